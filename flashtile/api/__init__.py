"""The public API's foundation: the argument model (problem.py) built by one validator from primitive checks
(checks.py), and the exception every check raises (errors.py)."""

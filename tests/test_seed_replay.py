"""tests/conftest.py's seeds: a failing case's report names its seed in a one-line replay command, and that command
(FLASHTILE_TEST_SEED=<seed> python -m pytest '<node id>') draws the same random numbers again: through the `seed`
fixture, through torch / random without the fixture, and through a Hypothesis test's examples.

Runs pytest in a subprocess on a deliberately failing test file in a temporary folder, with a copy of the conftest."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAILING = '''
import random

import torch


def test_with_fixture(seed):
    print(f"VALUE {seed} {torch.rand(3).tolist()}")
    assert False


def test_without_fixture():
    print(f"VALUE {torch.randn(3).tolist()} {random.random()!r}")
    assert False
'''

FAILING_HYPOTHESIS = '''
from hypothesis import given, settings, strategies as st


@settings(max_examples=8, database=None)
@given(st.integers(0, 10 ** 9), st.floats(-1e6, 1e6))
def test_hypothesis(n, x):
    print(f"VALUE {n} {x!r}")
    assert False
'''

REPLAY = re.compile(r"FLASHTILE_TEST_SEED=(\d+) python -m pytest '([^']+)'")


try:
    import hypothesis  # noqa: F401
    HAS_HYPOTHESIS = True
except ImportError:   # the GPU machine may lack hypothesis
    HAS_HYPOTHESIS = False
# plugins: only Hypothesis' (as in the suite), not every installed one, which would double each run's start-up
PLUGINS = ["-p", "no:cacheprovider"] + (["-p", "_hypothesis_pytestplugin"] if HAS_HYPOTHESIS else [])


def _pytest(folder: Path, *args, seed=None):
    env = {k: v for k, v in os.environ.items() if k != "FLASHTILE_TEST_SEED"}
    env.update(PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if seed is not None:
        env["FLASHTILE_TEST_SEED"] = str(seed)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", *PLUGINS, *args], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, f"expected failures, got exit {res.returncode}:\n{res.stdout[-3000:]}{res.stderr}"
    return res.stdout


def _values(output: str, nodeid: str) -> list:
    """The VALUE lines the test printed, from its failure report's captured stdout."""
    name = nodeid.split("::")[-1]
    block = output.split(f"_ {name} _", 1)[1]
    block = re.split(r"\n_{3,} ", block, maxsplit=1)[0]
    return re.findall(r"^VALUE .*$", block, flags=re.M)


def test_a_failing_case_prints_its_seed_and_the_command_replays_it(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")   # keep the repository's settings out of the folder
    (tmp_path / "test_fails.py").write_text(FAILING)
    names = ["test_with_fixture", "test_without_fixture"]
    if HAS_HYPOTHESIS:
        (tmp_path / "test_fails_hypothesis.py").write_text(FAILING_HYPOTHESIS)
        names.append("test_hypothesis")

    first = _pytest(tmp_path)
    replays = dict((nodeid, int(s)) for s, nodeid in REPLAY.findall(first))
    for name in names:
        (nodeid, ) = [n for n in replays if n.endswith("::" + name)]
        # in the failure's own report (its "replay" section) and in the closing list
        assert first.count(f"FLASHTILE_TEST_SEED={replays[nodeid]} python -m pytest '{nodeid}'") == 2, first[-3000:]
    assert "replay the failing cases with their seeds" in first

    fixture_id = next(n for n in replays if n.endswith("::test_with_fixture"))
    (line, ) = _values(first, fixture_id)
    assert line.startswith(f"VALUE {replays[fixture_id]} ")   # the fixture's value is the printed seed

    for nodeid, s in replays.items():
        again = _pytest(tmp_path, nodeid, seed=s)
        assert set(REPLAY.findall(again)) == {(str(s), nodeid)}
        assert _values(again, nodeid) == _values(first, nodeid) != [], nodeid


def test_a_bad_seed_variable_is_a_usage_error(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_one.py").write_text("def test_one(seed):\n    assert seed >= 0\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLASHTILE_TEST_SEED="not-a-number", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", *PLUGINS], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "FLASHTILE_TEST_SEED='not-a-number'" in res.stdout + res.stderr


@pytest.mark.parametrize("pinned", ["7", "0x10"])
def test_the_variable_pins_the_seed(pinned, monkeypatch):
    import conftest
    monkeypatch.setenv("FLASHTILE_TEST_SEED", pinned)
    assert conftest.draw_seed() == int(pinned, 0)
    monkeypatch.delenv("FLASHTILE_TEST_SEED")
    assert len({conftest.draw_seed() for _ in range(4)}) > 1   # fresh otherwise
    assert conftest.replay_command(5, "tests/t.py::test[a'b]") == \
        "FLASHTILE_TEST_SEED=5 python -m pytest 'tests/t.py::test[a'\"'\"'b]'"

"""The one exception every argument check raises.

flash-attn reports bad arguments as RuntimeError (its C++ TORCH_CHECKs); Python code expects ValueError /
TypeError. ArgumentError is all three, so code written against either catches it unchanged.
"""
from __future__ import annotations


class ArgumentError(ValueError, TypeError, RuntimeError):
    """A flashtile argument is missing, of the wrong type or out of range; the message names the argument, the
    value given and what is expected."""


def fail(arg: str, value, expected: str):
    """Raise ArgumentError for argument `arg`."""
    raise ArgumentError(f"flashtile: {arg} = {value!r}; expected {expected}")

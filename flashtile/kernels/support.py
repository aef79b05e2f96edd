"""What the installed Triton offers beyond what the portable Triton kernels need, decided once at import.

flashtile is supported on Triton >= 3.6 (pyproject.toml). An older Triton still runs the portable Triton kernels
(kernels/triton/); what needs a newer one is turned off here instead of failing deep inside a call, and one
warning (TritonSupportWarning) says what was turned off:

- ``triton.knobs`` (Triton >= 3.4): relaunch.py launches compiled kernels directly and reads Triton's launch hooks
  there; without it every launch goes through Triton's own dispatch (slower host side, same kernels).
- Gluon's Hopper API (``triton.experimental.gluon``, Triton >= 3.6 for these kernels): the FA3 kernels of
  kernels/gluon/ are written against Triton 3.6's Gluon (3.5's ``gl.warp_specialize`` takes other arguments,
  3.4 has no Hopper ``warpgroup_mma``); without it Hopper GPUs run the Triton kernels.
- ``triton.tools.tensor_descriptor`` (Triton >= 3.4): host-side TMA descriptors; without them the Triton kernels
  load tiles through pointers (launch.py, decode.py).

This module is a leaf: it imports Triton only.
"""
from __future__ import annotations

import importlib
import re
import warnings

import triton

SUPPORTED = (3, 6)   # the oldest Triton flashtile is tested on (the GPU image); pyproject.toml says the same
GLUON_MIN = (3, 6)   # the oldest Triton whose Gluon compiles kernels/gluon/ (tests/fa3_compile_check.py)


class TritonSupportWarning(UserWarning):
    """The installed Triton lacks a feature some flashtile kernels use; those kernels are turned off."""


def version_tuple(version: str) -> tuple:
    """'3.6.0', '3.7.0+git1a2b3c', '3.4.0rc1' -> (3, 6, 0), (3, 7, 0), (3, 4, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _importable(name: str):
    """The module, or None where it cannot be imported (absent, or failing inside: either way, not usable)."""
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means the feature is off, which the warning reports
        return None


TRITON_VERSION = version_tuple(getattr(triton, "__version__", "0"))

try:
    from triton import knobs
except ImportError:
    knobs = None

# feature -> whether this Triton has it (flashtile info prints these)
FEATURES = {
    "knobs": knobs is not None,
    "gluon": (TRITON_VERSION >= GLUON_MIN
              and _importable("triton.experimental.gluon.language.nvidia.hopper") is not None
              and _importable("triton.experimental.gluon.nvidia.hopper") is not None),
    "tensor_descriptor": _importable("triton.tools.tensor_descriptor") is not None,
}
GLUON = FEATURES["gluon"]

_WITHOUT = {"knobs": "direct kernel launches (need triton.knobs, Triton >= 3.4)",
            "gluon": f"the Gluon FA3 kernels for Hopper (need the Gluon of Triton >= {'.'.join(map(str, GLUON_MIN))})",
            "tensor_descriptor": "host-side TMA descriptors (need triton.tools.tensor_descriptor, Triton >= 3.4)"}


def missing_message():
    """The one-line explanation of what is turned off, or None when this Triton has every feature."""
    missing = [_WITHOUT[name] for name, present in FEATURES.items() if not present]
    if not missing:
        return None
    return (f"flashtile: Triton {getattr(triton, '__version__', '?')}: turned off {'; '.join(missing)}; the "
            f"portable Triton kernels run instead (flashtile is supported on triton>={'.'.join(map(str, SUPPORTED))})")


_message = missing_message()
if _message is not None:
    warnings.warn(_message, TritonSupportWarning, stacklevel=2)

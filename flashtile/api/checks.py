"""Primitive argument checks: each takes an argument's name and value, returns the value normalised (a bool, a
pair of ints, ...) or raises ArgumentError naming the argument, the value and what was expected.

Scalars are accepted in the forms flash-attn accepts (its arguments pass through pybind11 / the torch
dispatcher): Python ints and floats, numpy scalars, one-element integer tensors for window sizes.
"""
from __future__ import annotations

import math
import numbers
import operator

import torch

from ..kernels.runtime import interpreting
from .errors import fail

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


def flag(name: str, value) -> bool:
    """A bool, a numpy bool or a one-element bool tensor (flash-attn's `causal=torch.tensor(True)` works); an int,
    a string or None is refused: `causal="no"` must not run as causal=True."""
    if type(value) is bool:
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1:
        return bool(value)
    fail(name, value, "a bool")


def integer(name: str, value, minimum: int | None = None) -> int:
    """An int (Python, numpy, or a one-element integer tensor), not a bool, >= minimum."""
    if isinstance(value, (bool, float)) or (isinstance(value, torch.Tensor)
                                            and (value.dtype == torch.bool or value.is_floating_point())):
        fail(name, value, "an int")
    try:
        out = operator.index(value)
    except TypeError:
        fail(name, value, "an int")
    if minimum is not None and out < minimum:
        fail(name, out, f"an int >= {minimum}")
    return out


def real(name: str, value, expected: str) -> float:
    """A finite real number: a Python or numpy int / float or a one-element floating or integer tensor (flash-attn's
    custom ops take all of these), not a bool."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(name, value, expected)
    out = float(value)
    # comparisons rather than math.isfinite: torch.compile(dynamic=True) cannot fold math.* calls; NaN fails both
    if not -math.inf < out < math.inf:
        fail(name, value, expected)
    return out


def window(value) -> tuple:
    """window_size -> (left, right) Python ints >= -1 (-1: unbounded; flash-attn reads any negative value so). Any length-2 sequence of ints is accepted as flash-attn
    indexes it: a tuple or list, numpy ints, a 2-element integer tensor (its own tests pass
    `torch.randint(0, seqlen_k, (2,))`)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.numel() != 2 or value.is_floating_point() or value.dtype == torch.bool:
            fail("window_size", value, "a pair of ints (left, right)")
        value = value.tolist()
    elif type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        fail("window_size", value, "a pair of ints (left, right)")
    left, right = (integer("window_size", w) for w in value)
    return max(left, -1), max(right, -1)   # any negative edge is unbounded, as in flash-attn


def tensor(name: str, t, dims: int, dtypes=FLOAT_DTYPES, what: str = "float16, bfloat16 or float32") -> None:
    """A torch.Tensor of `dims` dimensions, one of `dtypes`, with a contiguous last dimension (the kernels read
    rows of head_dim elements)."""
    if not isinstance(t, torch.Tensor):
        fail(name, type(t).__name__, "a torch.Tensor")
    if t.dim() != dims:
        fail(f"{name}.dim()", t.dim(), f"{dims} (shape {tuple(t.shape)})")
    if t.dtype not in dtypes:
        fail(f"{name}.dtype", t.dtype, what)
    if t.numel() > 0 and t.stride(-1) != 1:
        fail(f"{name}.stride(-1)", t.stride(-1), "1 (contiguous last dimension)")


def same_device(name: str, t: torch.Tensor, device) -> None:
    if t.device != device:
        fail(f"{name}.device", t.device, f"the device of q ({device})")


def index_tensor(name: str, t, shape, device) -> None:
    """An int32 index tensor of the given shape (None entries: any size) on `device`, its elements at unit stride
    along a 1-D shape (the kernels read element b at offset b)."""
    if not isinstance(t, torch.Tensor):
        fail(name, type(t).__name__, "a torch.Tensor (int32)")
    if t.dtype != torch.int32:
        fail(f"{name}.dtype", t.dtype, "torch.int32")
    if t.dim() != len(shape) or any(s is not None and t.shape[i] != s for i, s in enumerate(shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        fail(f"{name}.shape", tuple(t.shape), want)
    same_device(name, t, device)
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
        fail(f"{name}.stride(0)", t.stride(0), "1 (contiguous)")


def cu_seqlens(name: str, cu, device, batch: int | None = None) -> int:
    """A cumulative-lengths tensor (batch + 1,) int32 on `device`; returns batch."""
    if not isinstance(cu, torch.Tensor):
        fail(name, type(cu).__name__, "a torch.Tensor of dtype int32, shape (batch + 1,)")
    if cu.dtype != torch.int32:
        fail(f"{name}.dtype", cu.dtype, "torch.int32")
    if cu.dim() != 1:
        fail(f"{name}.dim()", cu.dim(), f"1: shape (batch + 1,), got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        fail(f"{name}.shape", tuple(cu.shape), "(batch + 1,) with batch >= 1")
    if batch is not None and cu.numel() != batch + 1:
        fail(f"{name}.shape", tuple(cu.shape), f"({batch + 1},): batch + 1 with batch = {batch} (from cu_seqlens_q)")
    same_device(name, cu, device)
    if cu.stride(0) != 1:
        fail(f"{name}.stride(0)", cu.stride(0), "1 (contiguous)")
    return cu.numel() - 1


def check_device(t: torch.Tensor) -> None:
    """CPU tensors need the Triton interpreter, which must be on before flashtile is imported."""
    if not t.is_cuda and t.device.type == "cpu" and not interpreting():
        fail("q.device", t.device, "a CUDA device, or CPU tensors with the Triton interpreter enabled before "
             "flashtile is imported: set TRITON_INTERPRET=1 (flashtile sets it itself when no CUDA device is present)")

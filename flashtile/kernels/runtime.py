"""What every kernel family's host code shares: the interpreter switch, host integer helpers, TMA descriptors over
the (rows, nheads * head_dim) view of an attention tensor, SM counts and the zeroed ticket counters of persistent /
fused launches. The bottom layer of flashtile.kernels: it imports no kernel module."""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import Optional

import torch

from . import relaunch


def interpreting() -> bool:
    return environ("TRITON_INTERPRET", "0") not in ("", "0")


# os.environ's own dict (bytes keys and values on POSIX), which its changes write through: a lookup there costs a
# twentieth of os.environ.get's, and switches read on every call (FLASHTILE_GLUON...) may change at run time
_ENVIRON = os.environ._data if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict) else None


def environ(name: str, default: str) -> str:
    """os.environ.get(name, default), read at the cost of a dict lookup."""
    if _ENVIRON is None:
        return os.environ.get(name, default)
    value = _ENVIRON.get(name.encode())
    return default if value is None else os.fsdecode(value)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints. Host code uses these two helpers, not triton.cdiv / triton.next_power_of_2,
    which newer Triton wraps as constexpr functions at a few microseconds per call: grid sizes and the decode
    split heuristic call them on every launch."""
    return -(-int(a) // int(b))


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1), of a host int."""
    return 1 << max(int(x) - 1, 0).bit_length()


try:  # host-side TMA descriptors (triton >= 3.4; the interpreter emulates them)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


def tma_row_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """t, (batch, seqlen, nheads, headdim) or (tokens, nheads, headdim), as the 2-D view (rows, nheads * headdim)
    that TMA tiles, rows at one stride; None where it is no such view or its strides / base are not 16-byte
    aligned (a TMA requirement): e.g. a (batch, nheads, seqlen, d) tensor seen transposed. Slices of packed
    (q, k, v) tensors are such views."""
    head_dim, nheads = t.shape[-1], t.shape[-2]
    if t.stride(-1) != 1 or t.stride(-2) != head_dim:
        return None
    row_stride = t.stride(-3)
    if row_stride < nheads * head_dim or (t.dim() == 4 and t.shape[0] > 1 and t.stride(0) != t.shape[1] * row_stride):
        return None
    if t.data_ptr() % 16 or (row_stride * t.element_size()) % 16:
        return None
    rows = t.shape[0] * t.shape[1] if t.dim() == 4 else t.shape[0]
    return t.as_strided((rows, nheads * head_dim), (row_stride, 1))


# (descriptor class, shape, strides, dtype, block, id(layout)) -> the fields, base aside, of a descriptor built and
# checked for that geometry (row_descriptor)
_ROW_DESC_FIELDS: dict = {}


def row_descriptor(cls, t: torch.Tensor, block, layout=None):
    """A TMA descriptor of class cls (triton.tools' TensorDescriptor, or Gluon's, which takes the shared-memory
    layout) over tma_row_view(t), blocks `block`; None where t is no such view. Host time: building and checking
    one (the row view, the class's checks) costs ~10 us of Python and a launch builds two to seven; a geometry
    seen before (same class, shape, strides, dtype, block and layout) reuses the checked fields and only the base
    changes (its 16-byte alignment checked here): the launchers read nothing of the base but its data_ptr() and
    dtype, which the view shares with t."""
    # the layout by identity (hashing it costs more than the rest of the key): the cached fields hold it, so its
    # id cannot be reused by another object while the entry lives
    key = (cls, t.shape, t.stride(), t.dtype, tuple(block), id(layout))
    fields = _ROW_DESC_FIELDS.get(key)
    if fields is not None:
        desc = descriptor_from(cls, fields, t)
        if desc is not None:
            return desc
    view = tma_row_view(t)
    if view is None:
        return None
    desc = cls(view, list(view.shape), list(view.stride()), list(block), *(() if layout is None else (layout, )))
    if len(_ROW_DESC_FIELDS) < 4096:
        _ROW_DESC_FIELDS[key] = descriptor_fields(desc)
    return desc


def descriptor_fields(desc) -> dict:
    """A row descriptor's fields but its base (which holds no tensor, so they may be kept)."""
    return {name: val for name, val in vars(desc).items() if name != "base"}


class DescriptorType:
    """Descriptors of one geometry (descriptor_fields of one descriptor of class cls) made over tensor after tensor
    at the cost of setting the base: a subclass of cls holding the fields as class attributes. The launch
    templates of a training loop make 4-11 of them per step."""
    __slots__ = ("type",)

    def __init__(self, cls, fields: dict):
        # (descriptor_class: what relaunch keys a descriptor of this type by, as one of class cls)
        self.type = type(cls.__name__, (cls,), dict(fields, descriptor_class=cls))

    def __call__(self, t: torch.Tensor):
        """A descriptor over t (of the geometry's shape, strides and dtype), or None where t's base is not 16-byte
        aligned."""
        if t.data_ptr() % 16:
            return None
        desc = object.__new__(self.type)
        desc.base = t
        return desc


def descriptor_from(cls, fields: dict, t: torch.Tensor):
    """A descriptor of class cls with these fields (descriptor_fields of one over a tensor of t's shape, strides
    and dtype) over t, or None where t's base is not 16-byte aligned."""
    if t.data_ptr() % 16:
        return None
    desc = object.__new__(cls)
    vars(desc).update(fields, base=t)
    return desc


@functools.lru_cache(maxsize=None)
def _device_props(device_index: int):
    p = torch.cuda.get_device_properties(device_index)
    return p.multi_processor_count, p.major


def multiprocessors(device: torch.device) -> int:
    """SM count of a CUDA device; 8 on the CPU (so that the interpreter tests exercise splitting)."""
    if device.type != "cuda":
        return 8
    return _device_props(device.index if device.index is not None else torch.cuda.current_device())[0]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _zeroed_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 counters never handed out before, hence still zero: the next slice of the device's pool (a new pool,
    zero-filled, when this one cannot hold them). While a CUDA graph is captured a new pool is not made: its fill
    would be replayed with the graph over counters later handed to other streams, so the counters get a fill of
    their own (the graph re-zeroes only them)."""
    pool = _TICKET_POOL.get((device.type, device.index))
    if pool is None or pool[1] + n > pool[0].numel():
        if _capturing(device):
            return torch.zeros(n, dtype=torch.int32, device=device)
        pool = [torch.zeros(max(TICKET_POOL_SIZE, n), dtype=torch.int32, device=device), 0]
        _TICKET_POOL[(device.type, device.index)] = pool
    pool[1] += n
    return pool[0][pool[1] - n:pool[1]]


# (device index, stream) -> int32 ticket counters of the fused combine, one per tile, zero between launches (the
# last split of a tile resets its counter): launches on one stream run in order, so each stream has its own
_TICKETS: dict = {}
# (device type, index) -> [a zero-filled int32 tensor, how many of its counters were handed out]: new counters are
# slices of it, so a stream first seen while a CUDA graph is captured (torch.cuda.graph's capture stream) gets
# zeroed counters without a fill kernel in the graph, which would run again at every replay
_TICKET_POOL: dict = {}
TICKET_POOL_SIZE = 1 << 16


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed ticket counters for launches on the current stream of `device`."""
    stream = 0
    if device.type == "cuda":
        # (the raw handle: torch.cuda.current_stream builds a Stream object, ~5 us of host time)
        stream = relaunch.raw_stream(device.index if device.index is not None else relaunch.current_device())
    key = (device.type, device.index, stream)
    t = _TICKETS.get(key)
    if t is None or t.numel() < n:
        t = _zeroed_counters(device, max(n, 2 * (t.numel() if t is not None else 0), 1024))
        _TICKETS[key] = t
    return t


# (device index, stream, host thread) -> float32 scratch buffer of that thread's launches on that stream (workspace)
_WORKSPACES: dict = {}
# the largest scratch workspace() keeps per stream: above it a call allocates its own (its kernels then take longer
# than an allocation's host time)
WORKSPACE_MAX_BYTES = 1 << 26


def workspace(device: torch.device, numel: int) -> Optional[torch.Tensor]:
    """A float32 buffer of at least numel elements, kept for this host thread's launches on the current stream of
    the CUDA `device`, for scratch a call writes before it reads and drops before it returns (the Gluon backward's D
    and dQ accumulator): one thread's launches on one stream run in the order issued, so its consecutive calls may
    share the buffer, and a call saves the allocation's host time (autograd runs every backward of a device on one
    thread). None (the caller allocates its own) above WORKSPACE_MAX_BYTES and while a CUDA graph is captured (a graph
    would keep the buffer's address, which a later, larger buffer replaces). A buffer grows by at least twice its
    size, up to the limit; views of a replaced one keep it alive until dropped."""
    if numel * 4 > WORKSPACE_MAX_BYTES or _capturing(device):
        return None
    index = device.index if device.index is not None else relaunch.current_device()
    key = (index, relaunch.raw_stream(index), threading.get_ident())
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel:
        size = min(max(numel, 2 * buf.numel() if buf is not None else 0), WORKSPACE_MAX_BYTES // 4)
        buf = relaunch.remember(_WORKSPACES, key, torch.empty(size, dtype=torch.float32, device=device), 64)
    return buf


def workspace_views(device: torch.device, shapes: tuple, kept: list) -> Optional[tuple]:
    """Contiguous float32 views of these shapes in the workspace() of this thread and stream, each at a 128-byte
    aligned offset (as an allocation is: kernels are specialized on their pointers' alignment), or None where there
    is no workspace (the caller allocates). kept: a one-element list of the caller's, where the views are kept while
    the workspace stays the same buffer (making them costs host time)."""
    sizes = [math.prod(shape) for shape in shapes]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + -(-n // 32) * 32)
    ws = workspace(device, starts[-1] + sizes[-1])
    if ws is None:
        return None
    views = kept[0]
    if views is None or views[0] is not ws:
        views = kept[0] = (ws, *(ws[a:a + n].view(shape) for a, n, shape in zip(starts, sizes, shapes)))
    return views[1:]


# --------------------------------------------------------------------------------------------------
# Masks and biases as the kernels read them (Triton and Gluon)
# --------------------------------------------------------------------------------------------------
def pair_args(t, batch, nheads, sq, sk):
    """(pointer, stride_b, stride_h, stride_m, stride_n) of a (b, h, sq, sk)-broadcastable 4-D tensor: an expand
    view, so broadcast dimensions get stride 0 and nothing is materialised. bool masks are read as uint8."""
    if t is None:
        return (None, 0, 0, 0, 0)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    e = t.expand(batch, nheads, sq, sk)
    return (e, *e.stride())


def sparse_args(lists, batch, nheads, transposed):
    """(num, idx, full_num, full_idx, stride_b, stride_h, stride_block, n_blocks) for the kernels' block-sparse loop."""
    if lists is None:
        return (None, None, None, None, 0, 0, 0, 0)
    if transposed:
        num, idx, fnum, fidx = lists.q_num, lists.q_idx, lists.full_q_num, lists.full_q_idx
    else:
        num, idx, fnum, fidx = lists.kv_num, lists.kv_idx, lists.full_kv_num, lists.full_kv_idx
    st = num.expand(batch, nheads, num.shape[2]).stride()
    return (num, idx, fnum, fidx, st[0], st[1], st[2], idx.shape[-1])

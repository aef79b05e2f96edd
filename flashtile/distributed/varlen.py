"""Packed documents over the ring: ring attention on a varlen (cu_seqlens) batch sharded per document.

The batch is one packed sequence of documents, cu_seqlens over the GLOBAL packed tokens (flash_attn_varlen_func's
convention). Sharding rule (per-document zigzag): document i, of length L_i, is padded at its end to P_i, the next
multiple of 2W (W ranks in the ring; under USP, 2 W U: see ulysses.py), and cut into 2W chunks of c_i = P_i / (2W)
tokens; rank r holds chunks r and 2W - 1 - r of every document, in document order. So every rank holds
sum(P_i) / W rows, each document's causal work is balanced over the ranks exactly as the dense zigzag layout
balances one sequence's, and the local cu_seqlens (2 c_i per document) are the same on every rank.

Padding tokens are neither queries nor keys: no kernel call covers them, their outputs and gradients are zero.
A trainer gives them a label its loss ignores (shard_varlen's pad_value, e.g. -100) and needs nothing else.

Plan: at ring step t rank r holds the K/V shard of rank r' = (r - t) mod W. For each document the (query chunks,
key chunks) pair is planned by ring.plan_block on the document's own positions (so a call never pairs tokens of
two documents), and the rectangles of all documents that share a window are run as ONE varlen kernel call: they
are consecutive in both the query and key buffers, and the rows between them become filler sequences with no
keys (queries: output 0, lse -inf, merged as nothing) or no queries (keys: never read); rows after the last
rectangle are the call's padding tail. A document contributes no
rectangle at a step where the mask hides all of its keys from all of its queries.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import interface as _interface
from ..api import checks
from ..api import problem as P
from ..api.errors import fail
from ..api.problem import Problem
from .comm import check_device, require_process_group
from .ring import RingFlashAttnFunc, _Ring, check_group_agrees, plan_block

_INF = math.inf


# --------------------------------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------------------------------
# id(cu_seqlens tensor) -> (weak reference, version counter, its values): a model passes one cu_seqlens tensor to
# every layer, whose values (a device-to-host copy, a synchronisation on a GPU) are then read once per step
_CU_READ: dict = {}


def _cu_values(cu_seqlens) -> Tuple[int, ...]:
    """cu_seqlens as host ints, checked: a 1-D int tensor or a sequence of ints, starting at 0, non-decreasing."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            fail("cu_seqlens", f"tensor {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}",
                 "a 1-D int32 (or int64) tensor (num_documents + 1,)")
        seen = _CU_READ.get(id(cu_seqlens))
        if seen is not None and seen[0]() is cu_seqlens and seen[1] == cu_seqlens._version:
            return seen[2]
        vals = _cu_check(tuple(cu_seqlens.tolist()))
        if len(_CU_READ) >= 256:
            _CU_READ.clear()
        _CU_READ[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, vals)
        return vals
    if isinstance(cu_seqlens, (list, tuple)) and all(type(x) is int for x in cu_seqlens):
        vals = tuple(cu_seqlens)
    else:
        fail("cu_seqlens", type(cu_seqlens).__name__, "a 1-D int tensor or a list of ints")
    return _cu_check(vals)


def _cu_check(vals: Tuple[int, ...]) -> Tuple[int, ...]:
    if len(vals) < 2:
        fail("cu_seqlens", list(vals), "at least two values (0 and the total length)")
    if vals[0] != 0:
        fail("cu_seqlens[0]", vals[0], "0")
    for i in range(len(vals) - 1):
        if vals[i + 1] < vals[i]:
            fail("cu_seqlens", list(vals) if len(vals) <= 16 else f"... [{i}]={vals[i]}, [{i + 1}]={vals[i + 1]} ...",
                 "non-decreasing values (cumulative document lengths)")
    return vals


class VarlenLayout:
    """Where every token of a packed batch lives under per-document zigzag over `world_size` ranks (module
    docstring). Pure host-side bookkeeping; `varlen_layout` builds (and remembers) one per cu_seqlens.

    seqlens: the documents' real lengths L_i; padded: P_i (multiple of `multiple`); chunk: c_i = P_i / (2W);
    local_total: rows per rank, sum(P_i) / W; local_cu: (0, 2 c_0, 2 c_0 + 2 c_1, ...), the same on every rank."""

    def __init__(self, cu: Tuple[int, ...], world_size: int, multiple: int):
        self.cu = cu
        self.world_size = world_size
        self.multiple = multiple
        self.seqlens = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
        self.padded = tuple(-(-n // multiple) * multiple for n in self.seqlens)
        self.chunk = tuple(n // (2 * world_size) for n in self.padded)
        self.local_seqlens = tuple(2 * c for c in self.chunk)
        self.local_cu = tuple([0] + [sum(self.local_seqlens[:i + 1]) for i in range(len(self.local_seqlens))])
        self.local_total = self.local_cu[-1]
        self.total = cu[-1]

    def runs(self, rank: int, doc: int) -> Tuple[Tuple[int, int], ...]:
        """The real (non-padding) tokens of document `doc` that `rank` holds, in local order: ((position in the
        document, length), ...), empty runs dropped. Only a tail of a document is padding, so when a rank's first
        chunk is cut short its second chunk is all padding: the runs are a prefix of the rank's rows of the
        document, and plan_block's local offsets are buffer offsets."""
        c, n, w = self.chunk[doc], self.seqlens[doc], self.world_size
        out = []
        for j in (rank, 2 * w - 1 - rank):
            length = max(0, min(c, n - j * c))
            if length:
                out.append((j * c, length))
        return tuple(out)

    @functools.lru_cache(maxsize=64)
    def index(self, rank: int) -> torch.Tensor:
        """For each local row of `rank`: the global packed row it holds, or -1 for padding (int64, on the CPU)."""
        w = self.world_size
        n = len(self.seqlens)
        if self.local_total == 0:
            return torch.zeros(0, dtype=torch.long)
        doc = torch.repeat_interleave(torch.arange(n), torch.tensor(self.local_seqlens), output_size=self.local_total)
        c = torch.tensor(self.chunk)[doc]
        t = torch.arange(self.local_total) - torch.tensor(self.local_cu[:-1])[doc]
        pos = torch.where(t < c, rank * c + t, (2 * w - 1 - rank) * c + t - c)   # position in the document
        return torch.where(pos < torch.tensor(self.seqlens)[doc], torch.tensor(self.cu[:-1])[doc] + pos, -1)

    @functools.lru_cache(maxsize=256)
    def ring_plan(self, rank: int, window_left: int, window_right: int) -> Tuple[Tuple["VarlenBlock", ...], ...]:
        """plan[step]: the varlen kernel calls rank `rank` makes at ring step `step` (K/V of rank (rank - step)
        mod W), for the per-document band -window_left <= p_k - p_q <= window_right (-1 = unbounded)."""
        w = self.world_size
        plan = []
        for step in range(w):
            src = (rank - step) % w
            rects = []
            for i in range(len(self.seqlens)):
                qr, kr = self.runs(rank, i), self.runs(src, i)
                if not qr or not kr:
                    continue
                base = self.local_cu[i]
                for c in plan_block(qr, kr, window_left, window_right):
                    rects.append((base + c.q0, base + c.q1, base + c.k0, base + c.k1, c.window_left, c.window_right))
            plan.append(_pack_rects(rects, self.local_total))
        return tuple(plan)


@dataclass(frozen=True)
class VarlenBlock:
    """One varlen kernel call over a rank's whole local buffers: sequence j has seqlens_q[j] query rows and
    seqlens_k[j] key rows, consecutive in each buffer from row 0 (cu_seqlens of each are their prefix sums), all
    with the bottom-right aligned window (window_left, window_right). rects: the (q0, q1, k0, k1) of its real
    sequences (the others are fillers: no keys or no queries). pad_q / pad_k: where the rows after the last
    sequence start (Problem.pad_q / pad_k: zero output and gradient), or NO_PAD."""
    window_left: int
    window_right: int
    seqlens_q: Tuple[int, ...]
    seqlens_k: Tuple[int, ...]
    rects: Tuple[Tuple[int, int, int, int], ...]
    pad_q: int = P.NO_PAD
    pad_k: int = P.NO_PAD

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k)


def _pack_rects(rects, total: int) -> Tuple[VarlenBlock, ...]:
    """Group rectangles (q0, q1, k0, k1, window_left, window_right) into varlen calls: one call takes rectangles
    of one window that advance in both buffers; the rows between them become filler sequences."""
    groups: List[list] = []   # [window, rects, q end, k end]
    for q0, q1, k0, k1, wl, wr in rects:
        for g in groups:
            if g[0] == (wl, wr) and q0 >= g[2] and k0 >= g[3]:
                break
        else:
            g = [(wl, wr), [], 0, 0]
            groups.append(g)
        g[1].append((q0, q1, k0, k1))
        g[2], g[3] = q1, k1
    blocks = []
    for (wl, wr), rs, _, _ in groups:
        # a filler longer than the longest real sequence would only widen the kernel's grid: split it
        cap = max(max(q1 - q0, k1 - k0) for q0, q1, k0, k1 in rs)
        sq, sk = [], []

        def filler(n, is_q):
            while n > 0:
                m = min(n, cap)
                sq.append(m if is_q else 0)
                sk.append(0 if is_q else m)
                n -= m
        qe = ke = 0
        for q0, q1, k0, k1 in rs:
            filler(q0 - qe, True)
            filler(k0 - ke, False)
            sq.append(q1 - q0)
            sk.append(k1 - k0)
            qe, ke = q1, k1
        # rows after the last rectangle need no filler: they are the call's padding tail (Problem.pad_q / pad_k)
        blocks.append(VarlenBlock(wl, wr, tuple(sq), tuple(sk), tuple(rs), P.NO_PAD if qe == total else qe,
                                  P.NO_PAD if ke == total else ke))
    return tuple(blocks)


@functools.lru_cache(maxsize=256)
def _layout(cu: Tuple[int, ...], world_size: int, multiple: int) -> VarlenLayout:
    return VarlenLayout(cu, world_size, multiple)


def varlen_layout(cu_seqlens, world_size: int, pad_multiple: Optional[int] = None) -> VarlenLayout:
    """The per-document zigzag layout of a packed batch over `world_size` ranks. cu_seqlens: (num_documents + 1,)
    cumulative lengths of the GLOBAL packed batch (int tensor or list; a tensor's values are read on the host).
    pad_multiple: documents are padded to a multiple of it; default and minimum 2 * world_size (it must be a
    multiple of that)."""
    if not isinstance(world_size, int) or world_size < 1:
        fail("world_size", world_size, "an int >= 1")
    m = 2 * world_size if pad_multiple is None else pad_multiple
    if not isinstance(m, int) or m < 1 or m % (2 * world_size):
        fail("pad_multiple", pad_multiple, f"a positive multiple of 2 * world_size = {2 * world_size} (or None)")
    return _layout(_cu_values(cu_seqlens), world_size, m)


# --------------------------------------------------------------------------------------------------
# Sharding helpers
# --------------------------------------------------------------------------------------------------
def _check_rank(rank, world_size):
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        fail("rank", rank, f"an int in [0, {world_size})")


def _check_dim(x, dim):
    if not isinstance(x, torch.Tensor):
        fail("x", type(x).__name__, "a torch.Tensor")
    if not -x.dim() <= dim < x.dim():
        fail("dim", dim, f"a dimension of x (x.dim() = {x.dim()})")
    return dim % x.dim()


def shard_varlen(x: torch.Tensor, cu_seqlens, rank: int, world_size: int, dim: int = 0, pad_value=0,
                 pad_multiple: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of the packed tensor `x` (dimension `dim` runs over the global packed tokens, at least
    cu_seqlens[-1] of them; rows past it are ignored): local_total rows, padding rows filled with pad_value
    (labels: the loss's ignore index). Differentiable (an index_select)."""
    layout = varlen_layout(cu_seqlens, world_size, pad_multiple)
    _check_rank(rank, world_size)
    dim = _check_dim(x, dim)
    if x.shape[dim] < layout.total:
        fail(f"x.shape[{dim}] (packed tokens)", x.shape[dim], f">= cu_seqlens[-1] = {layout.total}")
    idx = layout.index(rank).to(x.device)
    pad_shape = list(x.shape)
    pad_shape[dim] = 1
    xp = torch.cat([x.narrow(dim, 0, layout.total), torch.full(pad_shape, pad_value, dtype=x.dtype, device=x.device)],
                   dim=dim)
    return xp.index_select(dim, torch.where(idx < 0, layout.total, idx))


def unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens, world_size: int, dim: int = 0,
                   pad_multiple: Optional[int] = None) -> torch.Tensor:
    """Inverse of shard_varlen: `shards[r]` is rank r's shard; returns the packed tensor (cu_seqlens[-1] rows along
    `dim`), padding rows dropped."""
    layout = varlen_layout(cu_seqlens, world_size, pad_multiple)
    if not isinstance(shards, (list, tuple)) or len(shards) != world_size:
        fail("shards", type(shards).__name__, f"a list of world_size = {world_size} tensors")
    dim = _check_dim(shards[0], dim)
    shape = list(shards[0].shape)
    shape[dim] = layout.total
    out = shards[0].new_zeros(shape)
    for r, t in enumerate(shards):
        if t.shape[dim] != layout.local_total:
            fail(f"shards[{r}].shape[{dim}]", t.shape[dim], f"local_total = {layout.local_total} rows")
        idx = layout.index(r).to(t.device)
        keep = (idx >= 0).nonzero().flatten()
        out.index_copy_(dim, idx[keep], t.index_select(dim, keep))
    return out


def gather_varlen(x: torch.Tensor, cu_seqlens, group=None, dim: int = 0, pad_multiple: Optional[int] = None
                  ) -> torch.Tensor:
    """All-gather every rank's shard and return the packed tensor on every rank (a collective; not
    differentiable)."""
    require_process_group("gather_varlen")
    world = dist.get_world_size(group)
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return unshard_varlen(parts, cu_seqlens, world, dim, pad_multiple)


def local_cu_seqlens(cu_seqlens, world_size: int, pad_multiple: Optional[int] = None, device=None
                     ) -> Tuple[torch.Tensor, int]:
    """(cu_seqlens, max_seqlen) of a rank's local buffer: each document's 2 c_i rows (padding included), the same
    on every rank. For layers that need document boundaries of the local tokens (not for the attention call,
    which takes the global cu_seqlens)."""
    layout = varlen_layout(cu_seqlens, world_size, pad_multiple)
    return (torch.tensor(layout.local_cu, dtype=torch.int32, device=device),
            max(layout.local_seqlens) if layout.local_seqlens else 0)


def varlen_positions(cu_seqlens, device=None) -> torch.Tensor:
    """Each packed token's position inside its document (int64, (cu_seqlens[-1],)): shard it like the tokens
    (shard_varlen / cp_shard) for rotary embeddings."""
    cu = _cu_values(cu_seqlens)
    lens = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], dtype=torch.long)
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    pos = torch.arange(cu[-1], dtype=torch.long) - torch.repeat_interleave(starts, lens, output_size=cu[-1])
    return pos.to(device) if device is not None else pos


# --------------------------------------------------------------------------------------------------
# Running a plan
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _cu_tensors(block: VarlenBlock, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The call's cu_seqlens on the device, made once per block (a copy from host memory waits for the work
    queued before it). Never written: the kernels only read them."""
    def cum(lens):
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return torch.tensor(out, dtype=torch.int32, device=device)
    return cum(block.seqlens_q), cum(block.seqlens_k)


@functools.lru_cache(maxsize=1024)
def _block_problem(p: Problem, c: VarlenBlock) -> Problem:
    """The problem of one varlen call (remembered: the kernels' dispatch keeps its choices with the Problem)."""
    params = dataclasses.replace(p.params, window_left=c.window_left, window_right=c.window_right)
    return dataclasses.replace(p, batch=len(c.seqlens_q), seqlen_q=c.max_seqlen_q, seqlen_k=c.max_seqlen_k,
                               params=params, pad_q=c.pad_q, pad_k=c.pad_k)


class VarlenBlocks:
    """Runs VarlenBlocks for ring.RingFlashAttnFunc: the shards arrive batch-first (1, local_total, heads,
    headdim) and every call reads the whole buffers."""

    def __init__(self, p: Problem, device: torch.device):
        self.p, self.device = p, device

    @staticmethod
    def rows(c):
        return slice(None), slice(None)

    def _call(self, c: VarlenBlock):
        cu_q, cu_k = _cu_tensors(c, self.device)
        return _block_problem(self.p, c), _interface.Extras(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

    def forward(self, c, q, k, v):
        p, x = self._call(c)
        out, lse, _, _ = _interface.forward(p, q[0], k[0], v[0], x)
        return out[None], lse[None]

    def backward(self, c, dout, q, k, v, out, lse, sums):
        p, x = self._call(c)
        # dK / dV through q's dtype: the float32 epilogue costs more on these blocks' many short key blocks than
        # the rounding it saves (the varlen ring's agreement is within its bound either way)
        _interface.backward(p, dout[0], q[0], k[0], v[0], out[0], lse[0], None, x,
                            sums=sums._replace(dq=sums.dq[0], dk=sums.dk[0], dv=sums.dv[0], delta=sums.delta[0],
                                               kv_f32=False))


def ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, max_seqlen: int,
                                group=None, causal: bool = False, softmax_scale: Optional[float] = None,
                                window_size=(-1, -1), softcap: float = 0.0, deterministic: bool = False,
                                return_softmax_lse: bool = False, pad_multiple: Optional[int] = None):
    """Exact attention over packed documents sharded per document across the ranks of `group`.

    q: (local_total, nheads, headdim); k, v: (local_total, nheads_k, headdim): this rank's shard as
    shard_varlen(x, cu_seqlens, rank, world_size) cuts the packed tensors (padding rows included).
    cu_seqlens: (num_documents + 1,) cumulative lengths of the GLOBAL packed batch, equal on every rank (int32
    tensor or list; its values are read on the host, once per distinct value); max_seqlen >= the longest document.
    causal / window_size / softcap act within each document exactly as flash_attn_varlen_func on the whole batch
    with cu_seqlens_q = cu_seqlens_k = cu_seqlens. GQA: nheads % nheads_k == 0. pad_multiple: the documents'
    padding multiple the shards were cut with (default 2 * world_size).
    Returns out (local_total, nheads, headdim) in q's dtype, zero on padding rows (and softmax_lse (nheads,
    local_total) float32, -inf on padding rows, if return_softmax_lse); differentiable in q, k, v.
    """
    require_process_group("ring_flash_attn_varlen_func")
    window_size, causal, deterministic, return_softmax_lse = P.scalars(
        window_size, ("causal", causal), ("deterministic", deterministic), ("return_softmax_lse", return_softmax_lse))
    P.qkv(q, k, v, 3)
    check_device(q)
    ring = _Ring.of(group)
    layout = varlen_layout(cu_seqlens, ring.world, pad_multiple)
    max_seqlen = checks.integer("max_seqlen", max_seqlen, 0)
    if layout.seqlens and max(layout.seqlens) > max_seqlen:
        fail("max_seqlen", max_seqlen, f">= the longest document in cu_seqlens ({max(layout.seqlens)})")
    for name, t in (("q", q), ("k", k)):
        if t.shape[0] != layout.local_total:
            fail(f"{name}.shape[0] (rows of this rank's shard)", t.shape[0],
                 f"{layout.local_total}: the documents of cu_seqlens padded to multiples of {layout.multiple}, "
                 f"summed and divided by world_size = {ring.world} (what shard_varlen returns)")
    check_group_agrees(ring.group, "q/k shard shapes and cu_seqlens across the ranks of group (rank: q.shape + "
                       "k.shape + (len(cu_seqlens), checksum))",
                       [*q.shape, *k.shape, len(layout.cu), hash(layout.cu) & (2 ** 62 - 1)],
                       "equal on every rank: the same packed batch, sharded with shard_varlen", q.device)
    params = P.attn_params(q.shape[-1], None, max_seqlen, 0.0, softmax_scale, causal, window_size, softcap)
    p = Problem(P.VARLEN, len(layout.seqlens), max_seqlen, max_seqlen, q.shape[1], k.shape[1], q.shape[2], q.dtype,
                params, deterministic=deterministic)
    plans = layout.ring_plan(ring.rank, params.window_left, params.window_right)
    out, lse = RingFlashAttnFunc.apply(q[None], k[None], v[None], ring, plans, VarlenBlocks(p, q.device))
    out, lse = out[0], lse[0]
    return (out, lse) if return_softmax_lse else out

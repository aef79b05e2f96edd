"""Ring attention: exact attention over a sequence sharded across the ranks of a torch.distributed group.

Each rank holds its shard of the sequence, q/k/v of shape (batch, seqlen_local, nheads[_k], headdim). The
K/V shards travel around the ring (rank r sends to r + 1 and receives from r - 1) with point-to-point
messages; the transfer of the next shard is posted before the current one is computed, so communication
hides behind the attention kernels. Partial results (O, LSE) of each (query shard, key shard) block are
combined exactly with the online-softmax rule (`merge_attention`).

Backward: the K/V shards go around the ring once more. Each rank adds its contribution to the dK/dV of the
shard it currently holds; those accumulators (float32) travel with the shard and arrive home after one full
turn. dQ never leaves its rank. The kernels' backward is given the GLOBAL (merged) out and lse, which makes
each block's result exactly that block's share of the gradient.

Masks are computed from global token positions. A rank's shard is a list of *chunks*, each a contiguous run
of global positions: one chunk for layout="contiguous" (rank r holds [r L, (r + 1) L)), two for
layout="zigzag" (the sequence cut into 2W chunks; rank r holds chunks r and 2W - 1 - r, which balances the
causal work). For every (query shard, key shard) pair the planner (`plan_block`) emits a few kernel calls,
each on a rectangle of the local tensors with a (window_left, window_right) that reproduces the global mask
there: no mask, a causal diagonal, a shifted band, or no call at all when everything is masked.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import dataclasses

from .. import interface as _interface
from ..kernels.params import GradSums
from ..kernels.triton.combine import merge_parts
from ..kernels.triton.launch import bwd_delta
from ..api import checks
from ..api import problem as P
from ..api.errors import fail
from ..api.problem import Problem

LAYOUTS = ("zigzag", "contiguous")
_TAG_KV, _TAG_DKV = 11, 12
_INF = math.inf


# --------------------------------------------------------------------------------------------------
# Sharding helpers
# --------------------------------------------------------------------------------------------------
def _check_layout(layout):
    if layout not in LAYOUTS:
        fail("layout", layout, f"one of {LAYOUTS}")


def _check_world(rank, world_size):
    if not isinstance(world_size, int) or world_size < 1:
        fail("world_size", world_size, "an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        fail("rank", rank, f"an int in [0, {world_size})")


def _num_chunks(layout: str, world_size: int) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def shard_chunks(rank: int, world_size: int, layout: str, seqlen_local: int) -> Tuple[Tuple[int, int], ...]:
    """The global runs a rank's shard is made of, in local order: ((global_start, length), ...)."""
    if layout == "contiguous":
        return ((rank * seqlen_local, seqlen_local),)
    c = seqlen_local // 2
    return ((rank * c, c), ((2 * world_size - 1 - rank) * c, c))


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1
                   ) -> torch.Tensor:
    """The shard of the full-sequence tensor `x` that `rank` holds (contiguous memory).

    x: any tensor whose dimension `dim` is the sequence, of length divisible by world_size (contiguous)
    or 2 * world_size (zigzag). Differentiable (a narrow / cat of narrows).
    """
    _check_layout(layout)
    _check_world(rank, world_size)
    if not isinstance(x, torch.Tensor):
        fail("x", type(x).__name__, "a torch.Tensor")
    if not -x.dim() <= dim < x.dim():
        fail("dim", dim, f"a dimension of x (x.dim() = {x.dim()})")
    n = _num_chunks(layout, world_size)
    s = x.shape[dim]
    if s % n != 0:
        fail(f"x.shape[{dim}] (seqlen)", s, f"a multiple of {n} ({'2 * ' if layout == 'zigzag' else ''}world_size for "
             f"layout={layout!r})")
    parts = [x.narrow(dim, start, length) for start, length in shard_chunks(rank, world_size, layout, s // world_size)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)).contiguous()


def unshard_sequence(shards: Sequence[torch.Tensor], world_size: int, layout: str = "zigzag", dim: int = 1
                     ) -> torch.Tensor:
    """Inverse of shard_sequence: `shards[r]` is rank r's shard; returns the full-sequence tensor."""
    _check_layout(layout)
    if not isinstance(shards, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in shards):
        fail("shards", type(shards).__name__, "a list or tuple of torch.Tensor")
    _check_world(0, world_size)
    if len(shards) != world_size:
        fail("len(shards)", len(shards), f"world_size = {world_size}")
    s_local = shards[0].shape[dim]
    for r, t in enumerate(shards):
        if t.shape != shards[0].shape:
            fail(f"shards[{r}].shape", tuple(t.shape), f"{tuple(shards[0].shape)} (all shards alike)")
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    if s_local % 2 != 0:
        fail(f"shards[0].shape[{dim}]", s_local, "an even length for layout='zigzag'")
    c = s_local // 2
    chunks = [None] * (2 * world_size)
    for r, t in enumerate(shards):
        chunks[r] = t.narrow(dim, 0, c)
        chunks[2 * world_size - 1 - r] = t.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard `x` and return the full-sequence tensor on every rank.

    A collective: all ranks of `group` must call it with shards of the same shape. Not differentiable
    (returns a tensor without grad history). With the gloo backend x must be on the CPU, with NCCL on the GPU.
    """
    _check_layout(layout)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashtile: gather_sequence needs an initialised torch.distributed process group")
    world = dist.get_world_size(group)
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return unshard_sequence(parts, world, layout, dim)


# --------------------------------------------------------------------------------------------------
# The one merge rule (online softmax over blocks of keys)
# --------------------------------------------------------------------------------------------------
def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union (exact).

    out_*: (batch, seqlen_q, nheads, headdim); lse_*: (batch, nheads, seqlen_q) natural log, -inf where
    the key set is empty for that row (its out is then ignored). Returns (out float32, lse float32):
        lse = log(e^lse_a + e^lse_b),  out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
    Rows empty in both stay empty (lse = -inf, out = 0), never NaN.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    # exponentiate against 0 where the union is empty, so both weights are exp(-inf) = 0, not NaN
    lse_safe = torch.where(lse == -_INF, torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - lse_safe).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse_safe).transpose(1, 2).unsqueeze(-1)
    out = out_a.float() * w_a + out_b.float() * w_b
    return out, lse


# --------------------------------------------------------------------------------------------------
# Mask planning: global band -> kernel calls on local rectangles
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockCall:
    """One kernel call: local query rows [q0, q1) against local key rows [k0, k1), with the kernel's
    bottom-right aligned (window_left, window_right) (-1 = unbounded)."""
    q0: int
    q1: int
    k0: int
    k1: int
    window_left: int
    window_right: int


def _global_band(q_start: int, k_start: int, left: int, right: int) -> Tuple[float, float]:
    """Key visibility of a (query run, key run) pair as a band of diagonals: key j of the run is visible to
    query i iff lo <= j - i <= hi (global: -left <= p_k - p_q <= right)."""
    shift = q_start - k_start
    lo = -_INF if left < 0 else shift - left
    hi = _INF if right < 0 else shift + right
    return lo, hi


def _clip(lo: float, hi: float, sq: int, sk: int) -> Optional[Tuple[int, int]]:
    """The band restricted to an sq x sk rectangle (diagonals -(sq-1) .. sk-1); None when empty. Two bands
    define the same mask on the rectangle iff their clipped intervals are equal."""
    a, b = max(lo, -(sq - 1)), min(hi, sk - 1)
    return None if a > b else (int(a), int(b))


def _express(sq: int, sk: int, lo: float, hi: float, q_base: int, k_base: int) -> BlockCall:
    """The kernel call computing the band lo <= j - i <= hi (non-empty) on an sq x sk rectangle whose
    corner sits at local (q_base, k_base).

    The kernel's band is [D - window_left, D + window_right] around D = sk - sq (its bottom-right diagonal)
    with windows >= 0, so D must lie inside the band: if the corner is right of the band, the trailing
    keys are all invisible and are dropped; if it is left of the band, the trailing queries see nothing
    and are dropped (their partial stays empty)."""
    left_free, right_free = lo <= -(sq - 1), hi >= sk - 1
    if not right_free and sk - sq > hi:
        sk = sq + int(hi)
    elif not left_free and sk - sq < lo:
        sq = sk - int(lo)
    d = sk - sq
    wl = -1 if left_free else d - int(lo)
    wr = -1 if right_free else int(hi) - d
    return BlockCall(q_base, q_base + sq, k_base, k_base + sk, wl, wr)


@functools.lru_cache(maxsize=4096)
def plan_block(q_chunks: Tuple[Tuple[int, int], ...], k_chunks: Tuple[Tuple[int, int], ...],
               window_left: int, window_right: int) -> Tuple[BlockCall, ...]:
    """Kernel calls that compute attention of a query shard over a key shard under the global mask.

    q_chunks / k_chunks: the shards' global runs in local order ((global_start, length), ...). The global
    mask is the band -window_left <= p_k - p_q <= window_right (-1 = unbounded; causal is right = 0).
    Prefers ONE call on the bounding rectangle of the non-empty chunk pairs when a single band in local
    coordinates reproduces the global mask on every chunk pair inside it (zigzag + causal always does);
    otherwise one call per non-empty chunk pair (each chunk pair is a band by itself).
    """
    q_off = [sum(n for _, n in q_chunks[:i]) for i in range(len(q_chunks))]
    k_off = [sum(n for _, n in k_chunks[:i]) for i in range(len(k_chunks))]
    pairs = {}
    for a, (qs, qn) in enumerate(q_chunks):
        for b, (ks, kn) in enumerate(k_chunks):
            band = _global_band(qs, ks, window_left, window_right)
            pairs[a, b] = (band, _clip(*band, qn, kn))
    live = [ab for ab, (_, c) in pairs.items() if c is not None]
    if not live:
        return ()
    ra, rb = min(a for a, _ in live), max(a for a, _ in live)
    ca, cb = min(b for _, b in live), max(b for _, b in live)

    # candidate local bands for the bounding rectangle: "no mask", or any live pair's band moved to it
    def to_rect(a, b, lo, hi):  # chunk-local diagonal -> rectangle diagonal
        shift = (k_off[b] - k_off[ca]) - (q_off[a] - q_off[ra])
        return lo + shift, hi + shift

    candidates = [(-_INF, _INF)] + [to_rect(a, b, *pairs[a, b][0]) for a, b in live]
    for lo, hi in candidates:
        ok = True
        for a in range(ra, rb + 1):
            for b in range(ca, cb + 1):
                shift = (k_off[b] - k_off[ca]) - (q_off[a] - q_off[ra])
                if _clip(lo - shift, hi - shift, q_chunks[a][1], k_chunks[b][1]) != pairs[a, b][1]:
                    ok = False
                    break
            if not ok:
                break
        if ok:
            sq = q_off[rb] + q_chunks[rb][1] - q_off[ra]
            sk = k_off[cb] + k_chunks[cb][1] - k_off[ca]
            return (_express(sq, sk, lo, hi, q_off[ra], k_off[ca]),)
    return tuple(_express(q_chunks[a][1], k_chunks[b][1], *pairs[a, b][0], q_off[a], k_off[b]) for a, b in live)


def ring_plan(rank: int, world_size: int, layout: str, seqlen_local: int, window_left: int, window_right: int
              ) -> List[Tuple[BlockCall, ...]]:
    """plan[step]: the calls rank `rank` makes at ring step `step`, when it holds the K/V shard of rank
    (rank - step) mod world_size."""
    q_chunks = shard_chunks(rank, world_size, layout, seqlen_local)
    return [plan_block(q_chunks, shard_chunks((rank - step) % world_size, world_size, layout, seqlen_local),
                       window_left, window_right) for step in range(world_size)]


# --------------------------------------------------------------------------------------------------
# Ring communication
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ring:
    group: object
    rank: int
    world: int
    next_peer: int  # global ranks (P2POp's `peer`)
    prev_peer: int

    @staticmethod
    def of(group) -> "_Ring":
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        g = group if group is not None else dist.group.WORLD
        return _Ring(group, rank, world, dist.get_global_rank(g, (rank + 1) % world),
                     dist.get_global_rank(g, (rank - 1) % world))

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        """Post: send `send` to the next rank, receive the previous rank's into `recv`. Returns the
        requests (wait() on them before reading `recv` or writing `send`)."""
        ops = [dist.P2POp(dist.isend, send, self.next_peer, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev_peer, self.group, tag)]
        return dist.batch_isend_irecv(ops)


def _wait(reqs):
    for r in reqs:
        r.wait()


def check_group_agrees(group, name: str, values, expected: str, device: torch.device) -> None:
    """Every rank of `group` must pass equal `values` (ints): one tiny all-gather, after which all ranks raise
    alike (one rank raising alone would leave the others waiting in the ring forever). device: where the
    inputs live (NCCL gathers there, gloo on the CPU)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(list(values), dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    seen = [tuple(t.tolist()) for t in every]
    if any(s != seen[0] for s in seen):
        fail(name, dict(enumerate(seen)), expected)


def _check_group_shapes(ring: _Ring, q, k):
    """Every rank must hold shards of the same shape."""
    check_group_agrees(ring.group, "q/k shard shapes across the ranks of group (rank: q.shape + k.shape)",
                       [*q.shape, *k.shape], "equal shapes: every rank must hold an equal shard of the sequence",
                       q.device)


# --------------------------------------------------------------------------------------------------
# Forward / backward passes
# --------------------------------------------------------------------------------------------------
def _block(p: Problem, c) -> Problem:
    """The problem of one (query chunk, key chunk) block call of a plan: its lengths and window."""
    params = dataclasses.replace(p.params, window_left=c.window_left, window_right=c.window_right)
    return dataclasses.replace(p, seqlen_q=c.q1 - c.q0, seqlen_k=c.k1 - c.k0, params=params)


class DenseBlocks:
    """Runs the BlockCalls of a dense plan, each on a rectangle of the (batch, seqlen_local, heads, headdim)
    shards. The ring passes (`_ring_forward` / `_ring_backward`) drive any object with this interface:
    rows(c) -> (query rows, key rows) of the local shards a call reads, forward(c, q, k, v) -> (out, lse)
    on those rows, backward(c, dout, q, k, v, out, lse, sums): dQ, dK, dV added into sums (params.GradSums:
    float32, those rows of the running sums, and D on the query rows), all batch-first."""

    def __init__(self, p: Problem):
        self.p = p

    @staticmethod
    def rows(c):
        return slice(c.q0, c.q1), slice(c.k0, c.k1)

    def forward(self, c, q, k, v):
        out, lse, _, _ = _interface.forward(_block(self.p, c), q, k, v)
        return out, lse

    def backward(self, c, dout, q, k, v, out, lse, sums):
        """The block's dQ, dK and dV added into sums (params.GradSums over those rows, float32)."""
        _interface.backward(_block(self.p, c), dout, q, k, v, out, lse, None, sums=sums)


# block results the forward holds: a fifth folds them into one float32 part (merge_parts), so a ring of up to this
# many single-call steps merges every block once, in q's dtype, at the end
_PARTS_HELD = 4


def _ring_forward(ring: _Ring, q, k, v, plans, blocks):
    s = q.shape[1]
    parts = []   # (first row, out, lse) of each call's block: merged by the online-softmax rule (merge_attention's)
    kv = torch.stack([k, v])
    for step in range(ring.world):
        if step + 1 < ring.world:
            kv_next = torch.empty_like(kv)
            reqs = ring.shift(kv, kv_next, _TAG_KV)  # posted before the compute it hides behind
        for c in plans[step]:
            qs, ks = blocks.rows(c)
            blk_out, blk_lse = blocks.forward(c, q[:, qs], kv[0][:, ks], kv[1][:, ks])
            parts.append((qs.indices(s)[0], blk_out, blk_lse))
            if len(parts) == _PARTS_HELD + 1:   # fold them into one float32 part
                parts = [(0, *_merged(parts, q.shape, torch.float32, q.device))]
        if step + 1 < ring.world:
            _wait(reqs)
            kv = kv_next
    return _merged(parts, q.shape, q.dtype, q.device)


def _merged(parts, shape, dtype, device):
    """(out, lse) of the merged parts, out of `dtype`: written into the first part where it spans every row in that
    dtype (merge_parts reads a row of every part before it writes that row), which is the result when it is the only
    part; else into new tensors."""
    b, s, h, _ = shape
    if parts and parts[0][1].shape == shape and parts[0][1].dtype == dtype and parts[0][1].is_contiguous() \
            and parts[0][2].shape == (b, h, s) and parts[0][2].is_contiguous():
        out, lse = parts[0][1], parts[0][2]
        if len(parts) == 1:
            return out, lse
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=device)
    if parts:
        merge_parts(parts, out, lse)
    else:   # every key masked from every query of this rank
        out.zero_()
        lse.fill_(-_INF)
    return out, lse


def _every_row(rows: slice, n: int) -> bool:
    """Whether a slice of a dimension of length n takes all of it."""
    return rows.indices(n) == (0, n, 1)


def _ring_backward(ring: _Ring, dout, q, k, v, out, lse, plans, blocks):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # D = rowsum(dO o O) of the global output: the same rows at every step, computed once
    delta = bwd_delta(out, dout.contiguous(), lse)
    rows_of = {}   # query rows -> their LSE and D, contiguous as the kernels read them: made once per backward
    kv = torch.stack([k, v])
    # (requests, buffer being sent, buffer being received) of the dK/dV transfer in flight; the send buffer
    # is referenced until its transfer is waited on, so its memory cannot be reused while NCCL reads it
    dkv_flight = None
    for step in range(ring.world):
        if step + 1 < ring.world:
            kv_next = torch.empty_like(kv)
            kv_reqs = ring.shift(kv, kv_next, _TAG_KV)
        calls = plans[step]
        # a first call over every key row writes the step's dK / dV (kv_fresh) into an unfilled accumulator
        fresh = bool(calls) and _every_row(blocks.rows(calls[0])[1], kv.shape[2])
        dkv = (torch.empty if fresh else torch.zeros)(kv.shape, dtype=torch.float32, device=kv.device)
        for i, c in enumerate(calls):
            # global out and lse: P = exp(S - lse_global), D = rowsum(dO * O_global) -> exactly this
            # block's share of dQ and of the shard's dK, dV
            qs, ks = blocks.rows(c)
            key = qs.indices(q.shape[1])
            if key not in rows_of:
                rows_of[key] = (lse[:, :, qs].contiguous(), delta[:, :, qs].contiguous())
            lse_q, delta_q = rows_of[key]
            sums = GradSums(dq[:, qs], dkv[0][:, ks], dkv[1][:, ks], delta_q, kv_fresh=fresh and i == 0)
            blocks.backward(c, dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs], lse_q, sums)
        if dkv_flight is not None:  # the shard's dK/dV accumulated by the ranks it visited before us
            _wait(dkv_flight[0])
            dkv += dkv_flight[2]
        if ring.world > 1:
            # pass it on; the transfer after the last step delivers each shard's dK/dV to its home rank, whole:
            # it goes in k's dtype (the home rank would round the same float32 sum), half the bytes of the
            # one transfer no compute hides
            if step + 1 == ring.world:
                dkv = dkv.to(k.dtype)
            dkv_in = torch.empty_like(dkv)
            dkv_flight = (ring.shift(dkv, dkv_in, _TAG_DKV), dkv, dkv_in)
        if step + 1 < ring.world:
            _wait(kv_reqs)
            kv = kv_next
    if dkv_flight is not None:
        _wait(dkv_flight[0])
        dkv = dkv_flight[2]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingFlashAttnFunc(torch.autograd.Function):
    """The ring passes as one autograd node: `blocks` (DenseBlocks, or the varlen plan's executor) runs each
    step's kernel calls on batch-first (batch, seqlen_local, heads, headdim) shards."""

    @staticmethod
    def forward(ctx, q, k, v, ring, plans, blocks):
        out, lse = _ring_forward(ring, q, k, v, plans, blocks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plans, ctx.blocks = ring, plans, blocks
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, dout, q, k, v, out, lse, ctx.plans, ctx.blocks)
        return dq, dk, dv, None, None, None


def ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = False,
                         softmax_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
                         layout: str = "zigzag", deterministic: bool = False, return_softmax_lse: bool = False):
    """Exact attention over a sequence sharded across the ranks of `group` (context parallelism).

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_k, headdim), this rank's
    shard of the global sequence of length seqlen_local * world_size as `shard_sequence(x, rank, world_size,
    layout)` cuts it (zigzag: seqlen_local even). Every rank of `group` must call it with equal shapes.
    causal / window_size / softcap act on GLOBAL positions exactly as flash_attn_func on the unsharded
    sequence. GQA: nheads % nheads_k == 0. Returns out (batch, seqlen_local, nheads, headdim) in q's dtype
    (and softmax_lse (batch, nheads, seqlen_local) float32 if return_softmax_lse); differentiable in q, k, v.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashtile: ring_flash_attn_func needs an initialised torch.distributed process group "
                           "(dist.init_process_group)")
    _check_layout(layout)
    window_size, causal, deterministic, return_softmax_lse = P.scalars(
        window_size, ("causal", causal), ("deterministic", deterministic), ("return_softmax_lse", return_softmax_lse))
    P.qkv(q, k, v, 4)
    checks.check_device(q)
    if k.shape[1] != q.shape[1]:
        fail("k.shape[1] (seqlen_local of k)", k.shape[1], f"q's seqlen_local {q.shape[1]} (q and k/v are shards of "
             "the same sequence)")
    ring = _Ring.of(group)
    if layout == "zigzag" and q.shape[1] % 2 != 0:
        fail("q.shape[1] (seqlen_local)", q.shape[1], f"an even length for layout='zigzag' (global seqlen "
             f"{q.shape[1] * ring.world} must be divisible by 2 * world_size = {2 * ring.world})")
    # the window acts on global positions: normalised against the global length
    n = q.shape[1] * ring.world
    params = P.attn_params(q.shape[-1], n, n, 0.0, softmax_scale, causal, window_size, softcap)
    p = Problem(P.DENSE, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, params,
                deterministic=deterministic)
    if ring.world > 1:
        _check_group_shapes(ring, q, k)
    plans = ring_plan(ring.rank, ring.world, layout, q.shape[1], params.window_left, params.window_right)
    out, lse = RingFlashAttnFunc.apply(q, k, v, ring, plans, DenseBlocks(p))
    return (out, lse) if return_softmax_lse else out

"""All-to-all sequence parallelism (DeepSpeed-Ulysses) and its hybrid with the ring (USP).

Ulysses: each of the W ranks of a group holds a contiguous shard of the sequence, (batch, s / W, heads,
headdim). One all-to-all trades it for every token of heads [r H / W, (r + 1) H / W); each rank runs flashtile's
local attention on its heads over the whole sequence; one all-to-all trades the output back. The backward runs
the same exchanges in reverse around the local backward (comm.seq_to_heads / heads_to_seq are autograd
Functions). Exact: every head sees exactly the keys it would in one process.

Heads rule: nheads must be divisible by W. KV heads (GQA/MQA): when nheads_k is not a multiple of W, each KV
head is repeated r = W / gcd(nheads_k, W) times before the exchange (r then divides nheads / nheads_k, so query
head i still reads a copy of KV head i // (nheads / nheads_k)). Cost: the K/V send buffers grow r-fold, to
r * nheads_k / W KV heads per rank over the whole sequence after the exchange (one head when nheads_k divides W);
the gradients of the copies are summed back.

Varlen: the packed batch (cu_seqlens over the GLOBAL packed tokens) is cut in W contiguous pieces; the packed
sequence is padded at its end to a multiple of W (rows past cu_seqlens[-1] are padding: zero output and
gradient); documents are not padded. After the exchange each rank has the whole packed sequence and runs
flash_attn_varlen_func's problem on it.

USP (hybrid): W = R U ranks form R Ulysses groups of U ranks (all-to-all inside a group, typically one node)
and U ring groups of R ranks (one rank of each Ulysses group; ring attention across nodes). Rank (i, j) (ring
rank i, Ulysses rank j) holds piece j of U contiguous pieces of ring shard i (ring.shard_sequence with the ring
layout over R ranks; varlen: varlen.shard_varlen over R ranks with documents padded to a multiple of 2 R U). The
Ulysses exchange rebuilds ring shard i for H / U heads, ring attention runs across the ring group, and the
exchange back restores the layout. context.cp_shard cuts any of these layouts.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import interface as _interface
from ..api import problem as P
from ..api.errors import fail
from .comm import check_device, heads_to_seq, require_process_group, seq_to_heads
from .ring import check_group_agrees, ring_flash_attn_func
from .varlen import _cu_values, ring_flash_attn_varlen_func


def kv_head_replication(nheads: int, nheads_k: int, world_size: int) -> int:
    """How many copies r of each KV head Ulysses sends over a group of `world_size` ranks (1: none): the least r
    with nheads_k * r divisible by world_size, r = world_size / gcd(nheads_k, world_size). Raises ArgumentError
    when nheads is not divisible by world_size. Then r always divides nheads / nheads_k (world_size divides
    (nheads / nheads_k) * nheads_k, and r is coprime to nheads_k / gcd), so each rank's query heads read whole
    copies of their own KV heads."""
    if nheads % world_size:
        fail("q.shape[-2] (nheads)", nheads, f"a multiple of the Ulysses group size {world_size} (each rank takes "
             "nheads / world_size query heads)")
    return world_size // math.gcd(nheads_k, world_size)


def _exchange_in(q, k, v, group, fn: str, cu: Tuple[int, ...] = ()):
    """Check the group agrees on shapes (and cu_seqlens' values `cu`), replicate KV heads where the rule says,
    and trade sequence shards for head shards: returns (q, k, v) of (batch, W s_local, heads / W, headdim)."""
    world = dist.get_world_size(group)
    # first the group, then the heads rule: ranks that disagree all raise here, ranks that agree raise alike below
    check_group_agrees(group, f"{fn}: q/k shard shapes (and cu_seqlens) across the ranks of the Ulysses group "
                       "(rank: q.shape + k.shape (+ len(cu_seqlens), checksum))",
                       [*q.shape, *k.shape] + ([len(cu), hash(cu) & (2 ** 62 - 1)] if cu else []),
                       "equal on every rank", q.device)
    rep = kv_head_replication(q.shape[-2], k.shape[-2], world)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
    return seq_to_heads([q, k, v], group)


def _exchange_out(out, lse, group, want_lse: bool):
    """(batch, s, H / W, d) out and (batch, H / W, s) lse -> this rank's (batch, s / W, H, d) and (batch, H,
    s / W)."""
    (out,) = heads_to_seq([out], group)
    if not want_lse:
        return out, None
    (lse,) = heads_to_seq([lse.transpose(1, 2).unsqueeze(-1)], group)
    return out, lse.squeeze(-1).transpose(1, 2)


def _alibi_heads(alibi_slopes, group, nheads: int):
    """This rank's slice of the ALiBi slopes ((nheads,) or (batch, nheads)): the heads it holds after the
    exchange."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape[-1] != nheads:
        fail("alibi_slopes.shape", tuple(getattr(alibi_slopes, "shape", ())), f"(nheads,) or (batch, nheads) with "
             f"nheads = {nheads}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    g = nheads // world
    return alibi_slopes[..., rank * g:(rank + 1) * g].contiguous()


def _local_dense(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic):
    p = P.dense(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, False)
    x = _interface.NO_EXTRAS if alibi_slopes is None else _interface.Extras(alibi=alibi_slopes)
    out, lse, _ = _interface.attention(p, q, k, v, x)
    return out, lse


def _checked(name: str, q, k, v, dims: int, window_size, causal, deterministic, return_softmax_lse):
    """A Ulysses call's checks before any collective: a process group, the flags and window (validated), q / k / v
    with `dims` dimensions on one device, and q and k / v shards of the same rows (their sequence dimension,
    dims - 3, equal). Returns (window_size, causal, deterministic, return_softmax_lse)."""
    require_process_group(name)
    scalars = P.scalars(window_size, ("causal", causal), ("deterministic", deterministic),
                        ("return_softmax_lse", return_softmax_lse))
    P.qkv(q, k, v, dims)
    check_device(q)
    s = dims - 3
    if k.shape[s] != q.shape[s]:
        fail(f"k.shape[{s}] (this rank's rows of k)", k.shape[s], f"q's {q.shape[s]} (q and k / v are shards of the "
             "same rows)")
    return scalars


def ulysses_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = False,
                            softmax_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
                            alibi_slopes=None, deterministic: bool = False, return_softmax_lse: bool = False):
    """Exact attention over a sequence sharded contiguously across the ranks of `group`, by all-to-all.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_k, headdim): rank r holds
    global positions [r seqlen_local, (r + 1) seqlen_local) (shard_sequence(x, r, W, "contiguous")). nheads
    divisible by W; KV heads replicated as the module docstring says. causal / window_size / softcap /
    alibi_slopes ((nheads,) or (batch, nheads) float32) act on global positions as flash_attn_func on the
    unsharded sequence. Returns out like q (and softmax_lse (batch, nheads, seqlen_local) float32 if
    return_softmax_lse); differentiable in q, k, v.
    """
    window_size, causal, deterministic, return_softmax_lse = _checked(
        "ulysses_flash_attn_func", q, k, v, 4, window_size, causal, deterministic, return_softmax_lse)
    alibi = _alibi_heads(alibi_slopes, group, q.shape[2])
    qh, kh, vh = _exchange_in(q, k, v, group, "ulysses_flash_attn_func")
    out, lse = _local_dense(qh, kh, vh, causal, softmax_scale, window_size, softcap, alibi, deterministic)
    out, lse = _exchange_out(out, lse, group, return_softmax_lse)
    return (out, lse) if return_softmax_lse else out


def _cu_tensor(cu_seqlens, device) -> torch.Tensor:
    if isinstance(cu_seqlens, (list, tuple)):
        return torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    return cu_seqlens


def ulysses_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, max_seqlen: int,
                                   group=None, causal: bool = False, softmax_scale: Optional[float] = None,
                                   window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                   deterministic: bool = False, return_softmax_lse: bool = False):
    """Ulysses on packed documents. q: (total_local, nheads, headdim), k, v: (total_local, nheads_k, headdim):
    rank r holds rows [r total_local, (r + 1) total_local) of the packed batch padded at its end to W total_local
    >= cu_seqlens[-1] rows. cu_seqlens: (num_documents + 1,) int32 on q's device (or a list), cumulative lengths
    of the GLOBAL packed batch; max_seqlen >= the longest document. Options as flash_attn_varlen_func with
    cu_seqlens_q = cu_seqlens_k = cu_seqlens. Returns out (total_local, nheads, headdim), zero on padding rows
    (and softmax_lse (nheads, total_local) if return_softmax_lse); differentiable in q, k, v."""
    window_size, causal, deterministic, return_softmax_lse = _checked(
        "ulysses_flash_attn_varlen_func", q, k, v, 3, window_size, causal, deterministic, return_softmax_lse)
    cu = _cu_tensor(cu_seqlens, q.device)
    alibi = _alibi_heads(alibi_slopes, group, q.shape[1])
    fn = "ulysses_flash_attn_varlen_func"
    qh, kh, vh = (t[0] for t in _exchange_in(q[None], k[None], v[None], group, fn, _cu_values(cu)))
    p = P.varlen(qh, kh, vh, cu, cu, max_seqlen, max_seqlen, 0.0, softmax_scale, causal, window_size, softcap, alibi,
                 deterministic, False)
    pad = P.cu_seqlens_values("cu_seqlens", cu, qh.shape[0], max_seqlen, "max_seqlen")
    p = p.with_padding(pad, pad)
    out, lse, _ = _interface.attention(p, qh, kh, vh, _interface.Extras(alibi, cu, cu))
    out, lse = _exchange_out(out[None], lse[None] if return_softmax_lse else None, group, return_softmax_lse)
    return (out[0], lse[0]) if return_softmax_lse else out[0]


def _usp_groups(ulysses_group, ring_group, fn):
    for name, g in (("ulysses_group", ulysses_group), ("ring_group", ring_group)):
        if g is None:
            fail(f"{fn}: {name}", None, "a torch.distributed ProcessGroup (e.g. mesh.get_group(dim)); None would mean "
                 "the world group for both")


def usp_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group, ring_group,
                        causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
                        softcap: float = 0.0, layout: str = "zigzag", deterministic: bool = False,
                        return_softmax_lse: bool = False):
    """Hybrid context parallelism (USP): all-to-all inside `ulysses_group` (U ranks), ring attention across
    `ring_group` (R ranks). q: (batch, seqlen_local, nheads, headdim), k, v: (batch, seqlen_local, nheads_k,
    headdim), as context.cp_shard(x, rank, ring_size=R, ulysses_size=U, layout=layout) cuts them. nheads divisible
    by U (KV heads replicated as Ulysses does). Options as ring_flash_attn_func. Returns out like q (and
    softmax_lse (batch, nheads, seqlen_local) if return_softmax_lse); differentiable in q, k, v."""
    require_process_group("usp_flash_attn_func")
    _usp_groups(ulysses_group, ring_group, "usp_flash_attn_func")
    P.qkv(q, k, v, 4)
    qh, kh, vh = _exchange_in(q, k, v, ulysses_group, "usp_flash_attn_func")
    out, lse = ring_flash_attn_func(qh, kh, vh, group=ring_group, causal=causal, softmax_scale=softmax_scale,
                                    window_size=window_size, softcap=softcap, layout=layout,
                                    deterministic=deterministic, return_softmax_lse=True)
    out, lse = _exchange_out(out, lse, ulysses_group, bool(return_softmax_lse))
    return (out, lse) if return_softmax_lse else out


def usp_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, max_seqlen: int,
                               ulysses_group, ring_group, causal: bool = False, softmax_scale: Optional[float] = None,
                               window_size=(-1, -1), softcap: float = 0.0, deterministic: bool = False,
                               return_softmax_lse: bool = False):
    """USP on packed documents: documents padded to a multiple of 2 R U and zigzagged per document over the R ring
    ranks, each ring shard cut in U contiguous pieces (context.cp_shard with cu_seqlens). With R = 1 this is
    ulysses_flash_attn_varlen_func and its layout (no per-document padding). Options and returns as
    ring_flash_attn_varlen_func."""
    require_process_group("usp_flash_attn_varlen_func")
    _usp_groups(ulysses_group, ring_group, "usp_flash_attn_varlen_func")
    ring_size, uly = dist.get_world_size(ring_group), dist.get_world_size(ulysses_group)
    if ring_size == 1:
        return ulysses_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, ulysses_group, causal, softmax_scale,
                                              window_size, softcap, None, deterministic, return_softmax_lse)
    P.qkv(q, k, v, 3)
    qh, kh, vh = (t[0] for t in _exchange_in(q[None], k[None], v[None], ulysses_group, "usp_flash_attn_varlen_func"))
    out, lse = ring_flash_attn_varlen_func(qh, kh, vh, cu_seqlens, max_seqlen, group=ring_group, causal=causal,
                                           softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                           deterministic=deterministic, return_softmax_lse=True,
                                           pad_multiple=2 * ring_size * uly)
    out, lse = _exchange_out(out[None], lse[None], ulysses_group, bool(return_softmax_lse))
    return (out[0], lse[0]) if return_softmax_lse else out[0]

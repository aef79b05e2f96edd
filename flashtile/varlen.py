"""Variable-length (packed) batches: flash_attn_varlen_func and its packed variants, flash-attn 2.x names.

Sequences are concatenated along the token axis: q (total_q, nheads, headdim), k/v (total_k, nheads_k,
headdim); sequence b owns rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. The dense FA2 kernels read these
bounds themselves (mods.seq_bounds), so these entry points are thin adapters over interface._attention after
checking cu_seqlens. With block_table, K/V live in a paged cache and the call goes to the split-KV decode
kernel (forward only, as in flash-attn).
"""
from __future__ import annotations

import torch

from .api import checks
from .api import problem as P
from .api.errors import fail
from .interface import Extras, attention, output, output_like
from .kernels import dispatch

_VARLEN: dict = {}   # argument signature -> Problem of varlen calls that passed the shape checks
_USED: dict = {}   # seqused's derived sequences (_used_sequences), per set of tensors


def _max_seqlen(name: str, value) -> int:
    return value if type(value) is int and value >= 0 else checks.integer(name, value, 0)


class _PagedForwardOnly(torch.autograd.Function):
    """Carries the paged forward through autograd only to refuse the backward with a clear message."""

    @staticmethod
    def forward(ctx, q, k, v, run):
        return run(q)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("flashtile: flash_attn_varlen_func with block_table (paged K/V) is forward-only, like "
                           "flash-attn's paged path (inference); call it under torch.no_grad() or use the "
                           "contiguous varlen layout (no block_table) for training")


def _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_attn_probs, block_table):
    for name, t, dims in (("q", q, 3), ("k", k, 4), ("v", v, 4)):
        checks.tensor(name, t, dims)
    batch = checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch=batch)
    # the paged cache checked as flash_attn_with_kvcache checks one, with q's packed tokens as one sequence each
    p = P.kvcache(q.unsqueeze(1)[:batch] if q.shape[0] >= batch else q.new_empty((batch, 1, *q.shape[1:])),
                  k, v, None, None, None, None, False, None, None, block_table, softmax_scale, causal, window_size,
                  softcap, False, alibi_slopes, 0, False)
    capacity = p.seqlen_k
    P.cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    P.cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, None, max_seqlen_k, "max_seqlen_k")
    seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    if P.values_checkable(q):
        if bool((seqlens_k > capacity).any()):
            fail("cu_seqlens_k", cu_seqlens_k.tolist(), f"sequence lengths <= the paged capacity {capacity} "
                 "(block_table.shape[1] * page_block_size)")
        P.kvcache_values(p, q.unsqueeze(1)[:batch], k, seqlens_k, None, None, None, block_table, None)
    checks.check_device(q)
    params = p.params
    if P.number("dropout_p", dropout_p) or return_attn_probs:
        # dropout and the probabilities are the dense kernels' features: the sequences' pages are gathered into
        # packed K / V (a copy of the keys the sequences use), then the varlen path runs on them, forward only
        kg, vg, cu_k = _gather_pages(k, v, block_table, seqlens_k)

        def gathered(q_):
            return flash_attn_varlen_func(q_, kg, vg, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                          softmax_scale, causal, window_size, softcap, alibi_slopes, False,
                                          return_attn_probs)
        with torch.no_grad():
            result = gathered(q)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out = _PagedForwardOnly.apply(q, k, v, lambda q_: result[0] if return_attn_probs else result)
            return (out, *result[1:]) if return_attn_probs else out
        return result

    def run(q_):
        out = output_like(q_)
        lse = output((q_.shape[1], q_.shape[0]), q_.device, torch.float32)
        dispatch.flash_decode(q_, k, v, out, lse, seqlens_k, params, cu_seqlens_q=cu_seqlens_q,
                              max_seqlen_q=max_seqlen_q, block_table=block_table, alibi=alibi_slopes,
                              max_seqlen_k=min(max_seqlen_k, capacity))
        return out

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _PagedForwardOnly.apply(q, k, v, run)
    with torch.no_grad():
        return run(q)


def _gather_pages(k_cache, v_cache, block_table, seqlens_k):
    """The keys / values each sequence uses (positions < seqlens_k[b] of its pages), packed: (total, nheads_k, d)
    twice and their cu_seqlens (int32)."""
    page = k_cache.shape[1]
    lens = seqlens_k.long()
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
    pos = torch.arange(total, device=lens.device) - cu[seq].long()
    rows = block_table[seq, pos // page].long() * page + pos % page
    flat = (-1, *k_cache.shape[2:])
    return k_cache.reshape(flat)[rows], v_cache.reshape(flat)[rows], cu


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None):
    """Exact attention over a packed batch of variable-length sequences (FA2 forward and backward).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q / cu_seqlens_k:
    (batch + 1,) int32 cumulative lengths starting at 0 and ending at total_q / total_k (zero-length sequences
    allowed); max_seqlen_q / max_seqlen_k: ints >= the longest sequence. Every option of flash_attn_func
    applies per sequence (causal / window bottom-right aligned within each sequence pair; alibi_slopes
    (nheads,) or (batch, nheads)).
    block_table: (batch, max_blocks_per_seq) int32 with k, v a paged cache (num_blocks, page_block_size,
    nheads_k, headdim); sequence b's keys are its first cu_seqlens_k[b+1] - cu_seqlens_k[b] cache positions.
    Forward only (backward raises); with dropout or return_attn_probs the pages used are gathered first.
    seqused_q / seqused_k (FlashAttention-3's): (batch,) int32, the rows of each sequence's slot that are used:
    sequence b is rows cu_seqlens[b] .. cu_seqlens[b] + seqused[b] - 1 (lengths, masks and alignment as if the
    slot held only those); the slot's other query rows output zeros (softmax_lse -inf) and no gradient reaches
    unused rows. Not with block_table.
    Returns out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q) float32,
    S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k)) if return_attn_probs.
    """
    window_size, causal, deterministic, return_attn_probs = P.scalars(
        window_size, ("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs))
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    if block_table is not None:
        if seqused_q is not None or seqused_k is not None:
            fail("seqused_q / seqused_k", "a tensor", "None with block_table (a paged call's lengths are cu_seqlens')")
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table)
    q, k, v = P.contiguous_last(q, k, v)
    bounds_q, bounds_k, slopes = cu_seqlens_q, cu_seqlens_k, alibi_slopes
    used = seqused_q is not None or seqused_k is not None
    if used:
        bounds_q, bounds_k, slopes = _used_sequences(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                                     alibi_slopes)
    p = P.memoised(_VARLEN, (q, k, v, bounds_q, bounds_k, max_seqlen_q, max_seqlen_k,
                             P.number("dropout_p", dropout_p), P.number("softmax_scale", softmax_scale), causal,
                             window_size, P.number("softcap", softcap), slopes, deterministic,
                             return_attn_probs), P.varlen)
    pad_q = P.cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    pad_k = P.cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    if used:
        for name, n, cu_ in (("seqused_q", seqused_q, cu_seqlens_q), ("seqused_k", seqused_k, cu_seqlens_k)):
            if n is not None:
                P.seqused_values(name, n, cu_)
    p = p.with_padding(pad_q, pad_k)
    checks.check_device(q)
    out, lse, probs = attention(p, q, k, v, Extras(slopes, bounds_q, bounds_k))
    if probs is not None and used:
        probs = probs[0::3]   # (the used sequences')
    return out if probs is None else (out, lse, probs)


def _used_sequences(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes):
    """seqused_q / seqused_k as plain varlen: each slot becomes three sequences (_used_bounds): its used rows, its
    unused query rows (no keys: zeros, lse -inf, no gradient, as every row that sees no key), its unused key rows
    (no queries: no work, zero gradients). Returns both sides' cu_seqlens of the 3 x batch sequences and the ALiBi
    slopes for them. The arguments' shapes are checked here, their values by the caller. Derived once per set of
    tensors (the layers of a model pass the same ones), except where a CUDA graph is captured (its replays derive
    them again) or torch.compile traces."""
    batch = checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch=batch)
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None:
            checks.index_tensor(name, used, (batch, ), q.device)
    per_slot = alibi_slopes if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2 else None
    if per_slot is not None and per_slot.shape[0] != batch:   # (batch, nheads): each slot's thrice
        fail("alibi_slopes.shape", tuple(per_slot.shape), f"(nheads,) or ({batch}, nheads)")

    def derive():
        return (_used_bounds(cu_seqlens_q, seqused_q, False), _used_bounds(cu_seqlens_k, seqused_k, True),
                alibi_slopes if per_slot is None else per_slot.repeat_interleave(3, dim=0))
    if not P.values_readable(q):
        return derive()
    given = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, per_slot)
    return P.remembered(_USED, tuple(t for t in given if t is not None),
                        ("seqused", *(t is None for t in given)), derive)


def _used_bounds(cu: torch.Tensor, used, keys: bool) -> torch.Tensor:
    """cu_seqlens (3 batch + 1,) int32 of three sequences per slot: its used rows; its other query rows, without
    keys; its other key rows, without queries (keys: the key side's bounds, else the query side's). Device work
    only, nothing read."""
    end = cu[1:] if used is None else cu[:-1] + used
    out = torch.empty(3 * cu.numel() - 2, dtype=torch.int32, device=cu.device)
    out[0::3] = cu
    out[1::3] = end
    out[2::3] = end if keys else cu[1:]
    return out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim); cu_seqlens (batch + 1,) int32. Gradients flow back into qkv."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        fail("qkv.shape", tuple(getattr(qkv, "shape", ())), "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        fail("kv.shape", tuple(getattr(kv, "shape", ())), "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)

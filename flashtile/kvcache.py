"""flash_attn_with_kvcache: attention of new queries over a KV cache, with in-place append, rotary embedding,
paged K/V and split-KV (flash-decoding). Forward only (inference), like flash-attn.

Flow: validate everything (shapes, dtypes, devices - remembered per argument signature, so a decode loop checks
them once, and its launches reuse that signature's templates - then the values of the index tensors) -> append the new
k/v into the cache (rotating k) and rotate q (kernels/triton/rotary.py) -> split-KV attention over the cache
(kernels/triton/decode.py, merged by combine.py).
"""
from __future__ import annotations

import itertools

import torch

from .api import problem as P
from .api.checks import check_device
from .api.errors import fail
from .interface import output, output_like
from .kernels import dispatch
from .kernels.triton import rotary as _rotary

# argument signature -> (Problem, token) of calls that passed the checks; the token (one per entry, never reused)
# keys the decode launch templates of that signature
_SHAPES: dict = {}
_TOKENS = itertools.count()


def _checked(*args):
    """(Problem, token or None where the signature is not remembered)."""
    return P.memoised(_SHAPES, args, lambda *a: (P.kvcache(*a), None), lambda checked: (checked[0], next(_TOKENS)))


def _seqlens_tensor(value, batch: int, device) -> torch.Tensor:
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    P.checks.index_tensor("cache_seqlens", value, (batch,), device)
    return value


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, appending k/v first (flash-attn 2.x semantics). No autograd.

    q: (batch, seqlen_q, nheads, headdim).
    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_block_size,
        nheads_k, headdim) with block_table (batch, max_blocks_per_seq) int32 (any page size).
    k, v: optional (batch, seqlen_new, nheads_k, headdim): written into the cache IN PLACE at positions
        cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attending.
    rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), seqlen_ro >= the cache capacity; q and the new
        k are rotated (rotary_interleaved: pairs (2i, 2i+1); else GPT-NeoX halves). The new k at position
        cache_seqlens - cache_leftpad + i; q row i at the same position if causal or local (a window edge below
        the cache's capacity: an edge at or past it masks nothing and is dropped), else every q row at
        cache_seqlens - cache_leftpad (flash-attn's convention).
    cache_seqlens: int or (batch,) int32: tokens already in the cache (counting the left padding); None: the
        whole cache (only without k/v).
    cache_batch_idx: (batch,) int32: cache row of each batch element (contiguous cache only; with duplicate
        indices and k/v given, which duplicate's values land in the cache is unspecified).
    cache_leftpad: (batch,) int32: the sequence starts at this cache position; positions below it are ignored,
        and key positions (causal alignment, ALiBi, rotary) count from it.
    Batch element b attends keys at cache positions [cache_leftpad[b], cache_seqlens[b] + seqlen_new): with
    seqlen_k = that count, causal/window/ALiBi align bottom-right as in flash_attn_func.
    num_splits: 0 (or less) picks the number of key splits from the problem and the GPU; 1 disables splitting.
    Returns out (batch, seqlen_q, nheads, headdim), and softmax_lse (batch, nheads, seqlen_q) float32 if
    return_softmax_lse.
    """
    # ---- shapes, dtypes, devices (no device memory is read; remembered per signature) ----
    window_size, causal, rotary_interleaved, return_softmax_lse = P.scalars(
        window_size, ("causal", causal), ("rotary_interleaved", rotary_interleaved),
        ("return_softmax_lse", return_softmax_lse))
    q, k, v = P.contiguous_last(q, k, v)
    if type(num_splits) is not int:
        num_splits = P.checks.integer("num_splits", num_splits)
    p, token = _checked(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens is None, cache_batch_idx,
                        cache_leftpad, block_table, P.number("softmax_scale", softmax_scale), causal, window_size,
                        P.number("softcap", softcap), rotary_interleaved, alibi_slopes, num_splits,
                        return_softmax_lse)
    num_splits = max(num_splits, 0)   # (< 1: automatic, as in flash-attn)
    capacity, seqlen_new = p.seqlen_k, p.seqlen_new
    batch, seqlen_q, nheads = q.shape[:3]
    device = q.device
    if cache_seqlens is None:
        cache_seqlens = capacity
    # Without an append, an int cache_seqlens (or None: the full cache) is one end position for every batch
    # element: the kernel takes it as a scalar, so no (batch,) tensor is filled on the device for it.
    static_end = None
    if isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _seqlens_tensor(cache_seqlens, batch, device)
    else:
        cache_seqlens = P.checks.integer("cache_seqlens", cache_seqlens, 0)
        if k is None:
            if cache_seqlens > capacity:
                fail("cache_seqlens", cache_seqlens, f"<= {P.capacity_name(p)}")
            static_end = cache_seqlens
        else:
            cache_seqlens = _seqlens_tensor(cache_seqlens, batch, device)
    check_device(q)
    # ---- index values (one synchronisation; skipped when disabled / capturing / compiling) ----
    P.kvcache_values(p, q, k_cache, cache_seqlens, static_end, cache_leftpad, cache_batch_idx, block_table,
                     rotary_cos)

    # ---- append (+ rotary) ----
    q_attn = q
    # the signature's token and static_end determine every argument of the launches below but the tensors' data
    # (q_attn, out, lse take their shapes from the checked arguments): repeated calls reuse the launches' templates
    sig = None if token is None else (token, static_end)
    with torch.no_grad():
        if k is not None:
            _rotary.append_kv(k, v, k_cache, v_cache, cache_seqlens, cos=rotary_cos, sin=rotary_sin,
                              interleaved=rotary_interleaved, leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                              block_table=block_table, sig=sig)
        if rotary_cos is not None:
            pos0 = cache_seqlens if cache_leftpad is None else cache_seqlens - cache_leftpad
            q_attn = _rotary.rotary_q(q, rotary_cos, rotary_sin, pos0.to(torch.int32),
                                      per_row=p.params.has_left or p.params.has_right, interleaved=rotary_interleaved)
        # the appended tokens count in the decode launch (seqlens_add), not by a kernel adding them to the tensor
        seqlens_k = None if static_end is not None else cache_seqlens

        # ---- split-KV attention over the cache ----
        out = output_like(q)
        lse = output((batch, nheads, seqlen_q), device, torch.float32)
        dispatch.flash_decode(q_attn, k_cache, v_cache, out, lse, seqlens_k, p.params,
                              cache_batch_idx=cache_batch_idx, leftpad=cache_leftpad, block_table=block_table,
                              alibi=alibi_slopes, num_splits=num_splits,
                              max_seqlen_k=capacity if static_end is None else static_end,
                              seqlen_k_static=static_end, seqlens_add=seqlen_new, sig=sig)
    return (out, lse) if return_softmax_lse else out

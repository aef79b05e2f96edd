"""flash_attn_with_kvcache: attention of new queries over a KV cache, with in-place append, rotary embedding,
paged K/V and split-KV (flash-decoding). Forward only (inference), like flash-attn.

Flow: validate everything (shapes, dtypes, devices - remembered per argument signature, so a decode loop checks
them once, and its launches reuse that signature's templates - then the values of the index tensors) -> append the new
k/v into the cache (rotating k) and rotate q (kernels/triton/rotary.py) -> split-KV attention over the cache
(kernels/triton/decode.py, merged by combine.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .interface import (AttnArgs, _check_device, _check_tensor, _fail, _output, _output_like, memoised,
                        validate)
from .kernels.triton import decode as _decode
from .kernels.triton import rotary as _rotary
from .kernels.triton.launch import AttnParams

# Value checks of the index tensors (cache_seqlens, cache_leftpad, cache_batch_idx, block_table, cu_seqlens):
# they read device memory, i.e. one host-device synchronisation per call. On by default (a bad index would
# otherwise read or write outside the cache); FLASHTILE_CHECK_VALUES=0 or setting this to False turns them off
# for serving loops that guarantee their indices (the decode benchmark does, to time the kernels alone).
# They are skipped automatically while a CUDA graph is being captured or torch.compile is tracing.
CHECK_VALUES = os.environ.get("FLASHTILE_CHECK_VALUES", "1") not in ("0", "")


def values_checkable(t: torch.Tensor) -> bool:
    """Whether reading index values now is allowed (and wanted)."""
    if not CHECK_VALUES:
        return False
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_index_tensor(name: str, t, shape, device) -> None:
    """An int32 index tensor of the given shape on the given device (shape entries None: any size)."""
    if not isinstance(t, torch.Tensor):
        _fail(name, type(t).__name__, "a torch.Tensor (int32)", TypeError)
    if t.dtype != torch.int32:
        _fail(f"{name}.dtype", t.dtype, "torch.int32", TypeError)
    if t.dim() != len(shape) or any(s is not None and t.shape[i] != s for i, s in enumerate(shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        _fail(f"{name}.shape", tuple(t.shape), want)
    if t.device != device:
        _fail(f"{name}.device", t.device, f"the device of q ({device})")
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:   # the kernels read element b at offset b
        _fail(f"{name}.stride(0)", t.stride(0), "1 (contiguous)")


def check_paged_cache(k_cache, v_cache, block_table, batch: int, device) -> int:
    """Shape checks of a paged cache (num_blocks, page_block_size, nheads_k, d) and its block table
    (batch, max_blocks_per_seq) int32. Returns the page size."""
    check_index_tensor("block_table", block_table, (batch, None), device)
    if block_table.numel() > 0 and block_table.stride(-1) != 1:
        _fail("block_table.stride(-1)", block_table.stride(-1), "1 (contiguous rows)")
    page = k_cache.shape[1]
    if page < 1:
        _fail("k_cache.shape[1] (page_block_size)", page, ">= 1")
    if tuple(v_cache.shape[:2]) != tuple(k_cache.shape[:2]):
        _fail("v_cache.shape[:2]", tuple(v_cache.shape[:2]), f"k_cache's (num_blocks, page_block_size) "
              f"{tuple(k_cache.shape[:2])}")
    return page


def check_block_table_values(block_table: torch.Tensor, seqlens_end: torch.Tensor, page: int,
                             num_blocks: int) -> None:
    """Every page a sequence uses (positions < seqlens_end[b]) must index a block of the cache."""
    if block_table.numel() == 0:
        return
    used = torch.arange(block_table.shape[1], device=block_table.device).view(1, -1) * page < seqlens_end.view(-1, 1)
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0].tolist())
        _fail(f"block_table[{b}, {j}]", int(block_table[b, j]), f"a block index in [0, {num_blocks}) "
              f"(num_blocks = k_cache.shape[0])")


def _seqlens_tensor(name: str, value, batch: int, device) -> torch.Tensor:
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        _fail(name, type(value).__name__, "an int or an int32 tensor of shape (batch,)", TypeError)
    if isinstance(value, int):
        if value < 0:
            _fail(name, value, ">= 0")
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    check_index_tensor(name, value, (batch,), device)
    return value


def _check_rotary(rotary_cos, rotary_sin, q, k, head_dim: int, capacity: int, rotary_interleaved) -> None:
    if (rotary_cos is None) != (rotary_sin is None):
        _fail("rotary_cos/rotary_sin", (rotary_cos is None, rotary_sin is None), "both given or both None")
    if not isinstance(rotary_interleaved, bool):
        _fail("rotary_interleaved", rotary_interleaved, "a bool", TypeError)
    if rotary_cos is None:
        return
    if k is None:
        _fail("k", None, "new keys/values to append when rotary_cos/rotary_sin are given (flash-attn semantics: "
              "the rotary embedding is applied to q and the new k)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            _fail(name, type(t).__name__, "a torch.Tensor", TypeError)
        if t.dim() != 2:
            _fail(f"{name}.dim()", t.dim(), "2: (seqlen_ro, rotary_dim / 2)")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            _fail(f"{name}.dtype", t.dtype, "float16, bfloat16 or float32", TypeError)
        if t.device != q.device:
            _fail(f"{name}.device", t.device, f"the device of q ({q.device})")
        if t.numel() > 0 and t.stride(-1) != 1:
            _fail(f"{name}.stride(-1)", t.stride(-1), "1")
    if rotary_sin.shape != rotary_cos.shape:
        _fail("rotary_sin.shape", tuple(rotary_sin.shape), f"rotary_cos's shape {tuple(rotary_cos.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if not 2 <= rotary_dim <= head_dim:
        _fail("rotary_cos.shape[1] (rotary_dim / 2)", rotary_cos.shape[1], f"1 .. headdim / 2 = {head_dim // 2}")
    if rotary_cos.shape[0] < capacity:
        _fail("rotary_cos.shape[0] (seqlen_ro)", rotary_cos.shape[0], f">= the cache capacity {capacity} "
              f"(every position a token can be written to)")


@dataclass(frozen=True)
class _Shapes:
    """What flash_attn_with_kvcache's shape / dtype / device checks derive: the normalised scalar arguments, the
    cache capacity (positions a batch element can hold), the page size (0: contiguous) and seqlen_new."""
    args: AttnArgs
    capacity: int
    page: int
    seqlen_new: int
    params: AttnParams   # the kernels' scalar arguments (from args)
    token: Optional[int] = None   # the memoised signature's, unique (flash_decode's sig); None: not memoised


# argument signature -> _Shapes of calls that passed the checks (_checked_shapes)
_SHAPES: dict = {}
_TOKENS = itertools.count()   # _Shapes.token: one per _Shapes remembered, never reused


def _checked_shapes(*args) -> _Shapes:
    """_check_shapes(*args), memoised on the arguments' signature (interface.memoised): a decode loop repeats one
    signature, and the checks cost more host time than the lookup (BENCHMARKS.md §1c). A remembered _Shapes gets a
    token of its own, by which flash_decode knows the signature again."""
    return memoised(_SHAPES, args, _check_shapes,
                    lambda shapes: dataclasses.replace(shapes, token=next(_TOKENS)))


def _check_shapes(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, no_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                  num_splits, return_softmax_lse) -> _Shapes:
    """Every check of flash_attn_with_kvcache that reads no device memory and no cache_seqlens value."""
    _check_tensor("q", q, 4)
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    page = 0
    if block_table is not None:
        page = check_paged_cache(k_cache, v_cache, block_table, batch, device)
        capacity = block_table.shape[1] * page
        if cache_batch_idx is not None:
            _fail("cache_batch_idx", "a tensor", "None with block_table (the block table already maps each batch "
                  "element to its pages)")
    else:
        if tuple(v_cache.shape[:2]) != tuple(k_cache.shape[:2]):
            _fail("v_cache.shape[:2]", tuple(v_cache.shape[:2]), f"k_cache's {tuple(k_cache.shape[:2])}")
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            check_index_tensor("cache_batch_idx", cache_batch_idx, (batch,), device)
        elif k_cache.shape[0] != batch:
            _fail("k_cache.shape[0] (batch_cache)", k_cache.shape[0], f"q's batch {batch} (or pass cache_batch_idx)")
    # Everything about q vs the cache that flash_attn_func checks (dtypes, heads, headdim, window, softcap,
    # ALiBi, scale): through the one validator, on views of the cache with q's batch size.
    if k_cache.shape[0] < 1:
        _fail("k_cache.shape[0]", k_cache.shape[0], ">= 1")
    kc_view = k_cache[:1].expand(batch, *k_cache.shape[1:])
    vc_view = v_cache[:1].expand(batch, *v_cache.shape[1:])
    a: AttnArgs = validate(q, kc_view, vc_view, dropout_p=0.0,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes)
    nheads_k = k_cache.shape[2]
    if (k is None) != (v is None):
        _fail("k/v", (k is None, v is None), "both given (to append) or both None")
    seqlen_new = 0
    if k is not None:
        _check_tensor("k", k, 4)
        _check_tensor("v", v, 4)
        want = (batch, k.shape[1], nheads_k, head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                _fail(f"{name}.shape", tuple(t.shape), f"(batch, seqlen_new, nheads_k, headdim) = {want}")
            if t.dtype != k_cache.dtype:
                _fail(f"{name}.dtype", t.dtype, f"the cache dtype {k_cache.dtype}", TypeError)
            if t.device != device:
                _fail(f"{name}.device", t.device, f"the device of q ({device})")
        seqlen_new = k.shape[1]
    _check_rotary(rotary_cos, rotary_sin, q, k, head_dim, capacity, rotary_interleaved)
    if no_seqlens and k is not None:
        _fail("cache_seqlens", None, "the current cache lengths when k/v are appended (flash-attn semantics)")
    if cache_leftpad is not None:
        check_index_tensor("cache_leftpad", cache_leftpad, (batch,), device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        _fail("num_splits", num_splits, "an int >= 0 (0: chosen automatically)")
    if not isinstance(return_softmax_lse, bool):
        _fail("return_softmax_lse", return_softmax_lse, "a bool", TypeError)
    return _Shapes(a, capacity, page, seqlen_new, AttnParams(a.softmax_scale, a.window_left, a.window_right,
                                                             a.softcap))


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
        cache_seqlens - cache_leftpad + i; q row i at the same position if causal or local, else every q row
        at cache_seqlens - cache_leftpad (flash-attn's convention).
    cache_seqlens: int or (batch,) int32: tokens already in the cache (counting the left padding); None: the
        whole cache (only without k/v).
    cache_batch_idx: (batch,) int32: cache row of each batch element (contiguous cache only; with duplicate
        indices and k/v given, which duplicate's values land in the cache is unspecified).
    cache_leftpad: (batch,) int32: the sequence starts at this cache position; positions below it are ignored,
        and key positions (causal alignment, ALiBi, rotary) count from it.
    Batch element b attends keys at cache positions [cache_leftpad[b], cache_seqlens[b] + seqlen_new): with
    seqlen_k = that count, causal/window/ALiBi align bottom-right as in flash_attn_func.
    num_splits: 0 picks the number of key splits from the problem and the GPU; 1 disables splitting.
    Returns out (batch, seqlen_q, nheads, headdim), and softmax_lse (batch, nheads, seqlen_q) float32 if
    return_softmax_lse.
    """
    # ---- shapes, dtypes, devices (no device memory is read) ----
    shapes = _checked_shapes(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens is None,
                             cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
    a, capacity, page, seqlen_new = shapes.args, shapes.capacity, shapes.page, shapes.seqlen_new
    batch, seqlen_q, nheads = q.shape[:3]
    device = q.device
    paged = block_table is not None
    if cache_seqlens is None:
        cache_seqlens = capacity
    # Without an append, an int cache_seqlens (or None: the full cache) is one end position for every batch
    # element: the kernel takes it as a scalar, so no (batch,) tensor is filled on the device for it.
    static_end = None
    if k is None and isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            _fail("cache_seqlens", cache_seqlens, ">= 0")
        if cache_seqlens > capacity:
            _fail("cache_seqlens", cache_seqlens, f"<= the cache capacity {capacity}")
        static_end = cache_seqlens
    else:
        cache_seqlens = _seqlens_tensor("cache_seqlens", cache_seqlens, batch, device)
    _check_device(q)

    # ---- index values (one synchronisation; skipped when disabled / capturing / compiling) ----
    if values_checkable(q):
        if static_end is None:
            end = cache_seqlens.long() + seqlen_new
            if bool((cache_seqlens < 0).any()):
                _fail("cache_seqlens", cache_seqlens.tolist(), "values >= 0")
            if bool((end > capacity).any()):
                _fail("cache_seqlens", cache_seqlens.tolist(), f"cache_seqlens + seqlen_new ({seqlen_new}) <= the "
                      f"cache capacity {capacity}")
        else:   # checked above, on the host
            end = torch.full((batch,), static_end, dtype=torch.long, device=device)
        if cache_leftpad is not None and bool(((cache_leftpad < 0) | (cache_leftpad > cache_seqlens)).any()):
            _fail("cache_leftpad", cache_leftpad.tolist(), "values in [0, cache_seqlens]")
        if cache_batch_idx is not None and bool(((cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0])).any()):
            _fail("cache_batch_idx", cache_batch_idx.tolist(), f"values in [0, {k_cache.shape[0]}) (k_cache.shape[0])")
        if paged:
            check_block_table_values(block_table, end, page, k_cache.shape[0])

    # ---- append (+ rotary) ----
    q_attn = q
    # the signature's token and static_end determine every argument of the launches below but the tensors' data
    # (q_attn, out, lse take their shapes from the checked arguments): repeated calls reuse the launches' templates
    sig = None if shapes.token is None else (shapes.token, static_end)
    with torch.no_grad():
        if k is not None:
            _rotary.append_kv(k, v, k_cache, v_cache, cache_seqlens, cos=rotary_cos, sin=rotary_sin,
                              interleaved=rotary_interleaved, leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                              block_table=block_table, sig=sig)
        if rotary_cos is not None:
            pos0 = cache_seqlens if cache_leftpad is None else cache_seqlens - cache_leftpad
            local = a.window_left >= 0 or a.window_right >= 0   # causal is window_right = 0
            q_attn = _rotary.rotary_q(q, rotary_cos, rotary_sin, pos0.to(torch.int32), per_row=local,
                                      interleaved=rotary_interleaved)
        # the appended tokens count in the decode launch (seqlens_add), not by a kernel adding them to the tensor
        seqlens_k = None if static_end is not None else cache_seqlens

        # ---- split-KV attention over the cache ----
        out = _output_like(q)
        lse = _output((batch, nheads, seqlen_q), device, torch.float32)
        _decode.flash_decode(q_attn, k_cache, v_cache, out, lse, seqlens_k, shapes.params,
                             cache_batch_idx=cache_batch_idx, leftpad=cache_leftpad, block_table=block_table,
                             alibi=alibi_slopes, num_splits=num_splits,
                             max_seqlen_k=capacity if static_end is None else static_end,
                             seqlen_k_static=static_end, seqlens_add=seqlen_new, sig=sig)
    return (out, lse) if return_softmax_lse else out

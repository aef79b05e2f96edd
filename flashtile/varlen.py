"""Variable-length (packed) batches: flash_attn_varlen_func and its packed variants, flash-attn 2.x names.

Sequences are concatenated along the token axis: q (total_q, nheads, headdim), k/v (total_k, nheads_k,
headdim); sequence b owns rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. The dense FA2 kernels read these
bounds themselves (mods.seq_bounds), so these entry points are thin adapters over interface._attention after
checking cu_seqlens. With block_table, K/V live in a paged cache and the call goes to the split-KV decode
kernel (forward only, as in flash-attn).
"""
from __future__ import annotations

import torch

from . import kvcache as _kvcache
from .interface import _attention, _check_device, _check_tensor, _fail, _output, _output_like, validate
from .kernels.triton import decode as _decode
from .kernels.triton.launch import AttnParams


def _check_max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "an int (the longest sequence in the batch)", TypeError)
    if value < 0:
        _fail(name, value, ">= 0")
    return int(value)


def check_cu_seqlens(name: str, cu, device, total=None, batch=None) -> int:
    """Shape/dtype/device checks of a cumulative-lengths tensor (batch + 1,) int32; returns batch.
    total: the number of packed tokens it must end at (None: not checked, e.g. a paged cache)."""
    if not isinstance(cu, torch.Tensor):
        _fail(name, type(cu).__name__, "a torch.Tensor of dtype int32, shape (batch + 1,)", TypeError)
    if cu.dtype != torch.int32:
        _fail(f"{name}.dtype", cu.dtype, "torch.int32", TypeError)
    if cu.dim() != 1:
        _fail(f"{name}.dim()", cu.dim(), f"1: shape (batch + 1,), got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        _fail(f"{name}.shape", tuple(cu.shape), "(batch + 1,) with batch >= 1")
    if batch is not None and cu.numel() != batch + 1:
        _fail(f"{name}.shape", tuple(cu.shape), f"({batch + 1},): batch + 1 with batch = {batch} (from cu_seqlens_q)")
    if cu.device != device:
        _fail(f"{name}.device", cu.device, f"the device of q ({device})")
    return cu.numel() - 1


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total, max_seqlen: int, max_name: str):
    """The values: start at 0, non-decreasing, end at total (if given), no sequence longer than max_seqlen.
    One host-device transfer; skipped where values cannot be read (CUDA graph capture, torch.compile)."""
    if not _kvcache.values_checkable(cu):
        return
    vals = cu.tolist()
    if vals[0] != 0:
        _fail(f"{name}[0]", vals[0], "0")
    lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if min(lens) < 0:
        i = lens.index(min(lens))
        _fail(name, vals if len(vals) <= 16 else f"... [{i}]={vals[i]}, [{i + 1}]={vals[i + 1]} ...",
              f"non-decreasing values (sequence {i} has length {lens[i]})")
    if total is not None and vals[-1] != total:
        _fail(f"{name}[-1]", vals[-1], f"the number of packed tokens {total}")
    if max(lens) > max_seqlen:
        _fail(max_name, max_seqlen, f">= the longest sequence in {name} ({max(lens)})")


def _check_flags(return_attn_probs, deterministic):
    for name, val in (("return_attn_probs", return_attn_probs), ("deterministic", deterministic)):
        if not isinstance(val, bool):
            _fail(name, val, "a bool", TypeError)


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
    _check_tensor("q", q, 3)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch=batch)
    page = _kvcache.check_paged_cache(k, v, block_table, batch, q.device)
    if dropout_p != 0:
        _fail("dropout_p", dropout_p, "0 with block_table (the paged path is inference-only)")
    if return_attn_probs:
        _fail("return_attn_probs", return_attn_probs, "False with block_table (the paged path is inference-only)")
    # (num_blocks, hk, d) views: the rest of the argument model, checked by the one validator
    a = validate(q, k[:, 0], v[:, 0], dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    capacity = block_table.shape[1] * page
    check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, None, max_seqlen_k, "max_seqlen_k")
    seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    if _kvcache.values_checkable(q):
        if bool((seqlens_k > capacity).any()):
            _fail("cu_seqlens_k", cu_seqlens_k.tolist(), f"sequence lengths <= the paged capacity {capacity} "
                  f"(block_table.shape[1] * page_block_size)")
        _kvcache.check_block_table_values(block_table, seqlens_k, page, k.shape[0])
    _check_device(q)
    params = AttnParams(a.softmax_scale, a.window_left, a.window_right, a.softcap)

    def run(q_):
        out = _output_like(q_)
        lse = _output((q_.shape[1], q_.shape[0]), q_.device, torch.float32)
        _decode.flash_decode(q_, k, v, out, lse, seqlens_k, params, cu_seqlens_q=cu_seqlens_q,
                             max_seqlen_q=max_seqlen_q, block_table=block_table, alibi=alibi_slopes,
                             max_seqlen_k=min(max_seqlen_k, capacity))
        return out

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _PagedForwardOnly.apply(q, k, v, run)
    with torch.no_grad():
        return run(q)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Exact attention over a packed batch of variable-length sequences (FA2 forward and backward).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q / cu_seqlens_k:
    (batch + 1,) int32 cumulative lengths starting at 0 and ending at total_q / total_k (zero-length sequences
    allowed); max_seqlen_q / max_seqlen_k: ints >= the longest sequence. Every option of flash_attn_func
    applies per sequence (causal / window bottom-right aligned within each sequence pair; alibi_slopes
    (nheads,) or (batch, nheads)).
    block_table: (batch, max_blocks_per_seq) int32 with k, v a paged cache (num_blocks, page_block_size,
    nheads_k, headdim); sequence b's keys are its first cu_seqlens_k[b+1] - cu_seqlens_k[b] cache positions.
    Forward only (backward raises), no dropout, no return_attn_probs.
    Returns out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q) float32,
    S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k)) if return_attn_probs.
    """
    _check_flags(return_attn_probs, deterministic)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if block_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3)
    batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch=batch)
    check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim); cu_seqlens (batch + 1,) int32. Gradients flow back into qkv."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        _fail("qkv.shape", tuple(getattr(qkv, "shape", ())), "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        _fail("kv.shape", tuple(getattr(kv, "shape", ())), "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)

"""Rotary position embedding (RoPE) inside Triton kernels, and the KV-cache append that uses it.

x of one head is rotated pairwise at position pos with cos/sin tables (seqlen_ro, rotary_dim / 2):
    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos),   frequency k = 0 .. rotary_dim/2 - 1
where the pair is (x[2k], x[2k+1]) (interleaved, GPT-J) or (x[k], x[k + rotary_dim/2]) (half-split, GPT-NeoX).
Dimensions >= rotary_dim pass through. Arithmetic in float32, one rounding to the storage dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import relaunch
from ..runtime import cdiv, next_pow2
from .mods import to_dtype


@triton.jit
def _rotate_heads(SRC, DST, src_rows, dst_rows, h_ok, COS, SIN, pos, stride_cos, stride_sin, head_dim, rotary_half,
                  ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """DST[dst_rows] = rope(SRC[src_rows], pos) for a block of heads (src_rows/dst_rows: (BLOCK_H,) int64
    element offsets of each head's vector)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if ROTARY:
        d_ok = d_ok & (offs_d >= 2 * rotary_half)      # the rotated part is written below
    x = tl.load(SRC + src_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    tl.store(DST + dst_rows[:, None] + offs_d[None, :], x, mask=h_ok[:, None] & d_ok[None, :])
    if ROTARY:
        offs_k = tl.arange(0, BLOCK_R)
        k_ok = offs_k < rotary_half
        if INTERLEAVED:
            i1 = 2 * offs_k
            i2 = i1 + 1
        else:
            i1 = offs_k
            i2 = offs_k + rotary_half
        mask = h_ok[:, None] & k_ok[None, :]
        x1 = to_dtype(tl.load(SRC + src_rows[:, None] + i1[None, :], mask=mask, other=0.0), tl.float32)
        x2 = to_dtype(tl.load(SRC + src_rows[:, None] + i2[None, :], mask=mask, other=0.0), tl.float32)
        pos64 = tl.cast(pos, tl.int64)
        c = to_dtype(tl.load(COS + pos64 * stride_cos + offs_k, mask=k_ok, other=0.0), tl.float32)[None, :]
        s = to_dtype(tl.load(SIN + pos64 * stride_sin + offs_k, mask=k_ok, other=0.0), tl.float32)[None, :]
        o1 = x1 * c - x2 * s
        o2 = x1 * s + x2 * c
        tl.store(DST + dst_rows[:, None] + i1[None, :], to_dtype(o1, DST.dtype.element_ty), mask=mask)
        tl.store(DST + dst_rows[:, None] + i2[None, :], to_dtype(o2, DST.dtype.element_ty), mask=mask)


@triton.jit
def rotary_q_kernel(Q, Q_OUT, COS, SIN, POS0, q_strides, out_strides, table_strides, sizes,
                    PER_ROW: tl.constexpr, INTERLEAVED: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Q_OUT[b, i] = rope(Q[b, i]) at position POS0[b] + i (PER_ROW) or POS0[b] (every row the same).
    q_strides, out_strides: (batch, row, head); table_strides: COS's and SIN's row strides; sizes: (seqlen, nheads,
    head_dim, rotary_half)."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_ob, stride_om, stride_oh = out_strides
    stride_cos, stride_sin = table_strides
    seqlen, nheads, head_dim, rotary_half = sizes
    row = tl.program_id(0)
    b = row // seqlen
    i = row % seqlen
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < nheads
    pos = tl.load(POS0 + b)
    if PER_ROW:
        pos = pos + i
    b64 = tl.cast(b, tl.int64)
    i64 = tl.cast(i, tl.int64)
    src = b64 * stride_qb + i64 * stride_qm + heads.to(tl.int64) * stride_qh
    dst = b64 * stride_ob + i64 * stride_om + heads.to(tl.int64) * stride_oh
    _rotate_heads(Q, Q_OUT, src, dst, h_ok, COS, SIN, pos, stride_cos, stride_sin, head_dim, rotary_half,
                  True, INTERLEAVED, BLOCK_D, BLOCK_R)


@triton.jit
def append_kv_kernel(K_NEW, V_NEW, K_CACHE, V_CACHE, COS, SIN, CACHE_SEQLENS, LEFTPAD, CACHE_BATCH_IDX, BLOCK_TABLE,
                     k_new_strides, v_new_strides, k_cache_strides, v_cache_strides, stride_bt_b, table_strides,
                     sizes, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, PAGED: tl.constexpr,
                     HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """New token i of batch element b goes to cache position p = CACHE_SEQLENS[b] + i (row p of cache row
    CACHE_BATCH_IDX[b], or slot p % page_size of page BLOCK_TABLE[b, p // page_size]); k is rotated at
    position p - LEFTPAD[b] (its index in the unpadded sequence), v is copied. k_new_strides, v_new_strides:
    (batch, row, head); k_cache_strides, v_cache_strides: (cache row or page, position, head); stride_bt_b:
    BLOCK_TABLE's row stride; table_strides: COS's and SIN's row strides; sizes: (seqlen_new, nheads_k, head_dim,
    rotary_half, page_size)."""
    stride_knb, stride_knm, stride_knh = k_new_strides
    stride_vnb, stride_vnm, stride_vnh = v_new_strides
    stride_kcp, stride_kcn, stride_kch = k_cache_strides
    stride_vcp, stride_vcn, stride_vch = v_cache_strides
    stride_cos, stride_sin = table_strides
    seqlen_new, nheads_k, head_dim, rotary_half, page_size = sizes
    row = tl.program_id(0)
    b = row // seqlen_new
    i = row % seqlen_new
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < nheads_k
    h64 = heads.to(tl.int64)
    p = tl.load(CACHE_SEQLENS + b) + i
    rot_pos = p
    if HAS_LEFTPAD:
        rot_pos = p - tl.load(LEFTPAD + b)
    if PAGED:
        page = tl.load(BLOCK_TABLE + tl.cast(b, tl.int64) * stride_bt_b + p // page_size).to(tl.int64)
        slot = tl.cast(p % page_size, tl.int64)
        k_dst = page * stride_kcp + slot * stride_kcn + h64 * stride_kch
        v_dst = page * stride_vcp + slot * stride_vcn + h64 * stride_vch
    else:
        cb = b
        if HAS_BATCH_IDX:
            cb = tl.load(CACHE_BATCH_IDX + b)
        cb64 = tl.cast(cb, tl.int64)
        p64 = tl.cast(p, tl.int64)
        k_dst = cb64 * stride_kcp + p64 * stride_kcn + h64 * stride_kch
        v_dst = cb64 * stride_vcp + p64 * stride_vcn + h64 * stride_vch
    b64 = tl.cast(b, tl.int64)
    i64 = tl.cast(i, tl.int64)
    k_src = b64 * stride_knb + i64 * stride_knm + h64 * stride_knh
    v_src = b64 * stride_vnb + i64 * stride_vnm + h64 * stride_vnh
    _rotate_heads(K_NEW, K_CACHE, k_src, k_dst, h_ok, COS, SIN, rot_pos, stride_cos, stride_sin, head_dim,
                  rotary_half, ROTARY, INTERLEAVED, BLOCK_D, BLOCK_R)
    _rotate_heads(V_NEW, V_CACHE, v_src, v_dst, h_ok, COS, SIN, rot_pos, stride_cos, stride_sin, head_dim,
                  rotary_half, False, INTERLEAVED, BLOCK_D, BLOCK_R)


def _blocks(nheads: int, head_dim: int, rotary_half: int):
    block_d = max(16, next_pow2(head_dim))
    block_h = max(1, min(next_pow2(nheads), 8192 // block_d))
    return block_h, block_d, max(16, next_pow2(max(rotary_half, 1)))


def rotary_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos0: torch.Tensor, per_row: bool,
             interleaved: bool) -> torch.Tensor:
    """A rotated copy of q (batch, seqlen, nheads, d): row i of batch element b at position pos0[b] + i
    (per_row) or pos0[b]. cos/sin (seqlen_ro, rotary_dim / 2); pos0 (batch,) int32."""
    batch, seqlen, nheads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.numel() == 0:
        return out
    rotary_half = cos.shape[1]
    block_h, block_d, block_r = _blocks(nheads, head_dim, rotary_half)
    relaunch.launch(rotary_q_kernel, (batch * seqlen, cdiv(nheads, block_h)), (
        q, out, cos, sin, pos0, q.stride()[:3], out.stride()[:3], (cos.stride(0), sin.stride(0)),
        (seqlen, nheads, head_dim, rotary_half)), dict(
        PER_ROW=per_row, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4))
    return out


# append_kv's launches per caller signature (flash_attn_with_kvcache's): append_kv_kernel's first ten parameters
# are the tensors, the rest strides, sizes and constexprs the signature fixes
_APPEND_BOUNDS = relaunch.Bounds()


def append_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              cache_seqlens: torch.Tensor, *, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
              interleaved: bool = True, leftpad: Optional[torch.Tensor] = None,
              cache_batch_idx: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
              sig=None) -> None:
    """Write k, v (batch, seqlen_new, nheads_k, d) into the caches in place at positions cache_seqlens[b] + i,
    rotating k when cos/sin are given (position cache_seqlens[b] - leftpad[b] + i). sig: None, or a hashable that
    determines everything of the call but the tensors' data (decode.flash_decode's contract): a repeated one
    launches through relaunch.Bounds."""
    batch, seqlen_new, nheads_k, head_dim = k.shape
    if k.numel() == 0:
        return
    rotary = cos is not None
    rotary_half = cos.shape[1] if rotary else 0
    paged = block_table is not None
    block_h, block_d, block_r = _blocks(nheads_k, head_dim, rotary_half)
    dummy = cache_seqlens
    grid = (batch * seqlen_new, cdiv(nheads_k, block_h), 1)
    live = (k, v, k_cache, v_cache, cos if rotary else k, sin if rotary else k, cache_seqlens,
            leftpad if leftpad is not None else dummy, cache_batch_idx if cache_batch_idx is not None else dummy,
            block_table if paged else dummy)
    if sig is not None and _APPEND_BOUNDS.launch(sig, grid, live):
        return
    args = (
        *live, k.stride()[:3], v.stride()[:3], k_cache.stride()[:3], v_cache.stride()[:3],
        block_table.stride(0) if paged else 0, (cos.stride(0) if rotary else 0, sin.stride(0) if rotary else 0),
        (seqlen_new, nheads_k, head_dim, rotary_half, k_cache.shape[1] if paged else 1))
    kwargs = dict(ROTARY=rotary, INTERLEAVED=interleaved, PAGED=paged, HAS_BATCH_IDX=cache_batch_idx is not None,
                  HAS_LEFTPAD=leftpad is not None, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4)
    launched = relaunch.launch(append_kv_kernel, grid[:2], args, kwargs)
    if sig is not None:
        _APPEND_BOUNDS.bind(sig, append_kv_kernel, args, kwargs, len(live), launched)

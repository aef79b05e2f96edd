"""Block-sparse attention (FA1 Algorithm 5) at the kernels' tile granularity, with a FlexAttention-style mask.

    from flashtile.blocksparse import create_block_mask, blocksparse_attn_func
    def document(b, h, q_idx, kv_idx):
        return doc_id[q_idx] == doc_id[kv_idx]
    bm = create_block_mask(document, None, None, seqlen, seqlen, BLOCK_SIZE=128, device="cuda")
    out = blocksparse_attn_func(q, k, v, bm)

`create_block_mask` evaluates mask_fn once on the whole (B, H, Q_LEN, KV_LEN) index grid and classifies every
(query block, key block) tile of BLOCK_SIZE x BLOCK_SIZE as empty (no visible pair), full (every pair visible)
or partial. The kernels visit only the listed tiles: empty tiles are never loaded (runtime ~ density), full
tiles skip per-element masking, partial tiles apply the element mask, which the BlockMask keeps as a bool
tensor of mask_fn's broadcast shape (so a mask that depends on neither b nor h costs Q_LEN * KV_LEN bytes).
mask_fn may instead be a flashtile.flex.MaskMod (a Triton device function): a kernel then classifies the
tiles and the attention kernels evaluate the mask_mod on partial tiles, so no Q_LEN x KV_LEN tensor exists.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .api.errors import fail
from .interface import dense_attention
from .masks import BlockMask, MaskMod, mask_mod_counts


def _lists(sel: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """sel (B, H, n_rows, n_cols) bool -> (num (B, H, n_rows) int32, idx (B, H, n_rows, n_cols) int32): per
    row, how many columns are selected and their indices in ascending order (the rest of idx is padding)."""
    num = sel.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def create_block_mask(mask_fn: Callable, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      BLOCK_SIZE: int = 128, device="cuda") -> BlockMask:
    """Evaluate mask_fn(b, h, q_idx, kv_idx) -> bool tensor (vectorised: called once with broadcastable int64
    index tensors of shapes (B,1,1,1), (1,H,1,1), (1,1,Q_LEN,1), (1,1,1,KV_LEN)) and classify its
    BLOCK_SIZE x BLOCK_SIZE tiles. B / H None (or 1): one mask for every batch element / head.
    mask_fn may be a flashtile.flex.MaskMod instead: evaluated tile by tile in a Triton kernel, never stored.
    BLOCK_SIZE: a power of two >= 16 (the kernels' tiles must divide it)."""
    B = 1 if B is None else B
    H = 1 if H is None else H
    for name, val in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(val, int) or val < 1:
            fail(name, val, "a positive int")
    if not isinstance(BLOCK_SIZE, int) or BLOCK_SIZE < 16 or BLOCK_SIZE & (BLOCK_SIZE - 1):
        fail("BLOCK_SIZE", BLOCK_SIZE, "a power of two >= 16")
    if isinstance(mask_fn, MaskMod):
        if mask_fn.check is not None:
            mask_fn.check(B, H, Q_LEN, KV_LEN)
        count, _ = mask_mod_counts(mask_fn, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, device, False)
        return _classify(count, (B, H, Q_LEN, KV_LEN), BLOCK_SIZE, None, mask_fn)
    if not callable(mask_fn):
        fail("mask_fn", type(mask_fn).__name__, "a callable (b, h, q_idx, kv_idx) -> bool tensor or a MaskMod")
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    mask = mask_fn(ar(B).view(B, 1, 1, 1), ar(H).view(1, H, 1, 1), ar(Q_LEN).view(1, 1, Q_LEN, 1),
                   ar(KV_LEN).view(1, 1, 1, KV_LEN))
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        fail("mask_fn(...)", type(mask).__name__ if not isinstance(mask, torch.Tensor) else mask.dtype,
              "a bool tensor")
    mask = mask[(None,) * max(0, 4 - mask.dim())]
    if mask.dim() != 4 or any(n not in (1, m) for n, m in zip(mask.shape, (B, H, Q_LEN, KV_LEN))):
        fail("mask_fn(...).shape", tuple(mask.shape), f"broadcastable to {(B, H, Q_LEN, KV_LEN)}")
    # keep batch / head dimensions mask_fn ignored at size 1; sequence dimensions at full size
    mask = mask.expand(mask.shape[0], mask.shape[1], Q_LEN, KV_LEN).contiguous()
    bs = BLOCK_SIZE
    nq, nk = -(-Q_LEN // bs), -(-KV_LEN // bs)
    padded = torch.zeros(*mask.shape[:2], nq * bs, nk * bs, dtype=torch.bool, device=mask.device)
    padded[:, :, :Q_LEN, :KV_LEN] = mask
    count = padded.view(*mask.shape[:2], nq, bs, nk, bs).sum((3, 5))
    return _classify(count, (B, H, Q_LEN, KV_LEN), bs, mask, None)


def _classify(count: torch.Tensor, shape, bs: int, mask, mask_mod) -> BlockMask:
    """count (B', H', n_q_blocks, n_kv_blocks): visible pairs per tile -> the BlockMask's tile lists."""
    _, _, Q_LEN, KV_LEN = shape
    nq, nk = count.shape[-2:]
    rows = torch.clamp(Q_LEN - torch.arange(nq, device=count.device) * bs, max=bs)
    cols = torch.clamp(KV_LEN - torch.arange(nk, device=count.device) * bs, max=bs)
    real = rows[:, None] * cols[None, :]           # pairs of each tile inside the sequences
    full = count == real
    partial = (count > 0) & ~full
    kv_num, kv_idx = _lists(partial)
    full_kv_num, full_kv_idx = _lists(full)
    q_num, q_idx = _lists(partial.transpose(-1, -2))
    full_q_num, full_q_idx = _lists(full.transpose(-1, -2))
    return BlockMask(shape, bs, mask, kv_num, kv_idx, full_kv_num, full_kv_idx,
                     q_num, q_idx, full_q_num, full_q_idx, mask_mod)


def blocksparse_attn_func(q, k, v, block_mask: BlockMask, dropout_p=0.0, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                          return_attn_probs=False, attn_bias=None):
    """flash_attn_func restricted to block_mask: query i may see key j iff block_mask.to_dense()[b, h, i, j]
    (and causal / window allow it). Tiles the block mask marks empty are skipped, so the work is proportional
    to its density. Arguments and returns as flashtile.flash_attn_func (q (batch, seqlen_q, nheads, headdim)
    etc.); attn_bias as there (gradients included). The kernels' tiles are shrunk to divide BLOCK_SIZE."""
    if not isinstance(block_mask, BlockMask):
        fail("block_mask", type(block_mask).__name__, "a flashtile.blocksparse.BlockMask (create_block_mask)")
    out, lse, probs = dense_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, return_attn_probs, attn_bias=attn_bias, block_mask=block_mask)
    return out if probs is None else (out, lse, probs)

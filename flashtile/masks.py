"""The types of a user's mask and scores: MaskMod and ScoreMod (Triton device functions and what they capture, which
flashtile.flex compiles into the kernels) and BlockMask (an attention mask classified into empty, partial and full
tiles, which flashtile.blocksparse.create_block_mask builds). A leaf under the entry points: flex.py and
blocksparse.py import these types and re-export them, nothing here imports them back.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton

from .api.checks import check_device
from .api.errors import fail
from .api.usermods import aux
from .kernels.params import SparseLists


try:  # @triton.jit gives an InterpretedFunction under TRITON_INTERPRET=1
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted
except ImportError:  # pragma: no cover
    _Interpreted = triton.runtime.jit.JITFunction


def _is_jit(fn) -> bool:
    return isinstance(fn, (triton.runtime.jit.JITFunction, _Interpreted))


def _check_fn(name: str, fn, optional: bool = False):
    if fn is None and optional:
        return
    if not _is_jit(fn):
        fail(name, type(fn).__name__, "a @triton.jit function")


def _check_captured(name: str, captured) -> tuple:
    if not isinstance(captured, (tuple, list)):
        fail(name, type(captured).__name__, "a tuple of tensors, ints and floats")
    for i, c in enumerate(captured):
        if isinstance(c, bool) or not isinstance(c, (torch.Tensor, int, float)):
            fail(f"{name}[{i}]", type(c).__name__, "a torch.Tensor, int or float")
    return tuple(captured)


def _check_hook(name: str, check):
    if check is not None and not callable(check):
        fail(name, type(check).__name__, "None or a callable (batch, nheads, seqlen_q, seqlen_k)")
    return check


class MaskMod:
    """mask_mod(b, h, q_idx, kv_idx, aux) -> bool tile, a @triton.jit function; captured: its aux tuple.
    check: optional callable(batch, nheads, seqlen_q, seqlen_k) run before any kernel, raising if the captured
    values do not fit the problem (the kernels index them by b, h and positions without bounds)."""

    def __init__(self, fn, captured: Sequence = (), check=None):
        _check_fn("MaskMod.fn", fn)
        self.fn = fn
        self.captured = _check_captured("MaskMod.captured", captured)
        self.check = _check_hook("MaskMod.check", check)

    def __repr__(self):
        return f"MaskMod({self.fn.__name__}, {len(self.captured)} captured)"


class ScoreMod:
    """score_mod(score, b, h, q_idx, kv_idx, aux) -> score tile, a @triton.jit function; grad_fn (None: the
    mod is score + something, derivative 1) and captured_grad_fn as in flashtile.flex's module docstring."""

    def __init__(self, fn, grad_fn=None, captured_grad_fn=None, captured: Sequence = (), check=None):
        _check_fn("ScoreMod.fn", fn)
        _check_fn("ScoreMod.grad_fn", grad_fn, optional=True)
        _check_fn("ScoreMod.captured_grad_fn", captured_grad_fn, optional=True)
        self.fn, self.grad_fn, self.captured_grad_fn = fn, grad_fn, captured_grad_fn
        self.captured = _check_captured("ScoreMod.captured", captured)
        self.check = _check_hook("ScoreMod.check", check)

    def __repr__(self):
        return f"ScoreMod({self.fn.__name__}, {len(self.captured)} captured)"


class BlockMask:
    """Tile classification of an attention mask (build it with create_block_mask).

    shape: (B, H, Q_LEN, KV_LEN) it was made for (B / H of 1 broadcast over any batch / heads).
    mask: bool, mask_fn's broadcast shape as 4-D (each dimension 1 or the full size), True = may attend.
    kv_num_blocks / full_kv_num_blocks (B', H', n_q_blocks) and kv_indices / full_kv_indices
    (B', H', n_q_blocks, n_kv_blocks), int32: per query block, its partial / full key blocks;
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the transpose, per key block (the backward's
    key-block programs). B', H' are the mask's own batch/head sizes (1 where mask_fn ignores b / h).
    """

    def __init__(self, shape, block_size, mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                 q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, mask_mod=None):
        self.shape = tuple(shape)
        self.BLOCK_SIZE = block_size
        self.mask = mask                  # None when built from a MaskMod
        self.mask_mod = mask_mod
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices

    def density(self) -> float:
        """Fraction of tiles the kernels visit (partial or full)."""
        visited = self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum()
        total = self.kv_num_blocks.numel() * self.kv_indices.shape[-1]
        return float(visited) / max(total, 1)

    def to_dense(self) -> torch.Tensor:
        """The element mask, (B, H, Q_LEN, KV_LEN) bool (an expand view: nothing copied; a MaskMod is
        evaluated into a new tensor)."""
        if self.mask is None:
            B, H, Q, KV = self.shape
            _, dense = mask_mod_counts(self.mask_mod, B, H, Q, KV, self.BLOCK_SIZE, self.kv_num_blocks.device, True)
            return dense
        return self.mask.expand(*self.shape)

    def __repr__(self):
        return f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, density={self.density():.3f})"

    def kernel_args(self, q: torch.Tensor, k: torch.Tensor):
        """(element mask or None, the tile lists as params.SparseLists) for the kernels, after checking that this
        block mask fits q (batch, seqlen_q, nheads, d) and k (batch, seqlen_k, nheads_k, d)."""
        B, H, Q, KV = self.shape
        if (Q, KV) != (q.shape[1], k.shape[1]):
            fail("block_mask.shape[2:] (Q_LEN, KV_LEN)", (Q, KV),
                  f"(seqlen_q, seqlen_k) = {(q.shape[1], k.shape[1])}")
        if B not in (1, q.shape[0]):
            fail("block_mask.shape[0] (B)", B, f"1 or the batch size {q.shape[0]}")
        if H not in (1, q.shape[2]):
            fail("block_mask.shape[1] (H)", H, f"1 or nheads = {q.shape[2]}")
        if self.kv_num_blocks.device != q.device:
            fail("block_mask device", self.kv_num_blocks.device, f"the device of q ({q.device})")
        lists = (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                 self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices)
        return self.mask, SparseLists(self.BLOCK_SIZE, *lists)


def mask_mod_counts(mask_mod, B, H, Q_LEN, KV_LEN, bs, device, dense: bool):
    """(visible pairs per tile (B, H, n_q_blocks, n_kv_blocks) int32, the dense bool mask or None) of a MaskMod,
    evaluated by kernels.triton.blockmask.classify_tiles_kernel."""
    from .kernels.triton.blockmask import classify_tiles_kernel
    probe = torch.empty(0, device=device)
    device = probe.device                        # "cuda" -> "cuda:0", as tensors report it
    for i, c in enumerate(mask_mod.captured):
        if isinstance(c, torch.Tensor) and c.device != device:
            fail(f"mask_fn.captured[{i}].device", c.device, f"the device argument ({device})")
    check_device(probe)
    nq, nk = -(-Q_LEN // bs), -(-KV_LEN // bs)
    count = torch.full((B, H, nq, nk), -1, dtype=torch.int32, device=device)   # poisoned: every tile is written
    out = torch.empty((B, H, Q_LEN, KV_LEN) if dense else (0, 0, 0, 0), dtype=torch.bool, device=device)
    mask_aux, _ = aux(mask_mod, [c for c in mask_mod.captured if isinstance(c, torch.Tensor)], 0)
    sub = min(bs, 32)
    classify_tiles_kernel[(nq, nk, B * H)](
        count, out.view(torch.int8), mask_aux, Q_LEN, KV_LEN, H, *count.stride()[:3], *out.stride()[:3],
        MASK_MOD=mask_mod.fn, BLOCK=bs, SUB=sub, WRITE_DENSE=dense, num_warps=4)
    return count, (out if dense else None)

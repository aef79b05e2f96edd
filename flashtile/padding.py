"""Padding helpers between (batch, seqlen, ...) tensors with an attention mask and the packed varlen layout,
with flash-attn's bert_padding semantics. All autograd-friendly (gradients are gathered / scattered back).

    hidden_unpad, indices, cu_seqlens, max_seqlen, used_seqlens = unpad_input(hidden, attention_mask)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out_unpad, indices, batch, seqlen)
"""
from __future__ import annotations

import torch

from .api import checks
from .api.errors import fail


class _IndexFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices]

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        grad_input = grad_output.new_zeros((ctx.first_axis_dim, *grad_output.shape[1:]))
        grad_input.index_copy_(0, indices, grad_output)   # indices are distinct: a scatter, not an add
        return grad_input, None


class _IndexPutFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        output = values.new_zeros((first_axis_dim, *values.shape[1:]))
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


def _check_indices(indices, device):
    if not isinstance(indices, torch.Tensor):
        fail("indices", type(indices).__name__, "a torch.Tensor of int64 token indices")
    if indices.dtype not in (torch.int64, torch.int32) or indices.dim() != 1:
        fail("indices", f"{indices.dtype} tensor of shape {tuple(indices.shape)}", "a 1-D int64/int32 tensor")
    if indices.device != device:
        fail("indices.device", indices.device, f"the device of the data ({device})")


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices] along the first axis; the gradient is scattered back into zeros. input: (N, ...)."""
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        fail("input", type(input).__name__, "a tensor with at least 1 dimension")
    _check_indices(indices, input.device)
    return _IndexFirstAxis.apply(input, indices.long())


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor (first_axis_dim, ...) with values placed at rows indices (the inverse of index_first_axis)."""
    _check_indices(indices, values.device)
    if values.shape[0] != indices.shape[0]:
        fail("values.shape[0]", values.shape[0], f"len(indices) = {indices.shape[0]}")
    return _IndexPutFirstAxis.apply(values, indices.long(), int(first_axis_dim))


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int, 1 = real token.

    unused_mask (optional, same shape): tokens kept in the packed layout but not counted in used_seqlens
    (flash-attn's convention for tokens that are allocated but not attended).
    Returns (hidden_unpad (total, ...), indices (total,) int64 into the flattened (batch * seqlen) axis,
    cu_seqlens (batch + 1,) int32, max_seqlen_in_batch int, used_seqlens_in_batch (batch,) int32).
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        fail("hidden_states", getattr(hidden_states, "shape", type(hidden_states).__name__),
              "a tensor (batch, seqlen, ...)")
    for name, m in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if m is None and name == "unused_mask":
            continue
        if not isinstance(m, torch.Tensor):
            fail(name, type(m).__name__, "a torch.Tensor (batch, seqlen)")
        if tuple(m.shape) != tuple(hidden_states.shape[:2]):
            fail(f"{name}.shape", tuple(m.shape), f"(batch, seqlen) = {tuple(hidden_states.shape[:2])}")
        if m.device != hidden_states.device:
            fail(f"{name}.device", m.device, f"the device of hidden_states ({hidden_states.device})")
        if m.dtype.is_floating_point or m.dtype.is_complex:
            fail(f"{name}.dtype", m.dtype, "bool or an integer dtype (1 = token)")
    all_masks = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    indices, cu_seqlens, max_seqlen_in_batch = packed_rows(all_masks)
    used_seqlens_in_batch = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def packed_rows(mask: torch.Tensor):
    """The packed layout of a bool padding mask (batch, seqlen), True = token: (indices (total,) int64 of its tokens
    in the flattened (batch * seqlen) axis, cu_seqlens (batch + 1,) int32, the longest sequence as an int). Reads
    the mask (a host synchronisation): a caller that unpads several tensors by one mask computes this once."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """hidden_states (total, ...) packed -> (batch, seqlen, ...) with zeros at padding positions."""
    batch, seqlen = checks.integer("batch", batch, 0), checks.integer("seqlen", seqlen, 0)
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *hidden_states.shape[1:])

"""FlashAttention-4 (package flash-attn-4, module flash_attn.cute) as bench_flex's "fa4" provider.

bench_flex's rows in FA4's FlexAttention interface (flash_attn.cute.flash_attn_func):
  document   mask_mod: same document (document ids as an aux tensor) and kv_idx <= q_idx
  prefix-lm  mask_mod: kv_idx <= q_idx or kv_idx < prefix[b] (prefix lengths as an aux tensor)
  sliding    mask_mod: kv_idx <= q_idx and (q_idx - kv_idx < window or kv_idx < sinks) (window, sinks compiled in)
  alibi      causal=True with a score_mod: score - slopes[h] * |q_idx - kv_idx| (slopes as an aux tensor); its
             score_mod_bwd passes the gradient through (the bias is additive)
The mask rows pass torch's BlockMask of the same mask as FA4's block-sparse tensors (block_sparse_tensors: each query
block's partial and full key blocks; block_sparse_tensors_bwd: each key block's query blocks), so FA4 skips empty
tiles and masks only partial ones, as torch.flex and flashtile do; the ALiBi row uses FA4's own causal tile skipping.

What FA4 4.0.0b36 runs on SM90, from its source (flash_attn/cute/):
  forward   mask_mod, score_mod and block sparsity: interface.py _flash_attn_fwd builds FlashAttentionForwardSm90 with
            mask_mod, score_mod and the block-sparse tensors (normalize_block_sparse_config: on SM90 the key block
            must equal the kernel's tile_n, 128 at head dim 128, and the query block be a multiple of its tile_m)
  backward  the same three: _flash_attn_bwd builds FlashAttentionBackwardSm90 with score_mod, score_mod_bwd (required
            with a score_mod), mask_mod and q_subtile_factor (a 128-row sparse query block over 64-row tiles), and
            flash_bwd_sm90.py iterates the key block's query blocks (consume_block_sparse_mma_bwd_sm90)
The BlockMask tiles here are 128 x 128, which is what both SM90 passes take; other GPUs are reported unsupported (on
SM100 the forward wants 256-row query blocks).

CuTe DSL conventions: a mask_mod is called (batch, head, q_idx, kv_idx, seqlen_info, aux_tensors) with TensorSSA
arguments of one element on SM90 and returns a boolean TensorSSA; a score_mod is called (score, b_idx, h_idx,
q_idx=, kv_idx=, seqlen_info=, aux_tensors=) on float32 scores already multiplied by the softmax scale (torch
FlexAttention's unit), a score_mod_bwd (grad, score, b_idx, h_idx, q_idx=, ...) returns d(score_mod)/d(score) * grad.
FA4 caches compiled kernels by the functions' source and captured values, not by the sequence length.

Nothing here needs FA4 to import: without it (or without CUDA) unavailable() says why and bench_flex skips "fa4".
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

try:  # FA4 and the CuTe DSL: absent on most machines, and they need CUDA
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import math as mlir_math
    from flash_attn.cute import utils as fa4_utils
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import flash_attn_func
    IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - a broken install is as unusable as an absent one
    IMPORT_ERROR = f"import flash_attn.cute failed: {type(e).__name__}: {e}"

ROWS = ("document", "prefix-lm", "sliding", "alibi")   # the bench_flex rows FA4 runs
BLOCK_SIZE = (128, 128)                              # the block-sparse tile both SM90 passes take


class Unsupported(Exception):
    """FA4 cannot run this row here; the message says why."""


def unavailable(device) -> Optional[str]:
    """Why the fa4 provider cannot run on this device (None when it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "FA4 (CuTe DSL) runs on CUDA GPUs only"
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"this provider passes 128 x 128 block-sparse tiles, the SM90 (Hopper) kernels' size; the GPU is "
                f"sm_{major}{minor}")
    return None


def block_sparse_lists(block_mask) -> tuple[dict, dict]:
    """(forward, backward) BlockSparseTensorsTorch fields of a torch BlockMask: per query block its partial ("mask")
    and full key blocks, and per key block its partial and full query blocks (the backward's order)."""
    size = tuple(block_mask.BLOCK_SIZE)
    fwd = dict(mask_block_cnt=block_mask.kv_num_blocks, mask_block_idx=block_mask.kv_indices,
               full_block_cnt=block_mask.full_kv_num_blocks, full_block_idx=block_mask.full_kv_indices,
               block_size=size)
    bwd = dict(mask_block_cnt=block_mask.q_num_blocks, mask_block_idx=block_mask.q_indices,
               full_block_cnt=block_mask.full_q_num_blocks, full_block_idx=block_mask.full_q_indices,
               block_size=size)
    return fwd, bwd


def attention(row: str, mask: dict, q, k, v, block_mask) -> Callable[[], torch.Tensor]:
    """fn() -> out (batch, seqlen, heads, d): FA4 on q, k, v (bench_flex's layout) for bench_flex's row `row`.

    mask: the row's entry of bench_flex.make_masks (its tensors and parameters); block_mask: torch's BlockMask of
    the row's mask (BLOCK_SIZE 128), unused by the ALiBi row. return_lse=True in every call, so that the forward
    under no_grad and the training forward are one compiled kernel. Raises Unsupported for a row FA4 cannot run."""
    if IMPORT_ERROR is not None:
        raise Unsupported(IMPORT_ERROR)
    if row == "alibi":
        kwargs = dict(causal=True, score_mod=_alibi, score_mod_bwd=_additive_bwd, aux_tensors=[mask["slopes"]])
    elif row in ROWS:
        if block_mask is None:
            raise Unsupported("needs torch's BlockMask of the mask for its block-sparse tensors")
        if tuple(block_mask.BLOCK_SIZE) != BLOCK_SIZE:
            raise Unsupported(f"block-sparse tiles of {tuple(block_mask.BLOCK_SIZE)}; SM90 takes {BLOCK_SIZE}")
        fwd, bwd = block_sparse_lists(block_mask)
        mask_mod, aux = _mask_mod(row, mask)
        kwargs = dict(mask_mod=mask_mod, aux_tensors=aux, block_sparse_tensors=BlockSparseTensorsTorch(**fwd),
                      block_sparse_tensors_bwd=BlockSparseTensorsTorch(**bwd))
    else:
        raise Unsupported(f"no FA4 form of the {row!r} row here")
    return lambda: flash_attn_func(q, k, v, return_lse=True, **kwargs)[0]


def _mask_mod(row: str, mask: dict):
    """(mask_mod, aux_tensors or None) of a mask row."""
    if row == "document":
        return _document, [mask["doc_ids"]]
    if row == "prefix-lm":
        return _prefix_lm, [mask["prefix_lengths"]]
    return _sliding_sinks(mask["window"], mask["sinks"]), None


if IMPORT_ERROR is None:
    @cute.jit
    def _document(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        doc = aux_tensors[0]                     # int32 (seqlen,), shared by the batch
        q_doc = fa4_utils.scalar_to_ssa(doc[q_idx[0]], cutlass.Int32)
        kv_doc = fa4_utils.scalar_to_ssa(doc[kv_idx[0]], cutlass.Int32)
        return (q_doc == kv_doc) & (kv_idx <= q_idx)

    @cute.jit
    def _prefix_lm(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        prefix = fa4_utils.scalar_to_ssa(aux_tensors[0][batch[0]], cutlass.Int32)   # int32 (batch,)
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    def _sliding_sinks(window: int, sinks: int):
        """The sliding-window-plus-sinks mask_mod with window and sinks compiled in (FA4 keys its cache on them)."""
        @cute.jit
        def sliding_sinks(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            w = fa4_utils.scalar_to_ssa(window, cutlass.Int32)
            s = fa4_utils.scalar_to_ssa(sinks, cutlass.Int32)
            return (kv_idx <= q_idx) & ((q_idx - kv_idx < w) | (kv_idx < s))
        return sliding_sinks

    @cute.jit
    def _alibi(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slopes = aux_tensors[0]                  # float32 (heads,)
        h = cute.make_rmem_tensor(1, cutlass.Int32)
        h.store(h_idx)
        slope = cute.make_rmem_tensor(1, slopes.element_type)
        slope[0] = slopes[h[0]]
        diff = q_idx - kv_idx
        dist = cute.TensorSSA(mlir_math.absi(diff), diff.shape, diff.dtype).to(cutlass.Float32)
        return score - slope.load().to(cutlass.Float32) * dist

    @cute.jit
    def _additive_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

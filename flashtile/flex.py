"""User-written masks and score modifiers compiled into the attention kernels (FlexAttention's idea, in Triton).

    import triton, triton.language as tl
    from flashtile.flex import MaskMod, ScoreMod, flex_attention, document_mask
    from flashtile.blocksparse import create_block_mask

    @triton.jit
    def local_bias(score, b, h, q_idx, kv_idx, aux):          # aux: the `captured` tuple
        return score - aux[0] * (q_idx - kv_idx).to(tl.float32)

    out = flex_attention(q, k, v, score_mod=ScoreMod(local_bias, captured=(0.1,)), mask_mod=causal_mask())
    bm = create_block_mask(document_mask(doc_ids), None, None, S, S, device="cuda")   # tiles classified on GPU
    out = flex_attention(q, k, v, block_mask=bm)               # empty tiles skipped, partial tiles masked

Functions are Triton device functions (`@triton.jit`), called on whole score tiles:
- mask_mod(b, h, q_idx, kv_idx, aux) -> bool tile (True = may attend);
- score_mod(score, b, h, q_idx, kv_idx, aux) -> score tile; score is float32 in natural-log units
  (q.k * softmax_scale), the unit FlexAttention uses.
b, h are scalars; q_idx, kv_idx int32 index tiles that broadcast against each other (the kernels hand over
(rows, 1) and (1, cols) tiles, or their transposes in the backward); positions count from the top-left
corner of each (batch, head) score matrix. aux is the tuple `captured`: tensors arrive as pointers (index them
yourself: make them contiguous or capture their strides too), ints and floats as scalars.

Gradients. Triton has no automatic differentiation, so a ScoreMod that is not additive in score says how
its derivative goes: grad_fn(dscore, score, b, h, q_idx, kv_idx, aux) -> dscore * d(out)/d(score). A captured
tensor that requires grad needs captured_grad_fn(dscore, score, b, h, q_idx, kv_idx, aux, aux_grad), which
adds d(loss)/d(tensor) into aux_grad[i] (a float32 zero buffer with the tensor's shape and strides) with
tl.atomic_add; dscore there is the gradient of score_mod's output. Every ready-made below comes with both.
Evaluation order inside the kernels: q.k * scale -> softcap -> score_mod -> mask_mod, block mask, causal,
window (-inf) -> softmax. A row that sees no key outputs 0 and lse = -inf.

softcap_score, and alibi_score with slopes that want no gradient over equal lengths, run as the kernels' own softcap
and ALiBi (the same scores, without a score_mod call per element). On Hopper (head dim 128) the mods are compiled
into FlashAttention-3's Gluon kernels, whose tiles carry an explicit register layout: mods written element-wise on
their arguments (loads, tl.where, arithmetic, atomics) run there; a mod that builds a tile of its own (tl.zeros,
tl.arange) does not compile for them, and the Triton kernels run it instead.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .api import checks
from .api.errors import fail
from .interface import dense_attention
from .masks import BlockMask, MaskMod, ScoreMod  # noqa: F401  (public here: flashtile.flex.MaskMod, ...)


def _validate_mods(q, k, score_mod, mask_mod):
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        fail("score_mod", type(score_mod).__name__, "a flashtile.flex.ScoreMod or None")
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        fail("mask_mod", type(mask_mod).__name__, "a flashtile.flex.MaskMod or None")
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        for i, c in enumerate(() if mod is None else mod.captured):
            if isinstance(c, torch.Tensor) and c.device != q.device:
                fail(f"{name}.captured[{i}].device", c.device, f"the device of q ({q.device})")
    for mod in (score_mod, mask_mod):
        if mod is not None and mod.check is not None:
            mod.check(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if score_mod is not None and score_mod.captured_grad_fn is None:
        for i, c in enumerate(score_mod.captured):
            if isinstance(c, torch.Tensor) and c.requires_grad and torch.is_grad_enabled():
                fail(f"score_mod.captured[{i}].requires_grad", True,
                      "False, or a ScoreMod with captured_grad_fn (Triton cannot differentiate score_mod by itself)")


def flex_attention(q, k, v, score_mod: Optional[ScoreMod] = None, block_mask=None, mask_mod: Optional[MaskMod] = None,
                   *, softmax_scale=None, causal=False, window_size=(-1, -1), return_lse=False):
    """Attention with a user score_mod and mask (mask_mod and/or a block mask), forward and backward.

    q: (batch, seqlen_q, nheads, headdim), k/v: (batch, seqlen_k, nheads_k, headdim) (flashtile's layout);
    float16 / bfloat16 / float32. block_mask: flashtile.blocksparse.create_block_mask(...): empty tiles are
    skipped, full tiles skip per-element masking, partial tiles apply its mask (the block mask's own
    mask_mod when it was built from a MaskMod). mask_mod: applied to every visited tile (with a block mask made
    from another mask, both apply). causal / window_size as in flash_attn_func (bottom-right aligned).
    Gradients reach q, k, v and the score_mod's captured tensors. Returns out, or (out, lse (batch, nheads,
    seqlen_q) float32, differentiable) with return_lse."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            fail(f"{name}.shape", tuple(getattr(t, "shape", ())), "(batch, seqlen, nheads, headdim)")
    _validate_mods(q, k, score_mod, mask_mod)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        fail("block_mask", type(block_mask).__name__, "a flashtile.blocksparse.BlockMask or None")
    if block_mask is not None and block_mask.mask_mod is not None:
        if mask_mod is not None and mask_mod is not block_mask.mask_mod:
            fail("mask_mod", mask_mod, "None (or the block mask's own mask_mod) with a block mask built from a MaskMod")
        mask_mod = block_mask.mask_mod
    builtin = _builtin_scores(score_mod, q, k)
    out, lse, _ = dense_attention(q, k, v, 0.0, softmax_scale, causal, window_size, block_mask=block_mask,
                                  score_mod=None if builtin else score_mod, mask_mod=mask_mod, **builtin)
    return (out, lse) if checks.flag("return_lse", return_lse) else out


def _builtin_scores(score_mod: Optional[ScoreMod], q, k) -> dict:
    """The kernels' own softcap / ALiBi arguments where a ready-made score_mod computes the same scores (they cost no
    score_mod call, input or gradient per element): softcap_score, and alibi_score when seqlen_q == seqlen_k (its
    |q_idx - kv_idx| is then the kernels' bottom-right distance) and its slopes want no gradient (the kernels'
    ALiBi has none). Empty where the score_mod runs as it is."""
    if score_mod is None:
        return {}
    if score_mod.fn is _softcap:
        return dict(softcap=score_mod.captured[0])
    slopes = score_mod.captured[0] if score_mod.fn is _alibi else None
    if slopes is not None and q.shape[1] == k.shape[1] and not (slopes.requires_grad and torch.is_grad_enabled()):
        return dict(alibi_slopes=slopes)
    return {}


# --------------------------------------------------------------------------------------------------
# Ready-made mods
# --------------------------------------------------------------------------------------------------
@triton.jit
def _causal(b, h, q_idx, kv_idx, aux):
    return kv_idx <= q_idx


def causal_mask() -> MaskMod:
    """kv_idx <= q_idx (top-left aligned, as FlexAttention; flash_attn_func's causal aligns bottom-right)."""
    return MaskMod(_causal)


@triton.jit
def _document(b, h, q_idx, kv_idx, aux):
    ids = aux[0] + b * aux[1]           # document ids of batch element b
    n = aux[2]
    doc_q = tl.load(ids + q_idx, mask=q_idx < n, other=-1)
    doc_k = tl.load(ids + kv_idx, mask=kv_idx < n, other=-2)
    return (doc_q == doc_k) & ((kv_idx <= q_idx) | (aux[3] == 0))


def document_mask(document_ids: torch.Tensor, causal: bool = True) -> MaskMod:
    """Packed sequences: query and key must belong to the same document (and kv_idx <= q_idx if causal).
    document_ids: int32, (seqlen,) shared by the batch or (batch, seqlen), one id per token (self-attention:
    seqlen_q = seqlen_k = seqlen)."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.dtype != torch.int32 or document_ids.dim() not in (1, 2):
        fail("document_ids", getattr(document_ids, "dtype", type(document_ids).__name__),
              "an int32 tensor of shape (seqlen,) or (batch, seqlen)")
    ids = document_ids.contiguous()

    def check(batch, nheads, seqlen_q, seqlen_k):
        if ids.shape[-1] < max(seqlen_q, seqlen_k) or (ids.dim() == 2 and ids.shape[0] != batch):
            fail("document_ids.shape", tuple(ids.shape),
                  f"(seqlen,) or ({batch}, seqlen) with seqlen >= {max(seqlen_q, seqlen_k)}")
    return MaskMod(_document, (ids, 0 if ids.dim() == 1 else ids.stride(0), ids.shape[-1], int(bool(causal))),
                   check)


@triton.jit
def _prefix_lm(b, h, q_idx, kv_idx, aux):
    prefix = tl.load(aux[0] + b)
    return (kv_idx <= q_idx) | (kv_idx < prefix)


def prefix_lm_mask(prefix_lengths: torch.Tensor) -> MaskMod:
    """Prefix-LM: bidirectional inside the first prefix_lengths[b] tokens, causal after.
    prefix_lengths: int32 (batch,)."""
    if not isinstance(prefix_lengths, torch.Tensor) or prefix_lengths.dtype != torch.int32 or prefix_lengths.dim() != 1:
        fail("prefix_lengths", getattr(prefix_lengths, "dtype", type(prefix_lengths).__name__),
              "an int32 tensor of shape (batch,)")
    def check(batch, nheads, seqlen_q, seqlen_k):
        if prefix_lengths.shape[0] != batch:
            fail("prefix_lengths.shape", tuple(prefix_lengths.shape), f"({batch},) (the batch size)")
    return MaskMod(_prefix_lm, (prefix_lengths.contiguous(),), check)


@triton.jit
def _sliding_sinks(b, h, q_idx, kv_idx, aux):
    return (kv_idx <= q_idx) & ((q_idx - kv_idx < aux[0]) | (kv_idx < aux[1]))


def sliding_window_mask(window: int, num_sinks: int = 0) -> MaskMod:
    """Causal sliding window of `window` keys (q_idx - window < kv_idx <= q_idx) plus the first num_sinks keys
    (attention sinks, StreamingLLM), which every later query sees."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        fail("window", window, "an int >= 1")
    if not isinstance(num_sinks, int) or isinstance(num_sinks, bool) or num_sinks < 0:
        fail("num_sinks", num_sinks, "an int >= 0")
    return MaskMod(_sliding_sinks, (window, num_sinks))


@triton.jit
def _alibi(score, b, h, q_idx, kv_idx, aux):
    dist = tl.abs(q_idx - kv_idx).to(tl.float32)
    return score - tl.load(aux[0] + h) * dist


@triton.jit
def _alibi_captured_grad(dscore, score, b, h, q_idx, kv_idx, aux, aux_grad):
    # d out / d slope[h] = -|q - kv|: one atomic per tile
    dist = tl.abs(q_idx - kv_idx).to(tl.float32)
    tl.atomic_add(aux_grad[0] + h, -tl.sum(tl.sum(dscore * dist, 1), 0), sem="relaxed")


def alibi_score(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi: score - slopes[h] * |q_idx - kv_idx|. slopes: float32 (nheads,); may require grad."""
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 or slopes.dim() != 1:
        fail("slopes", getattr(slopes, "dtype", type(slopes).__name__), "a float32 tensor of shape (nheads,)")
    if slopes.stride(0) != 1:
        fail("slopes.stride(0)", slopes.stride(0), "1")
    def check(batch, nheads, seqlen_q, seqlen_k):
        if slopes.shape[0] != nheads:
            fail("slopes.shape", tuple(slopes.shape), f"({nheads},) (nheads)")
    return ScoreMod(_alibi, None, _alibi_captured_grad, (slopes,), check)


@triton.jit
def _softcap(score, b, h, q_idx, kv_idx, aux):
    # tanh(x) = 2 sigmoid(2x) - 1, portable (no libdevice)
    return aux[0] * (2.0 * tl.sigmoid(2.0 * score / aux[0]) - 1.0)


@triton.jit
def _softcap_grad(dscore, score, b, h, q_idx, kv_idx, aux):
    t = 2.0 * tl.sigmoid(2.0 * score / aux[0]) - 1.0
    return dscore * (1.0 - t * t)


def softcap_score(cap: float) -> ScoreMod:
    """cap * tanh(score / cap) (Gemma 2 / Grok logit soft-capping)."""
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not 0 < cap < float("inf"):
        fail("cap", cap, "a finite float > 0")
    return ScoreMod(_softcap, _softcap_grad, None, (float(cap),))


@triton.jit
def _relpos_index(q_idx, kv_idx, max_distance):
    rel = kv_idx - q_idx
    rel = tl.minimum(tl.maximum(rel, -max_distance), max_distance)
    return rel + max_distance


@triton.jit
def _relpos(score, b, h, q_idx, kv_idx, aux):
    idx = _relpos_index(q_idx, kv_idx, aux[2])
    return score + tl.load(aux[0] + h * aux[1] + idx).to(tl.float32)


@triton.jit
def _relpos_captured_grad(dscore, score, b, h, q_idx, kv_idx, aux, aux_grad):
    idx = _relpos_index(q_idx, kv_idx, aux[2])
    idx = idx + q_idx * 0                    # full tile shape
    tl.atomic_add(aux_grad[0] + h * aux[1] + idx, dscore, mask=dscore != 0.0, sem="relaxed")


def relative_position_bias(table: torch.Tensor, max_distance: int) -> ScoreMod:
    """score + table[h, clamp(kv_idx - q_idx, -max_distance, max_distance) + max_distance] (T5 / Swin style,
    without log buckets). table: (nheads, 2 * max_distance + 1), float; may require grad (its gradient is
    accumulated with one atomic add per visible score)."""
    if not isinstance(max_distance, int) or isinstance(max_distance, bool) or max_distance < 0:
        fail("max_distance", max_distance, "an int >= 0")
    if (not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != 2 * max_distance + 1
            or not table.is_floating_point()):
        fail("table.shape", tuple(getattr(table, "shape", ())), f"(nheads, {2 * max_distance + 1}), floating point")
    if table.stride(1) != 1:
        fail("table.stride(1)", table.stride(1), "1")
    def check(batch, nheads, seqlen_q, seqlen_k):
        if table.shape[0] != nheads:
            fail("table.shape", tuple(table.shape), f"({nheads}, {2 * max_distance + 1})")
    return ScoreMod(_relpos, None, _relpos_captured_grad, (table, table.stride(0), max_distance), check)


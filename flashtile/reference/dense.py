"""Batched dense attention with every flash-attn option: the oracle every numeric test compares against.

Shapes follow flash-attn 2.x: q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
v (batch, seqlen_k, nheads_k, headdim_v). It materialises the full (seqlen_q, seqlen_k) score matrix, so it is
O(N^2) in memory: a test oracle and a CPU fallback, never a hot path.

Semantics (docs/semantics.md):
- causal / sliding-window masks are aligned to the bottom-right corner when seqlen_q != seqlen_k;
- softcap > 0 maps scores to softcap * tanh(scores / softcap) before masking;
- ALiBi adds -slope * |i + seqlen_k - seqlen_q - j|;
- a query row with no visible key outputs zeros and has lse = -inf (log of zero probability mass).
"""
from __future__ import annotations

import math

import torch

# eps of the flash-attn tolerance rule, max |ours - ref64| <= 2 max |std - ref64| + eps (ref64: attention_ref in
# float64; std: attention_ref(upcast=False), standard attention in the inputs' dtype), relative to max(1, max|ref64|)
# of the compared quantity. eps only matters where std happens to be almost exact (tiny problems, seqlen_k = 1):
# - float16 / bfloat16: one unit in the last place at magnitude 1 (2**-10, 2**-7). The kernel rounds its
#   float32 accumulator to the output dtype once, and std rounds independently: the two roundings may land one
#   ulp apart even when std's own error is (by luck) zero.
# - float32: 1e-5, about 80 ulps at magnitude 1. The kernels compute exp as exp2 of log2(e)-pre-scaled scores
#   and tanh (softcap) through a sigmoid; these add errors of order 2**-23 * |score| * softcap that std
#   (torch.exp / torch.tanh) does not share, plus a different (blocked) summation order; on the CPU the
#   interpreter's float32 dot products are numpy's. A real bug moves results by O(1e-2) or more.
EPS_REL = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}


def tolerance_eps(dtype: torch.dtype, ref64: torch.Tensor) -> float:
    """eps of the tolerance rule (EPS_REL) for a quantity whose float64 reference is ref64, inputs of `dtype`."""
    finite = ref64[torch.isfinite(ref64)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    return EPS_REL[dtype] * scale


def visible_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal: bool = False,
                 device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): True where query i may attend key j (bottom-right aligned).

    window_size = (left, right), -1 = unbounded; causal forces right = 0.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    diag = i + seqlen_k - seqlen_q  # key index on the query's (bottom-right aligned) diagonal
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= diag + right
    if left >= 0:
        mask &= j >= diag - left
    return mask


def alibi_bias(alibi_slopes: torch.Tensor, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
               dtype=torch.float64) -> torch.Tensor:
    """(batch, nheads, seqlen_q, seqlen_k) additive ALiBi bias -slope * |i + sk - sq - j|."""
    slopes = alibi_slopes.to(dtype)
    if slopes.dim() == 1:
        slopes = slopes.view(1, nheads).expand(batch, nheads)
    dev = slopes.device
    i = torch.arange(seqlen_q, device=dev).view(-1, 1)
    j = torch.arange(seqlen_k, device=dev).view(1, -1)
    dist = (i + seqlen_k - seqlen_q - j).abs().to(dtype)
    return -slopes.view(batch, nheads, 1, 1) * dist


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, dropout_p=0.0, dropout_mask=None, attn_bias=None, attn_mask=None,
                  key_padding_mask=None, query_padding_mask=None, upcast=True):
    """Dense attention. Returns (out, lse, probs).

    out (batch, seqlen_q, nheads, headdim_v); lse (batch, nheads, seqlen_q) float32/64 natural log;
    probs (batch, nheads, seqlen_q, seqlen_k), the softmax before dropout.

    upcast=True computes in float64 (the ground truth). upcast=False computes the matmuls in the inputs'
    dtype with the softmax in float32: "standard attention in the same dtype", the baseline of the
    flash-attn tolerance rule |ours - ref64| <= 2 |standard - ref64| + eps.
    dropout_mask: bool (batch, nheads, seqlen_q, seqlen_k), True = kept; kept entries scaled by 1/(1-p).
    attn_bias: additive, broadcastable to (batch, nheads, seqlen_q, seqlen_k). attn_mask: bool, same
    broadcast, True = may attend. key_padding_mask (batch, seqlen_k) / query_padding_mask (batch, seqlen_q):
    True = real token.
    """
    dtype_in = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if h != hk:  # GQA / MQA: each K/V head serves h // hk query heads
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    acc = torch.float64 if upcast else torch.float32
    s = torch.einsum("bihd,bjhd->bhij", q, k).to(acc) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, b, h, sq, sk, dtype=acc)
    if attn_bias is not None:
        s = s + attn_bias.to(acc)
    visible = visible_mask(sq, sk, window_size, causal, device=q.device).view(1, 1, sq, sk)
    visible = visible.expand(b, h, sq, sk)
    if attn_mask is not None:
        visible = visible & attn_mask.to(torch.bool)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.view(b, 1, 1, sk).to(torch.bool)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows with no visible key
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(acc).min))
    p = p.masked_fill(~visible, 0.0)
    if query_padding_mask is not None:
        p = p.masked_fill(~query_padding_mask.view(b, 1, sq, 1).to(torch.bool), 0.0)
    p_drop = p
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("attention_ref: dropout_p > 0 needs dropout_mask (the kept entries)")
        p_drop = p * dropout_mask.to(acc) / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", p_drop.to(v.dtype), v)
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask.view(b, sq, 1, 1).to(torch.bool), 0.0)
    if not upcast:
        out = out.to(dtype_in)
    return out, lse, p

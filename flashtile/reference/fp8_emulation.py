"""FP8 attention as in FlashAttention-3 (Shah et al., "FlashAttention-3: Fast and Accurate Attention with
Asynchrony and Low-precision", 2024, §3.3), emulated in pure PyTorch.

What flashtile.kernels.triton.fp8 computes, written so it can be read beside the paper and run anywhere
(CPU, any size that fits in memory). The e4m3 rounding is torch's own ``float8_e4m3fn`` conversion
(round-to-nearest-even); the matmuls take e4m3 values exactly (they are products of 4-bit significands) and
accumulate in float32, as the FP8 tensor cores do.

Pipeline (flashtile.fp8.flash_attn_fp8_func):
1. Incoherent processing (optional): Q and K are multiplied by M = diag(s) H / sqrt(d), s a seeded vector of
   +-1 signs and H the Sylvester-Hadamard matrix. M is orthogonal, so (QM)(KM)^T = QK^T, but every entry
   of QM is a signed mix of all of a row's entries: an outlier is spread over d entries instead of
   dominating one. Applied with the fast Walsh-Hadamard transform (log2 d butterfly stages).
2. Quantization: one scale per block of rows (Q: Br x d, K and V: Bc x d, the attention kernel's tiles) or
   one per tensor (the baseline). descale = amax / 448; x8 = e4m3(x * (448 / amax)), so x ~= x8 * descale.
3. Attention over the e4m3 tiles with FA2's online softmax in float32 (log2 units, exp2):
   S_ij = (Q8_i K8_j^T) * descale_q_i * descale_k_j * softmax_scale;
   P~ = exp2(S - m + log2 448) lies in [0, 448] and is rounded to e4m3 for the P~ V product. The factor 448
   (the e4m3 maximum: P~ uses the whole e4m3 range, so few probabilities fall into the subnormals) is
   also in the row sum l (computed from the unrounded P~), so it cancels in O = acc / l at no cost.
   V's per-block descale is folded into the per-row rescale of the accumulator: acc is kept in units of
   the current block's descale, acc <- acc * alpha * (dv_prev / dv_j) + P8 V8_j, and O = acc * dv_last / l.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

E4M3_MAX = 448.0
LOG2_E4M3_MAX = math.log2(E4M3_MAX)
LOG2E = 1.4426950408889634
# amax floor: an all-zero block gets a finite scale (zeros quantize to zeros either way)
AMAX_FLOOR = 2.0 ** -20


def hadamard_signs(head_dim: int, seed: int, device=None) -> torch.Tensor:
    """The +-1 diagonal of M (float32, (head_dim,)), a deterministic function of seed."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    s = torch.randint(0, 2, (head_dim,), generator=g, dtype=torch.int64) * 2 - 1
    return s.to(device=device, dtype=torch.float32)


def hadamard_matrix(n: int, dtype=torch.float64) -> torch.Tensor:
    """Sylvester-Hadamard matrix H_n (entries +-1, H H^T = n I); n a power of two. For tests."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform along the last dim: x @ H_d in d log2 d adds.

    Stage with half-width h pairs entries (i, i + h) inside each group of 2h: (a, b) -> (a + b, a - b),
    the same butterflies, in the same order, as the Triton kernel."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"fwht: last dim {d} is not a power of two")
    h = 1
    while h < d:
        y = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*x.shape[:-1], d)
        h *= 2
    return x


def incoherent_transform(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x M with M = diag(signs) H / sqrt(d), in float32 (x: (..., d))."""
    d = x.shape[-1]
    return fwht(x.float() * signs.float()) * (1.0 / math.sqrt(d))


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to e4m3fn (nearest-even, saturating at +-448), returned as float32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


@dataclass
class Quantized:
    """x ~= x8 * descale, with x8 e4m3 values held in float32 and descale broadcast per row.

    x8: (batch, seqlen, nheads, d); descale: (batch, nheads, nblocks) float32 (per-tensor: all equal)."""
    x8: torch.Tensor
    descale: torch.Tensor
    block: int

    def row_descale(self) -> torch.Tensor:
        """(batch, seqlen, nheads, 1): each row's descale."""
        n = self.x8.shape[1]
        d = self.descale.repeat_interleave(self.block, dim=2)[:, :, :n]
        return d.permute(0, 2, 1).unsqueeze(-1)


def quantize(x: torch.Tensor, block: int, per_tensor: bool = False) -> Quantized:
    """x (batch, seqlen, nheads, d) float -> e4m3 blocks of `block` rows per (batch, head), or one scale."""
    x = x.float()
    b, n, h, d = x.shape
    nblk = max(1, -(-n // block))
    if per_tensor:
        amax = x.abs().amax().clamp_min(AMAX_FLOOR).expand(b, h, nblk)
    else:
        pad = nblk * block - n
        xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        amax = xp.abs().reshape(b, nblk, block, h, d).amax(dim=(2, 4)).permute(0, 2, 1).clamp_min(AMAX_FLOOR)
    amax = amax.contiguous()
    inv = torch.full_like(amax, E4M3_MAX) / amax   # IEEE float32 divisions, as the Triton kernel (div_rn)
    descale = amax / E4M3_MAX
    q = Quantized(x8=x, descale=descale, block=block)
    inv_rows = Quantized(x8=x, descale=inv, block=block).row_descale()
    q.x8 = e4m3(x * inv_rows)
    return q


def attention_fp8_emulated(q8: Quantized, k8: Quantized, v8: Quantized, *, softmax_scale: float,
                           causal: bool = False, block_n: Optional[int] = None):
    """FP8 attention over already-quantized tensors, FA2's loop over key blocks of block_n rows (the V/K
    scale blocks). Returns (out float32 (b, sq, h, d), lse float32 (b, h, sq), natural log)."""
    block_n = block_n or k8.block
    b, sq, h, d = q8.x8.shape
    sk, hk = k8.x8.shape[1], k8.x8.shape[2]
    g = h // hk
    q = q8.x8.permute(0, 2, 1, 3)                                             # (b, h, sq, d)
    dq = q8.row_descale().permute(0, 2, 1, 3)                                 # (b, h, sq, 1)
    k = k8.x8.repeat_interleave(g, dim=2).permute(0, 2, 1, 3)                 # (b, h, sk, d)
    v = v8.x8.repeat_interleave(g, dim=2).permute(0, 2, 1, 3)
    dk = k8.descale.repeat_interleave(g, dim=1)                               # (b, h, nblk)
    dv = v8.descale.repeat_interleave(g, dim=1)
    score_scale = softmax_scale * LOG2E
    m = torch.full((b, h, sq), float("-inf"))
    l = torch.zeros(b, h, sq)
    acc = torch.zeros(b, h, sq, v.shape[-1])
    dv_prev = torch.ones(b, h)
    rows = torch.arange(sq).view(-1, 1)
    for j, start in enumerate(range(0, sk, block_n)):
        kj, vj = k[:, :, start:start + block_n], v[:, :, start:start + block_n]
        dkj, dvj = dk[:, :, j], dv[:, :, j]
        s = (q @ kj.transpose(-1, -2)) * ((dq * score_scale) * dkj[..., None, None])
        if causal:
            cols = torch.arange(start, start + kj.shape[2]).view(1, -1)
            s = s.masked_fill(cols > rows + sk - sq, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - m_use)
        p = torch.exp2(s - (m_use - LOG2_E4M3_MAX)[..., None])
        l = l * alpha + p.sum(-1)
        ratio = (dv_prev / dvj)[..., None]
        acc = acc * (alpha * ratio)[..., None] + e4m3(p) @ vj
        m, dv_prev = m_new, dvj
    empty = l == 0
    out = acc * (dv_prev[..., None] / torch.where(empty, torch.ones_like(l), l))[..., None]
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(l, float("-inf")),
                      (m + torch.log2(torch.where(empty, torch.ones_like(l), l)) - LOG2_E4M3_MAX) / LOG2E)
    return out.permute(0, 2, 1, 3), lse


def flash_attn_fp8_emulated(q, k, v, *, softmax_scale=None, causal=False, block_quant=True, incoherent=True,
                            hadamard_seed=0, block_m=128, block_n=128):
    """The whole FP8 path (transform, quantize, attend) from float inputs (b, s, h, d). block_quant=False:
    one scale per tensor (FA3's per-tensor baseline when incoherent=False too). Returns (out, lse) float32."""
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf, kf = q.float(), k.float()
    if incoherent:
        signs = hadamard_signs(d, hadamard_seed)
        qf, kf = incoherent_transform(qf, signs), incoherent_transform(kf, signs)
    per_tensor = not block_quant
    q8 = quantize(qf, block_m, per_tensor)
    k8 = quantize(kf, block_n, per_tensor)
    v8 = quantize(v.float(), block_n, per_tensor)
    return attention_fp8_emulated(q8, k8, v8, softmax_scale=scale, causal=causal, block_n=block_n)


def outlier_inputs(shape, generator: Optional[torch.Generator] = None, p: float = 0.001, std: float = 10.0,
                   dtype=torch.float32, device=None) -> torch.Tensor:
    """FA3 §4.3 inputs: N(0, 1) + N(0, std^2) * Bernoulli(p)."""
    x = torch.randn(shape, generator=generator, device=device)
    x = x + torch.randn(shape, generator=generator, device=device) * std * (
        torch.rand(shape, generator=generator, device=device) < p)
    return x.to(dtype)

"""FP8 (e4m3) attention forward as in FlashAttention-3 §3.3: block quantization, incoherent processing, FP8
tensor-core GEMMs with fp32 accumulation. Forward only.

    out = flash_attn_fp8_func(q, k, v, causal=True)            # bf16/fp16 in: quantized here, bf16/fp16 out
    out = flash_attn_fp8_func(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv)   # float8_e4m3fn in

Layout (batch, seqlen, nheads, headdim) as flash_attn_func; GQA (nheads % nheads_k == 0); causal masks
are bottom-right aligned. The algorithm and its float32 emulation: flashtile/reference/fp8_emulation.py;
the kernels: flashtile/kernels/triton/fp8.py (quantizer, portable attention kernel) and, on Hopper, FlashAttention-3's
warp-specialized kernel in Gluon (flashtile/kernels/gluon/_fa3_fwd.py with FP8=True; kernel_config says which runs).

Modes (bf16/fp16 inputs), the four rows of FA3's Table 3:
    block_quant=False, incoherent=False   per-tensor FP8 baseline (one scale for each of Q, K, V)
    block_quant=True,  incoherent=False   one scale per Br x d block of Q and Bc x d block of K, V
    block_quant=False, incoherent=True    Q, K rotated by M = diag(signs) H / sqrt(d), per-tensor scales
    block_quant=True,  incoherent=True    both (the default, FA3's FP8 path)
P is quantized to e4m3 for the P V product with the fixed scale 448 (P~ = exp2(S - m + log2 448) in
[0, 448]); the factor is in the row sum too, so it cancels in O = acc / l at no cost.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .api import checks
from .api import problem as P
from .api.errors import fail
from .interface import output as _output
from .kernels.gluon import fa3 as _fa3
from .kernels.triton import fp8 as _k
from .kernels.triton.decode import multiprocessors
from .kernels.triton.launch import TensorDescriptor, cdiv, interpreting, kv_descriptor, next_pow2
from .kernels.triton.mods import LOG2E
from .reference.fp8_emulation import hadamard_signs

FP8_DTYPE = torch.float8_e4m3fn
_FLOAT_IN = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FP8Config:
    BLOCK_M: int      # rows per Q scale block: Br, query rows per program (Gluon: per consumer warpgroup, 64)
    BLOCK_N: int      # Bc: key rows per step = rows per K / V scale block
    num_warps: int
    num_stages: int
    gluon: bool = False   # the Gluon FA3 kernel (Hopper) instead of the Triton one


# Benchmarks pin a config here ({"fwd": FP8Config}); empty in normal use.
CONFIG_OVERRIDE: dict = {}


def fp8_config(head_dim: int, causal: bool = False) -> FP8Config:
    """Tile shapes of the FP8 kernel; the quantization blocks follow them (Q: BLOCK_M rows, K/V: BLOCK_N)."""
    if "fwd" in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE["fwd"]
    if interpreting():
        return FP8Config(32, 16, 4, 1)
    # per head dim (and mask at d64): the best tiles of benchmarks/sweep_fp8.py
    if head_dim <= 64:
        return FP8Config(128, 128, 4, 3) if causal else FP8Config(64, 128, 4, 3)
    if head_dim <= 128:
        return FP8Config(128, 256, 8, 3)
    return FP8Config(128, 128, 8, 3)


def kernel_config(q, k, causal: bool = False, out_dtype=torch.bfloat16, transpose_v: bool = True) -> FP8Config:
    """The kernel (and its tiles, which are the quantization blocks) that runs FP8 attention of q against k: the
    Gluon FA3 kernel where fa3.supports_fp8 (Hopper; V transposed; shapes its tiles divide), else the Triton
    kernel's fp8_config. A config pinned in CONFIG_OVERRIDE wins."""
    d = q.shape[-1]
    if "fwd" not in CONFIG_OVERRIDE and transpose_v and _fa3.supports_fp8(q, k, causal, out_dtype):
        block_m, block_n = _fa3.fp8_block_shape(d)
        return FP8Config(block_m, block_n, 4, _fa3.FP8_CONFIGS[d][2], gluon=True)
    return fp8_config(d, causal)


@dataclass
class FP8Tensors:
    """Quantized attention inputs: x ~= x8 * descale (after the incoherent rotation of q and k, if any).

    q: (batch, seqlen_q, nheads, d) e4m3; k: (batch, seqlen_k, nheads_k, d) e4m3;
    v: (batch, seqlen_k, nheads_k, d) e4m3, or, with v_transposed, V^T (batch, nheads_k, d, seqlen_pad)
    with seqlen_pad = seqlen_k rounded up to 16 and zeros past seqlen_k (16-byte aligned rows for TMA).
    q_scale: (batch, nheads, ceil(seqlen_q / block_m)) float32; k_scale, v_scale: (batch, nheads_k,
    ceil(seqlen_k / block_n)). Per-tensor modes hold the same value in every block.
    v_key_perm: V^T's keys are stored in the order the Gluon kernel reads them (within each 32 keys, key
    16h + 8i + 2q + e at 16h + 4q + 2i + e; see gluon/_fa3_fwd._p_operand); only that kernel takes it."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    block_m: int
    block_n: int
    v_transposed: bool
    incoherent: bool
    v_key_perm: bool = False


def _check_qkv(q, k, v):
    """The shape rules of flash_attn_func (the one validator) with FP8's dtypes, and FP8's head dims."""
    P.qkv(q, k, v, 4, _FLOAT_IN + (FP8_DTYPE,), "torch.float16, torch.bfloat16 or torch.float8_e4m3fn")
    d = q.shape[-1]
    if d % 8 or d > 256:
        fail("q.shape[-1] (headdim)", d, "a multiple of 8, at most 256")
    checks.check_device(q)


def _check_incoherent(d):
    if d & (d - 1) or d < 16:
        fail("q.shape[-1] (headdim)", d, "a power of two (16..256, e.g. 64, 128, 256) with incoherent=True (the "
             "Walsh-Hadamard transform); or pass incoherent=False")


def _block_d(d):
    return max(32, next_pow2(d))


# How the quantizer applies H: on the tensor cores (fwht_rows_mma) unless set to False (butterflies, fwht_rows;
# tests and benchmarks force either).
FWHT_MMA = True


@functools.lru_cache(maxsize=64)
def _signs(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """hadamard_signs, made once per (d, seed, device): building them on the host and copying them over
    on every call stalled the GPU queue."""
    return hadamard_signs(d, seed, device=device)


def gluon_key_order(vt: torch.Tensor) -> torch.Tensor:
    """V^T (..., seqlen_k), seqlen_k % 32 == 0 -> its keys in the Gluon kernel's order (FP8Tensors.v_key_perm):
    within each 32 keys, key 16h + 8i + 2q + e moves to 16h + 4q + 2i + e. The quantizer writes the same order
    (kernels/triton/fp8.key_perm)."""
    n = vt.shape[-1]
    return vt.reshape(*vt.shape[:-1], n // 32, 2, 2, 4, 2).transpose(-3, -2).reshape(vt.shape)


# The quantizer's row blocks per program (quant_fp8_kernel's GROUP), at most: diag(signs) H is built once per
# program. A power of two, halved while the launch would have fewer programs than QUANT_MIN_PROGRAMS_PER_SM per
# multiprocessor: one program often fills an SM's shared memory, so a group that leaves e.g. 160 programs on 132
# SMs runs two waves (same-run A/Bs on an H200: `git log -S QUANT_MIN_PROGRAMS_PER_SM`)
QUANT_GROUP = 8
QUANT_MIN_PROGRAMS_PER_SM = 0.5
# Software-pipeline depth of the quantizer's block loop: None = the deepest of 3, 2, 1 whose input tiles and H
# fit QUANT_SMEM bytes of shared memory (an int pins it: benchmarks)
QUANT_STAGES = None
QUANT_SMEM = 200 * 1024


def quant_group(nblk: int, heads: int, device: torch.device) -> int:
    """Row blocks per quantizer program for nblk blocks of each of `heads` (batch * head) rows."""
    group = QUANT_GROUP
    while group > 1 and (group >= 2 * nblk
                         or cdiv(nblk, group) * heads < QUANT_MIN_PROGRAMS_PER_SM * multiprocessors(device)):
        group //= 2
    return group


def quant_stages(block: int, block_d: int, elem: int, h_on_tensor_cores: bool) -> int:
    """quant_fp8_kernel's num_stages for (block, block_d) tiles of elem-byte inputs (QUANT_STAGES)."""
    if QUANT_STAGES is not None:
        return QUANT_STAGES
    h_bytes = block_d * block_d * elem if h_on_tensor_cores else 0
    return next((s for s in (3, 2) if s * block * block_d * elem + h_bytes <= QUANT_SMEM), 1)


def _quant_one(x, block, per_tensor, signs, transpose, key_perm=False):
    """One tensor -> (e4m3 tensor, descale (batch, nheads, nblocks) float32). key_perm: V^T in the Gluon
    kernel's key order (FP8Tensors.v_key_perm; needs transpose and seqlen % 32 == 0)."""
    b, n, h, d = x.shape
    bd = _block_d(d)
    incoherent = signs is not None
    nblk = max(1, cdiv(n, block))
    scale = torch.empty(b, h, nblk, device=x.device, dtype=torch.float32)
    if transpose:
        n_pad = cdiv(n, 16) * 16
        y = torch.empty(b, h, d, n_pad, device=x.device, dtype=FP8_DTYPE)
        if n_pad > n:
            y[..., n:].view(torch.uint8).zero_()
        ystr = (y.stride(0), 1, y.stride(1), y.stride(2))
    else:
        y = torch.empty(b, n, h, d, device=x.device, dtype=FP8_DTYPE)
        ystr = (y.stride(0), y.stride(1), y.stride(2), 1)
    if n == 0:
        scale.fill_(1.0)
        return y, scale
    if x.stride(-1) != 1:
        x = x.contiguous()
    group = quant_group(nblk, b * h, x.device)
    grid = (cdiv(nblk, group), b * h)
    # 4 warps, 8 for the largest tiles (benchmarks/sweep_fp8.py's quantizer breakdown times both)
    warps = 8 if block * bd >= 32768 else 4
    sig = signs if incoherent else scale
    common = (x.stride()[:3], tuple(ystr), scale.stride()[:2], (h, n, d), 1.0 / math.sqrt(d))
    assert not key_perm or (transpose and n % 32 == 0 and block % 32 == 0)
    mma = bool(FWHT_MMA)
    meta = dict(BLOCK=block, BLOCK_D=bd, INCOHERENT=incoherent, FWHT_MMA=mma, SOFT_ROUND=interpreting(),
                KEY_PERM=key_perm, GROUP=group, num_warps=warps,
                num_stages=quant_stages(block, bd, x.element_size(), incoherent and mma))
    amax = scale
    if per_tensor:  # pass 1: block amaxes (after the rotation) -> the tensor's amax
        _k.quant_fp8_kernel[grid](x, y, scale, sig, scale, *common, PER_TENSOR=False, WRITE_Y=False, **meta)
        amax = scale.amax().reshape(1).clone()
    _k.quant_fp8_kernel[grid](x, y, scale, sig, amax, *common, PER_TENSOR=per_tensor, WRITE_Y=True, **meta)
    return y, scale


def quantize_fp8(q, k, v, *, block_quant: bool = True, incoherent: bool = True, hadamard_seed: int = 0,
                 transpose_v: bool = True, causal: bool = False, block_m: Optional[int] = None,
                 block_n: Optional[int] = None, v_key_perm: Optional[bool] = None) -> FP8Tensors:
    """The fused quantization kernel over q, k, v (bf16/fp16, (batch, seqlen, nheads, headdim)).

    incoherent: q and k rotated by M = diag(signs) H / sqrt(d) (signs seeded by hadamard_seed; the same M
    for both, so QK^T is unchanged) with a fast Walsh-Hadamard transform inside the kernel. block_quant:
    one scale per block_m x d block of q and block_n x d block of k, v (default: the attention kernel's
    tiles, kernel_config); else one per tensor. transpose_v: write V^T (K-major for the P V GEMM).
    v_key_perm: V^T in the Gluon kernel's key order (FP8Tensors); default: where kernel_config picks that kernel
    and the blocks are its tiles."""
    _check_qkv(q, k, v)
    if q.dtype not in _FLOAT_IN:
        fail("q.dtype", q.dtype, "torch.float16 or torch.bfloat16 to quantize")
    block_quant = checks.flag("block_quant", block_quant)
    incoherent = checks.flag("incoherent", incoherent)
    transpose_v = checks.flag("transpose_v", transpose_v)
    hadamard_seed = checks.integer("hadamard_seed", hadamard_seed)
    d = q.shape[-1]
    if incoherent:
        _check_incoherent(d)
    cfg = kernel_config(q, k, causal, q.dtype, transpose_v)
    block_m = block_m or cfg.BLOCK_M
    block_n = block_n or cfg.BLOCK_N
    if v_key_perm is None:
        v_key_perm = cfg.gluon and (block_m, block_n) == (cfg.BLOCK_M, cfg.BLOCK_N)
    if v_key_perm and not (transpose_v and k.shape[1] % 32 == 0 and block_n % 32 == 0):
        fail("v_key_perm", v_key_perm, "False unless transpose_v, seqlen_k % 32 == 0 and block_n % 32 == 0")
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            fail(name, val, "a power of two >= 16")
    signs = _signs(d, hadamard_seed, q.device) if incoherent else None
    per_tensor = not block_quant
    q8, qs = _quant_one(q, block_m, per_tensor, signs, False)
    k8, ks = _quant_one(k, block_n, per_tensor, signs, False)
    v8, vs = _quant_one(v, block_n, per_tensor, None, transpose_v, v_key_perm)
    return FP8Tensors(q8, k8, v8, qs, ks, vs, block_m, block_n, transpose_v, incoherent, v_key_perm)


def _scale_view(t: torch.Tensor, name: str, batch: int, nheads_k: int):
    """A descale given per (batch, nheads_k) or per tensor -> (tensor, stride_b, stride_h, stride_blk)."""
    if not isinstance(t, torch.Tensor):
        fail(name, type(t).__name__, "a torch.Tensor (float32, shape (batch, nheads_k) or one element)")
    if not t.is_floating_point() or t.dtype == FP8_DTYPE:
        fail(f"{name}.dtype", t.dtype, "a floating dtype (float32)")
    t = t.to(torch.float32)
    if t.numel() == 1:
        return t.reshape(1), 0, 0, 0
    if tuple(t.shape) != (batch, nheads_k):
        fail(f"{name}.shape", tuple(t.shape), f"(batch, nheads_k) = {(batch, nheads_k)} or one element")
    return t, t.stride(0), t.stride(1), 0


def attention_fp8(t: FP8Tensors, *, softmax_scale: float, causal: bool = False, out_dtype=torch.bfloat16,
                  seqlen_k: Optional[int] = None, descales=None, soft_cast: Optional[bool] = None,
                  use_tma: Optional[bool] = None, config: Optional[FP8Config] = None):
    """The FP8 attention kernel over quantized tensors. Returns (out (b, sq, h, d) out_dtype, lse (b, h, sq)
    float32 natural log). descales: ((tensor, sb, sh, sm, group) for q, k, v) overriding t's scales
    (pre-quantized inputs). soft_cast: round P onto the e4m3 grid in fp32 before the cast (default: only
    under the interpreter, whose cast does not round to nearest). use_tma: None = where possible."""
    q8, k8, v8 = t.q, t.k, t.v
    b, sq, h, d = q8.shape
    hk = k8.shape[2]
    sk = k8.shape[1] if seqlen_k is None else seqlen_k
    out = _output((b, sq, h, d), q8.device, out_dtype)   # NaN under FLASHTILE_POISON=1 (the tests)
    lse = _output((b, h, sq), q8.device, torch.float32)
    if sq == 0:
        return out, lse
    if sk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    cfg = config or kernel_config(q8, k8, causal, out_dtype, t.v_transposed)
    if config is None and cfg.gluon and ((t.block_m, t.block_n) != (cfg.BLOCK_M, cfg.BLOCK_N) or soft_cast
                                         or use_tma is False or not t.v_key_perm):
        cfg = fp8_config(d, causal)   # quantized for other tiles, or options only the Triton kernel has
    if t.block_m != cfg.BLOCK_M or t.block_n != cfg.BLOCK_N:
        raise ValueError(f"attention_fp8: quantization blocks (block_m={t.block_m}, block_n={t.block_n}) must "
                         f"match the kernel tiles (BLOCK_M={cfg.BLOCK_M}, BLOCK_N={cfg.BLOCK_N})")
    if cfg.gluon:
        # (kernel_config checked supports_fp8 unless the config came from the caller)
        if not (t.v_transposed and t.v_key_perm and _fa3.tma_aligned(q8, k8, v8)
                and (config is None or _fa3.supports_fp8(q8, k8, causal, out_dtype))):
            raise ValueError("attention_fp8: config.gluon needs V^T in its key order (v_key_perm), q, k, V^T "
                             "contiguous and 16-byte aligned, and a problem fa3.supports_fp8 takes")
        scales = [t.q_scale, t.k_scale, t.v_scale] if descales is None else \
            [_block_descales(x, b, heads, rows, blk) for x, heads, rows, blk in
             zip(descales, (h, hk, hk), (sq, sk, sk), (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_N))]
        _fa3.fwd_fp8(q8, k8, v8, *scales, out, lse, softmax_scale, bool(causal))
        return out, lse
    if t.v_key_perm:
        raise ValueError("attention_fp8: V^T was quantized in the Gluon kernel's key order (v_key_perm=True); the "
                         "Triton kernel needs quantize_fp8(..., v_key_perm=False)")
    bd = _block_d(d)
    if descales is None:
        qs = (t.q_scale, t.q_scale.stride(0), t.q_scale.stride(1), t.q_scale.stride(2), 1)
        ks = (t.k_scale, t.k_scale.stride(0), t.k_scale.stride(1), t.k_scale.stride(2))
        vs = (t.v_scale, t.v_scale.stride(0), t.v_scale.stride(1), t.v_scale.stride(2))
    else:
        qs, ks, vs = descales
    if soft_cast is None:
        soft_cast = interpreting()
    desc_k = desc_v = None
    if use_tma is not False and TensorDescriptor is not None and bd == d:
        desc_k = kv_descriptor(k8, cfg.BLOCK_N, bd)
        if t.v_transposed:
            if v8.is_contiguous() and v8.data_ptr() % 16 == 0 and (q8.device.type == "cuda" or interpreting()):
                rows = b * hk * d
                view = v8.view(rows, v8.shape[-1])
                desc_v = TensorDescriptor(view, [rows, v8.shape[-1]], [v8.shape[-1], 1], [bd, cfg.BLOCK_N])
        else:
            desc_v = kv_descriptor(v8, cfg.BLOCK_N, bd)
    tma = desc_k is not None and desc_v is not None
    if use_tma and not tma:
        raise ValueError("attention_fp8: use_tma=True but no TMA descriptor can be made for these tensors")
    if t.v_transposed:
        v_str = (v8.stride(0), 1, v8.stride(1), v8.stride(2))   # (batch, key, head, d) strides of V^T
    else:
        v_str = (v8.stride(0), v8.stride(1), v8.stride(2), 1)
    grid = (cdiv(sq, cfg.BLOCK_M), b * h)
    _k.attn_fwd_fp8_kernel[grid](
        q8, k8, v8, out, lse, qs[0], ks[0], vs[0], desc_k if tma else None, desc_v if tma else None,
        q8.stride()[:3], k8.stride()[:3], v_str, out.stride()[:3], lse.stride()[:2], tuple(qs[1:4]), tuple(ks[1:4]),
        tuple(vs[1:4]), (h, hk, h // hk, qs[4], sq, sk, d, d), softmax_scale * LOG2E,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=bd, CAUSAL=bool(causal),
        V_TRANSPOSED=t.v_transposed, USE_TMA=tma, SOFT_CAST=bool(soft_cast),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def _block_descales(view, batch: int, heads: int, seqlen: int, block: int) -> torch.Tensor:
    """A descale as attention_fp8 takes it ((tensor, stride_b, stride_h, stride_blk[, group]); q's reads head h at
    h // group) -> one value per (batch, head, block), contiguous, as the Gluon kernel reads it."""
    t, sb, sh, sm, *group = view
    group = group[0] if group else 1
    full = t.as_strided((batch, heads // group, cdiv(seqlen, block)), (sb, sh, sm))
    return full.repeat_interleave(group, dim=1) if group > 1 else full.contiguous()


class _FP8Attention(torch.autograd.Function):
    """Forward-only: gives inputs that require grad an output whose backward fails loudly."""

    @staticmethod
    def forward(ctx, q, k, v, run):
        out, lse = run()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError("flash_attn_fp8_func: the FP8 attention path is forward-only (FA3's FP8 "
                                  "kernel has no backward); use flashtile.flash_attn_func (bf16/fp16) to train")


def flash_attn_fp8_func(q, k, v, softmax_scale=None, causal=False, block_quant=True, incoherent=True,
                        hadamard_seed=0, q_descale=None, k_descale=None, v_descale=None, return_lse=False,
                        *, transpose_v=True, out_dtype=None):
    """FP8 attention forward (FA3 §3.3).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim); headdim <= 256, a
    multiple of 8 (a power of two with incoherent=True). dtype float16/bfloat16: quantized here (see the
    module doc for block_quant / incoherent / hadamard_seed); output in the same dtype.
    dtype float8_e4m3fn: already quantized, x = x8 * x_descale with descales float32 of shape
    (batch, nheads_k) or one element (None = 1), as FA3's q_descale/k_descale/v_descale; block_quant,
    incoherent and hadamard_seed do not apply (the caller quantized); output bfloat16 unless out_dtype.
    transpose_v: V is fed to the P V GEMM from a transposed (K-major) copy written by the quantizer
    (fp8 inputs: by a transpose copy); False reads V as it is (Triton transposes on chip).
    Returns out, or (out, lse) with return_lse (lse (batch, nheads, seqlen_q) float32, natural log).
    Backward raises NotImplementedError."""
    q, k, v = P.contiguous_last(q, k, v)
    _check_qkv(q, k, v)
    causal = checks.flag("causal", causal)
    return_lse = checks.flag("return_lse", return_lse)
    transpose_v = checks.flag("transpose_v", transpose_v)
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    elif checks.real("softmax_scale", softmax_scale, "a positive finite float or None") <= 0:
        fail("softmax_scale", softmax_scale, "a positive finite float or None")
    fp8_in = q.dtype == FP8_DTYPE
    descales = (q_descale, k_descale, v_descale)
    if not fp8_in and any(x is not None for x in descales):
        fail("q_descale/k_descale/v_descale", "given", "None for float16/bfloat16 inputs (they are quantized "
              "here); descales go with float8_e4m3fn inputs")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8_in else q.dtype
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        fail("out_dtype", out_dtype, "torch.bfloat16, torch.float16 or torch.float32")
    b, sq, h, _ = q.shape
    hk = k.shape[2]
    cfg = kernel_config(q, k, causal, out_dtype, transpose_v)

    def run():
        if fp8_in:
            ones = torch.ones(1, device=q.device, dtype=torch.float32)
            views = [_scale_view(x if x is not None else ones, name, b, hk)
                     for x, name in zip(descales, ("q_descale", "k_descale", "v_descale"))]
            qv = (*views[0], h // hk)   # q_descale is per (batch, head_k): query head h reads h // group
            vv = v
            if transpose_v:
                sk = v.shape[1]
                vt_bytes = v.permute(0, 2, 3, 1).view(torch.uint8)
                if cfg.gluon:   # sk % Bc == 0
                    vt_bytes = gluon_key_order(vt_bytes)
                vt = torch.zeros(b, hk, d, cdiv(sk, 16) * 16, device=v.device, dtype=torch.uint8)
                vt[..., :sk].copy_(vt_bytes)
                vv = vt.view(FP8_DTYPE)
            t = FP8Tensors(_fa3.tma_ready(q), _fa3.tma_ready(k), vv if transpose_v else v.contiguous(),
                           views[0][0], views[1][0], views[2][0], cfg.BLOCK_M, cfg.BLOCK_N, transpose_v, False,
                           cfg.gluon)
            return attention_fp8(t, softmax_scale=float(softmax_scale), causal=causal, out_dtype=out_dtype,
                                 descales=(qv, views[1], views[2]), config=cfg)
        t = quantize_fp8(q, k, v, block_quant=block_quant, incoherent=incoherent, hadamard_seed=hadamard_seed,
                         transpose_v=transpose_v, causal=causal, block_m=cfg.BLOCK_M, block_n=cfg.BLOCK_N,
                         v_key_perm=cfg.gluon)
        return attention_fp8(t, softmax_scale=float(softmax_scale), causal=causal, out_dtype=out_dtype, config=cfg)

    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = _FP8Attention.apply(q, k, v, run)
    else:
        out, lse = run()
    return (out, lse) if return_lse else out

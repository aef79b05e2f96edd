"""What limits the Triton forward on Hopper? Time variants of a minimal FA2 forward loop that drop or
change one stage, beside the real kernel, in one run (no masking, full attention, bf16).

  full        the complete online-softmax loop (what flashtile.flash_attn_func runs, minus masking)
  no-softmax  S = QK^T; O += S V (both GEMMs, no exp/max/rescale): the GEMM-pipeline ceiling
  qk-only     only S = QK^T and a row max: one GEMM
  full+tma    the full loop with K/V loaded through host-side TMA tensor descriptors
  full+ws     the full loop with tl.range(..., warp_specialize=True) (where the Triton build allows it)
  +poly       P~ = exp2 with half of each tile's columns by a polynomial on the FMA pipe (FA4's trick)
  +ex2h       P~ = exp2 on packed fp16 pairs (ex2.approx.f16x2)
Usage: PYTHONPATH=. python benchmarks/fwd_ablation.py
"""
import torch
import triton
import triton.language as tl

import flashtile

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton
    TensorDescriptor = None


@triton.jit
def exp2_f16x2(x):
    """2^x through MUFU.EX2 on packed fp16 pairs (PTX ex2.approx.f16x2): two results per instruction, twice
    the fp32 exp2 rate. x is rounded to fp16 first (spacing 2^-7 for |x| in [8, 16): 0.3 % relative error in
    2^x at most, against e4m3's 6 % spacing of the P~ it feeds). GPU only (inline PTX)."""
    return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                                     is_pure=True, pack=2)


@triton.jit
def exp2_poly(x):
    """2^x on the FMA pipe (no MUFU): x = j + f, j = round(x), f in [-0.5, 0.5]; 2^f by a degree-3 polynomial
    (relative error 7.5e-5), 2^j added into the exponent bits. x <= 127; x below -126 gives ~2^-126 (0 for
    every use here). FA4's trick for a softmax whose exponentials outrun the MUFU unit."""
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0                                       # 1.5 * 2^23: the fp32 adder rounds x to j
    j = t.to(tl.int32, bitcast=True) - 0x4B400000
    f = x - (t - 12582912.0)
    p = 0.9999281093641536 + f * (0.6932609856052576 + f * (0.24261054228172133 + f * 0.05517132143403311))
    return (p.to(tl.int32, bitcast=True) + (j << 23)).to(tl.float32, bitcast=True)


@triton.jit
def exp2_tile(x, EXP_MODE: tl.constexpr):
    """2^x of a score tile (BLOCK_M, BLOCK_N), fp32 out. EXP_MODE 0: MUFU fp32; 1: MUFU on fp16 pairs;
    2: the even columns on MUFU, the odd ones by exp2_poly (each thread holds column pairs, so the split
    costs no data movement)."""
    if EXP_MODE == 1:
        return exp2_f16x2(x).to(tl.float32)
    elif EXP_MODE == 2:
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        return tl.reshape(tl.join(tl.math.exp2(a), exp2_poly(b)), (x.shape[0], x.shape[1]))
    else:
        return tl.math.exp2(x)


@triton.jit
def _ablate_kernel(Q, K, V, O, desc_k, desc_v, sm_scale, H, N, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, MODE: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    row_stride = H * D
    base = tl.cast(b, tl.int64) * N * row_stride + h * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * row_stride + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    for start_n in tl.range(0, N, BLOCK_N, warp_specialize=WS):
        if USE_TMA:
            k = desc_k.load([b * N + start_n, h * D])
            v = desc_v.load([b * N + start_n, h * D])
        else:
            k = tl.load(K + base + (start_n + offs_n)[:, None] * row_stride + offs_d[None, :])
            v = tl.load(V + base + (start_n + offs_n)[:, None] * row_stride + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        if MODE == 0 or MODE >= 3:      # full online softmax (3: poly for half the columns, 4: fp16-pair exp2)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = exp2_tile(s * qk_scale - m_new[:, None], 2 if MODE == 3 else (1 if MODE == 4 else 0))
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        elif MODE == 1:    # both GEMMs, no softmax
            acc = tl.dot(s.to(v.dtype), v, acc)
        else:              # one GEMM
            m_i = tl.maximum(m_i, tl.max(s, 1))
    if MODE == 0 or MODE >= 3:
        acc = acc / l_i[:, None]
    elif MODE == 2:
        acc = acc + m_i[:, None]
    tl.store(O + base + offs_m[:, None] * row_stride + offs_d[None, :], acc.to(O.dtype.element_ty))


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for (b, h, n, d, bm, bn, w, st) in [(2, 16, 8192, 128, 128, 128, 8, 3), (2, 16, 8192, 128, 128, 64, 8, 3),
                                         (2, 32, 8192, 64, 128, 64, 8, 3), (2, 8, 8192, 256, 128, 64, 8, 2),
                                         (2, 8, 8192, 256, 64, 64, 4, 2)]:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.empty_like(q)
        flops = 4 * b * h * n * n * d
        dk = dv = None
        if TensorDescriptor is not None:
            k2, v2 = k.view(b * n, h * d), v.view(b * n, h * d)
            dk = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, d])
            dv = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [bn, d])
        ms = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v), return_mode="median")
        line = [f"b{b} h{h} n{n} d{d} cfg({bm},{bn},{w},{st})", f"flashtile {flops / ms / 1e9:6.1f}"]
        for name, mode, tma, ws in [("full", 0, False, False), ("no-softmax", 1, False, False),
                                    ("qk-only", 2, False, False), ("full+tma", 0, True, False),
                                    ("full+ws", 0, False, True), ("full+tma+ws", 0, True, True),
                                    ("full+tma+poly", 3, True, False), ("full+tma+ex2h", 4, True, False)]:
            if tma and dk is None:
                line.append(f"{name} n/a")
                continue
            try:
                grid = (n // bm, b * h)
                fn = lambda: _ablate_kernel[grid](q, k, v, o, dk, dv, d ** -0.5, h, n, D=d, BLOCK_M=bm, BLOCK_N=bn,  # noqa: E731
                                                  MODE=mode, USE_TMA=tma, WS=ws, num_warps=w, num_stages=st)
                fn()
                ms = triton.testing.do_bench(fn, return_mode="median")
                if mode == 0 and not ws:
                    ref = o.float().clone()
                elif mode >= 3:
                    line.append(f"(max|d| {(o.float() - ref).abs().max().item():.1e})")
                f = flops / (2 if mode == 2 else 1)
                line.append(f"{name} {f / ms / 1e9:6.1f}")
            except Exception as e:  # noqa: BLE001
                line.append(f"{name} FAIL({type(e).__name__}: {str(e)[:80]})")
        print(" | ".join(line), flush=True)
        rows.append(line)


if __name__ == "__main__":
    main()

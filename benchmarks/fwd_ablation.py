"""What limits the Triton forward on Hopper? Time variants of a minimal FA2 forward loop that drop or
change one stage, beside the real kernel, in one run (no masking, full attention, bf16).

  full        the complete online-softmax loop (what flashtile.flash_attn_func runs, minus masking)
  no-softmax  S = QK^T; O += S V (both GEMMs, no exp/max/rescale): the GEMM-pipeline ceiling
  qk-only     only S = QK^T and a row max: one GEMM
  full+tma    the full loop with K/V loaded through host-side TMA tensor descriptors
  full+ws     the full loop with tl.range(..., warp_specialize=True) (where the Triton build allows it)
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
        if MODE == 0:      # full online softmax
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        elif MODE == 1:    # both GEMMs, no softmax
            acc = tl.dot(s.to(v.dtype), v, acc)
        else:              # one GEMM
            m_i = tl.maximum(m_i, tl.max(s, 1))
    if MODE == 0:
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
                                    ("full+ws", 0, False, True), ("full+tma+ws", 0, True, True)]:
            if tma and dk is None:
                line.append(f"{name} n/a")
                continue
            try:
                grid = (n // bm, b * h)
                fn = lambda: _ablate_kernel[grid](q, k, v, o, dk, dv, d ** -0.5, h, n, D=d, BLOCK_M=bm, BLOCK_N=bn,  # noqa: E731
                                                  MODE=mode, USE_TMA=tma, WS=ws, num_warps=w, num_stages=st)
                fn()
                ms = triton.testing.do_bench(fn, return_mode="median")
                f = flops / (2 if mode == 2 else 1)
                line.append(f"{name} {f / ms / 1e9:6.1f}")
            except Exception as e:  # noqa: BLE001
                line.append(f"{name} FAIL({type(e).__name__}: {str(e)[:80]})")
        print(" | ".join(line), flush=True)
        rows.append(line)


if __name__ == "__main__":
    main()

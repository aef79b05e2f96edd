"""The FP8 attention launch path on a Hopper GPU (BENCHMARKS.md §5): per head dim of the Gluon FP8 kernel, full
and causal, seqlen 8192 (b*n = 16k, hidden 2048), TFLOP/s by triton.testing.do_bench (median; each call timed
alone, so host time longer than do_bench's L2 flush shows) and by a back-to-back loop of 30 calls (host time
hidden), and the host time per call, for attention_fp8 (the API on quantized inputs), fa3.fwd_fp8 (the kernel
launch alone) and flashtile's bf16 flash_attn_func.

    PYTHONPATH=. python benchmarks/fp8_launch.py OUT.json
"""
import json
import sys
import time

import torch
import triton

from flashtile import flash_attn_func
from flashtile.bench.measure import attention_flops
from flashtile.fp8 import attention_fp8, quantize_fp8
from flashtile.kernels.gluon import fa3

SEQLEN = 8192


def loop_ms(fn, reps=30):
    """(GPU ms per call over `reps` back-to-back calls, host ms per call while issuing them)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host


def main(path):
    rows = []
    n = SEQLEN
    for d in sorted(fa3.FP8_CONFIGS):
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = attention_flops(b, h, n, n, d, causal)
            t = quantize_fp8(q, k, v, causal=causal)
            out, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
            fns = {"api": lambda: attention_fp8(t, softmax_scale=d ** -0.5, causal=causal),
                   "kernel": lambda: fa3.fwd_fp8(t.q, t.k, t.v, t.q_scale, t.k_scale, t.v_scale, out, lse,
                                                 d ** -0.5, causal),
                   "bf16_api": lambda: flash_attn_func(q, k, v, causal=causal)}
            row = dict(d=d, causal=causal)
            for name, fn in fns.items():
                ms = triton.testing.do_bench(fn, return_mode="median")
                loop, host = loop_ms(fn)
                row[name] = dict(do_bench_tflops=flops / ms / 1e9, loop_tflops=flops / loop / 1e9,
                                 host_us=host * 1e3)
            rows.append(row)
            print(d, causal, " | ".join(f"{key}: do_bench {val['do_bench_tflops']:.0f} loop "
                                        f"{val['loop_tflops']:.0f} host {val['host_us']:.0f}us"
                                        for key, val in row.items() if isinstance(val, dict)), flush=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

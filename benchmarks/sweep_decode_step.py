"""Decode steps through flash_attn_func (seqlen_q = 1) on the forward kernel and on the decode kernel, one GPU: where
flashtile.kernels.dispatch.DECODE_STEP_MIN_KEY_WORK and DECODE_STEP_MIN_BYTES come from.

    PYTHONPATH=. python benchmarks/sweep_decode_step.py [--out DIR]

Per shape (batch, head dim; 32 query heads over 8 K/V heads, bf16, --seqlen keys (default 4097) as transformers'
DynamicCache holds them: (batch, heads, seqlen, d) tensors seen transposed) and per route (the forward kernel:
threshold off; the decode kernel: threshold 0): the GPU time of one call (torch.profiler, its kernels summed), and
the host time per call (40 calls enqueued, median of 9 rounds, the two routes alternating) for a repeated shape, for
a cache that grows by one token per call (a generation loop's steps) as views of one buffer, and for one that grows
into a new tensor per call (transformers' DynamicCache concatenates: the strides change with the length too; the
tensors are allocated, not written, inside the timing, the same for both routes). The decode kernel pays off where
the kernel time it saves exceeds the host time it adds. Writes DIR/decode_step.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flashtile  # noqa: E402
from flashtile import interface  # noqa: E402
from flashtile.api import problem  # noqa: E402
from flashtile.kernels import dispatch  # noqa: E402

ROUTES = {"forward kernel": 1 << 62, "decode kernel": 0}   # (both thresholds)


def route(threshold: int) -> None:
    dispatch.DECODE_STEP_MIN_BYTES = dispatch.DECODE_STEP_MIN_KEY_WORK = threshold


def kernel_us(fn, calls: int = 10) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / calls


def host_us(step, rounds: int = 9, calls: int = 40) -> dict:
    """{route: median host us per call}, the routes alternating round by round."""
    times = {r: [] for r in ROUTES}
    for _ in range(rounds):
        for route, threshold in ROUTES.items():
            route(threshold)
            interface._DENSE.clear()   # (a problem keeps the route it was planned with)
            step(2)                    # plan and compile outside the timing
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(calls)
            times[route].append((time.perf_counter() - t) / calls * 1e6)
            torch.cuda.synchronize()
    return {r: statistics.median(v) for r, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x64,8x64,8x128,32x128", help="batch x head dim, comma separated")
    ap.add_argument("--seqlen", type=int, default=4097, help="keys of a step (a growing cache: from there to twice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    problem.CHECK_VALUES = False
    saved = dispatch.DECODE_STEP_MIN_BYTES, dispatch.DECODE_STEP_MIN_KEY_WORK
    rows = []
    with torch.no_grad():
        for shape in args.shapes.split(","):
            b, d = (int(x) for x in shape.split("x"))
            n0 = args.seqlen
            K, V = (torch.randn(b, 8, 2 * n0 + 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            q = torch.randn(b, 32, 1, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k4, v4 = K[:, :, :n0].transpose(1, 2), V[:, :, :n0].transpose(1, 2)
            grow = {"s": n0}

            def fixed(n):
                for _ in range(n):
                    flashtile.flash_attn_func(q, k4, v4, causal=True)

            def growing(n):
                for _ in range(n):
                    grow["s"] = s = n0 + (grow["s"] - n0 + 1) % n0
                    flashtile.flash_attn_func(q, K[:, :, :s].transpose(1, 2), V[:, :, :s].transpose(1, 2),
                                              causal=True)
            def reallocated(n):
                for _ in range(n):
                    grow["s"] = s = n0 + (grow["s"] - n0 + 1) % n0
                    kn, vn = (torch.empty(b, 8, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                    flashtile.flash_attn_func(q, kn.transpose(1, 2), vn.transpose(1, 2), causal=True)
            gpu = {}
            for route, threshold in ROUTES.items():
                route(threshold)
                interface._DENSE.clear()
                fixed(3)
                gpu[route] = kernel_us(lambda: fixed(1))
            row = dict(batch=b, head_dim=d, nheads=32, nheads_k=8, seqlen_k=n0,
                       kv_bytes=2 * b * n0 * 8 * d * 2, kernel_us=gpu, host_us_fixed=host_us(fixed),
                       host_us_growing=host_us(growing), host_us_new_tensors=host_us(reallocated))
            rows.append(row)
            f, dk = "forward kernel", "decode kernel"
            print(f"b{b} d{d} ({row['kv_bytes'] / 2 ** 20:.0f} MiB of K/V): kernels {gpu[f]:.1f} -> {gpu[dk]:.1f} us, "
                  f"host (repeated shape) {row['host_us_fixed'][f]:.1f} -> {row['host_us_fixed'][dk]:.1f} us, "
                  f"host (growing cache) {row['host_us_growing'][f]:.1f} -> {row['host_us_growing'][dk]:.1f} us, "
                  f"(new tensors) {row['host_us_new_tensors'][f]:.1f} -> {row['host_us_new_tensors'][dk]:.1f} us",
                  flush=True)
            del K, V
    dispatch.DECODE_STEP_MIN_BYTES, dispatch.DECODE_STEP_MIN_KEY_WORK = saved
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_step.json"), "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()

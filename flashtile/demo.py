"""`flashtile demo`: the main job. Checks flashtile against the float64 reference, compares it side by side
with SDPA and standard attention (time and peak memory), and prints the IO-model summary.

On a machine with CUDA it uses the GPU at a realistic size; otherwise the CPU through the Triton
interpreter at a small size (the interpreter is exact but slow: CPU timings say nothing about GPU speed).
"""
from __future__ import annotations

import math
import sys
import time

import torch

from .interface import flash_attn_func
from .reference.dense import attention_ref, tolerance_eps


def _standard_attention(q, k, v, causal):
    """The 3-step algorithm that writes S and P: matmul, softmax (fp32), matmul. Layout (b, n, h, d)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    s = (qt @ kt.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return (p @ vt).transpose(1, 2)


def _sdpa(q, k, v, causal):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def _measure(fn, device):
    """(median seconds of one fwd+bwd call, peak bytes allocated above the inputs). On a GPU: triton's do_bench
    median (warm-up, then calls back to back for 100 ms between CUDA events, the L2 cache flushed between calls),
    as `flashtile bench --mode train` times it; on the CPU one call (the interpreter: not a speed claim)."""
    if device == "cuda":
        import triton.testing
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return ms * 1e-3, peak
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, None


def run_demo(progress: bool = True, file=None) -> dict:
    """Run the demo; returns a dict of what it measured, also printed to ``file`` (default sys.stdout) unless
    progress is False."""
    out_file = sys.stdout if file is None else file

    def say(text: str) -> None:
        if progress:
            print(text, file=out_file, flush=True)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        # the float64 reference materialises (b, h, n, n) scores: n = 2048 keeps it near 1 GB
        b, n, h, d, dtype = 2, 2048, 16, 128, torch.bfloat16
    else:
        b, n, h, d, dtype = 1, 128, 2, 64, torch.float16
    causal = True
    say(f"flashtile demo on {torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}: "
          f"batch {b}, seqlen {n}, heads {h}, headdim {d}, {str(dtype).split('.')[-1]}, causal")
    seed = int(time.time())   # fresh inputs per run, recorded in the report so a run can be replayed
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    do = torch.randn(b, n, h, d, generator=gen).to(device, dtype)

    # 1. correctness against float64, with the flash-attn tolerance rule the tests apply (its eps: tolerance_eps)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out.backward(do)
    grads = [x.grad.clone() for x in (q, k, v)]
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rl, _ = attention_ref(*ref, causal=causal)
    ro.backward(do.double())
    std = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    so, _, _ = attention_ref(*std, causal=causal, upcast=False)
    so.backward(do)
    report = {"device": device, "shape": [b, n, h, d], "dtype": str(dtype), "seed": seed, "checks": {}}
    ok_all = True
    for name, ours, std_t, r in [("out", out, so, ro)] + [
            (f"d{nm}", g, s.grad, rr.grad) for nm, g, s, rr in zip("qkv", grads, std, ref)]:
        err = (ours.double() - r).abs().max().item()
        std_err = (std_t.double() - r).abs().max().item()
        ok = err <= 2 * std_err + tolerance_eps(dtype, r)
        ok_all &= ok
        report["checks"][name] = {"max_err": err, "standard_err": std_err, "ok": ok}
        say(f"  {name:4s} max|flashtile - fp64| = {err:.2e}   standard attention in {str(dtype).split('.')[-1]}:"
              f" {std_err:.2e}   {'OK' if ok else 'FAIL'}")
    lse_err = (lse.double() - rl).abs().max().item()
    say(f"  lse  max|flashtile - fp64| = {lse_err:.2e}")
    report["checks"]["lse"] = {"max_err": lse_err}

    # 2. side by side: fwd+bwd time and peak memory
    def step(fn):
        def run():
            for x in (q, k, v):
                x.grad = None
            fn(q, k, v, causal).backward(do)
        return run

    providers = {"flashtile": lambda q, k, v, c: flash_attn_func(q, k, v, causal=c),
                 "sdpa": _sdpa, "standard": _standard_attention}
    say("  fwd+bwd per call, " + ("do_bench median (as flashtile bench --mode train):" if cuda
                                   else "one call (CPU interpreter: not a speed claim):"))
    report["side_by_side"] = {}
    for name, fn in providers.items():
        step(fn)()  # warm-up / compile
        t, peak = _measure(step(fn), device)
        report["side_by_side"][name] = {"seconds": t, "peak_bytes": peak}
        mem = f"  peak {peak / 2**20:8.1f} MiB" if peak is not None else ""
        say(f"    {name:10s} {t * 1e3:9.2f} ms{mem}")

    # 3. the IO model (counted by running the paper's algorithms through a counting HBM)
    from .io_report import gpt2_medium_counts
    io = gpt2_medium_counts()
    say(f"  IO model (GPT-2 medium: N={io['N']}, d={io['d']}, M={io['M']} elements = 100 KB of fp16), HBM "
          f"accesses counted as the algorithms run: standard attention {io['standard']:,}, FlashAttention-1 "
          f"{io['fa1']:,}: {io['ratio']:.2f}x fewer, forward + backward (`flashtile io` for the full study)")
    report["io"] = io
    report["ok"] = ok_all
    say("demo " + ("passed" if ok_all else "FAILED"))
    return report

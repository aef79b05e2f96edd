"""Launch-order sweep under a causal mask: flashtile's forward and backward TFLOP/s for several head-grouped
program orders (flashtile.kernels.triton.configs.SCHEDULE_OVERRIDE, mods.tile_order), interleaved in one run.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/sweep_schedule.py --out DIR [--heads 64,128,256] [--seqlens 2048,8192]
        [--rounds 2] [--variants "name:fwd,dkdv,dq,rev;..."]

A variant fixes, per kernel, about how many programs one head group holds (0: the grid's own order) and whether
the dQ pass runs its query blocks last-first (rev 1). "default" is the shipped schedule (configs.CAUSAL_SCHEDULE).
Shapes: the FA3 grid (16k tokens, hidden 2048), bf16, causal. Every variant's output and gradients are compared
with the first variant's (the programs only run in another order: the results agree to rounding) before timing.
Timing: triton.testing.do_bench medians; the forward under torch.no_grad, the backward as o.backward(do) with
the graph retained. Rounds alternate the variants so that drift hits all of them. Writes DIR/sweep_schedule.json
and prints per point the mean over rounds (forward / backward TFLOP/s).
"""
import json
import os
import sys

import torch
import triton

import flashtile
from flashtile.kernels.triton import configs
from _sweep_args import sweep_args

DEFAULT_VARIANTS = "grid:0,0,0,0;p256r:256,256,256,1;p256:256,256,256,0;p128:128,128,128,0;dkdv128:0,128,0,0"


def parse_variants(text):
    out = {"default": {}}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, vals = item.split(":")
        fwd, dkdv, dq, rev = (int(x) for x in vals.split(","))
        out[name] = dict(fwd=fwd, dkdv=dkdv, dq=dq, dq_reverse=bool(rev))
    return out


def main():
    args = sweep_args(seqlens="2048,8192,16384", variants=DEFAULT_VARIANTS)
    variants = parse_variants(args.variants)
    points = [(d, n) for d in map(int, args.heads.split(",")) for n in map(int, args.seqlens.split(","))]
    rows = []
    for rnd in range(args.rounds):
        for d, n in points:
            b, h = 16384 // n, 2048 // d
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            do = torch.randn_like(q)
            flops = 4 * b * h * n * n * d / 2
            ref = None
            for name, override in variants.items():
                configs.SCHEDULE_OVERRIDE.clear()
                configs.SCHEDULE_OVERRIDE.update(override)
                o = flashtile.flash_attn_func(q, k, v, causal=True)
                grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                got = (o,) + grads
                if ref is None:
                    ref = got
                err = max((a.float() - r.float()).abs().max().item() for a, r in zip(got, ref))
                if err > 0.05:
                    raise SystemExit(f"{name} d{d} n{n}: differs from {next(iter(variants))} by {err}")
                with torch.no_grad():
                    ms_f = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=True),
                                                   return_mode="median")
                ms_b = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v],
                                               return_mode="median")
                r = dict(round=rnd, d=d, n=n, batch=b, nheads=h, variant=name, schedule=configs.schedule(d),
                         fwd_tflops=flops / ms_f / 1e9, bwd_tflops=2.5 * flops / ms_b / 1e9, max_diff=err)
                rows.append(r)
                print(f"round {rnd} d{d} n{n} {name:10s} fwd {r['fwd_tflops']:6.1f} bwd {r['bwd_tflops']:6.1f}",
                      flush=True)
            del q, k, v, do, o, grads, got, ref
            torch.cuda.empty_cache()
    configs.SCHEDULE_OVERRIDE.clear()
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   rows=rows), open(os.path.join(args.out, "sweep_schedule.json"), "w"), indent=1)
    print("\n| d | seqlen | " + " | ".join(variants) + " |")
    print("|---:|---:|" + "---:|" * len(variants))
    for d, n in points:
        cells = []
        for name in variants:
            rs = [r for r in rows if (r["d"], r["n"], r["variant"]) == (d, n, name)]
            cells.append(f"{sum(r['fwd_tflops'] for r in rs) / len(rs):.1f} / "
                         f"{sum(r['bwd_tflops'] for r in rs) / len(rs):.1f}")
        print(f"| {d} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())

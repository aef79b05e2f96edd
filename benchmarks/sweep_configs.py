"""Tile-config sweep of the Triton kernels beside SDPA (flash, cuDNN) on one GPU, in one run.

Usage (GPU machine, from the repo root):  PYTHONPATH=. python benchmarks/sweep_configs.py --out DIR
Prints one line per (shape, causal, pass, provider/config) with TFLOP/s; writes DIR/sweep.json.
FLOPs as docs/performance.md (FA3 paper §4.1): fwd 4*b*h*n^2*d (halved when causal), bwd 2.5x fwd.
"""
import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

import flashtile
from flashtile.kernels.triton import configs
from flashtile.kernels.triton.tuning import BWD, FWD  # the candidate lists (also autotuning's): configs.Config each

HEAD_DIMS = (128, 64, 256)


def shapes(seqlen: int):
    """The FA3 grid's (batch, heads, seqlen, head dim) at one seqlen: 16k tokens, hidden 2048."""
    return [(16384 // seqlen, 2048 // d, seqlen, d) for d in HEAD_DIMS]


def flops(b, h, n, d, causal, mode):
    f = 4 * b * h * n * n * d / (2 if causal else 1)
    return f * (2.5 if mode == "bwd" else 1.0)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def candidates(mode, d, args):
    """The configs tried for one (mode, head dim): tuning's candidate list, plus atomic-dQ variants and --extra-bwd."""
    if mode == "fwd":
        return list(FWD[d])
    extra = [eval(e, {"Config": configs.Config}) for e in args.extra_bwd.split(";") if e.strip()]
    base = extra if args.extra_only else list(BWD[d]) + extra
    if args.bwd_atomic == "none":
        return base
    # atomic dQ has no dQ pass: its own tiles (dq=...) do not apply
    atomic = list(dict.fromkeys(dataclasses.replace(c, atomic_dq=True, dq=None)
                                for c in (BWD[d][:2] if args.bwd_atomic == "first2" else base)))
    return atomic if args.bwd_atomic == "only" else base + atomic


def _compile_one(task):
    """Worker: run one config on a small problem with the sweep's specialisations (same batch, heads, head dim;
    seqlen 1024), so Triton's disk cache holds the kernels when the main process times them."""
    (b, h, _, d), causal, mode, config = task
    try:
        q, k, v = (torch.randn(b, 1024, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        configs.CONFIG_OVERRIDE[mode] = config
        o = flashtile.flash_attn_func(q, k, v, causal=causal)
        if mode == "bwd":
            o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported; the timing loop skips it
        return f"{type(e).__name__}: {str(e)[:160]}"


def precompile(args, hds, causals):
    import multiprocessing as mp
    t0 = time.time()
    tasks = [(shape, causal, mode, c) for shape in shapes(args.seqlen) if shape[3] in hds for causal in causals
             for mode in args.modes.split(",") for c in candidates(mode, shape[3], args)]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        errs = pool.map(_compile_one, tasks, chunksize=1)
    failed = {(c, mode, causal): e for (_, causal, mode, c), e in zip(tasks, errs) if e}
    print(f"# precompiled {len(tasks)} variants with {args.jobs} workers in {time.time() - t0:.0f} s, "
          f"{len(failed)} failed", flush=True)
    return failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--heads", default="64,128,256")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--causal", default="0,1", help="0 full, 1 causal, or both")
    ap.add_argument("--bwd-atomic", choices=("first2", "all", "only", "none"), default="first2",
                    help="backward tiles also tried with atomic dQ: the first two of tuning.BWD, all of them, only "
                         "the atomic variants, or none")
    ap.add_argument("--extra-only", action="store_true", help="backward: only the --extra-bwd configs")
    ap.add_argument("--extra-bwd", default="", help="more backward configs, ';'-separated Python expressions "
                    "of configs.Config, e.g. 'Config(64, 128, 8, 2, dq=(128, 64, 8, 3))'")
    ap.add_argument("--jobs", type=int, default=0, help="compile every variant first in this many processes")
    ap.add_argument("--seqlen", type=int, default=8192, help="sequence length (batch = 16384 // seqlen)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    hds = [int(x) for x in args.heads.split(",")]
    rows = []
    dev = torch.cuda.get_device_name()
    print(dev, torch.__version__, triton.__version__, flush=True)
    causals = [bool(int(c)) for c in args.causal.split(",")]
    failed = precompile(args, hds, causals) if args.jobs else {}
    for (b, h, n, d) in shapes(args.seqlen):
        if d not in hds:
            continue
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)
        for causal in causals:
            ref = None
            for mode in args.modes.split(","):
                # peers
                for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel([be]):
                            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                            if name == "cudnn":
                                ref = o.detach().transpose(1, 2).float()
                            if mode == "fwd":
                                ms = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                            else:
                                ms = triton.testing.do_bench(lambda: o.backward(dot, retain_graph=True), warmup=25,
                                                             rep=100, grad_to_none=[qt, kt, vt], return_mode="median")
                        tf = flops(b, h, n, d, causal, mode) / ms / 1e9
                        rows.append(dict(shape=[b, h, n, d], causal=causal, mode=mode, provider=name, ms=ms, tflops=tf))
                        print(f"{b},{h},{n},{d} causal={causal:d} {mode} {name:12s} {ms:8.3f} ms {tf:7.1f} TF", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"{name} failed: {e!r}"[:200], flush=True)
                for config in candidates(mode, d, args):
                    # as printed / saved: the tile, the flags set, then each launch's own tiles (dq, dv) if set
                    cfg = (dataclasses.astuple(config)[:4]
                           + tuple(f for f in ("atomic_dq", "split_dkdv") if getattr(config, f))
                           + sum(((f, *getattr(config, f)) for f in ("dq", "dv") if getattr(config, f)), ()))
                    configs.CONFIG_OVERRIDE.clear()
                    configs.CONFIG_OVERRIDE[mode] = config
                    det = False
                    if (config, mode, causal) in failed:
                        print(f"ft{cfg} failed to compile: {failed[(config, mode, causal)]}"[:300], flush=True)
                        continue
                    try:
                        t0 = time.time()
                        o = flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=det)
                        torch.cuda.synchronize()
                        err = ((o.float() - ref).norm() / ref.norm()).item() if ref is not None else float("nan")
                        if mode == "fwd":
                            ms = bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal))
                        else:
                            o.backward(do, retain_graph=True)
                            ms = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), warmup=25, rep=100,
                                                         grad_to_none=[q, k, v], return_mode="median")
                        tf = flops(b, h, n, d, causal, mode) / ms / 1e9
                        rows.append(dict(shape=[b, h, n, d], causal=causal, mode=mode,
                                         provider="flashtile",
                                         config=cfg, ms=ms, tflops=tf, rel_err=err))
                        print(f"{b},{h},{n},{d} causal={causal:d} {mode} ft{cfg!s:18s} {ms:8.3f} ms {tf:7.1f} TF "
                              f"err={err:.2e} ({time.time()-t0:.1f}s)", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"ft{cfg} failed: {e!r}"[:300], flush=True)
                configs.CONFIG_OVERRIDE.clear()
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()
    json.dump(dict(device=dev, torch=torch.__version__, triton=triton.__version__, rows=rows),
              open(f"{args.out}/sweep.json", "w"), indent=1)
    # summary: best flashtile config per (shape, causal, mode) vs peers
    print("\nSUMMARY")
    keys = sorted({(tuple(r["shape"]), r["causal"], r["mode"]) for r in rows})
    for key in keys:
        rs = [r for r in rows if (tuple(r["shape"]), r["causal"], r["mode"]) == key]
        ft = [r for r in rs if r["provider"] == "flashtile"]
        best = max(ft, key=lambda r: r["tflops"]) if ft else None
        peers = {}
        for r in rs:
            if r["provider"] != "flashtile":
                peers[r["provider"]] = max(peers.get(r["provider"], 0), r["tflops"])
        print(key, "best", best and (best["config"], round(best["tflops"], 1)), {k: round(v, 1) for k, v in peers.items()})


if __name__ == "__main__":
    sys.exit(main())

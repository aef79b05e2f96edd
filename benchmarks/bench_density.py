"""Block-sparse attention runtime vs block density (FlashAttention paper, Figure 2 right): is it linear in the
fraction of non-empty tiles?

GPU run (repo root, one H100/H200, about 2-4 minutes):

    PYTHONPATH=. python benchmarks/bench_density.py --out DIR

CPU smoke run (Triton interpreter, tiny sizes):

    PYTHONPATH=. python benchmarks/bench_density.py --small --out /tmp/bench_density_smoke

Problem: flashtile.blocksparse.blocksparse_attn_func, batch 1, 16 heads, headdim 128, bf16, seqlen 4096, 8192,
16384 (--seqlens); BLOCK_SIZE 128. For each seqlen, one random order of the off-diagonal tiles (fixed seed);
the block mask at density x keeps the diagonal tiles (so no query row is empty) plus the first
round(x * n^2) - n tiles of that order, so the patterns are nested (each density's tiles contain the previous
one's). It is built with create_block_mask over a torch callable reading the (n, n) tile table, so every tile
is either full or empty (no per-element masking): runtime should be a * density + b.
Densities 0.1, 0.2, ..., 1.0 (--densities); the density reported is the block mask's own (tiles visited / n^2).
Timing: triton.testing.do_bench medians of the forward (no_grad) and of the backward alone
(autograd.grad(out, (q, k, v), dout, retain_graph=True) on a stored forward). Also the dense flash_attn_func
at the same size for scale. Effective TFLOP/s: 4 * d * seqlen^2 * density * heads (forward), 2.5x (backward).
Fit: least squares t = a * density + b per (seqlen, pass), R^2, and t(0.1) / t(1.0) (measured; 0.1 would be
perfectly proportional). Prints Markdown tables last; --out DIR writes DIR/bench_density.json,
DIR/bench_density.md and DIR/bench_density.png (time vs density, if matplotlib is installed).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:   # CPU smoke run: kernels through the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from flashtile import flash_attn_func  # noqa: E402
from flashtile.bench.report import write_script_results  # noqa: E402
from flashtile.blocksparse import blocksparse_attn_func, create_block_mask  # noqa: E402


def bench_ms(fn):
    if HAS_CUDA:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    t = time.perf_counter()              # CPU interpreter smoke run: one call, the time means nothing
    fn()
    return (time.perf_counter() - t) * 1e3


def tile_tables(n, densities, seed):
    """{density: (n, n) bool tile table}: the diagonal plus a prefix of one random order of the other tiles."""
    g = torch.Generator().manual_seed(seed)
    off = [(i, j) for i in range(n) for j in range(n) if i != j]
    order = torch.randperm(len(off), generator=g).tolist()
    tables = {}
    for x in densities:
        t = torch.eye(n, dtype=torch.bool)
        extra = max(0, round(x * n * n) - n)
        for idx in order[:extra]:
            t[off[idx]] = True
        tables[x] = t
    return tables


def linear_fit(xs, ys):
    """Least squares y = a x + b -> (a, b, R^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    a = sxy / sxx if sxx else 0.0
    b = my - a * mx
    ss_res = sum((y - (a * x + b)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, (1.0 - ss_res / ss_tot) if ss_tot else 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for bench_density.{json,md,png}")
    ap.add_argument("--seqlens", default=None, help="comma-separated (default 4096,8192,16384)")
    ap.add_argument("--densities", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--headdim", type=int, default=None)
    ap.add_argument("--block", type=int, default=None, help="BLOCK_SIZE (default 128; 16 with --small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    args = ap.parse_args()
    small = args.small or not HAS_CUDA
    dev = "cuda" if HAS_CUDA else "cpu"
    dtype = torch.bfloat16
    batch = 1
    heads = args.heads or (2 if small else 16)
    d = args.headdim or (32 if small else 128)
    bs = args.block or (16 if small else 128)
    seqlens = [int(x) for x in (args.seqlens or ("256" if small else "4096,8192,16384")).split(",")]
    densities = [float(x) for x in args.densities.split(",")]
    device_name = torch.cuda.get_device_name() if HAS_CUDA else f"CPU ({platform.processor() or 'interpreter'})"
    print(f"# {device_name}, torch {torch.__version__}, triton {triton.__version__}; batch {batch}, heads {heads}, "
          f"headdim {d}, {str(dtype)[6:]}, BLOCK_SIZE {bs}", flush=True)
    rows, dense_rows = [], []
    for s in seqlens:
        n = -(-s // bs)
        gen = torch.Generator(device=dev).manual_seed(s)
        q, k, v, do = (torch.randn(batch, s, heads, d, generator=gen, device=dev, dtype=dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        # dense reference point
        with torch.no_grad():
            ms_f = bench_ms(lambda: flash_attn_func(q, k, v))
        out = flash_attn_func(q, k, v)
        ms_b = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
        del out
        dense_rows.append(dict(seqlen=s, fwd_ms=ms_f, bwd_ms=ms_b))
        print(f"seqlen {s}: dense flash_attn_func fwd {ms_f:.3f} ms, bwd {ms_b:.3f} ms", flush=True)
        tables = tile_tables(n, densities, args.seed + s)
        for x in densities:
            table = tables[x].to(dev)
            bm = create_block_mask(lambda b, h, qi, ki: table[qi // bs, ki // bs], None, None, s, s,
                                   BLOCK_SIZE=bs, device=dev)
            dens = bm.density()
            assert int(bm.kv_num_blocks.sum()) == 0 or s % bs, "a tile table makes full / empty tiles only"
            with torch.no_grad():
                ms_f = bench_ms(lambda: blocksparse_attn_func(q, k, v, bm))
            out = blocksparse_attn_func(q, k, v, bm)
            ms_b = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            del out
            fl = 4.0 * d * s * s * dens * heads * batch
            for pas, ms, flops in (("fwd", ms_f, fl), ("bwd", ms_b, 2.5 * fl)):
                rows.append(dict(seqlen=s, target_density=x, density=dens, pass_=pas, ms=ms, tflops=flops / ms / 1e9))
            print(f"seqlen {s} density {dens:.3f} (target {x:.1f}): fwd {ms_f:9.3f} ms {fl / ms_f / 1e9:7.4g} TF/s, "
                  f"bwd {ms_b:9.3f} ms {2.5 * fl / ms_b / 1e9:7.4g} TF/s", flush=True)
            del bm, table
        del q, k, v, do
        if HAS_CUDA:
            torch.cuda.empty_cache()

    fits = []
    for s in seqlens:
        for pas in ("fwd", "bwd"):
            pts = [r for r in rows if r["seqlen"] == s and r["pass_"] == pas]
            a, b, r2 = linear_fit([r["density"] for r in pts], [r["ms"] for r in pts])
            lo = min(pts, key=lambda r: abs(r["target_density"] - 0.1))
            hi = min(pts, key=lambda r: abs(r["target_density"] - 1.0))
            fits.append(dict(seqlen=s, pass_=pas, a_ms=a, b_ms=b, r2=r2, t_lo_over_t_hi=lo["ms"] / hi["ms"],
                             lo_density=lo["density"], hi_density=hi["density"],
                             dense_ms=next(dr[f"{pas}_ms"] for dr in dense_rows if dr["seqlen"] == s)))
    md = markdown(rows, fits, device_name, batch, heads, d, dtype, bs, small)
    print()
    print(md)
    if args.out:
        meta = dict(device=device_name, batch=batch, heads=heads, headdim=d, dtype=str(dtype), block_size=bs,
                    small=small, seed=args.seed)
        write_script_results(args.out, "bench_density", md, meta, rows=rows, dense=dense_rows, fits=fits)
        png = plot(rows, fits, seqlens, os.path.join(args.out, "bench_density.png"), device_name)
        print(f"\nwrote {args.out}/bench_density.json, bench_density.md" + (", bench_density.png" if png else ""))


def markdown(rows, fits, device_name, batch, heads, d, dtype, bs, small):
    lines = [f"{device_name}; blocksparse_attn_func, batch {batch}, heads {heads}, headdim {d}, {str(dtype)[6:]}, "
             f"BLOCK_SIZE {bs}, random full tiles + diagonal" + (" (CPU interpreter smoke run: times are not "
                                                                  "performance)" if small else ""), ""]
    lines.append("| seqlen | density | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |")
    lines.append("|---:|---:|---:|---:|---:|---:|")
    by = {(r["seqlen"], r["target_density"], r["pass_"]): r for r in rows}
    for (s, x, pas), r in by.items():
        if pas != "fwd":
            continue
        rb = by[(s, x, "bwd")]
        lines.append(f"| {s} | {r['density']:.3f} | {r['ms']:.3f} | {r['tflops']:.4g} | {rb['ms']:.3f} | "
                     f"{rb['tflops']:.4g} |")
    lines.append("")
    lines.append("Least-squares fit t = a * density + b (ms); t(lo)/t(hi) measured at the lowest / highest density "
                 "(lo/hi is the proportional ratio); dense = flash_attn_func at the same size:")
    lines.append("")
    lines.append("| seqlen | pass | a (ms) | b (ms) | R^2 | t(lo)/t(hi) | lo/hi density | dense ms |")
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|")
    for f in fits:
        lines.append(f"| {f['seqlen']} | {f['pass_']} | {f['a_ms']:.3f} | {f['b_ms']:.3f} | {f['r2']:.4f} | "
                     f"{f['t_lo_over_t_hi']:.3f} | {f['lo_density'] / f['hi_density']:.3f} | {f['dense_ms']:.3f} |")
    return "\n".join(lines)


def plot(rows, fits, seqlens, path, device_name):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, pas in zip(axes, ("fwd", "bwd")):
        for s in seqlens:
            pts = sorted((r["density"], r["ms"]) for r in rows if r["seqlen"] == s and r["pass_"] == pas)
            f = next(f for f in fits if f["seqlen"] == s and f["pass_"] == pas)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=f"seqlen {s} (R^2 {f['r2']:.3f})")
            ax.plot([0, 1], [f["b_ms"], f["a_ms"] + f["b_ms"]], "-", color=line.get_color(), alpha=0.6)
        ax.set_xlabel("block density (fraction of tiles visited)")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"block-sparse {'forward' if pas == 'fwd' else 'backward'}")
        ax.set_xlim(0, 1.05)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"flashtile blocksparse_attn_func runtime vs density ({device_name})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()

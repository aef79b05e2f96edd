"""Causal block-sparse attention time against tile density, fitted as t = a * density + b (flashtile and torch.flex).

FlashAttention paper, Figure 2 right; issue #37's target: over densities 0.1-1.0, b <= 5% of the dense time, at 4k as
well as 16k.

GPU run (repo root, one H100/H200, about 3 minutes, a third of it torch.compile):

    PYTHONPATH=. python benchmarks/bench_density.py --out DIR

CPU smoke run (Triton interpreter, tiny sizes; torch FlexAttention only as an eager forward check):

    PYTHONPATH=. python benchmarks/bench_density.py --small --out /tmp/bench_density_smoke

Problem: batch 2, 16 heads, headdim 128, bf16, seqlen 4096 and 16384 (--seqlens); BLOCK_SIZE 128 (--block).
Masks: causal, block-sparse. Of the n (n + 1) / 2 causal tiles (n = seqlen / BLOCK_SIZE) the n diagonal tiles are
always kept (causal inside, so no query row is empty) and the others are taken in one seeded random order: density x
keeps max(n, round(x * n (n + 1) / 2)) tiles, so each density's tiles contain the previous one's and density 1.0 is
the causal mask. The density reported and fitted is the mask's own: kept tiles / causal tiles. Densities 0.1, 0.2,
..., 1.0 (--densities).
Providers, each with a block mask built from the same tile lists (the diagonal tiles partial, masked by kv <= q;
the other kept tiles full):
  flashtile.flex  flashtile.flex.flex_attention(q, k, v, block_mask=BlockMask(the lists, mask_mod=causal_mask()))
  torch.flex      torch.compile(flex_attention) (dynamic=False) on (batch, heads, seqlen, d) copies, block mask
                  BlockMask.from_kv_blocks(the same lists, mask_mod=kv <= q on the kept tiles: torch's eager path
                  applies the mask_mod on every tile, its compiled kernels on the partial ones only)
and flash_attn_func(causal=True) at each seqlen, for scale.
Check before timing, each provider at each density: max|out - ref| / max|ref| against float64
flashtile.reference.dense.attention_ref with the point's element mask on batch {0, b-1} x heads {0, h-1} x 128
query rows spread over the sequence; above flashtile.bench.measure.TOLERANCE the point is recorded wrong and not
timed.
Timing: triton.testing.do_bench medians (warmup 25 ms, rep 100 ms) of the forward (no_grad) and of forward + backward
(grad_to_none on q, k, v); --cuda-graph: the forward replayed from a CUDA graph (do_bench_cudagraph), where a
call's host time would otherwise set the time of a short forward. TFLOP/s count the visible (q, k) pairs: forward 4 * d * pairs * heads * batch,
forward + backward 3.5x.
Fit: least squares t = a * density + b per (provider, seqlen, pass) over the densities timed, with b / t(1.0) (the
target is at most TARGET_B_FRACTION), R^2, and each point's residual t - (a * density + b), also relative to t.
--budget-s: points not started once that many seconds have passed are listed as skipped.
Prints Markdown tables last; --out DIR writes DIR/bench_density.json, DIR/bench_density.md and DIR/bench_density.png
(time against density, if matplotlib is installed).
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
from flashtile.bench import measure  # noqa: E402
from flashtile.bench.report import write_script_results  # noqa: E402
from flashtile.blocksparse import _lists  # noqa: E402
from flashtile.flex import BlockMask, causal_mask, flex_attention  # noqa: E402
from flashtile.reference.dense import attention_ref  # noqa: E402

try:
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
except ImportError:  # pragma: no cover - old torch
    TorchBlockMask = torch_flex_attention = None

TARGET_B_FRACTION = 0.05   # issue #37: the fit's intercept at most this fraction of the time at density 1.0
CHECK_ROWS = 128
PASSES = ("fwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5}


def bench_ms(fn, grads=None):
    if HAS_CUDA:
        return measure.time_cuda_ms(fn, 25, 100, grads)
    t = time.perf_counter()              # CPU interpreter smoke run: one call, the time means nothing
    fn()
    return (time.perf_counter() - t) * 1e3


# ----------------------------------------------------------------------------------------------------------
# Masks

def causal_tile_tables(n: int, densities, seed: int) -> dict:
    """{density: (n, n) bool tile table}: the diagonal plus a prefix of one seeded random order of the tiles below
    it, max(n, round(density * n (n + 1) / 2)) tiles in all."""
    g = torch.Generator().manual_seed(seed)
    below = [(i, j) for i in range(n) for j in range(i)]
    order = torch.randperm(len(below), generator=g).tolist()
    total = n * (n + 1) // 2
    tables = {}
    for x in densities:
        t = torch.eye(n, dtype=torch.bool)
        for idx in order[:max(0, round(x * total) - n)]:
            t[below[idx]] = True
        tables[x] = t
    return tables


def tile_density(table: torch.Tensor) -> float:
    """Kept tiles / causal tiles."""
    n = table.shape[0]
    return int(table.sum()) / (n * (n + 1) // 2)


def visible_pairs(table: torch.Tensor, bs: int) -> int:
    """Visible (q, k) pairs of one (batch, head): full tiles bs^2 each, the diagonal ones bs (bs + 1) / 2."""
    n = table.shape[0]
    return (int(table.sum()) - n) * bs * bs + n * bs * (bs + 1) // 2


def torch_mask_mod(tab: torch.Tensor, bs: int):
    """kv <= q on the kept tiles of tab ((n, n) bool, read when the mask is evaluated: one function per seqlen, so
    torch.compile keeps one graph while the densities change tab in place)."""
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & tab[q_idx // bs, kv_idx // bs]
    return mask


def block_masks(table: torch.Tensor, seqlen: int, bs: int, dev, torch_mask=None):
    """(flashtile BlockMask, torch BlockMask or None) of kv <= q restricted to the kept tiles of table, from one set of
    tile lists: the diagonal tiles partial, the other kept tiles full, the rest skipped. flashtile's mask_mod is
    causal_mask() (it applies on the partial tiles only); torch's is torch_mask (the whole mask, as its eager path
    applies the mask_mod on every tile; its compiled kernels evaluate it on the partial tiles only)."""
    n = table.shape[0]
    partial = torch.eye(n, dtype=torch.bool, device=dev).view(1, 1, n, n)
    full = table.to(dev).view(1, 1, n, n) & ~partial
    kv = _lists(partial) + _lists(full)
    qs = _lists(partial.transpose(-1, -2)) + _lists(full.transpose(-1, -2))
    ft = BlockMask((1, 1, seqlen, seqlen), bs, None, *kv, *qs, mask_mod=causal_mask())
    if torch_mask is None or TorchBlockMask is None:
        return ft, None
    return ft, TorchBlockMask.from_kv_blocks(*kv, BLOCK_SIZE=bs, mask_mod=torch_mask, seq_lengths=(seqlen, seqlen))


def oracle_error(out, q, k, v, table: torch.Tensor, bs: int) -> float:
    """out (b, s, h, d) against float64 attention_ref on batch {0, b-1} x heads {0, h-1} x CHECK_ROWS query rows,
    under kv <= q restricted to the kept tiles: max|out - ref| / max|ref|."""
    b_idx, h_idx = measure.check_slice(q.shape[0], q.shape[2])
    s = q.shape[1]
    rows = torch.linspace(0, s - 1, min(s, CHECK_ROWS)).round().long().unique().to(q.device)
    cols = torch.arange(s, device=q.device)
    tab = table.to(q.device)
    mask = (cols.view(1, -1) <= rows.view(-1, 1)) & tab[rows // bs][:, cols // bs]
    qs = measure.take_slice(q.detach(), b_idx, h_idx)[:, rows]
    ks, vs = (measure.take_slice(x.detach(), b_idx, h_idx) for x in (k, v))
    ref, _, _ = attention_ref(qs, ks, vs, attn_mask=mask.view(1, 1, len(rows), s))
    return measure.max_rel_error(measure.take_slice(out.detach(), b_idx, h_idx)[:, rows], ref)


# ----------------------------------------------------------------------------------------------------------
# Fit

def linear_fit(xs, ys) -> dict:
    """Least squares y = a x + b: {a, b, r2, residuals: y - (a x + b) per point}."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    a = sxy / sxx if sxx else 0.0
    b = my - a * mx
    residuals = [y - (a * x + b) for x, y in zip(xs, ys)]
    ss_res = sum(r * r for r in residuals)
    ss_tot = sum((y - my) ** 2 for y in ys)
    return dict(a=a, b=b, r2=(1.0 - ss_res / ss_tot) if ss_tot else 1.0, residuals=residuals)


def fit_rows(rows) -> list:
    """One fit per (provider, seqlen, pass) with at least two densities timed: a_ms, b_ms, r2, t_dense_ms (the time at
    density 1.0, None if not timed), b_over_dense, meets_target (b_over_dense <= TARGET_B_FRACTION), and points
    (density, ms, fit_ms, residual_ms, residual_rel = residual / ms)."""
    fits = []
    for key in dict.fromkeys((r["provider"], r["seqlen"], r["pass_"]) for r in rows):
        pts = sorted((r["density"], r["ms"]) for r in rows if (r["provider"], r["seqlen"], r["pass_"]) == key)
        if len(pts) < 2:
            continue
        f = linear_fit([p[0] for p in pts], [p[1] for p in pts])
        t_dense = next((ms for x, ms in pts if abs(x - 1.0) < 1e-9), None)
        frac = f["b"] / t_dense if t_dense else None
        points = [dict(density=x, ms=ms, fit_ms=ms - r, residual_ms=r, residual_rel=r / ms)
                  for (x, ms), r in zip(pts, f["residuals"])]
        fits.append(dict(provider=key[0], seqlen=key[1], pass_=key[2], a_ms=f["a"], b_ms=f["b"], r2=f["r2"],
                         t_dense_ms=t_dense, b_over_dense=frac,
                         meets_target=None if frac is None else frac <= TARGET_B_FRACTION,
                         max_abs_residual_rel=max(abs(p["residual_rel"]) for p in points), points=points))
    return fits


# ----------------------------------------------------------------------------------------------------------
# Run

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for bench_density.{json,md,png}")
    ap.add_argument("--seqlens", default=None, help="comma-separated (default 4096,16384; 128 with --small)")
    ap.add_argument("--densities", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--headdim", type=int, default=None)
    ap.add_argument("--block", type=int, default=None, help="BLOCK_SIZE (default 128; 16 with --small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=None, help="points not started after this many seconds are "
                                                                 "skipped")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--cuda-graph", action="store_true", help="time the forward replayed from a CUDA graph (the "
                                                               "kernels without the host time of a call)")
    args = ap.parse_args(argv)
    if args.cuda_graph and not HAS_CUDA:
        ap.error("--cuda-graph needs a CUDA device")
    small = args.small or not HAS_CUDA
    args.small = small
    args.batch = args.batch or (1 if small else 2)
    args.heads = args.heads or (2 if small else 16)
    args.headdim = args.headdim or (32 if small else 128)
    args.block = args.block or (16 if small else 128)
    args.seqlens = [int(x) for x in (args.seqlens or ("128" if small else "4096,16384")).split(",")]
    args.densities = [float(x) for x in args.densities.split(",")]
    bad = [s for s in args.seqlens if s % args.block]
    if bad:
        ap.error(f"--seqlens {bad}: each a multiple of --block {args.block}")
    return args


def main(argv=None):
    args = parse_args(argv)
    dev = "cuda" if HAS_CUDA else "cpu"
    dtype = torch.bfloat16
    tol = measure.TOLERANCE[dtype]
    batch, heads, d, bs = args.batch, args.heads, args.headdim, args.block
    use_torch_flex = HAS_CUDA and torch_flex_attention is not None
    device_name = torch.cuda.get_device_name() if HAS_CUDA else f"CPU ({platform.processor() or 'interpreter'})"
    print(f"# {device_name}, torch {torch.__version__}, triton {triton.__version__}; batch {batch}, heads {heads}, "
          f"headdim {d}, {str(dtype)[6:]}, BLOCK_SIZE {bs}", flush=True)
    not_run = {}
    if torch_flex_attention is None:
        not_run["torch.flex"] = f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    elif not use_torch_flex:
        not_run["torch.flex"] = "timed on GPUs only (on a CPU: an eager forward check)"
    flex_compiled = torch.compile(torch_flex_attention, dynamic=False) if use_torch_flex else None
    budget = measure.Budget(args.budget_s)
    rows, checks, dense_rows, skipped = [], [], [], []
    for s in args.seqlens:
        n = s // bs
        if budget.spent():
            skipped += [dict(seqlen=s, target_density=x, reason=f"--budget-s {args.budget_s:g} reached")
                        for x in args.densities]
            print(f"seqlen {s}: skipped (--budget-s {args.budget_s:g} reached)", flush=True)
            continue
        gen = torch.Generator(device=dev).manual_seed(s)
        q, k, v, do = (torch.randn(batch, s, heads, d, generator=gen, device=dev, dtype=dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2).contiguous()
        dense = dict(seqlen=s)
        for pas, ms in zip(PASSES, time_passes(lambda: flash_attn_func(q, k, v, causal=True), [q, k, v], do,
                                                   args.cuda_graph)):
            dense[f"{pas}_ms"] = ms
        dense_rows.append(dense)
        print(f"seqlen {s}: flash_attn_func causal fwd {dense['fwd_ms']:.3f} ms, fwd+bwd {dense['fwd+bwd_ms']:.3f} ms",
              flush=True)
        tables = causal_tile_tables(n, args.densities, args.seed + s)
        tab = torch.zeros(n, n, dtype=torch.bool, device=dev)
        torch_mask = torch_mask_mod(tab, bs) if torch_flex_attention is not None else None
        for x in args.densities:
            table = tables[x]
            dens = tile_density(table)
            if budget.spent():
                skipped.append(dict(seqlen=s, target_density=x, reason=f"--budget-s {args.budget_s:g} reached"))
                print(f"seqlen {s} density {dens:.3f}: skipped (--budget-s {args.budget_s:g} reached)", flush=True)
                continue
            tab.copy_(table)
            bm_ft, bm_torch = block_masks(table, s, bs, dev, torch_mask)
            providers = {"flashtile.flex": dict(fn=lambda bm=bm_ft: flex_attention(q, k, v, block_mask=bm),
                                                to_bshd=lambda o: o, grads=[q, k, v], g_out=do)}
            if bm_torch is not None:
                fx = flex_compiled if use_torch_flex else torch_flex_attention
                # FlexAttention has no CPU backward (it refuses inputs that require grad): a forward check there
                src = (qt, kt, vt) if use_torch_flex else (qt.detach(), kt.detach(), vt.detach())
                providers["torch.flex"] = dict(fn=lambda bm=bm_torch, fx=fx, src=src: fx(*src, block_mask=bm),
                                               to_bshd=lambda o: o.transpose(1, 2), grads=[qt, kt, vt], g_out=dot)
            fl = 4.0 * d * visible_pairs(table, bs) * heads * batch
            for pname, pv in providers.items():
                with torch.no_grad():
                    err = oracle_error(pv["to_bshd"](pv["fn"]()), q, k, v, table, bs)
                ok = err <= tol                                       # nan fails
                checks.append(dict(provider=pname, seqlen=s, target_density=x, density=dens, rel_err=err, ok=ok))
                if not ok:
                    print(f"seqlen {s} density {dens:.3f} {pname}: WRONG, max|out - ref| / max|ref| {err:.2e} > {tol}",
                          flush=True)
                    continue
                if pname in not_run:
                    continue
                times = time_passes(pv["fn"], pv["grads"], pv["g_out"], args.cuda_graph)
                for pas, ms in zip(PASSES, times):
                    rows.append(dict(provider=pname, seqlen=s, target_density=x, density=dens, pass_=pas, ms=ms,
                                     tflops=FLOP_FACTOR[pas] * fl / ms / 1e9))
                print(f"seqlen {s} density {dens:.3f} (target {x:.1f}) {pname:15s} check {err:.1e}: "
                      f"fwd {times[0]:9.3f} ms {fl / times[0] / 1e9:7.4g} TF/s, "
                      f"fwd+bwd {times[1]:9.3f} ms {3.5 * fl / times[1] / 1e9:7.4g} TF/s", flush=True)
            del bm_ft, bm_torch, providers
        del q, k, v, do, qt, kt, vt, dot
        if HAS_CUDA:
            torch.cuda.empty_cache()

    fits = fit_rows(rows)
    md = markdown(rows, fits, checks, dense_rows, not_run, skipped, device_name, args, dtype, tol)
    print()
    print(md)
    if args.out:
        meta = dict(device=device_name, batch=batch, heads=heads, headdim=d, dtype=str(dtype), block_size=bs,
                    small=args.small, cuda_graph=args.cuda_graph, seed=args.seed, tolerance=tol, target_b_fraction=TARGET_B_FRACTION,
                    budget_s=args.budget_s)
        write_script_results(args.out, "bench_density", md, meta, rows=rows, fits=fits, checks=checks,
                             dense=dense_rows, not_run=not_run, skipped=skipped)
        png = plot(rows, fits, os.path.join(args.out, "bench_density.png"), device_name)
        print(f"\nwrote {args.out}/bench_density.json, bench_density.md" + (", bench_density.png" if png else ""))
    return 0


def time_passes(fn, grads, g_out, cuda_graph=False):
    """(forward ms under no_grad, forward + backward ms); cuda_graph: the forward replayed from a CUDA graph
    (triton.testing.do_bench_cudagraph: the kernels' time without the host's)."""
    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(g_out)

    if cuda_graph:
        from triton.testing import do_bench_cudagraph
        fwd()   # (compiled and warm before the capture)
        return do_bench_cudagraph(fwd, rep=100, return_mode="median"), bench_ms(fwd_bwd, grads)
    return bench_ms(fwd), bench_ms(fwd_bwd, grads)


# ----------------------------------------------------------------------------------------------------------
# Report

def markdown(rows, fits, checks, dense_rows, not_run, skipped, device_name, args, dtype, tol):
    lines = [f"{device_name}; batch {args.batch}, heads {args.heads}, headdim {args.headdim}, {str(dtype)[6:]}, "
             f"BLOCK_SIZE {args.block}, causal block-sparse masks (diagonal tiles kept, the others in a seeded random "
             f"order)" + (" (CPU interpreter smoke run: times are not performance)" if args.small else "")
             + ("; forward times replayed from a CUDA graph" if args.cuda_graph else ""), ""]
    if not_run or skipped:
        lines += ["Not run:", ""]
        lines += [f"- {pname}: {reason}" for pname, reason in not_run.items()]
        lines += [f"- seqlen {c['seqlen']}, density {c['target_density']:.1f}: {c['reason']}" for c in skipped]
        lines.append("")
    wrong = [c for c in checks if not c["ok"]]
    worst = max((c["rel_err"] for c in checks if c["ok"]), default=None)
    lines.append(f"Checks: {len(checks) - len(wrong)} of {len(checks)} outputs within {tol} of the float64 oracle "
                 f"(max|out - ref| / max|ref|)" + (f", largest {worst:.1e}" if worst is not None else "") + "."
                 + "".join(f" WRONG, not timed: {c['provider']} seqlen {c['seqlen']} density {c['density']:.3f} "
                           f"({c['rel_err']:.1e})." for c in wrong))
    lines.append("")
    resid = {(f["provider"], f["seqlen"], f["pass_"], p["density"]): p["residual_rel"] for f in fits
             for p in f["points"]}
    lines.append("Points (residual: t - fit, relative to t):")
    lines.append("")
    lines.append("| provider | seqlen | density | fwd ms | fwd TFLOP/s | fwd residual | fwd+bwd ms | fwd+bwd TFLOP/s | "
                 "fwd+bwd residual |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    by = {(r["provider"], r["seqlen"], r["target_density"], r["pass_"]): r for r in rows}
    for (pname, s, x, pas), r in by.items():
        if pas != "fwd":
            continue
        rb = by[(pname, s, x, "fwd+bwd")]
        cells = []
        for rr in (r, rb):
            res = resid.get((pname, s, rr["pass_"], rr["density"]))
            cells.append(f"{rr['ms']:.3f} | {rr['tflops']:.4g} | " + (f"{100 * res:+.1f}%" if res is not None else ""))
        lines.append(f"| {pname} | {s} | {r['density']:.3f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Least-squares fit t = a * density + b (ms); target b / t(1.0) <= {TARGET_B_FRACTION}; "
                 "flash_attn_func causal: the dense kernel at the same size:")
    lines.append("")
    lines.append("| provider | seqlen | pass | a (ms) | b (ms) | t(1.0) ms | b / t(1.0) | target | R^2 | "
                 "max abs residual / t | flash_attn_func causal ms |")
    lines.append("|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|")
    dense = {(dr["seqlen"], pas): dr[f"{pas}_ms"] for dr in dense_rows for pas in PASSES}
    for f in fits:
        t1 = f"{f['t_dense_ms']:.3f}" if f["t_dense_ms"] else ""
        frac = f"{f['b_over_dense']:.3f}" if f["b_over_dense"] is not None else ""
        target = "" if f["meets_target"] is None else ("met" if f["meets_target"] else "missed")
        lines.append(f"| {f['provider']} | {f['seqlen']} | {f['pass_']} | {f['a_ms']:.3f} | {f['b_ms']:.3f} | {t1} | "
                     f"{frac} | {target} | {f['r2']:.4f} | {100 * f['max_abs_residual_rel']:.1f}% | "
                     f"{dense[(f['seqlen'], f['pass_'])]:.3f} |")
    return "\n".join(lines)


def plot(rows, fits, path, device_name):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, pas in zip(axes, PASSES):
        for f in (f for f in fits if f["pass_"] == pas):
            pts = [(p["density"], p["ms"]) for p in f["points"]]
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o",
                            label=f"{f['provider']} {f['seqlen']} (R^2 {f['r2']:.3f})")
            ax.plot([0, 1], [f["b_ms"], f["a_ms"] + f["b_ms"]], "-", color=line.get_color(), alpha=0.6)
        ax.set_xlabel("block density (fraction of causal tiles kept)")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"causal block-sparse, {'forward' if pas == 'fwd' else 'forward + backward'}")
        ax.set_xlim(0, 1.05)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"runtime against block density ({device_name})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())

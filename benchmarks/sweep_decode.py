"""Decode sweep: tile configs and split counts of the split-KV decode kernel, beside SDPA cuDNN, on one GPU.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/sweep_decode.py --out DIR/sweep_decode.json
CPU smoke test (tiny problem, interpreter; no CUDA graphs, no cuDNN, timings meaningless):
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/sweep_decode.py --small --out /tmp/sweep_decode.json

Problem (as benchmarks/bench_decode.py): batch 1 / 8 / 64 x cache 4k / 32k / 128k positions x layout
(contiguous cache; paged cache of --page (256) positions per page, pages shuffled, through block_table),
nheads 32, nheads_k 8, headdim 128, bf16, seqlen_q 1, cache_seqlens = the full cache, no append. Points whose
K/V do not fit in 80% of free memory are skipped.

Per point:
  0. default: the shipped config and the heuristic split count (num_splits=0). Its output is the reference
     the other configs are checked against; it is itself checked against SDPA's math backend (float32) on
     batch element 0.
  1. tiles: every (BLOCK_N, num_warps, num_stages, use_tma) of the grid at the heuristic split count
     (flashtile.kernels.triton.decode.CONFIG_OVERRIDE; num_splits=0, so the heuristic sees each BLOCK_N).
  2. splits: the fastest tile of step 1 at num_splits in {heuristic, 1, h/2, 2h, 4h}.
  (paged only) the default config through the per-row gather (CONFIG_OVERRIDE["page_tiles"] = False): the
     paged path before the one-page-per-tile fast path.
  3. confirm: the default, the best (tile, split) and SDPA cuDNN (enable_gqa) re-timed with bench_decode's
     budget (do_bench warmup 25 ms, rep 100 ms, median).
Every config's output is compared with the default's first (max abs diff relative to max |default|, must be
<= --tol) and is only timed if it agrees. Timing is bench_decode's: flash_attn_with_kvcache captured in a CUDA
graph and replayed (triton.testing.do_bench, median; steps 1-2 with a shorter --warmup / --rep), index value
checks off; GB/s = K/V bytes (2 * batch * cache * nheads_k * d * 2 B) / time, next to the read-only ceiling
(x.sum() over 4.29 GB float32) measured in the same run.

Triton compiles every distinct config once; to keep the run short the configs are first compiled in parallel
by --jobs worker processes (a tiny problem with the same specialisations, so the main process then loads them
from Triton's cache). Budget: about 3-4 minutes on an H200 (--jobs 8).

Prints per-point results as Markdown tables (best config per point, GB/s, % of ceiling, time / cuDNN time) and
a ranking of the tile configs over all points; writes everything to --out (JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="sweep_decode.json", help="JSON output file")
    ap.add_argument("--small", action="store_true", help="tiny CPU smoke test (interpreter)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,64; --small: 1,3)")
    ap.add_argument("--caches", default=None, help="comma list (default 4096,32768,131072; --small: 96,160)")
    ap.add_argument("--layouts", default="contig,paged")
    ap.add_argument("--page", type=int, default=None, help="positions per page (default 256; --small: 32)")
    ap.add_argument("--block-n", default=None, help="BLOCK_N grid (default 32,64,128; --small: 16,32)")
    ap.add_argument("--warps", default=None, help="num_warps grid (default 4,8; --small: 4)")
    ap.add_argument("--stages", default=None, help="num_stages grid (default 2,3,4; --small: 1)")
    ap.add_argument("--tma", default="0,1", help="use_tma grid (0,1)")
    ap.add_argument("--warmup", type=float, default=10, help="do_bench warmup (ms) in steps 1-2")
    ap.add_argument("--rep", type=float, default=30, help="do_bench rep (ms) in steps 1-2")
    ap.add_argument("--tol", type=float, default=2e-2, help="max |out - default| / max |default|")
    ap.add_argument("--jobs", type=int, default=None, help="parallel precompile workers (0: none)")
    return ap.parse_args(argv)


def _ints(s):
    return tuple(int(x) for x in s.split(",") if x != "")


# --------------------------------------------------------------------------------------------------
# Problem constants (set by setup())
# --------------------------------------------------------------------------------------------------
P = dict(H=32, HK=8, D=128, dtype="bfloat16", batches=(1, 8, 64), caches=(4096, 32768, 131072), page=256,
         block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4))
P_SMALL = dict(H=4, HK=2, D=32, dtype="float16", batches=(1, 3), caches=(96, 160), page=32,
               block_n=(16, 32), warps=(4,), stages=(1,))


def setup(args):
    p = dict(P_SMALL if args.small else P)
    if args.batches:
        p["batches"] = _ints(args.batches)
    if args.caches:
        p["caches"] = _ints(args.caches)
    if args.page:
        p["page"] = args.page
    if args.block_n:
        p["block_n"] = _ints(args.block_n)
    if args.warps:
        p["warps"] = _ints(args.warps)
    if args.stages:
        p["stages"] = _ints(args.stages)
    p["tma"] = tuple(bool(int(x)) for x in args.tma.split(","))
    return p


def tile_grid(p, smem_limit=None):
    """The (BLOCK_N, num_warps, num_stages, use_tma) grid, less the configs whose K/V stages alone exceed the
    GPU's shared memory per block (num_stages * 2 tiles * BLOCK_N * d * itemsize; e.g. BLOCK_N 128 x 4 stages
    at d128 bf16 = 256 KB > 227 KB on H100/H200): they would only fail to launch."""
    item = 2 if p["dtype"] in ("bfloat16", "float16") else 4
    return [dict(BLOCK_N=bn, num_warps=w, num_stages=s, use_tma=t)
            for bn in p["block_n"] for w in p["warps"] for s in p["stages"] for t in p["tma"]
            if smem_limit is None or s * 2 * bn * p["D"] * item <= smem_limit]


def cfg_name(c):
    return f"N{c['BLOCK_N']}/w{c['num_warps']}/s{c['num_stages']}" + ("/tma" if c.get("use_tma") else "")


# --------------------------------------------------------------------------------------------------
# Inputs and calls
# --------------------------------------------------------------------------------------------------
def make_contig(torch, p, batch, seqlen, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, p["dtype"])
    q = torch.randn(batch, 1, p["H"], p["D"], device=device, dtype=dt, generator=g)
    k = torch.randn(batch, seqlen, p["HK"], p["D"], device=device, dtype=dt, generator=g)
    v = torch.randn(batch, seqlen, p["HK"], p["D"], device=device, dtype=dt, generator=g)
    return q, k, v


def make_paged(torch, p, k, v):
    """The same K/V in pages of p['page'] positions, pages shuffled: (k_pages, v_pages, block_table)."""
    b, s = k.shape[:2]
    page = p["page"]
    per = s // page
    perm = torch.randperm(b * per, device=k.device)
    kp = torch.empty(b * per, page, *k.shape[2:], dtype=k.dtype, device=k.device)
    vp = torch.empty_like(kp)
    kp[perm] = k.reshape(b * per, page, *k.shape[2:])
    vp[perm] = v.reshape(b * per, page, *v.shape[2:])
    return kp, vp, perm.view(b, per).to(torch.int32)


def call_fn(fa, q, kc, vc, table, num_splits):
    if table is None:
        return lambda: fa(q, kc, vc, num_splits=num_splits)
    return lambda: fa(q, kc, vc, block_table=table, num_splits=num_splits)


class Override:
    """with Override(dec, {...}): decode.CONFIG_OVERRIDE set for the block (capture / first call)."""

    def __init__(self, dec, ov):
        self.dec, self.ov = dec, ov

    def __enter__(self):
        self.saved = dict(self.dec.CONFIG_OVERRIDE)
        self.dec.CONFIG_OVERRIDE.clear()
        self.dec.CONFIG_OVERRIDE.update(self.ov)

    def __exit__(self, *exc):
        self.dec.CONFIG_OVERRIDE.clear()
        self.dec.CONFIG_OVERRIDE.update(self.saved)


# --------------------------------------------------------------------------------------------------
# Parallel precompile (worker processes fill Triton's on-disk cache)
# --------------------------------------------------------------------------------------------------
def _precompile_task(task):
    """Run one (override, layout, num_splits) on a tiny batch-1 problem whose kernel specialisations equal the
    sweep's (same heads / head dim / dtype / page size; strides all multiples of 16; seqlen_q 1)."""
    ov, layout, splits, pdict, device = task
    try:
        import torch
        from flashtile import kvcache
        from flashtile.api import problem
        from flashtile.kernels.triton import decode as dec
        problem.CHECK_VALUES = False
        seqlen = 16 * pdict["page"]
        q, k, v = make_contig(torch, pdict, 1, seqlen, device)
        table = None
        if layout == "paged":
            k, v, table = make_paged(torch, pdict, k, v)
        with Override(dec, ov):
            call_fn(kvcache.flash_attn_with_kvcache, q, k, v, table, splits)()
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported, the main process then skips / recompiles
        return f"{type(e).__name__}: {str(e)[:160]}"


def precompile(tasks, jobs):
    import multiprocessing as mp
    t0 = time.time()
    errors = {}
    try:
        ctx = mp.get_context("spawn")
        with ctx.Pool(jobs) as pool:
            for task, err in zip(tasks, pool.imap(_precompile_task, tasks, chunksize=1)):
                if err:
                    errors[json.dumps([task[0], task[1], task[2]], sort_keys=True)] = err
    except Exception as e:  # noqa: BLE001 - precompiling is an optimisation only
        print(f"# precompile failed ({type(e).__name__}: {e}); compiling serially instead", flush=True)
    print(f"# precompiled {len(tasks)} variants with {jobs} workers in {time.time() - t0:.0f} s "
          f"({len(errors)} failed: OutOfResources and the like, skipped later)", flush=True)
    return errors


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def main(argv=None):
    args = _parse(argv)
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton
    import flashtile  # noqa: F401
    from flashtile.api import problem
    from flashtile.kernels.triton import configs, decode as dec
    from flashtile.kvcache import flash_attn_with_kvcache as fa

    gpu = torch.cuda.is_available() and not args.small
    device = "cuda" if gpu else "cpu"
    p = setup(args)
    problem.CHECK_VALUES = False
    dt = getattr(torch, p["dtype"])
    H, HK, D = p["H"], p["HK"], p["D"]
    layouts = [x for x in args.layouts.split(",") if x]
    smem = None
    if gpu:
        props = torch.cuda.get_device_properties(0)
        smem = getattr(props, "shared_memory_per_block_optin", None)
    grid = tile_grid(p, smem)
    if gpu:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_decode import bandwidth_ceiling_gbs, graphed
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        devname = torch.cuda.get_device_name()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        devname, sms = "cpu (interpreter)", dec.multiprocessors(torch.device("cpu"))
    print(f"# {devname} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}", flush=True)
    print(f"# problem: nheads {H}, nheads_k {HK}, d {D}, {p['dtype']}, seqlen_q 1, batches {p['batches']}, "
          f"caches {p['caches']}, layouts {layouts} (page {p['page']}); {len(grid)} tile configs", flush=True)
    t_start = time.time()

    def timed(fn, warmup, rep):
        """ms per call: CUDA-graph replay under do_bench (median) on the GPU; one eager call on the CPU (a smoke
        test of the script, not a measurement)."""
        if not gpu:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        g = graphed(fn)
        ms = triton.testing.do_bench(g, warmup=warmup, rep=rep, return_mode="median")
        del g
        return ms

    # ---- precompile ----
    jobs = args.jobs if args.jobs is not None else (min(8, max(1, (os.cpu_count() or 2) // 2)) if gpu else 0)
    pre_errors = {}
    if jobs > 0:   # (on the CPU only to test this plumbing: --small --jobs 2)
        pdict = {k: v for k, v in p.items()}
        tasks = []
        for layout in layouts:
            for c in grid:
                for s in (1, 2):
                    tasks.append((c, layout, s, pdict, device))
            if layout == "paged":
                for s in (1, 2):
                    tasks.append(({"page_tiles": False}, layout, s, pdict, device))
        for s in (1, 2):   # the defaults
            for layout in layouts:
                tasks.append(({}, layout, s, pdict, device))
        pre_errors = precompile(tasks, jobs)

    ceiling = None
    if gpu:
        ceiling, ceiling_ms = bandwidth_ceiling_gbs()
        print(f"# read-only ceiling: x.sum() over 4.29 GB: {ceiling:.0f} GB/s ({ceiling_ms:.3f} ms)", flush=True)

    rows, points = [], []
    for batch in p["batches"]:
        for seqlen in p["caches"]:
            kv_bytes = 2 * batch * seqlen * HK * D * dt.itemsize
            point = dict(batch=batch, seqlen_k=seqlen, nheads=H, nheads_k=HK, headdim=D, dtype=p["dtype"],
                         kv_bytes=kv_bytes)
            if gpu:
                free, _ = torch.cuda.mem_get_info()
                if 2 * kv_bytes > 0.8 * free:   # contiguous + paged copy
                    print(f"| {batch} | {seqlen} | skipped: {2 * kv_bytes / 1e9:.1f} GB > 80% of free |", flush=True)
                    points.append(dict(point, status="skipped (memory)"))
                    continue
            q, kc, vc = make_contig(torch, p, batch, seqlen, device)

            def gbs(ms):
                return kv_bytes / ms / 1e6

            # fp32 math reference of batch element 0 (checks the default config)
            with torch.no_grad():
                qt = q[:1].transpose(1, 2).float()
                kt = kc[:1].transpose(1, 2).float().repeat_interleave(H // HK, dim=1)
                vt = vc[:1].transpose(1, 2).float().repeat_interleave(H // HK, dim=1)
                ref32 = torch.softmax(qt @ kt.transpose(-1, -2) / math.sqrt(D), dim=-1) @ vt
                ref32 = ref32.transpose(1, 2)
                del qt, kt, vt

            cudnn = None
            if gpu:
                try:
                    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

                    def run_cudnn():
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                    o = run_cudnn().transpose(1, 2)
                    err = (o[:1].float() - ref32).abs().max().item()
                    ms = timed(run_cudnn, 25, 100)
                    cudnn = dict(ms=ms, gbs=gbs(ms), max_abs_err_fp32=err, status="ok")
                    rows.append(dict(point, layout="contig", provider="sdpa-cudnn", step="confirm", ms=ms,
                                     gbs=gbs(ms), frac_ceiling=gbs(ms) / ceiling, max_abs_err_fp32=err, status="ok"))
                    del o
                except Exception as e:  # noqa: BLE001 - a backend refusing the problem is a result
                    rows.append(dict(point, provider="sdpa-cudnn", status=f"unsupported: {type(e).__name__}: "
                                     f"{str(e)[:120]}"))
                    print(f"# cuDNN unsupported at batch {batch} cache {seqlen}: {type(e).__name__}", flush=True)

            out_contig = None
            for layout in layouts:
                if layout == "paged":
                    kp, vp, table = make_paged(torch, p, kc, vc)
                    kcl, vcl = kp, vp
                    page_size = p["page"]
                else:
                    kcl, vcl, table, page_size = kc, vc, None, 0
                base = dict(point, layout=layout if layout == "contig" else f"paged{p['page']}")

                def plan(ov, splits=0):
                    with Override(dec, ov):
                        return dec.plan_decode(1, H, HK, D, dt, batch, seqlen, torch.device(device),
                                               page_size=page_size, num_splits=splits)

                def effective(ov, splits):
                    """(config dict as launched, splits, tma really used, paged path)."""
                    pl = plan(ov, splits)
                    c = dataclasses.asdict(pl.cfg)
                    tma = bool(c["use_tma"]) and (table is None or pl.page_tiles) and \
                        dec._cache_descriptor(kcl, c["BLOCK_N"], configs.block_d(D)) is not None
                    c["use_tma"] = tma
                    path = "contig" if table is None else ("page-tiles" if pl.page_tiles else "gather")
                    return c, pl.num_splits, path

                # 0. default, checked against the fp32 reference (batch element 0) and, paged, against the
                # contiguous cache's default output (same K/V, same tiles and splits: should agree to rounding)
                with torch.no_grad():
                    out_def = call_fn(fa, q, kcl, vcl, table, 0)()
                scale = out_def.float().abs().max().item() or 1.0
                err32 = (out_def[:1].float() - ref32).abs().max().item()
                dcfg, dsplits, dpath = effective({}, 0)
                default_ok = err32 <= args.tol * ref32.abs().max().item()
                diff_contig = None
                if table is None:
                    out_contig = out_def
                elif out_contig is not None:
                    diff_contig = (out_def.float() - out_contig.float()).abs().max().item()
                    default_ok = default_ok and diff_contig <= args.tol * scale
                if not default_ok:
                    print(f"# WARNING batch {batch} cache {seqlen} {base['layout']}: the DEFAULT config disagrees "
                          f"with the reference (max abs err vs fp32 {err32:.3e}, vs contiguous {diff_contig})",
                          flush=True)

                def run(ov, splits, step, warmup, rep):
                    c, s, path = effective(ov, splits)
                    row = dict(base, provider="flashtile", step=step, cfg=c, cfg_name=cfg_name(c), num_splits=s,
                               path=path)
                    try:
                        with Override(dec, ov):
                            fn = call_fn(fa, q, kcl, vcl, table, splits)
                            out = fn()
                            diff = (out.float() - out_def.float()).abs().max().item()
                            row["max_abs_diff_vs_default"] = diff
                            if not diff <= args.tol * scale:
                                row["status"] = "FAIL"
                                print(f"  {cfg_name(c)} splits {s}: FAIL max abs diff {diff:.3e}", flush=True)
                                return row
                            ms = timed(fn, warmup, rep)
                    except Exception as e:  # noqa: BLE001 - OutOfResources etc.: a result, not a crash
                        row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
                        return row
                    row.update(ms=ms, gbs=gbs(ms), status="ok")
                    if ceiling:
                        row["frac_ceiling"] = gbs(ms) / ceiling
                    return row

                t_point = time.time()
                seen = {}
                # 1. tiles at the heuristic split
                for c in grid:
                    ec, es, _ = effective(c, 0)
                    key = (json.dumps(ec, sort_keys=True), es)
                    if key in seen:
                        continue
                    r = run(c, 0, "tiles", args.warmup, args.rep)
                    r["override"] = c
                    seen[key] = r
                    rows.append(r)
                ok = [r for r in seen.values() if r["status"] == "ok"]
                if not ok:
                    print(f"# batch {batch} cache {seqlen} {layout}: no config ran", flush=True)
                    continue
                best_tile = min(ok, key=lambda r: r["ms"])
                tile_ov = best_tile["override"]
                # 2. splits at the best tile
                h = best_tile["num_splits"]
                n_blocks = triton.cdiv(seqlen, best_tile["cfg"]["BLOCK_N"])
                limit = min(dec.MAX_SPLITS, n_blocks)
                cands = sorted({min(limit, max(1, s)) for s in (h, 1, h // 2, 2 * h, 4 * h)})
                split_rows = []
                for s in cands:
                    ec, es, _ = effective(tile_ov, s)
                    key = (json.dumps(ec, sort_keys=True), es)
                    if key in seen:
                        split_rows.append(seen[key])
                        continue
                    r = run(tile_ov, s, "splits", args.warmup, args.rep)
                    r["override"] = tile_ov
                    seen[key] = r
                    rows.append(r)
                    split_rows.append(r)
                ok = [r for r in seen.values() if r["status"] == "ok"]
                best = min(ok, key=lambda r: r["ms"])
                # paged: the default config through the old per-row gather
                gather = None
                if table is not None and dpath == "page-tiles":
                    gather = run({"page_tiles": False}, 0, "gather", 25, 100)
                    rows.append(gather)
                # 3. confirm with bench_decode's budget
                conf_def = run({}, 0, "confirm-default", 25, 100)
                conf_best = run(best["override"], best["num_splits"] if best["step"] == "splits" else 0,
                                "confirm-best", 25, 100)
                rows += [conf_def, conf_best]
                pt = dict(base, default_cfg=cfg_name(dcfg), default_splits=dsplits, default_path=dpath,
                          default_max_abs_err_fp32=err32, default_max_abs_diff_vs_contig=diff_contig,
                          default_ok=default_ok, default=conf_def, best=conf_best,
                          best_tile_at_heuristic=best_tile.get("cfg_name"), split_candidates=cands,
                          gather=gather, cudnn=cudnn, seconds=time.time() - t_point)
                points.append(pt)
                print(f"# batch {batch} cache {seqlen} {base['layout']}: default {cfg_name(dcfg)} x{dsplits} "
                      f"{conf_def.get('ms', float('nan')) * 1e3:.1f} us | best {conf_best.get('cfg_name')} "
                      f"x{conf_best.get('num_splits')} {conf_best.get('ms', float('nan')) * 1e3:.1f} us"
                      + (f" | cuDNN {cudnn['ms'] * 1e3:.1f} us" if cudnn else "")
                      + (f" | gather {gather.get('ms', float('nan')) * 1e3:.1f} us" if gather else "")
                      + f" ({time.time() - t_point:.0f} s, total {time.time() - t_start:.0f} s)", flush=True)
                if table is not None:
                    del kp, vp, table
                kcl = vcl = None
            del kc, vc, ref32, out_contig
            if gpu:
                torch.cuda.empty_cache()

    # ---- report ----
    def fmt_us(r):
        return f"{r['ms'] * 1e3:.1f}" if r and r.get("status") == "ok" else (r or {}).get("status", "")

    def pct(r):
        return f"{100 * r['frac_ceiling']:.0f}%" if r and r.get("frac_ceiling") else ""

    print()
    if ceiling:
        print(f"Read-only bandwidth ceiling (x.sum(), 4.29 GB fp32): **{ceiling:.0f} GB/s**  ")
    print(f"{devname}, nheads {H}, nheads_k {HK}, headdim {D}, {p['dtype']}, one query token, full cache; "
          f"CUDA-graph replay, do_bench median; GB/s = K/V bytes / time; time/cuDNN <= 1.00 means at least as fast")
    print()
    print("| batch | cache | layout | default (cfg x splits) | default us | best cfg | best splits | best us | "
          "best GB/s | % of ceiling | cuDNN us | best / cuDNN | default / cuDNN | gather us |")
    print("|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pt in points:
        if pt.get("status"):
            print(f"| {pt['batch']} | {pt['seqlen_k']} | | {pt['status']} | | | | | | | | | | |")
            continue
        d, b, c, g = pt["default"], pt["best"], pt["cudnn"], pt["gather"]
        ok_b, ok_d = b.get("status") == "ok", d.get("status") == "ok"
        ratio_b = f"{b['ms'] / c['ms']:.2f}" if c and ok_b else ""
        ratio_d = f"{d['ms'] / c['ms']:.2f}" if c and ok_d else ""
        flag = "" if pt["default_ok"] else " (WRONG vs reference!)"
        print(f"| {pt['batch']} | {pt['seqlen_k']} | {pt['layout']} | {pt['default_cfg']} x{pt['default_splits']}{flag} | "
              f"{fmt_us(d)} | {b.get('cfg_name', '')} | {b.get('num_splits', '')} | {fmt_us(b)} | "
              f"{b['gbs']:.0f} | {pct(b)} | {fmt_us(c) if c else ''} | {ratio_b} | {ratio_d} | "
              f"{fmt_us(g) if g else ''} |" if ok_b else
              f"| {pt['batch']} | {pt['seqlen_k']} | {pt['layout']} | {pt['default_cfg']} | {fmt_us(d)} | "
              f"{b.get('status')} | | | | | | | | |")

    # tile ranking over all points (step-1 rows: each tile at its heuristic split), per layout
    ranking = []
    for layout in sorted({pt["layout"] for pt in points if not pt.get("status")}):
        per_cfg = {}
        npts = 0
        for pt in points:
            if pt.get("status") or pt["layout"] != layout:
                continue
            npts += 1
            trs = [r for r in rows if r.get("step") == "tiles" and r.get("status") == "ok"
                   and r["layout"] == layout and r["batch"] == pt["batch"] and r["seqlen_k"] == pt["seqlen_k"]]
            if not trs:
                continue
            tmin = min(r["ms"] for r in trs)
            for r in trs:
                per_cfg.setdefault(r["cfg_name"], []).append(r["ms"] / tmin)
        for name, rel in per_cfg.items():
            if len(rel) == npts:
                ranking.append(dict(layout=layout, cfg=name, points=npts,
                                    geomean_slowdown=math.exp(sum(math.log(x) for x in rel) / len(rel)),
                                    worst_slowdown=max(rel)))
    ranking.sort(key=lambda r: (r["layout"], r["geomean_slowdown"]))
    print()
    print("Tile configs at the heuristic split, time / fastest tile of the point (geomean and worst over points):")
    print()
    print("| layout | config | geomean | worst |")
    print("|---|---|---:|---:|")
    for layout in sorted({r["layout"] for r in ranking}):
        for r in [x for x in ranking if x["layout"] == layout][:6]:
            print(f"| {layout} | {r['cfg']} | {r['geomean_slowdown']:.3f} | {r['worst_slowdown']:.3f} |")

    # splits: time at each candidate relative to the heuristic's, per point
    print()
    print("Split counts at the best tile (us; * = heuristic):")
    print()
    print("| batch | cache | layout | tile | splits: us |")
    print("|---:|---:|---|---|---|")
    for pt in points:
        if pt.get("status"):
            continue
        srs = [r for r in rows if r.get("status") == "ok" and r.get("step") in ("tiles", "splits")
               and r["layout"] == pt["layout"] and r["batch"] == pt["batch"] and r["seqlen_k"] == pt["seqlen_k"]
               and r["cfg_name"] == pt["best_tile_at_heuristic"]]
        h = [r["num_splits"] for r in srs if r["step"] == "tiles"]
        cells = ", ".join(f"{r['num_splits']}{'*' if r['num_splits'] in h else ''}: {r['ms'] * 1e3:.1f}"
                          for r in sorted(srs, key=lambda r: r["num_splits"]))
        print(f"| {pt['batch']} | {pt['seqlen_k']} | {pt['layout']} | {pt['best_tile_at_heuristic']} | {cells} |")

    out = dict(device=devname, sms=sms, torch=torch.__version__, triton=triton.__version__, ceiling_gbs=ceiling,
               command=" ".join(sys.argv), problem={k: (list(v) if isinstance(v, tuple) else v) for k, v in p.items()},
               heuristic=dict(TARGET_WAVES=dec.TARGET_WAVES, WAVE_SLACK=dec.WAVE_SLACK,
                              MIN_BLOCKS_PER_SPLIT=dec.MIN_BLOCKS_PER_SPLIT, MAX_SPLITS=dec.MAX_SPLITS,
                              FEW_TILES_WAVES=dec.FEW_TILES_WAVES, FEW_TILES_CONFIG=dec.FEW_TILES_CONFIG),
               precompile_errors=pre_errors, points=points, rows=rows, tile_ranking=ranking,
               seconds=time.time() - t_start)
    d = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(d, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()

"""`flashtile io`: reproduce the FlashAttention papers' HBM-IO claims with the counting model.

Every number here is counted, not computed from a formula: ``reference.io_model.count_hbm_accesses`` runs
the papers' algorithms (standard attention = Alg. 0/3, FA1 = Alg. 2/4, FA2 = FA2 Alg. 1/2, block-sparse
FA1 = Alg. 5) on zero inputs through an HBM object that counts every element loaded or stored. The claims
checked (FA1 paper §3.2, appendix C):

  * standard attention: Theta(Nd + N^2) accesses, forward and backward;
  * FlashAttention: Theta(N^2 d^2 / M) for d <= M <= Nd (Theorem 2), backward alike (Theorem 5);
  * block-sparse FlashAttention: Theta(Nd + N^2 d^2 s / M), s the fraction of non-zero blocks (Theorem 4);
  * "up to 9x fewer HBM accesses" at GPT-2 medium sizes (N=1024, d=64, M ~ 100 KB), FA1 Fig. 2 left, which
    lists 40.3 GB (standard) vs 4.4 GB (FlashAttention) measured on an A100;
  * fewer accesses as the block size grows (FA1 Fig. 2 middle; that figure also shows runtime, which a
    counting model cannot: only accesses are reproduced here).

Counts are elements of one attention head (multiply by the element size for bytes). M is the SRAM size in
elements: 100 KB of fp16 is M = 51200. Block sizes follow FA1 Alg. 2 line 2 (Bc = ceil(M/4d),
Br = min(Bc, d)) for every tiled algorithm, FA2 included, which is why the FA2 reference (Q blocks outer,
K/V re-read once per Q block, Br capped at d) counts *more* than FA1 at these sizes: see docs/io_model.md.

Public API: :func:`run_io`, :func:`io_summary_lines`, and :func:`add_io_arguments` / :func:`run_io_cli` for
the ``flashtile io`` command.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .reference.io_counters import SRAMOverflowError, block_sizes
from .reference.io_model import count_hbm_accesses

__all__ = ["run_io", "io_summary_lines", "add_io_arguments", "run_io_cli", "FULL_GRID", "QUICK_GRID", "IOGrid",
           "GPT2_MEDIUM", "PAPER_GPT2_RATIO"]

#: GPT-2 medium attention head as in FA1 Fig. 2 (seq. length 1024, head dim 64) with M = 100 KB of fp16.
GPT2_MEDIUM = {"N": 1024, "d": 64, "M": 51200, "batch": 64, "nheads": 16}
#: FA1 paper Fig. 2 left (arXiv v2): HBM R/W of forward + backward, GB, standard vs FlashAttention, A100.
PAPER_GPT2_GB = {"standard": 40.3, "flashattention": 4.4}
PAPER_GPT2_RATIO = PAPER_GPT2_GB["standard"] / PAPER_GPT2_GB["flashattention"]
#: arrays the reference algorithms keep in float32 whatever the input dtype (softmax statistics);
#: every other array is counted at 2 bytes (fp16) when converting to bytes.
_STAT_ARRAYS = frozenset({"l", "m", "L", "D"})
_PASSES = ("fwd", "bwd")
_TILED = ("fa1", "fa2")


@dataclass(frozen=True)
class IOGrid:
    """The sizes one run counts. All sizes in elements; M values should be multiples of 4d (see io_counters)."""

    Ns: tuple            # sequence lengths of the main grid (standard, FA1, FA2; fwd and bwd)
    ds: tuple            # head dims of the main grid
    Ms: tuple            # SRAM sizes of the main grid
    head_d: int          # the configuration whose N-exponent is the headline
    head_M: int
    head_Ns: tuple       # N values of the headline N-exponent fit (the large-N end)
    std_fit_N_min: int   # standard attention's large-N exponent uses N >= this
    d_sweep: tuple       # (N, M, ds): the d-exponent at fixed N, M
    M_sweep: tuple       # (N, d, Ms): the M-exponent at fixed N, d
    sparse: tuple        # (N, d, M, densities): Theorem 4
    blocksize: tuple     # (N, d, Bcs): FA1 Fig. 2 middle, Bc set through M = 4 d Bc


FULL_GRID = IOGrid(
    Ns=(256, 512, 1024, 2048, 4096, 8192), ds=(64, 128), Ms=(32768, 51200, 65536, 131072),
    head_d=64, head_M=32768, head_Ns=(1024, 2048, 4096, 8192), std_fit_N_min=1024,
    d_sweep=(4096, 32768, (32, 64, 128, 256)),
    M_sweep=(4096, 64, (16384, 32768, 65536, 131072, 262144)),
    sparse=(4096, 64, 51200, tuple(round(0.1 * k, 1) for k in range(1, 11))),
    blocksize=(1024, 64, (32, 64, 128, 256, 512, 1024)),
)

QUICK_GRID = IOGrid(
    Ns=(256, 512, 1024, 2048), ds=(64, 128), Ms=(32768, 51200, 131072),
    head_d=64, head_M=32768, head_Ns=(1024, 2048, 4096), std_fit_N_min=512,
    d_sweep=(2048, 32768, (32, 64, 128)),
    M_sweep=(2048, 64, (16384, 32768, 65536, 131072)),
    sparse=(2048, 64, 51200, tuple(round(0.1 * k, 1) for k in range(1, 11))),
    blocksize=(1024, 64, (32, 64, 128, 256, 512, 1024)),
)


# --- counting ----------------------------------------------------------------------------------------------
def _job(algorithm, N, d, M, pass_, density=None, causal=False):
    """A hashable description of one count; standard attention ignores M, so it is keyed without it."""
    return (algorithm, N, d, None if algorithm == "standard" else M, pass_, density, causal)


def _on_chip(M: int, d: int) -> bool:
    """Whether the d-wide tiles of FA1 Alg. 2 (K_j, V_j: Bc x d; Q_i, O_i: Br x d) fit in M (the backward's
    eight tiles fit in 2M under the same condition)."""
    Br, Bc = block_sizes(M, d)
    return 2 * d * (Br + Bc) <= M


def _count_job(job) -> dict:
    """Run one count (module level so worker processes can import it)."""
    algorithm, N, d, M, pass_, density, causal = job
    try:
        r = count_hbm_accesses(algorithm, N, d, M, pass_, causal=causal, block_density=density)
    except SRAMOverflowError as e:
        return {"skipped": str(e)}
    return r


def _cost(job) -> float:
    """Rough relative cost (number of tile iterations), to hand the biggest counts out first."""
    algorithm, N, d, M, pass_, density, _ = job
    if algorithm == "standard":
        return 0.0
    Br, Bc = block_sizes(M, d)
    blocks = math.ceil(N / Br) * math.ceil(N / Bc) * (1.0 if density is None else density)
    return blocks * (2.2 if pass_ == "bwd" else 1.0) * (1.0 + d / 256)


def _execute(jobs, workers: int, progress: bool) -> dict:
    from tqdm.auto import tqdm

    jobs = sorted(set(jobs), key=_cost, reverse=True)
    results = {}
    bar = tqdm(total=len(jobs), desc="flashtile io", unit="count", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    cheap = [j for j in jobs if _cost(j) < 64]
    heavy = [j for j in jobs if _cost(j) >= 64]
    try:
        for job in cheap:
            results[job] = _count_job(job)
            bar.update()
        if workers > 1 and len(heavy) > 1:
            # spawn, not fork: the parent has already run torch (thread pools), which fork does not survive safely
            ctx = multiprocessing.get_context("spawn")
            try:
                with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                    futures = {pool.submit(_count_job, job): job for job in heavy}
                    for fut in as_completed(futures):
                        results[futures[fut]] = fut.result()
                        bar.update()
            except BrokenProcessPool:
                # e.g. called at import time of a __main__ script without a __name__ guard, which spawned
                # workers re-run: finish the remaining counts in this process instead of failing
                pass
        for job in heavy:
            if job not in results:
                results[job] = _count_job(job)
                bar.update()
    finally:
        bar.close()
    return results


# --- fits --------------------------------------------------------------------------------------------------
def _r2(y, pred):
    y, pred = np.asarray(y, float), np.asarray(pred, float)
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot == 0.0:
        return None
    return 1.0 - ss_res / ss_tot


def loglog_fit(xs, ys) -> dict:
    """Least-squares fit of log y = k log x + c: the exponent k, prefactor e^c, R^2 in log space."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) < 2:
        raise ValueError(f"loglog_fit: need at least 2 points, got {len(xs)}")
    A = np.stack([np.log(xs), np.ones_like(xs)], 1)
    (k, c), *_ = np.linalg.lstsq(A, np.log(ys), rcond=None)
    return {"exponent": float(k), "prefactor": float(math.exp(c)), "r2": _r2(np.log(ys), A @ (k, c)),
            "n_points": int(len(xs)), "x": [float(x) for x in xs], "y": [float(y) for y in ys]}


def model_fit(features: dict, ys) -> dict:
    """Fit y = sum_k a_k f_k(x) (no intercept) by least squares on the *relative* error, so points spanning
    orders of magnitude weigh alike. Returns the coefficients, R^2 (ordinary, on y) and the largest
    relative error of the model."""
    ys = np.asarray(ys, float)
    names = list(features)
    F = np.stack([np.asarray(features[n], float) for n in names], 1)
    coef, *_ = np.linalg.lstsq(F / ys[:, None], np.ones_like(ys), rcond=None)
    pred = F @ coef
    return {"coef": {n: float(a) for n, a in zip(names, coef)}, "r2": _r2(ys, pred),
            "max_rel_err": float(np.max(np.abs(pred - ys) / ys)), "n_points": int(len(ys))}


def linear_fit(xs, ys) -> dict:
    """Ordinary least squares y = intercept + slope x, with R^2."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    A = np.stack([xs, np.ones_like(xs)], 1)
    (slope, intercept), *_ = np.linalg.lstsq(A, ys, rcond=None)
    return {"slope": float(slope), "intercept": float(intercept), "r2": _r2(ys, A @ (slope, intercept)),
            "n_points": int(len(xs))}


# --- the study ---------------------------------------------------------------------------------------------
def _nbytes(per_array: dict) -> int:
    """Bytes moved if every array is fp16 except the float32 softmax statistics (l, m, L, D)."""
    return sum((4 if name in _STAT_ARRAYS else 2) * (rw["reads"] + rw["writes"]) for name, rw in per_array.items())


def _plan(grid: IOGrid):
    """The jobs of every section, and the (M, d) pairs the block rule cannot fit."""
    jobs, skipped = [], []

    def add(algorithm, N, d, M, pass_, **kw):
        if algorithm != "standard" and not _on_chip(M, d):
            Br, Bc = block_sizes(M, d)
            entry = {"M": M, "d": d, "Br": Br, "Bc": Bc,
                     "reason": f"block rule Bc=ceil(M/4d)={Bc}, Br={Br} needs 2d(Br+Bc)={2 * d * (Br + Bc)} "
                               f"> M={M} elements on chip"}
            if entry not in skipped:
                skipped.append(entry)
            return
        jobs.append(_job(algorithm, N, d, M, pass_, **kw))

    for pass_ in _PASSES:
        for d in grid.ds:
            for N in sorted(set(grid.Ns) | set(grid.head_Ns if d == grid.head_d else ())):
                add("standard", N, d, None, pass_)
                for M in grid.Ms if N in grid.Ns else (grid.head_M,):
                    for alg in _TILED:
                        add(alg, N, d, M, pass_)
        for N in grid.head_Ns:
            for alg in _TILED:
                add(alg, N, grid.head_d, grid.head_M, pass_)
        N, M, ds = grid.d_sweep
        for d in ds:
            for alg in _TILED:
                add(alg, N, d, M, pass_)
        N, d, Ms = grid.M_sweep
        for M in Ms:
            for alg in _TILED:
                add(alg, N, d, M, pass_)
        N, d, M, densities = grid.sparse
        add("standard", N, d, None, pass_)
        add("fa1", N, d, M, pass_)
        for s in densities:
            add("blocksparse", N, d, M, pass_, density=s)
        N, d, Bcs = grid.blocksize
        add("standard", N, d, None, pass_)
        for Bc in Bcs:
            add("fa1", N, d, 4 * d * Bc, pass_)
        g = GPT2_MEDIUM
        add("standard", g["N"], g["d"], None, pass_)
        for alg in _TILED:
            add(alg, g["N"], g["d"], g["M"], pass_)
        add("standard", g["N"], g["d"], None, pass_, causal=True)
        add("fa2", g["N"], g["d"], g["M"], pass_, causal=True)
    return jobs, skipped


def _point(results, algorithm, N, d, M, pass_, **kw) -> dict | None:
    r = results.get(_job(algorithm, N, d, M, pass_, **kw))
    if r is None or "skipped" in r:
        return None
    out = {"algorithm": algorithm, "pass": pass_, "N": N, "d": d, "M": None if algorithm == "standard" else M,
           "reads": r["reads"], "writes": r["writes"], "total": r["total"], "bytes_fp16": _nbytes(r["per_array"]),
           "Br": r["Br"], "Bc": r["Bc"], "Tr": r["Tr"], "Tc": r["Tc"], "nnz_blocks": r["nnz_blocks"]}
    if algorithm != "standard":
        out["in_theorem_range"] = d <= M <= N * d
    for k, v in kw.items():
        out[k] = v
    return out


def _total(results, *args, **kw) -> int:
    p = _point(results, *args, **kw)
    if p is None:
        raise KeyError(f"no count for {args} {kw}")
    return p["total"]


def _analyse(grid: IOGrid, results: dict, skipped: list) -> tuple[dict, dict]:
    """Turn the counts into (summary, data): the fits and headline numbers, and every point."""
    data, fits = {}, {}

    # 1. the main grid
    points = []
    for pass_ in _PASSES:
        for d in grid.ds:
            for N in sorted(set(grid.Ns) | set(grid.head_Ns if d == grid.head_d else ())):
                points.append(_point(results, "standard", N, d, None, pass_))
                for M in grid.Ms if N in grid.Ns else (grid.head_M,):
                    for alg in _TILED:
                        points.append(_point(results, alg, N, d, M, pass_))
    data["grid"] = [p for p in points if p is not None]

    def series(alg, pass_, d, M=None, Ns=None):
        rows = [p for p in data["grid"] if p["algorithm"] == alg and p["pass"] == pass_ and p["d"] == d
                and p["M"] == M and (Ns is None or p["N"] in Ns)]
        rows.sort(key=lambda p: p["N"])
        return [p["N"] for p in rows], [p["total"] for p in rows]

    # 2. fits
    nN, dN, Ms_ = grid.d_sweep[0], grid.M_sweep[0], grid.M_sweep[2]
    data["d_sweep"], data["M_sweep"] = [], []
    for pass_ in _PASSES:
        # standard: exponent in N at large N, per d; the model a (Nd + N^2) over the whole grid
        std = {"N_exponent_large_N": {}, "N_exponent_all_N": {}}
        for d in grid.ds:
            Ns, ys = series("standard", pass_, d)
            big = [(n, y) for n, y in zip(Ns, ys) if n >= grid.std_fit_N_min]
            std["N_exponent_large_N"][str(d)] = loglog_fit(*zip(*big))
            std["N_exponent_all_N"][str(d)] = loglog_fit(Ns, ys)
        rows = [p for p in data["grid"] if p["algorithm"] == "standard" and p["pass"] == pass_]
        std["model_a_Nd_plus_N2"] = model_fit({"Nd+N^2": [p["N"] * p["d"] + p["N"] ** 2 for p in rows]},
                                              [p["total"] for p in rows])
        std["model_a_Nd_b_N2"] = model_fit({"Nd": [p["N"] * p["d"] for p in rows],
                                            "N^2": [p["N"] ** 2 for p in rows]}, [p["total"] for p in rows])
        fits.setdefault("standard", {})[pass_] = std

        for alg in _TILED:
            f = {}
            Ns, ys = series(alg, pass_, grid.head_d, grid.head_M, grid.head_Ns)
            f["N_exponent"] = dict(loglog_fit(Ns, ys), d=grid.head_d, M=grid.head_M)
            by = []
            for d in grid.ds:
                for M in grid.Ms:
                    Ns, ys = series(alg, pass_, d, M)
                    keep = [(n, y) for n, y in zip(Ns, ys) if n >= grid.std_fit_N_min and M <= n * d]
                    if len(keep) >= 2:
                        by.append(dict(loglog_fit(*zip(*keep)), d=d, M=M))
            f["N_exponent_by_d_M"] = by
            N, M, ds = grid.d_sweep
            dpts = [_point(results, alg, N, d, M, pass_) for d in ds]
            dpts = [p for p in dpts if p is not None]
            data["d_sweep"] += dpts
            f["d_exponent"] = dict(loglog_fit([p["d"] for p in dpts], [p["total"] for p in dpts]), N=N, M=M)
            N, d, Ms = grid.M_sweep
            mpts = [_point(results, alg, N, d, M, pass_) for M in Ms]
            mpts = [p for p in mpts if p is not None]
            data["M_sweep"] += mpts
            f["M_exponent"] = dict(loglog_fit([p["M"] for p in mpts], [p["total"] for p in mpts]), N=N, d=d)
            # Theorem 2 / 5 model over every in-range point of this algorithm and pass
            allp = {(p["N"], p["d"], p["M"]): p for p in data["grid"] + dpts + mpts
                    if p["algorithm"] == alg and p["pass"] == pass_ and p["in_theorem_range"]}
            ps = list(allp.values())
            ys = [p["total"] for p in ps]
            quad = [p["N"] ** 2 * p["d"] ** 2 / p["M"] for p in ps]
            f["model_a_N2d2_over_M"] = model_fit({"N^2 d^2/M": quad}, ys)
            f["model_a_Nd_b_N2d2_over_M"] = model_fit({"Nd": [p["N"] * p["d"] for p in ps], "N^2 d^2/M": quad}, ys)
            fits.setdefault(alg, {})[pass_] = f

    # 3. GPT-2 medium
    g = GPT2_MEDIUM
    heads = g["batch"] * g["nheads"]
    gpt2 = {k: g[k] for k in ("N", "d", "M", "batch", "nheads")}
    Br, Bc = block_sizes(g["M"], g["d"])
    gpt2.update(Br=Br, Bc=Bc, Tc=math.ceil(g["N"] / Bc))
    counts, gbytes = {}, {}
    for name, alg, kw in (("standard", "standard", {}), ("fa1", "fa1", {}), ("fa2", "fa2", {}),
                          ("standard_causal", "standard", {"causal": True}), ("fa2_causal", "fa2", {"causal": True})):
        c, b = {}, {}
        for pass_ in _PASSES:
            p = _point(results, alg, g["N"], g["d"], g["M"], pass_, **kw)
            c[pass_], b[pass_] = p["total"], p["bytes_fp16"]
        c["fwd_bwd"], b["fwd_bwd"] = c["fwd"] + c["bwd"], b["fwd"] + b["bwd"]
        counts[name] = c
        gbytes[name] = {k: v * heads / 1e9 for k, v in b.items()}
    gpt2["elements_per_head"] = counts
    gpt2["GB_whole_batch_fp16"] = gbytes
    ratio = lambda a, b: {k: counts[a][k] / counts[b][k] for k in ("fwd", "bwd", "fwd_bwd")}  # noqa: E731
    gpt2["ratio_standard_over_fa1"] = ratio("standard", "fa1")
    gpt2["ratio_standard_over_fa2"] = ratio("standard", "fa2")
    gpt2["ratio_standard_over_fa2_causal"] = ratio("standard_causal", "fa2_causal")
    gpt2["ratio_bytes_standard_over_fa1_fwd_bwd"] = gbytes["standard"]["fwd_bwd"] / gbytes["fa1"]["fwd_bwd"]
    gpt2["paper"] = {"GB_fwd_bwd": PAPER_GPT2_GB, "ratio": PAPER_GPT2_RATIO,
                     "source": "FA1 paper Fig. 2 left (A100, GPT-2 medium, batch 64, 16 heads, fwd + bwd)",
                     "standard_elements_per_head_implied": PAPER_GPT2_GB["standard"] * 1e9 / 2 / heads,
                     "flashattention_elements_per_head_implied": PAPER_GPT2_GB["flashattention"] * 1e9 / 2 / heads}
    gpt2["N_squared"] = g["N"] ** 2

    # 4. block-sparse (Theorem 4)
    N, d, M, densities = grid.sparse
    sp = []
    for s in densities:
        row = {"s": s}
        for pass_ in _PASSES:
            p = _point(results, "blocksparse", N, d, M, pass_, density=s)
            row[pass_] = p["total"]
            row["nnz_blocks"], row["blocks"] = p["nnz_blocks"], p["Tr"] * p["Tc"]
        row["s_actual"] = row["nnz_blocks"] / row["blocks"]
        sp.append(row)
    data["blocksparse"] = sp
    Br, Bc = block_sizes(M, d)
    bs = {"N": N, "d": d, "M": M, "Br": Br, "Bc": Bc, "Tr": math.ceil(N / Br), "Tc": math.ceil(N / Bc)}
    for pass_ in _PASSES:
        fit = linear_fit([r["s_actual"] for r in sp], [r[pass_] for r in sp])
        fit["fit_on_requested_s"] = linear_fit([r["s"] for r in sp], [r[pass_] for r in sp])
        # Theorem 4's two terms: intercept ~ Nd, slope ~ N^2 d^2 / M; their constants
        fit["intercept_over_Nd"] = fit["intercept"] / (N * d)
        fit["slope_over_N2d2_over_M"] = fit["slope"] / (N * N * d * d / M)
        dense = _total(results, "fa1", N, d, M, pass_)
        full = next(r[pass_] for r in sp if r["s_actual"] == 1.0) if any(r["s_actual"] == 1.0 for r in sp) else None
        fit["dense_fa1"] = dense
        fit["s1_equals_dense_fa1"] = full == dense
        fit["standard"] = _total(results, "standard", N, d, None, pass_)
        bs[pass_] = fit
    # 5. block size (FA1 Fig. 2 middle)
    N, d, Bcs = grid.blocksize
    bz = []
    std = {pass_: _total(results, "standard", N, d, None, pass_) for pass_ in _PASSES}
    for Bc in Bcs:
        M = 4 * d * Bc
        row = {"Bc": Bc, "M": M, "Br": block_sizes(M, d)[0], "in_theorem_range": d <= M <= N * d}
        for pass_ in _PASSES:
            p = _point(results, "fa1", N, d, M, pass_)
            row[pass_] = p["total"]
            row["Tc"] = p["Tc"]
        row["fwd_bwd"] = row["fwd"] + row["bwd"]
        row["ratio_standard_over_fa1_fwd_bwd"] = (std["fwd"] + std["bwd"]) / row["fwd_bwd"]
        bz.append(row)
    data["blocksize"] = bz
    reach = [r["Bc"] for r in bz if r["ratio_standard_over_fa1_fwd_bwd"] >= PAPER_GPT2_RATIO]
    blocksize = {"N": N, "d": d, "Bc": list(Bcs), "standard": std,
                 "fwd": [r["fwd"] for r in bz], "bwd": [r["bwd"] for r in bz],
                 "decreasing_fwd": all(a["fwd"] > b["fwd"] for a, b in zip(bz, bz[1:])),
                 "decreasing_bwd": all(a["bwd"] > b["bwd"] for a, b in zip(bz, bz[1:])),
                 "ratio_standard_over_fa1_fwd_bwd": [r["ratio_standard_over_fa1_fwd_bwd"] for r in bz],
                 "smallest_Bc_reaching_paper_ratio": reach[0] if reach else None,
                 "M_of_that_Bc": 4 * d * reach[0] if reach else None,
                 "drop_fwd_64_to_512": _ratio_between(bz, 64, 512, "fwd")}

    headline = {
        "standard_N_exponent_fwd": fits["standard"]["fwd"]["N_exponent_large_N"][str(grid.head_d)]["exponent"],
        "standard_N_exponent_bwd": fits["standard"]["bwd"]["N_exponent_large_N"][str(grid.head_d)]["exponent"],
        "standard_model_r2_fwd": fits["standard"]["fwd"]["model_a_Nd_plus_N2"]["r2"],
        "standard_model_r2_bwd": fits["standard"]["bwd"]["model_a_Nd_plus_N2"]["r2"],
    }
    for alg in _TILED:
        for pass_ in _PASSES:
            f = fits[alg][pass_]
            headline[f"{alg}_N_exponent_{pass_}"] = f["N_exponent"]["exponent"]
            headline[f"{alg}_d_exponent_{pass_}"] = f["d_exponent"]["exponent"]
            headline[f"{alg}_M_exponent_{pass_}"] = f["M_exponent"]["exponent"]
            headline[f"{alg}_theorem_model_r2_{pass_}"] = f["model_a_Nd_b_N2d2_over_M"]["r2"]
    for k in ("fwd", "bwd", "fwd_bwd"):
        headline[f"gpt2_ratio_standard_over_fa1_{k}"] = gpt2["ratio_standard_over_fa1"][k]
        headline[f"gpt2_ratio_standard_over_fa2_{k}"] = gpt2["ratio_standard_over_fa2"][k]
    headline["paper_gpt2_ratio"] = PAPER_GPT2_RATIO
    for pass_ in _PASSES:
        headline[f"blocksparse_r2_{pass_}"] = bs[pass_]["r2"]
        headline[f"blocksparse_slope_{pass_}"] = bs[pass_]["slope"]
    headline["blocksize_decreasing"] = blocksize["decreasing_fwd"] and blocksize["decreasing_bwd"]

    summary = {"headline": headline, "fits": _strip_xy(fits), "gpt2_medium": gpt2, "blocksparse": bs,
               "blocksize": blocksize, "skipped": skipped}
    data["fits_with_points"] = fits
    return summary, data


def _ratio_between(rows, a, b, key):
    by = {r["Bc"]: r[key] for r in rows}
    return by[a] / by[b] if a in by and b in by else None


def _strip_xy(obj):
    """The fits without their data points (those stay in io.json's data section)."""
    if isinstance(obj, dict):
        return {k: _strip_xy(v) for k, v in obj.items() if k not in ("x", "y")}
    if isinstance(obj, list):
        return [_strip_xy(v) for v in obj]
    return obj


# --- plots -------------------------------------------------------------------------------------------------
def _plots(grid: IOGrid, summary: dict, data: dict, out: Path) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    colors = plt.get_cmap("viridis")

    # io_vs_N: rows fwd/bwd, columns d
    fig, axes = plt.subplots(2, len(grid.ds), figsize=(6 * len(grid.ds), 9), squeeze=False)
    for r, pass_ in enumerate(_PASSES):
        for c, d in enumerate(grid.ds):
            ax = axes[r][c]
            pts = [p for p in data["grid"] if p["pass"] == pass_ and p["d"] == d and p["N"] in grid.Ns]
            s = sorted((p for p in pts if p["algorithm"] == "standard"), key=lambda p: p["N"])
            ax.plot([p["N"] for p in s], [p["total"] for p in s], "k-o", lw=2, label="standard (Alg. 0/3)")
            for k, M in enumerate(grid.Ms):
                col = colors(k / max(1, len(grid.Ms) - 1) * 0.85)
                for alg, style in (("fa1", "-s"), ("fa2", "--^")):
                    q = sorted((p for p in pts if p["algorithm"] == alg and p["M"] == M), key=lambda p: p["N"])
                    if q:
                        ax.plot([p["N"] for p in q], [p["total"] for p in q], style, color=col, ms=4,
                                label=f"{alg.upper()} M={M}")
            ax.set_xlabel("sequence length N")
            ax.set_title(f"{pass_}, d={d}")
            _log_axes(ax, "HBM accesses (elements, one head)", fontsize=7, ncol=2)
    files["io_vs_N"] = _save(fig, out / "io_vs_N.png",
                             "HBM accesses counted by running the algorithms (standard vs FA1 vs FA2)")

    # io_fits: rows fwd/bwd; columns N (FA1, FA2, standard), d, M
    F = data["fits_with_points"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    for r, pass_ in enumerate(_PASSES):
        ax = axes[r][0]
        for alg, style, col in (("standard", "o", "k"), ("fa1", "s", "C0"), ("fa2", "^", "C1")):
            f = (F[alg][pass_]["N_exponent_large_N"][str(grid.head_d)] if alg == "standard"
                 else F[alg][pass_]["N_exponent"])
            _fit_line(ax, f, style, col, f"{alg.upper() if alg != 'standard' else 'standard'}: "
                                         f"N^{f['exponent']:.3f}")
        ax.set_title(f"{pass_}: exponent in N (d={grid.head_d}, M={grid.head_M} for FA)")
        ax.set_xlabel("N")
        # columns d and M: FA1 and FA2 over that sweep (N and the other one fixed), the exponent Theorems 2 / 5 give
        columns = (("d", grid.d_sweep, "M", "head dim d", 2), ("M", grid.M_sweep, "d", "SRAM size M (elements)", -1))
        for ax, (x, sweep, other, xlabel, theorem) in zip(axes[r][1:], columns):
            for alg, style, col in (("fa1", "s", "C0"), ("fa2", "^", "C1")):
                f = F[alg][pass_][f"{x}_exponent"]
                _fit_line(ax, f, style, col, f"{alg.upper()}: {x}^{f['exponent']:.3f}")
            ax.set_title(f"{pass_}: exponent in {x} (N={sweep[0]}, {other}={sweep[1]}); Thm 2/5: {theorem}")
            ax.set_xlabel(xlabel)
        for ax in axes[r]:
            _log_axes(ax, "HBM accesses", fontsize=8)
    files["io_fits"] = _save(fig, out / "io_fits.png", "Log-log least-squares fits (markers: counts; lines: fits)")

    # io_blocksparse
    bs = summary["blocksparse"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, pass_ in zip(axes, _PASSES):
        s = [r["s_actual"] for r in data["blocksparse"]]
        y = [r[pass_] for r in data["blocksparse"]]
        fit = bs[pass_]
        ax.plot(s, y, "o", color="C0", label="block-sparse FA1 (Alg. 5), counted")
        xs = np.linspace(0, 1, 50)
        ax.plot(xs, fit["intercept"] + fit["slope"] * xs, "-", color="C0", alpha=0.6,
                label=f"fit {fit['intercept']:.3g} + {fit['slope']:.3g} s (R^2={fit['r2']:.5f})")
        ax.axhline(fit["dense_fa1"], color="C2", ls="--", label="dense FA1")
        ax.axhline(fit["standard"], color="k", ls=":", label="standard")
        ax.set_xlabel("non-zero block fraction s")
        ax.set_ylabel("HBM accesses")
        ax.set_ylim(0, None)
        ax.set_title(f"{pass_}: N={bs['N']}, d={bs['d']}, M={bs['M']} (Theorem 4)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    files["io_blocksparse"] = _save(fig, out / "io_blocksparse.png")

    # io_blocksize (FA1 Fig. 2 middle: accesses only)
    bz = summary["blocksize"]
    fig, ax = plt.subplots(figsize=(7, 4.8))
    ax.plot(bz["Bc"], bz["fwd"], "-o", label="FA1 forward")
    ax.plot(bz["Bc"], bz["bwd"], "-s", label="FA1 backward")
    ax.axhline(bz["standard"]["fwd"], color="C0", ls=":", label="standard forward")
    ax.axhline(bz["standard"]["bwd"], color="C1", ls=":", label="standard backward")
    for x, y, rr in zip(bz["Bc"], bz["fwd"], bz["ratio_standard_over_fa1_fwd_bwd"]):
        ax.annotate(f"{rr:.1f}x", (x, y), textcoords="offset points", xytext=(0, -13), fontsize=7, ha="center")
    limit = bz["N"] / 4  # M = 4 d Bc <= N d, the range of Theorem 2
    if bz["Bc"][-1] > limit:
        ax.axvspan(limit, bz["Bc"][-1] * 1.1, color="0.9", zorder=0, label="M > Nd (outside Thm 2's range)")
    ax.set_xlabel("block size Bc (M = 4 d Bc)")
    ax.set_title(f"Effect of block size, N={bz['N']}, d={bz['d']} (counts only, no runtime);\n"
                 "labels: standard / FA1 ratio, fwd + bwd")
    _log_axes(ax, "HBM accesses (elements, one head)", fontsize=8)
    files["io_blocksize"] = _save(fig, out / "io_blocksize.png")
    return files


def _fit_line(ax, f, style, col, label):
    x, y = np.asarray(f["x"]), np.asarray(f["y"])
    ax.plot(x, y, style, color=col)
    ax.plot(x, f["prefactor"] * x ** f["exponent"], "-", color=col, alpha=0.6, label=label)


def _log_axes(ax, ylabel: str, **legend):
    """Log-log axes (N, d, M, Bc in powers of two) with this y label, a grid and a legend (legend: its options)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**legend)


def _save(fig, path: Path, title: str | None = None) -> str:
    """fig under its title laid out, written to path and closed; path as a string."""
    import matplotlib.pyplot as plt
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# --- entry points ------------------------------------------------------------------------------------------
def run_io(out_dir, quick: bool = False, progress: bool = True, *, workers: int | None = None,
           grid: IOGrid | None = None) -> dict:
    """Count, fit, plot. Writes ``io.json`` (every count and fit) and io_vs_N.png, io_fits.png,
    io_blocksparse.png, io_blocksize.png into ``out_dir``; returns the summary dict (headline numbers, fits
    without their points, GPT-2 medium ratios, block-sparse and block-size results, skipped (M, d) pairs,
    config, files).

    quick: a smaller grid (N up to 2048; the headline N-exponent up to 4096), ~30 s on 2 cores; the full
    grid (N up to 8192) takes a few minutes. ``workers`` processes share the tiled counts (default: up to 2,
    one per CPU); ``grid`` overrides the sizes (an :class:`IOGrid`).
    """
    t0 = time.perf_counter()
    grid = grid if grid is not None else (QUICK_GRID if quick else FULL_GRID)
    if workers is None:
        workers = max(1, min(2, os.cpu_count() or 1))
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: expected a positive int")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs, skipped = _plan(grid)
    results = _execute(jobs, workers, progress)
    for job, r in results.items():  # an overflow the pre-check did not predict: record it, never hide it
        if "skipped" in r:
            entry = {"M": job[3], "d": job[2], "reason": r["skipped"]}
            if not any(e["M"] == entry["M"] and e["d"] == entry["d"] for e in skipped):
                skipped.append(entry)
    summary, data = _analyse(grid, results, skipped)
    summary["config"] = {"quick": quick, "grid": asdict(grid), "counts": len(results), "workers": workers,
                         "units": "elements of one attention head (x2 for fp16 bytes)"}
    summary["files"] = {"json": str(out / "io.json"), **_plots(grid, summary, data, out)}
    summary["config"]["seconds"] = time.perf_counter() - t0
    with open(out / "io.json", "w") as fh:
        json.dump({**summary, "data": data}, fh, indent=1)
    return summary


def io_summary_lines(summary: dict) -> list[str]:
    """A short human-readable account of a :func:`run_io` summary (also printed by ``flashtile demo``)."""
    h, g, bs, bz = summary["headline"], summary["gpt2_medium"], summary["blocksparse"], summary["blocksize"]
    f1 = summary["fits"]["fa1"]["fwd"]
    h = {k: (_no_negative_zero(v) if "exponent" in k else v) for k, v in h.items()}
    reach = bz["smallest_Bc_reaching_paper_ratio"]
    reach = (f"reaches {PAPER_GPT2_RATIO:.1f}x at Bc={reach} (M={bz['M_of_that_Bc']})" if reach is not None
             else f"never reaches {PAPER_GPT2_RATIO:.1f}x (max {max(bz['ratio_standard_over_fa1_fwd_bwd']):.2f}x)")
    lines = [
        "HBM-IO model (counted by running the algorithms; elements per head):",
        f"  standard ~ Nd + N^2: exponent in N (N >= {summary['config']['grid']['std_fit_N_min']}) "
        f"fwd {h['standard_N_exponent_fwd']:.3f}, bwd {h['standard_N_exponent_bwd']:.3f}; "
        f"a(Nd + N^2) R^2 fwd {h['standard_model_r2_fwd']:.5f}, bwd {h['standard_model_r2_bwd']:.5f}",
        f"  FA1 ~ N^2 d^2 / M (Thm 2 fwd / Thm 5 bwd): exponent in N {h['fa1_N_exponent_fwd']:.3f} / "
        f"{h['fa1_N_exponent_bwd']:.3f} (d={f1['N_exponent']['d']}, M={f1['N_exponent']['M']}), "
        f"in d {h['fa1_d_exponent_fwd']:.3f} / {h['fa1_d_exponent_bwd']:.3f}, "
        f"in M {h['fa1_M_exponent_fwd']:.3f} / {h['fa1_M_exponent_bwd']:.3f}",
        f"  FA2 reference (FA1 block rule, Br <= d): exponent in N {h['fa2_N_exponent_fwd']:.3f} / "
        f"{h['fa2_N_exponent_bwd']:.3f}, in d {h['fa2_d_exponent_fwd']:.3f} / {h['fa2_d_exponent_bwd']:.3f}, "
        f"in M {h['fa2_M_exponent_fwd']:.3f} / {h['fa2_M_exponent_bwd']:.3f}",
        f"  GPT-2 medium (N={g['N']}, d={g['d']}, M={g['M']}: Bc={g['Bc']}, Br={g['Br']}): standard / FA1 = "
        f"{h['gpt2_ratio_standard_over_fa1_fwd']:.2f}x fwd, {h['gpt2_ratio_standard_over_fa1_bwd']:.2f}x bwd, "
        f"{h['gpt2_ratio_standard_over_fa1_fwd_bwd']:.2f}x fwd+bwd (paper: {PAPER_GPT2_RATIO:.1f}x measured); "
        f"standard / FA2 = {h['gpt2_ratio_standard_over_fa2_fwd_bwd']:.2f}x",
        f"  block-sparse ~ Nd + N^2 d^2 s / M (Thm 4, N={bs['N']}): linear in s, R^2 fwd {bs['fwd']['r2']:.6f}, "
        f"bwd {bs['bwd']['r2']:.6f}; slope fwd {bs['fwd']['slope']:.4g}, bwd {bs['bwd']['slope']:.4g}",
        f"  block size (N={bz['N']}, d={bz['d']}): FA1 fwd accesses fall "
        f"{'monotonically' if bz['decreasing_fwd'] else 'NOT monotonically'} as Bc grows "
        f"{bz['Bc'][0]}..{bz['Bc'][-1]} ({bz['fwd'][0]:.3g} -> {bz['fwd'][-1]:.3g}); standard/FA1 (fwd+bwd) "
        f"{reach}",
    ]
    if summary["skipped"]:
        lines.append("  skipped (M, d): " + ", ".join(f"({e['M']}, {e['d']})" for e in summary["skipped"]))
    else:
        lines.append("  skipped (M, d): none (every pair fits the block rule)")
    if "files" in summary:
        lines.append(f"  written: {summary['files']['json']} and {len(summary['files']) - 1} PNG plots")
    return lines


def _no_negative_zero(x: float) -> float:
    """An exponent that prints as -0.000 (e.g. -1e-17) printed as 0.000."""
    return 0.0 if abs(x) < 5e-4 else x


def add_io_arguments(parser) -> None:
    """Options of ``flashtile io``."""
    parser.add_argument("--quick", action="store_true",
                        help="smaller grid (N up to 2048; ~30 s on 2 cores) instead of the full one (N up to 8192)")
    parser.add_argument("--out", default="io_results", metavar="DIR",
                        help="directory for io.json and the PNG plots (default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print the summary JSON on stdout (the human summary then goes to stderr)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes sharing the counts (default: min(2, CPUs))")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_io_cli(args) -> int:
    """``flashtile io``: run :func:`run_io` with parsed ``args`` (see :func:`add_io_arguments`); 0 on success."""
    workers = getattr(args, "workers", None)
    if workers is not None and workers < 1:
        print(f"flashtile io: --workers={workers}: expected a positive int", file=sys.stderr)
        return 2
    summary = run_io(args.out, quick=args.quick, progress=not getattr(args, "no_progress", False), workers=workers)
    stream = sys.stderr if args.json else sys.stdout
    for line in io_summary_lines(summary):
        print(line, file=stream)
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":  # python -m flashtile.io_report [--quick] [--out DIR] [--json]
    import argparse

    _parser = argparse.ArgumentParser(prog="python -m flashtile.io_report", description=__doc__.split("\n")[0])
    add_io_arguments(_parser)
    sys.exit(run_io_cli(_parser.parse_args()))


def gpt2_medium_counts(N: int = 1024, d: int = 64, M: int = 51200) -> dict:
    """HBM accesses (elements, forward + backward, one head) of standard attention and FlashAttention-1 at
    GPT-2 medium sizes, counted by running both algorithms: the headline number of `flashtile demo`."""
    from .reference.io_model import count_hbm_accesses
    std = sum(count_hbm_accesses("standard", N, d, M, p)["total"] for p in ("fwd", "bwd"))
    fa1 = sum(count_hbm_accesses("fa1", N, d, M, p)["total"] for p in ("fwd", "bwd"))
    return {"N": N, "d": d, "M": M, "standard": std, "fa1": fa1, "ratio": std / fa1}

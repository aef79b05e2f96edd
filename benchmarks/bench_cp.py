"""Context parallelism on several GPUs: the varlen ring, Ulysses and the hybrid (USP), against one GPU.

    torchrun --nproc_per_node=2 benchmarks/bench_cp.py --out DIR/cp-2gpu.json --md DIR/cp-2gpu.md
    torchrun --nproc_per_node=4 benchmarks/bench_cp.py --out DIR/cp-4gpu.json --md DIR/cp-4gpu.md

(run from the repository root; no install needed: the script puts the source tree on sys.path.)

Problems (bf16, causal, nheads 32 / nheads_k 8, headdim 128 by default; every CP call goes through
flashtile.distributed.context_parallel_attention on a device mesh):
    varlen   the ring on packed documents (per-document zigzag): --docs documents of mixed lengths in
             [--doc-min, --doc-max] adding to --varlen-tokens (log-uniform draw, seeded; default 64 documents,
             1k..64k, 512k tokens). FLOPs count each document's own causal square only.
    ring     the dense zigzag ring on --tokens (default 256k): the reference point for the all-to-all modes.
    ulysses  all-to-all over all W GPUs on --tokens.
    usp      all-to-all over --usp-ulysses GPUs (default W / 2) x ring over the rest, on --tokens; needs W >= 4
             (on 2 GPUs it would be Ulysses or the ring alone) and is skipped otherwise.

1. Agreement (--check-tokens, default 16k; varlen: 8 documents of 1/32 .. 1/4 of it): each mode's out/dq/dk/dv,
   gathered, against one GPU in the same dtype and one GPU in float32 on the same inputs. Pass:
   |cp - fp32| <= 2 |one GPU - fp32| + 2^-7 max|fp32| (the rule of bench_ring.py); the Markdown gives each
   tensor's errors and their ratio CP / one GPU.
2. One GPU: the whole problem on one GPU (every rank at once; the fastest counts; timed once for the modes that
   share it). A problem that does not fit is measured on half of it (dense: half the tokens, time scaled by N^2;
   varlen: the first half of the documents, scaled by sum L_i^2), halving again if needed, and marked
   "extrapolated".
3. CP fwd+bwd, the slowest rank's time; per-GPU efficiency = t_1GPU / (W t_CP); peak memory per GPU (the
   largest over ranks, torch.cuda.max_memory_allocated) of the CP run and of the one-GPU run.

A time budget (--budget-s, default 420 s) keeps the run under 10 minutes: a mode whose projected time does not
fit in what is left is skipped and listed. Rank 0 prints a Markdown table and writes JSON (--out) and the table
(--md). NVLink multicast is turned off before NCCL starts, as the machines require. Without a GPU it runs on
gloo + the Triton interpreter (a smoke test: tiny sizes and --dtype float32).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench_ring (sets the NCCL variables first)
from bench_ring import DTYPES, START, Env, marker, timed  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import flashtile  # noqa: E402
from flashtile import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashtile.distributed import (  # noqa: E402
    context_parallel_attention,
    context_parallel_gather,
    context_parallel_shard,
    varlen_layout,
)


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="varlen,ring,ulysses,usp")
    p.add_argument("--tokens", type=int, default=262144, help="sequence length of the dense modes (batch 1)")
    p.add_argument("--varlen-tokens", type=int, default=524288)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--doc-min", type=int, default=1024)
    p.add_argument("--doc-max", type=int, default=65536)
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--nheads-k", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--usp-ulysses", type=int, default=None, help="Ulysses ranks of USP (default world / 2)")
    p.add_argument("--check-tokens", type=int, default=16384, help="tokens of the agreement check (0: skip)")
    p.add_argument("--min-time", type=float, default=2.0, help="seconds of timed iterations (at least 1)")
    p.add_argument("--max-iters", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file written by rank 0")
    p.add_argument("--md", default=None, help="Markdown table written by rank 0")
    return p.parse_args()


def doc_lengths(n: int, total: int, lo: int, hi: int, seed: int) -> list:
    """n lengths adding to total that span [lo, hi]: one document of each extreme (hi capped so that the rest can
    still hold lo each), the others a log-uniform draw scaled to the remainder, clamped and nudged to add up;
    shuffled."""
    hi = min(hi, total - (n - 1) * lo)
    if n < 2 or not n * lo <= total or hi < lo:
        raise SystemExit(f"{n} documents of {lo}..{hi} tokens cannot add to {total}")
    g = torch.Generator().manual_seed(seed)
    rest = total - hi - lo
    x = torch.empty(n - 2, dtype=torch.float64).uniform_(math.log(lo), math.log(hi), generator=g).exp()
    lens = [hi, lo] + [min(hi, max(lo, int(round(v)))) for v in (x / x.sum() * rest).tolist()]
    i = 2
    while sum(lens) != total:   # spread the rounding / clamping remainder over documents with room
        d = total - sum(lens)
        lens[i] += min(d, hi - lens[i]) if d > 0 else -min(-d, lens[i] - lo)
        i = 2 + (i - 1) % (n - 2)
    return [lens[j] for j in torch.randperm(n, generator=g).tolist()]


def flops(lens, h: int, d: int) -> float:
    """Causal fwd + bwd FLOPs of the documents (each its own square; backward = 2.5 x forward)."""
    return 3.5 * sum(4.0 * h * d * n * n * 0.5 for n in lens)


class Problem:
    def __init__(self, mode: str, lens: list, varlen: bool):
        self.mode, self.lens, self.varlen = mode, lens, varlen
        self.tokens = sum(lens)
        self.cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32) if varlen else None

    def describe(self) -> str:
        if self.varlen:
            return f"{len(self.lens)} docs {min(self.lens):,}..{max(self.lens):,}, {self.tokens:,} tokens"
        return f"{self.tokens:,} tokens"


class Meshes:
    """The CP mesh of each mode: 1-D ("cp",) for ring / Ulysses / varlen, (ring, uly) for USP."""

    def __init__(self, env: Env, usp_u: int):
        self.env = env
        self.flat = init_device_mesh(env.device.type, (env.world,), mesh_dim_names=("cp",))
        self.usp = None
        if env.world >= 4 and env.world % usp_u == 0 and usp_u > 1:
            self.usp = init_device_mesh(env.device.type, (env.world // usp_u, usp_u), mesh_dim_names=("ring", "uly"))

    def of(self, mode: str):
        """(mesh, cp_dim, mode as context_parallel_attention takes it)."""
        if mode == "usp":
            return self.usp, ("ring", "uly"), "usp"
        return self.flat, "cp", "ring" if mode in ("ring", "varlen") else "ulysses"


def cp_call(meshes: Meshes, prob: Problem):
    mesh, cp_dim, mode = meshes.of(prob.mode)
    if prob.varlen:
        cu = prob.cu.to(meshes.env.device)
        kw = dict(cu_seqlens=cu, max_seqlen=max(prob.lens))
    else:
        kw = {}

    def run(q, k, v):
        return context_parallel_attention(q, k, v, mesh, cp_dim, mode, causal=True, **kw)

    def shard(t):
        return context_parallel_shard(t, mesh, cp_dim, mode, cu_seqlens=kw.get("cu_seqlens"))

    def gather(t):
        return context_parallel_gather(t, mesh, cp_dim, mode, cu_seqlens=kw.get("cu_seqlens"))
    return run, shard, gather


def one_gpu_call(prob: Problem, device):
    if not prob.varlen:
        return lambda q, k, v: flash_attn_func(q, k, v, causal=True)
    cu, n = prob.cu.to(device), max(prob.lens)
    return lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)


def shapes(prob: Problem, rows: int, a):
    lead = (rows,) if prob.varlen else (1, rows)
    return (*lead, a.nheads, a.headdim), (*lead, a.nheads_k, a.headdim)


# --------------------------------------------------------------------------------------------------
def agreement(env: Env, meshes: Meshes, prob: Problem, a, dtype):
    g = torch.Generator(device=env.device).manual_seed(1234)
    qs, ks = shapes(prob, prob.tokens, a)
    mk = lambda s: torch.randn(*s, generator=g, device=env.device, dtype=dtype)  # noqa: E731
    q, k, v, dout = mk(qs), mk(ks), mk(ks), mk(qs)
    run, shard, gather = cp_call(meshes, prob)
    ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
    out = run(ql, kl, vl)
    out.backward(shard(dout))
    cp = {n: gather(t) for n, t in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
    row = dict(mode=prob.mode, problem=prob.describe())
    if env.rank == 0:
        one = one_gpu_call(prob, env.device)

        def single(dt):
            qq, kk, vv = (t.detach().to(dt).clone().requires_grad_() for t in (q, k, v))
            o = one(qq, kk, vv)
            o.backward(dout.to(dt))
            return dict(out=o.detach(), dq=qq.grad, dk=kk.grad, dv=vv.grad)
        same, hi = single(dtype), single(torch.float32)
        ok = True
        for n in ("out", "dq", "dk", "dv"):
            e_cp = (cp[n].float() - hi[n]).abs().max().item()
            e_one = (same[n].float() - hi[n]).abs().max().item()
            bound = 2 * e_one + 2.0 ** -7 * max(1.0, hi[n].abs().max().item())
            row[n] = dict(cp_vs_fp32=e_cp, one_gpu_vs_fp32=e_one, bound=bound, ok=e_cp <= bound)
            ok &= e_cp <= bound
        row["ok"] = ok
        env.log(f"check {prob.mode:>8} ({prob.describe()}): " + ", ".join(
            f"{n} |cp-fp32|={row[n]['cp_vs_fp32']:.2e} (1gpu {row[n]['one_gpu_vs_fp32']:.2e})"
            for n in ("out", "dq", "dk", "dv")) + f" -> {'PASS' if ok else 'FAIL'}")
    dist.barrier()
    return row


def time_step(env: Env, fn, q, k, v, dout, a, warmup: int):
    def step():
        q.grad = k.grad = v.grad = None
        s0 = marker(env)
        o = fn(q, k, v)
        s1 = marker(env)
        o.backward(dout)
        return s0, s1
    return timed(env, step, a.min_time, a.max_iters, warmup)


def peak_gib(env: Env) -> float:
    mine = torch.cuda.max_memory_allocated(env.device) / 2 ** 30 if env.cuda else 0.0
    return env.reduce(mine, dist.ReduceOp.MAX)


def one_gpu(env: Env, prob: Problem, a, dtype):
    """(s/iter, fwd s/iter, peak GiB, extrapolated, measured problem description)."""
    sub = prob
    while True:
        g = torch.Generator(device=env.device).manual_seed(10 + env.rank)
        qs, ks = shapes(sub, sub.tokens, a)
        fits = True
        try:
            if env.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(env.device)
            mk = lambda s: torch.randn(*s, generator=g, device=env.device, dtype=dtype)  # noqa: E731
            q, k, v = (mk(s).requires_grad_() for s in (qs, ks, ks))
            dout = mk(qs)
            t, tf, _ = time_step(env, one_gpu_call(sub, env.device), q, k, v, dout, a, warmup=1)
        except torch.cuda.OutOfMemoryError:
            fits = False
        q = k = v = dout = None
        fits = env.reduce(1.0 if fits else 0.0, dist.ReduceOp.MIN) > 0
        if fits:
            break
        env.log(f"one GPU: {sub.describe()} does not fit; halving")
        if sub.varlen:
            if len(sub.lens) == 1:
                return None, None, None, False, sub.describe()
            sub = Problem(sub.mode, sub.lens[:len(sub.lens) // 2], True)
        else:
            sub = Problem(sub.mode, [sub.tokens // 2], False)
    t = env.reduce(t, dist.ReduceOp.MIN)   # the fastest rank (all ran at once, each on its own GPU)
    peak = peak_gib(env)
    scale = sum(n * n for n in prob.lens) / sum(n * n for n in sub.lens)
    return t * scale, tf * scale, peak, sub is not prob, sub.describe()


def cp_run(env: Env, meshes: Meshes, prob: Problem, a, dtype):
    run, _, _ = cp_call(meshes, prob)
    if prob.varlen:
        rows = varlen_layout(prob.cu, env.world).local_total
    else:
        rows = prob.tokens // env.world
    qs, ks = shapes(prob, rows, a)
    g = torch.Generator(device=env.device).manual_seed(100 + env.rank)
    mk = lambda s: torch.randn(*s, generator=g, device=env.device, dtype=dtype)  # noqa: E731
    if env.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)
    q, k, v = (mk(s).requires_grad_() for s in (qs, ks, ks))
    dout = mk(qs)
    t, tf, it = time_step(env, run, q, k, v, dout, a, warmup=1)
    return t, tf, it, peak_gib(env)


def main():
    a = parse()
    env = Env()
    dtype = DTYPES[a.dtype]
    usp_u = a.usp_ulysses or max(1, env.world // 2)
    meshes = Meshes(env, usp_u)
    gpu = torch.cuda.get_device_name(env.device) if env.cuda else platform.processor() or "cpu"
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    env.log(f"cp bench: world={env.world} {gpu} torch {torch.__version__} triton {__import__('triton').__version__} "
            f"h={a.nheads} hk={a.nheads_k} d={a.headdim} {a.dtype} causal, modes {modes}")

    def problem(mode, tokens, docs, lo, hi):
        if mode == "varlen":
            return Problem(mode, doc_lengths(docs, tokens, min(lo, tokens // docs), hi, a.seed), True)
        return Problem(mode, [tokens], False)

    skipped, checks, rows = [], [], []
    for mode in modes:
        if mode not in ("varlen", "ring", "ulysses", "usp"):
            raise SystemExit(f"unknown mode {mode!r}")
        if mode == "usp" and meshes.usp is None:
            env.log(f"usp skipped: needs world >= 4 and a Ulysses size > 1 dividing it (world={env.world}, "
                    f"--usp-ulysses {usp_u})")
            skipped.append(dict(mode=mode, reason=f"world {env.world}: USP needs >= 4 GPUs"))
            continue
        if a.check_tokens:
            # 8 documents of check_tokens / 32 .. check_tokens / 4 tokens
            checks.append(agreement(env, meshes, problem(mode, a.check_tokens, 8, max(1, a.check_tokens // 32),
                                                         max(1, a.check_tokens // 4)), a, dtype))

    last = None   # (FLOPs, seconds) of the previous mode: projects the next one
    baselines = {}
    for mode in modes:
        if mode == "usp" and meshes.usp is None:
            continue
        prob = problem(mode, a.varlen_tokens if mode == "varlen" else a.tokens, a.docs, a.doc_min, a.doc_max)
        work = flops(prob.lens, a.nheads, a.headdim)
        est = 4 * last[1] * work / last[0] if last else 0.0   # one GPU (~W x CP) plus the CP run, warm-ups
        if not env.agree(time.perf_counter() - START + est <= a.budget_s):
            env.log(f"{mode} skipped: projected {est:.0f} s does not fit the budget")
            skipped.append(dict(mode=mode, projected_s=est))
            continue
        key = (tuple(prob.lens), prob.varlen)   # ring, Ulysses and USP share one dense problem: timed once
        if key not in baselines:
            baselines[key] = one_gpu(env, prob, a, dtype)
        t1, t1f, peak1, extrap, measured = baselines[key]
        env.log(f"one GPU {mode} ({prob.describe()}): " + ("-" if t1 is None else f"{t1 * 1e3:,.0f} ms fwd+bwd"
                + (f" (extrapolated from {measured})" if extrap else "")))
        t, tf, it, peak = cp_run(env, meshes, prob, a, dtype)
        last = (work, t1 if t1 else t * env.world)
        row = dict(mode=mode, problem=prob.describe(), tokens=prob.tokens, world=env.world,
                   mesh=dict(zip(("ring", "uly"), meshes.usp.mesh.shape)) if mode == "usp" else dict(cp=env.world),
                   cp_s_per_iter=t, cp_fwd_s=tf, iters=it, tflops_per_gpu=work / t / env.world / 1e12,
                   tokens_per_s_per_gpu=prob.tokens / t / env.world, peak_mem_gib=peak,
                   one_gpu_s_per_iter=t1, one_gpu_fwd_s=t1f, one_gpu_peak_mem_gib=None if extrap else peak1,
                   one_gpu_extrapolated=extrap, one_gpu_measured=measured,
                   efficiency=(t1 / (env.world * t)) if t1 else None,
                   doc_lengths=prob.lens if prob.varlen else None)
        rows.append(row)
        env.log(f"cp {mode}: {t * 1e3:,.0f} ms fwd+bwd ({tf * 1e3:,.0f} ms fwd), {row['tflops_per_gpu']:.0f} "
                f"TFLOPs/GPU, peak {peak:.1f} GiB/GPU" + (f", efficiency {row['efficiency']:.1%}" if t1 else ""))

    if env.rank == 0:
        lines = [f"Context parallelism fwd+bwd, {env.world} x {gpu}, h={a.nheads} hk={a.nheads_k} d={a.headdim} "
                 f"{a.dtype} causal", "",
                 "| mode | problem | CP ms (fwd) | TFLOPs/GPU | 1-GPU ms | per-GPU efficiency | peak GiB/GPU "
                 "| 1-GPU peak GiB |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            one = "-" if r["one_gpu_s_per_iter"] is None else (
                f"{r['one_gpu_s_per_iter'] * 1e3:,.0f}" + (" (extrap.)" if r["one_gpu_extrapolated"] else ""))
            eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.1%}"
            mesh = r["mode"] + (f" (ring {r['mesh']['ring']} x Ulysses {r['mesh']['uly']})" if r["mode"] == "usp"
                                else "")
            p1 = "-" if r["one_gpu_peak_mem_gib"] is None else f"{r['one_gpu_peak_mem_gib']:.1f}"
            lines.append(f"| {mesh} | {r['problem']} | {r['cp_s_per_iter'] * 1e3:,.0f} ({r['cp_fwd_s'] * 1e3:,.0f}) "
                         f"| {r['tflops_per_gpu']:.0f} | {one} | {eff} | {r['peak_mem_gib']:.1f} | {p1} |")
        for s in skipped:
            lines.append(f"\nskipped: {s}")
        if checks:
            lines += ["", "Agreement on the same inputs (max |x - one GPU in float32|; ratio = CP / one GPU in "
                      f"{a.dtype}; pass: CP <= bound = 2 x one GPU + 2^-7 max|fp32|):", "",
                      "| mode | problem | tensor | CP | one GPU | ratio | bound | pass |",
                      "|---|---|---|---:|---:|---:|---:|---|"]
            for c in checks:
                for n in ("out", "dq", "dk", "dv"):
                    e = c[n]
                    ratio = (f"{e['cp_vs_fp32'] / e['one_gpu_vs_fp32']:.2f}x" if e["one_gpu_vs_fp32"] > 0
                             else "-")   # (float32 runs: one GPU is the reference itself)
                    lines.append(f"| {c['mode']} | {c['problem']} | {n} | {e['cp_vs_fp32']:.2e} | "
                                 f"{e['one_gpu_vs_fp32']:.2e} | {ratio} | {e['bound']:.2e} | "
                                 f"{'yes' if e['ok'] else 'NO'} |")
            lines.append("\nagreement: " + ", ".join(f"{c['mode']} {'PASS' if c.get('ok') else 'FAIL'}"
                                                     for c in checks))
        print("\n" + "\n".join(lines))
        if a.md:
            os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
            with open(a.md, "w") as f:
                f.write("\n".join(lines) + "\n")
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            doc = dict(bench="context_parallel", date=datetime.datetime.now().isoformat(timespec="seconds"),
                       command="torchrun --nproc_per_node=%d %s" % (env.world, " ".join(sys.argv)),
                       device=gpu, world=env.world, torch=torch.__version__,
                       triton=__import__("triton").__version__, flashtile=flashtile.__version__,
                       config=dict(nheads=a.nheads, nheads_k=a.nheads_k, headdim=a.headdim, dtype=a.dtype,
                                   causal=True, tokens=a.tokens, varlen_tokens=a.varlen_tokens, docs=a.docs,
                                   doc_min=a.doc_min, doc_max=a.doc_max, usp_ulysses=usp_u, seed=a.seed),
                       agreement=checks, results=rows, skipped=skipped, wall_s=time.perf_counter() - START)
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"wrote {a.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

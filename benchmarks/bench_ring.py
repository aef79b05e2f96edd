"""Ring attention (context parallelism) on several GPUs: agreement with one GPU and scaling with sequence length.

    torchrun --nproc_per_node=2 benchmarks/bench_ring.py --out DIR/ring-2gpu.json
    torchrun --nproc_per_node=4 benchmarks/bench_ring.py --out DIR/ring-4gpu.json

(run from the repository root; no install needed: the script puts the source tree on sys.path.)

1. Agreement (--check-seqlen total tokens, bf16, causal, zigzag and contiguous): the ring's out/dq/dk/dv,
   gathered on rank 0, against flash_attn_func on one GPU in the same dtype and against one-GPU flashtile in
   float32 on the same (bf16-valued) inputs. Pass: |ring - fp32| <= 2 |one GPU - fp32| + 2^-7 max|fp32|.
2. One-GPU baseline: flash_attn_func fwd+bwd at every size <= --single-max (each rank runs it on its own GPU
   at the same time; the fastest rank's time is used). Sizes above it are extrapolated as t(N) ~ N^2 from the
   largest measured size (causal attention FLOPs are exactly quadratic), and marked "extrapolated".
3. Ring fwd+bwd (b1, h16, d128, bf16, causal, zigzag by default) at each total size in --seqlens; the slowest
   rank's time counts. Per-GPU efficiency = t_1GPU(N) / (world * t_ring(N)).

A time budget (--budget-s, default 270 s) keeps the run under 5 minutes: a size whose projected time (from
the previous size, scaled by N^2) does not fit in what is left is skipped and listed as skipped.
Prints a Markdown table; rank 0 writes JSON to --out. NVLink multicast is turned off before NCCL starts
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), as the machines require.
Without a GPU it runs on gloo + the Triton interpreter (a smoke test: use tiny --seqlens and --dtype float32).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashtile  # noqa: E402  (turns on the Triton interpreter when there is no GPU)
from flashtile import flash_attn_func  # noqa: E402
from flashtile.distributed import gather_sequence, ring_flash_attn_func, shard_sequence  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
START = time.perf_counter()


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="65536,131072,262144,524288,1048576",
                   help="total tokens, comma separated (each divisible by 2 * world size for zigzag)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--nheads-k", type=int, default=None, help="K/V heads (GQA); default nheads")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--check-seqlen", type=int, default=32768, help="total tokens of the agreement check (0: skip)")
    p.add_argument("--single-max", type=int, default=262144,
                   help="largest one-GPU baseline size measured; larger sizes are extrapolated (N^2)")
    p.add_argument("--min-time", type=float, default=2.0, help="seconds of timed iterations per size (at least 1)")
    p.add_argument("--max-iters", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=270.0, help="stop starting new sizes past this wall time")
    p.add_argument("--out", default=None, help="JSON file written by rank 0")
    return p.parse_args()


class Env:
    def __init__(self):
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=self.device)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reduce(self, x: float, op) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.item()

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def log(self, *a):
        if self.rank == 0:
            print(f"[{time.perf_counter() - START:6.1f}s]", *a, flush=True)


def causal_flops(b, n, h, d, causal):
    fwd = 4.0 * b * h * d * n * n * (0.5 if causal else 1.0)
    return fwd, 3.5 * fwd  # backward = 2.5 x forward (FA2 convention)


def timed(env: Env, step, min_time: float, max_iters: int, warmup: int):
    """step() -> None runs fwd+bwd and returns the forward's (start, end) markers. Returns (s/iter fwd+bwd,
    s/iter fwd, iters), each the max over ranks."""
    for _ in range(warmup):
        step()
    env.sync()
    dist.barrier()
    t0 = time.perf_counter()
    marks, n = [], 0
    while True:
        marks.append(step())
        n += 1
        env.sync()
        if n >= max_iters or time.perf_counter() - t0 >= min_time:
            break
    total = (time.perf_counter() - t0) / n
    if env.cuda:
        fwd = sum(a.elapsed_time(b) for a, b in marks) / n / 1e3
    else:
        fwd = sum(b - a for a, b in marks) / n
    return env.reduce(total, dist.ReduceOp.MAX), env.reduce(fwd, dist.ReduceOp.MAX), n


def marker(env: Env):
    if env.cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


# --------------------------------------------------------------------------------------------------
def agreement(env: Env, a, dtype, hk, causal):
    n = a.check_seqlen
    results = []
    for layout in ("zigzag", "contiguous"):
        if n % (2 * env.world):
            env.log(f"check skipped: --check-seqlen {n} not divisible by {2 * env.world}")
            return results
        g = torch.Generator(device=env.device).manual_seed(1234)
        mk = lambda *s: torch.randn(*s, generator=g, device=env.device, dtype=dtype)  # noqa: E731
        q, k, v = mk(a.batch, n, a.nheads, a.headdim), mk(a.batch, n, hk, a.headdim), mk(a.batch, n, hk, a.headdim)
        dout = mk(a.batch, n, a.nheads, a.headdim)
        ql, kl, vl = (shard_sequence(t, env.rank, env.world, layout).requires_grad_() for t in (q, k, v))
        out = ring_flash_attn_func(ql, kl, vl, causal=causal, layout=layout)
        out.backward(shard_sequence(dout, env.rank, env.world, layout))
        ring = {nm: gather_sequence(t, layout=layout) for nm, t in
                (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
        del out, ql, kl, vl
        row = dict(layout=layout, seqlen=n, causal=causal)
        if env.rank == 0:
            def one_gpu(dt):
                qs, ks, vs = (t.detach().to(dt).clone().requires_grad_() for t in (q, k, v))
                o = flash_attn_func(qs, ks, vs, causal=causal)
                o.backward(dout.to(dt))
                return dict(out=o.detach(), dq=qs.grad, dk=ks.grad, dv=vs.grad)
            same, hi = one_gpu(dtype), one_gpu(torch.float32)
            ok = True
            for nm in ("out", "dq", "dk", "dv"):
                e_ring = (ring[nm].float() - hi[nm]).abs().max().item()
                e_one = (same[nm].float() - hi[nm]).abs().max().item()
                e_pair = (ring[nm].float() - same[nm].float()).abs().max().item()
                bound = 2 * e_one + 2.0 ** -7 * max(1.0, hi[nm].abs().max().item())
                row[nm] = dict(ring_vs_fp32=e_ring, one_gpu_vs_fp32=e_one, ring_vs_one_gpu=e_pair, bound=bound,
                               ok=e_ring <= bound)
                ok &= e_ring <= bound
            row["ok"] = ok
            env.log(f"check {layout:>10} s={n}: " + ", ".join(
                f"{nm} |ring-1gpu|={row[nm]['ring_vs_one_gpu']:.2e} |ring-fp32|={row[nm]['ring_vs_fp32']:.2e} "
                f"(1gpu {row[nm]['one_gpu_vs_fp32']:.2e})" for nm in ("out", "dq", "dk", "dv"))
                + f" -> {'PASS' if ok else 'FAIL'}")
            del same, hi
        results.append(row)
        del ring, q, k, v, dout
        if env.cuda:
            torch.cuda.empty_cache()
        dist.barrier()
    return results


def main():
    a = parse()
    env = Env()
    dtype, causal = DTYPES[a.dtype], not a.no_causal
    hk = a.nheads_k or a.nheads
    seqlens = [int(s) for s in a.seqlens.split(",") if s.strip()]
    gpu = torch.cuda.get_device_name(env.device) if env.cuda else platform.processor() or "cpu"
    env.log(f"ring bench: world={env.world} {gpu} torch {torch.__version__} triton "
            f"{__import__('triton').__version__} b={a.batch} h={a.nheads} hk={hk} d={a.headdim} {a.dtype} "
            f"causal={causal} layout={a.layout}")

    check = agreement(env, a, dtype, hk, causal) if a.check_seqlen else []

    def budget_ok(est: float) -> bool:
        return env.agree(time.perf_counter() - START + est <= a.budget_s)

    # ---- one GPU (every rank on its own GPU at once; the fastest counts)
    single, skipped = {}, []
    last = None  # (n, s/iter)
    one_gpu_sizes = {s for s in seqlens if s <= a.single_max}
    if seqlens and 0 < a.single_max < max(seqlens):
        one_gpu_sizes.add(a.single_max)  # the reference point of the extrapolation
    for n in sorted(one_gpu_sizes):
        est = 3 * last[1] * (n / last[0]) ** 2 if last else 0.0
        if not budget_ok(est):
            skipped.append(dict(kind="one_gpu", seqlen=n, projected_s=est))
            continue
        g = torch.Generator(device=env.device).manual_seed(10 + env.rank)
        mk = lambda *s: torch.randn(*s, generator=g, device=env.device, dtype=dtype)  # noqa: E731
        try:
            q = mk(a.batch, n, a.nheads, a.headdim).requires_grad_()
            k, v = (mk(a.batch, n, hk, a.headdim).requires_grad_() for _ in range(2))
            dout = mk(a.batch, n, a.nheads, a.headdim)

            def step():
                q.grad = k.grad = v.grad = None
                s0 = marker(env)
                o = flash_attn_func(q, k, v, causal=causal)
                s1 = marker(env)
                o.backward(dout)
                return s0, s1
            fits = True
            t, tf, it = timed(env, step, a.min_time, a.max_iters, warmup=1 if est < 5 else 0)
        except torch.cuda.OutOfMemoryError:
            fits = False
        fits = env.reduce(1.0 if fits else 0.0, dist.ReduceOp.MIN) > 0
        q = k = v = dout = None
        if env.cuda:
            torch.cuda.empty_cache()
        if not fits:
            env.log(f"one GPU s={n}: out of memory")
            break
        t = env.reduce(t, dist.ReduceOp.MIN)  # fastest rank (the others ran at the same time)
        single[n] = dict(s_per_iter=t, fwd_s=tf, iters=it)
        last = (n, t)
        env.log(f"one GPU s={n}: {t * 1e3:.1f} ms fwd+bwd ({tf * 1e3:.1f} ms fwd), {it} iters")
    ref_n = max(single) if single else None

    def one_gpu_time(n):
        if n in single:
            return single[n]["s_per_iter"], False
        if ref_n is None:
            return None, False
        return single[ref_n]["s_per_iter"] * (n / ref_n) ** 2, True

    # ---- ring
    rows = []
    last = None
    for n in sorted(seqlens):
        if n % (2 * env.world if a.layout == "zigzag" else env.world):
            env.log(f"ring s={n}: skipped (not divisible by the shard count)")
            skipped.append(dict(kind="ring", seqlen=n, reason="not divisible"))
            continue
        est = 2 * last[1] * (n / last[0]) ** 2 if last else 0.0
        if not budget_ok(est):
            env.log(f"ring s={n}: skipped, projected {est:.0f} s does not fit the budget")
            skipped.append(dict(kind="ring", seqlen=n, projected_s=est))
            continue
        s_local = n // env.world
        g = torch.Generator(device=env.device).manual_seed(100 + env.rank)
        mk = lambda *s: torch.randn(*s, generator=g, device=env.device, dtype=dtype)  # noqa: E731
        if env.cuda:
            torch.cuda.reset_peak_memory_stats()
        q = mk(a.batch, s_local, a.nheads, a.headdim).requires_grad_()
        k, v = (mk(a.batch, s_local, hk, a.headdim).requires_grad_() for _ in range(2))
        dout = mk(a.batch, s_local, a.nheads, a.headdim)

        def step():
            q.grad = k.grad = v.grad = None
            s0 = marker(env)
            o = ring_flash_attn_func(q, k, v, causal=causal, layout=a.layout)
            s1 = marker(env)
            o.backward(dout)
            return s0, s1
        t, tf, it = timed(env, step, a.min_time, a.max_iters, warmup=1 if est < 5 else 0)
        peak = env.reduce(torch.cuda.max_memory_allocated() / 2 ** 30 if env.cuda else 0.0, dist.ReduceOp.MAX)
        q = k = v = dout = None
        if env.cuda:
            torch.cuda.empty_cache()
        last = (n, t)
        _, flops = causal_flops(a.batch, n, a.nheads, a.headdim, causal)
        t1, extrap = one_gpu_time(n)
        row = dict(seqlen=n, world=env.world, ring_s_per_iter=t, ring_fwd_s=tf, iters=it,
                   tokens_per_s=a.batch * n / t, tokens_per_s_per_gpu=a.batch * n / t / env.world,
                   tflops_per_gpu=flops / t / env.world / 1e12, peak_mem_gib=peak,
                   one_gpu_s_per_iter=t1, one_gpu_extrapolated=extrap,
                   one_gpu_tokens_per_s=(a.batch * n / t1) if t1 else None,
                   efficiency=(t1 / (env.world * t)) if t1 else None)
        rows.append(row)
        env.log(f"ring s={n}: {t * 1e3:.1f} ms fwd+bwd ({tf * 1e3:.1f} ms fwd), {row['tflops_per_gpu']:.0f} TFLOPs/GPU"
                + (f", efficiency {row['efficiency']:.1%}" if t1 else ""))

    if env.rank == 0:
        print()
        print(f"Ring attention fwd+bwd, {env.world} x {gpu}, b={a.batch} h={a.nheads} hk={hk} d={a.headdim} "
              f"{a.dtype} causal={causal} layout={a.layout}")
        print()
        print("| total tokens | ring ms (fwd) | tokens/s per GPU | TFLOPs/GPU | 1-GPU ms | 1-GPU tokens/s "
              "| per-GPU efficiency | peak GiB/GPU |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            one = "-" if r["one_gpu_s_per_iter"] is None else (
                f"{r['one_gpu_s_per_iter'] * 1e3:,.0f}" + (" (extrap.)" if r["one_gpu_extrapolated"] else ""))
            one_tok = "-" if r["one_gpu_tokens_per_s"] is None else f"{r['one_gpu_tokens_per_s']:,.0f}"
            eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.1%}"
            print(f"| {r['seqlen']:,} | {r['ring_s_per_iter'] * 1e3:,.0f} ({r['ring_fwd_s'] * 1e3:,.0f}) "
                  f"| {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | {one} | {one_tok} | {eff} "
                  f"| {r['peak_mem_gib']:.1f} |")
        for s in skipped:
            print(f"skipped: {s}")
        if check:
            print("agreement: " + ", ".join(f"{c['layout']} {'PASS' if c.get('ok') else 'FAIL'}" for c in check))
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            doc = dict(
                bench="ring_attention", date=datetime.datetime.now().isoformat(timespec="seconds"),
                command="torchrun --nproc_per_node=%d %s" % (env.world, " ".join(sys.argv)),
                device=gpu, world=env.world, torch=torch.__version__, triton=__import__("triton").__version__,
                flashtile=flashtile.__version__,
                config=dict(batch=a.batch, nheads=a.nheads, nheads_k=hk, headdim=a.headdim, dtype=a.dtype,
                            causal=causal, layout=a.layout),
                agreement=check, one_gpu=[dict(seqlen=n, **v) for n, v in sorted(single.items())],
                ring=rows, skipped=skipped, wall_s=time.perf_counter() - START)
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"wrote {a.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

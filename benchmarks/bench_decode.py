"""Decode (one new query token per sequence) over a KV cache: flashtile's split-KV kernel beside SDPA.

Usage (GPU machine, repo root):  PYTHONPATH=. python benchmarks/bench_decode.py --out DIR [--page 256[,16,...]]

Problem: batch 1 / 8 / 64 x cache 4k / 32k / 128k positions, nheads 32, nheads_k 8 (GQA 4:1), headdim 128, bf16,
cache_seqlens = the full cache, no append. Points whose K/V (plus the SDPA copies) do not fit in 80% of free
memory are skipped and listed as such.

Providers (same problem, same numbers of bytes):
- flashtile-contig: flash_attn_with_kvcache on a (batch, seqlen, nheads_k, d) cache, num_splits=0 (automatic).
- flashtile-paged:  the same K/V laid out in pages of --page positions (one provider per size of a comma list),
  shuffled, through block_table.
- sdpa-flash / sdpa-cudnn: torch SDPA restricted to one backend via torch.nn.attention.sdpa_kernel, on the
  same cache viewed as (batch, nheads_k, seqlen, d). GQA is given to SDPA with enable_gqa=True when the backend
  accepts it; otherwise K/V are expanded to nheads with repeat_interleave beforehand (the copy is not timed, but
  the kernel then reads 4x the bytes). The "gqa" column says which was used.
Metric: K/V bytes of the problem (2 * batch * seqlen * nheads_k * d * 2 B) / median time (triton.testing.do_bench),
in GB/s, next to a read-only bandwidth ceiling measured in the same run: x.sum() over a 4.3 GB float32 tensor.
Before timing, each provider's output is compared with SDPA's math backend (float32 upcast reference on a slice) and
the max abs error is recorded; a provider whose error exceeds 2e-2 is marked FAIL and not timed.
Value checks of the index tensors (a host-device sync per call) are turned off for timing
(flashtile.api.problem.CHECK_VALUES = False), as a serving loop would. Every provider is timed twice: "eager" (each
call from Python, as a plain loop would) and "graph" (the call captured once in a CUDA graph and replayed: no
Python/launch overhead, which at batch 1 with a 4k cache exceeds the kernel time).
Prints a Markdown table; writes DIR/bench_decode.json. Budget: about 2-3 minutes on an H200.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile  # noqa: F401
from flashtile.api import problem as _problem
from flashtile.kernels.triton import decode as _decode
from flashtile.kvcache import flash_attn_with_kvcache

H, HK, D = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 64)
CACHES = (4096, 32768, 131072)
TOL = 2e-2


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bandwidth_ceiling_gbs():
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").uniform_()   # 4.29 GB
    ms = bench_ms(lambda: x.sum())
    gbs = x.numel() * 4 / ms / 1e6
    del x
    torch.cuda.empty_cache()
    return gbs, ms


def sdpa_runner(backend, q, k_cache, v_cache, allow_repeat: bool):
    """(fn, gqa mode) running SDPA with one backend on the cache; raises if the backend refuses the problem
    (with enable_gqa and, where memory allows, with K/V repeated to nheads)."""
    qt = q.transpose(1, 2)                                     # (b, h, 1, d)
    kt, vt = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (b, hk, s, d) views of the cache

    def run_gqa():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    try:
        run_gqa()
        torch.cuda.synchronize()
        return run_gqa, "enable_gqa"
    except (RuntimeError, TypeError):
        if not allow_repeat:
            raise
    kr = kt.repeat_interleave(H // HK, dim=1)
    vr = vt.repeat_interleave(H // HK, dim=1)

    def run_rep():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kr, vr)
    run_rep()
    torch.cuda.synchronize()
    return run_rep, "repeat"


def graphed(fn):
    """fn captured in a CUDA graph (returns the replay function): removes the Python / launch overhead, which at
    batch 1 and a 4k cache is larger than the kernel time, so the graph column shows what the kernels achieve."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def reference_slice(q, k_cache, v_cache, nb):
    """float32 math-backend output for the first nb batch elements (b, 1, h, d)."""
    qt = q[:nb].transpose(1, 2).float()
    kt = k_cache[:nb].transpose(1, 2).float().repeat_interleave(H // HK, dim=1)
    vt = v_cache[:nb].transpose(1, 2).float().repeat_interleave(H // HK, dim=1)
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)


def to_paged(k_cache, v_cache, page):
    b, s = k_cache.shape[:2]
    per = s // page
    perm = torch.randperm(b * per, device="cuda")
    kp = torch.empty(b * per, page, HK, D, dtype=DTYPE, device="cuda")
    vp = torch.empty_like(kp)
    kp[perm] = k_cache.reshape(b * per, page, HK, D)
    vp[perm] = v_cache.reshape(b * per, page, HK, D)
    table = perm.view(b, per).to(torch.int32)
    return kp, vp, table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--page", default="256", help="page size(s), comma-separated")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--caches", default=",".join(map(str, CACHES)))
    args = ap.parse_args()
    torch.manual_seed(0)
    _problem.CHECK_VALUES = False
    dev = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {dev} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}", flush=True)
    ceiling, ceiling_ms = bandwidth_ceiling_gbs()
    print(f"read-only ceiling: x.sum() over 4.29 GB: {ceiling:.0f} GB/s ({ceiling_ms:.3f} ms)", flush=True)
    rows = []
    pages = [int(x) for x in str(args.page).split(",")]
    t0 = time.time()
    for batch in (int(x) for x in args.batches.split(",")):
        for seqlen in (int(x) for x in args.caches.split(",")):
            kv_bytes = 2 * batch * seqlen * HK * D * 2
            free, _ = torch.cuda.mem_get_info()
            point = dict(batch=batch, seqlen_k=seqlen, nheads=H, nheads_k=HK, headdim=D, dtype="bf16",
                         kv_bytes=kv_bytes)
            # contiguous cache + a paged copy per page size (+ a possible 4x repeat for SDPA, checked below)
            need = (1 + len(pages)) * kv_bytes
            if need > 0.8 * free:
                rows.append(dict(point, provider="all", status="skipped (memory)"))
                print(f"| {batch} | {seqlen} | all | skipped: {need / 1e9:.1f} GB > 80% of free |", flush=True)
                continue
            q = torch.randn(batch, 1, H, D, dtype=DTYPE, device="cuda")
            k_cache = torch.randn(batch, seqlen, HK, D, dtype=DTYPE, device="cuda")
            v_cache = torch.randn(batch, seqlen, HK, D, dtype=DTYPE, device="cuda")
            nb = min(batch, 2)
            ref = reference_slice(q, k_cache, v_cache, nb)
            providers = []
            splits = {"flashtile-contig": _decode.plan_decode(1, H, HK, D, DTYPE, batch, seqlen, q.device).num_splits}
            providers.append(("flashtile-contig", lambda: flash_attn_with_kvcache(q, k_cache, v_cache), "packed"))
            for page in pages:
                kp, vp, table = to_paged(k_cache, v_cache, page)
                run = (lambda kp=kp, vp=vp, table=table: flash_attn_with_kvcache(q, kp, vp, block_table=table))
                providers.append((f"flashtile-paged{page}", run, "packed"))
                splits[f"flashtile-paged{page}"] = _decode.plan_decode(1, H, HK, D, DTYPE, batch, seqlen, q.device,
                                                                       page_size=page).num_splits
            for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                free, _ = torch.cuda.mem_get_info()
                try:
                    # the repeat fallback holds 4x the K/V: only where it fits
                    fn, mode = sdpa_runner(be, q, k_cache, v_cache, allow_repeat=4 * kv_bytes < 0.8 * free)
                    providers.append((name, (lambda f=fn: f().transpose(1, 2)), mode))
                except Exception as e:  # noqa: BLE001 - a backend refusing the problem is a result, not a crash
                    rows.append(dict(point, provider=name, status=f"unsupported: {type(e).__name__}: {str(e)[:120]}"))
                    print(f"| {batch} | {seqlen} | {name} | unsupported ({type(e).__name__}) |", flush=True)
            for name, fn, mode in providers:
                out = fn()
                err = (out[:nb].float() - ref).abs().max().item()
                if not err <= TOL:
                    rows.append(dict(point, provider=name, gqa=mode, max_abs_err=err, status="FAIL"))
                    print(f"| {batch} | {seqlen} | {name} | FAIL: max abs err {err:.3e} |", flush=True)
                    continue
                for launch_mode in ("eager", "graph"):
                    try:
                        ms = bench_ms(fn if launch_mode == "eager" else graphed(fn))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(point, provider=name, gqa=mode, launch=launch_mode,
                                         status=f"{launch_mode} failed: {type(e).__name__}: {str(e)[:120]}"))
                        continue
                    gbs = kv_bytes / ms / 1e6
                    row = dict(point, provider=name, gqa=mode, launch=launch_mode, ms=ms, gbs=gbs,
                               frac_ceiling=gbs / ceiling, max_abs_err=err, status="ok")
                    if name in splits:
                        row["num_splits"] = splits[name]
                    rows.append(row)
            del providers, kp, vp, table, k_cache, v_cache, q
            torch.cuda.empty_cache()
            print(f"# done batch={batch} seqlen={seqlen} ({time.time() - t0:.0f} s)", flush=True)

    print()
    print(f"Read-only bandwidth ceiling (x.sum(), 4.29 GB fp32): **{ceiling:.0f} GB/s**  ")
    print(f"{dev}, nheads {H}, nheads_k {HK}, headdim {D}, bf16, one query token, full cache; GB/s = K/V bytes / "
          f"median time")
    print()
    print("| batch | cache | provider | launch | gqa | splits | time (us) | K/V GB/s | % of ceiling | max abs err |")
    print("|---:|---:|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.get("status") != "ok":
            print(f"| {r['batch']} | {r['seqlen_k']} | {r['provider']} | {r.get('launch', '')} | | | "
                  f"{r['status']} | | | |")
            continue
        print(f"| {r['batch']} | {r['seqlen_k']} | {r['provider']} | {r['launch']} | {r['gqa']} | "
              f"{r.get('num_splits', '')} | {r['ms'] * 1e3:.1f} | {r['gbs']:.0f} | {100 * r['frac_ceiling']:.0f}% | "
              f"{r['max_abs_err']:.1e} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_decode.json")
    with open(path, "w") as f:
        json.dump(dict(device=dev, sms=sms, torch=torch.__version__, triton=triton.__version__,
                       ceiling_gbs=ceiling, page=pages, command=" ".join(sys.argv), rows=rows), f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

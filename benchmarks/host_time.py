"""Host time per call of every entry point beside SDPA's equivalent call: how long the CPU spends issuing the work.

    PYTHONPATH=. python benchmarks/host_time.py [--out DIR] [--only NAME,NAME] [--profile N]     (GPU machine)

Each row is a pair (flashtile call, SDPA call) on the same tensors; a call is timed as `calls` calls enqueued back to
back without synchronising (the GPU work of these shapes is shorter than their host time, except where noted),
median of `rounds` rounds, the pair's two calls interleaved round by round. Rows:
- train: forward + backward in one call (flash_attn_func(...).backward(do) against SDPA's), b1 n128 h4 d128 causal
  and the demo's b2 n2048 h16 d128 causal (where the GPU time is about the host time: both appear in the table);
- fwd: the training forward alone (inputs requiring grad), and the inference forward (torch.no_grad);
- varlen: flash_attn_varlen_func fwd+bwd of 4 packed sequences of 128 (h4 d128) against SDPA on the padded batch;
- compiled: the train rows and the inference forward inside torch.compile'd functions (flashtile's custom ops);
- generation step: one step of an eager generation loop over a growing cache (transformers' DynamicCache), the
  16 layers of a 1B-class model at batch 1 (32 / 8 heads, d64) each attending one query over its cache, one more
  key at each step (from 4k) in new (batch, heads, seqlen, d) tensors: flash_attn_func on the (batch, seqlen,
  heads, d) views transformers' integration passes against SDPA on the tensors; each step is a shape not seen
  before, its first layer's call a new argument signature;
- decode: flash_attn_with_kvcache at batch 1, seqlen_q 1, nheads 32 / 8, d128, 4k cache (value checks off as a
  serving loop would have them): int and tensor cache_seqlens, paged (pages of 256 and 16), with an appended token;
  against cuDNN SDPA on the same (contiguous) cache.
bf16 throughout. --profile N: cProfile each flashtile call and print its N heaviest functions by own time.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.api import problem as _problem

DT = torch.bfloat16


def _t(*shape, grad=False):
    return torch.randn(*shape, device="cuda", dtype=DT, requires_grad=grad)


def _flash(q, k, v):
    return flashtile.flash_attn_func(q, k, v, causal=True)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _train_rows(prefix: str, attn, sdpa) -> list:
    """Training-call rows (forward + backward in one call) at b1 n128 h4 and the demo's b2 n2048 h16, d128:
    attn(q, k, v) on (b, n, h, d) tensors against sdpa on the same memory seen as (b, h, n, d)."""
    pairs = []
    for b, n, h in ((1, 128, 4), (2, 2048, 16)):
        q, k, v = (_t(b, n, h, 128, grad=True) for _ in range(3))
        do = torch.randn_like(q)
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)
        pairs.append((f"{prefix}train b{b} n{n} h{h} d128 causal",
                      lambda q=q, k=k, v=v, do=do: attn(q, k, v).backward(do),
                      lambda qt=qt, kt=kt, vt=vt, dot=dot: sdpa(qt, kt, vt).backward(dot)))
    return pairs


def train_pairs():
    pairs = _train_rows("", _flash, _sdpa)
    q, k, v = (_t(1, 128, 4, 128, grad=True) for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    pairs.append(("fwd (training) b1 n128 h4 d128 causal", lambda: _flash(q, k, v), lambda: _sdpa(qt, kt, vt)))

    def ft_inf():
        with torch.no_grad():
            _flash(q, k, v)

    def sd_inf():
        with torch.no_grad():
            _sdpa(qt, kt, vt)
    pairs.append(("fwd (inference) b1 n128 h4 d128 causal", ft_inf, sd_inf))
    return pairs


def compiled_pairs():
    """The training rows and the inference forward inside torch.compile'd functions (the default backend): what a
    compiled model's attention layer costs per call (flashtile through its custom ops). A graph per shape
    (dynamic=False), as a model of fixed shapes gets."""
    ft_c, sd_c = (torch.compile(fn, fullgraph=True, dynamic=False) for fn in (_flash, _sdpa))
    pairs = _train_rows("compiled ", ft_c, sd_c)
    q, k, v = (_t(1, 128, 4, 128) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    pairs.append(("compiled fwd (inference) b1 n128 h4 d128 causal", lambda: ft_c(q, k, v), lambda: sd_c(qt, kt, vt)))
    return pairs


def varlen_pairs():
    nseq, n, h = 4, 128, 4
    q, k, v = (_t(nseq * n, h, 128, grad=True) for _ in range(3))
    do = torch.randn_like(q)
    cu = torch.arange(0, nseq * n + 1, n, dtype=torch.int32, device="cuda")
    qt, kt, vt = (_t(nseq, h, n, 128, grad=True) for _ in range(3))
    dot = torch.randn_like(qt)

    def ft():
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True).backward(do)

    def sd():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(dot)
    return [(f"varlen train {nseq} x {n} h{h} d128 causal (SDPA: padded batch)", ft, sd)]


def generation_pairs(layers: int = 16, start: int = 4096, steps: int = 4096):
    """One eager generation step per call (the module docstring's row): keys grow by one per step, for `steps` steps
    (more than any run makes, so every step's length is new), then start over. Each step's layers get caches of a
    new tensor each, as transformers' DynamicCache concatenates them (allocated, not written: the same host work
    for both calls)."""
    b, h, hk, d = 1, 32, 8, 64
    q = _t(b, h, 1, d)
    step = {"flashtile": 0, "sdpa": 0}

    def caches(who):
        n = start + step[who] % steps
        step[who] += 1
        return [[torch.empty(b, hk, n, d, device="cuda", dtype=DT) for _ in range(2)] for _ in range(layers)]

    def ft():
        qt = q.transpose(1, 2)
        for kc, vc in caches("flashtile"):
            flashtile.flash_attn_func(qt, kc.transpose(1, 2), vc.transpose(1, 2), causal=True)

    def sd():   # (its flash kernel: cuDNN's, SDPA's first choice here, builds a plan per new length, tens of ms)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            for kc, vc in caches("sdpa"):
                F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
    return [(f"generation step, growing cache ({layers} layers, b1 4k+, d64)", ft, sd)]


def decode_pairs():
    b, h, hk, d, cache = 1, 32, 8, 128, 4096
    kc, vc = (_t(b, cache, hk, d) for _ in range(2))
    q = _t(b, 1, h, d)
    k1, v1 = (_t(b, 1, hk, d) for _ in range(2))
    seqlens = torch.full((b,), cache - 1, dtype=torch.int32, device="cuda")
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def sd():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    pairs = [("decode b1 4k, int cache_seqlens", lambda: flashtile.flash_attn_with_kvcache(q, kc, vc,
                                                                                           cache_seqlens=cache), sd),
             ("decode b1 4k, tensor cache_seqlens",
              lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens), sd),
             ("decode b1 4k, append one token",
              lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=seqlens), sd)]
    for page in (256, 16):
        kp, vp = (x.view(b * cache // page, page, hk, d) for x in (kc, vc))
        table = torch.arange(b * cache // page, dtype=torch.int32, device="cuda").view(b, -1)
        pairs.append((f"decode b1 4k, paged (page {page})",
                      lambda kp=kp, vp=vp, table=table: flashtile.flash_attn_with_kvcache(
                          q, kp, vp, cache_seqlens=seqlens, block_table=table), sd))
    return pairs


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def profile(fn, top: int, calls=300) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50, help="calls enqueued per round (default 50)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", default="", help="comma-separated substrings of row names")
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _problem.CHECK_VALUES = False
    torch.manual_seed(0)
    pairs = train_pairs() + varlen_pairs() + compiled_pairs() + generation_pairs() + decode_pairs()
    if args.only:
        pairs = [p for p in pairs if any(s in p[0] for s in args.only.split(","))]
    rows = []
    for name, ft, sd in pairs:
        for _ in range(20):
            ft(), sd()
        a, b = [], []
        for _ in range(args.rounds):
            a.append(host_us(ft, args.calls))
            b.append(host_us(sd, args.calls))
        rows.append(dict(call=name, flashtile_us=statistics.median(a), sdpa_us=statistics.median(b)))
        print(f"{name:58s} flashtile {rows[-1]['flashtile_us']:7.1f} us   SDPA {rows[-1]['sdpa_us']:7.1f} us",
              flush=True)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, calls=args.calls, rounds=args.rounds)
    md = ["| call | flashtile (us) | SDPA (us) | flashtile / SDPA |", "|---|---:|---:|---:|"]
    md += [f"| {r['call']} | {r['flashtile_us']:.1f} | {r['sdpa_us']:.1f} | {r['flashtile_us'] / r['sdpa_us']:.2f}x |"
           for r in rows]
    print("\n" + f"{env['device']}, torch {env['torch']}, triton {env['triton']}: host time per call, median of "
          f"{args.rounds} rounds of {args.calls} calls\n" + "\n".join(md))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_time.json"), "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "host_time.md"), "w") as f:
            f.write("\n".join(md) + "\n")
    if args.profile:
        for name, ft, _ in pairs:
            print("=====", name)
            print(profile(ft, args.profile), flush=True)


if __name__ == "__main__":
    main()

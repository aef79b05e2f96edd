"""Variable-length training step: packed (flash_attn_varlen_func) vs padded dense (flash_attn_func), fwd + bwd.

Usage (GPU machine, repo root):  PYTHONPATH=. python benchmarks/bench_varlen.py --out DIR

Each point is a batch of sequences with lengths drawn uniformly from [max_len / 8, max_len] (fixed seed) and
about --tokens real tokens in total; nheads 16, nheads_k 16 and 4 (GQA), headdim 128, bf16, causal and not.
- packed: the real tokens only, (total, h, d) with cu_seqlens; the kernels skip nothing that is not there.
- padded: the same sequences right-padded to (batch, max_len, h, d) and run dense (the padding rows are computed
  and then discarded, as a model without varlen support does); the key padding is not masked (flash_attn_func has
  no key mask), so this is the cost, not a numerically equal result: correctness of the packed path is
  checked separately against a per-sequence dense run of the same kernels (max abs error, bf16).
Metric: median time (triton.testing.do_bench) of forward+backward, real tokens/s, and useful TFLOP/s
(sum over sequences of 4 * s^2 * h * d for the forward (halved when causal), x3.5 for forward+backward).
Prints a Markdown table; writes DIR/bench_varlen.json. Budget: about 1-2 minutes on an H100/H200.
"""
import argparse
import json
import os
import sys

import torch
import triton

import flashtile
from flashtile.varlen import flash_attn_varlen_func

D = 128
DTYPE = torch.bfloat16


def bench_ms(fn, grads):
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def lengths(max_len, tokens, gen):
    out = []
    while sum(out) < tokens:
        out.append(int(torch.randint(max_len // 8, max_len + 1, (1,), generator=gen)))
    return out


def useful_flops(lens, h, causal):
    f = sum(4 * s * s * h * D for s in lens) / (2 if causal else 1)
    return 3.5 * f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--max-lens", default="1024,4096,16384")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = []
    for max_len in (int(x) for x in args.max_lens.split(",")):
        lens = lengths(max_len, args.tokens, gen)
        total, batch, mx = sum(lens), len(lens), max(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        for h, hk in ((16, 16), (16, 4)):
            for causal in (False, True):
                q = torch.randn(total, h, D, dtype=DTYPE, device="cuda", requires_grad=True)
                k = torch.randn(total, hk, D, dtype=DTYPE, device="cuda", requires_grad=True)
                v = torch.randn(total, hk, D, dtype=DTYPE, device="cuda", requires_grad=True)
                do = torch.randn(total, h, D, dtype=DTYPE, device="cuda")
                # correctness of the packed path: each sequence alone through the dense kernel
                with torch.no_grad():
                    out = flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal)
                    err = 0.0
                    for i in range(min(batch, 4)):
                        a, b = int(cu[i]), int(cu[i + 1])
                        o1 = flashtile.flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal)[0]
                        err = max(err, (o1.float() - out[a:b].float()).abs().max().item())

                def packed():
                    o = flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal)
                    o.backward(do)

                # padded dense layout of the same sequences
                qp = torch.zeros(batch, mx, h, D, dtype=DTYPE, device="cuda")
                kp = torch.zeros(batch, mx, hk, D, dtype=DTYPE, device="cuda")
                vp = torch.zeros(batch, mx, hk, D, dtype=DTYPE, device="cuda")
                for i, s in enumerate(lens):
                    a = int(cu[i])
                    qp[i, :s], kp[i, :s], vp[i, :s] = q.detach()[a:a + s], k.detach()[a:a + s], v.detach()[a:a + s]
                qp.requires_grad_()
                kp.requires_grad_()
                vp.requires_grad_()
                dop = torch.randn(batch, mx, h, D, dtype=DTYPE, device="cuda")

                def padded():
                    o = flashtile.flash_attn_func(qp, kp, vp, causal=causal)
                    o.backward(dop)

                fl = useful_flops(lens, h, causal)
                for name, fn, grads in (("packed", packed, [q, k, v]), ("padded", padded, [qp, kp, vp])):
                    ms = bench_ms(fn, grads)
                    rows.append(dict(max_len=max_len, batch=batch, total_tokens=total, padded_tokens=batch * mx,
                                     nheads=h, nheads_k=hk, causal=causal, provider=name, ms=ms,
                                     tokens_per_s=total / ms * 1e3, useful_tflops=fl / ms / 1e9,
                                     packed_max_abs_err=err))
                    print(f"max_len={max_len} b={batch} h={h}/{hk} causal={causal:d} {name:7s} {ms:8.3f} ms "
                          f"{fl / ms / 1e9:6.1f} TF (err {err:.1e})", flush=True)
                del q, k, v, do, qp, kp, vp, dop
                torch.cuda.empty_cache()
    print()
    print(f"{dev}; headdim {D}, bf16, forward+backward; useful TFLOP/s count real tokens only")
    print()
    print("| max len | seqs | tokens (padded) | heads | causal | packed ms | padded ms | speed-up | packed TF/s | "
          "packed err |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for p, d in zip(rows[0::2], rows[1::2]):
        print(f"| {p['max_len']} | {p['batch']} | {p['total_tokens']} ({p['padded_tokens']}) | "
              f"{p['nheads']}/{p['nheads_k']} | {p['causal']} | {p['ms']:.2f} | {d['ms']:.2f} | "
              f"{d['ms'] / p['ms']:.2f}x | {p['useful_tflops']:.0f} | {p['packed_max_abs_err']:.1e} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_varlen.json")
    with open(path, "w") as f:
        json.dump(dict(device=dev, torch=torch.__version__, triton=triton.__version__, command=" ".join(sys.argv),
                       rows=rows), f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

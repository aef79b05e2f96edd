"""FlashAttention-3 (Gluon, Hopper) forward variants beside flashtile's Triton forward and cuDNN, in one run.

Usage (Hopper GPU machine, repo root):
    PYTHONPATH=. python benchmarks/sweep_fa3.py --out DIR [--heads 64,128,256] [--seqlens 2048,8192] [--rounds 2]
        [--variants "d:num_wg,Bc,stages,pingpong[,persistent];..."]

A variant sets flashtile.kernels.gluon.fa3.CONFIGS[d] and fa3.PINGPONG[d] (0: the consumer warpgroups issue
their GEMMs without taking turns, full and causal alike) and fa3.PERSISTENT (0: one program per tile; default 1),
and drops fa3.SHORT_CONFIGS of d, so the variant runs at every length.
Default variants: the shipped config of each head dim plus its no-ping-pong twin and the neighbouring tile shapes.
Each variant is first checked against float64 (b2 s768, GQA 2:1, bf16, full and causal). Shapes: the FA3 grid
(16k tokens, hidden 2048), bf16. Timing: triton.testing.do_bench medians of the kernel launch (fa3.fwd on
preallocated outputs) and of flash_attn_func with FLASHTILE_GLUON=0 (the Triton kernel) and cuDNN SDPA; rounds
alternate the providers; the best round is reported. Writes DIR/sweep_fa3.json.
"""
import json
import os

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from _sweep_args import grid_points, parse_int_variants, restore, sweep_args
from flashtile.kernels.gluon import fa3
from flashtile.kernels.triton.launch import AttnParams
from flashtile.reference.dense import attention_ref

DEFAULT_VARIANTS = ("64:3,128,2,1;64:3,128,2,0;64:2,128,2,1;"
                    "128:2,128,2,1;128:2,128,2,0;128:2,128,3,1;128:2,64,4,1;"
                    "256:2,64,2,1;256:2,64,2,0;256:2,32,4,1")


def use(d, variant):
    for causal in (False, True):   # the variant at every length
        fa3.SHORT_CONFIGS.pop((d, causal), None)
    fa3.CONFIGS[d] = variant[:3]
    fa3.PINGPONG[d] = (bool(variant[3]), bool(variant[3]))
    fa3.PERSISTENT = bool(variant[4]) if len(variant) > 4 else True


def run_fa3(q, k, v, causal, out=None, lse=None):
    b, s, h, d = q.shape
    out = torch.full_like(q, float("nan")) if out is None else out
    lse = torch.full((b, h, s), float("nan"), device=q.device) if lse is None else lse
    fa3.fwd(q, k, v, out, lse, AttnParams(softmax_scale=d ** -0.5, window_right=0 if causal else -1))
    return out, lse


def check(d, variant):
    for causal in (False, True):
        q = torch.randn(2, 768, 4, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 768, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        use(d, variant)
        out, lse = run_fa3(q, k, v, causal)
        o_ref, l_ref, _ = attention_ref(q, k, v, causal=causal)   # float64
        err, l_err = (out.double() - o_ref).abs().max().item(), (lse.double() - l_ref).abs().max().item()
        if not (err < 2e-2 and l_err < 1e-3):
            raise SystemExit(f"d{d} {variant} causal={causal}: max error {err:.3g}, LSE {l_err:.3g}")


def main():
    args = sweep_args(seqlens="2048,8192", variants=DEFAULT_VARIANTS)
    variants = parse_int_variants(args.variants)   # (num_wg, Bc, stages, pingpong)
    rows = []
    for d in (int(x) for x in args.heads.split(",")):
        shipped, shipped_pp, persistent = fa3.CONFIGS.get(d), fa3.PINGPONG.get(d), fa3.PERSISTENT
        shipped_short = {c: fa3.SHORT_CONFIGS.get((d, c)) for c in (False, True)}
        for variant in variants[d]:
            check(d, variant)
        for s, causal, q, k, v, out, lse, flops in grid_points(d, (int(x) for x in args.seqlens.split(","))):
            res = {}
            for _ in range(args.rounds):
                for variant in variants[d]:
                    use(d, variant)
                    ms = triton.testing.do_bench(lambda: run_fa3(q, k, v, causal, out, lse), warmup=25, rep=150)
                    res.setdefault("fa3 wg%d Bc%d st%d pp%d" % variant[:4] + " np" * (variant[4:] == (0, )),
                                   []).append(flops / ms / 1e9)
                os.environ["FLASHTILE_GLUON"] = "0"
                ms = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
                                             warmup=25, rep=150)
                os.environ.pop("FLASHTILE_GLUON")
                res.setdefault("triton", []).append(flops / ms / 1e9)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal), warmup=25, rep=150)
                res.setdefault("cudnn", []).append(flops / ms / 1e9)
            print(f"d{d} s{s} causal={int(causal)} | " + " | ".join(f"{n} {max(t):.1f}" for n, t in res.items()),
                  flush=True)
            rows.append(dict(head_dim=d, seqlen=s, causal=causal, tflops=res))
        restore(((fa3.CONFIGS, d, shipped), (fa3.PINGPONG, d, shipped_pp),
                 *((fa3.SHORT_CONFIGS, (d, c), shipped_short[c]) for c in (False, True))))
        fa3.PERSISTENT = persistent
    with open(os.path.join(args.out, "sweep_fa3.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

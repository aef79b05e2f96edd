"""The Gluon FP8 forward's variants (fa3.FP8_CONFIGS / FP8_PINGPONG / FWD_REGS) beside the Triton FP8 kernel and
flashtile's bf16 forward, in one run (where fa3.FP8_CONFIGS comes from).

Usage (Hopper GPU machine, repo root):
    PYTHONPATH=. python benchmarks/sweep_fp8_gluon.py --out DIR [--heads 64,128,256] [--seqlens 8192] [--rounds 2]
        [--variants "d:warpgroups,Bc,stages,pingpong,programs_per_sm;..."]

Each variant runs fa3.fwd_fp8 on inputs quantized for its tiles (V^T in the kernel's key order) and is checked
against the Triton FP8 kernel on the same blocks (max difference < 5e-2: same e4m3 operands, fp32 summation order
and the tensor cores' FP8 accumulation differ). Shapes: the FA3 grid (16k tokens, hidden 2048), bf16 inputs.
Timing: triton.testing.do_bench medians of the kernel launch; rounds alternate the providers; the best round is
reported. Writes DIR/sweep_fp8_gluon.json.
"""
import json
import os

import triton

import flashtile
from _sweep_args import grid_points, parse_int_variants, restore, sweep_args
from flashtile.fp8 import FP8Config, attention_fp8, fp8_config, quantize_fp8
from flashtile.kernels.gluon import fa3

DEFAULT_VARIANTS = ("64:2,256,2,0,1;64:3,128,2,0,1;64:3,128,2,1,1;64:3,256,2,0,1;"
                    "128:2,128,2,0,1;128:3,128,2,0,1;128:3,128,2,1,1;"
                    "256:2,128,2,1,1;256:2,128,2,0,1")


def use(d, variant):
    num_wg, block_n, stages, pingpong, per_sm = variant
    fa3.FP8_CONFIGS[d] = (num_wg, block_n, stages)
    fa3.FP8_PINGPONG[d] = (bool(pingpong), bool(pingpong))
    fa3.FWD_REGS[(d, True)] = fa3.TWO_PER_SM if per_sm == 2 else fa3.ONE_PER_SM


def main():
    args = sweep_args(seqlens="8192", variants=DEFAULT_VARIANTS)
    variants = parse_int_variants(args.variants)   # (warpgroups, Bc, stages, pingpong, programs per SM)
    rows = []
    for d in (int(x) for x in args.heads.split(",")):
        shipped = fa3.FP8_CONFIGS.get(d), fa3.FP8_PINGPONG.get(d), fa3.FWD_REGS.get((d, True))
        for s, causal, q, k, v, out, lse, flops in grid_points(d, (int(x) for x in args.seqlens.split(","))):
            scale = d ** -0.5
            tcfg = fp8_config(d, causal)
            t_tri = quantize_fp8(q, k, v, causal=causal, block_m=tcfg.BLOCK_M, block_n=tcfg.BLOCK_N,
                                 v_key_perm=False)
            inputs = {}
            for variant in variants[d]:   # quantized for the variant's tiles, checked once
                t = quantize_fp8(q, k, v, causal=causal, block_m=fa3.WG_ROWS, block_n=variant[1], v_key_perm=True)
                same = quantize_fp8(q, k, v, causal=causal, block_m=fa3.WG_ROWS, block_n=variant[1],
                                    v_key_perm=False)
                use(d, variant)
                fa3.fwd_fp8(t.q, t.k, t.v, t.q_scale, t.k_scale, t.v_scale, out, lse, scale, causal)
                ref, _ = attention_fp8(same, softmax_scale=scale, causal=causal,
                                       config=FP8Config(fa3.WG_ROWS, variant[1], 4, 2))
                err = (out.float() - ref.float()).abs().max().item()
                if not err < 5e-2:
                    raise SystemExit(f"d{d} {variant} causal={causal}: max difference {err:.3g}")
                inputs[variant] = t
            res = {}
            for _ in range(args.rounds):
                for variant, t in inputs.items():
                    use(d, variant)
                    ms = triton.testing.do_bench(lambda: fa3.fwd_fp8(
                        t.q, t.k, t.v, t.q_scale, t.k_scale, t.v_scale, out, lse, scale, causal), rep=100)
                    res.setdefault("gluon wg%d Bc%d st%d pp%d per_sm%d" % variant, []).append(flops / ms / 1e9)
                ms = triton.testing.do_bench(lambda: attention_fp8(t_tri, softmax_scale=scale, causal=causal,
                                                                   config=tcfg), rep=100)
                res.setdefault("triton fp8", []).append(flops / ms / 1e9)
                ms = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal), rep=100)
                res.setdefault("flashtile bf16", []).append(flops / ms / 1e9)
            print(f"d{d} s{s} causal={int(causal)} | " + " | ".join(f"{n} {max(t):.0f}" for n, t in res.items()),
                  flush=True)
            rows.append(dict(head_dim=d, seqlen=s, causal=causal, tflops=res))
        restore(((fa3.FP8_CONFIGS, d, shipped[0]), (fa3.FP8_PINGPONG, d, shipped[1]),
                 (fa3.FWD_REGS, (d, True), shipped[2])))
    with open(os.path.join(args.out, "sweep_fp8_gluon.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

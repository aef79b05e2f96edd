"""Where the split-KV decode merges its splits, same-run A/B: in the decode launch (the last split of each tile,
decode.FUSED_MAX_SPLITS) or in combine.py's separate kernel (with its merge step of 32 or 64 splits), beside SDPA
cuDNN, at the points where the split count decides it.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/ab_decode_combine.py --out DIR [--rounds 3]

Problem: bench_decode.py's (nheads 32, nheads_k 8, d128, bf16, one query token, full cache) at batch 1 (4k / 32k /
128k: 16-33 splits, the separate kernel) and batch 8 with a 4k cache (4 splits, fused), contiguous and paged (256)
caches. Variants: "shipped" (what flash_attn_with_kvcache does), "separate chunk32" / "separate chunk64" (always
the separate kernel, merging 32 / 64 splits per step), "fused" (always in the decode launch), via
decode.CONFIG_OVERRIDE. Each is checked against SDPA's math backend (batch element 0), captured in a CUDA graph and
timed by do_bench medians in --rounds alternating rounds; the best round is reported (us). Writes
DIR/ab_decode_combine.json.
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as BD  # noqa: E402
from flashtile.api import problem as _problem  # noqa: E402
from flashtile.kernels.triton import decode as _decode  # noqa: E402
from flashtile.kvcache import flash_attn_with_kvcache  # noqa: E402

POINTS = ((1, 4096), (1, 32768), (1, 131072), (8, 4096))
VARIANTS = {"shipped": {}, "separate chunk32": {"fused_combine": False, "combine_chunk": 32},
            "separate chunk64": {"fused_combine": False, "combine_chunk": 64}, "fused": {"fused_combine": True}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    _problem.CHECK_VALUES = False
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    rows = []
    for batch, seqlen in POINTS:
        q = torch.randn(batch, 1, BD.H, BD.D, dtype=BD.DTYPE, device="cuda")
        kc = torch.randn(batch, seqlen, BD.HK, BD.D, dtype=BD.DTYPE, device="cuda")
        vc = torch.randn_like(kc)
        kp, vp, table = BD.to_paged(kc, vc, 256)
        cudnn, _ = BD.sdpa_runner(BD.SDPBackend.CUDNN_ATTENTION, q, kc, vc, allow_repeat=False)
        ref = BD.reference_slice(q, kc, vc, 1)
        for layout in ("contig", "paged256"):
            if layout == "contig":
                def run():
                    return flash_attn_with_kvcache(q, kc, vc)
            else:
                def run():
                    return flash_attn_with_kvcache(q, kp, vp, block_table=table)
            graphs, errs = {"cudnn": BD.graphed(cudnn)}, {}
            for name, override in VARIANTS.items():
                _decode.CONFIG_OVERRIDE.clear()
                _decode.CONFIG_OVERRIDE.update(override)
                try:
                    errs[name] = (run()[:1].float() - ref).abs().max().item()
                    if not errs[name] <= BD.TOL:
                        raise SystemExit(f"b{batch} {seqlen} {layout} {name}: max abs err {errs[name]:.3e}")
                    graphs[name] = BD.graphed(run)
                finally:
                    _decode.CONFIG_OVERRIDE.clear()
            us = {n: [] for n in graphs}
            for _ in range(args.rounds):
                for n, g in graphs.items():
                    us[n].append(triton.testing.do_bench(g, warmup=25, rep=100, return_mode="median") * 1e3)
            rows.append(dict(batch=batch, seqlen=seqlen, layout=layout, us={n: min(v) for n, v in us.items()},
                             rounds=us, max_abs_err=errs))
            print(f"b{batch} {seqlen} {layout}: " + " | ".join(f"{n} {min(v):.1f}" for n, v in us.items()), flush=True)
        del q, kc, vc, kp, vp, table
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_decode_combine.json"), "w") as f:
        json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

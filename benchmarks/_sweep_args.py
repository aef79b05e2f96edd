"""The command line shared by the interleaved sweeps (sweep_schedule.py, sweep_fa3.py): where to write, which head
dims / sequence lengths, how many alternating rounds, which variants. Parses sys.argv, creates --out and prints
the GPU and versions (every sweep log starts with that line)."""
import argparse
import os

import torch
import triton


def sweep_args(seqlens: str, variants: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--heads", default="64,128,256")
    ap.add_argument("--seqlens", default=seqlens)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=variants)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    return args


def parse_int_variants(text: str) -> dict:
    """"d:a,b,c;d:a,b,c" -> {d: [(a, b, c), ...]} (integers; the sweep gives the fields their meaning)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        d, vals = item.split(":")
        out.setdefault(int(d), []).append(tuple(int(x) for x in vals.split(",")))
    return out


def restore(entries) -> None:
    """Puts back the config tables a sweep changed: entries of (table, key, shipped value or None = absent)."""
    for table, key, value in entries:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def grid_points(d: int, seqlens):
    """The FA3 grid's problems at head dim d (16k tokens, hidden 2048, bf16), full and causal: (seqlen, causal, q,
    k, v, out, lse, flops) with fresh random inputs and preallocated outputs."""
    for s in seqlens:
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
            yield s, causal, q, k, v, out, lse, 4 * b * h * s * s * d / (2 if causal else 1)

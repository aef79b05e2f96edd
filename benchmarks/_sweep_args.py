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

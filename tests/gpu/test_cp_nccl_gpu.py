"""Context parallelism on several GPUs under NCCL: every mode's output and gradients against one GPU.

benchmarks/bench_cp.py's agreement step, launched by torchrun on min(4, the GPUs present) processes (skipped
with fewer than 2): the packed-document ring, the dense zigzag ring, Ulysses and (4 GPUs) the hybrid USP, bf16,
causal, 32 / 8 heads, d128, on 4096 tokens (the varlen problem: 8 documents of 128..1024 tokens), each gathered
and compared with one GPU in bf16 and in float32 on the same inputs. The bar, per tensor (out, dq, dk, dv):
|cp - fp32| <= 2 |one GPU - fp32| + 2^-7 max|fp32|.

Run with ``pytest tests/gpu`` on a machine with 2 or more GPUs (NVLink multicast is turned off by the script).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 or more CUDA GPUs", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_every_mode_agrees_with_one_gpu_under_nccl(tmp_path):
    world = min(4, torch.cuda.device_count())
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           str(ROOT / "benchmarks" / "bench_cp.py"), "--check-tokens", "4096", "--budget-s", "0", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    modes = {r["mode"]: r for r in doc["agreement"]}
    assert set(modes) == ({"varlen", "ring", "ulysses", "usp"} if world >= 4 else {"varlen", "ring", "ulysses"})
    for mode, row in modes.items():
        assert row["ok"], (mode, {n: row[n] for n in ("out", "dq", "dk", "dv")})
    print("\n".join(line for line in res.stdout.splitlines() if " check " in line))   # (the figures, with -s)

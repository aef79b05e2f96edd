"""benchmarks/ab_host.py: a revision's package extracted as flashtile_base loads beside the tree's in one process and
computes what the tree computes (CPU, the Triton interpreter; the timing itself needs a GPU)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ab_host():
    spec = importlib.util.spec_from_file_location("ab_host", ROOT / "benchmarks" / "ab_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rename_makes_the_package_names_the_base_ones():
    ab = _ab_host()
    source = ("from flashtile.api import problem\nfrom flashtile import interface\nimport flashtile.kernels.dispatch\n"
              "    import flashtile  # the public API\n_LIB = torch.library.Library(\"flashtile\", \"FRAGMENT\")\n"
              "torch.ops.flashtile.fwd(q)\n@torch.library.custom_op(\"flashtile::row_fwd\")\n"
              "flashtile_attention_forward = None  # flashtile.flex, not renamed\n")
    assert ab.rename(source) == (
        "from flashtile_base.api import problem\nfrom flashtile_base import interface\n"
        "import flashtile_base.kernels.dispatch\n    import flashtile_base as flashtile  # the public API\n"
        "_LIB = torch.library.Library(\"flashtile_base\", \"FRAGMENT\")\ntorch.ops.flashtile_base.fwd(q)\n"
        "@torch.library.custom_op(\"flashtile_base::row_fwd\")\n"
        "flashtile_attention_forward = None  # flashtile.flex, not renamed\n")


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout (git archive)")
def test_extracted_package_runs_beside_the_tree(tmp_path, seed):
    """HEAD extracted, then both packages imported in one (fresh) process: the base's own custom ops are registered
    and the two packages' forward and backward agree exactly on the same inputs."""
    _ab_host().extract("HEAD", str(tmp_path))
    script = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
import torch
import flashtile, flashtile_base
assert flashtile_base.__file__.startswith({str(tmp_path)!r}), flashtile_base.__file__
assert hasattr(torch.ops.flashtile_base, "fwd") and hasattr(torch.ops.flashtile, "fwd")
torch.manual_seed({seed})
q, k, v = (torch.randn(2, 37, 4, 16, requires_grad=True) for _ in range(3))
do = torch.randn(2, 37, 4, 16)
results = []
for package in (flashtile, flashtile_base):
    out = package.flash_attn_func(q, k, v, causal=True)
    results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
for a, b in zip(*results):
    assert torch.equal(a, b), (a - b).abs().max()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr

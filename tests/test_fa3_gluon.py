"""FlashAttention-3's Hopper forward (flashtile/kernels/gluon) without a GPU: which problems it takes, and that the
kernel compiles for sm_90 with the installed Triton. Its numerics are checked on a Hopper GPU
(tests/gpu/test_fa3_gluon_gpu.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile.kernels.gluon import fa3
from flashtile.kernels.triton.launch import AttnParams

ROOT = Path(__file__).resolve().parents[1]


def _qkv(b=2, sq=1024, sk=1024, h=4, hk=4, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


FULL, CAUSAL = AttnParams(softmax_scale=0.1), AttnParams(softmax_scale=0.1, window_right=0)


@pytest.mark.parametrize("kw,params", [
    (dict(), FULL), (dict(), CAUSAL), (dict(d=256), CAUSAL), (dict(dtype=torch.float16, hk=1), FULL),
    (dict(sq=512, sk=1536), FULL), (dict(sq=1536, sk=256, d=128), FULL), (dict(d=256, sk=1984), FULL),
])
def test_eligible_problems(kw, params):
    assert fa3.eligible(*_qkv(**kw), params)


@pytest.mark.parametrize("kw,params", [
    (dict(d=64), FULL),                                  # the Triton kernel is faster at head dim 64
    (dict(d=96), FULL),
    (dict(dtype=torch.float32), FULL),
    (dict(sq=1000, sk=1000), FULL),                      # not a multiple of Br = 128
    (dict(sk=1000), FULL),                               # not a multiple of Bc
    (dict(sq=1024, sk=2048), CAUSAL),                    # causal needs s_q == s_k
    (dict(), AttnParams(softmax_scale=0.1, window_left=256, window_right=0)),
    (dict(), AttnParams(softmax_scale=0.1, softcap=20.0)),
    (dict(), AttnParams(softmax_scale=0.1, dropout_p=0.1)),
    (dict(), AttnParams(softmax_scale=0.0)),             # the kernel scales the row max: scale must be > 0
    (dict(), AttnParams(softmax_scale=-0.1, window_right=0)),
])
def test_ineligible_problems(kw, params):
    assert not fa3.eligible(*_qkv(**kw), params)


def test_ineligible_features_and_layouts():
    q, k, v = _qkv()
    assert not fa3.eligible(q, k, v, FULL, alibi=torch.ones(4))
    assert not fa3.eligible(q, k, v, FULL, mask=torch.ones(1, 1, 1024, 1024, dtype=torch.bool))
    assert not fa3.eligible(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, FULL)   # strided q
    assert not fa3.eligible(q[0], k[0], v[0], FULL)                                        # packed (varlen) layout
    buf = torch.empty(q.numel() + 1, dtype=q.dtype)
    q_odd = buf[1:].view(q.shape)                     # contiguous, but not 16-byte aligned: TMA cannot read it
    assert q_odd.is_contiguous() and not fa3.eligible(q_odd, k, v, FULL)


def test_cpu_tensors_and_switch_off(monkeypatch):
    q, k, v = _qkv()
    assert not fa3.supports(q, k, v, FULL)   # CPU tensors: the Triton kernel (interpreter) runs
    monkeypatch.setenv("FLASHTILE_GLUON", "0")
    assert not fa3.enabled()


def test_kernel_compiles_for_sm90():
    """Every variant the dispatcher can launch compiles to sm_90 PTX with wgmma, within 227 KiB of shared memory,
    and every consumer's mbarrier arrival follows a bar.sync of its warpgroup (the barrier counts rely on it)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    specs = [f"{d},{c},{dt}" for d in sorted(fa3.CONFIGS) for c in (0, 1) for dt in ("bf16",)] + ["128,0,fp16"]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "fa3_compile_check.py"), *specs], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ok ")]
    assert len(lines) == len(specs), res.stdout
    for ln in lines:
        fields = dict(f.split("=") for f in ln.split()[2:] if "=" in f)
        assert int(fields["wgmma"]) > 0 and 0 < int(fields["shared"]) <= 227 * 1024, ln
        assert int(fields["arrives"]) > 0 and int(fields["unsynced"]) == 0, ln


def test_disabled_context_nests():
    assert fa3.enabled()
    with fa3.disabled():
        with fa3.disabled():
            assert not fa3.enabled()
        assert not fa3.enabled()
    assert fa3.enabled()

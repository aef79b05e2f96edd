"""The lean call path on a CUDA GPU: a problem's first call plans its launches (kernels.dispatch, the Gluon plans,
the Triton launch templates) and later calls launch through them. Repeated calls with fresh inputs must each match
the float64 reference, so a template that passes a stale or wrong tensor fails here.

Run with ``pytest tests/gpu`` on an H100/H200 (skipped without CUDA).
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA-only tests", allow_module_level=True)

import flashtile  # noqa: E402
from attn_utils import Case, case_inputs, check_against_reference, flash_kwargs  # noqa: E402
from flashtile.kernels.gluon import fa3  # noqa: E402

fp16, bf16 = torch.float16, torch.bfloat16

CASES = [
    Case(2, 1024, 1024, 8, 8, 128, bf16, causal=True),     # Gluon forward and backward plans
    Case(2, 1024, 1024, 8, 2, 64, fp16),                   # Gluon, GQA
    Case(1, 1024, 1024, 4, 4, 256, bf16, causal=True),     # Gluon forward, Triton backward template (split dK / dV)
    Case(2, 1000, 1000, 4, 4, 128, bf16, causal=True),     # Gluon forward (ragged tiles), Triton backward template
    Case(2, 900, 1300, 8, 2, 128, bf16, window=(200, 0), softcap=20.0, alibi="bh"),   # Gluon forward, features
    Case(1, 700, 1300, 4, 2, 96, fp16, window=(200, 0), softcap=20.0, alibi="bh"),   # Triton templates (d96)
    Case(2, 512, 512, 8, 8, 64, bf16, causal=True, deterministic=True),   # the two-pass backward
]


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_repeated_calls_match_the_reference(c, seed):
    for _ in range(3):   # the first call plans, the others launch through the plans / templates
        q, k, v, dout, alibi = case_inputs(c)
        out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **flash_kwargs(c, alibi))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)


def test_varlen_repeated_calls_match_per_sequence_reference(seed):
    from flashtile.reference.dense import attention_ref
    lens = [300, 0, 1000, 77]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, h, d = sum(lens), 8, 128
    for _ in range(3):
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=bf16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for i in range(len(lens)):
            a, b = int(cu[i]), int(cu[i + 1])
            if a == b:
                continue
            xs = [t.detach()[a:b].unsqueeze(0).double().requires_grad_() for t in (q, k, v)]
            ref, _, _ = attention_ref(*xs, causal=True)
            ref.backward(dout[a:b].unsqueeze(0).double())
            for name, ours, r in (("out", out, ref), ("dq", dq, xs[0].grad), ("dk", dk, xs[1].grad),
                                  ("dv", dv, xs[2].grad)):
                err = (ours[a:b].unsqueeze(0).double() - r).abs().max().item()
                assert err < 5e-2, (name, i, err)


def test_gluon_switched_off_between_calls_takes_the_triton_path(seed, monkeypatch):
    """A plan made with Gluon on is not used while Gluon is off (fa3.disabled, FLASHTILE_GLUON=0)."""
    c = Case(2, 1024, 1024, 4, 4, 128, bf16, causal=True)
    q, k, v, dout, alibi = case_inputs(c)
    flashtile.flash_attn_func(q, k, v, causal=True)
    with fa3.disabled():
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(c, q, k, v, dout, alibi, out, None, None, grads)
    monkeypatch.setenv("FLASHTILE_GLUON", "0")
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    check_against_reference(c, q, k, v, dout, alibi, out, None, None, None)

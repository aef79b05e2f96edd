"""FlashAttention-3's Hopper forward (flashtile/kernels/gluon, Gluon) on an H100/H200: every case it takes is
checked against float64 (output, LSE, and the gradients of the Triton backward that runs from its LSE); the
cases it must not take fall back to the Triton kernel. Skipped without a CUDA device of compute capability 9.x.
"""
import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("Hopper-only tests", allow_module_level=True)

import flashtile  # noqa: E402
from flashtile.kernels.gluon import fa3  # noqa: E402
from flashtile.kernels.triton import launch  # noqa: E402
from attn_utils import Case, case_inputs, check_against_reference, flash_kwargs, keep_mask_from_s_dmask  # noqa: E402

fp16, bf16 = torch.float16, torch.bfloat16

FA3_CASES = [
    Case(2, 1024, 1024, 8, 8, 128, bf16),
    Case(2, 1024, 1024, 8, 8, 128, fp16, causal=True),
    Case(1, 2048, 2048, 16, 2, 128, bf16, causal=True),            # GQA 8:1
    Case(2, 512, 1536, 4, 1, 128, fp16),                           # s_q < s_k, MQA
    Case(2, 1536, 256, 4, 4, 128, bf16),                           # s_q > s_k (full attention)
    Case(1, 8192, 8192, 2, 2, 128, bf16, causal=True),             # long
    Case(2, 1024, 1024, 4, 4, 256, bf16),
    Case(1, 2048, 2048, 4, 4, 256, fp16, causal=True),
    Case(2, 640, 1984, 8, 2, 256, bf16, softmax_scale=0.3),        # odd multiples of the tiles
    Case(1, 4096, 4096, 8, 8, 256, bf16, causal=True),
]

TRITON_CASES = [   # shapes or features the FA3 kernel does not take
    Case(2, 1024, 1024, 8, 8, 64, bf16, causal=True),              # head dim 64: the Triton kernel is faster
    Case(1, 1000, 1000, 4, 4, 128, bf16, causal=True),             # seqlen not a multiple of Br
    Case(1, 1024, 2048, 4, 4, 128, bf16, causal=True),             # causal with s_q != s_k
    Case(1, 1024, 1024, 4, 4, 128, fp16, window=(256, 0)),
    Case(1, 1024, 1024, 4, 4, 256, bf16, softcap=20.0),
    Case(1, 1024, 1024, 4, 4, 128, bf16, alibi="h"),
    Case(1, 1024, 1024, 4, 4, 128, bf16, dropout_p=0.1),
    Case(1, 1024, 1024, 4, 4, 128, bf16, layout="transposed"),
    Case(1, 1024, 1024, 4, 4, 128, torch.float32),
]


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _params(c: Case):
    return launch.AttnParams(softmax_scale=c.softmax_scale or c.d ** -0.5, window_left=c.window[0],
                             window_right=0 if c.causal else c.window[1], softcap=c.softcap, dropout_p=c.dropout_p)


def _run(c: Case, monkeypatch):
    """flash_attn_func forward + backward, counting the forwards the FA3 kernel ran."""
    calls = []
    real = fa3.fwd
    monkeypatch.setattr(fa3, "fwd", lambda *a: calls.append(1) or real(*a))
    q, k, v, dout, alibi = case_inputs(c, "cuda")
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi, return_attn_probs=True))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = keep_mask_from_s_dmask(s_dmask) if c.dropout_p > 0 else None
    return (q, k, v, dout, alibi), out, lse, grads, keep, len(calls)


@pytest.mark.parametrize("c", FA3_CASES, ids=lambda c: c.id)
def test_fa3_forward_matches_reference_gpu(c: Case, seed, monkeypatch):
    (q, k, v, dout, alibi), out, lse, grads, _, n_fa3 = _run(c, monkeypatch)
    assert n_fa3 == 1, f"the FA3 kernel did not take [{c.id}]"
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)


@pytest.mark.parametrize("c", TRITON_CASES, ids=lambda c: c.id)
def test_other_cases_run_triton_gpu(c: Case, seed, monkeypatch):
    (q, k, v, dout, alibi), out, lse, grads, keep, n_fa3 = _run(c, monkeypatch)
    assert n_fa3 == 0, f"the FA3 kernel took a case it does not support [{c.id}]"
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads, dropout_mask=keep)


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_agrees_with_triton_kernel_gpu(causal, seed, monkeypatch):
    """Both forwards on the same inputs: equal within bf16 rounding of the output, LSE to fp32 rounding."""
    q, k, v = (torch.randn(2, 2048, 16, 128, device="cuda", dtype=bf16) for _ in range(3))
    assert fa3.supports(q, k, v, _params(Case(2, 2048, 2048, 16, 16, 128, bf16, causal=causal)))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    monkeypatch.setenv("FLASHTILE_GLUON", "0")
    out_t, lse_t, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert (out.float() - out_t.float()).abs().max().item() < 2e-2
    assert (lse - lse_t).abs().max().item() < 1e-4


def test_fa3_writes_every_element_gpu(seed):
    """The kernel's outputs start as NaN (poisoned) and come back finite: every tile and LSE row written."""
    c = Case(3, 1152, 1152, 6, 3, 256, bf16, causal=True)
    q, k, v = (torch.randn(c.b, c.sq, n, c.d, device="cuda", dtype=bf16) for n in (c.h, c.hk, c.hk))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((c.b, c.h, c.sq), float("nan"), device="cuda")
    assert fa3.supports(q, k, v, _params(c))
    fa3.fwd(q, k, v, out, lse, _params(c))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()

"""FlashAttention-3's Hopper forward and backward (flashtile/kernels/gluon, Gluon) on an H100/H200: every case
they take is checked against float64 (output, LSE, and the gradients, from the Gluon backward at the head dims
it has, else the Triton one); the cases they must not take fall back to the Triton kernels. Skipped without a
CUDA device of compute capability 9.x.
"""
import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("Hopper-only tests", allow_module_level=True)

import flashtile  # noqa: E402
from flashtile import interface  # noqa: E402
from flashtile.kernels.gluon import fa3  # noqa: E402
from flashtile.kernels import dispatch  # noqa: E402
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
    Case(2, 1024, 1024, 8, 8, 64, bf16),                           # d64: Br = 192, the last tile's third
    Case(1, 2048, 2048, 16, 2, 64, fp16, causal=True),             # warpgroup (or second and third) idle
    Case(2, 640, 1536, 4, 1, 64, bf16),
    Case(2, 512, 512, 4, 2, 64, bf16),                             # d64 up to fa3.SHORT_CONFIGS' lengths:
    Case(2, 1024, 1024, 4, 4, 64, fp16, causal=True),              # two warpgroups (Br = 128)
    Case(2, 448, 1024, 4, 1, 64, bf16),                            # (the last tile's second warpgroup idle)
    Case(2, 512, 512, 8, 2, 64, bf16, causal=True),                # causal up to 512: Bc 64, 3 stages
    Case(2, 448, 448, 4, 4, 64, fp16, causal=True),                # (448: a multiple of Bc 64, not of 128)
    Case(2, 512, 512, 8, 2, 128, bf16, causal=True),
    Case(1, 320, 320, 4, 1, 128, fp16, causal=True),
    Case(2, 704, 640, 4, 2, 128, bf16),                            # s_q % Br = 64: the last tile's second
    Case(1, 1088, 1088, 2, 1, 256, fp16, causal=True),             # warpgroup computes rows it does not store
]

TRITON_CASES = [   # features or layouts the FA3 forward does not take (tests/gpu/test_fa3_features_gpu.py: those it
    Case(1, 1024, 1024, 4, 4, 128, bf16, dropout_p=0.1),        # takes beyond dense aligned problems)
    Case(1, 1024, 1024, 4, 4, 128, torch.float32),
    Case(1, 512, 512, 4, 4, 128, bf16, layout="transposed"),   # under dispatch.COPY_MIN_WORK: the strided inputs
]


def _params(c: Case):
    return launch.AttnParams(softmax_scale=c.softmax_scale or c.d ** -0.5, window_left=c.window[0],
                             window_right=0 if c.causal else c.window[1], softcap=c.softcap, dropout_p=c.dropout_p)


def _run(c: Case, monkeypatch):
    """flash_attn_func forward + backward, counting the forwards and backwards the FA3 kernels ran."""
    calls = {"fwd": 0, "bwd": 0}
    for name in calls:
        real = getattr(fa3, name)
        monkeypatch.setattr(fa3, name, lambda *a, _n=name, _f=real: calls.__setitem__(_n, calls[_n] + 1) or _f(*a))
    q, k, v, dout, alibi = case_inputs(c, "cuda")
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi, return_attn_probs=True))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = keep_mask_from_s_dmask(s_dmask) if c.dropout_p > 0 else None
    return (q, k, v, dout, alibi), out, lse, grads, keep, calls


def _bwd_takes(c: Case) -> bool:
    return c.d in fa3.BWD_CONFIGS   # (any lengths: tests/gpu/test_fa3_features_gpu.py)


@pytest.mark.parametrize("c", FA3_CASES, ids=lambda c: c.id)
def test_fa3_forward_matches_reference_gpu(c: Case, seed, monkeypatch):
    (q, k, v, dout, alibi), out, lse, grads, _, calls = _run(c, monkeypatch)
    assert calls["fwd"] == 1, f"the FA3 forward did not take [{c.id}]"
    assert calls["bwd"] == int(_bwd_takes(c)), f"FA3 backward calls {calls['bwd']} [{c.id}]"
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)


@pytest.mark.parametrize("c", TRITON_CASES, ids=lambda c: c.id)
def test_other_cases_run_triton_gpu(c: Case, seed, monkeypatch):
    (q, k, v, dout, alibi), out, lse, grads, keep, calls = _run(c, monkeypatch)
    assert calls == {"fwd": 0, "bwd": 0}, f"an FA3 kernel took a case it does not support [{c.id}]: {calls}"
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads, dropout_mask=keep)


BWD_CASES = [   # the Gluon backward (d64; the d128 backward's cases are in FA3_CASES)
    Case(2, 1024, 1024, 8, 8, 64, bf16, causal=True),
    Case(2, 640, 1152, 4, 2, 64, fp16),                            # GQA, s_q < s_k
    Case(1, 2048, 2048, 8, 1, 64, bf16, causal=True),              # MQA
    Case(2, 1536, 256, 4, 4, 64, bf16),                            # s_q > s_k
    Case(1, 4224, 1024, 2, 1, 64, fp16),                           # full, s_q > 4k
    Case(1, 4608, 4608, 2, 2, 128, bf16),
]


@pytest.mark.parametrize("c", BWD_CASES, ids=lambda c: c.id)
def test_fa3_backward_matches_reference_gpu(c: Case, seed, monkeypatch):
    (q, k, v, dout, alibi), out, lse, grads, _, calls = _run(c, monkeypatch)
    assert calls == {"fwd": int(fa3.eligible(q, k, v, _params(c))), "bwd": 1}, calls
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)


SPLIT_CASES = [   # causal GQA / MQA on the dense backward kernel
    Case(2, 1024, 1024, 8, 2, 64, bf16, causal=True),
    Case(1, 2048, 2048, 16, 2, 128, fp16, causal=True),
    Case(2, 512, 512, 8, 1, 128, bf16, causal=True),
]


@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize("c", SPLIT_CASES, ids=lambda c: c.id)
def test_fa3_backward_split_group_gpu(c: Case, split, seed, monkeypatch):
    """A KV head's query heads split over programs that add dK, dV into float32 accumulators (fa3.GQA_SPLIT: 0 = the
    rule's split, here the whole group (these problems fill no GPU), 2 = two; the size threshold lowered so these
    problems take it): outputs poisoned (tests/conftest.py), gradients against float64, on the first call and on
    the plan's repeat call."""
    monkeypatch.setattr(fa3, "GQA_SPLIT_MIN_WORK", 0)
    monkeypatch.setattr(fa3, "GQA_SPLIT", split)
    monkeypatch.setattr(interface, "_DENSE", {})   # (problems, and their plans, made under these settings)
    q, k = (torch.empty(c.b, c.sq, n, c.d, device="cuda") for n in (c.h, c.hk))
    assert fa3.bwd_split(q, k, _params(c), True, False, c.sq, c.sk, fa3.BWD_CONFIGS[c.d][1]) == (split or c.h // c.hk)
    for repeat in range(2):   # (the repeat: the plan's launch template)
        (q, k, v, dout, alibi), out, lse, grads, _, calls = _run(c, monkeypatch)
        assert calls["bwd"] == 1 - repeat, calls
        check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)


# (head_dim, (num_wg, Bc, stages), ping-pong) not shipped today: three consumer warpgroups (Br = 192), whose last
# tile of a sequence ends after one or two of them (1024 = 5 x 192 + 64, 2048 = 10 x 192 + 128)
TILE_VARIANTS = [(64, (3, 128, 2), True), (64, (3, 128, 2), False), (128, (3, 64, 2), False)]
TILE_CASES = [
    Case(2, 1024, 1024, 4, 2, 0, bf16),
    Case(2, 2048, 2048, 4, 4, 0, fp16, causal=True),
    Case(1, 1152, 1152, 6, 1, 0, bf16, causal=True),
    Case(2, 640, 1536, 4, 1, 0, bf16),
]


@pytest.mark.parametrize("variant", TILE_VARIANTS, ids=lambda v: f"d{v[0]}-{v[1]}-pp{int(v[2])}")
@pytest.mark.parametrize("c", TILE_CASES, ids=lambda c: c.id)
def test_fa3_forward_tile_variants_gpu(c: Case, variant, seed, monkeypatch):
    """The kernel at tiles the sweep tries (benchmarks/sweep_fa3.py): every row of a NaN-poisoned output and LSE
    written, and both against float64."""
    d, cfg, pingpong = variant
    monkeypatch.setattr(fa3, "SHORT_CONFIGS", {})   # the variant at every length
    monkeypatch.setitem(fa3.CONFIGS, d, cfg)
    monkeypatch.setitem(fa3.PINGPONG, d, (pingpong, pingpong))
    c = Case(c.b, c.sq, c.sk, c.h, c.hk, d, c.dtype, causal=c.causal)
    q, k, v, dout, alibi = case_inputs(c, "cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((c.b, c.h, c.sq), float("nan"), device="cuda")
    assert fa3.supports(q, k, v, _params(c))
    fa3.fwd(q, k, v, out, lse, _params(c))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, None)


def test_fa3_backward_deterministic_runs_triton_gpu(seed, monkeypatch):
    """deterministic=True asks for no atomics: the Gluon backward (TMA reduce-add of dQ) must not run."""
    c = Case(1, 1024, 1024, 4, 4, 128, bf16, causal=True)
    calls = []
    monkeypatch.setattr(fa3, "bwd", lambda *a: calls.append(1))
    q, k, v, dout, _ = case_inputs(c, "cuda")
    out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    g2 = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    assert not calls and all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", sorted(fa3.BWD_CONFIGS))
def test_fa3_backward_agrees_with_triton_gpu(d, causal, seed, monkeypatch):
    """Both backwards from the same forward: gradients equal within bf16 rounding."""
    q, k, v, dout = (torch.randn(2, 2048, 2048 // d, d, device="cuda", dtype=bf16, requires_grad=True)
                     for _ in range(4))
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    monkeypatch.setenv("FLASHTILE_GLUON", "0")
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    grads_t = torch.autograd.grad(out, (q, k, v), dout)
    for name, g, gt in zip(("dq", "dk", "dv"), grads, grads_t):
        scale = gt.float().abs().max().item()
        assert (g.float() - gt.float()).abs().max().item() < 2e-2 * scale, name


def test_fa3_backward_writes_every_element_gpu(seed):
    """dk, dv start as NaN (poisoned) and come back finite: every key block of every head written (GQA 2:1)."""
    _check_bwd_writes_every_element(Case(2, 1152, 1280, 6, 3, 128, bf16))


def test_fa3_backward_d64_writes_every_element_gpu(seed):
    _check_bwd_writes_every_element(Case(2, 1152, 1280, 6, 3, 64, fp16, causal=False))


def _check_bwd_writes_every_element(c: Case):
    q, k, v = (torch.randn(c.b, s, n, c.d, device="cuda", dtype=c.dtype) for s, n in ((c.sq, c.h), (c.sk, c.hk),
                                                                                     (c.sk, c.hk)))
    dout = torch.randn_like(q)
    out, lse = torch.empty_like(q), torch.empty(c.b, c.h, c.sq, device="cuda")
    dispatch.flash_fwd(q, k, v, out, lse, _params(c))
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    assert fa3.supports(q, k, v, _params(c), backward=True)
    dispatch.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, _params(c))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["packed", "heads_first"])
@pytest.mark.parametrize("d", sorted(fa3.BWD_CONFIGS))
def test_fa3_backward_strided_dk_dv_gpu(d, layout, causal, seed):
    """dK, dV leave by TMA: into slices of a packed (q, k, v)
    gradient directly (a TMA-ready view), into a (batch, nheads, seqlen, d) buffer seen transposed through a
    contiguous copy; both poisoned, both bitwise equal to contiguous dk, dv."""
    c = Case(2, 1024, 1024, 4, 2, d, bf16, causal=causal)
    q, k, v = (torch.randn(c.b, c.sq, n, d, device="cuda", dtype=bf16) for n in (c.h, c.hk, c.hk))
    dout = torch.randn_like(q)
    out, lse = torch.empty_like(q), torch.empty(c.b, c.h, c.sq, device="cuda")
    dispatch.flash_fwd(q, k, v, out, lse, _params(c))
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    dispatch.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, _params(c))
    if layout == "packed":
        kv = torch.full((c.b, c.sk, 2, c.hk, d), float("nan"), device="cuda", dtype=bf16)
        dk2, dv2 = kv[:, :, 0], kv[:, :, 1]
        assert launch.tma_row_view(dk2) is not None
    else:
        dk2, dv2 = (torch.full((c.b, c.hk, c.sk, d), float("nan"), device="cuda", dtype=bf16).transpose(1, 2)
                    for _ in range(2))
        assert launch.tma_row_view(dk2) is None
    dq2 = torch.full_like(q, float("nan"))
    dispatch.flash_bwd(dout, q, k, v, out, lse, dq2, dk2, dv2, _params(c))
    assert torch.equal(dk2, dk) and torch.equal(dv2, dv)
    assert (dq2.float() - dq.float()).abs().max().item() <= 1e-2 * dq.float().abs().max().item()


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


PERSISTENT_CASES = [   # (head_dim, seqlen_q, seqlen_k, causal, fp8)
    (64, 1024, 1024, False, False), (64, 2048, 2048, True, False), (128, 704, 640, False, False),
    (128, 1152, 1152, True, False), (256, 1088, 1088, True, False), (128, 1024, 1024, True, True),
    (256, 1024, 2048, False, True), (64, 1280, 1280, True, True), (64, 640, 1024, False, True),
]


@pytest.mark.parametrize("d,sq,sk,causal,fp8", PERSISTENT_CASES)
def test_fa3_persistent_equals_one_tile_per_program_gpu(d, sq, sk, causal, fp8, seed, monkeypatch):
    """The persistent forward with 5 programs (each draws tile after tile: ring positions, turns and Q buffers
    carried over tiles) gives bitwise the output and LSE of one program per tile, every element written, and
    leaves the stream's tile counter at 0."""
    from flashtile.fp8 import quantize_fp8
    from flashtile.kernels.triton.decode import tickets
    q = torch.randn(3, sq, 6, d, device="cuda", dtype=bf16)
    k, v = (torch.randn(3, sk, 2, d, device="cuda", dtype=bf16) for _ in range(2))
    if fp8:
        t = quantize_fp8(q, k, v, causal=causal, block_m=fa3.WG_ROWS, block_n=fa3.FP8_CONFIGS[d][1], v_key_perm=True)

    def run():
        out = torch.full_like(q, float("nan"))
        lse = torch.full((3, 6, sq), float("nan"), device="cuda")
        if fp8:
            fa3.fwd_fp8(t.q, t.k, t.v, t.q_scale, t.k_scale, t.v_scale, out, lse, d ** -0.5, causal)
        else:
            fa3.fwd(q, k, v, out, lse, launch.AttnParams(softmax_scale=d ** -0.5, window_right=0 if causal else -1))
        return out, lse

    monkeypatch.setattr(fa3, "PERSISTENT", False)
    want = run()
    monkeypatch.setattr(fa3, "PERSISTENT", True)
    monkeypatch.setattr(fa3, "_sm_count", lambda _: 5)
    got = run()
    got2 = run()
    assert tickets(q.device, 1)[0].item() == 0
    assert all(torch.isfinite(x).all() for x in got)
    assert torch.equal(got[0], got2[0]) and torch.equal(got[1], got2[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

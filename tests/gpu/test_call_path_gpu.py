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


@pytest.mark.parametrize("c", CASES[:2] + CASES[4:5], ids=[c.id for c in CASES[:2] + CASES[4:5]])
def test_launches_over_reused_buffers_match_the_reference(c, seed):
    """Launches over the same buffers refilled, alternating between two sets (A, B, A, B): the direct launches keep
    a TMA descriptor's encoded map per base address (relaunch._DescriptorSlot), so a map of the wrong buffer, or one
    kept past its tensor, fails here. On the GPU image's Triton (3.6) the Gluon templates launch directly."""
    import triton
    from flashtile.kernels import relaunch
    sets = [case_inputs(c) for _ in range(2)]
    for i in range(4):
        q, k, v, dout, alibi = sets[i % 2]
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **flash_kwargs(c, alibi))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)
    if triton.__version__.startswith("3.6") and relaunch.DIRECT:
        bounds = [t.bound for t in list(fa3._FWD_TEMPLATES.values()) + list(fa3._BWD_TEMPLATES.values())]
        assert bounds and all(b.direct is not None for b in bounds)


@pytest.mark.parametrize("rows", ["every-row-in-a-sequence", "padding-rows", "values-unread"])
def test_varlen_repeated_calls_match_per_sequence_reference(rows, seed, monkeypatch):
    """Repeated varlen training calls go through the Gluon plans, the backward's too (dispatch._GluonBackward, its
    dQ accumulator zeroed by the preprocess kernel, or zero-filled where packed rows may belong to no sequence:
    rows past cu_seqlens[-1], or cu_seqlens' values not read); each call matches the per-sequence float64
    reference, and rows of no sequence get zero outputs and gradients."""
    from flashtile.api import problem
    from flashtile.kernels import dispatch
    from flashtile.reference.dense import attention_ref
    if rows == "values-unread":
        monkeypatch.setattr(problem, "CHECK_VALUES", False)
    planned = []
    real = dispatch._GluonBackward.__call__
    monkeypatch.setattr(dispatch._GluonBackward, "__call__",
                        lambda self, *a: planned.append(self.p.padded_q) or real(self, *a))
    lens = [300, 0, 1000, 77]
    pad = 45 if rows == "padding-rows" else 0
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, h, d = sum(lens) + pad, 8, 128
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
        for t in (out, dq, dk, dv):
            assert (t[sum(lens):] == 0).all()
    assert planned == [rows != "every-row-in-a-sequence"] * 3


LAYOUTS = ("contig", "packed", "transposed", "sliced", "packed", "contig", "transposed")


@pytest.mark.parametrize("c", CASES[:2], ids=[c.id for c in CASES[:2]])
def test_layouts_of_one_shape_alternating(c, seed, monkeypatch):
    """Training calls of one shape in the layouts models hand over, alternating: contiguous, slices of a packed qkv
    (rows at stride 3 h d: the TMA descriptors tile them as they are), (b, h, s, d) memory seen transposed and an
    unaligned strided view (both copied contiguous for the Hopper kernels: dispatch.kernel_inputs, its work threshold
    lowered to this size, the problems' memo emptied for the test). Each call matches the float64 reference, so a
    launch template of one layout serving another (its descriptors' geometry is the layout's) fails here; none runs
    the Triton kernels."""
    import dataclasses
    from flashtile import interface
    from flashtile.kernels import dispatch
    from flashtile.kernels.triton import launch
    monkeypatch.setattr(dispatch, "COPY_MIN_WORK", 0)
    monkeypatch.setattr(interface, "_DENSE", {})   # (problems whose copy decision was made with the threshold)
    triton_calls = []
    for name in ("flash_fwd", "flash_bwd"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _n=name, _f=real, **kw: triton_calls.append(_n) or _f(*a, **kw))
    for layout in LAYOUTS:
        cl = dataclasses.replace(c, layout=layout)
        q, k, v, dout, alibi = case_inputs(cl)
        out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **flash_kwargs(cl, alibi))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_against_reference(cl, q, k, v, dout, alibi, out, lse, None, grads)
    assert triton_calls == []


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


@pytest.mark.parametrize("mode", ["f32", "f32-fresh", "16bit", "16bit-fresh"])
@pytest.mark.parametrize("case", ["dense-aligned", "dense-ragged", "varlen", "dense-sliced"])
@pytest.mark.parametrize("d", [64, 128])
def test_gradients_added_into_sums_by_the_gluon_backward_gpu(case, d, mode, seed):
    """backward(..., sums=GradSums) on the Gluon kernels (the ring's steps): the float32 sums gain the dQ, dK and dV
    the plain call returns (within its 16-bit rounding), twice in a row, with D given; rows of no sequence gain
    nothing. dense-aligned: the dense kernel; dense-ragged / varlen: the general one (the last key rows of a
    sequence by pointers); dense-sliced: sums that are seqlen slices of a batch (no TMA view). dK / dV leave the
    kernel in float32 (kv_f32) or 16-bit; -fresh (kv_fresh): they are written, not added (dQ is added)."""
    from attn_utils import sums_case
    from flashtile import interface
    from flashtile.kernels.params import GradSums
    from flashtile.kernels.triton.launch import bwd_delta
    dense = (2, 1024, 1024) if case in ("dense-aligned", "dense-sliced") else (2, 300, 500)
    p, x, q, k, v, do, out, lse = sums_case(case == "varlen", bf16, "cuda", dense, d)
    grads = [g.float() for g in interface.backward(p, do, q, k, v, out, lse, None, x)]
    delta = bwd_delta(out, do, lse, None, x.cu_seqlens_q, p.seqlen_q)
    if case == "dense-sliced":   # the sums: rows [64, 64 + seqlen) of longer float32 tensors
        sums = [torch.randn(t.shape[0], t.shape[1] + 128, *t.shape[2:], device="cuda")[:, 64:-64] for t in (q, k, v)]
    else:
        sums = [torch.randn(t.shape, device="cuda") for t in (q, k, v)]
    before = [t.clone() for t in sums]
    fresh = mode.endswith("fresh")
    for n in (1, 2):
        opts = dict(kv_f32=mode.startswith("f32"), kv_fresh=fresh)
        assert interface.backward(p, do, q, k, v, out, lse, None, x, sums=GradSums(*sums, delta, **opts)) == [None] * 3
        for name, got, b, g in zip("qkv", sums, before, grads):
            want = g if fresh and name != "q" else b + n * g
            err = (got - want).abs().max().item()
            assert err <= n * 2 ** -7 * g.abs().max().item() + 1e-5, (name, n, err)
    if case == "varlen":
        for name, got, b in zip("qkv", sums, before):
            assert torch.equal(got[161:], torch.zeros_like(b[161:]) if fresh and name != "q" else b[161:]), name


@pytest.mark.parametrize("n", [1, 4, 8])
def test_merge_parts_matches_merge_attention_gpu(seed, n):
    """The ring's merge (combine.merge_parts) of n parts on the GPU, compiled and through relaunch's fast path
    (launched twice), against the readable rule (merge_attention) applied part by part: bf16 parts, every other
    part over rows [100, 900) only, rows empty in some parts or all (their part rows hold NaN: never read), the
    output in bf16 and in float32."""
    from flashtile.distributed import merge_attention
    from flashtile.kernels.triton.combine import merge_parts
    b, s, h, d = 2, 1000, 8, 128
    parts = []
    mo = torch.zeros(b, s, h, d, device="cuda")
    ml = torch.full((b, h, s), float("-inf"), device="cuda")
    for i in range(n):
        r0, r1 = (100, 900) if i % 2 else (0, s)
        o = torch.randn(b, r1 - r0, h, d, device="cuda").to(bf16)
        lse = torch.randn(b, h, r1 - r0, device="cuda") * 4
        lse[:, :, :10] = float("-inf")
        lse[:, :, 5 + i:15 + i] = float("-inf")
        o[lse.transpose(1, 2) == float("-inf")] = float("nan")
        parts.append((r0, o, lse))
        part = torch.nan_to_num(o.float(), nan=0.0)
        mo[:, r0:r1], ml[:, :, r0:r1] = merge_attention(mo[:, r0:r1], ml[:, :, r0:r1], part, lse)
    for out_dtype in (bf16, torch.float32):
        for _ in range(2):
            out = torch.full((b, s, h, d), 7.0, device="cuda", dtype=out_dtype)
            lse = torch.full((b, h, s), 7.0, device="cuda")
            merge_parts(parts, out, lse)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any() and torch.equal(torch.isinf(lse), torch.isinf(ml)), n
            fin = torch.isfinite(ml)
            assert torch.allclose(lse[fin], ml[fin], atol=1e-5), n
            tol = 1e-5 if out_dtype == torch.float32 else 1e-2
            assert torch.allclose(out.float(), mo, atol=tol, rtol=tol), (n, out_dtype)


def test_backward_scratch_from_the_streams_workspace(seed, monkeypatch):
    """The Gluon backward's D and dQ accumulator are views of a workspace per (stream, host thread)
    (runtime.workspace), which its plan keeps while the buffer stays the stream's: repeated training calls, calls on
    a second stream (a buffer of its own), a larger problem growing the buffer between calls of a smaller one, each
    match the float64 reference. Another host thread gets a buffer of its own; none while a CUDA graph is captured,
    nor above WORKSPACE_MAX_BYTES."""
    import threading
    from flashtile.kernels import dispatch, relaunch, runtime
    plans = []
    real = dispatch._GluonBackward.__call__
    monkeypatch.setattr(dispatch._GluonBackward, "__call__", lambda self, *a: plans.append(self) or real(self, *a))

    def train(c):
        q, k, v, dout, alibi = case_inputs(c)
        out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **flash_kwargs(c, alibi))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)
        return plans[-1]

    def buffers():   # (the backward runs on autograd's device thread: the buffers of this stream, any thread)
        dev = torch.cuda.current_device()
        return [b for key, b in runtime._WORKSPACES.items() if key[:2] == (dev, relaunch.raw_stream(dev))]

    small, large = Case(2, 512, 512, 8, 8, 128, bf16, causal=True), Case(2, 2048, 2048, 8, 8, 128, bf16)
    for _ in range(2):
        plan = train(small)
        assert plan.scratch is not None and any(plan.scratch[0] is b for b in buffers())
    main_buffers = buffers()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan = train(small)
        assert any(plan.scratch[0] is b for b in buffers())
        assert not any(plan.scratch[0] is b for b in main_buffers)
    torch.cuda.current_stream().wait_stream(side)
    train(large)
    plan = train(small)
    assert any(plan.scratch[0] is b for b in buffers()) and plan.scratch[0].numel() >= 2 * 2048 * 8 * 128
    mine, theirs = runtime.workspace(torch.device("cuda"), 16), []
    worker = threading.Thread(target=lambda: theirs.append(runtime.workspace(torch.device("cuda"), 16)))
    worker.start()
    worker.join()
    assert mine is runtime.workspace(torch.device("cuda"), 16) and theirs[0] is not mine
    assert runtime.workspace(torch.device("cuda"), runtime.WORKSPACE_MAX_BYTES // 4 + 1) is None
    x = torch.zeros(16, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        x.add_(1)
        assert runtime.workspace(x.device, 16) is None
    torch.cuda.current_stream().wait_stream(stream)

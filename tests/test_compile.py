"""torch.compile(fullgraph=True) traces flash_attn_func (forward and backward) without a graph break.

The interface implements the kernels as torch.library custom ops with fake (meta) implementations, so Dynamo
sees one opaque op and AOTAutograd one backward op. fullgraph=True turns any graph break into an error;
torch._dynamo.explain counts them explicitly. On the CPU most cases use backend="aot_eager" (traces the same
graphs as inductor, without a C++ build per graph); one case compiles with inductor end to end.
"""
import pytest
import torch

import flashtile
from attn_utils import DEVICE, Case, case_inputs, check_against_reference, keep_mask_from_s_dmask

fp16, fp32 = torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class AttnBlock(torch.nn.Module):
    """Attention between a bit of surrounding computation, as in a transformer layer."""

    def __init__(self, **attn_kwargs):
        super().__init__()
        self.attn_kwargs = attn_kwargs

    def forward(self, q, k, v, alibi_slopes=None):
        out = flashtile.flash_attn_func(q * 1.0, k, v, alibi_slopes=alibi_slopes, **self.attn_kwargs)
        return out * 2.0 - 1.0


def _run(fn, q, k, v, dout, alibi=None):
    out = fn(q, k, v, alibi)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), grads


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fwd_bwd_equals_eager(backend, seed):
    c = Case(2, 64, 80, 4, 2, 40, fp16, causal=True, softcap=5.0, alibi="bh", window=(24, -1))
    q, k, v, dout, alibi = case_inputs(c)
    m = AttnBlock(causal=True, softcap=5.0, window_size=(24, -1), deterministic=True)
    out_e, g_e = _run(m, q, k, v, dout, alibi)
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    out_c, g_c = _run(compiled, q, k, v, dout, alibi)
    torch.testing.assert_close(out_c, out_e, rtol=1e-3, atol=1e-3)
    for name, a, b_ in zip(("dq", "dk", "dv"), g_c, g_e):
        torch.testing.assert_close(a, b_, rtol=1e-3, atol=1e-3, msg=lambda s, n=name: f"{n}: {s}")


def test_compiled_steps_share_one_problem(seed, monkeypatch):
    """A compiled graph calls the custom ops with the same arguments step after step: every step's forward and
    backward get one Problem (Problem.unpack's memo), so the plans dispatch keeps in it serve each step as they serve
    eager calls; inputs of other strides (a recompiled graph) get a Problem of their own. Each step matches the
    float64 reference."""
    from flashtile import interface
    seen = []
    for name in ("forward", "backward"):
        real = getattr(interface, name)
        monkeypatch.setattr(interface, name, lambda p, *a, _n=name, _f=real, **kw: seen.append((_n, p)) or _f(p, *a, **kw))
    c = Case(2, 48, 48, 4, 2, 32, fp16, causal=True)
    compiled = torch.compile(AttnBlock(causal=True), backend="aot_eager", fullgraph=True)
    for layout in ("contig", "contig", "contig", "transposed"):
        cl = Case(c.b, c.sq, c.sk, c.h, c.hk, c.d, c.dtype, causal=True, layout=layout)
        q, k, v, dout, _ = case_inputs(cl)
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout / 2.0)   # (the block doubles the attention output)
        check_against_reference(cl, q, k, v, dout, None, (out + 1.0) / 2.0, None, None, grads)
    assert [n for n, _ in seen] == ["forward", "backward"] * 4
    problems = [p for _, p in seen]
    assert all(p is problems[0] for p in problems[:6])
    assert problems[6] is not problems[0] and problems[7] is problems[6]


def test_explain_reports_no_graph_break(seed):
    c = Case(1, 32, 32, 2, 1, 24, fp32)
    q, k, v, _, _ = case_inputs(c)

    def fn(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True).sum()

    explanation = torch._dynamo.explain(fn)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_return_attn_probs_and_packed(seed):
    """The three-output form and the packed entry points also trace (fake impls give every output's shape)."""
    c = Case(1, 40, 40, 2, 2, 24, fp32, causal=True)
    qkv = torch.randn(c.b, c.sq, 3, c.h, c.d, device=DEVICE, requires_grad=True)
    dout = torch.randn(c.b, c.sq, c.h, c.d, device=DEVICE)

    def fn(qkv):
        out, lse, s_dmask = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
        q = qkv[:, :, 0]
        kv = qkv[:, :, 1:]
        out2 = flashtile.flash_attn_kvpacked_func(q, kv, causal=True)
        return out + out2, lse, s_dmask

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out_c, lse_c, s_c = compiled(qkv)
    (g_c,) = torch.autograd.grad(out_c, (qkv,), dout)
    out_e, lse_e, s_e = fn(qkv)
    (g_e,) = torch.autograd.grad(out_e, (qkv,), dout)
    assert lse_c.shape == (c.b, c.h, c.sq) and s_c.shape == (c.b, c.h, c.sq, c.sq)
    for a, b_ in ((out_c, out_e), (lse_c, lse_e), (s_c, s_e), (g_c, g_e)):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)
    q, k, v = (qkv[:, :, i].detach() for i in range(3))
    check_against_reference(c, q, k, v, dout, None, out_c.detach() / 2, lse_c, s_c, None)


def test_compiled_dropout_reproducible_and_matches_reference(seed):
    c = Case(1, 48, 48, 2, 2, 24, fp32, dropout_p=0.17)
    q, k, v, dout, _ = case_inputs(c)

    def fn(q, k, v):
        return flashtile.flash_attn_func(q, k, v, dropout_p=0.17, return_attn_probs=True)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for _ in range(2):
        torch.manual_seed(seed)
        out, lse, s_dmask = compiled(q, k, v)
        results.append((out, lse, s_dmask, torch.autograd.grad(out, (q, k, v), dout)))
    (o1, l1, s1, g1), (o2, _, s2, g2) = results
    assert torch.equal(o1, o2) and torch.equal(s1 >= 0, s2 >= 0), "same seed, different dropout under compile"
    check_against_reference(c, q, k, v, dout, None, o1, l1, s1, g1, dropout_mask=keep_mask_from_s_dmask(s1))


def test_compiled_dynamic_shapes(seed):
    """dynamic=True: the fake impls work with symbolic sizes; two sequence lengths, results as eager."""
    m = AttnBlock(causal=True)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=True)
    for sq, sk in ((24, 40), (33, 57)):
        c = Case(2, sq, sk, 2, 1, 24, fp32, causal=True)
        q, k, v, dout, _ = case_inputs(c)
        out_c, g_c = _run(compiled, q, k, v, dout)
        out_e, g_e = _run(m, q, k, v, dout)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
        for a, b_ in zip(g_c, g_e):
            torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_dispatch_modes_see_the_ops_and_eager_calls_skip_them(seed):
    """Eager calls run the kernels without the custom ops' dispatch (host time); a TorchDispatchMode still sees
    flashtile::fwd and flashtile::bwd as single ops, with the same results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashtile import interface

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, 40, 2, 32, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 40, 2, 32)
    assert interface._eager(q)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    eager = torch.autograd.grad(out, (q, k, v), do)
    rec = Recorder()
    with rec:
        assert not interface._eager(q)
        out_m = flashtile.flash_attn_func(q, k, v, causal=True)
        moded = torch.autograd.grad(out_m, (q, k, v), do)
    assert any("flashtile.fwd" in op for op in rec.ops) and any("flashtile.bwd" in op for op in rec.ops)
    assert torch.equal(out, out_m)
    for a, b in zip(eager, moded):
        assert torch.equal(a, b)


@pytest.mark.parametrize("features", ["plain", "bias-grad"])
def test_ops_pass_torch_library_opcheck(features, seed):
    """flashtile::fwd and flashtile::bwd, defined with torch.library's low-level API, pass torch.library.opcheck:
    schema (functional: no output aliases an input), autograd registration, fake implementations and AOT dispatch,
    the backward with attn_bias's gradient among its outputs too."""
    from flashtile import interface
    q, k, v = (torch.randn(1, 32, 2, 16, device=DEVICE) for _ in range(3))
    bias = torch.randn(1, 1, 32, 32, device=DEVICE) if features == "bias-grad" else None
    p = interface._dense_problem(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False)[0]
    if bias is not None:
        p = p.with_features(bias=True, bias_grad=True)
    ints, floats = p.pack()
    tensors = interface._op_tensors(interface.NO_EXTRAS, bias, ())
    result = torch.library.opcheck(torch.ops.flashtile.fwd.default, (q, k, v, tensors, ints, floats))
    assert all(r == "SUCCESS" for r in result.values()), result
    out, lse, rng_state, _ = torch.ops.flashtile.fwd(q, k, v, tensors, ints, floats)
    args = (torch.randn_like(out), q, k, v, out, lse, rng_state, tensors, ints, floats, None)
    result = torch.library.opcheck(torch.ops.flashtile.bwd.default, args)
    assert all(r == "SUCCESS" for r in result.values()), result
    assert len(torch.ops.flashtile.bwd(*args)) == (4 if bias is not None else 3)

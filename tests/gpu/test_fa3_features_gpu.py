"""The Hopper forward and backward (flashtile/kernels/gluon/_fa3_fwd.py, _fa3_bwd.py) on every input they take
beyond dense aligned problems, on an H100/H200: lengths their tiles do not divide, causal and windows aligned
bottom-right, softcap, ALiBi, GQA and varlen (random lengths, zero-length sequences) - each checked against float64
(output, LSE and gradients), each asserting which Gluon kernels ran (the backward at its head dims, 64 and 128),
and compared with the Triton kernels on the same inputs. Skipped without a CUDA device of compute capability 9.x.
"""
import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("Hopper-only tests", allow_module_level=True)

import flashtile  # noqa: E402
from flashtile import interface, varlen  # noqa: E402
from flashtile.kernels.gluon import fa3  # noqa: E402
from flashtile.kernels.params import AttnParams  # noqa: E402
from flashtile.varlen import flash_attn_varlen_func  # noqa: E402
from attn_utils import Case, case_inputs, check_against_reference, flash_kwargs  # noqa: E402
from test_varlen import VCase, check_varlen, cu, packed_inputs  # noqa: E402

fp16, bf16 = torch.float16, torch.bfloat16

DENSE_CASES = [
    Case(2, 1000, 1000, 4, 4, 128, bf16, causal=True),             # lengths the tiles do not divide
    Case(2, 1000, 1000, 8, 2, 64, fp16),
    Case(1, 777, 1299, 4, 1, 256, bf16),
    Case(2, 1024, 2048, 4, 4, 128, bf16, causal=True),             # bottom-right causal, s_q < s_k
    Case(2, 2048, 1000, 4, 2, 128, fp16, causal=True),             # s_q > s_k: the first rows see no key
    Case(1, 1024, 1024, 4, 4, 128, fp16, window=(256, 0)),
    Case(2, 1500, 1300, 4, 2, 64, bf16, window=(100, 37)),
    Case(1, 2048, 2048, 4, 4, 256, bf16, window=(0, 0)),           # each row sees its diagonal key only
    Case(1, 1024, 1024, 4, 4, 256, bf16, softcap=20.0),
    Case(2, 1100, 1100, 4, 4, 128, fp16, softcap=30.0, causal=True),
    Case(1, 1024, 1024, 4, 4, 128, bf16, alibi="h"),
    Case(2, 900, 1400, 8, 4, 64, bf16, alibi="bh", causal=True, softcap=15.0, window=(300, 0)),
    Case(1, 4096, 4096, 16, 2, 128, bf16, window=(1024, 1024)),
    Case(2, 1024, 1024, 8, 8, 64, fp16, causal=True, softcap=30.0),
    Case(1, 1088, 1000, 4, 1, 64, bf16, window=(0, 0)),
    # ALiBi's row term folded out of the scores (causal tiles left of the diagonal), and the general tiles
    Case(1, 4096, 4096, 8, 8, 128, bf16, alibi="h", causal=True),
    Case(2, 1000, 3000, 4, 2, 128, fp16, alibi="bh", causal=True),   # bottom-right: distances start past 2000
    Case(1, 2100, 1500, 4, 4, 64, bf16, alibi="h"),                  # s_q > s_k without a mask: tiles either side
]


def _count_gluon_calls(monkeypatch) -> dict:
    """Counts of fa3.fwd / fa3.bwd calls. The problems remembered per argument signature are emptied first: a problem
    made by an earlier test of the process (the same case in test_varlen_kvcache_gpu.py) keeps a plan that launches
    its template without calling fa3.fwd / fa3.bwd."""
    monkeypatch.setattr(interface, "_DENSE", {})
    monkeypatch.setattr(varlen, "_VARLEN", {})
    calls = {"fwd": 0, "bwd": 0}
    for name in calls:
        real = getattr(fa3, name)

        def counted(*a, _n=name, _f=real, **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(fa3, name, counted)
    return calls


def _triton_grads(fn, inputs, dout):
    with fa3.disabled():
        out = fn()
        return torch.autograd.grad(out, inputs, dout)


def _agree(name, ours, theirs, dtype):
    tol = 2e-2 if dtype == bf16 else 4e-3
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=tol * theirs.abs().max().item() + 1e-6,
                               msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("c", DENSE_CASES, ids=lambda c: c.id)
def test_gluon_features_gpu(c: Case, seed, monkeypatch):
    calls = _count_gluon_calls(monkeypatch)
    q, k, v, dout, alibi = case_inputs(c, "cuda")
    out, lse, _ = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi, return_attn_probs=True))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert calls == {"fwd": 1, "bwd": int(c.d in fa3.BWD_CONFIGS)}, f"Gluon kernels ran {calls} [{c.id}]"
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)
    with fa3.disabled(), torch.no_grad():   # the Triton kernels on the same inputs
        out_t, lse_t, _ = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi, return_attn_probs=True))
    _agree("out", out, out_t, c.dtype)
    finite = torch.isfinite(lse_t)
    assert torch.equal(finite, torch.isfinite(lse)), "rows without keys differ"
    torch.testing.assert_close(lse[finite], lse_t[finite], rtol=1e-4, atol=1e-4)
    ref = _triton_grads(lambda: flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi)), (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        _agree(name, g, r, c.dtype)


VARLEN_CASES = [
    VCase((1000, 0, 3000, 517), (1000, 0, 3000, 517), 16, 2, 128, bf16, causal=True),
    VCase((2048, 1, 777), (4096, 100, 777), 8, 8, 64, fp16, window=(256, 0), softcap=20.0, alibi="bh"),
    VCase((640, 1024, 3), (640, 0, 3), 4, 2, 256, bf16, causal=True),      # a sequence without keys
    VCase((129, 63, 64, 65, 1), (200, 63, 1, 65, 300), 4, 1, 128, fp16),
    VCase((700, 1300), (1700, 1300), 8, 2, 128, bf16, window=(128, 64), alibi="h"),
    VCase((1, 1, 1), (100, 5, 300), 8, 1, 64, bf16, causal=True),         # one query per sequence (max_seqlen_q 1)
]


@pytest.mark.parametrize("c", VARLEN_CASES, ids=lambda c: c.id)
def test_gluon_varlen_gpu(c: VCase, seed, monkeypatch):
    calls = _count_gluon_calls(monkeypatch)
    q, k, v, dout, alibi = packed_inputs(c)
    args = (q, k, v, cu(c.lens_q), cu(c.lens_k), max(c.lens_q), max(c.lens_k))
    kw = dict(causal=c.causal, window_size=c.window, softcap=c.softcap, alibi_slopes=alibi)
    out, lse, _ = flash_attn_varlen_func(*args, **kw, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert calls == {"fwd": 1, "bwd": int(c.d in fa3.BWD_CONFIGS)}, f"Gluon kernels ran {calls} [{c.id}]"
    check_varlen(c, q, k, v, dout, alibi, out, lse, grads)
    with fa3.disabled(), torch.no_grad():
        out_t, lse_t, _ = flash_attn_varlen_func(*args, **kw, return_attn_probs=True)
    _agree("out", out, out_t, c.dtype)
    finite = torch.isfinite(lse_t)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], lse_t[finite], rtol=1e-4, atol=1e-4)
    ref = _triton_grads(lambda: flash_attn_varlen_func(*args, **kw), (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        _agree(name, g, r, c.dtype)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_gluon_varlen_writes_only_its_rows_gpu(d, seed):
    """Outputs poisoned with NaN before the kernel: every row of a sequence is written (finite), and the rows past
    cu_seqlens_q[-1] (no sequence's) keep the poison - a tile's masked stores never write past its sequence."""
    lens_q, lens_k = (70, 1, 200, 0, 333), (70, 5, 129, 10, 400)
    total_q = sum(lens_q) + 17
    h, hk = 4, 2
    q = torch.randn(total_q, h, d, dtype=bf16, device="cuda")
    k = torch.randn(sum(lens_k), hk, d, dtype=bf16, device="cuda")
    v = torch.randn_like(k)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((h, total_q), float("nan"), device="cuda")
    params = AttnParams(softmax_scale=d ** -0.5, window_right=0)
    cq, ck = cu(lens_q), cu(lens_k)
    assert fa3.supports(q, k, v, params, None, cq)
    fa3.fwd(q, k, v, out, lse, params, None, cq, ck, max(lens_q), max(lens_k))
    end = sum(lens_q)
    assert torch.isfinite(out[:end]).all() and not torch.isnan(lse[:, :end]).any()
    assert torch.isnan(out[end:]).all() and torch.isnan(lse[:, end:]).all()
    # the zero-key sequence's row: output 0, LSE -inf
    row = sum(lens_q[:3])
    assert (out[row:row + lens_q[3]] == 0).all()


def test_gluon_forward_templates_follow_the_extras_gpu(seed):
    """A repeated varlen / ALiBi call launches the forward's template: it must read this call's cu_seqlens and
    slopes (live arguments), not the first call's."""
    h, d = 4, 128
    q = torch.randn(600, h, d, dtype=bf16, device="cuda")
    k, v = torch.randn_like(q), torch.randn_like(q)
    outs = []
    for lens in ((300, 300), (100, 500)):
        cq = cu(lens)
        for slopes in (torch.full((h,), 0.1, device="cuda"), torch.full((h,), 0.5, device="cuda")):
            out = flash_attn_varlen_func(q, k, v, cq, cq, 600, 600, causal=True, alibi_slopes=slopes)
            with fa3.disabled():
                ref = flash_attn_varlen_func(q, k, v, cq, cq, 600, 600, causal=True, alibi_slopes=slopes)
            torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=2e-2)
            outs.append(out)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("d", [64, 128])
def test_gluon_backward_writes_only_its_rows_gpu(d, seed):
    """Gradients poisoned with NaN before the backward: every key row of a sequence gets its dK / dV (finite), the
    rows past cu_seqlens_k[-1] keep the poison (the masked stores of a key block that ends past its sequence never
    write the next rows), and a sequence no query sees (or with no queries) gets dK = dV = 0."""
    from flashtile.kernels.triton import launch
    lens_q, lens_k = (70, 0, 200, 5, 333), (70, 130, 129, 0, 400)
    total_k = sum(lens_k) + 9
    h, hk = 4, 2
    q = torch.randn(sum(lens_q), h, d, dtype=bf16, device="cuda")
    k = torch.randn(total_k, hk, d, dtype=bf16, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    lse = torch.empty(h, sum(lens_q), device="cuda")
    params = AttnParams(softmax_scale=d ** -0.5, window_right=0)
    cq, ck = cu(lens_q), cu(lens_k)
    fa3.fwd(q, k, v, out, lse, params, None, cq, ck, max(lens_q), max(lens_k))
    dout = torch.randn_like(q)
    delta = launch.bwd_delta(out, dout, lse, None, cq, max(lens_q))
    dq = torch.full_like(q, float("nan"))
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    assert fa3.supports(q, k, v, params, None, cq, backward=True)
    fa3.bwd(dout, q, k, v, lse, delta, dq, dk, dv, params, None, None, cq, ck, max(lens_q), max(lens_k))
    end = sum(lens_k)
    assert torch.isfinite(dk[:end]).all() and torch.isfinite(dv[:end]).all() and torch.isfinite(dq).all()
    assert torch.isnan(dk[end:]).all() and torch.isnan(dv[end:]).all()
    first = lens_k[0]
    assert (dk[first:first + lens_k[1]] == 0).all() and (dv[first:first + lens_k[1]] == 0).all()   # no queries


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (200, 0))])
def test_gluon_varlen_one_cu_seqlens_gpu(d, causal, window, seed, monkeypatch):
    """Queries and keys that share one cu_seqlens tensor (the usual packed self-attention call; SAME_SEQS at
    fa3.BWD_SAME_SEQS' head dims): random lengths with a zero-length sequence and ends inside tiles, against
    float64; the same call with an equal copy as cu_seqlens_k (SAME_SEQS off) gives the same gradients; repeated
    calls alternating the two launch each one's template (BackwardPlan keeps both) with this call's tensors."""
    lens = tuple(int(n) for n in torch.randint(1, 700, (5, ))) + (0, 1024)
    c = VCase(lens, lens, 8, 2, d, bf16, causal=causal, window=window)
    seen = []
    real = fa3.bwd_features
    monkeypatch.setattr(fa3, "bwd_features", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    q, k, v, dout, alibi = packed_inputs(c)
    cq = cu(lens)
    kw = dict(causal=causal, window_size=window)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, cq, max(lens), max(lens), **kw, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [f.SAME_SEQS for f in seen] == [d in fa3.BWD_SAME_SEQS], seen
    check_varlen(c, q, k, v, dout, alibi, out, lse, grads)
    for cu_k in (cq.clone(), cq, cq.clone()):
        again = torch.autograd.grad(flash_attn_varlen_func(q, k, v, cq, cu_k, max(lens), max(lens), **kw), (q, k, v),
                                    dout)
        for name, g, r in zip(("dq", "dk", "dv"), again, grads):
            torch.testing.assert_close(g.float(), r.float(), rtol=0, atol=1e-2 * r.abs().max().item(),
                                       msg=lambda m: f"{name}: {m}")
    other = cu(lens[::-1])   # other lengths, the same shape: a template of the first call must not be reused
    g_other = torch.autograd.grad(flash_attn_varlen_func(q, k, v, other, other, max(lens), max(lens), **kw),
                                  (q, k, v), dout)
    with fa3.disabled():
        g_ref = torch.autograd.grad(flash_attn_varlen_func(q, k, v, other, other, max(lens), max(lens), **kw),
                                    (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), g_other, g_ref):
        _agree(name, g, r, bf16)

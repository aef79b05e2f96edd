"""Bad input is refused at the API boundary with ValueError / TypeError naming the offending argument.

Nothing here should reach a kernel: every case fails validation, so the file runs in about a second.
"""
import re

import pytest
import torch

import flashtile
from attn_utils import DEVICE

B, S, H, D = 2, 16, 4, 32
ERRORS = (ValueError, TypeError)


def _t(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


def _qkv(b=B, sq=S, sk=S, h=H, hk=H, d=D, dtype=torch.float16):
    return _t(b, sq, h, d, dtype=dtype), _t(b, sk, hk, d, dtype=dtype), _t(b, sk, hk, d, dtype=dtype)


def _word(name):
    """Regex matching ``name`` as a whole word (so 'q' does not match inside 'seqlen_q' ... nor 'equal')."""
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


def _call(q, k, v, **kw):
    return flashtile.flash_attn_func(q, k, v, **kw)


def _refused_with(name, change):
    """_call on _qkv() with input `name` replaced by change(it) is refused, the error naming `name`."""
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[name] = change(args[name])
    with pytest.raises(ERRORS, match=_word(name)):
        _call(**args)


# --------------------------------------------------------------------------------------------------------
# Shapes

def test_q_not_4d():
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match=_word("q")):
        _call(q[0], k, v)
    with pytest.raises(ERRORS, match=_word("q")):
        _call(q.unsqueeze(0), k, v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_k_or_v_not_4d(name):
    _refused_with(name, lambda t: t[0])


@pytest.mark.parametrize("name", ["k", "v"])
def test_batch_mismatch(name):
    _refused_with(name, lambda t: t[:1])


def test_seqlen_k_mismatch_between_k_and_v():
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match=_word("v")):
        _call(q, k, v[:, :S - 1])


def test_nheads_k_mismatch_between_k_and_v():
    q, k, _ = _qkv(hk=2)
    v = _t(B, S, 4, D)
    with pytest.raises(ERRORS, match=_word("v")):
        _call(q, k, v)


def test_nheads_not_divisible_by_nheads_k():
    q, k, v = _qkv(h=4, hk=3)
    with pytest.raises(ERRORS, match=r"nheads|" + _word("k")):
        _call(q, k, v)


def test_nheads_k_larger_than_nheads():
    q, k, v = _qkv(h=2, hk=4)
    with pytest.raises(ERRORS, match=r"nheads|" + _word("k")):
        _call(q, k, v)


def test_head_dim_mismatch_q_k():
    q, _, v = _qkv()
    k = _t(B, S, H, D + 8)
    with pytest.raises(ERRORS, match=_word("k")):
        _call(q, k, v)


def test_head_dim_above_256():
    q, k, v = _qkv(d=264)
    with pytest.raises(ERRORS, match=r"head_?dim|" + _word("q")):
        _call(q, k, v)


@pytest.mark.parametrize("dims", [dict(b=0), dict(sq=0), dict(sk=0)], ids=["batch0", "seqlen_q0", "seqlen_k0"])
def test_zero_sized_inputs_refused_or_handled(dims):
    """Degenerate sizes must not crash inside a kernel: either a clean error naming an argument, or a result of
    the right shape in which rows that see no key are 0."""
    q, k, v = _qkv(**dims)
    try:
        out = _call(q, k, v)
    except ERRORS:
        return
    assert out.shape == q.shape
    assert (out == 0).all() if dims.get("sk") == 0 else torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------------------
# dtypes, devices, layouts

@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int8, torch.bool])
def test_unsupported_dtype(dtype):
    q, k, v = _qkv(dtype=dtype)
    with pytest.raises(ERRORS, match=_word("q") + r"|dtype"):
        _call(q, k, v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_dtype_mismatch(name):
    _refused_with(name, lambda t: t.float())


@pytest.mark.parametrize("name", ["k", "v"])
def test_device_mismatch(name):
    _refused_with(name, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_contiguous_last_dim_is_copied_as_flash_attn_does(name, seed):
    """flash-attn copies an input whose last dimension is strided (maybe_contiguous); flashtile too, and the
    gradient reaches the strided original."""
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    t = args[name]
    base = _t(*t.shape[:-1], 2 * t.shape[-1]).requires_grad_()
    args[name] = base[..., ::2]
    assert args[name].stride(-1) == 2
    ref = _call(**{**args, name: args[name].detach().contiguous()})
    out = _call(**args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.float().sum().backward()
    assert base.grad is not None and torch.isfinite(base.grad).all() and base.grad[..., 1::2].abs().sum() == 0


# --------------------------------------------------------------------------------------------------------
# Scalar options

@pytest.mark.parametrize("window", [(-2, -1), (-1, -5), (3, -2), (-100, 0)])
def test_window_edges_below_minus_one_are_unbounded(window, seed):
    """flash-attn reads any negative window edge as unbounded; so does flashtile (same output as -1)."""
    q, k, v = _qkv()
    ref = _call(q, k, v, window_size=tuple(max(w, -1) for w in window))
    torch.testing.assert_close(_call(q, k, v, window_size=window), ref, rtol=0, atol=0)


@pytest.mark.parametrize("softcap", [-1.0, -0.0])
def test_softcap_at_most_zero_is_off(softcap, seed):
    q, k, v = _qkv()
    torch.testing.assert_close(_call(q, k, v, softcap=softcap), _call(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_p_outside_unit_interval(p):
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match="dropout_p"):
        _call(q, k, v, dropout_p=p)


@pytest.mark.parametrize("slopes_shape,dtype", [
    ((H + 1,), torch.float32),
    ((B + 1, H), torch.float32),
    ((B, H, 1), torch.float32),
    ((1, 1, H), torch.float32),
    ((H,), torch.float16),
    ((H,), torch.float64),
], ids=["h+1", "b+1_h", "b_h_1", "1_1_h", "fp16", "fp64"])
def test_alibi_slopes_wrong_shape_or_dtype(slopes_shape, dtype):
    q, k, v = _qkv()
    slopes = torch.rand(slopes_shape, device=DEVICE).to(dtype)
    with pytest.raises(ERRORS, match="alibi_slopes"):
        _call(q, k, v, alibi_slopes=slopes)


def test_alibi_slopes_wrong_device():
    q, k, v = _qkv()
    slopes = torch.empty(H, dtype=torch.float32, device="meta")
    with pytest.raises(ERRORS, match="alibi_slopes"):
        _call(q, k, v, alibi_slopes=slopes)


# --------------------------------------------------------------------------------------------------------
# Packed entry points validate their packing dimension

def test_qkvpacked_wrong_pack_dim():
    qkv = _t(B, S, 2, H, D)
    with pytest.raises(ERRORS, match="qkv"):
        flashtile.flash_attn_qkvpacked_func(qkv)


def test_qkvpacked_not_5d():
    qkv = _t(B, S, 3 * H, D)
    with pytest.raises(ERRORS, match="qkv"):
        flashtile.flash_attn_qkvpacked_func(qkv)


def test_kvpacked_wrong_pack_dim():
    q = _t(B, S, H, D)
    kv = _t(B, S, 3, H, D)
    with pytest.raises(ERRORS, match="kv"):
        flashtile.flash_attn_kvpacked_func(q, kv)


def test_kvpacked_head_mismatch():
    q = _t(B, S, H, D)
    kv = _t(B, S, 2, 3, D)
    with pytest.raises(ERRORS, match=r"nheads|kv"):
        flashtile.flash_attn_kvpacked_func(q, kv)


# --------------------------------------------------------------------------------------------------------
# Valid edge values are accepted (the validator must not be stricter than flash-attn)

@pytest.mark.parametrize("kw", [
    dict(window_size=(0, 0)),
    dict(window_size=(-1, 0)),
    dict(dropout_p=0.0),
    dict(causal=True, window_size=(4, -1)),
    dict(alibi_slopes="h"),
    dict(alibi_slopes="bh"),
], ids=["win0_0", "win-1_0", "drop0", "causal_win", "alibi_h", "alibi_bh"])
def test_valid_edge_options_accepted(kw, seed):
    q, k, v = _qkv(b=1, sq=4, sk=4, h=2, hk=1, d=8)
    if kw.get("alibi_slopes") == "h":
        kw = dict(alibi_slopes=torch.rand(2, device=DEVICE))
    elif kw.get("alibi_slopes") == "bh":
        kw = dict(alibi_slopes=torch.rand(1, 2, device=DEVICE))
    with torch.no_grad():
        out = _call(q, k, v, **kw)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_outputs_are_poisoned_under_the_test_suite():
    # tests/conftest.py turns the NaN fill on, so an element a kernel forgets to write cannot pass a test;
    # and with it on, an output buffer really starts as NaN
    from flashtile import interface
    assert interface.POISON_OUTPUTS
    assert torch.isnan(interface.output_like(torch.zeros(3, 4))).all()
    assert torch.isnan(interface.output((2, 2), "cpu", torch.float32)).all()

"""flashtile.flex: user-written mask_mod / score_mod compiled into the kernels (issue #5), on the CPU interpreter.

Every numeric check is the flash-attn tolerance rule of attn_utils (ours vs the float64 reference vs standard
attention in the inputs' dtype) for out, lse, dq, dk, dv and the gradients of captured tensors (ALiBi slopes,
relative-position tables, a custom per-key bias). The reference (``flex_ref``) builds the dense score matrix,
applies the same mod written in torch, masks, and takes the softmax:

    s = q.k * scale -> score_mod -> -inf where mask_mod / causal / window say no -> softmax -> P V

mask_mod / score_mod positions count from the top-left corner (FlexAttention's convention: causal_mask() is
kv <= q); the causal / window_size *flags* keep flash_attn_func's bottom-right alignment.
Small sizes on the CPU, fp16 / bf16 / fp32 (tests/test_dtypes_cpu.py runs the mods in each dtype);
tests/gpu/test_mods_gpu.py scales this up. Budget: well under 90 s on 2 cores.
"""
import pytest
import torch
import triton

import flashtile
from attn_utils import DEVICE, inputs as _inputs
from flashtile.api import usermods
from flashtile.blocksparse import BlockMask, create_block_mask
from flashtile.flex import (MaskMod, ScoreMod, alibi_score, causal_mask, document_mask, flex_attention,
                            prefix_lm_mask, relative_position_bias, sliding_window_mask, softcap_score)
from flex_utils import (flex_ref, keep_period_mask, late_rows_mask, plus_head_bias, row_mask, run_and_check,
                        sig_key_bias, sig_key_bias_dcaptured, sig_key_bias_grad, t_alibi, t_causal, t_document,
                        t_keep_period, t_prefix_lm, t_relpos, t_sig_key_bias, t_sliding, t_softcap,
                        tile_classes as _tile_classes)

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16


# ----------------------------------------------------------------------------------------------------------
# Ready-made masks: each against its torch twin, through mask_mod= (every tile evaluates the mod) or through a
# block mask built from the MaskMod (empty tiles skipped, full tiles unmasked, partial tiles evaluate the mod)

MASK_CASES = {
    # id: (b, s, h, hk, d, dtype, path, BLOCK_SIZE)
    "causal": (1, 64, 2, 1, 32, fp16, "mask_mod", None),
    "document-1d-causal": (1, 72, 2, 2, 32, fp32, "block_mask", 32),
    "document-2d-noncausal": (2, 64, 2, 1, 16, fp16, "block_mask", 16),
    "prefix_lm": (2, 64, 2, 2, 32, bf16, "mask_mod", None),
    "sliding+sinks": (1, 80, 2, 1, 32, fp32, "block_mask", 16),
}


def _ready_mask(name, b, s):
    if name == "causal":
        return causal_mask(), t_causal(), None
    if name == "document-1d-causal":
        ids = torch.tensor([0] * 20 + [1] * 33 + [2] * 19, dtype=torch.int32, device=DEVICE)
        return document_mask(ids), t_document(ids), None
    if name == "document-2d-noncausal":
        ids = torch.stack([torch.tensor([0] * 10 + [1] * 40 + [2] * 14),
                           torch.tensor([0] * 33 + [1] * 31)]).to(torch.int32).to(DEVICE)
        return document_mask(ids, causal=False), t_document(ids, causal=False), b
    if name == "prefix_lm":
        prefix = torch.tensor([10, 41], dtype=torch.int32, device=DEVICE)
        return prefix_lm_mask(prefix), t_prefix_lm(prefix), b
    if name == "sliding+sinks":
        return sliding_window_mask(19, num_sinks=3), t_sliding(19, 3), None
    raise ValueError(name)


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_ready_made_masks(name, seed):
    b, s, h, hk, d, dtype, path, bs = MASK_CASES[name]
    mod, twin, bm_b = _ready_mask(name, b, s)
    assert isinstance(mod, MaskMod)
    q, k, v, dout = _inputs(b, s, s, h, hk, d, dtype)
    if path == "mask_mod":
        kw = dict(mask_mod=mod)
    else:
        bm = create_block_mask(mod, bm_b, None, s, s, BLOCK_SIZE=bs, device=DEVICE)
        assert isinstance(bm, BlockMask) and bm.density() < 1.0
        kw = dict(block_mask=bm)
    run_and_check(q, k, v, dout, dtype, f"[{name} via {path}]", mask_fn=twin, **kw)


# ----------------------------------------------------------------------------------------------------------
# Ready-made score mods, with the gradients of their captured tensors

def test_alibi_score_slope_grads_gqa_sq_ne_sk_with_causal_mask(seed):
    b, sq, sk, h, hk = 1, 48, 80, 4, 2
    q, k, v, dout = _inputs(b, sq, sk, h, hk, 32, fp32)
    slopes = (torch.rand(h, device=DEVICE) * 0.5 + 2.0 ** -8).requires_grad_()
    mod = alibi_score(slopes)
    assert isinstance(mod, ScoreMod)
    run_and_check(q, k, v, dout, fp32, "[alibi, causal_mask, gqa, sq<sk]", score_mod=mod, mask_mod=causal_mask(),
                  score_fn=t_alibi, mask_fn=t_causal(), captured=(slopes,))
    assert slopes.grad.shape == slopes.shape and slopes.grad.dtype == torch.float32


@pytest.mark.parametrize("mod", ["alibi", "relpos"])
def test_captured_tensors_without_grad_stay_unchanged_through_the_backward(mod, seed):
    """A captured tensor that does not require grad gets no gradient, and the backward leaves it as it was (the
    captured_grad_fn must not add into it), with q, k, v's gradients right."""
    b, s, h, md = 1, 48, 2, 6
    q, k, v, dout = _inputs(b, s, s, h, h, 32, fp32)
    if mod == "alibi":
        t = torch.rand(h, device=DEVICE) * 0.5 + 2.0 ** -8
        score_mod, score_fn = alibi_score(t), (lambda sc, b_, h_, q_, kv: t_alibi(sc, b_, h_, q_, kv, t))
    else:
        t = torch.randn(h, 2 * md + 1, device=DEVICE)
        score_mod, score_fn = relative_position_bias(t, md), (lambda sc, b_, h_, q_, kv: t_relpos(md)(sc, b_, h_, q_,
                                                                                                    kv, t))
    before = t.clone()
    run_and_check(q, k, v, dout, fp32, f"[{mod}, captured tensor without grad]", score_mod=score_mod, causal=True,
                  score_fn=score_fn)
    assert torch.equal(t, before) and t.grad is None


def test_relative_position_bias_table_grads_with_causal_flag(seed):
    b, s, h, md = 2, 64, 2, 8
    q, k, v, dout = _inputs(b, s, s, h, 1, 32, fp16)
    table = torch.randn(h, 2 * md + 1, device=DEVICE, requires_grad=True)
    run_and_check(q, k, v, dout, fp16, "[relpos md=8, causal=True]", score_mod=relative_position_bias(table, md),
                  causal=True, score_fn=t_relpos(md), captured=(table,))
    assert table.grad.shape == table.shape
    # the clamped end buckets collect every pair at distance >= md: nonzero, and the upper half (kv > q) is
    # masked by causal, so its buckets get exactly 0
    assert (table.grad[:, md + 1:] == 0).all() and (table.grad[:, 0] != 0).all()


def test_relative_position_bias_sq_ne_sk_scale_window(seed):
    sq, sk, h, md = 72, 40, 2, 5                                  # sq > sk: rows 0..25 see no key (window)
    q, k, v, dout = _inputs(1, sq, sk, h, 2, 24, fp32)           # headdim not a power of two
    table = (2.0 * torch.randn(h, 2 * md + 1, device=DEVICE)).requires_grad_()
    run_and_check(q, k, v, dout, fp32, "[relpos sq>sk window scale]", score_mod=relative_position_bias(table, md),
                  softmax_scale=0.3, window_size=(20, 6), score_fn=t_relpos(md), captured=(table,))


def test_softcap_score_with_sliding_mask_bf16(seed):
    q, k, v, dout = _inputs(2, 56, 56, 2, 1, 32, bf16)
    q.data *= 3.0                                                 # scores large enough for the cap to bend them
    run_and_check(q, k, v, dout, bf16, "[softcap 4 + sliding 24]", score_mod=softcap_score(4.0),
                  mask_mod=sliding_window_mask(24), score_fn=t_softcap(4.0), mask_fn=t_sliding(24))


def test_block_mask_from_callable_masks_after_softcap_score(seed):
    # a block mask's element mask (from a torch callable) hides keys after score_mod: softcap maps the -inf of a
    # hidden key to -cap, which would make it visible again if the mask came first
    q, k, v, dout = _inputs(1, 64, 64, 2, 2, 32, fp32)
    q.data *= 3.0
    bm = create_block_mask(t_causal(), None, None, 64, 64, BLOCK_SIZE=32, device=DEVICE)
    run_and_check(q, k, v, dout, fp32, "[softcap 5 + block mask from a callable]", score_mod=softcap_score(5.0),
                  block_mask=bm, score_fn=t_softcap(5.0), mask_fn=t_causal())


# ----------------------------------------------------------------------------------------------------------
# User-written mods

def test_custom_mask_mod_and_score_mod_with_grad_fns(seed):
    b, sq, sk, h, hk = 2, 40, 56, 4, 2
    q, k, v, dout = _inputs(b, sq, sk, h, hk, 32, fp32)
    keep = (torch.rand(b, sk, device=DEVICE) > 0.25).to(torch.int32)
    keep[:, 0] = 1
    mask = MaskMod(keep_period_mask, captured=(keep, sk, 3))
    kb = torch.randn(h, sk, device=DEVICE, requires_grad=True)
    score = ScoreMod(sig_key_bias, grad_fn=sig_key_bias_grad, captured_grad_fn=sig_key_bias_dcaptured,
                     captured=(kb, sk, 0.75))
    run_and_check(q, k, v, dout, fp32, "[custom mask + custom score]", score_mod=score, mask_mod=mask,
                  score_fn=t_sig_key_bias(0.75), mask_fn=t_keep_period(keep, 3), captured=(kb,))


def test_custom_mods_fp16_block_mask_from_custom_mask_mod(seed):
    b, s, h = 1, 64, 2
    q, k, v, dout = _inputs(b, s, s, h, 1, 32, fp16)
    keep = (torch.rand(b, s, device=DEVICE) > 0.5).to(torch.int32)
    keep[:, 40:] = 0                                              # key tiles 40.. empty: skipped
    mask = MaskMod(keep_period_mask, captured=(keep, s, 4))
    bm = create_block_mask(mask, b, h, s, s, BLOCK_SIZE=16, device=DEVICE)
    assert bm.density() < 1.0
    kb = torch.randn(h, s, device=DEVICE, requires_grad=True)
    score = ScoreMod(sig_key_bias, grad_fn=sig_key_bias_grad, captured_grad_fn=sig_key_bias_dcaptured,
                     captured=(kb, s, -0.5))
    _, _, grads = run_and_check(q, k, v, dout, fp16, "[custom fp16 via block_mask]", score_mod=score,
                                block_mask=bm, score_fn=t_sig_key_bias(-0.5), mask_fn=t_keep_period(keep, 4),
                                captured=(kb,))
    assert (grads[3][:, 40:] == 0).all() and (grads[1][:, 40:] == 0).all()


# ----------------------------------------------------------------------------------------------------------
# Block masks: from a MaskMod (Triton) == from the equivalent torch callable

@pytest.mark.parametrize("name", ["document-2d", "sliding+sinks"])
def test_block_mask_from_mask_mod_equals_torch_callable(name, seed):
    b, s, h, bs = 2, 72, 2, 16
    if name == "document-2d":
        ids = torch.stack([torch.tensor([0] * 10 + [1] * 40 + [2] * 22),
                           torch.tensor([0] * 33 + [1] * 16 + [2] * 23)]).to(torch.int32).to(DEVICE)
        mod, twin, B = document_mask(ids), t_document(ids), b
    else:
        mod, twin, B = sliding_window_mask(30, num_sinks=2), t_sliding(30, 2), None
    bm_mod = create_block_mask(mod, B, None, s, s, BLOCK_SIZE=bs, device=DEVICE)
    bm_t = create_block_mask(twin, B, None, s, s, BLOCK_SIZE=bs, device=DEVICE)
    assert bm_mod.shape == bm_t.shape and bm_mod.BLOCK_SIZE == bm_t.BLOCK_SIZE == bs
    big = [key for key, val in vars(bm_mod).items() if isinstance(val, torch.Tensor) and val.numel() >= s * s]
    assert not big, f"a block mask built from a MaskMod holds Q_LEN x KV_LEN tensors: {big}"
    cls_mod, cls_t = _tile_classes(bm_mod, b, h), _tile_classes(bm_t, b, h)
    if not torch.equal(cls_mod, cls_t):
        bad = (cls_mod != cls_t).nonzero()[0].tolist()
        raise AssertionError(f"tile class differs at (b, h, q_block, kv_block) {bad}: MaskMod "
                             f"{cls_mod[tuple(bad)].item()} vs torch {cls_t[tuple(bad)].item()} "
                             f"(0 empty, 1 partial, 2 full); {(cls_mod != cls_t).sum().item()} tiles differ")
    assert abs(bm_mod.density() - bm_t.density()) < 1e-12
    assert (cls_t == 1).any() and (cls_t == 2).any() and (cls_t == 0).any()
    q, k, v, dout = _inputs(b, s, s, h, 1, 16, fp32)
    out_m, lse_m = flex_attention(q, k, v, block_mask=bm_mod, return_lse=True)
    g_m = torch.autograd.grad(out_m, (q, k, v), dout)
    out_t, lse_t = flex_attention(q, k, v, block_mask=bm_t, return_lse=True)
    g_t = torch.autograd.grad(out_t, (q, k, v), dout)
    torch.testing.assert_close(out_m, out_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_m, lse_t, rtol=1e-5, atol=1e-5)
    for name_, a, b_ in zip(("dq", "dk", "dv"), g_m, g_t):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name_}: {m}")
    # and both equal the reference
    r_out, r_lse = flex_ref(q.detach(), k.detach(), v.detach(), mask_fn=twin)
    torch.testing.assert_close(out_m.double(), r_out, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# Fully masked rows, causal / window flags on top of mods, the plain path

def test_fully_masked_rows_zero_output_and_neg_inf_lse(seed):
    b, s, h = 1, 48, 2
    q, k, v, dout = _inputs(b, s, s, h, 2, 32, fp32)
    mask = MaskMod(row_mask)
    twin = lambda b_, h_, qi, ki: (qi % 5 != 2) & (ki <= qi)  # noqa: E731
    out, lse, grads = run_and_check(q, k, v, dout, fp32, "[rows q%5==2 empty]", mask_mod=mask, mask_fn=twin)
    empty = torch.arange(s, device=DEVICE) % 5 == 2
    assert (out[:, empty] == 0).all(), "a fully masked row must output 0"
    assert torch.isneginf(lse[:, :, empty]).all(), "a fully masked row has lse = -inf"
    assert torch.isfinite(lse[:, :, ~empty]).all()
    for g in grads:
        assert torch.isfinite(g).all()
    assert (grads[0][:, empty] == 0).all()


def test_empty_query_blocks_of_a_block_mask(seed):
    """Query blocks with no tile at all (the kernel visits nothing) still write out = 0 and lse = -inf."""
    b, s, h, bs = 1, 64, 2, 16
    twin = lambda b_, h_, qi, ki: (qi >= 40) & (ki <= qi)  # noqa: E731   rows 0..39 empty: blocks 0, 1 no tiles
    bm = create_block_mask(MaskMod(late_rows_mask), None, None, s, s, BLOCK_SIZE=bs, device=DEVICE)
    cls = _tile_classes(bm, 1, 1)
    assert (cls[0, 0, :2] == 0).all()
    q, k, v, dout = _inputs(b, s, s, h, 1, 32, fp16)
    out, lse, grads = run_and_check(q, k, v, dout, fp16, "[empty query blocks]", block_mask=bm, mask_fn=twin)
    assert (out[:, :40] == 0).all() and torch.isneginf(lse[:, :, :40]).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_mods_combined_with_causal_flag_sq_lt_sk(seed):
    """ALiBi + prefix-LM mask_mod (top-left) + causal=True (bottom-right) together, sq < sk, GQA."""
    b, sq, sk, h = 2, 40, 64, 2
    q, k, v, dout = _inputs(b, sq, sk, h, 1, 32, fp16)
    slopes = (torch.rand(h, device=DEVICE) * 0.3 + 0.01).requires_grad_()
    prefix = torch.tensor([5, 50], dtype=torch.int32, device=DEVICE)
    run_and_check(q, k, v, dout, fp16, "[alibi + prefix_lm + causal]", score_mod=alibi_score(slopes),
                  mask_mod=prefix_lm_mask(prefix), causal=True, score_fn=t_alibi, mask_fn=t_prefix_lm(prefix),
                  captured=(slopes,))


def test_document_block_mask_with_window_flag(seed):
    s = 64
    ids = torch.tensor([0] * 25 + [1] * 39, dtype=torch.int32, device=DEVICE)
    bm = create_block_mask(document_mask(ids), None, None, s, s, BLOCK_SIZE=16, device=DEVICE)
    q, k, v, dout = _inputs(1, s, s, 2, 2, 32, fp32)
    run_and_check(q, k, v, dout, fp32, "[document + window (10, 0)]", block_mask=bm, window_size=(10, 0),
                  mask_fn=t_document(ids))


@triton.jit
def _keep_all(b, h, q_idx, kv_idx, aux):
    return (q_idx >= 0) & (kv_idx >= 0)


def test_mods_equal_but_for_their_tensors_share_one_key(seed):
    """A training loop builds document_mask over each batch's ids: the mods register under one key (one problem,
    one plan and launch template per shape), the registry keeps none of their tensors, and each call computes
    with its own ids (float64 reference); mods whose other captured values differ (a window, an int against a
    float, -0.0 against 0.0) get keys of their own, and a NaN value one key."""
    import gc
    import weakref
    s = 48
    q, k, v, dout = _inputs(1, s, s, 2, 2, 16, fp32)
    keys = []
    for cut in (20, 31):
        ids = torch.tensor([0] * cut + [1] * (s - cut), dtype=torch.int32, device=DEVICE)
        mod = document_mask(ids)
        key, tensors = usermods.register(None, mod)
        assert tensors == [ids]
        keys.append(key)
        run_and_check(q, k, v, dout, fp32, f"[document cut {cut}]", mask_mod=mod, mask_fn=t_document(ids))
    assert keys[0] == keys[1]
    held = weakref.ref(ids)
    del ids, mod, tensors
    gc.collect()
    assert held() is None, "the registry keeps a captured tensor alive"
    windows = [usermods.register(None, sliding_window_mask(w))[0] for w in (8, 16, 8)]
    assert windows[0] == windows[2] != windows[1]
    values = [usermods.register(None, MaskMod(_keep_all, captured=(c, )))[0]
              for c in (1, 1.0, 0.0, -0.0, float("nan"), float("nan"))]
    assert len(set(values[:4])) == 4                       # an int and a float apart, -0.0 and 0.0 apart
    assert values[4] == values[5]                           # a NaN value is one key, not one per call


def test_no_mods_equals_flash_attn_func_and_return_types(seed):
    q, k, v, _ = _inputs(1, 40, 40, 2, 1, 32, fp32)
    with torch.no_grad():
        out = flex_attention(q, k, v)
        assert isinstance(out, torch.Tensor)
        out_c, lse_c = flex_attention(q, k, v, causal=True, return_lse=True)
        ref_c, lse_ref, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        torch.testing.assert_close(out, flashtile.flash_attn_func(q, k, v), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out_c, ref_c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse_c, lse_ref, rtol=1e-5, atol=1e-5)
        # causal_mask() on a square problem is the causal flag
        torch.testing.assert_close(flex_attention(q, k, v, mask_mod=causal_mask()), ref_c, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Bad input

ERRORS = (ValueError, TypeError)


def test_bad_arguments_are_refused():
    q, k, v, _ = _inputs(1, 32, 32, 2, 2, 32, fp32)
    with pytest.raises(ERRORS, match="mask_mod"):
        flex_attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= ki)     # a torch callable, not a MaskMod
    with pytest.raises(ERRORS, match="score_mod"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s)
    with pytest.raises(ERRORS, match="score_mod"):
        flex_attention(q, k, v, score_mod=causal_mask())                   # a MaskMod where a ScoreMod goes
    with pytest.raises(ERRORS, match="mask_mod"):
        flex_attention(q, k, v, mask_mod=softcap_score(5.0))               # and the other way round
    with pytest.raises(ERRORS, match="block_mask"):
        flex_attention(q, k, v, block_mask=torch.ones(32, 32, dtype=torch.bool))
    with pytest.raises(ERRORS):
        MaskMod(lambda b, h, qi, ki, aux: qi >= ki)                        # not @triton.jit
    with pytest.raises(ERRORS):
        ScoreMod(plus_head_bias, grad_fn=lambda *a: a[0])
    with pytest.raises(ERRORS):
        MaskMod(row_mask, captured=("a string",))
    bm = create_block_mask(causal_mask(), None, None, 32, 48, BLOCK_SIZE=16, device=DEVICE)
    with pytest.raises(ValueError, match="block_mask"):
        flex_attention(q, k, v, block_mask=bm)                             # made for seqlen_k 48


def test_captured_tensor_on_wrong_device_is_refused():
    q, k, v, _ = _inputs(1, 32, 32, 2, 2, 32, fp32)
    other = "meta" if DEVICE == "cpu" else "cpu"
    with pytest.raises(ERRORS, match="device"):
        flex_attention(q, k, v, score_mod=alibi_score(torch.ones(2, device=other)))
    with pytest.raises(ERRORS, match="device"):
        flex_attention(q, k, v, mask_mod=MaskMod(keep_period_mask,
                                                 captured=(torch.ones(1, 32, dtype=torch.int32, device=other),
                                                           32, 3)))


def test_captured_tensor_requiring_grad_without_captured_grad_fn():
    """An error at call time or at backward time, never a silently missing / zero gradient."""
    q, k, v, dout = _inputs(1, 32, 32, 2, 2, 32, fp32)
    hb = torch.randn(2, device=DEVICE, requires_grad=True)
    mod = ScoreMod(plus_head_bias, captured=(hb,))
    with pytest.raises((ValueError, TypeError, RuntimeError), match="captured_grad_fn"):
        out = flex_attention(q, k, v, score_mod=mod)
        out.backward(dout)
    # the same mod with a captured tensor that does not require grad is fine
    out = flex_attention(q, k, v, score_mod=ScoreMod(plus_head_bias, captured=(hb.detach(),)))
    assert torch.isfinite(out).all()


TOO_SMALL = {
    # id: (builder of the mod on q's device, flex_attention keyword, expected word in the message)
    "document_ids shorter than seqlen": (lambda: document_mask(torch.zeros(16, dtype=torch.int32, device=DEVICE)),
                                         "mask_mod", "document_ids"),
    "document_ids batch 3 != 2": (lambda: document_mask(torch.zeros(3, 32, dtype=torch.int32, device=DEVICE)),
                                  "mask_mod", "document_ids"),
    "prefix_lengths (1,) for batch 2": (lambda: prefix_lm_mask(torch.ones(1, dtype=torch.int32, device=DEVICE)),
                                        "mask_mod", "prefix_lengths"),
    "slopes (2,) for nheads 4": (lambda: alibi_score(torch.ones(2, device=DEVICE)), "score_mod", "slopes"),
    "table (2, 9) for nheads 4": (lambda: relative_position_bias(torch.zeros(2, 9, device=DEVICE), 4),
                                  "score_mod", "table"),
}


@pytest.mark.parametrize("case", list(TOO_SMALL))
def test_ready_made_captured_tensor_not_matching_the_problem_is_refused(case):
    """The ready-mades' kernels index their tensors by b, h and positions: a tensor too small for the problem is
    an out-of-bounds read (or a silently wrong mask); flex_attention knows the problem's sizes and should say so."""
    build, kw, word = TOO_SMALL[case]
    q, k, v, _ = _inputs(2, 32, 32, 4, 2, 16, fp32)
    with pytest.raises(ERRORS, match=word):
        with torch.no_grad():
            flex_attention(q, k, v, **{kw: build()})


def test_ready_made_constructor_checks():
    with pytest.raises(ERRORS, match="document_ids"):
        document_mask(torch.zeros(32, device=DEVICE))                       # float ids
    with pytest.raises(ERRORS, match="prefix_lengths"):
        prefix_lm_mask(torch.ones(2, device=DEVICE))
    with pytest.raises(ERRORS, match="slopes"):
        alibi_score(torch.ones(2, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ERRORS, match="table"):
        relative_position_bias(torch.zeros(4, 7, device=DEVICE), 4)        # needs 2 * 4 + 1 = 9 columns
    with pytest.raises(ERRORS, match="window"):
        sliding_window_mask(0)
    with pytest.raises(ERRORS, match="cap"):
        softcap_score(0.0)


@pytest.mark.parametrize("mod", ["softcap", "alibi"])
def test_ready_made_scores_run_as_the_kernels_own(mod, seed, monkeypatch):
    """softcap_score, and alibi_score whose slopes want no gradient over equal lengths, reach the kernels as their own
    softcap / ALiBi (no score_mod compiled in), with a block mask's partial tiles masked after them; results against
    float64. alibi_score over unequal lengths keeps its score_mod (its distance is top-left aligned)."""
    b, s, h = 1, 64, 2
    q, k, v, dout = _inputs(b, s, s, h, h, 32, fp32)
    slopes = torch.rand(h, device=DEVICE) * 0.5 + 2.0 ** -8
    score_mod, score_fn = ((softcap_score(4.0), t_softcap(4.0)) if mod == "softcap" else
                           (alibi_score(slopes), (lambda sc, b_, h_, q_, kv: t_alibi(sc, b_, h_, q_, kv, slopes))))
    registered = []
    real = usermods.register
    monkeypatch.setattr(usermods, "register", lambda sm, mm: registered.append(sm) or real(sm, mm))
    run_and_check(q, k, v, dout, fp32, f"[{mod} as the kernels' own]", score_mod=score_mod, mask_mod=causal_mask(),
                  score_fn=score_fn, mask_fn=t_causal())
    assert registered and all(sm is None for sm in registered)
    registered.clear()
    q2 = q[:, :40].detach().requires_grad_()
    if mod == "alibi":
        flex_attention(q2, k, v, score_mod=score_mod)
        assert registered and registered[0] is score_mod

"""attn_bias / attn_mask, block-sparse attention and flashtile.flex mods on a CUDA GPU at seqlen 1k-4k.

Run with ``pytest tests/gpu/test_mods_gpu.py`` on an H100/H200 (skipped without CUDA). The CPU files
(tests/test_bias_mask.py, tests/test_blocksparse_kernels.py, tests/test_flex.py) scaled up, plus bf16 and head
dims 64 / 128: every output, lse and gradient (dbias, ALiBi slopes, relative-position tables included) is held
to the flash-attn tolerance rule against a float64 reference. The references materialise the score matrix,
so they run in chunks of heads with b * heads * s_q * s_k <= 2^26 per chunk (512 MiB per float64 matrix).
Budget: a few minutes of GPU time, most of it Triton compilation and the float64 references.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA-only tests", allow_module_level=True)

import flashtile  # noqa: E402
from flashtile.blocksparse import blocksparse_attn_func, create_block_mask  # noqa: E402
from flashtile.flex import (MaskMod, ScoreMod, alibi_score, causal_mask, document_mask,  # noqa: E402
                            prefix_lm_mask, relative_position_bias, sliding_window_mask,
                            softcap_score)
from flashtile.reference.dense import attention_ref  # noqa: E402
from attn_utils import inputs  # noqa: E402
from flex_utils import (check_all, keep_period_mask, random_tile_mask, reference_grads,  # noqa: E402
                        run_and_check, sig_key_bias, sig_key_bias_dcaptured, sig_key_bias_grad, t_alibi, t_causal,
                        t_document, t_keep_period, t_prefix_lm, t_relpos, t_sig_key_bias, t_sliding, t_softcap,
                        tile_classes)

fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
DEV = "cuda"
REF_ELEMS = 2 ** 26


def chunk_heads(b, h, hk, sq, sk):
    """Query heads per reference chunk: a multiple of the GQA group with b * heads * sq * sk <= REF_ELEMS."""
    group = h // hk
    return max(group, REF_ELEMS // (b * sq * sk) // group * group)


def _head_slice(t, h0, h1):
    """A (.., H or 1, sq or 1, sk) bias / mask restricted to query heads h0:h1 (broadcast heads untouched)."""
    if t is None or t.dim() < 3 or t.shape[-3] == 1:
        return t
    return t[..., h0:h1, :, :]


def dense_check(q, k, v, dout, dtype, ctx, *, ours, bias=None, mask=None, **ref_kw):
    """ours() -> (out, lse) of a flash_attn_func-like call with attn_bias=bias / attn_mask=mask; checks out, lse,
    dq, dk, dv and (when bias requires grad) dbias against attention_ref in head chunks."""
    leaves = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    out, lse = ours()
    grads = torch.autograd.grad(out, leaves, dout)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads), ctx
    captured = leaves[3:]

    def ref_fn(qc, kc, vc, caps, h0, upcast):
        b_ = caps[0] if caps else (None if bias is None else bias)
        h1 = h0 + qc.shape[2]
        r_out, r_lse, _ = attention_ref(qc, kc, vc, attn_bias=_head_slice(b_, h0, h1),
                                        attn_mask=_head_slice(mask, h0, h1), upcast=upcast, **ref_kw)
        return r_out, r_lse

    ch = chunk_heads(q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1])
    ref64 = reference_grads(ref_fn, q, k, v, dout, captured, upcast=True, chunk_heads=ch)
    std = reference_grads(ref_fn, q, k, v, dout, captured, upcast=False, chunk_heads=ch)
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    check_all(names, (out, lse, *grads), ref64, std, dtype, ctx)
    return out, lse, grads


def flex_check(q, k, v, dout, dtype, ctx, **kw):
    return run_and_check(q, k, v, dout, dtype, ctx,
                         chunk_heads=chunk_heads(q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1]), **kw)


def random_doc_ids(batch, s, n_docs, gen_seed=0):
    """(batch, s) int32 document ids: n_docs documents of random lengths per row (cut points drawn per row)."""
    g = torch.Generator().manual_seed(gen_seed)
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(s - 1, generator=g)[:n_docs - 1] + 1
        ids = torch.zeros(s, dtype=torch.int32)
        ids[cuts] = 1
        rows.append(ids.cumsum(0).to(torch.int32))
    return torch.stack(rows).to(DEV)


# ----------------------------------------------------------------------------------------------------------
# attn_bias (with dbias) and attn_mask through flash_attn_func

BIAS_CASES = [
    # (b, sq, sk, h, hk, d, dtype, bias shape kind, bias dtype, extra kwargs)
    (2, 1024, 1024, 8, 8, 64, bf16, "b-h-sq-sk", None, {}),
    (1, 2048, 2048, 8, 2, 128, fp16, "1-1-sq-sk", None, dict(causal=True)),
    (2, 1536, 2048, 4, 4, 128, bf16, "b-1-1-sk", None, dict(window_size=(256, 256))),
    (1, 4096, 4096, 4, 1, 64, fp16, "1-h-sq-sk", fp32, dict(causal=True, softcap=20.0)),
]


def _bias_shape(kind, b, h, sq, sk):
    return {"b-h-sq-sk": (b, h, sq, sk), "1-1-sq-sk": (1, 1, sq, sk), "b-1-1-sk": (b, 1, 1, sk),
            "1-h-sq-sk": (1, h, sq, sk)}[kind]


@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: "-".join(
    [f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{str(c[6])[6:]}-bias_{c[7]}", *c[9]]))
def test_bias_with_dbias_gpu(case, seed):
    b, sq, sk, h, hk, d, dtype, kind, bias_dtype, kw = case
    q, k, v, dout = inputs(b, sq, sk, h, hk, d, dtype, DEV)
    bias = (2.0 * torch.randn(_bias_shape(kind, b, h, sq, sk), device=DEV)).to(bias_dtype or dtype).requires_grad_()

    def ours():
        out, lse, _ = flashtile.flash_attn_func(q, k, v, attn_bias=bias, return_attn_probs=True, **kw)
        return out, lse
    _, _, grads = dense_check(q, k, v, dout, dtype, f"[bias {kind}]", ours=ours, bias=bias, **kw)
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype


@pytest.mark.parametrize("dtype", [bf16, fp16], ids=["bf16", "fp16"])
def test_bool_mask_with_empty_rows_causal_gpu(dtype, seed):
    b, s, h, d = 2, 2048, 4, 128
    q, k, v, dout = inputs(b, s, s, h, h, d, dtype, DEV)
    mask = torch.rand(b, 1, s, s, device=DEV) > 0.3
    mask[:, :, 1000:1010] = False                                  # fully masked rows
    mask[:, :, :, 1500:1700] = False                               # a band of hidden keys

    def ours():
        out, lse, _ = flashtile.flash_attn_func(q, k, v, attn_mask=mask, causal=True, return_attn_probs=True)
        return out, lse
    out, lse, _ = dense_check(q, k, v, dout, dtype, "[bool mask causal]", ours=ours, mask=mask, causal=True)
    assert (out[:, 1000:1010] == 0).all() and torch.isneginf(lse[:, :, 1000:1010]).all()


def test_bool_mask_broadcast_sq_ne_sk_mqa_gpu(seed):
    sq, sk = 1024, 3000
    q, k, v, dout = inputs(1, sq, sk, 8, 1, 64, fp16, DEV)
    mask = (torch.rand(sq // 64, sk // 8 + 1, device=DEV) > 0.5).repeat_interleave(64, 0).repeat_interleave(8, 1)
    mask = mask[:, :sk] | (torch.rand(sq, sk, device=DEV) > 0.8)

    def ours():
        out, lse, _ = flashtile.flash_attn_func(q, k, v, attn_mask=mask, return_attn_probs=True)
        return out, lse
    dense_check(q, k, v, dout, fp16, "[bool mask (sq, sk) mqa]", ours=ours, mask=mask)


# ----------------------------------------------------------------------------------------------------------
# blocksparse_attn_func (block masks from torch callables)

def test_blocksparse_document_gpu(seed):
    b, s, h, d = 1, 4096, 8, 128
    ids = random_doc_ids(1, s, 8, gen_seed=1)[0]
    bm = create_block_mask(t_document(ids), None, None, s, s, BLOCK_SIZE=128, device=DEV)
    assert bm.density() < 0.5
    q, k, v, dout = inputs(b, s, s, h, h, d, bf16, DEV)

    def ours():
        out, lse, _ = blocksparse_attn_func(q, k, v, bm, return_attn_probs=True)
        return out, lse
    dense_check(q, k, v, dout, bf16, "[blocksparse document]", ours=ours, mask=bm.to_dense())


def test_blocksparse_random_tiles_per_head_causal_gpu(seed):
    b, s, h, hk, d, bs = 2, 2048, 4, 2, 64, 128
    bm = create_block_mask(random_tile_mask(b, h, s, s, bs, DEV), b, h, s, s, BLOCK_SIZE=bs, device=DEV)
    q, k, v, dout = inputs(b, s, s, h, hk, d, fp16, DEV)

    def ours():
        out, lse, _ = blocksparse_attn_func(q, k, v, bm, causal=True, return_attn_probs=True)
        return out, lse
    dense_check(q, k, v, dout, fp16, "[blocksparse random tiles causal]", ours=ours, mask=bm.to_dense(),
                causal=True)


# ----------------------------------------------------------------------------------------------------------
# flashtile.flex mods

def test_flex_document_block_mask_gpu(seed):
    b, s, h, hk, d = 2, 4096, 4, 2, 128
    ids = random_doc_ids(b, s, 8, gen_seed=2)
    bm = create_block_mask(document_mask(ids), b, None, s, s, BLOCK_SIZE=128, device=DEV)
    bm_t = create_block_mask(t_document(ids), b, None, s, s, BLOCK_SIZE=128, device=DEV)
    assert torch.equal(tile_classes(bm, b, h), tile_classes(bm_t, b, h)), "MaskMod and torch block masks differ"
    q, k, v, dout = inputs(b, s, s, h, hk, d, bf16, DEV)
    flex_check(q, k, v, dout, bf16, "[flex document]", block_mask=bm, mask_fn=t_document(ids))


@pytest.mark.parametrize("path", ["mask_mod", "block_mask"])
def test_flex_prefix_lm_gpu(path, seed):
    b, s, h, hk, d = 2, 2048, 8, 2, 64
    prefix = torch.tensor([300, 1337], dtype=torch.int32, device=DEV)
    mod = prefix_lm_mask(prefix)
    kw = dict(mask_mod=mod) if path == "mask_mod" else dict(
        block_mask=create_block_mask(mod, b, None, s, s, BLOCK_SIZE=128, device=DEV))
    q, k, v, dout = inputs(b, s, s, h, hk, d, fp16, DEV)
    flex_check(q, k, v, dout, fp16, f"[flex prefix-lm via {path}]", mask_fn=t_prefix_lm(prefix), **kw)


def test_flex_sliding_window_sinks_gpu(seed):
    b, s, h, d = 1, 4096, 8, 128
    bm = create_block_mask(sliding_window_mask(512, num_sinks=4), None, None, s, s, BLOCK_SIZE=128, device=DEV)
    assert bm.density() < 0.25
    q, k, v, dout = inputs(b, s, s, h, h, d, bf16, DEV)
    flex_check(q, k, v, dout, bf16, "[flex sliding 512 + 4 sinks]", block_mask=bm, mask_fn=t_sliding(512, 4))


@pytest.mark.parametrize("dtype,d", [(fp16, 128), (bf16, 64)], ids=["fp16-d128", "bf16-d64"])
def test_flex_alibi_slope_grads_gpu(dtype, d, seed):
    b, s, h, hk = 2, 2048, 8, 2
    slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1, device=DEV) / h)).requires_grad_()
    bm = create_block_mask(causal_mask(), None, None, s, s, BLOCK_SIZE=128, device=DEV)
    q, k, v, dout = inputs(b, s, s, h, hk, d, dtype, DEV)
    flex_check(q, k, v, dout, dtype, "[flex alibi + causal block mask]", score_mod=alibi_score(slopes),
               block_mask=bm, score_fn=t_alibi, mask_fn=t_causal(), captured=(slopes,))


@pytest.mark.parametrize("dtype,d", [(bf16, 64), (fp16, 128)], ids=["bf16-d64", "fp16-d128"])
def test_flex_relative_position_bias_table_grads_gpu(dtype, d, seed):
    b, s, h, md = 1, 3000, 4, 128
    table = torch.randn(h, 2 * md + 1, device=DEV, requires_grad=True)
    q, k, v, dout = inputs(b, s, s, h, h, d, dtype, DEV)
    flex_check(q, k, v, dout, dtype, "[flex relpos md=128 causal]", score_mod=relative_position_bias(table, md),
               causal=True, score_fn=t_relpos(md), captured=(table,))


def test_flex_softcap_document_gpu(seed):
    b, s, h, d = 1, 2048, 8, 128
    ids = random_doc_ids(1, s, 5, gen_seed=3)[0]
    q, k, v, dout = inputs(b, s, s, h, 4, d, bf16, DEV)
    with torch.no_grad():
        q.mul_(4.0)
    flex_check(q, k, v, dout, bf16, "[flex softcap 30 + document]", score_mod=softcap_score(30.0),
               mask_mod=document_mask(ids), score_fn=t_softcap(30.0), mask_fn=t_document(ids))


def test_flex_custom_mods_gpu(seed):
    b, sq, sk, h, hk, d = 2, 1024, 1536, 8, 4, 128
    keep = (torch.rand(b, sk, device=DEV) > 0.2).to(torch.int32)
    mask = MaskMod(keep_period_mask, captured=(keep, sk, 7))
    kb = torch.randn(h, sk, device=DEV, requires_grad=True)
    score = ScoreMod(sig_key_bias, grad_fn=sig_key_bias_grad, captured_grad_fn=sig_key_bias_dcaptured,
                     captured=(kb, sk, 0.8))
    q, k, v, dout = inputs(b, sq, sk, h, hk, d, fp16, DEV)
    flex_check(q, k, v, dout, fp16, "[flex custom mods]", score_mod=score, mask_mod=mask,
               score_fn=t_sig_key_bias(0.8), mask_fn=t_keep_period(keep, 7), captured=(kb,))


def test_flex_block_mask_construction_large_gpu():
    """MaskMod block masks at 16k: same tiles as the torch callable's, without a Q_LEN x KV_LEN tensor."""
    b, s = 2, 16384
    ids = random_doc_ids(b, s, 8, gen_seed=4)
    for mod, twin, B in ((document_mask(ids), t_document(ids), b),
                         (sliding_window_mask(1024, num_sinks=4), t_sliding(1024, 4), None),
                         (prefix_lm_mask(torch.tensor([s // 2, 100], dtype=torch.int32, device=DEV)),
                          t_prefix_lm(torch.tensor([s // 2, 100], device=DEV)), b)):
        bm = create_block_mask(mod, B, None, s, s, BLOCK_SIZE=128, device=DEV)
        big = [key for key, val in vars(bm).items() if isinstance(val, torch.Tensor) and val.numel() >= s * s]
        assert not big, f"{mod}: Q_LEN x KV_LEN tensors {big}"
        bm_t = create_block_mask(twin, B, None, s, s, BLOCK_SIZE=128, device=DEV)
        assert torch.equal(tile_classes(bm, b, 1), tile_classes(bm_t, b, 1)), f"{mod}: tiles differ"
        del bm_t
        torch.cuda.empty_cache()

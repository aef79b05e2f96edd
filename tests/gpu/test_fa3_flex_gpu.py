"""The Hopper kernels (flashtile/kernels/gluon/_fa3_fwd.py, _fa3_bwd_any.py) on flashtile.flex's features, on an
H100/H200: score_mod and mask_mod compiled in (the backward: score_mod's derivative and its captured tensors'
gradients), attn_bias and bool masks, block masks (full blocks without element work, partial blocks masked, empty
ones never visited) - each asserting which Gluon kernels ran (the backward at head dims 64 and 128), checked against
float64 (output, LSE, gradients) and compared with the Triton kernels on the same inputs. Skipped without a CUDA
device of compute capability 9.x.
"""
import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("Hopper-only tests", allow_module_level=True)

import flashtile  # noqa: E402
from flashtile.blocksparse import blocksparse_attn_func, create_block_mask  # noqa: E402
from flashtile.flex import (alibi_score, document_mask, flex_attention, prefix_lm_mask,  # noqa: E402
                            relative_position_bias, sliding_window_mask, softcap_score)
from flashtile.kernels.gluon import fa3  # noqa: E402
from flashtile.reference.dense import attention_ref  # noqa: E402
from test_fa3_features_gpu import _count_gluon_calls  # noqa: E402
from attn_utils import inputs  # noqa: E402
from flex_utils import (random_tile_mask, run_and_check, t_alibi, t_document, t_prefix_lm, t_relpos,  # noqa: E402
                        t_sliding, t_softcap)

fp16, bf16 = torch.float16, torch.bfloat16
DEV = "cuda"


@pytest.fixture
def gluon_calls(monkeypatch):
    """{"fwd": calls of fa3.fwd, "bwd": of fa3.bwd} while the test runs."""
    return _count_gluon_calls(monkeypatch)


def _grads_as_triton(fn, inputs, dout, grads, dtype, ctx):
    """Gradients of the Gluon backward against the Triton backward's on the same inputs."""
    with fa3.disabled():
        theirs = torch.autograd.grad(fn(), inputs, dout)
    tol = 2e-2 if dtype == bf16 else 4e-3
    for name, a, b_ in zip(("dq", "dk", "dv"), grads, theirs):
        torch.testing.assert_close(a.float(), b_.float(), rtol=0, atol=tol * b_.abs().max().item() + 1e-6,
                                   msg=lambda m: f"{ctx} {name} vs Triton: {m}")


def _same_as_triton(fn, out, lse, dtype, ctx):
    """The Gluon forward's out / lse against the Triton forward's on the same inputs (float64 is checked apart)."""
    with fa3.disabled(), torch.no_grad():
        out_t, lse_t = fn()
    tol = 2e-2 if dtype == bf16 else 4e-3
    torch.testing.assert_close(out.float(), out_t.float(), rtol=0, atol=tol * out_t.abs().max().item() + 1e-6,
                               msg=lambda m: f"{ctx} out vs Triton: {m}")
    finite = torch.isfinite(lse_t)
    assert torch.equal(finite, torch.isfinite(lse)), f"{ctx}: rows without keys differ from Triton's"
    torch.testing.assert_close(lse[finite], lse_t[finite], rtol=0, atol=2e-3, msg=lambda m: f"{ctx} lse: {m}")


def _alibi_document_case(b, s):
    slopes = 2.0 ** (-8.0 * torch.arange(1, 9, device=DEV) / 8)
    ids = _doc_ids(b, s, 4, 5)
    return (dict(score_mod=alibi_score(slopes), block_mask=create_block_mask(document_mask(ids), b, None, s, s,
                                                                             device=DEV)),
            lambda sc, b_, h_, q_, kv: t_alibi(sc, b_, h_, q_, kv, slopes), t_document(ids), ())


def _doc_ids(b, s, n_docs, gen_seed):
    g = torch.Generator().manual_seed(gen_seed)
    cuts = torch.sort(torch.randperm(s - 1, generator=g)[:n_docs - 1] + 1).values
    ids = torch.zeros(b, s, dtype=torch.int32)
    for c in cuts:
        ids[:, c:] += 1
    return ids.to(DEV)


def _tiles_case(b, h, s):
    """A block mask of random empty / full / element-masked tiles per (batch, head) over a ragged last block."""
    tiles = random_tile_mask(b, h, s, s, 128, DEV)
    return dict(block_mask=create_block_mask(tiles, b, h, s, s, BLOCK_SIZE=128, device=DEV)), None, tiles, ()


FLEX_CASES = {
    # name: (b, sq, sk, h, hk, d, dtype, flex kwargs builder -> (kwargs, score_fn, mask_fn, captured))
    "document-mask_mod-unaligned-d128": (2, 2000, 2000, 4, 2, 128, bf16, lambda b, s: (
        dict(mask_mod=document_mask(_doc_ids(b, s, 6, 1))), None, t_document(_doc_ids(b, s, 6, 1)), ())),
    "document-block_mask-d128": (2, 4096, 4096, 4, 4, 128, bf16, lambda b, s: (
        dict(block_mask=create_block_mask(document_mask(_doc_ids(b, s, 8, 2)), b, None, s, s, device=DEV)),
        None, t_document(_doc_ids(b, s, 8, 2)), ())),
    "sliding-sinks-block_mask-256-d128-gqa": (1, 4096, 4096, 8, 2, 128, fp16, lambda b, s: (
        dict(block_mask=create_block_mask(sliding_window_mask(700, 4), None, None, s, s, BLOCK_SIZE=256,
                                          device=DEV)), None, t_sliding(700, 4), ())),
    "prefix-lm-mask_mod-d64": (2, 1024, 1024, 8, 2, 64, fp16, lambda b, s: (
        dict(mask_mod=prefix_lm_mask(torch.tensor([300, 1000], dtype=torch.int32, device=DEV))), None,
        t_prefix_lm(torch.tensor([300, 1000], device=DEV)), ())),
    "softcap-score_mod+document-block_mask-callable-d128": (1, 2048, 2048, 8, 4, 128, bf16, lambda b, s: (
        dict(score_mod=softcap_score(20.0),
             block_mask=create_block_mask(t_document(_doc_ids(1, s, 5, 3)[0]), None, None, s, s, BLOCK_SIZE=256,
                                          device=DEV)),
        t_softcap(20.0), t_document(_doc_ids(1, s, 5, 3)[0]), ())),
    # alibi_score with slopes that want no gradient runs as the kernels' own ALiBi (flex._builtin_scores)
    "alibi-score_mod-as-kernel-alibi+document-block_mask-d128": (2, 2048, 2048, 8, 8, 128, bf16,
                                                                 lambda b, s: _alibi_document_case(b, s)),
    "random-tiles-per-head-block_mask-ragged-d128": (2, 1900, 1900, 4, 4, 128, fp16,
                                                     lambda b, s: _tiles_case(b, 4, s)),
    "relpos-score_mod-causal-sq-ne-sk-d256": (1, 1000, 1500, 4, 4, 256, bf16, lambda b, s: (
        dict(score_mod=relative_position_bias(torch.randn(4, 257, device=DEV), 128), causal=True),
        t_relpos(128), None, ())),
}


@pytest.mark.parametrize("name", list(FLEX_CASES))
def test_gluon_flex_forward_gpu(name, seed, gluon_calls):
    b, sq, sk, h, hk, d, dtype, build = FLEX_CASES[name]
    kw, score_fn, mask_fn, captured = build(b, sq)
    if name.startswith("relpos"):   # (the table the score_fn reads: the one the ScoreMod captured)
        captured = (kw["score_mod"].captured[0].requires_grad_(),)
        score_fn = t_relpos(128)
    q, k, v, dout = inputs(b, sq, sk, h, hk, d, dtype, DEV)
    if "softcap" in name:
        with torch.no_grad():
            q.mul_(4.0)
    out, lse, _ = run_and_check(q, k, v, dout, dtype, f"[{name}]", score_fn=score_fn, mask_fn=mask_fn,
                                captured=captured, **kw)
    ran = int(d in fa3.FLEX_HEAD_DIMS)   # (other head dims: the Triton kernels)
    assert gluon_calls == {"fwd": ran, "bwd": ran * int(d in fa3.BWD_CONFIGS)}, f"[{name}] Gluon ran {gluon_calls}"
    _same_as_triton(lambda: flex_attention(q, k, v, return_lse=True, **kw), out.detach(), lse.detach(), dtype,
                    f"[{name}]")


def test_gluon_alibi_score_mod_with_window_flag_gpu(seed, gluon_calls):
    b, s, h, d = 2, 1500, 8, 128
    slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1, device=DEV) / h)).requires_grad_()
    q, k, v, dout = inputs(b, s, s, h, h, d, bf16, DEV)
    out, lse, _ = run_and_check(q, k, v, dout, bf16, "[alibi + window (300, 0)]", score_mod=alibi_score(slopes),
                                window_size=(300, 0), score_fn=t_alibi, captured=(slopes,))
    assert gluon_calls == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("causal", [False, True])
def test_gluon_blocksparse_random_tiles_empty_rows_gpu(causal, seed, gluon_calls):
    """Random tiles per (batch, head), query blocks with nothing listed (rows output 0, LSE -inf), a ragged last
    block (seqlen 1900), Triton's forward as the reference of the tile walk."""
    b, s, h, hk, d, bs = 2, 1900, 4, 2, 128, 128
    tiles = random_tile_mask(b, h, s, s, bs, DEV)
    bm = create_block_mask(tiles, b, h, s, s, BLOCK_SIZE=bs, device=DEV)
    bm.kv_num_blocks[:, :, 3] = 0            # query block 3: nothing listed
    bm.full_kv_num_blocks[:, :, 3] = 0
    q, k, v, _ = inputs(b, s, s, h, hk, d, bf16, DEV)
    with torch.no_grad():
        out, lse, _ = blocksparse_attn_func(q, k, v, bm, causal=causal, return_attn_probs=True)
    assert gluon_calls["fwd"] == 1
    rows = slice(3 * bs, 4 * bs)
    assert (out[:, rows] == 0).all() and torch.isneginf(lse[:, :, rows]).all()
    _same_as_triton(lambda: blocksparse_attn_func(q, k, v, bm, causal=causal, return_attn_probs=True)[:2], out, lse,
                    bf16, f"[random tiles causal={causal}]")


def test_gluon_bias_and_bool_mask_broadcast_gpu(seed, gluon_calls):
    b, sq, sk, h, d = 2, 1100, 900, 4, 128
    q, k, v, dout = inputs(b, sq, sk, h, h, d, bf16, DEV)
    bias = torch.randn(1, h, sq, sk, device=DEV, dtype=bf16)   # (no gradient asked: the Gluon backward takes it)
    mask = torch.rand(b, 1, sq, sk, device=DEV) > 0.3
    mask[0, 0, 50:70] = False                # rows without keys
    out, lse, _ = flashtile.flash_attn_func(q, k, v, attn_bias=bias, attn_mask=mask, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert gluon_calls == {"fwd": 1, "bwd": 1}
    assert all(torch.isfinite(g).all() for g in grads)
    _grads_as_triton(lambda: flashtile.flash_attn_func(q, k, v, attn_bias=bias, attn_mask=mask), (q, k, v), dout,
                     grads, bf16, "[bias + mask]")
    out, lse = out.detach(), lse.detach()
    ref_out = attention_ref(q, k, v, attn_bias=bias, attn_mask=mask)[0]
    seen = mask.any(-1).transpose(1, 2)[..., None]          # (b, sq, 1, 1): rows with a key
    torch.testing.assert_close(torch.where(seen, out.double(), 0), torch.where(seen, ref_out.double(), 0), rtol=0,
                               atol=2e-2)
    assert (out[0, 50:70] == 0).all() and torch.isneginf(lse[0, :, 50:70]).all()
    _same_as_triton(lambda: flashtile.flash_attn_func(q, k, v, attn_bias=bias, attn_mask=mask,
                                                      return_attn_probs=True)[:2], out, lse, bf16, "[bias + mask]")


def test_flex_launch_templates_take_each_calls_tensors_gpu(seed, gluon_calls):
    """A repeated flex problem launches its templates (fa3.fwd / fa3.bwd run once, at the first call), which take
    each call's block mask lists, captured tensors, attn_bias and attn_mask: the second call, with other tensors of
    the same shapes, matches the Triton kernels on its own inputs."""
    b, s, h, d = 2, 1536, 4, 128   # (a shape no other test uses: its first call makes the templates)
    q, k, v, dout = inputs(b, s, s, h, h, d, bf16, DEV)
    for n, gen_seed in enumerate((11, 12)):
        ids = _doc_ids(b, s, 3 + n, gen_seed)
        bm = create_block_mask(document_mask(ids), b, None, s, s, device=DEV)

        def doc(bm=bm):
            return flex_attention(q, k, v, block_mask=bm, return_lse=True)
        out, lse = doc()
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert gluon_calls == {"fwd": 1, "bwd": 1}, f"call {n}: {gluon_calls}"
        _same_as_triton(doc, out.detach(), lse.detach(), bf16, f"[document call {n}]")
        _grads_as_triton(lambda: doc()[0], (q, k, v), dout, grads, bf16, f"[document call {n}]")
    for n in range(2):
        bias = torch.randn(b, 1, s, s, device=DEV, dtype=bf16) * (n + 1)
        mask = torch.rand(1, h, s, s, device=DEV) > 0.2 + 0.3 * n

        def biased(bias=bias, mask=mask):
            return flashtile.flash_attn_func(q, k, v, attn_bias=bias, attn_mask=mask, return_attn_probs=True)[:2]
        out, lse = biased()
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert gluon_calls == {"fwd": 2, "bwd": 2}, f"bias call {n}: {gluon_calls}"
        _same_as_triton(biased, out.detach(), lse.detach(), bf16, f"[bias + mask call {n}]")
        _grads_as_triton(lambda: biased()[0], (q, k, v), dout, grads, bf16, f"[bias + mask call {n}]")

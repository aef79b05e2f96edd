"""attn_implementation="flashtile" in transformers models, checked against attn_implementation="sdpa".

Tiny randomly initialised models built from configs (no downloads), float32, so flashtile and SDPA must agree
to float32 rounding: logits at every real token and the gradient of every parameter. Covers GQA (4 query heads,
2 K/V heads), left and right padding (the varlen route), sliding windows (Mistral: every layer; Qwen2: only
the layers past max_window_layers), packed sequences (position_ids restarting), generation with a KV cache,
and the arguments the attention function forwards (dropout, softcap, scaling) against the float64 oracle.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile  # noqa: E402  (sets TRITON_INTERPRET on CPU-only machines before the kernels load)
from flashtile.integrations import transformers as ft_hf  # noqa: E402
from flashtile.reference.dense import attention_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQ = 24
RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert ft_hf.register() == "flashtile"


def _config(kind: str):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":   # every layer slides; window 8 < SEQ so the window really cuts
        return transformers.MistralConfig(sliding_window=8, **common)
    if kind == "qwen2":     # layer 0 full attention, layer 1 sliding window 6
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=6, max_window_layers=1, **common)
    raise ValueError(kind)


def _pair(kind: str, seed: int):
    """The same random weights under flashtile and under SDPA."""
    cfg = _config(kind)
    torch.manual_seed(seed)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flashtile")
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "flashtile"
    assert ref.config._attn_implementation == "sdpa"
    return ours.to(DEVICE).eval(), ref.to(DEVICE).eval()


def _mask(padding: str, batch: int, seq: int):
    if padding == "none":
        return None
    m = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        n_pad = 3 + 4 * b            # a different length per row
        if padding == "left":
            m[b, :n_pad] = 0
        else:
            m[b, seq - n_pad:] = 0
    return m.to(DEVICE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _compare(ours, ref, ids, mask, position_ids=None):
    """Logits at real tokens and every parameter gradient of a token-weighted loss over real tokens."""
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    w = torch.randn(*ids.shape, ours.config.vocab_size, device=DEVICE)
    results = []
    for model in (ours, ref):
        model.zero_grad(set_to_none=True)
        logits = model(ids, attention_mask=mask, position_ids=position_ids).logits
        loss = (logits[real] * w[real]).sum()      # indexing (not multiplying) keeps padding rows out entirely
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append((logits[real].detach(), grads))
    (lo, go), (lr, gr) = results
    assert torch.isfinite(lo).all()
    assert _rel(lo, lr) < RTOL, f"logits differ: rel {_rel(lo, lr):.2e}"
    assert go.keys() == gr.keys()
    for name in gr:
        assert torch.isfinite(go[name]).all(), name
        assert _rel(go[name], gr[name]) < RTOL, f"grad {name} differs: rel {_rel(go[name], gr[name]):.2e}"


@pytest.mark.parametrize("kind,padding", [("llama", "none"), ("llama", "left"), ("llama", "right"),
                                          ("mistral", "left"), ("qwen2", "right")])
def test_logits_and_grads_match_sdpa(kind, padding, seed):
    ours, ref = _pair(kind, seed)
    ids = torch.randint(0, 128, (2, SEQ), device=DEVICE)
    _compare(ours, ref, ids, _mask(padding, 2, SEQ))


def test_sliding_window_unpadded_matches_sdpa(seed):
    """The window off-by-one without padding (the dense, non-varlen route): window 8 over 24 tokens."""
    ours, ref = _pair("mistral", seed)
    ids = torch.randint(0, 128, (1, SEQ), device=DEVICE)
    _compare(ours, ref, ids, None)


def test_packed_sequences_do_not_attend_across_boundaries(seed):
    """Batch 1 holding sequences of 10, 6 and 8 tokens whose position_ids restart at 0 (transformers'
    DataCollatorWithFlattening layout, no mask): flashtile must route to varlen, so logits and gradients equal
    those of SDPA run on each sequence alone."""
    ours, ref = _pair("llama", seed)
    lens = (10, 6, 8)
    ids = torch.randint(0, 128, (1, sum(lens)), device=DEVICE)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(DEVICE)
    w = torch.randn(1, sum(lens), ours.config.vocab_size, device=DEVICE)
    logits = ours(ids, position_ids=pos).logits
    (logits * w).sum().backward()
    pieces, start = [], 0
    for n in lens:
        piece = ref(ids[:, start:start + n]).logits
        (piece * w[:, start:start + n]).sum().backward()   # gradients accumulate over the pieces
        pieces.append(piece.detach())
        start += n
    assert _rel(logits.detach(), torch.cat(pieces, dim=1)) < RTOL
    ref_grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, ref_grads[name].grad) < RTOL, name


def test_generate_left_padded_matches_sdpa(seed):
    """Prefill with a padded 2-D mask, then decode steps with seqlen_q = 1 against the KV cache."""
    ours, ref = _pair("llama", seed)
    ids = torch.randint(1, 128, (2, 12), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None,
              output_scores=True, return_dict_in_generate=True)   # (every step runs, an EOS token or not)
    a = ours.generate(ids, **kw)
    b = ref.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert _rel(sa, sb) < RTOL


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(seed, b=2, h=4, hk=2, s=20, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g).to(DEVICE)
    k = torch.randn(b, hk, s, d, generator=g).to(DEVICE)
    v = torch.randn(b, hk, s, d, generator=g).to(DEVICE)
    return q, k, v


def test_softcap_scaling_window_forwarded_to_kernel():
    q, k, v = _qkv(6)
    out, weights = ft_hf.flashtile_attention_forward(_Module(), q, k, v, None, scaling=0.3, sliding_window=5,
                                                     softcap=2.0)
    assert weights is None
    assert out.shape == (2, 20, 4, 16)
    ref = attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), softmax_scale=0.3, causal=True,
                        window_size=(4, 0), softcap=2.0)[0]
    assert _rel(out.double(), ref) < 1e-5


def test_non_causal_window_is_symmetric():
    q, k, v = _qkv(7)
    m = _Module()
    m.is_causal = False
    out, _ = ft_hf.flashtile_attention_forward(m, q, k, v, None, sliding_window=4)
    ref = attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=False, window_size=(3, 3))[0]
    assert _rel(out.double(), ref) < 1e-5


def test_dropout_forwarded_and_seeded():
    """dropout > 0 draws flashtile's dropout mask from torch's generator: reproducible under the same seed,
    different from no dropout, equal to flash_attn_func with the same arguments."""
    q, k, v = _qkv(8)
    m = _Module()
    torch.manual_seed(11)
    a, _ = ft_hf.flashtile_attention_forward(m, q, k, v, None, dropout=0.4)
    torch.manual_seed(11)
    b = flashtile.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.4, causal=True)
    no_drop, _ = ft_hf.flashtile_attention_forward(m, q, k, v, None, dropout=0.0)
    assert torch.equal(a, b)
    assert not torch.allclose(a, no_drop)


def test_packed_kwargs_and_position_ids_route_to_varlen():
    """Batch 1 packing two sequences (8 and 12 tokens), described by cu_seq_lens_q/k + max_length_q/k kwargs
    or by restarting position_ids: each sequence's output equals attention over that sequence alone."""
    q, k, v = _qkv(10, b=1)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32, device=DEVICE)
    by_cu, _ = ft_hf.flashtile_attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                 max_length_q=12, max_length_k=12)
    pos = torch.cat([torch.arange(8), torch.arange(12)]).unsqueeze(0).to(DEVICE)
    by_pos, _ = ft_hf.flashtile_attention_forward(_Module(), q, k, v, None, position_ids=pos)
    for lo, hi in ((0, 8), (8, 20)):
        alone = attention_ref(*(t[:, :, lo:hi].transpose(1, 2).double() for t in (q, k, v)), causal=True)[0]
        assert _rel(by_cu[:, lo:hi].double(), alone) < 1e-5
        assert _rel(by_pos[:, lo:hi].double(), alone) < 1e-5


def test_self_attention_varlen_calls_share_one_cu_seqlens_and_mask_reads(monkeypatch, seed):
    """A padded batch whose queries are every position of the mask (training) is unpadded once, the queries with
    the keys' indices: flash_attn_varlen_func gets one cu_seqlens tensor for both (the kernels then keep one length
    per sequence), and each row's real tokens equal attention over them alone (the padding's rows zeros);
    the mask's layout is read once for the layers that share it; cu_seq_lens_q / _k kwargs passed as one tensor
    stay one tensor after the int32 conversion."""
    calls = []
    real, real_rows = ft_hf.flash_attn_varlen_func, ft_hf.packed_rows
    monkeypatch.setattr(ft_hf, "_SEEN", {})

    def recorded(*args, **kw):
        calls.append(args[3:5])
        return real(*args, **kw)
    monkeypatch.setattr(ft_hf, "flash_attn_varlen_func", recorded)
    q, k, v = _qkv(seed, s=12)
    mask = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    mask[0, 9:] = 0                                   # row 0: 9 real tokens, right padding
    mask[1, :4] = 0                                   # row 1: 8 real tokens, left padding
    out, _ = ft_hf.flashtile_attention_forward(_Module(), q, k, v, mask)
    (cu_q, cu_k), = calls
    assert cu_q is cu_k and cu_q.tolist() == [0, 9, 17]
    for b, (lo, hi) in enumerate(((0, 9), (4, 12))):
        alone = attention_ref(*(t[b:b + 1, :, lo:hi].transpose(1, 2).double() for t in (q, k, v)), causal=True)[0]
        assert _rel(out[b:b + 1, lo:hi].double(), alone) < 1e-5
        pad = [i for i in range(12) if not lo <= i < hi]
        assert torch.equal(out[b, pad], torch.zeros_like(out[b, pad]))
    # the layers of a forward share the mask: its packed layout is read once, until the mask changes in place
    reads = []
    monkeypatch.setattr(ft_hf, "packed_rows", lambda m: reads.append(1) or real_rows(m))
    mask_b = mask.bool()
    for _ in range(3):
        again, _ = ft_hf.flashtile_attention_forward(_Module(), q, k, v, mask_b)
        assert torch.equal(again, out)
    assert len(reads) == 1
    mask_b[1, 4] = False   # in place: row 1 now starts at position 5
    again, _ = ft_hf.flashtile_attention_forward(_Module(), q, k, v, mask_b)
    assert len(reads) == 2 and calls[-1][0].tolist() == [0, 9, 16]
    n = len(ft_hf._SEEN)
    del mask_b   # a freed mask's entry (its token indices on the device) goes with it
    kept = mask.bool()
    ft_hf.flashtile_attention_forward(_Module(), q, k, v, kept)
    assert len(ft_hf._SEEN) == n
    del kept
    assert len(ft_hf._SEEN) == n - 1
    calls.clear()
    cu = torch.tensor([0, 8, 20], dtype=torch.int64, device=DEVICE)   # (transformers' dtype: converted here)
    q1, k1, v1 = _qkv(seed, b=1)
    ft_hf.flashtile_attention_forward(_Module(), q1, k1, v1, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                      max_length_q=12, max_length_k=12)
    (cu_q, cu_k), = calls
    assert cu_q is cu_k and cu_q.dtype == torch.int32


def test_four_d_boolean_mask_is_the_whole_pattern(seed):
    """A 4-D boolean mask (what the mask builder returns for a static cache) is the complete visibility pattern:
    the model's causal flag and sliding window are not applied on top; a query row that sees no key is zeros.
    Against the float64 oracle under the same mask, broadcast over heads."""
    q, k, v = _qkv(seed, s=12)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(2, 1, 12, 12, generator=g) < 0.6
    mask[1, 0, 5] = False                  # a row without keys
    mask = mask.to(DEVICE)
    out, _ = ft_hf.flashtile_attention_forward(_Module(), q, k, v, mask, sliding_window=3)
    ref = attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), attn_mask=mask)[0]
    ref[1, 5] = 0.0
    assert torch.equal(out[1, 5], torch.zeros_like(out[1, 5]))
    assert _rel(out.double(), ref) < 1e-5


def test_static_cache_mask_has_the_cache_shape():
    """The mask builder: a 2-D mask shorter than the cache (a static cache mid-generation) becomes transformers'
    4-D mask over every slot (the same shape at every step); one as long as the keys stays the 2-D padding mask,
    or None without padding, except in a static cache's decoding step."""
    mask = torch.ones(2, 5, dtype=torch.bool)   # (transformers hands the builders a boolean mask)
    mask[0, :2] = False
    kw = dict(batch_size=2, q_length=1, q_offset=4, kv_offset=0, device="cpu")
    try:
        built = ft_hf.padding_mask(kv_length=8, attention_mask=mask, **kw)
    except TypeError:   # transformers before q_length / q_offset: cache_position instead
        kw = dict(batch_size=2, cache_position=torch.tensor([4]), kv_offset=0, device="cpu")
        built = ft_hf.padding_mask(kv_length=8, attention_mask=mask, **kw)
    assert built.shape == (2, 1, 1, 8) and built.dtype == torch.bool
    assert built[0, 0, 0].tolist() == [False, False, True, True, True, False, False, False]
    assert built[1, 0, 0].tolist() == [True] * 5 + [False] * 3
    assert torch.equal(ft_hf.padding_mask(kv_length=5, attention_mask=mask, **kw), mask)
    assert ft_hf.padding_mask(kv_length=5, attention_mask=torch.ones(2, 5, dtype=torch.bool), **kw) is None
    if "q_length" in kw:
        # a decoding step over a static cache (transformers: allow_is_causal_skip=False) keeps the 4-D mask where
        # the 2-D one covers every slot (the last step), padded or not
        for m in (mask, torch.ones(2, 5, dtype=torch.bool)):
            built = ft_hf.padding_mask(kv_length=5, attention_mask=m, allow_is_causal_skip=False, **kw)
            assert built.shape == (2, 1, 1, 5) and torch.equal(built[:, 0, 0], m)


def test_unsupported_inputs_raise():
    q, k, v = _qkv(9)
    with pytest.raises(ValueError, match="s_aux"):
        ft_hf.flashtile_attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="attention_mask"):
        ft_hf.flashtile_attention_forward(_Module(), q, k, v, torch.zeros(2, 1, 20, 20, device=DEVICE))
    with pytest.raises(ValueError, match="attention_mask"):
        ft_hf.flashtile_attention_forward(_Module(), q, k, v, torch.ones(2, 20, 20, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="sliding_window"):
        ft_hf.flashtile_attention_forward(_Module(), q, k, v, None, sliding_window=0)


def test_other_flash_names_still_go_to_transformers():
    """The pre-import shim skips only flashtile's names; flash_attention_2 without flash-attn still fails
    the way transformers makes it fail."""
    from transformers import modeling_utils
    wrapped = modeling_utils.lazy_import_flash_attention
    assert wrapped("flashtile") is None
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed: flash_attention_2 would load")
    except ImportError:
        pass
    with pytest.raises(Exception):
        wrapped("flash_attention_2")


def test_position_ids_read_once_per_forward(monkeypatch):
    """Batch 1 with position_ids (every Llama forward): whether the row is packed is read from the device once per
    position_ids tensor, not once per layer; an in-place change reads it again."""
    from flashtile.integrations import transformers as ft_hf
    reads = []
    monkeypatch.setattr(ft_hf, "_SEEN", {})
    pos = torch.arange(12).view(1, 12)

    def compute(t):
        reads.append(1)
        return False
    for _ in range(4):   # four layers
        assert ft_hf._per_tensor("packed", pos, compute) is False
    assert len(reads) == 1
    pos[0, 5] = 0        # in place: a packed row now
    assert ft_hf._is_packed(pos, 1, 12, 12) is True
    assert ft_hf._is_packed(torch.arange(12).view(1, 12), 1, 12, 12) is False

"""flash_attn_with_kvcache end to end: in-place append, rotary (interleaved / GPT-NeoX, partial rotary_dim), paged
caches (page sizes 16/64/256), cache_batch_idx, cache_leftpad, seqlen_q > 1, GQA packing, fixed and automatic
split counts, against the float64 oracle; int and default cache_seqlens, an empty cache; argument validation.

The modules below the entry point have files of their own: tests/test_decode.py (the split-KV decode kernel, its
config, num_splits heuristic and plan), tests/test_combine.py (the merge of the splits), tests/test_rotary.py
(rotary_q, append_kv) and tests/test_mods.py (the masks, block ranges and softmax step every kernel shares). The
oracle (KCase, run_case: rotated appends, the cache's layouts, the float64 reference and the flash-attn tolerance
rule) lives in tests/kvcache_utils.py. fp16, bf16 and fp32 all run on the CPU (tests/test_dtypes_cpu.py adds every
entry point in each).
"""
import re

import pytest
import torch

import flashtile  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from attn_utils import DEVICE, assert_within_rule, given, st, sweep
from kvcache_utils import KCase, reference, run_case
from flashtile.kernels import dispatch
from flashtile.kvcache import flash_attn_with_kvcache

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16
ERRORS = (ValueError, TypeError)


KV_CASES = [
    # single-token decode, GQA 4:1 packed into one tile, append, automatic splits
    KCase(3, 1, 8, 2, 64, fp16, capacity=150, seqlen_new=1),
    # fixed split counts, no append, MQA, causal (with s_q = 1 causal changes nothing but the code path)
    KCase(2, 1, 4, 1, 32, fp32, capacity=130, causal=True, num_splits=1),
    KCase(2, 1, 4, 1, 32, fp32, capacity=130, causal=True, num_splits=5),
    # speculative decoding: s_q = s_new = 3, causal, rotary interleaved with rotary_dim < headdim
    KCase(2, 3, 4, 2, 64, fp16, capacity=90, seqlen_new=3, causal=True, rotary_dim=32, interleaved=True),
    # GPT-NeoX rotary, non-causal (every q row rotated at the same position), fp32, full rotary_dim
    KCase(2, 2, 2, 2, 32, fp32, capacity=60, seqlen_new=2, rotary_dim=32, interleaved=False, num_splits=3),
    # paged caches, page sizes 16 / 64 (bf16) / 256, shuffled pages, append + rotary, GQA
    KCase(2, 1, 4, 2, 32, fp16, capacity=100, seqlen_new=1, causal=True, rotary_dim=16, page=16),
    KCase(2, 2, 4, 2, 40, bf16, capacity=150, seqlen_new=2, causal=True, rotary_dim=24, interleaved=False, page=64,
          num_splits=3),
    KCase(1, 1, 2, 1, 32, fp32, capacity=300, seqlen_new=1, page=256, num_splits=4),
    # cache_batch_idx + cache_leftpad + ALiBi + softcap + sliding window + rotary, bf16
    KCase(3, 2, 4, 2, 32, bf16, capacity=80, seqlen_new=2, window=(20, 0), softcap=6.0, alibi="bh", rotary_dim=32,
          batch_idx=True, leftpad=True),
    # leftpad with a paged cache, per-head ALiBi
    KCase(2, 1, 4, 4, 24, fp32, capacity=70, seqlen_new=1, causal=True, alibi="h", page=16, leftpad=True,
          num_splits=2),
    # chunked prefill: s_q = 20 rows x group 4 = 80 packed rows (several M tiles), causal over a cache
    KCase(1, 20, 8, 2, 32, fp16, capacity=120, seqlen_new=20, causal=True, num_splits=2),
    # s_q > seqlen_k (some rows see nothing), odd head dim, left window
    KCase(2, 6, 2, 1, 40, fp32, capacity=8, window=(2, -1), causal=True),
]


@pytest.mark.parametrize("c", KV_CASES, ids=lambda c: c.id)
def test_kvcache_matches_reference(c: KCase, seed):
    run_case(c, seed)


if given is not None:
    @sweep(10)
    @given(b=st.integers(1, 3), sq=st.integers(1, 4), append=st.booleans(), hk=st.integers(1, 2),
           group=st.sampled_from([1, 2, 4]), d=st.sampled_from([16, 24, 32, 40, 64]),
           dtype=st.sampled_from([fp16, bf16, fp32]), capacity=st.integers(8, 200), causal=st.booleans(),
           left=st.integers(-1, 100), right=st.integers(-1, 100), softcap=st.sampled_from([0.0, 5.0]),
           alibi=st.sampled_from([None, "h", "bh"]), rotary=st.sampled_from([0, 1, 2]), interleaved=st.booleans(), layout=st.sampled_from(["plain", "batch_idx",
                                                                                              "page16", "page64"]),
           leftpad=st.booleans(), num_splits=st.sampled_from([0, 1, 3]), data_seed=st.integers(0, 2 ** 31 - 1))
    def test_kvcache_random_configs(b, sq, append, hk, group, d, dtype, capacity, causal, left, right, softcap, alibi,
                                    rotary, interleaved, layout, leftpad, num_splits, data_seed):
        """Random flash_attn_with_kvcache calls (append or not, rotary over all or half the head dim, plain /
        batch-indexed / paged caches, left padding, windows, softcap, ALiBi, GQA, fixed and automatic splits):
        the cache after the append and out / lse against the float64 oracle (kvcache_utils.run_case)."""
        torch.manual_seed(data_seed)
        rotary_dim = (0, d, d // 2 - d // 2 % 2)[rotary] if append else 0   # (rotary rotates the new k too)
        c = KCase(b, sq, hk * group, hk, d, dtype, capacity=max(capacity, sq), seqlen_new=sq if append else 0,
                  causal=causal, window=(left, right), softcap=softcap, alibi=alibi, rotary_dim=rotary_dim,
                  interleaved=interleaved, page=int(layout[4:]) if layout.startswith("page") else 0,
                  batch_idx=layout == "batch_idx", leftpad=leftpad, num_splits=num_splits)
        run_case(c, data_seed)


def test_window_edges_past_the_cache_are_dropped(seed):
    """A window edge at or past the cache's capacity is dropped, as flash-attn drops it (its seqlen_k is the
    capacity): such a call is not local, so q is rotated at one position for every row, exactly as without the
    window; an edge inside the capacity makes the call local (each row at its own position)."""
    q = torch.randn(2, 3, 4, 32, dtype=fp32, device=DEVICE)
    k_new, v_new = (torch.randn(2, 3, 2, 32, dtype=fp32, device=DEVICE) for _ in range(2))
    caches = [torch.randn(2, 40, 2, 32, dtype=fp32, device=DEVICE) for _ in range(2)]
    cos, sin = (torch.randn(40, 16, dtype=fp32, device=DEVICE) for _ in range(2))
    seqlens = torch.tensor([10, 30], dtype=torch.int32, device=DEVICE)

    def run(window):
        kc, vc = (c.clone() for c in caches)
        return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, window_size=window)
    plain = run((-1, -1))
    for window in ((-1, 40), (40, -1), (45, 60)):
        assert torch.equal(run(window), plain), window
    assert not torch.equal(run((-1, 39)), plain)   # (local: the rows' own rotary positions)


def test_int_cache_seqlens_equals_tensor(seed):
    """An int cache_seqlens (no append) goes to the kernel as a scalar; same result as the equivalent tensor."""
    q = torch.randn(2, 1, 4, 32, dtype=fp16, device=DEVICE)
    kc = torch.randn(2, 70, 2, 32, dtype=fp16, device=DEVICE)
    vc = torch.randn(2, 70, 2, 32, dtype=fp16, device=DEVICE)
    for n, ns in ((70, 3), (37, 2), (0, 1)):
        a = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, num_splits=ns, return_softmax_lse=True)
        b = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.full((2,), n, dtype=torch.int32, device=DEVICE),
                                    num_splits=ns, return_softmax_lse=True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_cache_gives_zero_output_and_neg_inf_lse(seed):
    q = torch.randn(2, 2, 2, 16, dtype=fp16, device=DEVICE)
    kc = torch.randn(2, 32, 1, 16, dtype=fp16, device=DEVICE)
    for ns in (1, 3):
        out, lse = flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=0, num_splits=ns, return_softmax_lse=True)
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_default_cache_seqlens_is_full_cache_and_int_broadcasts(seed):
    c = KCase(2, 1, 4, 2, 32, fp32, capacity=40)
    q = torch.randn(2, 1, 4, 32, dtype=fp32, device=DEVICE)
    kc = torch.randn(2, 40, 2, 32, dtype=fp32, device=DEVICE)
    vc = torch.randn(2, 40, 2, 32, dtype=fp32, device=DEVICE)
    full = flash_attn_with_kvcache(q, kc, vc)
    ref, _ = reference(c, q, kc.double(), vc.double(), torch.tensor([40, 40]), None, None, None, None, upcast=True)
    std, _ = reference(c, q, kc, vc, torch.tensor([40, 40]), None, None, None, None, upcast=False)
    assert_within_rule("out", full, ref, std, fp32)
    part = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=25)
    ref, _ = reference(c, q, kc.double(), vc.double(), torch.tensor([25, 25]), None, None, None, None, upcast=True)
    std, _ = reference(c, q, kc, vc, torch.tensor([25, 25]), None, None, None, None, upcast=False)
    assert_within_rule("out", part, ref, std, fp32)


def test_no_autograd_graph(seed):
    q = torch.randn(1, 1, 2, 16, dtype=fp32, device=DEVICE, requires_grad=True)
    kc = torch.randn(1, 20, 2, 16, dtype=fp32, device=DEVICE)
    out = flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=10)
    assert not out.requires_grad


# ---------------------------------------------------------------------------------------------------------
# Validation: refused before any kernel runs, naming the argument

def _word(name):
    return rf"(?<![A-Za-z0-9_.\[]){re.escape(name)}(?![A-Za-z0-9_])"


def _base():
    q = torch.randn(2, 1, 4, 16, dtype=fp16, device=DEVICE)
    kc = torch.randn(2, 32, 2, 16, dtype=fp16, device=DEVICE)
    return dict(q=q, k_cache=kc, v_cache=kc.clone())


def _i32(v):
    return torch.tensor(v, dtype=torch.int32, device=DEVICE)


BAD = [
    ("seqlens-int64", dict(cache_seqlens=torch.tensor([3, 4], device=DEVICE)), "cache_seqlens.dtype"),
    ("seqlens-shape", dict(cache_seqlens=_i32([3, 4, 5])), "cache_seqlens.shape"),
    ("seqlens-negative-int", dict(cache_seqlens=-1), "cache_seqlens"),
    ("seqlens-over-capacity", dict(cache_seqlens=_i32([3, 33])), "cache_seqlens"),
    ("seqlens-int-over-capacity", dict(cache_seqlens=33), "cache_seqlens"),
    ("append-over-capacity", dict(cache_seqlens=_i32([3, 32]), k=torch.randn(2, 1, 2, 16, dtype=fp16, device=DEVICE),
                                  v=torch.randn(2, 1, 2, 16, dtype=fp16, device=DEVICE)), "cache_seqlens"),
    ("append-without-seqlens", dict(k=torch.randn(2, 1, 2, 16, dtype=fp16, device=DEVICE),
                                    v=torch.randn(2, 1, 2, 16, dtype=fp16, device=DEVICE)), "cache_seqlens"),
    ("k-without-v", dict(k=torch.randn(2, 1, 2, 16, dtype=fp16, device=DEVICE)), "k/v"),
    ("k-wrong-heads", dict(k=torch.randn(2, 1, 4, 16, dtype=fp16, device=DEVICE),
                           v=torch.randn(2, 1, 4, 16, dtype=fp16, device=DEVICE)), "k.shape"),
    ("k-wrong-dtype", dict(k=torch.randn(2, 1, 2, 16, device=DEVICE), v=torch.randn(2, 1, 2, 16, device=DEVICE)),
     "k.dtype"),
    ("cache-batch-mismatch", dict(k_cache=torch.randn(3, 32, 2, 16, dtype=fp16, device=DEVICE),
                                  v_cache=torch.randn(3, 32, 2, 16, dtype=fp16, device=DEVICE)), "k_cache.shape[0]"),
    ("batch-idx-range", dict(cache_batch_idx=_i32([0, 2])), "cache_batch_idx"),
    ("batch-idx-int64", dict(cache_batch_idx=torch.tensor([0, 1], device=DEVICE)), "cache_batch_idx.dtype"),
    ("seqlens-strided", dict(cache_seqlens=_i32([3, 9, 4, 9])[::2]), "cache_seqlens.stride(0)"),
    ("leftpad-strided", dict(cache_seqlens=_i32([3, 4]), cache_leftpad=_i32([0, 9, 1, 9])[::2]),
     "cache_leftpad.stride(0)"),
    ("batch-idx-strided", dict(cache_batch_idx=_i32([0, 9, 1, 9])[::2]), "cache_batch_idx.stride(0)"),
    ("leftpad-above-seqlens", dict(cache_seqlens=_i32([3, 4]), cache_leftpad=_i32([4, 0])), "cache_leftpad"),
    ("rotary-without-k", dict(rotary_cos=torch.ones(32, 8, dtype=fp16, device=DEVICE),
                              rotary_sin=torch.ones(32, 8, dtype=fp16, device=DEVICE)), "k"),
    ("num-splits-float", dict(num_splits=1.5), "num_splits"),
    ("heads-not-divisible", dict(k_cache=torch.randn(2, 32, 3, 16, dtype=fp16, device=DEVICE),
                                 v_cache=torch.randn(2, 32, 3, 16, dtype=fp16, device=DEVICE)), "k.shape[-2]"),
    ("paged-with-batch-idx", dict(block_table=_i32([[0], [1]]), cache_batch_idx=_i32([0, 1])), "cache_batch_idx"),
    ("block-table-int64", dict(block_table=torch.tensor([[0], [1]], device=DEVICE)), "block_table.dtype"),
    ("block-table-out-of-range", dict(block_table=_i32([[0], [2]]), cache_seqlens=5), "block_table[1, 0]"),
]


@pytest.mark.parametrize("what,override,name", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_naming_argument(what, override, name, monkeypatch):
    from flashtile.kernels.triton import rotary
    monkeypatch.setattr(dispatch, "flash_decode", lambda *a, **k: pytest.fail("decode kernel ran on bad input"))
    monkeypatch.setattr(rotary, "append_kv", lambda *a, **k: pytest.fail("append kernel ran on bad input"))
    args = _base()
    args.update(override)
    with pytest.raises(ERRORS, match=_word(name)):
        flash_attn_with_kvcache(**args)


def test_shape_checks_memoised_per_signature(monkeypatch):
    """The shape / dtype / device checks run once per argument signature (api.problem.kvcache): a repeated call
    skips them, any change of what they read (a shape, a stride, a dtype, a scalar's value or type) checks again,
    and a call that failed them is not remembered."""
    from flashtile import kvcache
    from flashtile.api import problem
    from flashtile.kernels.triton import rotary
    monkeypatch.setattr(kvcache, "_SHAPES", {})
    calls = []
    real = problem.kvcache
    monkeypatch.setattr(problem, "kvcache", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(dispatch, "flash_decode", lambda *a, **k: None)
    monkeypatch.setattr(rotary, "append_kv", lambda *a, **k: None)
    args = _base()
    flash_attn_with_kvcache(**args, cache_seqlens=5)
    flash_attn_with_kvcache(**args, cache_seqlens=7)                        # an int's value: not a signature part
    flash_attn_with_kvcache(**{**args, "q": torch.randn(2, 1, 4, 16, dtype=fp16, device=DEVICE)}, cache_seqlens=5)
    assert len(calls) == 1
    kt = torch.randn(2, 16, 32, 2, dtype=fp16, device=DEVICE).permute(0, 2, 3, 1)   # k_cache with d strided
    for i, change in enumerate([dict(softcap=5.0), dict(window_size=(4, 0)), dict(causal=True),
                                dict(q=torch.randn(2, 1, 4, 16, dtype=fp32, device=DEVICE)),
                                dict(q=torch.randn(2, 1, 8, 16, dtype=fp16, device=DEVICE)[:, :, ::2]),   # strides
                                dict(num_splits=2), dict(return_softmax_lse=True)]):
        try:
            flash_attn_with_kvcache(**{**args, **change}, cache_seqlens=5)
        except ERRORS:
            pass
        assert len(calls) == 2 + i, change
    n = len(calls)
    for bad in (dict(k_cache=kt, v_cache=kt), dict(alibi_slopes=torch.ones(3, device=DEVICE)),
                dict(cache_leftpad=torch.zeros(2, dtype=torch.int64, device=DEVICE)),
                dict(q=torch.randn(2, 1, 4, 8, dtype=fp16, device=DEVICE))):
        for _ in range(2):   # refused each time: the failing check is not memoised
            with pytest.raises(ERRORS):
                flash_attn_with_kvcache(**{**args, **bad}, cache_seqlens=5)
    assert len(calls) == n + 8
    with pytest.raises(TypeError, match="rotary_cos"):   # not a tensor: checked without the memo
        flash_attn_with_kvcache(**args, k=args["q"][:, :, :2], v=args["q"][:, :, :2], cache_seqlens=_i32([1, 2]),
                                rotary_cos=[[1.0] * 8] * 32, rotary_sin=[[0.0] * 8] * 32)


def test_rotary_table_too_short_raises():
    args = _base()
    k = torch.randn(2, 1, 2, 16, dtype=fp16, device=DEVICE)
    cos = torch.ones(20, 8, dtype=fp16, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("rotary_cos.shape[0]")):
        flash_attn_with_kvcache(**args, k=k, v=k.clone(), rotary_cos=cos, rotary_sin=cos, cache_seqlens=3)
    with pytest.raises(ValueError, match=re.escape("rotary_cos.shape[1]")):
        big = torch.ones(40, 9, dtype=fp16, device=DEVICE)
        flash_attn_with_kvcache(**args, k=k, v=k.clone(), rotary_cos=big, rotary_sin=big, cache_seqlens=3)

"""Varlen, KV-cache decoding and split-KV on a CUDA GPU at realistic sizes (skipped without CUDA).

The same oracles as the CPU tests (tests/test_varlen.py; tests/test_kvcache.py and tests/test_decode.py, whose
oracle is tests/kvcache_utils.py), scaled up: caches of 32k positions, paged caches (pages of 16 / 64 / 256),
GQA 8:1 (nheads 32 / nheads_k 4, 16 / 2), head dims 64 / 128 / 256, bf16 (which the CPU interpreter cannot test)
next to fp16, automatic and fixed split counts. Run with ``pytest tests/gpu/test_varlen_kvcache_gpu.py`` on an
H100/H200; a few minutes, most of it Triton compilation and the float64 oracle.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA-only tests", allow_module_level=True)

import flashtile  # noqa: E402,F401
from kvcache_utils import KCase, make_problem, physical_cache, reference, run_case  # noqa: E402
from test_varlen import (VCase, check_seqused, check_varlen, cu, packed_inputs, paged_from_packed,  # noqa: E402
                         varlen_reference)
from attn_utils import assert_within_rule  # noqa: E402
from flashtile.kernels import runtime as _runtime  # noqa: E402
from flashtile.kernels.triton import decode as _decode  # noqa: E402
from flashtile.kvcache import flash_attn_with_kvcache  # noqa: E402
from flashtile.varlen import flash_attn_varlen_func  # noqa: E402
from flashtile.kernels.triton import configs as _configs  # noqa: E402

fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32


GPU_KV_CASES = [
    # single-token decode against a 32k cache, GQA 8:1, automatic splits (few tiles -> many splits)
    KCase(2, 1, 32, 4, 128, bf16, capacity=32768, seqlen_new=1),
    KCase(1, 1, 32, 4, 128, fp16, capacity=32768, seqlen_new=1, causal=True, rotary_dim=128, interleaved=False),
    # paged 32k caches, pages of 256 / 64 / 16, rotary, fixed and automatic splits
    KCase(2, 1, 32, 4, 128, bf16, capacity=32768, seqlen_new=1, causal=True, rotary_dim=128, page=256),
    KCase(2, 1, 16, 2, 128, bf16, capacity=16384, seqlen_new=1, rotary_dim=64, interleaved=True, page=64,
          num_splits=8),
    KCase(1, 1, 32, 4, 128, bf16, capacity=8192, seqlen_new=1, causal=True, page=16),
    # speculative decoding (s_q = 4) and chunked prefill (s_q = 256: 2048 packed rows) over paged caches
    KCase(2, 4, 32, 4, 128, bf16, capacity=16384, seqlen_new=4, causal=True, rotary_dim=128, page=256),
    KCase(1, 256, 32, 4, 128, bf16, capacity=8192, seqlen_new=256, causal=True, page=64),
    # cache_batch_idx, leftpad, ALiBi, softcap, sliding window
    KCase(3, 1, 16, 2, 128, bf16, capacity=8192, seqlen_new=1, window=(1024, 0), softcap=30.0, alibi="bh",
          rotary_dim=64, batch_idx=True, leftpad=True),
    KCase(2, 2, 16, 2, 128, fp16, capacity=8192, seqlen_new=2, causal=True, page=256, leftpad=True),
    # other head dims; many tiles (no split); fp32
    KCase(4, 1, 8, 1, 64, bf16, capacity=16384, seqlen_new=1, causal=True),
    KCase(2, 1, 8, 2, 256, bf16, capacity=8192, seqlen_new=1, page=64),
    KCase(64, 1, 32, 8, 128, bf16, capacity=2048, seqlen_new=1, causal=True),
    KCase(2, 1, 8, 2, 128, fp32, capacity=4096, seqlen_new=1, rotary_dim=128),
]


@pytest.mark.parametrize("c", GPU_KV_CASES, ids=lambda c: c.id)
def test_kvcache_gpu_matches_reference(c, seed):
    run_case(c, seed)


def test_split_counts_agree_on_gpu(seed):
    q = torch.randn(1, 1, 32, 128, dtype=bf16, device="cuda")
    kc = torch.randn(1, 32768, 8, 128, dtype=bf16, device="cuda")
    vc = torch.randn(1, 32768, 8, 128, dtype=bf16, device="cuda")
    one = flash_attn_with_kvcache(q, kc, vc, num_splits=1, return_softmax_lse=True)
    auto_n = _decode.plan_decode(1, 32, 8, 128, bf16, 1, 32768, q.device).num_splits
    assert auto_n > 1, "batch 1 x 8 K/V heads must be split to fill the GPU"
    for n in (0, 16, 128):
        o, l_ = flash_attn_with_kvcache(q, kc, vc, num_splits=n, return_softmax_lse=True)
        torch.testing.assert_close(o.float(), one[0].float(), rtol=0, atol=1.6e-2)   # one bf16 rounding apart
        torch.testing.assert_close(l_, one[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_n,warps,stages,use_tma", [(64, 4, 3, False), (64, 4, 3, True), (128, 8, 2, True),
                                                       (32, 4, 4, False)])
def test_decode_paths_and_configs_gpu(block_n, warps, stages, use_tma, seed, monkeypatch):
    """Paged (page 256: one page per tile) vs the per-row gather vs the contiguous cache, bf16, with tile configs
    of benchmarks/sweep_decode.py (TMA included), left padding aligned / misaligned / 0 in one launch."""
    cap = 8192
    c = KCase(3, 1, 32, 8, 128, bf16, capacity=cap, causal=True, page=256, leftpad=True, num_splits=4)
    gen = torch.Generator().manual_seed(seed)
    q, k_log, v_log, _, _, _, _, _, _, alibi = make_problem(c, gen)
    seqlens = torch.tensor([cap, 5000, 777])
    lp = torch.tensor([512, 37, 0])
    k_cache, table, _ = physical_cache(c, k_log, torch.Generator().manual_seed(seed + 1))
    v_cache, _, _ = physical_cache(c, v_log, torch.Generator().manual_seed(seed + 1))
    kw = dict(cache_seqlens=seqlens.to(torch.int32).cuda(), cache_leftpad=lp.to(torch.int32).cuda(), causal=True,
              return_softmax_lse=True)
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                                                         use_tma=use_tma))
    res = {}
    for ns in (1, 4):
        res["paged", ns] = flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, num_splits=ns, **kw)
        res["contig", ns] = flash_attn_with_kvcache(q, k_log, v_log, num_splits=ns, **kw)
        _decode.CONFIG_OVERRIDE["page_tiles"] = False
        res["gather", ns] = flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, num_splits=ns, **kw)
        _decode.CONFIG_OVERRIDE.pop("page_tiles")
    ref = reference(c, q, k_log.double(), v_log.double(), seqlens, lp, None, None, alibi, upcast=True)
    std = reference(c, q, k_log, v_log, seqlens, lp, None, None, alibi, upcast=False)
    for key, (o, l_) in res.items():
        assert_within_rule("out", o, ref[0], std[0], bf16, f"[{key}]")
        assert_within_rule("softmax_lse", l_, ref[1], std[1], bf16, f"[{key}]")
        torch.testing.assert_close(o.float(), res["paged", key[1]][0].float(), rtol=0, atol=2e-3)
        torch.testing.assert_close(l_, res["paged", key[1]][1], rtol=1e-5, atol=1e-5)


# The Gluon paged decode (flashtile/kernels/gluon/paged.py: pages of 16 / 32 read as TMA boxes under one barrier per
# stage): pages, GQA, causal s_q > 1, appended tokens with rotary, splits, fp16 / bf16, d64 / d128
GLUON_PAGED_CASES = [
    KCase(2, 1, 32, 8, 128, bf16, capacity=8192, seqlen_new=1, causal=True, page=16),
    KCase(3, 4, 32, 8, 128, bf16, capacity=4096, seqlen_new=4, causal=True, rotary_dim=128, page=16, num_splits=3),
    KCase(2, 2, 16, 2, 64, fp16, capacity=8192, seqlen_new=2, page=32),
    KCase(3, 1, 32, 4, 128, bf16, capacity=20000, page=32, num_splits=1),
    KCase(2, 1, 16, 2, 128, fp16, capacity=16384, seqlen_new=1, rotary_dim=64, interleaved=False, page=16),
]


@pytest.mark.parametrize("c", GLUON_PAGED_CASES, ids=lambda c: c.id)
def test_gluon_paged_decode_gpu(c, seed, monkeypatch):
    """The Gluon paged decode against float64 (run_case's oracle, cache checks included) and against the Triton
    decode kernel on the same inputs; the Gluon kernel must have run."""
    from flashtile.kernels.gluon import paged as _paged
    ran = []
    decode_paged = _paged.decode_paged
    monkeypatch.setattr(_paged, "decode_paged", lambda *a, **k: ran.append(decode_paged(*a, **k)) or ran[-1])
    torch.manual_seed(seed)   # (run_case draws q and the caches from the global generator: the same inputs twice)
    gluon = run_case(c, seed)
    assert ran and ran[-1] is not None, "the Gluon paged decode did not run"
    monkeypatch.setattr(_paged, "OVERRIDE", {"on": False})
    torch.manual_seed(seed)
    triton_ = run_case(c, seed)
    tol = 1.6e-2 if c.dtype == bf16 else 2e-3   # one rounding of the output apart
    torch.testing.assert_close(gluon[0].float(), triton_[0].float(), rtol=0, atol=tol)
    torch.testing.assert_close(gluon[1], triton_[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page", [16, 32])
def test_gluon_paged_decode_ignores_slots_past_the_end(page, seed):
    """Cache slots past each sequence's end hold NaN (never written): the output stays finite and equal to the
    float64 reference over the visible keys, lengths not multiples of the tile, one empty sequence."""
    torch.manual_seed(seed)
    b, cap, h, hk, d = 4, 3000 // page * page, 32, 8, 128
    q = torch.randn(b, 1, h, d, dtype=bf16, device="cuda")
    k = torch.randn(b, cap, hk, d, dtype=bf16, device="cuda")
    v = torch.randn_like(k)
    per = cap // page
    perm = torch.randperm(b * per, device="cuda")
    kp = torch.empty(b * per, page, hk, d, dtype=bf16, device="cuda")
    vp = torch.empty_like(kp)
    kp[perm], vp[perm] = k.reshape(b * per, page, hk, d), v.reshape(b * per, page, hk, d)
    table = perm.view(b, per).to(torch.int32)
    lens = torch.tensor([cap - 5, 1000, 129, 0], dtype=torch.int32, device="cuda")
    pos = torch.arange(cap, device="cuda")
    for i in range(b):
        tail = pos[pos >= lens[i]]
        kp[table[i, tail // page].long(), tail % page] = float("nan")
        vp[table[i, tail // page].long(), tail % page] = float("nan")
    out, lse = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, return_softmax_lse=True)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            assert (out[i] == 0).all() and (lse[i] == float("-inf")).all()
            continue
        kk = k[i, :n].double().repeat_interleave(h // hk, 1)
        vv = v[i, :n].double().repeat_interleave(h // hk, 1)
        s = torch.einsum("qhd,khd->hqk", q[i].double(), kk) * d ** -0.5
        torch.testing.assert_close(out[i].double(), torch.einsum("hqk,khd->qhd", s.softmax(-1), vv), rtol=0,
                                   atol=1.6e-2)
        torch.testing.assert_close(lse[i].double(), s.logsumexp(-1), rtol=0, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 0])
def test_gluon_paged_decode_template_gpu(num_splits, seed, monkeypatch):
    """A decode loop's later steps launch the Gluon paged decode through its template (the compiled kernel bound to
    every argument but the tensors, descriptors rebuilt from the first call's fields): bitwise the output of the
    slow path, one split and several (the fused combine's tickets reset for the next step)."""
    from flashtile.kernels.gluon import paged as _paged
    monkeypatch.setattr(_paged, "_TEMPLATES", {})
    torch.manual_seed(seed)
    b, page, h, hk, d = 2, 16, 32, 8, 128
    kp = torch.randn(b * 300, page, hk, d, dtype=bf16, device="cuda")
    vp = torch.randn_like(kp)
    table = torch.randperm(b * 300, device="cuda").view(b, 300).to(torch.int32)
    lens = torch.tensor([4000, 1234], dtype=torch.int32, device="cuda")

    def step(q):
        return flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=num_splits,
                                       return_softmax_lse=True)

    step(torch.randn(b, 1, h, d, dtype=bf16, device="cuda"))
    assert len(_paged._TEMPLATES) == 1
    used = []
    launch = _paged._Template.launch
    monkeypatch.setattr(_paged._Template, "launch", lambda self, *a: used.append(launch(self, *a)) or used[-1])
    qs = [torch.randn(b, 1, h, d, dtype=bf16, device="cuda") for _ in range(3)]
    fast = [step(q) for q in qs]
    assert used == [True] * 3
    monkeypatch.setattr(_paged, "_TEMPLATES", {})
    monkeypatch.setattr(_decode.relaunch, "bind", lambda *a: None)   # templates off
    for q, (o, l_) in zip(qs, fast):
        o2, l2 = step(q)
        assert torch.equal(o, o2) and torch.equal(l_, l2)


def test_gluon_paged_decode_separate_combine_gpu(seed, monkeypatch):
    """The Gluon paged decode's splits merged in its launch (the default in eager calls) and by combine.py's kernel
    (decode.fuse_combine's choice in captured graphs of many splits) agree, and with the Triton kernel."""
    from flashtile.kernels.gluon import paged as _paged
    torch.manual_seed(seed)
    b, page, h, hk, d = 3, 16, 32, 8, 128
    kp = torch.randn(b * 200, page, hk, d, dtype=bf16, device="cuda")
    vp = torch.randn_like(kp)
    table = torch.randperm(b * 200, device="cuda").view(b, 200).to(torch.int32)
    lens = torch.tensor([3200, 77, 1500], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 2, h, d, dtype=bf16, device="cuda")
    res = {}
    for name, cfg, ov in (("fused", {}, {}), ("separate", {"fused_combine": False}, {}),
                          ("triton", {}, {"on": False})):
        monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", cfg)
        monkeypatch.setattr(_paged, "OVERRIDE", ov)
        res[name] = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, causal=True,
                                            num_splits=5, return_softmax_lse=True)
    for name in ("separate", "triton"):
        torch.testing.assert_close(res[name][0].float(), res["fused"][0].float(), rtol=0, atol=1.6e-2)
        torch.testing.assert_close(res[name][1], res["fused"][1], rtol=1e-5, atol=1e-5)


GPU_VARLEN_CASES = [
    VCase((1000, 0, 3000, 517), (1000, 0, 3000, 517), 16, 2, 128, bf16, causal=True),
    VCase((2048, 1, 777), (4096, 100, 777), 8, 8, 64, fp16, window=(256, 0), softcap=20.0, alibi="bh"),
    VCase((1500, 900), (1500, 2000), 8, 1, 128, bf16, dropout_p=0.17, causal=True, deterministic=True),
    VCase((640, 1024), (640, 1024), 4, 2, 256, bf16, causal=True),
]


@pytest.mark.parametrize("c", GPU_VARLEN_CASES, ids=lambda c: c.id)
def test_varlen_gpu_fwd_bwd(c, seed):
    q, k, v, dout, alibi = packed_inputs(c)
    out, lse, s_dmask = flash_attn_varlen_func(
        q, k, v, cu(c.lens_q), cu(c.lens_k), max(c.lens_q), max(c.lens_k), dropout_p=c.dropout_p, causal=c.causal,
        window_size=c.window, softcap=c.softcap, alibi_slopes=alibi, deterministic=c.deterministic,
        return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_varlen(c, q, k, v, dout, alibi, out, lse, grads, s_dmask if c.dropout_p > 0 else None)


GPU_SEQUSED_CASES = [
    # slots with unused rows on both sides, a slot used whole, an empty one; GQA, causal (the Gluon varlen kernels)
    (VCase((1000, 0, 2048, 517), (1200, 64, 2048, 517), 16, 2, 128, bf16, causal=True), (900, 0, 2048, 1),
     (1000, 64, 1500, 517)),
    (VCase((2048, 777), (4096, 777), 8, 8, 64, fp16, window=(256, 0), softcap=20.0), None, (3000, 700)),
]


@pytest.mark.parametrize("c,used_q,used_k", GPU_SEQUSED_CASES, ids=[c.id for c, _, _ in GPU_SEQUSED_CASES])
def test_varlen_seqused_gpu(c, used_q, used_k, seed):
    check_seqused(c, used_q, used_k)


@pytest.mark.parametrize("c", [GPU_VARLEN_CASES[0], GPU_VARLEN_CASES[3]], ids=lambda c: c.id)
def test_varlen_gpu_atomic_dq_tma_reduce(c, seed):
    """Packed sequences with dQ added by TMA reduce-adds: a tile past one sequence's end covers the next one's
    rows and must add exact zeros there."""
    q, k, v, dout, alibi = packed_inputs(c)
    _configs.CONFIG_OVERRIDE["bwd"] = (_configs.Config(64, 128, 8, 2, atomic_dq=True) if c.d <= 128 else
                                      _configs.Config(64, 64, 4, 2, atomic_dq=True, split_dkdv=True))
    try:
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu(c.lens_q), cu(c.lens_k), max(c.lens_q), max(c.lens_k),
                                             causal=c.causal, window_size=c.window, softcap=c.softcap,
                                             alibi_slopes=alibi, return_attn_probs=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        _configs.CONFIG_OVERRIDE.clear()
    check_varlen(c, q, k, v, dout, alibi, out, lse, grads, None)


@pytest.mark.parametrize("page", [16, 256])
def test_varlen_paged_gpu(page, seed):
    c = VCase((7, 1, 300), (20000, 4000, 9000), 32, 4, 128, bf16, causal=True)
    q, k, v, dout, alibi = packed_inputs(c)
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // page) for n in c.lens_k) + 4
    k_cache, table = paged_from_packed(k.detach(), c.lens_k, page, nb, gen)
    v_cache, _ = paged_from_packed(v.detach(), c.lens_k, page, nb, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu(c.lens_q), cu(c.lens_k), 300, 20000, causal=True,
                                     block_table=table)
    ref = varlen_reference(c, q, k, v, dout, None, True)
    std = varlen_reference(c, q, k, v, dout, None, False)
    assert_within_rule("out", out, ref[0], std[0], c.dtype, f"[{c.id} page={page}]")


@pytest.mark.parametrize("pool_before_capture", [True, False])
def test_fused_decode_in_cuda_graph_gpu(pool_before_capture, seed, monkeypatch):
    """The fused split merge (batch 8: 4 splits, ticket counters) captured in a CUDA graph and replayed three times
    equals the eager call: with the ticket pool made before the capture (the counters of the capture stream are a
    slice of it) and with the first counters asked for inside the capture (no pool is made there: the counters get
    their own fill, replayed with the graph)."""
    monkeypatch.setattr(_runtime, "_TICKETS", {})
    monkeypatch.setattr(_runtime, "_TICKET_POOL", {})
    q = torch.randn(8, 1, 32, 128, device="cuda", dtype=bf16)
    kc, vc = (torch.randn(8, 4096, 8, 128, device="cuda", dtype=bf16) for _ in range(2))
    assert _decode.plan_decode(1, 32, 8, 128, bf16, 8, 4096, q.device).num_splits <= _decode.FUSED_MAX_SPLITS
    side = torch.cuda.Stream()
    if pool_before_capture:
        with torch.cuda.stream(side):
            expect = flash_attn_with_kvcache(q, kc, vc)
        torch.cuda.current_stream().wait_stream(side)
    else:   # an eager call first (it compiles the kernels), then its counters and pool are forgotten
        expect = flash_attn_with_kvcache(q, kc, vc)
        monkeypatch.setattr(_runtime, "_TICKETS", {})
        monkeypatch.setattr(_runtime, "_TICKET_POOL", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc)
    assert (_runtime._TICKET_POOL != {}) == pool_before_capture
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expect, rtol=0, atol=0)


@pytest.mark.parametrize("batch,seqlen_k,d", [(1, 4097, 64), (8, 1000, 128)])
def test_dense_decode_step_template_gpu(batch, seqlen_k, d, seed, monkeypatch):
    """Decode steps through flash_attn_func on the split-KV decode kernel (dispatch's _DecodeStep, its K / V size
    threshold off), over caches laid out as transformers passes them ((batch, heads, seqlen, d) seen transposed): the
    first call of a problem makes its decode template, the repeats launch it directly (dispatch.flash_decode is not
    called again) with their split partials in the stream's workspace, which a step of another shape in between
    shares. Every output equals the first route's for the same inputs (the same kernel and splits) and meets the
    float64 rule; a CUDA graph captured after the eager calls replays the step."""
    from flashtile import interface
    from flashtile.kernels import dispatch
    from flashtile.reference.dense import attention_ref

    monkeypatch.setattr(dispatch, "DECODE_STEP_MIN_BYTES", 0)
    monkeypatch.setattr(interface, "_DENSE", {})
    calls = []
    real = dispatch.flash_decode
    monkeypatch.setattr(dispatch, "flash_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    h, hk = 32, 8

    def step_inputs(n):
        q = torch.randn(batch, h, 1, d, device="cuda", dtype=bf16).transpose(1, 2)
        k, v = (torch.randn(batch, hk, n, d, device="cuda", dtype=bf16).transpose(1, 2) for _ in range(2))
        return q, k, v

    def check(q, k, v, out, context):
        kw = dict(causal=True, upcast=True)
        ref = attention_ref(*(t.double() for t in (q, k, v)), **kw)[0]
        std = attention_ref(q, k, v, **dict(kw, upcast=False))[0]
        assert_within_rule("out", out, ref, std, bf16, context)

    assert _decode.plan_decode(1, h, hk, d, bf16, batch, seqlen_k, torch.device("cuda")).num_splits > 1
    inputs = [step_inputs(seqlen_k) for _ in range(3)]
    other = step_inputs(seqlen_k // 2 + 3)
    first = [flashtile.flash_attn_func(*inputs[0], causal=True)]
    assert len(calls) == 1
    for qkv in inputs[1:] + inputs[:1]:   # (repeats, the first inputs again last)
        flashtile.flash_attn_func(*other, causal=True)   # (another problem's partials in the same workspace)
        first.append(flashtile.flash_attn_func(*qkv, causal=True))
    assert len(calls) == 2, calls   # (the other shape's first call only)
    torch.testing.assert_close(first[-1], first[0], rtol=0, atol=0)
    for i, (qkv, out) in enumerate(zip(inputs, first)):
        check(*qkv, out, f"[step {i}]")
    interface._DENSE.clear()   # the first route again, for each input: the same output
    for qkv, out in zip(inputs, first):
        torch.testing.assert_close(flashtile.flash_attn_func(*qkv, causal=True), out, rtol=0, atol=0)
    q, k, v = inputs[1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashtile.flash_attn_func(q, k, v, causal=True)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, first[1], rtol=0, atol=0)

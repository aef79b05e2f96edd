"""The split-KV decode kernel (flashtile/kernels/triton/decode.py) and the Gluon paged decode's host side
(flashtile/kernels/gluon/paged.py), below flash_attn_with_kvcache.

- config and plan: decode_config / CONFIG_OVERRIDE, num_splits_heuristic's rule, plan_decode's memo and its
  choices for few tiles, small pages and PAGE_VEC, page_tiles_ok;
- the kernel's paths: split counts agree within the combine's rounding; the paged one-page-per-tile path, the
  per-row gather and the contiguous cache are bitwise equal and within the float64 rule;
- launch templates: a decode loop's repeated signature launches with the slow path's arguments (stand-in kernels);
- the Gluon paged decode: which calls it takes, and its templates (stand-in kernel, no GPU).
- decode steps through flash_attn_func (seqlen_q = 1): dispatch sends them to the decode kernel, whose template
  the step's plan keeps and launches (stand-in kernel); split partials in the workspace.

The merge of the splits (combine.py, and the fused merge inside the decode launch) is tests/test_combine.py; the
flash_attn_with_kvcache feature matrix and argument checks are tests/test_kvcache.py. The oracle is
tests/kvcache_utils.py. tests/gpu/test_varlen_kvcache_gpu.py runs the decode paths at GPU sizes.
"""
import dataclasses

import pytest
import torch

import flashtile  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from attn_utils import (DEVICE, Case, assert_within_rule, case_inputs, check_against_reference, flash_kwargs, given,
                        st, sweep)
from kvcache_utils import KCase, make_problem, physical_cache, reference
from launch_utils import StandInKernel, fast_launches, same_arguments
from flashtile.kernels.triton import decode as _decode
from flashtile.kvcache import flash_attn_with_kvcache

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16


# ---------------------------------------------------------------------------------------------------------
# Config and plan: tile sizes, split counts, the paged paths

def test_num_splits_heuristic_fills_the_gpu():
    """Few (batch x K/V heads) tiles: split until about two programs per multiprocessor, never more splits than
    key blocks allow; many tiles: no split."""
    dev = torch.device("cpu")   # 8 "multiprocessors" on the CPU
    assert _decode.num_splits_heuristic(64, 100_000, 64, dev) == 1
    assert _decode.num_splits_heuristic(1, 100_000, 64, dev) == 16
    assert _decode.num_splits_heuristic(1, 64 * 8, 64, dev) == 4      # 8 key blocks, one wave -> 4 splits of 2
    assert _decode.num_splits_heuristic(1, 10, 64, dev) == 1


def test_num_splits_heuristic_rule():
    """The documented rule (decode.num_splits_heuristic) on an H200-sized GPU (132 SMs) and across a grid of
    problems: >= ~2 waves where the key blocks allow, >= MIN_BLOCKS_PER_SPLIT blocks per split (>=
    ONE_WAVE_MIN_BLOCKS where the programs fit in one wave, as many splits as fit there: rule 5), never an empty
    last split, no split when the tiles alone reach the target."""
    dev, h = torch.device("cpu"), _decode.num_splits_heuristic
    # nheads_k 8, BLOCK_N 64, seqlen_q 1 (one M tile): tiles = 8 * batch
    assert [h(8, n, 64, dev, sms=132) for n in (4096, 32768, 131072)] == [16, 32, 33]
    assert [h(64, n, 64, dev, sms=132) for n in (4096, 32768, 131072)] == [4, 4, 4]
    assert h(128, 32768, 64, dev, sms=132) == 2          # batch 16: one wave of tiles -> two
    assert h(256, 32768, 64, dev, sms=132) == 1          # batch 32: ~2 waves already
    assert h(512, 131072, 64, dev, sms=132) == 1
    # one wave of 128-key tiles (plan_decode's few tiles): batch 1 -> 16 splits of 2 blocks at 4096 keys; at 4352
    # (34 blocks) 12 of 3 (17 of 2 would take 136 programs: a second wave); batch 2 keeps 7 splits of 5
    assert [h(8, n, 128, dev, sms=132, waves=1.0) for n in (4096, 4352)] == [16, 12]
    assert h(16, 4352, 128, dev, sms=132, waves=1.0) == 7

    def candidates(n_blocks, min_blocks):
        limit = min(_decode.MAX_SPLITS, n_blocks // min_blocks)
        return [t for t in range(2, limit + 1) if -(-n_blocks // -(-n_blocks // t)) == t]

    for sms in (8, 78, 132):
        need = _decode.WAVE_SLACK * _decode.TARGET_WAVES * sms
        for tiles in (1, 3, 8, 24, 64, 100, 300):
            for n_blocks in (1, 3, 4, 7, 8, 33, 64, 100, 512, 2048, 5000):
                s = h(tiles, n_blocks * 64, 64, dev, sms=sms)
                assert 1 <= s <= _decode.MAX_SPLITS
                if tiles * s < sms:   # rule 5: no more splits fit in the wave
                    assert not [c for c in candidates(n_blocks, _decode.ONE_WAVE_MIN_BLOCKS)
                                if c > s and tiles * c <= sms], (tiles, n_blocks, s)
                if s == 1:
                    continue
                bps = -(-n_blocks // s)
                assert -(-n_blocks // bps) == s, (tiles, n_blocks, s)          # no empty split
                one_wave = tiles * s <= sms
                min_blocks = _decode.ONE_WAVE_MIN_BLOCKS if one_wave else _decode.MIN_BLOCKS_PER_SPLIT
                assert n_blocks // s >= min_blocks, (tiles, n_blocks, s)
                assert tiles < need
                old = candidates(n_blocks, _decode.MIN_BLOCKS_PER_SPLIT)
                if old and tiles * old[-1] < need:   # target out of reach: the most splits the block limit allows,
                    wider = [c for c in candidates(n_blocks, _decode.ONE_WAVE_MIN_BLOCKS)   # then rule 5
                             if c > old[-1] and tiles * c <= sms] if tiles * old[-1] < sms else []
                    assert s == (wider or old)[-1], (tiles, n_blocks, s)


def test_few_tiles_take_one_wave_of_128_key_tiles(monkeypatch):
    """plan_decode on an H200-sized GPU (132 SMs; the interpreter's small tiles turned off): problems of at most
    SMs / 8 tiles (batch 1-2 at nheads_k 8) get FEW_TILES_CONFIG's tiles and about one wave of splits; larger ones
    the default tiles and two waves."""
    monkeypatch.setattr(_decode, "interpreting", lambda: False)
    monkeypatch.setattr(_decode, "multiprocessors", lambda device: 132)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    few = (16, *_decode.FEW_TILES_CONFIG, True)
    for batch, cache, splits in ((1, 4096, 16), (1, 32768, 16), (1, 131072, 16), (2, 4096, 8), (2, 131072, 8)):
        plan = _decode._plan(1, 32, 8, 128, bf16, batch, cache, cpu, 0, 0)
        cfg = plan.cfg
        assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages, cfg.use_tma) == few, (batch, cache)
        assert plan.num_splits == splits, (batch, cache, plan.num_splits)
        assert 8 * batch * plan.num_splits <= 132   # one wave of programs
    plan = _decode._plan(1, 32, 8, 128, bf16, 8, 32768, cpu, 0, 0)   # 64 tiles: not few
    assert (plan.cfg.BLOCK_N, plan.cfg.num_stages) == (128, 2)
    assert plan.num_splits == _decode.num_splits_heuristic(64, 32768, 128, cpu, sms=132) == 4
    # the paged path keeps one page per tile: 128-key tiles need pages of a multiple of 128, smaller pages shrink them
    assert _decode._plan(1, 32, 8, 128, bf16, 1, 32768, cpu, 256, 0).page_tiles
    assert _decode._plan(1, 32, 8, 128, bf16, 1, 32768, cpu, 64, 0).cfg.BLOCK_N == 64


def test_small_pages_plan(monkeypatch):
    """plan_decode for pages smaller than the 128-key tile (132-SM GPU, interpreter tiles off): SMALL_PAGE_STAGES
    stages and splits for two waves (TARGET_WAVES) at every batch, batch 1-2 included (whose contiguous and
    large-page plans take one wave). Pages of 16 keep the 128-key tile and gather its rows (page_tiles False) where
    each split has >= GATHER_MIN_TILES tiles; else (batch 1 with a 4k cache, pages of 32 / 64) the tile shrinks to
    one page. Configs with smaller tiles (d256's) only shrink theirs."""
    monkeypatch.setattr(_decode, "interpreting", lambda: False)
    monkeypatch.setattr(_decode, "multiprocessors", lambda device: 132)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    stages = _decode.SMALL_PAGE_STAGES

    def two_waves(batch, cache, block_n):
        return _decode.num_splits_heuristic(8 * batch, cache, block_n, cpu, sms=132, waves=_decode.TARGET_WAVES)

    for batch, cache in ((1, 32768), (1, 131072), (2, 32768), (8, 4096), (8, 32768), (64, 4096)):
        plan = _decode._plan(1, 32, 8, 128, bf16, batch, cache, cpu, 16, 0)
        assert (plan.cfg.BLOCK_N, plan.cfg.num_stages, plan.page_tiles) == (128, stages, False), (batch, cache)
        assert plan.num_splits == two_waves(batch, cache, 128), (batch, cache, plan.num_splits)
        assert -(-cache // 128 // plan.num_splits) >= _decode.GATHER_MIN_TILES
        for page in (32, 64):
            plan = _decode._plan(1, 32, 8, 128, bf16, batch, cache, cpu, page, 0)
            assert (plan.cfg.BLOCK_N, plan.cfg.num_stages, plan.page_tiles) == (page, stages, True), (batch, page)
            assert plan.num_splits == two_waves(batch, cache, page), (batch, cache, page, plan.num_splits)
    assert _decode._plan(1, 32, 8, 128, bf16, 1, 32768, cpu, 16, 0).num_splits == 32   # one wave took 16
    plan = _decode._plan(1, 32, 8, 128, bf16, 1, 4096, cpu, 16, 0)   # 8 splits of 4 tiles: short
    assert (plan.cfg.BLOCK_N, plan.cfg.num_stages, plan.page_tiles, plan.num_splits) == (16, stages, True, 32)
    # pages the 128-key tile divides keep the few-tiles plan
    plan = _decode._plan(1, 32, 8, 128, bf16, 1, 32768, cpu, 256, 0)
    assert (plan.cfg.BLOCK_N, plan.cfg.num_stages, plan.page_tiles, plan.num_splits) == \
        (128, _decode.FEW_TILES_CONFIG[2], True, 16)
    plan = _decode._plan(1, 16, 8, 256, bf16, 1, 32768, cpu, 16, 0)
    base = _decode.default_decode_config(2, 256, bf16)
    assert (plan.cfg.BLOCK_N, plan.cfg.num_stages, plan.page_tiles) == (16, base.num_stages, True)


def test_page_vec_plan(monkeypatch):
    """plan_decode's PAGE_VEC (132-SM GPU, interpreter tiles off): one-page-per-tile splits of >= PAGE_VEC_MIN_BLOCK_N
    keys per tile reading <= PAGE_VEC_MAX block-table entries load them before the key loop (a power of two >= the
    entries, one more for a split starting inside a page); longer splits, 32-key tiles, the row gather and
    contiguous caches do not."""
    monkeypatch.setattr(_decode, "interpreting", lambda: False)
    monkeypatch.setattr(_decode, "multiprocessors", lambda device: 132)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    for page, batch, cache, vec in ((256, 1, 4096, 2), (256, 1, 32768, 16), (256, 2, 32768, 32), (256, 8, 4096, 8),
                                    (256, 64, 4096, 32), (64, 8, 4096, 32), (256, 1, 131072, 0), (256, 8, 32768, 0),
                                    (32, 1, 4096, 0), (16, 1, 32768, 0), (0, 1, 4096, 0)):
        plan = _decode._plan(1, 32, 8, 128, bf16, batch, cache, cpu, page, 0)
        assert plan.page_vec == vec, (page, batch, cache, plan.page_vec)
        if vec:   # the split's tiles read at most vec entries
            tiles = -(-cache // plan.cfg.BLOCK_N // plan.num_splits)
            assert -(-tiles * plan.cfg.BLOCK_N // page) + 1 <= vec


def test_config_override_fields_and_split_pin(monkeypatch):
    """CONFIG_OVERRIDE: single fields replace the default's, "num_splits" pins the automatic choice,
    "page_tiles": False turns the paged fast path off."""
    base = _decode.decode_config(4, 64, fp16)
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"BLOCK_N": 32, "num_warps": 8, "use_tma": True})
    cfg = _decode.decode_config(4, 64, fp16)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages, cfg.use_tma) == \
        (base.BLOCK_M, 32, 8, base.num_stages, True)
    plan = _decode.plan_decode(1, 8, 2, 64, fp16, 1, 1000, torch.device("cpu"), page_size=64)
    assert plan.page_tiles and plan.num_splits == _decode.num_splits_heuristic(2, 1000, 32, torch.device("cpu"))
    _decode.CONFIG_OVERRIDE["num_splits"] = 5
    assert _decode.plan_decode(1, 8, 2, 64, fp16, 1, 1000, torch.device("cpu")).num_splits == 5
    assert _decode.plan_decode(1, 8, 2, 64, fp16, 1, 1000, torch.device("cpu"), num_splits=2).num_splits == 2
    _decode.CONFIG_OVERRIDE["page_tiles"] = False
    assert not _decode.plan_decode(1, 8, 2, 64, fp16, 1, 1000, torch.device("cpu"), page_size=64).page_tiles


@pytest.mark.parametrize("page,block_n,tiles", [(16, 16, True), (64, 16, True), (48, 16, True), (256, 32, True),
                                               (16, 32, False), (24, 16, False), (8, 16, False), (0, 16, False)])
def test_page_tiles_ok(page, block_n, tiles):
    """The one-page-per-tile path is taken exactly when BLOCK_N divides the page size (0: contiguous)."""
    assert _decode.page_tiles_ok(page, block_n) is tiles


def test_plan_decode_is_memoised_unless_a_config_is_pinned(monkeypatch):
    """plan_decode (per decode call) returns the problem's plan from a memo; a pinned CONFIG_OVERRIDE is planned
    afresh (sweeps and tests change it between calls), and the memo is back once the override is gone."""
    dev = torch.device(DEVICE)
    problem = (1, 32, 8, 128, torch.float16, 1, 4096, dev)
    plan = _decode.plan_decode(*problem)
    assert _decode.plan_decode(*problem) is plan
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"num_splits": 3})
    assert _decode.plan_decode(*problem).num_splits == 3 != plan.num_splits
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {})
    assert _decode.plan_decode(*problem) is plan


# ---------------------------------------------------------------------------------------------------------
# The kernel's paths give the same result

def test_split_counts_agree_within_rounding(seed):
    """1, 2, 7 splits and the automatic choice give the same result up to float32 rounding of the combine."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 8, 64, dtype=fp32, device=DEVICE)
    kc = torch.randn(1, 250, 2, 64, dtype=fp32, device=DEVICE)
    vc = torch.randn(1, 250, 2, 64, dtype=fp32, device=DEVICE)
    seqlens = torch.tensor([int(torch.randint(200, 251, (1,), generator=gen))], dtype=torch.int32, device=DEVICE)
    res = {n: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=n, return_softmax_lse=True)
           for n in (1, 2, 7, 0)}
    auto = _decode.num_splits_heuristic(2, 250, _decode.decode_config(4, 64, fp32).BLOCK_N, torch.device("cpu"))
    assert auto > 1, "the CPU heuristic should split this long, narrow problem (so the combine is exercised)"
    for n in (2, 7, 0):
        torch.testing.assert_close(res[n][0], res[1][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res[n][1], res[1][1], rtol=1e-5, atol=1e-6)


# Paged caches: the one-page-per-tile fast path (page_size % BLOCK_N == 0, per batch element leftpad % BLOCK_N
# == 0) against the per-row gather and the contiguous cache, which read the same rows in the same order: the
# outputs must be bitwise equal, and within the rule of the float64 reference. Left padding is set per batch
# element to an aligned non-zero value, a misaligned value and 0, so that one launch runs both paths.
PAGED_PATH_CASES = [
    # page, BLOCK_N, dtype, leftpad, causal, window, num_splits, use_tma
    (16, 16, fp16, False, False, (-1, -1), 1, False),    # page == tile
    (64, 16, fp16, False, True, (-1, -1), 3, False),     # 4 tiles per page, splits
    (48, 16, fp32, False, False, (40, 0), 2, False),     # page not a power of two; left window: lo > 0
    (32, 16, fp16, True, False, (-1, -1), 3, False),     # leftpad: aligned / misaligned / 0 in one launch
    (64, 32, fp32, True, True, (-1, -1), 1, False),
    (16, 32, fp16, False, False, (-1, -1), 2, False),    # tile spans two pages: gather only
    (24, 16, fp16, True, False, (-1, -1), 3, False),     # 16 does not divide 24: gather only
    (8, 16, fp32, False, True, (-1, -1), 1, False),      # page smaller than the tile: gather only
    (32, 16, fp16, False, False, (-1, -1), 3, True),     # TMA descriptors (emulated by the interpreter)
    (64, 16, fp16, True, True, (-1, -1), 2, True),       # TMA + leftpad (misaligned elements: pointer gather)
]


@pytest.mark.parametrize("page,block_n,dtype,leftpad,causal,window,num_splits,use_tma", PAGED_PATH_CASES,
                         ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))
def test_paged_fast_path_matches_gather_and_contiguous(page, block_n, dtype, leftpad, causal, window, num_splits,
                                                       use_tma, seed, monkeypatch):
    sq, h, hk, d, cap = 2, 4, 2, 32, 150
    c = KCase(3, sq, h, hk, d, dtype, capacity=cap, causal=causal, window=window, page=page, leftpad=leftpad,
              num_splits=num_splits)
    gen = torch.Generator().manual_seed(seed)
    q, k_log, v_log, _, _, _, _, _, _, alibi = make_problem(c, gen)
    seqlens = torch.tensor([cap, 131, 77])
    lp = torch.tensor([2 * block_n, 5, 0]) if leftpad else None       # aligned non-zero, misaligned, zero
    k_cache, table, _ = physical_cache(c, k_log, torch.Generator().manual_seed(seed + 1))
    v_cache, _, _ = physical_cache(c, v_log, torch.Generator().manual_seed(seed + 1))
    kw = dict(cache_seqlens=seqlens.to(torch.int32).to(DEVICE), causal=causal, window_size=window,
              cache_leftpad=None if lp is None else lp.to(torch.int32).to(DEVICE), num_splits=num_splits,
              return_softmax_lse=True)
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"BLOCK_N": block_n, "use_tma": use_tma})
    page_vecs = []
    monkeypatch.setattr(_decode, "PAGE_VEC_MIN_BLOCK_N", 16)   # the interpreter's small tiles take it too
    launch = _decode.relaunch.launch
    monkeypatch.setattr(_decode.relaunch, "launch", lambda kern, grid, args, kwargs: (
        page_vecs.append(kwargs["PAGE_VEC"]) if "PAGE_VEC" in kwargs else None, launch(kern, grid, args, kwargs))[1])
    fast = flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, **kw)
    # the split's block-table entries loaded before the key loop (PAGE_VEC) or each one a tile ahead: same result
    assert (page_vecs[-1] > 0) is (page % block_n == 0), page_vecs
    monkeypatch.setattr(_decode, "PAGE_VEC_MAX", 0)
    ahead = flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, **kw)
    assert page_vecs[-1] == 0
    monkeypatch.undo()   # (the launch spy and the setting; CONFIG_OVERRIDE is set again below)
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"BLOCK_N": block_n, "use_tma": use_tma})
    contig = flash_attn_with_kvcache(q, k_log, v_log, **kw)
    _decode.CONFIG_OVERRIDE["page_tiles"] = False
    gather = flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, **kw)
    _decode.CONFIG_OVERRIDE["page_tiles"] = True
    assert _decode.page_tiles_ok(page, block_n) is (page % block_n == 0)
    if use_tma:
        assert _decode._cache_descriptor(k_cache, block_n, d) is not None, "the TMA path must be exercised"
    for name, other in (("gather", gather), ("contiguous", contig), ("one-tile-ahead entry", ahead)):
        assert torch.equal(fast[0], other[0]) and torch.equal(fast[1], other[1]), \
            f"paged (page {page}, BLOCK_N {block_n}) differs from the {name} result"
    ref = reference(c, q, k_log.double(), v_log.double(), seqlens, lp, None, None, alibi, upcast=True)
    std = reference(c, q, k_log, v_log, seqlens, lp, None, None, alibi, upcast=False)
    assert_within_rule("out", fast[0], ref[0], std[0], dtype)
    assert_within_rule("softmax_lse", fast[1], ref[1], std[1], dtype)


# ---------------------------------------------------------------------------------------------------------
# Launch templates

@pytest.mark.parametrize("paged,int_seqlens,num_splits,append,tma", [
    (False, True, 0, False, False), (False, False, 3, False, True), (True, False, 1, False, True),
    (True, True, 0, False, False), (False, False, 0, True, False), (True, True, 3, True, True)])
def test_decode_template_launches_what_the_slow_path_does(paged, int_seqlens, num_splits, append, tma, monkeypatch):
    """A decode loop's steps repeat one signature: after its first launch flash_decode (and the append of new
    tokens) keep a template (the compiled kernel bound to every argument but the tensors) and later steps launch
    through it, with exactly the arguments relaunch.launch would pass (compared against a launch with the templates
    off); a tensor of another 16-byte alignment goes back through Triton's dispatch; a signature change makes
    another template. The compiled kernels are stand-ins (no GPU needed: the launches are recorded, not run); tma:
    the K/V tiles by TMA descriptors (the GPU's default), which the template rebuilds from the first call's fields."""
    import functools
    from flashtile.kernels import relaunch
    from flashtile.kernels.triton import rotary
    real_config = _decode.default_decode_config
    kern, akern = StandInKernel(_decode.decode_kernel), StandInKernel(rotary.append_kv_kernel)
    kernels = (kern, akern) if append else (kern, )

    def stand_ins():
        if tma:   # (plans memoised in a memo of the test's own)
            monkeypatch.setattr(_decode, "default_decode_config",
                                lambda *a, **k: dataclasses.replace(real_config(*a, **k), use_tma=True))
            monkeypatch.setattr(_decode, "_plan_memo", functools.lru_cache(maxsize=None)(_decode._plan))
        monkeypatch.setattr(_decode, "decode_kernel", kern)
        monkeypatch.setattr(rotary, "append_kv_kernel", akern)
        monkeypatch.setattr(_decode, "_TEMPLATES", {})
        monkeypatch.setattr(rotary, "_APPEND_BOUNDS", relaunch.Bounds())
        return fast_launches(monkeypatch)

    launches = stand_ins()
    b, h, hk, d, cap = 2, 8, 2, 32, 96
    if paged:
        k_cache = torch.randn(12, 16, hk, d, dtype=fp16, device=DEVICE)
        table = torch.randperm(12, dtype=torch.int32, device=DEVICE)[:b * 6].reshape(b, 6)
    else:
        k_cache, table = torch.randn(b, cap, hk, d, dtype=fp16, device=DEVICE), None
    v_cache = torch.randn_like(k_cache)
    seqlens = 77 if int_seqlens else torch.tensor([77, 40], dtype=torch.int32, device=DEVICE)
    new = dict(k=torch.randn(b, 1, hk, d, dtype=fp16, device=DEVICE),
               v=torch.randn(b, 1, hk, d, dtype=fp16, device=DEVICE)) if append else {}

    def step(q):
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                       num_splits=num_splits, **new)

    q = torch.randn(b, 1, h, d, dtype=fp16, device=DEVICE)
    step(torch.randn_like(q))
    assert all([c[0] for c in x.calls] == ["dispatch"] for x in kernels) and len(_decode._TEMPLATES) == 1
    n = len(launches)
    step(q)
    assert all(x.calls[-1][0] == "run" for x in kernels) and len(launches) == n   # the templates' launches
    templated = [x.calls[-1] for x in kernels]
    monkeypatch.setattr(_decode, "_TEMPLATES", {})
    monkeypatch.setattr(rotary, "_APPEND_BOUNDS", relaunch.Bounds())
    monkeypatch.setattr(relaunch, "bind", lambda *a: None)   # templates off: relaunch.launch's own direct call
    step(q)
    assert len(launches) == n + len(kernels) and not _decode._TEMPLATES
    assert (templated[0][2][8] is not None) is tma   # (decode_kernel's desc_k)
    for x, t in zip(kernels, templated):
        assert x.calls[-1][0] == "run" and t[1] == x.calls[-1][1]
        same_arguments(t[2], x.calls[-1][2], shared=(q, k_cache, v_cache, table, seqlens, *new.values()))
    monkeypatch.undo()
    stand_ins()
    step(q)
    step(q)
    n = len(kern.calls)
    buf = torch.randn(b * h * d + 1, dtype=fp16, device=DEVICE)
    step(buf[1:].view(b, 1, h, d))   # q 2 bytes off 16-byte alignment: Triton specializes on it
    assert kern.calls[n][0] == "dispatch" and kern.calls[-1][0] == "dispatch"
    step(torch.randn(b, 1, h, d, dtype=fp16, device=DEVICE))
    assert kern.calls[-1][0] == "run"
    step(torch.randn(b, 2, h, d, dtype=fp16, device=DEVICE))   # seqlen_q 2: another signature, another template
    assert kern.calls[-1][0] == "dispatch" and len(_decode._TEMPLATES) == 2


# ---------------------------------------------------------------------------------------------------------
# The Gluon paged decode's host side (flashtile.kernels.gluon.paged)

def test_gluon_paged_decode_takes_only_what_it_computes(monkeypatch):
    """flashtile.kernels.gluon.paged.eligible: the Gluon paged decode takes pages of its table (16 / 32 keys), fp16 /
    bf16, head dims 64 / 128, at most 64 packed rows, no mask or the causal one; every other call (and every call
    with OVERRIDE["on"] False) goes to the Triton kernel. On the CPU decode_paged declines (None)."""
    from flashtile.kernels.gluon import paged
    from flashtile.kernels.triton.launch import AttnParams

    def ok(page=16, dtype=bf16, d=128, rows=4, params=None, **kw):
        q = torch.empty(2, 1, 32, d, dtype=dtype)
        k = torch.empty(64, page, 8, d, dtype=dtype)
        args = dict(alibi=None, leftpad=None, cu_seqlens_q=None, cache_batch_idx=None)
        args.update(kw)
        return paged.eligible(q, k, page, rows, params or AttnParams(0.1), **args)

    assert ok() and ok(page=32) and ok(dtype=fp16, d=64) and ok(rows=64)
    assert ok(params=AttnParams(0.1, window_right=0))                       # causal
    assert not ok(page=64) and not ok(page=256) and not ok(page=8)
    assert not ok(dtype=fp32) and not ok(d=256) and not ok(rows=65)
    assert not ok(params=AttnParams(0.1, softcap=5.0)) and not ok(params=AttnParams(0.1, 10, 0))
    t = torch.zeros(2, dtype=torch.int32)
    for arg in ("alibi", "leftpad", "cu_seqlens_q", "cache_batch_idx"):
        assert not ok(**{arg: t}), arg
    monkeypatch.setattr(paged, "OVERRIDE", {"on": False})
    assert not ok()
    monkeypatch.setattr(paged, "OVERRIDE", {})
    q = torch.randn(1, 1, 8, 64, dtype=bf16)
    kc = torch.randn(4, 16, 2, 64, dtype=bf16)
    assert paged.decode_paged(q, kc, kc, q, None, None, 16, torch.zeros(1, 4, dtype=torch.int32), AttnParams(0.1),
                              0, lambda n: 1, None, True, lambda *a, **k: pytest.fail("nothing to merge")) is None


@pytest.mark.parametrize("num_splits,fused", [(1, False), (3, True), (3, False)])
def test_gluon_paged_template_launches_what_the_slow_path_does(num_splits, fused, monkeypatch):
    """decode_paged's host logic without a GPU (the Gluon kernel a stand-in that records its launches): the first
    call of a signature dispatches and keeps a template; later calls launch through it with exactly the arguments
    of a slow-path launch (templates off); splits not merged in the launch go to the caller's merge (combine.py's
    kernel) and are not templated; a new signature makes a new template."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    import types
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from flashtile.kernels import relaunch
    from flashtile.kernels.gluon import _decode as gluon_decode, fa3, paged
    from flashtile.kernels.triton.launch import AttnParams
    kern = StandInKernel(gluon_decode.paged_decode_kernel)
    monkeypatch.setattr(paged, "_kernel", lambda index: (types.SimpleNamespace(paged_decode_kernel=kern),
                                                         TensorDescriptor))
    monkeypatch.setattr(paged, "_on_gpu", lambda q: True)
    monkeypatch.setattr(fa3, "_device_index", lambda t: 0)
    monkeypatch.setattr(paged, "_TEMPLATES", {})
    combined = []
    launches = fast_launches(monkeypatch)
    b, h, hk, d, page = 2, 8, 2, 64, 16
    k_cache = torch.randn(30, page, hk, d, dtype=fp16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(30, dtype=torch.int32)[:b * 12].reshape(b, 12)   # 192 keys: three 64-key tiles
    seqlens = torch.tensor([177, 40], dtype=torch.int32)
    tickets = []
    state = {"fused": fused}

    def step(q, sig="sig"):
        out, lse = torch.empty_like(q), torch.empty(b, h, 1)
        return paged.decode_paged(q, k_cache, v_cache, out, lse, seqlens, 0, table, AttnParams(0.125), num_splits,
                                  lambda n: 1, lambda n: tickets.append(n) or torch.zeros(n, dtype=torch.int32),
                                  state["fused"], lambda *a, **k: combined.append(a), sig=sig)

    q = torch.randn(b, 1, h, d, dtype=fp16)
    assert step(torch.randn_like(q)) == num_splits
    assert kern.calls[-1][0] == "dispatch" and len(launches) == 1
    assert kern.calls[-1][3]["SPLIT"] == (num_splits > 1) and kern.calls[-1][3]["FUSED"] == fused
    assert kern.calls[-1][3]["BLOCK_N"] == paged.PAGE_CONFIGS[page][0] and kern.calls[-1][1] == (b * hk, num_splits)
    templated = not (num_splits > 1 and not fused)
    assert len(paged._TEMPLATES) == int(templated) and len(combined) == int(not templated)
    step(q)
    if not templated:
        assert len(launches) == 2 and len(combined) == 2
        return
    assert kern.calls[-1][0] == "run" and len(launches) == 1   # through the template: no relaunch.launch
    fast = kern.calls[-1]
    assert tickets == ([b * hk] * 2 if fused else [])
    if fused:   # the same signature with the merge moved to combine.py's kernel (a captured graph): not the template
        state["fused"] = False
        step(q)
        assert len(launches) == 2 and kern.calls[-1][3]["FUSED"] is False and len(combined) == 1
        state["fused"] = True
        launches.pop()
    monkeypatch.setattr(paged, "_TEMPLATES", {})
    monkeypatch.setattr(relaunch, "bind", lambda *a: None)   # templates off: relaunch.launch's own direct call
    step(q)
    assert kern.calls[-1][0] == "run" and len(launches) == 2 and not paged._TEMPLATES
    assert fast[1] == kern.calls[-1][1]
    same_arguments(fast[2], kern.calls[-1][2], shared=(q, k_cache, v_cache, table, seqlens))
    monkeypatch.undo()


# ---------------------------------------------------------------------------------------------------------
# Decode steps through flash_attn_func (one query per row): the split-KV decode kernel computes them

@pytest.mark.parametrize("c", [
    Case(2, 1, 77, 4, 2, 24, fp16, causal=True),
    Case(1, 1, 200, 4, 1, 64, fp32, window=(50, 0), layout="transposed"),
    Case(2, 1, 130, 4, 2, 40, bf16, causal=True, softcap=5.0, alibi="bh", layout="sliced"),
    Case(1, 1, 96, 2, 2, 72, fp32, softmax_scale=0.3, alibi="h"),
], ids=lambda c: c.id)
def test_dense_decode_step_runs_the_decode_kernel(c, seed, monkeypatch):
    """flash_attn_func with seqlen_q = 1 (a generation step over its keys) takes the decode kernel (dispatch's
    _decode_step; its K / V size threshold off here), features included; out, lse and the gradients (whose backward
    reads that lse) meet the float64 rule, and a repeat of the call goes the same way."""
    from flashtile import interface
    from flashtile.interface import dense_attention
    from flashtile.kernels import dispatch

    monkeypatch.setattr(dispatch, "DECODE_STEP_MIN_BYTES", 0)
    monkeypatch.setattr(interface, "_DENSE", {})   # (problems, with the plans they keep, made before)
    calls = []
    real = dispatch.flash_decode
    monkeypatch.setattr(dispatch, "flash_decode", lambda *a, **kw: calls.append(kw["sig"]) or real(*a, **kw))
    q, k, v, dout, alibi = case_inputs(c)
    out, lse, _ = dense_attention(q, k, v, **flash_kwargs(c, alibi))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, grads)
    with torch.no_grad():
        again = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi))
    assert len(calls) == 2 and calls[0] == calls[1], calls
    assert torch.equal(again, out)


if given is not None:
    @sweep(10)
    @given(b=st.integers(1, 3), sk=st.integers(1, 300), hk=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
           d=st.sampled_from([8, 16, 24, 33, 40, 64, 72]), dtype=st.sampled_from([fp16, bf16, fp32]),
           causal=st.booleans(), left=st.integers(-1, 200), softcap=st.sampled_from([0.0, 4.0]),
           alibi=st.sampled_from([None, "h", "bh"]), layout=st.sampled_from(["contig", "transposed"]),
           grads=st.booleans(), data_seed=st.integers(0, 2 ** 31 - 1))
    def test_dense_decode_steps_random_configs(b, sk, hk, group, d, dtype, causal, left, softcap, alibi, layout,
                                               grads, data_seed, monkeypatch):
        """Random decode steps (one query per row) through flash_attn_func on the decode kernel (its thresholds
        off): out, lse and, where drawn, the gradients (whose backward reads the decode kernel's lse) meet the
        float64 rule, whatever the head dim, GQA group, window, softcap, ALiBi and layout."""
        from flashtile import interface
        from flashtile.kernels import dispatch

        monkeypatch.setattr(dispatch, "DECODE_STEP_MIN_BYTES", 0)
        monkeypatch.setattr(interface, "_DENSE", {})
        routed = []
        real = dispatch.flash_decode
        monkeypatch.setattr(dispatch, "flash_decode", lambda *a, **kw: routed.append(1) or real(*a, **kw))
        torch.manual_seed(data_seed)
        c = Case(b, 1, sk, hk * group, hk, d, dtype, causal=causal, window=(left, -1), softcap=softcap,
                 alibi=alibi, layout=layout)
        q, k, v, dout, alibi_t = case_inputs(c)
        with torch.set_grad_enabled(grads):
            out, lse, _ = interface.dense_attention(q, k, v, **flash_kwargs(c, alibi_t))
        check_against_reference(c, q, k, v, dout, alibi_t, out, lse, None,
                                torch.autograd.grad(out, (q, k, v), dout) if grads else None)
        assert routed, "the decode kernel did not compute the step"


@pytest.mark.parametrize("batch,seqlen_k", [(1, 400), (3, 40)])
def test_dense_decode_step_launches_its_kept_template(batch, seqlen_k, monkeypatch):
    """A decode step through flash_attn_func keeps the decode template its first call made (dispatch._DecodeStep,
    per problem) and launches it directly from then on: no dispatch.flash_decode, no relaunch.launch, exactly the
    arguments of the slow path's launch (compared with the templates off; split partials are views of the stream's
    workspace, of the allocations' geometry). A step with ALiBi keeps the keyed path. Stand-in kernel (no GPU)."""
    from flashtile import interface
    from flashtile.kernels import dispatch, relaunch

    kern = StandInKernel(_decode.decode_kernel)

    def stand_ins():
        monkeypatch.setattr(_decode, "decode_kernel", kern)
        monkeypatch.setattr(_decode, "_TEMPLATES", {})
        monkeypatch.setattr(_decode, "_FAST", {})
        monkeypatch.setattr(dispatch, "DECODE_STEP_MIN_BYTES", 0)
        monkeypatch.setattr(interface, "_DENSE", {})
        return fast_launches(monkeypatch)

    launches = stand_ins()
    routed = []
    real = dispatch.flash_decode
    monkeypatch.setattr(dispatch, "flash_decode", lambda *a, **kw: routed.append(1) or real(*a, **kw))
    q = torch.randn(batch, 1, 8, 32, dtype=fp16, device=DEVICE)
    k, v = (torch.randn(batch, 2, seqlen_k, 32, dtype=fp16, device=DEVICE).transpose(1, 2) for _ in range(2))
    with torch.no_grad():
        flashtile.flash_attn_func(torch.randn_like(q), k, v, causal=True)
        assert routed == [1] and [c[0] for c in kern.calls] == ["dispatch"]
        n = len(launches)
        for _ in range(2):
            flashtile.flash_attn_func(q, k, v, causal=True)
        assert routed == [1] and len(launches) == n and [c[0] for c in kern.calls[1:]] == ["run", "run"]
        templated = kern.calls[-1]
        if batch == 1:   # (two tiles over 400 keys: split, the partials (o_part) in the workspace)
            assert templated[2][5].shape[0] > 1
        alibi = torch.rand(8, device=DEVICE)
        flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=alibi)
        flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=alibi)
        assert routed == [1, 1, 1] and kern.calls[-1][0] == "run"   # (ALiBi: the keyed path, its own template)
        monkeypatch.setattr(relaunch, "bind", lambda *a: None)   # templates off: the slow path's own launch
        monkeypatch.setattr(interface, "_DENSE", {})
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert kern.calls[-1][0] == "run" and kern.calls[-1][1] == templated[1]
    same_arguments(templated[2], kern.calls[-1][2], shared=(q, ))


def test_decode_template_partials_in_the_workspace(monkeypatch):
    """A split template's partials: views of the stream's workspace, lse_part's at a 128-byte aligned offset whatever
    o_part's size, kept while the workspace stays the stream's and made again over a new one; allocated where there
    is no workspace (a CUDA graph being captured)."""
    from flashtile.kernels import runtime

    buffers = [torch.zeros(4096, dtype=fp32)]
    monkeypatch.setattr(runtime, "workspace", lambda device, numel: buffers[0])
    tpl = _decode._Template(None, (1, 1, 1), (3, 1, 5, 7), None, 0, None, torch.zeros(1, dtype=torch.int32))
    o_part, lse_part = tpl._parts(torch.device("cpu"))
    assert o_part.shape == (3, 1, 5, 7) and lse_part.shape == (3, 1, 5)
    assert o_part.data_ptr() == buffers[0].data_ptr() and o_part.is_contiguous() and lse_part.is_contiguous()
    assert lse_part.storage_offset() == 128 and lse_part.data_ptr() % 16 == 0   # (105 floats of o_part, then 128)
    assert tpl._parts(torch.device("cpu"))[0] is o_part
    buffers[0] = torch.zeros(8192, dtype=fp32)
    assert tpl._parts(torch.device("cpu"))[0].data_ptr() == buffers[0].data_ptr()
    buffers[0] = None
    o_new, lse_new = tpl._parts(torch.device("cpu"))
    assert o_new.shape == (3, 1, 5, 7) and lse_new.shape == (3, 1, 5) and o_new.data_ptr() != o_part.data_ptr()


def test_small_decode_steps_keep_the_forward_kernel(monkeypatch):
    """Below DECODE_STEP_MIN_KEY_WORK keys x head dim and DECODE_STEP_MIN_BYTES of K and V a decode step stays on
    the forward kernel (whose launch path costs less host time than the decode kernel's saves there); at either
    threshold it moves."""
    from flashtile import interface
    from flashtile.kernels import dispatch

    calls = []
    real = dispatch.flash_decode
    monkeypatch.setattr(dispatch, "flash_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = (torch.randn(1, s, 2, 16, device=DEVICE) for s in (1, 40, 40))
    kv_bytes, key_work, never = 2 * 40 * 2 * 16 * 4, 40 * 16, 1 << 62
    for min_bytes, min_work, expected in ((kv_bytes + 1, key_work + 1, 0), (kv_bytes, never, 1),
                                          (never, key_work, 2), (never, never, 2)):
        monkeypatch.setattr(dispatch, "DECODE_STEP_MIN_BYTES", min_bytes)
        monkeypatch.setattr(dispatch, "DECODE_STEP_MIN_KEY_WORK", min_work)
        monkeypatch.setattr(interface, "_DENSE", {})
        flashtile.flash_attn_func(q, k, v, causal=True)
        assert len(calls) == expected

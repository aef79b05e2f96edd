"""Context-parallel layouts and plans (flashtile.distributed), checked in one process: the per-document varlen
plan computes every visible same-document pair exactly once and never a cross-document or padding pair, the
sharding helpers of every mode invert, the padding and GQA rules hold, and bad arguments are named."""
from __future__ import annotations

import random

import pytest
import torch

from flashtile.api.errors import ArgumentError
from flashtile.distributed import (
    cp_shard,
    cp_unshard,
    kv_head_replication,
    local_cu_seqlens,
    shard_varlen,
    unshard_varlen,
    varlen_layout,
    varlen_positions,
)
from flashtile.reference.dense import visible_mask
from test_cp_modes import _doc_mask


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _covered(layout, window):
    """(T, T) int: how often the ring plans of all ranks compute each (global query, global key) pair; asserts no
    call touches a padding row."""
    t = layout.total
    full = torch.zeros(t, t, dtype=torch.int)
    w = layout.world_size
    for r in range(w):
        q_rows = layout.index(r)
        for step, blocks in enumerate(layout.ring_plan(r, *window)):
            k_rows = layout.index((r - step) % w)
            for b in blocks:
                cq = ck = 0
                for sq, sk in zip(b.seqlens_q, b.seqlens_k):
                    if sq and sk:
                        rq, rk = q_rows[cq:cq + sq], k_rows[ck:ck + sk]
                        assert (rq >= 0).all() and (rk >= 0).all(), "a kernel call covers padding rows"
                        m = visible_mask(sq, sk, (b.window_left, b.window_right)).int()
                        full[rq.view(-1, 1), rk.view(1, -1)] += m
                    cq += sq
                    ck += sk
    return full


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_varlen_plan_covers_each_same_document_pair_once(world, seed):
    """Random documents (lengths 0 .. 40, most not multiples of 2W), random windows and padding multiples: over all
    ranks and steps the calls compute exactly the visible pairs of each document, each once (a pair of two
    documents, or a padding row, is never in a call)."""
    rng = random.Random(seed)
    windows = [(-1, -1), (-1, 0), (0, 0), (3, 0), (5, 2), (2, 7), (-1, 4), (9, -1), (1, 1), (40, 40)]
    for _ in range(25):
        lens = [rng.choice([0, 1, 2, 3, 5, 7, 8, 13, 16, 24, 31, 40]) for _ in range(rng.randint(1, 5))]
        if sum(lens) == 0:
            continue
        window = rng.choice(windows)
        multiple = rng.choice([None, 2 * world * rng.choice([1, 2, 3])])
        layout = varlen_layout(_cu(lens), world, multiple)
        full = _covered(layout, window)
        ctx = f"lens={lens} world={world} window={window} multiple={multiple}"
        assert full.max() <= 1, f"a pair computed twice: {ctx}"
        assert torch.equal(full.bool(), _doc_mask(lens, window, False)), f"mask differs: {ctx}"


def test_causal_varlen_plan_is_one_call_per_step():
    """Per-document zigzag keeps the causal plan to one varlen kernel call per ring step on every rank, however
    many documents (their rectangles share one window), and the query and key rows it reads cover no two
    documents in one sequence."""
    world, lens = 4, [16, 40, 8, 24, 72]
    layout = varlen_layout(_cu(lens), world)
    for r in range(world):
        plan = layout.ring_plan(r, -1, 0)
        assert [len(p) for p in plan] == [1] * world, (r, [len(p) for p in plan])
        assert (plan[0][0].window_left, plan[0][0].window_right) == (-1, 0)
        # step 0: each document's two chunks against themselves, one causal sequence each, no filler
        assert plan[0][0].seqlens_q == plan[0][0].seqlens_k == layout.local_seqlens


def test_varlen_causal_work_is_balanced_per_document():
    """Each rank computes the same number of causal (query, key) pairs of every document whose length is a
    multiple of 2W (zigzag per document), whatever the mix of lengths."""
    world, lens = 4, [8, 64, 24, 128]
    layout = varlen_layout(_cu(lens), world)
    cu = _cu(lens)
    for i in range(len(lens)):
        work = []
        for r in range(world):
            pairs = 0
            for step, blocks in enumerate(layout.ring_plan(r, -1, 0)):
                for b in blocks:
                    for q0, q1, k0, k1 in b.rects:
                        if layout.local_cu[i] <= q0 < layout.local_cu[i + 1]:
                            pairs += int(visible_mask(q1 - q0, k1 - k0, (b.window_left, b.window_right)).sum())
            work.append(pairs)
        n = cu[i + 1] - cu[i]
        assert sum(work) == n * (n + 1) // 2 and len(set(work)) == 1, (lens[i], work)


def test_shard_varlen_pads_each_document_and_inverts(seed):
    lens, world = [5, 0, 16, 9], 2
    cu = _cu(lens)
    x = torch.randn(sum(lens), 3)
    shards = [shard_varlen(x, cu, r, world, pad_value=-7.0) for r in range(world)]
    layout = varlen_layout(cu, world)
    # documents padded to multiples of 2W = 4: 8 + 0 + 16 + 12 rows, half on each rank
    assert layout.padded == (8, 0, 16, 12) and all(s.shape == (18, 3) for s in shards)
    assert sum(int((s[:, 0] == -7.0).sum()) for s in shards) == 36 - 30
    assert torch.equal(unshard_varlen(shards, cu, world), x)
    # rank 1 holds chunks 1 and 2 of document 0 (chunk size 2): positions 2, 3, then 4 and padding
    assert torch.equal(shards[1][:4, 0], torch.cat([x[2:5, 0], torch.tensor([-7.0])]))
    cu_local, max_local = local_cu_seqlens(cu, world)
    assert cu_local.tolist() == [0, 4, 4, 12, 18] and cu_local.dtype == torch.int32 and max_local == 8
    assert varlen_positions(cu).tolist() == list(range(5)) + list(range(16)) + list(range(9))
    x.requires_grad_(True)
    shard_varlen(x, cu, 0, world).sum().backward()
    assert torch.equal(x.grad, (layout.index(0)[layout.index(0) >= 0].bincount(minlength=30) > 0).float()
                       .view(-1, 1).expand(30, 3))


@pytest.mark.parametrize("ring_size, ulysses_size, layout, varlen", [
    (4, 1, "zigzag", False), (2, 2, "zigzag", False), (2, 2, "contiguous", False), (1, 4, "zigzag", False),
    (4, 1, "zigzag", True), (2, 2, "zigzag", True), (1, 4, "zigzag", True), (1, 1, "zigzag", True),
])
def test_cp_shard_unshard_round_trip(ring_size, ulysses_size, layout, varlen):
    world = ring_size * ulysses_size
    if varlen:
        lens = [7, 16, 3]
        cu = _cu(lens)
        x = torch.arange(sum(lens) * 2).view(-1, 2).float()
        shards = [cp_shard(x, r, ring_size, ulysses_size, layout, cu_seqlens=cu) for r in range(world)]
        assert len({s.shape for s in shards}) == 1
        assert torch.equal(cp_unshard(shards, ring_size, ulysses_size, layout, cu_seqlens=cu), x)
    else:
        x = torch.arange(2 * 32 * 3).view(2, 32, 3).float()
        shards = [cp_shard(x, r, ring_size, ulysses_size, layout) for r in range(world)]
        assert torch.equal(cp_unshard(shards, ring_size, ulysses_size, layout), x)
        if ulysses_size > 1 and ring_size > 1 and layout == "zigzag":
            # CP rank (ring 1, Ulysses 0): the first half of ring shard 1 = chunk 1 of 4 (positions 8 .. 15)
            assert (shards[2][0, :, 0] // 3).tolist() == list(range(8, 16))


def test_ulysses_varlen_layout_pads_only_the_end():
    cu = [0, 5, 12]   # 12 tokens over 8 ranks: padded at the end to 16, documents untouched
    x = torch.arange(12).float()
    shards = [cp_shard(x, r, 1, 8, cu_seqlens=cu, pad_value=-1.0) for r in range(8)]
    assert torch.equal(torch.cat(shards), torch.cat([x, torch.full((4,), -1.0)]))


@pytest.mark.parametrize("nheads, nheads_k, world, rep", [
    (32, 8, 4, 1), (32, 8, 16, 2), (8, 2, 4, 2), (4, 1, 4, 4), (12, 6, 4, 2), (12, 3, 4, 4), (16, 16, 8, 1),
])
def test_kv_head_replication_rule(nheads, nheads_k, world, rep):
    assert kv_head_replication(nheads, nheads_k, world) == rep
    # after replication every rank holds whole KV heads for its query heads
    assert (nheads_k * rep) % world == 0 and (nheads // nheads_k) % rep == 0


def test_bad_arguments_are_named():
    with pytest.raises(ArgumentError, match=r"q.shape\[-2\] \(nheads\)"):
        kv_head_replication(6, 2, 4)
    with pytest.raises(ArgumentError, match="pad_multiple"):
        varlen_layout([0, 8], 2, pad_multiple=6)
    with pytest.raises(ArgumentError, match="cu_seqlens"):
        varlen_layout([0, 8, 4], 2)
    with pytest.raises(ArgumentError, match=r"cu_seqlens\[0\]"):
        shard_varlen(torch.zeros(8), [1, 8], 0, 2)
    with pytest.raises(ArgumentError, match="cu_seqlens"):
        varlen_layout(torch.tensor([0.0, 8.0]), 2)
    with pytest.raises(ArgumentError, match=r"x.shape\[0\]"):
        shard_varlen(torch.zeros(6), [0, 8], 0, 2)
    with pytest.raises(ArgumentError, match="rank"):
        cp_shard(torch.zeros(1, 16), 4, 2, 2)
    with pytest.raises(ArgumentError, match="shards"):
        cp_unshard([torch.zeros(1, 4)] * 3, 2, 2)


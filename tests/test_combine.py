"""Merging partial attention results (flashtile/kernels/triton/combine.py). The ring's merge_parts against one
softmax in float64 over the union of three key sets (a part over some rows only, rows empty in one set or in all,
16-bit parts and outputs, strided views). Flash-decoding's merge of the split partials: combine_splits on its own
against one softmax in float64 (dense and packed layouts, one merge step or several, empty splits, rows without
keys) and its chunk rule; the merge fused into the decode launch (the last split of each tile, by ticket counter:
runtime.tickets) against combine.py's kernel, and the rules that pick one or the other (decode.fuse_combine,
dispatch.gluon_fuse_combine).

The split-KV decode kernel that writes the partials is tests/test_decode.py; flash_attn_with_kvcache's feature
matrix is tests/test_kvcache.py.
"""
import math

import pytest
import torch

import flashtile  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from attn_utils import DEVICE
from flashtile.kernels import dispatch, runtime
from flashtile.kernels.triton import combine as _combine, decode as _decode
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.reference.dense import attention_ref

fp32 = torch.float32
LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------------------
# combine_splits: split partials merged into one softmax

def split_partials(rows: int, nheads: int, head_dim: int, num_splits: int, gen: torch.Generator):
    """Random attention rows cut into splits, as the decode kernel leaves them: per split s of (row, head) its
    keys' scores t (log2 units) and values V give O_s = softmax(t) V over the split and lse2_s = log2 sum 2^t
    (float64, then stored as float32). Split lengths are random, 0 included (lse2_s = -inf; O_s is then never
    to be read: it holds large garbage here); split offsets span +-120 in log2 units, past fp32's exp2 range;
    (row 0, head 0) has no key in any split. Returns o_part, lse_part (float32, the kernel's layout) and the
    float64 softmax over all of a row's keys: out (rows, nheads, d), lse (rows, nheads) natural log."""
    kmax = 6
    lengths = torch.randint(0, kmax + 1, (num_splits, rows, nheads), generator=gen)
    lengths[:, 0, 0] = 0
    t = torch.randn(num_splits, rows, nheads, kmax, generator=gen, dtype=torch.float64) * 3
    t += (torch.rand(num_splits, rows, nheads, 1, generator=gen, dtype=torch.float64) - 0.5) * 240
    t[torch.arange(kmax).view(1, 1, 1, -1) >= lengths[..., None]] = float("-inf")
    v = torch.randn(num_splits, rows, nheads, kmax, head_dim, generator=gen, dtype=torch.float64)
    lse2_s = torch.logsumexp(t * LN2, dim=-1) / LN2
    o_s = torch.einsum("srhk,srhkd->srhd", torch.exp2(t - lse2_s[..., None]).nan_to_num(0.0), v)
    empty = torch.isneginf(lse2_s)
    o_s[empty] = torch.randn(int(empty.sum()), head_dim, generator=gen, dtype=torch.float64) * 1e3
    # the one softmax: every key of the row, whichever split holds it
    t_all = t.permute(1, 2, 0, 3).reshape(rows, nheads, -1)
    v_all = v.permute(1, 2, 0, 3, 4).reshape(rows, nheads, -1, head_dim)
    lse2 = torch.logsumexp(t_all * LN2, dim=-1) / LN2
    out = torch.einsum("rhk,rhkd->rhd", torch.exp2(t_all - lse2[..., None]).nan_to_num(0.0), v_all)
    return o_s.float(), lse2_s.float(), out, lse2 * LN2


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("num_splits,chunk,head_dim", [(2, 0, 16), (7, 0, 40), (7, 2, 40), (13, 4, 24), (1, 0, 16)])
def test_combine_splits_is_one_softmax_in_float64(layout, num_splits, chunk, head_dim, seed):
    """combine_splits merges split partials (O_s, lse2_s) into the softmax over all of a row's keys: O and the
    natural-log LSE within fp32 rounding of float64, for split counts of one merge step or several (chunk 2 / 4:
    a ragged last step), head dims below a power of two, empty splits (weight 0, their O_s never mixed in),
    splits whose scores differ by far more than fp32's exp2 range, and a row with no key at all (O = 0,
    LSE = -inf). dense: out (batch, seqlen_q, nheads, d) with rows = batch * seqlen_q; packed (varlen):
    out (total_q, nheads, d). Only the head dim's columns of out are written."""
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen_q, nheads = (2, 3, 2) if layout == "dense" else (1, 5, 3)
    rows = batch * seqlen_q
    o_part, lse_part, ref_out, ref_lse = split_partials(rows, nheads, head_dim, num_splits, gen)
    pad = 8   # out's rows are wider than head_dim: columns past it must stay as they were
    if layout == "dense":
        buf = torch.full((batch, seqlen_q, nheads, head_dim + pad), float("nan"), device=DEVICE)
        lse = torch.full((batch, nheads, seqlen_q), float("nan"), device=DEVICE)
        seqlen_rows = seqlen_q
    else:
        buf = torch.full((rows, nheads, head_dim + pad), float("nan"), device=DEVICE)
        lse = torch.full((nheads, rows), float("nan"), device=DEVICE)
        seqlen_rows = rows
    out = buf[..., :head_dim]
    _combine.combine_splits(o_part.to(DEVICE), lse_part.to(DEVICE), out, lse, seqlen_rows, chunk=chunk)
    got_out = out.cpu().double().reshape(rows, nheads, head_dim)
    got_lse = (lse.cpu().double().permute(0, 2, 1) if layout == "dense" else lse.cpu().double().T).reshape(rows, nheads)
    assert torch.isnan(buf[..., head_dim:]).all(), "columns past head_dim were written"
    assert not torch.isnan(got_out).any() and not torch.isnan(got_lse).any(), "an output element was not written"
    assert torch.isneginf(got_lse[0, 0]) and (got_out[0, 0] == 0).all(), "a row without keys: O = 0, LSE = -inf"
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(ref_lse))
    # (fp32 lse2_s of magnitude 120 carry ~1e-5 of rounding: 1e-5 of relative error in each split's weight)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(got_lse[fin], ref_lse[fin], rtol=0, atol=1e-4)
    torch.testing.assert_close(got_out, ref_out, rtol=1e-4, atol=1e-4)


def test_combine_chunk_takes_every_split_in_one_step_where_registers_allow():
    """combine_chunk: a power of two >= 2 covering all splits in one merge step while chunk * BLOCK_D fits
    CHUNK_ELEMS (up to 64 splits at d128, 32 at d256), else that many per step."""
    c = _combine.combine_chunk
    assert [c(n, 128) for n in (1, 2, 3, 5, 16, 33, 64, 65, 128)] == [2, 2, 4, 8, 16, 64, 64, 64, 64]
    assert [c(n, 256) for n in (3, 32, 33, 100)] == [4, 32, 32, 32]
    for block_d in (16, 32, 64, 128, 256, 512):
        for n in range(1, 130):
            k = c(n, block_d)
            assert k >= 2 and k & (k - 1) == 0
            assert k >= n or k * block_d == _combine.CHUNK_ELEMS, (n, block_d, k)
            assert k * block_d <= max(_combine.CHUNK_ELEMS, 2 * block_d), (n, block_d, k)


# ---------------------------------------------------------------------------------------------------------
# Where the splits merge: in the decode launch (fused) or by combine.py's kernel

@pytest.mark.parametrize("num_splits", [3, 7])
def test_fused_combine_matches_combine_kernel_and_resets_its_tickets(num_splits, seed, monkeypatch):
    """The splits merged inside the decode launch (the last split of each tile, by ticket) equal combine.py's
    separate kernel; every ticket counter is back at 0 afterwards, so a second launch is right too. Several
    row tiles (seqlen_q 5 x group 4 = 20 rows > the interpreter's BLOCK_M 16), two batch elements of different
    lengths, causal (some splits of the short one see no key)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 5, 8, 32, generator=gen).to(DEVICE)
    kc = torch.randn(2, 150, 2, 32, generator=gen).to(DEVICE)
    vc = torch.randn(2, 150, 2, 32, generator=gen).to(DEVICE)
    seqlens = torch.tensor([150, int(torch.randint(20, 60, (1,), generator=gen))], dtype=torch.int32, device=DEVICE)

    def run():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=num_splits,
                                       return_softmax_lse=True)
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"fused_combine": False})
    sep = run()
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"fused_combine": True})
    monkeypatch.setattr(runtime, "_TICKETS", {})
    for _ in range(2):
        fused = run()
        torch.testing.assert_close(fused[0], sep[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused[1], sep[1], rtol=1e-6, atol=1e-6)
        (tickets,) = runtime._TICKETS.values()
        assert int(tickets.abs().sum()) == 0
    ref, ref_lse, _ = attention_ref(q[:1].double(), kc[:1].double(), vc[:1].double(), causal=True)
    torch.testing.assert_close(fused[0][:1].double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused[1][:1].double(), ref_lse.double(), rtol=1e-4, atol=1e-4)


def test_fused_combine_up_to_fused_max_splits(seed, monkeypatch):
    """The split count decides where the splits are merged: in the decode launch up to FUSED_MAX_SPLITS, by
    combine.py's kernel beyond, unless the call is eager (no CUDA graph capture) and reads at most
    EAGER_FUSED_BYTES of K/V (host-bound: one launch fewer). Both ways agree."""
    calls = []
    real = _decode._combine.combine_splits
    monkeypatch.setattr(_decode._combine, "combine_splits", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = torch.randn(1, 1, 4, 32, dtype=fp32, device=DEVICE)
    kc = torch.randn(1, 16 * (_decode.FUSED_MAX_SPLITS + 1), 1, 32, dtype=fp32, device=DEVICE)
    kv_bytes = 2 * kc.numel() * kc.element_size()
    outs = {}
    for limit, capturing in ((kv_bytes - 1, False), (kv_bytes, True), (kv_bytes, False)):
        monkeypatch.setattr(_decode, "EAGER_FUSED_BYTES", limit)
        monkeypatch.setattr(_decode, "_capturing", lambda device, c=capturing: c)
        eager_small = limit >= kv_bytes and not capturing
        for n, separate in ((2, 0), (_decode.FUSED_MAX_SPLITS, 0), (_decode.FUSED_MAX_SPLITS + 1, 1)):
            calls.clear()
            outs[(limit, capturing, n)] = out = flash_attn_with_kvcache(q, kc, kc, num_splits=n)
            assert out.isfinite().all()
            assert len(calls) == (0 if eager_small else separate), (limit, capturing, n)
    n = _decode.FUSED_MAX_SPLITS + 1
    torch.testing.assert_close(outs[(kv_bytes, False, n)], outs[(kv_bytes, True, n)], rtol=1e-6, atol=1e-6)
    assert _decode.fuse_combine(n, kv_bytes, torch.device(DEVICE)) is True
    monkeypatch.setattr(_decode, "_capturing", lambda device: True)
    assert _decode.fuse_combine(n, kv_bytes, torch.device(DEVICE)) is False
    assert _decode.fuse_combine(_decode.FUSED_MAX_SPLITS, kv_bytes, torch.device(DEVICE)) is True
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"fused_combine": False})
    assert _decode.fuse_combine(2, 0, torch.device(DEVICE)) is False


def test_gluon_fuse_combine_rule(monkeypatch):
    """dispatch.gluon_fuse_combine: the Gluon paged decode merges its splits in its launch only in eager calls
    reading at most decode.EAGER_FUSED_BYTES of K/V (host-bound: one launch instead of two), by combine.py's kernel
    otherwise; decode.CONFIG_OVERRIDE["fused_combine"] decides where set."""
    cpu = torch.device("cpu")
    assert dispatch.gluon_fuse_combine(_decode.EAGER_FUSED_BYTES, cpu)
    assert not dispatch.gluon_fuse_combine(_decode.EAGER_FUSED_BYTES + 1, cpu)
    monkeypatch.setattr(dispatch, "_capturing", lambda device: True)
    assert not dispatch.gluon_fuse_combine(1 << 20, cpu)
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"fused_combine": True})
    assert dispatch.gluon_fuse_combine(1 << 40, cpu)
    monkeypatch.setattr(_decode, "CONFIG_OVERRIDE", {"fused_combine": False})
    assert not dispatch.gluon_fuse_combine(1, cpu)


def test_ticket_counters_are_unused_slices_of_one_zeroed_pool(monkeypatch):
    """New ticket counters (a stream seen for the first time, or more tiles than before) are unused slices of the
    device's zero-filled pool: no fill runs for them, so none is captured into a CUDA graph whose capture stream
    asks for counters. torch.zeros runs only to make a pool."""
    monkeypatch.setattr(runtime, "_TICKETS", {})
    monkeypatch.setattr(runtime, "_TICKET_POOL", {})
    fills = []
    real_zeros = torch.zeros
    monkeypatch.setattr(runtime.torch, "zeros", lambda *a, **k: fills.append(a) or real_zeros(*a, **k))
    dev = torch.device(DEVICE)
    first = runtime.tickets(dev, 10)
    assert len(fills) == 1 and first.numel() == 1024 and int(first.abs().sum()) == 0
    assert runtime.tickets(dev, 1000) is first                      # enough counters: the same ones
    first[:3] = 7                                                    # (as if a launch were still using them)
    grown = runtime.tickets(dev, 3000)
    assert len(fills) == 1 and grown.numel() == 3000 and int(grown.abs().sum()) == 0
    assert grown.data_ptr() >= first.data_ptr() + 4 * first.numel()  # past every counter handed out
    big = runtime.tickets(dev, runtime.TICKET_POOL_SIZE)             # more than the pool has left: a new pool
    assert len(fills) == 2 and big.numel() == runtime.TICKET_POOL_SIZE and int(big.abs().sum()) == 0
    # inside a CUDA graph capture no pool is made (the graph would re-zero it under other streams' counters): the
    # counters get a fill of their own, and the pool stays as it was
    pool_before = runtime._TICKET_POOL[(dev.type, dev.index)]
    monkeypatch.setattr(runtime, "_capturing", lambda device: True)
    monkeypatch.setattr(runtime, "_TICKETS", {})
    own = runtime.tickets(dev, runtime.TICKET_POOL_SIZE)
    assert len(fills) == 3 and own.numel() == runtime.TICKET_POOL_SIZE and int(own.abs().sum()) == 0
    assert runtime._TICKET_POOL[(dev.type, dev.index)] is pool_before and own.data_ptr() != pool_before[0].data_ptr()


# ---------------------------------------------------------------------------------------------------------
# merge_parts: the ring's merge of its blocks' results, once

@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])
def test_merge_parts_is_attention_over_the_union(seed, part_dtype, out_dtype):
    """Three parts over keys [0, 7), [7, 20), [20, 30), the third for output rows [10, 35) only (its rows are
    views of a larger buffer: strided), the parts in the kernels' output dtype -> attention over all 30 keys,
    written once into views of larger buffers. Row 0 sees no key (0 / -inf, never NaN), row 1 none of the first
    set, row 2 none of the second; a part's row without keys is never read (NaN there changes nothing); the
    output is written in every row (it starts as 7.0). merge_attention, the readable rule, twice gives the same."""
    from flashtile.distributed import merge_attention
    b, s, h, d, sk, pad = 2, 40, 3, 24, 30, 5
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n in (s, sk, sk))
    mask = torch.rand(s, sk, generator=g) < 0.5
    mask[0] = False
    mask[1, :7] = False
    mask[2, 7:20] = False
    mask[3] = True
    mask[:10, 20:] = mask[35:, 20:] = False   # the third part's keys reach rows [10, 35) only
    ref, ref_lse, _ = attention_ref(q, k, v, attn_mask=mask)
    parts, pieces = [], []
    for k0, k1, r0, r1 in ((0, 7, 0, s), (7, 20, 0, s), (20, 30, 10, 35)):
        o, lse, _ = attention_ref(q[:, r0:r1], k[:, k0:k1], v[:, k0:k1], attn_mask=mask[r0:r1, k0:k1])
        pieces.append((o.float(), lse.float()))
        buf = torch.full((b, r1 - r0, h + 1, d), float("nan"), dtype=part_dtype)[:, :, 1:]   # strided rows
        buf.copy_(o)
        buf[lse.transpose(1, 2) == float("-inf")] = float("nan")   # rows without keys: never read
        parts.append((r0, buf, lse.float()))
    out_buf = torch.full((b, s + pad, h, d), 7.0, dtype=out_dtype)
    lse_buf = torch.full((b, h, s + pad), 7.0, dtype=fp32)
    out, lse = out_buf[:, pad:], lse_buf[:, :, pad:]
    _combine.merge_parts(parts, out, lse)
    assert torch.equal(out_buf[:, :pad], torch.full_like(out_buf[:, :pad], 7.0))   # nothing outside the views
    assert torch.equal(lse_buf[:, :, :pad], torch.full_like(lse_buf[:, :, :pad], 7.0))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert torch.equal(lse[:, :, 0], torch.full_like(lse[:, :, 0], float("-inf")))
    tol = 1e-5 if part_dtype == out_dtype == fp32 else 2e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=0), f"seed={seed}"
    assert torch.allclose(out.double(), ref, atol=tol, rtol=0), f"seed={seed}"
    (oa, la), (ob, lb), (oc, lc) = pieces
    mo, ml = merge_attention(oa, la, ob, lb)
    mo[:, 10:35], ml[:, :, 10:35] = merge_attention(mo[:, 10:35], ml[:, :, 10:35], oc, lc)
    if part_dtype == out_dtype == fp32:
        assert torch.allclose(out, mo, atol=1e-6, rtol=0) and torch.allclose(lse[finite], ml[finite], atol=1e-6)


def test_merge_parts_names_a_bad_part_count():
    out, lse = torch.zeros(1, 4, 1, 16), torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="parts"):
        _combine.merge_parts([], out, lse)
    part = (0, torch.zeros(1, 4, 1, 16), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="parts"):
        _combine.merge_parts([part] * (_combine.MAX_PARTS + 1), out, lse)

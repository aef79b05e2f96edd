"""Flash-decoding's merge of the split partials (flashtile/kernels/triton/combine.py): combine.py's kernel, the
merge fused into the decode launch (the last split of each tile, by ticket counter: runtime.tickets) and the
rules that pick one or the other (decode.fuse_combine, dispatch.gluon_fuse_combine).

The split-KV decode kernel that writes the partials is tests/test_decode.py; flash_attn_with_kvcache's feature
matrix is tests/test_kvcache.py.
"""
import pytest
import torch

import flashtile  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from attn_utils import DEVICE
from flashtile.kernels import dispatch, runtime
from flashtile.kernels.triton import decode as _decode
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.reference.dense import attention_ref

fp32 = torch.float32


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

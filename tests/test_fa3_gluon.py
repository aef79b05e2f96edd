"""FlashAttention-3's Hopper forward and backward (flashtile/kernels/gluon) without a GPU: which problems they take,
how kernels.dispatch hands a backward to them, and that the kernels compile for sm_90 with the installed Triton.
Their numerics are checked on a Hopper GPU (tests/gpu/test_fa3_gluon_gpu.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile.kernels import dispatch
from flashtile.kernels.gluon import fa3, paged
from flashtile.kernels.triton import launch
from flashtile.kernels.triton.launch import AttnParams

ROOT = Path(__file__).resolve().parents[1]


def _qkv(b=2, sq=1024, sk=1024, h=4, hk=4, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


FULL, CAUSAL = AttnParams(softmax_scale=0.1), AttnParams(softmax_scale=0.1, window_right=0)


@pytest.mark.parametrize("kw,params", [
    (dict(), FULL), (dict(), CAUSAL), (dict(d=256), CAUSAL), (dict(dtype=torch.float16, hk=1), FULL),
    (dict(sq=512, sk=1536), FULL), (dict(sq=1536, sk=256, d=128), FULL), (dict(d=256, sk=1984), FULL),
    (dict(sq=704, sk=640), FULL), (dict(sq=1088, sk=1088, d=256), CAUSAL),   # the last tile: one warpgroup
    (dict(d=64), FULL), (dict(d=64, sq=1088, sk=1152, hk=1), FULL), (dict(d=64, sq=2048, sk=2048), CAUSAL),
    (dict(d=64, sq=1088, sk=1088), FULL), (dict(sq=1000, sk=1000), FULL), (dict(sk=1000), FULL),   # any length
    (dict(sq=1024, sk=2048), CAUSAL), (dict(sq=2048, sk=1000), CAUSAL),   # bottom-right causal
    (dict(), AttnParams(softmax_scale=0.1, window_left=256, window_right=0)),
    (dict(), AttnParams(softmax_scale=0.1, window_left=100, window_right=37)),
    (dict(), AttnParams(softmax_scale=0.1, softcap=20.0)),
])
def test_eligible_problems(kw, params):
    assert fa3.eligible(*_qkv(**kw), params)


@pytest.mark.parametrize("kw,params", [
    (dict(d=96), FULL),
    (dict(dtype=torch.float32), FULL),
    (dict(sq=0), FULL),
    (dict(sq=1), FULL),                                  # (Gluon's lowering fails on seqlen_q == 1 folded)
    (dict(), AttnParams(softmax_scale=0.1, dropout_p=0.1)),
    (dict(), AttnParams(softmax_scale=0.0)),             # the kernel scales the row max: scale must be > 0
    (dict(), AttnParams(softmax_scale=-0.1, window_right=0)),
])
def test_ineligible_problems(kw, params):
    assert not fa3.eligible(*_qkv(**kw), params)


@pytest.mark.parametrize("kw,params", [
    (dict(), FULL), (dict(), CAUSAL), (dict(d=64), CAUSAL), (dict(d=64, hk=1), FULL),
    (dict(sq=704, sk=640), FULL),                        # d128: Br 64, Bc 128
    (dict(sq=512, sk=1536, d=64), FULL), (dict(dtype=torch.float16, hk=2), CAUSAL),
    (dict(d=64, sq=1088, sk=1088), FULL), (dict(sq=1000, sk=1024), FULL), (dict(sk=1088), FULL),   # any length
    (dict(sq=1024, sk=2048), CAUSAL), (dict(), AttnParams(softmax_scale=0.1, softcap=20.0)),
    (dict(), AttnParams(softmax_scale=0.1, window_left=100, window_right=0)),
])
def test_backward_eligible_problems(kw, params):
    assert fa3.eligible(*_qkv(**kw), params, backward=True)


@pytest.mark.parametrize("kw,params", [
    (dict(d=256), FULL),                                 # dK, dV of 64 keys x 256 do not fit the registers
    (dict(dtype=torch.float32), FULL),
    (dict(), AttnParams(softmax_scale=0.1, dropout_p=0.1)),
])
def test_backward_ineligible_problems(kw, params):
    assert not fa3.eligible(*_qkv(**kw), params, backward=True)


def _block_mask(s, block_size, heads=None):
    """A sliding window with sinks (heads: a window per head)."""
    from flashtile.blocksparse import create_block_mask
    bm = create_block_mask(lambda b, h, q, kv: (kv <= q) & ((q - kv < 300 + (h * 200 if heads else 0)) | (kv < 4)),
                           None, heads, s, s, BLOCK_SIZE=block_size, device="cpu")
    return bm.kernel_args(*_qkv(sq=s, sk=s, h=heads or 4, hk=heads or 4)[:2])[1]


def test_flex_features_eligible():
    """The forward and backward take flashtile.flex's features of dense problems at FLEX_HEAD_DIMS; not dBias, block masks of
    blocks smaller than 128 (a tile would span two), varlen, nor (the backward) per-head lists for a group of query
    heads sharing a KV head."""
    from flashtile.kernels.params import UserMods
    q, k, v = _qkv()
    mods = UserMods(mask_mod=object(), mask_aux=(0, ))
    assert fa3.eligible(*_qkv(d=64), FULL, mods=mods) == (64 in fa3.FLEX_HEAD_DIMS)
    bias, mask = torch.zeros(1, 4, 1024, 1024), torch.ones(1, 1, 1024, 1024, dtype=torch.bool)
    for backward in (False, True):
        assert fa3.eligible(q, k, v, FULL, mods=mods, backward=backward)
        assert fa3.eligible(q, k, v, CAUSAL, bias=bias, mask=mask, backward=backward)
        assert fa3.eligible(q, k, v, FULL, sparse=_block_mask(1024, 256), backward=backward)
        assert not fa3.eligible(q, k, v, FULL, sparse=_block_mask(1024, 64), backward=backward)
        assert not fa3.eligible(q, k, v, FULL, bias=bias, dbias=torch.zeros(1), backward=backward)
        assert not fa3.eligible(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), FULL, mods=mods,
                                cu_seqlens_q=torch.tensor([0, 1024, 2048], dtype=torch.int32), backward=backward)
    qg, kg, vg = _qkv(h=4, hk=2)
    per_head = _block_mask(1024, 128, heads=4)
    assert fa3.eligible(qg, kg, vg, FULL, sparse=per_head)
    assert not fa3.eligible(qg, kg, vg, FULL, sparse=per_head, backward=True)
    assert fa3.eligible(qg, kg, vg, FULL, sparse=_block_mask(1024, 128), backward=True)


def test_backward_programs_longest_first():
    """A key block every query sees (attention sinks) starts first in every head; the rest keep the grid's order
    (one head's key blocks after another)."""
    s, batch, nheads, nheads_k = 1024, 2, 4, 2
    order = fa3.longest_first(_block_mask(s, 128), batch, nheads, nheads_k, s, 128).tolist()
    n_kv = s // 128
    n_bh = batch * nheads_k
    assert sorted(order) == list(range(n_bh * n_kv))
    assert order[:n_bh] == [bh * n_kv for bh in range(n_bh)]      # every head's key block 0 (the sinks) first
    rest = order[n_bh:]
    assert rest == sorted(rest)
    lists = _block_mask(s, 128)
    first = fa3._order(lists, batch, nheads, nheads_k, s, 128)
    assert fa3._order(lists, batch, nheads, nheads_k, s, 128) is first            # a training loop's repeat
    lists.q_num.zero_()                                                           # lists changed in place: anew
    assert fa3._order(lists, batch, nheads, nheads_k, s, 128) is not first


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_bwd_dispatch(deterministic, monkeypatch):
    """Where fa3 supports a backward, dispatch.flash_bwd hands it (with Delta from the preprocess kernel) to fa3.bwd,
    except for deterministic gradients (fa3.bwd adds dQ atomically): then the Triton kernels compute them."""
    calls = []
    monkeypatch.setattr(fa3, "supports", lambda *a, backward=False, **kw: backward)
    monkeypatch.setattr(fa3, "bwd", lambda *a: calls.append(a))
    q, k, v = (torch.randn(1, 64, 2, 32, requires_grad=False) for _ in range(3))
    dout = torch.randn_like(q)
    params = AttnParams(softmax_scale=32 ** -0.5)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 64)
    dispatch.flash_fwd(q, k, v, out, lse, params)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    dispatch.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, params, deterministic=deterministic)
    if deterministic:
        assert not calls and all(torch.isfinite(g).all() for g in (dq, dk, dv))
    else:
        assert len(calls) == 1
        delta = calls[0][5]
        torch.testing.assert_close(delta, (dout.float() * out.float()).sum(-1).transpose(1, 2))


@triton.jit
def _plus_zeros(score, b, h, q_idx, kv_idx, aux):
    return score + tl.zeros([1], tl.float32)


def test_mods_gluon_cannot_compile_run_on_triton(monkeypatch, seed):
    """A user mod the Gluon kernels fail to compile (one building a tile of its own: tl.zeros has no layout there)
    runs on the Triton kernels, forward and backward, and is not offered to Gluon again."""
    from triton.compiler.errors import CompilationError
    from flashtile.flex import ScoreMod, flex_attention

    tried = []

    def fails(*a, **kw):
        tried.append(1)
        raise CompilationError(None, None, "a tile without a layout")

    q, k, v = (torch.randn(1, 48, 2, 128, requires_grad=True) for _ in range(3))
    ref = flashtile.flash_attn_func(q.detach(), k.detach(), v.detach())
    monkeypatch.setattr(fa3, "supports", lambda *a, **kw: True)
    monkeypatch.setattr(fa3, "_device_index", lambda t: 0)   # (the plans' grid, made on the CPU here)
    monkeypatch.setattr(fa3, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fa3, "fwd", fails)
    monkeypatch.setattr(fa3, "bwd", fails)
    monkeypatch.setattr(dispatch, "_TRITON_MODS", set())
    mod = ScoreMod(_plus_zeros)
    out = flex_attention(q, k, v, score_mod=mod)
    out.backward(torch.ones_like(out))
    assert tried == [1]                      # the forward tried Gluon once; the backward knew better
    torch.testing.assert_close(out.detach(), ref, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    flex_attention(q, k, v, score_mod=mod)
    assert tried == [1]


@pytest.mark.parametrize("dims", [dict(sk=0), dict(b=0), dict(h=0)], ids=["seqlen_k0", "batch0", "nheads0"])
def test_empty_problems_never_reach_the_gluon_kernels(dims, monkeypatch):
    """A problem without keys (or without queries) is no work for the FA3 kernels, whatever fa3.supports says of its
    shapes (seqlen_k = 0 is a multiple of every Bc, and the forward kernel waits for a first key block that never
    comes): the training path's plans and dispatch's calls leave it to the Triton launchers, which write zeros and
    an LSE of -inf (no gradient at all). The kernels here are stand-ins that fail when called."""
    def gluon(*a, **kw):
        pytest.fail("an empty problem reached the Gluon kernels")
    monkeypatch.setattr(fa3, "supports", lambda *a, **kw: True)
    for name in ("ForwardPlan", "BackwardPlan", "fwd", "bwd"):
        monkeypatch.setattr(fa3, name, gluon)
    b, sq, sk, h = dims.get("b", 2), 64, dims.get("sk", 128), dims.get("h", 4)
    q = torch.randn(b, sq, h, 128, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(b, sk, max(h, 1), 128, dtype=torch.float16, requires_grad=True) for _ in range(2))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and (out == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all((g == 0).all() for g in (dq, dk, dv))
    params = AttnParams(softmax_scale=0.1)
    o, l_ = torch.empty_like(q), torch.empty(b, h, sq)
    dispatch.flash_fwd(q.detach(), k.detach(), v.detach(), o, l_, params)
    assert (o == 0).all() and (l_ == float("-inf")).all()


def test_disabled_forward_gets_triton_backward(monkeypatch):
    """flash_attn_func records fa3.disabled() at the forward: its backward, run later outside the block, is off too."""
    seen = []
    real = launch.flash_bwd
    monkeypatch.setattr(launch, "flash_bwd", lambda *a, **kw: seen.append(fa3.enabled()) or real(*a, **kw))
    q, k, v = (torch.randn(1, 32, 2, 32, requires_grad=True) for _ in range(3))
    with fa3.disabled():
        out_off = flashtile.flash_attn_func(q, k, v)
    out_on = flashtile.flash_attn_func(q, k, v)
    out_off.sum().backward()
    out_on.sum().backward()
    assert seen == [False, True]


def test_features_and_layouts():
    """The kernels take ALiBi (float32 slopes), varlen (packed q with cu_seqlens) and slices of packed tensors;
    not bool masks or bias outside FLEX_HEAD_DIMS (test_flex_features_eligible), (b, h, s, d) tensors seen
    transposed, or a packed q without cu_seqlens."""
    q, k, v = _qkv()
    assert fa3.eligible(q, k, v, FULL, alibi=torch.ones(4))
    assert fa3.eligible(q, k, v, CAUSAL, alibi=torch.ones(2, 4))
    assert not fa3.eligible(q, k, v, FULL, alibi=torch.ones(4, dtype=torch.float64))
    assert fa3.eligible(q, k, v, FULL, alibi=torch.ones(4), backward=True)
    assert fa3.eligible(*_qkv(d=64), FULL, mask=torch.ones(1, 1, 1024, 1024, dtype=torch.bool)) == \
        (64 in fa3.FLEX_HEAD_DIMS)
    assert not fa3.eligible(*_qkv(d=256), FULL, bias=torch.ones(1, 1, 1024, 1024))
    assert not fa3.eligible(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, FULL)   # strided q
    assert not fa3.eligible(q[0], k[0], v[0], FULL)                                        # packed, no cu_seqlens
    cu = torch.tensor([0, 100, 1024], dtype=torch.int32)
    assert fa3.eligible(q[0], k[0], v[0], CAUSAL, cu_seqlens_q=cu)
    assert fa3.eligible(q[0], k[0], v[0], CAUSAL, cu_seqlens_q=cu, backward=True)
    qkv = torch.randn(2, 1024, 3, 4, 128, dtype=torch.bfloat16)                           # slices of packed qkv
    assert fa3.eligible(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], FULL)
    buf = torch.empty(q.numel() + 1, dtype=q.dtype)
    q_odd = buf[1:].view(q.shape)                     # contiguous, but not 16-byte aligned: TMA cannot read it
    assert q_odd.is_contiguous() and not fa3.eligible(q_odd, k, v, FULL)


def test_cpu_tensors_and_switch_off(monkeypatch):
    q, k, v = _qkv()
    assert not fa3.supports(q, k, v, FULL)   # CPU tensors: the Triton kernel (interpreter) runs
    assert fa3.enabled()
    monkeypatch.setenv("FLASHTILE_GLUON", "0")   # (read at every call: a change at run time takes effect)
    assert not fa3.enabled()
    monkeypatch.setenv("FLASHTILE_GLUON", "1")
    assert fa3.enabled()
    monkeypatch.delenv("FLASHTILE_GLUON")
    assert fa3.enabled()
    with fa3.disabled():
        assert not fa3.enabled()


def test_environ_reads_what_os_environ_holds(monkeypatch):
    from flashtile.kernels.runtime import environ
    monkeypatch.delenv("FLASHTILE_TEST_SWITCH", raising=False)
    assert environ("FLASHTILE_TEST_SWITCH", "dflt") == "dflt"
    monkeypatch.setenv("FLASHTILE_TEST_SWITCH", "é1")
    assert environ("FLASHTILE_TEST_SWITCH", "dflt") == "é1"
    monkeypatch.setenv("FLASHTILE_TEST_SWITCH", "")
    assert environ("FLASHTILE_TEST_SWITCH", "dflt") == ""


def test_kernels_compile_for_sm90():
    """Every variant the dispatcher can launch compiles to sm_90 PTX with wgmma (the backward with TMA reduce-add
    for dQ, the FP8 forward with e4m3 wgmmas), within 227 KiB of shared memory, and every consumer's mbarrier
    arrival follows a bar.sync of its warpgroup (the barrier counts rely on it)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    specs = [f"fwd,{d},{c},bf16" for d in sorted(fa3.CONFIGS) for c in (0, 1)] + ["fwd,128,0,fp16"]
    # the forward's features, each alone and together (fa3.fwd_features), at each head dim
    specs += [f"fwdx,{d},{f},bf16" for d in sorted(fa3.CONFIGS) for f in
              ("causal+tail", "left+right+tail+guard", "softcap+alibi", "causal+varlen+tail+guard+softcap+alibi")]
    specs += [f"fwdshort,{d},{int(c)},bf16,{n}" for (d, c), entries in sorted(fa3.SHORT_CONFIGS.items())
              for n, _ in entries]
    specs += [f"bwd,{d},{c},bf16" for d in sorted(fa3.BWD_CONFIGS) for c in (0, 1)] + ["bwd,64,1,fp16"]
    specs += [f"bwdx,{d},{f},bf16" for d in sorted(fa3.BWD_CONFIGS) for f in
              ("causal+tail", "left+right+tail", "softcap+alibi", "causal+varlen+tail+softcap+alibi")]
    # flashtile.flex's features (tests/fa3_compile_check.py FLEX): mods, masks, a bias, block masks
    specs += [f"fwdx,{d},{f}" for d in fa3.FLEX_HEAD_DIMS for f in ("scoremod+maskmod+causal,bf16",
                                                                   "sparse+mask+bias,fp16")]
    specs += [f"bwdx,{d},{f}" for d in fa3.FLEX_HEAD_DIMS for f in ("sparse+scoremod+maskmod,bf16",
                                                                   "mask+bias+causal,fp16")]
    specs += [f"fp8,{d},{c},bf16" for d in sorted(fa3.FP8_CONFIGS) for c in (0, 1)] + ["fp8,128,0,fp16"]
    # the paged decode (gluon/_decode.py), every page size of its table, both epilogues, both head dims
    specs += [f"paged,{d},{c},{dt},{page}" for page in sorted(paged.PAGE_CONFIGS) for d, c, dt in
              ((128, 0, "bf16"), (64, 1, "fp16"))]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "fa3_compile_check.py"), *specs], env=env,
                         capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ok ")]
    assert len(lines) == len(specs), res.stdout
    for ln in lines:
        fields = dict(f.split("=") for f in ln.split()[3:] if "=" in f)
        if ln.split()[1] == "paged":
            # TMA copies and wgmmas; pages of 16 take 64-key tiles so that two programs share an SM (228 KiB of
            # shared memory, 1 KiB reserved per program: paged.PAGE_CONFIGS)
            assert int(fields["wgmma"]) > 0 and int(fields["tma"]) > 0, ln
            assert 0 < int(fields["shared"]) <= 227 * 1024, ln
            if fields["page"] == "16":
                assert 2 * (int(fields["shared"]) + 1024) <= 228 * 1024, ln
            continue
        assert int(fields["wgmma"]) > 0 and 0 < int(fields["shared"]) <= 227 * 1024, ln
        assert int(fields["arrives"]) > 0 and int(fields["unsynced"]) == 0, ln
        assert (int(fields["reduce"]) > 0) == (ln.split()[1] in ("bwd", "bwdx")), ln
        # FP8: e4m3 wgmmas for both GEMMs, and P~ handed to the P V wgmma without exchanging bytes between threads
        # (that exchange took 32 indexed shuffles per P~ tile, 64+ per kernel; a few remain for warp indices)
        assert (int(fields["e4m3_mma"]) > 0) == (ln.split()[1] == "fp8"), ln
        assert int(fields["shfl_idx"]) < 16, ln


def test_host_launches_pass_the_jit(tmp_path):
    """fa3.fwd, fa3.bwd, fa3.fwd_fp8 and paged.decode_paged's launches (their argument tuples and constexpr groups as
    the host code builds them) go through Triton's JIT binder and compile for sm_90 with wgmmas: dense and general
    backward kernels, windows over unequal lengths, softcap with ALiBi, varlen (d128 and d64 causal; d128 full: keys
    bounded every step), attn_bias with a bool mask, a block mask with score_mod and mask_mod, the backward writing
    float32 dK / dV (dense d128 / d64, varlen d128 / d64), GQA with a group's heads split over programs adding dK /
    dV by TMA reduce-add, GQA with the dense backward's heads per program as a constant (fa3.BWD_GQA_HEADS), varlen at d128
    with one cu_seqlens for queries and keys (fa3.BWD_SAME_SEQS), the FP8
    forward, the paged decode split and whole (tests/gluon_launch_check.py: a stand-in
    sm_90 driver, kernel.warmup for the launch). The general backward at d64 (Br = 64: fa3.BWD_ANY_CONFIGS)
    assembles without register spills (ptxas -v, where Triton has its ptxas)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), PTX_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "gluon_launch_check.py")], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("ok ")]
    kernels = [ln[2] for ln in lines]
    assert res.stdout.splitlines()[-1] == f"done {len(lines)}" and len(lines) == 28, res.stdout
    assert kernels.count("fa3_fwd_kernel") == 12 and kernels.count("paged_decode_kernel") == 2, kernels
    assert kernels.count("fa3_bwd_kernel") == 5 and kernels.count("fa3_bwd_any_kernel") == 9, kernels
    assert [ln[-1] for ln in lines if ln[-1].startswith("split=")] == ["split=4"], res.stdout
    # the dense backward's query heads per program as a constant (GQA-2 at head dim x Br 128 x 64 and 64 x 128),
    # none where a split leaves one per program
    assert [ln[4:] for ln in lines if ln[2] == "fa3_bwd_kernel"] == [
        ["tile=128x64", "heads=2"], ["tile=64x128", "heads=2"], ["tile=128x64", "split=4"],
        ["tile=128x64", "heads=2"], ["tile=64x128", "heads=2"]], res.stdout
    # one cu_seqlens for queries and keys (the launch check's varlen problems): SAME_SEQS at d128 (BWD_SAME_SEQS)
    assert [ln[0:2] + ln[4:] for ln in lines if ln[-1] == "same"] == [
        ["ok", "11", "tile=128x64", "same"], ["ok", "15", "tile=128x64", "same"], ["ok", "22", "tile=128x64", "same"]]
    assert all(int(ln[3].split("=")[1]) > 0 for ln in lines), res.stdout
    general_d64 = [int(ln[1]) for ln in lines if ln[2] == "fa3_bwd_any_kernel" and "tile=64x64" in ln]
    assert general_d64, res.stdout
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return   # (no ptxas to ask: the launches compiled, which is this test's first part)
    for n in general_d64:
        ptx = tmp_path / f"{n:02d}_fa3_bwd_any_kernel.ptx"
        asm = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(ptx), "-o", str(tmp_path / "out.cubin")],
                             capture_output=True, text=True, timeout=600)
        assert asm.returncode == 0, asm.stderr[-2000:]
        assert " 0 bytes spill stores" in asm.stderr, asm.stderr[-2000:]


class _FakeDescriptor:
    """Stands in for Gluon's TensorDescriptor on a machine without a GPU: keeps what fa3.bwd builds it from."""
    def __init__(self, base, shape, strides, block, layout=None):
        self.base, self.shape, self.strides, self.block_shape, self.layout = base, shape, strides, block, layout
        self.padding = "zero"


@pytest.mark.parametrize("d", sorted(fa3.BWD_CONFIGS))
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_launch_follows_the_tables(d, causal, monkeypatch):
    """fa3.bwd launches the backward kernel with its tables' choices: Br / Bc / stages of BWD_CONFIGS, the turns of
    BWD_PINGPONG; dK / dV by TMA (descriptors over dk, dv, a consumer warpgroup's rows each); a grid of one program
    per key block and (batch, kv head)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    kernels = type("kernels", (), {"fa3_bwd_kernel": object()})
    monkeypatch.setattr(fa3, "_kernels", lambda index: (None, kernels, _FakeDescriptor))
    monkeypatch.setattr(fa3, "_device_index", lambda t: 0)
    launches = []
    monkeypatch.setattr(fa3.relaunch, "launch", lambda *launch_args: launches.append(launch_args))
    q, k, v = _qkv(b=2, sq=1024, sk=1024, h=4, hk=2, d=d)
    lse = torch.randn(2, 4, 1024)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    params = CAUSAL if causal else FULL
    block_m, block_n, stages = fa3.BWD_CONFIGS[d]
    for turns in (True, False):
        monkeypatch.setitem(fa3.BWD_PINGPONG, (d, causal), turns)
        launches.clear()
        fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse), *grads, params)
        (kernel, grid, args, kw), = launches
        assert kernel is kernels.fa3_bwd_kernel and grid == (1024 // block_n, 2 * 2)
        tile = kw["TILE"]
        assert (tile.BLOCK_M, tile.BLOCK_N, tile.STAGES, kw["CAUSAL"]) == (block_m, block_n, stages, causal)
        assert tile.PINGPONG is turns
        dk_out, dv_out = args[7], args[8]
        assert isinstance(dk_out, _FakeDescriptor) and dk_out.block_shape == [block_n // 2, d]
        assert dk_out.base.data_ptr() == grads[1].data_ptr() and dv_out.base.data_ptr() == grads[2].data_ptr()


@pytest.mark.parametrize("d", sorted(fa3.BWD_CONFIGS))
def test_split_bwd_launch_adds_into_float32_accumulators(d, monkeypatch):
    """A split GQA backward (fa3.bwd_split) launches SPLIT programs per (batch, kv head), each told its number of
    query heads (group / SPLIT), with dK / dV descriptors over float32 accumulators, zeroed, which are copied into
    the caller's dk, dv after the launch (here the launch writes nothing: the poisoned dk, dv come back as the
    accumulators' zeros)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    kernels = type("kernels", (), {"fa3_bwd_kernel": object()})
    monkeypatch.setattr(fa3, "_kernels", lambda index: (None, kernels, _FakeDescriptor))
    monkeypatch.setattr(fa3, "_device_index", lambda t: 0)
    monkeypatch.setattr(fa3, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fa3, "GQA_SPLIT_MIN_WORK", 0)
    launches = []
    monkeypatch.setattr(fa3.relaunch, "launch", lambda *launch_args: launches.append(launch_args))
    q, k, v = _qkv(b=2, sq=1024, sk=1024, h=4, hk=2, d=d)
    lse = torch.randn(2, 4, 1024)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse), dq, dk, dv, CAUSAL)
    (kernel, grid, args, kw), = launches
    block_n = fa3.BWD_CONFIGS[d][1]
    assert kw["SPLIT"] == 2 and grid == (1024 // block_n, 2 * 2 * 2)
    assert args[10] == (1024, 1024, 2, 1)   # sizes: seqlen_q, seqlen_k, nheads_k, query heads per program
    dk_acc, dv_acc = args[7].base, args[8].base
    assert dk_acc.dtype == torch.float32 and dk_acc.numel() == k.numel() and dk_acc.data_ptr() != dk.data_ptr()
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def _recorded_bwd_launches(monkeypatch):
    """fa3.bwd's launches recorded, not run: stand-in kernels (fa3_bwd_kernel, fa3_bwd_any_kernel) and descriptors,
    no launch templates. Returns (the kernels, the list of (kernel, grid, args, kwargs))."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    kernels = type("kernels", (), {"fa3_bwd_kernel": object(), "fa3_bwd_any_kernel": object()})
    monkeypatch.setattr(fa3, "_kernels", lambda index: (None, kernels, _FakeDescriptor))
    monkeypatch.setattr(fa3, "_device_index", lambda t: 0)
    monkeypatch.setattr(fa3, "_BWD_TEMPLATES", {})
    launches = []
    monkeypatch.setattr(fa3.relaunch, "launch", lambda *launch_args: launches.append(launch_args))
    return kernels, launches


@pytest.mark.parametrize("d", sorted(fa3.BWD_CONFIGS))
def test_general_bwd_launch_takes_its_own_tiles(d, monkeypatch):
    """fa3_bwd_any_kernel launches a problem with a mask rule, softcap or ALiBi with BWD_ANY_CONFIGS' tiles where
    the table has the head dim (at d64 Br = 64, whose tiles leave those terms room in registers), one with sequence
    ends only (lengths its tiles do not divide) and the dense kernel with BWD_CONFIGS'; the dQ tile and the
    descriptors of Q / dO follow Br. BackwardPlan asks the same rule."""
    kernels, launches = _recorded_bwd_launches(monkeypatch)
    window = AttnParams(softmax_scale=0.1, window_left=100, window_right=0)
    for params, sq, kernel, table in ((window, 1000, kernels.fa3_bwd_any_kernel, fa3.BWD_ANY_CONFIGS),
                                      (FULL, 1000, kernels.fa3_bwd_any_kernel, {}),
                                      (CAUSAL, 1024, kernels.fa3_bwd_kernel, {})):
        q, k, v = _qkv(b=2, sq=sq, sk=sq, h=4, hk=2, d=d)
        lse = torch.randn(2, 4, sq)
        launches.clear()
        fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse), *[torch.empty_like(t) for t in (q, k, v)],
                params)
        (launched, grid, args, kw), = launches
        block_m, block_n, stages = table.get(d, fa3.BWD_CONFIGS[d])
        tile = kw["TILE"]
        assert launched is kernel and (tile.BLOCK_M, tile.BLOCK_N, tile.STAGES) == (block_m, block_n, stages)
        assert tile.PINGPONG is fa3.BWD_PINGPONG.get((d, params.has_right), False)
        assert args[2].block_shape == [block_m, d] and args[3].block_shape == [block_m, d]   # Q_i, dO_i
        assert args[4].block_shape == list(fa3.bwd_dq_tile(block_m, d))
        plan = fa3.BackwardPlan(q, k, v, lse, k, v, params)
        assert plan.cfg == ((block_m, block_n, stages), tile.PINGPONG) and plan.grid == (-(-sq // block_n), 4, 1)
        # float32 dK / dV (a ring step's partial sums): staged in the Q_i / dO_i buffers, BWD_CONFIGS' tiles
        launches.clear()
        fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse), torch.empty_like(q),
                torch.empty(k.shape), torch.empty(v.shape), params)
        (_, _, _, kw), = launches
        assert (kw["TILE"].BLOCK_M, kw["TILE"].BLOCK_N, kw["TILE"].STAGES) == fa3.BWD_CONFIGS[d]
        assert fa3.BackwardPlan(q, k, v, lse, torch.empty(k.shape), v, params).cfg[0] == fa3.BWD_CONFIGS[d]


def test_dense_backward_takes_a_programs_query_heads_as_a_constant(monkeypatch):
    """The dense backward's GQA / MQA programs get their query heads (group / SPLIT) as the constexpr HEADS at the
    head dims of fa3.BWD_GQA_HEADS; MHA, and a split that leaves one head per program, take 0 (the division)."""
    kernels, launches = _recorded_bwd_launches(monkeypatch)
    for d in sorted(fa3.BWD_CONFIGS):
        for h, hk, split, heads in ((8, 8, 0, 0), (8, 2, 0, 4), (8, 1, 0, 8), (8, 2, 2, 2), (8, 2, 4, 0)):
            monkeypatch.setattr(fa3, "GQA_SPLIT", split)   # (a fixed split, from any amount of work)
            monkeypatch.setattr(fa3, "GQA_SPLIT_MIN_WORK", 0 if split else 1 << 62)
            q, k, v = _qkv(b=1, sq=1024, sk=1024, h=h, hk=hk, d=d)
            lse = torch.randn(1, h, 1024)
            launches.clear()
            fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse),
                    *[torch.empty_like(t) for t in (q, k, v)], CAUSAL)
            (launched, grid, _, kw), = launches
            assert launched is kernels.fa3_bwd_kernel and kw["SPLIT"] == max(split, 1), (d, h, hk, split)
            assert kw["HEADS"] == (heads if d in fa3.BWD_GQA_HEADS else 0), (d, h, hk, split)


def test_general_backward_takes_the_group_as_a_constant_where_the_table_says(monkeypatch):
    """fa3_bwd_any_kernel's GQA / MQA programs get their group as the constexpr HEADS at the head dims of
    fa3.BWD_ANY_GQA_HEADS (unaligned lengths here: the general kernel); MHA takes 0 (the division)."""
    kernels, launches = _recorded_bwd_launches(monkeypatch)
    for d in sorted(fa3.BWD_CONFIGS):
        for h, hk in ((8, 8), (8, 2), (8, 1)):
            q, k, v = _qkv(b=1, sq=1000, sk=1000, h=h, hk=hk, d=d)
            lse = torch.randn(1, h, 1000)
            launches.clear()
            fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse),
                    *[torch.empty_like(t) for t in (q, k, v)], CAUSAL)
            (launched, _, _, kw), = launches
            assert launched is kernels.fa3_bwd_any_kernel, (d, h, hk)
            assert kw["HEADS"] == (h // hk if d in fa3.BWD_ANY_GQA_HEADS and hk < h else 0), (d, h, hk)


def test_general_backward_masks_every_step_where_the_table_says(monkeypatch):
    """fa3_bwd_any_kernel masks P on every step (MASK_EVERY_STEP) for softcap, ALiBi or flex features with a mask
    rule or sequence ends, at the head dims of fa3.BWD_MASK_EVERY_STEP; without those features, or without anything
    to mask, it keeps the branch."""
    kernels, launches = _recorded_bwd_launches(monkeypatch)
    softcap_causal = AttnParams(softmax_scale=0.1, window_right=0, softcap=30.0)
    softcap_full = AttnParams(softmax_scale=0.1, softcap=30.0)
    window = AttnParams(softmax_scale=0.1, window_left=100, window_right=0)
    for d in sorted(fa3.BWD_CONFIGS):
        for params, alibi, sq, every in ((softcap_causal, None, 1024, True), (CAUSAL, torch.rand(4), 1024, True),
                                         (softcap_full, None, 1000, True), (FULL, torch.rand(4), 1024, False),
                                         (softcap_full, None, 1024, False), (window, None, 1024, False),
                                         (FULL, None, 1000, False)):
            q, k, v = _qkv(b=1, sq=sq, sk=sq, h=4, hk=4, d=d)
            lse = torch.randn(1, 4, sq)
            launches.clear()
            fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse),
                    *[torch.empty_like(t) for t in (q, k, v)], params, alibi=alibi)
            (launched, _, _, kw), = launches
            assert launched is kernels.fa3_bwd_any_kernel, (d, params, sq)
            assert kw["FEATURES"].MASK_EVERY_STEP is (every and d in fa3.BWD_MASK_EVERY_STEP), (d, params, sq)


def test_varlen_backward_with_one_cu_seqlens(monkeypatch):
    """A varlen backward whose queries and keys share one cu_seqlens tensor (the same object or a view of its memory)
    compiles SAME_SEQS in at the head dims of fa3.BWD_SAME_SEQS (one row offset and length per sequence); an equal
    copy, other lengths or a dense problem do not, and the launch templates and BackwardPlan's keys tell them apart
    (a template made for one cu_seqlens would read only the keys' lengths)."""
    kernels, launches = _recorded_bwd_launches(monkeypatch)
    cu = torch.tensor([0, 300, 1024, 2048], dtype=torch.int32)
    assert fa3.one_cu_seqlens(cu, cu) and fa3.one_cu_seqlens(cu, cu[:]) and not fa3.one_cu_seqlens(cu, cu.clone())
    assert not fa3.one_cu_seqlens(cu, cu[:3]) and not fa3.one_cu_seqlens(None, None)
    for d in sorted(fa3.BWD_CONFIGS):
        q, k, v = (t[0] for t in _qkv(b=1, sq=2048, sk=2048, h=4, hk=2, d=d))
        lse = torch.randn(4, 2048)
        for cu_k, same in ((cu, True), (cu[:], True), (cu.clone(), False)):
            launches.clear()
            fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse),
                    *[torch.empty_like(t) for t in (q, k, v)], CAUSAL, None, None, cu, cu_k, 1024, 1024)
            (launched, _, _, kw), = launches
            assert launched is kernels.fa3_bwd_any_kernel
            assert kw["FEATURES"].SAME_SEQS is (same and d in fa3.BWD_SAME_SEQS), (d, same)
        plan = fa3.BackwardPlan(q, k, v, lse, k, v, CAUSAL, None, cu, 1024, 1024)
        assert plan.keys[0] != plan.keys[1] and plan.tpls == [None, None]
    q, k, v = _qkv(b=2, sq=1000, sk=1000, h=4, hk=2, d=128)   # dense, lengths the tiles do not divide
    launches.clear()
    fa3.bwd(torch.randn_like(q), q, k, v, torch.randn(2, 4, 1000), torch.randn(2, 4, 1000),
            *[torch.empty_like(t) for t in (q, k, v)], CAUSAL)
    assert launches[0][3]["FEATURES"].SAME_SEQS is False


@pytest.mark.parametrize("causal", [False, True])
def test_launch_templates_pass_what_the_slow_path_passes(causal, monkeypatch):
    """A repeated forward / backward of one problem launches through its template (relaunch.Bound; the descriptors
    rebuilt from the first call's fields) with exactly the arguments relaunch.launch passes (compared against a
    call with templates off); a changed config table (other launch options) goes the slow way again. The kernels
    are stand-ins: launches are recorded, not run."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from launch_utils import StandInKernel, fast_launches, same_arguments
    from flashtile.kernels.gluon import _fa3_bwd, _fa3_fwd
    fwd_kern, bwd_kern = StandInKernel(_fa3_fwd.fa3_fwd_kernel), StandInKernel(_fa3_bwd.fa3_bwd_kernel)
    kernels = type("kernels", (), {"fa3_fwd_kernel": fwd_kern, "fa3_bwd_kernel": bwd_kern})
    monkeypatch.setattr(fa3, "_kernels", lambda index: (kernels, kernels, _FakeDescriptor))
    monkeypatch.setattr(fa3, "_device_index", lambda t: 0)
    monkeypatch.setattr(fa3, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fa3, "_FWD_TEMPLATES", {})
    monkeypatch.setattr(fa3, "_BWD_TEMPLATES", {})
    launches = fast_launches(monkeypatch)
    params = CAUSAL if causal else FULL
    q, k, v = _qkv(b=2, sq=1024, sk=1024, h=4, hk=2, d=128)
    out, lse, dout, delta = torch.empty_like(q), torch.empty(2, 4, 1024), torch.randn_like(q), torch.randn(2, 4, 1024)
    grads = [torch.empty_like(t) for t in (q, k, v)]

    def fwd(*qkv):
        fa3.fwd(*qkv, out, lse, params)
        return fwd_kern.calls[-1]

    def bwd(*qkv):
        fa3.bwd(dout, *qkv, lse, delta, *grads, params)
        return bwd_kern.calls[-1]

    for call, templates in ((fwd, "_FWD_TEMPLATES"), (bwd, "_BWD_TEMPLATES")):
        assert call(*_qkv(b=2, sq=1024, sk=1024, h=4, hk=2, d=128))[0] == "dispatch"
        assert len(getattr(fa3, templates)) == 1
        n = len(launches)
        templated = call(q, k, v)
        assert templated[0] == "run" and len(launches) == n   # (through the template, not relaunch.launch)
        monkeypatch.setattr(fa3, templates, {})
        with monkeypatch.context() as m:
            m.setattr(fa3.relaunch, "bind", lambda *a: None)   # templates off: relaunch.launch's direct call
            reference = call(q, k, v)
        assert reference[0] == "run" and not getattr(fa3, templates)
        assert templated[1] == reference[1]
        same_arguments(templated[2], reference[2], shared=(q, k, v, out, lse, dout, delta, *grads))
    with monkeypatch.context() as m:   # another table entry: other launch options, not the template's
        m.setitem(fa3.BWD_PINGPONG, (128, causal), not fa3.BWD_PINGPONG.get((128, causal), False))
        assert bwd(q, k, v)[0] == "dispatch"
    assert bwd(q, k, v)[0] == "run"


def test_tma_viewable_layouts():
    """Which dk / dv the backward's TMA stores write directly (else through a contiguous copy)."""
    viewable = lambda t: launch.tma_row_view(t) is not None   # noqa: E731
    g = torch.empty(2, 64, 4, 128, dtype=torch.bfloat16)
    assert viewable(g)
    assert viewable(torch.empty(2, 64, 3, 4, 128, dtype=torch.bfloat16)[:, :, 1])   # packed (q, k, v)
    assert not viewable(torch.empty(2, 4, 64, 128, dtype=torch.bfloat16).transpose(1, 2))
    assert not viewable(torch.empty(2 * 64 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 4, 128))


def test_launch_template_keys_hold_the_layout():
    """The Gluon launch templates bind their descriptors' geometry, so tensors of one shape in two layouts (contiguous,
    slices of a packed qkv) key two templates, forward and backward, and the plans keep the strides they were made
    with (tests/gpu/test_call_path_gpu.py runs the layouts through the kernels)."""
    bf16 = torch.bfloat16
    contiguous = [torch.empty(2, 256, 4, 128, dtype=bf16) for _ in range(3)]
    packed = list(torch.empty(2, 256, 3, 4, 128, dtype=bf16).unbind(2))
    lse = torch.empty(2, 4, 256)
    dk, dv = torch.empty(2, 256, 4, 128, dtype=bf16), torch.empty(2, 256, 4, 128, dtype=bf16)
    params = AttnParams(softmax_scale=0.1, window_right=0)
    out = torch.empty(2, 256, 4, 128, dtype=bf16)
    assert (fa3._fwd_key(*contiguous, out, lse, params, None, 256, 256)
            != fa3._fwd_key(*packed, out, lse, params, None, 256, 256))
    assert (fa3._bwd_key(*contiguous, lse, dk, dv, params, None, 256, 256, 64)
            != fa3._bwd_key(*packed, lse, dk, dv, params, None, 256, 256, 64))
    assert fa3._bwd_key(*packed, lse, dk, dv, params, None, 256, 256, 64) == fa3._bwd_key(
        *torch.empty(2, 256, 3, 4, 128, dtype=bf16).unbind(2), lse, dk, dv, params, None, 256, 256, 64)
    plan = fa3.BackwardPlan(*packed, lse, dk, dv, params)
    assert plan.layout == fa3.layout(*packed) != fa3.layout(*contiguous)
    assert plan.takes(*torch.empty(2, 256, 3, 4, 128, dtype=bf16).unbind(2)) and not plan.takes(*contiguous)


def test_row_descriptor_reuses_a_checked_geometry():
    """launch.row_descriptor: a second tensor of a geometry seen before gets the first's checked fields with its own
    base; a misaligned base of that geometry is checked again (None), and a non-view is None. Gluon's class (with
    its layout) and triton.tools' alike."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    for cls, layout in ((launch.TensorDescriptor, None), (GluonDescriptor, fa3._smem_layout(64, 128, torch.bfloat16))):
        a, b = (torch.randn(2, 64, 4, 128, dtype=torch.bfloat16) for _ in range(2))
        da = launch.row_descriptor(cls, a, (64, 128), layout)
        db = launch.row_descriptor(cls, b, (64, 128), layout)
        assert type(db) is cls and db.base is b and da.base.data_ptr() == a.data_ptr()
        for d in (da, db):
            assert (list(d.shape), list(d.strides), list(d.block_shape)) == ([128, 512], [512, 1], [64, 128])
        assert {n: v for n, v in vars(da).items() if n != "base"} == {n: v for n, v in vars(db).items() if n != "base"}
        buf = torch.empty(2 * 64 * 4 * 128 + 1, dtype=torch.bfloat16)
        assert launch.row_descriptor(cls, buf[1:].view(2, 64, 4, 128), (64, 128), layout) is None
        transposed = torch.empty(2, 4, 64, 128, dtype=torch.bfloat16).transpose(1, 2)
        assert launch.row_descriptor(cls, transposed, (64, 128), layout) is None
        packed = torch.empty(2, 64, 3, 4, 128, dtype=torch.bfloat16)[:, :, 1]   # rows 3 * 512 apart
        assert list(launch.row_descriptor(cls, packed, (64, 128), layout).strides) == [3 * 512, 1]


def test_forward_config_by_length():
    """fa3.fwd_config: each SHORT_CONFIGS entry from just past the previous entry's length up to its own
    (inclusive), CONFIGS and PINGPONG beyond the last, and for head dims / masks without a short entry."""
    for (d, causal), entries in fa3.SHORT_CONFIGS.items():
        assert list(entries) == sorted(entries, key=lambda e: e[0])
        prev = 0
        for longest, cfg in entries:
            assert fa3.fwd_config(d, longest, causal) == cfg and fa3.fwd_config(d, prev + 64, causal) == cfg
            prev = longest
        assert fa3.fwd_config(d, prev + 64, causal) == (*fa3.CONFIGS[d], fa3.PINGPONG[d][causal])
    assert fa3.fwd_config(64, 512, True)[1] == 64 and fa3.fwd_config(64, 576, True)[1] == 128
    assert (128, False) not in fa3.SHORT_CONFIGS
    assert fa3.fwd_config(128, 512, False) == (*fa3.CONFIGS[128], fa3.PINGPONG[128][False])


def test_disabled_context_nests():
    assert fa3.enabled()
    with fa3.disabled():
        with fa3.disabled():
            assert not fa3.enabled()
        assert not fa3.enabled()
    assert fa3.enabled()


def test_gqa_backward_split_rule(monkeypatch):
    """fa3.bwd_split: a group's query heads are split over programs where batch x KV heads x key blocks is under
    GQA_SPLIT_PROGRAMS_PER_SM per SM, by the least divisor of the group that reaches it (else the whole group);
    not for MHA, the general kernel, float32 partial sums or little work."""
    monkeypatch.setattr(fa3, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fa3, "_device_index", lambda t: 0)

    def split(b, s, h, hk, d, causal=True, dense=True, grads_f32=False):
        q, k = (torch.empty(b, s, n, d, device="meta") for n in (h, hk))
        params = AttnParams(softmax_scale=0.1, window_right=0 if causal else -1)
        return fa3.bwd_split(q, k, params, dense, grads_f32, s, s, fa3.BWD_CONFIGS[d][1])

    target = fa3.GQA_SPLIT_PROGRAMS_PER_SM * 132
    assert split(2, 4096, 16, 1, 128) == 16                       # MQA: 64 programs, the whole group
    assert split(2, 4096, 16, 1, 128, causal=False) == 16
    programs = 8 * 8192 // fa3.BWD_CONFIGS[128][1]             # b1 8k, 8 KV heads
    assert split(1, 8192, 32, 8, 128) == next(s for s in (1, 2, 4) if programs * s >= target or s == 4)
    assert split(4, 8192, 32, 8, 64) == (1 if 4 * programs >= target else 2)
    assert split(1, 2048, 32, 8, 64) == 1                          # under GQA_SPLIT_MIN_WORK
    assert split(2, 4096, 16, 16, 128) == 1                        # MHA
    assert split(2, 4096, 16, 1, 128, dense=False) == 1            # the general kernel
    assert split(2, 4096, 16, 1, 128, grads_f32=True) == 1         # a ring step's float32 sums
    monkeypatch.setattr(fa3, "GQA_SPLIT", 2)
    assert split(2, 4096, 16, 1, 128) == 2 and split(1, 8192, 32, 8, 128) == 2

"""The two backward strategies (dQ by a second pass, dQ by fp32 atomics) compute the same gradients, and the
second pass is bitwise reproducible."""
import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile.kernels.triton import configs, launch
from flashtile.kernels.triton.mods import tile_order
from attn_utils import DEVICE, sums_case
from flashtile.reference.dense import attention_ref


@pytest.mark.parametrize("causal", [False, True])
def test_atomic_dq_matches_two_pass_and_reference(seed, causal):
    b, sq, sk, h, hk, d = 2, 45, 70, 4, 2, 32
    q = torch.randn(b, sq, h, d, requires_grad=True)
    k = torch.randn(b, sk, hk, d, requires_grad=True)
    v = torch.randn(b, sk, hk, d, requires_grad=True)
    do = torch.randn(b, sq, h, d)
    grads = {}
    for atomic in (False, True):
        configs.CONFIG_OVERRIDE["bwd"] = configs.Config(16, 32, 4, 1, atomic_dq=atomic)
        try:
            for x in (q, k, v):
                x.grad = None
            flashtile.flash_attn_func(q, k, v, causal=causal).backward(do)
            grads[atomic] = [x.grad.clone() for x in (q, k, v)]
        finally:
            configs.CONFIG_OVERRIDE.clear()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    attention_ref(*ref, causal=causal)[0].backward(do.double())
    for g2, ga, r in zip(grads[False], grads[True], ref):
        assert (g2.double() - r.grad).abs().max() < 1e-5
        assert (ga.double() - r.grad).abs().max() < 1e-5


def _grads(cfg, run, leaves, do):
    configs.CONFIG_OVERRIDE["bwd"] = cfg
    try:
        for x in leaves:
            x.grad = None
        run().backward(do)
        return [x.grad.clone() for x in leaves]
    finally:
        configs.CONFIG_OVERRIDE.clear()


@pytest.mark.parametrize("case", ["causal+bias", "dropout+gqa", "block-sparse"])
def test_split_dkdv_and_dq_tiles_give_the_single_launch_gradients(seed, case, monkeypatch):
    """Config(split_dkdv=True) (dV and dK by two launches) is bitwise the single launch, dBias and dropout
    included; Config(dq=...) (the dQ pass's own tiles) keeps dK, dV bitwise and dQ to rounding, Config(dv=...) (the
    dV launch's own key tiles) dQ, dK bitwise and dV to rounding, and they match
    float64 with a block mask too (tiles clamped to its block size)."""
    b, s, h, hk, d = 1, 64, 4, 2, 32
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hk, d, requires_grad=True)
    v = torch.randn(b, s, hk, d, requires_grad=True)
    do = torch.randn(b, s, h, d)
    leaves = [q, k, v]
    if case == "causal+bias":
        bias = torch.randn(1, h, s, s, requires_grad=True)
        leaves.append(bias)
        run = lambda: flashtile.flash_attn_func(q, k, v, causal=True, attn_bias=bias)  # noqa: E731
    elif case == "dropout+gqa":
        def run():
            torch.manual_seed(7)   # the same dropout mask for every config
            return flashtile.flash_attn_func(q, k, v, dropout_p=0.25)
    else:
        from flashtile.blocksparse import blocksparse_attn_func, create_block_mask
        bm = create_block_mask(lambda b_, h_, qi, ki: (qi // 16) >= (ki // 16), None, None, s, s, BLOCK_SIZE=32,
                               device="cpu")
        run = lambda: blocksparse_attn_func(q, k, v, bm)  # noqa: E731
    base = _grads(configs.Config(16, 32, 4, 1), run, leaves, do)
    split = _grads(configs.Config(16, 32, 4, 1, split_dkdv=True), run, leaves, do)
    for g0, g1 in zip(base, split):
        assert torch.equal(g0, g1)
    dq_tiles = _grads(configs.Config(16, 32, 4, 1, split_dkdv=True, dq=(64, 16, 4, 1)), run, leaves, do)
    # dQ: 64 query rows, the same 16-key blocks -> the same sums; bitwise on a GPU, to rounding under the
    # interpreter, whose tl.dot is a BLAS matmul that may order a product's sum by the tile's row count
    assert all(torch.equal(g0, g1) for g0, g1 in zip(base[1:], dq_tiles[1:]))
    assert (dq_tiles[0] - base[0]).abs().max() < 1e-5 and not torch.equal(dq_tiles[0], torch.zeros_like(base[0]))
    # the dV launch on its own key tiles (64 rows; 32 under the block mask: clamped): dQ, dK (and dBias) bitwise,
    # dV to rounding (a key row's sums see the same query blocks, plus exact zeros from blocks it cannot see)
    dkdv_tiles = []   # (BLOCK_N, COMPUTE_DV) of each dK/dV launch
    real_launch = launch.relaunch.launch

    def recording(kernel, grid, args, kwargs):
        if kernel is launch._bwd.attn_bwd_dkdv_kernel:
            dkdv_tiles.append((kwargs["BLOCK_N"], kwargs.get("COMPUTE_DV", True)))
        return real_launch(kernel, grid, args, kwargs)
    monkeypatch.setattr(launch.relaunch, "launch", recording)
    dv_tiles = _grads(configs.Config(16, 32, 4, 1, split_dkdv=True, dv=(64, 4, 1)), run, leaves, do)
    assert dkdv_tiles == [(32 if case == "block-sparse" else 64, True), (32, False)]
    assert all(torch.equal(g0, g1) for i, (g0, g1) in enumerate(zip(base, dv_tiles)) if i != 2)
    assert (dv_tiles[2] - base[2]).abs().max() < 1e-5 and not torch.equal(dv_tiles[2], torch.zeros_like(base[2]))
    dq_keys = _grads(configs.Config(16, 32, 4, 1, dq=(16, 32, 4, 1)), run, leaves, do)
    assert all(torch.equal(g0, g1) for g0, g1 in zip(base[1:], dq_keys[1:]))
    assert (dq_keys[0] - base[0]).abs().max() < 1e-5   # dQ summed over 32-key blocks: rounding only
    assert not torch.equal(dq_keys[0], torch.zeros_like(dq_keys[0]))


def test_launch_retries_with_fewer_stages_when_shared_memory_runs_out():
    """launch._launch: a config whose tiles do not fit in shared memory (OutOfResources at compile time) is
    retried with one pipeline stage fewer, down to 1, then the error propagates; it returns the launch options it
    launched with (what a launch template binds) and relaunch.launch's key (None here: no compiled kernel)."""
    import triton

    calls = []

    class FakeKernel:
        def __init__(self, fits_at):
            self.fits_at = fits_at

        def __getitem__(self, grid):
            def launch_(*args, num_stages, **kwargs):
                calls.append(num_stages)
                if num_stages > self.fits_at:
                    raise triton.runtime.errors.OutOfResources(263168, 232448, "shared memory")
                return "ran"
            return launch_

    kw, key = launch._launch(FakeKernel(fits_at=2), (1,), 0, num_stages=4, num_warps=4)
    assert (kw, key) == (dict(num_stages=2, num_warps=4), None)
    assert calls == [4, 3, 2]
    calls.clear()
    with pytest.raises(triton.runtime.errors.OutOfResources):
        launch._launch(FakeKernel(fits_at=0), (1,), num_stages=2)
    assert calls == [2, 1]


@pytest.mark.parametrize("path", ["flash_attn_func", "flex score_mod", "varlen"])
def test_gradient_through_the_lse_output(seed, path):
    """softmax_lse is differentiable: d lse_i / d S_ij = P_ij, folded into D (dS = P o (dP - (D - dlse))).
    A loss using both out and lse matches float64 autograd; an lse the loss ignores changes nothing."""
    from flashtile.flex import flex_attention, softcap_score
    from flashtile.varlen import flash_attn_varlen_func
    b, s, h, hk, d = 2, 40, 4, 2, 32
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hk, d, requires_grad=True)
    v = torch.randn(b, s, hk, d, requires_grad=True)
    do = torch.randn(b, s, h, d)
    w = torch.randn(b, h, s)
    if path == "flash_attn_func":
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    elif path == "flex score_mod":
        out, lse = flex_attention(q, k, v, score_mod=softcap_score(3.0), causal=True, return_lse=True)
    else:
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
        out, lse, _ = flash_attn_varlen_func(q.reshape(b * s, h, d), k.reshape(b * s, hk, d), v.reshape(b * s, hk, d),
                                             cu, cu, s, s, causal=True, return_attn_probs=True)
        out = out.reshape(b, s, h, d)
        lse = lse.reshape(h, b, s).transpose(0, 1)            # (nheads, total) -> (batch, nheads, seqlen)
    grads = torch.autograd.grad((out * do).sum() + (lse * w).sum(), (q, k, v))
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    kw = dict(causal=True, softcap=3.0) if path == "flex score_mod" else dict(causal=True)
    r_out, r_lse, _ = attention_ref(*ref, **kw)
    ref_grads = torch.autograd.grad((r_out * do.double()).sum() + (r_lse * w.double()).sum(), ref, retain_graph=True)
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < 1e-4 * max(1.0, r.abs().max().item())
    # the lse gradient is really used: without the lse term the gradients differ
    plain = torch.autograd.grad((r_out * do.double()).sum(), ref)
    assert (plain[0] - ref_grads[0]).abs().max() > 1e-2


def test_gradient_of_an_lse_only_loss(seed):
    """A loss that uses only softmax_lse: the output's gradient arrives as None (not a zero tensor) and the
    backward stands a zero dO in for it; dv is then exactly 0 (out does not reach the loss)."""
    b, s, h, hk, d = 2, 33, 4, 2, 32
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hk, d, requires_grad=True)
    v = torch.randn(b, s, hk, d, requires_grad=True)
    w = torch.randn(b, h, s)
    _, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad((lse * w).sum(), (q, k, v))
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    _, r_lse, _ = attention_ref(*ref, causal=True)
    rq, rk = torch.autograd.grad((r_lse * w.double()).sum(), ref[:2])
    for g, r in ((dq, rq), (dk, rk)):
        assert (g.double() - r).abs().max() < 1e-4 * max(1.0, r.abs().max().item())
    assert torch.equal(dv, torch.zeros_like(dv))


@triton.jit
def _order_kernel(OUT, head_group, GROUPED: tl.constexpr, REVERSE: tl.constexpr):
    """OUT[launch index] = (block, batch x head) that mods.tile_order gives the program."""
    blk, bh = tile_order(head_group, GROUPED, REVERSE)
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    tl.store(OUT + 2 * pid + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, blk, bh))


@pytest.mark.parametrize("n_blocks,n_bh,group,reverse", [(5, 6, 4, False), (3, 7, 7, True), (4, 5, 1, True),
                                                         (2, 9, 20, False)])
def test_tile_order_visits_every_program_once_group_by_group(n_blocks, n_bh, group, reverse):
    """mods.tile_order is a permutation of the grid: heads in groups of `group` (the last one smaller), each
    group block by block (descending with reverse); group 1 without reverse is the grid's own order."""
    def order(grouped):
        out = torch.full((n_blocks * n_bh, 2), -1, dtype=torch.int32)
        _order_kernel[(n_blocks, n_bh)](out, group, GROUPED=grouped, REVERSE=reverse)
        return [tuple(r) for r in out.tolist()]

    expect = []
    for g0 in range(0, n_bh, group):
        heads = range(g0, min(g0 + group, n_bh))
        blocks = range(n_blocks - 1, -1, -1) if reverse else range(n_blocks)
        expect += [(blk, bh) for blk in blocks for bh in heads]
    assert order(True) == expect
    if group == 1:  # the ungrouped switch compiles the grid's own order
        assert order(False) == expect


@pytest.mark.parametrize("schedule", [dict(fwd=0, dkdv=0, dq=0, dq_reverse=False),
                                      dict(fwd=12, dkdv=12, dq=12, dq_reverse=True)])
def test_causal_launch_orders_give_the_same_result(seed, schedule):
    """The head-grouped launch orders under a causal mask (configs.CAUSAL_SCHEDULE; here groups that do not
    divide batch x heads) only reorder programs: output and gradients match float64. With the interpreter's
    32-row tiles every kernel has 3 blocks of 70 rows: 12 programs a group is 4 of the 6 (batch, head) pairs."""
    b, s, h, hk, d = 2, 70, 3, 3, 32
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hk, d, requires_grad=True)
    v = torch.randn(b, s, hk, d, requires_grad=True)
    do = torch.randn(b, s, h, d)
    configs.SCHEDULE_OVERRIDE.update(schedule)
    try:
        o = flashtile.flash_attn_func(q, k, v, causal=True)
        grads = torch.autograd.grad(o, (q, k, v), do)
    finally:
        configs.SCHEDULE_OVERRIDE.clear()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref = attention_ref(*ref, causal=True)[0]
    g_ref = torch.autograd.grad(o_ref, ref, do.double())
    assert (o.double() - o_ref).abs().max() < 1e-5
    for g, r in zip(grads, g_ref):
        assert (g.double() - r).abs().max() < 1e-5


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("atomic", [False, True])
def test_triton_templates_launch_what_the_slow_path_does(varlen, atomic, monkeypatch):
    """With a memo (the caller's per-problem dict) flash_fwd / flash_bwd keep templates after their first launches;
    later calls launch through them (no relaunch.launch) with exactly the arguments of the full path, D and the dQ
    accumulator made per call; a dout of other strides goes the full way; dropout is not templated. The compiled
    kernels are stand-ins (no GPU: launches recorded, not run)."""
    from launch_utils import StandInKernel, fast_launches, same_arguments
    from flashtile.kernels.triton import bwd as _bwd, fwd as _fwd
    kernels = {name: StandInKernel(getattr(mod, name)) for mod, name in (
        (_fwd, "attn_fwd_kernel"), (_bwd, "attn_bwd_preprocess_kernel"), (_bwd, "attn_bwd_dkdv_kernel"),
        (_bwd, "attn_bwd_dq_kernel"))}
    for name, kern in kernels.items():
        monkeypatch.setattr(_fwd if name == "attn_fwd_kernel" else _bwd, name, kern)
    monkeypatch.setattr(configs, "CONFIG_OVERRIDE", {"bwd": configs.Config(16, 32, 4, 1, atomic_dq=atomic)})
    launches = fast_launches(monkeypatch)
    g = torch.Generator().manual_seed(0)
    if varlen:
        q, k, v = (torch.randn(40, 4, 32, generator=g).to(DEVICE) for _ in range(3))
        cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE)
        lens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=23, max_seqlen_k=23)
        lse = torch.empty(4, 40, device=DEVICE)
    else:
        q, k, v = (torch.randn(2, 20, 4, 32, generator=g).to(DEVICE) for _ in range(3))
        lens = {}
        lse = torch.empty(2, 4, 20, device=DEVICE)
    out, dout = torch.empty_like(q), torch.randn_like(q)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    params = launch.AttnParams(0.3, -1, 0)

    def calls(name):
        return kernels[name].calls

    def step(memo, dout=dout):
        launch.flash_fwd(q, k, v, out, lse, params, **lens, memo=memo)
        launch.flash_bwd(dout, q, k, v, out, lse, *grads, params, **lens, memo=memo)

    memo = {}
    step(memo)
    assert set(memo) == {"triton_fwd", "triton_bwd"}
    n = len(launches)
    step(memo)
    assert len(launches) == n   # every launch through a template
    templated = {name: k.calls[-1] for name, k in kernels.items() if k.calls}
    assert ("attn_bwd_dq_kernel" in templated) is not atomic   # (atomic dQ: added inside the dK / dV launch)
    step(None)                  # the full path, for reference
    assert len(launches) > n
    for name, t in templated.items():
        ref = calls(name)[-1]
        assert t[0] == "run" and ref[0] == "run" and t[1] == ref[1], name
        # (D, the dQ accumulator and the outputs are made per call: same geometry, other tensors)
        same_arguments(t[2], ref[2], shared=(q, k, v, out, lse, dout, *grads, *lens.values()))
    n = len(launches)
    step(memo, dout=torch.randn(dout.shape[:-1] + (64,), device=DEVICE)[..., ::2])   # other strides: full path
    assert len(launches) > n
    memo = {}
    launch.flash_fwd(q, k, v, out, lse, launch.AttnParams(0.3, dropout_p=0.1, seed=1), **lens, memo=memo)
    assert not memo


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_gradients_added_into_float32_sums(seed, varlen, with_delta, fresh):
    """backward(..., sums=GradSums(dq, dk, dv[, delta])) (the ring's steps): the sums gain dQ, dK and dV in float32,
    the plain call's gradients (to their rounding), with D given or computed; rows of no sequence gain nothing; the
    result is [None, None, None]. kv_fresh: dK and dV are written (every row, zeros where no sequence), dQ added."""
    from flashtile import interface
    from flashtile.kernels.params import GradSums
    from flashtile.kernels.triton.launch import bwd_delta
    p, x, q, k, v, do, out, lse = sums_case(varlen, torch.float32, DEVICE)
    grads = interface.backward(p, do, q, k, v, out, lse, None, x)
    before = [torch.randn(t.shape, device=t.device) for t in (q, k, v)]
    sums = [t.clone() for t in before]
    delta = bwd_delta(out, do, lse, None, x.cu_seqlens_q, p.seqlen_q) if with_delta else None
    got = interface.backward(p, do, q, k, v, out, lse, None, x, sums=GradSums(*sums, delta, kv_fresh=fresh))
    assert got == [None] * 3
    for i, (acc, b, g) in enumerate(zip(sums, before, grads)):
        want = g if fresh and i > 0 else b + g
        assert torch.allclose(acc, want, atol=1e-5, rtol=0), f"seed={seed}"
        if varlen:
            assert torch.equal(acc[161:], torch.zeros_like(b[161:]) if fresh and i > 0 else b[161:])


def test_sums_refused_with_a_bias():
    from flashtile import interface
    from flashtile.api.errors import ArgumentError
    from flashtile.kernels.params import GradSums
    import dataclasses
    p, x, q, k, v, do, out, lse = sums_case(False, torch.float32, DEVICE)
    with pytest.raises(ArgumentError, match="sums"):
        interface.backward(dataclasses.replace(p, bias=True), do, q, k, v, out, lse, None, x,
                           bias=torch.zeros(1, 1, 77, 90),
                           sums=GradSums(*(torch.zeros(t.shape) for t in (q, k, v))))

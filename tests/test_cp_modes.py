"""Context parallelism (flashtile.distributed): every mode against one process, forward and backward.

Modes: the varlen ring (packed documents sharded per document), Ulysses all-to-all (dense and varlen), the hybrid
USP (all-to-all inside a group, ring across groups, dense and varlen), and the DeviceMesh entry point with a
data-parallel dimension beside the context-parallel one. They run on the gloo backend in W = 2 and 4 processes,
in the worker pools of tests/test_ring.py (one per W, reused by every case). The parent draws the full inputs
from the case's seed; the workers shard them with the library's helpers, run forward + backward and send their
shards back; the parent reassembles them (cp_unshard) and compares.

The bar (float32): for out, lse, dq, dk, dv,  max|cp - one process| <= 2 e1 + 2^-21 max(1, max|ref64|), where
e1 = max|one process - ref64| is the single process's own float32 error against the float64 oracle
(flashtile.reference). The floor is four float32 ulps at the values' magnitude: e1 is the maximum of a few
roundings and can land near one ulp by luck, while the ring's merge of partial results adds roundings of its own.
"""
from __future__ import annotations

import pytest
import torch

from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.distributed import cp_unshard
from flashtile.reference.dense import attention_ref
import test_ring
from test_ring import needs_interpreter

pools = test_ring.pools   # the gloo worker pools fixture (one per world size, for this module's cases)

FLOOR = 2.0 ** -21


# --------------------------------------------------------------------------------------------------
# The worker's side
# --------------------------------------------------------------------------------------------------
_MESHES: dict = {}


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh
    key = (tuple(shape), tuple(names))
    if key not in _MESHES:   # every rank runs the same tasks in the same order: the sub-groups match
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]


def _cp_task(rank, world, task):
    """Shard the full inputs, run one mode forward + backward, return this rank's shards (and where they go)."""
    import torch.distributed as dist

    from flashtile.distributed import (
        context_parallel_attention,
        context_parallel_shard,
        cp_shard,
        ring_flash_attn_varlen_func,
        ulysses_flash_attn_func,
        ulysses_flash_attn_varlen_func,
    )
    spec, kw = task["spec"], dict(task["kwargs"])
    cu = task.get("cu_seqlens")
    varlen = cu is not None
    dp_rank = 0
    if spec["api"] == "mesh":
        mesh = _mesh(spec["shape"], spec["names"])
        cp_dim, mode = spec["cp_dim"], spec["mode"]
        if "dp" in spec["names"]:
            dp_rank = mesh.get_local_rank("dp")

        def shard(t):
            return context_parallel_shard(t, mesh, cp_dim, mode, layout=spec.get("layout", "zigzag"), cu_seqlens=cu)

        def attn(q, k, v):
            extra = dict(cu_seqlens=cu, max_seqlen=task["max_seqlen"]) if varlen else dict(layout=spec["layout"])
            return context_parallel_attention(q, k, v, mesh, cp_dim, mode, return_softmax_lse=True, **extra, **kw)
        dims = (cp_dim,) if isinstance(cp_dim, str) else cp_dim
        ranks = [mesh.get_local_rank(d) for d in dims]
        cp_rank = ranks[0] * (mesh[dims[1]].size() if len(dims) == 2 else 1) + (ranks[1] if len(dims) == 2 else 0)
    else:   # the functions themselves over the world group
        cp_rank = dist.get_rank()
        ring_size, uly_size = (world, 1) if spec["mode"] == "ring" else (1, world)

        def shard(t):
            return cp_shard(t, cp_rank, ring_size, uly_size, cu_seqlens=cu)

        def attn(q, k, v):
            if spec["mode"] == "ring":
                return ring_flash_attn_varlen_func(q, k, v, cu, task["max_seqlen"], return_softmax_lse=True, **kw)
            if varlen:
                return ulysses_flash_attn_varlen_func(q, k, v, cu, task["max_seqlen"], return_softmax_lse=True, **kw)
            return ulysses_flash_attn_func(q, k, v, return_softmax_lse=True, **kw)
    q, k, v, dout = task["inputs"][dp_rank]
    q, k, v = (shard(t).requires_grad_(True) for t in (q, k, v))
    out, lse = attn(q, k, v)
    out.backward(shard(dout))
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad, cp_rank=cp_rank,
                dp_rank=dp_rank)


# --------------------------------------------------------------------------------------------------
# The parent's side
# --------------------------------------------------------------------------------------------------
def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _doc_mask(lens, window, causal):
    """(T, T) bool: query i may see key j (same document, inside the band of document positions)."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(len(doc)) - _cu(lens)[:-1].long()[doc]
    rel = pos.view(1, -1) - pos.view(-1, 1)   # p_k - p_q
    left, right = window
    right = 0 if causal else right
    m = doc.view(-1, 1) == doc.view(1, -1)
    if left >= 0:
        m &= rel >= -left
    if right >= 0:
        m &= rel <= right
    return m


def _one_process(q, k, v, dout, kw, lens):
    """flashtile in one process (float32) and the float64 oracle: dicts of out, lse, dq, dk, dv."""
    q1, k1, v1 = (t.clone().requires_grad_(True) for t in (q, k, v))
    if lens is None:
        out, lse, _ = flash_attn_func(q1, k1, v1, return_attn_probs=True, **kw)
    else:
        cu, n = _cu(lens), max(lens)
        out, lse, _ = flash_attn_varlen_func(q1, k1, v1, cu, cu, n, n, return_attn_probs=True, **kw)
    out.backward(dout)
    single = dict(out=out.detach(), lse=lse.detach(), dq=q1.grad, dk=k1.grad, dv=v1.grad)

    q2, k2, v2 = (t.double().requires_grad_(True) for t in (q, k, v))
    if lens is None:
        rkw = dict(kw)
        o, l_, _ = attention_ref(q2, k2, v2, **rkw)
        o.backward(dout.double())
        ref = dict(out=o.detach(), lse=l_.detach(), dq=q2.grad, dk=k2.grad, dv=v2.grad)
    else:
        mask = _doc_mask(lens, kw.get("window_size", (-1, -1)), kw.get("causal", False))
        rkw = {n: kw[n] for n in ("softmax_scale", "softcap") if n in kw}
        o, l_, _ = attention_ref(q2[None], k2[None], v2[None], attn_mask=mask, **rkw)
        o.backward(dout.double()[None])
        ref = dict(out=o.detach()[0], lse=l_.detach()[0], dq=q2.grad, dk=k2.grad, dv=v2.grad)
    return single, ref


def _check(name, cp, single, ref, ctx):
    assert not torch.isnan(cp).any(), f"{name}: NaN {ctx}"
    cp, single, ref = cp.double(), single.double(), ref.double()
    scale = max(1.0, ref.abs().max().item())
    e1 = (single - ref).abs().max().item()
    e_cp = (cp - single).abs().max().item()
    bound = 2 * e1 + FLOOR * scale
    assert e_cp <= bound, (f"{name}: max|cp - one process| = {e_cp:.3e} > 2 x {e1:.3e} (one process vs float64) "
                           f"+ floor = {bound:.3e} {ctx}")


def _run_case(pools, world, spec, kw, shape, lens=None, ndp=1):
    """Draw inputs (ndp batches for a dp dimension), run the mode, compare every output with one process."""
    b, s, h, hk, d = shape
    inputs = []
    for _ in range(ndp):
        if lens is None:
            dims = ((b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d))
        else:
            t = sum(lens)
            dims = ((t, h, d), (t, hk, d), (t, hk, d), (t, h, d))
        inputs.append(tuple(torch.randn(*x) for x in dims))
    task = dict(kind="call", fn=_cp_task, spec=spec, kwargs=kw, inputs=inputs)
    if lens is not None:
        task.update(cu_seqlens=_cu(lens), max_seqlen=max(lens))
    res = pools(world).run(task)
    for r, rr in enumerate(res):
        assert rr.get("error") is None, f"rank {r}: {rr.get('error')}\n{rr.get('tb')}"
    if spec["mode"] == "usp":
        ring_size, uly_size = spec["shape"][-2], spec["shape"][-1]
    elif spec["mode"] == "ring":
        ring_size, uly_size = world // ndp, 1
    else:
        ring_size, uly_size = 1, world // ndp
    layout = spec.get("layout", "zigzag")
    cu = None if lens is None else _cu(lens)
    for dp in range(ndp):
        mine = sorted((rr for rr in res if rr["dp_rank"] == dp), key=lambda rr: rr["cp_rank"])
        assert [rr["cp_rank"] for rr in mine] == list(range(ring_size * uly_size))
        seq_dim = 1 if lens is None else 0
        got = {n: cp_unshard([rr[n] for rr in mine], ring_size, uly_size, layout, seq_dim, cu)
               for n in ("out", "dq", "dk", "dv")}
        got["lse"] = cp_unshard([rr["lse"] for rr in mine], ring_size, uly_size, layout, seq_dim + 1, cu)
        single, ref = _one_process(*inputs[dp], kw, lens)
        ctx = f"[world={world} spec={spec} kwargs={kw} shape={shape} lens={lens} dp={dp}]"
        for n in ("out", "lse", "dq", "dk", "dv"):
            _check(n, got[n], single[n], ref[n], ctx)


# --------------------------------------------------------------------------------------------------
# Varlen ring
# --------------------------------------------------------------------------------------------------
RING = dict(api="direct", mode="ring")
# document lengths: not multiples of 2W (padding), a zero-length document, one shorter than 2W
RING_VARLEN = [
    pytest.param(2, dict(causal=True), (2, 1, 16), [13, 0, 5, 22], id="w2-causal-mqa-padded"),
    pytest.param(2, dict(causal=False), (2, 2, 16), [9, 16], id="w2-full"),
    pytest.param(2, dict(window_size=(5, 3)), (2, 1, 16), [20, 11], id="w2-window-mqa"),
    pytest.param(4, dict(causal=True), (4, 2, 16), [13, 27], id="w4-causal-gqa-padded"),
    pytest.param(4, dict(causal=True, window_size=(6, 0), softcap=4.0, softmax_scale=0.2), (2, 2, 16),
                 [30, 5], id="w4-causal-window-softcap"),
    pytest.param(4, dict(window_size=(3, 9)), (2, 2, 16), [21, 16], id="w4-window"),
]


@needs_interpreter
@pytest.mark.parametrize("world, kw, heads, lens", RING_VARLEN)
def test_varlen_ring_matches_one_process(pools, world, kw, heads, lens):
    h, hk, d = heads
    _run_case(pools, world, RING, kw, (None, None, h, hk, d), lens)


# --------------------------------------------------------------------------------------------------
# Ulysses
# --------------------------------------------------------------------------------------------------
ULYSSES = dict(api="direct", mode="ulysses")


@needs_interpreter
@pytest.mark.parametrize("world, kw, shape", [
    pytest.param(2, dict(causal=True), (2, 32, 4, 2, 16), id="w2-causal-gqa"),
    # nheads_k = 2 < W = 4: each KV head sent twice
    pytest.param(4, dict(causal=True), (1, 32, 8, 2, 16), id="w4-causal-gqa-replicated"),
    # MQA over 4 ranks (4 copies), with window, softcap and ALiBi (each rank takes its heads' slopes)
    pytest.param(4, dict(window_size=(7, 2), softcap=3.0, alibi=True), (1, 32, 4, 1, 16), id="w4-mqa-window-alibi"),
])
def test_ulysses_matches_one_process(pools, world, kw, shape):
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(shape[2]) * 0.3
    _run_case(pools, world, ULYSSES, kw, shape)


@needs_interpreter
@pytest.mark.parametrize("world, kw, heads, lens", [
    # 43 tokens: the packed batch is padded at its end to 44 (W = 2) / 44 (W = 4)
    pytest.param(2, dict(causal=True), (4, 2, 16), [13, 24, 0, 6], id="w2-causal-gqa-end-padding"),
    pytest.param(4, dict(window_size=(4, 4)), (4, 2, 16), [19, 7, 17], id="w4-window-gqa-replicated"),
])
def test_ulysses_varlen_matches_one_process(pools, world, kw, heads, lens):
    h, hk, d = heads
    _run_case(pools, world, ULYSSES, kw, (None, None, h, hk, d), lens)


# --------------------------------------------------------------------------------------------------
# USP and the DeviceMesh entry point (4 processes)
# --------------------------------------------------------------------------------------------------
def _usp(layout="zigzag"):
    return dict(api="mesh", mode="usp", shape=(2, 2), names=("ring", "uly"), cp_dim=("ring", "uly"), layout=layout)


@needs_interpreter
@pytest.mark.parametrize("spec, kw, shape", [
    pytest.param(_usp(), dict(causal=True), (1, 32, 4, 1, 16), id="usp-zigzag-causal-mqa"),
    pytest.param(_usp("contiguous"), dict(window_size=(5, 6)), (2, 32, 4, 2, 16), id="usp-contiguous-window-gqa"),
])
def test_usp_matches_one_process(pools, spec, kw, shape):
    _run_case(pools, 4, spec, kw, shape)


@needs_interpreter
def test_usp_varlen_matches_one_process(pools):
    # documents padded to multiples of 2 R U = 8, zigzagged over the ring, each ring shard split over Ulysses
    _run_case(pools, 4, _usp(), dict(causal=True), (None, None, 4, 2, 16), [13, 21, 6])


@needs_interpreter
@pytest.mark.parametrize("mode, lens", [
    pytest.param("ring", None, id="ring"),
    pytest.param("ulysses", None, id="ulysses"),
    pytest.param("ring", [11, 20], id="ring-varlen"),
])
def test_mesh_cp_beside_data_parallel(pools, mode, lens):
    """A (dp=2, cp=2) mesh: each dp rank its own batch, CP over "cp" only, both batches exact."""
    spec = dict(api="mesh", mode=mode, shape=(2, 2), names=("dp", "cp"), cp_dim="cp", layout="zigzag")
    _run_case(pools, 4, spec, dict(causal=True), (1, 32, 4, 2, 16), lens, ndp=2)


# --------------------------------------------------------------------------------------------------
# Refusals: every rank raises the same ArgumentError (none is left waiting in a collective)
# --------------------------------------------------------------------------------------------------
def _error_task(rank, world, task):
    import torch.distributed as dist

    from flashtile import distributed as cp
    what = task["what"]
    if what == "ulysses-heads":
        q = torch.randn(1, 8, 3, 16)
        cp.ulysses_flash_attn_func(q, q, q)
    elif what == "usp-groups":
        q = torch.randn(1, 8, 2, 16)
        cp.usp_flash_attn_func(q, q, q, None, None)
    elif what == "varlen-rows":
        q = torch.randn(7, 2, 16)
        cp.ring_flash_attn_varlen_func(q, q, q, [0, 13], 13)
    elif what == "varlen-cu-differs":
        cu = [0, 8] if dist.get_rank() == 0 else [0, 4, 8]
        q = torch.randn(4, 2, 16)
        cp.ring_flash_attn_varlen_func(q, q, q, cu, 8)
    elif what == "mesh-dim":
        mesh = _mesh((world,), ("cp",))
        q = torch.randn(1, 8, 2, 16)
        cp.context_parallel_attention(q, q, q, mesh, cp_dim="sp")
    return dict(error=None)


@needs_interpreter
@pytest.mark.parametrize("what, names", [
    ("ulysses-heads", "q.shape[-2] (nheads)"),
    ("usp-groups", "ulysses_group"),
    ("varlen-rows", "q.shape[0]"),
    ("varlen-cu-differs", "cu_seqlens across the ranks"),
    ("mesh-dim", "cp_dim"),
])
def test_refusals_name_the_argument_on_every_rank(pools, what, names):
    res = pools(2).run(dict(kind="call", kwargs={}, fn=_error_task, what=what))
    for r, rr in enumerate(res):
        assert rr["error"] is not None and rr["error"].startswith("ArgumentError") and names in rr["error"], \
            f"rank {r}: {rr}"

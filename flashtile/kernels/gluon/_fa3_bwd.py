"""FlashAttention-3's backward (FA3 paper appendix B.1: Algorithm 2 of the FlashAttention-2 paper with FA3's warp
specialization) for Hopper, written in Gluon: TMA loads by a producer warp, asynchronous wgmma, and dQ added to a
float32 accumulator by TMA reduce-add (one bulk `cp.reduce.async.bulk` per tile instead of scalar atomics).

One program owns one key block (Bc = 2 x 64 rows) of one (batch, kv head) and keeps K_j, V_j in shared memory and
dK_j, dV_j in registers; it streams the query blocks Q_i, dO_i (Br rows: 64 at d128, 128 at d64; every query head
of the kv head's group, GQA) through a ring of STAGES shared-memory buffers:
- the producer warp (`_load_partition`) loads K_j, V_j once, then Q_i and dO_i into buffer t % STAGES once both
  consumers released it;
- two consumer warpgroups (`_consumer_partition`; the first is the default partition) own 64 keys each (K_w, V_w)
  and compute, for every query block (`_step`, Algorithm 2 lines 8-20):
    S = Q_i K_w^T, dP = dO_i V_w^T                              (two asynchronous wgmmas)
    P = exp2(S * scale * log2 e - lse_i * log2 e)               (lse from the forward: no max, no sum)
    dS = P o (dP - D_i),  D_i = rowsum(dO_i o O_i)              (the preprocess kernel's Delta)
    dV_w += P^T dO_i,  dK_w += dS^T Q_i                          (P and dS through shared memory, read transposed)
  dS stays in shared memory for dQ_i = scale * dS K_j, which needs both warpgroups' key halves: at the next step
  (mbarrier `ds_ready` says both are stored, `ds_free` that both products read a buffer), warpgroup w computes
  its half of dQ_i (columns [w d/2, +d/2) at Br 64, rows [64 w, +64) at Br 128) and adds it to the float32 dQ
  accumulator with one TMA reduce-add.
dK_j = scale * dK_w and dV_j are written once, after the loop, by TMA (staged in the free Q_i / dO_i buffers while
the last dQ product runs; float32 outputs, partial gradients a caller sums, one tile after the other). With PINGPONG
(fa3.BWD_PINGPONG) the consumer warpgroups take turns issuing their GEMMs, two turns per step (S and dP; dV, dK and
dQ_{t-1}), as the forward's ping-pong. Registers: dK_w, dV_w, S and dP are 192 of the consumers' 240 per thread at
d128, so the loop keeps nothing else of that size (ptxas spills a few scalars).

Imported only on a CUDA device of compute capability 9.x (flashtile.kernels.gluon.fa3 decides).
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ..params import LOG2E as _LOG2E
from ._fa3_fwd import _pass_turn, _sparse_block, _turn, tma_load, tma_store

LOG2E = gl.constexpr(_LOG2E)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Global[coord:] += shared tile src, by the TMA unit (`cp.reduce.async.bulk.tensor ... .add`). Triton 3.9
    names it tma.async_atomic_add; Triton 3.6 (the GPU image's) has the builder operation but no Gluon wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add


@builtin
def _reinterpret(smem, dtype, shape, layout, _semantic=None):
    """smem viewed as a tile of another dtype, shape and layout (Triton 3.9: reinterpret; 3.6: _reinterpret)."""
    view = getattr(smem, "reinterpret", None) or smem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def _query_block(t, n_i, i_start, hk, group, blocks=0, SPARSE_BLOCK: gl.constexpr = 0, BLOCK_M: gl.constexpr = 64,
                 HEADS: gl.constexpr = 0):
    """Iteration t of a program -> (query head, query block index): the group's heads one after another, each
    from block i_start (the first one the key block is visible to) to the last; with a block mask (SPARSE_BLOCK >
    0; blocks: the key block's row of its transposed lists (_sparse_row), the lists, len_q) the blocks its lists
    name, partial ones first (_sparse_block). HEADS > 0 (the dense backward's GQA / MQA: the group as a compile-time
    count): the heads innermost instead, every head of a query block before the next block (no runtime division)."""
    if HEADS > 0:
        h = hk * HEADS + t % HEADS
        i = i_start + t // HEADS
    else:
        h = hk * group + t // n_i
        if SPARSE_BLOCK > 0:
            srow, sparse, len_q = blocks
            i = _sparse_block(t % n_i, srow, sparse, len_q, SPARSE_BLOCK, BLOCK_M)
        else:
            i = i_start + t % n_i
    return h, i


@gluon.jit
def _load_partition(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, qdo_ready, qdo_empty,
                    kv_row, kv_col, q_row0, n_iters, n_i, i_start, hk, group,
                    BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, blocks=0,
                    SPARSE_BLOCK: gl.constexpr = 0, HEADS: gl.constexpr = 0):
    """Producer: K_j and V_j once, then (Q_i, dO_i) of iteration t (_query_block: blocks, SPARSE_BLOCK, HEADS) into
    buffer t % STAGES once both consumer warpgroups released it."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [kv_row, kv_col], kv_bar, k_smem)
    tma_load(v_desc, [kv_row, kv_col], kv_bar, v_smem)
    for t in range(n_iters):
        s = t % STAGES
        h, i = _query_block(t, n_i, i_start, hk, group, blocks, SPARSE_BLOCK, BLOCK_M, HEADS)
        row = q_row0 + i * BLOCK_M
        # mbarriers start with phase 1 complete: the first STAGES waits pass at once
        mbarrier.wait(qdo_empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(qdo_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [row, h * HEAD_D], qdo_ready.index(s), q_bufs.index(s))
        tma_load(do_desc, [row, h * HEAD_D], qdo_ready.index(s), do_bufs.index(s))


@gluon.jit
def _dq_product(ds_bufs, ds_ready, k_smem, dq_init, t, wg: gl.constexpr, WG_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """Algorithm 2 line 18 for iteration t, warpgroup wg's part of dQ_i = dS K_j = dS_0 K_0 + dS_1 K_1 (both key
    halves), once both warpgroups stored their dS_t (mbarrier ds_ready of its buffer): rows [wg * 64, +64) when
    Br = 128 (dq_init is 64 x d), else columns [wg * d/2, +d/2) (dq_init is Br x d/2). Issued asynchronously:
    returns the wgmma token."""
    DQ_M: gl.constexpr = dq_init.shape[0]
    DQ_N: gl.constexpr = dq_init.shape[1]
    buf = t % 2
    mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
    a0 = ds_bufs.index(2 * buf)
    a1 = ds_bufs.index(2 * buf + 1)
    b0 = k_smem.slice(0, WG_N, dim=0)
    b1 = k_smem.slice(WG_N, WG_N, dim=0)
    if DQ_M < BLOCK_M:
        a0 = a0.slice(wg * DQ_M, DQ_M, dim=0)
        a1 = a1.slice(wg * DQ_M, DQ_M, dim=0)
    else:
        b0 = b0.slice(wg * DQ_N, DQ_N, dim=1)
        b1 = b1.slice(wg * DQ_N, DQ_N, dim=1)
    tok = warpgroup_mma(a0, b0, dq_init, use_acc=False, is_async=True)
    return warpgroup_mma(a1, b1, tok, is_async=True)


@gluon.jit
def _dq_reduce_add(dq_desc, dq_smem, dq, row, col):
    """dQ_acc[row:, col:] += dq by one TMA reduce-add through this warpgroup's staging buffer."""
    tma.store_wait(pendings=0)   # the previous reduce-add has read the buffer
    dq_smem.store(dq)
    fence_async_shared()
    tma_reduce_add(dq_desc, [row, col], dq_smem)


@gluon.jit
def _store_ds(ds, ds_bufs, ds_free, t, wg: gl.constexpr):
    """dS_t of warpgroup wg into iteration t's buffer pair (one buffer per key half), once both warpgroups' dQ
    products of iteration t - 2 have read it; fenced for the wgmmas that read it. Returns the buffer."""
    buf = t % 2
    mbarrier.wait(ds_free.index(buf), ((t // 2) & 1) ^ 1)
    ds_smem = ds_bufs.index(2 * buf + wg)
    ds_smem.store(ds)
    fence_async_shared()
    return ds_smem


@gluon.jit
def _add_dq(dq, ds_free, t, dq_desc, dq_smem, sm_scale, row, col):
    """After dQ_{t-1}'s product completed: its dS buffer pair may be refilled (ds_free), and dQ_{t-1} (scaled) goes
    into the float32 accumulator."""
    mbarrier.arrive(ds_free.index((t - 1) % 2), count=1)
    _dq_reduce_add(dq_desc, dq_smem, dq * sm_scale, row, col)


@gluon.jit
def _step(t, h, i, dk, dv, dq_row, dq_col, k_w, v_w, k_smem, q_bufs, do_bufs, p_smem, ds_bufs, dq_smem, qdo_ready,
          qdo_empty, ds_ready, ds_free, dq_desc, lse_ptr, delta_ptr, lse_off, kv_start, q_row0, sm_scale, qk_scale,
          wg: gl.constexpr, s_layout: gl.constexpr, dq_init, turns, TILE: gl.constexpr, CAUSAL: gl.constexpr):
    """Iteration t of consumer warpgroup wg: query block i of head h against the warpgroup's 64 keys (Algorithm 2
    lines 8-20), lse_off: (batch, head)'s offset into lse / delta. Returns dK_w, dV_w and where this step's dQ tile
    goes: it is computed at the next step (or after the loop)."""
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    STAGES: gl.constexpr = TILE.STAGES
    PINGPONG: gl.constexpr = TILE.PINGPONG
    dtype: gl.constexpr = q_bufs.dtype
    WG_N: gl.constexpr = k_w.shape[0]
    # this warpgroup's dQ tile: rows [wg * 64, +64) when Br = 128, else columns [wg * d/2, +d/2)
    DQ_M: gl.constexpr = dq_init.shape[0]
    DQ_N: gl.constexpr = dq_init.shape[1]
    DQ_ROW: gl.constexpr = wg * DQ_M if DQ_M < BLOCK_M else 0
    DQ_COL: gl.constexpr = 0 if DQ_M < BLOCK_M else wg * DQ_N
    s = t % STAGES
    q_start = i * BLOCK_M
    q_idx = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    lse2 = gl.load(lse_ptr + lse_off + q_idx) * LOG2E
    delta = gl.load(delta_ptr + lse_off + q_idx)
    q_s = q_bufs.index(s)
    do_s = do_bufs.index(s)
    mbarrier.wait(qdo_ready.index(s), (t // STAGES) & 1)
    masked = False
    if CAUSAL and BLOCK_M <= WG_N:
        # every key of this warpgroup after every query of the block (Br = 64: the second warpgroup at the block that
        # starts on the diagonal): P = dS = 0, dK_w and dV_w unchanged, no product but dQ_{t-1}; dS_w = 0 for dQ_i
        masked = q_start + BLOCK_M <= kv_start + wg * WG_N
    if masked:
        skip_step(t, ds_bufs, ds_ready, ds_free, k_smem, dq_init, dq_desc, dq_smem, dq_row, dq_col, sm_scale, turns, wg,
                  s_layout, BLOCK_M, WG_N, PINGPONG)
    else:
        sc, dp_tok = s_dp_products(t, q_s, do_s, k_w, v_w, turns, wg, s_layout, BLOCK_M, PINGPONG)
        # line 13: P = exp(S * scale - L_i) (base 2); under the causal mask, key > query -> 0
        p = gl.exp2(sc * qk_scale - gl.expand_dims(lse2, 1))
        if CAUSAL:
            if q_start < kv_start + BLOCK_N:   # a block that reaches the diagonal
                # key kv_start + wg * WG_N + c is visible to query r iff c <= r - kv_start - wg * WG_N
                last = q_idx - (kv_start + wg * WG_N)
                cols = gl.arange(0, WG_N, layout=gl.SliceLayout(0, s_layout))
                p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(last, 1), p, 0.0)
        # P through shared memory: dV's A operand is P^T (keys x queries), a transposed read of the tile
        p_smem.store(p.to(dtype))
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        # line 17: dS = P o (dP - D_i)
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)
        ds_smem = _store_ds(ds, ds_bufs, ds_free, t, wg)
        dk, dv = dkv_dq_products(t, p_smem, ds_smem, q_s, do_s, dk, dv, k_smem, ds_bufs, ds_ready, ds_free, dq_init,
                                 dq_desc, dq_smem, sm_scale, dq_row, dq_col, turns, wg, WG_N, BLOCK_M, PINGPONG)
    mbarrier.arrive(qdo_empty.index(s), count=1)   # Q_i, dO_i read by every product: the buffer may refill
    return dk, dv, q_row0 + q_start + DQ_ROW, h * TILE.HEAD_D + DQ_COL


@gluon.jit
def skip_step(t, ds_bufs, ds_ready, ds_free, k_smem, dq_init, dq_desc, dq_smem, dq_row, dq_col, sm_scale, turns,
              wg: gl.constexpr, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, WG_N: gl.constexpr,
              PINGPONG: gl.constexpr):
    """A step whose query rows see none of the warpgroup's keys (both backward kernels): P = dS = 0, dK_w and dV_w
    unchanged, no product but dQ_{t-1}; dS_w = 0 for dQ_i. Its turns pass as a computing step's do."""
    _turn(turns, wg, 2 * t, 2, PINGPONG)
    _pass_turn(turns, wg, 2, PINGPONG)
    _store_ds(gl.zeros([BLOCK_M, WG_N], ds_bufs.dtype, s_layout), ds_bufs, ds_free, t, wg)
    mbarrier.arrive(ds_ready.index(t % 2), count=1)
    _turn(turns, wg, 2 * t + 1, 2, PINGPONG)
    if t > 0:
        dq_tok = _dq_product(ds_bufs, ds_ready, k_smem, dq_init, t - 1, wg, WG_N, BLOCK_M)
        _pass_turn(turns, wg, 2, PINGPONG)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
        _add_dq(dq, ds_free, t, dq_desc, dq_smem, sm_scale, dq_row, dq_col)
    else:
        _pass_turn(turns, wg, 2, PINGPONG)


@gluon.jit
def s_dp_products(t, q_s, do_s, k_w, v_w, turns, wg: gl.constexpr, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  PINGPONG: gl.constexpr):
    """The first half of step t (both backward kernels): Algorithm 2 lines 11 and 16 for this warpgroup's keys,
    S = Q_i K_w^T and dP = dO_i V_w^T, issued together (with PINGPONG on this warpgroup's turn). Returns S (waited
    for) and dP's wgmma token (waited for after P is stored)."""
    _turn(turns, wg, 2 * t, 2, PINGPONG)
    s_tok = _issue_product(q_s, k_w, s_layout, BLOCK_M)
    dp_tok = dp_product(do_s, v_w, s_layout, BLOCK_M)
    _pass_turn(turns, wg, 2, PINGPONG)
    return warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, )), dp_tok


@gluon.jit
def _issue_product(a_s, b_w, s_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """A_s B_w^T (BLOCK_M x the warpgroup's keys, float32) issued asynchronously: its wgmma token."""
    WG_N: gl.constexpr = b_w.shape[0]
    init = gl.zeros([BLOCK_M, WG_N], gl.float32, s_layout)
    return warpgroup_mma(a_s, b_w.permute((1, 0)), init, use_acc=False, is_async=True)


@gluon.jit
def s_product(q_s, k_w, s_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """Algorithm 2 line 11 alone, S = Q_i K_w^T, waited for: the first half of a step whose dP is issued later
    (dp_product, once P is computed), without turns (not with PINGPONG)."""
    return warpgroup_mma_wait(num_outstanding=0, deps=(_issue_product(q_s, k_w, s_layout, BLOCK_M), ))


@gluon.jit
def dp_product(do_s, v_w, s_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """Algorithm 2 line 16, dP = dO_i V_w^T, issued (s_dp_products: beside S; with s_product: once P is computed):
    its wgmma token."""
    return _issue_product(do_s, v_w, s_layout, BLOCK_M)


@gluon.jit
def dkv_dq_products(t, p_smem, ds_smem, q_s, do_s, dk, dv, k_smem, ds_bufs, ds_ready, ds_free, dq_init, dq_desc,
                    dq_smem, sm_scale, dq_row, dq_col, turns, wg: gl.constexpr, WG_N: gl.constexpr,
                    BLOCK_M: gl.constexpr, PINGPONG: gl.constexpr):
    """The second half of step t (both backward kernels), once P and dS_t are in shared memory: Algorithm 2 line
    14 (dV_w += P^T dO_i) and line 19 (dK_w += dS^T Q_i), and dQ_{t-1}'s product (line 18). Returns dK_w, dV_w."""
    _turn(turns, wg, 2 * t + 1, 2, PINGPONG)
    dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do_s, dv, is_async=True)
    dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q_s, dk, is_async=True)
    mbarrier.arrive(ds_ready.index(t % 2), count=1)
    if t > 0:
        # line 18 one step late, so the warpgroups need not meet at every step (measured faster than meeting):
        # dQ_{t-1} needs the other warpgroup's dS_{t-1}, which it stored half a step ago at the latest
        dq_tok = _dq_product(ds_bufs, ds_ready, k_smem, dq_init, t - 1, wg, WG_N, BLOCK_M)
        _pass_turn(turns, wg, 2, PINGPONG)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok))
        _add_dq(dq, ds_free, t, dq_desc, dq_smem, sm_scale, dq_row, dq_col)
    else:
        _pass_turn(turns, wg, 2, PINGPONG)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok))
    return dk, dv


@gluon.jit
def warpgroup_state(wg: gl.constexpr, k_smem, v_smem, p_bufs, dq_bufs, dq_desc, BLOCK_N: gl.constexpr,
                    HEAD_D: gl.constexpr):
    """Consumer warpgroup wg's views of the program's shared memory (its 64 keys of K_j and V_j, its P and dQ staging
    tiles) and its accumulators: dK_w = dV_w = 0, and the zero its dQ products start from."""
    WG_N: gl.constexpr = BLOCK_N // 2          # key rows of this warpgroup
    DQ_M: gl.constexpr = dq_desc.block_type.shape[0]   # this warpgroup's dQ tile (_dq_product)
    DQ_N: gl.constexpr = dq_desc.block_type.shape[1]
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_N, 16])
    return (k_smem.slice(wg * WG_N, WG_N, dim=0), v_smem.slice(wg * WG_N, WG_N, dim=0), p_bufs.index(wg),
            dq_bufs.index(wg), gl.zeros([WG_N, HEAD_D], gl.float32, kv_layout),
            gl.zeros([WG_N, HEAD_D], gl.float32, kv_layout), gl.zeros([DQ_M, DQ_N], gl.float32, dq_layout))


@gluon.jit
def _consumer_partition(wg: gl.constexpr, shared, TILE: gl.constexpr, CAUSAL: gl.constexpr, ADD_DKV: gl.constexpr,
                        HEADS: gl.constexpr):
    """Consumer warpgroup `wg`: key rows [wg * 64, wg * 64 + 64) of the program's block through every query block
    (per query head of the group), then its rows of dK_j, dV_j (Algorithm 2 line 22). `shared`: the buffers,
    barriers, descriptors and scalars it uses (as the kernel names them); hk, group there: the program's query heads
    [hk * group, +group). ADD_DKV: dK_j, dV_j added into float32 accumulators (the kernel's SPLIT). HEADS: the
    kernel's (_query_block's order)."""
    (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, qdo_ready, qdo_empty, ds_ready, ds_free, turns,
     dq_desc, lse_ptr, delta_ptr, stride_lse_b, stride_lse_h, dk_desc, dv_desc, kv_row, kv_col, b, kv_start, q_row0,
     n_iters, n_i, i_start, hk, group, sm_scale, qk_scale) = shared
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    WG_N: gl.constexpr = BLOCK_N // 2          # key rows of this warpgroup
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, WG_N, 16])
    k_w, v_w, p_smem, dq_smem, dk, dv, dq_init = warpgroup_state(wg, k_smem, v_smem, p_bufs, dq_bufs, dq_desc,
                                                                  BLOCK_N, TILE.HEAD_D)

    dq_row = q_row0   # where the previous step's dQ tile goes
    dq_col = 0
    mbarrier.wait(kv_bar, 0)
    for t in range(n_iters):
        h, i = _query_block(t, n_i, i_start, hk, group, HEADS=HEADS)
        dk, dv, dq_row, dq_col = _step(
            t, h, i, dk, dv, dq_row, dq_col, k_w, v_w, k_smem, q_bufs, do_bufs, p_smem, ds_bufs, dq_smem,
            qdo_ready, qdo_empty, ds_ready, ds_free, dq_desc, lse_ptr, delta_ptr, b * stride_lse_b + h * stride_lse_h,
            kv_start, q_row0, sm_scale, qk_scale, wg, s_layout, dq_init, turns, TILE, CAUSAL)
    # the last query block's dQ, issued first: by TMA, dK_j and dV_j (line 22) are staged and stored while it runs
    dq_tok = _dq_product(ds_bufs, ds_ready, k_smem, dq_init, n_iters - 1, wg, WG_N, BLOCK_M)
    _store_dkv_tma(dk, dv, dk_desc, dv_desc, q_bufs, do_bufs, qdo_empty, kv_row + wg * WG_N, kv_col, n_iters,
                   sm_scale, wg, BLOCK_M, TILE.STAGES, ADD_DKV)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
    _dq_reduce_add(dq_desc, dq_smem, dq * sm_scale, dq_row, dq_col)
    tma.store_wait(pendings=0)


@gluon.jit
def _store_dkv_tma(dk, dv, dk_desc, dv_desc, q_bufs, do_bufs, qdo_empty, row, col, n_iters, sm_scale,
                   wg: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ADD: gl.constexpr = False):
    """dK_w (scaled) and dV_w to rows [row, +64) by TMA (stage_dkv, tma_store_dkv): one bulk store each instead of
    4-byte stores; to float32 descriptors (gradients kept in float32: the ring's partial sums) through float32
    staging (store_dkv_f32; ADD: added into them by TMA reduce-add)."""
    if dk_desc.dtype == gl.float32:
        store_dkv_f32(dk, dv, dk_desc, dv_desc, q_bufs, do_bufs, qdo_empty, row, col, n_iters, sm_scale, wg, STAGES,
                      ADD)
    else:
        dk_smem, dv_smem = stage_dkv(dk, dv, q_bufs, do_bufs, qdo_empty, n_iters, sm_scale, wg, BLOCK_M, STAGES)
        tma_store_dkv(dk_desc, dv_desc, dk_smem, dv_smem, row, col)


@gluon.jit
def wait_qdo_free(qdo_empty, n_iters, STAGES: gl.constexpr):
    """Until both warpgroups released the last STAGES Q_i / dO_i buffers (qdo_empty): after the loop, every buffer is
    then free (the producer loads nothing more)."""
    for k in range(gl.minimum(n_iters, STAGES)):
        t = n_iters - 1 - k
        mbarrier.wait(qdo_empty.index(t % STAGES), (t // STAGES) & 1)


@gluon.jit
def dkv_f32_stage(q_bufs, do_bufs, out_desc, wg: gl.constexpr):
    """Warpgroup wg's float32 (64, HEAD_D) staging tile for store_dkv_f32, in the free Q_i buffers (warpgroup 0) or
    dO_i buffers (warpgroup 1): one buffer where a buffer holds the tile's bytes (Br = 128 at d64), else all
    STAGES."""
    if wg == 0:
        bufs = q_bufs
    else:
        bufs = do_bufs
    BUF_BYTES: gl.constexpr = bufs.shape[1] * bufs.shape[2] * bufs.dtype.primitive_bitwidth // 8
    TILE_BYTES: gl.constexpr = out_desc.block_type.shape[0] * out_desc.block_type.shape[1] * 4
    if BUF_BYTES == TILE_BYTES:
        raw = bufs.index(0)
    else:
        gl.static_assert(bufs.shape[0] * BUF_BYTES == TILE_BYTES, "float32 dK / dV staging: buffer sizes")
        raw = bufs
    return _reinterpret(raw, gl.float32, out_desc.block_type.shape, out_desc.layout)


@gluon.jit
def store_dkv_f32(dk, dv, dk_desc, dv_desc, q_bufs, do_bufs, qdo_empty, row, col, n_iters, sm_scale,
                  wg: gl.constexpr, STAGES: gl.constexpr, ADD: gl.constexpr = False):
    """dK_w (scaled) and dV_w in float32 to rows [row, +64) of the tensors of dk_desc / dv_desc, one after the other
    through this warpgroup's float32 staging tile (dkv_f32_stage: shared memory holds one per warpgroup), each by
    one TMA store (ADD: reduce-add): no 16-bit rounding of a partial gradient that a caller (or the kernel's other
    programs) sums."""
    wait_qdo_free(qdo_empty, n_iters, STAGES)
    stage = dkv_f32_stage(q_bufs, do_bufs, dk_desc, wg)
    stage.store(dk * sm_scale)
    fence_async_shared()
    if ADD:
        tma_reduce_add(dk_desc, [row, col], stage)
    else:
        tma_store(dk_desc, [row, col], stage)
    tma.store_wait(pendings=0)   # (the store has read the tile)
    stage.store(dv)
    fence_async_shared()
    if ADD:
        tma_reduce_add(dv_desc, [row, col], stage)
    else:
        tma_store(dv_desc, [row, col], stage)
    tma.store_wait(pendings=0)


@gluon.jit
def stage_dkv(dk, dv, q_bufs, do_bufs, qdo_empty, n_iters, sm_scale, wg: gl.constexpr, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr):
    """dK_w (scaled) and dV_w in q's dtype in the Q_i / dO_i buffers, free once both warpgroups released the last
    STAGES of them (qdo_empty). Returns the two tiles."""
    dtype: gl.constexpr = q_bufs.dtype
    WG_N: gl.constexpr = dk.shape[0]
    wait_qdo_free(qdo_empty, n_iters, STAGES)
    if BLOCK_M == WG_N:   # a buffer per warpgroup
        dk_smem = q_bufs.index(wg)
        dv_smem = do_bufs.index(wg)
    else:                 # this warpgroup's rows of the first buffer
        dk_smem = q_bufs.index(0).slice(wg * WG_N, WG_N, dim=0)
        dv_smem = do_bufs.index(0).slice(wg * WG_N, WG_N, dim=0)
    dk_smem.store((dk * sm_scale).to(dtype))
    dv_smem.store(dv.to(dtype))
    return dk_smem, dv_smem


@gluon.jit
def tma_store_dkv(dk_desc, dv_desc, dk_smem, dv_smem, row, col):
    """Staged dK_w, dV_w to rows [row, +64) at column col by TMA, waited for (the stores have read shared memory
    before the program ends)."""
    fence_async_shared()
    tma_store(dk_desc, [row, col], dk_smem)
    tma_store(dv_desc, [row, col], dv_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def allocate(k_desc, v_desc, q_desc, do_desc, dq_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_D: gl.constexpr, STAGES: gl.constexpr, P_LAYOUT: gl.constexpr):
    """A backward program's shared memory: K_j, V_j, STAGES (Q_i, dO_i) buffers, each consumer warpgroup's P, two
    dS buffer pairs, each warpgroup's dQ staging tile; and its mbarriers, initialised (invalidate: their end)."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N // 2], P_LAYOUT)
    ds_bufs = gl.allocate_shared_memory(dtype, [4, BLOCK_M, BLOCK_N // 2], P_LAYOUT)   # [2 x buffer + half]
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):   # per dS buffer pair; both consumer warpgroups arrive
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=2)
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)

    return ((k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs),
            (kv_bar, qdo_ready, qdo_empty, ds_ready, ds_free, turns))


@gluon.jit
def invalidate(barriers, STAGES: gl.constexpr):
    kv_bar, qdo_ready, qdo_empty, ds_ready, ds_free, turns = barriers
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(ds_ready.index(i))
        mbarrier.invalidate(ds_free.index(i))
        mbarrier.invalidate(turns.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(qdo_ready.index(i))
        mbarrier.invalidate(qdo_empty.index(i))


@gluon.jit
def fa3_bwd_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, lse_ptr, delta_ptr, dk_desc, dv_desc, lse_strides, sizes,
                   scales, TILE: gl.constexpr, P_LAYOUT: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
                   HEADS: gl.constexpr, num_warps: gl.constexpr):
    """Grid (seqlen_k / BLOCK_N, batch * nheads_k); TILE (fa3.BwdTile): HEAD_D, BLOCK_N = 2 x 64 key rows (one
    64-row half per consumer warpgroup, num_warps = 4), BLOCK_M query rows per step, STAGES, PINGPONG.
    The argument groups: lse_strides (stride_lse_b, stride_lse_h), sizes (seqlen_q, seqlen_k, nheads_k, heads: the
    query heads of a program, group / SPLIT),
    scales (sm_scale = softmax_scale, qk_scale = softmax_scale log2 e). k/v descriptors: 2-D views (batch * seqlen_k,
    nheads_k * HEAD_D), blocks (BLOCK_N, HEAD_D); q/dO: (batch * seqlen_q, nheads * HEAD_D), blocks
    (BLOCK_M, HEAD_D); dk_desc / dv_desc: descriptors over dK, dV as k/v's, blocks (BLOCK_N / 2, HEAD_D) (one
    consumer warpgroup's rows); dq_desc: the float32 accumulator
    (zero-filled) in q's layout, blocks fa3.bwd_dq_tile: (64, HEAD_D) when BLOCK_M = 128 (each warpgroup adds half
    the rows of dQ_i), else (BLOCK_M, HEAD_D / 2) (half the columns).
    lse, delta: (batch, nheads, seqlen_q) fp32 with the same strides. P_LAYOUT: the shared layout of a
    (BLOCK_M, BLOCK_N / 2) tile of q's dtype (a warpgroup's P or dS). seqlen_q % BLOCK_M == 0 and
    seqlen_k % BLOCK_N == 0 (the host checks); causal only with seqlen_q == seqlen_k.
    SPLIT > 1 (GQA / MQA): a KV head's query heads are shared by SPLIT programs (grid (seqlen_k / BLOCK_N, batch *
    nheads_k * SPLIT)), each running heads = group / SPLIT of them and adding its dK_j, dV_j into zeroed float32
    accumulators (dk_desc / dv_desc) by TMA reduce-add: more, shorter programs where batch x nheads_k x key blocks
    are too few to balance over the SMs (fa3.bwd_split). HEADS (fa3.BWD_GQA_HEADS; 0: the division): a program's
    query heads (group / SPLIT) as a compile-time count, run innermost (_query_block)."""
    stride_lse_b, stride_lse_h = lse_strides
    seqlen_q, seqlen_k, nheads_k, heads = sizes
    sm_scale, qk_scale = scales
    HEAD_D: gl.constexpr = TILE.HEAD_D
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    STAGES: gl.constexpr = TILE.STAGES
    # program (key block, (b, hq)) runs query heads [hq * heads, +heads) of KV head hk = hq // SPLIT; one head's key
    # blocks after another: they share the head's Q_i, dO_i in L2 (every head's first block, then every head's
    # second... measured slower). heads comes from the host: computed here (group // SPLIT) it held a register
    # through the loop, where ptxas then spilled the step's state.
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // (nheads_k * SPLIT)
    hq = bh % (nheads_k * SPLIT)
    hk = hq // SPLIT
    kv_start = pid_n * BLOCK_N
    kv_row = b * seqlen_k + kv_start
    q_row0 = b * seqlen_q
    n_qblocks = seqlen_q // BLOCK_M
    i_start = 0
    if CAUSAL:   # query blocks entirely above the diagonal see none of this block's keys
        i_start = kv_start // BLOCK_M
    n_i = n_qblocks - i_start
    n_iters = n_i * heads

    buffers, barriers = allocate(k_desc, v_desc, q_desc, do_desc, dq_desc, BLOCK_M, BLOCK_N, HEAD_D, STAGES, P_LAYOUT)
    k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs = buffers
    kv_bar, qdo_ready, qdo_empty, ds_ready, ds_free, turns = barriers

    shared = (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, qdo_ready, qdo_empty, ds_ready,
              ds_free, turns, dq_desc, lse_ptr, delta_ptr, stride_lse_b, stride_lse_h, dk_desc, dv_desc, kv_row,
              hk * HEAD_D, b, kv_start, q_row0, n_iters, n_i, i_start, hq, heads, sm_scale, qk_scale)
    gl.warp_specialize([
        (_consumer_partition, (0, shared, TILE, CAUSAL, SPLIT > 1, HEADS)),
        (_consumer_partition, (1, shared, TILE, CAUSAL, SPLIT > 1, HEADS)),
        (_load_partition, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, qdo_ready,
                           qdo_empty, kv_row, hk * HEAD_D, q_row0, n_iters, n_i, i_start, hq, heads, BLOCK_M,
                           HEAD_D, STAGES, 0, 0, HEADS)),
    ], [4, 1], [240, 24])

    invalidate(barriers, STAGES)

"""FlashAttention-3's backward (_fa3_bwd.py) for every problem the dense kernel there does not take: any lengths
(a sequence may end inside a key block or a query block), causal and windows aligned bottom-right, softcap, ALiBi,
GQA and varlen (cu_seqlens), and flashtile.flex's features of a dense problem (score_mod with its derivative and
captured tensors' gradients, mask_mod, attn_bias without its gradient, bool masks, block masks: a key block visits
the query blocks its transposed lists name). The same program structure, producer and dQ path (imported from
_fa3_bwd), with the mask rule per step (_tile_mask: a query block that sees none of a warpgroup's keys skips its
products, one where some pair is hidden masks P), the forward's scores (_scores_log2, _user_scores) and dS through
score_mod's and softcap's derivatives, and dK / dV rows past a sequence stored by masked pointer stores instead of
TMA.

The dense kernel keeps the problems it takes (fa3.bwd decides): this kernel, compiled for them, measured slower on
an H100 (the same products, a different register allocation by ptxas).

Imported only on a CUDA device of compute capability 9.x (flashtile.kernels.gluon.fa3 decides).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from ._fa3_bwd import (LOG2E, _dq_product, _dq_reduce_add, _load_partition, _query_block, _store_ds,
                       allocate, dkv_dq_products, dp_product, invalidate, s_dp_products, s_product, skip_step,
                       stage_dkv, store_dkv_f32, tma_store_dkv, wait_qdo_free, warpgroup_state)
from ..elementwise import score_mod_grad
from ._fa3_fwd import (_alibi_distance_log2, _head_tile, _scores_log2, _seq_info, _sparse_row, _user_scores,
                       _visible, store_rows)


@gluon.jit
def _query_blocks(c0, c1, len_q, len_k, window, BLOCK_M: gl.constexpr, FEATURES: gl.constexpr):
    """The transpose of the forward's _key_blocks (the mask rule): query blocks [lo, hi) some of whose rows see a
    key of [c0, c1); at least one (a block no query sees computes one query block fully masked: dK = dV = 0)."""
    window_left, window_right = window
    shift = len_k - len_q
    lo = 0
    hi = gl.cdiv(len_q, BLOCK_M)
    if FEATURES.HAS_RIGHT:   # query i sees key j <= i + shift + right
        lo = gl.maximum(c0 - shift - window_right, 0) // BLOCK_M
    if FEATURES.HAS_LEFT:    # query i sees key j >= i + shift - left
        hi = gl.minimum(hi, gl.cdiv(gl.maximum(c1 - shift + window_left, 0), BLOCK_M))
    return lo, gl.maximum(hi, lo + 1)


@gluon.jit
def _tile_mask(r0, R: gl.constexpr, c0, C: gl.constexpr, len_q, len_k, window, FEATURES: gl.constexpr):
    """For rows [r0, r0 + R) against keys [c0, c0 + C) of a sequence: (no pair visible, some pair hidden) under
    the mask rule (the forward's _visible), the sequence's ends included."""
    window_left, window_right = window
    shift = len_k - len_q
    none = c0 < 0   # (False; the first term of the runtime flags)
    some = c0 < 0
    if FEATURES.TAIL:
        none = (c0 >= len_k) | (r0 >= len_q)
        some = (c0 + C > len_k) | (r0 + R > len_q)
    if FEATURES.HAS_RIGHT:   # keys past the last row's last visible key; past the first row's
        none = none | (c0 > r0 + R - 1 + shift + window_right)
        some = some | (c0 + C - 1 > r0 + shift + window_right)
    if FEATURES.HAS_LEFT:    # keys before the first row's first visible key; before the last row's
        none = none | (c0 + C - 1 < r0 + shift - window_left)
        some = some | (c0 < r0 + R - 1 + shift - window_left)
    return none, some | none


@gluon.jit
def _step(t, h, i, dk, dv, dq_row, dq_col, k_w, v_w, k_smem, q_bufs, do_bufs, p_smem, ds_bufs, dq_smem, qdo_ready,
          qdo_empty, ds_ready, ds_free, dq_desc, lse_ptr, delta_ptr, lse_row, kv_start, q_row0, sm_scale, qk_scale,
          seq, score, flex, wg: gl.constexpr, s_layout: gl.constexpr, dq_init, turns, TILE: gl.constexpr,
          FEATURES: gl.constexpr, FLEX: gl.constexpr):
    """Iteration t of consumer warpgroup wg: query block i of head h against the warpgroup's 64 keys (Algorithm 2
    lines 8-20); lse_row: the head's LSE / Delta row (lse_ptr, delta_ptr + lse_row); seq: (len_q, len_k,
    window); score: _scores_log2's (slope of head h). Returns dK_w, dV_w and where this step's dQ tile goes: it is
    computed at the next step (or after the loop). FEATURES.SKIP (a step may see none of the warpgroup's keys): a block
    whose rows see none of them (the mask rule: _tile_mask) computes no product but dQ_{t-1}, with dS_w = 0 for
    dQ_i; one where some pair is hidden masks P. flex: (user, partial, the captured tensors' gradient buffers) of
    flashtile.flex's features (_products)."""
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    STAGES: gl.constexpr = TILE.STAGES
    TAIL: gl.constexpr = FEATURES.TAIL
    WG_N: gl.constexpr = k_w.shape[0]
    # this warpgroup's dQ tile: rows [wg * 64, +64) when Br = 128, else columns [wg * d/2, +d/2)
    DQ_M: gl.constexpr = dq_init.shape[0]
    DQ_N: gl.constexpr = dq_init.shape[1]
    DQ_ROW: gl.constexpr = wg * DQ_M if DQ_M < BLOCK_M else 0
    DQ_COL: gl.constexpr = 0 if DQ_M < BLOCK_M else wg * DQ_N
    len_q, len_k, window = seq
    s = t % STAGES
    q_start = i * BLOCK_M
    c0 = kv_start + wg * WG_N
    # L_i and D_i (lines 8-9), loaded before the wait for Q_i, dO_i: their latency hides behind it
    q_idx = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    if TAIL:   # rows past the sequence: L = -inf (P = 0 below), D = 0
        lse = gl.load(lse_ptr + lse_row + q_idx, mask=q_idx < len_q, other=float("-inf"))
        delta = gl.load(delta_ptr + lse_row + q_idx, mask=q_idx < len_q, other=0.0)
    else:
        lse = gl.load(lse_ptr + lse_row + q_idx)
        delta = gl.load(delta_ptr + lse_row + q_idx)
    lse2 = lse * LOG2E
    if FEATURES.EMPTY:   # a row that saw no key (L = -inf) gets P = exp2(S - inf) = 0, not NaN
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse2)
    rows = (q_idx, lse2, delta)
    mbarrier.wait(qdo_ready.index(s), (t // STAGES) & 1)
    skip = False     # (constexpr False unless SKIP: a step then always computes)
    hidden = False   # (constexpr False without a mask rule or sequence ends: P is never masked)
    if FEATURES.HAS_LEFT or FEATURES.HAS_RIGHT or FEATURES.SKIP:
        none, hidden = _tile_mask(q_start, BLOCK_M, c0, WG_N, len_q, len_k, window, FEATURES)
        if FEATURES.SKIP:
            skip = none
    elif TAIL:   # sequence ends only, no skip path (fa3.BWD_TAIL_EVERY_STEP): every step bounds its keys
        hidden = True
    if FEATURES.MASK_EVERY_STEP:   # (fa3.BWD_MASK_EVERY_STEP: no branch around the mask, which costs registers)
        hidden = True
    if skip:
        skip_step(t, ds_bufs, ds_ready, ds_free, k_smem, dq_init, dq_desc, dq_smem, dq_row, dq_col, sm_scale, turns, wg,
                  s_layout, BLOCK_M, WG_N, TILE.PINGPONG)
    else:
        dk, dv = _products(t, q_start, c0, hidden, dk, dv, dq_row, dq_col, k_w, v_w, k_smem, q_bufs.index(s),
                           do_bufs.index(s), p_smem, ds_bufs, dq_smem, ds_ready, ds_free, dq_desc, rows, sm_scale,
                           qk_scale, seq, score, flex, wg, s_layout, dq_init, turns, TILE, FEATURES, FLEX)
    mbarrier.arrive(qdo_empty.index(s), count=1)   # Q_i, dO_i read by every product: the buffer may refill
    return dk, dv, q_row0 + q_start + DQ_ROW, h * TILE.HEAD_D + DQ_COL


@gluon.jit
def _products(t, q_start, c0, hidden, dk, dv, dq_row, dq_col, k_w, v_w, k_smem, q_s, do_s, p_smem, ds_bufs, dq_smem,
              ds_ready, ds_free, dq_desc, rows, sm_scale, qk_scale, seq, score, flex,
              wg: gl.constexpr, s_layout: gl.constexpr, dq_init, turns, TILE: gl.constexpr, FEATURES: gl.constexpr,
              FLEX: gl.constexpr):
    """Algorithm 2 lines 11-19 of a step: S, dP, P (masked where `hidden`: some pair of the tile is), dS, then
    dV_w, dK_w and dQ_{t-1}'s product. rows: the block's query indices, L_i (log2 units) and D_i. Returns dK_w,
    dV_w. flex: (user, partial, score_aux_grad): the forward's _user_scores on S (element masks where `partial`),
    dS through score_mod's derivative, its captured tensors' gradients added (this program is the only one that
    visits the tile)."""
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    PINGPONG: gl.constexpr = TILE.PINGPONG
    SOFTCAP: gl.constexpr = FEATURES.SOFTCAP
    ALIBI: gl.constexpr = FEATURES.ALIBI
    MASKED: gl.constexpr = FEATURES.HAS_LEFT or FEATURES.HAS_RIGHT or FEATURES.TAIL
    SCORE_MOD: gl.constexpr = FLEX.SCORE_MOD
    USER: gl.constexpr = SCORE_MOD is not None or FLEX.MASK_MOD is not None or FLEX.HAS_BIAS or FLEX.HAS_MASK
    user, partial, score_aux_grad = flex
    dtype: gl.constexpr = q_s.dtype
    WG_N: gl.constexpr = k_w.shape[0]
    len_q, len_k, window = seq
    q_idx, lse2, delta = rows
    # With a mask_mod, dP is issued once P is computed (DP_LATE), not beside S: its accumulator is then not live
    # while the mask_mod is evaluated, where ptxas spilled the step's state (same-run A/B on an H200: `git log -S
    # DP_LATE`). The flex head dims have no PINGPONG, whose turns this order does not take.
    DP_LATE: gl.constexpr = FLEX.MASK_MOD is not None
    if DP_LATE:
        gl.static_assert(not PINGPONG, "DP_LATE issues S and dP outside the PINGPONG turns")
        sc = s_product(q_s, k_w, s_layout, BLOCK_M)
    else:
        sc, dp_tok = s_dp_products(t, q_s, do_s, k_w, v_w, turns, wg, s_layout, BLOCK_M, PINGPONG)
    # line 13: P = exp(S * scale - L_i) (base 2; softcap / ALiBi: the forward's scores), 0 where the mask hides
    # the key
    # (the key indices are made where they are used: kept live across the step, they cost registers that the
    # step's accumulators need)
    if USER:
        cols = c0 + gl.arange(0, WG_N, layout=gl.SliceLayout(0, s_layout))
        s2, tanh = _scores_log2(sc, score, 0, SOFTCAP, False)
        if ALIBI:
            s2 = _alibi_distance_log2(s2, q_idx, c0, gl.arange(0, WG_N, layout=gl.SliceLayout(0, s_layout)), len_q,
                                      len_k, score[2])
        s2, s_in = _user_scores(s2, q_idx, cols, len_q, len_k, user, partial, FLEX)
        p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
    elif SOFTCAP or ALIBI:
        s2, tanh = _scores_log2(sc, score, 0, SOFTCAP, False)
        if ALIBI:
            s2 = _alibi_distance_log2(s2, q_idx, c0, gl.arange(0, WG_N, layout=gl.SliceLayout(0, s_layout)), len_q,
                                      len_k, score[2])
        p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
    else:   # (one FMA per element)
        p = gl.exp2(sc * qk_scale - gl.expand_dims(lse2, 1))
    if MASKED:
        if hidden:   # (a window's two edges by one compare: RANGE)
            p = _visible(p, q_idx, c0, gl.arange(0, WG_N, layout=gl.SliceLayout(0, s_layout)), len_q, len_k,
                         window, FEATURES, 0.0, True)
    if DP_LATE:   # (line 16)
        dp_tok = dp_product(do_s, v_w, s_layout, BLOCK_M)
    # P through shared memory: dV's A operand is P^T (keys x queries), a transposed read of the tile
    p_smem.store(p.to(dtype))
    if SOFTCAP and SCORE_MOD is None:   # (P stored: its registers hold P o (1 - tanh^2), dS's factor, not tanh too)
        p = p * (1.0 - tanh * tanh)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
    # line 17: dS = P o (dP - D_i); softcap: times d(softcap tanh(x / softcap)) / dx = 1 - tanh^2
    ds = p * (dp - gl.expand_dims(delta, 1))
    if SCORE_MOD is not None:   # (user: b, h, score_aux, ...)
        i2 = gl.expand_dims(q_idx, 1)
        j2 = gl.expand_dims(cols, 0)
        if FLEX.SCORE_CAPTURED_GRAD is not None:
            FLEX.SCORE_CAPTURED_GRAD(ds, s_in, user[0], user[1], i2, j2, user[2], score_aux_grad)
        ds = score_mod_grad(ds, s_in, user[0], user[1], i2, j2, user[2], FLEX.SCORE_GRAD)
    if SOFTCAP and SCORE_MOD is not None:
        ds = ds * (1.0 - tanh * tanh)
    ds_smem = _store_ds(ds.to(dtype), ds_bufs, ds_free, t, wg)
    # lines 14, 19 and dQ_{t-1}'s product (line 18)
    return dkv_dq_products(t, p_smem, ds_smem, q_s, do_s, dk, dv, k_smem, ds_bufs, ds_ready, ds_free, dq_init, dq_desc,
                           dq_smem, sm_scale, dq_row, dq_col, turns, wg, WG_N, BLOCK_M, PINGPONG)


@gluon.jit
def _consumer_partition(wg: gl.constexpr, shared, TILE: gl.constexpr, FEATURES: gl.constexpr, FLEX: gl.constexpr,
                        HEADS: gl.constexpr):
    """Consumer warpgroup `wg`: key rows [wg * 64, wg * 64 + 64) of the program's block through every query block
    (per query head of the group), then its rows of dK_j, dV_j (Algorithm 2 line 22). `shared`: the buffers,
    barriers, descriptors and scalars it uses (as the kernel names them), among them lse_rows: (stride_lse_b,
    stride_lse_h, the sequence's first LSE column); dkv: the dK / dV descriptors, pointers and row strides; seq:
    (len_q, len_k, window); alibi: (slopes, their batch stride, softcap log2 e); flex: (the key block's row of the
    block mask's transposed lists, the lists, score_aux, mask_aux, score_aux_grad, attn_bias's and the mask's
    pointers and strides) with a block mask's next query block read a step ahead of its use. HEADS: the kernel's
    (_query_block's order)."""
    (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, qdo_ready, qdo_empty, ds_ready, ds_free, turns,
     dq_desc, lse_ptr, delta_ptr, lse_rows, dkv, kv_row, kv_col, b, kv_start, q_row0, n_iters, n_i, i_start, hk, group,
     sm_scale, qk_scale, seq, alibi, flex) = shared
    srow, sparse, score_aux, mask_aux, score_aux_grad, bias_t, mask_t = flex
    HEAD_D: gl.constexpr = TILE.HEAD_D
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    SPARSE_BLOCK: gl.constexpr = FLEX.SPARSE_BLOCK
    WG_N: gl.constexpr = BLOCK_N // 2          # key rows of this warpgroup
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, WG_N, 16])
    stride_lse_b, stride_lse_h, lse_col0 = lse_rows
    alibi_ptr, stride_alibi_b, softcap_log2 = alibi
    dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dk_row, stride_dv_row = dkv
    len_q, len_k, window = seq
    k_w, v_w, p_smem, dq_smem, dk, dv, dq_init = warpgroup_state(wg, k_smem, v_smem, p_bufs, dq_bufs, dq_desc,
                                                                  BLOCK_N, HEAD_D)

    dq_row = q_row0   # where the previous step's dQ tile goes
    dq_col = 0
    blocks = (srow, sparse, len_q)
    h_next, i_next = _query_block(0, n_i, i_start, hk, group, blocks, SPARSE_BLOCK, BLOCK_M)
    # ALiBi where P is masked every step (fa3.BWD_MASK_EVERY_STEP): the slope of the group's first head (MHA's only
    # one) and its pointer taken before the loop; elsewhere each step loads its head's (which measured faster there)
    HOIST_SLOPE: gl.constexpr = FEATURES.ALIBI and FEATURES.MASK_EVERY_STEP
    if HOIST_SLOPE:
        slope_ptr = alibi_ptr + b * stride_alibi_b + hk * group
        slope_log2 = gl.load(slope_ptr) * LOG2E
    mbarrier.wait(kv_bar, 0)
    for t in range(n_iters):
        if SPARSE_BLOCK > 0:
            h = h_next
            i = i_next
            partial = (t % n_i) < srow[0]
            h_next, i_next = _query_block(gl.minimum(t + 1, n_iters - 1), n_i, i_start, hk, group, blocks,
                                          SPARSE_BLOCK, BLOCK_M)
        else:
            h, i = _query_block(t, n_i, i_start, hk, group, HEADS=HEADS)
            partial = True
        user = (b, h, score_aux, mask_aux, _head_tile(bias_t, b, h, FLEX.HAS_BIAS),
                _head_tile(mask_t, b, h, FLEX.HAS_MASK))
        if HOIST_SLOPE:
            if group > 1:   # (GQA: the step's query head's)
                slope_log2 = gl.load(slope_ptr + (h - hk * group)) * LOG2E
        else:
            slope_log2 = qk_scale * 0.0
            if FEATURES.ALIBI:
                slope_log2 = gl.load(alibi_ptr + b * stride_alibi_b + h) * LOG2E
        dk, dv, dq_row, dq_col = _step(
            t, h, i, dk, dv, dq_row, dq_col, k_w, v_w, k_smem, q_bufs, do_bufs, p_smem, ds_bufs, dq_smem,
            qdo_ready, qdo_empty, ds_ready, ds_free, dq_desc, lse_ptr, delta_ptr,
            b * stride_lse_b + h * stride_lse_h + lse_col0, kv_start, q_row0, sm_scale, qk_scale, seq,
            (qk_scale, softcap_log2, slope_log2), (user, partial, score_aux_grad), wg, s_layout, dq_init, turns,
            TILE, FEATURES, FLEX)
    # the last query block's dQ, issued first: dK_j and dV_j (line 22) are stored while it runs - by TMA, or (TAIL:
    # key rows past the sequence) by masked pointer stores
    dq_tok = _dq_product(ds_bufs, ds_ready, k_smem, dq_init, n_iters - 1, wg, WG_N, BLOCK_M)
    _store_dkv(dk, dv, dkv, q_bufs, do_bufs, qdo_empty, kv_row + wg * WG_N, kv_col, len_k - (kv_start + wg * WG_N),
               n_iters, sm_scale, wg, BLOCK_M, TILE.STAGES, FEATURES.TAIL)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
    _dq_reduce_add(dq_desc, dq_smem, dq * sm_scale, dq_row, dq_col)
    tma.store_wait(pendings=0)


@gluon.jit
def _store_dkv(dk, dv, dkv, q_bufs, do_bufs, qdo_empty, row, col, n_rows, n_iters, sm_scale, wg: gl.constexpr,
               BLOCK_M: gl.constexpr, STAGES: gl.constexpr, TAIL: gl.constexpr):
    """dK_w (scaled) and dV_w to rows [row, +64), staged as the dense kernel does (stage_dkv): one TMA store each,
    or (TAIL, fewer than 64 of the rows in the sequence: n_rows) masked pointer stores (store_rows); float32 tensors
    (gradients kept in float32) through float32 staging (store_dkv_f32), the tail's rows from registers
    (_store_dkv_rows_f32). dkv: the descriptors, pointers and row strides."""
    dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dk_row, stride_dv_row = dkv
    WG_N: gl.constexpr = dk.shape[0]
    HEAD_D: gl.constexpr = dk.shape[1]
    if dk_desc.dtype == gl.float32:
        if TAIL:
            if n_rows < WG_N:
                _store_dkv_rows_f32(dk, dv, dkv, qdo_empty, row, col, n_rows, n_iters, sm_scale, STAGES)
            else:
                store_dkv_f32(dk, dv, dk_desc, dv_desc, q_bufs, do_bufs, qdo_empty, row, col, n_iters, sm_scale,
                              wg, STAGES)
        else:
            store_dkv_f32(dk, dv, dk_desc, dv_desc, q_bufs, do_bufs, qdo_empty, row, col, n_iters, sm_scale, wg,
                          STAGES)
    else:
        dk_smem, dv_smem = stage_dkv(dk, dv, q_bufs, do_bufs, qdo_empty, n_iters, sm_scale, wg, BLOCK_M, STAGES)
        if TAIL:
            if n_rows < WG_N:
                store_rows(dk_smem, dk_ptr, stride_dk_row, row, n_rows, col, WG_N, HEAD_D)
                store_rows(dv_smem, dv_ptr, stride_dv_row, row, n_rows, col, WG_N, HEAD_D)
            else:
                tma_store_dkv(dk_desc, dv_desc, dk_smem, dv_smem, row, col)
        else:
            tma_store_dkv(dk_desc, dv_desc, dk_smem, dv_smem, row, col)


@gluon.jit
def _store_dkv_rows_f32(dk, dv, dkv, qdo_empty, row, col, n_rows, n_iters, sm_scale, STAGES: gl.constexpr):
    """dK_w (scaled) and dV_w in float32 to rows row + [0, n_rows) by pointer stores from registers (the key rows
    past a sequence belong to the next one, which a TMA store would overwrite)."""
    dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dk_row, stride_dv_row = dkv
    WG_N: gl.constexpr = dk.shape[0]
    HEAD_D: gl.constexpr = dk.shape[1]
    wait_qdo_free(qdo_empty, n_iters, STAGES)   # (as the staged stores: the other warpgroup's steps have ended)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, HEAD_D, 16])   # (dK_w's: warpgroup_state)
    r = gl.arange(0, WG_N, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    keep = gl.expand_dims(r < n_rows, 1) & gl.expand_dims(d < HEAD_D, 0)
    rows = gl.expand_dims((row + r).to(gl.int64), 1)
    cols = gl.expand_dims((col + d).to(gl.int64), 0)
    gl.store(dk_ptr + rows * stride_dk_row + cols, dk * sm_scale, mask=keep)
    gl.store(dv_ptr + rows * stride_dv_row + cols, dv, mask=keep)


@gluon.jit
def fa3_bwd_any_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, lse_ptr, delta_ptr, dk_desc, dv_desc, dk_ptr, dv_ptr,
                       cu_seqlens_q, cu_seqlens_k, alibi_ptr, flex, strides, sizes, scales, window,
                       TILE: gl.constexpr, P_LAYOUT: gl.constexpr, FEATURES: gl.constexpr, FLEX: gl.constexpr,
                       num_warps: gl.constexpr, HEADS: gl.constexpr = 0):
    """Grid (cdiv(seqlen_k, BLOCK_N), batch * nheads_k); TILE (fa3.BwdTile): HEAD_D, BLOCK_N = 2 x 64 key rows (one
    64-row half per consumer warpgroup, num_warps = 4), BLOCK_M query rows per step, STAGES, PINGPONG. k/v
    descriptors: 2-D views (rows, nheads_k * HEAD_D), blocks (BLOCK_N, HEAD_D); q/dO: (rows, nheads * HEAD_D), blocks
    (BLOCK_M, HEAD_D); rows = batch * seqlen (dense) or tokens (VARLEN: cu_seqlens, seqlen_q / seqlen_k the
    longest, seqlen_q >= 2); dk_desc / dv_desc: descriptors over dK, dV as k/v's, blocks (BLOCK_N / 2, HEAD_D) (one
    consumer warpgroup's rows), dk_ptr / dv_ptr with their row strides for the rows TMA must not write (TAIL);
    dq_desc: the float32 accumulator (zero-filled) in q's layout, blocks fa3.bwd_dq_tile: (64, HEAD_D) when
    BLOCK_M = 128 (each warpgroup adds half the rows of dQ_i), else (BLOCK_M, HEAD_D / 2) (half the columns); a
    query block past its sequence adds exact zeros there. lse, delta: (batch, nheads, seqlen_q) or (VARLEN,
    stride_lse_b = 0) (nheads, total_q) fp32 with the same strides. P_LAYOUT: the shared layout of a (BLOCK_M,
    BLOCK_N / 2) tile of q's dtype (a warpgroup's P or dS). The argument groups:
    - flex: (bias_t, mask_t, sparse, score_aux, mask_aux, score_aux_grad, order_ptr) (after the live tensors, as
      fa3_fwd_kernel's);
    - strides: (stride_lse_b, stride_lse_h, stride_dk_row, stride_dv_row, stride_alibi_b);
    - sizes: (seqlen_q, seqlen_k, nheads_k, group); scales: (sm_scale = softmax_scale, qk_scale, softcap_log2);
      window: (window_left, window_right).
    FEATURES as fa3_fwd_kernel's (HAS_LEFT / HAS_RIGHT windows, SOFTCAP, ALIBI, TAIL: a sequence may end inside
    a block; qk_scale and softcap_log2 as there); SKIP: a query block may see none of a warpgroup's keys (else
    every step computes); EMPTY: a query row may have no key or lie past its sequence; SAME_SEQS (VARLEN): the
    queries and keys are the same sequences (cu_seqlens_q is cu_seqlens_k, fa3.BWD_SAME_SEQS), one row offset and
    one length per sequence (_seq_info).
    FLEX, flashtile.flex's features, as fa3_fwd_kernel's (bias_t, mask_t, score_aux, mask_aux; sparse: the block
    mask's transposed lists, per key block its query blocks, one list for the program's group of query heads),
    plus score_mod's derivative SCORE_GRAD (None: additive) and SCORE_CAPTURED_GRAD adding its captured tensors'
    gradients into score_aux_grad's buffers (fa3.flex_args); with a block mask, order_ptr: the programs' (head, key
    block) pairs as bh * n_key_blocks + key block, those with the most listed query blocks first (a key block every
    query sees, such as attention sinks', is the longest program: started last, it would end the launch alone).
    Without one: one head's key blocks after another: they share the head's Q_i, dO_i in L2 (every head's first
    block, then every head's second... measured slower).
    HEADS (fa3.BWD_ANY_GQA_HEADS; 0: the division; not with a block mask): the group as a compile-time count, its
    heads run innermost (_query_block)."""
    HEAD_D: gl.constexpr = TILE.HEAD_D
    SPARSE_BLOCK: gl.constexpr = FLEX.SPARSE_BLOCK
    gl.static_assert(HEADS == 0 or SPARSE_BLOCK == 0, "HEADS: no block mask")
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    STAGES: gl.constexpr = TILE.STAGES
    stride_lse_b, stride_lse_h, stride_dk_row, stride_dv_row, stride_alibi_b = strides
    seqlen_q, seqlen_k, nheads_k, group = sizes
    sm_scale, qk_scale, softcap_log2 = scales
    bias_t, mask_t, sparse, score_aux, mask_aux, score_aux_grad, order_ptr = flex
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    if SPARSE_BLOCK > 0:
        pair = gl.load(order_ptr + bh * gl.num_programs(0) + pid_n)
        pid_n = pair % gl.num_programs(0)
        bh = pair // gl.num_programs(0)
    b = bh // nheads_k
    hk = bh % nheads_k
    q_row0, k_row0, len_q, len_k = _seq_info(b, (cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k), FEATURES.VARLEN,
                                             FEATURES.SAME_SEQS)
    kv_start = pid_n * BLOCK_N
    if FEATURES.VARLEN:   # (the grid counts the longest sequence's key blocks)
        if kv_start >= len_k:
            return
    kv_row = k_row0 + kv_start
    if SPARSE_BLOCK > 0:   # the query blocks the block mask lists for this key block (at least one: _sparse_steps)
        srow = _sparse_row(sparse, b, hk * group, kv_start, SPARSE_BLOCK, BLOCK_M)
        i_start = 0
        n_i = gl.maximum(srow[1], 1)
    else:
        srow = (0, 0, 0)
        i_start, i_end = _query_blocks(kv_start, kv_start + BLOCK_N, len_q, len_k, window, BLOCK_M, FEATURES)
        n_i = i_end - i_start
    n_iters = n_i * group
    lse_col0 = 0
    if FEATURES.VARLEN:
        lse_col0 = q_row0

    buffers, barriers = allocate(k_desc, v_desc, q_desc, do_desc, dq_desc, BLOCK_M, BLOCK_N, HEAD_D, STAGES, P_LAYOUT)
    k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs = buffers
    kv_bar, qdo_ready, qdo_empty, ds_ready, ds_free, turns = barriers

    seq = (len_q, len_k, window)
    lse_rows = (stride_lse_b, stride_lse_h, lse_col0)
    dkv = (dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dk_row, stride_dv_row)
    alibi = (alibi_ptr, stride_alibi_b, softcap_log2)
    flex = (srow, sparse, score_aux, mask_aux, score_aux_grad, bias_t, mask_t)
    shared = (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, qdo_ready, qdo_empty, ds_ready,
              ds_free, turns, dq_desc, lse_ptr, delta_ptr, lse_rows, dkv, kv_row, hk * HEAD_D, b, kv_start, q_row0,
              n_iters, n_i, i_start, hk, group, sm_scale, qk_scale, seq, alibi, flex)
    gl.warp_specialize([
        (_consumer_partition, (0, shared, TILE, FEATURES, FLEX, HEADS)),
        (_consumer_partition, (1, shared, TILE, FEATURES, FLEX, HEADS)),
        (_load_partition, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, qdo_ready,
                           qdo_empty, kv_row, hk * HEAD_D, q_row0, n_iters, n_i, i_start, hk, group, BLOCK_M,
                           HEAD_D, STAGES, (srow, sparse, len_q), SPARSE_BLOCK, HEADS)),
    ], [4, 1], [240, 24])

    invalidate(barriers, STAGES)

"""FlashAttention-2 backward (FA2 paper, Dao 2023, Algorithm 2) in Triton.

Three launches, no atomics, so gradients are bitwise reproducible (exceptions: the gradient of an attn_bias
that broadcasts over some dimension, summed over it with fp32 atomics in the dK/dV kernel; and a config with
atomic_dq, which adds dQ inside the dK/dV kernel instead of step 3 unless deterministic=True):
  1. preprocess:  D_i = rowsum(dO_i o O_i)                                    (Alg. 2 line 4)
  2. dK/dV:       one program per key block K_j, V_j of one K/V head; it loops over the query blocks that
                  see it (and, for GQA, over every query head of its group), recomputing P from L and
                  accumulating dK_j, dV_j on chip                             (Alg. 2 lines 6-21)
  3. dQ:          one program per query block Q_i, looping over its key blocks (the second pass FA2 offers
                  instead of atomic adds of dQ_i)
Scores are recomputed exactly as the forward computed them (mods.py), so P = exp2(S*log2e - L*log2e).
A block mask (FLEX.SPARSE_BLOCK > 0) swaps the range loops for FA1 Alg. 5's: only the tiles it lists.
"""
import triton
import triton.language as tl

from ..params import Flex
from .mods import (block_indices, dropout_keep, first_row, head_lse, head_rows, head_scalars, head_tile, key_range,
                   load_lse2, load_tile, load_tile_pair, mma, present, query_block, query_head, query_range,
                   score_mod_grad, score_mods_log2, scores_log2, seq_bounds, sequences, sparse_tile_start, sparse_tiles,
                   tile_order, to_dtype)

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def attn_bwd_preprocess_kernel(O, DO, Delta, DQ_ACC, CU_SEQLENS_Q, o_strides, do_strides, lse_strides, dq_strides,
                               problem, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
                               ZERO_DQ: tl.constexpr):
    """FA2 Alg. 2 line 4: D_i = rowsum(dO_i o O_i) for BLOCK_M rows of one (batch, head). ZERO_DQ: the same rows of
    the float32 dQ accumulator (a backward that adds dQ_i into it) are zeroed here, so no separate fill runs.
    O, DO, DQ_ACC as Q (dense or varlen; CU_SEQLENS_Q where IS_VARLEN), Delta as the LSE; o_strides, do_strides,
    dq_strides: their (batch, row, head) strides, lse_strides: Delta's (batch, head); problem: (nheads, seqlen_q
    (the longest where varlen), head dim)."""
    stride_ob, stride_om, stride_oh = o_strides
    stride_dob, stride_dom, stride_doh = do_strides
    stride_lse_b, stride_lse_h = lse_strides
    stride_dqb, stride_dqm, stride_dqh = dq_strides
    nheads, seqlen_q_static, head_dim = problem
    pid_m = tl.program_id(0)
    b, h, _ = query_head(tl.program_id(1), nheads, 1)
    q_start, seqlen_q = seq_bounds(b, CU_SEQLENS_Q, seqlen_q_static, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    rows = (q_start + offs_m).to(tl.int64)
    o = to_dtype(tl.load(O + tl.cast(b, tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_om
                         + offs_d[None, :], mask=mask, other=0.0), tl.float32)
    do = to_dtype(tl.load(DO + tl.cast(b, tl.int64) * stride_dob + h * stride_doh + rows[:, None] * stride_dom
                          + offs_d[None, :], mask=mask, other=0.0), tl.float32)
    tl.store(Delta + tl.cast(b, tl.int64) * stride_lse_b + tl.cast(h, tl.int64) * stride_lse_h + rows, tl.sum(o * do, 1),
             mask=offs_m < seqlen_q)
    if ZERO_DQ:
        tl.store(DQ_ACC + tl.cast(b, tl.int64) * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm
                 + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=mask)


@triton.jit
def _dkdv_tile(dk, dv, start_m, row, MASKED: tl.constexpr, ELEMENT_MASKS: tl.constexpr, FEATURES: tl.constexpr,
               FLEX: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr,
               DQ_TMA: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DBIAS: tl.constexpr,
               DBIAS_ATOMIC: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr):
    """Alg. 2 lines 8-20 for one query block Q_i against the program's K_j, V_j, in transposed form
    (S^T, P^T: keys along rows) so dK_j and dV_j accumulate without transposing P. With ATOMIC_DQ the
    same tile also adds its dQ_i contribution (line 15) to an fp32 buffer with atomics.
    row: what every step reads for the current query head (packed by attn_bwd_dkdv_kernel); MASKED /
    ELEMENT_MASKS: which per-element masks this tile needs (mods.score_mods_log2).
    COMPUTE_DK / COMPUTE_DV: a launch may do only one of the two (two launches then split the work: each
    keeps one BLOCK_N x d accumulator instead of two, for large head dims; S is recomputed by both)."""
    (k, v, desc_q, desc_do, desc_dq, q_head, do_head, dq_head, lse_blk, delta_blk, q_row0, b, h, offs_m_rel, offs_n,
     offs_d, seqlen_q, seqlen_k, stride_qm, stride_dom, stride_dqm, head_dim, sm_scale, scale, alibi_slope_log2, window,
     dropout, rng_base, bias, mask, dbias, score_aux, mask_aux, score_aux_grad) = row
    dropout_p, _, _, _, _, _ = dropout
    q_blk = q_head + tl.cast(start_m, tl.int64) * stride_qm
    do_blk = do_head + tl.cast(start_m, tl.int64) * stride_dom
    dq_blk = dq_head + tl.cast(start_m, tl.int64) * stride_dqm
    q_row = q_row0 + start_m
    offs_m = start_m + offs_m_rel
    q = load_tile(desc_q, q_blk, q_row, h, offs_m_rel, offs_d, offs_m, seqlen_q, stride_qm, head_dim,
                  MASKED, EVEN_D, USE_TMA, BLOCK_D)                      # Q_i  (BLOCK_M, BLOCK_D)
    do = load_tile(desc_do, do_blk, q_row, h, offs_m_rel, offs_d, offs_m, seqlen_q, stride_dom, head_dim,
                   MASKED, EVEN_D, USE_TMA, BLOCK_D)                     # dO_i (BLOCK_M, BLOCK_D)
    qt = tl.trans(q)
    lse2 = load_lse2(lse_blk, offs_m, seqlen_q)
    delta = tl.load(delta_blk + offs_m, mask=offs_m < seqlen_q, other=0.0)
    i = offs_m[None, :]
    j = offs_n[:, None]
    # Alg. 2 lines 9-11: recompute S_ij^T = K_j Q_i^T and P_ij^T = exp(S^T - L_i)
    qkt = mma(k, qt, None, DOT_PREC)
    st, t = scores_log2(qkt, i, j, seqlen_q, seqlen_k, scale, alibi_slope_log2, FEATURES.SOFTCAP, FEATURES.ALIBI)
    st, st_in = score_mods_log2(st, b, h, i, j, seqlen_q, seqlen_k, window, bias, mask, score_aux, mask_aux, MASKED,
                                ELEMENT_MASKS, FEATURES, FLEX)
    pt = tl.math.exp2(st - lse2[None, :])
    keep = None
    if FEATURES.DROPOUT:
        keep = dropout_keep(dropout, rng_base, i, j)
    if COMPUTE_DK:
        # issued before the dV product, the order the single-launch kernel was tuned with
        dpt = mma(v, tl.trans(do), None, DOT_PREC)     # (dO_i V_j^T)^T
    if COMPUTE_DV:
        # Alg. 2 line 12 (FA1 Alg. 4 lines 13-16 with dropout): dV_j += (P o Z / (1-p))^T dO_i
        if FEATURES.DROPOUT:
            pdt = tl.where(keep, pt, 0.0) * (1.0 / (1.0 - dropout_p))
        else:
            pdt = pt
        dv = mma(to_dtype(pdt, do.dtype), do, dv, DOT_PREC)
    if COMPUTE_DK:
        dk = _dk_step(dk, pt, dpt, qt, k, delta, st_in, t, keep, b, h, i, j, offs_m, offs_m_rel, offs_d, dq_blk,
                      desc_dq, q_row, stride_dqm, seqlen_q, seqlen_k, head_dim, sm_scale, dropout_p, dbias, score_aux,
                      score_aux_grad, MASKED, EVEN_D, FEATURES, FLEX, DOT_PREC, ATOMIC_DQ, DQ_TMA, BLOCK_D, HAS_DBIAS,
                      DBIAS_ATOMIC)
    return dk, dv


@triton.jit
def _dk_step(dk, pt, dpt, qt, k, delta, st_in, t, keep, b, h, i, j, offs_m, offs_m_rel, offs_d, dq_blk,
             desc_dq, q_row, stride_dqm, seqlen_q, seqlen_k, head_dim, sm_scale, dropout_p, dbias, score_aux,
             score_aux_grad, MASKED: tl.constexpr, EVEN_D: tl.constexpr, FEATURES: tl.constexpr, FLEX: tl.constexpr,
             DOT_PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, BLOCK_D: tl.constexpr,
             HAS_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr):
    """Alg. 2 lines 13-16 of one tile (transposed), given dP^T: dS^T, dK_j += dS^T Q_i (and the atomic dQ_i,
    dBias and score_mod-captured gradients, which all need dS). dbias: head_tile's (pointer, row stride, column
    stride) of dBias."""
    if FEATURES.DROPOUT:
        dpt = tl.where(keep, dpt, 0.0) * (1.0 / (1.0 - dropout_p))
    # Alg. 2 line 14: dS_ij = P_ij o (dP_ij - D_i); softcap multiplies by d(cap tanh(x))/dx = 1 - tanh^2
    dst = pt * (dpt - delta[None, :])
    if FLEX.SCORE_MOD is not None:
        # through score_mod: its captured tensors' gradients (this kernel visits each tile once, so they are
        # accumulated here only, not again in the dQ pass), then dS w.r.t. its input
        if FLEX.SCORE_CAPTURED_GRAD is not None:
            FLEX.SCORE_CAPTURED_GRAD(dst, st_in, b, h, i, j, score_aux, score_aux_grad)
        dst = score_mod_grad(dst, st_in, b, h, i, j, score_aux, FLEX.SCORE_GRAD)
    if HAS_DBIAS:
        # dBias = dS, the gradient of the score after softcap (bias is added there, before score_mod). This program
        # is the only one that visits tile (b, h, i-block, j-block): a full-shape bias takes plain stores; a
        # broadcast one sums over its broadcast dimensions with atomics into an fp32 buffer.
        dbias_bh, stride_dbias_m, stride_dbias_n = dbias
        db_ptrs = dbias_bh + i.to(tl.int64) * stride_dbias_m + j.to(tl.int64) * stride_dbias_n
        db_mask = (i < seqlen_q) & (j < seqlen_k)
        if DBIAS_ATOMIC:
            tl.atomic_add(db_ptrs, dst, mask=db_mask, sem="relaxed")
        else:
            tl.store(db_ptrs, dst, mask=db_mask)
    if FEATURES.SOFTCAP:
        dst = dst * (1.0 - t * t)
    # Alg. 2 line 16: dK_j += dS_ij^T Q_i   (the softmax scale tau is applied once at the end)
    dk = mma(to_dtype(dst, qt.dtype), tl.trans(qt), dk, DOT_PREC)
    if ATOMIC_DQ:
        # Alg. 2 line 15: dQ_i += tau dS_ij K_j, read-modify-write in HBM (FA2's atomic variant)
        dq = mma(to_dtype(tl.trans(dst), k.dtype), k, None, DOT_PREC) * sm_scale
        if DQ_TMA:
            # FA3's dQ write: one asynchronous bulk reduce-add of the tile (cp.reduce.async.bulk.tensor), done by
            # the L2 instead of BLOCK_M * BLOCK_D scalar atomics. Rows past the sequence end hold exact zeros
            # (P = 0 there), so a tile reaching into the next sequence's rows adds nothing to them.
            desc_dq.atomic_add([q_row, h * BLOCK_D], dq)
        else:
            dq_ptrs = dq_blk + offs_m_rel[:, None] * stride_dqm + offs_d[None, :]
            if MASKED or not EVEN_D:
                tl.atomic_add(dq_ptrs, dq, mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim),
                              sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk


@triton.jit(do_not_specialize=["head_group"])
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQ_ACC, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, desc_q, desc_do, desc_dq,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, dq_strides, lse_strides, stride_alibi_b,
    problem, sm_scale, scale, window, dropout, bias, mask, dbias, sparse,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr, FEATURES: tl.constexpr, DQ_TMA: tl.constexpr = False,
    HAS_DBIAS: tl.constexpr = False, DBIAS_ATOMIC: tl.constexpr = False, score_aux=None, mask_aux=None,
    score_aux_grad=None, FLEX: tl.constexpr = Flex(), SPARSE_FULL_MASKED: tl.constexpr = True,
    COMPUTE_DK: tl.constexpr = True, COMPUTE_DV: tl.constexpr = True, GROUPED: tl.constexpr = False, head_group=1,
):
    """One program per key block of BLOCK_N rows and (batch, K/V head); grid (key blocks, batch * nheads_k).
    The tensors (each call's own; a launch template binds the rest): Q, K, V, LSE, CU_SEQLENS_*, ALIBI_SLOPES as
    attn_fwd_kernel's; DO as Q, Delta (D) as LSE; DK, DV as K, V; DQ_ACC: the fp32 dQ accumulator (ATOMIC_DQ) as Q;
    desc_q, desc_do: TMA descriptors over Q, dO (USE_TMA), desc_dq over DQ_ACC (DQ_TMA). FEATURES, FLEX as
    attn_fwd_kernel's (FLEX with score_mod's derivative SCORE_GRAD and SCORE_CAPTURED_GRAD, which adds its captured
    tensors' gradients into score_aux_grad). The groups:
    - q_strides ... dq_strides: (batch, row, head) strides of Q, K, V, dO, dK, dV and DQ_ACC; lse_strides: (batch,
      head) of LSE and Delta;
    - problem: (nheads_k, query heads per K/V head, seqlen_q, seqlen_k (the longest where varlen), head dim);
    - sm_scale: the softmax scale tau (dK = tau dS^T Q); scale, window, dropout, bias, mask as attn_fwd_kernel's;
    - dbias: dBias's (pointer, batch, head, row and column strides) (HAS_DBIAS; runtime.pair_args);
    - sparse: the block mask's transposed lists (q_num, q_idx, full_q_num, full_q_idx, batch, head and
      block-column strides, blocks per index row) (FLEX.SPARSE_BLOCK > 0; runtime.sparse_args)."""
    SPARSE_BLOCK: tl.constexpr = FLEX.SPARSE_BLOCK
    nheads_k, group_size, seqlen_q_static, _, head_dim = problem
    # causal: the first key blocks are seen by the most queries: the grid's order already runs them first
    pid_n, bhk = tile_order(head_group, GROUPED, False)
    b, hk, _ = query_head(bhk, nheads_k, 1)
    q_start, seqlen_q, k_start, seqlen_k = sequences(b, CU_SEQLENS_Q, CU_SEQLENS_K, problem, FEATURES.VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:
        return
    b64 = tl.cast(b, tl.int64)
    offs_n, offs_m_rel, offs_d, kv_rows, kv_mask = block_indices(start_n, k_start, seqlen_k, head_dim, BLOCK_N, BLOCK_M,
                                                                 BLOCK_D)
    # Alg. 2 line 6: load K_j, V_j; line 7: dK_j = dV_j = 0 (on chip)
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    k = tl.load(K + b64 * stride_kb + hk * stride_kh + kv_rows[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + hk * stride_vh + kv_rows[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    window_left, window_right = window
    lo, full_lo, full_hi, hi = query_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                           BLOCK_M, BLOCK_N, FEATURES.HAS_LEFT, FEATURES.HAS_RIGHT)
    q_row0 = first_row(b, q_start, seqlen_q_static, FEATURES.VARLEN)
    # GQA: dK_j, dV_j of K/V head hk sum the contributions of all group_size query heads that read it.
    for g in range(0, group_size):
        h = hk * group_size + g
        alibi_slope_log2, rng_base = head_scalars(b, h, ALIBI_SLOPES, stride_alibi_b, dropout, FEATURES.ALIBI)
        q_head, stride_qm = head_rows(Q, q_strides, b64, h, q_start)
        do_head, stride_dom = head_rows(DO, do_strides, b64, h, q_start)
        dq_head, stride_dqm = head_rows(DQ_ACC, dq_strides, b64, h, q_start)
        lse_head = head_lse(LSE, lse_strides, b64, h, q_start)
        delta_head = head_lse(Delta, lse_strides, b64, h, q_start)
        head_bias = head_tile(bias, b64, h, FLEX.HAS_BIAS)
        head_mask = head_tile(mask, b64, h, FLEX.HAS_MASK)
        head_dbias = head_tile(dbias, b64, h, HAS_DBIAS)
        # what every tile step reads for query head h (one tuple: each call site names only the tile and its masks)
        row = (k, v, present(desc_q), present(desc_do), present(desc_dq), q_head, do_head, dq_head, lse_head,
               delta_head, q_row0, b, h, offs_m_rel, offs_n, offs_d, seqlen_q, seqlen_k, stride_qm, stride_dom,
               stride_dqm, head_dim, sm_scale, scale, alibi_slope_log2, window, dropout, rng_base, head_bias,
               head_mask, head_dbias, present(score_aux), present(mask_aux), present(score_aux_grad))
        if SPARSE_BLOCK > 0:
            # FA1 Alg. 5 transposed: only the query blocks the block mask lists for this key block
            Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, stride_sp_b, stride_sp_h, stride_sp_n, sparse_blocks = sparse
            sp = b64 * stride_sp_b + tl.cast(h, tl.int64) * stride_sp_h + (start_n // SPARSE_BLOCK) * stride_sp_n
            # the listed blocks the mask cuts (through the element masks), then the full ones (through none; the
            # bounds mask only where SPARSE_FULL_MASKED)
            for full in tl.static_range(2):
                for t in range(0, sparse_tiles((Q_NUM, FULL_Q_NUM)[full], sp, SPARSE_BLOCK, BLOCK_M)):
                    start_m = sparse_tile_start((Q_IDX, FULL_Q_IDX)[full], sp, t, sparse_blocks, SPARSE_BLOCK,
                                                BLOCK_M)
                    dk, dv = _dkdv_tile(dk, dv, start_m, row, (True, SPARSE_FULL_MASKED)[full], (True, False)[full],
                                        FEATURES, FLEX, EVEN_D, DOT_PREC, ATOMIC_DQ, DQ_TMA, USE_TMA, BLOCK_D,
                                        HAS_DBIAS, DBIAS_ATOMIC, COMPUTE_DK, COMPUTE_DV)
        else:
            # Alg. 2 line 8: for i = 1..Tr (only the query blocks that can see this key block): those of [lo, full_lo)
            # and [full_hi, hi) straddle a mask edge or the end of Q and take the masked path, those between skip it
            bounds = (lo, full_lo, full_hi, hi)
            for part in tl.static_range(3):
                for start_m in range(bounds[part], bounds[part + 1], BLOCK_M):
                    dk, dv = _dkdv_tile(dk, dv, start_m, row, part != 1, True, FEATURES, FLEX, EVEN_D, DOT_PREC,
                                        ATOMIC_DQ, DQ_TMA, USE_TMA, BLOCK_D, HAS_DBIAS, DBIAS_ATOMIC, COMPUTE_DK,
                                        COMPUTE_DV)
    # Alg. 2 line 21: write dK_j (with the softmax scale tau of dK = tau dS^T Q), dV_j
    if COMPUTE_DK:
        stride_dkb, stride_dkn, stride_dkh = dk_strides
        dk = dk * sm_scale
        tl.store(DK + b64 * stride_dkb + hk * stride_dkh + kv_rows[:, None] * stride_dkn + offs_d[None, :],
                 to_dtype(dk, DK.dtype.element_ty), mask=kv_mask)
    if COMPUTE_DV:
        stride_dvb, stride_dvn, stride_dvh = dv_strides
        tl.store(DV + b64 * stride_dvb + hk * stride_dvh + kv_rows[:, None] * stride_dvn + offs_d[None, :],
                 to_dtype(dv, DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tile(dq, start_n, row, MASKED: tl.constexpr, ELEMENT_MASKS: tl.constexpr, FEATURES: tl.constexpr,
             FLEX: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """dQ_i += dS_ij K_j (Alg. 2 line 15), recomputing S_ij, P_ij and dP_ij for one key block; row: what every
    step of this program reads (packed by attn_bwd_dq_kernel); MASKED / ELEMENT_MASKS as _dkdv_tile's."""
    (q, do, lse2, delta, desc_k, desc_v, k_base, v_base, kv_row0, b, h, hk, offs_m, offs_n_rel, offs_d, seqlen_q,
     seqlen_k, stride_kn, stride_vn, head_dim, scale, alibi_slope_log2, window, dropout, rng_base, bias, mask,
     score_aux, mask_aux) = row
    k, v, cols = load_tile_pair(desc_k, desc_v, k_base, v_base, kv_row0, hk, start_n, offs_n_rel, offs_d, seqlen_k,
                                stride_kn, stride_vn, head_dim, MASKED, EVEN_D, USE_TMA, BLOCK_D)
    kt = tl.trans(k)
    vt = tl.trans(v)
    i = offs_m[:, None]
    j = cols[None, :]
    qk = mma(q, kt, None, DOT_PREC)
    s, t = scores_log2(qk, i, j, seqlen_q, seqlen_k, scale, alibi_slope_log2, FEATURES.SOFTCAP, FEATURES.ALIBI)
    s, s_in = score_mods_log2(s, b, h, i, j, seqlen_q, seqlen_k, window, bias, mask, score_aux, mask_aux, MASKED,
                              ELEMENT_MASKS, FEATURES, FLEX)
    p = tl.math.exp2(s - lse2[:, None])
    dp = mma(do, vt, None, DOT_PREC)
    if FEATURES.DROPOUT:
        keep = dropout_keep(dropout, rng_base, i, j)
        dropout_p, _, _, _, _, _ = dropout
        dp = tl.where(keep, dp, 0.0) * (1.0 / (1.0 - dropout_p))
    ds = p * (dp - delta[:, None])
    if FLEX.SCORE_MOD is not None:
        ds = score_mod_grad(ds, s_in, b, h, i, j, score_aux, FLEX.SCORE_GRAD)
    if FEATURES.SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = mma(to_dtype(ds, kt.dtype), tl.trans(kt), dq, DOT_PREC)
    return dq


@triton.jit(do_not_specialize=["head_group"])
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, desc_k, desc_v,
    q_strides, k_strides, v_strides, do_strides, dq_strides, lse_strides, stride_alibi_b,
    problem, sm_scale, scale, window, dropout, bias, mask, sparse,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_TMA: tl.constexpr, FEATURES: tl.constexpr, score_aux=None, mask_aux=None, FLEX: tl.constexpr = Flex(),
    SPARSE_FULL_MASKED: tl.constexpr = True, REVERSE: tl.constexpr = False, GROUPED: tl.constexpr = False,
    head_group=1,
):
    """One program per query block of BLOCK_M rows and (batch, head); grid (query blocks, batch * nheads).
    The tensors and groups as attn_bwd_dkdv_kernel's, with DQ (as Q) the output; desc_k, desc_v: TMA descriptors
    over K, V (USE_TMA); problem: (nheads, query heads per K/V head, seqlen_q, seqlen_k, head dim); sparse: the
    block mask's lists as attn_fwd_kernel's."""
    SPARSE_BLOCK: tl.constexpr = FLEX.SPARSE_BLOCK
    _, _, _, seqlen_k_static, head_dim = problem
    start_m, b, h, hk, q_start, seqlen_q, k_start, seqlen_k = query_block(head_group, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                                          problem, BLOCK_M, GROUPED, REVERSE,
                                                                          FEATURES.VARLEN)
    if start_m >= seqlen_q:
        return
    b64 = tl.cast(b, tl.int64)
    offs_m, offs_n_rel, offs_d, rows, q_mask = block_indices(start_m, q_start, seqlen_q, head_dim, BLOCK_M, BLOCK_N,
                                                             BLOCK_D)
    q_rows = head_rows(Q, q_strides, b64, h, rows[:, None])[0]
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    do_rows = head_rows(DO, do_strides, b64, h, rows[:, None])[0]
    do = tl.load(do_rows + offs_d[None, :], mask=q_mask, other=0.0)
    lse2 = load_lse2(head_lse(LSE, lse_strides, b64, h, q_start), offs_m, seqlen_q)
    delta = tl.load(head_lse(Delta, lse_strides, b64, h, q_start) + offs_m, mask=offs_m < seqlen_q, other=0.0)
    alibi_slope_log2, rng_base = head_scalars(b, h, ALIBI_SLOPES, stride_alibi_b, dropout, FEATURES.ALIBI)
    k_base, stride_kn = head_rows(K, k_strides, b64, hk, k_start)
    v_base, stride_vn = head_rows(V, v_strides, b64, hk, k_start)
    kv_row0 = first_row(b, k_start, seqlen_k_static, FEATURES.VARLEN)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    head_bias = head_tile(bias, b64, h, FLEX.HAS_BIAS)
    head_mask = head_tile(mask, b64, h, FLEX.HAS_MASK)
    window_left, window_right = window
    # what every tile step reads (one tuple: each call site names only the tile and its masks)
    row = (q, do, lse2, delta, present(desc_k), present(desc_v), k_base, v_base, kv_row0, b, h, hk, offs_m,
           offs_n_rel, offs_d, seqlen_q, seqlen_k, stride_kn, stride_vn, head_dim, scale, alibi_slope_log2, window,
           dropout, rng_base, head_bias, head_mask, present(score_aux), present(mask_aux))
    if SPARSE_BLOCK > 0:
        # FA1 Alg. 5: only the key blocks the block mask lists for this query block
        KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, stride_sp_b, stride_sp_h, stride_sp_m, sparse_blocks = sparse
        sp = b64 * stride_sp_b + tl.cast(h, tl.int64) * stride_sp_h + (start_m // SPARSE_BLOCK) * stride_sp_m
        for t in range(0, sparse_tiles(KV_NUM, sp, SPARSE_BLOCK, BLOCK_N)):
            start_n = sparse_tile_start(KV_IDX, sp, t, sparse_blocks, SPARSE_BLOCK, BLOCK_N)
            dq = _dq_tile(dq, start_n, row, True, True, FEATURES, FLEX, EVEN_D, DOT_PREC, USE_TMA, BLOCK_D)
        for t in range(0, sparse_tiles(FULL_KV_NUM, sp, SPARSE_BLOCK, BLOCK_N)):
            start_n = sparse_tile_start(FULL_KV_IDX, sp, t, sparse_blocks, SPARSE_BLOCK, BLOCK_N)
            dq = _dq_tile(dq, start_n, row, SPARSE_FULL_MASKED, False, FEATURES, FLEX, EVEN_D, DOT_PREC, USE_TMA,
                          BLOCK_D)
    else:
        lo, full_lo, full_hi, hi = key_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                             BLOCK_M, BLOCK_N, FEATURES.HAS_LEFT, FEATURES.HAS_RIGHT)
        for start_n in range(lo, full_lo, BLOCK_N):
            dq = _dq_tile(dq, start_n, row, True, True, FEATURES, FLEX, EVEN_D, DOT_PREC, USE_TMA, BLOCK_D)
        for start_n in range(full_lo, full_hi, BLOCK_N):
            dq = _dq_tile(dq, start_n, row, False, True, FEATURES, FLEX, EVEN_D, DOT_PREC, USE_TMA, BLOCK_D)
        for start_n in range(full_hi, hi, BLOCK_N):
            dq = _dq_tile(dq, start_n, row, True, True, FEATURES, FLEX, EVEN_D, DOT_PREC, USE_TMA, BLOCK_D)
    dq = dq * sm_scale
    dq_rows = head_rows(DQ, dq_strides, b64, h, rows[:, None])[0]
    tl.store(dq_rows + offs_d[None, :], to_dtype(dq, DQ.dtype.element_ty), mask=q_mask)

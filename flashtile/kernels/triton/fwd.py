"""FlashAttention-2 forward (FA2 paper, Dao 2023, Algorithm 1) in Triton.

One program owns one query block Q_i (Br = BLOCK_M rows) of one (batch, head) and streams the key/value
blocks K_j, V_j (Bc = BLOCK_N rows) through on-chip memory, keeping the running row max m_i, the running
row sum l_i and the *un-scaled* accumulator acc = O~_i. Only the log-sum-exp L_i = m_i + log l_i is written
besides O. Scores live in log2 units (see mods.py), so exp is exp2.
Optional, each behind a constexpr that defaults off (the dense path compiles as before): an additive attn_bias
and a bool attn_mask (mods.bias_mask_log2), and a block mask (FLEX.SPARSE_BLOCK > 0): FA1 Alg. 5's loop over
the key blocks it lists instead of the key range of causal/window masking.
"""
import triton
import triton.language as tl

from ..params import Flex
from .mods import (block_indices, dropout_keep, first_row, head_lse, head_rows, head_scalars, head_tile, key_range,
                   load_lse2, load_tile_pair, mma, online_softmax_step, present, query_block, score_mods_log2,
                   scores_log2, sparse_tile_start, sparse_tiles, to_dtype)


@triton.jit
def _fwd_tile(acc, l_i, m_i, start_n, row, MASKED: tl.constexpr, ELEMENT_MASKS: tl.constexpr, FEATURES: tl.constexpr,
              FLEX: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
              BLOCK_D: tl.constexpr, FOLD_SCALE: tl.constexpr):
    """One step j of the inner loop (FA2 Alg. 1 lines 7-10) for the key block starting at start_n.
    row: what every step of this program reads, as attn_fwd_kernel packs it; MASKED / ELEMENT_MASKS: which
    per-element masks this tile needs (edge tiles and a block mask's partial tiles do, the others not;
    mods.score_mods_log2).
    FOLD_SCALE (softmax scale > 0, no score-changing feature): S stays raw q.k and the online softmax applies the
    scale inside exp2's argument (mods.online_softmax_step)."""
    (q, desc_k, desc_v, k_base, v_base, b, h, hk, kv_row0, offs_m, offs_n, offs_d, seqlen_q, seqlen_k, stride_kn,
     stride_vn, head_dim, scale, alibi_slope_log2, window, dropout, rng_base, bias, mask, score_aux, mask_aux) = row
    # V_j is requested together with K_j (not after the softmax): the pipeliner then waits for both tiles at the
    # top of the step, and the softmax's FMULs/conversions interleave with the QK^T GEMM instead of trailing it
    k, v, cols = load_tile_pair(desc_k, desc_v, k_base, v_base, kv_row0, hk, start_n, offs_n, offs_d, seqlen_k,
                                stride_kn, stride_vn, head_dim, MASKED, EVEN_D, USE_TMA, BLOCK_D)
    kt = tl.trans(k)
    i = offs_m[:, None]
    j = cols[None, :]
    # Alg. 1 line 8: S_i^(j) = Q_i K_j^T (then scale / softcap / ALiBi, in log2 units)
    qk = mma(q, kt, None, DOT_PREC)
    USER: tl.constexpr = (FLEX.HAS_BIAS or (FLEX.HAS_MASK and ELEMENT_MASKS) or FLEX.SCORE_MOD is not None
                          or (FLEX.MASK_MOD is not None and ELEMENT_MASKS))
    if FOLD_SCALE and not (FEATURES.SOFTCAP or FEATURES.ALIBI or USER):
        s = qk
        fold, _ = scale
    else:
        s, _ = scores_log2(qk, i, j, seqlen_q, seqlen_k, scale, alibi_slope_log2, FEATURES.SOFTCAP, FEATURES.ALIBI)
        fold = 1.0
    s, _ = score_mods_log2(s, b, h, i, j, seqlen_q, seqlen_k, window, bias, mask, score_aux, mask_aux, MASKED,
                           ELEMENT_MASKS, FEATURES, FLEX)
    # Alg. 1 line 9: m_i^(j) = max(m_i^(j-1), rowmax(S)), P~ = exp(S - m_i^(j)), l_i^(j) = e^(m_old - m_new) l + rowsum(P~)
    if USER:
        # a user mask (or a -inf bias / score_mod) can hide a whole row of any tile, not only of the edge tiles
        m_new, p, alpha, l_i = online_softmax_step(m_i, l_i, s, True, fold)
    else:
        m_new, p, alpha, l_i = online_softmax_step(m_i, l_i, s, MASKED, fold)
    if FEATURES.DROPOUT:
        # l_i sums the un-dropped P~ (the softmax normaliser); only the P~ V product sees Z (FA1 Alg. 2 line 13)
        keep = dropout_keep(dropout, rng_base, i, j)
        p = tl.where(keep, p, 0.0)
    # Alg. 1 line 10: O~_i^(j) = diag(e^(m_old - m_new)) O~_i^(j-1) + P~ V_j   (no division here: FA2's change)
    acc = acc * alpha[:, None]
    acc = mma(to_dtype(p, v.dtype), v, acc, DOT_PREC)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["head_group"])
def attn_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, desc_k, desc_v,
    q_strides, k_strides, v_strides, o_strides, lse_strides, stride_alibi_b,
    problem, scale, window, dropout, bias, mask, sparse,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_TMA: tl.constexpr, FEATURES: tl.constexpr, score_aux=None, mask_aux=None, FLEX: tl.constexpr = Flex(),
    SPARSE_FULL_MASKED: tl.constexpr = True, FOLD_SCALE: tl.constexpr = False, GROUPED: tl.constexpr = False,
    head_group=1,
):
    """One program per query block of BLOCK_M rows and (batch, head); grid (query blocks, batch * nheads).
    The tensors (each call's own; a launch template binds the rest): Q, O (batch, seqlen_q, nheads, headdim) or
    varlen (total_q, nheads, headdim), K, V likewise with nheads_k heads; LSE (batch, nheads, seqlen_q) or (nheads,
    total_q), fp32; CU_SEQLENS_Q / CU_SEQLENS_K (VARLEN); ALIBI_SLOPES (ALIBI: fp32, (nheads) or (batch, nheads),
    stride_alibi_b); desc_k, desc_v: TMA descriptors over K, V (USE_TMA). FEATURES (params.Features: VARLEN,
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DROPOUT) and FLEX (params.Flex: HAS_BIAS, HAS_MASK, SCORE_MOD / MASK_MOD
    with the values they capture in score_aux / mask_aux, SPARSE_BLOCK) say which features it compiles in. The
    groups:
    - q_strides, k_strides, v_strides, o_strides: (batch, row, head) strides (batch 0 where varlen); lse_strides:
      (batch, head);
    - problem: (nheads, query heads per K/V head, seqlen_q, seqlen_k (the longest where varlen), head dim);
    - scale: (score_scale, softcap_log2): mods.scores_log2's scalars; window: (window_left, window_right)
      (HAS_LEFT / HAS_RIGHT; causal is right = 0);
    - dropout: (p, Philox seed, counter offset, counter strides of batch, head and row) (DROPOUT);
    - bias, mask: an attn_bias / attn_mask's (pointer, batch, head, row and column strides) (FLEX.HAS_BIAS /
      HAS_MASK; runtime.pair_args);
    - sparse: a block mask's (num, idx, full_num, full_idx, batch, head and block-row strides, blocks per index row)
      (SPARSE_BLOCK > 0; runtime.sparse_args; SPARSE_FULL_MASKED: its full tiles need the window / sequence-end
      masks).
    Absent features' groups hold None and zeros, read only under the flag that says they exist."""
    _, _, _, seqlen_k_static, head_dim = problem
    # causal/banded: the last query blocks see the most keys; launch them first so the short ones
    # fill the tail of the schedule instead of the long ones
    start_m, b, h, hk, q_start, seqlen_q, k_start, seqlen_k = query_block(head_group, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                                          problem, BLOCK_M, GROUPED,
                                                                          FEATURES.HAS_RIGHT, FEATURES.VARLEN)
    if start_m >= seqlen_q:
        return
    b64 = tl.cast(b, tl.int64)
    q_base, stride_qm = head_rows(Q, q_strides, b64, h, q_start, start_m)
    k_base, stride_kn = head_rows(K, k_strides, b64, hk, k_start)
    kv_row0 = first_row(b, k_start, seqlen_k_static, FEATURES.VARLEN)
    v_base, stride_vn = head_rows(V, v_strides, b64, hk, k_start)
    o_base, stride_om = head_rows(O, o_strides, b64, h, q_start, start_m)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_M)   # row offsets relative to the block (pointer arithmetic stays int32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    alibi_slope_log2, rng_base = head_scalars(b, h, ALIBI_SLOPES, stride_alibi_b, dropout, FEATURES.ALIBI)
    head_bias = head_tile(bias, b64, h, FLEX.HAS_BIAS)
    head_mask = head_tile(mask, b64, h, FLEX.HAS_MASK)
    window_left, window_right = window
    SPARSE_BLOCK: tl.constexpr = FLEX.SPARSE_BLOCK

    # Alg. 1 line 4: load Q_i (rows past the end are 0; their outputs are never stored)
    q_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    q = tl.load(q_base + offs_r[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
    # Alg. 1 line 5: O~ = 0, l = 0, m = -inf
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # what every tile step reads (one tuple, so each call site names only what differs: the tile and its masks)
    row = (q, present(desc_k), present(desc_v), k_base, v_base, b, h, hk, kv_row0, offs_m, offs_n, offs_d, seqlen_q,
           seqlen_k, stride_kn, stride_vn, head_dim, scale, alibi_slope_log2, window, dropout, rng_base, head_bias,
           head_mask, present(score_aux), present(mask_aux))
    if SPARSE_BLOCK > 0:
        KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, stride_sp_b, stride_sp_h, stride_sp_m, sparse_blocks = sparse
        # FA1 Alg. 5: visit only the key blocks the block mask lists for this query block; empty blocks are
        # never touched. Partial blocks apply the element mask (the mask tensor or mask_mod), full blocks skip it.
        sp = b64 * stride_sp_b + tl.cast(h, tl.int64) * stride_sp_h + (start_m // SPARSE_BLOCK) * stride_sp_m
        for t in range(0, sparse_tiles(KV_NUM, sp, SPARSE_BLOCK, BLOCK_N)):
            start_n = sparse_tile_start(KV_IDX, sp, t, sparse_blocks, SPARSE_BLOCK, BLOCK_N)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, start_n, row, True, True, FEATURES, FLEX, EVEN_D, DOT_PREC,
                                      USE_TMA, BLOCK_D, FOLD_SCALE)
        for t in range(0, sparse_tiles(FULL_KV_NUM, sp, SPARSE_BLOCK, BLOCK_N)):
            start_n = sparse_tile_start(FULL_KV_IDX, sp, t, sparse_blocks, SPARSE_BLOCK, BLOCK_N)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, start_n, row, SPARSE_FULL_MASKED, False, FEATURES, FLEX, EVEN_D,
                                      DOT_PREC, USE_TMA, BLOCK_D, FOLD_SCALE)
    else:
        lo, full_lo, full_hi, hi = key_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                             BLOCK_M, BLOCK_N, FEATURES.HAS_LEFT, FEATURES.HAS_RIGHT)
        # Alg. 1 line 6: for j = 1..Tc. Tiles straddling a mask edge or the end of K take the masked path;
        # the rest (most of them) skip per-element masking entirely.
        for start_n in range(lo, full_lo, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, start_n, row, True, True, FEATURES, FLEX, EVEN_D, DOT_PREC,
                                      USE_TMA, BLOCK_D, FOLD_SCALE)
        for start_n in range(full_lo, full_hi, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, start_n, row, False, True, FEATURES, FLEX, EVEN_D, DOT_PREC,
                                      USE_TMA, BLOCK_D, FOLD_SCALE)
        for start_n in range(full_hi, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, start_n, row, True, True, FEATURES, FLEX, EVEN_D, DOT_PREC,
                                      USE_TMA, BLOCK_D, FOLD_SCALE)

    # Alg. 1 lines 12-13: O_i = diag(l_i)^-1 O~_i, L_i = m_i + log l_i. A row that saw no key has l_i = 0:
    # it outputs 0 and L = -inf (zero probability mass), never NaN.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if FEATURES.DROPOUT:
        dropout_p, _, _, _, _, _ = dropout
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    tl.store(o_base + offs_r[:, None] * stride_om + offs_d[None, :], to_dtype(out, O.dtype.element_ty), mask=o_mask)
    lse_ptrs = head_lse(LSE, lse_strides, b64, h, q_start) + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


@triton.jit
def attn_probs_kernel(
    Q, K, LSE, P, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES,
    q_strides, k_strides, p_strides, lse_strides, stride_alibi_b,
    problem, scale, window, dropout, bias, mask,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    FEATURES: tl.constexpr, FLEX: tl.constexpr = Flex(),
):
    """Debug/test output of return_attn_probs: P = exp(S - L) from the forward's L, negated where dropout
    dropped the entry (flash-attn's S_dmask convention). O(N^2) memory: never used by the fast path.
    P: (batch, nheads, seqlen_q, seqlen_k) fp32, p_strides its (batch, head, row) strides; the other tensors and
    groups as attn_fwd_kernel's; FLEX: attn_bias and attn_mask only."""
    nheads, group_size, seqlen_q_static, seqlen_k_static, head_dim = problem
    start_m, b, h, hk, q_start, seqlen_q, k_start, seqlen_k = query_block(1, CU_SEQLENS_Q, CU_SEQLENS_K, problem,
                                                                          BLOCK_M, False, False, FEATURES.VARLEN)
    if start_m >= seqlen_q:
        return
    b64 = tl.cast(b, tl.int64)
    offs_m, offs_n, offs_d, rows, q_mask = block_indices(start_m, q_start, seqlen_q, head_dim, BLOCK_M, BLOCK_N,
                                                         BLOCK_D)
    q = tl.load(head_rows(Q, q_strides, b64, h, rows[:, None])[0] + offs_d[None, :], mask=q_mask, other=0.0)
    lse2 = load_lse2(head_lse(LSE, lse_strides, b64, h, q_start), offs_m, seqlen_q)
    alibi_slope_log2, rng_base = head_scalars(b, h, ALIBI_SLOPES, stride_alibi_b, dropout, FEATURES.ALIBI)
    k_base, stride_kn = head_rows(K, k_strides, b64, hk, k_start)
    stride_pb, stride_ph, stride_pm = p_strides
    p_base = P + b64 * stride_pb + tl.cast(h, tl.int64) * stride_ph
    head_bias = head_tile(bias, b64, h, FLEX.HAS_BIAS)
    head_mask = head_tile(mask, b64, h, FLEX.HAS_MASK)
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + offs_n
        kt = tl.load(k_base + cols[None, :].to(tl.int64) * stride_kn + offs_d[:, None],
                     mask=(cols[None, :] < seqlen_k) & (offs_d[:, None] < head_dim), other=0.0)
        qk = mma(q, kt, None, DOT_PREC)
        i = offs_m[:, None]
        j = cols[None, :]
        s, _ = scores_log2(qk, i, j, seqlen_q, seqlen_k, scale, alibi_slope_log2, FEATURES.SOFTCAP, FEATURES.ALIBI)
        s, _ = score_mods_log2(s, b, h, i, j, seqlen_q, seqlen_k, window, head_bias, head_mask, None, None, True,
                               True, FEATURES, FLEX)
        p = tl.math.exp2(s - lse2[:, None])
        if FEATURES.DROPOUT:
            keep = dropout_keep(dropout, rng_base, i, j)
            p = tl.where(keep, p, -p)
        tl.store(p_base + offs_m[:, None].to(tl.int64) * stride_pm + j, p,
                 mask=(offs_m[:, None] < seqlen_q) & (j < seqlen_k))

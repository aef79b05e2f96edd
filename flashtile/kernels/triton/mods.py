"""Score modifiers and masks shared by every Triton attention kernel: the one place masking lives.

All kernels work in the base-2 log domain (FA3 / Triton tutorial trick): scores are pre-multiplied by
log2(e) so the softmax uses exp2, and the stored LSE is converted back to natural log at the end.
"""
import triton
import triton.language as tl

from ..params import LOG2E  # noqa: F401  (host code imports it from here)

from ..elementwise import (INTERPRETED, _per_tile, bias_mask_log2, score_mod_grad, to_dtype,  # noqa: F401
                           user_mods_log2)   # (the Triton kernels import them from here)


@_per_tile
def mma(a, b, acc, DOT_PREC: tl.constexpr):
    """a @ b (+ acc), fp32 accumulate: every tl.dot of the Triton kernels goes through here. DOT_PREC: tl.dot's
    input_precision (None: its default).

    The Triton interpreter multiplies bf16 tiles as their raw 16-bit patterns (it stores bf16 as uint16: numpy has
    no bfloat16), so there the operands are widened to fp32 first: a bf16 x bf16 product is exact in fp32 and the
    sum is fp32, as on the tensor cores, so the result is what a GPU computes. INTERPRETED is False wherever the
    kernels are compiled: the branch is dropped at compile time and the GPU kernels are the plain tl.dot."""
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            return tl.dot(to_dtype(a, tl.float32), to_dtype(b, tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def seq_bounds(b, cu_seqlens_ptr, seqlen_static, IS_VARLEN: tl.constexpr):
    """(start row in the packed/varlen layout, length) of batch element b."""
    if IS_VARLEN:
        start = tl.load(cu_seqlens_ptr + b)
        end = tl.load(cu_seqlens_ptr + b + 1)
        return start, end - start
    else:
        return 0, seqlen_static


# --------------------------------------------------------------------------------------------------
# A program's prologue, one helper per concern: which heads, which sequence, the head's scalars and side tensors
# --------------------------------------------------------------------------------------------------
@triton.jit
def query_head(bh, nheads, group_size):
    """(batch element, query head, KV head) of program index bh = batch * nheads + head; GQA: query head h reads
    K/V head h // group_size (group_size = nheads / nheads_k)."""
    b = bh // nheads
    h = bh % nheads
    return b, h, h // group_size


@triton.jit
def sequences(b, CU_SEQLENS_Q, CU_SEQLENS_K, problem, IS_VARLEN: tl.constexpr):
    """(first query row, seqlen_q, first key row, seqlen_k) of batch element b (seq_bounds of both sides).
    problem: the kernel's group (heads, query heads per K/V head, seqlen_q, seqlen_k, head dim), whose lengths
    (the longest where IS_VARLEN) are every sequence's without cu_seqlens."""
    _, _, seqlen_q_static, seqlen_k_static, _ = problem
    q_start, seqlen_q = seq_bounds(b, CU_SEQLENS_Q, seqlen_q_static, IS_VARLEN)
    k_start, seqlen_k = seq_bounds(b, CU_SEQLENS_K, seqlen_k_static, IS_VARLEN)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def query_block(head_group, CU_SEQLENS_Q, CU_SEQLENS_K, problem, BLOCK_M: tl.constexpr, GROUPED: tl.constexpr,
                REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The prologue of a kernel with one program per query block of BLOCK_M rows and (batch, query head):
    (start_m: the block's first row, b, h, hk: query_head's, q_start, seqlen_q, k_start, seqlen_k: sequences').
    head_group, GROUPED, REVERSE: tile_order's; problem: as sequences takes it. The caller returns when
    start_m >= seqlen_q (a block past its sequence's end, varlen)."""
    nheads, group_size, _, _, _ = problem
    pid_m, bh = tile_order(head_group, GROUPED, REVERSE)
    b, h, hk = query_head(bh, nheads, group_size)
    q_start, seqlen_q, k_start, seqlen_k = sequences(b, CU_SEQLENS_Q, CU_SEQLENS_K, problem, IS_VARLEN)
    return pid_m * BLOCK_M, b, h, hk, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def block_indices(start, seq_start, seqlen, head_dim, ROWS: tl.constexpr, STREAMED: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """The index tiles of a program that owns rows [start, start + ROWS) of a sequence (first row seq_start, length
    seqlen) and streams blocks of STREAMED rows past them: (offs = start + [0, ROWS); offs_rel = [0, STREAMED), a
    streamed block's rows relative to its start; offs_d = [0, BLOCK_D); rows: the owned rows' indices in the tensor,
    int64; mask: the in-bounds elements (rows < seqlen, columns < head_dim) of an owned (ROWS, BLOCK_D) tile)."""
    offs = start + tl.arange(0, ROWS)
    offs_rel = tl.arange(0, STREAMED)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (seq_start + offs).to(tl.int64)
    mask = (offs[:, None] < seqlen) & (offs_d[None, :] < head_dim)
    return offs, offs_rel, offs_d, rows, mask


@triton.jit
def head_rows(T, strides, b64, h, row, offset=0):
    """(pointer to row `row + offset` of head h of batch element b64 (int64), row stride) of a Q / K / V / O-shaped
    tensor T given its (batch, row, head) strides; row: a scalar (e.g. a sequence's first row, offset then the
    block's start in it) or an int64 index tile (the pointer tile then)."""
    stride_b, stride_m, stride_h = strides
    return (T + b64 * stride_b + tl.cast(h, tl.int64) * stride_h + tl.cast(row + offset, tl.int64) * stride_m,
            stride_m)


@triton.jit
def head_lse(T, strides, b64, h, q_start):
    """Pointer to the first entry of (batch b64 (int64), head h) of an LSE-shaped tensor T (the LSE, Delta) given
    its (batch, head) strides, at the sequence's first row q_start (rows are contiguous)."""
    stride_b, stride_h = strides
    return T + b64 * stride_b + tl.cast(h, tl.int64) * stride_h + q_start


@triton.jit
def first_row(b, start, seqlen_static, IS_VARLEN: tl.constexpr):
    """First row of batch element b's sequence in the 2-D (rows, heads * headdim) view the TMA descriptors use:
    start (its cu_seqlens entry) where IS_VARLEN, b * seqlen_static otherwise."""
    if IS_VARLEN:
        return start
    else:
        return b * seqlen_static


@triton.jit
def head_scalars(b, h, ALIBI_SLOPES, stride_alibi_b, dropout, ALIBI: tl.constexpr):
    """(query head h's ALiBi slope in log2 units, 0.0 without ALiBi; the base of its dropout counters, from the
    dropout group's batch and head counter strides)."""
    _, _, _, rng_stride_b, rng_stride_h, _ = dropout
    alibi_slope_log2 = 0.0
    if ALIBI:
        alibi_slope_log2 = tl.load(ALIBI_SLOPES + b * stride_alibi_b + h).to(tl.float32) * 1.4426950408889634
    rng_base = tl.cast(b, tl.int64) * rng_stride_b + tl.cast(h, tl.int64) * rng_stride_h
    return alibi_slope_log2, rng_base


@triton.jit
def head_tile(t, b64, h, PRESENT: tl.constexpr):
    """(pointer moved to (batch b, head h), row stride, column stride) of an attn_bias / attn_mask / dBias given as
    its group t = (pointer, batch, head, row and column strides) (runtime.pair_args: broadcast dimensions have
    stride 0); the pointer is 0 where absent (present()'s placeholder: read only under the flag that says it
    exists)."""
    T, stride_b, stride_h, stride_m, stride_n = t
    if PRESENT:
        return T + b64 * stride_b + tl.cast(h, tl.int64) * stride_h, stride_m, stride_n
    else:
        return 0, stride_m, stride_n


@triton.jit
def visible(i, j, seqlen_q, seqlen_k, window_left, window_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Bool tile: query i may see key j (i, j: broadcastable 2-D index tensors, e.g. rows[:, None] and
    cols[None, :], or transposed for the backward's S^T tiles).

    Bottom-right alignment: query i's diagonal is key i + seqlen_k - seqlen_q; causal is window_right = 0.
    """
    diag = i + (seqlen_k - seqlen_q)
    vis = (j < seqlen_k) & (i < seqlen_q)
    if HAS_RIGHT:
        vis = vis & (j <= diag + window_right)
    if HAS_LEFT:
        vis = vis & (j >= diag - window_left)
    return vis


@triton.jit
def scores_log2(qk, i, j, seqlen_q, seqlen_k, scale, alibi_slope_log2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Raw q.k products -> scores in log2 units, plus t = tanh(.) (needed by the softcap backward).
    scale: the kernels' (score_scale, softcap_log2) group, score_scale as below and softcap_log2 = softcap * log2 e.

    Without softcap: s2 = qk * (softmax_scale * log2 e)        (score_scale = softmax_scale * log2 e)
    With softcap:    s2 = softcap * log2 e * tanh(qk * softmax_scale / softcap)
                                                              (score_scale = softmax_scale / softcap)
    ALiBi adds -slope * log2 e * |i + seqlen_k - seqlen_q - j|.
    """
    score_scale, softcap_log2 = scale
    if SOFTCAP:
        # tanh(x) = 2 sigmoid(2x) - 1: portable (no libdevice), exact enough in fp32
        t = 2.0 * tl.sigmoid(2.0 * qk * score_scale) - 1.0
        s2 = t * softcap_log2
    else:
        t = qk  # unused
        s2 = qk * score_scale
    if ALIBI:
        dist = i + (seqlen_k - seqlen_q) - j
        dist = tl.where(dist < 0, -dist, dist)
        s2 = s2 - alibi_slope_log2 * dist.to(tl.float32)
    return s2, t


@triton.jit
def score_mods_log2(s, b, h, i, j, seqlen_q, seqlen_k, window, bias, mask, score_aux, mask_aux, MASKED: tl.constexpr,
                    ELEMENT_MASKS: tl.constexpr, FEATURES: tl.constexpr, FLEX: tl.constexpr):
    """Everything after scores_log2 that changes a score tile s (log2 units; i, j: broadcastable query and key
    indices), in this order: attn_bias; flashtile.flex's score_mod and mask_mod; attn_mask (after score_mod, which
    may map -inf to a finite score); where MASKED (a tile on a causal / window edge or a sequence end), -inf where
    not visible. window: the kernels' (window_left, window_right) group; bias, mask: head_tile's (pointer, row
    stride, column stride) of each. ELEMENT_MASKS: attn_mask and mask_mod apply to this tile (off on a block mask's
    full tiles). Returns (s, s_in), s_in score_mod's input (natural units), which its gradient needs (s itself when
    there is no score_mod)."""
    HAS_BIAS: tl.constexpr = FLEX.HAS_BIAS
    HAS_MASK: tl.constexpr = FLEX.HAS_MASK and ELEMENT_MASKS
    SCORE_MOD: tl.constexpr = FLEX.SCORE_MOD
    MASK_MOD: tl.constexpr = FLEX.MASK_MOD if ELEMENT_MASKS else None
    bias_bh, stride_bias_m, stride_bias_n = bias
    mask_bh, stride_mask_m, stride_mask_n = mask
    if HAS_BIAS:
        s = bias_mask_log2(s, i, j, seqlen_q, seqlen_k, bias_bh, stride_bias_m, stride_bias_n, mask_bh,
                           stride_mask_m, stride_mask_n, HAS_BIAS, False)
    s_in = s
    if SCORE_MOD is not None or MASK_MOD is not None:
        s, s_in = user_mods_log2(s, b, h, i, j, score_aux, mask_aux, SCORE_MOD, MASK_MOD)
    if HAS_MASK:
        s = bias_mask_log2(s, i, j, seqlen_q, seqlen_k, bias_bh, stride_bias_m, stride_bias_n, mask_bh,
                           stride_mask_m, stride_mask_n, False, True)
    if MASKED:
        window_left, window_right = window
        s = tl.where(visible(i, j, seqlen_q, seqlen_k, window_left, window_right, FEATURES.HAS_LEFT,
                             FEATURES.HAS_RIGHT), s, float("-inf"))
    return s, s_in


@triton.jit
def dropout_keep(dropout, rng_base, i, j):
    """Keep mask of one tile (i, j broadcastable 2-D indices): Philox counter rng_offset + rng_base +
    i * rng_stride_m + j, exactly the counter flashtile.reference.rng.dropout_counter gives entry (b, h, i, j).
    dropout: the kernels' group (p, seed, rng_offset, counter strides of batch, head and row); rng_base: the
    head's (head_scalars)."""
    dropout_p, seed, rng_offset, _, _, rng_stride_m = dropout
    cnt = rng_offset + rng_base + i.to(tl.int64) * rng_stride_m + j.to(tl.int64)
    return tl.rand(seed, cnt) >= dropout_p


@triton.jit
def key_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks a query block [start_m, start_m + BLOCK_M) must visit, split by whether per-element
    masking is needed:  [lo, full_lo) masked | [full_lo, full_hi) unmasked | [full_hi, hi) masked.
    All bounds are multiples of BLOCK_N except hi (clamped to seqlen_k)."""
    diag_lo = start_m + seqlen_k - seqlen_q          # diagonal of the block's first query
    diag_hi = diag_lo + BLOCK_M - 1                  # ... and of its last
    lo = 0
    full_lo = 0
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, diag_hi + window_right + 1)
        full_hi = tl.minimum(full_hi, ((diag_lo + window_right + 1) // BLOCK_N) * BLOCK_N)
    if HAS_LEFT:
        lo = tl.maximum(0, ((diag_lo - window_left) // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(0, tl.cdiv(diag_hi - window_left, BLOCK_N) * BLOCK_N)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The transpose of key_range, for the backward's K/V-block programs: query blocks that see keys
    [start_n, start_n + BLOCK_N), split as [lo, full_lo) masked | [full_lo, full_hi) unmasked | [full_hi, hi)
    masked. Query i sees key j iff diag_i - left <= j <= diag_i + right, diag_i = i + seqlen_k - seqlen_q."""
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if start_n + BLOCK_N > seqlen_k:     # the last key block is ragged: every tile needs the bounds mask
        full_hi = 0
    if HAS_RIGHT:
        lo = tl.maximum(0, ((start_n - window_right - shift) // BLOCK_M) * BLOCK_M)
        full_lo = tl.maximum(0, tl.cdiv(start_n + BLOCK_N - 1 - window_right - shift, BLOCK_M) * BLOCK_M)
    if HAS_LEFT:
        hi = tl.minimum(hi, start_n + BLOCK_N - 1 + window_left - shift + 1)
        full_hi = tl.minimum(full_hi, ((start_n + window_left - shift + 1) // BLOCK_M) * BLOCK_M)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def load_lse2(lse_row_ptr, offs, seqlen):
    """L (natural log) -> log2 units. Empty rows (L = -inf) and rows past the end get +inf, so that a
    recomputed P = exp2(S - L) is 0 there instead of NaN."""
    lse = tl.load(lse_row_ptr + offs, mask=offs < seqlen, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def load_tile(desc, blk, row, head, offs_r, offs_d, idx, seqlen, stride_r, head_dim,
              MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (rows, BLOCK_D) tile of one head of Q, K, V or dO: rows idx = start + offs_r of a sequence.

    USE_TMA: one bulk tensor copy through a host-made 2-D descriptor over (rows, heads * headdim), at
    (row, head * BLOCK_D); only used when BLOCK_D == headdim, so no other head's columns are read. Rows past
    the sequence (the next sequence's, or zeros past the tensor) are zeroed when MASKED.
    Otherwise pointer loads from blk (the tile's first row), masked at the sequence end and the head dim."""
    if USE_TMA:
        t = desc.load([row, head * BLOCK_D])
        if MASKED:
            t = tl.where(idx[:, None] < seqlen, t, 0.0)
    else:
        t = load_rows(blk + offs_r[:, None] * stride_r + offs_d[None, :], idx < seqlen, offs_d, head_dim,
                      MASKED, EVEN_D)
    return t


@triton.jit
def load_tile_pair(desc_a, desc_b, a_base, b_base, row0, head, start, offs_r, offs_d, seqlen, stride_a, stride_b,
                   head_dim, MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tiles of rows idx = start + offs_r of two tensors a tile step streams together (K_j and V_j; Q_i and
    dO_i), one head of each, and idx: load_tile of each. a_base, b_base: the head's pointers at its sequence's
    first row, stride_a, stride_b their row strides; row0: that row in the TMA descriptors' 2-D view. Both requests
    are issued before either tile is used."""
    a_blk = a_base + tl.cast(start, tl.int64) * stride_a
    b_blk = b_base + tl.cast(start, tl.int64) * stride_b
    row = row0 + start
    idx = start + offs_r
    a = load_tile(desc_a, a_blk, row, head, offs_r, offs_d, idx, seqlen, stride_a, head_dim, MASKED, EVEN_D, USE_TMA,
                  BLOCK_D)
    b = load_tile(desc_b, b_blk, row, head, offs_r, offs_d, idx, seqlen, stride_b, head_dim, MASKED, EVEN_D, USE_TMA,
                  BLOCK_D)
    return a, b, idx


@triton.jit
def load_rows(ptrs, valid, offs_d, head_dim, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Pointer load of a (rows, BLOCK_D) tile: rows where `valid` is False (only masked tiles have them) and
    columns past the head dim read as 0."""
    if MASKED:
        t = tl.load(ptrs, mask=valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    elif EVEN_D:
        t = tl.load(ptrs)
    else:
        t = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    return t


# --------------------------------------------------------------------------------------------------
# Online-softmax update and partial-result merge, shared by the decode (split-KV) and combine kernels.
# --------------------------------------------------------------------------------------------------
@triton.jit
def online_softmax_step(m_i, l_i, s, MASKED: tl.constexpr, scale=1.0):
    """FA2 Alg. 1 line 9 for one score tile s * scale (BLOCK_M, BLOCK_N), log2 units.

    Returns (m_new, p, alpha, l_new): m_new = max(m_i, rowmax(s) * scale), P~ = exp2(s * scale - m_new),
    alpha = exp2(m_i - m_new) (the factor by which the caller rescales its accumulator before adding P~ V,
    Alg. 1 line 10), l_new = alpha * l_i + rowsum(P~). MASKED: a row that has seen no visible key yet keeps
    m = -inf and is exponentiated against 0, so P~ = 0 and alpha = 0 instead of NaN (its l and accumulator are 0).
    scale (> 0): raw q.k products may come in with the softmax scale still to apply; the max commutes with
    it, so the scale costs one multiply per row for m and rides in exp2's argument as one FMA per element
    ("exp2 with the scale folded in"), instead of a multiply of the whole tile. Already-scaled scores pass 1.0,
    which the compiler drops."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    m_use = m_new
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s * scale - m_use[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, p, alpha, l_new


@triton.jit
def sparse_tiles(NUM, sp, SPARSE_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Tiles of TILE rows in row sp of a block mask's list: its NUM[sp] listed blocks of SPARSE_BLOCK rows each, the
    tiles sparse_tile_start numbers."""
    return tl.load(NUM + sp) * (SPARSE_BLOCK // TILE)


@triton.jit
def sparse_tile_start(IDX, sp, t, sparse_blocks, SPARSE_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Start (a row or key index) of tile t in the flat loop over a block mask's listed blocks: listed block
    t // (SPARSE_BLOCK / TILE) of row sp of IDX (sparse_blocks entries per row), tile t % (SPARSE_BLOCK / TILE)
    inside it. One flat loop over (block, tile) lets Triton pipeline across blocks; tiles past the sequence
    end (a ragged last block) are fully masked by the caller."""
    per: tl.constexpr = SPARSE_BLOCK // TILE
    return tl.load(IDX + sp * sparse_blocks + t // per) * SPARSE_BLOCK + (t % per) * TILE


@triton.jit
def tile_order(head_group, GROUPED: tl.constexpr, REVERSE: tl.constexpr):
    """(block, batch * head index) of this program over a grid (blocks, batch * heads), in launch order.
    GROUPED: heads in groups of head_group; within a group block by block (every head's block 0, then block 1,
    ...), so under a causal mask the long programs of all the group's heads start before any short one and the
    short ones fill the schedule's tail. Not GROUPED: the grid's own order (one head's blocks in a row, sharing
    its tiles in L2; compiled without the grouping's index arithmetic, which slowed the d64 full backward down).
    REVERSE: blocks in descending order (causal forward and dQ: the last query blocks see the most keys)."""
    n_blocks = tl.num_programs(0)
    if GROUPED:
        pid = tl.program_id(0) + tl.program_id(1) * n_blocks
        span = head_group * n_blocks
        g0 = (pid // span) * head_group
        size = tl.minimum(head_group, tl.num_programs(1) - g0)
        r = pid % span
        blk = r // size
        bh = g0 + r % size
    else:
        blk = tl.program_id(0)
        bh = tl.program_id(1)
    if REVERSE:
        blk = n_blocks - 1 - blk
    return blk, bh


@triton.jit
def present(x):
    """x, or 0 in place of None: the tile steps get their per-program values as one tuple, and Triton 3.6
    cannot build a tuple holding None (an absent TMA descriptor, bias, mask or mod). Every such value is read
    only under the constexpr flag that says it exists."""
    if x is None:
        return 0
    else:
        return x

"""FlashAttention-3's forward (FA3 paper, Shah et al. 2024: Algorithm 1 with §3.1's warp specialization and ping-pong schedule and
§3.2's intra-warpgroup pipelining) for Hopper, written in Gluon, Triton's lower-level Python DSL: explicit
layouts, TMA, mbarriers, asynchronous warpgroup MMA (wgmma) and warp specialization, none of which Triton's
`tl.dot` kernels can schedule by hand on Hopper.

A program (one per SM: persistent) computes (Br x d) output tiles O_i of one (batch, head) after another, Br =
64 x NUM_WG rows (two consumer warpgroups; three at d64, FA3's Br = 192):
- a producer warp (`_load_partition`) draws the program's next tile from a counter shared by the launch
  (dynamic scheduling, so causal tiles of unequal length balance), hands its number to the consumers with its
  Q rows, and issues the TMA loads: Q_i into a free Q buffer, then K_j and V_j into a ring of STAGES
  shared-memory buffers. Each buffer has a "ready" mbarrier (TMA transaction bytes) and an "empty" one, which
  the consumers arrive on once their wgmmas have read it: K_j's as soon as S_j is computed, V_j's after P~_j V_j,
  so the next keys (and the next tile's first keys) load while this block's values are still in use;
- the consumer warpgroups (`_consumer_partition`; the first is the default partition), 64 rows each, run the
  online softmax, each over its own key blocks (causal: up to its diagonal block, the only one it masks). Turn j
  issues S_j = Q K_j^T and O += P~_{j-1} V_{j-1} as two asynchronous wgmmas, waits for S_j only and computes its
  softmax while the tensor cores work on P~_{j-1} V_{j-1} (intra-warpgroup overlap). With PINGPONG
  (fa3.PINGPONG: today the d64 / d128 full forward) the warpgroups take turns issuing
  (mbarriers `turns`), so one's GEMMs run while the other computes exponentials (ping-pong).

Algorithm line numbers below are FlashAttention-2's Algorithm 1 (the FA2 paper's forward), as in triton/fwd.py.

Imported only on a CUDA device of compute capability 9.x (flashtile.kernels.gluon.fa3 decides).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .. import params
from ..elementwise import bias_mask_log2, small_float, user_mods_log2

LN2 = gl.constexpr(params.LN2)
LOG2E = gl.constexpr(params.LOG2E)
LOG2_E4M3_MAX = gl.constexpr(params.LOG2_E4M3_MAX)   # log2(448), e4m3's largest finite value
# TMA copies: Triton 3.6 (the GPU image's) names them async_copy_global_to_shared / async_copy_shared_to_global;
# later releases async_load / async_store and drop the old store name
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.constexpr_function
def wgmma_acc_layout(n, dtype):
    """The layout of one warpgroup's wgmma accumulator of 64 rows x n columns over operands of `dtype`: 4 warps
    down the rows, instructions 16 rows x n columns x 32 bytes of K deep."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 256 // dtype.primitive_bitwidth])


@gluon.constexpr_function
def p_operand_layout(o_layout, dtype):
    """P~ as the register A operand of the P V wgmma accumulating into o_layout: 32 bits of consecutive keys per
    register (2 x 16, 4 x 8 bit)."""
    return gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // dtype.primitive_bitwidth)


@gluon.jit
def _tile_coords(tile, n_m, nheads, LONGEST_FIRST: gl.constexpr):
    """Tile number `tile` -> (bh = batch * nheads + head, batch, head, pid_m). Tiles are numbered head by head (a
    head's tiles share its K / V in L2); LONGEST_FIRST (a right window, causal included): each head's last query
    tile, which sees the most keys, first, so the short ones fill the tail."""
    bh = tile // n_m
    pid_m = tile % n_m
    if LONGEST_FIRST:
        pid_m = n_m - 1 - pid_m
    return bh, bh // nheads, bh % nheads, pid_m


@gluon.jit
def _seq_info(b, seq, VARLEN: gl.constexpr, SAME_SEQS: gl.constexpr = False):
    """Sequence b's first query row and first key row in the 2-D (rows, heads x d) views the descriptors tile, and
    its lengths: dense, the batch's seqlen_q / seqlen_k; VARLEN, from cu_seqlens (packed tokens); SAME_SEQS (the
    queries and keys are the same sequences: cu_seqlens_q is cu_seqlens_k), one row offset and one length, which
    the kernel then keeps in one register each."""
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k = seq
    if VARLEN:
        if SAME_SEQS:
            k_row0 = gl.load(cu_seqlens_k + b)
            len_k = gl.load(cu_seqlens_k + b + 1) - k_row0
            q_row0 = k_row0
            len_q = len_k
        else:
            q_row0 = gl.load(cu_seqlens_q + b)
            k_row0 = gl.load(cu_seqlens_k + b)
            len_q = gl.load(cu_seqlens_q + b + 1) - q_row0
            len_k = gl.load(cu_seqlens_k + b + 1) - k_row0
    else:
        q_row0 = b * seqlen_q
        k_row0 = b * seqlen_k
        len_q = seqlen_q
        len_k = seqlen_k
    return q_row0, k_row0, len_q, len_k


@gluon.jit
def _key_blocks(row_lo, row_hi, len_q, len_k, window, BLOCK_N: gl.constexpr, FEATURES: gl.constexpr):
    """The mask rule, per key block (the Triton kernels' mods.key_range): query i of a sequence sees key j iff
    j < len_k and, with the window's bounds, i + shift - left <= j <= i + shift + right, shift = len_k - len_q
    (bottom-right aligned; causal is right = 0). Rows [row_lo, row_hi) see key blocks [lo, hi), and each of them
    sees blocks [full_lo, full_hi) whole (no element mask there)."""
    window_left, window_right = window
    shift = len_k - len_q
    lo = 0
    full_lo = 0
    hi = gl.cdiv(len_k, BLOCK_N)
    full_hi = len_k // BLOCK_N
    if FEATURES.HAS_RIGHT:   # the last row's last key; the first row's
        hi = gl.minimum(hi, gl.cdiv(gl.maximum(row_hi + shift + window_right, 0), BLOCK_N))
        full_hi = gl.minimum(full_hi, gl.maximum(row_lo + shift + window_right + 1, 0) // BLOCK_N)
    if FEATURES.HAS_LEFT:    # the first row's first key; the last row's
        lo = gl.maximum(row_lo + shift - window_left, 0) // BLOCK_N
        full_lo = gl.cdiv(gl.maximum(row_hi - 1 + shift - window_left, 0), BLOCK_N)
    return lo, full_lo, full_hi, hi


@gluon.jit
def _tile_blocks(q_start, tile_rows, len_q, len_k, window, BLOCK_N: gl.constexpr, FEATURES: gl.constexpr):
    """Key blocks [lo, hi) a query tile loads: those its rows see, at least one (a tile whose rows see no key,
    e.g. a sequence without keys, computes one block fully masked: its rows output 0)."""
    lo, _, _, hi = _key_blocks(q_start, q_start + tile_rows, len_q, len_k, window, BLOCK_N, FEATURES)
    return lo, gl.maximum(hi, lo + 1)


@gluon.jit
def _sparse_row(sparse, b, h, q_start, SPARSE_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """A block mask's lists for the query tile that starts at q_start (its rows lie in one mask row: they divide
    SPARSE_BLOCK), as steps: step j is one BLOCK_N-key block of a listed mask block, the partial blocks' first.
    Returns (partial steps, steps, the offset of the row in the index lists)."""
    num, idx, full_num, full_idx, stride_b, stride_h, stride_m, n_blocks = sparse
    PER: gl.constexpr = SPARSE_BLOCK // BLOCK_N
    sp = b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h + (q_start // SPARSE_BLOCK) * stride_m
    n_partial = gl.load(num + sp) * PER
    return n_partial, n_partial + gl.load(full_num + sp) * PER, sp * n_blocks


@gluon.jit
def _sparse_steps(q_start, b, h, sparse, SPARSE_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """Steps [0, hi) a query tile loads under a block mask: its listed blocks', at least one (a tile with nothing
    listed computes one key block past the sequence, fully masked: its rows output 0)."""
    _, n_steps, _ = _sparse_row(sparse, b, h, q_start, SPARSE_BLOCK, BLOCK_N)
    return 0, gl.maximum(n_steps, 1)


@gluon.jit
def _sparse_block(j, row, sparse, len_k, SPARSE_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key block (BLOCK_N keys) of step j of a tile's block-mask row (_sparse_row's); a row with nothing listed:
    the first block past the sequence's keys."""
    num, idx, full_num, full_idx, stride_b, stride_h, stride_m, n_blocks = sparse
    n_partial, n_steps, off = row
    PER: gl.constexpr = SPARSE_BLOCK // BLOCK_N
    if j < n_partial:
        blk = gl.load(idx + off + j // PER)
    else:
        blk = gl.load(full_idx + off + (j - n_partial) // PER)
    kb = blk * PER + j % PER
    if n_steps == 0:
        kb = gl.cdiv(len_k, BLOCK_N)
    return kb


@gluon.jit
def _step_block(j, srow, sparse, len_k, SPARSE_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """(key block of step j, whether the element masks apply to it): block j itself and True without a block mask
    (the masks then apply everywhere); with one, _sparse_block and whether j is a partial block's step."""
    if SPARSE_BLOCK > 0:
        return _sparse_block(j, srow, sparse, len_k, SPARSE_BLOCK, BLOCK_N), j < srow[0]
    else:
        return j, True


@gluon.jit
def _element_masks(s, i, j, len_q, len_k, user, FLEX: gl.constexpr):
    """-inf where attn_mask (or a block mask's element mask) or mask_mod hides query i from key j (elementwise's
    rules, as the Triton kernels apply them)."""
    b, h, score_aux, mask_aux, bias_t, mask_t = user
    if FLEX.HAS_MASK:
        mask_bh, stride_mask_m, stride_mask_n = mask_t
        s = bias_mask_log2(s, i, j, len_q, len_k, mask_bh, 0, 0, mask_bh, stride_mask_m, stride_mask_n, False, True)
    if FLEX.MASK_MOD is not None:
        s = gl.where(FLEX.MASK_MOD(b, h, i, j, mask_aux), s, float("-inf"))
    return s


@gluon.jit
def _user_scores(s, rows, cols, len_q, len_k, user, partial, FLEX: gl.constexpr):
    """flashtile.flex's features on a score tile (log2 units where it has a bias or score_mod): attn_bias and
    score_mod on every block, then the element masks (_element_masks) on `partial` ones (every block without a
    block mask, its partial blocks with one): a mask applies after score_mod, which may map -inf to a finite
    score (softcap). user: (b, h, score_aux, mask_aux, (bias of the head, its row and column strides), (the
    mask's)); FLEX: fa3_fwd_kernel's. Also returns score_mod's input in natural-log units (its gradient's)."""
    b, h, score_aux, mask_aux, bias_t, mask_t = user
    i = gl.expand_dims(rows, 1)
    j = gl.expand_dims(cols, 0)
    if FLEX.HAS_BIAS:
        bias_bh, stride_bias_m, stride_bias_n = bias_t
        s = bias_mask_log2(s, i, j, len_q, len_k, bias_bh, stride_bias_m, stride_bias_n, bias_bh, 0, 0, True, False)
    s, s_in = user_mods_log2(s, b, h, i, j, score_aux, mask_aux, FLEX.SCORE_MOD, None)
    if FLEX.SPARSE_BLOCK > 0:
        if partial:
            s = _element_masks(s, i, j, len_q, len_k, user, FLEX)
    else:
        s = _element_masks(s, i, j, len_q, len_k, user, FLEX)
    return s, s_in


@gluon.jit
def _diagonal(rows, col0, len_q, len_k):
    """Each query row's diagonal key (i + len_k - len_q: causal and windows are aligned bottom-right) as an offset
    from a tile's first key col0: the bounds of the mask rule (_visible) and ALiBi's distances are taken from it."""
    return rows + (len_k - len_q) - col0


@gluon.jit
def _visible(s, rows, col0, offs, len_q, len_k, window, FEATURES: gl.constexpr, fill: gl.constexpr = float("-inf"),
             RANGE: gl.constexpr = False):
    """The mask rule per element (_key_blocks'): s with `fill` (S: -inf, P: 0) where query rows[i] does not see key
    col0 + offs[j] (FEATURES.TAIL: keys past len_k as well; without it every block ends within the sequence). The
    bounds are taken per row relative to col0 and compared with the tile's key offsets: no tile of key indices is
    made (its registers are the backward's accumulators'); the right window's bound and the sequence's end are one
    bound per row, one compare per element. RANGE (the backward's): a window's two edges by one unsigned compare."""
    window_left, window_right = window
    diag = _diagonal(rows, col0, len_q, len_k)
    keys = gl.expand_dims(offs, 0)
    if FEATURES.HAS_RIGHT:
        last = diag + window_right
        if FEATURES.TAIL:
            last = gl.minimum(last, len_k - col0 - 1)
        if RANGE and FEATURES.HAS_LEFT:
            # both edges by one unsigned compare: first <= key <= last <=> (key - first) <= (last - first) unsigned
            # (exact where last >= first, every row of a sequence: a row past it may see garbage, which P = 0 hides)
            first = diag - window_left
            span = gl.expand_dims((last - first).to(gl.uint32, bitcast=True), 1)
            return gl.where((keys - gl.expand_dims(first, 1)).to(gl.uint32, bitcast=True) <= span, s, fill)
        s = gl.where(keys <= gl.expand_dims(last, 1), s, fill)
    elif FEATURES.TAIL:
        s = gl.where(keys < len_k - col0, s, fill)
    if FEATURES.HAS_LEFT:
        s = gl.where(keys >= gl.expand_dims(diag - window_left, 1), s, fill)
    return s


@gluon.jit
def _softcap_tanh(s, score_scale):
    """tanh(S * score_scale) = 1 - 2 / (exp(2 S score_scale) + 1) (exact at both ends: exp2 saturates to 0 or inf)."""
    e = gl.exp2(s * (score_scale * 2.0 * LOG2E))
    return 1.0 - gl.fdiv(gl.full_like(e, 2.0), e + 1.0)


@gluon.jit
def _scores_log2(s, score, alibi, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """Raw Q K^T -> scores in log2 units with softcap and / or ALiBi (the Triton kernels' mods.scores_log2):
    softcap: softcap log2(e) tanh(S softmax_scale / softcap); else S softmax_scale log2(e); ALiBi then subtracts
    slope log2(e) |i + len_k - len_q - j|, plus the row term r_i of the tile's _alibi_terms (alibi; _alibi_log2).
    score = (score_scale (softcap: softmax_scale / softcap), softcap log2(e), slope log2(e)). Also returns
    tanh(.) (softcap; else S), which the backward's dS needs."""
    score_scale, softcap_log2, slope_log2 = score
    if SOFTCAP:
        t = _softcap_tanh(s, score_scale)
        s = t * softcap_log2
    else:
        t = s
        s = s * score_scale
    if ALIBI:
        s = _alibi_log2(s, alibi)
    return s, t


@gluon.jit
def _alibi_distance_log2(s, rows, col0, offs, len_q, len_k, slope_log2):
    """s - slope log2(e) |i + len_k - len_q - j| for query rows i and keys j = col0 + offs: the backward's ALiBi,
    the distance taken from each row's diagonal key as an offset from col0 (_diagonal, as _visible's bounds). (Two
    float terms s - |r_i - c_j| measured slower without a mask; the fold of _alibi_log2, its terms beside the
    backward's tiles, no faster.)"""
    dist = gl.expand_dims(_diagonal(rows, col0, len_q, len_k), 1) - gl.expand_dims(offs, 0)
    dist = gl.where(dist < 0, -dist, dist)
    return s - slope_log2 * dist.to(gl.float32)


@gluon.jit
def _alibi_terms(slope_log2, rows_from0, col0, cols_from0, diag0):
    """ALiBi's terms for a tile of rows row0 + a (rows_from0: a) and keys col0 + b (cols_from0: b), diag0 = row0 +
    len_k - len_q the first row's diagonal key: slope |i + len_k - len_q - j| = |r_a - c_b| with r_a = slope a and
    c_b = slope (col0 + b - diag0). Returns (r, c, whether every key of the tile lies at or left of every row's
    diagonal key: r - c >= 0 for every pair)."""
    N: gl.constexpr = cols_from0.shape[0]
    r = slope_log2 * rows_from0.to(gl.float32)
    # (small_float: an int -> float conversion per key would run at the rate of the softmax's exp2)
    c = slope_log2 * small_float(cols_from0) + slope_log2 * (col0 - diag0).to(gl.float32)
    return r, c, col0 + N - 1 <= diag0


@gluon.jit
def _alibi_log2(s, alibi):
    """s - slope |i + len_k - len_q - j| + r_i from _alibi_terms' (r, c, left): s - |r - c| + r, which on a `left`
    tile is s + c, one add per element (the causal mask makes every tile but the diagonal's left). The softmax does
    not see a row's constant r_i; the LSE subtracts it."""
    r, c, left = alibi
    if left:
        s = s + gl.expand_dims(c, 0)
    else:
        r2 = gl.expand_dims(r, 1)
        s = s - gl.abs(r2 - gl.expand_dims(c, 0)) + r2
    return s


@gluon.jit
def store_rows(tile, ptr, stride_row, row0, n_rows, col, ROWS: gl.constexpr, COLS: gl.constexpr):
    """A (ROWS, COLS) tile staged in shared memory into rows row0 + [0, n_rows) of a row-major 2-D view at columns
    [col, +COLS), by pointer stores masked at n_rows (where a TMA store of the whole tile would write rows past a
    sequence), read back in a blocked layout of 16-byte column runs (coalesced)."""
    VEC: gl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth   # 16 bytes
    T_COLS: gl.constexpr = COLS // VEC if COLS // VEC < 32 else 32   # threads along a row
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // T_COLS, T_COLS], [4, 1], [1, 0])
    x = tile.load(layout)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    offs = (gl.expand_dims((row0 + r).to(gl.int64) * stride_row, 1) + gl.expand_dims((col + d).to(gl.int64), 0))
    keep = gl.expand_dims(r < n_rows, 1) & gl.expand_dims(d < COLS, 0)
    gl.store(ptr + offs, x, mask=keep)


@gluon.jit
def _load_partition(loads, TILE: gl.constexpr, FEATURES: gl.constexpr, FLEX: gl.constexpr):
    """Producer and tile scheduler. It draws the program's next tile from a counter shared by the launch (dynamic
    scheduling: a program that drew short tiles draws more), skips a tile past its sequence's end (VARLEN: the
    tiles are counted for the longest sequence), writes its number into the slot of a free Q buffer (Q_BUFS per
    consumer warpgroup: the next tile's Q loads while this one's keys run) and loads each consumer warpgroup's Q
    rows there, then K_j / V_j for the tile's key blocks [lo, hi) (_tile_blocks) into ring buffer c % STAGES (c
    counts the program's blocks over its tiles) once every consumer warpgroup released it; SPARSE_BLOCK (a block
    mask): the key blocks its lists name for the tile (_sparse_steps, _sparse_block). FP8: V_j from V^T, a
    (HEAD_D, BLOCK_N) block. The counter: every program draws until it gets a number >= n_tiles (the consumers see
    it and stop); the last of those n_tiles + G draws resets it to 0 for the launch after this one on the stream.
    `loads`: the descriptors, buffers, barriers and scalars it uses (as the kernel names them)."""
    (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, slots,
     counter_ptr, n_m, n_tiles, nheads, group, seq, window, sparse) = loads
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    NUM_WG: gl.constexpr = TILE.NUM_WG
    Q_BUFS: gl.constexpr = TILE.Q_BUFS
    SPARSE_BLOCK: gl.constexpr = FLEX.SPARSE_BLOCK
    slot_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    c = 0
    it = 0
    tile = gl.atomic_add(counter_ptr, 1)
    while tile < n_tiles:
        bh, b, h, pid_m = _tile_coords(tile, n_m, nheads, FEATURES.HAS_RIGHT)
        q_row0, k_row0, len_q, len_k = _seq_info(b, seq, FEATURES.VARLEN)
        q_start = pid_m * (NUM_WG * BLOCK_M)
        if q_start < len_q:
            if SPARSE_BLOCK > 0:
                lo, hi = _sparse_steps(q_start, b, h, sparse, SPARSE_BLOCK, BLOCK_N)
                srow = _sparse_row(sparse, b, h, q_start, SPARSE_BLOCK, BLOCK_N)
            else:
                lo, hi = _tile_blocks(q_start, NUM_WG * BLOCK_M, len_q, len_k, window, BLOCK_N, FEATURES)
            qb = it % Q_BUFS
            for wg in gl.static_range(NUM_WG):
                # mbarriers start with phase 1 complete, so each buffer's first wait passes at once
                mbarrier.wait(q_empty.index(qb * NUM_WG + wg), ((it // Q_BUFS) & 1) ^ 1)
            # every warpgroup is done with the buffer's previous tile, so its slot is free; the expect below (an
            # arrive) publishes the slot to the consumers that wait on q_ready
            slots.index(qb).store(gl.full([1], tile, gl.int32, slot_layout))
            for wg in gl.static_range(NUM_WG):
                mbarrier.expect(q_ready.index(qb * NUM_WG + wg), q_desc.block_type.nbytes)
                tma_load(q_desc, [q_row0 + q_start + wg * BLOCK_M, h * TILE.HEAD_D],
                         q_ready.index(qb * NUM_WG + wg), q_bufs.index(qb * NUM_WG + wg))
            kv_col = (h // group) * TILE.HEAD_D
            vt_row = (b * (nheads // group) + h // group) * TILE.HEAD_D
            for j in range(lo, hi):
                s = c % TILE.STAGES
                # K_j's buffer frees as soon as S_{j-STAGES} is computed, V_j's only once P~ V of that block is:
                # separate barriers let K run ahead
                phase = ((c // TILE.STAGES) & 1) ^ 1
                kb = j
                if SPARSE_BLOCK > 0:
                    kb = _sparse_block(j, srow, sparse, len_k, SPARSE_BLOCK, BLOCK_N)
                row = k_row0 + kb * BLOCK_N
                mbarrier.wait(k_empty.index(s), phase)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma_load(k_desc, [row, kv_col], k_ready.index(s), k_bufs.index(s))
                mbarrier.wait(v_empty.index(s), phase)
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                if TILE.FP8:
                    tma_load(v_desc, [vt_row, kb * BLOCK_N], v_ready.index(s), v_bufs.index(s))
                else:
                    tma_load(v_desc, [row, kv_col], v_ready.index(s), v_bufs.index(s))
                c += 1
            it += 1
        tile = gl.atomic_add(counter_ptr, 1)
    if tile == n_tiles + gl.num_programs(0) - 1:
        gl.atomic_xchg(counter_ptr, 0)
    # no more tiles: the next slot says so (>= n_tiles), published by a plain arrive on each warpgroup's q_ready
    qb = it % Q_BUFS
    for wg in gl.static_range(NUM_WG):
        mbarrier.wait(q_empty.index(qb * NUM_WG + wg), ((it // Q_BUFS) & 1) ^ 1)
    slots.index(qb).store(gl.full([1], n_tiles, gl.int32, slot_layout))
    for wg in gl.static_range(NUM_WG):
        mbarrier.arrive(q_ready.index(qb * NUM_WG + wg), count=1)


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale, masked, rows, cols, mask, user, partial, alibi, FP8: gl.constexpr,
                    SCORED: gl.constexpr, FEATURES: gl.constexpr, FLEX: gl.constexpr):
    """Algorithm 1 lines 9-10 for one S block, in base 2: m_new = max(m_i, rowmax(S2)); P~ = exp2(S2 - m_new);
    l_new = exp2(m_i - m_new) l_i + rowsum(P~), with S2 = S * qk_scale (qk_scale = softmax_scale * log2 e > 0,
    which lets the row max be taken before scaling) or, SCORED (softcap / ALiBi), _scores_log2(S). A `masked`
    block (one some of the warpgroup's rows do not see whole: _key_blocks) gets -inf where the mask rule hides a
    key (_visible). FEATURES.GUARD: a row may have seen no key yet (m = -inf); its exponentials are taken against 0
    instead of NaN, so it adds nothing. Without GUARD the warpgroup's first block has a visible key in every row.
    mask = (len_q, len_k, (left, right), score), rows the block's query indices in the sequence, cols = (col0,
    offs) its keys' (col0 + offs).
    FP8: P~ = exp2(S * scale - m_new + log2 448) fills e4m3's range [0, 448] for the P V product; l carries the
    same factor, so it cancels in O = acc / l (the LSE subtracts it). flashtile.flex's features (`user` and
    `partial`: _user_scores) apply after softcap / ALiBi; SCORED then includes a bias or score_mod.
    alibi: the block's _alibi_terms (ALIBI); without a score_mod the scores, m_i with them, carry its row term
    r (_alibi_log2; the caller's LSE subtracts it).
    (SCORED: the scores are in log2 units before the max; else they are scaled inside the exponential.)"""
    MASKED: gl.constexpr = FEATURES.HAS_LEFT or FEATURES.HAS_RIGHT or FEATURES.TAIL
    len_q, len_k, window, score = mask
    if SCORED:
        s, _ = _scores_log2(s, score, alibi, FEATURES.SOFTCAP, FEATURES.ALIBI)
        if FEATURES.ALIBI and FLEX.SCORE_MOD is not None:   # (it reads the true score)
            s = s - gl.expand_dims(alibi[0], 1)
    col0, offs = cols
    if FLEX.SCORE_MOD is not None or FLEX.MASK_MOD is not None or FLEX.HAS_BIAS or FLEX.HAS_MASK:
        s, _ = _user_scores(s, rows, col0 + offs, len_q, len_k, user, partial, FLEX)
    if MASKED:   # (a problem without a mask compiles none of it)
        if masked:
            s = _visible(s, rows, col0, offs, len_q, len_k, window, FEATURES)
    if SCORED:
        m_new = gl.maximum(m_i, gl.max(s, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = m_new
    if FEATURES.GUARD:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    if FP8:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use - LOG2_E4M3_MAX, 1))
    elif SCORED:
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _turn(bars, wg: gl.constexpr, t, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG, wait until consumer warpgroup `wg` may issue its t-th group of wgmmas (FA3's "ping-pong"
    schedule, §3.1): turns go round the warpgroups, so one's GEMMs run on the tensor cores while the others
    compute their softmax. Warpgroup 0's first wait passes at once (an mbarrier starts with phase 1 complete).
    Every warpgroup runs n_blocks + 1 turns (n_blocks is the program's, not the warpgroup's: the blocks it does not
    read pass their turns too)."""
    if NUM_WG > 1 and PINGPONG:
        mbarrier.wait(bars.index(wg), (t & 1) ^ (1 if wg == 0 else 0))


@gluon.jit
def _pass_turn(bars, wg: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    # One thread of the warpgroup arrives (count 1), after a bar.sync of its 128 threads that Triton inserts
    # before every mbarrier.arrive of a multi-warp partition: all four warps have passed this turn's wait, so no
    # warp can see the turn barrier a phase ahead. tests/fa3_compile_check.py checks the PTX for that bar.sync;
    # the consumers' k_empty / v_empty arrivals (count NUM_WG) rely on it as well.
    if NUM_WG > 1 and PINGPONG:
        mbarrier.arrive(bars.index((wg + 1) % NUM_WG), count=1)


@gluon.jit
def _consumer_partition(wg: gl.constexpr, shared, TILE: gl.constexpr, FEATURES: gl.constexpr, FLEX: gl.constexpr):
    """Consumer warpgroup `wg`, tile after tile as the producer hands them over (the tile number in the slot of
    the Q buffer, >= n_tiles: none left): c counts the program's K / V blocks (ring position), t its turns, `it`
    its tiles (Q buffer). `shared`: the buffers, barriers and scalars it uses (as the kernel names them);
    TILE, FEATURES, FLEX: fa3_fwd_kernel's."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, slots, o_desc,
     lse_ptr, stride_lse_b, stride_lse_h, q_scale_ptr, k_scale_ptr, v_scale_ptr, n_m, n_tiles, nheads, group,
     qk_scale, seq, window, epilogue, alibi, flex) = shared
    alibi_ptr, stride_alibi_b, softcap_log2 = alibi
    score_aux, mask_aux, bias_t, mask_t, sparse = flex
    slot_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    NUM_WG: gl.constexpr = TILE.NUM_WG
    Q_BUFS: gl.constexpr = TILE.Q_BUFS
    SPARSE_BLOCK: gl.constexpr = FLEX.SPARSE_BLOCK
    c = 0
    t = 0
    it = 0
    mbarrier.wait(q_ready.index(wg), 0)
    tile = gl.max(slots.index(0).load(slot_layout), 0)
    while tile < n_tiles:
        bh, b, h, pid_m = _tile_coords(tile, n_m, nheads, FEATURES.HAS_RIGHT)
        q_row0, k_row0, len_q, len_k = _seq_info(b, seq, FEATURES.VARLEN)
        q_start = pid_m * (NUM_WG * BLOCK_M)
        srow = (0, 0, 0)
        if SPARSE_BLOCK > 0:
            lo, hi = _sparse_steps(q_start, b, h, sparse, SPARSE_BLOCK, BLOCK_N)
            srow = _sparse_row(sparse, b, h, q_start, SPARSE_BLOCK, BLOCK_N)
        else:
            lo, hi = _tile_blocks(q_start, NUM_WG * BLOCK_M, len_q, len_k, window, BLOCK_N, FEATURES)
        user = (b, h, score_aux, mask_aux, _head_tile(bias_t, b, h, FLEX.HAS_BIAS),
                _head_tile(mask_t, b, h, FLEX.HAS_MASK))
        tile_scale = qk_scale
        k_scales = k_scale_ptr
        v_scales = v_scale_ptr
        if TILE.FP8:   # the descale of this warpgroup's 64 Q rows joins the softmax scale (clamped: a sequence's last
            # tile may end before this warpgroup's rows); K_j's and V_j's are read per block
            q_blocks = len_q // BLOCK_M
            tile_scale = qk_scale * gl.load(q_scale_ptr + bh * q_blocks + gl.minimum(pid_m * NUM_WG + wg,
                                                                                     q_blocks - 1))
            bhk = b * (nheads // group) + h // group
            k_scales = k_scale_ptr + bhk * (len_k // BLOCK_N)
            v_scales = v_scale_ptr + bhk * (len_k // BLOCK_N)
        slope_log2 = softcap_log2 * 0.0
        if FEATURES.ALIBI:
            slope_log2 = gl.load(alibi_ptr + b * stride_alibi_b + h) * LOG2E
        lse_row = lse_ptr + b * stride_lse_b + h * stride_lse_h
        if FEATURES.VARLEN:   # (nheads, total_q): the sequence's rows start at its first token
            lse_row = lse_row + q_row0
        qb = (it % Q_BUFS) * NUM_WG + wg
        rows = (q_row0, q_start, len_q, len_k, h * TILE.HEAD_D)
        mask = (len_q, len_k, window, (tile_scale, softcap_log2, slope_log2))
        _consumer_tile(wg, q_bufs.index(qb), q_empty.index(qb), k_bufs, v_bufs, o_bufs, k_ready, v_ready, k_empty,
                       v_empty, turns, o_desc, lse_row, k_scales, v_scales, rows, mask, epilogue, lo, hi,
                       tile_scale, c, t, (user, srow, sparse), TILE, FEATURES, FLEX)
        c += hi - lo
        t += hi - lo + 1
        it += 1
        # the next tile's Q (or the end): its slot is valid once q_ready completes
        mbarrier.wait(q_ready.index((it % Q_BUFS) * NUM_WG + wg), (it // Q_BUFS) & 1)
        tile = gl.max(slots.index(it % Q_BUFS).load(slot_layout), 0)


@gluon.jit
def _head_tile(t, b, h, PRESENT: gl.constexpr):
    """(pointer at (b, h), row stride, column stride) of an attn_bias / attn_mask given as (pointer, batch, head,
    row and column strides; broadcast dimensions 0); t itself where absent."""
    if PRESENT:
        ptr, stride_b, stride_h, stride_m, stride_n = t
        return ptr + b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h, stride_m, stride_n
    else:
        return t


@gluon.jit
def _release(j0, j1, k_ready, v_ready, k_empty, v_empty, turns, c, t, wg: gl.constexpr, STAGES: gl.constexpr,
             NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Blocks j0 <= j < j1 of the ring (positions c + j, turns t + j) that this warpgroup does not read: released
    once loaded (an early release would complete the phase of the block STAGES before, which the other
    warpgroups may still be reading), their turns passed on."""
    for j in range(j0, j1):
        cur = (c + j) % STAGES
        mbarrier.wait(k_ready.index(cur), ((c + j) // STAGES) & 1)
        mbarrier.arrive(k_empty.index(cur), count=1)
        mbarrier.wait(v_ready.index(cur), ((c + j) // STAGES) & 1)
        mbarrier.arrive(v_empty.index(cur), count=1)
        _turn(turns, wg, t + j, NUM_WG, PINGPONG)
        _pass_turn(turns, wg, NUM_WG, PINGPONG)


@gluon.jit
def _consumer_tile(wg: gl.constexpr, q_smem, q_empty, k_bufs, v_bufs, o_bufs, k_ready, v_ready,
                   k_empty, v_empty, turns, o_desc, lse_row, k_scale_ptr, v_scale_ptr, rows, mask, epilogue,
                   lo, hi, qk_scale, c, t, flex, TILE: gl.constexpr, FEATURES: gl.constexpr, FLEX: gl.constexpr):
    """Consumer warpgroup `wg` on one tile: rows [wg * BLOCK_M, (wg + 1) * BLOCK_M) of its Q tile (in q_smem),
    through the whole key loop (Algorithm 1 lines 6-11), then its part of the epilogue (lines 12-15). The tile's
    key blocks are [lo, hi) (_tile_blocks); block j is the program's block c + j - lo (ring buffer
    (c + j - lo) % STAGES), turns t .. t + hi - lo. rows: (the sequence's first row in the 2-D views, the tile's
    first row in the sequence, len_q, len_k, the head's first column); mask: _online_softmax's.
    FP8 (FA3 §3.3): Q, K, V^T are e4m3 with one descale per block; qk_scale already holds Q_i's, K_j's joins it
    per block (k_scale_ptr[j]), and V_j's (v_scale_ptr[j]) rides on the row rescale: acc is kept in units of
    the last V block's descale, so block quantization costs a scalar per block.
    flex: (user, the tile's block-mask row (_sparse_row), the block mask's lists): with a block mask
    (FLEX.SPARSE_BLOCK) step j reads key block _sparse_block(j), every warpgroup runs every step, and the element
    masks apply on the partial blocks' steps."""
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    HEAD_D: gl.constexpr = TILE.HEAD_D
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    FP8: gl.constexpr = TILE.FP8
    SCORED: gl.constexpr = FEATURES.SOFTCAP or FEATURES.ALIBI or FLEX.SCORE_MOD is not None or FLEX.HAS_BIAS
    user, srow, sparse = flex
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, dtype)   # S_ij = Q_i K_j^T
    o_layout: gl.constexpr = wgmma_acc_layout(HEAD_D, dtype)    # O_i
    p_layout: gl.constexpr = p_operand_layout(o_layout, dtype)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_row0, q_start, len_q, len_k, q_col = rows
    len_q, len_k, window, score = mask
    row_lo = q_start + wg * BLOCK_M
    rows_from0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    q_rows = row_lo + rows_from0
    key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    diag0 = row_lo + (len_k - len_q)   # the first row's diagonal key (ALiBi's distances count from it)
    # this warpgroup's key blocks: it computes blocks [mine_lo, mine_hi) of the tile's and masks those outside
    # [full_lo, full_hi); the tile's other blocks (before or past its rows' window, or every block after the first
    # for rows past the sequence) it only releases (_release)
    mine_lo, full_lo, full_hi, mine_hi = _key_blocks(row_lo, row_lo + BLOCK_M, len_q, len_k, window, BLOCK_N,
                                                     FEATURES)
    mine_lo = gl.minimum(gl.maximum(mine_lo, lo), hi - 1)
    mine_hi = gl.minimum(gl.maximum(mine_hi, mine_lo + 1), hi)
    if FLEX.SPARSE_BLOCK > 0:   # (the steps are the listed blocks, not a range of them)
        mine_lo = lo
        mine_hi = hi
    if row_lo >= len_q:
        mine_hi = mine_lo + 1
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    # ring positions and turns relative to the tile's first block
    c = c - lo
    t = t - lo
    _release(lo, mine_lo, k_ready, v_ready, k_empty, v_empty, turns, c, t, wg, TILE.STAGES, TILE.NUM_WG, TILE.PINGPONG)
    scale_j = qk_scale
    if FP8:   # the first block's descales, and the next one's loaded a turn ahead of their use (latency hidden)
        scale_j = qk_scale * gl.load(k_scale_ptr + mine_lo)
        dv_prev = gl.load(v_scale_ptr + mine_lo)
        ks_next = gl.load(k_scale_ptr + gl.minimum(mine_lo + 1, mine_hi - 1))
        dv_next = gl.load(v_scale_ptr + gl.minimum(mine_lo + 1, mine_hi - 1))
    # the first step's key block, and (a block mask) the next one's read a turn ahead of its use, as FP8's descales
    kb, partial = _step_block(mine_lo, srow, sparse, len_k, FLEX.SPARSE_BLOCK, BLOCK_N)
    kb_next, partial_next = _step_block(gl.minimum(mine_lo + 1, mine_hi - 1), srow, sparse, len_k, FLEX.SPARSE_BLOCK,
                                        BLOCK_N)

    # (Q_i has landed: the caller waited for q_ready to read the tile number)
    # first turn: S_j = Q K_j^T (nothing to overlap it with yet)
    first = (c + mine_lo) % TILE.STAGES
    mbarrier.wait(k_ready.index(first), ((c + mine_lo) // TILE.STAGES) & 1)
    _turn(turns, wg, t + mine_lo, TILE.NUM_WG, TILE.PINGPONG)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(first).permute((1, 0)), s_init, use_acc=False, is_async=True)
    _pass_turn(turns, wg, TILE.NUM_WG, TILE.PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(first), count=1)
    masked = (kb < full_lo) | (kb >= full_hi)
    alibi = 0
    if FEATURES.ALIBI:
        alibi = _alibi_terms(score[2], rows_from0, kb * BLOCK_N, key_cols, diag0)
    # (the key indices whole, col0 = 0: ptxas allocates the ALiBi variant's registers better so than from the
    # block's first key and offsets, which the backward takes)
    p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, scale_j, masked, q_rows, (0, kb * BLOCK_N + key_cols), mask,
                                         user, partial, alibi, FP8, SCORED, FEATURES, FLEX)
    p = _p_operand(p, dtype, p_layout, BLOCK_M, BLOCK_N, FP8)
    for j in range(mine_lo + 1, mine_hi):
        cur = (c + j) % TILE.STAGES
        prev = (c + j - 1) % TILE.STAGES
        if FP8:   # block j's descales (loaded last turn); block j + 1's
            scale_j = qk_scale * ks_next
            dv_j = dv_next
            ks_next = gl.load(k_scale_ptr + gl.minimum(j + 1, mine_hi - 1))
            dv_next = gl.load(v_scale_ptr + gl.minimum(j + 1, mine_hi - 1))
        if FLEX.SPARSE_BLOCK > 0:
            kb = kb_next
            partial = partial_next
            kb_next, partial_next = _step_block(gl.minimum(j + 1, mine_hi - 1), srow, sparse, len_k, FLEX.SPARSE_BLOCK,
                                                BLOCK_N)
        else:
            kb = j
        # turn j: issue S_j = Q K_j^T, then O += P~_{j-1} V_{j-1}; both run on the tensor cores meanwhile
        mbarrier.wait(k_ready.index(cur), ((c + j) // TILE.STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((c + j - 1) // TILE.STAGES) & 1)
        _turn(turns, wg, t + j, TILE.NUM_WG, TILE.PINGPONG)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(cur).permute((1, 0)), s_init, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(_p_cast(p, FP8), _v_operand(v_bufs, prev, FP8), acc, is_async=True)
        _pass_turn(turns, wg, TILE.NUM_WG, TILE.PINGPONG)
        # wgmma groups retire in order: <= 1 outstanding means S_j is done (P~_{j-1} V_{j-1} may still run)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(cur), count=1)   # K_j read: the producer may refill its buffer
        masked = (kb < full_lo) | (kb >= full_hi)
        alibi_j = 0   # (not `alibi`: a name assigned before the loop would be carried across it)
        if FEATURES.ALIBI:
            alibi_j = _alibi_terms(score[2], rows_from0, kb * BLOCK_N, key_cols, diag0)
        cols = (0, kb * BLOCK_N + key_cols)
        p_next, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, scale_j, masked, q_rows, cols, mask, user, partial,
                                                  alibi_j, FP8, SCORED, FEATURES, FLEX)
        if FP8:   # (the wait cannot carry 8-bit registers; the e4m3 P~ is a temporary of this turn)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
        else:
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))
        mbarrier.arrive(v_empty.index(prev), count=1)   # V_{j-1} read
        # Algorithm 1 line 10's rescale, O = diag(exp2(m_old - m_new)) O, before P~_j V_j is added (FP8: and from
        # units of V_{j-1}'s descale to V_j's)
        if FP8:
            alpha = alpha * (dv_prev / dv_j)
            dv_prev = dv_j
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        p = _p_operand(p_next, dtype, p_layout, BLOCK_M, BLOCK_N, FP8)
    last = (c + mine_hi - 1) % TILE.STAGES
    mbarrier.wait(v_ready.index(last), ((c + mine_hi - 1) // TILE.STAGES) & 1)
    _turn(turns, wg, t + mine_hi, TILE.NUM_WG, TILE.PINGPONG)
    o_tok = warpgroup_mma(_p_cast(p, FP8), _v_operand(v_bufs, last, FP8), acc, is_async=True)
    _pass_turn(turns, wg, TILE.NUM_WG, TILE.PINGPONG)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    # epilogue (Algorithm 1 lines 12-15): O_i = diag(l_i)^-1 acc, L_i = m_i + log(l_i); GUARD: a row that saw no
    # key has l_i = 0 and outputs 0 with L = -inf. The output goes through this warpgroup's Q buffer (free: its S
    # wgmmas have retired), FP8: its own buffer; the TMA store has read it before the Q buffer is released
    l_safe = l_i
    if FEATURES.GUARD:
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    if FP8:
        o = acc * gl.expand_dims(gl.convert_layout(dv_prev / l_safe, o_rows), 1)
        o_smem = o_bufs.index(wg)
    else:
        o = acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
        o_smem = q_smem
    if FP8:   # l_i carries P~'s factor 448
        lse = (m_i + gl.log2(l_safe) - LOG2_E4M3_MAX) * LN2
    elif FEATURES.ALIBI and FLEX.SCORE_MOD is None:   # m_i carries ALiBi's row term (_alibi_log2)
        lse = (m_i - score[2] * rows_from0.to(gl.float32) + gl.log2(l_safe)) * LN2
    else:
        lse = (m_i + gl.log2(l_safe)) * LN2
    if FEATURES.GUARD:
        lse = gl.where(l_i == 0.0, float("-inf"), lse)
    # Rows past the sequence (the next sequence's, or TMA's zero fill) were computed but are not stored: a
    # warpgroup's rows all past it store nothing; TAIL: rows partly past it store through masked pointer stores
    # (a TMA store would write the next sequence's rows)
    if row_lo < len_q:
        if FEATURES.TAIL:
            if row_lo + BLOCK_M > len_q:
                _store_rows(o, lse, o_smem, epilogue, q_row0, row_lo, len_q, lse_row, q_col, BLOCK_M, HEAD_D)
            else:
                _store_tile(o, lse, o_smem, o_desc, q_row0, row_lo, q_col, lse_row, q_rows)
        else:
            _store_tile(o, lse, o_smem, o_desc, q_row0, row_lo, q_col, lse_row, q_rows)
    mbarrier.arrive(q_empty, count=1)
    _release(mine_hi, hi, k_ready, v_ready, k_empty, v_empty, turns, c, t + 1, wg, TILE.STAGES, TILE.NUM_WG,
             TILE.PINGPONG)


@gluon.jit
def _store_tile(o, lse, o_smem, o_desc, q_row0, row_lo, q_col, lse_row, q_rows):
    """A warpgroup's output rows by one TMA store (through o_smem), and their LSE."""
    o_smem.store(o.to(o_desc.dtype))
    fence_async_shared()
    tma_store(o_desc, [q_row0 + row_lo, q_col], o_smem)
    gl.store(lse_row + q_rows, lse)
    tma.store_wait(pendings=0)


@gluon.jit
def _store_rows(o, lse, o_smem, epilogue, q_row0, row_lo, len_q, lse_row, q_col, BLOCK_M: gl.constexpr,
                HEAD_D: gl.constexpr):
    """A warpgroup's output rows that end past the sequence, through o_smem by masked pointer stores (store_rows;
    epilogue: the output's pointer and row stride), and their LSE."""
    out_ptr, stride_o_row = epilogue
    o_smem.store(o.to(out_ptr.dtype.element_ty))
    store_rows(o_smem, out_ptr, stride_o_row, q_row0 + row_lo, len_q - row_lo, q_col, BLOCK_M, HEAD_D)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows = row_lo + gl.arange(0, BLOCK_M, layout=row_layout)
    gl.store(lse_row + rows, gl.convert_layout(lse, row_layout), mask=rows < len_q)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               FP8: gl.constexpr):
    """P~ (fp32, in the S accumulator's layout) in the P V wgmma's register A-operand layout: 16-bit, cast and
    converted (register-local). FP8: in each 32 keys the accumulator holds keys {2q, 2q+1, 2q+8, 2q+9} (+16) in
    thread q of a quad where the e4m3 A operand wants {4q, ..., 4q+3} (+16); instead of exchanging bytes across
    the quad (shuffles), the keys are renumbered: key 16h + 8i + 2q + e becomes 16h + 4q + 2i + e (the reshape /
    permute below, which moves no data), and the quantizer stored V^T's keys in that order (KEY_PERM), so P V is
    unchanged. FP8: it stays fp32 until _p_cast, next to its wgmma."""
    if FP8:
        p = gl.reshape(p, [BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2])
        p = gl.permute(p, [0, 1, 2, 4, 3, 5])
        p = gl.reshape(p, [BLOCK_M, BLOCK_N])
        return gl.convert_layout(p, p_layout, assert_trivial=True)
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _p_cast(p, CAST: gl.constexpr):
    """CAST: P~ -> e4m3 (round to nearest even, saturating, as the quantizer and the Triton kernel), four
    consecutive keys (one A-operand register) per two cvt; else P~ as it is. Cast next to the wgmma that reads
    it: carried across the loop as e4m3, P~'s bytes were split and repacked (about 3 more instructions per
    element), which measured slower although it saves registers (at d256 a few spill)."""
    if CAST:
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        return p


@gluon.jit
def _v_operand(v_bufs, i, FP8: gl.constexpr):
    """V_j as the B operand (keys x HEAD_D) of P V. FP8 wgmma takes only K-major operands: V^T's buffer
    (HEAD_D x keys, keys contiguous), transposed as a view."""
    if FP8:
        return v_bufs.index(i).permute((1, 0))
    else:
        return v_bufs.index(i)


@gluon.jit
def fa3_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, counter_ptr,
                   out_ptr, cu_seqlens_q, cu_seqlens_k, alibi_ptr, flex, strides, sizes, scales, window,
                   TILE: gl.constexpr, FEATURES: gl.constexpr, FLEX: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   num_warps: gl.constexpr):
    """Persistent: G programs (at most one per SM) share the cdiv(seqlen_q, NUM_WG * BLOCK_M) output tiles of each
    of the n_bh = batch * nheads heads, drawing them from counter_ptr (an int32 that is 0 at the launch and
    again after it; _tile_coords: the order), so one tile's epilogue overlaps the next one's loads; with G = the
    tile count it is one tile per program. TILE (fa3.FwdTile): HEAD_D, BLOCK_M = 64 rows per consumer warpgroup
    (num_warps = 4: the first consumer is the default partition), BLOCK_N, STAGES, NUM_WG consumer warpgroups,
    Q_BUFS, PINGPONG, FP8. q/k/v/o descriptors are over the 2-D views (rows, nheads * HEAD_D) with blocks (BLOCK_M
    or BLOCK_N, HEAD_D); rows = batch * seqlen (dense) or tokens (VARLEN: sequence b's are cu_seqlens[b] ..
    cu_seqlens[b + 1], seqlen_q / seqlen_k the longest, seqlen_q >= 2). lse: (batch, nheads, seqlen_q) or (VARLEN,
    stride_lse_b = 0) (nheads, total_q), fp32, natural log. The argument groups:
    - flex: (bias_t, mask_t, sparse, score_aux, mask_aux) of flashtile.flex's features (below): tensors a call
      changes, so it follows the live tensors (a launch template of a flex problem takes it per call);
    - strides: (stride_lse_b, stride_lse_h, stride_o_row, stride_alibi_b);
    - sizes: (seqlen_q, seqlen_k, n_bh, nheads, group = query heads per K/V head);
    - scales: (qk_scale, softcap_log2); window: (window_left, window_right).
    The problem's FEATURES (params.Features; constexpr, so a problem without them compiles none of their code):
    - HAS_LEFT / HAS_RIGHT: a window (window_left / window_right keys around each row's bottom-right diagonal;
      causal is right = 0) - _key_blocks;
    - SOFTCAP (softcap_log2 = softcap log2 e; qk_scale = softmax_scale / softcap), ALIBI (alibi_ptr: float32
      slopes, (nheads) or (batch, nheads) with stride_alibi_b) - _scores_log2; else qk_scale = softmax_scale
      log2 e;
    - TAIL: a sequence may end inside a tile (seqlen_q % 64, seqlen_k % BLOCK_N, VARLEN): keys past it are
      masked, and output rows past it are not stored (out_ptr, stride_o_row: pointer stores where a TMA store
      would write past the sequence);
    - GUARD: a row may see no key (left windows, VARLEN, a right window above the diagonal, the features below):
      its output is 0 and its LSE -inf.
    flashtile.flex's features, FLEX (params.Flex; dense problems; _user_scores): HAS_BIAS (bias_t: attn_bias's
    pointer and its batch, head, row and column strides, 0 where it broadcasts), HAS_MASK (mask_t: a bool attn_mask
    or a block mask's element mask read as uint8, likewise), SCORE_MOD / MASK_MOD (@triton.jit functions, or None,
    with the values they capture in score_aux / mask_aux), SPARSE_BLOCK (> 0: a block mask of that block size,
    sparse = its (num, idx, full_num, full_idx) lists with their batch, head and row strides and the index lists'
    row length: a tile visits only the key blocks listed for its rows, SPARSE_BLOCK a multiple of the tile's rows
    and of BLOCK_N; TAIL and GUARD on). Absent ones get placeholders the kernel does not read.
    FP8: dense, seqlen_q % 64 == 0 and seqlen_k % BLOCK_N == 0, causal only with seqlen_q == seqlen_k; q, k
    e4m3, v_desc over V^T viewed (batch * nheads_k * HEAD_D, seqlen_k) with blocks (HEAD_D, BLOCK_N); o_desc over
    the bf16 / fp16 output; descales q_scale (batch, nheads, seqlen_q / BLOCK_M), k_scale, v_scale (batch,
    nheads_k, seqlen_k / BLOCK_N), contiguous float32 (unused otherwise)."""
    stride_lse_b, stride_lse_h, stride_o_row, stride_alibi_b = strides
    seqlen_q, seqlen_k, n_bh, nheads, group = sizes
    qk_scale, softcap_log2 = scales
    HEAD_D: gl.constexpr = TILE.HEAD_D
    BLOCK_M: gl.constexpr = TILE.BLOCK_M
    BLOCK_N: gl.constexpr = TILE.BLOCK_N
    NUM_WG: gl.constexpr = TILE.NUM_WG
    n_m = gl.cdiv(seqlen_q, NUM_WG * BLOCK_M)
    n_tiles = n_m * n_bh
    STAGES: gl.constexpr = TILE.STAGES
    Q_BUFS: gl.constexpr = TILE.Q_BUFS
    dtype: gl.constexpr = q_desc.dtype

    q_bufs = gl.allocate_shared_memory(dtype, [Q_BUFS * NUM_WG, BLOCK_M, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    if TILE.FP8:
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, HEAD_D, BLOCK_N], v_desc.layout)
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [NUM_WG, BLOCK_M, HEAD_D], o_desc.layout)
    else:
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
        o_bufs = q_bufs
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS * NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    slots = gl.allocate_shared_memory(gl.int32, [Q_BUFS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(Q_BUFS * NUM_WG):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)   # every consumer warpgroup releases the buffer
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    for i in gl.static_range(NUM_WG):
        mbarrier.init(turns.index(i), count=1)

    # partitions: consumer warpgroup 0 (the default partition, num_warps = 4), consumer warpgroups 1 (and 2), the
    # producer warp; each worker gets its own copy of the (scalar / shared-memory) arguments. Registers:
    # CONSUMER_REGS per consumer thread, 24 for the producer (setmaxnreg within the kernel's limit: fa3._regs)
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3)
    seq = (cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k)
    bias_t, mask_t, sparse, score_aux, mask_aux = flex
    shared = (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, slots,
              o_desc, lse_ptr, stride_lse_b, stride_lse_h, q_scale_ptr, k_scale_ptr, v_scale_ptr, n_m, n_tiles,
              nheads, group, qk_scale, seq, window, (out_ptr, stride_o_row), (alibi_ptr, stride_alibi_b, softcap_log2),
              (score_aux, mask_aux, bias_t, mask_t, sparse))
    loads = (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
             slots, counter_ptr, n_m, n_tiles, nheads, group, seq, window, sparse)
    # partition i < NUM_WG: consumer warpgroup i (i = 0: the default partition); i = NUM_WG: the producer
    gl.warp_specialize(
        [(_consumer_partition, (i, shared, TILE, FEATURES, FLEX)) if i < NUM_WG else
         (_load_partition, (loads, TILE, FEATURES, FLEX)) for i in (0, 1, 2, 3)[:NUM_WG + 1]],
        [4] * (NUM_WG - 1) + [1], [CONSUMER_REGS] * (NUM_WG - 1) + [24])

    for i in gl.static_range(Q_BUFS * NUM_WG):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(q_empty.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
    for i in gl.static_range(NUM_WG):
        mbarrier.invalidate(turns.index(i))

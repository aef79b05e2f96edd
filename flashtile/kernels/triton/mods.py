"""Score modifiers and masks shared by every Triton attention kernel: the one place masking lives.

All kernels work in the base-2 log domain (FA3 / Triton tutorial trick): scores are pre-multiplied by
log2(e) so the softmax uses exp2, and the stored LSE is converted back to natural log at the end.
"""
import triton
import triton.language as tl

from ..params import LOG2E  # noqa: F401  (host code imports it from here)

try:  # @triton.jit gives an InterpretedFunction under TRITON_INTERPRET=1
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted
except ImportError:  # pragma: no cover
    _Interpreted = ()


@triton.jit
def _decorated():
    pass


# Whether Triton runs this module's kernels through its interpreter. It decides when a function is decorated
# (TRITON_INTERPRET at import), so the type of a decorated function gives its answer for every kernel here.
INTERPRETED = tl.constexpr(isinstance(_decorated, _Interpreted))


def _per_tile(fn):
    """@triton.jit for the helpers that every tile's products pass through (mma, to_dtype), except under the
    interpreter: it runs a kernel as Python and re-patches triton.language on every call of a jitted helper, which
    costs more than a tile's arithmetic; there the same source runs as the plain Python function it is."""
    return fn if INTERPRETED else triton.jit(fn)


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


@_per_tile
def to_dtype(x, DTYPE: tl.constexpr):
    """x.to(DTYPE) with the GPU's conversions (round to nearest even): every conversion of the kernels between
    fp32 and a 16-bit float (P and dS before their products, the stored O, dQ, dK, dV, loaded inputs widened for
    fp32 arithmetic) goes through here.

    The Triton interpreter's own bf16 conversions are wrong: fp32 -> bf16 drops the low 16 bits (rounds toward
    zero: half an ulp of bias on average) and both directions mangle subnormals. There the bits are moved
    directly instead: bf16 -> fp32 is the 16 bits shifted up (exact), fp32 -> bf16 the high half rounded to
    nearest even on the low half (a NaN becomes the quiet NaN). Compiled kernels (INTERPRETED False) convert
    directly."""
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            if x.dtype == tl.float32:
                bits = x.to(tl.uint32, bitcast=True)
                hi = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
                hi = tl.where(x == x, hi, 0x7FC0)
                return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        if DTYPE == tl.float32:
            if x.dtype == tl.bfloat16:
                return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def seq_bounds(b, cu_seqlens_ptr, seqlen_static, IS_VARLEN: tl.constexpr):
    """(start row in the packed/varlen layout, length) of batch element b."""
    if IS_VARLEN:
        start = tl.load(cu_seqlens_ptr + b)
        end = tl.load(cu_seqlens_ptr + b + 1)
        return start, end - start
    else:
        return 0, seqlen_static


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
def scores_log2(qk, i, j, seqlen_q, seqlen_k, score_scale, softcap_log2, alibi_slope_log2,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Raw q.k products -> scores in log2 units, plus t = tanh(.) (needed by the softcap backward).

    Without softcap: s2 = qk * (softmax_scale * log2 e)        (score_scale = softmax_scale * log2 e)
    With softcap:    s2 = softcap * log2 e * tanh(qk * softmax_scale / softcap)
                                                              (score_scale = softmax_scale / softcap)
    ALiBi adds -slope * log2 e * |i + seqlen_k - seqlen_q - j|.
    """
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
def dropout_keep(seed, rng_offset, rng_base, i, j, rng_stride_m, dropout_p):
    """Keep mask of one tile (i, j broadcastable 2-D indices): Philox counter rng_offset + rng_base +
    i * rng_stride_m + j, exactly the counter flashtile.reference.rng.dropout_counter gives entry (b, h, i, j)."""
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
    m = -inf and is exponentiated against 0, so P~ = 0 and alpha = 1 instead of NaN.
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
def bias_mask_log2(s, i, j, seqlen_q, seqlen_k, bias_bh, stride_bias_m, stride_bias_n,
                   mask_bh, stride_mask_m, stride_mask_n, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Score tile s (log2 units) at query i, key j (broadcastable 2-D index tensors) plus attn_bias[i, j]
    (natural-log units, so times log2 e; added after softcap and ALiBi), and -inf where attn_mask[i, j] is
    False. Entries outside the sequences read bias 0 / mask False."""
    inb = (i < seqlen_q) & (j < seqlen_k)
    ii = i.to(tl.int64)
    jj = j.to(tl.int64)
    if HAS_BIAS:
        bias = tl.load(bias_bh + ii * stride_bias_m + jj * stride_bias_n, mask=inb, other=0.0)
        s = s + to_dtype(bias, tl.float32) * 1.4426950408889634
    if HAS_MASK:
        keep = tl.load(mask_bh + ii * stride_mask_m + jj * stride_mask_n, mask=inb, other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    return s


# --------------------------------------------------------------------------------------------------
# User-written modifiers (flashtile.flex): mask_mod / score_mod as Triton device functions compiled into the
# kernels. Each is a constexpr JITFunction (None: compiled out) with its captured values in a tuple `aux`.
# Scores reach score_mod in natural-log units (q.k * softmax_scale, after softcap / ALiBi / attn_bias), the
# unit FlexAttention uses; the kernels' log2 units are restored right after.
# --------------------------------------------------------------------------------------------------
@triton.jit
def user_mods_log2(s, b, h, i, j, score_aux, mask_aux, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr):
    """Score tile s (log2 units) at query i, key j -> (s after score_mod, in log2 units, -inf where mask_mod
    is False; s_in, score_mod's input in natural units, which its gradient needs)."""
    s_in = s * 0.6931471805599453
    if SCORE_MOD is not None:
        s = to_dtype(SCORE_MOD(s_in, b, h, i, j, score_aux), tl.float32) * 1.4426950408889634
    if MASK_MOD is not None:
        s = tl.where(MASK_MOD(b, h, i, j, mask_aux), s, float("-inf"))
    return s, s_in


@triton.jit
def score_mod_grad(ds, s_in, b, h, i, j, score_aux, GRAD_FN: tl.constexpr):
    """dS w.r.t. score_mod's output -> dS w.r.t. its input (GRAD_FN None: identity, an additive mod). Entries
    with dS = 0 (masked, or P = 0) stay exactly 0, whatever GRAD_FN does with an infinite s_in."""
    if GRAD_FN is not None:
        ds = tl.where(ds == 0.0, 0.0, to_dtype(GRAD_FN(ds, s_in, b, h, i, j, score_aux), tl.float32))
    return ds


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

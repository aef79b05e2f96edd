"""Score modifiers and masks shared by every Triton attention kernel: the one place masking lives.

All kernels work in the base-2 log domain (FA3 / Triton tutorial trick): scores are pre-multiplied by
log2(e) so the softmax uses exp2, and the stored LSE is converted back to natural log at the end.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


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

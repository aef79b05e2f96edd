"""FP8 (e4m3) attention forward as in FlashAttention-3 §3.3 (Shah et al. 2024): a fused quantization kernel and
an attention kernel over its tiles. The math is written out in flashtile/reference/fp8_emulation.py.

quant_fp8_kernel: one program per GROUP blocks of BLOCK rows of one (batch, head) of Q, K or V: load a block,
  optionally apply the incoherent transform x -> x diag(s) H / sqrt(d), take the block's amax, store descale =
  amax / 448 and e4m3(x * 448 / amax); V can be written transposed, (batch, nheads_k, d, seqlen_pad), so that the P V
  product's B operand is K-major in memory (FP8 wgmma accepts only K-major operands, FA3 §3.3 "layout").
  H is applied one of two ways: fwht_rows, the fast Walsh-Hadamard transform (log2 d butterfly stages on the
  register tile, O(d log d) adds), or fwht_rows_mma, one tensor-core product with the +-1 matrix (O(d^2)
  multiply-adds, but on the tensor cores). Each butterfly stage regroups the tile's columns, which Triton does
  through shared memory, so on Hopper the product is the faster (benchmarks/sweep_fp8.py's quantizer breakdown
  times both); the launcher takes it unless fp8.FWHT_MMA says otherwise. With GROUP blocks per program
  (fp8.quant_group) the matrix is built once per program.
attn_fwd_fp8_kernel: FA2's forward loop (fwd.py) on e4m3 tiles; the per-block scales enter as one scalar
  per S tile (folded into the softmax scale) and one per-row factor per V tile (folded into the rescale
  of the accumulator), so block quantization costs no extra work per element.

e4m3 rounding: the kernels' casts are round-to-nearest-even, saturating at +-448 (PTX cvt.rn.satfinite).
The Triton interpreter's fp32 -> fp8 cast does not round that way (it truncates with a half-up bit and
drops the carry into the exponent: 125.04 -> 64), so with SOFT_CAST / SOFT_ROUND the value is first rounded
onto the e4m3 grid in fp32 arithmetic (e4m3_round), after which any cast is exact. The launchers set them
under the interpreter only; on the GPU both casts give the same bits (checked by benchmarks/bench_fp8.py
and tests/gpu), and the hardware cast keeps the quantizer at the speed of a plain copy.
"""
import triton
import triton.language as tl

from .mods import key_range, load_rows, mma, present, to_dtype, visible

E4M3_MAX = 448.0
AMAX_FLOOR = 9.5367431640625e-07     # 2^-20: an all-zero block still gets a finite scale


@triton.jit
def e4m3_round(x):
    """fp32 -> the nearest e4m3fn value (ties to even, saturating at +-448), still fp32.

    For |x| in [2^E, 2^(E+1)) the e4m3 spacing is 2^(E-3) (2^-9 in the subnormals, E < -6); adding and
    subtracting 1.5 * 2^23 * spacing makes the fp32 adder do the rounding to that spacing."""
    a = tl.minimum(tl.abs(x), 448.0)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 121)                                   # 121 = 127 - 6: subnormal spacing 2^-9
    spacing = ((e - 3) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0                             # 1.5 * 2^23
    r = (a + magic) - magic
    return tl.where(x < 0, -r, r)


@triton.jit
def to_e4m3(x, SOFT_CAST: tl.constexpr):
    if SOFT_CAST:
        x = e4m3_round(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _fwht_stage(x, BLOCK: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    """Butterfly stage of half-width H: columns (c, c + H) inside each group of 2H -> (a + b, a - b)."""
    y = tl.reshape(x, (BLOCK, D // (2 * H), 2, H))
    y = tl.permute(y, (0, 1, 3, 2))                          # the pair axis last, for split/join
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (BLOCK, D))


@triton.jit
def fwht_rows(x, BLOCK: tl.constexpr, D: tl.constexpr):
    """Unnormalised fast Walsh-Hadamard transform of every row of x (BLOCK, D): x @ H_D in log2(D) butterfly stages
    of half-widths 1, 2, 4, ..., D / 2 (D a power of two, 2..256), unrolled at compile time."""
    for stage in tl.static_range(8):
        if 2 ** (stage + 1) <= D:
            x = _fwht_stage(x, BLOCK, D, 2 ** stage)
    return x


@triton.jit
def signed_hadamard(signs, BLOCK_D: tl.constexpr):
    """The +-1 matrix diag(signs) H_D (H[i, j] = (-1)^popcount(i & j)), built in registers (float32)."""
    i = tl.arange(0, BLOCK_D)
    v = i[:, None] & i[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)                                         # bit 0: parity of popcount(i & j), i, j < 256
    return tl.where((v & 1) == 0, 1.0, -1.0) * signs[:, None]


@triton.jit
def fwht_rows_mma(x, h):
    """x diag(signs) H_D on the tensor cores: x (BLOCK, D) in its 16-bit input dtype times h = signed_hadamard()
    in that dtype (+-1 and 0: exact), fp32 accumulate. Every product is exact; only the fp32 summation order
    differs from the butterflies."""
    return mma(x, h, None, None)


@triton.jit
def key_perm(c):
    """The key order of V^T that makes the Gluon FP8 kernel's P operand need no data exchange
    (gluon/_fa3_fwd._p_operand): bits (h, i, q1, q0, e) of c mod 32 -> (h, q1, q0, i, e)."""
    return (c & ~14) | ((c & 6) << 1) | ((c & 8) >> 2)


@triton.jit
def quant_fp8_kernel(
    X, Y, SCALE, SIGNS, AMAX_IN, x_strides, y_strides, scale_strides, sizes, inv_sqrt_d,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, INCOHERENT: tl.constexpr,
    PER_TENSOR: tl.constexpr, WRITE_Y: tl.constexpr, FWHT_MMA: tl.constexpr = False, SOFT_ROUND: tl.constexpr = True,
    KEY_PERM: tl.constexpr = False, GROUP: tl.constexpr = 1,
):
    """Y = e4m3(T(X) * 448 / amax), SCALE[b, h, blk] = amax / 448, T the optional incoherent transform.

    Block mode (PER_TENSOR=False): amax over this (BLOCK, d) tile. PER_TENSOR: amax is read from AMAX_IN
    (a 1-element tensor, the tensor-wide amax found by a first launch with WRITE_Y=False, which only
    stores the block amaxes into SCALE). Y's strides are free, so V can be written transposed
    (stride_yn = 1, stride_yd = seqlen_pad). KEY_PERM (V^T for the Gluon kernel, seqlen % 32 == 0): within each
    32 rows, row 16h + 8i + 2q + e is stored at 16h + 4q + 2i + e (key_perm).
    A program quantizes GROUP consecutive blocks of one (batch, head): diag(signs) H is built once per GROUP
    blocks (building it costs about as much as a block's product) and the loop loads the next block while this
    one is quantized. x_strides: X's (batch, row, head); y_strides: Y's (batch, row, head, d); scale_strides:
    SCALE's (batch, head); sizes: (nheads, seqlen, head_dim)."""
    stride_xb, stride_xn, stride_xh = x_strides
    stride_yb, stride_yn, stride_yh, stride_yd = y_strides
    stride_sb, stride_sh = scale_strides
    nheads, seqlen, head_dim = sizes
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    offs_r = tl.arange(0, BLOCK)                             # rows relative to the block: int32 offsets
    offs_d = tl.arange(0, BLOCK_D)
    b64 = tl.cast(b, tl.int64)
    x_head = X + b64 * stride_xb + tl.cast(h, tl.int64) * stride_xh
    y_head = Y + b64 * stride_yb + tl.cast(h, tl.int64) * stride_yh
    if INCOHERENT:
        signs = tl.load(SIGNS + offs_d, mask=offs_d < head_dim, other=0.0)
        if FWHT_MMA:
            hmat = to_dtype(signed_hadamard(signs, BLOCK_D), X.dtype.element_ty)
    first = pid_g * GROUP
    for pid_n in range(first, tl.minimum(first + GROUP, tl.cdiv(seqlen, BLOCK))):
        offs_n = pid_n * BLOCK + offs_r
        mask = (offs_n[:, None] < seqlen) & (offs_d[None, :] < head_dim)
        n0 = tl.cast(pid_n * BLOCK, tl.int64)
        x = tl.load(x_head + n0 * stride_xn + offs_r[:, None] * stride_xn + offs_d[None, :], mask=mask, other=0.0)
        if INCOHERENT:
            if FWHT_MMA:
                x = fwht_rows_mma(x, hmat) * inv_sqrt_d
            else:
                x = fwht_rows(to_dtype(x, tl.float32) * signs[None, :], BLOCK, BLOCK_D) * inv_sqrt_d
        else:
            x = to_dtype(x, tl.float32)
        if PER_TENSOR:
            amax = tl.load(AMAX_IN)
        else:
            amax = tl.max(tl.max(tl.abs(x), 1), 0)
        amax = tl.maximum(amax, 9.5367431640625e-07)
        # IEEE divisions (Triton's `/` on fp32 is approximate on NVIDIA): the same bits as the torch emulation
        if WRITE_Y:
            inv = tl.math.div_rn(amax * 0.0 + 448.0, amax)
            y = to_e4m3(x * inv, SOFT_ROUND)
            rows = key_perm(offs_r) if KEY_PERM else offs_r
            y_blk = y_head + n0 * stride_yn
            tl.store(y_blk + rows[:, None] * stride_yn + offs_d[None, :] * stride_yd, y, mask=mask)
            tl.store(SCALE + b * stride_sb + h * stride_sh + pid_n, tl.math.div_rn(amax, amax * 0.0 + 448.0))
        else:
            tl.store(SCALE + b * stride_sb + h * stride_sh + pid_n, amax)


@triton.jit
def _load_kv(desc, blk, kv_row, hk, offs_n, offs_d, cols, seqlen_k, stride_n, head_dim,
             MASKED: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_D: tl.constexpr):
    """K_j or V_j (BLOCK_N, BLOCK_D) e4m3 from its (seqlen, d) layout: one TMA copy, or mods.load_rows (columns past
    the head dim, and rows past seqlen_k where MASKED, read as 0). Through TMA, rows past seqlen_k are the next
    sequence's: the caller zeroes them where they matter."""
    if USE_TMA:
        t = desc.load([kv_row, hk * BLOCK_D])
    else:
        t = load_rows(blk + offs_n[:, None] * stride_n + offs_d[None, :], cols < seqlen_k, offs_d, head_dim, MASKED,
                      False)
    return t


@triton.jit
def _load_v(desc_v, v_blk, vt_row, start_n, kv_row, hk, offs_n, offs_d, cols, seqlen_k, stride_vn, stride_vd,
            head_dim, MASKED: tl.constexpr, V_TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """V_j as the (BLOCK_N, BLOCK_D) B operand of P V. V_TRANSPOSED: read from V^T (d, seqlen_pad), so
    the tile is K-major (sequence-contiguous) in memory as FP8 wgmma needs, and transposed in registers."""
    if V_TRANSPOSED:
        # V^T's columns [seqlen_k, seqlen_pad) hold zeros and the descriptor zero-fills past them
        if USE_TMA:
            vt = desc_v.load([vt_row, start_n])
        else:
            ptrs = v_blk + offs_d[:, None] * stride_vd + offs_n[None, :]
            if MASKED:
                vt = tl.load(ptrs, mask=(cols[None, :] < seqlen_k) & (offs_d[:, None] < head_dim), other=0.0)
            else:
                vt = tl.load(ptrs, mask=offs_d[:, None] < head_dim, other=0.0)
        v = tl.trans(vt)
    else:
        v = _load_kv(desc_v, v_blk, kv_row, hk, offs_n, offs_d, cols, seqlen_k, stride_vn, head_dim, MASKED, USE_TMA,
                     BLOCK_D)
        if USE_TMA and MASKED:
            # rows past seqlen_k are the next sequence's: zero them (as bytes: 0x00 is +0 in e4m3) so
            # that P = 0 there cannot meet a NaN
            v = tl.where(cols[:, None] < seqlen_k, v.to(tl.uint8, bitcast=True), 0).to(tl.float8e4nv, bitcast=True)
    return v


@triton.jit
def _fp8_tile(acc, l_i, m_i, dv_prev, start_n, row, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              V_TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr, SOFT_CAST: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """One step j of FA2 Alg. 1 (lines 7-10) on e4m3 tiles, for the key block starting at start_n; row: what every
    step of this program reads, as attn_fwd_fp8_kernel packs it."""
    (q, qk_scale, desc_k, desc_v, k_base, v_base, K_SCALE_ROW, V_SCALE_ROW, stride_ksm, stride_vsm, kv_row0, vt_row,
     hk, offs_m, offs_n, offs_d, seqlen_q, seqlen_k, stride_kn, stride_vn, stride_vd, head_dim) = row
    k_blk = k_base + tl.cast(start_n, tl.int64) * stride_kn
    v_blk = v_base + tl.cast(start_n, tl.int64) * stride_vn
    kv_row = kv_row0 + start_n
    cols = start_n + offs_n
    blk = start_n // BLOCK_N
    # rows past seqlen_k (the next sequence's, through TMA) only reach S entries that the mask sets to -inf
    k = _load_kv(desc_k, k_blk, kv_row, hk, offs_n, offs_d, cols, seqlen_k, stride_kn, head_dim,
                 MASKED, USE_TMA, BLOCK_D)
    # line 8: S = Q8 K8^T, fp32 accumulate; block descales of Q_i and K_j join the softmax scale (FA3 §3.3)
    # (the scale c > 0 is applied to the row max and inside exp2's argument, not to the whole tile)
    c = qk_scale * tl.load(K_SCALE_ROW + blk * stride_ksm)
    s = mma(q, tl.trans(k), None, None)
    if MASKED:
        s = tl.where(visible(offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, 0, 0, False, CAUSAL),
                     s, float("-inf"))
    # line 9: online softmax in log2 units
    m_new = tl.maximum(m_i, tl.max(s, 1) * c)
    m_use = m_new
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    # P~ scaled by 448 (free: it rides on the row max) so it spans e4m3's range; l carries the same factor
    p = tl.math.exp2(s * c - (m_use - 8.807354922057604)[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_v(desc_v, v_blk, vt_row, start_n, kv_row, hk, offs_n, offs_d, cols, seqlen_k, stride_vn, stride_vd,
                head_dim, MASKED, V_TRANSPOSED, USE_TMA, BLOCK_D)
    # line 10 with V_j's block descale dv_j folded into the row rescale: acc is kept in units of dv_j
    dv = tl.load(V_SCALE_ROW + blk * stride_vsm)
    acc = acc * (alpha * (dv_prev / dv))[:, None]
    acc = mma(to_e4m3(p, SOFT_CAST), v, acc, None)
    return acc, l_i, m_new, dv


@triton.jit
def attn_fwd_fp8_kernel(
    Q, K, V, O, LSE, Q_SCALE, K_SCALE, V_SCALE, desc_k, desc_v,
    q_strides, k_strides, v_strides, o_strides, lse_strides, q_scale_strides, k_scale_strides, v_scale_strides,
    sizes, score_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    V_TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr, SOFT_CAST: tl.constexpr,
):
    """O = softmax(S) V from e4m3 Q (b, sq, h, d), K (b, sk, hk, d), V (b, sk, hk, d) or V^T (b, hk, d, sk_pad).

    Scales: Q_SCALE[b, h // q_scale_group, m-block], K_SCALE / V_SCALE[b, hk, n-block], any stride 0 (per
    (batch, head_k) or per-tensor descales use stride_*sm = 0 and broadcast). LSE: natural log, float32.
    The groups: q_strides, k_strides, o_strides (batch, row, head); v_strides (batch, key, head, d: V^T's where
    V_TRANSPOSED); lse_strides (batch, head); q / k / v_scale_strides (batch, head, block); sizes (nheads, nheads_k,
    group_size, q_scale_group, seqlen_q, seqlen_k, vt_rows_per_head, head_dim); score_scale: softmax_scale log2 e."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh, stride_vd = v_strides
    stride_ob, stride_om, stride_oh = o_strides
    stride_lse_b, stride_lse_h = lse_strides
    stride_qsb, stride_qsh, stride_qsm = q_scale_strides
    stride_ksb, stride_ksh, stride_ksm = k_scale_strides
    stride_vsb, stride_vsh, stride_vsm = v_scale_strides
    nheads, nheads_k, group_size, q_scale_group, seqlen_q, seqlen_k, vt_rows_per_head, head_dim = sizes
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m       # longest rows first
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    hk = h // group_size
    start_m = pid_m * BLOCK_M
    b64 = tl.cast(b, tl.int64)
    q_base = Q + b64 * stride_qb + tl.cast(h, tl.int64) * stride_qh + tl.cast(start_m, tl.int64) * stride_qm
    k_base = K + b64 * stride_kb + tl.cast(hk, tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + tl.cast(hk, tl.int64) * stride_vh
    o_base = O + b64 * stride_ob + tl.cast(h, tl.int64) * stride_oh + tl.cast(start_m, tl.int64) * stride_om
    kv_row0 = b * seqlen_k                            # row of this sequence in the (b * sk, hk * d) view
    vt_row = (b * nheads_k + hk) * vt_rows_per_head   # row of this head in the (b * hk * d, sk_pad) view
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_scale_row = K_SCALE + b * stride_ksb + hk * stride_ksh
    v_scale_row = V_SCALE + b * stride_vsb + hk * stride_vsh
    dq = tl.load(Q_SCALE + b * stride_qsb + (h // q_scale_group) * stride_qsh + pid_m * stride_qsm)
    qk_scale = score_scale * dq                       # softmax_scale * log2(e) * descale_q (> 0)

    q = tl.load(q_base + offs_r[:, None] * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dv_prev = tl.load(v_scale_row)                    # any value: acc is 0 until the first tile

    # what every tile step reads (one tuple, so each call site names only the tile and whether it is masked)
    row = (q, qk_scale, present(desc_k), present(desc_v), k_base, v_base, k_scale_row, v_scale_row, stride_ksm,
           stride_vsm, kv_row0, vt_row, hk, offs_m, offs_n, offs_d, seqlen_q, seqlen_k, stride_kn, stride_vn,
           stride_vd, head_dim)
    lo, full_lo, full_hi, hi = key_range(start_m, seqlen_q, seqlen_k, 0, 0, BLOCK_M, BLOCK_N, False, CAUSAL)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, l_i, m_i, dv_prev = _fp8_tile(acc, l_i, m_i, dv_prev, start_n, row, False, CAUSAL, V_TRANSPOSED, USE_TMA,
                                           SOFT_CAST, BLOCK_N, BLOCK_D)
    # diagonal / ragged-end tiles (lo == full_lo without a left window)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i, dv_prev = _fp8_tile(acc, l_i, m_i, dv_prev, start_n, row, True, CAUSAL, V_TRANSPOSED, USE_TMA,
                                           SOFT_CAST, BLOCK_N, BLOCK_D)

    # Alg. 1 lines 12-13: O = diag(l)^-1 O~ (times the last V descale), L = m + log l (448 cancels in O)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (dv_prev / l_safe)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe) - 8.807354922057604) * 0.6931471805599453)
    tl.store(o_base + offs_r[:, None] * stride_om + offs_d[None, :], to_dtype(out, O.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim))
    lse_ptrs = LSE + b64 * stride_lse_b + tl.cast(h, tl.int64) * stride_lse_h + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)

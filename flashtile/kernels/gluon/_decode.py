"""Split-KV decode over a paged KV cache with pages smaller than the key tile (pages of 16 / 32 keys), in Gluon.

Triton's decode kernel (kernels/triton/decode.py) reads such pages by a per-row gather: a block-table entry and a
256-byte pointer load per key row, which reads HBM well below a contiguous cache's TMA tiles (random page order
itself costs little). Reading each page as a TMA box through tl.dot's
pipeline was slower still: Triton waits for every box on its own barrier. This kernel owns its barriers: a
BLOCK_N-key tile of K (and of V) is BLOCK_N / PAGE TMA boxes of (PAGE, HEAD_D) copied into one stage's buffer and
counted by ONE mbarrier with the tile's bytes, so a stage costs one wait whatever the page size.

Grid (batch * nheads_k, num_splits), one warpgroup per program (paged.PAGE_CONFIGS sizes the tiles and stages:
pages of 16 take 64-key tiles so that two programs share an SM). As in the Triton kernel, the tile packs the GQA
group's query heads and the seqlen_q query rows into its M rows (row r -> query r // group, head hk * group +
r % group; at most 64 rows, wgmma's M), each program runs FA2's Algorithm 1 lines 6-10 over its split's key
tiles (a STAGES-deep ring of K / V buffers refilled STAGES - 1 tiles ahead; a tile's block-table entries are read
at the start of the step that issues its copies, which waits for them only after S_j and its softmax), and
writes the final O and LSE (one split) or its split's normalised O_s and log2-sum-exp, which the last split of
the (batch, K/V head) to finish merges (FUSED: a ticket counter, as the Triton kernel's FUSED_COMBINE, where
decode.fuse_combine says so) or combine.py's kernel merges.
Bottom-right causal alignment as in the dense path; keys past seqlens_k[b] are masked (their V rows zeroed in
shared memory, the cache slots past a sequence's end need not hold finite values).

Imported only on a CUDA device of compute capability 9.x (flashtile.kernels.gluon.fa3 decides).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from ._fa3_fwd import p_operand_layout, wgmma_acc_layout

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a CTA-wide bar.sync: Triton 3.6's Gluon (the GPU image's) names it thread_barrier, later releases barrier
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _tile_pages(bt_row, j, last_page, PAGES: gl.constexpr):
    """Block-table entries of key tile j's PAGES pages, as a tuple (clamped to the last visible key's page)."""
    pages = ()
    for p in gl.static_range(PAGES):
        pages = pages + (gl.load(bt_row + gl.minimum(j * PAGES + p, last_page)), )
    return pages


@gluon.jit
def _issue(k_desc, v_desc, k_buf, v_buf, k_bar, v_bar, pages, col, PAGE: gl.constexpr, PAGES: gl.constexpr):
    """The TMA copies of one key tile: each page's (PAGE, HEAD_D) box of K (and of V) into its rows of the stage's
    buffer, all counted by the stage's one barrier per tensor."""
    mbarrier.expect(k_bar, PAGES * k_desc.block_type.nbytes)
    for p in gl.static_range(PAGES):
        tma_load(k_desc, [pages[p] * PAGE, col], k_bar, k_buf.slice(p * PAGE, PAGE, dim=0))
    mbarrier.expect(v_bar, PAGES * v_desc.block_type.nbytes)
    for p in gl.static_range(PAGES):
        tma_load(v_desc, [pages[p] * PAGE, col], v_bar, v_buf.slice(p * PAGE, PAGE, dim=0))


@gluon.jit
def _online_softmax_step(m_i, l_i, s):
    """FA2 Alg. 1 line 9 for a (rows, n) tile s in log2 units, as triton/mods.online_softmax_step (which Gluon
    cannot call): (m_new, P~ = exp2(s - m_new), alpha = exp2(m_i - m_new), l_new = alpha l_i + rowsum(P~)); a row
    that has seen no finite score yet (m_new = -inf) is exponentiated against 0, so P~ = 0 and alpha = 1, not NaN.
    Used by the key loop (s: scores) and by the merge of the splits (s: their lse2 values, P~: their weights)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    return m_new, p, alpha, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _merge_splits(o_ptr, lse_ptr, o_part_ptr, lse_part_ptr, b, hk, n_rows, group, seqlen_q, num_splits, o_strides,
                  lse_strides, part_strides, HEAD_D: gl.constexpr):
    """Flash-decoding's combine of one (batch, K/V head) tile's rows: O = sum_s w_s O_s / sum_s w_s, lse = log
    sum_s 2^lse2_s, w_s = 2^(lse2_s - max), as the online-softmax update over (lse2_s, O_s) pairs. RG rows and
    CHUNK splits at a time (one (RG, CHUNK, HEAD_D) load per step, so a step waits for memory once, not once per
    split); a row no split saw: O = 0, lse = -inf. The strides: paged_decode_kernel's groups."""
    stride_ob, stride_om, stride_oh = o_strides
    stride_lse_b, stride_lse_h = lse_strides
    stride_ps, stride_pm, stride_ph, stride_lps, stride_lpm = part_strides
    RG: gl.constexpr = 4
    CHUNK: gl.constexpr = 16
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0])   # (row, split, d)
    LS: gl.constexpr = gl.SliceLayout(2, L3)        # (row, split)
    LO: gl.constexpr = gl.SliceLayout(1, L3)        # (row, d)
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LO)), 0), 1)   # (1, 1, d)
    for r0 in range(0, n_rows, RG):
        rr = r0 + gl.arange(0, RG, layout=gl.SliceLayout(1, LS))
        row_p = b.to(gl.int64) * seqlen_q + rr // group
        h = (hk * group + rr % group).to(gl.int64)
        m_c = gl.full([RG], float("-inf"), gl.float32, layout=gl.SliceLayout(1, LS))
        l_c = gl.zeros([RG], gl.float32, layout=gl.SliceLayout(1, LS))
        acc = gl.zeros([RG, HEAD_D], gl.float32, layout=LO)
        for s0 in range(0, num_splits, CHUNK):
            ss = s0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LS))
            ok = gl.expand_dims(rr < n_rows, 1) & gl.expand_dims(ss < num_splits, 0)
            lse_t = gl.load(lse_part_ptr + gl.expand_dims(ss.to(gl.int64) * stride_lps, 0)
                            + gl.expand_dims(row_p * stride_lpm + h, 1), mask=ok, other=float("-inf"))
            o_off = (gl.expand_dims(gl.expand_dims(row_p * stride_pm + h * stride_ph, 1), 2)
                     + gl.expand_dims(gl.expand_dims(ss.to(gl.int64) * stride_ps, 0), 2) + d3)
            o_t = gl.load(o_part_ptr + o_off, mask=gl.expand_dims(ok, 2) & (d3 < HEAD_D), other=0.0)
            m_c, w, alpha, l_c = _online_softmax_step(m_c, l_c, lse_t)
            acc = (acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, LO)), 1)
                   + gl.sum(o_t * gl.expand_dims(w, 2), axis=1))
        empty = l_c == 0.0
        l_c = gl.where(empty, 1.0, l_c)
        lse = gl.where(empty, float("-inf"), (m_c + gl.log2(l_c)) * LN2)
        ro = r0 + gl.arange(0, RG, layout=gl.SliceLayout(1, LO))
        ro_ok = gl.expand_dims(ro < n_rows, 1) & (gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LO)),
                                                                0) < HEAD_D)
        out_off = (b.to(gl.int64) * stride_ob + (ro // group).to(gl.int64) * stride_om
                   + (hk * group + ro % group).to(gl.int64) * stride_oh)
        gl.store(o_ptr + gl.expand_dims(out_off, 1)
                 + gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LO)), 0),
                 (acc / gl.expand_dims(gl.convert_layout(l_c, gl.SliceLayout(1, LO)), 1)).to(o_ptr.dtype.element_ty),
                 mask=ro_ok)
        gl.store(lse_ptr + b.to(gl.int64) * stride_lse_b + h * stride_lse_h + rr // group, lse, mask=rr < n_rows)


@gluon.jit
def paged_decode_kernel(k_desc, v_desc, q_ptr, o_ptr, lse_ptr, o_part_ptr, lse_part_ptr, sem_ptr, bt_ptr, seqlens_ptr,
                        q_strides, o_strides, lse_strides, part_strides, stride_bt, sizes, score_scale,
                        HEAD_D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        HAS_SEQLENS: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
                        FUSED: gl.constexpr):
    """q / o (batch, seqlen_q, nheads, HEAD_D), lse (batch, nheads, seqlen_q) natural log; k_desc / v_desc over the
    cache's (num_pages * PAGE, nheads_k * HEAD_D) view with (PAGE, HEAD_D) boxes; bt (batch, >= pages) int32;
    seqlens_k (batch,) int32 (HAS_SEQLENS, plus seqlen_k_static) or seqlen_k_static for every batch element.
    SPLIT: each split stores its float32 partials (o_part (num_splits, batch * seqlen_q, nheads, HEAD_D), lse_part
    (num_splits, batch * seqlen_q, nheads), log2 units); FUSED: the last split of a (batch, K/V head) to finish (a
    ticket in sem (batch * nheads_k,) int32, zero between launches) merges them into o and lse and resets its
    ticket (else combine.py's kernel merges them). score_scale: softmax_scale * log2 e. The parameters a decode step
    changes come first (paged.LIVE); then the groups q_strides / o_strides (batch, row, head), lse_strides (batch,
    head), part_strides (o_part's split, row and head strides, lse_part's split and row strides), the block table's
    row stride and sizes (nheads_k, group = query heads per K/V head, seqlen_q, seqlen_k_static, num_splits)."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_ob, stride_om, stride_oh = o_strides
    stride_lse_b, stride_lse_h = lse_strides
    stride_ps, stride_pm, stride_ph, stride_lps, stride_lpm = part_strides
    nheads_k, group, seqlen_q, seqlen_k_static, num_splits = sizes
    BLOCK_M: gl.constexpr = 64                    # wgmma's M: the packed (query, head) rows, padded
    PAGES: gl.constexpr = BLOCK_N // PAGE
    dtype: gl.constexpr = k_desc.dtype
    s_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, dtype)
    o_layout: gl.constexpr = wgmma_acc_layout(HEAD_D, dtype)
    p_layout: gl.constexpr = p_operand_layout(o_layout, dtype)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    bhk = gl.program_id(0)
    split = gl.program_id(1)
    b = bhk // nheads_k
    hk = bhk % nheads_k
    seqlen_k = seqlen_k_static
    if HAS_SEQLENS:
        seqlen_k = gl.load(seqlens_ptr + b) + seqlen_k_static
    n_rows = seqlen_q * group
    # this split's key tiles (flash-decoding): [j_lo, j_hi) of the sequence's cdiv(seqlen_k, BLOCK_N)
    n_tiles = gl.cdiv(seqlen_k, BLOCK_N)
    per_split = gl.cdiv(n_tiles, num_splits)
    j_lo = gl.minimum(split * per_split, n_tiles)
    j_hi = gl.minimum(j_lo + per_split, n_tiles)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    last_page = gl.maximum(seqlen_k - 1, 0) // PAGE
    col = hk * HEAD_D

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype))
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)

    # the first STAGES - 1 tiles' copies in flight before anything else (Alg. 1 line 6's loads, run ahead)
    for t in gl.static_range(STAGES - 1):
        if j_lo + t < j_hi:
            _issue(k_desc, v_desc, k_bufs.index(t), v_bufs.index(t), k_ready.index(t), v_ready.index(t),
                   _tile_pages(bt_row, j_lo + t, last_page, PAGES), col, PAGE, PAGES)

    # Alg. 1 line 4: Q_i, the packed rows (padding rows 0, never stored)
    r_io = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    d_io = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, io_layout))
    q_off = (b.to(gl.int64) * stride_qb + (r_io // group).to(gl.int64) * stride_qm
             + (hk * group + r_io % group).to(gl.int64) * stride_qh)
    r_ok = r_io < n_rows
    io_ok = gl.expand_dims(r_ok, 1) & gl.expand_dims(d_io < HEAD_D, 0)
    q = gl.load(q_ptr + gl.expand_dims(q_off, 1) + gl.expand_dims(d_io, 0), mask=io_ok, other=0.0)
    q_smem.store(q)
    fence_async_shared()

    # Alg. 1 line 5
    rows = gl.arange(0, BLOCK_M, layout=s_rows)
    diag = rows // group + (seqlen_k - seqlen_q)      # each row's last visible key (bottom-right causal)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for j in range(j_lo, j_hi):
        it = j - j_lo
        s = it % STAGES
        # the block-table entries of the tile STAGES - 1 ahead, read now: their latency passes behind S_j and its
        # softmax, after which its copies go into the buffer tile j - 1 freed
        ahead = j + STAGES - 1
        nxt = _tile_pages(bt_row, ahead, last_page, PAGES)
        phase = (it // STAGES) & 1
        k_buf = k_bufs.index(s)
        v_buf = v_bufs.index(s)
        # Alg. 1 line 8: S = Q K_j^T, in log2 units, masked past the keys (and the causal diagonal)
        mbarrier.wait(k_ready.index(s), phase)
        qk = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_init, use_acc=False)
        cols = j * BLOCK_N + cols0
        keep = gl.expand_dims(cols < seqlen_k, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(diag, 1))
        s2 = gl.where(keep, qk * score_scale, float("-inf"))
        # Alg. 1 line 9: running max m_i, P~, l_i
        m_i, p, alpha, l_i = _online_softmax_step(m_i, l_i, s2)
        if ahead < j_hi:
            sa = (it + STAGES - 1) % STAGES
            _issue(k_desc, v_desc, k_bufs.index(sa), v_bufs.index(sa), k_ready.index(sa), v_ready.index(sa),
                   nxt, col, PAGE, PAGES)
        mbarrier.wait(v_ready.index(s), phase)
        if (j + 1) * BLOCK_N > seqlen_k:
            # the sequence's last tile: cache slots past its end may hold anything (0 x NaN is NaN): zeroed
            r_kv = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
            v_t = v_buf.load(io_layout)
            v_buf.store(gl.where(gl.expand_dims(r_kv < seqlen_k, 1), v_t, 0.0))
            fence_async_shared()
        # Alg. 1 line 10: O~ = diag(alpha) O~ + P~ V_j
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_buf, acc)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))

    # Alg. 1 lines 12-13: O = O~ / l, lse = m + log2 l; a row that saw no key: O = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))
    out = gl.convert_layout(acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1), io_layout)
    qi = r_io // group
    h = (hk * group + r_io % group).to(gl.int64)
    lse_io = gl.convert_layout(lse2, gl.SliceLayout(1, io_layout))
    o_off = b.to(gl.int64) * stride_ob + qi.to(gl.int64) * stride_om + h * stride_oh
    lse_off = b.to(gl.int64) * stride_lse_b + h * stride_lse_h + qi
    if SPLIT:
        row_p = b.to(gl.int64) * seqlen_q + qi
        part = row_p * stride_pm + h * stride_ph
        lpart = row_p * stride_lpm + h
        gl.store(o_part_ptr + split.to(gl.int64) * stride_ps + gl.expand_dims(part, 1) + gl.expand_dims(d_io, 0), out,
                 mask=io_ok)
        gl.store(lse_part_ptr + split.to(gl.int64) * stride_lps + lpart, lse_io, mask=r_ok)
        # flash-decoding's combine by the last split to finish (one launch): every thread's partial stores before
        # the ticket (bar.sync, then acq_rel at GPU scope publishes them); the last one merges the splits'
        # partials with the online-softmax rule (Alg. 1 line 9 over (lse_s, O_s) pairs) and resets the ticket
        if FUSED:
            thread_barrier()
            ticket = gl.atomic_add(sem_ptr + bhk, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                _merge_splits(o_ptr, lse_ptr, o_part_ptr, lse_part_ptr, b, hk, n_rows, group, seqlen_q, num_splits,
                              o_strides, lse_strides, part_strides, HEAD_D)
                gl.store(sem_ptr + bhk, 0)
    else:
        gl.store(o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(d_io, 0), out.to(o_ptr.dtype.element_ty),
                 mask=io_ok)
        gl.store(lse_ptr + lse_off, lse_io * LN2, mask=r_ok)

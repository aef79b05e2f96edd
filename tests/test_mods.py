"""The device helpers every Triton kernel shares (flashtile/kernels/triton/mods.py), each called on its own through a
small @triton.jit kernel (under TRITON_INTERPRET=1 on the CPU; the same kernels compile on a GPU):

- to_dtype: the GPU's conversions (round to nearest even) between fp32 and bf16 / fp16, which the interpreter's own
  bf16 conversions get wrong: bitwise against torch, every 16-bit pattern for the widening direction;
- mma: bf16 / fp16 / fp32 products with fp32 accumulation against float64 (the interpreter multiplies bf16 tiles
  as raw 16-bit integers unless mma widens them);
- visible, key_range, query_range: the mask rule and the key / query block ranges a block program visits, against
  a brute-force mask for random (seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N): no visible
  entry skipped, the unmasked middle range fully visible and in bounds, no block visited that holds nothing to see;
- small_float: integers below 2^23 as float32 from their bits, exact against torch's conversion;
- online_softmax_step: one step against its float64 formulas (masked rows included), and a sequence of steps
  against one softmax in float64 (scores far beyond fp32's exp2 range).

Each random test draws from the case's seed (tests/conftest.py prints the command that replays a failure).
The kernels that use these helpers are tested end to end elsewhere (tests/test_flash_attn.py, tests/test_dtypes_cpu.py
for bf16, tests/test_decode.py, tests/test_combine.py); the user-written score / mask mods are tests/test_flex.py.
"""
import random

import pytest
import torch
import triton
import triton.language as tl

import flashtile  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from attn_utils import DEVICE
from flashtile.kernels.elementwise import small_float
from flashtile.kernels.triton.mods import key_range, mma, online_softmax_step, query_range, to_dtype, visible
from flashtile.reference.dense import visible_mask

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16
TL = {fp16: tl.float16, fp32: tl.float32, bf16: tl.bfloat16}


# ---------------------------------------------------------------------------------------------------------
# to_dtype and mma

@triton.jit
def _convert_kernel(X, Y, N: tl.constexpr, DTYPE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, to_dtype(tl.load(X + offs), DTYPE))


def _convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    _convert_kernel[(1,)](x, y, N=x.numel(), DTYPE=TL[dtype])
    return y


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equal, except that any NaN matches any NaN (the payload is not part of the contract)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN at other places"
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    g, w = got[~nan].view(ints), want[~nan].view(ints)
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {g.numel()} differ, first: got {got[~nan][bad[0]].item()!r} "
                              f"want {want[~nan][bad[0]].item()!r}")


def _fp32_edge_values(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """fp32 values a conversion to dtype must round right: random magnitudes over the whole exponent range, exact
    ties (halfway between two representable values, both parities), one ulp of fp32 either side of a tie,
    subnormals of both formats, signed zeros, infinities, NaN, values that round up to infinity."""
    drop = 16 if dtype == bf16 else 13          # fp32 mantissa bits the narrow format lacks
    n = 1024
    mags = torch.randn(n, generator=gen).abs() * torch.exp2(torch.randint(-140, 128, (n,), generator=gen).float())
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    rand = (mags * signs).to(fp32)
    lo = {bf16: -126, fp16: -14}[dtype]
    kept = torch.randint(0, 1 << (23 - drop), (n,), generator=gen, dtype=torch.int32) << drop   # both parities
    exps = torch.randint(lo + 127, 127 + 16, (n,), generator=gen, dtype=torch.int32) << 23
    tie = kept | exps | (1 << (drop - 1))                       # exactly halfway: ties to even
    ties = torch.cat([tie, tie - 1, tie + 1]).view(fp32)
    ties = ties * torch.where(torch.rand(ties.numel(), generator=gen) < 0.5, -1.0, 1.0)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 65519.0, 65520.0,
                            1e-40, -1e-40, 1.4e-45, 5.96e-8, 2.98e-8, 6.1e-5, 1.0e-7], dtype=fp32)
    return torch.cat([rand, ties, special])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # (numpy: fp32 -> fp16 inf)
@pytest.mark.parametrize("dtype", [bf16, fp16], ids=["bf16", "fp16"])
def test_to_dtype_rounds_fp32_to_nearest_even(dtype, seed):
    """fp32 -> bf16 / fp16 as the GPU converts (torch's CPU conversion rounds to nearest even too): bitwise."""
    x = _fp32_edge_values(dtype, torch.Generator().manual_seed(seed))
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    _same_bits(_convert(x, dtype).cpu(), x.to(dtype).cpu(), f"fp32 -> {dtype}")


@pytest.mark.parametrize("dtype", [bf16, fp16], ids=["bf16", "fp16"])
def test_to_dtype_widens_every_16_bit_pattern_exactly(dtype):
    """bf16 / fp16 -> fp32 is exact: all 65536 bit patterns (subnormals, infinities and NaNs included)."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).to(DEVICE)
    _same_bits(_convert(x, fp32).cpu(), x.float().cpu(), f"{dtype} -> fp32")


@triton.jit
def _mma_kernel(A, B, C, OUT, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, HAS_ACC: tl.constexpr,
                DOT_PREC: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    a = tl.load(A + rm[:, None] * K + rk[None, :])
    b = tl.load(B + rk[:, None] * N + rn[None, :])
    if HAS_ACC:
        acc = tl.load(C + rm[:, None] * N + rn[None, :])
        out = mma(a, b, acc, DOT_PREC)
    else:
        out = mma(a, b, None, DOT_PREC)
    tl.store(OUT + rm[:, None] * N + rn[None, :], out)


@pytest.mark.parametrize("dtype", [bf16, fp16, fp32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("has_acc", [False, True], ids=["no-acc", "acc"])
def test_mma_is_a_product_with_fp32_accumulation(dtype, has_acc, seed):
    """mma(a, b, acc) = a @ b (+ acc) with fp32 accumulation: within fp32 summation rounding of the float64
    product of the same operands (16-bit products are exact in fp32), in every input dtype."""
    m, n, k = 16, 32, 64
    a = (torch.randn(m, k) * 4).to(dtype).to(DEVICE)
    b = (torch.randn(k, n) * 4).to(dtype).to(DEVICE)
    c = torch.randn(m, n).to(DEVICE) * 100
    out = torch.full((m, n), float("nan"), device=DEVICE)
    _mma_kernel[(1,)](a, b, c, out, M=m, N=n, K=k, HAS_ACC=has_acc, DOT_PREC="ieee" if dtype == fp32 else None)
    ref = a.double() @ b.double() + (c.double() if has_acc else 0.0)
    bound = (k + 1) * 2.0 ** -24 * (a.double().abs() @ b.double().abs() + (c.double().abs() if has_acc else 0.0))
    if dtype == fp32:   # fp32 products round too (and a GPU's ieee dot may fuse them): one more rounding each
        bound = 2 * bound
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3e}, bound there {bound.flatten()[err.argmax()]:.3e}"


# ---------------------------------------------------------------------------------------------------------
# The mask rule and the block ranges

def window_ok(i, j, seqlen_q, seqlen_k, left, right):
    """Brute force of the window rule alone (no bounds): query i's diagonal is key i + seqlen_k - seqlen_q, key j
    is visible iff diag - left <= j <= diag + right (-1: that side unbounded). i, j broadcastable int tensors."""
    diag = i + seqlen_k - seqlen_q
    ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool)
    if right >= 0:
        ok &= j <= diag + right
    if left >= 0:
        ok &= j >= diag - left
    return ok


def brute_mask(seqlen_q, seqlen_k, left, right):
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    return window_ok(i, j, seqlen_q, seqlen_k, left, right)


def random_problems(seed, n):
    """n random (seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N): lengths 1..90 (either longer),
    each window side unbounded (-1), 0 (causal on the right) or 1..40, blocks 16 / 32 / 64 (BLOCK_M also 1, the
    decode kernel's query-row ranges, less often: under the interpreter every call of a jitted helper costs
    milliseconds). Half the lengths and window sides are a multiple of 16 give or take one, where an off-by-one
    in a bound moves it across a block edge."""
    rng = random.Random(seed)
    edge = lambda lo: max(lo, 16 * rng.randint(0, 5) + rng.choice([-1, 0, 1]))   # noqa: E731
    length = lambda: rng.choice([rng.randint(1, 90), edge(1)])   # noqa: E731
    side = lambda: rng.choice([-1, -1, 0, rng.randint(1, 40), edge(0)])   # noqa: E731
    return [(length(), length(), side(), side(), rng.choice([1, 16, 16, 32, 32, 64, 64]), rng.choice([16, 32, 64]))
            for _ in range(n)]


@triton.jit
def _visible_kernel(OUT, seqlen_q, seqlen_k, window_left, window_right, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    i = tl.arange(0, R)
    j = tl.arange(0, C)
    vis = visible(i[:, None], j[None, :], seqlen_q, seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    tl.store(OUT + i[:, None] * C + j[None, :], vis.to(tl.int8))


def test_visible_is_the_bottom_right_aligned_window(seed):
    """mods.visible over a 128 x 128 tile (past both sequence ends) equals the brute-force mask inside the
    sequences (and flashtile.reference's visible_mask), False outside."""
    for sq, sk, left, right, _, _ in random_problems(seed, 40):
        out = torch.full((128, 128), -1, dtype=torch.int8, device=DEVICE)
        _visible_kernel[(1,)](out, sq, sk, left, right, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, R=128, C=128)
        want = torch.zeros(128, 128, dtype=torch.bool)
        want[:sq, :sk] = brute_mask(sq, sk, left, right)
        assert torch.equal(want[:sq, :sk], visible_mask(sq, sk, (left, right)))
        assert torch.equal(out.cpu().bool(), want), (sq, sk, left, right)


@triton.jit
def _ranges_kernel(OUT, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KEYS: tl.constexpr):
    """OUT[program] = (lo, full_lo, full_hi, hi) of key_range for query block program (KEYS) or of query_range
    for key block program."""
    pid = tl.program_id(0)
    if KEYS:
        lo, full_lo, full_hi, hi = key_range(pid * BLOCK_M, seqlen_q, seqlen_k, window_left, window_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:
        lo, full_lo, full_hi, hi = query_range(pid * BLOCK_N, seqlen_q, seqlen_k, window_left, window_right,
                                               BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    k = tl.arange(0, 4)
    vals = tl.where(k == 0, lo, 0) + tl.where(k == 1, full_lo, 0) + tl.where(k == 2, full_hi, 0) + \
        tl.where(k == 3, hi, 0)
    tl.store(OUT + pid * 4 + k, vals)


def _ranges(keys: bool, sq, sk, left, right, block_m, block_n):
    programs = triton.cdiv(sq, block_m) if keys else triton.cdiv(sk, block_n)
    out = torch.full((programs, 4), -(1 << 30), dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(programs,)](out, sq, sk, left, right, BLOCK_M=block_m, BLOCK_N=block_n, HAS_LEFT=left >= 0,
                                HAS_RIGHT=right >= 0, KEYS=keys)
    return out.cpu().tolist()


def _check_ranges(ranges, other_len, other_block, vis, ext, what):
    """Checks of one program's [lo, full_lo) masked | [full_lo, full_hi) unmasked | [full_hi, hi) masked range
    over the other axis (length other_len, tiles of other_block). vis: (own rows in the sequence) x other
    (in the sequence) brute-force mask; ext: the program's whole block (past the sequence end too) against every
    index of the other axis (0 .. other_len), the window rule only."""
    lo, full_lo, full_hi, hi = ranges
    assert 0 <= lo <= full_lo <= full_hi <= hi <= other_len, what
    # tiles start at multiples of the block; full_lo / full_hi may sit at hi (clamped to the sequence) only where
    # the ranges after them are empty
    assert lo % other_block == 0 and (full_lo % other_block == 0 or full_lo == hi), what
    assert full_hi % other_block == 0 or full_hi == full_lo, what
    # nothing visible is skipped
    seen = vis.any(dim=0).nonzero().flatten()
    assert seen.numel() == 0 or (lo <= seen.min().item() and seen.max().item() < hi), what
    # the unmasked middle: whole tiles inside the other sequence, every entry visible to every row in the sequence
    assert vis[:, full_lo:full_hi].all(), what
    # the visited tiles are exactly those holding an index the block's rows (extended) may see
    want = set((ext.any(dim=0).nonzero().flatten() // other_block).tolist())
    assert set(range(lo // other_block, -(-hi // other_block))) == want, (what, sorted(want))


@pytest.mark.parametrize("keys", [True, False], ids=["key_range", "query_range"])
def test_block_ranges_against_brute_force(keys, seed):
    """key_range (per query block: the key blocks to visit) and query_range (per key block: the query blocks,
    the backward's transpose) for random problems and windows (see _check_ranges for what is pinned)."""
    for sq, sk, left, right, block_m, block_n in random_problems(seed, 100):
        if not keys and block_m == 1:
            block_m = 16
        what = dict(seqlen_q=sq, seqlen_k=sk, window_left=left, window_right=right, BLOCK_M=block_m,
                    BLOCK_N=block_n)
        vis = brute_mask(sq, sk, left, right)
        for p, r in enumerate(_ranges(keys, sq, sk, left, right, block_m, block_n)):
            if keys:
                rows = torch.arange(p * block_m, (p + 1) * block_m)
                ext = window_ok(rows[:, None], torch.arange(sk)[None, :], sq, sk, left, right)
                _check_ranges(r, sk, block_n, vis[p * block_m:(p + 1) * block_m], ext,
                              {**what, "query block": p, "got": r})
            else:
                cols = torch.arange(p * block_n, (p + 1) * block_n)
                ext = window_ok(torch.arange(sq)[None, :], cols[:, None], sq, sk, left, right)
                _check_ranges(r, sq, block_m, vis[:, p * block_n:(p + 1) * block_n].T, ext,
                              {**what, "key block": p, "got": r})
                if r[1] < r[2]:   # an unmasked query tile is read without the key bound: the key block is whole
                    assert (p + 1) * block_n <= sk, what


# ---------------------------------------------------------------------------------------------------------
# online_softmax_step

@triton.jit
def _softmax_step_kernel(S, M, L, M_OUT, P_OUT, A_OUT, L_OUT, scale, BM: tl.constexpr, BN: tl.constexpr,
                         MASKED: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    s = tl.load(S + rows[:, None] * BN + cols[None, :])
    m_new, p, alpha, l_new = online_softmax_step(tl.load(M + rows), tl.load(L + rows), s, MASKED, scale)
    tl.store(M_OUT + rows, m_new)
    tl.store(P_OUT + rows[:, None] * BN + cols[None, :], p)
    tl.store(A_OUT + rows, alpha)
    tl.store(L_OUT + rows, l_new)


@pytest.mark.parametrize("scale", [1.0, 0.375])
def test_online_softmax_step_against_float64(scale, seed):
    """One step: m_new = max(m_i, rowmax(s) * scale), P~ = exp2(s * scale - m_new), alpha = exp2(m_i - m_new),
    l_new = alpha * l_i + rowsum(P~), within fp32 rounding of float64. Rows that have seen no key yet
    (m_i = -inf, l_i = 0) and masked (-inf) scores included; a row still without a key after the step keeps
    m = -inf and gets P~ = 0, l = 0 and a finite alpha (no NaN, MASKED)."""
    bm, bn = 16, 16
    s = torch.randn(bm, bn) * 8                             # (P~ and alpha stay in fp32's normal range)
    s[torch.rand(bm, bn) < 0.3] = float("-inf")
    s[:4] = float("-inf")                                   # rows 0-3: nothing visible in this tile
    m = torch.randn(bm) * 8 * scale
    l_i = torch.rand(bm) * 5 + 0.5
    m[[0, 4, 5]] = float("-inf")                            # rows 0, 4, 5: nothing seen before
    l_i[[0, 4, 5]] = 0.0
    outs = [torch.full((bm,), float("nan")), torch.full((bm, bn), float("nan")), torch.full((bm,), float("nan")),
            torch.full((bm,), float("nan"))]
    s, m, l_i, *outs = (t.to(DEVICE) for t in (s, m, l_i, *outs))
    _softmax_step_kernel[(1,)](s, m, l_i, *outs, scale, BM=bm, BN=bn, MASKED=True)
    m_new, p, alpha, l_new = (t.cpu().double() for t in outs)
    s, m, l_i = s.cpu().double(), m.cpu().double(), l_i.cpu().double()
    want_m = torch.maximum(m, s.max(dim=1).values * scale)
    empty = torch.isneginf(want_m)
    assert torch.equal(torch.isneginf(m_new), empty) and empty.tolist()[:1] == [True]
    torch.testing.assert_close(m_new[~empty], want_m[~empty], rtol=1e-6, atol=0)
    m_use = torch.where(empty, 0.0, want_m)
    want_p = torch.exp2(s * scale - m_use[:, None])
    want_alpha = torch.exp2(m - m_use)
    assert torch.equal(p == 0, want_p == 0), "P~ must be exactly 0 at masked scores, and only there"
    torch.testing.assert_close(p, want_p, rtol=5e-5, atol=0)
    torch.testing.assert_close(alpha[~empty], want_alpha[~empty], rtol=5e-5, atol=0)
    assert alpha[empty].isfinite().all() and (alpha[empty] >= 0).all() and (alpha[empty] <= 1).all()
    torch.testing.assert_close(l_new, want_alpha * l_i + want_p.sum(dim=1), rtol=5e-5, atol=0)
    assert (l_new[empty] == 0).all()


@triton.jit
def _online_softmax_kernel(S, V, O, LSE2, scale, NT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BD: tl.constexpr):
    """FA2's inner loop over NT score tiles of BN keys: O = softmax(S * scale in log2 units) V, LSE2 = log2 of
    the row sums, through online_softmax_step alone."""
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for t in range(NT):
        s = tl.load(S + rows[:, None] * (NT * BN) + t * BN + cols[None, :])
        v = tl.load(V + (t * BN + cols[:, None]) * BD + offs_d[None, :])
        m_i, p, alpha, l_i = online_softmax_step(m_i, l_i, s, True, scale)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(O + rows[:, None] * BD + offs_d[None, :], acc / l_safe[:, None])
    tl.store(LSE2 + rows, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)))


def test_online_softmax_steps_compose_to_one_softmax(seed):
    """A sequence of steps over 5 tiles is one softmax over all keys, in float64, though the scores (log2 units)
    reach +-300, far past fp32's exp2 range: only the running max keeps them finite. Rows with keys in one
    tile only, in late tiles only, or in none (O = 0, LSE = -inf) included."""
    bm, bn, bd, nt, scale = 16, 16, 16, 5, 0.75
    s = torch.randn(bm, nt * bn) * 30 + torch.randn(bm, 1) * 250
    s[torch.rand(bm, nt * bn) < 0.25] = float("-inf")
    s[0] = float("-inf")                         # no key at all
    s[1, bn:] = float("-inf")                    # keys in the first tile only
    s[2, :3 * bn] = float("-inf")                # keys in the last two tiles only
    s[3] = torch.linspace(-300, 300, nt * bn)    # the max grows in every tile
    v = torch.randn(nt * bn, bd)
    o = torch.full((bm, bd), float("nan"))
    lse2 = torch.full((bm,), float("nan"))
    s, v, o, lse2 = (t.to(DEVICE) for t in (s, v, o, lse2))
    _online_softmax_kernel[(1,)](s, v, o, lse2, scale, NT=nt, BM=bm, BN=bn, BD=bd)
    t = s.cpu().double() * scale
    want_lse2 = torch.logsumexp(t * torch.log(torch.tensor(2.0, dtype=torch.float64)), dim=1) / \
        torch.log(torch.tensor(2.0, dtype=torch.float64))
    w = torch.exp2(t - want_lse2[:, None]).nan_to_num(0.0)
    want_o = w @ v.cpu().double()
    o, lse2 = o.cpu().double(), lse2.cpu().double()
    assert torch.isneginf(lse2[0]) and (o[0] == 0).all()
    # (fp32 scores of magnitude 300 carry 2e-5 of rounding in log2 units: 1e-5 of relative error per weight)
    torch.testing.assert_close(lse2[1:], want_lse2[1:], rtol=0, atol=1e-4)
    torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# small_float

@triton.jit
def _small_float_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, small_float(tl.load(X + offs)))


def test_small_float_is_exact():
    """Every integer of [0, 2^23) that ALiBi's distances take converts exactly: the ends, powers of two and their
    neighbours, and random ones."""
    ends = [0, 1, 2, 3, 127, 128, 4095, 4096, 2 ** 23 - 2, 2 ** 23 - 1]
    powers = [p + d for e in range(1, 23) for p in (2 ** e,) for d in (-1, 0, 1)]
    rand = torch.randint(0, 2 ** 23, (1024 - len(ends) - len(powers),)).tolist()
    x = torch.tensor(ends + powers + rand, dtype=torch.int32, device=DEVICE)
    y = torch.empty(x.shape, dtype=fp32, device=DEVICE)
    _small_float_kernel[(1,)](x, y, N=x.numel())
    assert torch.equal(y, x.to(fp32))

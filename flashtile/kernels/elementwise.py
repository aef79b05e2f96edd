"""Element-wise rules that both kernel families (triton/, gluon/) apply to a score tile: conversions with the GPU's
rounding (to_dtype, with the interpreter's bf16 worked around), an attn_bias / attn_mask tile, and the user mods of
flashtile.flex compiled in. A leaf of kernels/: it imports nothing of flashtile."""
import triton
import triton.language as tl

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


@triton.jit
def small_float(x):
    """Integers 0 <= x < 2^23 as float32 from their bits (x is the mantissa of 2^23 + x): two full-rate
    instructions, where an int -> float conversion per element runs at the rate of the softmax's exp2, on the same
    units (ALiBi's distances)."""
    return (x.to(tl.int32) + 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


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

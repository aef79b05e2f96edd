"""The public API: one argument model, validated in one place, dispatched to the Triton kernels.

Names, arguments and return values follow flash-attn 2.x (see docs/semantics.md); the packed
entry points are thin adapters over `flash_attn_func`. The kernels are wrapped as torch.library custom ops
(`flashtile::fwd`, `flashtile::bwd`) with fake implementations, and autograd is a torch.autograd.Function
around them, so models using flashtile compile under torch.compile(fullgraph=True) without graph breaks.
Eager calls on plain tensors run the ops' implementations directly (`_eager`: the dispatch costs more host
time than a small attention call takes on the GPU).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch.utils import _python_dispatch

from .kernels import relaunch
from .kernels.gluon import fa3
from .kernels.triton import launch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


# --------------------------------------------------------------------------------------------------
# Argument model and validation (the only place flashtile checks user input)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnArgs:
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float


def _fail(arg: str, value, expected: str, exc=ValueError):
    raise exc(f"flashtile: {arg} = {value!r}; expected {expected}")


def _check_tensor(name: str, t, dims: int):
    if not isinstance(t, torch.Tensor):
        _fail(name, type(t).__name__, "a torch.Tensor", TypeError)
    if t.dim() != dims:
        _fail(f"{name}.dim()", t.dim(), f"{dims} (shape {tuple(t.shape)})")
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(f"{name}.dtype", t.dtype, "one of float16, bfloat16, float32", TypeError)
    if t.numel() > 0 and t.stride(-1) != 1:
        _fail(f"{name}.stride(-1)", t.stride(-1), "1 (contiguous last dimension)")


def validate(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
             cu_seqlens_q=None, cu_seqlens_k=None) -> AttnArgs:
    """Check every argument before any kernel runs; return the normalised scalar arguments.

    Dense: q (b, sq, h, d), k/v (b, sk, hk, d). Varlen (cu_seqlens given): q (total_q, h, d), k/v (total_k, hk, d).
    """
    varlen = cu_seqlens_q is not None
    dims = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, dims)
    if not (q.dtype == k.dtype == v.dtype):
        _fail("k.dtype/v.dtype", (k.dtype, v.dtype), f"the dtype of q ({q.dtype})", TypeError)
    if not (q.device == k.device == v.device):
        _fail("k.device/v.device", (k.device, v.device), f"the device of q ({q.device})")
    if not varlen:
        if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            _fail("k.shape[0]/v.shape[0] (batch)", (k.shape[0], v.shape[0]), f"q's batch {q.shape[0]}")
    if k.shape[-3] != v.shape[-3]:
        _fail("v.shape[-3] (seqlen_k)", v.shape[-3], f"k's seqlen {k.shape[-3]}")
    h, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if v.shape[-2] != hk:
        _fail("v.shape[-2] (nheads_k)", v.shape[-2], f"k's nheads {hk}")
    if hk == 0 or h % hk != 0:
        _fail("k.shape[-2] (nheads_k)", hk, f"a divisor of nheads = {h} (GQA/MQA)")
    if k.shape[-1] != d or v.shape[-1] != d:
        _fail("k.shape[-1]/v.shape[-1] (headdim)", (k.shape[-1], v.shape[-1]), f"q's headdim {d}")
    if not 1 <= d <= MAX_HEADDIM:
        _fail("q.shape[-1] (headdim)", d, f"1 <= headdim <= {MAX_HEADDIM}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        _fail("dropout_p", dropout_p, "a float in [0, 1)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    # comparisons rather than math.isfinite: torch.compile(dynamic=True) cannot fold math.* calls (torch 2.13);
    # NaN fails every comparison, so it is refused too
    elif not isinstance(softmax_scale, (int, float)) or not -math.inf < softmax_scale < math.inf:
        _fail("softmax_scale", softmax_scale, "a finite float or None")
    if not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        _fail("softcap", softcap, "a float >= 0 (0 disables it)")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) for w in window_size)):
        _fail("window_size", window_size, "a pair of ints (left, right)")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        _fail("window_size", tuple(window_size), "values >= -1 (-1 means unbounded)")
    if causal:
        right = 0
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            _fail("alibi_slopes", type(alibi_slopes).__name__, "a torch.Tensor or None", TypeError)
        batch = q.shape[0] if not varlen else cu_seqlens_q.numel() - 1
        if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
            _fail("alibi_slopes.shape", tuple(alibi_slopes.shape), f"({h},) or ({batch}, {h})")
        if alibi_slopes.dtype != torch.float32:
            _fail("alibi_slopes.dtype", alibi_slopes.dtype, "torch.float32", TypeError)
        if alibi_slopes.device != q.device:
            _fail("alibi_slopes.device", alibi_slopes.device, f"the device of q ({q.device})")
        if alibi_slopes.stride(-1) != 1:
            _fail("alibi_slopes.stride(-1)", alibi_slopes.stride(-1), "1")
    return AttnArgs(float(softmax_scale), left, right, float(softcap), float(dropout_p))


def signature(args) -> tuple:
    """What argument checks read of their arguments: each tensor's shape, strides, dtype and device; anything else's
    type and value (None as itself). A tensor subclass gives an unhashable part (a list), as does an unhashable value
    (a list window_size, say): then there is no key."""
    T = torch.Tensor
    return tuple([x if x is None else (x.shape, x.stride(), x.dtype, x.device) if type(x) is T
                  else [] if isinstance(x, T) else (type(x), x) for x in args])


MEMO_MAX = 1024   # entries per memo of memoised()


def memoised(cache: dict, args: tuple, check, keep=None):
    """check(*args), remembered in cache per signature(args): a training or decode loop repeats one signature, and
    argument checks cost more host time than the lookup (BENCHMARKS.md section 1c). Only what passed is remembered
    (keep(result) is what is kept and returned, if given); no memo for an unhashable signature or while
    torch.compile traces (no global state for the tracer)."""
    try:
        if torch.compiler.is_compiling():
            raise TypeError
        key = signature(args)
        hit = cache.get(key)   # TypeError if unhashable
    except TypeError:
        key = hit = None
    if hit is None:
        hit = check(*args)
        if key is not None:
            hit = relaunch.remember(cache, key, hit if keep is None else keep(hit), MEMO_MAX)
    return hit


def _validate_positional(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, cu_seqlens_q,
                         cu_seqlens_k) -> AttnArgs:
    return validate(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


# argument signature -> AttnArgs of validate() calls that passed (validated)
_VALIDATED: dict = {}


def validated(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, cu_seqlens_q=None,
              cu_seqlens_k=None) -> AttnArgs:
    """validate(...), memoised on the arguments' signature (it reads nothing else of them)."""
    return memoised(_VALIDATED, (q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                 cu_seqlens_q, cu_seqlens_k), _validate_positional)


def validate_bias_mask(q, k, attn_bias, attn_mask):
    """Check attn_bias / attn_mask of a dense (batch, seqlen, nheads, headdim) call; return them as 4-D views
    broadcastable to (batch, nheads, seqlen_q, seqlen_k) (leading size-1 dimensions added, nothing copied)."""
    target = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    expected = f"broadcastable to (batch, nheads, seqlen_q, seqlen_k) = {target}"
    out = []
    for name, t, dtypes, what in (("attn_bias", attn_bias, SUPPORTED_DTYPES, "float16, bfloat16 or float32"),
                                  ("attn_mask", attn_mask, (torch.bool,), "torch.bool (True = may attend)")):
        if t is None:
            out.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            _fail(name, type(t).__name__, "a torch.Tensor or None", TypeError)
        if t.dtype not in dtypes:
            _fail(f"{name}.dtype", t.dtype, what, TypeError)
        if t.device != q.device:
            _fail(f"{name}.device", t.device, f"the device of q ({q.device})")
        if not 1 <= t.dim() <= 4:
            _fail(f"{name}.shape", tuple(t.shape), expected)
        t4 = t[(None,) * (4 - t.dim())]
        if any(n not in (1, m) for n, m in zip(t4.shape, target)):
            _fail(f"{name}.shape", tuple(t.shape), expected)
        out.append(t4)
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Custom ops (what torch.compile sees) and their fake implementations
# --------------------------------------------------------------------------------------------------
# Debugging aid, on in the test suite (tests/conftest.py sets FLASHTILE_POISON=1): outputs start as NaN, so an
# element a kernel failed to write shows up instead of passing as stale memory. Off by default: the fill is one
# more full write of out (and of dq, dk, dv in the backward): ~1% of an 8k-token forward, ~10% at 512 tokens.
POISON_OUTPUTS = os.environ.get("FLASHTILE_POISON", "0") == "1"


def _output_like(t: torch.Tensor) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _output(shape, device, dtype) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def _params(softmax_scale, window_left, window_right, softcap, dropout_p, rng_state):
    seed, offset = (int(x) for x in rng_state.tolist()) if dropout_p > 0 else (0, 0)
    return launch.AttnParams(softmax_scale, window_left, window_right, softcap, dropout_p, seed, offset)


def _lse_shape(q, cu_seqlens_q):
    if cu_seqlens_q is None:
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[1], q.shape[0])


def _check_device(q):
    if q.device.type == "cpu" and not launch.interpreting():
        raise RuntimeError("flashtile: CPU tensors run through the Triton interpreter, which must be enabled "
                           "before flashtile is imported: set TRITON_INTERPRET=1 (flashtile sets it itself "
                           "when no CUDA device is present)")


def _user_mods(mod_key, mod_tensors, grad_buffers=None):
    """launch.UserMods of flashtile.flex's registered mods (mod_key > 0), else None."""
    if not mod_key:
        return None
    from . import flex
    return flex.user_mods(mod_key, list(mod_tensors or []), grad_buffers)


def _score_tensors(mod_key, mod_tensors):
    """The captured tensors of the score_mod (the first ones of mod_tensors)."""
    if not mod_key:
        return []
    from . import flex
    return list(mod_tensors or [])[:flex.n_score_tensors(mod_key)]


def _sparse(block_size, *lists):
    if block_size <= 0:
        return None
    return launch.SparseLists(block_size, *lists)


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
            max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
            window_left: int, window_right: int, softcap: float, return_probs: bool, deterministic: bool,
            mod_tensors: List[torch.Tensor], attn_bias: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
            sparse_kv_num: Optional[torch.Tensor] = None, sparse_kv_idx: Optional[torch.Tensor] = None,
            sparse_full_kv_num: Optional[torch.Tensor] = None, sparse_full_kv_idx: Optional[torch.Tensor] = None,
            sparse_q_num: Optional[torch.Tensor] = None, sparse_q_idx: Optional[torch.Tensor] = None,
            sparse_full_q_num: Optional[torch.Tensor] = None, sparse_full_q_idx: Optional[torch.Tensor] = None,
            sparse_block_size: int = 0, mod_key: int = 0,
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward kernel. Returns (out, softmax_lse, rng_state (seed, offset) int64 on CPU, probs or empty).
    `deterministic` is only recorded for the backward (see _setup_context). attn_bias / attn_mask: 4-D,
    broadcastable to (batch, nheads, seqlen_q, seqlen_k). sparse_*: a block mask's tile lists (see
    launch.SparseLists), sparse_block_size > 0 when given; its partial tiles read attn_mask.
    mod_key > 0: flashtile.flex's registered score_mod / mask_mod, whose captured tensors are mod_tensors."""
    _check_device(q)
    # Dropout RNG state (seed, offset): drawn from torch's default generator (so torch.manual_seed
    # reproduces it), returned so the backward replays exactly the same mask Z; never a stored mask.
    if dropout_p > 0:
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
        rng_state = torch.tensor([seed, 0], dtype=torch.int64)
    else:
        rng_state = torch.zeros(2, dtype=torch.int64)
    out = _output_like(q)
    lse = _output(_lse_shape(q, cu_seqlens_q), q.device, torch.float32)
    params = _params(softmax_scale, window_left, window_right, softcap, dropout_p, rng_state)
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k)
    sparse = _sparse(sparse_block_size, sparse_kv_num, sparse_kv_idx, sparse_full_kv_num, sparse_full_kv_idx,
                     sparse_q_num, sparse_q_idx, sparse_full_q_num, sparse_full_q_idx)
    launch.flash_fwd(q, k, v, out, lse, params, alibi_slopes, **varlen, bias=attn_bias, mask=attn_mask, sparse=sparse,
                     mods=_user_mods(mod_key, mod_tensors))
    if return_probs:
        probs = launch.attn_probs(q, k, lse, params, alibi_slopes, **varlen, bias=attn_bias, mask=attn_mask)
    else:
        probs = torch.empty(0, device=q.device, dtype=torch.float32)
    return out, lse, rng_state, probs


_fwd_op = torch.library.custom_op("flashtile::fwd", mutates_args=(), device_types=None)(_fwd_impl)


@_fwd_op.register_fake
def _(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
      softmax_scale, window_left, window_right, softcap, return_probs, deterministic, mod_tensors, attn_bias=None,
      attn_mask=None, sparse_kv_num=None, sparse_kv_idx=None, sparse_full_kv_num=None, sparse_full_kv_idx=None,
      sparse_q_num=None, sparse_q_idx=None, sparse_full_q_num=None, sparse_full_q_idx=None, sparse_block_size=0,
      mod_key=0):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    rng_state = torch.empty(2, dtype=torch.int64)
    if return_probs:
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        sq = q.shape[1] if cu_seqlens_q is None else max_seqlen_q
        sk = k.shape[1] if cu_seqlens_k is None else max_seqlen_k
        probs = q.new_empty((batch, q.shape[-2], sq, sk), dtype=torch.float32)
    else:
        probs = q.new_empty((0,), dtype=torch.float32)
    return out, lse, rng_state, probs


def _bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, rng_state: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
            max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
            window_left: int, window_right: int, softcap: float, deterministic: bool,
            mod_tensors: List[torch.Tensor], attn_bias: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
            sparse_kv_num: Optional[torch.Tensor] = None, sparse_kv_idx: Optional[torch.Tensor] = None,
            sparse_full_kv_num: Optional[torch.Tensor] = None, sparse_full_kv_idx: Optional[torch.Tensor] = None,
            sparse_q_num: Optional[torch.Tensor] = None, sparse_q_idx: Optional[torch.Tensor] = None,
            sparse_full_q_num: Optional[torch.Tensor] = None, sparse_full_q_idx: Optional[torch.Tensor] = None,
            sparse_block_size: int = 0, bias_grad: bool = False, mod_key: int = 0, mod_grad_bits: int = 0,
            dlse: Optional[torch.Tensor] = None,
            ) -> List[torch.Tensor]:
    """[dq, dk, dv], plus dbias (attn_bias's shape and dtype) when bias_grad, plus the gradient of every
    score_mod captured tensor i with bit i of mod_grad_bits set (its shape and dtype). A list, so that callers
    of the three-gradient form unpack it unchanged. dlse: the gradient of the forward's LSE output, if any."""
    _check_device(q)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = _output_like(q), _output_like(k), _output_like(v)
    params = _params(softmax_scale, window_left, window_right, softcap, dropout_p, rng_state)
    sparse = _sparse(sparse_block_size, sparse_kv_num, sparse_kv_idx, sparse_full_kv_num, sparse_full_kv_idx,
                     sparse_q_num, sparse_q_idx, sparse_full_q_num, sparse_full_q_idx)
    # dBias accumulates in float32 (atomics where attn_bias broadcasts); tiles never visited stay 0
    dbias = torch.zeros(attn_bias.shape, device=q.device, dtype=torch.float32) if bias_grad else None
    # score_mod's captured tensors that want a gradient get a float32 zero buffer (same strides) to add into
    score_tensors = _score_tensors(mod_key, mod_tensors)
    mod_buffers = [torch.zeros_like(t, dtype=torch.float32) if mod_grad_bits >> i & 1 else None
                   for i, t in enumerate(score_tensors)]
    launch.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, params, alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                     deterministic=deterministic, bias=attn_bias, mask=attn_mask, sparse=sparse, dbias=dbias,
                     mods=_user_mods(mod_key, mod_tensors, mod_buffers), dlse=dlse)
    grads = [dq, dk, dv]
    if bias_grad:
        grads.append(dbias.to(attn_bias.dtype))
    for t, g in zip(score_tensors, mod_buffers):
        if g is not None:
            grads.append(g.to(t.dtype))
    return grads


_bwd_op = torch.library.custom_op("flashtile::bwd", mutates_args=(), device_types=None)(_bwd_impl)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, rng_state, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap, deterministic, mod_tensors,
      attn_bias=None,
      attn_mask=None, sparse_kv_num=None, sparse_kv_idx=None, sparse_full_kv_num=None, sparse_full_kv_idx=None,
      sparse_q_num=None, sparse_q_idx=None, sparse_full_q_num=None, sparse_full_q_idx=None, sparse_block_size=0,
      bias_grad=False, mod_key=0, mod_grad_bits=0, dlse=None):
    grads = [torch.empty_like(q, memory_format=torch.contiguous_format),
             torch.empty_like(k, memory_format=torch.contiguous_format),
             torch.empty_like(v, memory_format=torch.contiguous_format)]
    if bias_grad:
        grads.append(attn_bias.new_empty(attn_bias.shape))
    for i, t in enumerate(_score_tensors(mod_key, mod_tensors)):
        if mod_grad_bits >> i & 1:
            grads.append(torch.empty_like(t))
    return grads


def _eager(q: torch.Tensor) -> bool:
    """Whether a call may skip the custom op's dispatch and run its implementation directly: plain tensors, no
    torch.compile tracing and no dispatch mode (FakeTensorMode, FlopCounterMode, ...) that must see the op.
    The op's dispatch costs ~0.7 ms of host time per call on a GPU machine (torch 2.11), more than the kernels of
    a 2k-token attention call; the op itself stays what torch.compile, export and dispatch modes see."""
    return (type(q) is torch.Tensor and not torch.compiler.is_compiling()
            and _python_dispatch._get_current_dispatch_mode() is None)


def _fwd_call(*args):
    return _fwd_impl(*args) if _eager(args[0]) else torch.ops.flashtile.fwd(*args)


def _bwd_call(*args):
    return _bwd_impl(*args) if _eager(args[1]) else torch.ops.flashtile.bwd(*args)


_FWD_SCALARS = ("max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "window_left", "window_right",
                "softcap")


_N_FWD_BASE = 6 + len(_FWD_SCALARS) + 2   # q k v alibi cu_q cu_k, the scalars, return_probs, deterministic
_N_SPARSE = 8
# the op's optional trailing arguments: attn_bias, attn_mask, the 8 sparse lists, sparse_block_size, mod_key
_TRAILING_DEFAULTS = (None, None) + (None,) * _N_SPARSE + (0, 0)


class _FlashAttnFn(torch.autograd.Function):
    """Autograd of flashtile::fwd (the backward is flashtile::bwd).

    Inputs: the op's first _N_FWD_BASE arguments, then n_mod and the n_mod captured tensors of a score_mod /
    mask_mod (flattened: autograd sees tensors inside a list as constants), then any of the op's trailing
    arguments. Not torch.library.register_autograd: its wrapper re-reads the op's 28-argument schema once per
    argument on every call (torch._library.utils.fill_defaults), ~300 us of host time per training forward,
    more than the GPU time of a 2k-token attention call. torch.compile traces this Function like the op's
    registered autograd (tests/test_compile.py)."""

    @staticmethod
    def forward(ctx, *inputs):
        # (the ctx-taking form: with a separate setup_context, Function.apply binds arguments through
        # inspect.signature on every call)
        n_mod = inputs[_N_FWD_BASE]
        mods = list(inputs[_N_FWD_BASE + 1:_N_FWD_BASE + 1 + n_mod])
        output = _fwd_call(*inputs[:_N_FWD_BASE], mods, *inputs[_N_FWD_BASE + 1 + n_mod:])
        _FlashAttnFn._save(ctx, inputs, output)
        # an output the loss does not use sends None, not a zero tensor: no LSE gradient -> no D - dlse launch
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def _save(ctx, inputs, output):
        (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *scalars, _return_probs,
         deterministic) = inputs[:_N_FWD_BASE]
        n_mod = inputs[_N_FWD_BASE]
        mod_tensors = list(inputs[_N_FWD_BASE + 1:_N_FWD_BASE + 1 + n_mod])
        ctx.extra_at = _N_FWD_BASE + 1 + n_mod
        extra = tuple(inputs[ctx.extra_at:])
        attn_bias, attn_mask, *sparse, ctx.sparse_block_size, ctx.mod_key = extra + _TRAILING_DEFAULTS[len(extra):]
        ctx.n_inputs = len(inputs)
        ctx.n_mod_tensors = n_mod
        # which of score_mod's captured tensors want a gradient (bit i: tensor i)
        ctx.mod_grad_bits = sum(1 << i for i, t in enumerate(_score_tensors(ctx.mod_key, mod_tensors))
                                if t.requires_grad)
        out, lse, rng_state, _ = output
        ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi_slopes, cu_seqlens_q, cu_seqlens_k, attn_bias,
                              attn_mask, *sparse, *mod_tensors)
        ctx.scalars = (*scalars, deterministic)
        ctx.gluon = fa3.enabled()   # a forward inside fa3.disabled() gets its backward from the Triton kernels too

    @staticmethod
    def backward(ctx, dout, dlse, _drng, _dprobs):
        (q, k, v, out, lse, rng_state, alibi_slopes, cu_seqlens_q, cu_seqlens_k, attn_bias, attn_mask,
         *rest) = ctx.saved_tensors
        sparse, mod_tensors = rest[:_N_SPARSE], rest[_N_SPARSE:]
        if dout is None:   # only the LSE output reaches the loss
            dout = torch.zeros_like(out)
        bias_grad = attn_bias is not None and ctx.needs_input_grad[ctx.extra_at]
        with contextlib.nullcontext() if ctx.gluon else fa3.disabled():
            grads = _bwd_call(dout, q, k, v, out, lse, rng_state, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                              *ctx.scalars, list(mod_tensors), attn_bias, attn_mask, *sparse, ctx.sparse_block_size,
                              bias_grad, ctx.mod_key, ctx.mod_grad_bits, dlse)
        result = [grads[0], grads[1], grads[2]] + [None] * (ctx.n_inputs - 3)
        if bias_grad:
            result[ctx.extra_at] = grads[3]
        extra = iter(grads[3 + bias_grad:])
        for i in range(ctx.n_mod_tensors):
            result[_N_FWD_BASE + 1 + i] = next(extra) if ctx.mod_grad_bits >> i & 1 else None
        return tuple(result)


# --------------------------------------------------------------------------------------------------
# Public entry points (flash-attn 2.x names)
# --------------------------------------------------------------------------------------------------
def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q=None, max_seqlen_k=None, attn_bias=None, attn_mask=None, block_mask=None,
               score_mod=None, mask_mod=None, return_lse=False):
    a = validated(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, cu_seqlens_q,
                  cu_seqlens_k)
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    extra = ()
    mod_tensors = []
    if block_mask is not None and mask_mod is None:
        mask_mod = block_mask.mask_mod     # a block mask built from a MaskMod masks its partial tiles with it
    mods = score_mod is not None or mask_mod is not None
    if attn_bias is not None or attn_mask is not None or block_mask is not None or mods:
        attn_bias, attn_mask = validate_bias_mask(q, k, attn_bias, attn_mask)
        sparse = (None,) * 8 + (0,)
        if block_mask is not None:
            if attn_mask is not None:
                _fail("attn_mask", "a tensor", "None when block_mask is given (fold it into the block mask's mask_fn)")
            attn_mask, sparse = block_mask._kernel_args(q, k)
        extra = (attn_bias, attn_mask, *sparse)
        if mods:
            from . import flex
            mod_key, mod_tensors = flex.register(score_mod, mask_mod)
            extra = (*extra, mod_key)
    base = (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), a.dropout_p,
            a.softmax_scale, a.window_left, a.window_right, a.softcap, bool(return_attn_probs), bool(deterministic))
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, v, *mod_tensors, *extra)):
        out, lse, _, probs = _FlashAttnFn.apply(*base, len(mod_tensors), *mod_tensors, *extra)
    else:   # inference: the op alone (no autograd Function to set up)
        out, lse, _, probs = _fwd_call(*base, mod_tensors, *extra)
    if return_attn_probs:
        return out, lse, probs
    if return_lse:
        return out, lse
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                    attn_bias=None, attn_mask=None):
    """Exact attention, FlashAttention-2 algorithm.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.
    dtype float16, bfloat16 or float32; headdim 1..256; any strides with a contiguous last dimension.
    causal / window_size=(left, right) are aligned to the bottom-right corner; softcap > 0 applies
    softcap * tanh(s / softcap); alibi_slopes (nheads,) or (batch, nheads) float32.
    attn_bias: float16/bfloat16/float32, broadcastable to (batch, nheads, seqlen_q, seqlen_k) (e.g. (1, 1, sq, sk),
    (batch, 1, 1, sk)); added to the scores after softcap and ALiBi; receives a gradient (summed over its
    broadcast dimensions) when it requires grad. attn_mask: bool, same broadcast, True = may attend (SDPA's
    convention), combined with causal/window; a row with no visible key outputs 0 with lse = -inf.
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse (batch, nheads, seqlen_q) float32,
    S_dmask (batch, nheads, seqlen_q, seqlen_k) float32: P, negated where dropped) if return_attn_probs.
    softmax_lse is differentiable (flash-attn's is not): a loss that uses it gets its gradient.
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              attn_bias=None, attn_mask=None):
    """qkv: (batch, seqlen, 3, nheads, headdim). Gradients flow back into qkv. attn_bias/attn_mask as in
    flash_attn_func."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        _fail("qkv.shape", tuple(getattr(qkv, "shape", ())), "(batch, seqlen, 3, nheads, headdim)")
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias,
                      attn_mask=attn_mask)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             attn_bias=None, attn_mask=None):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim). attn_bias/attn_mask as
    in flash_attn_func."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        _fail("kv.shape", tuple(getattr(kv, "shape", ())), "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask)

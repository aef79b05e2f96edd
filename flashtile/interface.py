"""The dense entry points (flash-attn 2.x names), and the one path every trainable call takes to the kernels.

An entry point describes its call as a Problem (api/problem.py: one validator, remembered per argument signature)
and hands it to attention(), which runs the forward through the autograd Function _Attention where a gradient is
wanted. The kernels are also registered as torch.library custom ops (`flashtile::fwd`, `flashtile::bwd`) with fake
implementations, carrying the Problem packed (Problem.pack): that is what torch.compile, export and dispatch modes
see, so models using flashtile compile with fullgraph=True. Eager calls on plain tensors run the implementations
directly (_eager): the op dispatch costs more host time than a small attention call takes on the GPU.
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional

import torch
from torch.utils import _python_dispatch

from .api import problem as P
from .api import usermods
from .api.checks import check_device
from .api.errors import fail
from .api.problem import Problem
from .kernels import dispatch
from .kernels.gluon import fa3
from .kernels.params import GradSums, SparseLists
from .kernels.triton import launch


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------
# Debugging aid, on in the test suite (tests/conftest.py sets FLASHTILE_POISON=1): outputs start as NaN, so an
# element a kernel failed to write shows up instead of passing as stale memory. Off by default: the fill is one
# more full write of every output.
POISON_OUTPUTS = os.environ.get("FLASHTILE_POISON", "0") == "1"


def output_like(t: torch.Tensor) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def output(shape, device, dtype) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# Forward and backward of a Problem (what the custom ops and the autograd Function run)
# --------------------------------------------------------------------------------------------------
class Extras(NamedTuple):
    """A call's tensors beside q, k, v that no gradient flows into: ALiBi slopes, varlen bounds, a bool mask, a
    block mask's tile lists (params.SparseLists)."""
    alibi: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    sparse: Optional[SparseLists] = None


NO_EXTRAS = Extras()
_SPARSE_FIELDS = ("kv_num", "kv_idx", "full_kv_num", "full_kv_idx", "q_num", "q_idx", "full_q_num", "full_q_idx")


def _flat(x: Extras) -> list:
    """The extras as the ops' tensor list (alibi, cu_q, cu_k, mask, the 8 tile lists)."""
    sparse = [None] * 8 if x.sparse is None else [getattr(x.sparse, f) for f in _SPARSE_FIELDS]
    return [x.alibi, x.cu_seqlens_q, x.cu_seqlens_k, x.mask, *sparse]


def _unflat(p: Problem, flat) -> Extras:
    alibi, cu_q, cu_k, mask, *sparse = flat
    return Extras(alibi, cu_q, cu_k, mask, SparseLists(p.sparse_block, *sparse) if p.sparse_block else None)


def lse_shape(p: Problem, q: torch.Tensor):
    """softmax_lse: (batch, nheads, seqlen_q) dense, (nheads, total_q) varlen."""
    return (q.shape[1], q.shape[0]) if p.varlen else (q.shape[0], q.shape[2], q.shape[1])


def _zero_tail(t: torch.Tensor, start: int, dim: int = 0, value: float = 0.0) -> None:
    """Rows from `start` on of a packed varlen buffer belong to no sequence (cu_seqlens[-1] < total)."""
    if start >= 0:
        t.narrow(dim, start, t.shape[dim] - start).fill_(value)


def _padded_output(like: torch.Tensor, pad: int) -> torch.Tensor:
    # rows past the last sequence at an unknown start (values not read): zeros throughout, the kernels overwrite
    # every row that belongs to a sequence
    return torch.zeros_like(like, memory_format=torch.contiguous_format) if pad == P.PAD_UNKNOWN else output_like(like)


def forward(p: Problem, q, k, v, x: Extras = NO_EXTRAS, bias=None, mod_tensors=()) -> tuple:
    """(out, lse, rng_state or None, probs or None): out like q, lse (lse_shape) float32 natural log, rng_state the
    dropout's (seed, offset) int64 on the CPU, probs (batch, nheads, seqlen_q, seqlen_k) float32 when requested."""
    params = p.params
    rng_state = None
    if params.dropout_p > 0:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            fail("dropout_p", params.dropout_p, "0 inside a CUDA graph capture (the dropout seed is drawn on the host "
                 "at each call; a graph would replay one mask)")
        # drawn from torch's default generator (torch.manual_seed reproduces it), returned so the backward replays
        # exactly the same mask Z; never a stored mask
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
        rng_state = torch.tensor([seed, 0], dtype=torch.int64)
        params = dataclasses.replace(params, seed=seed, rng_offset=0)
    out = _padded_output(q, p.pad_q) if p.varlen else output_like(q)
    lse = output(lse_shape(p, q), q.device, torch.float32)
    if p.varlen and p.pad_q == P.PAD_UNKNOWN:
        lse.fill_(float("-inf"))
    mods = usermods.user_mods(p.mod_key, list(mod_tensors)) if p.mod_key else None
    dispatch.forward(p, params, q, k, v, out, lse, x, bias, mods)
    if p.varlen:
        _zero_tail(out, p.pad_q)
        _zero_tail(lse, p.pad_q, dim=1, value=float("-inf"))
    probs = None
    if p.return_probs:
        probs = launch.attn_probs(q, k, lse, params, x.alibi, x.cu_seqlens_q, x.cu_seqlens_k, p.seqlen_q, p.seqlen_k,
                                  bias=bias, mask=x.mask)
    return out, lse, rng_state, probs


def backward(p: Problem, dout, q, k, v, out, lse, rng_state, x: Extras = NO_EXTRAS, bias=None, mod_tensors=(),
             dlse=None, sums: Optional[GradSums] = None) -> list:
    """[dq, dk, dv], then dbias (attn_bias's shape and dtype) if p.bias_grad, then the gradient of every score_mod
    captured tensor i with bit i of p.mod_grad_bits set. dlse: the gradient reaching the forward's LSE output.
    sums (params.GradSums, plain problems): float32 running sums that dQ, dK and dV are added into, in float32 (a
    caller summing the gradients over several calls, as the ring does over its steps), from sums.delta where the
    caller computed D once; the result is then [None, None, None]."""
    params = p.params
    if rng_state is not None:
        seed, offset = (int(s) for s in rng_state.tolist())
        params = dataclasses.replace(params, seed=seed, rng_offset=offset)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if sums is not None:
        if not p.plain:
            fail("sums", "running sums", "None for problems with ALiBi, attn_bias, attn_mask, block masks or mods")
        dispatch.backward(p, params, dout, q, k, v, out, lse, None, None, None, x, dlse=dlse, sums=sums)
        return [None, None, None]
    if p.varlen:
        dq = _padded_output(q, p.pad_q)
        dk, dv = _padded_output(k, p.pad_k), _padded_output(v, p.pad_k)
    else:
        dq, dk, dv = output_like(q), output_like(k), output_like(v)
    if p.plain:
        dispatch.backward(p, params, dout, q, k, v, out, lse, dq, dk, dv, x, dlse=dlse)
        if p.varlen:
            _zero_tail(dq, p.pad_q)
            _zero_tail(dk, p.pad_k)
            _zero_tail(dv, p.pad_k)
        return [dq, dk, dv]
    # dBias accumulates in float32 (atomics where attn_bias broadcasts); tiles never visited stay 0
    dbias = torch.zeros(bias.shape, device=q.device, dtype=torch.float32) if p.bias_grad else None
    # When one of score_mod's captured tensors wants a gradient, every captured tensor gets a float32 zero buffer
    # (same strides) for its captured_grad_fn to add into, and the wanted ones are returned; when none wants one,
    # the captured_grad_fn is not run (it would otherwise add into the captured tensors themselves).
    score_tensors = list(mod_tensors)[:usermods.n_score_tensors(p.mod_key)]
    wanted = [bool(p.mod_grad_bits >> i & 1) for i in range(len(score_tensors))]
    mod_buffers = [torch.zeros_like(t, dtype=torch.float32) for t in score_tensors] if any(wanted) else None
    mods = usermods.user_mods(p.mod_key, list(mod_tensors), mod_buffers) if p.mod_key else None
    dispatch.backward(p, params, dout, q, k, v, out, lse, dq, dk, dv, x, bias, dbias, mods, dlse)
    grads = [dq, dk, dv]
    if p.bias_grad:
        grads.append(dbias.to(bias.dtype))
    if mod_buffers is not None:
        grads.extend(g.to(t.dtype) for t, g, w in zip(score_tensors, mod_buffers, wanted) if w)
    return grads


# --------------------------------------------------------------------------------------------------
# Custom ops (what torch.compile, export and dispatch modes see) and their fake implementations
# --------------------------------------------------------------------------------------------------
def _op_tensors(x: Extras, bias, mod_tensors) -> list:
    """The ops' optional tensors: alibi, cu_q, cu_k, mask, the 8 tile lists, bias, then the mods' tensors."""
    return [*_flat(x), bias, *mod_tensors]


def _from_op(q, k, v, tensors, ints, floats):
    flat, bias, mods = tensors[:12], tensors[12], tensors[13:]
    cu_q = flat[1]
    p = Problem.unpack(q, k, ints, floats, q.shape[0] if cu_q is None else cu_q.shape[0] - 1, v)
    return p, _unflat(p, flat), bias, mods


# The ops are defined with torch.library's low-level API: torch.library.custom_op's Python layers around an op (its
# autograd and backend wrappers, a redispatch, an output-alias check) cost more host time per call than the dispatch
# itself, and a compiled model calls the ops once per attention layer and step. They are functional (every output is
# a new tensor), implemented for CPU and CUDA tensors, with fake implementations for torch.compile and FakeTensorMode.
_LIB = torch.library.Library("flashtile", "FRAGMENT")


def _op(schema: str, fake):
    """Decorator: defines flashtile::<schema>, implemented by the decorated function, with the fake implementation
    `fake`."""
    name = schema.split("(", 1)[0]

    def define(impl):
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag, ))
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, impl, key)
        torch.library.register_fake(f"flashtile::{name}", fake, lib=_LIB)
        return impl
    return define


def _fwd_fake(q, k, v, tensors, ints, floats):
    p, x, _, _ = _from_op(q, k, v, tensors, ints, floats)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(lse_shape(p, q), dtype=torch.float32)
    rng_state = torch.empty(2, dtype=torch.int64)
    if p.return_probs:
        probs = q.new_empty((p.batch, p.nheads, p.seqlen_q, p.seqlen_k), dtype=torch.float32)
    else:
        probs = q.new_empty((0,), dtype=torch.float32)
    return out, lse, rng_state, probs


@_op("fwd(Tensor q, Tensor k, Tensor v, Tensor?[] tensors, int[] ints, float[] floats) -> (Tensor, Tensor, Tensor, "
     "Tensor)", _fwd_fake)
def _fwd_op(q, k, v, tensors, ints, floats):
    p, x, bias, mods = _from_op(q, k, v, tensors, ints, floats)
    q, k, v = dispatch.kernel_inputs(p, q, k, v)   # (the traced Function passed them as they are)
    out, lse, rng_state, probs = forward(p, q, k, v, x, bias, mods)
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64)
    if probs is None:
        probs = q.new_empty(0, dtype=torch.float32)
    return out, lse, rng_state, probs


def _bwd_fake(dout, q, k, v, out, lse, rng_state, tensors, ints, floats, dlse):
    p, _, bias, mods = _from_op(q, k, v, tensors, ints, floats)
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    if p.bias_grad:
        grads.append(bias.new_empty(bias.shape))
    grads.extend(torch.empty_like(t) for i, t in enumerate(mods[:usermods.n_score_tensors(p.mod_key)])
                 if p.mod_grad_bits >> i & 1)
    return grads


@_op("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor rng_state, Tensor?[] tensors, "
     "int[] ints, float[] floats, Tensor? dlse) -> Tensor[]", _bwd_fake)
def _bwd_op(dout, q, k, v, out, lse, rng_state, tensors, ints, floats, dlse):
    p, x, bias, mods = _from_op(q, k, v, tensors, ints, floats)
    q, k, v = dispatch.kernel_inputs(p, q, k, v)   # (the forward's copies are not kept: made again)
    return backward(p, dout, q, k, v, out, lse, rng_state if p.params.dropout_p > 0 else None, x, bias, mods, dlse)


def _eager(q: torch.Tensor) -> bool:
    """Whether a call may skip the custom op's dispatch and run its implementation directly: plain tensors, no
    torch.compile tracing and no dispatch mode (FakeTensorMode, FlopCounterMode, ...) that must see the op."""
    return (type(q) is torch.Tensor and not torch.compiler.is_compiling()
            and _python_dispatch._get_current_dispatch_mode() is None)


def _run_forward(p: Problem, q, k, v, x, bias, mod_tensors) -> tuple:
    if _eager(q):
        return forward(p, q, k, v, x, bias, mod_tensors)
    ints, floats = p.pack()
    out, lse, rng_state, probs = torch.ops.flashtile.fwd(q, k, v, _op_tensors(x, bias, mod_tensors), ints, floats)
    return out, lse, rng_state, probs if p.return_probs else None


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------
class _Attention(torch.autograd.Function):
    """Forward and backward of a Problem. Inputs: q, k, v, the Problem, the Extras (no gradient), attn_bias (None
    or a tensor that may receive a gradient), then the mods' captured tensors (flattened: autograd sees no tensor
    inside a tuple). Outputs out, lse (differentiable: a loss using it gets its gradient), probs (or None)."""

    @staticmethod
    def forward(ctx, q, k, v, p, x, bias, *mod_tensors):
        # (copies made here are no nodes of the graph: the gradients of q, k, v are those of their copies)
        q, k, v = dispatch.kernel_inputs(p, q, k, v)
        out, lse, rng_state, probs = _run_forward(p, q, k, v, x, bias, mod_tensors)
        ctx.p = p
        ctx.gluon = fa3.enabled()   # a forward inside fa3.disabled() gets its backward from the Triton kernels too
        ctx.has_x = x is not NO_EXTRAS
        ctx.save_for_backward(q, k, v, out, lse, rng_state, bias, *(_flat(x) if ctx.has_x else ()), *mod_tensors)
        # an output the loss does not use sends None, not a zero tensor: no LSE gradient -> no D - dlse work
        ctx.set_materialize_grads(False)
        if probs is not None:
            ctx.mark_non_differentiable(probs)
        return out, lse, probs

    @staticmethod
    def backward(ctx, dout, dlse, _dprobs):
        q, k, v, out, lse, rng_state, bias, *rest = ctx.saved_tensors
        p = ctx.p
        x, mods = (_unflat(p, rest[:12]), rest[12:]) if ctx.has_x else (NO_EXTRAS, rest)
        if dout is None:   # only the LSE output reaches the loss
            dout = torch.zeros_like(out)
        if ctx.gluon:
            grads = _run_backward(p, dout, q, k, v, out, lse, rng_state, x, bias, mods, dlse)
        else:
            with fa3.disabled():
                grads = _run_backward(p, dout, q, k, v, out, lse, rng_state, x, bias, mods, dlse)
        if not (p.bias_grad or mods):
            return grads[0], grads[1], grads[2], None, None, None
        dbias = grads[3] if p.bias_grad else None
        extra = iter(grads[3 + p.bias_grad:])
        mod_grads = [next(extra) if p.mod_grad_bits >> i & 1 else None for i in range(len(mods))]
        return (grads[0], grads[1], grads[2], None, None, dbias, *mod_grads)


def _run_backward(p: Problem, dout, q, k, v, out, lse, rng_state, x, bias, mods, dlse) -> list:
    if _eager(q):
        return backward(p, dout, q, k, v, out, lse, rng_state, x, bias, mods, dlse)
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64)
    ints, floats = p.pack()
    return torch.ops.flashtile.bwd(dout, q, k, v, out, lse, rng_state, _op_tensors(x, bias, mods), ints, floats,
                                   dlse)


def attention(p: Problem, q, k, v, x: Extras = NO_EXTRAS, bias=None, mod_tensors=()) -> tuple:
    """Run a validated Problem: (out, lse, probs or None), differentiable in q, k, v, attn_bias and the mods'
    captured tensors where they require grad."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (bias is not None and bias.requires_grad)
                                    or any(t.requires_grad for t in mod_tensors)):
        return _Attention.apply(q, k, v, p, x, bias, *mod_tensors)
    q, k, v = dispatch.kernel_inputs(p, q, k, v)   # inference: no autograd Function
    out, lse, _, probs = _run_forward(p, q, k, v, x, bias, mod_tensors)
    return out, lse, probs


# --------------------------------------------------------------------------------------------------
# Dense calls with every feature
# --------------------------------------------------------------------------------------------------
_DENSE: dict = {}   # argument signature -> Problem of dense calls that passed the checks


def _dense_problem(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs) -> tuple:
    """(Problem, q, k, v): the checked problem, and the inputs with a contiguous last dimension."""
    window_size, causal, deterministic, return_attn_probs = P.scalars(
        window_size, ("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs))
    q, k, v = P.contiguous_last(q, k, v)
    p = P.memoised(_DENSE, (q, k, v, P.number("dropout_p", dropout_p), P.number("softmax_scale", softmax_scale),
                            causal, window_size, P.number("softcap", softcap), alibi_slopes, deterministic,
                            return_attn_probs), P.dense)
    check_device(q)
    return p, q, k, v


def dense_attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, attn_bias=None, attn_mask=None,
                    block_mask=None, score_mod=None, mask_mod=None) -> tuple:
    """A dense call with any of attn_bias, attn_mask, a block mask (blocksparse.BlockMask) and flex mods (already
    checked by flashtile.flex): (out, lse, probs or None)."""
    p, q, k, v = _dense_problem(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs)
    if attn_bias is None and attn_mask is None and block_mask is None and score_mod is None and mask_mod is None:
        return attention(p, q, k, v, NO_EXTRAS if alibi_slopes is None else Extras(alibi=alibi_slopes))
    attn_bias, attn_mask = P.bias_mask(q, k, attn_bias, attn_mask)
    sparse = None
    if block_mask is not None:
        if attn_mask is not None:
            fail("attn_mask", "a tensor", "None when block_mask is given (fold it into the block mask's mask_fn)")
        attn_mask, sparse = block_mask.kernel_args(q, k)
        if mask_mod is None:
            mask_mod = block_mask.mask_mod   # a block mask built from a MaskMod masks its partial tiles with it
    mod_key, mod_tensors = (0, []) if score_mod is None and mask_mod is None else usermods.register(score_mod,
                                                                                                   mask_mod)
    grad = torch.is_grad_enabled()
    n_score = usermods.n_score_tensors(mod_key)
    p = p.with_features(
        bias=attn_bias is not None, mask=attn_mask is not None, sparse_block=0 if sparse is None else
        sparse.block_size, mod_key=mod_key, bias_grad=grad and attn_bias is not None and attn_bias.requires_grad,
        mod_grad_bits=sum(1 << i for i, t in enumerate(mod_tensors[:n_score]) if grad and t.requires_grad))
    return attention(p, q, k, v, Extras(alibi_slopes, mask=attn_mask, sparse=sparse), attn_bias, tuple(mod_tensors))


# --------------------------------------------------------------------------------------------------
# Public entry points (flash-attn 2.x names)
# --------------------------------------------------------------------------------------------------
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
    if attn_bias is None and attn_mask is None:   # the common call, in as few steps as possible
        p, q, k, v = _dense_problem(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_attn_probs)
        out, lse, probs = attention(p, q, k, v, NO_EXTRAS if alibi_slopes is None else Extras(alibi=alibi_slopes))
    else:
        out, lse, probs = dense_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                          alibi_slopes, deterministic, return_attn_probs, attn_bias, attn_mask)
    return out if probs is None else (out, lse, probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              attn_bias=None, attn_mask=None):
    """qkv: (batch, seqlen, 3, nheads, headdim). Gradients flow back into qkv. attn_bias/attn_mask as in
    flash_attn_func."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        fail("qkv.shape", tuple(getattr(qkv, "shape", ())), "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, attn_bias, attn_mask)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             attn_bias=None, attn_mask=None):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim). attn_bias/attn_mask as
    in flash_attn_func."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        fail("kv.shape", tuple(getattr(kv, "shape", ())), "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, attn_bias, attn_mask)

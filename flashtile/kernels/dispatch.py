"""Which kernel computes a problem: FlashAttention-3's Gluon kernels on Hopper where they take it, else the portable
Triton kernels. The one module that knows both families: triton/ and gluon/ import neither each other nor this.

Each entry point has the contract of its Triton launcher and hands a call to the Gluon kernel first where that
takes it: flash_fwd (launch.flash_fwd; fa3.supports), flash_bwd (launch.flash_bwd; fa3.supports(backward=True),
not for deterministic gradients: the Gluon backward adds dQ atomically) and flash_decode (decode.flash_decode;
paged caches of 16- or 32-key pages: paged.eligible). A Triton launch template a problem left (its memo) is
launched before the Gluon kernel is asked, so a problem the Triton kernels took keeps them while its template
holds.

A dense forward of one query per row over enough keys (a decode step of a generation loop that calls
flash_attn_func) runs the split-KV decode kernel over them (_decode_step): it spreads the keys over the GPU.

The training path (forward / backward, over an api.problem.Problem) decides once per problem: dispatch keeps a
plan in the problem's cache (Problem.cache), and a repeated call (a training loop) checks only what may change
between calls (the FLASHTILE_GLUON switch, fa3.disabled(), the tensors' contiguity and 16-byte alignment) before
launching. The Triton launchers keep their launch templates in the same cache (their `memo`).
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.compiler.errors import CompilationError

from . import relaunch
from .gluon import fa3, paged
from .params import GradSums
from .runtime import _capturing, cdiv, tickets, tma_row_view, workspace_views
from .triton import bwd as _bwd
from .triton import combine, decode, launch


# --------------------------------------------------------------------------------------------------
# Forward and backward of one call (launch.flash_fwd's and launch.flash_bwd's contracts)
# --------------------------------------------------------------------------------------------------
# user mods (flashtile.flex's functions) the Gluon kernels failed to compile, e.g. one that builds a tile of its
# own (tl.zeros, tl.arange: a Gluon tile needs a layout): the Triton kernels run them
_TRITON_MODS: set = set()


def _mods_key(mods):
    return (mods.score_mod, mods.score_grad, mods.score_captured_grad, mods.mask_mod)


def _gluon_flex(run, mods, *args) -> bool:
    """run(*args) (a Gluon launch, or a plan's call answering whether it launched) -> True unless it answered False;
    False without launching where the mods are known not to compile for Gluon, or fail to now (the Triton kernels
    then run the call: nothing was written)."""
    if mods is None:
        return run(*args) is not False
    key = _mods_key(mods)
    if key in _TRITON_MODS:
        return False
    try:
        return run(*args) is not False
    except CompilationError:
        _TRITON_MODS.add(key)
        return False


def flash_fwd(q, k, v, out, lse, params, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, bias=None, mask=None, sparse=None, mods=None, memo: Optional[dict] = None) -> None:
    """launch.flash_fwd's call: out[...] = attention(q, k, v), lse[...] its natural-log LSE; by FlashAttention-3's
    warp-specialized kernel (Gluon) where fa3.supports says it takes the problem (Hopper), else by the Triton one."""
    if launch.relaunch_fwd(memo, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi):
        return   # (a problem the Triton kernel took before)
    max_sk = max_seqlen_k if cu_seqlens_k is not None else k.shape[1]
    attends = not (q.numel() == 0 or k.shape[-3] == 0 or max_sk == 0)   # (else the launcher writes 0 and -inf)
    def gluon():
        fa3.fwd(q, k, v, out, lse, params, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bias, mask,
                sparse, mods)

    if attends and fa3.supports(q, k, v, params, alibi, cu_seqlens_q, bias, mask, sparse, mods) and _gluon_flex(
            gluon, mods):
        return
    launch.flash_fwd(q, k, v, out, lse, params, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     bias=bias, mask=mask, sparse=sparse, mods=mods, memo=memo)


def flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, params, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, deterministic=False, bias=None, mask=None, sparse=None,
              dbias=None, mods=None, dlse: Optional[torch.Tensor] = None, memo: Optional[dict] = None,
              sums: Optional[GradSums] = None) -> None:
    """launch.flash_bwd's call: dq, dk, dv (and dbias, the mods' captured gradients); by FlashAttention-3's
    warp-specialized backward (Gluon) from the Triton preprocess kernel's D where fa3.supports(backward=True) says
    it takes the problem (not dbias), except for deterministic gradients (it adds dQ atomically); else by the Triton
    kernels. sums (params.GradSums; dq, dk, dv then None): the gradients go into its float32 tensors instead, from
    its delta where given: by the Gluon kernel, which adds dQ into sums.dq and writes dK, dV (in float32 with
    sums.kv_f32) to be added (written with sums.kv_fresh), else computed in q's dtype and added."""
    if sums is not None:
        if (not deterministic and k.numel() > 0
                and fa3.supports(q, k, v, params, alibi, cu_seqlens_q, bias, mask, sparse, mods, backward=True,
                                 dbias=dbias)):
            delta = sums.delta
            if delta is None:
                delta = launch.bwd_delta(out, dout, lse, dlse, cu_seqlens_q, max_seqlen_q)
            elif dlse is not None:
                delta = delta - dlse   # (launch._delta's rule)
            if sums.kv_fresh and sums.kv_f32 and cu_seqlens_k is None:
                dk_b, dv_b = sums.dk, sums.dv   # (the kernel writes every key row: straight into the sums)
            else:   # (varlen: rows of no sequence are not written, so they add 0)
                dk_b, dv_b = ((torch.zeros if cu_seqlens_k is not None else torch.empty)(
                    t.shape, dtype=torch.float32 if sums.kv_f32 else t.dtype, device=t.device) for t in (k, v))
            fa3.bwd(dout, q, k, v, lse, delta, None, dk_b, dv_b, params, sums.dq, alibi, cu_seqlens_q,
                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, bias, mask, sparse, mods)
            _into(sums, (None, dk_b, dv_b))
            return
        # (varlen: rows of no sequence stay 0, so nothing is added there)
        grads = [(torch.zeros_like if cu_seqlens_q is not None else torch.empty_like)(t) for t in (q, k, v)]
        flash_bwd(dout, q, k, v, out, lse, *grads, params, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, deterministic, bias, mask, sparse, dbias, mods, dlse, memo)
        _into(sums, grads)
        return
    if launch.relaunch_bwd(memo, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi, dlse):
        return
    max_sq = max_seqlen_q if cu_seqlens_q is not None else q.shape[1]
    max_sk = max_seqlen_k if cu_seqlens_k is not None else k.shape[1]
    attends = not (q.numel() == 0 or k.numel() == 0 or max_sq == 0 or max_sk == 0)   # (else the launcher zeroes)
    def gluon():
        delta = launch.bwd_delta(out, dout, lse, dlse, cu_seqlens_q, max_seqlen_q)
        fa3.bwd(dout, q, k, v, lse, delta, dq, dk, dv, params, None, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, bias, mask, sparse, mods)

    if (attends and not deterministic
            and fa3.supports(q, k, v, params, alibi, cu_seqlens_q, bias, mask, sparse, mods, backward=True,
                             dbias=dbias)
            and _gluon_flex(gluon, mods)):
        return
    launch.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, params, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, deterministic=deterministic, bias=bias, mask=mask, sparse=sparse, dbias=dbias,
                     mods=mods, dlse=dlse, memo=memo)


def _into(sums: GradSums, grads) -> None:
    """grads (dq, dk, dv; None: already in place) into the sums: added, dK / dV written where sums.kv_fresh."""
    for i, (acc, g) in enumerate(zip(sums[:3], grads)):
        if g is None or g is acc:
            continue
        if i > 0 and sums.kv_fresh:
            acc.copy_(g)
        else:
            acc.add_(g)


# --------------------------------------------------------------------------------------------------
# The training path: a plan per problem
# --------------------------------------------------------------------------------------------------
def _gluon_candidate(p, params) -> bool:
    """The problem is plain for the FA3 kernels (their shapes are checked by fa3.supports): no bias, bool mask,
    block mask, mods or dropout."""
    return not (p.bias or p.mask or p.sparse_block or p.mod_key) and params.dropout_p == 0


def _attends(p, q, k) -> bool:
    """Queries and keys to attend with: an empty problem's outputs (zeros, an LSE of -inf, zero gradients) are the
    Triton launchers' to write; the FA3 forward would wait for a first key block that never comes."""
    return q.numel() > 0 and k.numel() > 0 and p.seqlen_q > 0 and p.seqlen_k > 0


# the least work (batch x heads x seqlen_q x seqlen_k x head_dim) for which kernel_inputs copies inputs TMA cannot
# tile (b2 h16 d128 at 4k x 4k): below, a training call is bound by host time, where the copies and the Gluon plans
# cost more than the Triton kernels reading the strided tensors (`flashtile bench --mode train` with the
# flashtile-bhsd provider, this constant at 0 and at 2^62)
COPY_MIN_WORK = 1 << 36


def kernel_inputs(p, q, k, v) -> tuple:
    """q, k, v as the kernels of problem p read them best: the tensors copies(p, q, k, v) names copied contiguous
    (one copy each per call, made inside the autograd Function: the backward reads the copies). Decided once per
    problem (p.cache: the dense memo's key holds the strides); none off CUDA or while torch.compile traces (the
    custom ops call this when the graph runs, the backward's making its copies again)."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return q, k, v
    copy = p.cache.get("copy")
    if copy is None:
        copy = p.cache["copy"] = copies(p, q, k, v)
    if not copy:
        return q, k, v
    return tuple(t.contiguous() if c else t for t, c in zip((q, k, v), copy))


def copies(p, q, k, v) -> tuple:
    """Which of q, k, v to copy contiguous for the FA3 kernels ((copy q, copy k, copy v), or () for none): where they
    take the dense problem p but for the layout (a tensor that is no (rows, heads x d) view TMA can tile, such as
    (batch, nheads, seqlen, d) memory seen transposed, SDPA's layout, or a view with an unaligned base), from
    COPY_MIN_WORK; else the kernels read the tensors as they are (the Triton kernels take any strides)."""
    copy = tuple(tma_row_view(t) is None for t in (q, k, v))
    if (any(copy) and _gluon_candidate(p, p.params) and not p.varlen
            and p.batch * p.nheads * p.seqlen_q * p.seqlen_k * p.head_dim >= COPY_MIN_WORK
            and fa3.supports(q, k, v, p.params, layout=False)):
        return copy
    return ()


# When a decode step runs the decode kernel: from DECODE_STEP_MIN_KEY_WORK keys x head dim per (batch, head), where
# the forward kernel's one program per (batch, head) walks the keys alone, or from DECODE_STEP_MIN_BYTES of K and V:
# from there the kernel time the split-KV kernel saves exceeds the host time its launch path costs beyond the
# forward's (benchmarks/sweep_decode_step.py); with an attn_mask (a static cache's step: transformers' mask over its
# slots) from DECODE_STEP_MASKED_MIN_BYTES, where the forward kernel's masked tiles cost more
DECODE_STEP_MIN_KEY_WORK = 1 << 20
DECODE_STEP_MIN_BYTES = 1 << 27
DECODE_STEP_MASKED_MIN_BYTES = 0


def _decode_step(p, params, bias, mods) -> bool:
    """Whether a dense forward is a decode step (one query per row over keys: a generation loop's call) that the
    split-KV decode kernel computes, with the keys as a full cache: it splits the keys over the GPU where the
    forward kernel runs one program per (batch, head). From DECODE_STEP_MIN_KEY_WORK keys x head dim or
    DECODE_STEP_MIN_BYTES of K and V (DECODE_STEP_MASKED_MIN_BYTES with an attn_mask); not with attn_bias / block
    masks / mods / dropout / probabilities, which the decode kernel has no part of."""
    if (p.varlen or p.seqlen_q != 1 or p.batch == 0 or p.seqlen_k == 0 or bias is not None or mods is not None
            or p.sparse_block or p.return_probs or params.dropout_p > 0):
        return False
    threshold = DECODE_STEP_MASKED_MIN_BYTES if p.mask else DECODE_STEP_MIN_BYTES
    return (p.seqlen_k * p.head_dim >= DECODE_STEP_MIN_KEY_WORK
            or 2 * p.batch * p.seqlen_k * p.nheads_k * p.head_dim * p.dtype.itemsize >= threshold)


class _DecodeStep:
    """The decode kernel over a dense problem's k, v (_decode_step), called as fa3.ForwardPlan is. Its launch
    templates are keyed on this plan (one per problem, which is remembered per argument signature: the shapes and
    strides of q, k, v) and the strides of ALiBi and the mask, so a generation loop repeating a shape launches its
    template. A step without ALiBi or mask launches the template it was served by directly (kept per CUDA-graph
    capture state), without building that key."""
    __slots__ = ("tpls", )

    def __init__(self):
        self.tpls = [None, None]   # per capture state: the decode _Template of a call without ALiBi or mask

    def __call__(self, q, k, v, out, lse, params, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, mask=None,
                 bias=None, sparse=None, mods=None) -> bool:
        plain = alibi is None and mask is None and not decode.CONFIG_OVERRIDE
        if plain:
            capturing = _capturing(q.device)
            tpl = self.tpls[capturing]
            if tpl is not None and tpl.launch(q, k, v, out, lse, None, None, None, None, None, None, None):
                return True
        sig = (self, q.stride(), k.stride(), v.stride(), q.device, None if alibi is None else alibi.stride(),
               None if mask is None else (mask.shape, mask.stride()))
        flash_decode(q, k, v, out, lse, None, params, alibi=alibi, max_seqlen_k=k.shape[1], seqlen_k_static=k.shape[1],
                     mask=mask, sig=sig)
        if plain:
            served = decode.template_for(sig, q.device)
            self.tpls[capturing] = None if served is None else served[0]
        return True


def forward(p, params, q, k, v, out, lse, x, bias=None, mods=None) -> None:
    """out, lse of problem p (api.problem.Problem) with its call's scalars params (params.AttnParams) and extras x
    (interface.Extras)."""
    plan = p.cache.get("fwd", False)
    if plan is False:
        plan = None
        features = (bias, x.mask, x.sparse, mods)
        if _decode_step(p, params, bias, mods):
            plan = _DecodeStep()
        elif (params.dropout_p == 0 and _attends(p, q, k)
                and fa3.supports(q, k, v, params, x.alibi, x.cu_seqlens_q, *features)):
            # (flashtile.flex's features: their tensors are the plan's per call, and the mods may not compile for
            # Gluon: _gluon_flex below)
            plan = fa3.ForwardPlan(q, k, v, lse, params, x.alibi, x.cu_seqlens_q, p.seqlen_q, p.seqlen_k, features)
        p.cache["fwd"] = plan
    if plan is not None and _gluon_flex(plan, mods, q, k, v, out, lse, params, x.alibi, x.cu_seqlens_q,
                                        x.cu_seqlens_k, x.mask, bias, x.sparse, mods):
        return
    flash_fwd(q, k, v, out, lse, params, x.alibi, x.cu_seqlens_q, x.cu_seqlens_k, p.seqlen_q, p.seqlen_k,
              bias=bias, mask=x.mask, sparse=x.sparse, mods=mods, memo=p.cache)


_PRE_CHECKED = ((1, ), (1, 4))   # the preprocess launch's checked live arguments, dense and varlen (relaunch.Bound)


class _GluonBackward:
    """The Gluon backward of one problem, dense or varlen: D = rowsum(dO o O) by the Triton preprocess kernel, which
    also zeroes the float32 dQ accumulator (a varlen problem whose packed rows may belong to no sequence gets a
    zero-filled one instead: the preprocess reaches only sequences' rows), then fa3's kernel (fa3.BackwardPlan),
    then dQ converted. features: (bias, mask, sparse, mods) of a problem with flashtile.flex's features (as
    fa3.ForwardPlan's), whose tensors each call passes."""
    __slots__ = ("fa3", "pre", "p", "scratch")

    def __init__(self, p, q, k, v, lse, params, x, features=None):
        dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))   # (as backward's)
        self.fa3 = fa3.BackwardPlan(q, k, v, lse, dk, dv, params, x.alibi, x.cu_seqlens_q, p.seqlen_q, p.seqlen_k,
                                    features)
        self.p, self.pre, self.scratch = p, None, [None]

    def _scratch(self, q, lse) -> tuple:
        """(D like lse, dQ's float32 accumulator like q, contiguous): views of the stream's workspace
        (runtime.workspace_views: the backward runs on autograd's device thread, where each allocation costs host
        time), else allocated (dQ's zero-filled where packed rows may belong to no sequence)."""
        if self.p.padded_q:
            return torch.empty_like(lse), torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        views = workspace_views(q.device, (q.shape, lse.shape), self.scratch) if lse.is_contiguous() else None
        if views is None:   # (D has lse's strides)
            return torch.empty_like(lse), torch.empty(q.shape, device=q.device, dtype=torch.float32)
        return views[1], views[0]

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, params, dlse, x, bias=None, mods=None) -> bool:
        """False (nothing launched) where this call cannot take the plan (Gluon off, q, k, v of other strides than the
        plan's or not 16-byte aligned, the outputs not contiguous and aligned, or a block mask the kernel does not
        take: fa3.sparse_ok)."""
        if not (fa3.enabled() and self.fa3.takes(q, k, v) and fa3.tma_aligned(out, dq, dk, dv)
                and fa3.sparse_ok(q, k, x.sparse)):
            return False
        p = self.p
        dout = fa3.tma_ready(dout)
        delta, dq_acc = self._scratch(q, lse)
        # the preprocess kernel's live arguments: out, dout, delta, dQ's accumulator (None where zero-filled here)
        # and, varlen, cu_seqlens_q
        live = (out, dout, delta, None if p.padded_q else dq_acc, *((x.cu_seqlens_q, ) if p.varlen else ()))
        # (out is the forward's, delta and dQ's accumulator this plan's: dout and cu_seqlens_q are checked)
        if self.pre is None or not self.pre[1](self.pre[0], live, _PRE_CHECKED[p.varlen]):
            grid, args, kwargs = launch.preprocess_launch(*live[:4], x.cu_seqlens_q, p.batch, p.nheads, p.seqlen_q,
                                                          p.head_dim)
            launched = relaunch.launch(_bwd.attn_bwd_preprocess_kernel, grid, args, kwargs)
            # (out and dq_acc are made contiguous by the callers, dout by tma_ready: the strides bound are the call's)
            bound = relaunch.bind(_bwd.attn_bwd_preprocess_kernel, args, kwargs, len(live), launched)
            self.pre = None if bound is None else ((*grid, 1), bound)
        if dlse is not None:
            # a gradient arriving through the LSE output: d lse_i / d S_ij = P_ij, so dS_ij gains P_ij * dlse_i,
            # i.e. dS = P o (dP - (D - dlse)): folded into D, the kernels are unchanged
            delta.sub_(dlse)
        self.fa3(dout, q, k, v, lse, delta, dq, dk, dv, params, dq_acc, x.alibi, x.cu_seqlens_q, x.cu_seqlens_k,
                 bias, x.mask, x.sparse, mods)
        return True


def backward(p, params, dout, q, k, v, out, lse, dq, dk, dv, x, bias=None, dbias=None, mods=None, dlse=None,
             sums=None) -> None:
    """dq, dk, dv (and dbias, the mods' captured gradients) of problem p; see forward. sums: flash_bwd's (dq, dk,
    dv None)."""
    if sums is not None:
        flash_bwd(dout, q, k, v, out, lse, None, None, None, params, x.alibi, x.cu_seqlens_q, x.cu_seqlens_k,
                  p.seqlen_q, p.seqlen_k, deterministic=p.deterministic, bias=bias, mask=x.mask, sparse=x.sparse,
                  dbias=dbias, mods=mods, dlse=dlse, memo=p.cache, sums=sums)
        return
    plan = p.cache.get("bwd", False)
    if plan is False:
        plan = None
        features = (bias, x.mask, x.sparse, mods)
        if (params.dropout_p == 0 and _attends(p, q, k) and not p.deterministic and out.is_contiguous()
                and fa3.supports(q, k, v, params, x.alibi, x.cu_seqlens_q, *features, backward=True, dbias=dbias)):
            plan = _GluonBackward(p, q, k, v, lse, params, x, features)
        p.cache["bwd"] = plan
    if plan is not None and _gluon_flex(plan, mods, dout, q, k, v, out, lse, dq, dk, dv, params, dlse, x, bias, mods):
        return
    flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, params, x.alibi, x.cu_seqlens_q, x.cu_seqlens_k, p.seqlen_q,
              p.seqlen_k, deterministic=p.deterministic, bias=bias, mask=x.mask, sparse=x.sparse, dbias=dbias,
              mods=mods, dlse=dlse, memo=p.cache)


# --------------------------------------------------------------------------------------------------
# Decode over a KV cache (decode.flash_decode's contract)
# --------------------------------------------------------------------------------------------------
# decode.CONFIG_OVERRIDE keys the Gluon paged decode honours (num_splits, fused_combine) or that do not concern it
# (combine_chunk); any other pins the Triton kernel's launch, which then takes the call
_GLUON_OVERRIDES = {"num_splits", "fused_combine", "combine_chunk"}
# (caller's signature, CUDA graph capture under way) -> (key of paged's template that served the signature, split
# count): a decode step repeating a signature the Gluon paged decode took skips the route and the key
_PAGED_FAST: dict = {}


def gluon_fuse_combine(kv_bytes: int, device: torch.device) -> bool:
    """Whether the Gluon paged decode's splits merge in its launch (the last split to finish merges, serially at
    the launch's tail) rather than by combine.py's kernel: decode.CONFIG_OVERRIDE["fused_combine"] if set, else
    only in eager calls reading at most decode.EAGER_FUSED_BYTES, which are bound by host time (one launch instead
    of two; same-run A/Bs on an H200: `git log -S gluon_fuse_combine`)."""
    if "fused_combine" in decode.CONFIG_OVERRIDE:
        return bool(decode.CONFIG_OVERRIDE["fused_combine"])
    return kv_bytes <= decode.EAGER_FUSED_BYTES and not _capturing(device)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, seqlens_k: Optional[torch.Tensor], params, *,
                 cu_seqlens_q: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                 cache_batch_idx: Optional[torch.Tensor] = None, leftpad: Optional[torch.Tensor] = None,
                 block_table: Optional[torch.Tensor] = None, alibi: Optional[torch.Tensor] = None,
                 num_splits: int = 0, max_seqlen_k: Optional[int] = None,
                 seqlen_k_static: Optional[int] = None, seqlens_add: int = 0, mask: Optional[torch.Tensor] = None,
                 sig=None) -> int:
    """decode.flash_decode's call (its arguments and the split count it returns); paged caches whose pages hold
    16 or 32 keys go to the Gluon paged decode on Hopper where paged.eligible says it computes the call: a key
    tile's pages are TMA boxes under one barrier. mask (dense decode steps): the Triton decode kernel's."""
    if sig is not None and not decode.CONFIG_OVERRIDE:
        # a signature launched before goes straight to the template that served it: the Triton decode's, else the
        # Gluon paged decode's
        n = decode.relaunch_decode(sig, q, k_cache, v_cache, out, lse, seqlens_k, cu_seqlens_q, cache_batch_idx,
                                   leftpad, block_table, alibi, mask)
        if n:
            return n
        fast = _PAGED_FAST.get((sig, _capturing(q.device)))
        if fast is not None:
            key, n = fast
            tpl = paged.template(*key)
            if tpl is not None and fa3.enabled() and tpl.launch(q, k_cache, v_cache, out, lse, block_table, seqlens_k,
                                                                lambda m: tickets(q.device, m)):
                return n
    if block_table is not None and mask is None and q.is_cuda and not decode.CONFIG_OVERRIDE.keys() - _GLUON_OVERRIDES:
        n = _paged_decode(q, k_cache, v_cache, out, lse, seqlens_k, params, cu_seqlens_q, max_seqlen_q,
                          cache_batch_idx, leftpad, block_table, alibi, num_splits, max_seqlen_k, seqlen_k_static,
                          seqlens_add, sig)
        if n is not None:
            return n
    return decode.flash_decode(q, k_cache, v_cache, out, lse, seqlens_k, params, cu_seqlens_q=cu_seqlens_q,
                               max_seqlen_q=max_seqlen_q, cache_batch_idx=cache_batch_idx, leftpad=leftpad,
                               block_table=block_table, alibi=alibi, num_splits=num_splits,
                               max_seqlen_k=max_seqlen_k, seqlen_k_static=seqlen_k_static, seqlens_add=seqlens_add,
                               mask=mask, sig=sig)


def _paged_decode(q, k_cache, v_cache, out, lse, seqlens_k, params, cu_seqlens_q, max_seqlen_q, cache_batch_idx,
                  leftpad, block_table, alibi, num_splits, max_seqlen_k, seqlen_k_static, seqlens_add,
                  sig) -> Optional[int]:
    """The Gluon paged decode of a paged call on a CUDA device: the split count, or None where it does not take
    the call (paged.eligible, or decode_paged declining: no Hopper, Gluon off, a cache TMA cannot read)."""
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    sq = int(max_seqlen_q) if varlen else q.shape[1]
    total_rows = q.shape[0] if varlen else batch * sq
    nheads_k, head_dim = k_cache.shape[-2], q.shape[-1]
    group = q.shape[-2] // nheads_k
    page_size = k_cache.shape[1]
    if max_seqlen_k is None:
        max_seqlen_k = block_table.shape[1] * page_size
    if not (batch > 0 and total_rows > 0
            and paged.eligible(q, k_cache, page_size, sq * group, params, alibi=alibi, leftpad=leftpad,
                               cu_seqlens_q=cu_seqlens_q, cache_batch_idx=cache_batch_idx)):
        return None
    has_seqlens = seqlens_k is not None
    if not has_seqlens and seqlen_k_static is None:
        raise ValueError("flash_decode: seqlens_k or seqlen_k_static is required")
    kv_bytes = 2 * batch * max_seqlen_k * nheads_k * head_dim * k_cache.element_size()   # (the most K / V read)
    fuse = gluon_fuse_combine(kv_bytes, q.device)

    def splits_for(block_n: int) -> int:   # the Triton decode's split rule, for the Gluon kernel's key tiles
        return (int(decode.CONFIG_OVERRIDE.get("num_splits", 0))
                or decode.num_splits_heuristic(batch * nheads_k, max_seqlen_k, block_n, q.device))

    n = paged.decode_paged(
        q, k_cache, v_cache, out, lse, seqlens_k, int(seqlens_add) if has_seqlens else int(seqlen_k_static),
        block_table, params, num_splits, splits_for, lambda m: tickets(q.device, m), fuse, combine.combine_splits,
        sig=sig)
    if n is not None and sig is not None and not decode.CONFIG_OVERRIDE:
        relaunch.remember(_PAGED_FAST, (sig, _capturing(q.device)), ((sig, n, n > 1 and fuse), n))
    return n

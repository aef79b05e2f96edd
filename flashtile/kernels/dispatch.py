"""Which kernel computes a problem: FlashAttention-3's Gluon kernels on Hopper where they take it, else the portable
Triton kernels (launch.py). The decision is made once per problem: dispatch keeps a plan in the problem's cache
(api.problem.Problem.cache), and a repeated call (a training loop) checks only what may change between calls (the
FLASHTILE_GLUON switch, fa3.disabled(), the tensors' contiguity and 16-byte alignment) before launching. The Triton
launchers keep their launch templates in the same cache (their `memo`).
"""
from __future__ import annotations

import torch

from . import relaunch
from .gluon import fa3
from .runtime import cdiv
from .triton import bwd as _bwd
from .triton import launch


def _gluon_candidate(p, params) -> bool:
    """The problem's features allow the FA3 kernels (their shapes are checked by fa3.supports)."""
    return (p.plain and not p.varlen and params.dropout_p == 0 and params.softcap == 0
            and (params.is_causal or not (params.has_left or params.has_right)))


def forward(p, params, q, k, v, out, lse, x, bias=None, mods=None) -> None:
    """out, lse of problem p (api.problem.Problem) with its call's scalars params (launch.AttnParams) and extras x
    (interface.Extras)."""
    plan = p.cache.get("fwd", False)
    if plan is False:
        plan = None
        if _gluon_candidate(p, params) and fa3.supports(q, k, v, params):
            plan = fa3.ForwardPlan(q, k, v, lse, params.softmax_scale, params.is_causal)
        p.cache["fwd"] = plan
    if plan is not None and plan(q, k, v, out, lse, params):
        return
    launch.flash_fwd(q, k, v, out, lse, params, x.alibi, x.cu_seqlens_q, x.cu_seqlens_k, p.seqlen_q, p.seqlen_k,
                     bias=bias, mask=x.mask, sparse=x.sparse, mods=mods, memo=p.cache)


class _GluonBackward:
    """The Gluon backward of one problem: D = rowsum(dO o O) by the Triton preprocess kernel, which also zeroes the
    float32 dQ accumulator, then fa3's kernel (fa3.BackwardPlan), then dQ converted."""
    __slots__ = ("fa3", "pre_grid", "pre")

    PRE_ROWS = 64

    def __init__(self, q, k, v, lse, params):
        dk, dv = torch.empty_like(k), torch.empty_like(v)   # (the gradients' strides: contiguous, as backward makes them)
        self.fa3 = fa3.BackwardPlan(q, k, v, lse, dk, dv, params.softmax_scale, params.is_causal)
        self.pre_grid = (cdiv(q.shape[1], self.PRE_ROWS), q.shape[0] * q.shape[2], 1)
        self.pre = None

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, params, dlse) -> bool:
        """False (nothing launched) where this call cannot take the plan (Gluon off, or a tensor not contiguous or
        not 16-byte aligned)."""
        if not (fa3.enabled() and fa3.tma_aligned(q, k, v, out, dq, dk, dv)):
            return False
        dout = fa3.tma_ready(dout)
        delta = torch.empty_like(lse)
        dq_acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        live = (out, dout, delta, dq_acc)
        if self.pre is None or not self.pre(self.pre_grid, live):
            args = (*live, None, *out.stride()[:3], *dout.stride()[:3], lse.stride(0), lse.stride(1),
                    *dq_acc.stride()[:3], q.shape[2], q.shape[1], q.shape[3])
            kwargs = dict(BLOCK_M=self.PRE_ROWS, BLOCK_D=q.shape[3], IS_VARLEN=False, ZERO_DQ=True)
            relaunch.launch(_bwd.attn_bwd_preprocess_kernel, self.pre_grid[:2], args, kwargs)
            # (out and dq_acc are made contiguous by the callers, dout by tma_ready: the strides bound are the call's)
            self.pre = relaunch.bind(_bwd.attn_bwd_preprocess_kernel, args, kwargs, len(live))
        if dlse is not None:
            # a gradient arriving through the LSE output: d lse_i / d S_ij = P_ij, so dS_ij gains P_ij * dlse_i,
            # i.e. dS = P o (dP - (D - dlse)): folded into D, the kernels are unchanged
            delta.sub_(dlse)
        self.fa3(dout, q, k, v, lse, delta, dq, dk, dv, params, dq_acc)
        return True


def backward(p, params, dout, q, k, v, out, lse, dq, dk, dv, x, bias=None, dbias=None, mods=None, dlse=None) -> None:
    """dq, dk, dv (and dbias, the mods' captured gradients) of problem p; see forward."""
    plan = p.cache.get("bwd", False)
    if plan is False:
        plan = None
        if (_gluon_candidate(p, params) and not p.deterministic and out.is_contiguous()
                and fa3.supports(q, k, v, params, backward=True)):
            plan = _GluonBackward(q, k, v, lse, params)
        p.cache["bwd"] = plan
    if plan is not None and plan(dout, q, k, v, out, lse, dq, dk, dv, params, dlse):
        return
    launch.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, params, x.alibi, x.cu_seqlens_q, x.cu_seqlens_k,
                     p.seqlen_q, p.seqlen_k, deterministic=p.deterministic, bias=bias, mask=x.mask, sparse=x.sparse,
                     dbias=dbias, mods=mods, dlse=dlse, memo=p.cache)

"""Host-side launchers of the Triton attention kernels: tensors in, tensors out.

Inputs are already validated by flashtile.interface. Two layouts are accepted for q/k/v/out:
dense (batch, seqlen, nheads, headdim) and varlen/packed (total_tokens, nheads, headdim) with cu_seqlens.
These launchers run the Triton kernels whatever the device; kernels/dispatch.py decides which problems go to the
Gluon kernels instead.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from .. import relaunch
from . import bwd as _bwd
from . import configs, tuning
from . import fwd as _fwd
from .configs import Config
from ..params import AttnParams, Features, Flex, SparseLists, UserMods  # noqa: F401  (the launchers' side arguments)
from ..runtime import (DescriptorType, TensorDescriptor, cdiv, descriptor_fields,  # noqa: F401
                       interpreting, next_pow2, pair_args, row_descriptor, sparse_args, tma_row_view)


def row_strides(t: torch.Tensor):
    """(stride_batch, stride_row, stride_head) of a dense 4-D or a packed 3-D tensor."""
    if t.dim() == 4:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(0), t.stride(1)


def lse_strides(lse: torch.Tensor):
    """LSE is (batch, nheads, seqlen_q) dense or (nheads, total_q) varlen."""
    if lse.dim() == 3:
        return lse.stride(0), lse.stride(1)
    return 0, lse.stride(0)


def kv_descriptor(t: torch.Tensor, block_n: int, block_d: int):
    """A TMA descriptor over the 2-D view (rows, nheads_k * headdim) of K or V (tma_row_view), for tiles of
    (block_n rows, one head); rows = batch * seqlen (dense) or tokens (varlen). None where the kernel must use
    pointer loads instead: headdim not a power of two (the tile would read the next head's columns), or no such
    view."""
    if TensorDescriptor is None or (t.device.type != "cuda" and not interpreting()) or t.numel() == 0:
        return None
    if block_d != t.shape[-1]:
        return None
    return row_descriptor(TensorDescriptor, t, (block_n, block_d))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (flashtile's fp32 promise), not TF32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _pinned_or_tuned(pass_: str, interpreter: Config, head_dim: int, dtype: torch.dtype, causal: bool,
                     seqlen: int) -> Optional[Config]:
    """What overrides the hand-picked table, in order: a config pinned in configs.CONFIG_OVERRIDE, the interpreter's
    small tiles, a winner cached by tuning.py (only when seqlen > 0 is known). None: use the table."""
    if pass_ in configs.CONFIG_OVERRIDE:
        return configs.CONFIG_OVERRIDE[pass_]
    if interpreting():
        return interpreter
    if seqlen > 0:
        return tuning.lookup(pass_, head_dim, dtype, causal, seqlen)
    return None


def fwd_config(head_dim: int, dtype: torch.dtype, causal: bool, seqlen: int = 0) -> Config:
    """The forward's tiles: _pinned_or_tuned (a winner cached by tuning.py for the key where seqlen =
    max(seqlen_q, seqlen_k) > 0), else configs.fwd_table."""
    chosen = _pinned_or_tuned("fwd", configs.INTERPRETER_FWD, head_dim, dtype, causal, seqlen)
    return configs.fwd_table(head_dim, dtype, causal) if chosen is None else chosen


def bwd_config(head_dim: int, dtype: torch.dtype, causal: bool = False, seqlen: int = 0) -> Config:
    """The backward's tiles: _pinned_or_tuned, else configs.bwd_table."""
    chosen = _pinned_or_tuned("bwd", configs.INTERPRETER_BWD, head_dim, dtype, causal, seqlen)
    return configs.bwd_table(head_dim, dtype, causal) if chosen is None else chosen


def _flags(params: AttnParams, alibi, cu_q, head_dim, dtype):
    """The attention kernels' head-dim tile, dot precision and FEATURES (params.Features) of a problem."""
    return dict(
        BLOCK_D=configs.block_d(head_dim), DOT_PREC=_dot_precision(dtype),
        FEATURES=Features(VARLEN=cu_q is not None, HAS_LEFT=params.has_left, HAS_RIGHT=params.has_right,
                          SOFTCAP=params.softcap > 0, ALIBI=alibi is not None, DROPOUT=params.dropout_p > 0),
    )


def _rng_strides(nheads, seqlen_q, seqlen_k):
    """Philox counter strides (batch, head, row) of entry (b, h, i, j): see reference.rng.dropout_counter."""
    return nheads * seqlen_q * seqlen_k, seqlen_q * seqlen_k, seqlen_k


def _common(q, k, params, alibi, cu_q, cu_k, max_seqlen_q, max_seqlen_k):
    """What every launcher derives from a call: the longest lengths (varlen: the given ones), batch, heads, the
    kernels' scale, window and dropout groups (score scalars; window_left, window_right; probability, seed, counter
    offset and strides) and ALiBi's batch stride."""
    max_sq = max_seqlen_q if cu_q is not None else q.shape[1]
    max_sk = max_seqlen_k if cu_k is not None else k.shape[1]
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    batch = q.shape[0] if cu_q is None else cu_q.numel() - 1
    window = (params.window_left, params.window_right)
    dropout = (params.dropout_p, params.seed, params.rng_offset, *_rng_strides(nheads, max_sq, max_sk))
    alibi_stride_b = 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0)
    return max_sq, max_sk, batch, nheads, nheads_k, params.score_args(), window, dropout, alibi_stride_b


def _order_args(params: AttnParams, head_dim: int, kernel: str, n_blocks: int, n_bh: int) -> dict:
    """mods.tile_order's arguments for a grid (n_blocks, n_bh): heads per launch-order group (programs differ in
    length only under a causal mask without a left window), the switch that compiles the grouping in, and for the
    dQ pass whether its query blocks go last-first (the forward reverses under any right window by itself)."""
    schedule = configs.schedule(head_dim)
    group = 1
    if params.is_causal and schedule[kernel] > 0:
        group = max(1, min(n_bh, schedule[kernel] // max(n_blocks, 1)))
    args = dict(head_group=group, GROUPED=group > 1)
    if kernel == "dq":
        args["REVERSE"] = schedule["dq_reverse"] and params.has_right
    return args


def _launch(kernel, grid, *args, num_stages: int, **kwargs):
    """kernel[grid](*args, ...), retried with fewer pipeline stages when the tiles do not fit in shared memory:
    the tuned configs leave little room, and an attn_bias / attn_mask tile or a user mod's loads can push one
    over (the compile-time check raises before anything runs, so a retry is safe). Returns the keyword arguments
    it launched with and relaunch.launch's key (for relaunch.bind)."""
    while True:
        try:
            kw = dict(kwargs, num_stages=num_stages)
            return kw, relaunch.launch(kernel, grid, args, kw)
        except triton.runtime.errors.OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1


def _sparse_config(cfg: Config, lists) -> Config:
    """With a block mask every kernel tile must lie inside one mask block: tile sizes divide block_size (both
    powers of two)."""
    if lists is None:
        return cfg
    bs = lists.block_size
    dv = None if cfg.dv is None else (min(cfg.dv[0], bs), *cfg.dv[1:])
    return dataclasses.replace(cfg, BLOCK_M=min(cfg.BLOCK_M, bs), BLOCK_N=min(cfg.BLOCK_N, bs), dv=dv)


def _flex(bias, mask, lists, mods: Optional[UserMods] = None, kernel: str = "fwd", params: Optional[AttnParams] = None,
          sq: int = 0, sk: int = 0) -> dict:
    """The attention kernels' FLEX (params.Flex: attn_bias, attn_mask, a block mask's block size, the user mods for
    kernel "fwd", "dq" or "dkdv": UserMods.flex_fields) and the keyword arguments beside it: the mods' captured
    values (UserMods.kernel_kwargs) and, with a block mask, SPARSE_FULL_MASKED."""
    kw = {} if mods is None else mods.kernel_kwargs(kernel)
    kw["FLEX"] = Flex(HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
                      SPARSE_BLOCK=0 if lists is None else lists.block_size,
                      **({} if mods is None else mods.flex_fields(kernel)))
    if lists is not None:
        # a block mask's full tiles need no per-element masking at all, unless causal / window masking applies
        # too or a sequence ends inside a block (then its last tiles read past the end)
        even = sq % lists.block_size == 0 and sk % lists.block_size == 0
        window = params is not None and (params.has_left or params.has_right)
        kw["SPARSE_FULL_MASKED"] = window or not even
    return kw


def _descriptor_type(desc):
    """What makes descriptors of desc's geometry over other tensors (None for None)."""
    return None if desc is None else DescriptorType(type(desc), descriptor_fields(desc))


def _templated(params: AttnParams, bias, mask, sparse, mods) -> bool:
    """Whether a launch's arguments other than its leading tensors are fixed by the caller's problem: no dropout
    (its seed changes per call), none of the feature tensors that sit among the later arguments."""
    return params.dropout_p == 0 and bias is None and mask is None and sparse is None and mods is None


class _ForwardTemplate:
    """flash_fwd's launch of one problem (the caller's memo keeps it): the compiled kernel bound to every argument
    but the leading tensors and K / V descriptors, which are made over each call's tensors (host time: a training
    loop repeats one problem per layer)."""
    __slots__ = ("bound", "grid", "desc_k", "desc_v")

    def __init__(self, bound, grid, desc_k, desc_v):
        self.bound, self.grid = bound, (*grid, 1)
        self.desc_k, self.desc_v = _descriptor_type(desc_k), _descriptor_type(desc_v)

    def __call__(self, q, k, v, out, lse, cu_q, cu_k, alibi) -> bool:
        dk = dv = None
        if self.desc_k is not None:
            dk, dv = self.desc_k(k), self.desc_v(v)
            if dk is None or dv is None:
                return False
        return self.bound(self.grid, (q, k, v, out, lse, cu_q, cu_k, alibi, dk, dv))


_FWD_LIVE = 10   # attn_fwd_kernel's leading tensors and descriptors


def relaunch_fwd(memo: Optional[dict], q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, alibi=None) -> bool:
    """Launch the template flash_fwd kept in memo (the caller's per-problem dict) over these tensors; False
    (nothing launched) where there is none or it does not take them."""
    tpl = memo.get("triton_fwd") if memo is not None else None
    return tpl is not None and tpl(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi)


def flash_fwd(q, k, v, out, lse, params: AttnParams, alibi: Optional[torch.Tensor] = None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
              bias=None, mask=None, sparse: Optional[SparseLists] = None, mods: Optional[UserMods] = None,
              memo: Optional[dict] = None):
    """out[...] = attention(q, k, v); lse[...] = row log-sum-exp (natural log, -inf for empty rows).
    bias (float) / mask (bool, True = may attend): 4-D, broadcastable to (batch, nheads, seqlen_q, seqlen_k);
    dense layout only. sparse: a block mask's lists (the partial tiles read `mask` and mods.mask_mod).
    mods: user score_mod / mask_mod (flashtile.flex). memo: a dict the caller keeps per problem (everything but
    the tensors' data fixed: shapes, strides, dtypes, scalars), where the launch's template is kept."""
    if relaunch_fwd(memo, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi):
        return
    head_dim = q.shape[-1]
    max_sq, max_sk, batch, nheads, nheads_k, scale, window, dropout, alibi_sb = _common(
        q, k, params, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if q.numel() == 0 or k.shape[-3] == 0 or max_sk == 0:
        # nothing to attend to (or nobody asking): rows that see no key are 0 with lse = -inf
        out.zero_()
        lse.fill_(float("-inf"))
        return
    causal, seqlen = params.lower_triangular, max(max_sq, max_sk)
    if sparse is None and tuning.needs_tuning("fwd", head_dim, q.dtype, causal, seqlen, q.device):
        # FLASHTILE_AUTOTUNE=1, key not cached: time the candidates on scratch outputs; the launch below uses the winner
        out_, lse_ = torch.empty_like(out), torch.empty_like(lse)
        tuning.autotune("fwd", head_dim, q.dtype, causal, seqlen, lambda: flash_fwd(
            q, k, v, out_, lse_, params, alibi=alibi, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, bias=bias, mask=mask, mods=mods),
            default=fwd_config(head_dim, q.dtype, causal))
    cfg = _sparse_config(fwd_config(head_dim, q.dtype, causal, seqlen=seqlen), sparse)
    grid = (cdiv(max_sq, cfg.BLOCK_M), batch * nheads)
    block_d = configs.block_d(head_dim)
    desc_k = kv_descriptor(k, cfg.BLOCK_N, block_d)
    desc_v = kv_descriptor(v, cfg.BLOCK_N, block_d)
    use_tma = desc_k is not None and desc_v is not None
    if not use_tma:
        desc_k = desc_v = None
    args = (
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi, desc_k, desc_v,
        row_strides(q), row_strides(k), row_strides(v), row_strides(out), lse_strides(lse), alibi_sb,
        (nheads, nheads // nheads_k, max_sq, max_sk, head_dim), scale, window, dropout,
        pair_args(bias, batch, nheads, max_sq, max_sk), pair_args(mask, batch, nheads, max_sq, max_sk),
        sparse_args(sparse, batch, nheads, False))
    kwargs, launched = _launch(
        _fwd.attn_fwd_kernel, grid, *args,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, EVEN_D=block_d == head_dim, USE_TMA=use_tma,
        FOLD_SCALE=scale[0] > 0, **_order_args(params, head_dim, "fwd", *grid),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_flags(params, alibi, cu_seqlens_q, head_dim, q.dtype),
        **_flex(bias, mask, sparse, mods, "fwd", params, max_sq, max_sk))
    if memo is not None and _templated(params, bias, mask, sparse, mods):
        bound = relaunch.bind(_fwd.attn_fwd_kernel, args, kwargs, _FWD_LIVE, launched)
        if bound is not None:
            memo["triton_fwd"] = _ForwardTemplate(bound, grid, desc_k, desc_v)


def attn_probs(q, k, lse, params: AttnParams, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q=None, max_seqlen_k=None, bias=None, mask=None):
    """(batch, nheads, max_seqlen_q, max_seqlen_k) float32 P, negated where dropout dropped it."""
    head_dim = q.shape[-1]
    max_sq, max_sk, batch, nheads, nheads_k, scale, window, dropout, alibi_sb = _common(
        q, k, params, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    p = torch.zeros(batch, nheads, max_sq, max_sk, device=q.device, dtype=torch.float32)
    if p.numel() == 0:
        return p
    grid = (cdiv(max_sq, 32), batch * nheads)
    _fwd.attn_probs_kernel[grid](
        q, k, lse, p, cu_seqlens_q, cu_seqlens_k, alibi,
        row_strides(q), row_strides(k), p.stride()[:3], lse_strides(lse), alibi_sb,
        (nheads, nheads // nheads_k, max_sq, max_sk, head_dim), scale, window, dropout,
        pair_args(bias, batch, nheads, max_sq, max_sk), pair_args(mask, batch, nheads, max_sq, max_sk),
        BLOCK_M=32, BLOCK_N=32, num_warps=4, **_flags(params, alibi, cu_seqlens_q, head_dim, q.dtype),
        **_flex(bias, mask, None))
    return p


class _BackwardTemplate:
    """flash_bwd's launches of one problem (the caller's memo keeps it), each compiled kernel bound to every argument
    but its leading tensors and descriptors: the preprocess (D), the dK / dV launch(es), then the dQ pass or, with
    atomic dQ, the accumulator's copy. A call makes D, the accumulator and the descriptors over its own tensors."""
    __slots__ = ("pre", "dkdv", "dq", "atomic", "descs", "dout_stride")

    def __init__(self, pre, dkdv, dq, atomic, descs, dout_stride):
        self.pre, self.dkdv, self.dq, self.atomic = pre, dkdv, dq, atomic
        self.descs = [_descriptor_type(d) for d in descs]   # over q, dout, k, v, the dQ accumulator
        self.dout_stride = dout_stride

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, alibi, dlse) -> bool:
        """False where a launch does not take this call's tensors: nothing is left half done then, as the caller's
        full path recomputes every output."""
        if dout.stride() != self.dout_stride:
            return False
        delta = torch.empty_like(lse)
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if self.atomic else dq
        tq, tdo, tk, tv, tdq = self.descs
        descs = (tq and tq(q), tdo and tdo(dout), tk and tk(k), tv and tv(v), tdq and tdq(dq_acc))
        if any(d is None and t is not None for d, t in zip(descs, self.descs)):
            return False
        desc_q, desc_do, desc_k, desc_v, desc_dq = descs
        bound, grid = self.pre
        if not bound(grid, (out, dout, delta, None, cu_q)):
            return False
        if dlse is not None:
            delta.sub_(dlse)
        for bound, grid in self.dkdv:
            if not bound(grid, (q, k, v, dout, lse, delta, dk, dv, dq_acc, cu_q, cu_k, alibi, desc_q, desc_do,
                                desc_dq)):
                return False
        if self.atomic:
            dq.copy_(dq_acc)
            return True
        bound, grid = self.dq
        return bound(grid, (q, k, v, dout, lse, delta, dq, cu_q, cu_k, alibi, desc_k, desc_v))


_PRE_LIVE, _DKDV_LIVE, _DQ_LIVE = 5, 15, 12   # the kernels' leading tensors and descriptors


def relaunch_bwd(memo: Optional[dict], dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=None, cu_seqlens_k=None,
                 alibi=None, dlse=None) -> bool:
    """Launch the templates flash_bwd kept in memo over these tensors; False (nothing launched, or nothing left half
    done: the full path recomputes every output) where there are none or they do not take them."""
    tpl = memo.get("triton_bwd") if memo is not None else None
    return tpl is not None and tpl(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi, dlse)


def preprocess_launch(out, dout, delta, dq_acc, cu_seqlens_q, batch: int, nheads: int, max_sq: int, head_dim: int):
    """(grid, args, kwargs) of the preprocess kernel writing D into delta (lse's shape) and, where dq_acc is given
    (float32, q's shape), zeroing dQ's accumulator over every sequence's rows; args in the kernel's order."""
    pre_m = 64 if not interpreting() else 32
    grid = (cdiv(max_sq, pre_m), batch * nheads)
    args = (out, dout, delta, dq_acc, cu_seqlens_q, row_strides(out), row_strides(dout), lse_strides(delta),
            (0, 0, 0) if dq_acc is None else row_strides(dq_acc), (nheads, max_sq, head_dim))
    kwargs = dict(BLOCK_M=pre_m, BLOCK_D=configs.block_d(head_dim), IS_VARLEN=cu_seqlens_q is not None,
                  ZERO_DQ=dq_acc is not None)
    return grid, args, kwargs


def _delta(out, dout, lse, dlse, cu_seqlens_q, batch: int, nheads: int, max_sq: int, head_dim: int):
    """(D, its launch as _remember_bwd takes it): D = rowsum(dO o O) (FA2 Alg. 2 line 4), lse's shape, by the
    preprocess kernel, less dlse where a gradient arrives through the LSE output."""
    # (lse's strides: the backward kernels read delta with them)
    delta = torch.empty_strided(lse.shape, lse.stride(), dtype=lse.dtype, device=lse.device)
    grid, args, kwargs = preprocess_launch(out, dout, delta, None, cu_seqlens_q, batch, nheads, max_sq, head_dim)
    launched = relaunch.launch(_bwd.attn_bwd_preprocess_kernel, grid, args, kwargs)
    if dlse is not None:
        # a gradient arriving through the LSE output: d lse_i / d S_ij = P_ij, so dS_ij gains P_ij * dlse_i, i.e.
        # dS = P o (dP - (D - dlse)): folded into D, the kernels are unchanged
        delta.sub_(dlse)
    return delta, (_bwd.attn_bwd_preprocess_kernel, grid, args, kwargs, _PRE_LIVE, launched)


def bwd_delta(out, dout, lse, dlse=None, cu_seqlens_q=None, max_seqlen_q=None) -> torch.Tensor:
    """D = rowsum(dO o O) - dlse as flash_bwd computes it (the preprocess kernel), for a backward that runs other
    kernels from it (the Gluon FA3 backward): out, dout as q; lse (batch, nheads, seqlen_q) or (nheads, total_q)."""
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else out.shape[0]
    max_sq = max_seqlen_q if varlen else out.shape[1]
    return _delta(out, dout, lse, dlse, cu_seqlens_q, batch, out.shape[-2], max_sq, out.shape[-1])[0]


def flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, params: AttnParams, alibi=None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False,
              bias=None, mask=None, sparse: Optional[SparseLists] = None, dbias=None,
              mods: Optional[UserMods] = None, dlse: Optional[torch.Tensor] = None, memo: Optional[dict] = None):
    """Fills dq, dk, dv (same layouts as q, k, v). deterministic=True: no atomics anywhere, bitwise
    reproducible gradients (a broadcast bias's dbias excepted: its reduction uses atomics).
    dbias: a zero-filled float32 tensor of bias's (4-D, unexpanded) shape, filled with dS summed over the
    dimensions bias broadcasts along; None skips that work. memo: as flash_fwd's (the launches' template)."""
    if relaunch_bwd(memo, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi, dlse):
        return
    head_dim = q.shape[-1]
    max_sq, max_sk, batch, nheads, nheads_k, scale, window, dropout, alibi_sb = _common(
        q, k, params, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    flags = _flags(params, alibi, cu_seqlens_q, head_dim, q.dtype)
    even_d = configs.block_d(head_dim) == head_dim
    if q.numel() == 0 or k.numel() == 0 or max_sq == 0 or max_sk == 0:
        # no query or no key: every gradient is 0 (and launching an empty grid is an error)
        for g in (dq, dk, dv):
            g.zero_()
        return
    causal, seqlen = params.lower_triangular, max(max_sq, max_sk)
    if (sparse is None and mods is None
            and tuning.needs_tuning("bwd", head_dim, q.dtype, causal, seqlen, q.device)):
        # FLASHTILE_AUTOTUNE=1, key not cached: time the candidates on scratch gradients; the launches below use the
        # winner (not with mods: their captured-tensor gradient buffers would be added into)
        dq_, dk_, dv_ = torch.empty_like(dq), torch.empty_like(dk), torch.empty_like(dv)
        dbias_ = None if dbias is None else torch.zeros_like(dbias)
        tuning.autotune("bwd", head_dim, q.dtype, causal, seqlen, lambda: flash_bwd(
            dout, q, k, v, out, lse, dq_, dk_, dv_, params, alibi=alibi, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            deterministic=deterministic, bias=bias, mask=mask, dbias=dbias_),
            default=bwd_config(head_dim, q.dtype, causal))
    delta, pre = _delta(out, dout, lse, dlse, cu_seqlens_q, batch, nheads, max_sq, head_dim)
    cfg = _sparse_config(bwd_config(head_dim, q.dtype, causal, seqlen=seqlen), sparse)
    common = (lse_strides(lse), alibi_sb)
    bias_args = pair_args(bias, batch, nheads, max_sq, max_sk)
    mask_args = pair_args(mask, batch, nheads, max_sq, max_sk)
    dbias_flags = {}
    if dbias is not None:
        # a dimension bias broadcasts along is summed over: several tiles add into one element
        target = (batch, nheads, max_sq, max_sk)
        broadcast = any(n == 1 and t > 1 for n, t in zip(dbias.shape, target))
        dbias_flags = dict(HAS_DBIAS=True, DBIAS_ATOMIC=broadcast)
    # atomic_dq: dQ accumulated with fp32 atomics inside the dK/dV kernel (5 matmuls per tile instead of 7,
    # but contended read-modify-writes); otherwise a second pass computes dQ without atomics. deterministic
    # forces the second pass.
    atomic = cfg.atomic_dq and not deterministic
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic else dq
    # the streamed operands (Q, dO in the dK/dV kernel; K, V in the dQ pass) come in tiles of BLOCK_M rows
    block_d = flags["BLOCK_D"]
    dq_rows, dq_keys, dq_warps, dq_stages = cfg.dq_tiles(sparse.block_size if sparse is not None else 0)
    descs = [kv_descriptor(t, rows, block_d) for t, rows in ((q, cfg.BLOCK_M), (dout, cfg.BLOCK_M), (k, dq_keys),
                                                             (v, dq_keys))]
    use_tma = all(d is not None for d in descs)
    desc_q, desc_do, desc_k, desc_v = descs if use_tma else (None,) * 4
    # atomic dQ through TMA: each tile's dQ_i added by one bulk reduce (the interpreter has no such op: there, and
    # where the tiles cannot come through TMA, scalar fp32 atomics)
    desc_dq = kv_descriptor(dq_acc, cfg.BLOCK_M, block_d) if atomic and use_tma and not interpreting() else None
    # split_dkdv: a dV-only launch, then a dK-only one that also does everything else that needs dS (atomic
    # dQ, dBias, score_mod's captured gradients); otherwise one launch does both
    # (flags, key rows, warps, stages) of each launch: the dV launch may take its own tiles (Config.dv)
    tiles = (cfg.BLOCK_N, cfg.num_warps, cfg.num_stages)
    passes = ([(dict(COMPUTE_DK=False), *(cfg.dv or tiles)), (dict(COMPUTE_DV=False), *tiles)] if cfg.split_dkdv
              else [({}, *tiles)])
    record = memo is not None and _templated(params, bias, mask, sparse, mods) and dbias is None
    launched = []   # (kernel, grid, args, kwargs, live count, key) of the dK / dV launches and the dQ pass
    for only, block_n, warps, stages in passes:
        with_ds = only.get("COMPUTE_DK", True)
        dkdv_grid = (cdiv(max_sk, block_n), batch * nheads_k)
        dkdv_args = (
            q, k, v, dout, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k, alibi, desc_q, desc_do, desc_dq,
            row_strides(q), row_strides(k), row_strides(v), row_strides(dout), row_strides(dk), row_strides(dv),
            row_strides(dq_acc), *common,
            (nheads_k, nheads // nheads_k, max_sq, max_sk, head_dim), params.softmax_scale, scale, window, dropout,
            bias_args, mask_args, pair_args(dbias, batch, nheads, max_sq, max_sk),
            sparse_args(sparse, batch, nheads, True))
        kw, key = _launch(
            _bwd.attn_bwd_dkdv_kernel, dkdv_grid, *dkdv_args,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=block_n, EVEN_D=even_d, ATOMIC_DQ=atomic and with_ds, USE_TMA=use_tma,
            DQ_TMA=desc_dq is not None and with_ds,
            **_order_args(params, head_dim, "dkdv", *dkdv_grid),
            num_warps=warps, num_stages=stages, **flags, **(dbias_flags if with_ds else {}),
            **_flex(bias, mask, sparse, mods, "dkdv" if with_ds else "dq", params, max_sq, max_sk), **only)
        launched.append((_bwd.attn_bwd_dkdv_kernel, dkdv_grid, dkdv_args, kw, _DKDV_LIVE, key))
    if atomic:
        dq.copy_(dq_acc)
        if record:
            _remember_bwd(memo, pre, launched, True, (desc_q, desc_do, desc_k, desc_v, desc_dq), dout.stride())
        return
    # dQ pass: query blocks of dq_rows stream key blocks of dq_keys (by default BLOCK_N and BLOCK_M: the roles swap)
    dq_grid = (cdiv(max_sq, dq_rows), batch * nheads)
    dq_args = (
        q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, alibi, desc_k, desc_v,
        row_strides(q), row_strides(k), row_strides(v), row_strides(dout), row_strides(dq), *common,
        (nheads, nheads // nheads_k, max_sq, max_sk, head_dim), params.softmax_scale, scale, window, dropout,
        bias_args, mask_args, sparse_args(sparse, batch, nheads, False))
    kw, key = _launch(
        _bwd.attn_bwd_dq_kernel, dq_grid, *dq_args,
        BLOCK_M=dq_rows, BLOCK_N=dq_keys, EVEN_D=even_d, USE_TMA=use_tma,
        **_order_args(params, head_dim, "dq", *dq_grid),
        num_warps=dq_warps, num_stages=dq_stages, **flags, **_flex(bias, mask, sparse, mods, "dq", params, max_sq,
                                                                   max_sk))
    if record:
        launched.append((_bwd.attn_bwd_dq_kernel, dq_grid, dq_args, kw, _DQ_LIVE, key))
        _remember_bwd(memo, pre, launched, False, (desc_q, desc_do, desc_k, desc_v, desc_dq), dout.stride())


def _remember_bwd(memo: dict, pre, launched, atomic: bool, descs, dout_stride) -> None:
    """Keep a _BackwardTemplate in memo when every launch has a bound kernel (relaunch.bind). pre and each of
    launched: (kernel, grid, args, kwargs, live argument count, relaunch.launch's key)."""
    bounds = []
    for kernel, grid, args, kwargs, n_live, key in (pre, *launched):
        bound = relaunch.bind(kernel, args, kwargs, n_live, key)
        if bound is None:
            return
        bounds.append((bound, (*grid, 1)))
    dkdv = bounds[1:] if atomic else bounds[1:-1]
    memo["triton_bwd"] = _BackwardTemplate(bounds[0], dkdv, None if atomic else bounds[-1], atomic, descs,
                                           dout_stride)

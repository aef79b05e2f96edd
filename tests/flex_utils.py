"""Helpers of the flashtile.flex tests (tests/test_flex.py on the CPU, tests/gpu/test_mods_gpu.py on a GPU).

- torch twins of the ready-made mods (t_*): the same mask / score written with torch ops on broadcast index
  tensors b (B,1,1,1), h (1,H,1,1), q (1,1,Sq,1), kv (1,1,1,Sk);
- user-written @triton.jit mods (what issue #5 is about) and their twins;
- ``flex_ref``: dense attention with torch mods (float64 ground truth or standard attention in the inputs' dtype);
- ``reference_grads``: forward + autograd backward of any dense reference, optionally in chunks of heads so the
  float64 score matrix of a GPU-sized problem fits in memory;
- ``run_and_check``: flex_attention forward + backward vs the reference under the flash-attn tolerance rule
  (attn_utils.assert_within_rule), captured-tensor gradients included;
- ``tile_classes``: a BlockMask's tile lists as a dense (B, H, n_q_blocks, n_kv_blocks) table.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import triton
import triton.language as tl

from attn_utils import DEVICE, EPS_REL, assert_within_rule, tolerance_eps
from flashtile.reference.dense import visible_mask


# ----------------------------------------------------------------------------------------------------------
# Torch twins of the ready-made mods

def t_causal():
    return lambda b, h, q, kv: kv <= q


def t_document(ids, causal=True):
    ids = ids.long()

    def fn(b, h, q, kv):
        same = (ids[q] == ids[kv]) if ids.dim() == 1 else (ids[b, q] == ids[b, kv])
        return same & (kv <= q) if causal else same
    return fn


def t_prefix_lm(prefix):
    prefix = prefix.long()
    return lambda b, h, q, kv: (kv <= q) | (kv < prefix[b])


def t_sliding(window, num_sinks=0):
    # the sinks are causal too (StreamingLLM): a query q < num_sinks does not see the sink keys after it
    return lambda b, h, q, kv: (kv <= q) & ((q - kv < window) | (kv < num_sinks))


def t_alibi(s, b, h, q, kv, slopes):
    return s - slopes[h] * (q - kv).abs().to(s.dtype)


def t_softcap(cap):
    return lambda s, b, h, q, kv: cap * torch.tanh(s / cap)


def t_relpos(max_distance):
    def fn(s, b, h, q, kv, table):
        return s + table[h, (kv - q).clamp(-max_distance, max_distance) + max_distance].to(s.dtype)
    return fn


# ----------------------------------------------------------------------------------------------------------
# User-written mods: a mask reading a captured (B, Sk) key-keep table plus two scalars, and a non-additive score
# mod with grad_fn and a captured (H, Sk) per-key bias that receives a gradient through captured_grad_fn.

@triton.jit
def keep_period_mask(b, h, q_idx, kv_idx, aux):
    keep_ptr, n_keys, period = aux[0], aux[1], aux[2]
    kept = tl.load(keep_ptr + b * n_keys + kv_idx, mask=kv_idx < n_keys, other=0) != 0
    return kept & ((q_idx + kv_idx + h) % period != 0)


def t_keep_period(keep, period):
    keep = keep.bool()
    return lambda b, h, q, kv: keep[b, kv] & ((q + kv + h) % period != 0)


@triton.jit
def sig_key_bias(score, b, h, q_idx, kv_idx, aux):
    kb, n_keys, factor = aux[0], aux[1], aux[2]
    bias = tl.load(kb + h * n_keys + kv_idx, mask=kv_idx < n_keys, other=0.0)
    return score * factor + 0.5 * tl.sigmoid(score) + bias


@triton.jit
def sig_key_bias_grad(dscore, score, b, h, q_idx, kv_idx, aux):
    factor = aux[2]
    sg = tl.sigmoid(score)
    return dscore * (factor + 0.5 * sg * (1.0 - sg))


@triton.jit
def sig_key_bias_dcaptured(dscore, score, b, h, q_idx, kv_idx, aux, aux_grad):
    n_keys = aux[1]
    col = kv_idx + q_idx * 0          # the full tile: right whichever orientation the kernel hands over
    tl.atomic_add(aux_grad[0] + h * n_keys + col, dscore, mask=col < n_keys)


def t_sig_key_bias(factor):
    def fn(s, b, h, q, kv, kb):
        return s * factor + 0.5 * torch.sigmoid(s) + kb[h, kv].to(s.dtype)
    return fn


@triton.jit
def plus_head_bias(score, b, h, q_idx, kv_idx, aux):     # additive; used by the "no captured_grad_fn" error
    return score + tl.load(aux[0] + h)


@triton.jit
def row_mask(b, h, q_idx, kv_idx, aux):                   # rows q % 5 == 2 see nothing; top-left causal
    return (q_idx % 5 != 2) & (kv_idx <= q_idx)


@triton.jit
def late_rows_mask(b, h, q_idx, kv_idx, aux):             # query rows 0..39 see nothing
    return (q_idx >= 40) & (kv_idx <= q_idx)


# ----------------------------------------------------------------------------------------------------------
# References

def random_tile_mask(b, h, sq, sk, bs, device=DEVICE):
    """A torch mask_fn for create_block_mask whose bs x bs tiles are, per (batch, head), at random empty, full or
    element-wise random: all three tile kinds of FA1 Alg. 5 in one mask."""
    kind = torch.randint(0, 3, (b, h, -(-sq // bs), -(-sk // bs)), device=device)   # 0 empty, 1 full, 2 mixed
    noise = torch.rand(b, h, sq, sk, device=device) > 0.5

    def mask_fn(bi, hi, qi, ki):
        t = kind[bi, hi, qi // bs, ki // bs]
        return (t == 1) | ((t == 2) & noise[bi, hi, qi, ki])
    return mask_fn


def flex_ref(q, k, v, *, score_fn=None, mask_fn=None, captured=(), softmax_scale=None, causal=False,
             window_size=(-1, -1), upcast=True, h_offset=0):
    """Dense attention with torch mods: s = q.k * scale -> score_fn -> -inf where mask_fn / causal / window say
    no -> softmax -> P V. upcast: float64 everything (ref64); else matmuls in q.dtype and scores, mods, softmax
    in float32 (std). captured: tensors passed to score_fn after the indices. h_offset: global index of q's
    first head (head-chunked runs). Returns (out, lse)."""
    acc = torch.float64 if upcast else torch.float32
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if h != hk:
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    s = torch.einsum("bihd,bjhd->bhij", q, k).to(acc) * scale
    dev = q.device
    bi = torch.arange(b, device=dev).view(b, 1, 1, 1)
    hi = torch.arange(h_offset, h_offset + h, device=dev).view(1, h, 1, 1)
    qi, ki = torch.arange(sq, device=dev).view(1, 1, sq, 1), torch.arange(sk, device=dev).view(1, 1, 1, sk)
    if score_fn is not None:
        s = score_fn(s, bi, hi, qi, ki, *captured)
    vis = visible_mask(sq, sk, window_size, causal, device=dev).view(1, 1, sq, sk).expand(b, h, sq, sk)
    if mask_fn is not None:
        vis = vis & mask_fn(bi, hi, qi, ki)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(acc).min)).masked_fill(~vis, 0.0)
    out = torch.einsum("bhij,bjhd->bihd", p.to(v.dtype), v)
    return (out if upcast else out.to(q.dtype)), lse


def reference_grads(ref_fn: Callable, q, k, v, dout, captured: Sequence[torch.Tensor] = (), *, upcast: bool,
                    chunk_heads: Optional[int] = None):
    """Forward + backward of ref_fn(q_chunk, k_chunk, v_chunk, captured_leaves, h0, upcast) -> (out, lse) over
    chunks of chunk_heads query heads (a multiple of the GQA group; None: all heads at once).

    upcast: leaves in float64 (ref64), else copies in their own dtype (std). Captured tensors are shared leaves
    (their gradients summed over the chunks). Returns (out, lse, dq, dk, dv, *d_captured)."""
    cast = (lambda t: t.detach().double()) if upcast else (lambda t: t.detach().clone())
    h, hk = q.shape[2], k.shape[2]
    group = h // hk
    chunk = h if chunk_heads is None else max(group, chunk_heads // group * group)
    caps = [cast(c).requires_grad_(c.requires_grad) for c in captured]
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for h0 in range(0, h, chunk):
        h1 = min(h, h0 + chunk)
        qc = cast(q[:, :, h0:h1]).requires_grad_()
        kc = cast(k[:, :, h0 // group:h1 // group]).requires_grad_()
        vc = cast(v[:, :, h0 // group:h1 // group]).requires_grad_()
        out, lse = ref_fn(qc, kc, vc, caps, h0, upcast)
        out.backward(dout[:, :, h0:h1].to(out.dtype))
        outs.append(out.detach())
        lses.append(lse.detach())
        dqs.append(qc.grad)
        dks.append(kc.grad)
        dvs.append(vc.grad)
        del out, lse, qc, kc, vc
    d_caps = [c.grad if c.requires_grad else None for c in caps]
    return (torch.cat(outs, 2), torch.cat(lses, 1), torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2),
            *d_caps)


def captured_noise(q, k, v, dout, captured, *, score_fn, mask_fn=None, chunk_heads: Optional[int] = None,
                   probes: int = 16, **ref_kw) -> list:
    """Per captured tensor, the scale of its gradient's rounding noise: sqrt(sum_ij t_ij^2) for each entry, where
    t_ij = dS_ij * d s_ij / d(entry) are the terms that gradient sums (float64, the scores after score_fn).

    Those terms cancel (sum_j dS_ij = 0 in every row), so the gradient can be far smaller than its terms, and
    rounding each term at the kernels' precision moves the sum by about EPS * sqrt(sum t^2) (a random walk), not by
    EPS times the result, which is what the plain rule's eps scales with. Estimated with random-sign probes r:
    E[(sum_ij r_ij t_ij)^2] = sum_ij t_ij^2."""
    caps = [c.detach().double().requires_grad_() for c in captured]
    h, hk = q.shape[2], k.shape[2]
    group = h // hk
    chunk = h if chunk_heads is None else max(group, chunk_heads // group * group)
    squares = [torch.zeros_like(c) for c in caps]
    gen = torch.Generator(device=q.device).manual_seed(0)
    for h0 in range(0, h, chunk):
        h1 = min(h, h0 + chunk)
        seen = {}

        def recorded(s, *args):
            s = score_fn(s, *args)
            seen["s"] = s
            s.register_hook(lambda g: seen.__setitem__("ds", g))
            return s
        qc, kc, vc = (t.detach()[:, :, a:b].double() for t, a, b in ((q, h0, h1), (k, h0 // group, h1 // group),
                                                                          (v, h0 // group, h1 // group)))
        out, _ = flex_ref(qc, kc, vc, score_fn=recorded, mask_fn=mask_fn, captured=caps, h_offset=h0, **ref_kw)
        out.backward(dout[:, :, h0:h1].double(), retain_graph=True)
        for _ in range(probes):
            r = torch.randint(0, 2, seen["s"].shape, generator=gen, device=q.device).double() * 2 - 1
            grads = torch.autograd.grad(seen["s"], caps, seen["ds"] * r, retain_graph=True, allow_unused=True)
            for acc, g in zip(squares, grads):
                if g is not None:
                    acc += g * g / probes
        del out, seen
    return [a.sqrt() for a in squares]


def check_all(names, ours, ref64, std, dtype, ctx, noise=()):
    """assert_within_rule for each output; a captured tensor's gradient (names "d(captured[i])") with its eps
    raised by twice its rounding noise (captured_noise, noise[i]), as the rule doubles standard attention's error."""
    for name, o, r, s in zip(names, ours, ref64, std):
        assert o is not None, f"{name} is None {ctx}"
        eps = None
        if name.startswith("d(captured"):
            i = int(name[len("d(captured["):-2])
            eps = tolerance_eps(dtype, r) + 2 * EPS_REL[dtype] * noise[i].max().item()
        assert_within_rule(name, o, r, s, dtype, ctx, eps=eps)


def run_and_check(q, k, v, dout, dtype, ctx, *, score_fn=None, mask_fn=None, captured=(), chunk_heads=None,
                  **kw):
    """flex_attention(q, k, v, **kw) forward + backward vs flex_ref (ref64 and std) under the tolerance rule,
    for out, lse, dq, dk, dv and the .grad of each captured tensor (score_fn's extra arguments). Returns
    (out, lse, [dq, dk, dv, *d_captured])."""
    from flashtile.flex import flex_attention
    ref_kw = {key: kw[key] for key in ("softmax_scale", "causal", "window_size") if key in kw}
    for c in captured:
        c.grad = None
    out, lse = flex_attention(q, k, v, return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype, ctx
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32, ctx
    q.grad = k.grad = v.grad = None
    out.backward(dout)
    ours = [out, lse, q.grad, k.grad, v.grad] + [c.grad for c in captured]
    names = ["out", "lse", "dq", "dk", "dv"] + [f"d(captured[{i}])" for i in range(len(captured))]

    def ref_fn(qc, kc, vc, caps, h0, upcast):
        return flex_ref(qc, kc, vc, score_fn=score_fn, mask_fn=mask_fn, captured=caps, upcast=upcast,
                        h_offset=h0, **ref_kw)

    ref64 = reference_grads(ref_fn, q, k, v, dout, captured, upcast=True, chunk_heads=chunk_heads)
    std = reference_grads(ref_fn, q, k, v, dout, captured, upcast=False, chunk_heads=chunk_heads)
    noise = (captured_noise(q, k, v, dout, captured, score_fn=score_fn, mask_fn=mask_fn, chunk_heads=chunk_heads,
                            **ref_kw) if captured else [])
    check_all(names, ours, ref64, std, dtype, ctx, noise)
    return out, lse, ours[2:]


def tile_classes(bm, B: int, H: int) -> torch.Tensor:
    """(B, H, n_q_blocks, n_kv_blocks) int64 on the CPU: 0 empty, 1 partial, 2 full, from a BlockMask's kv
    lists; asserts that its q lists (the backward's transpose) say the same and no tile is listed twice."""
    nq, nk = bm.kv_num_blocks.shape[-1], bm.kv_indices.shape[-1]
    tables = []
    for num, idx, full_num, full_idx, n_rows, n_cols in (
            (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, nq, nk),
            (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices, nk, nq)):
        cls = torch.zeros(*num.shape[:2], n_rows, n_cols, dtype=torch.long)
        for val, n_, i_ in ((1, num, idx), (2, full_num, full_idx)):
            n_, i_ = n_.long().cpu(), i_.long().cpu()[..., :n_cols]
            valid = torch.arange(i_.shape[-1]) < n_[..., None]
            cls.scatter_add_(-1, torch.where(valid, i_, 0), valid.long() * val)
        tables.append(cls)
    kv_cls, q_cls = tables
    assert torch.equal(kv_cls, q_cls.transpose(-1, -2)), "the kv lists and the q lists of the block mask disagree"
    assert kv_cls.max() <= 2, "a tile is listed twice"
    return kv_cls.expand(B, H, -1, -1)

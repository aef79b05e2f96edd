"""Shared helpers for the attention tests: input generation, the reference runs, and the one tolerance rule.

The tolerance rule (flash-attn 2.x test suite), applied to out, lse, the attention probabilities and every
gradient:

    max |ours - ref64|  <=  2 * max |std - ref64|  +  eps

ref64 is ``attention_ref(upcast=True)`` (float64 ground truth) and std is ``attention_ref(upcast=False)``:
standard attention in the inputs' dtype (matmuls in that dtype, softmax in float32). "Twice as wrong as the
textbook implementation in the same precision" is the bar. eps only matters where std happens to be almost
exact (tiny problems, seqlen_k = 1, ...); see ``flashtile.reference.dense.EPS_REL`` for the values and why.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import torch

from flashtile.reference.dense import EPS_REL, attention_ref, tolerance_eps, visible_mask  # noqa: F401

try:   # (property sweeps; the GPU machine may lack hypothesis: `given` is then None and the sweeps are not defined)
    from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: F401
except ImportError:
    given = st = None


def sweep(examples: int):
    """hypothesis settings of a property sweep over small random problems: `examples` of them, no deadline (the
    interpreter's first call compiles), fresh ones each run (a failure prints its example, seed included)."""
    return settings(max_examples=examples, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}


def assert_within_rule(name: str, ours: torch.Tensor, ref64: torch.Tensor, std: torch.Tensor,
                       dtype: torch.dtype, context: str = "", eps: Optional[float] = None,
                       extra: Optional[torch.Tensor] = None) -> None:
    """The flash-attn tolerance rule: max|ours - ref64| <= 2 max|std - ref64| + eps (see module docstring), plus,
    element by element, `extra` where given (stored_output_bounds: an error of the algorithm that std lacks).

    -inf entries (lse of rows with no visible key) must be -inf in ours too, at exactly the same places;
    NaN anywhere in ours fails. ``dtype`` is the dtype of the attention inputs (it picks eps).
    """
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != expected {tuple(ref64.shape)} {context}"
    ours64, std64, ref64 = ours.detach().double(), std.detach().double(), ref64.detach().double()
    n_nan = torch.isnan(ours64).sum().item()
    assert n_nan == 0, f"{name}: {n_nan} NaN entries in ours {context}"
    ref_inf = torch.isinf(ref64)
    ours_inf = torch.isinf(ours64)
    if ref_inf.any() or ours_inf.any():
        mism = (ref_inf != ours_inf) | (ref_inf & (torch.sign(ref64) != torch.sign(ours64)))
        if mism.any():
            idx = tuple(mism.nonzero()[0].tolist())
            raise AssertionError(f"{name}: infinities differ at {mism.sum().item()} entries, first {idx}: "
                                 f"ours={ours64[idx].item()} ref={ref64[idx].item()} {context}")
        fin = ~ref_inf
        ours64, std64, ref64 = ours64[fin], std64[fin], ref64[fin]
        extra = None if extra is None else extra[fin]
        std64 = torch.where(torch.isfinite(std64), std64, ref64)
    if ref64.numel() == 0:
        return
    if eps is None:
        eps = tolerance_eps(dtype, ref64)
    err = (ours64 - ref64).abs()
    err_std = (std64 - ref64).abs().max().item()
    bound = 2 * err_std + eps + (0.0 if extra is None else extra.detach().double())
    used = (err / bound).max().item() if torch.is_tensor(bound) else err.max().item() / bound
    more = "" if extra is None else f"  + extra up to {extra.max().item():.1e}"
    print(f"  {name}: max|ours-ref64| {err.max().item():.2e}  2*max|std-ref64| {2 * err_std:.2e}  eps {eps:.1e}"
          f"{more}  used {used:.0%} of the bound {context}")
    if not used <= 1.0:
        flat = (err / bound).argmax().item()
        at = bound.flatten()[flat].item() if torch.is_tensor(bound) else bound
        raise AssertionError(
            f"{name}: |ours - ref64| = {err.flatten()[flat].item():.3e} > bound {at:.3e} "
            f"(= 2 * max|std - ref64| {err_std:.3e} + eps {eps:.1e}{more}) at flat index {flat} "
            f"(ours={ours64.flatten()[flat].item():.6g}, ref64={ref64.flatten()[flat].item():.6g}); "
            f"{(err > bound).sum().item()}/{err.numel()} entries out of bound {context}")


def stored_output_bounds(q, k, dout, out64, probs64, dtype: torch.dtype, softmax_scale: Optional[float] = None):
    """Per-element bounds (dq, dk) of the error FA2's backward adds by taking D_i = rowsum(dO_i o O_i) (Algorithm 2,
    line 4 of the backward) from the output stored in `dtype`, which std's backward (autograd of the textbook
    attention, D from P and dP) never rounds: |delta D_i| <= u |dO_i| . |O_i| (unit roundoff u), and dS_ij =
    P_ij (dP_ij - D_i) moves by P_ij |delta D_i| (softcap's derivative is at most 1), so
      |delta dQ_i| <= scale sum_j P_ij |delta D_i| |K_j|,   |delta dK_j| <= scale sum_i P_ij |delta D_i| |Q_i|.
    Shapes (b, s, h, d) for q / dout / out64 and (b, s, h_k, d) for k (a group's query heads summed into its key
    head); probs64 (b, h, s_q, s_k), the softmax before dropout (dS's P, dropout or not)."""
    u = UNIT_ROUNDOFF[dtype]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    q64, k64, do64 = (t.detach().double() for t in (q, k, dout))
    b, sk, hk, d = k64.shape
    group = q64.shape[2] // hk
    k64 = k64.repeat_interleave(group, dim=2)
    delta_d = u * (do64.abs() * out64.detach().double().abs()).sum(-1).transpose(1, 2)   # (b, h, s_q)
    w = probs64.double() * delta_d[..., None]                                            # (b, h, s_q, s_k)
    dq = scale * torch.einsum("bhij,bjhd->bihd", w, k64.abs())
    dk = scale * torch.einsum("bhij,bihd->bjhd", w, q64.abs())
    return dq, dk.view(b, sk, hk, group, d).sum(3)


def stored_output_bias_bound(dout, out64, probs64, dtype: torch.dtype, shape) -> torch.Tensor:
    """dBias's counterpart of stored_output_bounds: dBias of an attn_bias of `shape` (broadcastable to (b, h, s_q,
    s_k)) sums dS over the entries the bias broadcasts to, each moved by P_ij |delta D_i| (the bias is added after
    softcap: no derivative of it), so its bound is that sum over the same entries."""
    delta_d = UNIT_ROUNDOFF[dtype] * (dout.detach().double().abs()
                                      * out64.detach().double().abs()).sum(-1).transpose(1, 2)   # (b, h, s_q)
    w = probs64.double() * delta_d[..., None]
    full = (1, ) * (4 - len(shape)) + tuple(shape)
    dims = [i for i, n in enumerate(full) if n == 1 and w.shape[i] > 1]
    return (w.sum(dims, keepdim=True) if dims else w).reshape(shape)


# ----------------------------------------------------------------------------------------------------------
# Inputs

LAYOUTS = ("contig", "sliced", "padded", "transposed")


def rand_tensor(shape: Sequence[int], dtype, device=DEVICE, layout: str = "contig",
                requires_grad: bool = False) -> torch.Tensor:
    """Standard-normal tensor of ``shape`` (b, s, h, d) with the given memory layout; never zeros.

    contig:     a fresh contiguous tensor.
    sliced:     a view into a larger (b, s+3, h+1, d+5) buffer with an odd storage offset: every stride but the
                last differs from the contiguous one, and nothing is 16-byte aligned (kernels that use TMA
                descriptors must fall back to plain loads).
    padded:     a view into a larger (b, s+2, h+1, d+pad) buffer, pad chosen so every stride and the storage
                offset stay 16-byte aligned: strided, yet eligible for TMA descriptors.
    transposed: a (b, h, s, d) buffer transposed to (b, s, h, d) (the layout of q after a head-first projection).
    packed:     the middle slice of a (b, s, 3, h, d) buffer (q, k or v of a fused qkv projection): rows at stride
                3 h d, a (rows, heads x d) view TMA can tile.
    The last dimension is always contiguous. The result is a leaf (requires_grad as asked) with that layout.
    """
    b, s, h, d = shape
    if layout == "contig":
        t = torch.randn(b, s, h, d, dtype=dtype, device=device)
    elif layout == "sliced":
        t = torch.randn(b, s + 3, h + 1, d + 5, dtype=dtype, device=device)[:, 2:2 + s, 1:, 3:3 + d]
    elif layout == "padded":
        elems16 = 16 // torch.tensor([], dtype=dtype).element_size()
        pad = elems16 + (-d) % elems16
        t = torch.randn(b, s + 2, h + 1, d + pad, dtype=dtype, device=device)[:, 1:1 + s, 1:, :d]
    elif layout == "transposed":
        t = torch.randn(b, h, s, d, dtype=dtype, device=device).transpose(1, 2)
    elif layout == "packed":
        t = torch.randn(b, s, 3, h, d, dtype=dtype, device=device)[:, :, 1]
    else:
        raise ValueError(layout)
    assert t.shape == (b, s, h, d) and t.stride(-1) == 1
    return t.detach().requires_grad_(requires_grad)


def rand_alibi(kind: Optional[str], batch: int, nheads: int, device=DEVICE) -> Optional[torch.Tensor]:
    """ALiBi slopes, float32, shape (nheads,) for kind 'h' or (batch, nheads) for kind 'bh'; None for None."""
    if kind is None:
        return None
    shape = (nheads,) if kind == "h" else (batch, nheads)
    # positive slopes of the usual magnitude (2**-1 .. 2**-8), randomised so heads/batches differ
    return torch.rand(shape, dtype=torch.float32, device=device) * 0.5 + 2.0 ** -8


def inputs(b, sq, sk, h, hk, d, dtype, device=DEVICE):
    """Standard-normal q (b, sq, h, d), k and v (b, sk, hk, d), leaves requiring grad, and dout shaped as q."""
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, sk, hk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, sk, hk, d, dtype=dtype, device=device, requires_grad=True)
    dout = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    return q, k, v, dout


@dataclasses.dataclass(frozen=True, kw_only=True)
class Features:
    """The options of one call that the dense (Case) and the varlen (test_varlen.VCase) feature matrices vary;
    keyword-only, after a case's own fields."""
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None   # None, 'h' or 'bh'
    dropout_p: float = 0.0
    deterministic: bool = False

    def feature_tags(self, *own: str) -> list:
        """A case id's parts for the options that are set; own: the case's own parts, placed before "det"."""
        tags = [tag for on, tag in ((self.causal, "causal"),
                                    (self.window != (-1, -1), f"win{self.window[0]}_{self.window[1]}"),
                                    (self.softcap, f"cap{self.softcap:g}"), (self.alibi, f"alibi-{self.alibi}"),
                                    (self.dropout_p, f"drop{self.dropout_p:g}")) if on]
        return tags + list(own) + (["det"] if self.deterministic else [])


@dataclasses.dataclass(frozen=True)
class Case(Features):
    """One forward+backward configuration of the feature matrix."""
    b: int
    sq: int
    sk: int
    h: int
    hk: int
    d: int
    dtype: torch.dtype
    layout: str = "contig"
    softmax_scale: Optional[float] = None

    @property
    def id(self) -> str:
        dt = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        parts = [f"b{self.b}", f"sq{self.sq}", f"sk{self.sk}", f"h{self.h}", f"hk{self.hk}", f"d{self.d}", dt]
        own = [self.layout] if self.layout != "contig" else []
        if self.softmax_scale is not None:
            own.append(f"scale{self.softmax_scale:g}")
        return "-".join(parts + self.feature_tags(*own))

    def replace(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)


def case_inputs(c: Case, device=DEVICE):
    """Fresh random q, k, v (leaves requiring grad), dout and alibi slopes for a case."""
    q = rand_tensor((c.b, c.sq, c.h, c.d), c.dtype, device, c.layout, requires_grad=True)
    k = rand_tensor((c.b, c.sk, c.hk, c.d), c.dtype, device, c.layout, requires_grad=True)
    v = rand_tensor((c.b, c.sk, c.hk, c.d), c.dtype, device, c.layout, requires_grad=True)
    dout = torch.randn(c.b, c.sq, c.h, c.d, dtype=c.dtype, device=device)
    alibi = rand_alibi(c.alibi, c.b, c.h, device)
    return q, k, v, dout, alibi


def flash_kwargs(c: Case, alibi, **extra) -> dict:
    """flash_attn_func keyword arguments of a case (plus overrides)."""
    kw = dict(dropout_p=c.dropout_p, softmax_scale=c.softmax_scale, causal=c.causal, window_size=c.window,
              softcap=c.softcap, alibi_slopes=alibi, deterministic=c.deterministic)
    kw.update(extra)
    return kw


def ref_kwargs(c: Case, alibi) -> dict:
    return dict(softmax_scale=c.softmax_scale, causal=c.causal, window_size=c.window, softcap=c.softcap,
                alibi_slopes=alibi)


def reference_fwd_bwd(q, k, v, dout, *, upcast: bool, dropout_p: float = 0.0, dropout_mask=None, **kw):
    """attention_ref forward + autograd backward. upcast=True: float64 leaves (ref64); False: std in q.dtype.

    Returns (out, lse, probs, dq, dk, dv).
    """
    cast = (lambda t: t.detach().double()) if upcast else (lambda t: t.detach().clone())
    qr, kr, vr = (cast(t).requires_grad_() for t in (q, k, v))
    out, lse, probs = attention_ref(qr, kr, vr, dropout_p=dropout_p, dropout_mask=dropout_mask,
                                    upcast=upcast, **kw)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), probs.detach(), qr.grad, kr.grad, vr.grad


def check_against_reference(c: Case, q, k, v, dout, alibi, out, lse, s_dmask, grads,
                            dropout_mask=None) -> None:
    """Rule-check ours (out, lse, optional S_dmask, optional grads (dq, dk, dv)) against ref64 and std."""
    kw = ref_kwargs(c, alibi)
    ref = reference_fwd_bwd(q, k, v, dout, upcast=True, dropout_p=c.dropout_p, dropout_mask=dropout_mask, **kw)
    std = reference_fwd_bwd(q, k, v, dout, upcast=False, dropout_p=c.dropout_p, dropout_mask=dropout_mask, **kw)
    ctx = f"[{c.id}]"
    assert_within_rule("out", out, ref[0], std[0], c.dtype, ctx)
    if lse is not None:
        assert_within_rule("softmax_lse", lse, ref[1], std[1], c.dtype, ctx)
    if s_dmask is not None:
        assert_within_rule("|S_dmask| (probabilities)", s_dmask.abs(), ref[2], std[2], c.dtype, ctx)
    if grads is not None:
        extras = (*stored_output_bounds(q, k, dout, ref[0], ref[2], c.dtype, c.softmax_scale), None)
        for name, g, gr, gs, x in zip(("dq", "dk", "dv"), grads, ref[3:], std[3:], extras):
            assert g is not None, f"{name} is None {ctx}"
            assert_within_rule(name, g, gr, gs, c.dtype, ctx, extra=x)


def keep_mask_from_s_dmask(s_dmask: torch.Tensor) -> torch.Tensor:
    """S_dmask holds P where kept and -P where dropped (0 where masked): kept <=> S_dmask >= 0."""
    return s_dmask >= 0


def visible(c: Case, device=DEVICE) -> torch.Tensor:
    """Bool (sq, sk) visibility of the case (bottom-right aligned causal/window)."""
    return visible_mask(c.sq, c.sk, c.window, c.causal, device=device)


def empty_rows(c: Case, device=DEVICE) -> torch.Tensor:
    """Bool (sq,): query rows that see no key at all."""
    return ~visible(c, device).any(dim=1)


def binomial_5sigma(n: int, p_keep: float) -> float:
    return 5.0 * math.sqrt(n * p_keep * (1.0 - p_keep))


def sums_case(varlen: bool, dtype, device, dense=(2, 77, 90), d: int = 64):
    """A problem (dense causal GQA of (batch, seqlen_q, seqlen_k) `dense`, or varlen with a zero-length sequence
    and padding rows after the last one) with its forward run: (problem, extras, q, k, v, dout, out, lse)."""
    from flashtile import interface
    from flashtile.api import problem as P
    h, hk = 4, 2
    if varlen:
        cu = torch.tensor([0, 37, 37, 100, 161], dtype=torch.int32, device=device)
        total = 170   # rows 161.. belong to no sequence
        q, do = (torch.randn(total, h, d, device=device).to(dtype) for _ in range(2))
        k, v = (torch.randn(total, hk, d, device=device).to(dtype) for _ in range(2))
        p = P.memoised({}, (q, k, v, cu, cu, 64, 64, 0.0, None, True, (-1, -1), 0.0, None, False, False), P.varlen)
        pad = P.cu_seqlens_values("cu_seqlens_q", cu, total, 64, "max_seqlen_q")
        p = dataclasses.replace(p, pad_q=pad, pad_k=pad)
        x = interface.Extras(None, cu, cu)
    else:
        b, sq, sk = dense
        q, do = (torch.randn(b, sq, h, d, device=device).to(dtype) for _ in range(2))
        k, v = (torch.randn(b, sk, hk, d, device=device).to(dtype) for _ in range(2))
        p = P.memoised({}, (q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False), P.dense)
        x = interface.NO_EXTRAS
    out, lse, _, _ = interface.forward(p, q, k, v, x)
    return p, x, q, k, v, do, out, lse

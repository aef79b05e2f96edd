"""Standard attention (FA1 paper, Dao et al. 2022: Algorithm 0 and its backward, Algorithm 3): the
three-step algorithm that writes the N x N matrices S and P to HBM, and its five-step backward.

This module also defines, once, what every reference algorithm means by one attention head: the softmax
scale tau, the MASK function (causal, bottom-right aligned like ``dense.visible_mask``; key padding) and the
dropout mask Z drawn from ``rng`` by (seed, offset, b, h, row, col). ``validate`` checks all arguments of
all algorithms and returns a :class:`Head`; FA1, FA2 and block-sparse FlashAttention import it from here.

Shapes (one head): Q (N_q, d); K, V (N_k, d); O, dO (N_q, d); S, P (N_q, N_k). Any float dtype; on chip the
algorithms compute in ``Head.acc`` (float64 for float64 inputs, float32 otherwise) and HBM intermediates
(S, P, dP, dS, FA's O accumulators and statistics) are kept in that precision; outputs return in the input
dtype. Works on CPU, CUDA and ``meta`` tensors (no ``.item()``; control flow depends on shapes only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import rng
from .io_counters import HBM, Tiling, block_sizes as paper_block_sizes
from .softmax import NEG_INF, safe_softmax


@dataclass(frozen=True)
class Head:
    """One head's attention problem minus its tensors: sizes, tau, MASK, dropout and the RNG key.

    ``tiling`` is set for the tiled algorithms (Br, Bc, and the block mask of Alg. 5).
    """

    N_q: int
    N_k: int
    d: int
    dtype: torch.dtype
    acc: torch.dtype
    device: torch.device
    tau: float
    causal: bool
    key_padding_mask: torch.Tensor | None  # (N_k,) bool, True = real token
    dropout_p: float
    seed: int
    offset: int
    b: int
    h: int
    nheads: int
    tiling: Tiling | None = None

    def _index(self, s: slice) -> torch.Tensor:
        return torch.arange(s.start, s.stop, device=self.device)

    def MASK(self, S: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """S_masked = MASK(S): -inf where query row i may not see key col j (causal: j > i + N_k - N_q; key
        padding: key j is padding). S is the (rows, cols) tile of the score matrix."""
        visible = None
        if self.causal:
            i, j = self._index(rows).view(-1, 1), self._index(cols).view(1, -1)
            visible = j <= i + (self.N_k - self.N_q)
        if self.key_padding_mask is not None:
            # the padding mask is a function argument (the paper's MASK), so reading it is not HBM traffic
            kp = self.key_padding_mask[cols].view(1, -1)
            visible = kp if visible is None else visible & kp
        return S if visible is None else S.masked_fill(~visible, NEG_INF)

    def Z(self, rows: slice, cols: slice):
        """Dropout mask tile Z_ij (FA1 Alg. 4 line 14): 1/(1 - p) where kept, 0 where dropped; the kept set
        is ``rng.block_keep_mask`` keyed by (seed, offset, b, h, row, col), so every algorithm, forward and
        backward, draws the same Z. Without dropout Z is the scalar 1."""
        if self.dropout_p == 0.0:
            return 1.0
        keep = rng.block_keep_mask(self.seed, self.offset, self.b, self.h, self._index(rows), self._index(cols),
                                   self.nheads, self.N_q, self.N_k, self.dropout_p)
        return keep.to(self.acc) / (1.0 - self.dropout_p)

    def block_is_masked(self, rows: slice, cols: slice) -> bool:
        """True when causal masking hides the whole (rows, cols) block: its first key lies right of the last
        query's diagonal. Index arithmetic only (FA2 §3.1.1 skips these blocks)."""
        return self.causal and cols.start > (rows.stop - 1) + (self.N_k - self.N_q)


def validate(Q, K, V, *, where: str, softmax_scale: float | None = None, causal: bool = False,
             key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int = 0,
             offset: int = 0, b: int = 0, h: int = 0, nheads: int = 1, rows: dict | None = None,
             square: dict | None = None, M: int | None = None, block_sizes=None, block_mask=None,
             tiled: bool = False, R=None) -> Head:
    """Check every argument of a reference algorithm and build its :class:`Head`; raises ValueError naming
    the argument, its value and what was expected.

    Head options (shared by all algorithms): softmax_scale (tau, default 1/sqrt(d)); causal; key_padding_mask
    (N_k,) bool; dropout_p in [0, 1); seed, offset (the Philox key and counter offset: FA1's RNG state R);
    b, h, nheads (this head's batch and head index and the head count, which key the dropout counter).
    ``rows``: extra tensors that must be (N_q, d) (O, dO) or (N_q,) (l, m, L), as {name: tensor}; ``square``:
    {name: tensor} that must be (N_q, N_k) (P). ``tiled``: check M (SRAM size in elements), the optional
    block_sizes (Br, Bc) override, and block_mask ((Tr, Tc) bools, a nested sequence or CPU tensor).
    ``R``: FA1's RNG state (seed, offset) as returned by its forward; replaces seed and offset.
    """
    def fail(arg, value, expected):
        raise ValueError(f"{where}: {arg}={value}; expected {expected}")

    def describe(t):
        return f"{type(t).__name__}" if not isinstance(t, torch.Tensor) else f"{t.dtype} {tuple(t.shape)}"

    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            fail(name, describe(t), "a 2-D float tensor (N, d)")
    N_q, d = Q.shape
    N_k = K.shape[0]
    if N_q < 1 or N_k < 1 or d < 1:
        fail("Q/K", f"shapes {tuple(Q.shape)}, {tuple(K.shape)}", "N_q, N_k, d >= 1")
    expected = {"K": (N_k, d), "V": (N_k, d)}
    for name in rows or {}:
        expected[name] = (N_q, d) if name in ("O", "dO") else (N_q,)
    for name in square or {}:
        expected[name] = (N_q, N_k)
    tensors = {"K": K, "V": V, **(rows or {}), **(square or {})}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            fail(name, describe(t), f"a float tensor of shape {expected[name]}")
        if tuple(t.shape) != expected[name]:
            fail(name, f"shape {tuple(t.shape)}",
                 f"{expected[name]} (Q is {tuple(Q.shape)}, K is {tuple(K.shape)})")
        if t.device != Q.device:
            fail(name, f"device {t.device}", f"Q's device {Q.device}")
    for name in ("K", "V", "O", "dO"):
        if name in tensors and tensors[name].dtype != Q.dtype:
            fail(name, f"dtype {tensors[name].dtype}", f"Q's dtype {Q.dtype}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool \
                or tuple(key_padding_mask.shape) != (N_k,) or key_padding_mask.device != Q.device:
            fail("key_padding_mask", describe(key_padding_mask), f"a bool tensor of shape (N_k,) = ({N_k},) "
                 f"on {Q.device}")
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        fail("dropout_p", repr(dropout_p), "a float in [0, 1)")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale)):
        fail("softmax_scale", repr(softmax_scale), "a finite float or None (1/sqrt(d))")
    if R is not None:
        if not isinstance(R, (tuple, list)) or len(R) != 2:
            fail("R", repr(R), "the RNG state (seed, offset) returned by the forward")
        seed, offset = R
    for name, v in (("seed", seed), ("offset", offset), ("b", b), ("h", h), ("nheads", nheads)):
        if not isinstance(v, int) or v < 0:
            fail(name, repr(v), "a non-negative int")
    if not h < nheads:
        fail("h", h, f"a head index < nheads={nheads}")
    tiling = None
    if tiled:
        if (M is not None or block_sizes is None) and (not isinstance(M, int) or isinstance(M, bool) or M < 1):
            fail("M", repr(M), "the SRAM size in elements, a positive int (None only with block_sizes)")
        if block_sizes is None:
            Br, Bc = paper_block_sizes(M, d)
        elif (not isinstance(block_sizes, (tuple, list)) or len(block_sizes) != 2
              or not all(isinstance(x, int) and x >= 1 for x in block_sizes)):
            fail("block_sizes", repr(block_sizes), "None or (Br, Bc), two positive ints")
        else:
            Br, Bc = block_sizes
        tiling = Tiling(Br, Bc, N_q, N_k)
        if block_mask is not None:
            if isinstance(block_mask, torch.Tensor):
                if block_mask.device.type == "meta":
                    fail("block_mask", "a meta tensor", "a CPU tensor or nested sequence (it steers control flow)")
                block_mask = block_mask.tolist()
            try:
                shape = (len(block_mask), len(block_mask[0]) if len(block_mask) else 0)
                ragged = any(len(r) != tiling.Tc for r in block_mask)
            except TypeError:
                fail("block_mask", type(block_mask).__name__, f"(Tr, Tc) = ({tiling.Tr}, {tiling.Tc}) bools")
            if shape != (tiling.Tr, tiling.Tc) or ragged:
                fail("block_mask", f"shape {shape}", f"(Tr, Tc) = ({tiling.Tr}, {tiling.Tc}) for N_q={N_q}, "
                     f"N_k={N_k}, Br={Br}, Bc={Bc}")
            tiling = Tiling(Br, Bc, N_q, N_k, tuple(tuple(bool(x) for x in r) for r in block_mask))
    acc = torch.float64 if Q.dtype == torch.float64 else torch.float32
    tau = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    return Head(N_q, N_k, d, Q.dtype, acc, Q.device, tau, bool(causal), key_padding_mask, float(dropout_p),
                seed, offset, b, h, nheads, tiling)


class StandardForward(NamedTuple):
    """O (N_q, d) in the input dtype; P (N_q, N_k) = softmax(MASK(tau Q K^T)) before dropout, as kept in HBM
    for the backward (accumulation dtype)."""

    O: torch.Tensor
    P: torch.Tensor


def standard_forward(Q, K, V, *, hbm: HBM | None = None, **options) -> StandardForward:
    """Standard attention forward, Alg. 0 with MASK and dropout. Q (N_q, d); K, V (N_k, d).

    HBM traffic: reads Q, K (line 1), S (line 2), P, V (line 3): N_q d + 2 N_k d + 2 N_q N_k; writes S, P, O:
    2 N_q N_k + N_q d. For N_q = N_k = N that is 4N^2 + 4Nd = Theta(Nd + N^2) (FA1 paper, appendix C, proof of Theorem 2).
    ``options``: the head options of :func:`validate`.
    """
    head = validate(Q, K, V, where="standard_forward", **options)
    hbm = HBM() if hbm is None else hbm
    hbm.put(Q=Q, K=K, V=V)
    every_row, every_col = slice(0, head.N_q), slice(0, head.N_k)
    # line 1: load Q, K, compute S = tau Q K^T (MASK applied on chip before the write), write S to HBM
    S = head.tau * hbm.load("Q").to(head.acc) @ hbm.load("K").to(head.acc).T
    hbm.store("S", ..., head.MASK(S, every_row, every_col))
    # line 2: read S, compute P = softmax(S) row by row, write P (safe softmax: a row with no visible key gives 0)
    hbm.store("P", ..., safe_softmax(hbm.load("S")))
    # line 3: load P and V, compute O = P_dropped V with P_dropped = P o Z, write O
    P_dropped = hbm.load("P") * head.Z(every_row, every_col)
    hbm.store("O", ..., (P_dropped @ hbm.load("V").to(head.acc)).to(head.dtype))
    return StandardForward(hbm["O"], hbm["P"])


def standard_backward(Q, K, V, O, dO, P, *, hbm: HBM | None = None, **options):
    """Standard attention backward (FA1 paper appendix B.2, Alg. 3) with MASK and dropout. Returns
    (dQ, dK, dV) in the input dtype.

    Q, O, dO (N_q, d); K, V (N_k, d); P (N_q, N_k) from :func:`standard_forward`. The dropout mask Z is
    regenerated from (seed, offset) (a framework would store it: one more N^2 array). With tau the softmax
    scale: dV = P_dropped^T dO, dP = (dO V^T) o Z, dS = P o (dP - D) with D = rowsum(dO o O),
    dQ = tau dS K, dK = tau dS^T Q. HBM traffic: 5 N_q N_k + 5 N_q d + 2 N_k d reads, 2 N_q N_k + N_q d +
    2 N_k d writes = Theta(Nd + N^2) (Theorem 5).
    """
    head = validate(Q, K, V, where="standard_backward", rows={"O": O, "dO": dO}, square={"P": P}, **options)
    hbm = HBM() if hbm is None else hbm
    hbm.put(Q=Q, K=K, V=V, O=O, dO=dO, P=P)
    acc, Z = head.acc, head.Z(slice(0, head.N_q), slice(0, head.N_k))
    # line 1: load P, dO, compute dV = P_dropped^T dO, write dV
    hbm.store("dV", ..., (hbm.load("P") * Z).T @ hbm.load("dO").to(acc))
    # line 2: load dO, V, compute dP = (dO V^T) o Z (the gradient w.r.t. P before dropout), write dP
    hbm.store("dP", ..., (hbm.load("dO").to(acc) @ hbm.load("V").to(acc).T) * Z)
    # line 3: read P, dP (and dO, O for D = rowsum(dO o O), which equals rowsum(P o dP)),
    # compute dS = P o (dP - D), write dS
    D = (hbm.load("dO").to(acc) * hbm.load("O").to(acc)).sum(-1, keepdim=True)
    hbm.store("dS", ..., hbm.load("P") * (hbm.load("dP") - D))
    # line 4: load dS, K, compute dQ = tau dS K, write dQ
    hbm.store("dQ", ..., head.tau * hbm.load("dS") @ hbm.load("K").to(acc))
    # line 5: load dS, Q, compute dK = tau dS^T Q, write dK
    hbm.store("dK", ..., head.tau * hbm.load("dS").T @ hbm.load("Q").to(acc))
    return tuple(hbm[name].to(head.dtype) for name in ("dQ", "dK", "dV"))

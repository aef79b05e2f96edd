"""Softmax three ways, and the merge operator FlashAttention is built on (Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018; "M&G" below).

Each softmax takes x (..., V), any float dtype, and normalises along the last dim. Its memory traffic goes
through an :class:`~flashtile.reference.io_counters.HBM` counter (pass ``hbm=``; x is placed there as array
"x", the output is written as "y"), so the accesses per element M&G count are measured, not asserted:

=========  =====================================  ==========================
function    passes over x                          loads + stores / element
=========  =====================================  ==========================
naive       d = sum e^x ; y = e^x / d              2 + 1 = 3
safe        m = max x ; d = sum e^(x-m) ; y        3 + 1 = 4
online      (m, d) in one pass ; y                 2 + 1 = 3
=========  =====================================  ==========================

The online normaliser's state (m, d) is a monoid under the merge ``⊕`` (M&G §3.1):
[m_a, d_a] ⊕ [m_b, d_b] = [max(m_a, m_b), d_a e^(m_a - max) + d_b e^(m_b - max)], so chunks of x can be
reduced independently and merged in any grouping (``parallel_online_softmax``). FA1's statistic update
(Alg. 2 line 13) is exactly ``merge``; FA1, FA2 and their backwards use ``safe_exp`` and ``diag_inv`` from
here, so the online-softmax update lives in one place.

Convention for attention: a row whose entries are all -inf (no visible key) has m = -inf, d = 0 and
softmax 0, never NaN. ``safe_exp`` and ``diag_inv`` implement it; the naive softmax, which has no max to
subtract, is left as the paper states it (it overflows, which is its point).
"""
from __future__ import annotations

import torch

from .io_counters import HBM

NEG_INF = float("-inf")


# --- the two guarded primitives every tiled algorithm uses ------------------------------------------------
def safe_exp(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """e^(x - m), reading m = -inf as 0: where nothing is visible yet, x is -inf too and the result is 0,
    not e^(-inf + inf) = NaN. x and m broadcast (m is the row max, so x - m <= 0 where m is finite)."""
    return torch.exp(x - torch.where(m == NEG_INF, 0.0, m))


def diag_inv(l: torch.Tensor) -> torch.Tensor:
    """The column of diag(l)^-1 as (..., 1), with 0 where l = 0 (a fully masked row: its numerator is 0)."""
    return torch.where(l == 0, 0.0, 1.0 / torch.where(l == 0, 1.0, l)).unsqueeze(-1)


def merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    """The online-softmax merge ⊕ of partial normalisers (M&G §3.1; FA1 Alg. 2 line 13):
    (m_a, d_a) ⊕ (m_b, d_b) = (m, d_a e^(m_a - m) + d_b e^(m_b - m)) with m = max(m_a, m_b).
    Identity (-inf, 0); associative and commutative."""
    (m_a, d_a), (m_b, d_b) = a, b
    m = torch.maximum(m_a, m_b)
    return m, d_a * safe_exp(m_a, m) + d_b * safe_exp(m_b, m)


# --- the three softmaxes ----------------------------------------------------------------------------------
def _setup(x: torch.Tensor, hbm: HBM | None) -> HBM:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"x: expected a float tensor (..., V) with at least one dim, got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}")
    hbm = HBM() if hbm is None else hbm
    hbm.put(x=x)
    return hbm


def naive_softmax(x: torch.Tensor, hbm: HBM | None = None) -> torch.Tensor:
    """M&G Alg. 1: y = e^x / sum e^x, no max subtracted, so e^x overflows for x >~ 88 (float32) / 709
    (float64). 3 accesses per element."""
    hbm = _setup(x, hbm)
    d = torch.exp(hbm.load("x")).sum(-1, keepdim=True)      # lines 1-4: pass 1, line 3 d_j += e^(x_j)
    hbm.store("y", ..., torch.exp(hbm.load("x")) / d)       # lines 5-7: pass 2, line 6 y_i = e^(x_i) / d_V
    return hbm["y"]


def safe_softmax(x: torch.Tensor, hbm: HBM | None = None) -> torch.Tensor:
    """M&G Alg. 2: subtract m = max x before exponentiating; one more pass. 4 accesses per element."""
    hbm = _setup(x, hbm)
    m = hbm.load("x").amax(-1, keepdim=True)                # lines 1-4: pass 1, line 3 m_k = max(m_{k-1}, x_k)
    d = safe_exp(hbm.load("x"), m).sum(-1, keepdim=True)    # lines 5-8: pass 2, line 7 d_j += e^(x_j - m_V)
    hbm.store("y", ..., safe_exp(hbm.load("x"), m) * diag_inv(d.squeeze(-1)))  # lines 9-11: pass 3
    return hbm["y"]


def online_normalizer(x: torch.Tensor, hbm: HBM | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """M&G Alg. 3 lines 1-6: the running max m_j and the normaliser d_j in ONE pass over x, rescaling d by
    e^(m_{j-1} - m_j) whenever the max grows. Returns (m, d), each (...,). 1 load per element."""
    hbm = _setup(x, hbm)
    m = torch.full(x.shape[:-1], NEG_INF, dtype=x.dtype, device=x.device)  # line 1: m_0 = -inf
    d = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)          # line 2: d_0 = 0
    for j in range(x.shape[-1]):                            # line 3
        x_j = hbm.load("x", (..., j))
        m_j = torch.maximum(m, x_j)                         # line 4
        d = d * safe_exp(m, m_j) + safe_exp(x_j, m_j)       # line 5: rescale d when the max grows
        m = m_j
    return m, d


def online_softmax(x: torch.Tensor, hbm: HBM | None = None) -> torch.Tensor:
    """M&G Alg. 3: online normaliser, then y_i = e^(x_i - m_V) / d_V. 3 accesses per element."""
    hbm = _setup(x, hbm)
    m, d = online_normalizer(x, hbm)                        # lines 1-6: pass 1
    hbm.store("y", ..., safe_exp(hbm.load("x"), m.unsqueeze(-1)) * diag_inv(d))  # lines 7-9: pass 2 (line 8)
    return hbm["y"]


def parallel_online_softmax(x: torch.Tensor, chunks: int, hbm: HBM | None = None) -> torch.Tensor:
    """M&G §3.1: split x's last dim into ``chunks`` pieces, compute each piece's (m, d) independently
    (as parallel threads would), reduce them with ⊕ as a balanced tree, then normalise. 3 accesses per
    element, like ``online_softmax``; the result is the same for any ``chunks`` >= 1."""
    hbm = _setup(x, hbm)
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}: expected a positive int")
    V = x.shape[-1]
    bounds = [(V * c // chunks, V * (c + 1) // chunks) for c in range(chunks)]
    partial = []
    for lo, hi in bounds:  # pass 1, one independent reduction per chunk
        x_c = hbm.load("x", (..., slice(lo, hi)))
        m_c = x_c.amax(-1) if hi > lo else torch.full(x.shape[:-1], NEG_INF, dtype=x.dtype, device=x.device)
        partial.append((m_c, safe_exp(x_c, m_c.unsqueeze(-1)).sum(-1)))
    while len(partial) > 1:  # tree reduction with ⊕: the grouping does not matter (associativity)
        partial = [merge(partial[k], partial[k + 1]) if k + 1 < len(partial) else partial[k]
                   for k in range(0, len(partial), 2)]
    m, d = partial[0]
    hbm.store("y", ..., safe_exp(hbm.load("x"), m.unsqueeze(-1)) * diag_inv(d))  # pass 2
    return hbm["y"]

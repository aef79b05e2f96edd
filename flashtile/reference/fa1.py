"""FlashAttention-1, forward and backward, as in the paper's appendix B (Dao et al., "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", 2022: Algorithms 2 and 4, which add MASK and dropout to
Algorithm 1).

Read it beside the paper: "Alg. 2 line 10" is the paper's numbering.
Blocks are 0-based here (the paper counts from 1); block i covers rows ``tiling.rows(i)``.

The forward's outer loop runs over K/V blocks j and its inner loop over Q blocks i, so O, l and m travel
between HBM and SRAM once per (i, j): Theta(N_q d Tc) = Theta(N^2 d^2 / M) accesses (Theorem 2). The
backward recomputes P_ij from (m, l) instead of reading an N x N matrix (Theorem 5).

Block-sparse FlashAttention (Alg. 5) is this code with a block mask: a zero block (i, j) is skipped before
anything of it is loaded. ``blocksparse.py`` is its documented entry point.

Shapes (one head): Q, O, dO (N_q, d); K, V (N_k, d); l, m (N_q,). HBM traffic goes through ``hbm``
(io_counters.HBM), on-chip tiles through an io_counters.SRAM of M elements (2M for the backward, see io_counters).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .io_counters import BACKWARD_SRAM_FACTOR, HBM, SRAM
from .softmax import NEG_INF, diag_inv, merge, safe_exp
from .standard import validate


class FA1Forward(NamedTuple):
    """O (N_q, d) in the input dtype; l, m (N_q,) the softmax statistics (accumulation dtype: float32, or
    float64 for float64 inputs); R = (seed, offset), the RNG state the backward replays; Br, Bc the block
    sizes used."""

    O: torch.Tensor
    l: torch.Tensor
    m: torch.Tensor
    R: tuple[int, int]
    Br: int
    Bc: int


def logsumexp(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """L = m + log l (what FA2 stores instead of m and l); -inf for a row with no visible key (l = 0)."""
    return m + torch.log(l)


def fa1_forward(Q, K, V, *, M: int | None = None, block_mask=None, block_sizes=None,
                hbm: HBM | None = None, **options) -> FA1Forward:
    """FA1 forward pass (Alg. 2; Alg. 5 when ``block_mask`` is given).

    Q (N_q, d); K, V (N_k, d); M the SRAM size in elements (block sizes Bc = ceil(M/4d), Br = min(Bc, d),
    unless ``block_sizes=(Br, Bc)`` overrides them; M may then be None: SRAM unchecked); block_mask
    (Tr, Tc) bools or None (dense); ``options``: the head options of ``standard.validate``
    (softmax_scale, causal, key_padding_mask, dropout_p, seed, offset, b, h, nheads).
    Returns :class:`FA1Forward`.
    """
    head = validate(Q, K, V, where="fa1_forward", M=M, block_sizes=block_sizes, block_mask=block_mask,
                    tiled=True, **options)
    t, acc, dev = head.tiling, head.acc, head.device
    hbm = HBM() if hbm is None else hbm
    sram = SRAM(M, what=f"fa1_forward (Alg. 2, d={head.d}, Br={t.Br}, Bc={t.Bc})")
    # line 1: the RNG state R. The counter-based Philox of rng.py needs only (seed, offset): nothing to
    # initialise, two integers to keep (not counted as traffic).
    R = (head.seed, head.offset)
    # line 2: Br, Bc were set by validate (io_counters.block_sizes)
    hbm.put(Q=Q, K=K, V=V)
    # line 3: O = (0), l = (0), m = (-inf) in HBM
    hbm.alloc("O", (head.N_q, head.d), 0.0, acc, dev)
    hbm.alloc("l", (head.N_q,), 0.0, acc, dev)
    hbm.alloc("m", (head.N_q,), NEG_INF, acc, dev)
    # lines 4-5: the blocks Q_i, O_i, l_i, m_i are rows t.rows(i); K_j, V_j are rows t.cols(j)
    for j in range(t.Tc):                                                    # line 6
        cols = t.cols(j)
        with sram.scope():
            K_j = sram.load("K_j", hbm, "K", cols, acc)                      # line 7
            V_j = sram.load("V_j", hbm, "V", cols, acc)
            for i in range(t.Tr):                                            # line 8
                if not t.nonzero(i, j):  # Alg. 5 line 8: a zero block is skipped, so it costs no HBM traffic
                    continue
                rows = t.rows(i)
                with sram.scope():
                    Q_i = sram.load("Q_i", hbm, "Q", rows, acc)              # line 9
                    O_i = sram.load("O_i", hbm, "O", rows, acc)
                    l_i, m_i = hbm.load("l", rows), hbm.load("m", rows)
                    S_ij = head.tau * Q_i @ K_j.T                            # line 10
                    S_ij_masked = head.MASK(S_ij, rows, cols)                # line 11
                    m_tilde_ij = S_ij_masked.amax(-1)                        # line 12
                    P_tilde_ij = safe_exp(S_ij_masked, m_tilde_ij.unsqueeze(-1))
                    l_tilde_ij = P_tilde_ij.sum(-1)
                    m_new_i, l_new_i = merge((m_i, l_i), (m_tilde_ij, l_tilde_ij))  # line 13
                    # line 14: dropout after l_tilde was summed: the softmax normalises the undropped P
                    P_tilde_ij_dropped = P_tilde_ij * head.Z(rows, cols)
                    # line 15: O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i
                    #                                  + e^(m~_ij - m_new) P~_ij_dropped V_j)
                    O_i = diag_inv(l_new_i) * ((l_i * safe_exp(m_i, m_new_i)).unsqueeze(-1) * O_i
                                               + safe_exp(m_tilde_ij, m_new_i).unsqueeze(-1)
                                               * (P_tilde_ij_dropped @ V_j))
                    hbm.store("O", rows, sram.hold("O_i", O_i))
                    hbm.store("l", rows, l_new_i)                            # line 16
                    hbm.store("m", rows, m_new_i)
    return FA1Forward(hbm["O"].to(head.dtype), hbm["l"], hbm["m"], R, t.Br, t.Bc)  # line 19


def load_kv_zero_grads(sram: SRAM, hbm: HBM, cols: slice, acc: torch.dtype, dk_name: str, dv_name: str):
    """The backward's outer-loop step shared by FA1 (Alg. 4 lines 7-8) and FA2 (Alg. 2 lines 6-7): load K_j, V_j
    from HBM to SRAM and hold their gradient accumulators, zero, in SRAM. Returns (K_j, V_j, dK_j, dV_j)."""
    K_j = sram.load("K_j", hbm, "K", cols, acc)
    V_j = sram.load("V_j", hbm, "V", cols, acc)
    return K_j, V_j, sram.hold(dk_name, torch.zeros_like(K_j)), sram.hold(dv_name, torch.zeros_like(V_j))


def fa1_backward(Q, K, V, O, dO, l, m, R, *, M: int | None = None, block_mask=None, block_sizes=None,
                 hbm: HBM | None = None, **options):
    """FA1 backward pass (Alg. 4; skipping zero blocks when ``block_mask`` is given). Returns (dQ, dK, dV)
    in the input dtype.

    Q, O, dO (N_q, d); K, V (N_k, d); l, m (N_q,) and R = (seed, offset) from :func:`fa1_forward`; M,
    block_mask, block_sizes as in the forward (they must match it); ``options`` the forward's head options
    other than seed and offset, which R replaces.
    """
    head = validate(Q, K, V, where="fa1_backward", rows={"O": O, "dO": dO, "l": l, "m": m}, M=M,
                    block_sizes=block_sizes, block_mask=block_mask, tiled=True, R=R, **options)
    t, acc, dev = head.tiling, head.acc, head.device
    hbm = HBM() if hbm is None else hbm
    sram = SRAM(M, what=f"fa1_backward (Alg. 4, d={head.d}, Br={t.Br}, Bc={t.Bc})", budget=BACKWARD_SRAM_FACTOR)
    # line 1: the RNG state is R: head.Z draws Z_ij from (seed, offset) = R, the forward's mask exactly
    # line 2: Br, Bc as in the forward (validate)
    hbm.put(Q=Q, K=K, V=V, O=O, dO=dO, l=l, m=m)
    # lines 3-4: blocks as in the forward; line 5: dQ = (0), dK = (0), dV = (0) in HBM
    hbm.alloc("dQ", (head.N_q, head.d), 0.0, acc, dev)
    hbm.alloc("dK", (head.N_k, head.d), 0.0, acc, dev)
    hbm.alloc("dV", (head.N_k, head.d), 0.0, acc, dev)
    for j in range(t.Tc):                                                    # line 6
        cols = t.cols(j)
        with sram.scope():
            # line 7: K_j, V_j to SRAM; line 8: dK~_j = (0), dV~_j = (0) in SRAM
            K_j, V_j, dK_tilde_j, dV_tilde_j = load_kv_zero_grads(sram, hbm, cols, acc, "dK~_j", "dV~_j")
            for i in range(t.Tr):                                            # line 9
                if not t.nonzero(i, j):  # Alg. 5: zero blocks are skipped in the backward too
                    continue
                rows = t.rows(i)
                with sram.scope():
                    Q_i = sram.load("Q_i", hbm, "Q", rows, acc)              # line 10
                    O_i = sram.load("O_i", hbm, "O", rows, acc)
                    dO_i = sram.load("dO_i", hbm, "dO", rows, acc)
                    dQ_i = sram.load("dQ_i", hbm, "dQ", rows, acc)
                    l_i, m_i = hbm.load("l", rows).to(acc), hbm.load("m", rows).to(acc)
                    S_ij = head.tau * Q_i @ K_j.T                            # line 11
                    S_ij_masked = head.MASK(S_ij, rows, cols)                # line 12
                    P_ij = diag_inv(l_i) * safe_exp(S_ij_masked, m_i.unsqueeze(-1))  # line 13: recomputed P
                    Z_ij = head.Z(rows, cols)                                # line 14
                    P_ij_dropped = P_ij * Z_ij                               # line 15
                    dV_tilde_j = sram.hold("dV~_j", dV_tilde_j + P_ij_dropped.T @ dO_i)  # line 16
                    dP_ij_dropped = dO_i @ V_j.T                             # line 17
                    dP_ij = dP_ij_dropped * Z_ij                             # line 18
                    D_i = (dO_i * O_i).sum(-1)                               # line 19: rowsum(dO_i o O_i)
                    dS_ij = P_ij * (dP_ij - D_i.unsqueeze(-1))               # line 20
                    hbm.store("dQ", rows, dQ_i + head.tau * dS_ij @ K_j)     # line 21
                    dK_tilde_j = sram.hold("dK~_j", dK_tilde_j + head.tau * dS_ij.T @ Q_i)  # line 22
            hbm.store("dK", cols, dK_tilde_j)                                # line 24
            hbm.store("dV", cols, dV_tilde_j)
    return tuple(hbm[name].to(head.dtype) for name in ("dQ", "dK", "dV"))    # line 26

"""FlashAttention-2, forward and backward (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and
Work Partitioning", 2023: Algorithms 1 and 2), with the softmax scale tau, MASK and dropout of FA1's Algorithms 2
and 4 added.

Read it beside the paper: "Alg. 1 line 10" is the FA2 paper's numbering.

What changes from FA1 (fa1.py):
  * forward loops: Q blocks i outer, K/V blocks j inner, so O_i, l_i, m_i stay on chip for the whole row of
    blocks and are written once (O: N_q d writes instead of N_q d Tc);
  * O_i is kept un-scaled (O~) and multiplied by diag(l)^-1 once, after the last block (line 12);
  * only the log-sum-exp L = m + log l is stored for the backward (line 13);
  * backward: D = rowsum(dO o O) is computed once up front (line 4), so O is not re-read per block;
  * causal masking skips the blocks that lie entirely above the (bottom-right) diagonal, forward and
    backward (FA2 paper §3.1.1): no compute and no HBM traffic for them.

Shapes (one head): Q, O, dO (N_q, d); K, V (N_k, d); L (N_q,). Block sizes: FA1's rule from M (io_counters).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .fa1 import load_kv_zero_grads, logsumexp
from .io_counters import BACKWARD_SRAM_FACTOR, HBM, SRAM
from .softmax import NEG_INF, diag_inv, safe_exp
from .standard import validate


class FA2Forward(NamedTuple):
    """O (N_q, d) in the input dtype; L (N_q,) log-sum-exp of the masked scaled scores (accumulation dtype,
    -inf for a row with no visible key); Br, Bc the block sizes used."""

    O: torch.Tensor
    L: torch.Tensor
    Br: int
    Bc: int


def fa2_forward(Q, K, V, *, M: int | None = None, block_sizes=None, hbm: HBM | None = None,
                **options) -> FA2Forward:
    """FA2 forward pass (Alg. 1) with tau, MASK and dropout.

    Q (N_q, d); K, V (N_k, d); M the SRAM size in elements, or ``block_sizes=(Br, Bc)`` (then M may be None:
    SRAM unchecked); ``options``: the
    head options of ``standard.validate``. Returns :class:`FA2Forward`.
    """
    head = validate(Q, K, V, where="fa2_forward", M=M, block_sizes=block_sizes, tiled=True, **options)
    t, acc, dev = head.tiling, head.acc, head.device
    hbm = HBM() if hbm is None else hbm
    sram = SRAM(M, what=f"fa2_forward (Alg. 1, d={head.d}, Br={t.Br}, Bc={t.Bc})")
    hbm.put(Q=Q, K=K, V=V)
    # lines 1-2: blocks as in FA1; O and L are only divided into blocks (each block is written once)
    hbm.empty("O", (head.N_q, head.d), head.dtype, dev)
    hbm.empty("L", (head.N_q,), acc, dev)
    for i in range(t.Tr):                                                    # line 3
        rows = t.rows(i)
        with sram.scope():
            Q_i = sram.load("Q_i", hbm, "Q", rows, acc)                      # line 4
            n_i = rows.stop - rows.start
            O_i = sram.hold("O~_i", torch.zeros(n_i, head.d, dtype=acc, device=dev))  # line 5: O_i^(0) = 0
            l_i = torch.zeros(n_i, dtype=acc, device=dev)                    #   l_i^(0) = 0
            m_i = torch.full((n_i,), NEG_INF, dtype=acc, device=dev)         #   m_i^(0) = -inf
            for j in range(t.Tc):                                            # line 6
                cols = t.cols(j)
                if head.block_is_masked(rows, cols):  # §3.1.1: fully causal-masked block, skipped
                    continue
                with sram.scope():
                    K_j = sram.load("K_j", hbm, "K", cols, acc)              # line 7
                    V_j = sram.load("V_j", hbm, "V", cols, acc)
                    S_ij = head.MASK(head.tau * Q_i @ K_j.T, rows, cols)     # line 8: S_i^(j), masked
                    m_new_i = torch.maximum(m_i, S_ij.amax(-1))              # line 9: m_i^(j)
                    P_tilde_ij = safe_exp(S_ij, m_new_i.unsqueeze(-1))       #   P~_i^(j) = exp(S - m_i^(j))
                    alpha_i = safe_exp(m_i, m_new_i)                         #   e^(m_i^(j-1) - m_i^(j))
                    l_i = alpha_i * l_i + P_tilde_ij.sum(-1)                 #   l_i^(j)
                    # line 10: O~_i^(j) = diag(e^(m^(j-1) - m^(j))) O~_i^(j-1) + P~_dropped V_j, not yet / l
                    O_i = sram.hold("O~_i", alpha_i.unsqueeze(-1) * O_i
                                    + (P_tilde_ij * head.Z(rows, cols)) @ V_j)
                    m_i = m_new_i
            O_i = diag_inv(l_i) * O_i                                        # line 12: the one rescale
            L_i = logsumexp(m_i, l_i)                                        # line 13: L_i = m_i + log l_i
            hbm.store("O", rows, O_i)                                        # line 14
            hbm.store("L", rows, L_i)                                        # line 15
    return FA2Forward(hbm["O"], hbm["L"], t.Br, t.Bc)                        # line 17


def fa2_backward(Q, K, V, O, dO, L, *, M: int | None = None, block_sizes=None, hbm: HBM | None = None,
                 **options):
    """FA2 backward pass (Alg. 2) with tau, MASK and dropout. Returns (dQ, dK, dV) in the input dtype.

    Q, O, dO (N_q, d); K, V (N_k, d); L (N_q,) from :func:`fa2_forward`; M / block_sizes and ``options``
    (including seed and offset, which regenerate the forward's dropout mask) as in the forward.
    """
    head = validate(Q, K, V, where="fa2_backward", rows={"O": O, "dO": dO, "L": L}, M=M,
                    block_sizes=block_sizes, tiled=True, **options)
    t, acc, dev = head.tiling, head.acc, head.device
    hbm = HBM() if hbm is None else hbm
    sram = SRAM(M, what=f"fa2_backward (Alg. 2, d={head.d}, Br={t.Br}, Bc={t.Bc})", budget=BACKWARD_SRAM_FACTOR)
    hbm.put(Q=Q, K=K, V=V, O=O, dO=dO, L=L)
    # lines 1-2: blocks as in the forward. line 3: dQ = (0) in HBM; dK, dV are only divided into blocks
    hbm.alloc("dQ", (head.N_q, head.d), 0.0, acc, dev)
    hbm.empty("dK", (head.N_k, head.d), acc, dev)
    hbm.empty("dV", (head.N_k, head.d), acc, dev)
    # line 4: D = rowsum(dO o O), written to HBM (one pass over dO and O instead of one per K/V block)
    hbm.store("D", ..., (hbm.load("dO").to(acc) * hbm.load("O").to(acc)).sum(-1))
    for j in range(t.Tc):                                                    # line 5
        cols = t.cols(j)
        with sram.scope():
            # line 6: K_j, V_j to SRAM; line 7: dK_j = (0), dV_j = (0) in SRAM
            K_j, V_j, dK_j, dV_j = load_kv_zero_grads(sram, hbm, cols, acc, "dK_j", "dV_j")
            for i in range(t.Tr):                                            # line 8
                rows = t.rows(i)
                if head.block_is_masked(rows, cols):  # §3.1.1, as in the forward
                    continue
                with sram.scope():
                    # line 9 lists Q_i, O_i, dO_i, dQ_i, L_i, D_i; O_i's only use was D (line 4) and dQ_i is
                    # loaded where it is updated (line 15), so neither is loaded here.
                    Q_i = sram.load("Q_i", hbm, "Q", rows, acc)
                    dO_i = sram.load("dO_i", hbm, "dO", rows, acc)
                    L_i, D_i = hbm.load("L", rows).to(acc), hbm.load("D", rows)
                    S_ij = head.MASK(head.tau * Q_i @ K_j.T, rows, cols)     # line 10: S_i^(j), masked
                    P_ij = safe_exp(S_ij, L_i.unsqueeze(-1))                 # line 11: exp(S - L_i)
                    Z_ij = head.Z(rows, cols)
                    dV_j = sram.hold("dV_j", dV_j + (P_ij * Z_ij).T @ dO_i)  # line 12 (P dropped)
                    dP_ij = (dO_i @ V_j.T) * Z_ij                            # line 13 (gradient w.r.t. P)
                    dS_ij = P_ij * (dP_ij - D_i.unsqueeze(-1))               # line 14
                    dQ_i = sram.load("dQ_i", hbm, "dQ", rows, acc)           # line 15: load, update, write
                    hbm.store("dQ", rows, dQ_i + head.tau * dS_ij @ K_j)
                    dK_j = sram.hold("dK_j", dK_j + head.tau * dS_ij.T @ Q_i)  # line 16
            hbm.store("dK", cols, dK_j)                                      # line 18
            hbm.store("dV", cols, dV_j)
    return tuple(hbm[name].to(head.dtype) for name in ("dQ", "dK", "dV"))    # line 20

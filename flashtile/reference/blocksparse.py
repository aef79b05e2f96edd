"""Block-sparse FlashAttention (FA1 paper, Dao et al. 2022, §3.3: Algorithm 5 and Theorem 4).

Given a block mask M in {0, 1}^(Tr x Tc) over the (Br, Bc) tiling of the score matrix, block-sparse
attention is standard attention with the expanded mask M~ (N_q x N_k, M~_kl = M_(k // Br, l // Bc)):
P = softmax(S o 1_M~), scores in zero blocks set to -inf. Alg. 5 is Alg. 2 with one change, line 8
"if M_ij != 0": a zero block is skipped before Q_i, O_i, l_i, m_i are loaded, so its HBM traffic vanishes and
the IO complexity becomes Theta(Nd + N^2 d^2 s / M) for a fraction s of non-zero blocks (Theorem 4). K_j, V_j
are still loaded once per column (Alg. 5 line 6), even when the whole column is zero.

This module is the documented entry point; the algorithm itself is ``fa1.fa1_forward`` /
``fa1.fa1_backward`` with a ``block_mask`` (one code path, so block-sparse and dense FA1 cannot drift).
The block mask is a Python structure (nested sequence of bools, or a CPU tensor): it steers control flow.
"""
from __future__ import annotations

import torch

from .fa1 import FA1Forward, fa1_backward, fa1_forward
from .io_counters import HBM, Tiling, block_sizes as paper_block_sizes, random_block_mask

__all__ = ["blocksparse_forward", "blocksparse_backward", "expand_block_mask", "random_block_mask",
           "paper_block_sizes"]


def blocksparse_forward(Q, K, V, block_mask, *, M: int | None = None, block_sizes=None,
                        hbm: HBM | None = None, **options) -> FA1Forward:
    """Alg. 5: FA1's forward skipping the zero blocks of ``block_mask`` (shape (Tr, Tc) with
    Tr = ceil(N_q / Br), Tc = ceil(N_k / Bc); Br, Bc from ``io_counters.block_sizes(M, d)`` unless
    ``block_sizes`` overrides them). Q (N_q, d); K, V (N_k, d); ``options`` as for ``fa1_forward``.
    A query row none of whose blocks is non-zero outputs 0 (l = 0, m = -inf)."""
    return fa1_forward(Q, K, V, M=M, block_mask=block_mask, block_sizes=block_sizes, hbm=hbm, **options)


def blocksparse_backward(Q, K, V, O, dO, l, m, R, block_mask, *, M: int | None = None, block_sizes=None,
                         hbm: HBM | None = None, **options):
    """Backward of Alg. 5: FA1's Alg. 4 skipping the zero blocks, which contribute nothing to dQ, dK, dV.
    Arguments as ``fa1_backward`` plus the forward's ``block_mask``. Returns (dQ, dK, dV)."""
    return fa1_backward(Q, K, V, O, dO, l, m, R, M=M, block_mask=block_mask, block_sizes=block_sizes,
                        hbm=hbm, **options)


def expand_block_mask(block_mask, Br: int, Bc: int, N_q: int, N_k: int) -> torch.Tensor:
    """M~: the (N_q, N_k) bool mask that block-sparse attention applies, M~_kl = block_mask[k // Br][l // Bc]
    (True = may attend). For comparing with dense attention (``dense.attention_ref(attn_mask=...)``)."""
    t = Tiling(Br, Bc, N_q, N_k)
    bm = torch.as_tensor(block_mask, dtype=torch.bool).reshape(t.Tr, t.Tc)
    return bm.repeat_interleave(Br, 0)[:N_q].repeat_interleave(Bc, 1)[:, :N_k]

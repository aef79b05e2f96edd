"""Counter-based dropout RNG shared by every algorithm (reference and Triton kernels).

The keep/drop decision for score entry (batch b, head h, row i, col j) is a pure function of
(seed, offset, b, h, i, j): Philox4x32-10 on the 64-bit counter

    c = offset + ((b * nheads + h) * seqlen_q + i) * seqlen_k + j

exactly as Triton's ``tl.rand(seed, c)`` computes it. Because nothing is stored, the standard, FA1 and FA2
reference algorithms, forward and backward, and the GPU kernels all draw the same mask Z (FA1's "RNG state
R" is just (seed, offset)). An entry is kept iff u >= dropout_p, with u uniform in [0, 1).
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul_hi_lo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of the 64-bit product a*b of uint32 values held in int64 (no overflow)."""
    b1, b0 = b >> 16, b & 0xFFFF
    p1, p0 = a * b1, a * b0  # each < 2**48
    hi = (p1 + (p0 >> 16)) >> 16
    lo = (((p1 & 0xFFFF) << 16) + p0) & _M32
    return hi, lo


def philox_uint32(seed: int, counter: torch.Tensor, n_rounds: int = 10) -> torch.Tensor:
    """First 32-bit output of Philox4x32 for the 64-bit counters (as int64 values >= 0), like tl.randint."""
    counter = counter.to(torch.int64)
    c0 = counter & _M32
    c1 = (counter >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(n_rounds):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0


def uniform(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), bit-identical to ``tl.rand(seed, counter)``."""
    x = philox_uint32(seed, counter)
    x = torch.where(x >= 2**31, x - 2**32, x)  # reinterpret as int32
    x = torch.where(x < 0, -x - 1, x)          # ~x for negatives
    return x.to(torch.float32) * 4.6566127342e-10


def dropout_counter(offset: int, b, h, i, j, nheads: int, seqlen_q: int, seqlen_k: int):
    """The Philox counter of score entry (b, h, i, j); arguments broadcast."""
    return offset + ((b * nheads + h) * seqlen_q + i) * seqlen_k + j


def dropout_keep_mask(seed: int, offset: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float, device=None) -> torch.Tensor:
    """Bool (batch, nheads, seqlen_q, seqlen_k): True where the entry is kept (u >= dropout_p)."""
    ar = lambda n: torch.arange(n, dtype=torch.int64, device=device)  # noqa: E731
    c = dropout_counter(offset, ar(batch).view(-1, 1, 1, 1), ar(nheads).view(1, -1, 1, 1),
                        ar(seqlen_q).view(1, 1, -1, 1), ar(seqlen_k).view(1, 1, 1, -1),
                        nheads, seqlen_q, seqlen_k)
    return uniform(seed, c) >= dropout_p


def block_keep_mask(seed: int, offset: int, b: int, h: int, rows: torch.Tensor, cols: torch.Tensor,
                    nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float) -> torch.Tensor:
    """Keep mask of one (rows x cols) tile of head (b, h): what a tiled algorithm draws for block (i, j)."""
    c = dropout_counter(offset, b, h, rows.view(-1, 1).to(torch.int64), cols.view(1, -1).to(torch.int64),
                        nheads, seqlen_q, seqlen_k)
    return uniform(seed, c) >= dropout_p

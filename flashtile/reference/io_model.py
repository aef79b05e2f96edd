"""The HBM-IO experiment: runs a reference algorithm (standard.py, fa1.py, fa2.py, blocksparse.py) on one head and
reports the element reads and writes its HBM counter saw (io_counters.py: HBM, SRAM, the paper's block sizes).
``count_hbm_accesses`` is what ``flashtile io`` (io_report.py) fits against FA1's Theorems 2, 4 and 5.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import blocksparse, fa1, fa2, standard
# the counters' names stay importable from here as well (io_counters.py defines them)
from .io_counters import (BACKWARD_SRAM_FACTOR, HBM, SRAM, SRAMOverflowError, Tiling, block_sizes,  # noqa: F401
                          random_block_mask)


# --- running an algorithm by name ------------------------------------------------------------------------
ALGORITHMS = ("standard", "fa1", "fa2", "blocksparse")


@dataclass
class Run:
    """One head's forward and (optionally) backward through a reference algorithm.

    O (N_q, d) in the input dtype; lse (N_q,) natural-log sum-exp of the masked scaled scores (-inf for a row
    with no visible key; None for standard attention, which does not keep it); dQ, dK, dV (None without
    dO); Br, Bc the block sizes (None for standard attention); hbm_fwd / hbm_bwd the counters used.
    """

    O: torch.Tensor
    lse: torch.Tensor | None
    dQ: torch.Tensor | None
    dK: torch.Tensor | None
    dV: torch.Tensor | None
    Br: int | None
    Bc: int | None
    hbm_fwd: HBM
    hbm_bwd: HBM | None


def run(algorithm: str, Q, K, V, dO=None, *, M: int | None = None, block_mask=None, block_sizes=None,
        hbm_fwd: HBM | None = None, hbm_bwd: HBM | None = None, **options) -> Run:
    """Forward, then backward when ``dO`` is given, of one head through ``algorithm`` in ALGORITHMS.

    Q (N_q, d), K and V (N_k, d), dO (N_q, d), any float dtype. ``options`` are the head options of
    ``standard.validate`` (softmax_scale, causal, key_padding_mask, dropout_p, seed, offset, b, h, nheads).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {ALGORITHMS}")
    hbm_fwd = HBM() if hbm_fwd is None else hbm_fwd
    if dO is not None and hbm_bwd is None:
        hbm_bwd = HBM()
    tiles = dict(M=M, block_sizes=block_sizes)
    dQ = dK = dV = None
    if algorithm == "standard":
        fwd = standard.standard_forward(Q, K, V, hbm=hbm_fwd, **options)
        lse, Br, Bc = None, None, None
        if dO is not None:
            dQ, dK, dV = standard.standard_backward(Q, K, V, fwd.O, dO, fwd.P, hbm=hbm_bwd, **options)
    elif algorithm == "fa2":
        if block_mask is not None:
            raise ValueError("block_mask: only the 'blocksparse' (and 'fa1') algorithms take a block mask")
        fwd = fa2.fa2_forward(Q, K, V, hbm=hbm_fwd, **tiles, **options)
        lse, Br, Bc = fwd.L, fwd.Br, fwd.Bc
        if dO is not None:
            dQ, dK, dV = fa2.fa2_backward(Q, K, V, fwd.O, dO, fwd.L, hbm=hbm_bwd, **tiles, **options)
    else:  # fa1 and its block-sparse entry point share one code path
        forward, backward = ((blocksparse.blocksparse_forward, blocksparse.blocksparse_backward)
                             if algorithm == "blocksparse" else (fa1.fa1_forward, fa1.fa1_backward))
        seed, offset = options.pop("seed", 0), options.pop("offset", 0)
        fwd = forward(Q, K, V, block_mask=block_mask, hbm=hbm_fwd, seed=seed, offset=offset, **tiles, **options)
        lse, Br, Bc = fa1.logsumexp(fwd.m, fwd.l), fwd.Br, fwd.Bc
        if dO is not None:
            dQ, dK, dV = backward(Q, K, V, fwd.O, dO, fwd.l, fwd.m, fwd.R, block_mask=block_mask, hbm=hbm_bwd,
                                  **tiles, **options)
    return Run(fwd.O, lse, dQ, dK, dV, Br, Bc, hbm_fwd, hbm_bwd)


def count_hbm_accesses(algorithm: str, N: int, d: int, M: int, pass_: str = "fwd", causal: bool = False,
                       block_density: float | None = None, seed: int = 0, *, N_k: int | None = None,
                       device: str | None = None) -> dict:
    """HBM element reads and writes of one head of ``algorithm`` ("standard", "fa1", "fa2", "blocksparse"),
    counted by running it on (N, d) inputs with SRAM size ``M`` elements.

    pass_ "fwd" counts the forward; "bwd" counts the backward only (the forward it needs runs uncounted).
    block_density (blocksparse only; default 1.0) picks round(density * Tr * Tc) non-zero blocks at random
    with ``seed``. N_k (default N) sets seqlen_k. The inputs are zeros: the counts depend on shapes and
    masks only. ``device`` None picks "meta" for standard attention (a few whole-matrix ops: no N x N memory,
    instant at any N) and "cpu" for the tiled algorithms (thousands of small-tile ops, which torch 2.13 runs
    ~50x slower on meta than on CPU); either device gives the same counts.

    Returns dict(reads, writes, total, Br, Bc, Tr, Tc, nnz_blocks, per_array, seconds); Br, Bc, Tr, Tc are
    None for standard attention.
    """
    if pass_ not in ("fwd", "bwd"):
        raise ValueError(f"pass_={pass_!r}: expected 'fwd' or 'bwd'")
    if block_density is not None and algorithm != "blocksparse":
        raise ValueError(f"block_density={block_density!r}: only algorithm='blocksparse' takes a block density")
    N_k = N if N_k is None else N_k
    if device is None:
        device = "meta" if algorithm == "standard" else "cpu"
    t0 = time.perf_counter()
    Q = torch.zeros(N, d, device=device)
    K, V = torch.zeros(N_k, d, device=device), torch.zeros(N_k, d, device=device)
    dO = torch.zeros(N, d, device=device) if pass_ == "bwd" else None
    block_mask = None
    if algorithm == "blocksparse":
        if not isinstance(M, int) or M < 1 or not isinstance(d, int) or d < 1:
            raise ValueError(f"M={M!r}, d={d!r}: expected positive ints")
        t = Tiling(*block_sizes(M, d), N, N_k)
        block_mask = random_block_mask(t.Tr, t.Tc, 1.0 if block_density is None else block_density, seed)
    hbm = HBM()
    with _one_thread():  # tiles are small: intra-op threading only adds overhead
        r = run(algorithm, Q, K, V, dO, M=M, block_mask=block_mask, causal=causal,
                **({"hbm_fwd": hbm} if pass_ == "fwd" else {"hbm_bwd": hbm}))
    tiling = None if r.Br is None else Tiling(r.Br, r.Bc, N, N_k, None if block_mask is None
                                              else tuple(map(tuple, block_mask)))
    return dict(reads=hbm.reads, writes=hbm.writes, total=hbm.total, Br=r.Br, Bc=r.Bc,
                Tr=None if tiling is None else tiling.Tr, Tc=None if tiling is None else tiling.Tc,
                nnz_blocks=None if tiling is None else tiling.nnz, per_array=hbm.per_array,
                seconds=time.perf_counter() - t0)


@contextmanager
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)

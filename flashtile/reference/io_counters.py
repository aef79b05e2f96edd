"""HBM-IO accounting: the two memories of the FlashAttention papers, as objects the algorithms go through.
The experiment that runs the algorithms through them and counts is io_model.py.

Every reference algorithm (standard.py, fa1.py, fa2.py, blocksparse.py) touches "HBM" only through an
:class:`HBM` object and keeps its on-chip tiles in an :class:`SRAM` object, so the element reads and writes
counted here are those the algorithm actually executes, not a closed-form formula (the FA1 paper's proofs of
Theorems 2 and 5, appendix C, give the formulas; the tests check the counts against them).

What is counted
  * ``HBM.load`` / ``HBM.store`` count ``numel`` of the tile moved; ``HBM.alloc`` with a fill value counts
    the initialisation as writes ("Initialize O = (0) in HBM", Alg. 2 line 3). Inputs put in HBM with
    ``HBM.put`` and results read back with ``hbm[name]`` are free: they exist before / after the algorithm.
  * Element counts, not bytes: multiply by the element size for bytes.

What SRAM holds (the capacity M, in elements)
  The paper sizes its blocks from M (Alg. 2 line 2: Bc = ceil(M/4d), Br = min(ceil(M/4d), d)); the 4 budgets
  the four d-wide tiles the forward keeps on chip, K_j, V_j (Bc x d) and Q_i, O_i (Br x d), at <= M/4 each
  (FA1 paper, appendix C, proof of Theorem 2). :class:`SRAM` charges exactly these d-wide tiles. The Br x Bc tiles
  S_ij, P_ij, dP_ij, dS_ij, Z_ij and the length-Br statistics m_i, l_i, L_i, D_i live in registers, as in the
  flash-attn CUDA kernels (github.com/Dao-AILab/flash-attention); they are not charged.
  The backward (Alg. 4 line 2, and FA2's) reuses the forward's block sizes, so it walks the same (Tr, Tc)
  grid (the block-sparse mask needs that), but holds eight d-wide tiles (K_j, V_j, dK_j, dV_j resident,
  Q_i, O_i, dO_i, dQ_i streamed): up to 2M elements. That is the Theta(M) of Theorem 5, not <= M, so the
  backwards check their working set against 2M (``BACKWARD_SRAM_FACTOR``). Because the paper rounds
  M/4d *up*, a few (M, d) pairs (M just above 4d^2, or M < 4d^2 and not a multiple of 4d) overflow even in
  the forward; they raise, and M a multiple of 4d avoids them.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

#: The backward keeps twice the forward's d-wide tiles on chip with the same block sizes (see module doc).
BACKWARD_SRAM_FACTOR = 2


class SRAMOverflowError(ValueError):
    """The on-chip working set of an algorithm exceeded the SRAM size M."""


class HBM:
    """Named arrays in high-bandwidth memory; every element moved on or off chip is counted.

    ``reads`` / ``writes`` / ``total`` are element counts over all arrays; ``per_array`` breaks them down:
    ``{name: {"reads": r, "writes": w}}``. One HBM object may be shared by several calls (e.g. a forward
    and a backward) to accumulate their traffic.
    """

    def __init__(self):
        self.arrays: dict[str, torch.Tensor] = {}
        self._reads: dict[str, int] = defaultdict(int)
        self._writes: dict[str, int] = defaultdict(int)

    # --- placing arrays (no traffic) -------------------------------------------------------------------
    def put(self, **arrays: torch.Tensor) -> None:
        """Place inputs that already live in HBM (``put(Q=Q, K=K, V=V)``): no traffic."""
        self.arrays.update(arrays)

    def empty(self, name: str, shape, dtype, device) -> None:
        """Declare an output array whose blocks will be written later ("divide O into Tr blocks"): no traffic."""
        self.arrays[name] = torch.empty(shape, dtype=dtype, device=device)

    def alloc(self, name: str, shape, fill: float, dtype, device) -> None:
        """Initialise an array in HBM to ``fill`` ("Initialize O = (0)_{N x d} in HBM"): counted as writes."""
        self.arrays[name] = torch.full(shape, fill, dtype=dtype, device=device)
        self._writes[name] += self.arrays[name].numel()

    def __getitem__(self, name: str) -> torch.Tensor:
        """The array itself, as the algorithm returns it (it stays in HBM): no traffic."""
        return self.arrays[name]

    # --- traffic ---------------------------------------------------------------------------------------
    def load(self, name: str, idx=slice(None)) -> torch.Tensor:
        """Copy ``array[idx]`` from HBM on chip; counts its numel as reads."""
        tile = self.arrays[name][idx].clone()  # a copy: later stores to HBM must not change the on-chip tile
        self._reads[name] += tile.numel()
        return tile

    def store(self, name: str, idx, value: torch.Tensor) -> None:
        """Write ``value`` to ``array[idx]`` in HBM (creating the array on a whole-array first write); counts
        ``value.numel()`` as writes."""
        if name not in self.arrays:
            if idx not in (slice(None), Ellipsis):
                raise KeyError(f"HBM.store: array {name!r} does not exist; only a whole-array store creates it")
            self.arrays[name] = value.clone()
        else:
            self.arrays[name][idx] = value.to(self.arrays[name].dtype)
        self._writes[name] += value.numel()

    @property
    def reads(self) -> int:
        return sum(self._reads.values())

    @property
    def writes(self) -> int:
        return sum(self._writes.values())

    @property
    def total(self) -> int:
        return self.reads + self.writes

    @property
    def per_array(self) -> dict[str, dict[str, int]]:
        names = sorted(set(self._reads) | set(self._writes))
        return {n: {"reads": self._reads.get(n, 0), "writes": self._writes.get(n, 0)} for n in names}

    def __repr__(self) -> str:
        return f"HBM(reads={self.reads}, writes={self.writes}, total={self.total})"


class SRAM:
    """On-chip memory of ``M`` elements holding named tiles; raises :class:`SRAMOverflowError` when the tiles
    held at once exceed ``budget * M`` (budget 2 for the backwards, see the module doc; M None: unchecked).

    ``hold(name, tile)`` charges a tile (re-holding a name replaces its charge: an accumulator updated in
    place); ``load(name, hbm, array, idx, dtype)`` holds a tile loaded from HBM; ``scope()`` releases, at
    exit, the tiles first held inside it. ``peak`` is the largest working set seen. ``what`` names the
    algorithm and its block sizes in error messages.
    """

    def __init__(self, M: int | None, what: str = "", budget: int = 1):
        self.M = M
        self.capacity = math.inf if M is None else budget * M  # None: unchecked (explicit block sizes)
        self.budget = budget
        self.what = what
        self.used = 0
        self.peak = 0
        self._held: dict[str, int] = {}
        self._scopes: list[list[str]] = []

    def hold(self, name: str, tile: torch.Tensor) -> torch.Tensor:
        n = tile.numel()
        used = self.used - self._held.get(name, 0) + n
        if used > self.capacity:
            held = ", ".join(f"{k}:{v}" for k, v in self._held.items() if k != name) or "nothing"
            budget = "" if self.budget == 1 else f" (budget {self.budget}M = {self.capacity})"
            raise SRAMOverflowError(
                f"{self.what}: on-chip working set exceeds the SRAM size M={self.M} elements{budget}: holding "
                f"{name} {tuple(tile.shape)} ({n} elements) on top of [{held}] needs {used}; expected M >= {used} "
                f"(a larger M, or a smaller head dim d / block sizes)")
        if name not in self._held and self._scopes:
            self._scopes[-1].append(name)
        self._held[name] = n
        self.used = used
        self.peak = max(self.peak, used)
        return tile

    def load(self, name: str, hbm: HBM, array: str, idx, dtype: torch.dtype) -> torch.Tensor:
        """"Load array[idx] from HBM to on-chip SRAM" as tile ``name``, converted to the on-chip ``dtype``."""
        return self.hold(name, hbm.load(array, idx).to(dtype))

    def free(self, name: str) -> None:
        self.used -= self._held.pop(name)

    @contextmanager
    def scope(self):
        self._scopes.append([])
        try:
            yield self
        finally:
            for name in self._scopes.pop():
                if name in self._held:
                    self.free(name)


def block_sizes(M: int, d: int) -> tuple[int, int]:
    """(Br, Bc) of FA1 Alg. 2 line 2: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d). M, d in elements."""
    Bc = math.ceil(M / (4 * d))
    return min(Bc, d), Bc


@dataclass(frozen=True)
class Tiling:
    """The block partition of Alg. 2 lines 4-5: Q, O, l, m into Tr blocks of Br rows; K, V into Tc blocks of
    Bc rows (the last block of each may be shorter). ``block_mask`` is the (Tr, Tc) block-sparsity mask of
    Alg. 5 as nested tuples of bool (all True when dense)."""

    Br: int
    Bc: int
    N_q: int
    N_k: int
    block_mask: tuple | None = None

    @property
    def Tr(self) -> int:
        return math.ceil(self.N_q / self.Br)

    @property
    def Tc(self) -> int:
        return math.ceil(self.N_k / self.Bc)

    def rows(self, i: int) -> slice:
        """Rows of block i (0-based; the paper counts from 1)."""
        return slice(i * self.Br, min((i + 1) * self.Br, self.N_q))

    def cols(self, j: int) -> slice:
        return slice(j * self.Bc, min((j + 1) * self.Bc, self.N_k))

    def nonzero(self, i: int, j: int) -> bool:
        """M_ij != 0 (Alg. 5 line 8); always True without a block mask."""
        return self.block_mask is None or self.block_mask[i][j]

    @property
    def nnz(self) -> int:
        return self.Tr * self.Tc if self.block_mask is None else sum(map(sum, self.block_mask))


def random_block_mask(Tr: int, Tc: int, density: float, seed: int = 0) -> list[list[bool]]:
    """A (Tr, Tc) block mask with exactly round(density * Tr * Tc) non-zero blocks, chosen uniformly at
    random by ``seed`` (a Python structure: it steers control flow, so it is never a tensor)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"block_density={density!r}: expected a float in [0, 1]")
    nnz = round(density * Tr * Tc)
    on = set(random.Random(seed).sample(range(Tr * Tc), nnz))
    return [[i * Tc + j in on for j in range(Tc)] for i in range(Tr)]

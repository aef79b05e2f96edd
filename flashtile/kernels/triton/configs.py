"""What the Triton attention kernels are launched with: tile configs (Config) and their hand-picked table per head
dim (fwd_table, bwd_table), the launch order of programs under a causal mask (CAUSAL_SCHEDULE), and the dicts where
benchmarks and sweeps pin them (CONFIG_OVERRIDE, SCHEDULE_OVERRIDE; empty in normal use). launch.fwd_config /
bwd_config choose a pinned config first, then the interpreter's small tiles, a winner cached by tuning.py, and
last these tables; tuning.py's candidates are Configs too. Imports nothing of the launchers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..runtime import next_pow2


def block_d(head_dim: int) -> int:
    """The kernels' BLOCK_D: the head dim's next power of two, at least 16 (also tuning's head-dim bucket)."""
    return max(16, next_pow2(head_dim))


@dataclass(frozen=True)
class Config:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    atomic_dq: bool = False   # backward only: dQ by fp32 atomics in the dK/dV kernel instead of a second pass
    split_dkdv: bool = False  # backward only: dV and dK by two launches of the dK/dV kernel, one accumulator each
    # backward only: (query rows, key rows, num_warps, num_stages) of the dQ pass; None: the dK/dV tiles swapped
    # (BLOCK_N query rows streaming BLOCK_M key rows) with the same warps and stages
    dq: Optional[tuple] = None
    # backward with split_dkdv only: (key rows, num_warps, num_stages) of the dV launch; None: BLOCK_N, num_warps,
    # num_stages as the dK launch. The dV launch keeps one accumulator and makes 2 products per step where the dK
    # launch makes 3, so it may take longer key tiles (each Q_i, dO_i tile read serves more keys)
    dv: Optional[tuple] = None

    def __post_init__(self):
        for name in ("dq", "dv"):   # JSON (the tuning cache) gives a list back
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))

    def dq_tiles(self, block_size: int = 0):
        """(query rows, key rows, num_warps, num_stages) of the dQ pass, tiles clamped to a block mask's
        block_size when given."""
        rows_q, rows_k, warps, stages = self.dq or (self.BLOCK_N, self.BLOCK_M, self.num_warps, self.num_stages)
        if block_size:
            rows_q, rows_k = min(rows_q, block_size), min(rows_k, block_size)
        return rows_q, rows_k, warps, stages


# Benchmarks and tuning sweeps pin a config here ({"fwd": Config, "bwd": Config}); empty in normal use.
CONFIG_OVERRIDE: dict = {}

# Under the Triton interpreter: small tiles, so that the CPU tests cross many tile edges
INTERPRETER_FWD = Config(32, 16, 4, 1)
INTERPRETER_BWD = Config(16, 32, 4, 1)


def fwd_table(head_dim: int, dtype: torch.dtype, causal: bool) -> Config:
    """Block shapes per head dim (Br = BLOCK_M, Bc = BLOCK_N) and mask: the best of benchmarks/sweep_configs.py
    (bf16, b2 n8192)."""
    bd = block_d(head_dim)
    if dtype == torch.float32:  # 4-byte tiles: half the rows
        return Config(64, 64 if bd <= 64 else 32, 4, 2)
    if bd <= 64:
        return Config(64, 64, 4, 3) if causal else Config(128, 64, 4, 3)
    if bd <= 128:
        return Config(128, 128, 8, 3)
    return Config(64, 64, 4, 3)


def bwd_table(head_dim: int, dtype: torch.dtype, causal: bool = False) -> Config:
    """BLOCK_N: key rows a dK/dV program owns; BLOCK_M: query rows per inner step (swapped for the dQ pass unless
    Config.dq gives the dQ pass its own tiles): the best of benchmarks/sweep_configs.py (bf16, b2 n8192). The
    two-pass backward (no atomics: bitwise reproducible) everywhere except d64 causal, where dQ added by TMA bulk
    reduce-adds inside the dK/dV kernel (5 products per tile instead of 7) wins; that one is the only
    non-reproducible default, and `deterministic=True` turns it into the two-pass backward."""
    bd = block_d(head_dim)
    if dtype == torch.float32:
        return Config(32, 64 if bd <= 64 else 32, 4, 1)
    # 64 x 64 dK/dV tiles of 4 warps, the dQ pass on 128 x 64 tiles of 8 warps (d64 causal: atomic dQ instead)
    if bd <= 64:
        return Config(64, 64, 4, 3, atomic_dq=causal, dq=(128, 64, 8, 3))
    if bd <= 128:
        return Config(64, 64, 4, 2, dq=(128, 64, 8, 3))
    # d256: dV and dK by two launches (one 256-wide accumulator each), the dV launch on 128-key tiles of 8 warps, 2
    # stages (Config.dv: its K_j and two (Q_i, dO_i) stages fit where the dK launch's K_j, V_j allow one), the dQ pass
    # on 64 x 64 tiles of 4 warps (causal) or streaming 32-key blocks through 3 stages (full)
    if causal:
        return Config(64, 128, 8, 1, split_dkdv=True, dq=(64, 64, 4, 2), dv=(128, 8, 2))
    return Config(64, 64, 4, 2, split_dkdv=True, dq=(64, 32, 4, 3), dv=(128, 8, 2))


# Launch order under a causal mask (mods.tile_order), per head-dim bucket: heads are grouped so that a group holds
# about this many programs of each kernel (0: the grid's own order, one head's blocks in a row), and whether the dQ
# pass runs its query blocks last-first. The long programs of a group's heads then start before its short ones and
# the short ones fill the tail, while a group stays small enough to share its heads' tiles in L2. Picked by
# benchmarks/sweep_schedule.py (bf16, FA3 grid, causal).
CAUSAL_SCHEDULE = {
    128: dict(fwd=256, dkdv=256, dq=256, dq_reverse=True),
    256: dict(fwd=0, dkdv=128, dq=128, dq_reverse=False),
}
SCHEDULE_OVERRIDE: dict = {}   # sweeps pin fields of the schedule here (keys as CAUSAL_SCHEDULE's entries)


def schedule(head_dim: int) -> dict:
    """The CAUSAL_SCHEDULE entry of head_dim's bucket, with the fields SCHEDULE_OVERRIDE pins."""
    entry = CAUSAL_SCHEDULE[128 if block_d(head_dim) <= 128 else 256]
    return {**entry, **SCHEDULE_OVERRIDE} if SCHEDULE_OVERRIDE else entry

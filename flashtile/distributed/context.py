"""Context parallelism as a trainer configures it: one entry point over a torch.distributed DeviceMesh, and the
sharding helpers of every mode.

Modes (see ring.py, varlen.py and ulysses.py for the algorithms):
    "ring"     ring attention over the mesh dimension `cp_dim` (R = its size, U = 1);
    "ulysses"  all-to-all over `cp_dim` (R = 1, U = its size);
    "usp"      all-to-all over the second name of `cp_dim = (ring_dim, ulysses_dim)`, ring over the first.
A context-parallel dimension lives beside the data-parallel / FSDP ones, e.g.
    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
    out = context_parallel_attention(q, k, v, mesh, cp_dim="cp", mode="ring", causal=True)
or, for USP, (dp, ring, ulysses) with cp_dim=("ring", "ulysses") (Ulysses innermost: its all-to-all wants the
fastest links).

Layouts (`cp_shard`): the CP rank is ring_rank * U + ulysses_rank (row-major over (ring, ulysses), as a mesh
flattens them). Dense: the sequence is cut by the ring layout over R ranks ("zigzag": 2R chunks, rank i holds
chunks i and 2R - 1 - i; "contiguous"), and each ring shard in U contiguous pieces; the sequence length must be
divisible by 2 R U (zigzag) or R U. Pure Ulysses is contiguous. Varlen (cu_seqlens over the global packed batch):
with R > 1 every document is padded at its end to a multiple of 2 R U and zigzagged per document over the ring
(varlen.py), each ring shard cut in U contiguous pieces; with R = 1 (pure Ulysses) the packed batch is padded
at its end to a multiple of U and cut in U contiguous pieces. Padding rows take `pad_value`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..api.errors import fail
from .comm import require_process_group
from .ring import _check_layout, ring_flash_attn_func, shard_sequence, unshard_sequence
from .ulysses import (
    ulysses_flash_attn_func,
    ulysses_flash_attn_varlen_func,
    usp_flash_attn_func,
    usp_flash_attn_varlen_func,
)
from .varlen import _cu_values, ring_flash_attn_varlen_func, shard_varlen, unshard_varlen

MODES = ("ring", "ulysses", "usp")


# --------------------------------------------------------------------------------------------------
# Layouts of every mode
# --------------------------------------------------------------------------------------------------
def _sizes(rank, ring_size, ulysses_size):
    for name, n in (("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        if not isinstance(n, int) or n < 1:
            fail(name, n, "an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < ring_size * ulysses_size:
        fail("rank", rank, f"an int in [0, ring_size * ulysses_size = {ring_size * ulysses_size})")
    return divmod(rank, ulysses_size)


def _pad_rows(x: torch.Tensor, dim: int, n: int, pad_value) -> torch.Tensor:
    if x.shape[dim] == n:
        return x
    shape = list(x.shape)
    shape[dim] = n - x.shape[dim]
    return torch.cat([x, torch.full(shape, pad_value, dtype=x.dtype, device=x.device)], dim=dim)


def _ulysses_varlen_rows(cu, ulysses_size: int) -> int:
    """Rows of the packed batch after padding its end to a multiple of the Ulysses group size."""
    return -(-cu[-1] // ulysses_size) * ulysses_size


def cp_shard(x: torch.Tensor, rank: int, ring_size: int = 1, ulysses_size: int = 1, layout: str = "zigzag",
             dim: Optional[int] = None, cu_seqlens=None, pad_value=0) -> torch.Tensor:
    """CP rank `rank`'s shard of the full tensor `x` (module docstring). dim: the sequence dimension (default 1
    dense, 0 varlen). Differentiable. ring: (ring_size=W); ulysses: (ulysses_size=W); usp: both."""
    ring_rank, uly_rank = _sizes(rank, ring_size, ulysses_size)
    _check_layout(layout)
    if cu_seqlens is None:
        dim = 1 if dim is None else dim
        if ring_size == 1:
            return shard_sequence(x, uly_rank, ulysses_size, "contiguous", dim)
        ring_shard = shard_sequence(x, ring_rank, ring_size, layout, dim)
        return shard_sequence(ring_shard, uly_rank, ulysses_size, "contiguous", dim)
    dim = 0 if dim is None else dim
    if ring_size == 1:
        cu = _cu_values(cu_seqlens)
        full = _pad_rows(x.narrow(dim, 0, cu[-1]), dim, _ulysses_varlen_rows(cu, ulysses_size), pad_value)
        return shard_sequence(full, uly_rank, ulysses_size, "contiguous", dim)
    ring_shard = shard_varlen(x, cu_seqlens, ring_rank, ring_size, dim, pad_value, 2 * ring_size * ulysses_size)
    return shard_sequence(ring_shard, uly_rank, ulysses_size, "contiguous", dim)


def cp_unshard(shards: Sequence[torch.Tensor], ring_size: int = 1, ulysses_size: int = 1, layout: str = "zigzag",
               dim: Optional[int] = None, cu_seqlens=None) -> torch.Tensor:
    """Inverse of cp_shard: shards[rank] for every CP rank -> the full tensor (varlen: cu_seqlens[-1] rows,
    padding dropped)."""
    _sizes(0, ring_size, ulysses_size)
    if not isinstance(shards, (list, tuple)) or len(shards) != ring_size * ulysses_size:
        fail("shards", type(shards).__name__, f"a list of ring_size * ulysses_size = {ring_size * ulysses_size} "
             "tensors (CP rank order)")
    dim = (1 if cu_seqlens is None else 0) if dim is None else dim
    ring_shards = [torch.cat(list(shards[i * ulysses_size:(i + 1) * ulysses_size]), dim=dim) for i in range(ring_size)]
    if cu_seqlens is None:
        return ring_shards[0] if ring_size == 1 else unshard_sequence(ring_shards, ring_size, layout, dim)
    if ring_size == 1:
        return ring_shards[0].narrow(dim, 0, _cu_values(cu_seqlens)[-1])
    return unshard_varlen(ring_shards, cu_seqlens, ring_size, dim, 2 * ring_size * ulysses_size)


# --------------------------------------------------------------------------------------------------
# The device-mesh entry point
# --------------------------------------------------------------------------------------------------
def _mesh_groups(mesh, cp_dim, mode):
    """(ring group or None, Ulysses group or None, R, U, ring rank, Ulysses rank) of this rank."""
    if mode not in MODES:
        fail("mode", mode, f"one of {MODES}")
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or not hasattr(mesh, "get_group"):
        fail("mesh", type(mesh).__name__, "a torch.distributed DeviceMesh with mesh_dim_names")
    dims = (cp_dim,) if isinstance(cp_dim, str) else tuple(cp_dim) if isinstance(cp_dim, (tuple, list)) else None
    want = 2 if mode == "usp" else 1
    if dims is None or len(dims) != want or not all(isinstance(d, str) for d in dims):
        fail("cp_dim", cp_dim, "(ring_dim, ulysses_dim): two mesh dimension names" if mode == "usp" else
             "a mesh dimension name")
    for d in dims:
        if d not in names:
            fail("cp_dim", cp_dim, f"names among mesh.mesh_dim_names {tuple(names)}")
    sizes = [mesh[d].size() for d in dims]
    groups = [mesh.get_group(d) for d in dims]
    ranks = [mesh.get_local_rank(d) for d in dims]
    if mode == "ring":
        return groups[0], None, sizes[0], 1, ranks[0], 0
    if mode == "ulysses":
        return None, groups[0], 1, sizes[0], 0, ranks[0]
    return groups[0], groups[1], sizes[0], sizes[1], ranks[0], ranks[1]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, cp_dim="cp",
                               mode: str = "ring", cu_seqlens=None, max_seqlen: Optional[int] = None,
                               causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
                               softcap: float = 0.0, layout: str = "zigzag", deterministic: bool = False,
                               return_softmax_lse: bool = False):
    """Exact attention of this rank's shard under context parallelism over `mesh` (module docstring).

    q, k, v: this rank's shard as context_parallel_shard (or cp_shard) cuts the full tensors: (batch, seqlen_local,
    heads, headdim), or (total_local, heads, headdim) with cu_seqlens (global packed batch) and max_seqlen.
    mode: "ring" | "ulysses" | "usp"; cp_dim: the mesh dimension name, or (ring_dim, ulysses_dim) for "usp".
    layout: the ring's dense layout ("zigzag" | "contiguous"; Ulysses alone is contiguous). Other options as
    flash_attn_func / flash_attn_varlen_func on the unsharded batch. Returns out like q (and softmax_lse if
    return_softmax_lse); differentiable in q, k, v.
    """
    require_process_group("context_parallel_attention")
    ring_g, uly_g, _, _, _, _ = _mesh_groups(mesh, cp_dim, mode)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
              deterministic=deterministic, return_softmax_lse=return_softmax_lse)
    if cu_seqlens is not None:
        if max_seqlen is None:
            fail("max_seqlen", None, "the longest document's length (an int) when cu_seqlens is given")
        if mode == "ring":
            return ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group=ring_g, **kw)
        if mode == "ulysses":
            return ulysses_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group=uly_g, **kw)
        return usp_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, uly_g, ring_g, **kw)
    if mode == "ring":
        return ring_flash_attn_func(q, k, v, group=ring_g, layout=layout, **kw)
    if mode == "ulysses":
        return ulysses_flash_attn_func(q, k, v, group=uly_g, **kw)
    return usp_flash_attn_func(q, k, v, uly_g, ring_g, layout=layout, **kw)


def context_parallel_shard(x: torch.Tensor, mesh, cp_dim="cp", mode: str = "ring", layout: str = "zigzag",
                           dim: Optional[int] = None, cu_seqlens=None, pad_value=0) -> torch.Tensor:
    """This rank's shard of the full tensor `x` for context_parallel_attention on `mesh` (tokens, labels with
    pad_value = the loss's ignore index, positions, or q/k/v themselves)."""
    _, _, ring_size, uly_size, ring_rank, uly_rank = _mesh_groups(mesh, cp_dim, mode)
    return cp_shard(x, ring_rank * uly_size + uly_rank, ring_size, uly_size, layout, dim, cu_seqlens, pad_value)


def context_parallel_gather(x: torch.Tensor, mesh, cp_dim="cp", mode: str = "ring", layout: str = "zigzag",
                            dim: Optional[int] = None, cu_seqlens=None) -> torch.Tensor:
    """All-gather the shards of the mesh's CP group(s) and return the full tensor on every rank (a collective;
    not differentiable)."""
    require_process_group("context_parallel_gather")
    ring_g, uly_g, ring_size, uly_size, _, _ = _mesh_groups(mesh, cp_dim, mode)
    x = x.detach().contiguous()
    pieces = _all_gather(x, uly_g) if uly_size > 1 else [x]              # pieces[j]: Ulysses rank j's
    if ring_size == 1:
        return cp_unshard(pieces, ring_size, uly_size, layout, dim, cu_seqlens)
    by_ring = [_all_gather(t, ring_g) for t in pieces]                   # by_ring[j][i]: CP rank (i, j)'s
    shards = [by_ring[j][i] for i in range(ring_size) for j in range(uly_size)]
    return cp_unshard(shards, ring_size, uly_size, layout, dim, cu_seqlens)


def _all_gather(x: torch.Tensor, group) -> list:
    got = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, x, group=group)
    return got

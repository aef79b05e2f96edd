"""Collectives the context-parallel modes share: the all-to-all that trades a sequence shard for a head shard
(Ulysses), as differentiable autograd Functions, and the checks every distributed entry point makes.

All-to-all goes through `torch.distributed.all_to_all_single` on every backend: NCCL implements it, and so does
gloo on CPU tensors (checked with torch 2.13), so the CPU tests run the code path the GPUs run.

Layouts (W ranks in the group, rank i holding sequence shard i of length s_local):
    seq_to_heads: (batch, s_local, H, d) on every rank -> (batch, W * s_local, H / W, d): the whole sequence
                  (shards concatenated in rank order) for heads [i H / W, (i + 1) H / W) of rank i.
    heads_to_seq: its inverse.
Several tensors with one head dim travel in one exchange (their head groups concatenated), so q, k and v
cost one message per rank pair, not three.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from ..api.errors import fail

from ..api.checks import check_device

__all__ = ["check_device", "require_process_group", "seq_to_heads", "heads_to_seq"]


def require_process_group(fn: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"flashtile: {fn} needs an initialised torch.distributed process group "
                           "(dist.init_process_group)")


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """send (W, ...) contiguous: returns recv with recv[i] = rank i's send[me]."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _a2a_seq_to_heads(packed: torch.Tensor, group) -> torch.Tensor:
    """packed (b, s_local, W, G, d), head group j for rank j -> (b, W * s_local, G, d)."""
    b, s, w, g, d = packed.shape
    recv = _all_to_all(packed.permute(2, 0, 1, 3, 4).contiguous(), group)   # recv[i]: rank i's sequence shard
    return recv.permute(1, 0, 2, 3, 4).reshape(b, w * s, g, d)


def _a2a_heads_to_seq(x: torch.Tensor, w: int, group) -> torch.Tensor:
    """x (b, W * s_local, G, d) -> (b, s_local, W, G, d), head group j from rank j."""
    b, n, g, d = x.shape
    recv = _all_to_all(x.reshape(b, w, n // w, g, d).permute(1, 0, 2, 3, 4).contiguous(), group)
    return recv.permute(1, 2, 0, 3, 4)


def _zeros_for_none(grads, shapes):
    """An output the loss does not use sends None; every rank must still take part in the exchange, with zeros."""
    like = next(g for g in grads if g is not None)
    return [g if g is not None else like.new_zeros(shape) for g, shape in zip(grads, shapes)]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, *xs):
        b, s, _, d = xs[0].shape
        groups = [x.shape[2] // world for x in xs]
        packed = torch.cat([x.reshape(b, s, world, g, d) for x, g in zip(xs, groups)], dim=3)
        outs = _a2a_seq_to_heads(packed, group).split(groups, dim=2)
        ctx.group, ctx.world, ctx.groups, ctx.shapes = group, world, groups, [t.shape for t in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        back = _a2a_heads_to_seq(torch.cat(_zeros_for_none(grads, ctx.shapes), dim=2), ctx.world, ctx.group)
        b, s, w, _, d = back.shape
        return (None, None, *[t.reshape(b, s, w * g, d) for t, g in zip(back.split(ctx.groups, dim=3), ctx.groups)])


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, *xs):
        groups = [x.shape[2] for x in xs]
        back = _a2a_heads_to_seq(torch.cat(xs, dim=2), world, group)
        b, s, w, _, d = back.shape
        outs = [t.reshape(b, s, w * g, d) for t, g in zip(back.split(groups, dim=3), groups)]
        ctx.group, ctx.world, ctx.groups, ctx.shapes = group, world, groups, [t.shape for t in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads = _zeros_for_none(grads, ctx.shapes)
        b, s, _, d = grads[0].shape
        packed = torch.cat([t.reshape(b, s, ctx.world, g, d) for t, g in zip(grads, ctx.groups)], dim=3)
        return (None, None, *_a2a_seq_to_heads(packed, ctx.group).split(ctx.groups, dim=2))


def _check_heads(xs: Sequence[torch.Tensor], fn: str) -> None:
    for i, x in enumerate(xs):
        if x.dim() != 4:
            fail(f"{fn}: tensor {i}.dim()", x.dim(), "4: (batch, seqlen, heads, headdim)")
        if x.shape[:2] != xs[0].shape[:2] or x.shape[3] != xs[0].shape[3]:
            fail(f"{fn}: tensor {i}.shape", tuple(x.shape), f"(batch, seqlen, heads, headdim) with batch, seqlen "
                 f"and headdim of tensor 0 {tuple(xs[0].shape)}")
        if x.dtype != xs[0].dtype or x.device != xs[0].device:
            fail(f"{fn}: tensor {i}.dtype/device", (x.dtype, x.device), f"tensor 0's ({xs[0].dtype}, {xs[0].device})")


def seq_to_heads(xs: Sequence[torch.Tensor], group=None) -> List[torch.Tensor]:
    """Trade sequence shards for head shards, differentiably: each x (batch, s_local, H, d) -> (batch,
    W * s_local, H / W, d). H of every tensor divisible by the group size W; one exchange for all of them."""
    world = dist.get_world_size(group)
    _check_heads(xs, "seq_to_heads")
    for i, x in enumerate(xs):
        if x.shape[2] % world:
            fail(f"seq_to_heads: tensor {i}.shape[2] (heads)", x.shape[2], f"a multiple of the group size {world}")
    if world == 1:
        return list(xs)
    return list(_SeqToHeads.apply(group, world, *xs))


def heads_to_seq(xs: Sequence[torch.Tensor], group=None) -> List[torch.Tensor]:
    """The inverse of seq_to_heads: each x (batch, W * s_local, G, d) -> (batch, s_local, W * G, d)."""
    world = dist.get_world_size(group)
    _check_heads(xs, "heads_to_seq")
    if xs[0].shape[1] % world:
        fail("heads_to_seq: tensor 0.shape[1] (seqlen)", xs[0].shape[1], f"a multiple of the group size {world}")
    if world == 1:
        return list(xs)
    return list(_HeadsToSeq.apply(group, world, *xs))

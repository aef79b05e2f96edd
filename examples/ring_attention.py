"""Ring attention across GPUs: a sequence sharded over the ranks, checked against one-GPU attention.

    torchrun --nproc_per_node=2 examples/ring_attention.py                      # GPUs, NCCL
    torchrun --nproc_per_node=2 examples/ring_attention.py --seqlen 256 --nheads 2 --headdim 32 --dtype float32
                                                                                # no GPU: gloo + Triton interpreter

Every rank draws the same random full-sequence q, k, v, dout (same seed), keeps its zigzag shard, runs
ring attention forward and backward, and the shards of out/dq/dk/dv are gathered. Rank 0 runs
flash_attn_func on the whole sequence on one device and prints the largest differences, then every rank
times the ring forward+backward and rank 0 prints tokens/s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# NVLink multicast (NVLS) off before NCCL starts: the ring's point-to-point exchanges do not use it, and on shared
# multi-GPU hosts a program that sets it up can put the GPUs out of service for everyone
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashtile  # noqa: E402,F401  (turns on the Triton interpreter when there is no GPU)
from flashtile import flash_attn_func  # noqa: E402
from flashtile.distributed import gather_sequence, ring_flash_attn_func, shard_sequence  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=32768, help="total tokens (divisible by 2 * world size)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--nheads-k", type=int, default=None, help="K/V heads (GQA); default nheads")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, causal = DTYPES[a.dtype], not a.no_causal
    hk = a.nheads_k or a.nheads

    g = torch.Generator(device=device).manual_seed(a.seed)
    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)
    q, dout = rand(a.batch, a.seqlen, a.nheads, a.headdim), rand(a.batch, a.seqlen, a.nheads, a.headdim)
    k, v = rand(a.batch, a.seqlen, hk, a.headdim), rand(a.batch, a.seqlen, hk, a.headdim)
    shard = lambda t: shard_sequence(t, rank, world, a.layout)  # noqa: E731
    ql, kl, vl, doutl = (shard(t).requires_grad_(t is not dout) for t in (q, k, v, dout))

    def ring_step():
        out = ring_flash_attn_func(ql, kl, vl, causal=causal, layout=a.layout)
        out.backward(doutl)
        return out

    out = ring_step()
    got = {n: gather_sequence(t, layout=a.layout) for n, t in
           (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
    if rank == 0:
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out = flash_attn_func(qs, ks, vs, causal=causal)
        ref_out.backward(dout)
        ref = dict(out=ref_out, dq=qs.grad, dk=ks.grad, dv=vs.grad)
        print(f"ring attention: world={world} layout={a.layout} causal={causal} b={a.batch} s={a.seqlen} "
              f"h={a.nheads} hk={hk} d={a.headdim} {a.dtype} on {device.type}")
        for n in ("out", "dq", "dk", "dv"):
            err = (got[n].float() - ref[n].float()).abs().max().item()
            print(f"  max |ring - one device| {n:>3}: {err:.3e}   (max |one device| {ref[n].abs().max().item():.3g})")
        del qs, ks, vs, ref_out, ref
    del got

    for t in (ql, kl, vl):
        t.grad = None
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        ring_step()
    if cuda:
        torch.cuda.synchronize()
    dt = torch.tensor([(time.perf_counter() - t0) / a.iters], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    if rank == 0:
        tok = a.batch * a.seqlen / dt.item()
        print(f"  forward+backward: {dt.item() * 1e3:.1f} ms/iter, {tok:,.0f} tokens/s ({tok / world:,.0f} per rank)")
    # leave together: a gloo rank that tears its group down while a peer is still inside it can abort at exit
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

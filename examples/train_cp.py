"""Train a small Llama-style model with context parallelism x FSDP2 on a 2-D device mesh.

    torchrun --nproc_per_node=4 examples/train_cp.py                                  # GPUs: NCCL, dp=2 x cp=2
    torchrun --nproc_per_node=8 examples/train_cp.py --cp 8 --mode usp --ulysses 4 --seqlen 131072
    torchrun --nproc_per_node=4 examples/train_cp.py --device cpu --check             # no GPU: gloo + Triton
                                                                                      # interpreter, tiny sizes

The mesh is (dp, cp) — (dp, ring, ulysses) for --mode usp, with Ulysses innermost (its all-to-all wants the
fastest links). Every parameter is sharded by FSDP2 (fully_shard) over ALL ranks, dp and cp flattened into one
dimension, as long-context trainers do: the cp ranks of a dp group hold different tokens of the same samples,
so their gradients are summed, and FSDP's reduce-scatter averages over dp * cp ranks. Hence each rank's loss is
(sum of its tokens' losses) * cp / (tokens of its dp group): the average FSDP takes is then the mean over dp
of each group's per-token loss.

Each step draws a batch of random tokens (the same on every rank, from the step's seed); dp rank i takes its
samples, and context_parallel_shard gives this rank its tokens, labels and rotary positions (the layout of the
chosen mode). With --varlen each sample is a packed sequence of documents of random lengths (cu_seqlens over the
sample), labels do not cross documents, and padding tokens of the layout carry label -100.

--check: rank 0 also trains an unsharded copy of the model in one process on the whole batch (flash_attn_func
/ flash_attn_varlen_func), and prints both losses at every step; they agree to float32 rounding (the sharded
model computes in float32 then, bf16 otherwise on GPUs).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

# NVLink multicast (NVLS) off before NCCL starts: the shared multi-GPU hosts require it
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

# (importing flashtile turns on the Triton interpreter when there is no GPU)
from flashtile import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashtile.distributed import context_parallel_attention, context_parallel_shard, varlen_positions  # noqa: E402


# --------------------------------------------------------------------------------------------------
# The model (Llama: pre-norm RMSNorm, rotary positions, GQA attention, SwiGLU MLP)
# --------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, positions, base: float = 10000.0):
    """x (..., tokens, heads, d); positions (..., tokens) int: each token rotated at its own position (the shard's
    positions, so any context-parallel layout gets the rotation of the unsharded sequence)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.to(torch.float32).unsqueeze(-1) * inv           # (..., tokens, d / 2)
    cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)     # broadcast over heads
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, positions, attend):
        shape = x.shape[:-1]
        q = rotary(self.wq(x).view(*shape, self.heads, self.head_dim), positions)
        k = rotary(self.wk(x).view(*shape, self.kv_heads, self.head_dim), positions)
        v = self.wv(x).view(*shape, self.kv_heads, self.head_dim)
        return self.wo(attend(q, k, v).reshape(*shape, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, positions, attend):
        x = x + self.attn(self.attn_norm(x), positions, attend)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        hidden = 256 * math.ceil(8 * dim / 3 / 256)
        self.blocks = nn.ModuleList([Block(dim, heads, kv_heads, hidden) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, positions, attend):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, positions, attend)
        return self.head(self.norm(x)).float()


# --------------------------------------------------------------------------------------------------
# Data: one global batch per step, the same on every rank
# --------------------------------------------------------------------------------------------------
def batch_for_step(a, step: int, dp: int):
    """[per dp rank: (tokens, labels, positions, cu_seqlens or None)] of full (unsharded) samples."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(dp):
        if not a.varlen:
            tokens = torch.randint(0, a.vocab, (a.batch, a.seqlen + 1), generator=g)
            pos = torch.arange(a.seqlen).expand(a.batch, a.seqlen)
            out.append((tokens[:, :-1], tokens[:, 1:], pos, None))
            continue
        # a packed sample: documents of random lengths filling seqlen tokens (batch is 1 packed sequence)
        lens, left = [], a.seqlen
        while left > 0:
            n = min(left, int(torch.randint(1, max(2, a.seqlen // 3), (1,), generator=g)))
            lens.append(n)
            left -= n
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        tokens = torch.randint(0, a.vocab, (a.seqlen,), generator=g)
        labels = torch.roll(tokens, -1).clone()
        labels[cu[1:].long() - 1] = -100     # a document's last token predicts nothing of the next document
        out.append((tokens, labels, varlen_positions(cu), cu))
    return out


# --------------------------------------------------------------------------------------------------
def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks (the rest are data-parallel)")
    p.add_argument("--mode", choices=["ring", "ulysses", "usp"], default="ring")
    p.add_argument("--ulysses", type=int, default=2, help="Ulysses ranks inside cp for --mode usp")
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--varlen", action="store_true", help="packed documents (cu_seqlens) instead of full samples")
    p.add_argument("--seqlen", type=int, default=None, help="tokens per sample (default 8192 GPU, 32 CPU)")
    p.add_argument("--batch", type=int, default=1, help="samples per dp rank (dense only)")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true", help="rank 0 also trains an unsharded copy and compares losses")
    a = p.parse_args()
    gpu = a.device == "cuda"
    for name, on_gpu, on_cpu in (("seqlen", 8192, 32), ("vocab", 32000, 64), ("dim", 1024, 32), ("layers", 8, 2),
                                 ("heads", 16, 4), ("kv_heads", 4, 2), ("steps", 20, 2)):
        if getattr(a, name) is None:
            setattr(a, name, on_gpu if gpu else on_cpu)
    return a


def main():
    a = parse()
    gpu = a.device == "cuda"
    if gpu:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % a.cp:
        raise SystemExit(f"--cp {a.cp} must divide the number of processes {world}")
    dp = world // a.cp
    if a.mode == "usp":
        if a.cp % a.ulysses:
            raise SystemExit(f"--ulysses {a.ulysses} must divide --cp {a.cp}")
        names, shape = ("dp", "ring", "uly"), (dp, a.cp // a.ulysses, a.ulysses)
        cp_dim = ("ring", "uly")
    else:
        names, shape, cp_dim = ("dp", "cp"), (dp, a.cp), "cp"
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    everyone = mesh[names]._flatten("dp_cp")   # FSDP shards every parameter over all ranks (module docstring)
    dp_rank = mesh.get_local_rank("dp")

    torch.manual_seed(0)
    model = Llama(a.vocab, a.dim, a.layers, a.heads, a.kv_heads).to(device)
    ref = copy.deepcopy(model) if (a.check and rank == 0) else None
    # bf16 compute on GPUs; float32 under --check, so the comparison with the float32 copy is to rounding
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if gpu and not a.check else \
        MixedPrecisionPolicy()
    for blk in model.blocks:
        fully_shard(blk, mesh=everyone, mp_policy=mp)
    fully_shard(model, mesh=everyone, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=a.lr) if ref is not None else None

    if rank == 0:
        print(f"mesh {dict(zip(names, shape))}, mode={a.mode}, layout={a.layout}, varlen={a.varlen}, "
              f"{sum(p.numel() for p in ref.parameters()) if ref is not None else ''} params, seqlen={a.seqlen}, "
              f"device={device.type}", flush=True)
    t_start = None
    for step in range(a.steps):
        if step == 1:
            t_start = time.perf_counter()
        data = batch_for_step(a, step, dp)
        tokens, labels, pos, cu = data[dp_rank]
        if cu is not None:
            cu = cu.to(device)
            max_seqlen = int((cu[1:] - cu[:-1]).max())
            shard_kw, attn_kw = dict(cu_seqlens=cu), dict(cu_seqlens=cu, max_seqlen=max_seqlen)
        else:
            shard_kw = attn_kw = dict(layout=a.layout)

        def shard(t, pad=0):
            return context_parallel_shard(t.to(device), mesh, cp_dim, a.mode, pad_value=pad, **shard_kw)
        tok_l, lab_l, pos_l = shard(tokens), shard(labels, -100), shard(pos)

        def attend(q, k, v):
            return context_parallel_attention(q, k, v, mesh, cp_dim, a.mode, causal=True, **attn_kw)
        logits = model(tok_l, pos_l, attend)
        local_sum = F.cross_entropy(logits.reshape(-1, a.vocab), lab_l.reshape(-1), ignore_index=-100,
                                    reduction="sum")
        count = int((labels != -100).sum())               # tokens of this dp group, every cp rank knows them
        (local_sum * a.cp / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        report = (local_sum.detach() / count / dp).reshape(1)
        dist.all_reduce(report)                            # sum over cp: the group's loss; over dp: the mean

        if ref is not None:
            losses = []
            for tok, lab, p_, c_ in data:
                tok, lab, p_ = tok.to(device), lab.to(device), p_.to(device)
                if c_ is None:
                    def one(q, k, v):
                        return flash_attn_func(q, k, v, causal=True)
                else:
                    c_ = c_.to(device)
                    n = int((c_[1:] - c_[:-1]).max())

                    def one(q, k, v, c_=c_, n=n):
                        return flash_attn_varlen_func(q, k, v, c_, c_, n, n, causal=True)
                lg = ref(tok, p_, one)
                losses.append(F.cross_entropy(lg.reshape(-1, a.vocab), lab.reshape(-1), ignore_index=-100))
            ref_loss = torch.stack(losses).mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            print(f"step {step}: loss {report.item():.6f}  one process {ref_loss.item():.6f}  "
                  f"|diff| {abs(report.item() - ref_loss.item()):.2e}", flush=True)
        elif rank == 0:
            print(f"step {step}: loss {report.item():.6f}", flush=True)
    if gpu:
        torch.cuda.synchronize()
    if rank == 0 and t_start is not None and a.steps > 1:
        dt = (time.perf_counter() - t_start) / (a.steps - 1)
        tokens_per_step = dp * (a.seqlen * (1 if a.varlen else a.batch))
        print(f"{dt * 1e3:.1f} ms/step, {tokens_per_step / dt:,.0f} tokens/s"
              + (f", peak {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB/GPU" if gpu else ""), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

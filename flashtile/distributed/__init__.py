"""Context parallelism over torch.distributed: exact attention on a sequence sharded across ranks.

ring.py      ring attention (K/V shards travel around the ranks; zigzag or contiguous layout)
varlen.py    ring attention on packed documents (cu_seqlens), sharded per document
ulysses.py   all-to-all sequence parallelism (Ulysses) and the hybrid with the ring (USP)
context.py   the DeviceMesh entry point (mode="ring" | "ulysses" | "usp") and the layouts of every mode
comm.py      the differentiable all-to-all the modes share
"""
from .comm import heads_to_seq, seq_to_heads
from .context import (
    MODES,
    context_parallel_attention,
    context_parallel_gather,
    context_parallel_shard,
    cp_shard,
    cp_unshard,
)
from .ring import (
    LAYOUTS,
    BlockCall,
    gather_sequence,
    merge_attention,
    plan_block,
    ring_flash_attn_func,
    ring_plan,
    shard_sequence,
    unshard_sequence,
)
from .ulysses import (
    kv_head_replication,
    ulysses_flash_attn_func,
    ulysses_flash_attn_varlen_func,
    usp_flash_attn_func,
    usp_flash_attn_varlen_func,
)
from .varlen import (
    VarlenBlock,
    VarlenLayout,
    gather_varlen,
    local_cu_seqlens,
    ring_flash_attn_varlen_func,
    shard_varlen,
    unshard_varlen,
    varlen_layout,
    varlen_positions,
)

__all__ = ["LAYOUTS", "MODES", "BlockCall", "VarlenBlock", "VarlenLayout", "context_parallel_attention",
           "context_parallel_gather", "context_parallel_shard", "cp_shard", "cp_unshard", "gather_sequence",
           "gather_varlen", "heads_to_seq", "kv_head_replication", "local_cu_seqlens", "merge_attention",
           "plan_block", "ring_flash_attn_func", "ring_flash_attn_varlen_func", "ring_plan", "seq_to_heads",
           "shard_sequence", "shard_varlen", "ulysses_flash_attn_func", "ulysses_flash_attn_varlen_func",
           "unshard_sequence", "unshard_varlen", "usp_flash_attn_func", "usp_flash_attn_varlen_func",
           "varlen_layout", "varlen_positions"]

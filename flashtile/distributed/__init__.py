"""Context parallelism over torch.distributed: ring attention on a sequence sharded across ranks."""
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

__all__ = ["LAYOUTS", "BlockCall", "gather_sequence", "merge_attention", "plan_block", "ring_flash_attn_func",
           "ring_plan", "shard_sequence", "unshard_sequence"]

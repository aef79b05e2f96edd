"""Tile classification of a user mask_mod (flashtile.flex.MaskMod) for create_block_mask.

One program per (query block, key block, batch * head) evaluates the mask_mod on its BLOCK x BLOCK tile, SUB
rows at a time, and writes how many (query, key) pairs inside the sequences are visible. The host turns the
counts into empty / partial / full tiles. No Q_LEN x KV_LEN tensor is made unless the dense mask is asked for.
"""
import triton
import triton.language as tl


@triton.jit
def classify_tiles_kernel(COUNT, DENSE, aux, q_len, kv_len, n_heads, stride_cb, stride_ch, stride_cq,
                          stride_db, stride_dh, stride_dq, MASK_MOD: tl.constexpr, BLOCK: tl.constexpr,
                          SUB: tl.constexpr, WRITE_DENSE: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_k = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // n_heads
    h = bh % n_heads
    j = pid_k * BLOCK + tl.arange(0, BLOCK)[None, :]
    count = 0
    for sub in range(0, BLOCK, SUB):
        i = pid_q * BLOCK + sub + tl.arange(0, SUB)[:, None]
        inb = (i < q_len) & (j < kv_len)
        visible = MASK_MOD(b, h, i, j, aux) & inb
        count += tl.sum(tl.sum(visible.to(tl.int32), 1), 0)
        if WRITE_DENSE:
            ptrs = DENSE + tl.cast(b, tl.int64) * stride_db + tl.cast(h, tl.int64) * stride_dh + i.to(tl.int64) * stride_dq + j
            tl.store(ptrs, visible.to(tl.int8), mask=inb)
    tl.store(COUNT + tl.cast(b, tl.int64) * stride_cb + tl.cast(h, tl.int64) * stride_ch + pid_q * stride_cq + pid_k,
             count)

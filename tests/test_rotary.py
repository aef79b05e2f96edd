"""Rotary position embedding (flashtile/kernels/triton/rotary.py) on its own, against the float64 rotation of
tests/kvcache_utils.py (rope_ref): rotary_q (q rotated at pos0[b] + i, or at pos0[b] for every row) and append_kv
(new k rotated into the cache at its position after the left padding, v copied; contiguous, batch-indexed and
paged caches), interleaved (GPT-J pairs 2k, 2k+1) and GPT-NeoX (halves k, k + rotary_dim / 2), rotary_dim below
and equal to the head dim, in fp32, fp16 and bf16.

The kernels compute in fp32 and round once to the storage dtype (to nearest), so the rotated part of q is within
half a unit in the last place of the float64 rotation of the same inputs (plus fp32 arithmetic), and the
dimensions past rotary_dim are copied bit for bit.
flash_attn_with_kvcache's use of both (which positions it passes) is tests/test_kvcache.py.
"""
import pytest
import torch

import flashtile  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from attn_utils import DEVICE, rand_tensor
from kvcache_utils import KCase, check_append, make_problem, physical_cache, rope_ref, rotary_tables
from flashtile.kernels.triton import rotary

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [fp32, fp16, bf16], ids=["fp32", "fp16", "bf16"])
# half a unit in the last place, relative: the one rounding to the storage dtype (round to nearest)
HALF_ULP = {fp32: 2.0 ** -24, fp16: 2.0 ** -11, bf16: 2.0 ** -8}


def assert_rotated(got, x, cos, sin, pos, interleaved, what):
    """got (s, h, d) is x (s, h, d) rotated at positions pos (s,) on its first 2 * cos.shape[1] dims: within the
    rounding to nearest of the float64 rotation, plus fp32 arithmetic (a few units of 2^-24 of the inputs'
    magnitude: cancellation in x1 cos - x2 sin), bit for bit past them."""
    rd = 2 * cos.shape[1]
    want = rope_ref(x.double(), cos, sin, pos, interleaved)
    assert torch.equal(got[..., rd:], x[..., rd:]), f"{what}: dims past rotary_dim changed"
    err = (got[..., :rd].double() - want[..., :rd]).abs()
    bound = HALF_ULP[x.dtype] * want[..., :rd].abs() + 8 * 2.0 ** -24 * x[..., :rd].double().abs().max()
    worst = err.argmax()
    assert (err <= bound).all(), (f"{what}: max error {err.max().item():.3e} at flat index {worst.item()} "
                                  f"(bound there {bound.flatten()[worst].item():.3e})")


@DTYPES
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("shape,rotary_dim,layout", [((2, 3, 4, 40), 24, "sliced"), ((1, 2, 130, 64), 64, "contig")],
                         ids=["partial-strided", "full-260heads"])
def test_rotary_q_against_float64(dtype, interleaved, shape, rotary_dim, layout, seed):
    """rotary_q at per-row positions (pos0[b] + i: causal / local attention) and at one position per batch element
    (pos0[b]: flash-attn's convention otherwise); a strided q (rand_tensor's "sliced" layout), more heads than one
    program's block (130 heads of d64: two head blocks, the second partial)."""
    b, s, h, d = shape
    q = rand_tensor(shape, dtype, layout=layout)
    seqlen_ro = 50
    cos, sin = rotary_tables(seqlen_ro, rotary_dim, dtype)
    pos0 = torch.randint(0, seqlen_ro - s + 1, (b,), dtype=torch.int32)
    pos0[0] = seqlen_ro - s   # the table's last row is used
    for per_row in (True, False):
        out = rotary.rotary_q(q, cos, sin, pos0.to(DEVICE), per_row, interleaved)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        for i in range(b):
            pos = int(pos0[i]) + (torch.arange(s) if per_row else torch.zeros(s, dtype=torch.long))
            assert_rotated(out[i], q[i], cos, sin, pos, interleaved, f"batch element {i}, per_row={per_row}")


APPEND_CASES = [
    # contiguous cache, interleaved, rotary_dim < head dim, several new tokens
    KCase(2, 1, 2, 2, 32, fp16, capacity=40, seqlen_new=3, rotary_dim=16, interleaved=True),
    # cache_batch_idx + left padding (k rotated at its position after the padding), GPT-NeoX, bf16
    KCase(3, 1, 2, 2, 40, bf16, capacity=50, seqlen_new=2, rotary_dim=24, interleaved=False, batch_idx=True,
          leftpad=True),
    # paged (pages of 16, shuffled; appends across a page boundary) + left padding, full rotary_dim, fp32
    KCase(2, 1, 2, 1, 32, fp32, capacity=70, seqlen_new=4, rotary_dim=32, interleaved=True, page=16, leftpad=True),
    # no rotary: k and v copied
    KCase(2, 1, 2, 2, 32, fp16, capacity=40, seqlen_new=2, page=16),
]


@pytest.mark.parametrize("c", APPEND_CASES, ids=lambda c: c.id)
def test_append_kv_writes_rotated_k_and_v_in_place(c, seed):
    """append_kv alone: row cache_seqlens[b] + i of batch element b's cache (its cache_batch_idx row, or its pages
    through the block table) holds new token i, k rotated at cache_seqlens[b] - leftpad[b] + i; nothing else of
    either buffer changes (kvcache_utils.check_append)."""
    gen = torch.Generator().manual_seed(seed)
    _, k_log, v_log, seqlens, leftpad, k_new, v_new, cos, sin, _ = make_problem(c, gen)
    k_cache, table, idx = physical_cache(c, k_log, torch.Generator().manual_seed(seed + 1))
    v_cache, _, _ = physical_cache(c, v_log, torch.Generator().manual_seed(seed + 1))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    rotary.append_kv(k_new, v_new, k_cache, v_cache, seqlens.to(torch.int32).to(DEVICE), cos=cos, sin=sin,
                     interleaved=c.interleaved, leftpad=None if leftpad is None else leftpad.to(torch.int32).to(DEVICE),
                     cache_batch_idx=idx, block_table=table)
    check_append(c, k_cache, v_cache, k_before, v_before, table, idx, k_log, v_log, k_new, v_new, seqlens, leftpad,
                 cos, sin)

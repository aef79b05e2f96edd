"""Oracle of the flash_attn_with_kvcache tests (tests/test_kvcache.py, tests/test_decode.py, tests/test_rotary.py,
tests/test_dtypes_cpu.py, tests/gpu/test_varlen_kvcache_gpu.py): a problem description (KCase), its random inputs,
the cache laid out as the kernels see it (paged, batch-indexed or plain), and the float64 reference.

The oracle rebuilds what the cache must hold after the append (new k rotated in float64), gathers each batch
element's visible keys [leftpad, cache_seqlens + seqlen_new) into a dense (1, seqlen_k, nheads_k, d) problem and
runs attention_ref on it; out and lse follow the flash-attn tolerance rule (tests/attn_utils.py). The "std"
side of the rule uses q / k rotated then rounded to the input dtype, as a same-precision implementation would.
"""
import dataclasses
from typing import Optional, Tuple

import torch

from attn_utils import DEVICE, assert_within_rule, rand_alibi
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.reference.dense import attention_ref

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16


def rope_ref(x, cos, sin, pos, interleaved):
    """x (..., s, h, d) float64, pos (s,) long: rotary embedding at positions pos (first rotary_dim dims)."""
    rd = 2 * cos.shape[1]
    c = cos.double()[pos][:, None, :]
    s = sin.double()[pos][:, None, :]
    xr, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot, rest], dim=-1)


def rotary_tables(seqlen_ro, rotary_dim, dtype, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype).to(DEVICE), ang.sin().to(dtype).to(DEVICE)


@dataclasses.dataclass(frozen=True)
class KCase:
    b: int
    sq: int
    h: int
    hk: int
    d: int
    dtype: torch.dtype
    capacity: int                      # per-sequence cache capacity (positions)
    seqlen_new: int = 0                # tokens appended (k/v given) or 0 (no append)
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None
    rotary_dim: int = 0                # 0: no rotary
    interleaved: bool = True
    page: int = 0                      # 0: contiguous cache
    batch_idx: bool = False            # cache_batch_idx (contiguous only; cache has b + 2 rows)
    leftpad: bool = False
    num_splits: int = 0

    @property
    def id(self):
        dt = {fp16: "fp16", fp32: "fp32", bf16: "bf16"}[self.dtype]
        p = [f"b{self.b}", f"sq{self.sq}", f"h{self.h}", f"hk{self.hk}", f"d{self.d}", dt, f"cap{self.capacity}",
             f"new{self.seqlen_new}"]
        for flag, name in ((self.causal, "causal"), (self.window != (-1, -1), f"win{self.window[0]}_{self.window[1]}"),
                           (self.softcap, f"cap{self.softcap:g}"), (self.alibi, f"alibi-{self.alibi}"),
                           (self.rotary_dim, f"rope{self.rotary_dim}{'i' if self.interleaved else 'h'}"),
                           (self.page, f"page{self.page}"), (self.batch_idx, "bidx"), (self.leftpad, "leftpad"),
                           (self.num_splits, f"splits{self.num_splits}")):
            if flag:
                p.append(name)
        return "-".join(p)


def make_problem(c: KCase, gen: torch.Generator):
    """Random inputs and the logical (per batch element) view of the cache before the call."""
    dev = DEVICE
    q = torch.randn(c.b, c.sq, c.h, c.d, dtype=c.dtype, device=dev)
    # logical caches: (b, capacity, hk, d), filled everywhere (garbage beyond cache_seqlens must be ignored)
    k_log = torch.randn(c.b, c.capacity, c.hk, c.d, dtype=c.dtype, device=dev)
    v_log = torch.randn(c.b, c.capacity, c.hk, c.d, dtype=c.dtype, device=dev)
    hi = c.capacity - c.seqlen_new
    seqlens = torch.randint(0 if c.seqlen_new else 1, hi + 1, (c.b,), generator=gen)
    seqlens[0] = hi  # one batch element fills the cache exactly
    leftpad = None
    if c.leftpad:
        leftpad = torch.stack([torch.randint(0, int(n) + 1, (1,), generator=gen)[0] for n in seqlens])
        leftpad[-1] = 0
    k_new = v_new = None
    if c.seqlen_new:
        k_new = torch.randn(c.b, c.seqlen_new, c.hk, c.d, dtype=c.dtype, device=dev)
        v_new = torch.randn(c.b, c.seqlen_new, c.hk, c.d, dtype=c.dtype, device=dev)
    cos = sin = None
    if c.rotary_dim:
        # seqlen_ro must cover every position the cache can address (the block table's capacity if paged)
        addressable = (-(-c.capacity // c.page) + 1) * c.page if c.page else c.capacity
        cos, sin = rotary_tables(addressable + 3, c.rotary_dim, c.dtype)
    alibi = rand_alibi(c.alibi, c.b, c.h)
    return q, k_log, v_log, seqlens, leftpad, k_new, v_new, cos, sin, alibi


def physical_cache(c: KCase, k_log, gen):
    """Lay the logical cache out as the kernel sees it: paged (shuffled pages, spare pages, block table padded
    with -1), batch-indexed (extra rows, permuted), or plain. Returns (cache, block_table, cache_batch_idx)."""
    if c.page:
        per_seq = -(-c.capacity // c.page)
        num_blocks = c.b * per_seq + 3
        perm = torch.randperm(num_blocks, generator=gen)
        cache = torch.randn(num_blocks, c.page, c.hk, c.d, dtype=c.dtype, device=DEVICE)
        table = torch.full((c.b, per_seq + 1), -1, dtype=torch.int32)
        for b in range(c.b):
            for j in range(per_seq):
                blk = int(perm[b * per_seq + j])
                table[b, j] = blk
                rows = k_log[b, j * c.page:(j + 1) * c.page]
                cache[blk, :rows.shape[0]] = rows
        return cache, table.to(DEVICE), None
    if c.batch_idx:
        idx = torch.randperm(c.b + 2, generator=gen)[:c.b].to(torch.int32)
        cache = torch.randn(c.b + 2, c.capacity, c.hk, c.d, dtype=c.dtype, device=DEVICE)
        cache[idx.long()] = k_log
        return cache, None, idx.to(DEVICE)
    return k_log.clone(), None, None


def logical_from_physical(c: KCase, cache, table, idx):
    if table is not None:
        pos = torch.arange(c.capacity, device=DEVICE)
        pages = table[:, pos // c.page].long()                   # (b, capacity)
        return cache[pages, (pos % c.page).view(1, -1).expand_as(pages)]
    if idx is not None:
        return cache[idx.long()]
    return cache


def expected_cache(c: KCase, k_log, k_new, seqlens, leftpad, cos, sin, rotate: bool):
    """float64 logical cache after the append (k_new rotated when rotate)."""
    out = k_log.double().clone()
    if k_new is None:
        return out
    for b in range(c.b):
        n = int(seqlens[b])
        kn = k_new[b].double()
        if rotate and cos is not None:
            lp = 0 if leftpad is None else int(leftpad[b])
            kn = rope_ref(kn, cos, sin, torch.arange(n - lp, n - lp + c.seqlen_new), c.interleaved)
        out[b, n:n + c.seqlen_new] = kn
    return out


def reference(c: KCase, q, k_after, v_after, seqlens, leftpad, cos, sin, alibi, upcast: bool):
    """out (b, sq, h, d), lse (b, h, sq) of each batch element over its visible keys."""
    outs, lses = [], []
    for b in range(c.b):
        lp = 0 if leftpad is None else int(leftpad[b])
        end = int(seqlens[b]) + c.seqlen_new
        qb = q[b:b + 1].double()
        if cos is not None:
            # local as flash-attn decides it: causal, or a window edge below the cache's addressable positions (an
            # edge at or past them is dropped)
            addressable = (-(-c.capacity // c.page) + 1) * c.page if c.page else c.capacity
            local = c.causal or any(0 <= w < addressable for w in c.window)
            pos = torch.arange(c.sq) + (int(seqlens[b]) - lp) if local else torch.full((c.sq,), int(seqlens[b]) - lp)
            qb = rope_ref(qb, cos, sin, pos, c.interleaved)
        kb, vb = k_after[b:b + 1, lp:end], v_after[b:b + 1, lp:end]
        if not upcast:
            qb, kb, vb = qb.to(c.dtype), kb.to(c.dtype), vb.to(c.dtype)
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b:b + 1])
        o, l_, _ = attention_ref(qb, kb, vb, causal=c.causal, window_size=c.window, softcap=c.softcap,
                                 alibi_slopes=slopes, upcast=upcast)
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs), torch.cat(lses)


def check_append(c: KCase, k_cache, v_cache, k_before, v_before, table, idx, k_log, v_log, k_new, v_new, seqlens,
                 leftpad, cos, sin):
    """The caches after an append of k_new / v_new (None: no append) into k_cache / v_cache (laid out by
    physical_cache, k_before / v_before their copies from before): the appended rows hold the new v and the new k
    rotated (within a rounding of the float64 rotation), every other logical position is untouched, and nothing
    outside the logical cache was written (spare pages, other cache rows). Returns the float64 logical caches
    expected after the append (k_exp, v_exp)."""
    k_exp = expected_cache(c, k_log, k_new, seqlens, leftpad, cos, sin, rotate=True)
    v_exp = expected_cache(c, v_log, v_new, seqlens, leftpad, cos, sin, rotate=False)
    k_got = logical_from_physical(c, k_cache, table, idx)
    v_got = logical_from_physical(c, v_cache, table, idx)
    written = torch.zeros(c.b, c.capacity, dtype=torch.bool)
    for b in range(c.b):
        written[b, int(seqlens[b]):int(seqlens[b]) + c.seqlen_new] = True
    written = written.to(DEVICE)
    assert torch.equal(k_got[~written], k_log[~written]) and torch.equal(v_got[~written], v_log[~written]), \
        f"cache positions outside the append changed [{c.id}]"
    assert torch.equal(v_got[written], v_new.reshape(-1, c.hk, c.d) if v_new is not None else v_got[written])
    if k_new is not None:
        tol = {fp16: 2e-3, bf16: 1.6e-2, fp32: 1e-6}[c.dtype]
        torch.testing.assert_close(k_got[written].double(), k_exp[written], rtol=tol, atol=tol)
    # physical buffers: no write outside the logical cache (spare pages / other cache rows intact)
    touched = ((k_cache != k_before) | (v_cache != v_before)).any(dim=(-1, -2))
    if table is not None:
        used_pages = set(int(x) for x in table.flatten().tolist() if x >= 0)
        pages_touched = set(touched.any(dim=1).nonzero().flatten().tolist())
        assert pages_touched <= used_pages, f"pages outside the block table were written [{c.id}]"
    elif idx is not None:
        rows_touched = set(touched.any(dim=1).nonzero().flatten().tolist())
        assert rows_touched <= set(idx.tolist()), f"cache rows outside cache_batch_idx were written [{c.id}]"
    return k_exp, v_exp


def run_case(c: KCase, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k_log, v_log, seqlens, leftpad, k_new, v_new, cos, sin, alibi = make_problem(c, gen)
    k_cache, table, idx = physical_cache(c, k_log, torch.Generator().manual_seed(seed + 1))
    v_cache, _, _ = physical_cache(c, v_log, torch.Generator().manual_seed(seed + 1))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=seqlens.to(torch.int32).to(DEVICE), cache_batch_idx=idx,
        cache_leftpad=None if leftpad is None else leftpad.to(torch.int32).to(DEVICE), block_table=table,
        causal=c.causal, window_size=c.window, softcap=c.softcap, rotary_interleaved=c.interleaved,
        alibi_slopes=alibi, num_splits=c.num_splits, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (c.b, c.h, c.sq)

    # the cache: appended rows hold the (rotated) new k / v, every other position is untouched
    k_exp, v_exp = check_append(c, k_cache, v_cache, k_before, v_before, table, idx, k_log, v_log, k_new, v_new,
                                seqlens, leftpad, cos, sin)

    # attention over the cache
    ref = reference(c, q, k_exp, v_exp.double(), seqlens, leftpad, cos, sin, alibi, upcast=True)
    k_std = k_exp.to(c.dtype)   # rotated then rounded, like any same-precision implementation
    std = reference(c, q, k_std, v_exp.to(c.dtype), seqlens, leftpad, cos, sin, alibi, upcast=False)
    assert_within_rule("out", out, ref[0], std[0], c.dtype, f"[{c.id}]")
    assert_within_rule("softmax_lse", lse, ref[1], std[1], c.dtype, f"[{c.id}]")
    return out, lse

"""The argument model: one frozen description of an attention problem, built by one validator.

Every entry point (dense, packed, varlen, KV cache, FP8, flex / bias / mask / block-sparse, ring) describes its
call as a Problem through the functions below, which check every argument before any kernel runs and raise
ArgumentError naming the argument. The custom ops carry a Problem packed into two lists (Problem.pack /
Problem.unpack), and dispatch picks a kernel from it. The checks of a repeated call (a training or decode loop)
are remembered per argument signature (memoised), so they cost a dictionary lookup after the first call.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ..kernels.params import AttnParams
from . import checks
from .errors import fail

# --------------------------------------------------------------------------------------------------
# The problem
# --------------------------------------------------------------------------------------------------
DENSE, VARLEN, KVCACHE = "dense", "varlen", "kvcache"
# Problem.pad_q / pad_k of a varlen call: every row of the packed buffer belongs to a sequence (NO_PAD), rows from
# n >= 0 on are padding (cu_seqlens[-1] = n < total), or cu_seqlens' values were not read (PAD_UNKNOWN)
NO_PAD, PAD_UNKNOWN = -1, -2


@dataclass(frozen=True)
class Problem:
    """A validated attention problem.

    Shapes: q (batch, seqlen_q, nheads, head_dim) dense, (total_q, nheads, head_dim) varlen (seqlen_q is then
    max_seqlen_q, and likewise for k); k / v (.., seqlen_k, nheads_k, head_dim).
    params: the kernels' scalars (scale, the mask as a bottom-right aligned window, softcap, dropout_p) with
    is_causal / is_local derived there once.
    Features: alibi (slopes given), bias / mask (attn_bias / attn_mask given), sparse_block (a block mask's
    block size, 0: none), mod_key (flashtile.flex's registered score_mod / mask_mod, 0: none).
    Output requests: return_probs, bias_grad (attn_bias receives a gradient), mod_grad_bits (bit i: the
    score_mod's captured tensor i receives one), deterministic (bitwise reproducible backward).
    KV cache (flash_attn_with_kvcache): seqlen_k is the capacity, page_size the paged cache's page (0: contiguous),
    seqlen_new the tokens appended before attending.
    Varlen: pad_q / pad_k say which rows of the packed q / k buffers follow the last sequence (NO_PAD, the first
    such row, or PAD_UNKNOWN): their outputs and gradients are zeros."""
    layout: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: torch.dtype
    params: AttnParams
    alibi: bool = False
    deterministic: bool = False
    return_probs: bool = False
    bias: bool = False
    mask: bool = False
    sparse_block: int = 0
    mod_key: int = 0
    bias_grad: bool = False
    mod_grad_bits: int = 0
    pad_q: int = NO_PAD
    pad_k: int = NO_PAD
    # KV cache: seqlen_k is the cache capacity (positions a batch element can hold); page_size > 0: paged
    page_size: int = 0
    seqlen_new: int = 0   # tokens appended before attending
    # what kernels.dispatch decided for this problem (its plans), kept with it: not part of its value, and not an
    # init field, so that dataclasses.replace gives a problem of other lengths or features a cache of its own
    cache: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    @property
    def varlen(self) -> bool:
        return self.layout == VARLEN

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA / MQA)."""
        return self.nheads // self.nheads_k

    @property
    def padded_q(self) -> bool:
        """Varlen: rows of the packed q may belong to no sequence (pad_q is a row, or the values were not read)."""
        return self.varlen and self.pad_q != NO_PAD

    def with_padding(self, pad_q: int, pad_k: int) -> "Problem":
        """This problem with pad_q / pad_k, one object per pair (kept in this problem's cache, at most MEMO_MAX
        pairs), so that a loop over padded packed batches keeps its plans."""
        if (pad_q, pad_k) == (self.pad_q, self.pad_k):
            return self
        return self._kept("padding", pad_q=pad_q, pad_k=pad_k)

    def with_features(self, **fields) -> "Problem":
        """This problem with the feature fields a call adds to its checked shapes (bias, mask, sparse_block,
        mod_key, bias_grad, mod_grad_bits), one object per set of values (kept in this problem's cache, at most
        MEMO_MAX), so that a loop of masked or biased calls keeps its plans."""
        return self._kept("features", **fields)

    def _kept(self, slot: str, **fields) -> "Problem":
        """replace(self, **fields), made once per value of fields and kept in self.cache[slot]."""
        kept = self.cache.setdefault(slot, {})
        key = tuple(fields.items())
        p = kept.get(key)
        if p is None:
            if len(kept) >= MEMO_MAX:
                kept.clear()
            p = kept[key] = replace(self, **fields)
        return p

    @property
    def plain(self) -> bool:
        """No per-element feature beyond the window: no ALiBi, bias, mask, block mask or user mod."""
        return not (self.alibi or self.bias or self.mask or self.sparse_block or self.mod_key)

    # The custom ops' scalar arguments: (ints, floats). Tensors travel as the ops' tensor arguments; the sizes
    # that tensors give (batch, heads, head_dim, dtype) are read back from them.
    _INTS = ("seqlen_q", "seqlen_k", "alibi", "deterministic", "return_probs", "bias", "mask", "sparse_block",
             "mod_key", "bias_grad", "mod_grad_bits", "pad_q", "pad_k")

    def pack(self) -> tuple:
        p = self.params
        ints = [int(self.layout == VARLEN), p.window_left, p.window_right] + [int(getattr(self, f)) for f in self._INTS]
        return ints, [p.softmax_scale, p.softcap, p.dropout_p]

    @classmethod
    def unpack(cls, q: torch.Tensor, k: torch.Tensor, ints, floats, batch: int, v=None) -> "Problem":
        """The Problem that pack() gave these lists, for q, k (and v) of these shapes and strides: one object per
        such call (memoised), so that the plans a problem keeps (Problem.cache) serve the ops' calls as they serve
        eager ones (a compiled graph calls the ops with the same arguments step after step)."""
        return memoised(_UNPACKED, (tuple(ints), tuple(floats), batch, q, k, v), cls._unpack)

    @classmethod
    def _unpack(cls, ints, floats, batch, q, k, v) -> "Problem":
        varlen, left, right, *rest = ints
        fields = dict(zip(cls._INTS, rest))
        for name in ("alibi", "deterministic", "return_probs", "bias", "mask", "bias_grad"):
            fields[name] = bool(fields[name])
        params = AttnParams(floats[0], left, right, floats[1], floats[2])
        return cls(VARLEN if varlen else DENSE, batch, nheads=q.shape[-2], nheads_k=k.shape[-2],
                   head_dim=q.shape[-1], dtype=q.dtype, params=params, **fields)


# --------------------------------------------------------------------------------------------------
# Memo of passed checks
# --------------------------------------------------------------------------------------------------
def signature(args) -> tuple:
    """What argument checks read of their arguments: each tensor's shape, strides, dtype and device; anything else's
    type and value (None as itself). A tensor subclass gives an unhashable part (a list), as does an unhashable value
    (a list window_size, say): then there is no key."""
    T = torch.Tensor
    return tuple([(x.shape, x.stride(), x.dtype, x.device) if type(x) is T else x if x is None
                  else [] if isinstance(x, T) else (type(x), x) for x in args])


MEMO_MAX = 1024   # entries per memo
_UNPACKED: dict = {}   # Problem.unpack's memo


def memoised(cache: dict, args: tuple, check, keep=None):
    """check(*args), remembered in cache per signature(args): a training or decode loop repeats one signature, and
    the checks cost more host time than the lookup. Only what passed is remembered (keep(result) is what is kept and
    returned, if given); no memo (and no keep) for an unhashable signature or while torch.compile traces (no global
    state for the tracer)."""
    try:
        if torch.compiler.is_compiling():
            raise TypeError
        key = signature(args)
        hit = cache.get(key)   # TypeError if unhashable
    except TypeError:
        key = hit = None
    if hit is None:
        hit = check(*args)
        if key is not None:
            if keep is not None:
                hit = keep(hit)
            if len(cache) >= MEMO_MAX:
                cache.clear()
            cache[key] = hit
    return hit


def scalars(window_size, *flags):
    """window_size and the bool flags (name, value) normalised before they key a memo: a tensor window's values
    are not part of a signature, and `causal=np.True_` must key like True. The common case (a tuple of two ints
    >= -1, plain bools) costs a few type checks."""
    if not (type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and window_size[0] >= -1 and window_size[1] >= -1):
        window_size = checks.window(window_size)
    return (window_size, *[v if type(v) is bool else checks.flag(n, v) for n, v in flags])


def number(name: str, value, expected: str = "a finite float"):
    """A float argument (softmax_scale, softcap, dropout_p) as a memo keys it: a tensor's value is not part of a
    signature, so one-element tensors and numpy scalars become Python floats first (None and Python numbers pass
    as they are, checked by the validator)."""
    if value is None or type(value) is float or type(value) is int:
        return value
    return checks.real(name, value, expected)


def contiguous_last(*ts):
    """The tensors with a contiguous last dimension (the kernels read rows of head_dim elements): one with another
    stride is copied, as flash-attn does (maybe_contiguous)."""
    strided = [isinstance(t, torch.Tensor) and t.dim() and t.stride(-1) != 1 for t in ts]
    if not any(strided):   # (the common case: the tensors as they are)
        return ts
    return tuple(t.contiguous() if s else t for t, s in zip(ts, strided))


# --------------------------------------------------------------------------------------------------
# The validator
# --------------------------------------------------------------------------------------------------
def qkv(q, k, v, dims: int, dtypes=checks.FLOAT_DTYPES, what: str = "float16, bfloat16 or float32"):
    """q / k / v: tensors of one dtype and device with matching batch (dense), seqlen_k, heads (GQA) and head dim."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, t, dims, dtypes, what)
    if not (q.dtype == k.dtype == v.dtype):
        fail("k.dtype/v.dtype", (k.dtype, v.dtype), f"the dtype of q ({q.dtype})")
    if not (q.device == k.device == v.device):
        fail("k.device/v.device", (k.device, v.device), f"the device of q ({q.device})")
    if dims == 4 and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        fail("k.shape[0]/v.shape[0] (batch)", (k.shape[0], v.shape[0]), f"q's batch {q.shape[0]}")
    if k.shape[-3] != v.shape[-3]:
        fail("v.shape[-3] (seqlen_k)", v.shape[-3], f"k's seqlen {k.shape[-3]}")
    h, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if v.shape[-2] != hk:
        fail("v.shape[-2] (nheads_k)", v.shape[-2], f"k's nheads {hk}")
    if hk == 0 or h % hk != 0:
        fail("k.shape[-2] (nheads_k)", hk, f"a divisor of nheads = {h} (GQA/MQA)")
    if k.shape[-1] != d or v.shape[-1] != d:
        fail("k.shape[-1]/v.shape[-1] (headdim)", (k.shape[-1], v.shape[-1]), f"q's headdim {d}")
    if not 1 <= d <= checks.MAX_HEADDIM:
        fail("q.shape[-1] (headdim)", d, f"1 <= headdim <= {checks.MAX_HEADDIM}")


def attn_params(head_dim: int, seqlen_q: Optional[int], seqlen_k: int, dropout_p, softmax_scale, causal: bool,
                window, softcap) -> AttnParams:
    """The scalar arguments checked and normalised: softmax_scale defaults to 1/sqrt(head_dim); causal sets the
    right window edge to 0; a window edge that masks nothing at these lengths (left >= seqlen_k; right >= seqlen_k
    with seqlen_q <= seqlen_k) becomes unbounded, as flash-attn normalises it. seqlen_k: the longest key sequence;
    seqlen_q None: lengths vary per sequence (varlen), so the right edge is kept."""
    dropout_p = checks.real("dropout_p", dropout_p, "a float in [0, 1)")
    if not 0.0 <= dropout_p < 1.0:
        fail("dropout_p", dropout_p, "a float in [0, 1)")
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    else:
        softmax_scale = checks.real("softmax_scale", softmax_scale, "a finite float or None")
    # softcap <= 0 is off (flash-attn applies it only when > 0)
    softcap = max(checks.real("softcap", softcap, "a finite float (softcap > 0 caps the scores, else off)"), 0.0)
    left, right = (max(w, -1) for w in window)   # any negative edge is unbounded
    if causal:
        right = 0
    if left >= seqlen_k > 0:
        left = -1
    if seqlen_q is not None and right >= seqlen_k > 0 and seqlen_q <= seqlen_k:
        right = -1
    return AttnParams(float(softmax_scale), left, right, softcap, float(dropout_p))


def _alibi(alibi_slopes, nheads: int, batch: int, device) -> bool:
    if alibi_slopes is None:
        return False
    if not isinstance(alibi_slopes, torch.Tensor):
        fail("alibi_slopes", type(alibi_slopes).__name__, "a torch.Tensor or None")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        fail("alibi_slopes.shape", tuple(alibi_slopes.shape), f"({nheads},) or ({batch}, {nheads})")
    if alibi_slopes.dtype != torch.float32:
        fail("alibi_slopes.dtype", alibi_slopes.dtype, "torch.float32")
    checks.same_device("alibi_slopes", alibi_slopes, device)
    if alibi_slopes.stride(-1) != 1:
        fail("alibi_slopes.stride(-1)", alibi_slopes.stride(-1), "1")
    return True


def dense(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
          return_probs) -> Problem:
    """q (batch, seqlen_q, nheads, d), k / v (batch, seqlen_k, nheads_k, d). window, causal, deterministic,
    return_probs as scalars() returns them."""
    qkv(q, k, v, 4)
    batch, sq, h, d = q.shape
    sk = k.shape[1]
    params = attn_params(d, sq, sk, dropout_p, softmax_scale, causal, window, softcap)
    alibi = _alibi(alibi_slopes, h, batch, q.device)
    return Problem(DENSE, batch, sq, sk, h, k.shape[2], d, q.dtype, params, alibi=alibi,
                   deterministic=deterministic, return_probs=return_probs)


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
           window, softcap, alibi_slopes, deterministic, return_probs) -> Problem:
    """Packed sequences: q (total_q, nheads, d), k / v (total_k, nheads_k, d), cu_seqlens (batch + 1,) int32.
    Shapes only: varlen_values() checks what cu_seqlens hold."""
    qkv(q, k, v, 3)
    batch = checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch=batch)
    max_sq = checks.integer("max_seqlen_q", max_seqlen_q, 0)
    max_sk = checks.integer("max_seqlen_k", max_seqlen_k, 0)
    h, d = q.shape[1], q.shape[2]
    params = attn_params(d, None, max_sk, dropout_p, softmax_scale, causal, window, softcap)
    alibi = _alibi(alibi_slopes, h, batch, q.device)
    return Problem(VARLEN, batch, max_sq, max_sk, h, k.shape[1], d, q.dtype, params, alibi=alibi,
                   deterministic=deterministic, return_probs=return_probs)


# --------------------------------------------------------------------------------------------------
# Value checks (they read device memory: one synchronisation)
# --------------------------------------------------------------------------------------------------
# On by default (a bad index would otherwise read or write outside a buffer); FLASHTILE_CHECK_VALUES=0 or setting
# this to False turns them off for serving loops that guarantee their indices. They are skipped while a CUDA graph
# is being captured or torch.compile traces.
CHECK_VALUES = os.environ.get("FLASHTILE_CHECK_VALUES", "1") not in ("0", "")


def values_readable(t: torch.Tensor) -> bool:
    """Whether t's values can be read on the host now: not while torch.compile traces (a traced tensor has no values)
    nor while a CUDA graph is captured (a read synchronises). Code that reads values to choose a path (a check, an
    unpadding) takes a path with static shapes instead where this is False."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


def values_checkable(t: torch.Tensor) -> bool:
    """Whether reading index values now is allowed (and wanted)."""
    return CHECK_VALUES and values_readable(t)


def remembered(memo: dict, tensors: tuple, scalars: tuple, compute, limit: int = MEMO_MAX):
    """compute() (which reads the tensors' values, or derives tensors from them), remembered in memo for these
    tensors and scalars until one of the tensors is modified in place (its version counter) or freed: then the
    entry goes (a weak reference's callback), and with it whatever device memory its result holds. A memo past
    `limit` entries is emptied. Keys: the scalars (the first names the use), then the tensors' ids."""
    key = (*scalars, *map(id, tensors))
    seen = memo.get(key)
    if (seen is not None and all(ref() is t for ref, t in zip(seen[0], tensors))
            and seen[1] == tuple(t._version for t in tensors)):
        return seen[2]
    result = compute()
    if len(memo) >= limit:
        memo.clear()
    forget = lambda _ref, key=key: memo.pop(key, None)   # noqa: E731  (a freed tensor's entry)
    memo[key] = (tuple(weakref.ref(t, forget) for t in tensors), tuple(t._version for t in tensors), result)
    return result


# values read from index tensors (remembered): a model's layers pass one cu_seqlens (seqused) tensor to every
# attention call of a step, which then reads its values once, not once per layer
_CU_CHECKED: dict = {}


def cu_seqlens_values(name: str, cu: torch.Tensor, total: Optional[int], max_seqlen: int, max_name: str) -> int:
    """cu_seqlens start at 0, do not decrease, end at most at `total` (the rows of the packed tensor; tokens after
    the last sequence are padding, as flash-attn allows), and no sequence is longer than max_seqlen. Returns the
    padding rows' start as Problem.pad_q / pad_k take it. A tensor checked before, not modified since (its version
    counter), with the same total and max_seqlen, is not read again."""
    if not values_checkable(cu):
        return PAD_UNKNOWN
    return remembered(_CU_CHECKED, (cu, ), ("cu_seqlens", total, max_seqlen),
                      lambda: _cu_seqlens_values(name, cu, total, max_seqlen, max_name))


def seqused_values(name: str, used: torch.Tensor, cu: torch.Tensor) -> None:
    """Each seqused entry within its slot: 0 <= seqused[b] <= cu[b + 1] - cu[b] (read where values are readable;
    a pair checked before, neither modified since, is not read again)."""
    def check():
        lens = (cu[1:] - cu[:-1]).tolist()
        for b, (n, room) in enumerate(zip(used.tolist(), lens)):
            if not 0 <= n <= room:
                fail(f"{name}[{b}]", n, f"between 0 and the sequence's rows in cu_seqlens ({room})")
    if values_checkable(used):
        remembered(_CU_CHECKED, (used, cu), ("seqused", ), check)


def _cu_seqlens_values(name: str, cu: torch.Tensor, total: Optional[int], max_seqlen: int, max_name: str) -> int:
    vals = cu.tolist()
    if vals[0] != 0:
        fail(f"{name}[0]", vals[0], "0")
    lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if min(lens) < 0:
        i = lens.index(min(lens))
        fail(name, vals if len(vals) <= 16 else f"... [{i}]={vals[i]}, [{i + 1}]={vals[i + 1]} ...",
             f"non-decreasing values (sequence {i} has length {lens[i]})")
    if total is not None and vals[-1] > total:
        fail(f"{name}[-1]", vals[-1], f"at most the number of packed tokens {total}")
    if max(lens) > max_seqlen:
        fail(max_name, max_seqlen, f">= the longest sequence in {name} ({max(lens)})")
    return NO_PAD if total is None or vals[-1] == total else vals[-1]


# --------------------------------------------------------------------------------------------------
# Additive bias and bool mask
# --------------------------------------------------------------------------------------------------
def bias_mask(q, k, attn_bias, attn_mask):
    """attn_bias / attn_mask of a dense call, as 4-D views broadcastable to (batch, nheads, seqlen_q, seqlen_k)
    (leading size-1 dimensions added, nothing copied)."""
    target = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    expected = f"broadcastable to (batch, nheads, seqlen_q, seqlen_k) = {target}"
    out = []
    for name, t, dtypes, what in (("attn_bias", attn_bias, checks.FLOAT_DTYPES, "float16, bfloat16 or float32"),
                                  ("attn_mask", attn_mask, (torch.bool,), "torch.bool (True = may attend)")):
        if t is None:
            out.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            fail(name, type(t).__name__, "a torch.Tensor or None")
        if t.dtype not in dtypes:
            fail(f"{name}.dtype", t.dtype, what)
        checks.same_device(name, t, q.device)
        if not 1 <= t.dim() <= 4:
            fail(f"{name}.shape", tuple(t.shape), expected)
        t4 = t[(None,) * (4 - t.dim())]
        if any(n not in (1, m) for n, m in zip(t4.shape, target)):
            fail(f"{name}.shape", tuple(t.shape), expected)
        out.append(t4)
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# KV cache (flash_attn_with_kvcache)
# --------------------------------------------------------------------------------------------------
def _writes_alias(name: str, cache: torch.Tensor) -> bool:
    """Whether distinct positions of a cache share memory (an expand over the batch, a stride-0 view): appending
    into it would write one element from several programs."""
    return cache.numel() > 1 and torch._debug_has_internal_overlap(cache) == 1


def kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, no_seqlens: bool, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal: bool, window, softcap, rotary_interleaved: bool, alibi_slopes,
            num_splits, return_softmax_lse: bool) -> Problem:
    """Every check of flash_attn_with_kvcache that reads no device memory: q (batch, seqlen_q, nheads, d); the
    cache (batch_cache, capacity, nheads_k, d) or paged (num_blocks, page_size, nheads_k, d) with block_table
    (batch, max_blocks) int32; k / v (batch, seqlen_new, nheads_k, d) to append; rotary tables
    (seqlen_ro, rotary_dim / 2). kvcache_values() checks the index tensors' values."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.tensor(name, t, 4)
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    page = 0
    if block_table is not None:
        checks.index_tensor("block_table", block_table, (batch, None), device)
        if block_table.numel() > 0 and block_table.stride(-1) != 1:
            fail("block_table.stride(-1)", block_table.stride(-1), "1 (contiguous rows)")
        page = k_cache.shape[1]
        if page < 1:
            fail("k_cache.shape[1] (page_block_size)", page, ">= 1")
        if tuple(v_cache.shape[:2]) != tuple(k_cache.shape[:2]):
            fail("v_cache.shape[:2]", tuple(v_cache.shape[:2]), f"k_cache's (num_blocks, page_block_size) "
                 f"{tuple(k_cache.shape[:2])}")
        capacity = block_table.shape[1] * page
        if cache_batch_idx is not None:
            fail("cache_batch_idx", "a tensor", "None with block_table (the block table already maps each batch "
                 "element to its pages)")
    else:
        if tuple(v_cache.shape[:2]) != tuple(k_cache.shape[:2]):
            fail("v_cache.shape[:2]", tuple(v_cache.shape[:2]), f"k_cache's {tuple(k_cache.shape[:2])}")
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            checks.index_tensor("cache_batch_idx", cache_batch_idx, (batch,), device)
        elif k_cache.shape[0] != batch:
            fail("k_cache.shape[0] (batch_cache)", k_cache.shape[0], f"q's batch {batch} (or pass cache_batch_idx)")
    if k_cache.shape[0] < 1:
        fail("k_cache.shape[0]", k_cache.shape[0], ">= 1")
    # q against the cache as flash_attn_func checks q against k / v (dtypes, heads, head dim): views of the cache
    # with q's batch size
    qkv(q, k_cache[:1].expand(batch, *k_cache.shape[1:]), v_cache[:1].expand(batch, *v_cache.shape[1:]), 4)
    nheads_k = k_cache.shape[2]
    if (k is None) != (v is None):
        fail("k/v", (k is None, v is None), "both given (to append) or both None")
    seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            checks.tensor(name, t, 4)
        want = (batch, k.shape[1], nheads_k, head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                fail(f"{name}.shape", tuple(t.shape), f"(batch, seqlen_new, nheads_k, headdim) = {want}")
            if t.dtype != k_cache.dtype:
                fail(f"{name}.dtype", t.dtype, f"the cache dtype {k_cache.dtype}")
            checks.same_device(name, t, device)
        seqlen_new = k.shape[1]
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if _writes_alias(name, cache):
                fail(f"{name}.stride()", cache.stride(), f"strides under which no two positions of {name} share "
                     "memory when k/v are appended (an expand over the batch would be written by every batch "
                     "element)")
        if no_seqlens:
            fail("cache_seqlens", None, "the current cache lengths when k/v are appended (flash-attn semantics)")
    _rotary(rotary_cos, rotary_sin, q, k, head_dim, capacity)
    if cache_leftpad is not None:
        checks.index_tensor("cache_leftpad", cache_leftpad, (batch,), device)
    checks.integer("num_splits", num_splits)   # (< 1: chosen automatically, as flash-attn does)
    # (seqlen_q queries end each sequence's keys, at most capacity of them: a window edge at or past the capacity
    # masks nothing and is dropped, as flash-attn drops it; a call without causal or an edge left is then not local,
    # and rotates every query row at one position)
    params = attn_params(head_dim, seqlen_q, capacity, 0.0, softmax_scale, causal, window, softcap)
    alibi = _alibi(alibi_slopes, nheads, batch, device)
    return Problem(KVCACHE, batch, seqlen_q, capacity, nheads, nheads_k, head_dim, q.dtype, params, alibi=alibi,
                   page_size=page, seqlen_new=seqlen_new)


def _rotary(rotary_cos, rotary_sin, q, k, head_dim: int, capacity: int) -> None:
    if (rotary_cos is None) != (rotary_sin is None):
        fail("rotary_cos/rotary_sin", (rotary_cos is None, rotary_sin is None), "both given or both None")
    if rotary_cos is None:
        return
    if k is None:
        fail("k", None, "new keys/values to append when rotary_cos/rotary_sin are given (flash-attn semantics: the "
             "rotary embedding is applied to q and the new k)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            fail(name, type(t).__name__, "a torch.Tensor")
        if t.dim() != 2:
            fail(f"{name}.dim()", t.dim(), "2: (seqlen_ro, rotary_dim / 2)")
        if t.dtype not in checks.FLOAT_DTYPES:
            fail(f"{name}.dtype", t.dtype, "float16, bfloat16 or float32")
        checks.same_device(name, t, q.device)
        if t.numel() > 0 and t.stride(-1) != 1:
            fail(f"{name}.stride(-1)", t.stride(-1), "1")
    if rotary_sin.shape != rotary_cos.shape:
        fail("rotary_sin.shape", tuple(rotary_sin.shape), f"rotary_cos's shape {tuple(rotary_cos.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if not 2 <= rotary_dim <= head_dim:
        fail("rotary_cos.shape[1] (rotary_dim / 2)", rotary_cos.shape[1], f"1 .. headdim / 2 = {head_dim // 2}")
    if rotary_cos.shape[0] < capacity:
        fail("rotary_cos.shape[0] (seqlen_ro)", rotary_cos.shape[0], f">= the cache capacity {capacity} (every "
             "position a token can be written to)")


def rotary_positions_end(p: Problem, seqlen_q: int) -> int:
    """How many positions past a batch element's first new token the rotary tables are read at: the new k rows
    (seqlen_new), and q's rows, each at its own position when the attention is causal or local (flash-attn's
    convention), else all at the first."""
    q_rows = seqlen_q if (p.params.has_left or p.params.has_right) else 1
    return max(p.seqlen_new, q_rows)


def kvcache_values(p: Problem, q, k_cache, cache_seqlens, static_end, cache_leftpad, cache_batch_idx, block_table,
                   rotary_cos) -> None:
    """The index tensors' values (one synchronisation; skipped where values_checkable says so, except what needs no
    device memory): cache lengths within the capacity, left padding within the lengths, cache_batch_idx within the
    cache (and distinct when appending: two batch elements would write one cache row), every page a sequence uses
    a block of the cache and no page written by one batch element used by another, every rotary position inside
    the cos / sin tables."""
    capacity, seqlen_new = p.seqlen_k, p.seqlen_new
    batch = q.shape[0]
    rotary_reach = rotary_positions_end(p, q.shape[1]) if rotary_cos is not None else 0   # (rotary: k is appended)
    if not values_checkable(q):
        if rotary_cos is not None and capacity - seqlen_new + rotary_reach > rotary_cos.shape[0]:
            # the lengths are not read: the last position any length within the capacity would rotate at
            fail("rotary_cos.shape[0] (seqlen_ro)", rotary_cos.shape[0],
                 f">= {capacity - seqlen_new + rotary_reach}: with seqlen_q = {q.shape[1]} > seqlen_new = "
                 f"{seqlen_new} under a causal or local mask, q's rows are rotated at up to cache_seqlens + seqlen_q "
                 "- 1, and cache_seqlens' values are not checked (FLASHTILE_CHECK_VALUES=0, CUDA graph capture or "
                 "torch.compile)")
        return
    if static_end is None:
        if bool((cache_seqlens < 0).any()):
            fail("cache_seqlens", cache_seqlens.tolist(), "values >= 0")
        end = cache_seqlens.long() + seqlen_new
        if bool((end > capacity).any()):
            fail("cache_seqlens", cache_seqlens.tolist(), f"cache_seqlens + seqlen_new ({seqlen_new}) <= "
                 f"{capacity_name(p)}")
    else:
        end = torch.full((batch,), static_end, dtype=torch.long, device=q.device)
    if cache_leftpad is not None and bool(((cache_leftpad < 0) | (cache_leftpad > end - seqlen_new)).any()):
        fail("cache_leftpad", cache_leftpad.tolist(), "values in [0, cache_seqlens]")
    if rotary_cos is not None:
        start = end - seqlen_new - (0 if cache_leftpad is None else cache_leftpad.long())
        reach = int((start + rotary_reach).max())
        if reach > rotary_cos.shape[0]:
            _rotary_fail(rotary_cos, reach - rotary_reach, rotary_reach)
    if cache_batch_idx is not None:
        if bool(((cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0])).any()):
            fail("cache_batch_idx", cache_batch_idx.tolist(), f"values in [0, {k_cache.shape[0]}) "
                 "(k_cache.shape[0])")
        if seqlen_new and torch.unique(cache_batch_idx).numel() != batch:
            fail("cache_batch_idx", cache_batch_idx.tolist(), "distinct values when k/v are appended (two batch "
                 "elements would write the same cache row)")
    if block_table is not None:
        _block_table_values(block_table, end, p.page_size, k_cache.shape[0], seqlen_new)


def capacity_name(p: Problem) -> str:
    """The cache capacity as an error message names it (a paged cache's is block_table's pages)."""
    if p.page_size:
        return (f"the pages block_table maps: block_table.shape[1] * page_block_size = "
                f"{p.seqlen_k // p.page_size} * {p.page_size} = {p.seqlen_k}")
    return f"the cache capacity k_cache.shape[1] = {p.seqlen_k}"


def _rotary_fail(rotary_cos, start: int, reach: int):
    fail("rotary_cos.shape[0] (seqlen_ro)", rotary_cos.shape[0],
         f">= {start + reach}: a batch element's first new token is at position {start} and the rotary embedding "
         f"is read at {reach} positions from there (the new k, and q's rows under a causal or local mask)")


def _block_table_values(block_table: torch.Tensor, end: torch.Tensor, page: int, num_blocks: int,
                        seqlen_new: int) -> None:
    """Every page a sequence uses (positions < end[b]) indexes a block of the cache; a page that a batch element
    appends into is used by no other (batch element, page slot) pair."""
    if block_table.numel() == 0:
        return
    slots = torch.arange(block_table.shape[1], device=block_table.device).view(1, -1)
    used = slots * page < end.view(-1, 1)
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0].tolist())
        fail(f"block_table[{b}, {j}]", int(block_table[b, j]), f"a block index in [0, {num_blocks}) (num_blocks = "
             f"k_cache.shape[0]) for the pages cache_seqlens (+ new tokens) reach")
    if not seqlen_new:
        return
    written = used & ((slots + 1) * page > (end - seqlen_new).view(-1, 1))
    users = torch.zeros(num_blocks, dtype=torch.int32, device=block_table.device)
    users.index_add_(0, block_table[used].long(), torch.ones_like(block_table[used]))
    shared = written & (users[block_table.clamp(0, num_blocks - 1).long()] > 1)
    if bool(shared.any()):
        b, j = (int(x) for x in shared.nonzero()[0].tolist())
        fail(f"block_table[{b}, {j}]", int(block_table[b, j]), "a page that no other batch element (or page slot) "
             f"uses: batch element {b} appends into it, so every user of the page would see the write")

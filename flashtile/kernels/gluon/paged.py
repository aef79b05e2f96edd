"""Host side of the Gluon paged decode (_decode.paged_decode_kernel): which decode calls it takes, and its launch.

kernels/dispatch.flash_decode hands a paged call here first (decode_paged); everything this kernel does not cover
goes on to the Triton decode kernel (triton/decode.py), which covers every case.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import relaunch
from ..runtime import DescriptorType, descriptor_fields
from . import fa3

# page size (keys) -> (BLOCK_N keys per tile, STAGES) of the pages this kernel reads: 64-key tiles and 3 stages (104
# KB of shared memory at d128: two programs per SM); pages of 64 and more stay with the Triton kernel's one-page TMA
# tiles (chosen by the decode grid with paged.OVERRIDE pinning block_n / stages: `git log -S PAGE_CONFIGS`)
PAGE_CONFIGS = {16: (64, 3), 32: (64, 3)}
HEAD_DIMS = (64, 128)
MAX_ROWS = 64          # seqlen_q x (nheads / nheads_k): wgmma's M
# Benchmarks pin the path here: "on": False sends every call to the Triton kernel; "block_n", "stages",
# "num_splits" replace the table's / the split rule's choice. Empty in normal use.
OVERRIDE: dict = {}


def _on_gpu(q: torch.Tensor) -> bool:
    return q.is_cuda


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int):
    """The kernel module and Gluon's TensorDescriptor, or None where Gluon cannot run (not Hopper, no Gluon)."""
    if fa3._kernels(device_index) is None:
        return None
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from . import _decode
    return _decode, TensorDescriptor


def eligible(q: torch.Tensor, k_cache: torch.Tensor, page_size: int, rows: int, params, *, alibi, leftpad,
             cu_seqlens_q, cache_batch_idx) -> bool:
    """Whether the kernel computes this paged decode call (its features and shapes; device not checked)."""
    if OVERRIDE.get("on") is False or page_size not in PAGE_CONFIGS or q.dim() != 4 or rows > MAX_ROWS:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or q.shape[-1] not in HEAD_DIMS:
        return False
    if alibi is not None or leftpad is not None or cu_seqlens_q is not None or cache_batch_idx is not None:
        return False
    # masks: none, or the bottom-right causal one (window (-1, 0))
    return params.softcap == 0 and not params.has_left and params.window_right in (-1, 0)


def decode_paged(q, k_cache, v_cache, out, lse, seqlens_k: Optional[torch.Tensor], seqlen_k_static: int,
                 block_table, params, num_splits: int, splits_for, tickets, fuse: bool, combine,
                 sig=None) -> Optional[int]:
    """out, lse of the paged decode by the Gluon kernel; the split count used, or None where the kernel does not
    take the call (the caller runs the Triton kernel). splits_for(block_n): the caller's split rule (num_splits
    <= 0: automatic) for tiles of block_n keys; tickets(n): n zeroed int32 ticket counters for this stream
    (runtime.tickets); fuse: whether splits merge in the launch (dispatch.gluon_fuse_combine) rather than by
    combine(o_part, lse_part, out, lse, seqlen_rows=...), the caller's merge of split partials (combine.py's
    kernel). sig: the caller's argument signature (kvcache's token), which with the split count determines every
    launch argument but the live ones: a repeated signature reuses its launch template."""
    if not (fa3.enabled() and _on_gpu(q)):
        return None
    kern = _kernel(fa3._device_index(q))
    if kern is None:
        return None
    mod, TensorDescriptor = kern
    batch, sq, nheads, head_dim = q.shape
    nheads_k, page = k_cache.shape[-2], k_cache.shape[1]
    block_n, stages = PAGE_CONFIGS[page]
    block_n = int(OVERRIDE.get("block_n", block_n))
    n = int(OVERRIDE.get("num_splits", 0)) or (num_splits if num_splits > 0 else splits_for(block_n))
    n = max(1, min(n, -(-block_table.shape[1] * page // block_n)))
    split = n > 1
    fused = split and fuse
    key = (sig, n, fused) if sig is not None and not OVERRIDE else None
    tpl = _TEMPLATES.get(key) if key is not None else None
    if tpl is not None and tpl.launch(q, k_cache, v_cache, out, lse, block_table, seqlens_k, tickets):
        return n
    k_desc = fa3._desc(TensorDescriptor, k_cache, page, head_dim, q.dtype)
    v_desc = fa3._desc(TensorDescriptor, v_cache, page, head_dim, q.dtype) if k_desc is not None else None
    if v_desc is None:
        return None
    o_part, lse_part, sem = _parts(q, n, tickets if fused else None, batch * nheads_k)
    score_scale, _ = params.score_args()
    args = (k_desc, v_desc, q, out, lse, o_part, lse_part, sem, block_table,
            seqlens_k if seqlens_k is not None else block_table,
            q.stride()[:3], out.stride()[:3], lse.stride()[:2],
            (*(o_part.stride()[:3] if split else (0, 0, 0)), *(lse_part.stride()[:2] if split else (0, 0))),
            block_table.stride(0), (nheads_k, nheads // nheads_k, sq, int(seqlen_k_static), n), score_scale)
    kwargs = dict(HEAD_D=head_dim, PAGE=page, BLOCK_N=block_n, STAGES=int(OVERRIDE.get("stages", stages)),
                  HAS_SEQLENS=seqlens_k is not None, CAUSAL=params.is_causal, SPLIT=split, FUSED=fused,
                  num_warps=4)
    grid = (batch * nheads_k, n)
    launched = relaunch.launch(mod.paged_decode_kernel, grid, args, kwargs)
    if split and not fused:
        combine(o_part, lse_part, out, lse, seqlen_rows=sq)
    elif key is not None:   # (a separate combine launch is not templated)
        bound = relaunch.bind(mod.paged_decode_kernel, args, kwargs, LIVE, launched)
        if bound is not None:
            relaunch.remember(_TEMPLATES, key, _Template(bound, (*grid, 1), TensorDescriptor, descriptor_fields(k_desc),
                                                         descriptor_fields(v_desc), n))
    return n


def _parts(q, n, tickets, n_tiles):
    """(o_part, lse_part, ticket counters) of a launch of n splits over n_tiles (batch, K/V head) tiles;
    placeholders (never read) for one split, and for the counters without the fused combine (tickets None)."""
    batch, sq, nheads, head_dim = q.shape
    if n == 1:
        return q, q, q
    return (torch.empty(n, batch * sq, nheads, head_dim, device=q.device, dtype=torch.float32),
            torch.empty(n, batch * sq, nheads, device=q.device, dtype=torch.float32),
            q if tickets is None else tickets(n_tiles))


def template(sig, n: int, fused: bool):
    """The launch template decode_paged keeps for (signature, split count, fused combine), or None."""
    return _TEMPLATES.get((sig, n, fused)) if sig is not None and not OVERRIDE else None


# paged_decode_kernel's first LIVE parameters are the descriptors and tensors a decode step changes
LIVE = 10
# (caller's signature, split count, fused combine) -> _Template of a launch decode_paged made before
_TEMPLATES: dict = {}


class _Template:
    """How decode_paged launched a signature before: the compiled kernel bound to every argument but the live ones
    (relaunch.Bound), the grid, the cache descriptors' types (runtime.DescriptorType) and the split count; a decode
    loop's later steps skip the launch's key over every argument and the descriptors' checks (host time)."""
    __slots__ = ("bound", "grid", "k_type", "v_type", "n")

    def __init__(self, bound, grid, cls, k_fields, v_fields, n):
        self.bound, self.grid, self.n = bound, grid, n
        self.k_type, self.v_type = DescriptorType(cls, k_fields), DescriptorType(cls, v_fields)

    def launch(self, q, k_cache, v_cache, out, lse, block_table, seqlens_k, tickets) -> bool:
        k_desc, v_desc = self.k_type(k_cache), self.v_type(v_cache)
        if k_desc is None or v_desc is None:
            return False
        o_part, lse_part, sem = _parts(q, self.n, tickets, self.grid[0])
        # (checked: q, the block table and seqlens; out and lse are the caller's allocations (kvcache's), the parts
        # and counters this template's, the descriptors of its types)
        return self.bound(self.grid, (k_desc, v_desc, q, out, lse, o_part, lse_part, sem, block_table,
                                      seqlens_k if seqlens_k is not None else block_table), (2, 8, 9))

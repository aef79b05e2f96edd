"""When and how the dense forward runs FlashAttention-3's Hopper kernel (_fa3_fwd.py, Gluon) instead of the
portable Triton kernel: a CUDA device of compute capability 9.x with Gluon importable, fp16/bf16, the
(batch, seqlen, nheads, headdim) layout contiguous with 16-byte aligned bases, headdim 128 or 256, a positive
softmax scale, no feature but causal / GQA (no window, softcap, ALiBi, dropout, bias, mask or block sparsity),
seqlen_q a multiple of Br and seqlen_k of Bc (CONFIGS), causal with seqlen_q == seqlen_k. FLASHTILE_GLUON=0
turns it off."""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from ..triton.mods import LOG2E

WG_ROWS = 64   # query rows per consumer warpgroup (one wgmma M); two consumer warpgroups: Br = 128
# head_dim -> (consumer warpgroups, Bc, pipeline stages), chosen by measurement on an H200 (benchmarks/sweep_fa3.py,
# BENCHMARKS.md): Q_i + STAGES x (K_j, V_j) must fit the 227 KiB of shared memory (d128: 160 KiB; a third stage
# fits but measured no faster; d256: 192 KiB) and S, P~, O the consumers' 240 registers per thread. At head dim
# 64 the Triton kernel is as fast, so it keeps that head dim.
CONFIGS = {128: (2, 128, 2), 256: (2, 64, 2)}
# head_dim -> whether the consumer warpgroups take turns issuing their GEMMs (FA3's ping-pong), (full, causal).
# Measured: turns win at d128 full attention (+1-2%); under a causal mask, and at d256, free scheduling by the
# warp scheduler is as fast or 2-3% faster (BENCHMARKS.md, the fa3 sweep)
PINGPONG = {128: (True, False), 256: (False, False)}
# the kernel's register limit per thread: 12 warps (4 + 4 + 1 rounded up to warpgroups) x 32 x 168 = the 64K
# registers of an SM; inside the partitions setmaxnreg moves them to 240 per consumer thread and 24 for the producer
MAXNREG = 168


def block_shape(head_dim: int):
    """(Br, Bc) of the kernel at this head dim."""
    num_wg, block_n, _ = CONFIGS[head_dim]
    return num_wg * WG_ROWS, block_n


_off = 0   # > 0 inside disabled()


def enabled() -> bool:
    return _off == 0 and os.environ.get("FLASHTILE_GLUON", "1") != "0"


@contextlib.contextmanager
def disabled():
    """Within this block every forward runs the Triton kernel (the benchmark's `flashtile-triton` provider)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _kernels(device_index: int):
    """The Gluon module, or None where it cannot run on this device (not Hopper, or no Gluon)."""
    if torch.cuda.get_device_capability(device_index)[0] != 9:
        return None
    try:
        from . import _fa3_fwd
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return None
    return _fa3_fwd, TensorDescriptor


def eligible(q, k, v, params, alibi=None, cu_seqlens_q=None, bias=None, mask=None, sparse=None,
             mods=None) -> bool:
    """Whether the FA3 kernel computes this problem (dtype, layout, shapes, features), whatever the device."""
    if not (q.dim() == 4 and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    if cu_seqlens_q is not None or alibi is not None or bias is not None or mask is not None:
        return False
    if sparse is not None or mods is not None:
        return False
    if params.dropout_p > 0 or params.softcap > 0 or params.window_left >= 0 or params.window_right > 0:
        return False
    if not params.softmax_scale > 0:   # the kernel takes max(S) * scale for max(S * scale), and masks with -inf
        return False
    head_dim, sq, sk = q.shape[-1], q.shape[1], k.shape[1]
    if head_dim not in CONFIGS or not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v)):
        return False   # TMA needs 16-byte aligned bases (the row strides are: head_dim x nheads x 2 bytes)
    block_m, block_n = block_shape(head_dim)
    causal = params.window_right == 0
    return not (sq % block_m or sk % block_n or sq == 0 or (causal and sq != sk))


def supports(q, k, v, params, *args, **kwargs) -> bool:
    """Whether fwd() computes this forward (else the Triton kernel does): eligible, on a Hopper GPU with Gluon,
    and not turned off by FLASHTILE_GLUON=0."""
    if not (enabled() and q.is_cuda and eligible(q, k, v, params, *args, **kwargs)):
        return False
    return _kernels(_device_index(q)) is not None


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a (rows, head_dim) tile, which TMA writes and wgmma reads."""
    gl = _gluon_language()
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


def _gluon_language():
    from triton.experimental.gluon import language as gl
    return gl


def fwd(q, k, v, out, lse, params) -> None:
    """out = attention(q, k, v), lse = its row log-sum-exp (natural log), by the Gluon FA3 kernel. Call only
    where supports() said yes; out and lse contiguous."""
    kern, TensorDescriptor = _kernels(_device_index(q))
    batch, sq, nheads, head_dim = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    num_wg, block_n, stages = CONFIGS[head_dim]
    block_m = num_wg * WG_ROWS

    def desc(t, rows):
        view = t.view(t.shape[0] * t.shape[1], t.shape[2] * head_dim)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, head_dim],
                                _smem_layout(rows, head_dim, q.dtype))

    causal = params.window_right == 0
    kern.fa3_fwd_kernel[(sq // block_m, batch * nheads)](
        desc(q, WG_ROWS), desc(k, block_n), desc(v, block_n), desc(out, WG_ROWS), lse,
        lse.stride(0), lse.stride(1), sq, sk, nheads, nheads // nheads_k, params.softmax_scale * LOG2E,
        HEAD_D=head_dim, BLOCK_M=WG_ROWS, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, NUM_WG=num_wg,
        PINGPONG=PINGPONG.get(head_dim, (True, True))[causal],
        num_warps=4, maxnreg=MAXNREG)

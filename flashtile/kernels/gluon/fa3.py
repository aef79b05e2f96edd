"""When and how the forward and backward run FlashAttention-3's Hopper kernels (_fa3_fwd.py, _fa3_bwd.py, Gluon) instead
of the portable Triton kernels: a CUDA device of compute capability 9.x with Gluon importable, fp16/bf16, dense
(batch, seqlen, nheads, headdim) or varlen (tokens, nheads, headdim) tensors TMA can tile (16-byte aligned base and
row stride), headdim 64, 128 or 256 (the backward: 64 or 128), a positive softmax scale, any lengths, causal and
windows aligned bottom-right, softcap, ALiBi, GQA, and (dense problems) flashtile.flex's features: attn_bias (the
backward: without its gradient), bool masks, block masks, score_mod / mask_mod (eligible); not dropout, nor (the
backward) deterministic gradients: it adds dQ with TMA reduce-add. FLASHTILE_GLUON=0 turns both off."""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from .. import relaunch, support
from ..params import LOG2E, AttnParams, Features, Flex
from ..runtime import (DescriptorType, descriptor_fields, environ, pair_args, row_descriptor, sparse_args, tickets,
                       tma_row_view)

SMEM_LIMIT = 227 * 1024 - 1024   # an SM's shared memory per block, less room for the mbarriers
# the forward runs persistent (at most one program per SM, each drawing tile after tile from a counter of the
# stream: runtime.tickets); False: one program per tile
PERSISTENT = True
WG_ROWS = 64   # query rows per consumer warpgroup (one wgmma M): Br = 64 x consumer warpgroups
# head_dim -> (consumer warpgroups, Bc, pipeline stages) of the forward (benchmarks/sweep_fa3.py). Q_i + STAGES x
# (K_j, V_j) fit the 227 KiB of shared memory, S, P~ and O the consumers' registers (240 per thread with two
# warpgroups, 160 with three: THREE_WG); d64 takes FA3's Br = 192 (three warpgroups)
CONFIGS = {64: (3, 128, 2), 128: (2, 128, 2), 256: (2, 64, 2)}
# head_dim -> whether the consumer warpgroups take turns issuing their GEMMs (FA3's ping-pong), (full, causal)
# (benchmarks/sweep_fa3.py)
PINGPONG = {64: (True, False), 128: (True, False), 256: (False, False)}
# (head_dim, causal) -> ((longest seqlen_q, (consumer warpgroups, Bc, stages, ping-pong)), ...) by increasing length:
# the first entry whose length seqlen_q does not exceed replaces the two tables above (fwd_config): short sequences
# have few tiles, which fewer warpgroups and shorter key blocks balance better (benchmarks/sweep_fa3.py --seqlens)
SHORT_CONFIGS = {(64, True): ((512, (2, 64, 3, False)), (1024, (2, 128, 2, False))),
                 (64, False): ((512, (2, 128, 2, False)), ),
                 (128, True): ((512, (2, 64, 3, False)), )}
# head_dim -> the forward's config with ALiBi where it is not the one above: at d64 the three consumer warpgroups'
# registers do not hold ALiBi's terms beside their tiles (ptxas spills), two warpgroups' do (same-run A/B: the note
# of the ALiBi fold, issue #36)
ALIBI_CONFIGS = {64: (2, 128, 2, False)}
# the kernel's register limit per thread: 12 warps (4 + 4 + 1 rounded up to warpgroups) x 32 x 168 = the 64K
# registers of an SM; inside the partitions setmaxnreg moves them to 240 per consumer thread and 24 for the producer
MAXNREG = 168
# (kernel limit, consumer registers) of the forward: one program per SM (168, 240), or two (80, 104: 12 warps x 32
# x 80 = 30720 registers each; 256 x 104 + 128 x 24 fit in that), whose warps hide each other's softmax latency
ONE_PER_SM, TWO_PER_SM = (MAXNREG, 240), (80, 104)
# three consumer warpgroups (Br = 192): 16 warps x 32 x 128 = 64K registers; 3 x 128 x 160 + 128 x 24 fit in them
THREE_WG = (128, 160)
# (head_dim, fp8) -> the forward's registers where not ONE_PER_SM
FWD_REGS: dict = {}


# head_dim -> (consumer warpgroups, Bc, stages) of the FP8 forward (FA3 §3.3; Br = 64 x warpgroups, one Q descale
# per warpgroup's 64 rows): Q_i, STAGES x (K_j, V_j^T) e4m3 and a bf16 / fp16 output tile per consumer warpgroup
# within 227 KiB (benchmarks/sweep_fp8_gluon.py)
FP8_CONFIGS = {64: (3, 128, 2), 128: (2, 128, 2), 256: (2, 128, 2)}
# head_dim -> ping-pong (full, causal) of the FP8 forward (benchmarks/sweep_fp8_gluon.py)
FP8_PINGPONG = {64: (False, False), 128: (False, False), 256: (True, False)}

# head dims at which the forward and backward take flashtile.flex's features (mods, masks, attn_bias, block masks):
# where they run them faster than the Triton kernels (benchmarks/bench_flex.py --headdim: flashtile.flex against
# flashtile.flex (Triton))
FLEX_HEAD_DIMS = (64, 128)

# head_dim -> (Br, Bc, stages) of the backward: a program owns Bc = 2 x 64 keys (one half per consumer
# warpgroup, dK / dV in registers) and streams Br query rows per step through `stages` (Q_i, dO_i) buffers
BWD_CONFIGS = {64: (128, 128, 2), 128: (64, 128, 2)}
# head_dim -> fa3_bwd_any_kernel's (Br, Bc, stages) for a problem with a mask rule (causal, windows), softcap or
# ALiBi where not BWD_CONFIGS': at d64 their terms do not fit beside Br = 128's S, dP, dK and dV in the consumers'
# registers (ptxas spills), Br = 64's do; without them (sequence ends only) Br = 128 stays the faster (same-run A/B
# on an H200: `git log -S BWD_ANY_CONFIGS`)
BWD_ANY_CONFIGS = {64: (64, 128, 3)}
# head dims at which fa3_bwd_any_kernel, for a varlen problem without a mask rule (sequence ends only), bounds the
# keys of every step and skips none (a step past a sequence's keys computes P = 0): the skip path's branch costs
# registers that the bound's one compare per column does not. Faster at d128, slower at d64 and for unaligned dense
# lengths (same-run A/B on an H200: `git log -S BWD_TAIL_EVERY_STEP`)
BWD_TAIL_EVERY_STEP = (128, )
# head dims at which fa3_bwd_any_kernel, for a varlen problem whose queries and keys are the same sequences (one
# cu_seqlens tensor for both: one_cu_seqlens), keeps one row offset and one length per sequence (SAME_SEQS): two
# registers fewer than separate ones, which at d128 is where the consumers spill. Faster at d128, slower at d64
# (same-run A/B on an H200: `git log -S BWD_SAME_SEQS`)
BWD_SAME_SEQS = (128, )
# head dims at which fa3_bwd_any_kernel, for a problem with a mask rule or sequence ends and softcap, ALiBi or
# flashtile.flex's features, masks P on every step (MASK_EVERY_STEP) instead of under a runtime branch on whether
# some pair of the tile is hidden: with those features' terms live the branch makes ptxas spill (with ALiBi the
# slope is then taken before the loop as well). Faster at d128, slower at d64, where nothing spills and full tiles
# pay the compares (same-run A/B on an H200: `git log -S BWD_MASK_EVERY_STEP`)
BWD_MASK_EVERY_STEP = (128, )
# (head_dim, causal) -> whether the backward's consumer warpgroups take turns issuing their GEMMs (S, dP; then dV,
# dK, dQ), as the forward's ping-pong (same-run A/Bs on an H200: `git log -S BWD_PINGPONG`)
BWD_PINGPONG = {(64, True): True}
# GQA / MQA on the dense backward kernel: a program per (KV head, key block) runs the group's query heads, and where
# batch x nheads_k x key blocks is under GQA_SPLIT_PROGRAMS_PER_SM programs per SM the programs are too few and too
# long to balance over the SMs (MQA at batch 2, 4k: 64 programs on 132 SMs): the group's heads are then split over
# SPLIT programs (fa3_bwd_kernel's SPLIT: the least divisor of the group that reaches that count, else the group),
# which add their dK_j, dV_j into float32 accumulators. From GQA_SPLIT_MIN_WORK (batch x nheads x seqlen_q x
# seqlen_k x head_dim): below, the accumulators' fill and conversion cost more host time than the split saves GPU
# time. Same-run A/Bs on an H200: `git log -S GQA_SPLIT_PROGRAMS_PER_SM`. GQA_SPLIT (tests, sweeps): a fixed SPLIT.
GQA_SPLIT_PROGRAMS_PER_SM = 8
GQA_SPLIT_MIN_WORK = 1 << 36
GQA_SPLIT = 0
# head dims at which the dense backward's GQA / MQA programs (more than one query head each) take their query heads
# as a compile-time count and run them innermost (fa3_bwd_kernel's HEADS: a compile per group size, no runtime
# division of the step's index; fewer registers spilled). Faster at both (same-run A/B on an H200: `git log -S
# BWD_GQA_HEADS`); other head dims keep the heads outermost.
BWD_GQA_HEADS = (64, 128)
# head dims at which fa3_bwd_any_kernel does the same for GQA / MQA problems without a block mask (its HEADS; the
# group's heads innermost, every head of a query block before the next block). Faster at d64 (varlen, unaligned
# causal); at d128 slower with a mask rule (causal, windows) though ptxas spills less (same-run A/B on an H200:
# `git log -S BWD_ANY_GQA_HEADS`)
BWD_ANY_GQA_HEADS = (64, )


class FwdTile(NamedTuple):
    """fa3_fwd_kernel's tiles and schedule (one constexpr): head dim, a consumer warpgroup's query rows (Br =
    BLOCK_M x NUM_WG), Bc, the K / V ring's stages, consumer warpgroups, Q buffers per warpgroup (q_buffers),
    ping-pong, e4m3 inputs."""
    HEAD_D: int
    BLOCK_M: int
    BLOCK_N: int
    STAGES: int
    NUM_WG: int
    Q_BUFS: int
    PINGPONG: bool
    FP8: bool


class BwdTile(NamedTuple):
    """The backward kernels' tiles and schedule (one constexpr): head dim, Br, Bc (two consumer warpgroups' 64
    keys), the (Q_i, dO_i) stages, ping-pong. (The shared layout of P / dS is a constexpr of its own: a layout
    cannot travel inside a tuple.)"""
    HEAD_D: int
    BLOCK_M: int
    BLOCK_N: int
    STAGES: int
    PINGPONG: bool


_off = 0   # > 0 inside disabled()


def enabled() -> bool:
    return _off == 0 and environ("FLASHTILE_GLUON", "1") != "0"


@contextlib.contextmanager
def disabled():
    """Within this block every forward and backward runs the Triton kernels (the benchmark's `flashtile-triton`
    provider); flash_attn_func records it at the forward, so the backward of a forward run here does too."""
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
    """The Gluon module, or None where it cannot run on this device (not Hopper, or no Gluon of Triton >= 3.6)."""
    if not support.GLUON or torch.cuda.get_device_capability(device_index)[0] != 9:
        return None
    try:
        from . import _fa3_bwd, _fa3_bwd_any, _fa3_fwd
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return None
    return _fa3_fwd, _Backward(_fa3_bwd.fa3_bwd_kernel, _fa3_bwd_any.fa3_bwd_any_kernel), TensorDescriptor


def eligible(q, k, v, params, alibi=None, cu_seqlens_q=None, bias=None, mask=None, sparse=None,
             mods=None, backward=False, dbias=None, layout=True) -> bool:
    """Whether the FA3 kernel (forward, or backward) computes this problem (dtype, layout, shapes, features),
    whatever the device: dense or varlen, any lengths, windows and causal (bottom-right), softcap, ALiBi (float32
    slopes), GQA; q / k / v as (rows, heads x d) views TMA can tile (tma_viewable); head dims of CONFIGS (the
    forward) or BWD_CONFIGS (the backward). A dense problem at a head dim of FLEX_HEAD_DIMS may also have
    flashtile.flex's features: attn_bias (the backward: not its gradient dbias), a bool mask, score_mod /
    mask_mod, a block mask whose block size is a multiple of 128 (each tile inside one mask block; the backward:
    one list per group of query heads sharing a KV head). Not: dropout (the Triton kernels). layout=False: whatever
    q, k, v's strides (dispatch.kernel_inputs asks whether contiguous copies would be taken)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if params.dropout_p > 0:
        return False
    if bias is not None or mask is not None or sparse is not None or mods is not None:
        if (q.dim() != 4 or q.shape[-1] not in FLEX_HEAD_DIMS or dbias is not None
                or (sparse is not None and sparse.block_size % 128)):
            return False
        if backward and not sparse_ok(q, k, sparse):
            return False
    if not params.softmax_scale > 0:   # the kernel takes max(S) * scale for max(S * scale), and masks with -inf
        return False
    if q.shape[-1] not in (BWD_CONFIGS if backward else CONFIGS):
        return False
    if (q.dim() == 3) != (cu_seqlens_q is not None) or q.shape[-3] == 0:
        return False
    if q.dim() == 4 and q.shape[1] == 1:
        # (Triton compiles an int argument equal to 1 as a constant, and Gluon's lowering of the kernels fails on
        # seqlen_q == 1 so folded: a dense single-query call runs the Triton kernels; varlen passes at least 2)
        return False
    if alibi is not None and not (alibi.dtype == torch.float32 and alibi.stride(-1) == 1):
        return False
    return not layout or tma_viewable(q, k, v)


def sparse_ok(q, k, sparse) -> bool:
    """Whether the backward takes this block mask (None: no block mask): one list per group of query heads that
    share a KV head (a program reads its group's first list)."""
    return sparse is None or q.shape[2] == k.shape[2] or sparse.q_num.shape[1] == 1


def supports(q, k, v, params, *args, **kwargs) -> bool:
    """Whether fwd() computes this forward (backward=True: bwd() this backward; else the Triton kernels do):
    eligible, on a Hopper GPU with Gluon, and not turned off by FLASHTILE_GLUON=0."""
    if not (enabled() and q.is_cuda and eligible(q, k, v, params, *args, **kwargs)):
        return False
    return _kernels(_device_index(q)) is not None


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a (rows, head_dim) tile, which TMA writes and wgmma reads."""
    gl = _gluon_language()
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
          torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], el)


def tma_aligned(*ts: torch.Tensor) -> bool:
    """Whether every tensor is contiguous with a 16-byte aligned base (what the kernels' TMA descriptors need)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ts)


def aligned_bases(*ts: torch.Tensor) -> bool:
    """Whether every tensor's base is 16-byte aligned (with strides a plan's: tensors its descriptors tile)."""
    return all(t.data_ptr() % 16 == 0 for t in ts)


def tma_viewable(*ts: torch.Tensor) -> bool:
    """Whether every tensor is a (rows, heads x d) view TMA can tile (runtime.tma_row_view: contiguous, or a slice
    of a packed tensor, with 16-byte aligned base and row stride)."""
    return all(tma_row_view(t) is not None for t in ts)


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy of it, contiguous with a 16-byte aligned base."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _desc(TensorDescriptor, t, rows, cols, dtype):
    """A TMA descriptor over t viewed as (batch * seqlen, nheads * head_dim) (launch.tma_row_view), blocks (rows,
    cols); None where t is no such view."""
    return row_descriptor(TensorDescriptor, t, (rows, cols), _smem_layout(rows, cols, dtype))


class _Backward:
    """The two backward kernels: `dense` (_fa3_bwd.py: the problems dense_bwd names) and `any` (_fa3_bwd_any.py)."""
    __slots__ = ("fa3_bwd_kernel", "fa3_bwd_any_kernel")

    def __init__(self, dense, any_):
        self.fa3_bwd_kernel, self.fa3_bwd_any_kernel = dense, any_


def _gluon_language():
    from triton.experimental.gluon import language as gl
    return gl


def fwd(q, k, v, out, lse, params, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
        max_seqlen_k=None, bias=None, mask=None, sparse=None, mods=None) -> None:
    """out = attention(q, k, v), lse = its row log-sum-exp (natural log; -inf where a row sees no key), by the
    Gluon FA3 kernel: dense (batch, seqlen, nheads, d) or varlen (tokens, nheads, d) with cu_seqlens and the
    longest lengths; bias / mask (4-D, broadcastable to (batch, nheads, seqlen_q, seqlen_k)), sparse (a block
    mask's params.SparseLists) and mods (params.UserMods) as launch.flash_fwd takes them. Call only where supports()
    said yes; out contiguous, lse (batch, nheads, seqlen_q) or (nheads, total_q)."""
    varlen = cu_seqlens_q is not None
    sq = max_seqlen_q if varlen else q.shape[1]
    sk = max_seqlen_k if varlen else k.shape[1]
    flex = None
    if has_flex(bias, mask, sparse, mods):
        flex = flex_args(lse, q.shape[0], q.shape[2], sq, sk, bias, mask, sparse, mods)
    cfg = fwd_config(q.shape[-1], sq, params.has_right, alibi is not None, flex is not None)
    _launch_fwd(q, k, v, out, lse, (lse, lse, lse), params, cfg, False, alibi, cu_seqlens_q, cu_seqlens_k, sq, sk,
                flex)


# placeholders the kernels do not read for an absent bias / mask (pointer and strides), block mask (lists and
# strides) or mod's captured values; _NO_FLEX / _NO_FLEX_BWD: flex_args' (runtime, constexprs) of a problem with
# none of flashtile.flex's features (the backward's also with score_aux_grad and the program order)
_NO_PAIR = (0, 0, 0, 0, 0)
_NO_LISTS = (0, 0, 0, 0, 0, 0, 0, 0)
_NO_AUX = (0, )
_NO_FLEX = ((_NO_PAIR, _NO_PAIR, _NO_LISTS, _NO_AUX, _NO_AUX), Flex())
_NO_FLEX_BWD = ((*_NO_FLEX[0], _NO_AUX, 0), _NO_FLEX[1])


def flex_args(lse, batch: int, nheads: int, sq: int, sk: int, bias=None, mask=None, sparse=None, mods=None,
              backward: bool = False):
    """(flex_runtime(...), flex_consts(...)) of flashtile.flex's features."""
    return (flex_runtime(lse, batch, nheads, sq, sk, bias, mask, sparse, mods, backward),
            flex_consts(bias, mask, sparse, mods, backward))


def flex_runtime(lse, batch: int, nheads: int, sq: int, sk: int, bias=None, mask=None, sparse=None, mods=None,
                 backward: bool = False) -> tuple:
    """fa3_fwd_kernel's runtime group flex (bias_t, mask_t, sparse, score_aux, mask_aux) of flashtile.flex's
    features, placeholders for the absent ones; backward: fa3_bwd_any_kernel's (the block mask's transposed lists,
    score_aux_grad added; the programs' order is bwd_flex's)."""
    def pair(t):
        return _NO_PAIR if t is None else pair_args(t, batch, nheads, sq, sk)
    lists = _NO_LISTS if sparse is None else sparse_args(sparse, batch, nheads, backward)
    score_aux = mods.score_aux if mods is not None and mods.score_aux is not None else _NO_AUX
    mask_aux = mods.mask_aux if mods is not None and mods.mask_aux is not None else _NO_AUX
    runtime = (pair(bias), pair(mask), lists, score_aux, mask_aux)
    if backward:
        aux_grad = mods.score_aux_grad if mods is not None and mods.score_aux_grad is not None else score_aux
        runtime += (aux_grad, )
    return runtime


def flex_consts(bias=None, mask=None, sparse=None, mods=None, backward: bool = False) -> Flex:
    """The constexpr FLEX of flashtile.flex's features (the forward's; backward: fa3_bwd_any_kernel's, with
    SCORE_GRAD and SCORE_CAPTURED_GRAD)."""
    return Flex(HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
                SPARSE_BLOCK=0 if sparse is None else sparse.block_size,
                **({} if mods is None else mods.flex_fields("dkdv" if backward else "fwd")))


def longest_first(sparse, batch: int, nheads: int, nheads_k: int, sk: int, block_n: int) -> torch.Tensor:
    """fa3_bwd_any_kernel's order_ptr over a block mask: its programs' (batch x KV head, key block) pairs as
    bh * n_key_blocks + key block (int32), those listing at least twice the mean count of query blocks first (a
    key block every query sees, such as attention sinks': started late, it ends the launch alone), the rest in
    the grid's order (a head's key blocks one after another share its Q_i, dO_i in L2). A program reads the list
    of its group's first query head (eligible: one list per group)."""
    n_kv = -(-sk // block_n)
    steps = (sparse.q_num + sparse.full_q_num).expand(batch, nheads, -1)[:, ::nheads // nheads_k]
    steps = steps.repeat_interleave(sparse.block_size // block_n, dim=2)[:, :, :n_kv].reshape(-1)
    long = steps >= 2 * steps.float().mean()
    return torch.argsort(long.to(torch.int8), descending=True, stable=True).to(torch.int32)


# (the transposed lists' pointers and versions, the problem's sizes) -> longest_first's order: a training loop's
# backward over one block mask computes it once
_ORDERS: dict = {}


def _order(sparse, batch: int, nheads: int, nheads_k: int, sk: int, block_n: int) -> torch.Tensor:
    """longest_first(...), kept per block mask lists (an in-place change of them bumps their version: a new key).
    Any order of the programs is correct (a stale one, of lists freed and reallocated at the same address, only
    schedules worse): the key fixes how many there are."""
    key = (sparse.q_num.data_ptr(), sparse.q_num._version, sparse.full_q_num.data_ptr(), sparse.full_q_num._version,
           sparse.q_num.shape, sparse.block_size, batch, nheads, nheads_k, sk, block_n)
    order = _ORDERS.get(key)
    if order is None:
        order = relaunch.remember(_ORDERS, key, longest_first(sparse, batch, nheads, nheads_k, sk, block_n))
    return order


def bwd_flex(lse, batch: int, nheads: int, nheads_k: int, sq: int, sk: int, block_n: int, bias=None, mask=None,
             sparse=None, mods=None) -> tuple:
    """fa3_bwd_any_kernel's flex group of flashtile.flex's features: flex_runtime's with the programs' order
    (longest_first, kept per block mask) last."""
    order = 0 if sparse is None else _order(sparse, batch, nheads, nheads_k, sk, block_n)
    return (*flex_runtime(lse, batch, nheads, sq, sk, bias, mask, sparse, mods, backward=True), order)


def has_flex(bias=None, mask=None, sparse=None, mods=None) -> bool:
    """Whether a problem has any of flashtile.flex's features."""
    return not (bias is None and mask is None and sparse is None and mods is None)


def fwd_features(params, varlen: bool, alibi, sq: int, sk: int, block_n: int, flex: bool = False,
                 sparse: bool = False) -> Features:
    """fa3_fwd_kernel's FEATURES for a problem (its docstring says what each compiles in); flex: the problem has
    flashtile.flex's features (its rows may see no key), sparse: a block mask (tiles may visit blocks past the keys)."""
    tail = varlen or sq % WG_ROWS != 0 or sk % block_n != 0 or sparse
    return Features(VARLEN=varlen, HAS_LEFT=params.has_left, HAS_RIGHT=params.has_right, SOFTCAP=params.softcap > 0,
                    ALIBI=alibi is not None, TAIL=tail, GUARD=rows_may_see_no_key(params, varlen, sq, sk, flex))


def rows_may_see_no_key(params, varlen: bool, sq: int, sk: int, flex: bool) -> bool:
    """Whether some query row may see no key (its output 0, LSE -inf): varlen (a sequence without keys), a left
    window, a right window that ends before the first key for the first rows (sk - sq + right < 0), or
    flashtile.flex's features (masks and mods may hide a whole row)."""
    return (varlen or params.has_left or (params.has_right and sk - sq + params.window_right < 0)
            or flex)


def fwd_config(head_dim: int, seqlen_q: int, causal: bool, alibi: bool = False, flex: bool = False):
    """(consumer warpgroups, Bc, stages, ping-pong) of the bf16 / fp16 forward: ALIBI_CONFIGS with ALiBi, else
    SHORT_CONFIGS up to their length, else CONFIGS and PINGPONG. flex (flashtile.flex's features): two consumer
    warpgroups where the tables give three (their terms beside three warpgroups' tiles spill; a block mask's
    blocks then hold whole tiles, Br = 128)."""
    if alibi and head_dim in ALIBI_CONFIGS:
        cfg = ALIBI_CONFIGS[head_dim]
    else:
        cfg = next((cfg for longest, cfg in SHORT_CONFIGS.get((head_dim, causal), ()) if seqlen_q <= longest),
                   (*CONFIGS[head_dim], PINGPONG.get(head_dim, (True, True))[causal]))
    return (2, *cfg[1:]) if flex and cfg[0] == 3 else cfg


# fa3_fwd_kernel's first _FWD_LIVE parameters are the descriptors and tensors a call changes (q, k, v, out, lse, the
# descales, the tile counter, out's pointer, cu_seqlens, the ALiBi slopes), then the flex group (live in the template
# of a problem with flashtile.flex's features: its tensors change per call; bound, as placeholders, otherwise); the
# rest are sizes, strides and scalars, fixed by the problem
_FWD_LIVE = 13
# (q / k / v shapes, dtype, device, lse strides, the scalars, ALiBi's shape, the longest lengths, FLEX) -> _FwdTemplate
# of a bf16 / fp16 launch seen before
_FWD_TEMPLATES: dict = {}


@functools.lru_cache(maxsize=None)
def _checked(n_live: int, first: int, descriptors: tuple = ()) -> tuple:
    """The positions of a template's n_live live arguments that its launch checks (relaunch.Bound): from `first` on,
    but the descriptors (made from the bound fields)."""
    return tuple(i for i in range(first, n_live) if i not in descriptors)


class _FwdTemplate:
    """How _launch_fwd launched a problem before: the compiled kernel bound to every argument but the live ones
    (relaunch.Bound), the launch options it was bound with (a call whose options differ, after a change of the
    config tables, goes the slow way) and the q, k, v, out descriptors' fields (launch.descriptor_fields): a
    repeated call skips relaunch's key over every argument and the descriptors' geometry checks (host time)."""
    __slots__ = ("bound", "kwargs", "descs")

    def __init__(self, bound, kwargs, cls, fields):
        self.bound, self.kwargs = bound, kwargs
        self.descs = [DescriptorType(cls, f) for f in fields]

    def launch(self, grid, q, k, v, out, lse, scales, counter, extras, flex=None, fresh: bool = False) -> bool:
        """extras: (cu_seqlens_q, cu_seqlens_k, alibi), None where absent; flex: flex_args' runtime group of a
        template bound with it live (None: bound). fresh: out and lse were allocated by the caller (in the key's
        dtypes), scales are lse and counter is from tickets(): only the extras and flex are checked."""
        d = self.descs
        descs = (d[0](q), d[1](k), d[2](v), d[3](out))
        if None in descs:
            return False
        cu_q, cu_k, alibi = extras
        live = (*descs, lse, *scales, counter, out, lse if cu_q is None else cu_q, lse if cu_k is None else cu_k,
                lse if alibi is None else alibi)
        if flex is not None:
            live += (flex, )
        # (the descriptors have the bound ones' class, block and layout and the base dtype of the key's q; fresh:
        # checked from the extras, _FWD_LIVE - 3, on)
        return self.bound(grid, live, _checked(len(live), _FWD_LIVE - 3 if fresh else 4))


def layout(*ts) -> tuple:
    """The strides of q, k, v (and out): with the shapes, the geometry of their TMA descriptors (tma_row_view), which
    a launch template binds."""
    return tuple(t.stride() for t in ts)


def _fwd_key(q, k, v, out, lse, params, alibi, sq, sk, flex=None):
    """The key of a forward's launch template: what fixes every argument but the live ones (the shapes and strides of
    q, k, v and out fix their descriptors' geometry); flex: the constexpr FLEX of a problem with flashtile.flex's
    features (its runtime group is live)."""
    return (q.shape, k.shape, v.shape, layout(q, k, v, out), q.dtype, q.device, lse.stride(), params.softmax_scale,
            params.window_left, params.window_right, params.softcap, None if alibi is None else alibi.stride(), sq,
            sk, flex)


def _launch_fwd(q, k, v, out, lse, scales, params, cfg, fp8, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None,
                sq=None, sk=None, flex=None):
    """fa3_fwd_kernel over dense (batch, seqlen, nheads, d) or varlen (tokens, nheads, d) q, k and v (fp8: dense,
    V^T (batch, nheads_k, d, seqlen_k) and the three descale tensors; else unused pointers); cfg: fwd_config's;
    flex: flex_args' (None: no such feature)."""
    num_wg, block_n, stages, pingpong = cfg
    kern, _, TensorDescriptor = _kernels(_device_index(q))
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    sq = q.shape[1] if sq is None else sq
    sk = k.shape[1] if sk is None else sk
    nheads, head_dim, nheads_k = q.shape[-2], q.shape[-1], k.shape[-2]
    n_tiles = -(-sq // (num_wg * WG_ROWS)) * batch * nheads   # (not triton.cdiv: ~2 us of host time per call)
    programs = min(n_tiles, _sm_count(_device_index(q))) if PERSISTENT else n_tiles
    # (a block mask's blocks hold whole tiles: FLEX_HEAD_DIMS' configs)
    assert not flex or flex[1].SPARSE_BLOCK % (num_wg * WG_ROWS) == 0 == flex[1].SPARSE_BLOCK % block_n
    flex_runtime, flex_consts = flex if flex is not None else _NO_FLEX
    tile = FwdTile(head_dim, WG_ROWS, block_n, stages, num_wg,
                   q_buffers(head_dim, num_wg, block_n, stages, q.element_size(), fp8), pingpong, fp8)
    kwargs = dict(TILE=tile, FEATURES=fwd_features(params, varlen, alibi, sq, sk, block_n, flex is not None,
                                                   flex_consts.SPARSE_BLOCK > 0),
                  FLEX=flex_consts, **_regs(head_dim, fp8, num_wg))
    counter = tickets(q.device, 1)
    extras = (cu_seqlens_q, cu_seqlens_k, alibi)
    live_flex = None if flex is None else flex_runtime   # (a flex problem's template takes its tensors per call)
    key = None if fp8 else _fwd_key(q, k, v, out, lse, params, alibi, sq, sk, None if flex is None else flex_consts)
    tpl = _FWD_TEMPLATES.get(key) if key is not None else None
    if tpl is not None and tpl.kwargs == kwargs and tpl.launch((programs, 1, 1), q, k, v, out, lse, scales, counter,
                                                               extras, live_flex):
        return

    def desc(t, rows):
        return _desc(TensorDescriptor, t, rows, head_dim, t.dtype)

    if fp8:   # V^T viewed (batch * nheads_k * d, seqlen_k), blocks (d, Bc)
        vt_view = v.view(batch * nheads_k * head_dim, sk)
        v_desc = TensorDescriptor(vt_view, list(vt_view.shape), list(vt_view.stride()), [head_dim, block_n],
                                  _smem_layout(head_dim, block_n, v.dtype))
    else:
        v_desc = desc(v, block_n)
    descs = (desc(q, WG_ROWS), desc(k, block_n), v_desc, desc(out, WG_ROWS))
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    score_scale, softcap_log2 = params.score_args()
    strides = (*lse_strides, tma_row_view(out).stride(0), 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0))
    sizes = (max(sq, 2) if varlen else sq, sk, batch * nheads, nheads, nheads // nheads_k)
    args = (*descs, lse, *scales, counter, out, *(lse if t is None else t for t in extras), flex_runtime, strides,
            sizes, (score_scale, softcap_log2), (max(params.window_left, 0), max(params.window_right, 0)))
    launched = relaunch.launch(kern.fa3_fwd_kernel, (programs, ), args, kwargs)
    if key is not None:
        bound = relaunch.bind(kern.fa3_fwd_kernel, args, kwargs, _FWD_LIVE + (live_flex is not None), launched)
        if bound is not None:
            relaunch.remember(_FWD_TEMPLATES, key, _FwdTemplate(bound, kwargs, TensorDescriptor,
                                                                [descriptor_fields(d) for d in descs]))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def q_buffers(head_dim: int, num_wg: int, block_n: int, stages: int, elem: int, fp8: bool) -> int:
    """Q tiles per consumer warpgroup in the forward's shared memory: 2 (the next tile's Q loads during this one)
    where they fit the 227 KiB beside the K / V ring (and FP8's output tiles), else 1."""
    q_tile, kv = num_wg * WG_ROWS * head_dim * elem, 2 * stages * block_n * head_dim * elem
    out = num_wg * WG_ROWS * head_dim * 2 if fp8 else 0
    return 2 if 2 * q_tile + kv + out <= SMEM_LIMIT else 1


def _regs(head_dim: int, fp8: bool, num_wg: int = 2) -> dict:
    """The forward's launch options for its register split (FWD_REGS; THREE_WG with three consumer warpgroups)."""
    maxnreg, consumer = THREE_WG if num_wg == 3 else FWD_REGS.get((head_dim, fp8), ONE_PER_SM)
    return dict(CONSUMER_REGS=consumer, num_warps=4, maxnreg=maxnreg)


def fp8_block_shape(head_dim: int):
    """The quantization blocks of Q and of K, V that the FP8 kernel reads at this head dim: (a consumer warpgroup's
    64 rows, Bc)."""
    return WG_ROWS, FP8_CONFIGS[head_dim][1]


def supports_fp8(q, k, causal: bool, out_dtype: torch.dtype) -> bool:
    """Whether fwd_fp8() computes the FP8 forward of q (batch, seqlen_q, nheads, d) against k (batch, seqlen_k,
    nheads_k, d) (any dtype: only shapes and the device count), with V given transposed: a Hopper GPU with Gluon,
    not turned off, head dim in FP8_CONFIGS, seqlen_q a multiple of 64 and seqlen_k of Bc, causal with
    seqlen_q == seqlen_k, a bf16 / fp16 output."""
    head_dim, sq, sk = q.shape[-1], q.shape[1], k.shape[1]
    if not (enabled() and q.is_cuda and head_dim in FP8_CONFIGS and out_dtype in (torch.float16, torch.bfloat16)):
        return False
    block_m, block_n = fp8_block_shape(head_dim)
    if sq == 0 or sq % block_m or sk % block_n or (causal and sq != sk):
        return False
    return _kernels(_device_index(q)) is not None


def fwd_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, out, lse, softmax_scale: float, causal: bool) -> None:
    """out = attention of e4m3 q8 (batch, seqlen_q, nheads, d), k8 (batch, seqlen_k, nheads_k, d) and V^T vt8
    (batch, nheads_k, d, seqlen_k), all contiguous, with x = x8 * descale per block: q_scale (batch, nheads,
    seqlen_q / 64), k_scale and v_scale (batch, nheads_k, seqlen_k / Bc), contiguous float32 (fp8_block_shape);
    lse (batch, nheads, seqlen_q) natural log. Call only where supports_fp8() said yes."""
    head_dim = q8.shape[-1]
    num_wg, block_n, stages = FP8_CONFIGS[head_dim]
    for name, t in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        assert t.is_contiguous() and t.dtype == torch.float32, name
    assert vt8.shape == (k8.shape[0], k8.shape[2], head_dim, k8.shape[1]) and vt8.is_contiguous()
    params = AttnParams(softmax_scale=softmax_scale, window_right=0 if causal else -1)
    _launch_fwd(q8, k8, vt8, out, lse, (q_scale, k_scale, v_scale), params,
                (num_wg, block_n, stages, FP8_PINGPONG[head_dim][causal]), True)


def bwd_config(head_dim: int, params, alibi, dense: bool, grads_f32: bool = False, flex: bool = False):
    """((Br, Bc, stages), ping-pong) of the backward kernel that takes a problem: fa3_bwd_kernel's (dense: the
    problems dense_bwd names) from BWD_CONFIGS; fa3_bwd_any_kernel's from BWD_ANY_CONFIGS where it has the head dim
    and the problem a mask rule, softcap, ALiBi or flashtile.flex's features (flex; then without ping-pong), else
    BWD_CONFIGS too. grads_f32: dK and dV written in float32 (partial sums of a 16-bit problem, dk.dtype !=
    q.dtype): their tiles are staged in the Q_i / dO_i buffers, which BWD_CONFIGS' tiles size for them
    (store_dkv_f32), so they keep BWD_CONFIGS'."""
    scored = params.has_left or params.has_right or params.softcap > 0 or alibi is not None or flex
    tiles = BWD_CONFIGS[head_dim]
    if scored and not dense and not grads_f32:
        tiles = BWD_ANY_CONFIGS.get(head_dim, tiles)
    return tiles, BWD_PINGPONG.get((head_dim, params.has_right), False) and not flex


def bwd_split(q, k, params, dense: bool, grads_f32: bool, sq: int, sk: int, block_n: int) -> int:
    """fa3_bwd_kernel's SPLIT for a problem on key tiles of block_n (GQA_SPLIT_PROGRAMS_PER_SM's rule), 1 where
    none: not the dense kernel, no group, float32 dK / dV (a caller's partial sums, written, not added), or little
    work."""
    nheads, nheads_k, batch = q.shape[-2], k.shape[-2], q.shape[0]
    group = nheads // nheads_k
    if (not dense or group == 1 or grads_f32
            or batch * nheads * sq * sk * q.shape[-1] < GQA_SPLIT_MIN_WORK):
        return 1
    if GQA_SPLIT:
        return GQA_SPLIT if group % GQA_SPLIT == 0 else 1
    programs = batch * nheads_k * -(-sk // block_n)
    target = GQA_SPLIT_PROGRAMS_PER_SM * _sm_count(_device_index(q))
    return next(s for s in range(1, group + 1) if group % s == 0 and (programs * s >= target or s == group))


def _dkv_targets(dk, dv, split: int) -> tuple:
    """What the backward kernel writes dK, dV into: dk, dv, or (SPLIT > 1) float32 accumulators, zeroed, that its
    programs add into (_dkv_out copies them into dk, dv)."""
    if split == 1:
        return dk, dv
    return tuple(torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in (dk, dv))


def _dkv_out(grads, written) -> None:
    """dK, dV from where the kernel wrote them (a split's float32 accumulators, or buffers TMA can tile) into the
    caller's grads, where those differ."""
    for out, grad in zip(written, grads):
        if out is not grad:
            grad.copy_(out)


def bwd_dq_tile(block_m: int, head_dim: int):
    """The dQ tile a consumer warpgroup of the backward adds: half the rows of dQ_i when Br = 128, else half the
    columns."""
    return (WG_ROWS, head_dim) if block_m == 2 * WG_ROWS else (block_m, head_dim // 2)


# the backward kernels' first parameters that a call changes: fa3_bwd_kernel's _BWD_LIVE (k, v, q, dO, the dQ
# accumulator, lse, delta, dK and dV), fa3_bwd_any_kernel's _BWD_LIVE + 5 (dK's and dV's pointers, cu_seqlens, the ALiBi
# slopes), then its flex group (live for a problem with flashtile.flex's features, as the forward's); the rest are
# sizes, strides and scalars, fixed by the problem
_BWD_LIVE = 9
# (shapes, dtype, device, lse / dK / dV strides, the scalars, ALiBi's strides, the longest lengths, dQ tile) ->
# _BwdTemplate of a backward launch seen before
_BWD_TEMPLATES: dict = {}


class _BwdTemplate(_FwdTemplate):
    """_FwdTemplate's counterpart for the backward: the bound kernel, its launch options, the fields of the k, v, q,
    dO, dQ-accumulator, dK and dV descriptors, and whether it is fa3_bwd_any_kernel's (more live arguments)."""
    __slots__ = ("any",)

    def __init__(self, bound, kwargs, cls, fields, any_kernel: bool):
        super().__init__(bound, kwargs, cls, fields)
        self.any = any_kernel

    def launch(self, grid, tensors, lse, delta, extras, flex=None, fresh: bool = False) -> bool:
        """tensors: (k, v, q, dO, dQ accumulator, dK, dV); extras: (cu_seqlens_q, cu_seqlens_k, alibi), None where
        absent; flex: the flex group of a template bound with it live (None: bound). fresh: lse is the forward's,
        delta, the dQ accumulator, dK and dV the caller's allocations (in the key's dtypes): only the extras and
        flex are checked."""
        descs = [d(t) for d, t in zip(self.descs, tensors)]
        if None in descs:
            return False
        # (descriptors from the bound ones' fields over tensors of the key's dtype: their keys are the bound ones)
        live = (*descs[:5], lse, delta, *descs[5:])
        if self.any:
            live += (*tensors[5:], *(lse if t is None else t for t in extras))
        if flex is not None:
            live += (flex, )
        # (checked: lse, delta and, fa3_bwd_any_kernel's, dK, dV and the extras, then the flex group; fresh: from
        # the extras on)
        return self.bound(grid, live, _checked(len(live), (11 if self.any else 9) if fresh else 5, (7, 8)))


def _bwd_key(q, k, v, lse, dk, dv, params, alibi, sq, sk, block_m: int, flex=None, split: int = 1,
             same: bool = False):
    """The key of a backward's launch template: what fixes every argument but the live ones (the shapes and strides
    of q, k, v fix their descriptors' geometry; dO and dQ's accumulator are contiguous); block_m: the kernel's Br
    (its dQ tile); flex: the constexpr FLEX of a problem with flashtile.flex's features; split: bwd_split's; same:
    one_cu_seqlens()'s."""
    return (q.shape, k.shape, v.shape, layout(q, k, v), q.dtype, q.device, lse.stride(), dk.dtype, dk.stride(),
            dv.stride(), params.softmax_scale, params.window_left, params.window_right, params.softcap,
            None if alibi is None else alibi.stride(), sq, sk, bwd_dq_tile(block_m, q.shape[-1]), flex, split, same)


def dense_bwd(q, k, params, alibi, varlen: bool, flex: bool = False) -> bool:
    """Whether the dense backward kernel (_fa3_bwd.fa3_bwd_kernel) takes the problem: dense, no softcap, ALiBi,
    flashtile.flex feature (flex) or window but causal's, lengths its tiles divide, causal with equal lengths; else
    fa3_bwd_any_kernel does."""
    if varlen or alibi is not None or params.softcap > 0 or params.is_local or flex:
        return False
    block_m, block_n, _ = BWD_CONFIGS[q.shape[-1]]
    sq, sk = q.shape[1], k.shape[1]
    return not (sq % block_m or sk % block_n or (params.is_causal and sq != sk))


def bwd_features(params, varlen: bool, alibi, sq: int, sk: int, block_m: int, block_n: int, flex: bool = False,
                 sparse: bool = False, head_dim: int = 0, same_seqs: bool = False) -> Features:
    """fa3_bwd_any_kernel's FEATURES for a problem (its docstring and fa3_fwd_kernel's say what each compiles
    in).
    SKIP: a query block may see none of a consumer warpgroup's 64 keys - a left window, a sequence's end, or a right
    window other than causal over equal lengths with Br <= 64 (with Br 128, aligned causal blocks always see some);
    not for sequence ends alone where BWD_TAIL_EVERY_STEP has the head dim of a varlen problem (the kernel then
    bounds every step's keys).
    flex: flashtile.flex's features (rows may see no key), sparse: a block mask (steps past the rows: TAIL).
    same_seqs: one_cu_seqlens() (False for a dense problem); SAME_SEQS where BWD_SAME_SEQS has the head dim.
    MASK_EVERY_STEP: softcap, ALiBi or flex with a mask rule or sequence ends where BWD_MASK_EVERY_STEP has the
    head dim."""
    has_left, has_right = params.has_left, params.has_right
    tail = varlen or sq % block_m != 0 or sk % block_n != 0 or sparse
    aligned_causal = params.lower_triangular and sq == sk and block_m > block_n // 2
    every_step = varlen and not (has_left or has_right or sparse) and head_dim in BWD_TAIL_EVERY_STEP
    scores = params.softcap > 0 or alibi is not None or flex
    return Features(VARLEN=varlen, HAS_LEFT=has_left, HAS_RIGHT=has_right, SOFTCAP=params.softcap > 0,
                    ALIBI=alibi is not None, TAIL=tail,
                    SKIP=has_left or (tail and not every_step) or (has_right and not aligned_causal),
                    EMPTY=rows_may_see_no_key(params, varlen, sq, sk, flex) or tail,
                    SAME_SEQS=same_seqs and head_dim in BWD_SAME_SEQS,
                    MASK_EVERY_STEP=scores and (has_left or has_right or tail) and head_dim in BWD_MASK_EVERY_STEP)


def one_cu_seqlens(cu_seqlens_q, cu_seqlens_k) -> bool:
    """Whether a varlen problem's queries and keys are the same sequences: one cu_seqlens tensor passed for both (the
    same object, or views of the same memory with the same shape and strides); False for a dense problem."""
    if cu_seqlens_q is None:
        return False
    return cu_seqlens_q is cu_seqlens_k or (cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr()
                                            and cu_seqlens_q.shape == cu_seqlens_k.shape
                                            and cu_seqlens_q.stride() == cu_seqlens_k.stride())


def bwd(dout, q, k, v, lse, delta, dq, dk, dv, params, dq_acc=None, alibi=None, cu_seqlens_q=None,
        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, bias=None, mask=None, sparse=None,
        mods=None) -> None:
    """dq, dk, dv of attention(q, k, v) by the Gluon FA3 backward, from the forward's lse (natural log) and
    delta = rowsum(dout o out) (- dlse), both (batch, nheads, seqlen_q) or (varlen) (nheads, total_q) float32 with
    equal strides. Call only where supports(..., backward=True) said yes; dout is made contiguous here, dk / dv
    may be strided. dq_acc: a zeroed float32 accumulator of q's shape, contiguous (None: made here); dq None: dQ
    is added into dq_acc and left there (the caller's running sum, not zeroed here; dq_acc then required). dk / dv
    float32 (q 16-bit): dK and dV are written in float32 (partial gradients a caller sums); else a GQA problem
    whose programs are too few splits each group over programs (bwd_split), adding dK, dV into float32
    accumulators converted into dk, dv. bias, mask, sparse, mods: flashtile.flex's features as fwd takes them
    (mods.score_aux_grad: the captured tensors' gradient buffers)."""
    _, kern, TensorDescriptor = _kernels(_device_index(q))
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    sq = max_seqlen_q if varlen else q.shape[1]
    sk = max_seqlen_k if varlen else k.shape[1]
    nheads, head_dim, nheads_k = q.shape[-2], q.shape[-1], k.shape[-2]
    group = nheads // nheads_k
    with_flex = has_flex(bias, mask, sparse, mods)
    same = one_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    dense = dense_bwd(q, k, params, alibi, varlen, with_flex)
    (block_m, block_n, stages), pingpong = bwd_config(head_dim, params, alibi, dense, dk.dtype != q.dtype, with_flex)
    split = bwd_split(q, k, params, dense, dk.dtype != q.dtype, sq, sk, block_n)
    grads = (dk, dv)
    dk, dv = _dkv_targets(dk, dv, split)
    dout = tma_ready(dout)
    assert lse.stride() == delta.stride() and lse.stride(-1) == 1
    assert dk.stride(-1) == 1 and dv.stride(-1) == 1
    dq_sum = None   # a caller's running sum TMA cannot tile (a slice of a batch): dQ is added into it from a buffer
    if dq_acc is None or (dq is None and tma_row_view(dq_acc) is None):
        dq_sum, dq_acc = dq_acc, torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dq_tile = bwd_dq_tile(block_m, head_dim)
    grid = (-(-sk // block_n), batch * nheads_k * split, 1)
    flex = None
    if with_flex:
        flex = (bwd_flex(lse, batch, nheads, nheads_k, sq, sk, block_n, bias, mask, sparse, mods),
                flex_consts(bias, mask, sparse, mods, backward=True))
    tile = BwdTile(head_dim, block_m, block_n, stages, pingpong)
    kwargs = dict(TILE=tile, P_LAYOUT=_smem_layout(block_m, block_n // 2, q.dtype), num_warps=4, maxnreg=MAXNREG)
    heads = group // split   # query heads per program
    if dense:
        kwargs.update(CAUSAL=params.is_causal, SPLIT=split,
                      HEADS=heads if head_dim in BWD_GQA_HEADS and heads > 1 else 0)
    else:
        kwargs.update(FEATURES=bwd_features(params, varlen, alibi, sq, sk, block_m, block_n, flex is not None,
                                            sparse is not None, head_dim, same),
                      FLEX=(flex or _NO_FLEX_BWD)[1],
                      HEADS=group if head_dim in BWD_ANY_GQA_HEADS and group > 1 and sparse is None else 0)
    extras = (cu_seqlens_q, cu_seqlens_k, alibi)
    live_flex = None if flex is None else flex[0]   # (a flex problem's template takes its tensors per call)
    key = _bwd_key(q, k, v, lse, dk, dv, params, alibi, sq, sk, block_m, None if flex is None else flex[1], split,
                   same)
    tpl = _BWD_TEMPLATES.get(key)
    if tpl is not None and tpl.kwargs == kwargs and tpl.launch(grid, (k, v, q, dout, dq_acc, dk, dv), lse, delta,
                                                               extras, live_flex):
        _dq_out(dq, dq_sum, dq_acc)
        _dkv_out(grads, (dk, dv))
        return

    def desc(t, rows, cols):
        return _desc(TensorDescriptor, t, rows, cols, t.dtype)

    # dK, dV by TMA: through a (rows, nheads_k * d) view of dk / dv where their strides allow one (e.g. slices of a
    # packed gradient), else through a contiguous buffer copied into them
    dkv = []
    for g in (dk, dv):
        g_desc = desc(g, block_n // 2, head_dim)
        if g_desc is None:
            g = torch.empty(g.shape, dtype=g.dtype, device=g.device)
            g_desc = desc(g, block_n // 2, head_dim)
        dkv.append((g, g_desc))
    (dk_out, dk_desc), (dv_out, dv_desc) = dkv

    descs = (desc(k, block_n, head_dim), desc(v, block_n, head_dim), desc(q, block_m, head_dim),
             desc(dout, block_m, head_dim), desc(dq_acc, *dq_tile))
    if dense:
        kernel, n_live = kern.fa3_bwd_kernel, _BWD_LIVE
        args = (*descs, lse, delta, dk_desc, dv_desc, (lse.stride(0), lse.stride(1)), (sq, sk, nheads_k, heads),
                (params.softmax_scale, params.softmax_scale * LOG2E))
    else:
        kernel, n_live = kern.fa3_bwd_any_kernel, _BWD_LIVE + 5
        lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
        score_scale, softcap_log2 = params.score_args()
        strides = (*lse_strides, tma_row_view(dk_out).stride(0), tma_row_view(dv_out).stride(0),
                   0 if alibi is None or alibi.dim() == 1 else alibi.stride(0))
        args = (*descs, lse, delta, dk_desc, dv_desc, dk_out, dv_out, *(lse if t is None else t for t in extras),
                (flex or _NO_FLEX_BWD)[0], strides, (max(sq, 2) if varlen else sq, sk, nheads_k, group),
                (params.softmax_scale, score_scale, softcap_log2),
                (max(params.window_left, 0), max(params.window_right, 0)))
        n_live += live_flex is not None
    launched = relaunch.launch(kernel, grid[:2], args, kwargs)
    if dk_out is dk and dv_out is dv:   # (not through copies: descriptors over per-call buffers)
        bound = relaunch.bind(kernel, args, kwargs, n_live, launched)
        if bound is not None:
            relaunch.remember(_BWD_TEMPLATES, key, _BwdTemplate(bound, kwargs, TensorDescriptor, [
                descriptor_fields(d) for d in (*descs, dk_desc, dv_desc)], not dense))
    _dq_out(dq, dq_sum, dq_acc)
    _dkv_out(grads, (dk_out, dv_out))


def _dq_out(dq, dq_sum, dq_acc) -> None:
    """dQ from the kernel's float32 accumulator to where bwd's caller wants it: dq (q's dtype), else added into the
    caller's running sum where that was not the accumulator itself."""
    if dq is not None:
        dq.copy_(dq_acc)
    elif dq_sum is not None:
        dq_sum.add_(dq_acc)


class ForwardPlan:
    """fwd() of one problem (shapes, dtype, device, LSE strides, the scalars, extras' layout) called again and
    again (a training loop): what fwd() derives from the problem is derived once, and a call launches the
    template fwd() left (_FwdTemplate), checking only the config it was made with (benchmark sweeps change the
    tables) and the strides of q, k, v and out (their descriptors' geometry). Call only where supports() said yes
    for tensors of these shapes. A dense problem with flashtile.flex's features (features: its (bias, mask,
    sparse, mods), as supports() took them) passes its tensors to each call, which the template takes live."""
    __slots__ = ("key", "cfg", "grid", "tpl", "sizes", "layout", "flex")

    def __init__(self, q, k, v, lse, params, alibi=None, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None,
                 features=None):
        varlen = cu_seqlens_q is not None
        head_dim = q.shape[-1]
        sq = max_seqlen_q if varlen else q.shape[1]
        sk = max_seqlen_k if varlen else k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
        self.sizes = (sq, sk)
        self.flex = None if features is None or not has_flex(*features) else flex_consts(*features)
        self.cfg = fwd_config(head_dim, sq, params.has_right, alibi is not None, self.flex is not None)
        n_tiles = -(-sq // (self.cfg[0] * WG_ROWS)) * batch * q.shape[-2]
        self.grid = (min(n_tiles, _sm_count(_device_index(q))) if PERSISTENT else n_tiles, 1, 1)
        out = torch.empty(q.shape, device="meta")   # (the output the callers make: contiguous)
        self.layout = layout(q, k, v, out)
        self.key = _fwd_key(q, k, v, out, lse, params, alibi, sq, sk, self.flex)
        self.tpl = None

    def __call__(self, q, k, v, out, lse, params, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, mask=None,
                 bias=None, sparse=None, mods=None) -> bool:
        """False (nothing launched) where this call cannot take the kernel: Gluon turned off, or a tensor TMA
        cannot tile. mask, bias, sparse, mods: the flex features of a plan made with them (else None)."""
        if not enabled():
            return False
        tpl = self.tpl
        flex = None if self.flex is None else flex_runtime(lse, q.shape[0], q.shape[2], *self.sizes, bias, mask,
                                                           sparse, mods)
        if (tpl is not None and layout(q, k, v, out) == self.layout
                and self.cfg == fwd_config(q.shape[-1], self.sizes[0], params.has_right, alibi is not None,
                                           self.flex is not None)
                and tpl.launch(self.grid, q, k, v, out, lse, (lse, lse, lse), tickets(q.device, 1),
                               (cu_seqlens_q, cu_seqlens_k, alibi), flex, fresh=True)):
            return True
        if not tma_viewable(q, k, v, out):
            return False
        fwd(q, k, v, out, lse, params, alibi, cu_seqlens_q, cu_seqlens_k, *self.sizes, bias, mask, sparse, mods)
        self.tpl = _FWD_TEMPLATES.get(self.key)
        return True


class BackwardPlan:
    """bwd() of one problem (dense or varlen) called again and again: the template bwd() left (_BwdTemplate) is
    launched directly, with the config it was made with checked. Call only where supports(..., backward=True) said
    yes and takes(q, k, v), with contiguous dK and dV. features: as ForwardPlan's. A varlen plan keeps two templates:
    for calls whose queries and keys share one cu_seqlens tensor (one_cu_seqlens) and for the others."""
    __slots__ = ("keys", "grid", "tpls", "cfg", "sizes", "layout", "flex", "dense", "grads_f32", "split")

    def __init__(self, q, k, v, lse, dk, dv, params, alibi=None, cu_seqlens_q=None, max_seqlen_q=None,
                 max_seqlen_k=None, features=None):
        varlen = cu_seqlens_q is not None
        batch, head_dim = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0], q.shape[-1]
        self.sizes = (max_seqlen_q, max_seqlen_k) if varlen else (q.shape[1], k.shape[1])
        flex = features is not None and has_flex(*features)
        self.dense = dense_bwd(q, k, params, alibi, varlen, flex)
        self.grads_f32 = dk.dtype != q.dtype   # (float32 partial sums of a 16-bit problem)
        self.cfg = bwd_config(head_dim, params, alibi, self.dense, self.grads_f32, flex)
        block_m, block_n, _ = self.cfg[0]
        self.split = bwd_split(q, k, params, self.dense, self.grads_f32, *self.sizes, block_n)
        self.grid = (-(-self.sizes[1] // block_n), batch * k.shape[-2] * self.split, 1)
        self.layout = layout(q, k, v)
        self.flex = flex_consts(*features, backward=True) if flex else None
        if self.split > 1:   # (the key of bwd()'s launch: over the float32 accumulators)
            dk, dv = (torch.empty(t.shape, device="meta", dtype=torch.float32) for t in (dk, dv))
        self.keys = tuple(_bwd_key(q, k, v, lse, dk, dv, params, alibi, *self.sizes, block_m, self.flex, self.split,
                                   same) for same in (False, True))
        self.tpls = [None, None]   # (per one_cu_seqlens(): the launch template bwd() left)

    def takes(self, q, k, v) -> bool:
        """Whether q, k, v have the strides the plan was made with (its descriptors' geometry) and aligned bases."""
        return layout(q, k, v) == self.layout and aligned_bases(q, k, v)

    def __call__(self, dout, q, k, v, lse, delta, dq, dk, dv, params, dq_acc, alibi=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, bias=None, mask=None, sparse=None, mods=None) -> None:
        """dq_acc: zeroed, float32, q's shape, contiguous; dq is filled from it here. dout contiguous and aligned.
        bias, mask, sparse, mods: the flex features of a plan made with them (else None)."""
        same = one_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
        tpl = self.tpls[same]
        head_dim = q.shape[-1]
        flex = None
        if self.flex is not None:
            flex = bwd_flex(lse, q.shape[0], q.shape[2], k.shape[2], *self.sizes, self.cfg[0][1], bias, mask, sparse,
                            mods)
        if tpl is not None and self.cfg == bwd_config(head_dim, params, alibi, self.dense, self.grads_f32,
                                                      self.flex is not None):
            targets = _dkv_targets(dk, dv, self.split)
            if tpl.launch(self.grid, (k, v, q, dout, dq_acc, *targets), lse, delta, (cu_seqlens_q, cu_seqlens_k, alibi),
                          flex, fresh=True):
                dq.copy_(dq_acc)
                _dkv_out((dk, dv), targets)
                return
        bwd(dout, q, k, v, lse, delta, dq, dk, dv, params, dq_acc, alibi, cu_seqlens_q, cu_seqlens_k, *self.sizes,
            bias, mask, sparse, mods)
        self.tpls[same] = _BWD_TEMPLATES.get(self.keys[same])

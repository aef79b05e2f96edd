"""What the benchmark measures, each in one place: FLOPs, inputs, correctness against the oracle, time, memory.

FLOPs (FA3 paper §4.1; docs/performance.md): forward = 4 * seqlen_q * seqlen_k * headdim * nheads * batch (two
matmuls of 2 * sq * sk * d each), halved when causal; backward = 2.5 x forward (five matmuls instead of two).

Correctness: every provider's output (and gradients, when the backward is timed) is compared with the float64
oracle ``flashtile.reference.dense.attention_ref`` before it is timed. The oracle materialises the score matrix,
so at benchmark sizes it runs on a *slice*: the first and last batch element x the first and last head (attention
is independent per (batch, head), so the slice's outputs and gradients are exactly those of the full problem),
in float64 on the inputs' device, over chunks of query rows so that no chunk holds more than
``max_score_elems`` scores. Error = ||x - ref|| / ||ref|| (Frobenius, in float64) per tensor.

Time: on CUDA ``triton.testing.do_bench(..., return_mode="median")`` (CUDA events, L2 flushed between runs);
on CPU a ``time.perf_counter`` median. CPU numbers exist so the runner can be tested without a GPU; they mean
nothing about the kernels (flashtile runs through the Triton *interpreter* there).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
import time
from typing import Callable, Dict, Optional, Sequence

import torch

from flashtile.reference.dense import attention_ref, visible_mask

# Relative error ||out - ref|| / ||ref|| a provider must stay below to be timed.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-2}


# ----------------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------------
# Matmul FLOPs of a pass relative to the forward's (FA papers): the backward runs five matmuls to the forward's two.
MODE_FACTORS = {"fwd": 1.0, "bwd": 2.5, "train": 3.5, "fwd_bwd": 3.5}


def visible_pairs(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal: bool = False) -> int:
    """Exact number of (query, key) pairs one head of one sequence attends, under flash-attn's mask rule.

    Bottom-right aligned: key j is visible from query i iff i + sk - sq - left <= j <= i + sk - sq + right, with
    window_size = (left, right), -1 = unbounded on that side; causal forces right = 0
    (flashtile.reference.dense.visible_mask is the same rule as a matrix).
    """
    left, right = window_size
    if causal:
        right = 0
    diag = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)
    lo = (diag - left).clamp_min(0) if left >= 0 else torch.zeros_like(diag)
    hi = (diag + right).clamp_max(seqlen_k - 1) if right >= 0 else torch.full_like(diag, seqlen_k - 1)
    return int((hi - lo + 1).clamp_min(0).sum())


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int, causal: bool,
                    mode: str = "fwd") -> float:
    """Matmul FLOPs of one attention call, the FA papers' convention.

    mode "fwd": 4 * sq * sk * d * h * b (QK^T and PV), x 0.5 when causal and sq == sk. When sq != sk the causal
    factor is the exact fraction of visible (query, key) pairs under bottom-right alignment.
    mode "bwd": 2.5 x fwd. mode "train" (or "fwd_bwd"): 3.5 x fwd.
    """
    for name, val in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k),
                      ("headdim", headdim)):
        if int(val) <= 0:
            raise ValueError(f"attention_flops: {name}={val}, expected a positive integer")
    flops = 4.0 * seqlen_q * seqlen_k * headdim * nheads * batch
    if causal:
        if seqlen_q == seqlen_k:
            flops *= 0.5
        else:
            flops *= visible_pairs(seqlen_q, seqlen_k, causal=True) / (seqlen_q * seqlen_k)
    factor = MODE_FACTORS.get(mode)
    if factor is None:
        raise ValueError(f"attention_flops: mode={mode!r}, expected 'fwd', 'bwd', 'train' or 'fwd_bwd'")
    return flops * factor


def tflops_per_s(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------
def random_inputs(batch, nheads, seqlen, headdim, dtype, device, seed: int):
    """Fresh N(0, 1) q, k, v and upstream gradient do, (batch, seqlen, nheads, headdim), never zeros.

    Drawn on the CPU from a seeded generator (same numbers on any device), then moved.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (batch, seqlen, nheads, headdim)
    return tuple(torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
                 for _ in range(4))


def alibi_slopes(nheads: int) -> torch.Tensor:
    """The geometric ALiBi slopes (Press et al., "Train Short, Test Long", section 3), float32 (nheads,).

    For n heads, n a power of two: 2^(-8/n), 2^(-16/n), ..., 2^(-8). Otherwise the slopes of the largest power of two
    p below n, then every other slope of 2p, as the ALiBi authors' code does.
    """
    def geometric(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** int(math.floor(math.log2(nheads)))
    slopes = geometric(p) + geometric(2 * p)[0::2][: nheads - p]
    return torch.tensor(slopes, dtype=torch.float32)


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """(b, s, h, d) -> a new contiguous tensor in the provider's layout (never x itself: each provider gets
    its own leaf tensors, so gradients cannot leak from one provider to the next)."""
    x = x.detach()
    return x.clone() if layout == "bshd" else x.transpose(1, 2).contiguous()


def from_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The provider's layout -> (b, s, h, d) (a view)."""
    return x if layout == "bshd" else x.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------------------------------------
def check_slice(batch: int, nheads: int):
    """(batch indices, head indices) the oracle is computed on: first and last of each."""
    return sorted({0, batch - 1}), sorted({0, nheads - 1})


def take_slice(x: torch.Tensor, b_idx, h_idx) -> torch.Tensor:
    """x (b, s, h, d) -> (len(b_idx), s, len(h_idx), d)."""
    return x[b_idx][:, :, h_idx]


@dataclasses.dataclass
class Reference:
    """Oracle output and gradients on the checked slice, float64, (len(b_idx), s, len(h_idx), d)."""
    b_idx: list
    h_idx: list
    out: torch.Tensor
    grads: Optional[Dict[str, torch.Tensor]]  # dq, dk, dv, or None when only the forward is checked


def compute_reference(q, k, v, do, causal: bool, with_grads: bool, max_score_elems: int = 1 << 26) -> Reference:
    """float64 attention_ref on the check slice of (b, s, h, d) inputs, chunked over query rows.

    Rows of a chunk keep their global causal mask (passed as attn_mask), and dk/dv accumulate over chunks
    through autograd, so chunking changes nothing but peak memory.
    """
    b_idx, h_idx = check_slice(q.shape[0], q.shape[2])
    qs, ks, vs, dos = (take_slice(x, b_idx, h_idx).double() for x in (q, k, v, do))
    qs.requires_grad_(with_grads)
    ks.requires_grad_(with_grads)
    vs.requires_grad_(with_grads)
    nb, sq, nh, _ = qs.shape
    sk = ks.shape[1]
    rows = max(1, max_score_elems // (nb * nh * sk))
    mask = visible_mask(sq, sk, causal=True, device=q.device) if causal else None
    outs = []
    with torch.enable_grad():
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            attn_mask = mask[r0:r1].view(1, 1, r1 - r0, sk) if causal else None
            out_c, _, _ = attention_ref(qs[:, r0:r1], ks, vs, attn_mask=attn_mask)
            if with_grads:
                out_c.backward(dos[:, r0:r1])
            outs.append(out_c.detach())
    grads = {"dq": qs.grad, "dk": ks.grad, "dv": vs.grad} if with_grads else None
    return Reference(b_idx, h_idx, torch.cat(outs, dim=1), grads)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (nan when x has non-finite entries; then no tolerance passes)."""
    x = x.detach().double()
    denom = ref.norm().clamp_min(torch.finfo(torch.float64).tiny)
    return float((x - ref).norm() / denom)


def max_rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x - ref| / max|ref| in float64 (nan where x has a non-finite entry or another shape than ref)."""
    if x.shape != ref.shape:
        return math.nan
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(torch.finfo(torch.float64).tiny))


def compare(ref: Reference, tensors: Dict[str, torch.Tensor], tol: float) -> Dict:
    """Relative errors of full (b, s, h, d) tensors {"out"|"dq"|"dk"|"dv": x} on ref's slice.

    Returns {"errors": {name: err}, "tol": tol, "passed": all(err < tol)}.
    """
    want = {"out": ref.out, **(ref.grads or {})}
    errors = {}
    for name, x in tensors.items():
        if x.dim() != 4 or x.shape[0] <= ref.b_idx[-1] or x.shape[2] <= ref.h_idx[-1]:
            errors[name] = float("nan")  # a wrong shape is wrong, not a crash
            continue
        got = take_slice(x, ref.b_idx, ref.h_idx)
        errors[name] = relative_error(got, want[name]) if got.shape == want[name].shape else float("nan")
    passed = all(e < tol for e in errors.values())  # nan < tol is False
    return {"errors": errors, "tol": tol, "passed": passed}


# ----------------------------------------------------------------------------------------------------------
# Time
# ----------------------------------------------------------------------------------------------------------
def time_cuda_ms(fn: Callable, warmup: float, rep: float, grad_to_none: Optional[Sequence] = None) -> float:
    """Median milliseconds of fn() by triton.testing.do_bench (same keywords on triton 3.6 and 3.9)."""
    from triton.testing import do_bench

    params = inspect.signature(do_bench).parameters
    kwargs = {"warmup": warmup, "rep": rep, "grad_to_none": grad_to_none}
    if "return_mode" in params:
        kwargs["return_mode"] = "median"
    else:  # older triton: the median is the 0.5 quantile
        kwargs["quantiles"] = [0.5]
    ms = do_bench(fn, **kwargs)
    return float(ms[0] if isinstance(ms, (list, tuple)) else ms)


def time_cpu_ms(fn: Callable, warmup: float, rep: float, grad_to_none: Optional[Sequence] = None,
                max_iters: int = 100) -> float:
    """Median milliseconds of fn() by time.perf_counter: warm-up for ~warmup ms (at least one call), then
    ~rep ms of timed calls (at least one, at most max_iters). For tests of the runner only."""
    def once():
        if grad_to_none is not None:
            for x in grad_to_none:
                x.grad = None
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    spent = once()
    while spent < warmup:
        spent += once()
    times = [once()]
    while sum(times) < rep and len(times) < max_iters:
        times.append(once())
    return statistics.median(times)


def timer_for(device: torch.device):
    return time_cuda_ms if torch.device(device).type == "cuda" else time_cpu_ms


class Budget:
    """A run's wall-clock budget (a script's --budget-s): once it is spent, cases not yet started are skipped.
    seconds None: no budget."""

    def __init__(self, seconds: Optional[float]):
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds


TIMER_DESCRIPTION = {
    "cuda": 'triton.testing.do_bench(fn, warmup, rep, grad_to_none, return_mode="median"), milliseconds',
    "cpu": "time.perf_counter median on the CPU (runner test only: the numbers mean nothing about the kernels)",
}


# ----------------------------------------------------------------------------------------------------------
# Memory and failures
# ----------------------------------------------------------------------------------------------------------
class CudaMemoryProbe:
    """Peak bytes allocated by the PyTorch caching allocator on one CUDA device."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"memory measurement needs a CUDA device, got device={self.device}")

    def reset(self) -> int:
        """Empty the cache, reset the peak; returns the bytes allocated now (the baseline)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """Out of device memory (not Triton's 'out of resource: shared memory', which is a capability limit)."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    return isinstance(exc, oom_types) or "out of memory" in str(exc).lower()


def describe(exc: BaseException, limit: int = 300) -> str:
    """One line: 'Type: message', cut to limit characters."""
    msg = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""Benchmark runner: the grid, the loop over (case, provider), and the command-line arguments.

Python API::

    from flashtile.bench import BenchConfig, fa3_grid, run_speed, write_report
    cfg = BenchConfig(shapes=fa3_grid(headdims=(128,)), providers=["flashtile", "cudnn"], device="cuda")
    result = run_speed(cfg)              # dict: settings, providers, results (one record per case x provider x mode)
    write_report(result, "results/x")    # results.json, results.md, PNG plots

CLI (flashtile/cli.py wires these in): ``add_bench_arguments(parser)`` and ``run_bench(args) -> exit code``.

For each (shape, causal) the runner draws fresh N(0, 1) inputs (seed = --seed + case index, recorded), computes
the float64 oracle on a slice once (measure.compute_reference), then for each provider: builds the inputs in the
provider's layout, makes one untimed call (compile / autotune / capability errors surface here and are reported
as 'skipped' with the reason, an out-of-memory as 'oom'), checks the output and, when the backward is timed,
the gradients ('wrong' ones are not timed), then times the forward ``attn(q, k, v, causal)`` (inputs
requires_grad, i.e. the training forward, as flash-attn's own benchmarks) and the backward
``o.backward(do, retain_graph=True)`` with grad_to_none=[q, k, v].
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from flashtile.bench import measure
from flashtile.bench.providers import PROVIDERS, Provider, ProviderUnavailable, resolve_names

# The FA3 paper grid (§4.1): 16k tokens in total, hidden size 2048.
FA3_HEADDIMS = (64, 128, 256)
FA3_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOTAL_TOKENS = 16384
HIDDEN = 2048
# CPU: a tiny grid that only exercises the runner (flashtile runs through the Triton interpreter there).
CPU_HEADDIMS, CPU_SEQLENS, CPU_BATCH, CPU_NHEADS = (32,), (64, 128), 1, 2
# Memory mode (FA1 Figure 3 right): fixed batch and heads, growing seqlen, so O(N) and O(N^2) separate.
MEMORY_HEADDIMS = (128,)
MEMORY_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
MEMORY_BATCH = 2

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# fwd: the training forward; bwd: o.backward(do) alone; train: forward + backward in one timed call (a training
# step's attention, host time included: at short sequences and small batches the call is host-bound)
MODES = ("fwd", "bwd", "train")


# ----------------------------------------------------------------------------------------------------------
# Grid
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    """One problem size; q, k, v are (batch, seqlen, nheads, headdim) (seqlen_q == seqlen_k)."""
    batch: int
    nheads: int
    seqlen: int
    headdim: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"Shape: {f.name}={val!r}, expected a positive integer")


def derive_shapes(headdims: Sequence[int], seqlens: Sequence[int], batch: Optional[int] = None,
                  nheads: Optional[int] = None, total_tokens: int = TOTAL_TOKENS, hidden: int = HIDDEN) -> List[Shape]:
    """Shapes for every (headdim, seqlen); batch defaults to total_tokens // seqlen (at least 1) and nheads to
    hidden // headdim (at least 1), the FA3 paper's convention."""
    shapes = []
    for d in headdims:
        for n in seqlens:
            b = batch if batch is not None else max(1, total_tokens // n)
            h = nheads if nheads is not None else max(1, hidden // d)
            shapes.append(Shape(batch=b, nheads=h, seqlen=n, headdim=d))
    return shapes


def fa3_grid(headdims: Sequence[int] = FA3_HEADDIMS, seqlens: Sequence[int] = FA3_SEQLENS) -> List[Shape]:
    """The FA3 paper benchmark grid: 16k tokens, hidden 2048, headdim 64/128/256, seqlen 512..16k."""
    return derive_shapes(headdims, seqlens)


@dataclasses.dataclass
class BenchConfig:
    shapes: List[Shape]
    providers: List[str]
    causals: Tuple[bool, ...] = (False, True)
    modes: Tuple[str, ...] = ("fwd", "bwd")
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    warmup: float = 25.0  # ms of warm-up (do_bench)
    rep: float = 100.0  # ms of timed repetitions (do_bench)
    seed: int = 0
    baseline: Optional[str] = None  # ratio denominator in the report
    compare: Optional[List[str]] = None  # ratio numerators (default: flashtile providers)
    max_score_elems: int = 1 << 26  # oracle chunk size (float64 scores per chunk)

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"BenchConfig: modes={self.modes!r}, expected a non-empty subset of {MODES}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"BenchConfig: dtype={self.dtype}, expected one of {list(DTYPES.values())}")
        if not self.shapes:
            raise ValueError("BenchConfig: shapes is empty")
        if self.warmup <= 0 or self.rep <= 0:
            raise ValueError(f"BenchConfig: warmup={self.warmup}, rep={self.rep}: expected positive milliseconds")


# ----------------------------------------------------------------------------------------------------------
# Progress (tqdm when installed; the GPU image may not have it)
# ----------------------------------------------------------------------------------------------------------
class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar, self.total, self.done, self.enabled = None, total, 0, enabled
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def start(self, desc: str):
        """Announce the item about to run (a slow compile should show what is compiling)."""
        if self.bar is not None:
            self.bar.set_description_str(desc)
        elif self.enabled:
            print(f"[{self.done + 1}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def step(self):
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------------------
# Speed
# ----------------------------------------------------------------------------------------------------------
def _make_providers(names, registry, device, dtype) -> Tuple[Dict[str, object], Dict[str, dict]]:
    """name -> attn (or None), and name -> {status, reason, layout, description} for the report."""
    fns, info = {}, {}
    for name in names:
        prov: Provider = registry[name]
        entry = {"layout": prov.layout, "description": prov.description}
        try:
            fns[name] = prov.make(device, dtype)
            entry.update(status="available", reason=None)
        except Exception as e:  # ProviderUnavailable, or any surprise in a third-party import
            fns[name] = None
            reason = str(e) if isinstance(e, ProviderUnavailable) else measure.describe(e)
            entry.update(status="unavailable", reason=reason)
        info[name] = entry
    return fns, info


def _release(device: torch.device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_call(fn, *args):
    """(fn(*args), None), or (None, (status, reason)) when it raises. The call runs with warnings recorded:
    SDPA explains why a backend refused the inputs only in warnings, which then go into the reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn(*args), None
        except Exception as e:
            notes = sorted({" ".join(str(w.message).split())[:200] for w in caught})
            return None, _failure(e, notes)


def _failure(exc: BaseException, notes=()) -> Tuple[str, str]:
    """(status, reason) for an exception at a provider's first call."""
    reason = measure.describe(exc)
    if notes:
        reason += " | warnings: " + " | ".join(notes)
    return ("oom" if measure.is_oom(exc) else "skipped"), reason[:1000]


def _bench_one(name: str, prov: Provider, attn, shape: Shape, causal: bool, inputs, ref, cfg: BenchConfig,
               timer, seed: int, unavailable: Optional[str] = None) -> List[dict]:
    """Records (one per mode) for one provider on one (shape, causal); attn None = unavailable (the reason)."""
    tol = prov.tolerance if prov.tolerance is not None else measure.TOLERANCE[cfg.dtype]

    def rec(mode, status, reason=None, **kw):
        r = {"provider": name, "mode": mode, "causal": causal, **dataclasses.asdict(shape),
             "dtype": DTYPE_NAMES[cfg.dtype], "seed": seed, "status": status, "reason": reason,
             "flops": measure.attention_flops(shape.batch, shape.nheads, shape.seqlen, shape.seqlen,
                                              shape.headdim, causal, mode),
             "ms": None, "tflops": None, "errors": None, "tol": tol}
        r.update(kw)
        if r["ms"] is not None:
            r["tflops"] = measure.tflops_per_s(r["flops"], r["ms"])
        return r

    if attn is None:
        return [rec(m, "skipped", f"unavailable: {unavailable}") for m in cfg.modes]

    q, k, v, do = (measure.to_layout(x, prov.layout) for x in inputs)
    for t in (q, k, v):
        t.requires_grad_(True)
    records = {}

    # Forward: one untimed call, checked against the oracle, then timed.
    out, failed = first_call(attn, q, k, v, causal)
    if failed is None and not isinstance(out, torch.Tensor):
        failed = ("skipped", f"returned {type(out).__name__}, expected a tensor")
    if failed is not None:
        status, reason = failed
        return [rec(m, status, f"first call: {reason}") for m in cfg.modes]
    check = measure.compare(ref, {"out": measure.from_layout(out, prov.layout)}, tol)
    if not check["passed"]:
        return [rec(m, "wrong", "output differs from the float64 reference", errors=check["errors"])
                for m in cfg.modes]
    errors = dict(check["errors"])
    if "fwd" in cfg.modes:
        try:
            ms = timer(lambda: attn(q, k, v, causal), cfg.warmup, cfg.rep)
            records["fwd"] = rec("fwd", "ok", ms=ms, errors=dict(errors))
        except Exception as e:
            records["fwd"] = rec("fwd", "oom" if measure.is_oom(e) else "error", measure.describe(e))

    # Backward: one untimed backward, gradients checked, then o.backward(do) timed (and the training step, forward
    # + backward in one call)
    if "bwd" in cfg.modes or "train" in cfg.modes:
        _, failed = first_call(lambda: out.backward(do, retain_graph=True))
        grads = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
        if failed is None and any(g is None for g in grads.values()):
            failed = ("skipped", "backward left a gradient of q, k or v unset")
        passes = [m for m in ("bwd", "train") if m in cfg.modes]
        if failed is not None:
            status, reason = failed
            records.update({m: rec(m, status, f"first backward: {reason}", errors=dict(errors)) for m in passes})
        else:
            gcheck = measure.compare(ref, {n: measure.from_layout(g, prov.layout) for n, g in grads.items()}, tol)
            errors.update(gcheck["errors"])
            if not gcheck["passed"]:
                records.update({m: rec(m, "wrong", "gradients differ from the float64 reference", errors=errors)
                                for m in passes})
            else:
                timed = {"bwd": lambda: out.backward(do, retain_graph=True),
                         "train": lambda: attn(q, k, v, causal).backward(do)}
                for m in passes:
                    try:
                        ms = timer(timed[m], cfg.warmup, cfg.rep, grad_to_none=[q, k, v])
                        records[m] = rec(m, "ok", ms=ms, errors=errors)
                    except Exception as e:
                        records[m] = rec(m, "oom" if measure.is_oom(e) else "error", measure.describe(e),
                                         errors=errors)
    return [records[m] for m in cfg.modes]


def _run_setup(cfg: BenchConfig, registry: Optional[Dict[str, Provider]], progress: bool):
    """What a speed run and a memory run set up alike: (the registry, PROVIDERS by default; the device; the providers'
    functions and report entries, _make_providers; the (shape, causal) cases; a progress bar over every case and
    provider)."""
    registry = PROVIDERS if registry is None else registry
    device = torch.device(cfg.device)
    fns, info = _make_providers(cfg.providers, registry, device, cfg.dtype)
    cases = [(s, c) for s in cfg.shapes for c in cfg.causals]
    return registry, device, fns, info, cases, _Progress(len(cases) * len(cfg.providers), progress)


def run_speed(cfg: BenchConfig, registry: Optional[Dict[str, Provider]] = None, progress: bool = True) -> dict:
    """Time every provider on every (shape, causal, mode). Never raises for a provider's failure.

    Returns {"kind": "speed", "settings": ..., "providers": {name: info}, "results": [record, ...]}; a record has
    provider, mode, causal, batch, nheads, seqlen, headdim, dtype, seed, status ('ok' | 'wrong' | 'skipped' |
    'oom' | 'error'), reason, flops, ms, tflops, errors ({out, dq, dk, dv: relative error}), tol.
    """
    registry, device, fns, info, cases, bar = _run_setup(cfg, registry, progress)
    timer = measure.timer_for(device)
    records = []
    try:
        for ci, (shape, causal) in enumerate(cases):
            seed = cfg.seed + ci
            inputs = measure.random_inputs(shape.batch, shape.nheads, shape.seqlen, shape.headdim, cfg.dtype,
                                           device, seed)
            try:
                grads = "bwd" in cfg.modes or "train" in cfg.modes
                ref = measure.compute_reference(*inputs, causal=causal, with_grads=grads,
                                                max_score_elems=cfg.max_score_elems)
                ref_error = None
            except Exception as e:  # e.g. OOM on a small GPU: nothing can be checked, so nothing is timed
                ref, ref_error = None, f"reference failed: {measure.describe(e)}"
                _release(device)
            for name in cfg.providers:
                bar.start(f"{name} d{shape.headdim} n{shape.seqlen} {'causal' if causal else 'full'}")
                if ref is None:
                    records += [_error_record(name, shape, causal, m, cfg, seed, ref_error) for m in cfg.modes]
                else:
                    records += _bench_one(name, registry[name], fns[name], shape, causal, inputs, ref, cfg,
                                          timer, seed, unavailable=info[name]["reason"])
                _release(device)
                bar.step()
            del inputs, ref
            _release(device)
    finally:
        bar.close()
    return {"kind": "speed", "settings": settings_of(cfg, timer="cuda" if device.type == "cuda" else "cpu"),
            "providers": info, "results": records}


def _error_record(name, shape, causal, mode, cfg, seed, reason):
    return {"provider": name, "mode": mode, "causal": causal, **dataclasses.asdict(shape),
            "dtype": DTYPE_NAMES[cfg.dtype], "seed": seed, "status": "error", "reason": reason,
            "flops": measure.attention_flops(shape.batch, shape.nheads, shape.seqlen, shape.seqlen, shape.headdim,
                                             causal, mode),
            "ms": None, "tflops": None, "errors": None, "tol": measure.TOLERANCE[cfg.dtype]}


def settings_of(cfg: BenchConfig, timer: str) -> dict:
    return {"providers": list(cfg.providers), "modes": list(cfg.modes), "causals": list(cfg.causals),
            "dtype": DTYPE_NAMES[cfg.dtype], "device": str(cfg.device), "warmup_ms": cfg.warmup, "rep_ms": cfg.rep,
            "seed": cfg.seed, "baseline": cfg.baseline, "compare": cfg.compare,
            "shapes": [dataclasses.asdict(s) for s in cfg.shapes], "timer": measure.TIMER_DESCRIPTION[timer],
            "tolerance": measure.TOLERANCE[cfg.dtype],
            "check": "relative Frobenius error vs float64 flashtile.reference.dense.attention_ref on batch "
                     "{0, b-1} x heads {0, h-1}, chunked over query rows",
            "forward_timed": "attn(q, k, v, causal) with q, k, v requiring grad (training forward)",
            "backward_timed": "o.backward(do, retain_graph=True), grad_to_none=[q, k, v]",
            "train_timed": "attn(q, k, v, causal).backward(do), grad_to_none=[q, k, v] (one call, host time included)"}


# ----------------------------------------------------------------------------------------------------------
# Memory (FA1 Figure 3 right)
# ----------------------------------------------------------------------------------------------------------
def run_memory(cfg: BenchConfig, registry: Optional[Dict[str, Provider]] = None, probe=None,
               progress: bool = True) -> dict:
    """Peak memory of one forward + backward per provider and shape (no correctness check, no timing).

    Each measurement follows an untimed warm-up forward + backward (compilation, autotuning and workspaces
    happen there), then: reset the peak, forward, backward, read torch.cuda.max_memory_allocated. Records
    peak_bytes (includes the inputs q, k, v, do), base_bytes (allocated before the call) and
    extra_bytes = peak - base. An out-of-memory is recorded as status 'oom'.
    probe: an object with reset() -> base bytes, peak() -> bytes, release(); CudaMemoryProbe by default.
    """
    probe = measure.CudaMemoryProbe(cfg.device) if probe is None else probe
    registry, device, fns, info, cases, bar = _run_setup(cfg, registry, progress)
    records = []
    try:
        for ci, (shape, causal) in enumerate(cases):
            for name in cfg.providers:
                bar.start(f"{name} d{shape.headdim} n{shape.seqlen} memory")
                r = {"provider": name, "mode": "fwd_bwd", "causal": causal, **dataclasses.asdict(shape),
                     "dtype": DTYPE_NAMES[cfg.dtype], "seed": cfg.seed + ci, "status": "ok", "reason": None,
                     "peak_bytes": None, "base_bytes": None, "extra_bytes": None}
                if fns[name] is None:
                    r.update(status="skipped", reason=f"unavailable: {info[name]['reason']}")
                else:
                    r.update(_memory_one(registry[name], fns[name], shape, causal, cfg, device, probe,
                                         cfg.seed + ci))
                records.append(r)
                probe.release()
                bar.step()
    finally:
        bar.close()
    settings = settings_of(cfg, timer="cuda" if device.type == "cuda" else "cpu")
    settings.update(timer=None, check=None, forward_timed=None, backward_timed=None,
                    measured="torch.cuda.max_memory_allocated over forward + backward, after reset_peak_memory_stats")
    return {"kind": "memory", "settings": settings, "providers": info, "results": records}


def _memory_one(prov: Provider, attn, shape: Shape, causal: bool, cfg: BenchConfig, device, probe, seed) -> dict:
    tensors = []
    try:
        inputs = measure.random_inputs(shape.batch, shape.nheads, shape.seqlen, shape.headdim, cfg.dtype,
                                       device, seed)
        q, k, v, do = tensors = [measure.to_layout(x, prov.layout) for x in inputs]
        del inputs
        for t in (q, k, v):
            t.requires_grad_(True)
        attn(q, k, v, causal).backward(do)  # warm-up
        q.grad = k.grad = v.grad = None
        base = probe.reset()
        attn(q, k, v, causal).backward(do)
        peak = probe.peak()
        return {"status": "ok", "peak_bytes": int(peak), "base_bytes": int(base), "extra_bytes": int(peak - base)}
    except Exception as e:
        return {"status": "oom" if measure.is_oom(e) else "skipped", "reason": measure.describe(e)}
    finally:
        tensors.clear()


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def positive_ints(text: str) -> List[int]:
    """'128', '64,128', '8k' -> positive ints (k = 1024)."""
    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            val = int(item[:-1]) * 1024 if item.endswith("k") else int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an integer (e.g. 128, 8192 or 8k)") from None
        if val <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} must be positive")
        out.append(val)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} holds no value")
    return out


def _single(parse_list, what: str):
    """An argparse type taking exactly one item of what parse_list accepts."""
    def parse(text: str):
        vals = parse_list(text)
        if len(vals) != 1:
            raise argparse.ArgumentTypeError(f"{text!r}: expected one {what}")
        return vals[0]
    return parse


positive_int = _single(positive_ints, "value")


def _number(text: str, cast, what: str, ok, bound: str):
    """text as cast(text), an argparse error naming `what` where it is not one, or `bound` where ok(value) fails."""
    try:
        val = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not ok(val):
        raise argparse.ArgumentTypeError(f"{text!r} must be {bound}")
    return val


def _positive_float(text: str) -> float:
    return _number(text, float, "a number", lambda x: x > 0, "positive")


def _provider_names(text: str) -> List[str]:
    try:
        return resolve_names(str(text).split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_provider_name = _single(_provider_names, "provider")


def _cpu_core(text: str) -> int:
    return _number(text, int, "a CPU core number", lambda x: x >= 0, ">= 0")


def pin_to_cpu(core: int) -> None:
    """Runs every thread of this process, and every thread it starts later, on CPU `core` only. Host-bound points
    (short sequences, where a call's Python and launches take about as long as its kernels) move less within a run
    then: unpinned, host times moved between rounds, and a backward in the autograd engine's thread cost more than
    in the calling thread; between processes they still vary.
    ValueError if the process may not run there, or the OS has no CPU affinity calls (Linux has)."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"--pin-cpu {core}: this OS offers no os.sched_setaffinity (pin with its own tools)")
    allowed = os.sched_getaffinity(0)
    if core not in allowed:
        raise ValueError(f"--pin-cpu {core}: this process may run on CPUs {sorted(allowed)} only")
    tasks = Path("/proc/self/task")
    for tid in (int(t) for t in os.listdir(tasks)) if tasks.is_dir() else (0, ):
        try:
            os.sched_setaffinity(tid, {core})
        except ProcessLookupError:   # a thread that ended meanwhile
            pass


def _device(text: str) -> str:
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cuda, cuda:1, cpu)") from None
    if dev.type not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a cuda or cpu device")
    return str(dev)


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `flashtile bench` options. Without grid options: the FA3 paper grid on CUDA, a tiny grid on CPU."""
    known = ", ".join(PROVIDERS)
    g = parser.add_argument_group("providers")
    g.add_argument("--providers", type=_provider_names, default=None,
                   help=f"comma-separated providers to run (default: all). Known: {known}")
    g.add_argument("--baseline", type=_provider_name, default=None,
                   help="ratio denominator in the report (default: cudnn if selected, else the first non-flashtile)")
    g.add_argument("--compare", type=_provider_names, default=None,
                   help="providers shown as ratios to the baseline (default: the flashtile ones)")
    g = parser.add_argument_group("grid (values: comma or space separated; 8k = 8192)")
    g.add_argument("--headdim", type=positive_ints, nargs="+", default=None, help="head dims (default 64 128 256)")
    g.add_argument("--seqlen", type=positive_ints, nargs="+", default=None,
                   help="sequence lengths (default 512 .. 16k; memory mode 512 .. 64k)")
    g.add_argument("--batch", type=positive_int, default=None, help="batch (default: --total-tokens // seqlen)")
    g.add_argument("--nheads", type=positive_int, default=None, help="heads (default: --hidden // headdim)")
    g.add_argument("--total-tokens", type=positive_int, default=TOTAL_TOKENS, help="for the default batch (16384)")
    g.add_argument("--hidden", type=positive_int, default=HIDDEN, help="for the default nheads (2048)")
    g.add_argument("--causal", choices=("both", "true", "false"), default=None,
                   help="masks to run (default: both; memory mode: false)")
    g.add_argument("--mode", choices=("fwd", "bwd", "both", "train", "all"), default="both",
                   help="passes to time: fwd, bwd, both (fwd and bwd), train (forward + backward in one timed call, "
                        "host time included), all (default both)")
    g.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="input dtype (default bf16)")
    g = parser.add_argument_group("measurement")
    g.add_argument("--device", type=_device, default=None, help="cuda (default when available) or cpu")
    g.add_argument("--warmup", type=_positive_float, default=25.0, help="do_bench warm-up, ms (default 25)")
    g.add_argument("--rep", type=_positive_float, default=100.0, help="do_bench repetition time, ms (default 100)")
    g.add_argument("--seed", type=int, default=0, help="seed of the first case; case i uses seed + i (default 0)")
    g.add_argument("--pin-cpu", type=_cpu_core, default=None, metavar="CORE",
                   help="run the benchmark on this CPU core only (steadier host time at short sequences)")
    g.add_argument("--memory", action="store_true",
                   help="measure peak memory of forward+backward vs seqlen instead of time (CUDA only)")
    g = parser.add_argument_group("output")
    g.add_argument("--out", default=None, help="results folder (default results/<gpu-name>-<date>/)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _flat(values) -> Optional[List[int]]:
    if values is None:
        return None
    out = []
    for v in values:
        for x in (v if isinstance(v, list) else [v]):
            if x not in out:
                out.append(x)
    return out


def build_config(args: argparse.Namespace) -> Tuple[BenchConfig, bool]:
    """(config, memory_mode) from parsed arguments; ValueError naming the argument for inconsistent ones."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    on_cpu = torch.device(device).type == "cpu"
    memory = bool(args.memory)
    if memory and on_cpu:
        raise ValueError("--memory needs a CUDA device (it reads torch.cuda.max_memory_allocated)")

    headdims, seqlens = _flat(args.headdim), _flat(args.seqlen)
    batch, nheads = args.batch, args.nheads
    if on_cpu:
        headdims, seqlens = headdims or list(CPU_HEADDIMS), seqlens or list(CPU_SEQLENS)
        batch, nheads = batch or CPU_BATCH, nheads or CPU_NHEADS
    elif memory:
        headdims, seqlens = headdims or list(MEMORY_HEADDIMS), seqlens or list(MEMORY_SEQLENS)
        batch = batch or MEMORY_BATCH
    else:
        headdims, seqlens = headdims or list(FA3_HEADDIMS), seqlens or list(FA3_SEQLENS)
    bad = [d for d in headdims if d > args.hidden and nheads is None]
    if bad:
        raise ValueError(f"--headdim {bad[0]} exceeds --hidden {args.hidden}: give --nheads")
    shapes = derive_shapes(headdims, seqlens, batch, nheads, args.total_tokens, args.hidden)

    causal = args.causal or ("false" if memory else "both")
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[causal]
    modes = {"both": ("fwd", "bwd"), "fwd": ("fwd",), "bwd": ("bwd",), "train": ("train",),
             "all": ("fwd", "bwd", "train")}[args.mode]

    providers = args.providers or resolve_names(["all"])
    baseline = args.baseline
    if baseline is not None and baseline not in providers:
        raise ValueError(f"--baseline {baseline} is not among --providers ({', '.join(providers)})")
    if baseline is None:
        others = [p for p in providers if not p.startswith("flashtile")]
        baseline = "cudnn" if "cudnn" in providers else (others[0] if others else None)
    compare = args.compare
    if compare is not None:
        missing = [p for p in compare if p not in providers]
        if missing:
            raise ValueError(f"--compare {missing[0]} is not among --providers ({', '.join(providers)})")
    else:
        compare = [p for p in providers if p.startswith("flashtile") and p != baseline] or \
                  [p for p in providers if p != baseline]
    dtype = DTYPES[args.dtype or "bf16"]
    cfg = BenchConfig(shapes=shapes, providers=providers, causals=causals, modes=modes, dtype=dtype,
                      device=device, warmup=args.warmup, rep=args.rep, seed=args.seed, baseline=baseline,
                      compare=compare)
    return cfg, memory


def run_bench(args: argparse.Namespace) -> int:
    """Run `flashtile bench` from parsed arguments; write results; return the exit code.

    0: the run finished (providers that were skipped, out of memory or wrong are reported, not fatal);
    1: a flashtile provider produced a wrong result; 2: inconsistent arguments.
    """
    from flashtile.bench import report

    try:
        cfg, memory = build_config(args)
        if args.pin_cpu is not None:
            pin_to_cpu(args.pin_cpu)
    except ValueError as e:
        print(f"flashtile bench: error: {e}", file=sys.stderr)
        return 2
    device = torch.device(cfg.device)
    if device.type == "cpu":
        # Kernels decorated from now on run through the Triton interpreter (too late for ones already imported).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print("flashtile bench: CPU run: timings come from time.perf_counter and mean nothing about the "
              "kernels (flashtile runs in the Triton interpreter); use it to test the runner.", file=sys.stderr)
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("flashtile bench: warning: TRITON_INTERPRET is set on a CUDA run; flashtile timings will be "
              "those of the interpreter.", file=sys.stderr)

    env = report.collect_environment(device)
    env["pinned_cpu"] = args.pin_cpu
    print(f"flashtile bench: {len(cfg.shapes)} shapes x {len(cfg.causals)} masks x {len(cfg.providers)} providers "
          f"on {env['gpu']} ({'memory' if memory else '/'.join(cfg.modes)}, {DTYPE_NAMES[cfg.dtype]})",
          file=sys.stderr)
    run = run_memory if memory else run_speed
    result = run(cfg, progress=not args.no_progress)
    result["environment"] = env
    out_dir = args.out or report.default_out_dir(env)
    paths = report.write_report(result, out_dir, plots=not args.no_plots)
    print(report.summary(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    wrong = [r for r in result["results"] if r["status"] == "wrong" and r["provider"].startswith("flashtile")]
    return 1 if wrong else 0

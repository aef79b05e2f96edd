"""Autotuning of the attention kernels' tile configs, cached on disk (issue #6).

A winner is stored per key (pass, block_d, dtype, causal, seqlen bucket) in one JSON file per device
fingerprint (GPU name + Triton version: a config that wins on one GPU or compiler need not win on another):

    $FLASHTILE_CACHE_DIR/tune-<fingerprint>.json      (default directory ~/.cache/flashtile)

The file is read once per process; afterwards `lookup` is a dict access. launch.fwd_config / bwd_config consult
it before their hand-picked table. Tuning itself never happens by surprise: only with FLASHTILE_AUTOTUNE=1 (the
first call of each untuned key times every candidate, then the cache answers) or through an explicit `tune()`.
FLASHTILE_AUTOTUNE=0 ignores the cache as well (the table only, e.g. to compare against it).

This module knows nothing of kernel arguments: whoever tunes passes bench_fn(config) -> milliseconds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import tempfile
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
import triton

from ..runtime import interpreting, next_pow2
from . import configs
from .configs import Config, block_d

CACHE_VERSION = 1
SEQLEN_MIN, SEQLEN_MAX = 1024, 16384
PASSES = ("fwd", "bwd")

# Candidates per head-dim bucket: benchmarks/sweep_configs.py sweeps exactly these (single source), and configs.py's
# table holds each list's winner. Fields: BLOCK_M, BLOCK_N, num_warps, num_stages (backward: BLOCK_N = key rows per
# dK/dV program, BLOCK_M = query rows per step).
FWD: Dict[int, List[Config]] = {
    64: [Config(128, 64, 4, 3), Config(128, 64, 8, 3), Config(128, 128, 8, 3), Config(128, 128, 4, 3),
         Config(64, 64, 4, 3), Config(128, 64, 4, 4), Config(64, 128, 4, 3), Config(128, 128, 8, 2)],
    128: [Config(128, 64, 8, 3), Config(128, 64, 4, 3), Config(128, 128, 8, 3), Config(128, 32, 4, 3),
          Config(64, 64, 4, 3), Config(128, 64, 8, 4), Config(128, 128, 8, 2), Config(64, 128, 4, 3)],
    256: [Config(64, 64, 4, 2), Config(64, 64, 8, 2), Config(64, 32, 4, 3), Config(128, 64, 8, 2),
          Config(128, 32, 8, 2), Config(64, 64, 4, 3)],
}
BWD: Dict[int, List[Config]] = {
    64: [Config(64, 64, 4, 3, dq=(128, 64, 8, 3)), Config(64, 64, 4, 3, atomic_dq=True, dq=(128, 64, 8, 3)),
         Config(64, 64, 4, 2, dq=(128, 64, 8, 3)), Config(64, 128, 8, 2), Config(32, 64, 4, 3),
         Config(64, 128, 8, 3), Config(128, 128, 8, 2, atomic_dq=True)],
    128: [Config(64, 64, 4, 2, dq=(128, 64, 8, 3)), Config(64, 64, 4, 2), Config(64, 128, 8, 2, dq=(128, 64, 8, 3)),
          Config(64, 128, 8, 2), Config(32, 64, 4, 3), Config(64, 128, 8, 1, atomic_dq=True)],
    256: [Config(64, 32, 4, 1), Config(32, 32, 4, 2), Config(64, 32, 8, 2), Config(64, 64, 8, 1),
          Config(32, 64, 8, 1), Config(128, 32, 8, 1),
          # dV and dK by two launches (one BLOCK_N x 256 accumulator each): larger key tiles fit
          Config(64, 64, 8, 1, split_dkdv=True), Config(64, 64, 4, 2, split_dkdv=True),
          Config(32, 64, 4, 2, split_dkdv=True), Config(64, 128, 8, 1, split_dkdv=True),
          Config(32, 128, 8, 2, split_dkdv=True),
          # ... with the dQ pass's own tiles (query rows, key rows, warps, stages)
          Config(64, 128, 8, 1, split_dkdv=True, dq=(64, 64, 4, 2)),
          Config(64, 128, 8, 1, split_dkdv=True, dq=(64, 32, 4, 2)),
          Config(64, 64, 4, 2, split_dkdv=True, dq=(64, 64, 8, 2)),
          Config(64, 128, 8, 1, split_dkdv=True, dq=(128, 32, 8, 2)),
          Config(64, 128, 8, 1, split_dkdv=True, dq=(32, 64, 4, 2)),
          # ... and the dV launch's own key tiles (key rows, warps, stages)
          Config(64, 64, 4, 2, split_dkdv=True, dv=(128, 8, 2)),
          Config(64, 64, 4, 2, split_dkdv=True, dq=(64, 32, 4, 3), dv=(128, 8, 2)),
          Config(32, 64, 4, 3, split_dkdv=True, dq=(64, 64, 4, 2), dv=(128, 8, 3)),
          Config(64, 128, 8, 1, split_dkdv=True, dq=(64, 64, 4, 2), dv=(128, 8, 2)),
          Config(64, 64, 4, 2, split_dkdv=True, dv=(128, 8, 2), dq=(128, 64, 8, 2))],
}


# ---------------------------------------------------------------------------------------------------- the key
def seqlen_bucket(seqlen: int) -> int:
    """Next power of two of seqlen, clamped to [1024, 16384]."""
    return min(SEQLEN_MAX, max(SEQLEN_MIN, next_pow2(max(1, int(seqlen)))))


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (a string passes through)."""
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class Key:
    pass_: str
    block_d: int
    dtype: str
    causal: bool
    seqlen: int            # the bucket, not the call's length

    def __str__(self) -> str:  # the JSON key
        return f"{self.pass_}/d{self.block_d}/{self.dtype}/{'causal' if self.causal else 'full'}/n{self.seqlen}"


def make_key(pass_: str, head_dim: int, dtype, causal: bool, seqlen: int) -> Key:
    """seqlen: max(seqlen_q, seqlen_k) of the call."""
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    return Key(pass_, block_d(head_dim), dtype_name(dtype), bool(causal), seqlen_bucket(seqlen))


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_fingerprint() -> Optional[str]:
    """'<GPU name>-triton<version>' of the current CUDA device; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return f"{_device_name(torch.cuda.current_device())}-triton{triton.__version__}"


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("FLASHTILE_CACHE_DIR") or os.path.join("~", ".cache", "flashtile"))


def cache_path(fingerprint: str) -> str:
    return _cache_path(fingerprint, os.environ.get("FLASHTILE_CACHE_DIR"))


@functools.lru_cache(maxsize=64)
def _cache_path(fingerprint: str, env_dir: Optional[str]) -> str:
    # memoised: every kernel launch looks its key up (the regex and expanduser cost ~10 us of host time a call)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", fingerprint).strip("_") or "unknown"
    return os.path.join(cache_dir(), f"tune-{safe}.json")


def candidates(pass_: str, head_dim: int, extra: Iterable[Config] = ()) -> List[Config]:
    """The sweep list of head_dim's bucket (d <= 64 uses the d64 list, d > 128 the d256 one), then `extra`
    (e.g. the hand-picked table's config, so a tuned winner is never slower than the table) if not listed."""
    table = FWD if pass_ == "fwd" else BWD
    bd = block_d(head_dim)
    out = list(table[64 if bd <= 64 else 128 if bd <= 128 else 256])
    out += [c for c in extra if c not in out]
    return out


# ---------------------------------------------------------------------------------------------------- the cache
_loaded: Dict[str, Dict[str, dict]] = {}   # cache file path -> {str(key): entry}; one disk read per file
_forced: List[frozenset] = []              # passes tune() is tuning now, whatever FLASHTILE_AUTOTUNE says


def _reset() -> None:
    """Forget what was read from disk (tests: the next lookup reads the file again, as a new process would)."""
    _loaded.clear()
    _LOOKUPS.clear()


def _read(path: str) -> Dict[str, dict]:
    """{str(key): entry} of a cache file; {} (with a warning) if it is unreadable or malformed."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"not a version-{CACHE_VERSION} flashtile tuning cache")
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("no 'entries' object")
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"flashtile: ignoring tuning cache {path}: {e}", RuntimeWarning, stacklevel=3)
        return {}
    good = {}
    for k, entry in entries.items():
        try:
            if entry["config"] is not None:
                Config(**entry["config"])
            good[k] = entry
        except (TypeError, KeyError) as e:
            warnings.warn(f"flashtile: ignoring tuning cache entry {k!r} in {path}: {e!r}", RuntimeWarning,
                          stacklevel=3)
    return good


def _entries(fingerprint: str) -> Dict[str, dict]:
    path = cache_path(fingerprint)
    if path not in _loaded:
        _loaded[path] = _read(path)
    return _loaded[path]


def _store(fingerprint: str, key: Key, entry: dict) -> None:
    """Record entry in memory and on disk. Other processes may have added keys since this one read the file,
    so the file is re-read and merged; written to a temporary file and renamed over (atomic: a reader sees the
    old or the new file, never half of one). An unwritable directory costs a warning, not the result."""
    path = cache_path(fingerprint)
    _entries(fingerprint)[str(key)] = entry
    _LOOKUPS.clear()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a corrupt file was already reported when it was loaded
            merged = _read(path)
        merged.update(_loaded[path])
        _loaded[path] = merged
        fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".tmp", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(dict(version=CACHE_VERSION, fingerprint=fingerprint, entries=merged), f, indent=1,
                          sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    except OSError as e:
        warnings.warn(f"flashtile: could not write tuning cache {path}: {e}", RuntimeWarning, stacklevel=3)


def _enabled_env() -> str:
    return os.environ.get("FLASHTILE_AUTOTUNE", "").strip()


# (pass, head dim, dtype, causal, seqlen bucket, FLASHTILE_AUTOTUNE, FLASHTILE_CACHE_DIR, CUDA device) -> what
# lookup returned: a call of a new shape (a decode step's longer cache) asks again what the last one asked; cleared
# whenever the entries change (_store, _reset, tune's forced keys)
_LOOKUPS: Dict[tuple, Optional[Config]] = {}


def lookup(pass_: str, head_dim: int, dtype, causal: bool, seqlen: int) -> Optional[Config]:
    """The cached winner for the key, or None: none cached (or tuning failed for every candidate), under the
    Triton interpreter, without CUDA, or with FLASHTILE_AUTOTUNE=0."""
    if interpreting():
        return None
    memo = None
    if not _forced and torch.cuda.is_available():
        memo = (pass_, head_dim, dtype, causal, seqlen_bucket(seqlen), os.environ.get("FLASHTILE_AUTOTUNE"),
                os.environ.get("FLASHTILE_CACHE_DIR"), torch.cuda.current_device())
        if memo in _LOOKUPS:
            return _LOOKUPS[memo]
    found = _lookup(pass_, head_dim, dtype, causal, seqlen)
    if memo is not None and len(_LOOKUPS) < 1024:
        _LOOKUPS[memo] = found
    return found


def _lookup(pass_: str, head_dim: int, dtype, causal: bool, seqlen: int) -> Optional[Config]:
    if _enabled_env() == "0" and not _is_forced(pass_):
        return None
    fp = device_fingerprint()
    if fp is None:
        return None
    entries = _entries(fp)
    if not entries:
        return None
    entry = entries.get(str(make_key(pass_, head_dim, dtype, causal, seqlen)))
    return Config(**entry["config"]) if entry and entry["config"] is not None else None


def _is_forced(pass_: str) -> bool:
    return any(pass_ in s for s in _forced)


def autotune_enabled(pass_: str) -> bool:
    """FLASHTILE_AUTOTUNE=1, or inside tune() for its passes; never under the interpreter."""
    return not interpreting() and (_enabled_env() == "1" or _is_forced(pass_))


def needs_tuning(pass_: str, head_dim: int, dtype, causal: bool, seqlen: int, device: torch.device) -> bool:
    """Whether a launch on `device` should tune this key now: tuning enabled, a CUDA device, no config pinned in
    configs.CONFIG_OVERRIDE (which is also how the timed re-launches of autotune() avoid tuning again), no CUDA
    graph being captured, and nothing cached yet (a key whose candidates all failed is cached too: tried once)."""
    if (not autotune_enabled(pass_) or device.type != "cuda" or pass_ in configs.CONFIG_OVERRIDE
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
        return False
    fp = device_fingerprint()
    return fp is not None and str(make_key(pass_, head_dim, dtype, causal, seqlen)) not in _entries(fp)


def benchmark_ms(fn: Callable[[], object]) -> float:
    """Median time of fn() in milliseconds (triton.testing.do_bench: CUDA events, L2 flushed between runs; the
    protocol of docs/performance.md)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def tune_key(pass_: str, head_dim: int, dtype, causal: bool, seqlen: int,
             bench_fn: Callable[[Config], float], configs: Optional[Sequence[Config]] = None) -> Optional[Config]:
    """Time every candidate with bench_fn(config) -> ms, cache the fastest for the key (memory and disk) and
    return it. A config whose bench_fn raises (does not compile, out of shared memory, ...) is recorded as
    failed and skipped. configs: the candidates (default: candidates(pass_, head_dim)). Returns None, caching
    nothing, under the interpreter or without CUDA; returns None, caching the failure, if every candidate failed."""
    if interpreting():
        return None
    fp = device_fingerprint()
    if fp is None:
        return None
    key = make_key(pass_, head_dim, dtype, causal, seqlen)
    timings: Dict[str, float] = {}
    failed: Dict[str, str] = {}
    best, best_ms = None, float("inf")
    for cfg in (candidates(pass_, head_dim) if configs is None else configs):
        name = _config_name(cfg)
        try:
            ms = float(bench_fn(cfg))
        except Exception as e:  # noqa: BLE001 - any failure of one candidate only rules that candidate out
            failed[name] = f"{type(e).__name__}: {e}"[:200]
            continue
        if not ms == ms or ms <= 0:  # NaN or nonsense: not a measurement
            failed[name] = f"bad time {ms!r}"
            continue
        timings[name] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    entry = dict(config=dataclasses.asdict(best) if best is not None else None,
                 ms=best_ms if best is not None else None, timings=timings, failed=failed, seqlen=int(seqlen))
    if best is None:
        warnings.warn(f"flashtile: every candidate failed while tuning {key}; the hand-picked config stays",
                      RuntimeWarning, stacklevel=2)
    _store(fp, key, entry)
    return best


def _config_name(cfg: Config) -> str:
    """'128x64/w4/s3', then each boolean option that is on (e.g. '/atomic_dq')."""
    flags = [f.name for f in dataclasses.fields(cfg) if isinstance(getattr(cfg, f.name), bool) and getattr(cfg, f.name)]
    return "/".join([f"{cfg.BLOCK_M}x{cfg.BLOCK_N}", f"w{cfg.num_warps}", f"s{cfg.num_stages}", *flags])


def pinned_bench(pass_: str, run: Callable[[], object]) -> Callable[[Config], float]:
    """bench_fn for tune_key: times run() with configs.CONFIG_OVERRIDE[pass_] pinned to the config (what
    benchmarks/sweep_configs.py does by hand). run must write only scratch outputs."""
    def bench(cfg: Config) -> float:
        saved = dict(configs.CONFIG_OVERRIDE)
        configs.CONFIG_OVERRIDE[pass_] = cfg
        try:
            return benchmark_ms(run)
        finally:
            configs.CONFIG_OVERRIDE.clear()
            configs.CONFIG_OVERRIDE.update(saved)
    return bench


def autotune(pass_: str, head_dim: int, dtype, causal: bool, seqlen: int, run: Callable[[], object],
             default: Optional[Config] = None) -> Optional[Config]:
    """The launchers' hook: tune_key over candidates(pass_, head_dim, [default]) (default: the hand-picked
    table's config, so the winner is never slower than it), timing run() once per config pinned."""
    return tune_key(pass_, head_dim, dtype, causal, seqlen, pinned_bench(pass_, run),
                    configs=candidates(pass_, head_dim, [default] if default is not None else []))


# ---------------------------------------------------------------------------------------------------- explicit
@contextlib.contextmanager
def _forcing(passes: Iterable[str]):
    _forced.append(frozenset(passes))
    try:
        yield
    finally:
        _forced.pop()


def tune(head_dims: Sequence[int] = (64, 128, 256), dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
         causal: Sequence[bool] = (False, True), seqlens: Sequence[int] = (1024, 2048, 4096, 8192, 16384),
         passes: Sequence[str] = PASSES, tokens: int = 16384, hidden: int = 2048,
         force: bool = False) -> Dict[str, Optional[Config]]:
    """Tune every (pass, head dim, dtype, causal, seqlen) key now, whatever FLASHTILE_AUTOTUNE says, by running
    flashtile.flash_attn_func on random tensors of the benchmark grid (batch = tokens / seqlen, nheads =
    hidden / head dim) on the current CUDA device. Keys already cached are kept unless force=True.
    Returns {str(key): winner or None}. Raises RuntimeError without CUDA or under the interpreter."""
    if interpreting() or not torch.cuda.is_available():
        raise RuntimeError("flashtile tuning needs a CUDA device and TRITON_INTERPRET unset")
    import flashtile  # the public API: its validation and layouts are what a tuned call goes through

    bad = [p for p in passes if p not in PASSES]
    if bad:
        raise ValueError(f"passes must be among {PASSES}, got {bad}")
    fp = device_fingerprint()
    results: Dict[str, Optional[Config]] = {}
    with _forcing(passes):
        for d in head_dims:
            for dtype in dtypes:
                for c in causal:
                    for n in seqlens:
                        keys = [make_key(p, d, dtype, c, n) for p in passes]
                        if force:
                            for k in keys:
                                _entries(fp).pop(str(k), None)
                            _LOOKUPS.clear()
                        b, h = max(1, tokens // n), max(1, hidden // d)
                        q, k_, v = (torch.randn(b, n, h, d, device="cuda", dtype=dtype,
                                                requires_grad="bwd" in passes) for _ in range(3))
                        out = flashtile.flash_attn_func(q, k_, v, causal=c)  # tunes "fwd" on a miss
                        if "bwd" in passes:
                            out.backward(torch.randn_like(out))              # tunes "bwd" on a miss
                        torch.cuda.synchronize()
                        for key in keys:
                            results[str(key)] = lookup(key.pass_, d, dtype, c, n)
                        del q, k_, v, out
    return results

"""Benchmark output: the environment, results.json (every raw number), results.md (tables), PNG plots.

Tables put providers in columns (TFLOP/s, or peak GiB in memory mode) and add ratio columns
``<provider> / <baseline>``; a cell that was not measured shows why in one word (wrong, skip, oom, error), and
the reasons are listed under the tables. Plots follow FA3 Figures 5-6: TFLOP/s vs seqlen, one panel per head
dim, one figure per (pass, mask), one line per provider; memory mode plots peak memory vs seqlen on log-log
axes (FA1 Figure 3 right), where O(N) and O(N^2) providers show slopes 1 and 2.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import List, Optional

import torch

STATUS_WORD = {"wrong": "wrong", "skipped": "skip", "oom": "oom", "error": "error"}


# ----------------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------------
def _cudnn_version() -> Optional[str]:
    try:
        v = torch.backends.cudnn.version()
    except Exception:
        return None
    if not v:
        return None
    # cuDNN 9 encodes major*10000 + minor*100 + patch; cuDNN 8 major*1000 + minor*100 + patch.
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"

MODE_TITLES = {"fwd": "Forward", "bwd": "Backward", "train": "Training step (forward + backward)"}


def _run(cmd: List[str], cwd=None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def source_fingerprint(package_dir) -> str:
    """sha256 over the package's .py files (relative paths and contents, in sorted order): which code a run used even
    where git_commit cannot say (a dirty tree, or a copy of the tree whose .git is stale)."""
    package_dir = Path(package_dir)
    h = hashlib.sha256()
    for f in sorted(package_dir.rglob("*.py")):
        h.update(f.relative_to(package_dir).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def collect_environment(device) -> dict:
    """Versions, hardware, date and the exact command line of this run."""
    device = torch.device(device)
    now = datetime.datetime.now().astimezone()
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    import flashtile

    root = Path(flashtile.__file__).resolve().parent.parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root) if commit else None
    env = {
        "date": now.isoformat(timespec="seconds"),
        "date_utc": now.astimezone(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
        "argv": list(sys.argv),
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "flashtile": getattr(flashtile, "__version__", None),
        "git_commit": commit,
        "git_dirty": bool(dirty) if commit else None,
        "source_sha256": source_fingerprint(root / "flashtile"),
        "device": str(device),
        "gpu": "cpu",
        "driver": None,
        "env": {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
                                               "PYTORCH_CUDA_ALLOC_CONF", "PYTHONPATH")},
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        env.update(gpu=props.name, gpu_index=index, gpu_capability=f"{props.major}.{props.minor}",
                   gpu_memory_bytes=props.total_memory, gpu_sm_count=props.multi_processor_count,
                   gpu_count=torch.cuda.device_count())
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                              str(index)])
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["cpu_count"] = os.cpu_count()
    return env


def format_environment(env: dict) -> str:
    keys = ("gpu", "gpu_capability", "driver", "cuda", "cudnn", "torch", "triton", "python", "flashtile",
            "git_commit", "date", "command")
    return "\n".join(f"{k:>15}: {env[k]}" for k in keys if env.get(k) is not None)


def default_out_dir(env: dict, root: str | Path = "results") -> Path:
    """results/<gpu-name>-<date>/, with -2, -3, ... when that folder already holds results."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", str(env.get("gpu", "unknown"))).strip("-") or "unknown"
    base = Path(root) / f"{slug}-{env['date'][:10]}"
    path, i = base, 1
    while (path / "results.json").exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


# ----------------------------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------------------------
def _finite(x):
    """Strict JSON has no NaN/Infinity: non-finite floats become the strings 'nan', 'inf', '-inf'."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_script_results(out_dir, stem: str, md: str, meta: dict, **payload) -> None:
    """What a benchmarks/ script leaves in its --out folder: <stem>.json = {meta: torch/triton versions and the
    command line plus the script's own fields, **payload} and <stem>.md (its tables)."""
    import triton
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(torch=torch.__version__, triton=triton.__version__, command=" ".join(sys.argv), **meta)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, **payload), f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(md + "\n")


def write_json(result: dict, path: str | Path, schema: str = "flashtile.bench/1") -> Path:
    """result as strict JSON at path, under a "schema" key naming its layout (non-finite floats as strings)."""
    path = Path(path)
    doc = {"schema": schema, **result}
    path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def ratio(a: Optional[float], b: Optional[float]) -> str:
    """a / b as '1.23x', or '–' where either is missing."""
    return f"{a / b:.2f}x" if a is not None and b else "–"


def md_table(header: List[str], rows: List[List[str]], align: str | List[str] = "---:") -> str:
    """A Markdown table: header, an alignment row (align for every column, or one entry per column), one line per
    row of cells."""
    aligns = [align] * len(header) if isinstance(align, str) else list(align)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def cell(r: Optional[dict], value_key: str, scale: float = 1.0) -> str:
    """A record's value (x scale) when its status is 'ok', else its status in one word; '' for no record."""
    if r is None:
        return ""
    if r["status"] == "ok":
        return _fmt(r[value_key] * scale)
    return STATUS_WORD.get(r["status"], r["status"])


def speed_tables(result: dict) -> str:
    """One Markdown table of TFLOP/s per (pass, mask), providers as columns, then ratio columns."""
    s = result["settings"]
    providers, baseline = s["providers"], s.get("baseline")
    compare = [p for p in (s.get("compare") or []) if p != baseline] if baseline else []
    by_case = defaultdict(dict)
    for r in result["results"]:
        by_case[(r["mode"], r["causal"])][(r["headdim"], r["seqlen"], r["batch"], r["nheads"], r["provider"])] = r
    parts = []
    for mode in s["modes"]:
        for causal in s["causals"]:
            recs = by_case.get((mode, causal), {})
            rows = []
            for key in sorted({k[:4] for k in recs}):
                get = lambda p: recs.get(key + (p,))  # noqa: E731
                tf = lambda p: (get(p) or {}).get("tflops")  # noqa: E731
                rows.append([str(x) for x in key] + [cell(get(p), "tflops") for p in providers]
                            + [ratio(tf(p), tf(baseline)) for p in compare])
            header = ["headdim", "seqlen", "batch", "nheads"] + providers + [f"{p} / {baseline}" for p in compare]
            title = f"### {MODE_TITLES[mode].lower()}, {'causal' if causal else 'full'}, " \
                    f"{s['dtype']}: TFLOP/s"
            parts.append(title + "\n\n" + md_table(header, rows))
    return "\n\n".join(parts)


def memory_tables(result: dict) -> str:
    """Peak memory (GiB) of forward + backward per seqlen, providers as columns."""
    s = result["settings"]
    recs = {(r["headdim"], r["batch"], r["nheads"], r["causal"], r["seqlen"], r["provider"]): r
            for r in result["results"]}
    rows = []
    for key in sorted({k[:5] for k in recs}):
        d, b, h, c, n = key
        rows.append([str(d), str(b), str(h), "causal" if c else "full", str(n)]
                    + [cell(recs.get(key + (p,)), "peak_bytes", 1 / 2**30) for p in s["providers"]])
    header = ["headdim", "batch", "nheads", "mask", "seqlen"] + s["providers"]
    return f"### peak memory of forward + backward, {s['dtype']}: GiB\n\n" + md_table(header, rows)


def not_measured(result: dict) -> str:
    """Why cells are empty: one line per (provider, status, reason), with the number of cases."""
    groups = defaultdict(list)
    for r in result["results"]:
        if r["status"] != "ok":
            groups[(r["provider"], r["status"], r.get("reason") or "")].append(r)
    lines = []
    for (prov, status, reason), rs in groups.items():
        worst = ""
        if status == "wrong":
            errs = [e for r in rs for e in (r.get("errors") or {}).values() if isinstance(e, float)]
            worst = f" (max relative error {max(errs):.3g}, tolerance {rs[0]['tol']})" if errs else ""
        lines.append(f"- **{prov}** {status} in {len(rs)} case(s): {reason}{worst}")
    return "\n".join(lines)


def correctness_table(result: dict) -> str:
    """Max relative error vs the float64 oracle per provider and tensor, over the cases checked."""
    worst = defaultdict(dict)
    for r in result["results"]:
        for name, e in (r.get("errors") or {}).items():
            if isinstance(e, float):
                prev = worst[r["provider"]].get(name)
                if prev is None or math.isnan(e) or (not math.isnan(prev) and e > prev):  # nan sticks
                    worst[r["provider"]][name] = e
    if not worst:
        return ""
    names = ["out", "dq", "dk", "dv"]
    rows = [[p] + [f"{worst[p][n]:.2e}" if n in worst[p] else "" for n in names] for p in worst]
    tol = result["settings"].get("tolerance")
    return (f"### correctness: max relative error vs float64 reference (tolerance {tol})\n\n"
            + md_table(["provider"] + names, rows))


def environment_table(env: dict) -> str:
    """The run's GPU, versions, commit, date and command line (collect_environment's keys) as a Markdown table."""
    return md_table(["", ""], [[k, f"`{env[k]}`" if k == "command" else str(env[k])]
                               for k in ENV_KEYS if env.get(k) is not None], align=":---")


def markdown(result: dict) -> str:
    env, s = result.get("environment", {}), result["settings"]
    head = [f"# flashtile benchmark: {env.get('gpu', '?')}, {str(env.get('date', ''))[:10]}", ""]
    head += [environment_table(env), ""]
    if result["kind"] == "speed":
        head += [f"Timing: {s['timer']}; warm-up {s['warmup_ms']} ms, repetitions {s['rep_ms']} ms. "
                 f"Forward timed as {s['forward_timed']}; backward as {s['backward_timed']}. "
                 f"FLOPs: forward 4·n²·d·h·b (halved when causal), backward 2.5x forward. "
                 f"Correctness before timing: {s['check']}.", ""]
        body = [speed_tables(result), correctness_table(result)]
    else:
        head += [f"Measured: {s['measured']}; after one warm-up forward + backward.", ""]
        body = [memory_tables(result)]
    reasons = not_measured(result)
    if reasons:
        body.append("### not measured\n\n" + reasons)
    return "\n".join(head) + "\n" + "\n\n".join(b for b in body if b) + "\n"


ENV_KEYS = ("gpu", "gpu_capability", "driver", "cuda", "cudnn", "torch", "triton", "python", "flashtile",
            "git_commit", "date", "command")


def summary(result: dict) -> str:
    """What the CLI prints at the end: the environment, the tables, and the reasons for empty cells."""
    parts = [format_environment(result.get("environment", {}))]
    parts.append(speed_tables(result) if result["kind"] == "speed" else memory_tables(result))
    reasons = not_measured(result)
    if reasons:
        parts.append("not measured:\n" + reasons)
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------
def _seq_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _panel_axes(fig, n):
    axes = fig.subplots(1, n, squeeze=False)[0]
    return list(axes)


def speed_plots(result: dict, out_dir: Path) -> List[Path]:
    """tflops_<fwd|bwd>_<full|causal>.png: one panel per head dim, TFLOP/s vs seqlen, a line per provider."""
    from matplotlib.figure import Figure

    s, env = result["settings"], result.get("environment", {})
    paths = []
    for mode in s["modes"]:
        for causal in s["causals"]:
            recs = [r for r in result["results"] if r["mode"] == mode and r["causal"] == causal]
            headdims = sorted({r["headdim"] for r in recs})
            fig = Figure(figsize=(4.5 * max(1, len(headdims)), 4), layout="constrained")
            for ax, d in zip(_panel_axes(fig, max(1, len(headdims))), headdims):
                seqlens = sorted({r["seqlen"] for r in recs if r["headdim"] == d})
                for p in s["providers"]:
                    pts = sorted((r["seqlen"], r["tflops"]) for r in recs
                                 if r["headdim"] == d and r["provider"] == p and r["status"] == "ok")
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=p)
                ax.set_xscale("log", base=2)
                ax.set_xticks(seqlens, [_seq_label(n) for n in seqlens])
                ax.set_xlabel("sequence length")
                ax.set_ylabel("TFLOP/s")
                ax.set_title(f"head dim {d}")
                ax.grid(True, alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize="small")
            fig.suptitle(f"{MODE_TITLES[mode]}, {'causal' if causal else 'full'}, "
                         f"{s['dtype']}, {env.get('gpu', '')}")
            path = out_dir / f"tflops_{mode}_{'causal' if causal else 'full'}.png"
            fig.savefig(path, dpi=110)
            paths.append(path)
    return paths


def memory_plots(result: dict, out_dir: Path) -> List[Path]:
    """memory.png: peak GiB vs seqlen (log-log), a panel per (head dim, mask), a line per provider."""
    from matplotlib.figure import Figure

    s, env = result["settings"], result.get("environment", {})
    panels = sorted({(r["headdim"], r["causal"]) for r in result["results"]})
    fig = Figure(figsize=(5.5 * max(1, len(panels)), 4.5), layout="constrained")
    for ax, (d, causal) in zip(_panel_axes(fig, max(1, len(panels))), panels):
        recs = [r for r in result["results"] if r["headdim"] == d and r["causal"] == causal]
        seqlens = sorted({r["seqlen"] for r in recs})
        for p in s["providers"]:
            mine = [r for r in recs if r["provider"] == p]
            pts = sorted((r["seqlen"], r["peak_bytes"] / 2**30) for r in mine if r["status"] == "ok")
            ooms = sorted(r["seqlen"] for r in mine if r["status"] == "oom")
            if pts:
                label = p + (f" (OOM from {_seq_label(ooms[0])})" if ooms else "")
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(seqlens, [_seq_label(n) for n in seqlens])
        ax.set_xlabel("sequence length")
        ax.set_ylabel("peak memory, GiB")
        b, h = recs[0]["batch"], recs[0]["nheads"]
        ax.set_title(f"head dim {d}, {'causal' if causal else 'full'}, batch {b}, heads {h}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle(f"Peak memory of forward + backward, {s['dtype']}, {env.get('gpu', '')}")
    path = out_dir / "memory.png"
    fig.savefig(path, dpi=110)
    return [path]


# ----------------------------------------------------------------------------------------------------------
# All of it
# ----------------------------------------------------------------------------------------------------------
def write_report(result: dict, out_dir: str | Path, plots: bool = True) -> List[Path]:
    """Write results.json, results.md and (plots=True, matplotlib installed) the PNGs into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [write_json(result, out_dir / "results.json")]
    md = out_dir / "results.md"
    md.write_text(markdown(result))
    paths.append(md)
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            warnings.warn("matplotlib is not installed: no PNG plots (pip install matplotlib)")
            return paths
        paths += speed_plots(result, out_dir) if result["kind"] == "speed" else memory_plots(result, out_dir)
    return paths

"""Feature benchmark: flashtile beside FlashAttention-4 and cuDNN SDPA on the inputs real models send, one process.

GPU run (repo root, one H100/H200; FA4 importable, e.g. installed into /tmp/fa4 as benchmarks/fa4_peer.sh says):

    PYTHONPATH=.:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages python benchmarks/bench_features.py \
        --budget-s 480 --out DIR/features.json

CPU smoke run (Triton interpreter, tiny sizes; FA4 and cuDNN are recorded as skipped, with the reason):

    PYTHONPATH=. python benchmarks/bench_features.py --device cpu --seqlen 128 --headdim 32 --batch 1 --nheads 2 \
        --dtype fp32 --unaligned-offset 24 --windows 32:0,16:16 --doc-lens 64,32 --out /tmp/features.json

Problem: batch 2, 16 heads, head dim 128 (--headdim 64 128 256), bf16, --seqlen tokens per batch row (default 8192;
several values sweep). Rows, by the names --rows takes:
  dense, dense-causal             (batch, seqlen, heads, d)
  unaligned, unaligned-causal     seqlen - 192 tokens (--unaligned-offset): a length no tile size divides
  softcap, softcap-causal         softcap 30 (--softcap)
  window-L-R                      window_size (L, R), one row per --windows entry (default 4096:0 and 1024:1024)
  varlen-L, varlen-L-causal       documents of L tokens (--doc-lens, default 2048 and 1024) packed seqlen // L per
                                  batch row (and a last, shorter one where L does not divide seqlen); the batch's
                                  documents go through flash_attn_varlen_func as one packed (tokens, heads, d) tensor
  alibi, alibi-causal             ALiBi with the geometric slopes of the heads (flashtile.bench.measure.alibi_slopes), float32
  gqa-G, gqa-G-causal             G query heads per K / V head (--groups, default 4 and 16; with 16 heads, 16
                                  is MQA)
Masks follow flash-attn: key j is visible from query i iff i + sk - sq - left <= j <= i + sk - sq + right, -1 =
unbounded; causal sets right = 0.
Providers (--providers):
  flashtile  flashtile.flash_attn_func / flash_attn_varlen_func with the row's options
  fa4        flash_attn.cute.flash_attn_func / flash_attn_varlen_func (the length arguments by keyword, a window
             side of -1 passed as None); it has no ALiBi slopes argument, so the ALiBi rows are unsupported
  cudnn      torch SDPA under sdpa_kernel(SDPBackend.CUDNN_ATTENTION) on (batch, heads, seqlen, d) copies, is_causal
             for the causal rows; the dense and unaligned rows only (SDPA has no softcap, window, slopes or packed
             documents)
A provider that cannot express a row is recorded as skipped with "unsupported: <why>", one whose first call raises as
skipped with the error; nothing a provider does stops the run.
Check before timing, every provider's forward output on the same inputs, as max|x - ref| / max|ref| (float64):
  vs the oracle     flashtile.reference.dense.attention_ref on batch {0, b-1} x heads {0, h-1} x up to 128 query
                    rows spread over the sequence (varlen: the first and the last document); above the tolerance
                    (flashtile.bench.measure.TOLERANCE) the provider is recorded 'wrong' and not timed;
  vs flashtile      the whole output (and, when a backward is timed, dq, dk, dv), recorded only.
Timing: triton.testing.do_bench medians (--warmup-ms 25, --rep-ms 100), the providers of a point timed back to back:
  fwd    the forward, inputs requiring grad (the training forward)
  bwd    torch.autograd.grad(out, (q, k, v), do, retain_graph=True) on one retained forward
  train  forward and backward in one timed call
On CPU, time.perf_counter medians (they say nothing about the kernels). TFLOP/s count the visible (query, key) pairs
only: forward 4 * d * pairs * heads, pairs summed over the batch and the documents; backward 2.5x, forward and
backward 3.5x. Ratios are flashtile's TFLOP/s over the peer's (above one: flashtile is faster).
--budget-s: points not started once that many seconds have passed are recorded as skipped, reason "budget".
Writes --out (JSON: environment, settings, one record per point x provider x mode) and --md (the tables); prints
the TFLOP/s tables last.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not torch.cuda.is_available():   # CPU run: kernels through the Triton interpreter (set before flashtile loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flashtile  # noqa: E402
from flashtile.bench import measure, report  # noqa: E402
from flashtile.bench.measure import alibi_slopes, max_rel_error  # noqa: E402
from flashtile.bench.providers import PROVIDERS, available_providers, first_output  # noqa: E402
from flashtile.bench.runner import DTYPE_NAMES, DTYPES, first_call, positive_int, positive_ints  # noqa: E402
from flashtile.reference.dense import attention_ref, visible_mask  # noqa: E402

SCHEMA = "flashtile.bench_features/1"
PROVIDER_NAMES = ("flashtile", "fa4", "cudnn")
TITLES = {"flashtile": "flashtile", "fa4": "FA4", "cudnn": "cuDNN SDPA"}
MODES = ("fwd", "bwd", "train")
MODE_TITLES = {"fwd": "forward", "bwd": "backward", "train": "forward + backward"}
CHECK_ROWS = 128      # query rows of the oracle check


# ----------------------------------------------------------------------------------------------------------
# Rows and points
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:
    """One kind of input of the table; with a head dim and a sequence length it is a Point."""
    name: str
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    unaligned: bool = False
    doc_len: Optional[int] = None      # varlen rows: tokens per document
    group: int = 1                     # query heads per K / V head (GQA rows)


def build_rows(softcap: float, windows, doc_lens, groups=()) -> List[Row]:
    """The rows of the table, in its order (names as in the module docstring)."""
    rows = []
    for name, kw in (("dense", {}), ("unaligned", dict(unaligned=True)), ("softcap", dict(softcap=softcap))):
        rows += [Row(name, **kw), Row(f"{name}-causal", causal=True, **kw)]
    rows += [Row(f"window-{left}-{right}", window=(left, right)) for left, right in windows]
    for n in doc_lens:
        rows += [Row(f"varlen-{n}", doc_len=n), Row(f"varlen-{n}-causal", causal=True, doc_len=n)]
    rows += [Row("alibi", alibi=True), Row("alibi-causal", causal=True, alibi=True)]
    for g in groups:
        rows += [Row(f"gqa-{g}", group=g), Row(f"gqa-{g}-causal", causal=True, group=g)]
    return rows


@dataclasses.dataclass(frozen=True)
class Point:
    """A row at one (head dim, --seqlen): the problem every provider of the point runs."""
    row: Row
    headdim: int
    seqlen: int            # --seqlen: tokens per batch row
    batch: int
    nheads: int
    unaligned_offset: int

    @property
    def length(self) -> int:
        """Tokens per batch row of the input (seqlen, less the offset on the unaligned rows)."""
        return self.seqlen - self.unaligned_offset if self.row.unaligned else self.seqlen

    @property
    def nheads_k(self) -> int:
        """K / V heads: nheads over the row's group."""
        return self.nheads // self.row.group

    @property
    def doc_lens(self) -> Optional[List[int]]:
        """Varlen rows: the documents of one batch row (full documents, then the remainder); else None."""
        if self.row.doc_len is None:
            return None
        full, rest = divmod(self.length, self.row.doc_len)
        return [self.row.doc_len] * full + ([rest] if rest else [])

    def pairs(self) -> int:
        """Visible (query, key) pairs of one head, summed over the batch (and the documents of each row)."""
        lens = self.doc_lens or [self.length]
        window, causal = self.row.window, self.row.causal
        return self.batch * sum(measure.visible_pairs(n, n, window, causal) for n in lens)

    def flops(self, mode: str) -> float:
        """4 * d * visible pairs * heads for the forward, times measure.MODE_FACTORS[mode]."""
        return 4.0 * self.headdim * self.pairs() * self.nheads * measure.MODE_FACTORS[mode]

    def label(self) -> str:
        """The row as the table names it, e.g. 'dense 8000 causal (unaligned)', 'varlen 4 docs x 2048'."""
        r = self.row
        causal = " causal" if r.causal else ""
        if r.doc_len is not None:
            lens = self.doc_lens
            full = lens.count(r.doc_len)
            rest = "" if full == len(lens) else f" + 1 x {lens[-1]}"
            return f"varlen {full} docs x {r.doc_len}{rest}{causal}"
        if r.window != (-1, -1):
            return f"window ({r.window[0]}, {r.window[1]}){causal}"
        if r.softcap > 0:
            return f"softcap {r.softcap:g}{causal}"
        if r.alibi:
            return f"ALiBi {self.length}{causal}"
        if r.group > 1:
            kind = "MQA" if self.nheads_k == 1 else "GQA"
            return f"{kind} {self.nheads} / {self.nheads_k} heads {self.length}{causal}"
        return f"dense {self.length}{causal}" + (" (unaligned)" if r.unaligned else "")


@dataclasses.dataclass
class Inputs:
    """q, k, v, do: (batch, length, heads, d) (k, v: nheads_k heads), or (batch * length, heads, d) packed for
    varlen rows; cu_seqlens: int32 (documents + 1,) over the packed batch (varlen rows) or None; slopes: float32
    (heads,) (ALiBi rows) or None."""
    tensors: tuple
    cu_seqlens: Optional[torch.Tensor]
    max_seqlen: Optional[int]
    slopes: Optional[torch.Tensor]


def make_inputs(point: Point, dtype, device, seed: int) -> Inputs:
    """Fresh N(0, 1) inputs of the point, drawn as measure.random_inputs does (the same numbers on any device)."""
    b, h, n, d = point.batch, point.nheads, point.length, point.headdim
    tensors = measure.random_inputs(b, h, n, d, dtype, device, seed)
    if point.row.group > 1:   # (K and V: their first nheads_k heads)
        q, k, v, do = tensors
        k, v = (x.detach()[:, :, :point.nheads_k].contiguous().requires_grad_(x.requires_grad) for x in (k, v))
        tensors = (q, k, v, do)
    cu, mx = None, None
    if point.doc_lens is not None:
        tensors = tuple(x.view(b * n, h, d) for x in tensors)
        lens = point.doc_lens * b
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        mx = max(lens)
    slopes = alibi_slopes(h).to(device) if point.row.alibi else None
    return Inputs(tensors, cu, mx, slopes)


# ----------------------------------------------------------------------------------------------------------
# Providers: one function each, (point, inputs, device, dtype) -> attn(q, k, v) -> out in the provider's layout
# ----------------------------------------------------------------------------------------------------------
class Unsupported(Exception):
    """The provider has no way to express this input; the message says why."""


def flashtile_call(point: Point, inp: Inputs, device, dtype) -> Callable:
    r = point.row
    if r.doc_len is not None:
        cu, mx = inp.cu_seqlens, inp.max_seqlen
        return lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=r.causal)
    return lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=r.causal, window_size=r.window,
                                                     softcap=r.softcap, alibi_slopes=inp.slopes)


def fa4_call(point: Point, inp: Inputs, device, dtype) -> Callable:
    r = point.row
    if r.alibi:
        raise Unsupported("flash_attn.cute.flash_attn_func has no alibi_slopes argument")
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    if r.doc_len is not None:
        cu, mx = inp.cu_seqlens, inp.max_seqlen
        return lambda q, k, v: first_output(flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=r.causal))
    window = tuple(None if w < 0 else w for w in r.window)      # FA4 spells an unbounded side None
    return lambda q, k, v: first_output(flash_attn_func(q, k, v, causal=r.causal, window_size=window,
                                                        softcap=r.softcap))


def cudnn_call(point: Point, inp: Inputs, device, dtype) -> Callable:
    r = point.row
    lacks = [what for what, needed in (("a softcap", r.softcap > 0), ("a sliding window", r.window != (-1, -1)),
                                       ("ALiBi slopes", r.alibi), ("packed documents", r.doc_len is not None))
             if needed]
    if lacks:
        raise Unsupported(f"torch SDPA has no argument for {lacks[0]} (cuDNN runs the dense rows only)")
    attn = PROVIDERS["cudnn"].make(device, dtype)
    return lambda q, k, v: attn(q, k, v, r.causal)


CALLS = {"flashtile": (flashtile_call, "bshd"), "fa4": (fa4_call, "bshd"), "cudnn": (cudnn_call, "bhsd")}


# ----------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------
def dense_oracle_error(out, q, k, v, row: Row, slopes) -> float:
    """out against float64 attention_ref on batch {0, b-1} x heads {0, h-1} x up to CHECK_ROWS query rows spread
    over the sequence, all (b, s, h, d) with seqlen_q == seqlen_k. The rows keep their place in the full mask
    (passed as attn_mask) and their ALiBi distances (passed as attn_bias)."""
    b_idx, h_idx = measure.check_slice(q.shape[0], q.shape[2])
    s = q.shape[1]
    rows = torch.linspace(0, s - 1, min(s, CHECK_ROWS)).round().long().unique().to(q.device)
    qs = measure.take_slice(q, b_idx, h_idx)[:, rows]
    ks, vs = (measure.take_slice(x, b_idx, h_idx) for x in (k, v))
    mask = visible_mask(s, s, row.window, row.causal, device=q.device)[rows].view(1, 1, len(rows), s)
    bias = None
    if slopes is not None:                     # -slope * |i - j| (seqlen_q == seqlen_k)
        dist = (rows.view(-1, 1) - torch.arange(s, device=q.device).view(1, -1)).abs().double()
        bias = -slopes[h_idx].double().view(1, -1, 1, 1) * dist
    ref, _, _ = attention_ref(qs, ks, vs, softcap=row.softcap, attn_mask=mask, attn_bias=bias)
    return max_rel_error(measure.take_slice(out, b_idx, h_idx)[:, rows], ref)


def oracle_error(out: torch.Tensor, point: Point, inp: Inputs) -> float:
    """out (the inputs' layout) against the float64 oracle: dense rows on their check slice, varlen rows on the
    first and the last document, each as a dense problem of its own."""
    q, k, v, _ = (x.detach() for x in inp.tensors)
    if out.shape != q.shape:            # a wrong shape is wrong, not a crash
        return math.nan
    if k.shape[-2] != q.shape[-2]:      # GQA: each query head against its K / V head
        k, v = (x.repeat_interleave(q.shape[-2] // k.shape[-2], dim=-2) for x in (k, v))
    if inp.cu_seqlens is None:
        return dense_oracle_error(out, q, k, v, point.row, inp.slopes)
    cu = inp.cu_seqlens.tolist()
    errors = []
    for doc in sorted({0, len(cu) - 2}):
        a, e = cu[doc], cu[doc + 1]
        errors.append(dense_oracle_error(out[None, a:e], q[None, a:e], k[None, a:e], v[None, a:e], point.row, None))
    return max(errors, key=lambda x: math.inf if math.isnan(x) else x)


# ----------------------------------------------------------------------------------------------------------
# One point
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """A provider's state on one point: its call, its own leaf tensors in its layout, its first output."""
    attn: Callable
    layout: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    out: torch.Tensor
    grads: Optional[tuple] = None

    def bshd(self, x: torch.Tensor) -> torch.Tensor:
        return measure.from_layout(x, self.layout)


def point_record(point: Point, dtype, seed: int) -> dict:
    """The fields every record of the point carries."""
    r = point.row
    return {"row": r.name, "label": point.label(), "headdim": point.headdim, "seqlen": point.seqlen,
            "length": point.length, "batch": point.batch, "nheads": point.nheads, "nheads_k": point.nheads_k,
            "causal": r.causal, "window": list(r.window), "softcap": r.softcap, "alibi": r.alibi,
            "doc_lens": point.doc_lens, "dtype": DTYPE_NAMES[dtype], "seed": seed, "pairs": point.pairs()}


def skipped_records(point: Point, providers, modes, dtype, seed: int, reason: str) -> List[dict]:
    base = point_record(point, dtype, seed)
    return [{**base, "provider": p, "mode": m, "status": "skipped", "reason": reason, "flops": point.flops(m),
             "ms": None, "tflops": None, "errors": None, "tol": measure.TOLERANCE[dtype]}
            for p in providers for m in modes]


def run_point(point: Point, providers, avail: Dict[str, dict], modes, dtype, device, seed: int,
              warmup_ms: float, rep_ms: float, log=print) -> List[dict]:
    """Records (provider x mode) of one point: each provider's first forward, checked; then, mode by mode, the
    providers timed back to back. Never raises for a provider's failure."""
    timer = measure.timer_for(device)
    tol = measure.TOLERANCE[dtype]
    inp = make_inputs(point, dtype, device, seed)
    base = point_record(point, dtype, seed)
    records: Dict[tuple, dict] = {}
    errors: Dict[str, dict] = {}

    def rec(name, mode, status, reason=None, ms=None):
        flops = point.flops(mode)
        records[(name, mode)] = {**base, "provider": name, "mode": mode, "status": status, "reason": reason,
                                 "flops": flops, "ms": ms, "tflops": None if ms is None else
                                 measure.tflops_per_s(flops, ms), "errors": errors.get(name), "tol": tol}

    # First forward of each provider, checked against the oracle.
    runs: Dict[str, Run] = {}
    for name in providers:
        if not avail[name]["available"]:
            for m in modes:
                rec(name, m, "skipped", f"unavailable: {avail[name]['reason']}")
            continue
        make, layout = CALLS[name]
        try:
            attn = make(point, inp, device, dtype)
        except Unsupported as e:
            for m in modes:
                rec(name, m, "skipped", f"unsupported: {e}")
            continue
        except Exception as e:   # an import or a capability check of the peer
            for m in modes:
                rec(name, m, "skipped", measure.describe(e))
            continue
        q, k, v, do = (measure.to_layout(x, layout) for x in inp.tensors)
        for t in (q, k, v):
            t.requires_grad_(True)
        out, failed = first_call(attn, q, k, v)
        if failed is None and not isinstance(out, torch.Tensor):
            failed = ("skipped", f"returned {type(out).__name__}, expected a tensor")
        if failed is not None:
            for m in modes:
                rec(name, m, failed[0], f"first call: {failed[1]}")
            continue
        run = Run(attn, layout, q, k, v, do, out)
        try:
            errors[name] = {"out_vs_reference": oracle_error(run.bshd(out), point, inp)}
        except Exception as e:   # the oracle itself failed (memory): nothing unchecked is timed
            for m in modes:
                rec(name, m, "error", f"reference check failed: {measure.describe(e)}")
            continue
        runs[name] = run

    # First backward (untimed) of each provider when a backward is timed.
    if "bwd" in modes or "train" in modes:
        for name, run in list(runs.items()):
            grads, failed = first_call(lambda: torch.autograd.grad(run.out, (run.q, run.k, run.v), run.do,
                                                                   retain_graph=True))
            if failed is not None:
                for m in modes:
                    if m != "fwd":
                        rec(name, m, failed[0], f"first backward: {failed[1]}")
            else:
                run.grads = grads

    # Every output (and gradient) against flashtile's.
    ref = runs.get("flashtile")
    for name, run in runs.items():
        if ref is None or name == "flashtile":
            continue
        errors[name]["out_vs_flashtile"] = max_rel_error(run.bshd(run.out), ref.bshd(ref.out))
        if run.grads is not None and ref.grads is not None:
            for g, mine, theirs in zip(("dq", "dk", "dv"), run.grads, ref.grads):
                errors[name][f"{g}_vs_flashtile"] = max_rel_error(run.bshd(mine), ref.bshd(theirs))
    for name in list(runs):   # records share errors[name], so those written earlier see the comparisons too
        err = errors[name]["out_vs_reference"]
        if not err <= tol:   # nan included
            for m in modes:
                rec(name, m, "wrong", f"output differs from the float64 reference: {err:.3g} > {tol}")
            del runs[name]

    # Timing, mode by mode, the providers back to back.
    for mode in modes:
        for name, run in runs.items():
            if (name, mode) in records:
                continue
            leaves = (run.q, run.k, run.v)
            timed = {"fwd": lambda: run.attn(*leaves),
                     "bwd": lambda: torch.autograd.grad(run.out, leaves, run.do, retain_graph=True),
                     "train": lambda: torch.autograd.grad(run.attn(*leaves), leaves, run.do)}[mode]
            try:
                rec(name, mode, "ok", ms=timer(timed, warmup_ms, rep_ms))
            except Exception as e:
                rec(name, mode, "oom" if measure.is_oom(e) else "error", measure.describe(e))
            r = records[(name, mode)]
            log(f"  {point.label()}, d{point.headdim}: {name} {mode} "
                + (f"{r['ms']:.4g} ms, {r['tflops']:.4g} TFLOP/s" if r["status"] == "ok" else r["reason"]))
    runs.clear()
    return [records[(p, m)] for p in providers for m in modes]


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------
def speed_tables(result: dict) -> str:
    """One table per (head dim, seqlen, mode): TFLOP/s of each provider per row, then flashtile / peer ratios."""
    s = result["settings"]
    providers = s["providers"]
    peers = [p for p in providers if p != "flashtile"] if "flashtile" in providers else []
    recs = {(r["headdim"], r["seqlen"], r["mode"], r["row"], r["provider"]): r for r in result["results"]}
    labels = {(r["headdim"], r["seqlen"], r["row"]): r["label"] for r in result["results"]}
    parts = []
    for d in s["headdims"]:
        for n in s["seqlens"]:
            for mode in s["modes"]:
                rows = []
                for row in s["rows"]:
                    if (d, n, row) not in labels:
                        continue
                    get = lambda p: recs.get((d, n, mode, row, p))  # noqa: E731
                    tf = lambda p: (get(p) or {}).get("tflops")  # noqa: E731
                    rows.append([labels[(d, n, row)]] + [report.cell(get(p), "tflops") for p in providers]
                                + [report.ratio(tf("flashtile"), tf(p)) for p in peers])
                header = (["input"] + [TITLES[p] for p in providers]
                          + [f"flashtile / {TITLES[p]}" for p in peers])
                parts.append(f"### head dim {d}, {n} tokens per row, {MODE_TITLES[mode]}: TFLOP/s\n\n"
                             + report.md_table(header, rows, align=[":---"] + ["---:"] * (len(header) - 1)))
    return "\n\n".join(parts)


def checks_table(result: dict) -> str:
    """Per point: each provider's error against the float64 oracle / against flashtile (max|x - ref| / max|ref|)."""
    s = result["settings"]
    cells, labels = {}, {}
    for r in result["results"]:
        e = r.get("errors")
        if e and r["mode"] == s["modes"][0]:
            ref, ft = e.get("out_vs_reference"), e.get("out_vs_flashtile")
            text = f"{ref:.1e}" + (f" / {ft:.1e}" if isinstance(ft, float) else "")
            cells[(r["headdim"], r["seqlen"], r["row"], r["provider"])] = text
            labels[(r["headdim"], r["seqlen"], r["row"])] = r["label"]
    rows = [[str(d), str(n), labels[(d, n, row)]] + [cells.get((d, n, row, p), "") for p in s["providers"]]
            for d in s["headdims"] for n in s["seqlens"] for row in s["rows"] if (d, n, row) in labels]
    if not rows:
        return ""
    header = ["head dim", "seqlen", "input"] + [TITLES[p] for p in s["providers"]]
    align = ["---:", "---:", ":---"] + ["---:"] * len(s["providers"])
    return ("### checks: forward output, max|x - ref| / max|ref| against the float64 oracle / against flashtile "
            f"(tolerance {s['tolerance']} against the oracle)\n\n" + report.md_table(header, rows, align=align))


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    head = [f"# flashtile feature benchmark: {env.get('gpu', '?')}, {str(env.get('date', ''))[:10]}", "",
            report.environment_table(env), "",
            f"batch {s['batch']}, {s['nheads']} heads, {s['dtype']}. Timing: {s['timer']}; warm-up {s['warmup_ms']} "
            f"ms, repetitions {s['rep_ms']} ms. {s['flops']} {s['ratios']}", ""]
    body = [speed_tables(result), checks_table(result)]
    reasons = report.not_measured(result)
    if reasons:
        body.append("### not measured\n\n" + reasons)
    return "\n".join(head) + "\n" + "\n\n".join(b for b in body if b) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def _windows(text: str):
    try:
        out = [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LEFT:RIGHT[,LEFT:RIGHT...]") from None
    if not out or any(len(w) != 2 or min(w) < -1 for w in out):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LEFT:RIGHT pairs of integers >= -1")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--headdim", type=positive_int, nargs="+", default=[128], help="head dims (default 128)")
    ap.add_argument("--seqlen", type=positive_int, nargs="+", default=[8192],
                    help="tokens per batch row (default 8192; 8k = 8192)")
    ap.add_argument("--batch", type=positive_int, default=2)
    ap.add_argument("--nheads", type=positive_int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES) + ["bfloat16", "float16", "float32"], default="bf16")
    ap.add_argument("--mode", nargs="+", choices=MODES, default=["fwd", "train"],
                    help="fwd, bwd, train (forward + backward in one call); default fwd train")
    ap.add_argument("--rows", nargs="+", default=None, help="row names (default: all; see the module docstring)")
    ap.add_argument("--providers", default=",".join(PROVIDER_NAMES), help="comma-separated subset of "
                    + ",".join(PROVIDER_NAMES))
    ap.add_argument("--softcap", type=float, default=30.0, help="softcap of the softcap rows (default 30)")
    ap.add_argument("--windows", type=_windows, default=[(4096, 0), (1024, 1024)],
                    help="LEFT:RIGHT window rows (default 4096:0,1024:1024)")
    ap.add_argument("--doc-lens", type=positive_ints, default=[2048, 1024],
                    help="document lengths of the varlen rows (default 2048,1024)")
    ap.add_argument("--groups", type=positive_ints, default=[4, 16],
                    help="query heads per K / V head of the GQA rows (default 4,16); each must divide --nheads")
    ap.add_argument("--unaligned-offset", type=int, default=192,
                    help="the unaligned rows run seqlen minus this many tokens (default 192)")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first point; point i uses seed + i")
    ap.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (default 25)")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetitions (default 100)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="points not started after this many seconds are recorded as skipped (reason 'budget')")
    ap.add_argument("--out", default="bench_features.json", help="JSON results (default bench_features.json)")
    ap.add_argument("--md", default=None, help="Markdown tables (default: --out with the suffix .md)")
    return ap


def settings_of(args, rows: List[Row], providers, dtype, device) -> dict:
    return {"headdims": args.headdim, "seqlens": args.seqlen, "batch": args.batch, "nheads": args.nheads,
            "dtype": DTYPE_NAMES[dtype], "modes": list(args.mode), "providers": providers,
            "rows": [r.name for r in rows], "row_definitions": [dataclasses.asdict(r) for r in rows],
            "softcap": args.softcap, "windows": [list(w) for w in args.windows], "doc_lens": args.doc_lens,
            "groups": args.groups, "unaligned_offset": args.unaligned_offset, "device": str(device), "seed": args.seed,
            "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "budget_s": args.budget_s,
            "timer": measure.TIMER_DESCRIPTION[torch.device(device).type], "tolerance": measure.TOLERANCE[dtype],
            "timed": {"fwd": "attn(q, k, v), q, k, v requiring grad",
                      "bwd": "torch.autograd.grad(out, (q, k, v), do, retain_graph=True)",
                      "train": "torch.autograd.grad(attn(q, k, v), (q, k, v), do)"},
            "flops": "TFLOP/s count the visible (query, key) pairs only: forward 4 * d * pairs * heads (pairs summed "
                     "over the batch and the documents), backward 2.5x, forward + backward 3.5x.",
            "ratios": "Ratios: flashtile's TFLOP/s over the peer's, timed in the same process on the same inputs "
                      "(above one: flashtile is faster).",
            "check": f"max|x - ref| / max|ref|: against float64 attention_ref on batch {{0, b-1}} x heads "
                     f"{{0, h-1}} x up to {CHECK_ROWS} query rows (varlen: first and last document), and against "
                     "flashtile's output (dq, dk, dv too when a backward is timed)"}


def main(argv=None) -> int:
    """Run the benchmark; 0 when it finished (skipped and failed providers are reported), 1 when flashtile's output
    was wrong, 2 for inconsistent arguments."""
    ap = parser()
    args = ap.parse_args(argv)
    dtype = DTYPES.get(args.dtype) or getattr(torch, args.dtype)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    providers = [p.strip().lower() for p in args.providers.split(",") if p.strip()]
    all_rows = build_rows(args.softcap, args.windows, args.doc_lens, args.groups)
    by_name = {r.name: r for r in all_rows}
    problems = []
    if device.type == "cuda" and not torch.cuda.is_available():
        problems.append(f"--device {device}: CUDA is not available here (use --device cpu)")
    if device.type not in ("cuda", "cpu"):
        problems.append(f"--device {device}: expected cuda or cpu")
    problems += [f"--providers: unknown {p!r} (known: {', '.join(PROVIDER_NAMES)})" for p in providers
                 if p not in PROVIDER_NAMES]
    problems += [f"--rows: unknown {r!r} (known: {', '.join(by_name)})" for r in args.rows or [] if r not in by_name]
    problems += [f"--groups {g}: expected a divisor of --nheads {args.nheads}" for g in args.groups
                 if args.nheads % g]
    if not 0 <= args.unaligned_offset < min(args.seqlen):
        problems.append(f"--unaligned-offset {args.unaligned_offset}: expected 0 <= offset < the shortest --seqlen")
    if problems or not providers:
        ap.error("; ".join(problems) or "--providers names none")
    rows = [by_name[r] for r in dict.fromkeys(args.rows)] if args.rows else all_rows
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if device.type == "cpu":
        log("bench_features: CPU run: times come from time.perf_counter through the Triton interpreter and say "
            "nothing about the kernels")
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            log("bench_features: warning: CUDA is present, so TRITON_INTERPRET was not set before flashtile loaded: "
                "flashtile cannot run on CPU tensors (run with TRITON_INTERPRET=1)")

    env = report.collect_environment(device)
    avail = available_providers(device, dtype, registry={name: PROVIDERS[name] for name in providers})
    for name, info in avail.items():
        if not info["available"]:
            log(f"bench_features: {name} unavailable: {info['reason']}")
    points = [Point(r, d, n, args.batch, args.nheads, args.unaligned_offset)
              for d in args.headdim for n in args.seqlen for r in rows]
    start = time.monotonic()
    records = []
    for i, point in enumerate(points):
        seed = args.seed + i
        if args.budget_s is not None and time.monotonic() - start > args.budget_s:
            records += skipped_records(point, providers, args.mode, dtype, seed, "budget")
            continue
        log(f"[{i + 1}/{len(points)}] {point.label()}, head dim {point.headdim}")
        records += run_point(point, providers, avail, args.mode, dtype, device, seed, args.warmup_ms, args.rep_ms,
                             log)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"kind": "features", "environment": env, "settings": settings_of(args, rows, providers, dtype, device),
              "providers": avail, "elapsed_s": time.monotonic() - start, "results": records}
    md_path = Path(args.md) if args.md else Path(args.out).with_suffix(".md")
    for path in (Path(args.out), md_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    report.write_json(result, args.out, schema=SCHEMA)
    md_path.write_text(markdown(result))
    log(f"wrote {args.out} and {md_path}")
    print(speed_tables(result))
    wrong = [r for r in records if r["provider"] == "flashtile" and r["status"] == "wrong"]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""flashtile.flex_attention beside PyTorch FlexAttention and FlashAttention-4 on structured masks and a score_mod.

GPU run (repo root, one H100/H200, about 5-10 minutes, most of it torch.compile and FA4's compiles; FA4 importable,
e.g. installed into /tmp/fa4 as benchmarks/fa4_peer.sh says, else the fa4 provider is skipped with the reason):

    PYTHONPATH=.:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages python benchmarks/bench_flex.py --out DIR

CPU smoke run (Triton interpreter, tiny sizes; torch FlexAttention only as an eager forward check, fa4 skipped):

    PYTHONPATH=. python benchmarks/bench_flex.py --small --out /tmp/bench_flex_smoke

Problem: batch 2, nheads 16, headdim 128, bf16, total seqlen 8192 and 16384 (--seqlens), self-attention.
Rows (--masks; the same mask for every provider that claims it; BLOCK_SIZE 128 block masks):
  document  causal, ~8 documents of random lengths (fixed seed, the same for every batch row)
  prefix-lm bidirectional over the first seqlen/2 tokens (prefix_lengths = seqlen/2 for each row), causal after
  sliding   causal sliding window of 1024 keys (q - kv < 1024) plus 4 attention sinks (kv < 4, causal)
  alibi     causal with an ALiBi score_mod: score - slopes[h] * |q - kv|, the geometric slopes of the heads
            (flashtile.bench.measure.alibi_slopes)
Providers (--providers, by key):
  flashtile  flashtile.flex       flashtile.flex.flex_attention(q, k, v, block_mask=create_block_mask(<ready-made
                                  MaskMod>)), with score_mod=alibi_score(slopes) on the ALiBi row
  triton     flashtile.flex (Triton)  the same call with the Hopper kernels turned off (fa3.disabled()): the portable
                                  Triton kernels, forward and backward (GPU runs only)
  torch      torch.flex           torch.nn.attention.flex_attention.flex_attention compiled with
                                  torch.compile(dynamic=False), block mask from its own create_block_mask over the
                                  same mask written as a torch mask_mod (and the ALiBi torch score_mod); inputs in its
                                  (batch, heads, seqlen, headdim) layout (contiguous copies)
  fa4        fa4                  flash_attn.cute.flash_attn_func with each mask as a CuTe DSL mask_mod and torch's
                                  block mask as its block-sparse tensors, the ALiBi row as causal=True plus a score_mod
                                  (benchmarks/fa4_masks.py; SM90 only)
  varlen     flashtile.varlen     flash_attn_varlen_func(causal=True) over the documents (document mask, exact)
  window     flashtile.window (no sinks)  flash_attn_func(window_size=(1023, 0)) (sliding, *without the 4 sinks*: a
                                  different mask, shown for the cost of the dense-kernel window path)
A provider that cannot run here (fa4 without FA4 or off SM90, triton and torch.flex timing on a CPU) is listed under
"not run" with the reason; nothing a provider does stops the run.
Checks before timing (printed and stored): max |out - float32 reference| and max|out - ref| / max|ref| on a slice of
256 query rows (all keys, the provider's own mask and score_mod), then the backward; max |out - torch.flex out| and
max |d{q,k,v} - torch.flex d{q,k,v}|. A provider whose relative error exceeds flashtile.bench.measure.TOLERANCE for
the dtype is marked "wrong" and not timed; one whose backward raises is timed in the forward only (the reason is in
the table).
Timing: triton.testing.do_bench medians (warmup 25 ms, rep 100 ms) of the forward (no_grad) and of forward +
backward (grad_to_none on q, k, v). Effective TFLOP/s count the visible (q, k) pairs only: forward 4 * d * pairs
(summed over batch and heads), backward 2.5x that, forward+backward 3.5x. ratio = provider time / torch.flex
time (< 1: faster than torch.flex). Block-mask construction is timed too (median of 5 after a warm-up call;
--no-construction skips it): flashtile from the MaskMod (a Triton kernel, no N^2 tensor), flashtile from the torch
callable, torch's create_block_mask eager and with _compile=True.
--budget-s: (seqlen, row) cases not started once that many seconds have passed are listed as skipped.
Prints Markdown tables last; --out DIR writes DIR/bench_flex.json and DIR/bench_flex.md.
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)           # fa4_masks, imported when the fa4 provider runs
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:   # CPU smoke run: kernels through the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from flashtile import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashtile.bench import measure  # noqa: E402
from flashtile.bench.report import write_script_results  # noqa: E402
from flashtile.blocksparse import create_block_mask as ft_create_block_mask  # noqa: E402
from flashtile.flex import (alibi_score, causal_mask, document_mask, flex_attention, prefix_lm_mask,  # noqa: E402
                            sliding_window_mask)
from flashtile.kernels.gluon import fa3  # noqa: E402

try:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
except ImportError:  # pragma: no cover - old torch
    torch_flex_attention = torch_create_block_mask = None


MASKS = ("document", "prefix-lm", "sliding", "alibi")
# --providers key -> the provider's name in the tables
PROVIDERS = {"flashtile": "flashtile.flex", "triton": "flashtile.flex (Triton)", "torch": "torch.flex", "fa4": "fa4",
             "varlen": "flashtile.varlen", "window": "flashtile.window (no sinks)"}


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


def portable(fn):
    """fn() with the Hopper kernels turned off (the Triton kernels run it)."""
    with fa3.disabled():
        return fn()


def bench_ms(fn, grads=None):
    if HAS_CUDA:
        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
    t = time.perf_counter()              # CPU interpreter smoke run: one call, the time means nothing
    fn()
    return (time.perf_counter() - t) * 1e3


def wall_ms(fn, n=None):
    n = n or (5 if HAS_CUDA else 1)
    fn()
    sync()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[n // 2]


# ----------------------------------------------------------------------------------------------------------
# Masks: flashtile's ready-made MaskMod and the same mask as a torch mask_mod (b, h, q_idx, kv_idx) -> bool

def doc_lengths(seqlen, n_docs, seed):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(seqlen - 1, generator=g)[:n_docs - 1] + 1).tolist())
    bounds = [0] + cuts + [seqlen]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def make_masks(seqlen, batch, heads, window, sinks, dev, n_docs=8, seed=0):
    """{row: dict(mod=MaskMod, torch_fn: the mask as a torch mask_mod, B (None: shared by the batch), score_mod /
    torch_score: the row's flashtile ScoreMod and torch score_mod (ALiBi row), and the row's tensors and
    parameters (doc_ids, prefix_lengths, window, sinks, slopes) for the providers that build the mask their way)}."""
    lens = doc_lengths(seqlen, n_docs, seed)
    ids = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens)).to(dev)
    ids_l = ids.long()
    prefix = torch.full((batch,), seqlen // 2, dtype=torch.int32, device=dev)
    prefix_l = prefix.long()
    slopes = measure.alibi_slopes(heads).to(dev)

    def document(b, h, q_idx, kv_idx):
        return (ids_l[q_idx] == ids_l[kv_idx]) & (kv_idx <= q_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_l[b])

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < window) | (kv_idx < sinks))

    def window_only(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return {
        "document": dict(mod=document_mask(ids), torch_fn=document, B=None, doc_lengths=lens, doc_ids=ids),
        "prefix-lm": dict(mod=prefix_lm_mask(prefix), torch_fn=prefix_lm, B=batch, prefix=seqlen // 2,
                          prefix_lengths=prefix),
        "sliding": dict(mod=sliding_window_mask(window, num_sinks=sinks), torch_fn=sliding, B=None,
                        window=window, sinks=sinks, window_only_fn=window_only),
        "alibi": dict(mod=causal_mask(), torch_fn=causal, B=None, score_mod=alibi_score(slopes), torch_score=alibi,
                      slopes=slopes),
    }


def visible_pairs(mask_fn, batch, seqlen, dev, chunk=1024):
    """Number of visible (q, k) pairs summed over the batch (for one head)."""
    b = torch.arange(batch, device=dev).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    kv = torch.arange(seqlen, device=dev).view(1, 1, 1, seqlen)
    total = 0
    for r0 in range(0, seqlen, chunk):
        q = torch.arange(r0, min(seqlen, r0 + chunk), device=dev).view(1, 1, -1, 1)
        total += int(mask_fn(b, h, q, kv).expand(batch, 1, q.shape[2], seqlen).sum())
    return total


def reference_rows(q, k, v, mask_fn, rows, score_fn=None):
    """float32 attention of the given query rows (all keys), (batch, len(rows), heads, d); score_fn: a torch
    score_mod (score, b, h, q_idx, kv_idx) applied to the scaled scores before the mask."""
    batch, seqlen, heads = q.shape[0], k.shape[1], q.shape[2]
    qf, kf, vf = q.detach()[:, rows].float(), k.detach().float(), v.detach().float()
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * q.shape[-1] ** -0.5
    b = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=q.device).view(1, heads, 1, 1)
    q_idx, kv_idx = rows.view(1, 1, -1, 1), torch.arange(seqlen, device=q.device).view(1, 1, 1, seqlen)
    if score_fn is not None:
        s = score_fn(s, b, h, q_idx, kv_idx)
    s = s.masked_fill(~mask_fn(b, h, q_idx, kv_idx), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, vf)


# ----------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for bench_flex.json / bench_flex.md")
    ap.add_argument("--seqlens", default=None, help="comma-separated total seqlens (default 8192,16384)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--headdim", type=int, default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--masks", default=None, help="comma-separated subset of " + ",".join(MASKS))
    ap.add_argument("--providers", default=None,
                    help="comma-separated subset of " + ",".join(PROVIDERS) + " (default: all)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="(seqlen, row) cases not started after this many seconds are skipped")
    ap.add_argument("--no-construction", action="store_true", help="do not time the block-mask construction")
    args = ap.parse_args(argv)
    unknown = [x for x in (args.masks or "").split(",") if x and x not in MASKS]
    unknown += [x for x in (args.providers or "").split(",") if x and x not in PROVIDERS]
    if unknown:
        ap.error(f"unknown --masks / --providers entries {unknown}: masks {', '.join(MASKS)}; providers "
                 f"{', '.join(PROVIDERS)}")
    return args


def construction_times(m, B, seqlen, block, dev):
    """Block-mask construction, median ms of each way to build this mask's block mask."""
    cons = {"flashtile MaskMod ms": wall_ms(
        lambda: ft_create_block_mask(m["mod"], B, None, seqlen, seqlen, BLOCK_SIZE=block, device=dev))}
    cons["flashtile torch callable ms"] = wall_ms(
        lambda: ft_create_block_mask(m["torch_fn"], B, None, seqlen, seqlen, BLOCK_SIZE=block, device=dev))
    if torch_create_block_mask is not None:
        try:
            cons["torch eager ms"] = wall_ms(lambda: torch_create_block_mask(
                m["torch_fn"], B, None, seqlen, seqlen, device=dev, BLOCK_SIZE=block))
            if HAS_CUDA:
                cons["torch _compile ms"] = wall_ms(lambda: torch_create_block_mask(
                    m["torch_fn"], B, None, seqlen, seqlen, device=dev, BLOCK_SIZE=block, _compile=True))
        except Exception as e:  # noqa: BLE001
            cons["torch error"] = measure.describe(e)
    return cons


def check_provider(pv, q, k, v, rows, tol):
    """Run a provider once, forward and backward, before it is timed. Returns (results (out, dq, dk, dv) in
    (b, s, h, d), the check entry). The entry's status: "ok", "wrong" (relative error above tol: not timed) or
    "error" (the forward raised); bwd_error: why the backward is not timed (it raised, or the provider has none)."""
    if pv.get("bwd_error"):
        with torch.no_grad():
            out = pv["to_bshd"](pv["fn"]())
        dq = dk = dv = None
    else:
        out = pv["fn"]()
        try:
            grads = torch.autograd.grad(out, pv["grads"], pv["g_out"])
            dq, dk, dv = (pv["to_bshd"](g) for g in grads)
        except Exception as e:  # noqa: BLE001 - a forward-only provider is still timed in the forward
            pv["bwd_error"] = f"backward failed: {measure.describe(e)}"
            traceback.print_exc()
            dq = dk = dv = None
        out = pv["to_bshd"](out.detach())
    ref = reference_rows(q, k, v, pv["mask_fn"], rows, pv.get("score_fn"))
    got = out[:, rows].float()
    entry = dict(max_abs_err_vs_fp32_rows=(got - ref).abs().max().item(),
                 rel_err_vs_fp32_rows=measure.max_rel_error(got, ref), finite=bool(torch.isfinite(out).all()))
    entry["status"] = "ok" if entry["rel_err_vs_fp32_rows"] <= tol else "wrong"   # nan is wrong
    if pv.get("bwd_error"):
        entry["bwd_error"] = pv["bwd_error"]
    return (out, dq, dk, dv), entry


def main(argv=None):
    args = parse_args(argv)
    small = args.small or not HAS_CUDA
    dev = "cuda" if HAS_CUDA else "cpu"
    dtype = torch.bfloat16
    tol = measure.TOLERANCE[dtype]
    batch = args.batch or (1 if small else 2)
    heads = args.heads or (2 if small else 16)
    d = args.headdim or (32 if small else 128)
    block = 32 if small else 128
    seqlens = [int(x) for x in (args.seqlens or ("128,256" if small else "8192,16384")).split(",")]
    mask_names = [x for x in MASKS if x in (args.masks or ",".join(MASKS)).split(",")]
    wanted = {PROVIDERS[x] for x in (args.providers or ",".join(PROVIDERS)).split(",") if x}
    sinks = 4
    use_torch_flex = HAS_CUDA and torch_flex_attention is not None
    device_name = torch.cuda.get_device_name() if HAS_CUDA else f"CPU ({platform.processor() or 'interpreter'})"
    print(f"# {device_name}, torch {torch.__version__}, triton {triton.__version__}; batch {batch}, heads {heads}, "
          f"headdim {d}, {str(dtype)[6:]}, BLOCK_SIZE {block}", flush=True)
    not_run = {}                        # provider -> why it runs nowhere in this process
    if "flashtile.flex (Triton)" in wanted and not HAS_CUDA:
        not_run["flashtile.flex (Triton)"] = "GPU runs only (on a CPU flashtile.flex is the Triton kernels already)"
    if "torch.flex" in wanted and torch_flex_attention is None:
        not_run["torch.flex"] = f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    fa4 = None
    if "fa4" in wanted:
        fa4 = importlib.import_module("fa4_masks")
        reason = fa4.unavailable(dev)
        if reason is not None:
            not_run["fa4"] = reason
            fa4 = None
    for pname, reason in not_run.items():
        print(f"{pname}: not run: {reason}", flush=True)
    if use_torch_flex:
        # one compiled graph per (mask, seqlen, grad mode): raise the recompile limit so none falls back to eager
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    flex_compiled = torch.compile(torch_flex_attention, dynamic=False) if use_torch_flex else None
    budget = measure.Budget(args.budget_s)
    rows, checks, construction, skipped = [], [], [], []
    for seqlen in seqlens:
        window = args.window or (1024 if not small else seqlen // 8)
        masks = make_masks(seqlen, batch, heads, window, sinks, dev)
        gen = torch.Generator(device=dev).manual_seed(seqlen)
        q, k, v, do = (torch.randn(batch, seqlen, heads, d, generator=gen, device=dev, dtype=dtype)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2).contiguous()
        n_rows = min(256, seqlen)
        check_rows = torch.linspace(0, seqlen - 1, n_rows, device=dev).round().long().unique()
        for mname in mask_names:
            m = masks[mname]
            if budget.spent():
                skipped.append(dict(seqlen=seqlen, mask=mname, reason=f"--budget-s {args.budget_s:g} reached"))
                print(f"\n## seqlen {seqlen}, {mname}: skipped (--budget-s {args.budget_s:g} reached)", flush=True)
                continue
            print(f"\n## seqlen {seqlen}, {mname}", flush=True)
            # ---- block masks (and their construction time)
            B = m["B"]
            bm_ft = ft_create_block_mask(m["mod"], B, None, seqlen, seqlen, BLOCK_SIZE=block, device=dev)
            bm_torch = None
            if torch_create_block_mask is not None:
                try:
                    bm_torch = torch_create_block_mask(m["torch_fn"], B, None, seqlen, seqlen, device=dev,
                                                       BLOCK_SIZE=block)
                except Exception as e:  # noqa: BLE001
                    print(f"torch create_block_mask failed: {measure.describe(e)}", flush=True)
            if not args.no_construction:
                cons = dict(seqlen=seqlen, mask=mname, **construction_times(m, B, seqlen, block, dev))
                construction.append(cons)
                print("block mask construction: " + ", ".join(f"{key} {val:.2f}" if isinstance(val, float) else
                                                             f"{key} {val}" for key, val in cons.items()
                                                             if key not in ("seqlen", "mask")), flush=True)
            pairs = visible_pairs(m["torch_fn"], batch, seqlen, dev)
            density = pairs / (batch * seqlen * seqlen)
            # ---- providers: name -> dict(fn: forward in the provider's own layout, to_bshd: that layout ->
            # (b, s, h, d), grads: the leaves, g_out: dout in its layout, mask_fn / score_fn: the exact mask and
            # score_mod, pairs, bwd_error: why there is no backward to time)
            bshd = lambda t: t  # noqa: E731
            bhsd = lambda t: t.transpose(1, 2)  # noqa: E731
            exact = dict(mask_fn=m["torch_fn"], score_fn=m.get("torch_score"), pairs=pairs)
            providers = {}
            if "flashtile.flex" in wanted:
                providers["flashtile.flex"] = dict(
                    fn=lambda bm=bm_ft: flex_attention(q, k, v, score_mod=m.get("score_mod"), block_mask=bm),
                    to_bshd=bshd, grads=[q, k, v], g_out=do, **exact)
            if HAS_CUDA and "flashtile.flex (Triton)" in wanted:
                providers["flashtile.flex (Triton)"] = dict(
                    fn=lambda bm=bm_ft: portable(lambda: flex_attention(q, k, v, score_mod=m.get("score_mod"),
                                                                        block_mask=bm)),
                    to_bshd=bshd, grads=[q, k, v], g_out=do, **exact)
            if bm_torch is not None and "torch.flex" in wanted:
                fx = flex_compiled if use_torch_flex else torch_flex_attention
                # FlexAttention has no CPU backward (it refuses inputs that require grad): outputs only
                src = (qt, kt, vt) if HAS_CUDA else (qt.detach(), kt.detach(), vt.detach())
                providers["torch.flex"] = dict(
                    fn=lambda bm=bm_torch, fx=fx, src=src: fx(*src, score_mod=m.get("torch_score"), block_mask=bm),
                    to_bshd=bhsd, grads=[qt, kt, vt], g_out=dot, **exact,
                    bwd_error=None if HAS_CUDA else "no CPU backward (a forward check only)")
            if fa4 is not None:
                try:
                    providers["fa4"] = dict(fn=fa4.attention(mname, m, q, k, v, bm_torch), to_bshd=bshd,
                                            grads=[q, k, v], g_out=do, **exact)
                except fa4.Unsupported as e:
                    checks.append(dict(seqlen=seqlen, mask=mname, provider="fa4", error=f"unsupported: {e}"))
                    print(f"check fa4: unsupported: {e}", flush=True)
            if mname == "document" and "flashtile.varlen" in wanted:
                lens = m["doc_lengths"] * batch
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
                mx = max(lens)
                providers["flashtile.varlen"] = dict(
                    fn=lambda cu=cu, mx=mx: flash_attn_varlen_func(
                        q.reshape(batch * seqlen, heads, d), k.reshape(batch * seqlen, heads, d),
                        v.reshape(batch * seqlen, heads, d), cu, cu, mx, mx, causal=True).view(q.shape),
                    to_bshd=bshd, grads=[q, k, v], g_out=do, **exact)
            if mname == "sliding" and "flashtile.window (no sinks)" in wanted:
                providers["flashtile.window (no sinks)"] = dict(
                    fn=lambda w=window: flash_attn_func(q, k, v, window_size=(w - 1, 0)), to_bshd=bshd,
                    grads=[q, k, v], g_out=do, mask_fn=m["window_only_fn"],
                    pairs=visible_pairs(m["window_only_fn"], batch, seqlen, dev))
            # ---- correctness before timing
            results, entry = {}, {}
            for pname, pv in providers.items():
                try:
                    results[pname], e = check_provider(pv, q, k, v, check_rows, tol)
                except Exception as exc:  # noqa: BLE001
                    checks.append(dict(seqlen=seqlen, mask=mname, provider=pname, status="error",
                                       error=measure.describe(exc)))
                    print(f"check {pname}: FAILED {measure.describe(exc)}", flush=True)
                    traceback.print_exc()
                    continue
                entry[pname] = dict(seqlen=seqlen, mask=mname, provider=pname, **e)
                checks.append(entry[pname])
                print(f"check {pname:28s} max|out - fp32 ref| {e['max_abs_err_vs_fp32_rows']:.2e}, relative "
                      f"{e['rel_err_vs_fp32_rows']:.2e} ({len(check_rows)} rows)"
                      + ("" if e["status"] == "ok" else f": WRONG (tolerance {tol}), not timed")
                      + (f"; {e['bwd_error']}" if "bwd_error" in e else ""), flush=True)
            if "torch.flex" in results:
                ref_o = results["torch.flex"]
                for pname, res in results.items():
                    if pname == "torch.flex" or providers[pname]["mask_fn"] is not m["torch_fn"]:
                        continue
                    diffs = {name: (a.float() - b_.float()).abs().max().item()
                             for name, a, b_ in zip(("out", "dq", "dk", "dv"), res, ref_o)
                             if a is not None and b_ is not None}
                    entry[pname].update(
                        {f"max_abs_diff_vs_torch.flex_{n}": x for n, x in diffs.items()})
                    print(f"check {pname:28s} vs torch.flex: " + ", ".join(f"{n} {x:.2e}" for n, x in diffs.items()),
                          flush=True)
            del results
            # ---- timing
            for pname, pv in providers.items():
                if entry.get(pname, {}).get("status") != "ok" or (pname == "torch.flex" and not use_torch_flex):
                    continue                        # failed check, or eager CPU flex (a correctness check only)
                fwd_flops = 4.0 * d * pv["pairs"] * heads
                for pas, flops in (("fwd", fwd_flops), ("fwd+bwd", 3.5 * fwd_flops)):
                    row = dict(seqlen=seqlen, mask=mname, provider=pname, pass_=pas)
                    if pas == "fwd+bwd" and pv.get("bwd_error"):
                        row["error"] = f"not timed: {pv['bwd_error']}"
                    else:
                        try:
                            if pas == "fwd":
                                def run(fn=pv["fn"]):
                                    with torch.no_grad():
                                        fn()
                                ms = bench_ms(run)
                            else:
                                def run(fn=pv["fn"], g_out=pv["g_out"]):
                                    fn().backward(g_out)
                                ms = bench_ms(run, pv["grads"])
                            row.update(ms=ms, tflops=flops / ms / 1e9, density=pv["pairs"] / (batch * seqlen * seqlen),
                                       block_density=bm_ft.density())
                        except Exception as e:  # noqa: BLE001
                            row["error"] = measure.describe(e)
                    rows.append(row)
                    print(f"{pname:28s} {pas:8s} " + (f"{row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
                                                      if "ms" in row else row["error"]), flush=True)
            print(f"visible pairs density {density:.4f}, flashtile block density {bm_ft.density():.4f}", flush=True)
            del bm_ft, bm_torch, providers
            if HAS_CUDA:
                torch.cuda.empty_cache()
        del q, k, v, do, qt, kt, vt, dot
        if HAS_CUDA:
            torch.cuda.empty_cache()

    md = markdown(rows, checks, construction, not_run, skipped, device_name, batch, heads, d, dtype, small, tol)
    print()
    print(md)
    if args.out:
        meta = dict(device=device_name, batch=batch, heads=heads, headdim=d, dtype=str(dtype), block_size=block,
                    small=small, tolerance=tol, budget_s=args.budget_s)
        write_script_results(args.out, "bench_flex", md, meta, rows=rows, checks=checks,
                             block_mask_construction=construction, not_run=not_run, skipped=skipped)
        print(f"\nwrote {os.path.join(args.out, 'bench_flex.json')} and bench_flex.md")
    return 0


def markdown(rows, checks, construction, not_run, skipped, device_name, batch, heads, d, dtype, small, tol):
    lines = [f"{device_name}; batch {batch}, heads {heads}, headdim {d}, {str(dtype)[6:]}"
             + (" (CPU interpreter smoke run: times are not performance)" if small else ""), ""]
    if not_run or skipped:
        lines += ["Not run:", ""]
        lines += [f"- {pname}: {reason}" for pname, reason in not_run.items()]
        lines += [f"- seqlen {c['seqlen']}, {c['mask']}: {c['reason']}" for c in skipped]
        lines.append("")
    lines.append(f"Checks (fp32 reference on a slice of rows, each provider's own mask: max abs difference and "
                 f"max|out - ref| / max|ref|, above {tol} wrong and not timed; max abs difference against torch.flex):")
    lines.append("")
    lines.append("| seqlen | mask | provider | vs fp32 ref | relative | out vs torch.flex | dq | dk | dv | note |")
    lines.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
    for c in checks:
        if "error" in c:
            lines.append(f"| {c['seqlen']} | {c['mask']} | {c['provider']} | | | | | | | {c['error']} |")
            continue
        f = lambda key: (f"{c[key]:.1e}" if key in c else "")  # noqa: E731
        note = "; ".join(x for x in ("WRONG: not timed" if c["status"] == "wrong" else "", c.get("bwd_error", ""))
                         if x)
        lines.append(f"| {c['seqlen']} | {c['mask']} | {c['provider']} | {f('max_abs_err_vs_fp32_rows')} | "
                     f"{f('rel_err_vs_fp32_rows')} | {f('max_abs_diff_vs_torch.flex_out')} | "
                     f"{f('max_abs_diff_vs_torch.flex_dq')} | {f('max_abs_diff_vs_torch.flex_dk')} | "
                     f"{f('max_abs_diff_vs_torch.flex_dv')} | {note} |")
    lines.append("")
    if construction:
        lines.append("Block-mask construction (ms, median of 5):")
        lines.append("")
        keys = ["flashtile MaskMod ms", "flashtile torch callable ms", "torch eager ms", "torch _compile ms"]
        lines.append("| seqlen | mask | " + " | ".join(k_[:-3] for k_ in keys) + " |")
        lines.append("|---:|---|" + "---:|" * len(keys))
        for c in construction:
            lines.append(f"| {c['seqlen']} | {c['mask']} | " + " | ".join(
                f"{c[k_]:.2f}" if k_ in c else ("error" if "torch error" in c and "torch" in k_[:5] else "")
                for k_ in keys) + " |")
        lines.append("")
    lines.append("Attention (median ms; effective TFLOP/s on the visible (q, k) pairs; ratio = time / torch.flex "
                 "time, < 1 is faster):")
    lines.append("")
    lines.append("| seqlen | mask | pairs density | pass | provider | ms | TFLOP/s | ratio vs torch.flex |")
    lines.append("|---:|---|---:|---|---|---:|---:|---:|")
    flex_ms = {(r["seqlen"], r["mask"], r["pass_"]): r["ms"] for r in rows if r["provider"] == "torch.flex"
               and "ms" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seqlen']} | {r['mask']} | | {r['pass_']} | {r['provider']} | {r['error']} | | |")
            continue
        base = flex_ms.get((r["seqlen"], r["mask"], r["pass_"]))
        ratio = f"{r['ms'] / base:.2f}" if base and r["provider"] != "torch.flex" else ""
        lines.append(f"| {r['seqlen']} | {r['mask']} | {r['density']:.3f} | {r['pass_']} | {r['provider']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.4g} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

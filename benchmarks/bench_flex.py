"""flashtile.flex_attention (Triton mask_mod kernels) vs PyTorch FlexAttention (torch.compile) on structured masks.

GPU run (repo root, one H100/H200, about 5-10 minutes, most of it torch.compile):

    PYTHONPATH=. python benchmarks/bench_flex.py --out DIR

CPU smoke run (Triton interpreter, tiny sizes; torch FlexAttention only as an eager correctness check):

    PYTHONPATH=. python benchmarks/bench_flex.py --small --out /tmp/bench_flex_smoke

Problem: batch 2, nheads 16, headdim 128, bf16, total seqlen 8192 and 16384 (--seqlens), self-attention.
Masks (the same mask for every provider that claims it; BLOCK_SIZE 128 block masks):
  document  causal, ~8 documents of random lengths (fixed seed, the same for every batch row)
  prefix-lm bidirectional over the first seqlen/2 tokens (prefix_lengths = seqlen/2 for each row), causal after
  sliding   causal sliding window of 1024 keys (q - kv < 1024) plus 4 attention sinks (kv < 4, causal)
Providers:
  flashtile.flex   flashtile.flex.flex_attention(q, k, v, block_mask=create_block_mask(<ready-made MaskMod>))
  flashtile.flex (Triton)  the same call with the Hopper kernels turned off (fa3.disabled()): the portable Triton
                   kernels, forward and backward (GPU runs only)
  torch.flex       torch.nn.attention.flex_attention.flex_attention compiled with torch.compile(dynamic=False),
                   block mask from its own create_block_mask over the same mask written as a torch mask_mod;
                   inputs in its (batch, heads, seqlen, headdim) layout (contiguous copies)
  flashtile.varlen flash_attn_varlen_func(causal=True) over the documents (document mask, exact)
  flashtile.window flash_attn_func(window_size=(1023, 0)) (sliding, *without the 4 sinks*: a different mask,
                   shown for the cost of the dense-kernel window path)
Checks before timing (printed and stored): max |out - torch.flex out| and max |d{q,k,v} - torch.flex d{q,k,v}|,
and max |out - float32 reference| on a slice of 256 query rows (all keys, the provider's own mask).
Timing: triton.testing.do_bench medians (warmup 25 ms, rep 100 ms) of the forward (no_grad) and of forward +
backward (grad_to_none on q, k, v). Effective TFLOP/s count the visible (q, k) pairs only: forward 4 * d * pairs
(summed over batch and heads), backward 2.5x that, forward+backward 3.5x. ratio = flashtile time / torch.flex
time (< 1: flashtile faster). Block-mask construction is timed too (median of 5 after a warm-up call):
flashtile from the MaskMod (a Triton kernel, no N^2 tensor), flashtile from the torch callable, torch's
create_block_mask eager and with _compile=True.
Prints Markdown tables last; --out DIR writes DIR/bench_flex.json and DIR/bench_flex.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:   # CPU smoke run: kernels through the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from flashtile import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashtile.bench.report import write_script_results  # noqa: E402
from flashtile.blocksparse import create_block_mask as ft_create_block_mask  # noqa: E402
from flashtile.flex import document_mask, flex_attention, prefix_lm_mask, sliding_window_mask  # noqa: E402
from flashtile.kernels.gluon import fa3  # noqa: E402

try:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
except ImportError:  # pragma: no cover - old torch
    torch_flex_attention = torch_create_block_mask = None


def _err(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


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


def make_masks(seqlen, batch, window, sinks, dev, n_docs=8, seed=0):
    """{name: dict(mod=MaskMod, torch_fn, B (None: shared by the batch), extra info)}."""
    lens = doc_lengths(seqlen, n_docs, seed)
    ids = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens)).to(dev)
    ids_l = ids.long()
    prefix = torch.full((batch,), seqlen // 2, dtype=torch.int32, device=dev)
    prefix_l = prefix.long()

    def document(b, h, q_idx, kv_idx):
        return (ids_l[q_idx] == ids_l[kv_idx]) & (kv_idx <= q_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_l[b])

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < window) | (kv_idx < sinks))

    def window_only(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return {
        "document": dict(mod=document_mask(ids), torch_fn=document, B=None, doc_lengths=lens),
        "prefix-lm": dict(mod=prefix_lm_mask(prefix), torch_fn=prefix_lm, B=batch, prefix=seqlen // 2),
        "sliding": dict(mod=sliding_window_mask(window, num_sinks=sinks), torch_fn=sliding, B=None,
                        window=window, sinks=sinks, window_only_fn=window_only),
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


def reference_rows(q, k, v, mask_fn, rows):
    """float32 attention of the given query rows (all keys), (batch, len(rows), heads, d)."""
    batch, seqlen = q.shape[0], k.shape[1]
    qf, kf, vf = q.detach()[:, rows].float(), k.detach().float(), v.detach().float()
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * q.shape[-1] ** -0.5
    b = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
    vis = mask_fn(b, h, rows.view(1, 1, -1, 1), torch.arange(seqlen, device=q.device).view(1, 1, 1, seqlen))
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, vf)


# ----------------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for bench_flex.json / bench_flex.md")
    ap.add_argument("--seqlens", default=None, help="comma-separated total seqlens (default 8192,16384)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--headdim", type=int, default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--masks", default=None, help="comma-separated subset of document,prefix-lm,sliding")
    args = ap.parse_args()
    small = args.small or not HAS_CUDA
    dev = "cuda" if HAS_CUDA else "cpu"
    dtype = torch.bfloat16
    batch = args.batch or (1 if small else 2)
    heads = args.heads or (2 if small else 16)
    d = args.headdim or (32 if small else 128)
    block = 32 if small else 128
    seqlens = [int(x) for x in (args.seqlens or ("128,256" if small else "8192,16384")).split(",")]
    sinks = 4
    use_torch_flex = HAS_CUDA and torch_flex_attention is not None
    device_name = torch.cuda.get_device_name() if HAS_CUDA else f"CPU ({platform.processor() or 'interpreter'})"
    print(f"# {device_name}, torch {torch.__version__}, triton {triton.__version__}; batch {batch}, heads {heads}, "
          f"headdim {d}, {str(dtype)[6:]}, BLOCK_SIZE {block}", flush=True)
    if use_torch_flex:
        # one compiled graph per (mask, seqlen, grad mode): raise the recompile limit so none falls back to eager
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    flex_compiled = torch.compile(torch_flex_attention, dynamic=False) if use_torch_flex else None
    rows, checks, construction = [], [], []
    for seqlen in seqlens:
        window = args.window or (1024 if not small else seqlen // 8)
        masks = make_masks(seqlen, batch, window, sinks, dev)
        if args.masks:
            masks = {name: m for name, m in masks.items() if name in args.masks.split(",")}
        gen = torch.Generator(device=dev).manual_seed(seqlen)
        q, k, v, do = (torch.randn(batch, seqlen, heads, d, generator=gen, device=dev, dtype=dtype)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2).contiguous()
        n_rows = min(256, seqlen)
        check_rows = torch.linspace(0, seqlen - 1, n_rows, device=dev).round().long().unique()
        for mname, m in masks.items():
            print(f"\n## seqlen {seqlen}, {mname}", flush=True)
            # ---- block masks (and their construction time)
            B = m["B"]
            bm_ft = ft_create_block_mask(m["mod"], B, None, seqlen, seqlen, BLOCK_SIZE=block, device=dev)
            cons = dict(seqlen=seqlen, mask=mname)
            cons["flashtile MaskMod ms"] = wall_ms(
                lambda: ft_create_block_mask(m["mod"], B, None, seqlen, seqlen, BLOCK_SIZE=block, device=dev))
            cons["flashtile torch callable ms"] = wall_ms(
                lambda: ft_create_block_mask(m["torch_fn"], B, None, seqlen, seqlen, BLOCK_SIZE=block, device=dev))
            bm_torch = None
            if torch_create_block_mask is not None:
                try:
                    bm_torch = torch_create_block_mask(m["torch_fn"], B, None, seqlen, seqlen, device=dev,
                                                       BLOCK_SIZE=block)
                    cons["torch eager ms"] = wall_ms(lambda: torch_create_block_mask(
                        m["torch_fn"], B, None, seqlen, seqlen, device=dev, BLOCK_SIZE=block))
                    if HAS_CUDA:
                        cons["torch _compile ms"] = wall_ms(lambda: torch_create_block_mask(
                            m["torch_fn"], B, None, seqlen, seqlen, device=dev, BLOCK_SIZE=block, _compile=True))
                except Exception as e:  # noqa: BLE001
                    cons["torch error"] = _err(e)
                    print(f"torch create_block_mask failed: {_err(e)}", flush=True)
            construction.append(cons)
            print("block mask construction: " + ", ".join(f"{key} {val:.2f}" if isinstance(val, float) else
                                                         f"{key} {val}" for key, val in cons.items()
                                                         if key not in ("seqlen", "mask")), flush=True)
            pairs = visible_pairs(m["torch_fn"], batch, seqlen, dev)
            density = pairs / (batch * seqlen * seqlen)
            # ---- providers: name -> dict(fn: forward in the provider's own layout, to_bshd: that layout ->
            # (b, s, h, d), grads: the leaves, g_out: dout in its layout, mask_fn: the exact mask, pairs)
            bshd = lambda t: t  # noqa: E731
            bhsd = lambda t: t.transpose(1, 2)  # noqa: E731
            providers = {"flashtile.flex": dict(fn=lambda bm=bm_ft: flex_attention(q, k, v, block_mask=bm),
                                                to_bshd=bshd, grads=[q, k, v], g_out=do, mask_fn=m["torch_fn"],
                                                pairs=pairs)}
            if HAS_CUDA:
                providers["flashtile.flex (Triton)"] = dict(
                    fn=lambda bm=bm_ft: portable(lambda: flex_attention(q, k, v, block_mask=bm)), to_bshd=bshd,
                    grads=[q, k, v], g_out=do, mask_fn=m["torch_fn"], pairs=pairs)
            if bm_torch is not None and (use_torch_flex or small):
                fx = flex_compiled if use_torch_flex else torch_flex_attention
                providers["torch.flex"] = dict(fn=lambda bm=bm_torch, fx=fx: fx(qt, kt, vt, block_mask=bm),
                                               to_bshd=bhsd, grads=[qt, kt, vt], g_out=dot, mask_fn=m["torch_fn"],
                                               pairs=pairs)
            if mname == "document":
                lens = m["doc_lengths"] * batch
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
                mx = max(lens)
                providers["flashtile.varlen"] = dict(
                    fn=lambda cu=cu, mx=mx: flash_attn_varlen_func(
                        q.reshape(batch * seqlen, heads, d), k.reshape(batch * seqlen, heads, d),
                        v.reshape(batch * seqlen, heads, d), cu, cu, mx, mx, causal=True).view(q.shape),
                    to_bshd=bshd, grads=[q, k, v], g_out=do, mask_fn=m["torch_fn"], pairs=pairs)
            if mname == "sliding":
                providers["flashtile.window (no sinks)"] = dict(
                    fn=lambda w=window: flash_attn_func(q, k, v, window_size=(w - 1, 0)), to_bshd=bshd,
                    grads=[q, k, v], g_out=do, mask_fn=m["window_only_fn"],
                    pairs=visible_pairs(m["window_only_fn"], batch, seqlen, dev))
            # ---- correctness before timing
            results, ok, entry = {}, set(), {}
            for pname, pv in providers.items():
                try:
                    if pname == "torch.flex" and not HAS_CUDA:
                        # FlexAttention has no CPU backward (it refuses inputs that require grad): outputs only
                        out = bhsd(torch_flex_attention(qt.detach(), kt.detach(), vt.detach(), block_mask=bm_torch))
                        dq = dk = dv = None
                    else:
                        out = pv["fn"]()
                        grads = torch.autograd.grad(out, pv["grads"], pv["g_out"])
                        out, dq, dk, dv = (pv["to_bshd"](t) for t in (out.detach(), *grads))
                    ref = reference_rows(q, k, v, pv["mask_fn"], check_rows)
                    err_ref = (out[:, check_rows].float() - ref).abs().max().item()
                    results[pname] = (out, dq, dk, dv)
                    ok.add(pname)
                    entry[pname] = dict(seqlen=seqlen, mask=mname, provider=pname, max_abs_err_vs_fp32_rows=err_ref,
                                        finite=bool(torch.isfinite(out).all()))
                    checks.append(entry[pname])
                    print(f"check {pname:28s} max|out - fp32 ref| {err_ref:.2e} ({len(check_rows)} rows)", flush=True)
                except Exception as e:  # noqa: BLE001
                    checks.append(dict(seqlen=seqlen, mask=mname, provider=pname, error=_err(e)))
                    print(f"check {pname}: FAILED {_err(e)}", flush=True)
                    traceback.print_exc()
            if "torch.flex" in results:
                ref_o = results["torch.flex"]
                for pname, res in results.items():
                    if pname == "torch.flex" or providers[pname]["mask_fn"] is not m["torch_fn"]:
                        continue
                    diffs = {name: (a.float() - b_.float()).abs().max().item()
                             for name, a, b_ in zip(("out", "dq", "dk", "dv"), res, ref_o) if b_ is not None}
                    entry[pname].update(
                        {f"max_abs_diff_vs_torch.flex_{n}": x for n, x in diffs.items()})
                    print(f"check {pname:28s} vs torch.flex: " + ", ".join(f"{n} {x:.2e}" for n, x in diffs.items()),
                          flush=True)
            del results
            # ---- timing
            for pname, pv in providers.items():
                if pname not in ok or (pname == "torch.flex" and not use_torch_flex):
                    continue                        # failed check, or eager CPU flex (a correctness check only)
                fwd_flops = 4.0 * d * pv["pairs"] * heads
                for pas, flops in (("fwd", fwd_flops), ("fwd+bwd", 3.5 * fwd_flops)):
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
                        row = dict(seqlen=seqlen, mask=mname, provider=pname, pass_=pas, ms=ms,
                                   tflops=flops / ms / 1e9, density=pv["pairs"] / (batch * seqlen * seqlen),
                                   block_density=bm_ft.density())
                    except Exception as e:  # noqa: BLE001
                        row = dict(seqlen=seqlen, mask=mname, provider=pname, pass_=pas, error=_err(e))
                    rows.append(row)
                    print(f"{pname:28s} {pas:8s} " + (f"{row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
                                                      if "ms" in row else row["error"]), flush=True)
            print(f"visible pairs density {density:.4f}, flashtile block density {bm_ft.density():.4f}", flush=True)
            del bm_ft, bm_torch
            if HAS_CUDA:
                torch.cuda.empty_cache()
        del q, k, v, do, qt, kt, vt, dot
        if HAS_CUDA:
            torch.cuda.empty_cache()

    md = markdown(rows, checks, construction, device_name, batch, heads, d, dtype, small)
    print()
    print(md)
    if args.out:
        meta = dict(device=device_name, batch=batch, heads=heads, headdim=d, dtype=str(dtype), block_size=block,
                    small=small)
        write_script_results(args.out, "bench_flex", md, meta, rows=rows, checks=checks,
                             block_mask_construction=construction)
        print(f"\nwrote {os.path.join(args.out, 'bench_flex.json')} and bench_flex.md")


def markdown(rows, checks, construction, device_name, batch, heads, d, dtype, small):
    lines = [f"{device_name}; batch {batch}, heads {heads}, headdim {d}, {str(dtype)[6:]}"
             + (" (CPU interpreter smoke run: times are not performance)" if small else ""), ""]
    lines.append("Checks (max abs difference; fp32 reference on a slice of rows, each provider's own mask):")
    lines.append("")
    lines.append("| seqlen | mask | provider | vs fp32 ref | out vs torch.flex | dq | dk | dv |")
    lines.append("|---:|---|---|---:|---:|---:|---:|---:|")
    for c in checks:
        if "error" in c:
            lines.append(f"| {c['seqlen']} | {c['mask']} | {c['provider']} | {c['error']} | | | | |")
            continue
        f = lambda key: (f"{c[key]:.1e}" if key in c else "")  # noqa: E731
        lines.append(f"| {c['seqlen']} | {c['mask']} | {c['provider']} | {f('max_abs_err_vs_fp32_rows')} | "
                     f"{f('max_abs_diff_vs_torch.flex_out')} | {f('max_abs_diff_vs_torch.flex_dq')} | "
                     f"{f('max_abs_diff_vs_torch.flex_dk')} | {f('max_abs_diff_vs_torch.flex_dv')} |")
    lines.append("")
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
    main()

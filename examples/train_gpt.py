"""Train a small character-level GPT with three attention implementations and compare them.

    python examples/train_gpt.py                                   # GPU: flashtile, sdpa, eager; bf16
    python examples/train_gpt.py --attn flashtile --steps 200
    python examples/train_gpt.py --max-context                     # GPU: longest context each one fits
    python examples/train_gpt.py --device cpu --steps 3            # CPU smoke test (tiny model; fp32, or --dtype bf16)

The FlashAttention-1 paper's two end-to-end claims, measured on one model: training is faster (step time)
and longer contexts fit (exact attention in O(N) memory instead of the standard implementation's O(N^2)).

* flashtile: ``flashtile.flash_attn_func(q, k, v, causal=True)`` (Triton FA2 kernels; on CPU the Triton
  interpreter).
* sdpa: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` (PyTorch picks its fused
  kernel: FlashAttention-2 or cuDNN on the GPU).
* eager: standard attention, S = QK^T / sqrt(d), P = softmax(S + causal mask), O = PV, every N x N matrix
  materialised (the baseline of the papers).

All implementations start from the same weights and see the same batches, so their loss curves should
overlap (bf16 rounding makes them drift apart slowly). The training text is generated here: sentences of a
small random grammar, enough structure for the loss to fall well below log(vocab) in a few hundred steps.

Outputs in --out (default results/train_gpt/): train_gpt.json (settings, per-implementation loss curve,
median step time, tokens/s, peak CUDA memory, validation loss; --max-context: every context tried and the
longest that fit), train_gpt.csv (one row per step and implementation), train_gpt.png (loss curves, if
matplotlib is installed and --no-plot is not given).
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source tree without installing
# Imported before anything else loads Triton: without CUDA, flashtile switches Triton to its interpreter,
# which must happen before the first @triton.jit (torch.optim / autocast may import Triton themselves).
import flashtile  # noqa: E402

IMPLS = ("flashtile", "sdpa", "eager")

# Sizes per device: the GPU default runs the three implementations in well under 3 minutes on one H200
# (bf16); the CPU default is a smoke test (flashtile's kernels run through the Triton interpreter there).
PRESETS = {
    "cuda": dict(layers=6, dim=384, heads=6, context=1024, batch_size=32, steps=600, lr=1e-3, dtype="bf16",
                 eval_batches=20),
    "cpu": dict(layers=2, dim=32, heads=2, context=32, batch_size=4, steps=20, lr=3e-3, dtype="fp32",
                eval_batches=2),
}


# --------------------------------------------------------------------------------------------------
# Data: text from a small random grammar, encoded as characters
# --------------------------------------------------------------------------------------------------
_WORDS = {
    "adj": "quick lazy small bright quiet old young green heavy careful clever tired".split(),
    "noun": "fox dog river garden teacher engine window lantern farmer story bridge market".split(),
    "verb": "watches finds carries paints follows repairs opens builds remembers crosses".split(),
    "adv": "slowly quietly today again carefully often early later".split(),
    "prep": "near under behind beside across inside".split(),
}


def _phrase(rng: random.Random) -> str:
    words = [rng.choice(("the", "a", "every", "one"))]
    if rng.random() < 0.6:
        words.append(rng.choice(_WORDS["adj"]))
    words.append(rng.choice(_WORDS["noun"]))
    return " ".join(words)


def make_text(n_chars: int, seed: int = 0) -> str:
    """Sentences "Subject verb object [prep place] [adverb]." until n_chars characters."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        s = f"{_phrase(rng)} {rng.choice(_WORDS['verb'])} {_phrase(rng)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_WORDS['prep'])} {_phrase(rng)}"
        if rng.random() < 0.4:
            s += f" {rng.choice(_WORDS['adv'])}"
        s = s[0].upper() + s[1:] + (".\n" if rng.random() < 0.2 else ". ")
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]


class CharData:
    def __init__(self, text: str, device):
        self.chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(data))
        self.train, self.val = data[:n].to(device), data[n:].to(device)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, split: str, batch_size: int, context: int, gen: torch.Generator):
        data = self.train if split == "train" else self.val
        ix = torch.randint(len(data) - context - 1, (batch_size,), generator=gen).to(data.device)
        offs = torch.arange(context + 1, device=data.device)
        chunk = data[ix[:, None] + offs[None, :]]
        return chunk[:, :-1], chunk[:, 1:]


# --------------------------------------------------------------------------------------------------
# Model: a GPT-2-style decoder; only the attention call differs between implementations
# --------------------------------------------------------------------------------------------------
def attention(q, k, v, impl: str, dropout_p: float):
    """q, k, v: (batch, seqlen, nheads, headdim) -> (batch, seqlen, nheads, headdim), causal."""
    if impl == "flashtile":
        return flashtile.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, n, d)
    if impl == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    elif impl == "eager":
        n = q.shape[-2]
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")).float(), dim=-1).to(q.dtype)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        o = p @ v
    else:
        raise ValueError(f"attention impl {impl!r}; expected one of {IMPLS}")
    return o.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, impl: str, dropout: float):
        super().__init__()
        self.heads, self.impl, self.dropout = heads, impl, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        y = attention(q, k, v, self.impl, self.dropout if self.training else 0.0)
        x = x + self.proj(y.reshape(b, n, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int, impl: str, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, impl, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _autocast(device: str, dtype: str):
    if dtype == "fp32":
        return torch.autocast(device_type=device, enabled=False)
    return torch.autocast(device_type=device, dtype=_DTYPES[dtype])


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _make_model(args, vocab: int, impl: str, context: int):
    torch.manual_seed(args.seed)  # the same initial weights for every implementation
    return GPT(vocab, context, args.dim, args.heads, args.layers, impl, args.dropout).to(args.device)


def train_one(args, data: CharData, impl: str) -> dict:
    model = _make_model(args, data.vocab_size, impl, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every implementation
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    scaler = torch.amp.GradScaler(enabled=args.dtype == "fp16")
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    model.train()
    for step in range(args.steps):
        x, y = data.batch("train", args.batch_size, args.context, gen)
        _sync(args.device)
        t0 = time.perf_counter()
        with _autocast(args.device, args.dtype):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        _sync(args.device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[{impl}] step {step:5d}  loss {losses[-1]:.4f}  {1e3 * times[-1]:.1f} ms", flush=True)
    model.eval()
    val = []
    with torch.no_grad(), _autocast(args.device, args.dtype):
        g = torch.Generator().manual_seed(args.seed + 2)
        for _ in range(args.eval_batches):
            x, y = data.batch("val", args.batch_size, args.context, g)
            val.append(float(model(x, y).item()))
    # the first steps include Triton compilation / cuDNN plan selection: leave them out of the median
    timed = times[min(len(times) - 1, max(1, args.steps // 10)):]
    step_s = statistics.median(timed)
    return {
        "losses": losses,
        "step_times_s": times,
        "median_step_ms": 1e3 * step_s,
        "tokens_per_s": args.batch_size * args.context / step_s,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "val_loss": statistics.fmean(val) if val else None,
        "loss_decreased": losses[-1] < losses[0],
    }


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def max_context_one(args, vocab: int, impl: str) -> dict:
    """Double the context (batch --max-context-batch) from --max-context-start until one training step
    (forward + backward + optimizer) runs out of GPU memory or --max-context-limit is passed."""
    tried, ctx, best = [], args.max_context_start, None
    while ctx <= args.max_context_limit:
        model = opt = x = y = loss = None
        rec = {"context": ctx}
        try:
            model = _make_model(args, vocab, impl, ctx)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            g = torch.Generator(device="cuda").manual_seed(args.seed)
            x = torch.randint(vocab, (args.max_context_batch, ctx), device="cuda", generator=g)
            y = torch.randint(vocab, (args.max_context_batch, ctx), device="cuda", generator=g)
            for i in range(2):  # the second step is timed (the first compiles)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with _autocast("cuda", args.dtype):
                    loss = model(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                torch.cuda.synchronize()
            rec.update(ok=True, step_ms=1e3 * (time.perf_counter() - t0),
                       peak_memory_bytes=torch.cuda.max_memory_allocated(), loss=float(loss.item()))
            best = ctx
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if not _is_oom(e):
                raise
            rec.update(ok=False, error=str(e).splitlines()[0][:200])
        del model, opt, x, y, loss
        gc.collect()
        torch.cuda.empty_cache()
        tried.append(rec)
        print(f"[{impl}] context {ctx:8d}: " + (f"ok, {rec['step_ms']:.0f} ms/step, peak "
              f"{rec['peak_memory_bytes'] / 2**30:.1f} GiB" if rec["ok"] else "out of memory"), flush=True)
        if not rec["ok"]:
            break
        ctx *= 2
    return {"max_context": best, "tried": tried, "hit_limit": bool(tried and tried[-1]["ok"])}


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------
def _write_csv(path: Path, results: dict):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["impl", "step", "loss", "step_time_ms"])
        for impl, r in results.items():
            for step, (loss, t) in enumerate(zip(r["losses"], r["step_times_s"])):
                w.writerow([impl, step, f"{loss:.6f}", f"{1e3 * t:.3f}"])


def _plot(path: Path, results: dict, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, r in results.items():
        ax.plot(r["losses"], label=f"{impl} ({r['median_step_ms']:.1f} ms/step)", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/char)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", default="all",
                   help="comma-separated implementations from flashtile,sdpa,eager, or 'all' (default)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available, else cpu (tiny preset)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--context", type=int, default=None, help="sequence length of a training sample")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dim", type=int, default=None, help="model width (nheads * headdim)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                   help="autocast dtype (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout (default 0)")
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--text-chars", type=int, default=2_000_000, help="size of the generated training text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="print every N steps (0: quiet)")
    p.add_argument("--out", default="results/train_gpt", help="output directory")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--max-context", action="store_true",
                   help="GPU only: instead of training, double the context until out of memory, per implementation")
    p.add_argument("--max-context-start", type=int, default=1024)
    p.add_argument("--max-context-limit", type=int, default=1 << 19,
                   help="stop doubling past this context even if it still fits (bounds the run time)")
    p.add_argument("--max-context-batch", type=int, default=1)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    for key, val in PRESETS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.impls = IMPLS if args.attn == "all" else tuple(a.strip() for a in args.attn.split(","))
    bad = [a for a in args.impls if a not in IMPLS]
    if bad:
        p.error(f"--attn: unknown {bad}; expected a subset of {IMPLS} or 'all'")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.max_context and args.device != "cuda":
        p.error("--max-context needs a CUDA device (it measures GPU memory)")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = make_text(args.text_chars, seed=args.seed)
    data = CharData(text, args.device)
    settings = {k: v for k, v in vars(args).items() if k != "impls"}
    settings["impls"] = list(args.impls)
    settings["vocab_size"] = data.vocab_size
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    report = {"settings": settings, "env": env}
    if args.max_context:
        report["max_context"] = {impl: max_context_one(args, data.vocab_size, impl) for impl in args.impls}
        for impl, r in report["max_context"].items():
            more = " (limit reached; raise --max-context-limit)" if r["hit_limit"] else ""
            print(f"{impl:10s} longest context that fits: {r['max_context']}{more}")
    else:
        results = {}
        for impl in args.impls:
            results[impl] = train_one(args, data, impl)
        report["results"] = results
        _write_csv(out / "train_gpt.csv", results)
        if not args.no_plot and _plot(out / "train_gpt.png", results,
                                      f"char GPT {args.layers}L d{args.dim} ctx{args.context} {args.dtype}"):
            report["plot"] = str(out / "train_gpt.png")
        print(f"{'impl':10s} {'first loss':>10s} {'final loss':>10s} {'val loss':>9s} {'ms/step':>9s} "
              f"{'tokens/s':>10s} {'peak GiB':>9s}")
        for impl, r in results.items():
            mem = f"{r['peak_memory_bytes'] / 2**30:9.2f}" if r["peak_memory_bytes"] is not None else f"{'-':>9s}"
            print(f"{impl:10s} {r['first_loss']:10.4f} {r['final_loss']:10.4f} {r['val_loss']:9.4f} "
                  f"{r['median_step_ms']:9.2f} {r['tokens_per_s']:10.0f} {mem}")
    (out / "train_gpt.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'train_gpt.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

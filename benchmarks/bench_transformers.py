"""End to end: Hugging Face ``LlamaForCausalLM`` training steps and ``generate()`` with attn_implementation
"flashtile" against "sdpa" and "flex_attention".

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/bench_transformers.py --out DIR                 # the whole default grid
    PYTHONPATH=. python benchmarks/bench_transformers.py --configs 1b --seqlens 2048,8192 --sections train --out DIR
    PYTHONPATH=. python benchmarks/bench_transformers.py --quick --out DIR         # CPU smoke run (Triton interpreter)
Writes DIR/transformers.json and DIR/transformers.md after every case (a run that is stopped keeps what it
measured) and prints the Markdown tables at the end. The whole default grid (72 training cases, 8 generation
cases) takes far longer than one 10-minute call: split it with --sections / --configs / --compile / --seqlens, give
each call --budget-s so that no case starts late, and join the calls' reports with --merge RUN... --out DIR.

Models: random weights from a config (no download, HF_HUB_OFFLINE=1), untied embeddings, vocabulary 32000 (Llama 2's,
not Llama 3's 128256: the logits and the loss's fp32 copies of them take about 4 x 14 bytes x tokens x vocab, some
15 GB per 32k tokens at 32000 and 60 GB at 128256, memory that has nothing to do with attention and would not leave
room for the 8b config on an 80 GB GPU):
  1b: 16 layers, hidden 2048, 32 heads, 8 K/V heads, head dim 64, MLP 8192 (Llama 3.2 1B's shape), 1.1 B parameters;
  8b: Llama 3 8B's layer (hidden 4096, 32/8 heads, head dim 128, MLP 14336) cut to --layers-8b layers (4: 1.1 B).
Each config's weights are drawn once (seed --seed) and loaded into every implementation's model, so all
implementations start from the same weights and see the same batches.

Training (--sections train): one step = forward with labels = input_ids (transformers' shifted cross entropy) +
backward + optimizer step (AdamW, fused when torch has it; --optimizer sgd saves the 2 optimizer states).
Parameters, gradients and optimizer states are all in --dtype (pure bf16 on CUDA, no fp32 master copy), gradient
checkpointing off unless --gradient-checkpointing, use_cache=False. The batch is tokens-per-step / seqlen sequences
(32768: 16 x 2k, 4 x 8k, 1 x 32k).
  dense:  no attention_mask (causal pretraining batches; an all-ones mask would make transformers build a 4-D mask
          for SDPA under torch.compile).
  padded: each row's length uniform in [L/2, L], right padding, 2-D attention_mask, labels -100 on padding.
          flashtile unpads every layer and runs varlen when eager; compiled, its ops read the mask when the graph
          runs and run varlen over each row's tokens and its padding; SDPA gets a 4-D mask; flex_attention a
          BlockMask.
tokens/s counts real (non-padding) tokens: padded rows are worth only their real tokens.
--compile: "eager" and/or "compile". --compile-scope layers (default) compiles each decoder layer
(``layer.compile()``: the identical layers share one compiled graph, so compiling costs one layer's time);
"model" compiles the whole model, loss included (``torch.compile(model)``). Embedding, final norm, lm_head and
loss run eagerly with scope "layers", identically for every implementation. Dynamo is reset between cases.
Timing: --warmup steps (the first includes compilation), then --steps steps timed one by one with CUDA events;
median ms per step, tokens/s from it, peak allocated GiB over the case (weights and optimizer states included).
Check: the first step's loss of every implementation against SDPA's on the same weights and batch, relative
difference <= --loss-rtol (default 1e-3 in bf16/fp16, 1e-5 in fp32; two correct bf16 attentions differ by about
1e-5 on this loss); the gradient norm of that step is compared too, recorded but not checked. With random weights
the loss sits near ln(vocab), so this catches broken runs (NaN, padding leaking into real tokens), not small
numerical differences: tests/test_transformers_integration.py checks logits and every gradient against SDPA.

Generation (--sections generate): greedy ``generate`` of --new-tokens tokens (min_new_tokens = max_new_tokens, so
exactly that many) after a random --prompt-len prompt, batch --gen-batches, all-ones attention_mask.
  dynamic: eager, transformers' default DynamicCache;
  static:  cache_implementation="static"; transformers then compiles the decoding forward itself (torch.compile of
           the model's __call__, prefill eager) with CompileConfig(mode=--gen-compile-mode, "reduce-overhead" =
           CUDA graphs), the documented static-cache + torch.compile route. flashtile's prefill runs over the
           prompt's slots only; every decode step gets transformers' 4-D mask over the cache's slots (one shape at
           every step: one CUDA graph) and runs the split-KV decode kernel under it.
One warm-up generate, then one timed (wall clock, synchronized): new tokens/s = batch * new_tokens / generate time;
TTFT (prefill + first token) = when the first new token reaches the host (a streamer notes it); decode tokens/s =
batch * (new_tokens - 1) / (generate time - TTFT). Tokens are compared with SDPA's (greedy argmax on random
weights may flip on bf16 near-ties, so this is reported, not checked), and so are the logits of the warm-up run's
first steps while a row's tokens are still SDPA's (Δlogits); --gen-impls ...,eager adds transformers' eager
attention, whose Δlogits against SDPA is the scale of two correct implementations in the same dtype.

Every case runs in its own try/except: status "ok", "oom", "error" (with the message) or "skipped" (with the
reason: flex_attention refused by transformers, --budget-s reached); memory is freed between cases.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # random weights only: never reach the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

import flashtile  # noqa: E402  (sets TRITON_INTERPRET on CPU-only machines before the kernels load)
import flashtile.integrations.transformers as ft_hf  # noqa: E402

CONFIGS = {
    "1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192),
    "8b": dict(num_hidden_layers=4, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128),
}
IMPLS = ("flashtile", "sdpa", "flex_attention")
# transformers' own attention in PyTorch ops, on request only (--impls / --gen-impls): its (b, h, s, s) scores do not
# fit at training lengths; beside SDPA in generation its Δlogits is the scale of two correct bf16 implementations
OPT_IN = ("eager", )
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REF = "sdpa"   # the implementation every other one is compared with
CHECK_STEPS = 32   # generate steps whose logits the warm-up run keeps for the check against SDPA's


def _csv(text: str, cast=str) -> list:
    return [cast(t.strip()) for t in text.split(",") if t.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for transformers.json and transformers.md")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: tiny config (2 layers, hidden 64, 4/2 heads), seq 64, 1 + 2 steps, "
                         "4 tokens generated after 16; options given explicitly still win")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sections", default="train,generate")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--configs", default=None, help="1b,8b (default); tiny with --quick")
    ap.add_argument("--layers-8b", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    # training
    ap.add_argument("--seqlens", default=None, help="default 2048,8192,32768")
    ap.add_argument("--tokens-per-step", type=int, default=None, help="default 32768: batch = this / seqlen")
    ap.add_argument("--padding", default="dense,padded")
    ap.add_argument("--compile", default="eager,compile", help="eager and/or compile")
    ap.add_argument("--compile-scope", default="layers", choices=("layers", "model"))
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode for training: default, max-autotune-no-cudagraphs, ...")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; aot_eager with --quick: traces forward and "
                         "backward without generating code)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps, >= 1 (default 2; 1 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; 2 with --quick)")
    ap.add_argument("--loss-rtol", type=float, default=None, help="default 1e-3 (bf16/fp16), 1e-5 (fp32)")
    # generation
    ap.add_argument("--gen-configs", default=None, help="default 1b; tiny with --quick")
    ap.add_argument("--gen-impls", default="flashtile,sdpa")
    ap.add_argument("--gen-batches", default=None, help="default 1,8")
    ap.add_argument("--gen-modes", default="dynamic,static")
    ap.add_argument("--gen-compile-mode", default="reduce-overhead")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 4096; 16 with --quick")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256; 4 with --quick")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no new case after this many seconds (0 = no limit); the rest are 'skipped'")
    ap.add_argument("--merge", nargs="+", default=None, metavar="RUN",
                    help="measure nothing: combine earlier runs (each a --out DIR or its transformers.json) into "
                         "one report, written to --out and printed")
    args = ap.parse_args(argv)

    quick = args.quick
    defaults = dict(configs="tiny" if quick else "1b,8b", seqlens="64" if quick else "2048,8192,32768",
                    tokens_per_step=128 if quick else 32768, warmup=1 if quick else 2, steps=2 if quick else 5,
                    gen_configs="tiny" if quick else "1b", gen_batches="1,2" if quick else "1,8",
                    prompt_len=16 if quick else 4096, new_tokens=4 if quick else 256,
                    compile_backend="aot_eager" if quick else "inductor")
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.loss_rtol is None:
        args.loss_rtol = 1e-5 if args.dtype == "fp32" else 1e-3

    args.sections = _csv(args.sections)
    args.impls = _csv(args.impls)
    args.configs = _csv(args.configs)
    args.seqlens = _csv(args.seqlens, int)
    args.padding = _csv(args.padding)
    args.compile = _csv(args.compile)
    args.gen_configs = _csv(args.gen_configs)
    args.gen_impls = _csv(args.gen_impls)
    args.gen_batches = _csv(args.gen_batches, int)
    args.gen_modes = _csv(args.gen_modes)
    for name, values, allowed in (("--sections", args.sections, ("train", "generate")),
                                  ("--impls", args.impls, IMPLS + OPT_IN),
                                  ("--gen-impls", args.gen_impls, IMPLS + OPT_IN),
                                  ("--configs", args.configs, tuple(CONFIGS)),
                                  ("--gen-configs", args.gen_configs, tuple(CONFIGS)),
                                  ("--padding", args.padding, ("dense", "padded")),
                                  ("--compile", args.compile, ("eager", "compile")),
                                  ("--gen-modes", args.gen_modes, ("dynamic", "static"))):
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"{name}: {bad} not in {list(allowed)}")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1: the first step is the one whose loss is checked and it compiles")
    if args.steps < 1 or args.new_tokens < 2 or args.prompt_len < 1 or args.tokens_per_step < 1:
        ap.error("--steps >= 1, --new-tokens >= 2, --prompt-len >= 1, --tokens-per-step >= 1")
    if any(s < 2 for s in args.seqlens):
        ap.error("--seqlens: every length must be >= 2")
    return args


# ---------------------------------------------------------------------------------------------------- models


def llama_config(name: str, args):
    shape = dict(CONFIGS[name])
    if name == "8b":
        shape["num_hidden_layers"] = args.layers_8b
    max_pos = max(args.seqlens + [args.prompt_len + args.new_tokens])
    return transformers.LlamaConfig(vocab_size=args.vocab if name != "tiny" else 128, max_position_embeddings=max_pos,
                                    tie_word_embeddings=False, attention_dropout=0.0, use_cache=False, **shape)


def build_model(cfg, impl: str, args, state=None):
    """A LlamaForCausalLM with attn_implementation=impl on args.device in args.dtype; state: weights to load."""
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                              dtype=DTYPES[args.dtype])
    got = model.config._attn_implementation
    if got != impl:
        raise RuntimeError(f"asked for attn_implementation={impl!r}, the model uses {got!r}")
    if state is not None:
        model.load_state_dict(state)
    return model


def base_weights(cfg, args) -> dict:
    """One draw of the config's weights (on the CPU, to load into every implementation's model)."""
    model = build_model(cfg, REF, args)
    pin = args.device.startswith("cuda")   # pinned: each case's copy to the GPU is a plain DMA
    state = {k: (v.detach().to("cpu", copy=True).pin_memory() if pin else v.detach().to("cpu", copy=True))
             for k, v in model.state_dict().items()}
    del model
    free_memory()
    return state


def n_params(state: dict) -> int:
    return sum(v.numel() for v in state.values())


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def reset_compiler():
    """Each case compiles afresh: reset Dynamo so earlier cases' graphs neither count toward the recompile limit
    (past it Dynamo would silently run eagerly) nor keep memory."""
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - an old torch without dynamo: nothing to reset
        pass


def make_optimizer(model, args):
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr), "SGD"
    try:
        return torch.optim.AdamW(params, lr=args.lr, fused=True), "AdamW(fused)"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=args.lr, foreach=True), "AdamW(foreach)"


def compile_kwargs(args, mode) -> dict:
    """torch.compile arguments; a mode only with inductor (the other backends take none, and CompileConfig must be
    told mode=None since its own default is "reduce-overhead")."""
    use_mode = args.compile_backend == "inductor" and mode not in (None, "default")
    return dict(backend=args.compile_backend, mode=mode if use_mode else None)


# ------------------------------------------------------------------------------------------------ measurement


class Timer:
    """Per-step wall times: CUDA events on the GPU (kernels end to end), perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.times = []

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.times.append((start, end))
        else:
            t0 = time.perf_counter()
            out = fn()
            self.times.append(time.perf_counter() - t0)
        return out

    def ms(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.times]
        return [t * 1e3 for t in self.times]


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gib(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def classify(exc: BaseException):
    """(status, message) of a failed case."""
    msg = f"{type(exc).__name__}: {exc}".strip()
    oom = isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in msg.lower()
    first = msg.splitlines()[0] if msg else type(exc).__name__
    return ("oom" if oom else "error"), first[:500]


def train_batch(cfg, seqlen, batch, padded, args):
    """input_ids, attention_mask (None when dense), labels (-100 on padding), real tokens; same for every impl."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + seqlen * 2 + int(padded))
    ids = torch.randint(0, cfg.vocab_size, (batch, seqlen), generator=g)
    labels = ids.clone()
    mask = None
    if padded:
        lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), generator=g)
        mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
        labels[mask == 0] = -100
        ids[mask == 0] = 0
        real = int(lengths.sum())
    else:
        real = batch * seqlen
    to = (lambda t: None if t is None else t.to(args.device))
    return to(ids), to(mask), to(labels), real


def grad_norm(model) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else float("nan")


def run_train_case(cfg, state, impl, seqlen, batch, padded, compiled, args, data):
    """Build, (compile,) warm up, time. Returns the measured fields of the row."""
    ids, mask, labels, real = data
    model = build_model(cfg, impl, args, state)
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    opt, opt_name = make_optimizer(model, args)
    forward = model
    if compiled:
        kw = compile_kwargs(args, args.compile_mode)
        if args.compile_scope == "layers":
            for layer in model.model.layers:
                layer.compile(**kw)
        else:
            forward = torch.compile(model, **kw)

    def step(check=False):
        # use_cache=False: a training forward that builds a KV cache keeps every layer's K/V alive and makes
        # compiled layers guard on (and recompile for) each layer's cache slot
        out = forward(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        loss = out.loss
        del out   # the logits (tokens x vocab) need not outlive the backward
        loss.backward()
        gn = grad_norm(model) if check else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), gn

    t0 = time.perf_counter()
    loss, gn = step(check=True)
    loss = float(loss)
    sync(args.device)
    first_step_s = time.perf_counter() - t0
    if not math.isfinite(loss):
        raise FloatingPointError(f"first-step loss is {loss}")
    for _ in range(args.warmup - 1):
        step()
    sync(args.device)
    timer = Timer(args.device)
    for _ in range(args.steps):
        timer(step)
    ms = timer.ms()
    med = statistics.median(ms)
    return dict(ms_per_step=med, ms_steps=[round(t, 3) for t in ms], tokens_per_step=real,
                tokens_per_s=real / med * 1e3, loss=loss, grad_norm=gn, first_step_s=round(first_step_s, 2),
                optimizer=opt_name)


class TokenClock(BaseStreamer):
    """A generate() streamer that notes when each batch of tokens reaches the host: put() receives the prompt first,
    then every new token (transformers copies it to the CPU, so the device has finished it by then)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_generate_case(cfg, state, impl, batch, mode, args, prompt):
    """A warm-up generate, then a timed one. Returns the row fields and the new tokens."""
    gcfg = copy.deepcopy(cfg)
    gcfg.use_cache = True
    model = build_model(gcfg, impl, args, state)
    model.eval()
    mask = torch.ones_like(prompt)
    n = args.new_tokens
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
              pad_token_id=cfg.eos_token_id, use_cache=True)
    if mode == "static":
        cc = transformers.CompileConfig(**compile_kwargs(args, args.gen_compile_mode))
        if not args.device.startswith("cuda"):
            cc._compile_all_devices = True   # transformers compiles on accelerators only; the CPU smoke run forces it
        kw.update(cache_implementation="static", compile_config=cc)

    with torch.no_grad():
        t0 = time.perf_counter()
        # the warm-up keeps its first steps' logits: the check against SDPA's (annotate: logits_agreement)
        warm = model.generate(prompt, output_logits=True, return_dict_in_generate=True, **kw)
        sync(args.device)
        warm_s = time.perf_counter() - t0
        steps = min(CHECK_STEPS, len(warm.logits))
        check = dict(prefix=warm.sequences[:, prompt.shape[1]:prompt.shape[1] + steps].to("cpu"),
                     logits=torch.stack(warm.logits[:steps]).float().to("cpu"))
        del warm
        clock = TokenClock()
        t0 = time.perf_counter()
        out = model.generate(prompt, streamer=clock, **kw)
        sync(args.device)
        t_end = time.perf_counter()
    new = out[:, prompt.shape[1]:]
    if new.shape[1] != n or len(clock.times) != n + 1:
        raise RuntimeError(f"generate returned {new.shape[1]} new tokens ({len(clock.times) - 1} streamed), "
                           f"expected {n}")
    gen_ms = (t_end - t0) * 1e3
    ttft_ms = (clock.times[1] - t0) * 1e3
    decode_ms = (t_end - clock.times[1]) * 1e3
    row = dict(generate_ms=gen_ms, new_tokens_per_s=batch * n / gen_ms * 1e3, ttft_ms=ttft_ms,
               decode_tokens_per_s=batch * (n - 1) / decode_ms * 1e3 if decode_ms > 0 else None,
               warmup_s=round(warm_s, 2))
    return row, dict(check, tokens=new.to("cpu"))


# ------------------------------------------------------------------------------------------------------ report


def versions() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                triton=triton_version, flashtile=getattr(flashtile, "__version__", None))


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores; Triton interpreter)"


def logits_agreement(ours: dict, ref: dict):
    """(largest relative logits difference, row-steps compared) of two generate runs' first steps (run_generate_case's
    check: prefix tokens (batch, steps), logits (steps, batch, vocab)). Greedy decoding from random weights, whose
    logits lie close together, soon picks a different token than SDPA's and the rows then diverge: a row's step is
    compared while the tokens before it are SDPA's (step s of a row whose first s tokens agree), the difference
    max|ours - ref| / max|ref| of the step's logits. (None, 0) where either run kept no logits."""
    if ours.get("logits") is None or ref.get("logits") is None:
        return None, 0
    steps = min(ours["logits"].shape[0], ref["logits"].shape[0])
    worst, compared = 0.0, 0
    for i in range(ref["prefix"].shape[0]):
        differ = (ours["prefix"][i, :steps] != ref["prefix"][i, :steps]).nonzero()
        last = int(differ[0]) if len(differ) else steps - 1    # step `last` still follows an equal prefix
        for t in range(last + 1):
            a, b = ours["logits"][t, i], ref["logits"][t, i]
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
            compared += 1
    return worst, compared


def annotate(report: dict, gen_tokens: dict):
    """Adds the comparisons with SDPA: loss (checked against --loss-rtol), grad norm, tokens/s ratio, tokens."""
    rtol = report["meta"]["loss_rtol"]
    key = (lambda r: (r["config"], r["seqlen"], r["batch"], r["padded"], r["compiled"]))
    refs = {key(r): r for r in report["train"] if r["impl"] == REF and r["status"] == "ok"}
    for r in report["train"]:
        ref = refs.get(key(r))
        ok = r["status"] == "ok" and ref is not None
        r["speedup_vs_sdpa"] = r["tokens_per_s"] / ref["tokens_per_s"] if ok else None
        r["loss_rel_diff_vs_sdpa"] = abs(r["loss"] - ref["loss"]) / abs(ref["loss"]) if ok else None
        r["grad_norm_rel_diff_vs_sdpa"] = (abs(r["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])
                                           if ok and ref["grad_norm"] else None)
        r["loss_ok"] = (r["loss_rel_diff_vs_sdpa"] <= rtol) if ok else None
    gkey = (lambda r: (r["config"], r["batch"], r["mode"]))
    grefs = {gkey(r): r for r in report["generate"] if r["impl"] == REF and r["status"] == "ok"}
    for r in report["generate"]:
        ref = grefs.get(gkey(r))
        ok = r["status"] == "ok" and ref is not None
        r["speedup_vs_sdpa"] = r["new_tokens_per_s"] / ref["new_tokens_per_s"] if ok else None
        a, b = gen_tokens.get(gkey(r) + (r["impl"],)), gen_tokens.get(gkey(r) + (REF,))
        if a is not None and b is not None:   # else keep what the run that generated them computed (--merge)
            r["same_tokens_as_sdpa"] = float((a["tokens"] == b["tokens"]).float().mean()) if ok else None
            r["logits_rel_diff_vs_sdpa"], r["logit_steps_compared"] = logits_agreement(a, b) if ok else (None, 0)
        r.setdefault("same_tokens_as_sdpa", None)
        r.setdefault("logits_rel_diff_vs_sdpa", None)
        r.setdefault("logit_steps_compared", 0)


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def _status(r, notes):
    if r["status"] == "ok":
        return "ok"
    if r.get("error"):
        notes.append(r["error"])
        return f"{r['status']} [{len(notes)}]"
    return r["status"]


def markdown(report: dict) -> str:
    m = report["meta"]
    commands = [r["command"] for r in m.get("merged_from", [m])]
    lines = ["# transformers end to end: flashtile vs SDPA vs FlexAttention", "",
             f"{m['device_name']}; torch {m['torch']}, transformers {m['transformers']}, triton {m['triton']}; "
             f"{m['dtype']}", ""] + [f"    {c}" for c in commands] + [""]
    if m.get("warning"):
        lines += [f"**{m['warning']}**", ""]
    for name, c in report["configs"].items():
        lines.append(f"- **{name}**: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, heads "
                     f"{c['num_attention_heads']}/{c['num_key_value_heads']}, head dim {c['head_dim']}, MLP "
                     f"{c['intermediate_size']}, vocab {c['vocab_size']}, {c['params'] / 1e9:.2f} B parameters")
    notes = []
    if report["train"]:
        lines += ["", f"## Training step (forward + loss + backward + {m.get('optimizer') or m['optimizer_arg']})",
                  "", f"{m['tokens_per_step']} tokens per step (batch = tokens / seqlen); padded rows hold "
                  "lengths uniform in [L/2, L] and tokens/s counts real tokens only; compile = "
                  f"torch.compile of the {m['compile_scope']} ({m['train_compile_kwargs']}); "
                  f"median of {m['steps']} steps after {m['warmup']} warm-up; "
                  f"loss = first step, Δ = relative difference from SDPA's (tolerance {m['loss_rtol']:g}).", "",
                  "| config | seqlen | batch | padded | compiled | impl | status | ms/step | tokens/s | vs sdpa | "
                  "peak GiB | loss | Δloss |",
                  "|---|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in report["train"]:
            lines.append(
                f"| {r['config']} | {r['seqlen']} | {r['batch']} | {'yes' if r['padded'] else 'no'} | "
                f"{'yes' if r['compiled'] else 'no'} | {r['impl']} | {_status(r, notes)} | "
                f"{_f(r.get('ms_per_step'))} | {_f(r.get('tokens_per_s'), '{:,.0f}')} | "
                f"{_f(r.get('speedup_vs_sdpa'), '{:.2f}x')} | {_f(r.get('peak_gib'), '{:.1f}')} | "
                f"{_f(r.get('loss'), '{:.4f}')} | {_f(r.get('loss_rel_diff_vs_sdpa'), '{:.1e}')}"
                f"{' (over tolerance)' if r.get('loss_ok') is False else ''} |")
    if report["generate"]:
        lines += ["", "## Generation (greedy, batch x new tokens after the prompt)", "",
                  "dynamic = eager with DynamicCache; static = cache_implementation=\"static\" with transformers' "
                  f"compiled decoding forward ({m['gen_compile_kwargs']}); new tok/s = batch x new tokens / "
                  "generate time; TTFT = prefill + first token; same = fraction of new tokens equal to SDPA's "
                  "(random weights: greedy rows soon pick another near-tied token and diverge); Δlogits = the "
                  "largest max|Δ| / max|SDPA's| of a step's logits over the warm-up run's first "
                  f"{CHECK_STEPS} steps while a row's tokens so far are SDPA's (in parentheses: row-steps "
                  "compared).", "",
                  "| config | batch | prompt | new | mode | impl | status | generate ms | new tok/s | vs sdpa | "
                  "TTFT ms | decode tok/s | peak GiB | same | Δlogits |",
                  "|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["generate"]:
            lines.append(
                f"| {r['config']} | {r['batch']} | {r['prompt_len']} | {r['new_tokens']} | {r['mode']} | "
                f"{r['impl']} | {_status(r, notes)} | {_f(r.get('generate_ms'))} | "
                f"{_f(r.get('new_tokens_per_s'), '{:,.0f}')} | {_f(r.get('speedup_vs_sdpa'), '{:.2f}x')} | "
                f"{_f(r.get('ttft_ms'))} | {_f(r.get('decode_tokens_per_s'), '{:,.0f}')} | "
                f"{_f(r.get('peak_gib'), '{:.1f}')} | {_f(r.get('same_tokens_as_sdpa'), '{:.2f}')} | "
                f"{_f(r.get('logits_rel_diff_vs_sdpa'), '{:.1e}')} ({r.get('logit_steps_compared', 0)}) |")
    if notes:
        lines += ["", "Errors:"] + [f"{i}. `{n}`" for i, n in enumerate(notes, 1)]
    lines.append("")
    return "\n".join(lines)


def write(report, gen_tokens, out):
    annotate(report, gen_tokens)
    if "_t0" in report["meta"]:
        report["meta"]["elapsed_s"] = round(time.perf_counter() - report["meta"]["_t0"], 1)
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    meta = {k: v for k, v in report["meta"].items() if not k.startswith("_")}
    with open(os.path.join(out, "transformers.json"), "w") as f:
        json.dump(dict(report, meta=meta), f, indent=1)
    with open(os.path.join(out, "transformers.md"), "w") as f:
        f.write(markdown(report))


# -------------------------------------------------------------------------------------------------------- main


def merge(runs: list) -> dict:
    """One report from several runs' transformers.json (e.g. the calls a split grid took): their rows in order, the
    first run's settings, every run's meta under "merged_from" and a warning when device, versions, dtype or timing
    settings differ."""
    reports = []
    for run in runs:
        path = run if run.endswith(".json") else os.path.join(run, "transformers.json")
        with open(path) as f:
            reports.append(json.load(f))
    meta = dict(reports[0]["meta"], merged_from=[r["meta"] for r in reports])
    keys = ("device_name", "torch", "transformers", "triton", "dtype", "warmup", "steps", "tokens_per_step",
            "compile_scope", "train_compile_kwargs", "gen_compile_kwargs", "prompt_len", "new_tokens")
    differ = [k for k in keys if len({json.dumps(r["meta"].get(k)) for r in reports}) > 1]
    if differ:
        meta["warning"] = f"the merged runs differ in {', '.join(differ)}: the header shows the first run's"
    report = dict(meta=meta, configs={}, train=[], generate=[])
    for r in reports:
        report["configs"].update(r["configs"])
        report["train"] += r["train"]
        report["generate"] += r["generate"]
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge:
        report = merge(args.merge)
        write(report, {}, args.out)
        print(markdown(report))
        return report
    ft_hf.register()
    meta = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv if argv is None
                                 else ["bench_transformers.py"] + list(argv)),
                argv=list(sys.argv[1:] if argv is None else argv), **versions(), device=args.device,
                device_name=device_name(args.device), dtype=args.dtype, seed=args.seed,
                tokens_per_step=args.tokens_per_step, warmup=args.warmup, steps=args.steps,
                compile_scope=args.compile_scope, compile_mode=args.compile_mode,
                compile_backend=args.compile_backend, gen_compile_mode=args.gen_compile_mode,
                train_compile_kwargs=compile_kwargs(args, args.compile_mode),
                gen_compile_kwargs=compile_kwargs(args, args.gen_compile_mode),
                optimizer_arg=args.optimizer, optimizer=None, gradient_checkpointing=args.gradient_checkpointing,
                loss_rtol=args.loss_rtol, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                started=time.strftime("%Y-%m-%d %H:%M:%S"), _t0=time.perf_counter())
    report = dict(meta=meta, configs={}, train=[], generate=[])
    gen_tokens = {}
    print(f"# {meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}, "
          f"triton {meta['triton']}; {args.dtype}", flush=True)

    def over_budget():
        return args.budget_s > 0 and time.perf_counter() - meta["_t0"] > args.budget_s

    def run_case(row, fn):
        """fn() -> dict of measured fields; the row gets them, or the failure. Memory and Dynamo are cleaned up
        after every case that ran (the case's model, optimizer and compiled graphs die with fn's frame)."""
        if over_budget():
            row.update(status="skipped", error=f"--budget-s {args.budget_s:g} reached")
            return row
        reset_peak(args.device)
        t0 = time.perf_counter()
        try:
            row.update(fn())
            row.update(status="ok", error=None, peak_gib=peak_gib(args.device))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row, the grid goes on
            status, msg = classify(exc)
            traceback.print_exc(limit=6)
            row.update(status=status, error=msg, peak_gib=peak_gib(args.device))
            del exc   # the traceback holds the case's frames, hence its tensors
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        try:
            reset_compiler()
            free_memory()
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error that poisoned the context: keep the row
            row["cleanup_error"] = classify(exc)[1]
        return row

    def flex_refusal(cfg, impl):
        """Why transformers refuses impl for this model (None when it accepts it): build on the meta device."""
        if impl != "flex_attention":
            return None
        try:
            with torch.device("meta"):
                transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        except Exception as exc:  # noqa: BLE001
            return f"transformers refuses attn_implementation={impl!r}: {type(exc).__name__}: {exc}"[:500]
        return None

    states = {}

    def weights(name):
        if name not in states:
            states.clear()
            free_memory()
            cfg = llama_config(name, args)
            states[name] = (cfg, base_weights(cfg, args))
            report["configs"][name] = dict({k: getattr(cfg, k) for k in CONFIGS[name]}, vocab_size=cfg.vocab_size,
                                           params=n_params(states[name][1]))
        return states[name]

    if "train" in args.sections:
        for name in args.configs:
            cfg, state = weights(name)
            refusals = {impl: flex_refusal(cfg, impl) for impl in args.impls}
            for mode in args.compile:
                for seqlen in args.seqlens:
                    batch = max(1, args.tokens_per_step // seqlen)
                    for padding in args.padding:
                        padded = padding == "padded"
                        data = train_batch(cfg, seqlen, batch, padded, args)
                        for impl in args.impls:
                            row = dict(config=name, impl=impl, seqlen=seqlen, batch=batch, padded=padded,
                                       compiled=mode == "compile")
                            if refusals[impl]:
                                row.update(status="skipped", error=refusals[impl])
                            else:
                                run_case(row, lambda: run_train_case(cfg, state, impl, seqlen, batch, padded,
                                                                     mode == "compile", args, data))
                            meta["optimizer"] = meta["optimizer"] or row.get("optimizer")
                            report["train"].append(row)
                            write(report, gen_tokens, args.out)
                            print(f"train {name} L={seqlen} b={batch} {padding:6s} {mode:7s} {impl:14s} "
                                  f"{row['status']:7s} {_f(row.get('ms_per_step'))} ms "
                                  f"{_f(row.get('tokens_per_s'), '{:,.0f}')} tok/s "
                                  f"peak {_f(row.get('peak_gib'), '{:.1f}')} GiB loss "
                                  f"{_f(row.get('loss'), '{:.5f}')} ({row.get('wall_s', 0)} s)"
                                  + (f" -- {row['error']}" if row.get("error") else ""), flush=True)
                        del data

    if "generate" in args.sections:
        for name in args.gen_configs:
            cfg, state = weights(name)
            for mode in args.gen_modes:
                for batch in args.gen_batches:
                    g = torch.Generator().manual_seed(args.seed * 1_000_003 + batch)
                    prompt = torch.randint(3, cfg.vocab_size, (batch, args.prompt_len), generator=g).to(args.device)
                    for impl in args.gen_impls:
                        row = dict(config=name, impl=impl, batch=batch, prompt_len=args.prompt_len,
                                   new_tokens=args.new_tokens, mode=mode)
                        refusal = flex_refusal(cfg, impl)
                        if refusal:
                            row.update(status="skipped", error=refusal)
                        else:
                            def case():
                                fields, new = run_generate_case(cfg, state, impl, batch, mode, args, prompt)
                                gen_tokens[(name, batch, mode, impl)] = new
                                return fields
                            run_case(row, case)
                        report["generate"].append(row)
                        write(report, gen_tokens, args.out)
                        print(f"generate {name} b={batch} {mode:7s} {impl:14s} {row['status']:7s} "
                              f"{_f(row.get('generate_ms'))} ms {_f(row.get('new_tokens_per_s'), '{:,.0f}')} "
                              f"new tok/s TTFT {_f(row.get('ttft_ms'))} ms ({row.get('wall_s', 0)} s)"
                              + (f" -- {row['error']}" if row.get("error") else ""), flush=True)
                    del prompt

    write(report, gen_tokens, args.out)
    print()
    print(markdown(report))
    if args.out:
        print(f"wrote {os.path.join(args.out, 'transformers.json')} and transformers.md "
              f"({meta['elapsed_s']} s in all)")
    return report


if __name__ == "__main__":
    main()

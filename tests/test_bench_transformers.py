"""benchmarks/bench_transformers.py --quick as a smoke test: every training and generation case of a tiny Llama runs
under flashtile and SDPA, writes real numbers, and flashtile's first-step loss and greedy tokens equal SDPA's.

The run is cut to what 2 CPU cores finish in well under a minute through the Triton interpreter: batch 1 of 16
tokens (the padded row keeps 8-16 of them), one timed step, 2 tokens generated after 8, and Dynamo's "eager"
backend for the compiled cases (it traces the layers and transformers' static-cache decoding step, graph breaks
included, without generating code).
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bench_utils import ROOT, load_script

pytest.importorskip("transformers")

SCRIPT = ROOT / "benchmarks" / "bench_transformers.py"


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_quick_run_fills_every_section(tmp_path):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = tmp_path / "e2e"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", device, "--dtype", "fp32", "--impls", "flashtile,sdpa",
           "--seqlens", "16", "--tokens-per-step", "16", "--steps", "1", "--gen-batches", "1", "--prompt-len", "8",
           "--new-tokens", "2", "--gen-impls", "flashtile,sdpa,eager", "--compile-backend", "eager", "--out", str(out)]
    # one OpenMP thread: on a 2-core machine torch's default pool spins against the interpreter's numpy work
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((out / "transformers.json").read_text())

    meta = report["meta"]
    for key in ("command", "torch", "transformers", "triton", "device_name"):
        assert meta[key], key
    assert "--quick" in meta["command"]
    assert meta["dtype"] == "fp32" and meta["loss_rtol"] == 1e-5
    assert report["configs"]["tiny"]["num_hidden_layers"] == 2 and report["configs"]["tiny"]["params"] > 0

    train = report["train"]
    cases = {(r["impl"], r["padded"], r["compiled"]) for r in train}
    assert cases == {(i, p, c) for i in ("flashtile", "sdpa") for p in (False, True) for c in (False, True)}
    for r in train:
        assert r["status"] == "ok", r
        for key in ("ms_per_step", "tokens_per_s", "loss", "grad_norm", "speedup_vs_sdpa", "loss_rel_diff_vs_sdpa"):
            assert _real(r[key]), (key, r)
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
        assert r["batch"] == 1 and r["seqlen"] == 16
        # the padded row holds 8..16 real tokens and only those are counted
        assert (8 <= r["tokens_per_step"] <= 16) if r["padded"] else r["tokens_per_step"] == 16
        assert (r["peak_gib"] > 0) if device == "cuda" else r["peak_gib"] is None
    for r in train:
        if r["impl"] == "flashtile":
            # fp32, same weights, same batch: flashtile's loss and gradient norm are SDPA's up to rounding
            assert r["loss_ok"] is True, r
            assert r["loss_rel_diff_vs_sdpa"] <= 1e-5, r
            assert r["grad_norm_rel_diff_vs_sdpa"] <= 1e-4, r

    gen = report["generate"]
    assert {(r["impl"], r["mode"]) for r in gen} == {(i, m) for i in ("flashtile", "sdpa", "eager")
                                                    for m in ("dynamic", "static")}
    for r in gen:
        assert r["status"] == "ok", r
        assert r["batch"] == 1 and r["prompt_len"] == 8 and r["new_tokens"] == 2
        for key in ("generate_ms", "new_tokens_per_s", "ttft_ms", "decode_tokens_per_s", "speedup_vs_sdpa"):
            assert _real(r[key]) and r[key] > 0, (key, r)
        assert r["ttft_ms"] < r["generate_ms"]
        assert r["same_tokens_as_sdpa"] == 1.0, r   # greedy fp32 decoding: the same tokens
        # ... from the same logits at every step (2 new tokens: both steps of the one row compared)
        assert r["logit_steps_compared"] == 2 and r["logits_rel_diff_vs_sdpa"] <= 1e-5, r

    md = (out / "transformers.md").read_text()
    assert "## Training step" in md and "## Generation" in md
    assert md.count("| tiny |") == len(train) + len(gen)
    assert "## Training step" in proc.stdout and "## Generation" in proc.stdout   # the tables end the log too


def test_quick_defaults():
    mod = load_script(SCRIPT)
    args = mod.parse_args(["--quick", "--device", "cpu"])
    assert args.configs == ["tiny"] and args.seqlens == [64] and args.tokens_per_step == 128
    assert args.warmup == 1 and args.steps == 2 and args.prompt_len == 16 and args.new_tokens == 4
    assert args.dtype == "fp32" and args.compile_backend == "aot_eager" and args.loss_rtol == 1e-5
    args = mod.parse_args(["--device", "cuda"])
    assert args.configs == ["1b", "8b"] and args.seqlens == [2048, 8192, 32768] and args.tokens_per_step == 32768
    assert args.dtype == "bf16" and args.compile_backend == "inductor" and args.loss_rtol == 1e-3
    assert args.prompt_len == 4096 and args.new_tokens == 256 and args.gen_batches == [1, 8]


def test_logits_are_compared_while_the_tokens_agree(seed):
    """The generation check: a row's step is compared while the row's earlier tokens are SDPA's (the step whose
    token first differs included); later steps, which follow another prefix, are not."""
    mod = load_script(SCRIPT)
    g = torch.Generator().manual_seed(seed)
    ref = dict(prefix=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), logits=torch.randn(4, 2, 10, generator=g))
    ours = dict(prefix=torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8]]), logits=ref["logits"].clone())
    ours["logits"][3, 0] += 100.0   # row 0, step 3: after the differing token, not compared
    ours["logits"][1, 1] += 0.5
    worst, compared = mod.logits_agreement(ours, ref)
    assert compared == 3 + 4
    assert worst == pytest.approx(0.5 / ref["logits"][1, 1].abs().max().item(), rel=1e-5)
    assert mod.logits_agreement(dict(tokens=ours["prefix"]), ref) == (None, 0)


def test_failures_become_rows_and_the_grid_goes_on(tmp_path, monkeypatch):
    """A case that raises is recorded (status "error" or "oom", with the message) and the cases after it still run;
    the comparison with SDPA is left empty for it. The measurements are stubbed: no kernel runs."""
    mod = load_script(SCRIPT)

    def fake_train(cfg, state, impl, seqlen, batch, padded, compiled, args, data):
        if impl == "flashtile" and padded:
            raise ValueError("flashtile (transformers integration): boom\nsecond line")
        return dict(ms_per_step=2.0 if impl == "flashtile" else 4.0, ms_steps=[2.0], tokens_per_step=data[3],
                    tokens_per_s=data[3] / (2.0 if impl == "flashtile" else 4.0) * 1e3, loss=4.0, grad_norm=1.0,
                    first_step_s=0.1, optimizer="AdamW(stub)")

    def fake_generate(cfg, state, impl, batch, mode, args, prompt):
        if mode == "static" and impl == "flashtile":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        new = torch.zeros(batch, args.new_tokens, dtype=torch.long)
        return dict(generate_ms=10.0, new_tokens_per_s=batch * args.new_tokens / 10.0 * 1e3, ttft_ms=5.0,
                    decode_tokens_per_s=1.0, warmup_s=0.0), dict(tokens=new)

    monkeypatch.setattr(mod, "run_train_case", fake_train)
    monkeypatch.setattr(mod, "run_generate_case", fake_generate)
    monkeypatch.setattr(mod, "free_memory", lambda: None)   # gc.collect: 0.3 s a case here, nothing to free
    report = mod.main(["--quick", "--device", "cpu", "--impls", "flashtile,sdpa", "--compile", "eager",
                       "--gen-batches", "1", "--out", str(tmp_path)])
    rows = {(r["impl"], r["padded"]): r for r in report["train"]}
    bad = rows["flashtile", True]
    assert bad["status"] == "error" and bad["error"] == "ValueError: flashtile (transformers integration): boom"
    assert bad["speedup_vs_sdpa"] is None and bad["loss_ok"] is None
    assert rows["sdpa", True]["status"] == "ok"            # ran after the failure
    assert rows["flashtile", False]["speedup_vs_sdpa"] == 2.0 and rows["flashtile", False]["loss_ok"] is True
    gen = {(r["impl"], r["mode"]): r for r in report["generate"]}
    assert gen["flashtile", "static"]["status"] == "oom"
    assert gen["sdpa", "static"]["status"] == "ok" and gen["flashtile", "dynamic"]["same_tokens_as_sdpa"] == 1.0
    md = (tmp_path / "transformers.md").read_text()
    assert "error [1]" in md and "oom [2]" in md and "1. `ValueError: flashtile" in md
    saved = json.loads((tmp_path / "transformers.json").read_text())
    assert [r["status"] for r in saved["train"]] == [r["status"] for r in report["train"]]

    # --merge joins runs (a split grid's calls): rows in order, every command listed, same-token fractions kept
    other = dict(saved, meta=dict(saved["meta"], command="bench_transformers.py --second-call", dtype="bf16"))
    (tmp_path / "other.json").write_text(json.dumps(other))
    merged = mod.main(["--merge", str(tmp_path), str(tmp_path / "other.json"), "--out", str(tmp_path / "merged")])
    assert len(merged["train"]) == 2 * len(saved["train"]) and len(merged["generate"]) == 2 * len(saved["generate"])
    assert "dtype" in merged["meta"]["warning"]
    assert [r["same_tokens_as_sdpa"] for r in merged["generate"]] == [r["same_tokens_as_sdpa"]
                                                                      for r in saved["generate"]] * 2
    md = (tmp_path / "merged" / "transformers.md").read_text()
    assert saved["meta"]["command"] in md and "--second-call" in md and "differ in dtype" in md

    skipped = mod.main(["--quick", "--device", "cpu", "--impls", "flashtile,sdpa", "--compile", "eager",
                        "--sections", "train", "--budget-s", "1e-9"])
    assert {r["status"] for r in skipped["train"]} == {"skipped"}
    assert all("--budget-s" in r["error"] for r in skipped["train"])


@pytest.mark.parametrize("argv", [["--impls", "flashtile,nope"], ["--gen-impls", "eagre"], ["--compile", "jit"],
                                  ["--warmup", "0"], ["--configs", "70b"], ["--seqlens", "1"]])
def test_bad_arguments_are_rejected(argv):
    mod = load_script(SCRIPT)
    with pytest.raises(SystemExit):
        mod.parse_args(["--device", "cpu", *argv])

"""The benchmark runner on the CPU: grid, FLOP formula, correctness gate, skip/oom handling, and the files it writes.

CPU timings are time.perf_counter medians and mean nothing; these tests check the runner, not the kernels.
Providers that exist on the CPU: sdpa-math, eager, and flashtile (Triton interpreter).
"""
import argparse
import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest
import torch

import flashtile
from flashtile.bench import measure, providers, report, runner
from flashtile.bench.runner import BenchConfig, Shape
from flashtile.reference.dense import visible_mask

HAS_FLASHTILE = hasattr(flashtile, "flash_attn_func")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = dict(warmup=0.1, rep=0.1)  # ms: one warm-up call and one timed call on the CPU


def parse(argv):
    parser = argparse.ArgumentParser(prog="flashtile bench")
    runner.add_bench_arguments(parser)
    return parser.parse_args(argv)


def cpu_config(names, **kw):
    base = dict(shapes=[Shape(batch=2, nheads=3, seqlen=48, headdim=16)], providers=names, device="cpu",
                dtype=torch.float16, causals=(False, True), **FAST)
    base.update(kw)
    return BenchConfig(**base)


def by(records, **match):
    return [r for r in records if all(r[k] == v for k, v in match.items())]


# ----------------------------------------------------------------------------------------------------------
# grid and FLOPs
# ----------------------------------------------------------------------------------------------------------
def test_fa3_grid_is_16k_tokens_hidden_2048():
    grid = runner.fa3_grid()
    assert len(grid) == 3 * 6
    assert {s.headdim for s in grid} == {64, 128, 256}
    assert {s.seqlen for s in grid} == {512, 1024, 2048, 4096, 8192, 16384}
    for s in grid:
        assert s.batch * s.seqlen == 16384
        assert s.nheads * s.headdim == 2048
    # The shapes the peers' reference measurements use (b2 h16 8k d128, b2 h32 8k d64, b8 h16 2k d128) are in it.
    assert Shape(batch=2, nheads=16, seqlen=8192, headdim=128) in grid
    assert Shape(batch=2, nheads=32, seqlen=8192, headdim=64) in grid
    assert Shape(batch=8, nheads=16, seqlen=2048, headdim=128) in grid


def test_explicit_batch_and_nheads_override_the_derivation():
    shapes = runner.derive_shapes([64, 128], [32768], batch=None, nheads=16)
    assert shapes == [Shape(1, 16, 32768, 64), Shape(1, 16, 32768, 128)]  # 16384 // 32768 -> at least 1
    assert runner.derive_shapes([128], [4096], batch=3) == [Shape(3, 16, 4096, 128)]
    with pytest.raises(ValueError, match="headdim"):
        Shape(batch=1, nheads=1, seqlen=8, headdim=0)


def test_flop_formula():
    fwd = measure.attention_flops(2, 16, 8192, 8192, 128, causal=False, mode="fwd")
    assert fwd == 4 * 8192 * 8192 * 128 * 16 * 2
    assert measure.attention_flops(2, 16, 8192, 8192, 128, causal=True, mode="fwd") == fwd / 2
    assert measure.attention_flops(2, 16, 8192, 8192, 128, causal=False, mode="bwd") == 2.5 * fwd
    assert measure.attention_flops(2, 16, 8192, 8192, 128, causal=True, mode="bwd") == 1.25 * fwd
    # seqlen_q != seqlen_k: the exact visible fraction of the bottom-right aligned causal mask.
    frac = visible_mask(3, 7, causal=True).double().mean().item()
    assert measure.attention_flops(1, 1, 3, 7, 8, causal=True) == pytest.approx(4 * 3 * 7 * 8 * frac)
    assert measure.tflops_per_s(2e12, 1000.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="headdim"):
        measure.attention_flops(1, 1, 8, 8, 0, causal=False)
    with pytest.raises(ValueError, match="mode"):
        measure.attention_flops(1, 1, 8, 8, 8, causal=False, mode="both")


# ----------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------
def test_custom_grid_from_the_command_line():
    args = parse("--headdim 64,128 --seqlen 8k --batch 2 --nheads 16 --causal true --mode fwd --dtype bf16 "
                 "--device cpu --providers eager,sdpa-cudnn --warmup 5 --rep 20".split())
    cfg, memory = runner.build_config(args)
    assert not memory
    assert cfg.shapes == [Shape(2, 16, 8192, 64), Shape(2, 16, 8192, 128)]
    assert cfg.causals == (True,) and cfg.modes == ("fwd",) and cfg.dtype == torch.bfloat16
    assert cfg.providers == ["eager", "cudnn"]  # alias resolved
    assert cfg.baseline == "cudnn" and cfg.compare == ["eager"]
    assert (cfg.warmup, cfg.rep) == (5.0, 20.0)


def test_cpu_defaults_are_a_tiny_bf16_grid():
    cfg, _ = runner.build_config(parse(["--device", "cpu"]))
    assert all(s.batch * s.nheads * s.seqlen <= 1024 for s in cfg.shapes)
    assert cfg.dtype == torch.bfloat16 and cfg.causals == (False, True) and cfg.modes == ("fwd", "bwd")
    assert cfg.providers == list(providers.PROVIDERS)
    assert cfg.baseline == "cudnn" and cfg.compare == ["flashtile", "flashtile-triton", "flashtile-bhsd"]


@pytest.mark.parametrize("argv, needle", [
    (["--providers", "flashtile,nope"], "nope"),
    (["--headdim", "0"], "--headdim"),
    (["--seqlen", "abc"], "--seqlen"),
    (["--batch", "-2"], "--batch"),
    (["--warmup", "0"], "--warmup"),
    (["--dtype", "fp8"], "--dtype"),
    (["--mode", "sideways"], "--mode"),
    (["--pin-cpu", "-1"], "--pin-cpu"),
    (["--pin-cpu", "first"], "--pin-cpu"),
])
def test_bad_arguments_are_argparse_errors_naming_the_argument(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--device", "cpu", "--memory"], "--memory"),
    (["--device", "cpu", "--providers", "eager", "--baseline", "cudnn"], "--baseline"),
    (["--device", "cpu", "--providers", "eager,cudnn", "--compare", "fa2"], "--compare"),
])
def test_inconsistent_arguments_exit_2_with_a_message(argv, needle, capsys, tmp_path):
    assert runner.run_bench(parse(argv + ["--out", str(tmp_path / "x")])) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="--device"):
        runner.build_config(parse(["--device", "cuda"]))


# ----------------------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------------------
def test_registry_names_aliases_and_duplicates():
    assert {"flashtile", "sdpa-flash", "cudnn", "sdpa-efficient", "sdpa-math", "eager", "flex", "fa2", "fa3",
            "fa4"} <= set(providers.PROVIDERS)
    assert providers.resolve_names(["SDPA-cudnn", "eager", "eager"]) == ["cudnn", "eager"]
    assert providers.resolve_names(["all"]) == list(providers.PROVIDERS)
    with pytest.raises(ValueError, match="'bogus'"):
        providers.resolve_names(["bogus"])
    reg = {}
    providers.register_provider("x", registry=reg)(lambda device, dtype: None)
    with pytest.raises(ValueError, match="already registered"):
        providers.register_provider("x", registry=reg)(lambda device, dtype: None)
    with pytest.raises(ValueError, match="layout"):
        providers.register_provider("y", layout="hsbd", registry=reg)


def test_available_providers_says_what_runs_here_and_why_not():
    reg = {}

    def refuses(device, dtype):
        raise providers.ProviderUnavailable("needs a Hopper GPU")

    def imports_missing(device, dtype):
        import flashtile_no_such_module  # noqa: F401
        return None

    providers.register_provider("ok", devices=("cpu",), modules=("torch",), registry=reg)(lambda d, t: None)
    providers.register_provider("refuses", devices=("cpu",), registry=reg)(refuses)
    providers.register_provider("missing", devices=("cpu",), modules=("flashtile_no_such_module",),
                                registry=reg)(imports_missing)
    providers.register_provider("gpu-only", devices=("cuda",), modules=("flashtile_no_such_module",),
                                registry=reg)(lambda d, t: None)
    got = providers.available_providers("cpu", torch.float16, registry=reg)
    assert got["ok"]["available"] and got["ok"]["importable"] and got["ok"]["reason"] is None
    assert got["refuses"] == {**got["refuses"], "available": False, "importable": True, "reason": "needs a Hopper GPU"}
    assert not got["missing"]["available"] and not got["missing"]["importable"]
    assert "flashtile_no_such_module" in got["missing"]["reason"]
    # ruled out by the device, and its module is absent: both said
    assert not got["gpu-only"]["importable"]
    assert "cuda only" in got["gpu-only"]["reason"] and "flashtile_no_such_module" in got["gpu-only"]["reason"]


def test_fa3_fa4_tuple_outputs_are_unwrapped():
    t = torch.ones(1)
    assert providers.first_output((t, torch.zeros(1))) is t and providers.first_output(t) is t


# ----------------------------------------------------------------------------------------------------------
# correctness oracle
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_reference_equals_the_whole_one(causal, seed):
    q, k, v, do = measure.random_inputs(3, 4, 40, 8, torch.float32, "cpu", seed)
    whole = measure.compute_reference(q, k, v, do, causal, with_grads=True)
    chunked = measure.compute_reference(q, k, v, do, causal, with_grads=True, max_score_elems=4 * 40 * 3)
    assert (whole.b_idx, whole.h_idx) == ([0, 2], [0, 3])
    assert whole.out.shape == (2, 40, 2, 8) and whole.out.dtype == torch.float64
    torch.testing.assert_close(chunked.out, whole.out, rtol=1e-12, atol=1e-12)
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(chunked.grads[name], whole.grads[name], rtol=1e-12, atol=1e-12)


def test_non_finite_output_never_passes():
    ref = measure.Reference([0], [0], torch.ones(1, 4, 1, 2, dtype=torch.float64), None)
    bad = torch.full((1, 4, 1, 2), float("nan"))
    assert not measure.compare(ref, {"out": bad}, tol=1.0)["passed"]
    assert measure.compare(ref, {"out": torch.ones(1, 4, 1, 2)}, tol=1e-6)["passed"]
    assert not measure.compare(ref, {"out": torch.ones(1, 4, 1, 3)}, tol=1.0)["passed"]  # wrong shape


def test_do_bench_accepts_the_keywords_the_runner_passes():
    from triton.testing import do_bench

    params = inspect.signature(do_bench).parameters
    assert {"warmup", "rep", "grad_to_none"} <= set(params)
    assert "return_mode" in params or "quantiles" in params


def test_cpu_timer_resets_grads_and_returns_a_median():
    x = torch.ones(3, requires_grad=True)
    seen = []

    def fn():
        seen.append(x.grad is None)
        (x * 2).sum().backward()

    ms = measure.time_cpu_ms(fn, warmup=0.0, rep=0.0, grad_to_none=[x])
    assert ms > 0 and len(seen) >= 2 and all(seen)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"),
                    reason="Linux CPU affinity")
def test_pin_cpu_runs_every_thread_on_one_core_and_refuses_a_core_out_of_reach(tmp_path, capsys):
    """--pin-cpu CORE: every thread of the process (one started before the pinning included) and every thread
    started after it runs on CORE only, the run records it; a core the process may not use exits 2 naming the
    argument, before anything runs. The test process's affinity is put back afterwards."""
    import threading
    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    started = threading.Event()
    stop = threading.Event()
    seen = {}

    def worker(name, ready):
        seen[name] = threading.get_native_id()
        ready.set()
        stop.wait()

    before = threading.Thread(target=worker, args=("before", started))
    before.start()
    started.wait()
    try:
        out = tmp_path / "run"
        argv = ["--device", "cpu", "--providers", "eager", "--headdim", "16", "--seqlen", "32", "--causal", "false",
                "--mode", "fwd", "--warmup", "0.1", "--rep", "0.1", "--out", str(out), "--no-progress",
                "--no-plots", "--pin-cpu", str(core)]
        assert runner.run_bench(parse(argv)) == 0
        after_ready = threading.Event()
        after = threading.Thread(target=worker, args=("after", after_ready))
        after.start()
        after_ready.wait()
        for name in ("before", "after"):
            assert os.sched_getaffinity(seen[name]) == {core}, name
        assert os.sched_getaffinity(0) == {core}
        assert json.loads((out / "results.json").read_text())["environment"]["pinned_cpu"] == core
        capsys.readouterr()
        bad = max(allowed) + 4096
        assert runner.run_bench(parse(argv[:-1] + [str(bad), "--out", str(tmp_path / "x")])) == 2
        assert "--pin-cpu" in capsys.readouterr().err and not (tmp_path / "x").exists()
    finally:
        stop.set()
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), allowed)
            except ProcessLookupError:
                pass
        before.join()
        if "after" in seen:
            after.join()


def test_source_fingerprint_follows_the_code(tmp_path):
    """results.json's source_sha256: equal for equal trees, different when a .py file's content or name changes."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code")
    first = report.source_fingerprint(pkg)
    assert first == report.source_fingerprint(pkg) and len(first) == 64
    (pkg / "notes.txt").write_text("still not code")
    assert report.source_fingerprint(pkg) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    changed = report.source_fingerprint(pkg)
    assert changed != first
    (pkg / "sub" / "b.py").rename(pkg / "sub" / "c.py")
    assert report.source_fingerprint(pkg) not in (first, changed)


# ----------------------------------------------------------------------------------------------------------
# end to end
# ----------------------------------------------------------------------------------------------------------
def test_cpu_run_writes_json_markdown_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--device", "cpu", "--providers", "sdpa-math,eager", "--headdim", "16", "--seqlen", "32,64",
            "--warmup", "0.1", "--rep", "0.1", "--out", str(out), "--no-progress"]
    assert runner.run_bench(parse(argv)) == 0
    printed = capsys.readouterr().out
    assert "torch: " + torch.__version__ in printed and "sdpa-math" in printed

    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == "flashtile.bench/1" and doc["kind"] == "speed"
    env = doc["environment"]
    assert env["torch"] == torch.__version__ and env["python"] and env["date"] and env["command"]
    assert env["device"] == "cpu" and env["gpu"] == "cpu"
    assert env["source_sha256"] == report.source_fingerprint(Path(flashtile.__file__).parent)
    assert doc["settings"]["dtype"] == "bf16" and doc["settings"]["baseline"] == "sdpa-math"
    recs = doc["results"]
    assert len(recs) == 2 * 2 * 2 * 2  # providers x seqlens x masks x passes
    for r in recs:
        assert r["status"] == "ok", r
        assert r["ms"] > 0 and r["tflops"] > 0
        flops = measure.attention_flops(r["batch"], r["nheads"], r["seqlen"], r["seqlen"], r["headdim"],
                                        r["causal"], r["mode"])
        assert r["flops"] == flops
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
        assert set(r["errors"]) == ({"out"} if r["mode"] == "fwd" else {"out", "dq", "dk", "dv"})
        assert all(0 <= e < r["tol"] for e in r["errors"].values())

    md = (out / "results.md").read_text()
    assert "| headdim | seqlen | batch | nheads | sdpa-math | eager | eager / sdpa-math |" in md
    assert "### backward, causal, bf16: TFLOP/s" in md
    r_math = by(recs, provider="sdpa-math", mode="fwd", causal=True, seqlen=64)[0]
    r_eager = by(recs, provider="eager", mode="fwd", causal=True, seqlen=64)[0]
    assert f"{r_eager['tflops'] / r_math['tflops']:.2f}x" in md
    for mode in ("fwd", "bwd"):
        for mask in ("full", "causal"):
            png = out / f"tflops_{mode}_{mask}.png"
            assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


@pytest.mark.skipif(not HAS_FLASHTILE, reason="flashtile.flash_attn_func does not exist yet")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_flashtile_runs_and_passes_the_check_on_cpu(tmp_path, dtype):
    cfg = cpu_config(["flashtile", "sdpa-math"], shapes=[Shape(1, 2, 64, 32)], causals=(True,),
                     baseline="sdpa-math", compare=["flashtile"], dtype=dtype)
    result = runner.run_speed(cfg, progress=False)
    mine = by(result["results"], provider="flashtile")
    assert [r["mode"] for r in mine] == ["fwd", "bwd"]
    for r in mine:
        assert r["status"] == "ok", r
        assert r["tflops"] > 0 and max(r["errors"].values()) < r["tol"]
    assert all(r["status"] == "ok" for r in by(result["results"], provider="sdpa-math"))
    report.write_report(result, tmp_path, plots=False)
    assert "flashtile / sdpa-math" in (tmp_path / "results.md").read_text()


def _registry_with(**extra):
    reg = {"sdpa-math": providers.PROVIDERS["sdpa-math"], "fa4": providers.PROVIDERS["fa4"]}
    for name, factory in extra.items():
        providers.register_provider(name, layout="bhsd", devices=("cpu",), registry=reg)(factory)
    return reg


def _math(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _math_bshd(device, dtype):
    return lambda q, k, v, causal: _math(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         causal).transpose(1, 2)


def test_each_provider_gets_its_own_inputs_in_its_layout():
    reg = {}
    providers.register_provider("bshd-1", layout="bshd", devices=("cpu",), registry=reg)(_math_bshd)
    providers.register_provider("bshd-2", layout="bshd", devices=("cpu",), registry=reg)(_math_bshd)
    reg["sdpa-math"] = providers.PROVIDERS["sdpa-math"]
    result = runner.run_speed(cpu_config(list(reg), causals=(True,)), registry=reg, progress=False)
    for r in result["results"]:  # gradients accumulated across providers would fail the bwd check
        assert r["status"] == "ok", r
        assert max(r["errors"].values()) < 5e-3


def test_a_provider_may_carry_its_own_tolerance():
    reg = {}

    def off_by_3_percent(device, dtype):
        return lambda q, k, v, causal: _math(q, k, v, causal) * 1.03

    providers.register_provider("strict", layout="bhsd", devices=("cpu",), registry=reg)(off_by_3_percent)
    providers.register_provider("lenient", layout="bhsd", devices=("cpu",), tolerance=5e-2,
                                registry=reg)(off_by_3_percent)
    result = runner.run_speed(cpu_config(list(reg), causals=(False,), modes=("fwd",)), registry=reg,
                              progress=False)
    (strict,) = by(result["results"], provider="strict")
    (lenient,) = by(result["results"], provider="lenient")
    assert strict["status"] == "wrong" and strict["tol"] == 2e-2
    assert lenient["status"] == "ok" and lenient["tol"] == 5e-2


def test_wrong_provider_is_flagged_and_not_timed(tmp_path):
    calls = {"wrong-out": 0, "wrong-grad": 0}

    def wrong_out(device, dtype):
        def attn(q, k, v, causal):
            calls["wrong-out"] += 1
            return _math(q, k, v, causal) * 1.1  # 10% off: above the 2e-2 tolerance
        return attn

    def wrong_grad(device, dtype):
        def attn(q, k, v, causal):
            calls["wrong-grad"] += 1
            o = _math(q, k, v, causal)
            return o + 0.5 * (o - o.detach())  # right values, gradients 1.5x
        return attn

    reg = _registry_with(**{"wrong-out": wrong_out, "wrong-grad": wrong_grad})
    cfg = cpu_config(["sdpa-math", "wrong-out", "wrong-grad"])
    result = runner.run_speed(cfg, registry=reg, progress=False)
    recs = result["results"]

    for r in by(recs, provider="wrong-out"):
        assert r["status"] == "wrong" and r["ms"] is None and r["tflops"] is None
        assert r["errors"]["out"] > r["tol"]
    assert calls["wrong-out"] == 2  # one checking call per mask, never timed

    for r in by(recs, provider="wrong-grad", mode="fwd"):
        assert r["status"] == "ok" and r["errors"]["out"] < r["tol"]  # the forward is right, so it is timed
    for r in by(recs, provider="wrong-grad", mode="bwd"):
        assert r["status"] == "wrong" and r["ms"] is None
        assert r["errors"]["dq"] == pytest.approx(0.5, rel=0.05)
    assert all(r["status"] == "ok" for r in by(recs, provider="sdpa-math"))

    report.write_report(result, tmp_path, plots=False)
    md = (tmp_path / "results.md").read_text()
    assert "**wrong-out** wrong in 4 case(s)" in md and "| wrong |" in md


def test_unusable_providers_are_skipped_with_reasons_and_the_run_goes_on(tmp_path):
    def missing(device, dtype):
        import flashtile_no_such_package  # noqa: F401

    def refuses(device, dtype):
        def attn(q, k, v, causal):
            raise RuntimeError("head dim 16 is not supported")
        return attn

    def ooms(device, dtype):
        def attn(q, k, v, causal):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return attn

    def no_backward(device, dtype):
        class Fwd(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                return _math(q, k, v, False)

            @staticmethod
            def backward(ctx, do):
                raise NotImplementedError("backward not implemented")

        return lambda q, k, v, causal: Fwd.apply(q, k, v) if not causal else _math(q, k, v, True)

    reg = _registry_with(missing=missing, refuses=refuses, ooms=ooms, **{"no-backward": no_backward})
    cfg = cpu_config(list(reg), causals=(False,))
    result = runner.run_speed(cfg, registry=reg, progress=False)
    recs = result["results"]

    def only(name, mode):
        (r,) = by(recs, provider=name, mode=mode)
        return r

    for mode in ("fwd", "bwd"):
        assert only("sdpa-math", mode)["status"] == "ok"
        assert only("missing", mode)["status"] == "skipped"
        assert "flashtile_no_such_package" in only("missing", mode)["reason"]
        assert only("fa4", mode)["status"] == "skipped" and "cuda" in only("fa4", mode)["reason"]
        assert only("refuses", mode)["status"] == "skipped"
        assert "head dim 16 is not supported" in only("refuses", mode)["reason"]
        assert only("ooms", mode)["status"] == "oom"
        for name in ("missing", "fa4", "refuses", "ooms"):
            assert only(name, mode)["ms"] is None
    assert only("no-backward", "fwd")["status"] == "ok"
    assert only("no-backward", "bwd")["status"] == "skipped"
    assert "backward not implemented" in only("no-backward", "bwd")["reason"]
    assert result["providers"]["missing"]["status"] == "unavailable"

    paths = report.write_report(result, tmp_path)
    assert {p.name for p in paths} >= {"results.json", "results.md", "tflops_fwd_full.png"}
    md = (tmp_path / "results.md").read_text()
    assert "| skip |" in md and "| oom |" in md
    assert "**refuses** skipped in 2 case(s): first call: RuntimeError: head dim 16 is not supported" in md


def test_memory_mode_records_peaks_and_ooms(tmp_path):
    class FakeProbe:  # CPU stand-in for CudaMemoryProbe: the real one needs CUDA
        def __init__(self):
            self.base, self.resets = 1000, 0

        def reset(self):
            self.resets += 1
            return self.base

        def peak(self):
            return self.base + 500 * self.resets

        def release(self):
            pass

    def ooms(device, dtype):
        def attn(q, k, v, causal):
            if q.shape[-2] > 32:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return _math(q, k, v, causal)
        return attn

    reg = _registry_with(ooms=ooms)
    cfg = cpu_config(list(reg), shapes=runner.derive_shapes([16], [32, 64], batch=1, nheads=2), causals=(False,))
    probe = FakeProbe()
    result = runner.run_memory(cfg, registry=reg, probe=probe, progress=False)
    recs = result["results"]
    assert result["kind"] == "memory" and len(recs) == 2 * 3
    ok = [r for r in recs if r["status"] == "ok"]
    assert len(ok) == 3 and probe.resets == 3  # the peak is reset once per measurement, after the warm-up
    for r in ok:
        assert r["peak_bytes"] > r["base_bytes"] == 1000 and r["extra_bytes"] == r["peak_bytes"] - 1000
    assert by(recs, provider="ooms", seqlen=64)[0]["status"] == "oom"
    assert by(recs, provider="fa4", seqlen=32)[0]["status"] == "skipped"

    report.write_report(result, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "peak memory of forward + backward" in md and "| oom |" in md
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="CUDA"):
        measure.CudaMemoryProbe("cpu")


def test_json_is_strict_even_with_nan_errors(tmp_path):
    result = {"kind": "speed", "settings": {}, "providers": {},
              "results": [{"errors": {"out": float("nan"), "dq": float("inf")}}]}
    path = report.write_json(result, tmp_path / "r.json")
    doc = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert doc["results"][0]["errors"] == {"out": "nan", "dq": "inf"}


def test_default_out_dir_is_gpu_and_date_and_never_overwrites(tmp_path):
    env = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-21T10:00:00+00:00"}
    first = report.default_out_dir(env, root=tmp_path)
    assert first == tmp_path / "NVIDIA-H100-80GB-HBM3-2026-11-21"
    first.mkdir()
    (first / "results.json").write_text("{}")
    assert report.default_out_dir(env, root=tmp_path) == tmp_path / "NVIDIA-H100-80GB-HBM3-2026-11-21-2"


@pytest.mark.skipif(not HAS_FLASHTILE, reason="flashtile.flash_attn_func does not exist yet")
def test_train_mode_times_forward_and_backward_in_one_call(tmp_path):
    """--mode train: one timed call of attn(q, k, v).backward(do), checked like the backward, 3.5x the forward's
    FLOPs, in its own report section."""
    cfg = dataclasses.replace(cpu_config(["flashtile", "sdpa-math"], shapes=[Shape(1, 2, 64, 32)], causals=(True,),
                                         baseline="sdpa-math", compare=["flashtile"]), modes=("fwd", "bwd", "train"))
    result = runner.run_speed(cfg, progress=False)
    for name in ("flashtile", "sdpa-math"):
        recs = by(result["results"], provider=name)
        assert [r["mode"] for r in recs] == ["fwd", "bwd", "train"]
        assert all(r["status"] == "ok" and r["ms"] > 0 for r in recs), recs
        fwd, train = recs[0], recs[2]
        assert train["flops"] == 3.5 * fwd["flops"] and set(train["errors"]) == {"out", "dq", "dk", "dv"}
    report.write_report(result, tmp_path, plots=False)
    assert "### training step (forward + backward), causal" in (tmp_path / "results.md").read_text()
    args = runner.add_bench_arguments(argparse.ArgumentParser()).parse_args(["--device", "cpu", "--mode", "all"])
    assert runner.build_config(args)[0].modes == ("fwd", "bwd", "train")
    # the training step alone (the reference then has gradients too)
    only = runner.run_speed(dataclasses.replace(cfg, modes=("train",), providers=["flashtile"]), progress=False)
    assert [(r["mode"], r["status"]) for r in only["results"]] == [("train", "ok")]

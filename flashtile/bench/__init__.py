"""flashtile.bench: time flashtile against every attention implementation present, in one process and one run.

    python -m flashtile.cli bench --headdim 128 --seqlen 8k --batch 2 --nheads 16 --providers flashtile,cudnn

- providers.py: the registry (name -> factory), one function per provider; register_provider adds one.
- measure.py:   FLOP formula, inputs, float64 correctness check, timers (do_bench / perf_counter), memory probe.
- runner.py:    grid, the (case x provider) loop for speed and memory, CLI arguments (add_bench_arguments,
                run_bench).
- report.py:    environment, results.json, results.md, PNG plots, console summary.
"""
from flashtile.bench.measure import TOLERANCE, attention_flops, tflops_per_s
from flashtile.bench.providers import PROVIDERS, Provider, ProviderUnavailable, register_provider, resolve_names
from flashtile.bench.report import collect_environment, write_report
from flashtile.bench.runner import (BenchConfig, Shape, add_bench_arguments, build_config, derive_shapes, fa3_grid,
                                    run_bench, run_memory, run_speed)

__all__ = ["TOLERANCE", "attention_flops", "tflops_per_s", "PROVIDERS", "Provider", "ProviderUnavailable",
           "register_provider", "resolve_names", "collect_environment", "write_report", "BenchConfig", "Shape",
           "add_bench_arguments", "build_config", "derive_shapes", "fa3_grid", "run_bench", "run_memory",
           "run_speed"]

"""The `flashtile` command: demo (the main job), bench, io, info."""
from __future__ import annotations

import argparse
import json
import sys


def _info(args) -> int:
    import platform

    import torch
    info = {"flashtile": __import__("flashtile").__version__, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version())
        info["backend"] = "triton (compiled)"
    else:
        info["device"] = "cpu"
        info["backend"] = "triton interpreter (TRITON_INTERPRET=1): exact, slow; for tests and CPU runs"
    try:
        from .bench.providers import available_providers
        info["peers"] = available_providers()
    except Exception as e:  # noqa: BLE001 - info must never crash
        info["peers"] = f"unavailable: {e}"
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        for k, v in info.items():
            print(f"{k:16s} {v}")
    return 0


def _demo(args) -> int:
    from .demo import run_demo
    report = run_demo()
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    return 0 if report["ok"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashtile", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="check against the float64 reference, compare with SDPA and standard "
                                    "attention, print the IO-model summary")
    p.add_argument("--json", action="store_true", help="also print the report as JSON")
    p.set_defaults(fn=_demo)
    p = sub.add_parser("info", help="versions, device, usable backends and peers")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_info)
    try:
        from .bench.runner import add_bench_arguments, run_bench
        p = sub.add_parser("bench", help="benchmark flashtile against every available peer")
        add_bench_arguments(p)
        p.set_defaults(fn=run_bench)
    except ImportError:
        pass
    try:
        from .io_report import add_io_arguments, run_io_cli
        p = sub.add_parser("io", help="HBM-access model: standard attention vs FlashAttention-1/2")
        add_io_arguments(p)
        p.set_defaults(fn=run_io_cli)
    except ImportError:
        pass
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

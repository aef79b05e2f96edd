"""The `flashtile` command: demo (the main job), bench, io, info."""
from __future__ import annotations

import argparse
import importlib
import json
import sys


def collect_info() -> dict:
    """What `flashtile info` reports: versions, the device, the backends flashtile runs on it, which optional Triton
    features are present (kernels/support.py) and which benchmark peers run here (bench.providers)."""
    import os
    import platform

    import torch

    import flashtile
    from .bench.providers import available_providers
    from .kernels import support
    from .kernels.gluon import fa3

    info = {"flashtile": flashtile.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "triton": support.triton.__version__, "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cuda_version=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    else:
        info.update(device="cpu", cpu_count=os.cpu_count())
    # the kernels flashtile runs here, in the order it tries them
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        backends = ["triton-interpreter"]   # what `import flashtile` turns on without a CUDA device
    else:
        backends = (["gluon-fa3"] if fa3.enabled() and fa3._kernels(0) is not None else []) + ["triton"]
    info["backends"] = backends
    info["triton_features"] = dict(support.FEATURES)
    info["peers"] = {name: {k: p[k] for k in ("available", "importable", "reason")}
                     for name, p in available_providers().items()}
    return info


_BACKENDS = {"triton-interpreter": "Triton kernels on CPU tensors through the interpreter (exact, slow)",
             "triton": "Triton kernels, compiled", "gluon-fa3": "FlashAttention-3's Gluon kernels (Hopper)"}


def _info(args) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key, val in info.items():
        if key == "backends":
            val = "; ".join(f"{b}: {_BACKENDS[b]}" for b in val)
        elif key == "triton_features":
            val = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in val.items())
        elif key == "peers":
            print(f"{'peers':16s} {sum(p['available'] for p in val.values())} of {len(val)} run here")
            for name, p in val.items():
                print(f"  {name:16s} {'available' if p['available'] else 'no: ' + p['reason']}")
            continue
        print(f"{key:16s} {val}")
    return 0


def _demo(args) -> int:
    from .demo import run_demo
    # --json: stdout carries the JSON document alone, so the human account goes to stderr
    report = run_demo(file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    return 0 if report["ok"] else 1


# (name, help, module, its add-arguments function, its run function) of the subcommands left out where their module
# cannot be imported
_OPTIONAL_COMMANDS = (
    ("bench", "benchmark flashtile against every available peer", ".bench.runner", "add_bench_arguments", "run_bench"),
    ("io", "HBM-access model: standard attention vs FlashAttention-1/2", ".io_report", "add_io_arguments",
     "run_io_cli"),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashtile", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="check against the float64 reference, compare with SDPA and standard "
                                    "attention, print the IO-model summary")
    p.add_argument("--json", action="store_true",
                   help="print the report as one JSON document on stdout (the human account goes to stderr)")
    p.set_defaults(fn=_demo)
    p = sub.add_parser("info", help="versions, device, usable backends and peers")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document instead")
    p.set_defaults(fn=_info)
    for name, help_, module, add_arguments, run in _OPTIONAL_COMMANDS:
        try:
            mod = importlib.import_module(module, __package__)
        except ImportError:
            continue
        p = sub.add_parser(name, help=help_)
        getattr(mod, add_arguments)(p)
        p.set_defaults(fn=getattr(mod, run))
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/ and examples/ scripts in tests: they are files, not a package, so a test loads the one it checks by
path."""
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def load_script(path: Path):
    """The script at path as a module named after its file (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_module(name: str):
    """For a module-scoped fixture (`yield from script_module("bench_flex")`): benchmarks/<name>.py as a module,
    registered in sys.modules while the tests use it (dataclasses look their module up), with torch on one thread
    (on 2 cores torch's thread pool spins against the Triton interpreter's work)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(module)
        torch.set_num_threads(1)
        yield module
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop(name, None)

"""Stand-ins for launching compiled kernels without a GPU: a kernel whose launches are recorded (Triton's dispatch,
and relaunch's direct calls of the compiled kernel), and relaunch's fast path switched on around it."""
import inspect

import torch

from flashtile.kernels import relaunch


def fast_launches(monkeypatch) -> list:
    """relaunch's fast path on, as on a CUDA machine (device 0, stream 7), with no compiled kernel remembered.
    Returns a list that records each relaunch.launch call (a template's launch makes none)."""
    calls = []
    real = relaunch.launch
    monkeypatch.setattr(relaunch, "launch", lambda *a: calls.append(a[0]) or real(*a))
    monkeypatch.setattr(relaunch, "_COMPILED", {})
    monkeypatch.setattr(relaunch, "_compiles", lambda k: True)
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", True)
    monkeypatch.setattr(relaunch, "BIND", True)
    monkeypatch.setattr(relaunch, "current_device", lambda: 0)
    monkeypatch.setattr(relaunch, "raw_stream", lambda device: 7)
    return calls


class StandInKernel:
    """A JIT kernel's surface (its parameters) with launches recorded instead of run: [grid](*args, **kwargs) is
    Triton's dispatch (recorded as "dispatch"), and the compiled kernel it returns records relaunch's direct calls
    ("run": grid and every argument in parameter order)."""

    def __init__(self, real):
        fn = getattr(real, "fn", real)
        self.signature = inspect.signature(fn)
        self.arg_names = list(self.signature.parameters)
        self.constexprs = [i for i, p in enumerate(self.signature.parameters.values())
                           if "constexpr" in str(p.annotation)]
        self.calls = []
        calls = self.calls

        class Compiled:
            function, packed_metadata = "fn", "meta"

            def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *a):
                calls.append(("run", (gx, gy, gz), a))

        self.compiled = Compiled()

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append(("dispatch", grid, a, kw)) or self.compiled


def same_arguments(a, b, shared=()):
    """Two launches' argument lists agree: equal values, tensors of the same geometry and dtype (outputs, split
    partials and accumulators are allocated per call), the same object where either is one of `shared` (tensors
    both calls were given), TMA descriptors with the same fields over such tensors."""
    assert len(a) == len(b)
    shared = {id(t) for t in shared}
    for i, (x, y) in enumerate(zip(a, b)):
        if hasattr(x, "block_shape"):
            # (a template's descriptors are runtime.DescriptorType's: their geometry is held by their class)
            kind = lambda d: getattr(d, "descriptor_class", type(d))   # noqa: E731
            fields = lambda d: {n: getattr(d, n) for n in ("shape", "strides", "block_shape", "layout", "padding")  # noqa: E731
                                if hasattr(d, n)}
            assert kind(x) is kind(y) and fields(x) == fields(y), i
            x, y = x.base, y.base
        if isinstance(x, torch.Tensor):
            assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype), i
            assert x is y or not {id(x), id(y)} & shared, i
        else:
            assert type(x) is type(y) and x == y, (i, x, y)

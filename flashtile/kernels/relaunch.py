"""Launching a compiled Triton / Gluon kernel again without Triton's JIT dispatch (host time).

`kernel[grid](*args, **kwargs)` binds the arguments, specializes each one and builds the cache key before it finds
the compiled kernel, then builds launch-hook metadata and looks up the device and stream: tens of microseconds of
Python per launch, as much as the GPU time of a small attention call's kernels. launch() keys the compiled kernel on a superset of what Triton specializes on (per tensor its dtype and
16-byte alignment; per int whether it is 1, a multiple of 16 and within int32; per TMA descriptor its dtype, block,
layout and padding; tuples element by element; every constexpr and launch option by value) and calls it directly
the next time with the same arguments in parameter order (CompiledKernel[grid], the call Triton's dispatch ends
with, minus its launch-hook metadata when no hook is registered). A key not seen goes through kernel[grid], which
compiles the kernel or finds it in Triton's cache, and so does everything under the interpreter. Changing Triton's
debug / instrumentation knobs after a first launch is not seen. FLASHTILE_FAST_LAUNCH=0 (or FAST_LAUNCH = False)
turns it off.

A caller that launches one problem again and again (a decode loop, a training step) goes further: bind() returns the
compiled kernel bound to every argument but the leading live ones (Bound), whose call checks only the live
arguments' keys; the caller keys its Bounds on a signature of its own that fixes the rest (Bounds, or the
templates of decode.py and gluon/fa3.py). FLASHTILE_BIND=0 (or BIND = False) turns bind() off.

A Bound also skips the Python layers of Triton's launcher where it knows them (_Direct: Triton 3.6's CudaLauncher):
the C launch function is called with the bound arguments already expanded as the launcher would expand them, and a
TMA descriptor's expansion (its encoded CUtensorMap, shape and strides) is kept per base address for descriptors of
one geometry. FLASHTILE_DIRECT_LAUNCH=0 (or DIRECT = False) turns it off.
"""
from __future__ import annotations

import inspect
import operator
import os
import sys
import types
from typing import Optional

import torch
from triton.runtime.jit import JITFunction

from .support import knobs as _knobs

# a Triton without triton.knobs (< 3.4) keeps its launch hooks elsewhere: no fast path there (support.py)
FAST_LAUNCH = _knobs is not None and os.environ.get("FLASHTILE_FAST_LAUNCH", "1") != "0"
# bind() on: callers keep launch templates (Bound); off (FLASHTILE_BIND=0), every call goes through launch()
BIND = _knobs is not None and os.environ.get("FLASHTILE_BIND", "1") != "0"
# Bounds call the C launch function directly where the launcher is one _Direct knows (FLASHTILE_DIRECT_LAUNCH=0: off)
DIRECT = os.environ.get("FLASHTILE_DIRECT_LAUNCH", "1") != "0"
# key -> compiled kernel
_COMPILED: dict = {}
_MAX_ENTRIES = 4096
_INT32 = 2 ** 31
# the current device and its current stream's raw handle, as Triton's driver reads them (the C calls underneath
# torch.cuda.current_device / current_stream; a CPU-only torch has neither, and never takes the fast path)
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
raw_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
              or (lambda index: torch.cuda.current_stream(index).cuda_stream))


def _arg_key(x):
    """What Triton's specialization of a runtime argument depends on (a superset)."""
    t = type(x)
    if t is int:
        return int, x == 1, x % 16 == 0, -_INT32 <= x < _INT32
    if t is torch.Tensor:   # (_args_key spells this and the int case out inline: keep them the same)
        return x.dtype, x.data_ptr() % 16 == 0
    if x is None or t is float or t is bool:
        return t, x if t is bool else None
    if t is tuple:
        return tuple(map(_arg_key, x))
    if hasattr(x, "block_shape"):   # a TMA descriptor (triton.tools' or Gluon's; runtime.DescriptorType's as its class)
        return (getattr(x, "descriptor_class", t), x.base.dtype, tuple(x.block_shape), getattr(x, "layout", None),
                x.padding)
    return t, x   # anything else by value (must be hashable)


# int -> its _arg_key (a launch passes the same strides and sizes call after call); at most _MAX_ENTRIES of them
_INT_KEYS: dict = {}


def _int_key(x: int):
    k = _INT_KEYS.get(x)
    if k is None:
        k = _arg_key(x)
        if len(_INT_KEYS) < _MAX_ENTRIES:
            _INT_KEYS[x] = k
    return k


# (tuple of ints, floats, bools and Nones, its elements' types) -> its _arg_key: a kernel's argument groups of
# strides, sizes and scalars repeat call after call (the types in the key: True == 1 == 1.0 as dict keys); at most
# _MAX_ENTRIES of them
_TUPLE_KEYS: dict = {}
_SCALARS = frozenset((int, float, bool, type(None)))


def _tuple_key(a: tuple, types: tuple):
    k = _args_key(a)
    if len(_TUPLE_KEYS) < _MAX_ENTRIES and _SCALARS.issuperset(types):
        _TUPLE_KEYS[(a, types)] = k
    return k


_NONE_KEY = _arg_key(None)


def _args_key(args) -> tuple:
    """tuple(map(_arg_key, args)) with tuples (argument groups: from _TUPLE_KEYS where they hold scalars only, else
    element by element), ints (from _INT_KEYS), tensors and None inline: a launch passes tens of arguments, and a
    call per argument showed in its host time."""
    T = torch.Tensor
    return tuple([(_TUPLE_KEYS.get((a, types := tuple(map(type, a)))) or _tuple_key(a, types))
                  if type(a) is tuple else
                  (_INT_KEYS.get(a) or _int_key(a)) if type(a) is int else
                  (a.dtype, a.data_ptr() % 16 == 0) if type(a) is T else
                  _NONE_KEY if a is None else _arg_key(a) for a in args])


def _compiles(kernel) -> bool:
    """Whether kernel[grid] compiles and returns a CompiledKernel: a JIT function (not the interpreter's) with a
    CUDA device present."""
    return isinstance(kernel, JITFunction) and torch.cuda.is_available()


def _param_info(kernel):
    """(names of the parameters, which are constexpr, their defaults, call plans) of a JIT function, cached on it;
    None for a kernel that is no compiled JIT function (the interpreter's) or without a CUDA device."""
    info = getattr(kernel, "_flashtile_params", False)
    if info is False:
        info = None
        if _compiles(kernel):
            params = list(kernel.signature.parameters.values())
            names = tuple(p.name for p in params)
            constexpr = frozenset(kernel.arg_names[i] for i in kernel.constexprs)
            defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
            info = (names, constexpr, defaults, {})
        kernel._flashtile_params = info
    return info


def _plan(info, n_args: int, kwarg_names: tuple):
    """How a call with n_args positional arguments and these keyword names maps onto the kernel's parameters:
    getters (dict -> tuple) of the values of the parameters after the positional ones, of their runtime and
    constexpr subsets and of the launch options, and the defaults to fill in; or None when a parameter has no
    value (Triton's binder reports it). Cached per call shape."""
    names, constexpr, defaults, plans = info
    key = (n_args, kwarg_names)
    plan = plans.get(key, False)
    if plan is False:
        rest = names[n_args:]
        given = set(kwarg_names)
        plan = None
        if all(n in given or n in defaults for n in rest):
            fill = {n: defaults[n] for n in rest if n not in given}
            plan = (_getter(rest), _getter([n for n in rest if n not in constexpr]),
                    _getter([n for n in rest if n in constexpr]), _getter([k for k in kwarg_names if k not in names]),
                    fill)
        plans[key] = plan
    return plan


def _getter(keys):
    """A function of a dict returning the tuple of its values at these keys (operator.itemgetter, always a tuple)."""
    if len(keys) == 1:
        key = keys[0]
        return lambda d: (d[key], )
    return operator.itemgetter(*keys) if keys else (lambda d: ())


def _lookup(kernel, args: tuple, kwargs: dict):
    """(key, values of the parameters after the positional ones, the key's compiled kernel or None) of a launch, or
    None where there is no fast path (FAST_LAUNCH off, no compiled JIT function, a parameter without a value, an
    unhashable value)."""
    info = _param_info(kernel) if FAST_LAUNCH else None
    plan = _plan(info, len(args), tuple(kwargs)) if info is not None else None
    if plan is None:
        return None
    rest, runtime, consts, options, fill = plan
    merged = {**kwargs, **fill} if fill else kwargs
    try:
        key = (kernel, current_device(), _args_key(args), _args_key(runtime(merged)), consts(merged),
               options(kwargs))
        entry = _COMPILED.get(key)
    except TypeError:   # an unhashable value
        return None
    return key, rest(merged), entry


def launch(kernel, grid, args: tuple, kwargs: dict):
    """kernel[grid](*args, **kwargs), through the compiled kernel directly when this key was launched before.
    args: the first parameters in order; kwargs: the rest (constexpr or not, parameters with defaults may be left
    out) and the launch options (num_warps, num_stages, maxnreg, ...). Returns the launch's key (what bind() of the
    same arguments looks up otherwise: pass it on), or None where there is no fast path."""
    found = _lookup(kernel, args, kwargs)
    if found is None:
        kernel[grid](*args, **kwargs)
        return None
    key, rest, entry = found
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "run") and not hasattr(compiled, "result") and len(_COMPILED) < _MAX_ENTRIES:
            _COMPILED[key] = compiled
        return key, rest
    g = (*grid, 1, 1)
    if _no_launch_hooks():
        # what CompiledKernel[grid](...) does, less the launch-hook metadata it builds for every launch (Triton 3.6
        # keeps empty hook chains, never None) and its device / stream lookups
        entry.run(g[0], g[1], g[2], raw_stream(key[1]), entry.function, entry.packed_metadata, None, None, None,
                  *args, *rest)
    else:
        entry[g[:3]](*args, *rest)
    return key, rest


class Bound:
    """A compiled kernel with its arguments after the first n_live fixed (bind): a caller that launches one kernel
    with the same arguments call after call but for a few tensors (a decode step's q, outputs and cache) skips
    launch()'s key over every argument and its parameter plan. Calling it checks the live arguments' keys (dtype
    and 16-byte alignment of a tensor, a descriptor's block...) and the device against those it was bound with."""
    __slots__ = ("entry", "device", "live_key", "tail", "direct", "checked_keys")

    def __init__(self, entry, device, live_key, tail, direct=None):
        self.entry, self.device, self.live_key, self.tail, self.direct = entry, device, live_key, tail, direct
        self.checked_keys = {}   # checked positions -> the bound live key at them

    def __call__(self, grid, live: tuple, checked: Optional[tuple] = None) -> bool:
        """Launch on grid (three ints) with these live arguments; False (nothing launched) where they or the device
        differ from the bound ones or a launch hook is registered: the caller then goes through launch().
        checked: the positions of the live arguments whose keys are checked (None: all); the caller vouches for
        the others, having made them with the bound ones' keys: TMA descriptors from the bound descriptors' fields
        (costly to key), outputs and scratch it allocated itself in the bound dtypes (fresh allocations are
        16-byte aligned). A tensor the caller was handed is always checked: its key is a call's cost."""
        if checked is None:
            same = _args_key(live) == self.live_key
        else:
            bound_key = self.checked_keys.get(checked)
            if bound_key is None:
                bound_key = self.checked_keys[checked] = tuple(self.live_key[i] for i in checked)
            same = _args_key([live[i] for i in checked]) == bound_key
        if not same or current_device() != self.device or not _no_launch_hooks():
            return False
        if self.direct is not None:
            self.direct(grid, live, raw_stream(self.device))
            return True
        e = self.entry
        e.run(grid[0], grid[1], grid[2], raw_stream(self.device), e.function, e.packed_metadata, None, None, None,
              *live, *self.tail)
        return True


# --------------------------------------------------------------------------------------------------
# The launcher underneath CompiledKernel.run, called directly (Triton 3.6's CudaLauncher)
# --------------------------------------------------------------------------------------------------
# CudaLauncher.__call__(gx, gy, gz, stream, function, *args) allocates the kernel's scratch buffers (none for
# flashtile's kernels) and calls its `launch`: the C launch function itself when the kernel takes no TMA descriptor,
# else a Python closure (driver.wrap_handle_tensordesc's `inner`, over `launcher`, `tensordesc_indices` and
# `tensordesc_meta`) that walks every argument and expands each descriptor into the C function's arguments
# (driver.make_tensordesc_arg: its CUtensorMap, encoded by the driver, then its shape and strides). Those layers
# cost about as much host time as the C launch itself. The C function's leading arguments: grid x, y, z, stream,
# function, cooperative-grid and PDL flags, global and profile scratch, packed metadata, launch metadata and the
# two launch hooks (driver._BASE_ARGS_FORMAT).
_INNER_FREEVARS = ("launcher", "tensordesc_indices", "tensordesc_meta")
_BASE_ARGS = 13
_TMA_MAPS_MAX = 256   # expansions kept per descriptor parameter of a Bound (base addresses a loop cycles through)


class _DescriptorSlot:
    """A TMA-descriptor parameter of a direct launch: expand(desc, meta) (the launcher's make_tensordesc_arg) of each
    descriptor passed there, kept per base address for descriptors of a runtime.DescriptorType (whose class fixes
    every field but the base) where the kernel has TMA metadata (meta): a repeated launch over the same tensors
    encodes no CUtensorMap. A tensor freed and another allocated at its address with the same geometry is described
    by the same map (it holds the address, shape, strides, box and swizzle, no reference to the tensor)."""
    __slots__ = ("expand", "meta", "maps")

    def __init__(self, expand, meta):
        self.expand, self.meta, self.maps = expand, meta, {}

    def __call__(self, desc) -> list:
        if self.meta is None or getattr(type(desc), "descriptor_class", None) is None:
            # (without the kernel's TMA metadata the launcher passes the base tensor itself: nothing to keep, and a
            # kept expansion would keep its tensor alive)
            return self.expand(desc, self.meta)
        key = (desc.base.data_ptr(), type(desc))
        args = self.maps.get(key)
        if args is None:
            args = self.expand(desc, self.meta)
            remember(self.maps, key, args, _TMA_MAPS_MAX)
        return args


class _Direct:
    """entry.run(grid, stream, function, packed metadata, no hooks, *live, *tail) without the launcher's Python
    layers: the C launch function called with the tail expanded once and the live descriptors through their
    _DescriptorSlot. Made by _direct only where it reproduces the launcher's arguments exactly."""
    __slots__ = ("c_launch", "function", "flags", "packed", "live_slots", "tail")

    def __init__(self, entry, c_launch, live_slots, tail):
        run = entry.run
        self.c_launch, self.function, self.packed = c_launch, entry.function, entry.packed_metadata
        self.flags = (run.launch_cooperative_grid, run.launch_pdl)
        self.live_slots, self.tail = live_slots, tail

    def expand(self, live: tuple) -> list:
        """The C function's kernel arguments: live's, each descriptor expanded, then the expanded tail."""
        args, start = [], 0
        for i, slot in self.live_slots:
            args += live[start:i]
            args += slot(live[i])
            start = i + 1
        args += live[start:]
        args += self.tail
        return args

    def __call__(self, grid, live: tuple, stream: int) -> None:
        self.c_launch(grid[0], grid[1], grid[2], stream, self.function, *self.flags, None, None, self.packed, None,
                      None, None, *self.expand(live))


def _direct(entry, live: tuple, tail: tuple):
    """A _Direct for launches of entry (a CompiledKernel) with live arguments like `live` and this tail, or None
    where the launcher is not the one it knows (another Triton, scratch buffers, clusters) or DIRECT is off. Checked
    once here: the launcher's own `inner`, rebuilt over a recording stand-in for the C function, must expand these
    arguments into the same list."""
    run = getattr(entry, "run", None)
    if not (DIRECT and type(run).__name__ == "CudaLauncher" and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0 and getattr(run, "num_ctas", 0) == 1):
        return None
    launch = run.launch
    if isinstance(launch, types.BuiltinFunctionType):   # no descriptor parameter: the C function itself
        return _Direct(entry, launch, (), tuple(tail))
    code = getattr(launch, "__code__", None)
    driver = sys.modules.get(getattr(launch, "__module__", None) or "")
    if (code is None or code.co_freevars != _INNER_FREEVARS or driver is None
            or getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != _BASE_ARGS
            or not callable(getattr(driver, "make_tensordesc_arg", None))):
        return None
    c_launch, indices, metas = (cell.cell_contents for cell in launch.__closure__)
    metas = list(metas) if metas else [None] * len(indices)
    ordinal = {i: n for n, i in enumerate(sorted(indices))}
    expand = driver.make_tensordesc_arg
    slots = {i: _DescriptorSlot(expand, metas[ordinal[i]]) for i in indices}
    expanded_tail = []
    for i, a in enumerate(tail, start=len(live)):
        expanded_tail += slots[i](a) if i in slots else [a]
    direct = _Direct(entry, c_launch, tuple((i, slots[i]) for i in sorted(indices) if i < len(live)),
                     tuple(expanded_tail))
    # the launcher's own expansion of the same arguments, into a recorder
    seen = []
    recorder = types.FunctionType(code, launch.__globals__, code.co_name, launch.__defaults__,
                                  tuple(types.CellType(c) for c in (lambda *a: seen.append(a), indices, metas)))
    recorder(*range(_BASE_ARGS), *live, *tail)
    if not seen or not _same_arguments(seen[0][_BASE_ARGS:], direct.expand(live)):
        return None
    return direct


def _same_arguments(a, b) -> bool:
    """Two expansions agree: equal but for the encoded CUtensorMaps (fresh objects each), which must be in the same
    places."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if type(x).__name__ == "PyCUtensorMap" or type(y).__name__ == "PyCUtensorMap":
            if type(x) is not type(y):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is not y:
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def bind(kernel, args: tuple, kwargs: dict, n_live: int, launched=None):
    """A Bound for launches of kernel with these arguments but for args[:n_live], after launch(kernel, grid, args,
    kwargs) compiled it; None where launch() has no fast path for them (the interpreter, no CUDA device, a key not
    compiled, BIND off). launched: what that launch() returned (its key, not looked up again; None: look it up).
    The caller vouches that nothing it binds (args[n_live:], kwargs) changes while it uses the Bound."""
    if not (BIND and _compiles(kernel)):
        return None
    if launched is None:
        found = _lookup(kernel, args, kwargs)
        if found is None:
            return None
        key, rest, entry = found
    else:
        key, rest = launched
        entry = _COMPILED.get(key)
    if entry is None:
        return None
    tail = (*args[n_live:], *rest)
    return Bound(entry, key[1], _args_key(args[:n_live]), tail, _direct(entry, args[:n_live], tail))


TEMPLATES_MAX = 256   # entries per call site's memo of launch templates (remember)


def remember(memo: dict, key, value, limit: int = TEMPLATES_MAX):
    """memo[key] = value, the memo starting over when it holds `limit` entries (a loop repeats a few keys; a
    workload of ever new ones must not grow it without bound). Returns value."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value


class Bounds:
    """One call site's Bound launches, per caller signature (a hashable that determines every argument but the live
    ones: the caller's promise, as for bind): launch() runs the signature's Bound, bind() keeps a new one after a
    slow launch (remember's bound on their number)."""

    def __init__(self):
        self.entries: dict = {}

    def launch(self, sig, grid, live: tuple) -> bool:
        bound = self.entries.get(sig)
        return bound is not None and bound(grid, live)

    def bind(self, sig, kernel, args: tuple, kwargs: dict, n_live: int, launched=None) -> None:
        bound = bind(kernel, args, kwargs, n_live, launched)
        if bound is not None:
            remember(self.entries, sig, bound)


def _no_launch_hooks() -> bool:
    """Whether no launch enter / exit hook is registered with Triton (a profiler's, e.g. proton's)."""
    rt = _knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return ((enter is None or getattr(enter, "calls", None) == []) and
            (leave is None or getattr(leave, "calls", None) == []))

"""flashtile.kernels.relaunch: which launches reuse a compiled kernel, and with which arguments (no GPU: a stand-in
kernel records what it is called with)."""
import inspect

import pytest
import torch

from flashtile.kernels import relaunch


class _Compiled:
    """A CompiledKernel's surface: run(grid x, y, z, stream, function, packed metadata, launch metadata, enter hook,
    exit hook, *args) is its launcher; [grid](*args) Triton's runner, which fills in the rest."""
    function, packed_metadata = "fn", "meta"

    def __init__(self, calls):
        self.calls = calls

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *a):
        assert (stream, function, packed, metadata, enter, leave) == (7, "fn", "meta", None, None, None)
        self.calls.append(("compiled", (gx, gy, gz), a))

    def __getitem__(self, grid):
        return lambda *a: self.calls.append(("runner", grid, a))


class _Kernel:
    """A JIT function's surface: kernel(x, n, scale, desc, aux, BLOCK: constexpr, head_group=1, FLAG: constexpr = False)."""
    arg_names = ["x", "n", "scale", "desc", "aux", "BLOCK", "head_group", "FLAG"]
    constexprs = [5, 7]

    def __init__(self):
        self.calls = []
        P = inspect.Parameter
        self.signature = inspect.Signature(
            [P(n, P.POSITIONAL_OR_KEYWORD) for n in self.arg_names[:6]]
            + [P("head_group", P.POSITIONAL_OR_KEYWORD, default=1), P("FLAG", P.POSITIONAL_OR_KEYWORD, default=False)])

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append(("dispatch", grid, a, kw)) or _Compiled(self.calls)


class _Desc:
    def __init__(self, base, block_shape):
        self.base, self.block_shape, self.padding = base, block_shape, "zero"


@pytest.fixture
def kern(monkeypatch):
    monkeypatch.setattr(relaunch, "_COMPILED", {})
    monkeypatch.setattr(relaunch, "_compiles", lambda k: True)
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", True)
    monkeypatch.setattr(relaunch, "current_device", lambda: 0)
    monkeypatch.setattr(relaunch, "raw_stream", lambda device: 7)
    return _Kernel()


def test_relaunch_keys_on_specialization(kern, monkeypatch):
    """The first launch of a key goes through kernel[grid] (Triton's dispatch, which compiles); the next ones of
    that key call the compiled kernel with every parameter after the positional ones in order, defaults filled in,
    options left out; a tensor of another alignment or dtype, an int that becomes 1 or a multiple of 16 or leaves
    int32, a descriptor of another block, a tuple element, another constexpr or option: the dispatch again.
    FAST_LAUNCH off: the dispatch always."""
    buf = torch.empty(64)
    x, x_odd, x_half = buf[:16], buf[1:17], buf[:16].half()
    d64, d128 = _Desc(x, [64, 16]), _Desc(x, [128, 16])
    kw = dict(BLOCK=64, num_warps=4)

    def go(*args, **extra):
        relaunch.launch(kern, (3, ), args, dict(kw, **extra))
        return kern.calls[-1][0]

    aux = (x, 7)
    assert go(x, 32, 0.5, d64, aux) == "dispatch"
    assert go(x, 48, 0.25, _Desc(buf[16:32], [64, 16]), (buf[16:32], 9)) == "compiled"
    assert kern.calls[-1][1:] == ((3, 1, 1), (x, 48, 0.25, kern.calls[-1][2][3], kern.calls[-1][2][4], 64, 1, False))
    for args, extra in (((x_odd, 48, 0.25, d64, aux), {}), ((x_half, 48, 0.25, d64, aux), {}),
                        ((x, 1, 0.5, d64, aux), {}), ((x, 33, 0.5, d64, aux), {}), ((x, 2 ** 40, 0.5, d64, aux), {}),
                        ((x, 32, 0.5, d128, aux), {}), ((x, 32, 0.5, d64, (x, 16)), {}),
                        ((x, 32, 0.5, d64, aux), dict(BLOCK=128)), ((x, 32, 0.5, d64, aux), dict(num_warps=8)),
                        ((x, 32, 0.5, d64, aux), dict(FLAG=True))):
        assert go(*args, **extra) == "dispatch", (args, extra)
    assert go(x, 35, 0.5, d64, aux) == "compiled"   # (33's key: not 1, not a multiple of 16)
    # a runtime parameter given by keyword is part of the key by its specialization, and passed in order
    assert go(x, 32, 0.5, d64, aux, head_group=3) == "dispatch"
    assert go(x, 32, 0.5, d64, aux, head_group=5) == "compiled"
    assert kern.calls[-1][2][5:] == (64, 5, False)
    # with a launch hook registered (a profiler's) the compiled kernel goes through Triton's runner, which calls it
    monkeypatch.setattr(relaunch, "_no_launch_hooks", lambda: False)
    assert go(x, 32, 0.5, d64, aux, head_group=5) == "runner"
    assert kern.calls[-1][1:] == ((3, 1, 1), (x, 32, 0.5, d64, aux, 64, 5, False))
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", False)
    assert go(x, 48, 0.25, d64, aux) == "dispatch"


def test_relaunch_falls_back(kern, monkeypatch):
    """No fast path for an unhashable constexpr or a missing parameter (Triton's dispatch reports it), nor for a
    kernel that does not compile (the interpreter's)."""
    x = torch.empty(16)
    for _ in range(2):
        relaunch.launch(kern, (1, ), (x, 32, 0.5, None, ()), dict(BLOCK=[64]))
    assert [c[0] for c in kern.calls] == ["dispatch", "dispatch"]
    relaunch.launch(kern, (1, ), (x, 32, 0.5, None), dict(BLOCK=64))   # no aux: the dispatch raises in Triton
    assert kern.calls[-1][0] == "dispatch"
    monkeypatch.setattr(relaunch, "_compiles", lambda k: False)
    other = _Kernel()
    for _ in range(2):
        relaunch.launch(other, (1, ), (x, 32, 0.5, None, ()), dict(BLOCK=64))
    assert [c[0] for c in other.calls] == ["dispatch", "dispatch"]


def test_args_key_equals_per_argument_keys(monkeypatch):
    """_args_key (ints from a cache, tensors inline) gives what _arg_key gives argument by argument, for every kind
    of argument, and its int cache stays bounded."""
    base = torch.empty(64, dtype=torch.float16)
    args = (1, 0, 16, 17, -16, 2 ** 31, -2 ** 31 - 1, True, False, 1.0, None, base, base[1:], torch.empty(3),
            (1, base[1:], (16, None)), torch.nn.Parameter(torch.empty(2)))
    for _ in range(2):   # the second time the ints come from the cache
        assert relaunch._args_key(args) == tuple(map(relaunch._arg_key, args))
    assert relaunch._args_key((True,)) != relaunch._args_key((1,))   # a bool is not the int 1
    monkeypatch.setattr(relaunch, "_INT_KEYS", {})
    monkeypatch.setattr(relaunch, "_MAX_ENTRIES", 8)
    keys = relaunch._args_key(tuple(range(100)))
    assert keys == tuple(map(relaunch._arg_key, range(100))) and len(relaunch._INT_KEYS) == 8


def test_args_key_of_argument_groups(monkeypatch):
    """A tuple of scalars (an argument group) is keyed from _TUPLE_KEYS after its first time, with its elements'
    types in the entry's key (True, 1 and 1.0 are equal dict keys, but specialize differently); a tuple holding a
    tensor or another tuple is keyed element by element each time, never kept (a kept tensor would stay alive), a
    scalar tuple inside it is; the cache stays bounded."""
    monkeypatch.setattr(relaunch, "_TUPLE_KEYS", {})
    base = torch.empty(64, dtype=torch.float16)
    groups = [(1, 0), (True, 0), (1.0, 0), (16, 2 ** 31, None), (0.5, -1), (), (base[1:], 16), ((16, 1), 3)]
    for _ in range(2):   # the second time the scalar groups come from the cache
        assert relaunch._args_key(groups) == tuple(map(relaunch._arg_key, groups))
    assert len({relaunch._args_key([g]) for g in groups[:3]}) == 3
    kept = {g for g, _ in relaunch._TUPLE_KEYS}   # (the scalar groups, and the one nested in the last group)
    assert len(relaunch._TUPLE_KEYS) == 7 and kept == {*groups[:6], (16, 1)}
    monkeypatch.setattr(relaunch, "_TUPLE_KEYS", {})
    monkeypatch.setattr(relaunch, "_MAX_ENTRIES", 8)
    relaunch._args_key([(i, 16) for i in range(100)])
    assert len(relaunch._TUPLE_KEYS) == 8


def test_bound_launches_with_the_bound_arguments(kern, monkeypatch):
    """bind: None before the key was compiled (or without a fast path); then a Bound that calls the compiled kernel
    with the live arguments, the bound ones and the parameters after them in order - as launch() would - and
    refuses (False, nothing launched) live arguments of another key, another current device or a launch hook."""
    buf = torch.empty(64)
    x, y = buf[:16], buf[16:32]
    args, kw = (x, 48, 0.25, None, (x, 9)), dict(BLOCK=64, num_warps=4)
    assert relaunch.bind(kern, args, kw, 1) is None
    relaunch.launch(kern, (3, ), args, kw)
    relaunch.launch(kern, (3, ), (y, *args[1:]), kw)
    reference = kern.calls[-1]
    bound = relaunch.bind(kern, args, kw, 1)
    assert bound((3, 1, 1), (y, ))
    assert kern.calls[-1] == reference and reference[0] == "compiled"
    for live in ((buf[1:17], ), (x.half(), ), (None, )):
        assert not bound((3, 1, 1), live)
    monkeypatch.setattr(relaunch, "current_device", lambda: 1)
    assert not bound((3, 1, 1), (x, ))
    monkeypatch.setattr(relaunch, "current_device", lambda: 0)
    monkeypatch.setattr(relaunch, "_no_launch_hooks", lambda: False)
    assert not bound((3, 1, 1), (x, ))
    assert kern.calls[-1] == reference
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", False)
    assert relaunch.bind(kern, args, kw, 1) is None


def test_bound_checks_the_positions_it_is_told(kern):
    """checked: only those live arguments' keys are compared (a caller vouches for the others, e.g. its own outputs);
    a mismatch there refuses the launch, one elsewhere does not; None checks every live argument."""
    buf = torch.empty(64)
    x, y = buf[:16], buf[16:32]
    args, kw = (x, 48, 0.25, None, (x, 9)), dict(BLOCK=64, num_warps=4)
    relaunch.launch(kern, (3, ), args, kw)
    bound = relaunch.bind(kern, args, kw, 3)
    assert bound((3, 1, 1), (y, 48, 0.25), checked=(0, 2))
    misaligned = buf[1:17]
    assert not bound((3, 1, 1), (misaligned, 48, 0.25), checked=(0, 2))
    assert not bound((3, 1, 1), (x.half(), 48, 0.25), checked=(0, ))
    assert not bound((3, 1, 1), (y, 48, None), checked=(0, 2))
    n = len(kern.calls)
    assert bound((3, 1, 1), (y, 47, 0.25), checked=(0, 2))   # (position 1 vouched for by the caller)
    assert len(kern.calls) == n + 1
    assert not bound((3, 1, 1), (y, 47, 0.25))


def test_bind_takes_the_key_launch_returned(kern, monkeypatch):
    """launch() returns its key (None without a fast path); bind() given it binds what it would have looked up
    itself - the first launch of a key included, which compiled it - and still refuses with BIND off."""
    buf = torch.empty(64)
    x, y = buf[:16], buf[16:32]
    args, kw = (x, 48, 0.25, None, (x, 9)), dict(BLOCK=64, num_warps=4)
    launched = relaunch.launch(kern, (3, ), args, kw)
    assert launched is not None and launched[0] in relaunch._COMPILED
    bound = relaunch.bind(kern, args, kw, 1, launched)
    looked_up = relaunch.bind(kern, args, kw, 1)
    assert (bound.entry, bound.tail, bound.live_key) == (looked_up.entry, looked_up.tail, looked_up.live_key)
    assert bound((3, 1, 1), (y, ))
    assert kern.calls[-1] == ("compiled", (3, 1, 1), (y, 48, 0.25, None, (x, 9), 64, 1, False))
    monkeypatch.setattr(relaunch, "BIND", False)
    assert relaunch.bind(kern, args, kw, 1, launched) is None
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", False)
    assert relaunch.launch(kern, (3, ), args, kw) is None


# --------------------------------------------------------------------------------------------------
# Direct launches: this module stands in for Triton 3.6's nvidia driver module (its launcher's surface)
# --------------------------------------------------------------------------------------------------
_BASE_ARGS_FORMAT_LEN = 13
ENCODED = []   # base addresses of the tensor maps encoded so far


class PyCUtensorMap:
    def __init__(self, address):
        self.address = address


def make_tensordesc_arg(arg, metadata):
    """The driver's expansion of a descriptor: its encoded map, shape and strides (metadata: the kernel's)."""
    ENCODED.append(arg.base.data_ptr())
    return [PyCUtensorMap(arg.base.data_ptr()), *arg.shape, *arg.strides, metadata]


def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
    """Triton 3.6's wrapper: every argument after the 13 leading ones in order, each descriptor expanded."""
    tensordesc_indices = {i for i, sig in enumerate(signature) if sig.startswith("tensordesc")}

    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner


class CudaLauncher:
    def __init__(self, launch, scratch=0):
        self.launch, self.num_ctas = launch, 1
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


class _Entry:
    function, packed_metadata = "fn", (4, 1, 0)

    def __init__(self, run):
        self.run = run


def test_direct_launch_passes_what_the_launcher_would(monkeypatch):
    """_direct: the C function gets the arguments Triton's launcher would give it (descriptors expanded in place,
    live and bound ones), a descriptor of a DescriptorType is expanded once per base address (where the kernel has
    TMA metadata), any other descriptor every call; no direct path for a launcher of another shape (scratch
    buffers, another wrapper) or DIRECT off."""
    from flashtile.kernels.runtime import DescriptorType
    monkeypatch.setattr(relaunch, "DIRECT", True)
    calls = []

    def c_launch(*a):
        calls.append(a)
    signature = ["tensordesc<bf16[64,16]>", "*fp32", "tensordesc<bf16[64,16]>", "i32", "tensordesc<fp32[64,16]>", "fp32"]
    meta = ["m0", "m1", "m2"]
    entry = _Entry(CudaLauncher(wrap_handle_tensordesc(c_launch, signature, meta)))
    buf = torch.empty(256)
    a, b, c = buf[:64], buf[64:128], buf[128:192]
    desc_type = DescriptorType(_Desc, dict(shape=[4, 16], strides=[16, 1], block_shape=[64, 16], padding="zero"))
    plain = _Desc(c, [64, 16])
    plain.shape, plain.strides = [4, 16], [16, 1]
    tail = (7, plain, 0.5)
    direct = relaunch._direct(entry, (desc_type(a), a, desc_type(b)), tail)
    assert direct is not None
    for live in ((desc_type(a), b, desc_type(b)), (desc_type(b), a, desc_type(a)), (desc_type(a), c, desc_type(c))):
        entry.run(2, 3, 1, 9, "fn", entry.packed_metadata, None, None, None, *live, *tail)
        expected = calls.pop()
        ENCODED.clear()
        direct((2, 3, 1), live, 9)
        got = calls.pop()
        assert len(got) == len(expected) and relaunch._same_arguments(got, expected)
        assert [x.address for x in got if isinstance(x, PyCUtensorMap)] == [
            live[0].base.data_ptr(), live[2].base.data_ptr(), c.data_ptr()]
    assert ENCODED == [c.data_ptr()]   # (the last call's one new base; the tail was expanded at _direct)
    # without the kernel's TMA metadata the expansion holds the base tensor: expanded at every call, never kept
    no_meta = _Entry(CudaLauncher(wrap_handle_tensordesc(c_launch, signature, [None] * 3)))
    direct = relaunch._direct(no_meta, (desc_type(a), a, desc_type(b)), tail)
    ENCODED.clear()
    for _ in range(2):
        direct((2, 3, 1), (desc_type(a), a, desc_type(b)), 9)
    assert ENCODED == [a.data_ptr(), b.data_ptr()] * 2 and not any(s.maps for _, s in direct.live_slots)
    no_desc = _Entry(CudaLauncher(len))   # a builtin: the C function itself, for kernels without descriptors
    assert relaunch._direct(no_desc, (a, ), (1, )).c_launch is len
    assert relaunch._direct(_Entry(CudaLauncher(wrap_handle_tensordesc(c_launch, signature, meta), scratch=64)),
                            (desc_type(a), a, desc_type(b)), tail) is None
    assert relaunch._direct(_Entry(CudaLauncher(lambda *args: None)), (desc_type(a), a, desc_type(b)), tail) is None
    monkeypatch.setattr(relaunch, "DIRECT", False)
    assert relaunch._direct(entry, (desc_type(a), a, desc_type(b)), tail) is None

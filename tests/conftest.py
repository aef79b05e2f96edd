"""Test-wide set-up: without CUDA, Triton kernels run on CPU tensors through the interpreter; every test case draws a
fresh seed, and a failing case prints the one command that replays it; a GPU test (tests/gpu/) gives its memory back.

TRITON_INTERPRET must be set before any @triton.jit function is decorated, i.e. before flashtile's kernels
are imported, so it is set here, at collection time.

Seeds: each test case draws a fresh seed from os.urandom (or takes FLASHTILE_TEST_SEED when that is set) and seeds
torch (CPU and CUDA), Python's random and numpy with it before it runs, so tests that draw random inputs without
asking for the `seed` fixture are covered too; a Hypothesis test is seeded with it as well (its examples follow from
the seed). A failing case's report carries a "replay" section,
``FLASHTILE_TEST_SEED=<seed> python -m pytest '<node id>'``, and the run ends with the list of those commands.
"""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# outputs start as NaN in every test, so an element a kernel fails to write cannot pass (flashtile.interface)
os.environ.setdefault("FLASHTILE_POISON", "1")

HAS_CUDA = torch.cuda.is_available()
SEED_ENV = "FLASHTILE_TEST_SEED"
_SEED = pytest.StashKey[int]()

try:  # Hypothesis prints the blob that replays a failing example, beside the example itself
    from hypothesis import settings as _hypothesis_settings
    _hypothesis_settings.register_profile("flashtile", print_blob=True)
    _hypothesis_settings.load_profile("flashtile")
except ImportError:  # the GPU machine may lack hypothesis
    pass


def draw_seed() -> int:
    """FLASHTILE_TEST_SEED when set (a replay), else 32 fresh random bits."""
    pinned = os.environ.get(SEED_ENV, "").strip()
    if pinned:
        try:
            return int(pinned, 0)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={pinned!r}: expected an integer seed") from None
    return int.from_bytes(os.urandom(4), "little")


def replay_command(seed: int, nodeid: str) -> str:
    quoted = "'" + nodeid.replace("'", "'\"'\"'") + "'"
    return f"{SEED_ENV}={seed} python -m pytest {quoted}"


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seeds every generator a test may draw from with this case's seed (see the module docstring)."""
    s = draw_seed()
    request.node.stash[_SEED] = s
    request.node.user_properties.append(("seed", s))
    torch.manual_seed(s)   # also every CUDA device's generator
    random.seed(s)
    try:
        import numpy
        numpy.random.seed(s)
    except ImportError:
        pass
    test = getattr(request.node, "obj", None)
    if getattr(test, "is_hypothesis_test", False):
        # what hypothesis.seed(s) sets: the test's examples follow from s instead of Hypothesis' own random seed
        getattr(test, "__func__", test)._hypothesis_internal_use_seed = s
    return s


@pytest.fixture
def seed(_seeded):
    """This test case's seed (torch is already seeded with it): for generators a test builds itself."""
    return _seeded


@pytest.fixture(autouse=True)
def _free_gpu_memory(request):
    """After each GPU test (tests/gpu/): wait for its kernels, then hand the caching allocator's free blocks back, so
    the next test's large problem finds the memory. (Here, not in a tests/gpu/conftest.py: a second module named
    conftest would take this one's place for `import conftest`.)"""
    yield
    if request.node.path.parent.name == "gpu":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    s = item.stash.get(_SEED, None)
    if report.failed and s is not None:
        report.sections.append(("replay", replay_command(s, item.nodeid)))


def pytest_terminal_summary(terminalreporter):
    commands = []
    for rep in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", []):
        commands += [content for name, content in getattr(rep, "sections", ()) if name == "replay"]
    if commands:
        terminalreporter.section("replay the failing cases with their seeds")
        for cmd in dict.fromkeys(commands):
            terminalreporter.write_line(cmd)

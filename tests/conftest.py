"""Test-wide set-up: without CUDA, Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is decorated, i.e. before flashtile's kernels
are imported, so it is set here, at collection time.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# outputs start as NaN in every test, so an element a kernel fails to write cannot pass (flashtile.interface)
os.environ.setdefault("FLASHTILE_POISON", "1")

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def seed(request):
    """A fresh seed per test case, printed on failure so the case can be replayed."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    request.node.user_properties.append(("seed", s))
    print(f"[seed={s}]")
    return s

"""kernels/dispatch.py's rules that hold without a GPU: which inputs are copied contiguous for the Hopper kernels
(dispatch.copies). The Hopper check itself (fa3.supports) is replaced by the eligibility rule it applies, so the
rule runs on the CPU; tests/gpu/test_call_path_gpu.py runs the copies through the kernels."""
import pytest
import torch

from flashtile import interface
from flashtile.kernels import dispatch
from flashtile.kernels.gluon import fa3

B, S, H, D = 1, 256, 2, 128   # the work of one problem: B * H * S * S * D


@pytest.fixture
def rule(monkeypatch):
    """dispatch.copies with fa3.supports as its eligibility rule, the work threshold at one test problem's, and
    an empty memo of dense problems."""
    monkeypatch.setattr(fa3, "supports", lambda q, k, v, params, *a, **kw: fa3.eligible(q, k, v, params, *a, **kw))
    monkeypatch.setattr(dispatch, "COPY_MIN_WORK", B * H * S * S * D)
    monkeypatch.setattr(interface, "_DENSE", {})

    def copies(q, k, v, **kw):
        p, q, k, v = interface._dense_problem(q, k, v, kw.get("dropout_p", 0.0), None, True, (-1, -1), 0.0, None,
                                              False, False)
        return dispatch.copies(p, q, k, v)
    return copies


def layout(name, s=S, h=H, d=D, dtype=torch.bfloat16):
    if name == "contig":
        return torch.randn(B, s, h, d, dtype=dtype)
    if name == "packed":   # q, k or v of a fused projection: rows at stride 3 h d
        return torch.randn(B, s, 3, h, d, dtype=dtype)[:, :, 1]
    if name == "transposed":   # (b, h, s, d) memory
        return torch.randn(B, h, s, d, dtype=dtype).transpose(1, 2)
    if name == "unaligned":   # a view whose base is 2 bytes past an aligned one
        return torch.randn(B * s * h * d + 1, dtype=dtype)[1:].view(B, s, h, d)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["contig", "packed"])
def test_layouts_tma_tiles_are_not_copied(rule, name):
    assert rule(*(layout(name) for _ in range(3))) == ()


@pytest.mark.parametrize("name", ["transposed", "unaligned"])
def test_layouts_tma_cannot_tile_are_copied(rule, name):
    assert rule(*(layout(name) for _ in range(3))) == (True, True, True)


def test_only_the_tensors_tma_cannot_tile_are_copied(rule):
    assert rule(layout("contig"), layout("transposed"), layout("packed")) == (False, True, False)


def test_below_the_work_threshold_nothing_is_copied(rule):
    assert rule(*(layout("transposed", s=S - 64) for _ in range(3))) == ()


def test_problems_the_hopper_kernels_do_not_take_are_not_copied(rule):
    assert rule(*(layout("transposed", dtype=torch.float32) for _ in range(3))) == ()   # float32
    assert rule(*(layout("transposed", s=320, d=96) for _ in range(3))) == ()   # head dim 96 (above the
    assert rule(*(layout("transposed", s=320) for _ in range(3))) != ()          # work threshold: d128 is)
    assert rule(*(layout("transposed") for _ in range(3)), dropout_p=0.1) == ()        # dropout


def test_no_copy_off_cuda():
    """On the CPU the kernels read the tensors as they are (kernel_inputs returns them unchanged)."""
    q, k, v = (layout("transposed") for _ in range(3))
    p, *_ = interface._dense_problem(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False)
    assert all(a is b for a, b in zip(dispatch.kernel_inputs(p, q, k, v), (q, k, v)))

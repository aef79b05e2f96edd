"""Dropout: one mask Z, keyed by (seed, offset, b, h, row, col), shared by every algorithm, forward and
backward; FA1's backward replays it from the RNG state R its forward returned."""
import math

import pytest
import torch

from flashtile.reference import rng
from flashtile.reference.fa1 import fa1_backward, fa1_forward
from flashtile.reference.io_counters import Tiling
from flashtile.reference.standard import validate

from . import TOL64, make_inputs, oracle, run_batched


def _head(N_q, N_k, p, seed, **kw):
    Q, K = torch.empty(N_q, 4), torch.empty(N_k, 4)
    return validate(Q, K, K, where="test", dropout_p=p, seed=seed, **kw)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_5_sigma_of_1_minus_p(p, seed):
    head = _head(150, 200, p, seed)
    Z = head.Z(slice(0, 150), slice(0, 200))
    kept = (Z > 0).sum().item()
    n = Z.numel()
    assert abs(kept - n * (1 - p)) <= 5 * math.sqrt(n * p * (1 - p))
    assert torch.equal(Z.unique(), torch.tensor([0.0, 1 / (1 - p)]))  # kept entries scaled by 1/(1-p)


def test_tiles_of_Z_assemble_into_the_full_dropout_mask(seed):
    N_q, N_k, H = 23, 31, 3
    head = _head(N_q, N_k, 0.4, seed, offset=5, b=1, h=2, nheads=H)
    t = Tiling(4, 7, N_q, N_k)
    Z = torch.cat([torch.cat([head.Z(t.rows(i), t.cols(j)) for j in range(t.Tc)], 1) for i in range(t.Tr)], 0)
    full = rng.dropout_keep_mask(seed, 5, 2, H, N_q, N_k, 0.4)[1, 2]
    assert torch.equal(Z > 0, full)


def test_standard_fa1_fa2_draw_the_same_dropout_mask(seed):
    q, k, v, do, kpm = make_inputs(2, 2, 26, 19, 8, padding=True)
    opts = dict(key_padding_mask=kpm, causal=True, dropout_p=0.4, seed=seed, offset=3)
    results = [run_batched(a, q, k, v, do, block_sizes=(5, 3), **opts) for a in ("standard", "fa1", "fa2")]
    for other in results[1:]:
        for g, s in zip(other[:1] + other[2:], results[0][:1] + results[0][2:]):
            torch.testing.assert_close(g, s, **TOL64)
    # and all equal the oracle given rng.dropout_keep_mask, so the shared mask is that one
    ref = oracle(q, k, v, do, **opts)
    torch.testing.assert_close(results[0][0], ref[0], **TOL64)


def test_fa1_backward_replays_the_rng_state_R(seed):
    q, k, v, do, _ = make_inputs(1, 1, 17, 17, 8)
    Q, K, V, dO = (x[0, :, 0] for x in (q, k, v, do))
    fwd = fa1_forward(Q, K, V, M=96, dropout_p=0.3, seed=seed, offset=9)
    assert fwd.R == (seed, 9)
    grads = fa1_backward(Q, K, V, fwd.O, dO, fwd.l, fwd.m, fwd.R, M=96, dropout_p=0.3)
    ref = oracle(q, k, v, do, dropout_p=0.3, seed=seed, offset=9)
    for g, r in zip(grads, ref[2:]):
        torch.testing.assert_close(g, r[0, :, 0], **TOL64)
    wrong = fa1_backward(Q, K, V, fwd.O, dO, fwd.l, fwd.m, (seed + 1, 9), M=96, dropout_p=0.3)
    assert not torch.allclose(wrong[2], grads[2])  # another R, another mask: the gradients depend on R

"""Standard attention, FA1 and FA2 (and block-sparse with an all-ones mask) against the float64 oracle
dense.attention_ref and torch.autograd's gradients of it: forward output, log-sum-exp, dQ, dK, dV."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashtile.reference.fa1 import fa1_forward
from flashtile.reference.fa2 import fa2_backward, fa2_forward
from flashtile.reference.io_counters import HBM
from flashtile.reference.io_model import run
from flashtile.reference.standard import standard_forward

from . import TOL64, make_inputs, oracle, run_batched

ALGORITHMS = ["standard", "fa1", "fa2", "blocksparse"]

# (B, H, N_q, N_k, d, tiles, options): sizes that are not multiples of the blocks, N_q != N_k both ways,
# Br != Bc, and every MASK / dropout combination.
CASES = {
    "square-ragged": (2, 2, 37, 37, 8, dict(M=4 * 8 * 5), dict()),  # Br = Bc = 5, 37 = 7 * 5 + 2
    "Nq<Nk-Br<Bc": (1, 2, 29, 41, 8, dict(M=4 * 8 * 13), dict()),  # Br = 8, Bc = 13
    "Nq>Nk-causal": (2, 1, 41, 29, 8, dict(block_sizes=(6, 4)), dict(causal=True)),  # 12 empty rows
    "causal-padding": (2, 2, 33, 45, 16, dict(M=4 * 16 * 7), dict(causal=True, padding=True)),
    "dropout": (2, 2, 33, 27, 8, dict(block_sizes=(5, 7)), dict(dropout_p=0.3)),
    "all": (2, 2, 30, 47, 8, dict(block_sizes=(7, 6)),
            dict(causal=True, padding=True, dropout_p=0.2, softmax_scale=0.7)),
    "single-query": (1, 1, 1, 9, 4, dict(M=64), dict(padding=True)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float64_matches_oracle_and_autograd(algorithm, case, seed):
    B, H, N_q, N_k, d, tiles, opts = CASES[case]
    opts = dict(opts)
    q, k, v, do, kpm = make_inputs(B, H, N_q, N_k, d, padding=opts.pop("padding", False))
    opts.update(seed=seed, offset=11 * seed % 1000)
    ref = oracle(q, k, v, do, key_padding_mask=kpm, **opts)
    got = run_batched(algorithm, q, k, v, do, key_padding_mask=kpm, **tiles, **opts)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if g is None:  # standard attention keeps no lse
            continue
        assert g.dtype == r.dtype, name
        torch.testing.assert_close(g, r, **TOL64, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fully_masked_rows_give_zero_output_and_finite_zero_grads(algorithm, seed):
    B, H, N_q, N_k, d = 2, 1, 20, 12, 8
    q, k, v, do, _ = make_inputs(B, H, N_q, N_k, d)
    kpm = torch.ones(B, N_k, dtype=torch.bool)
    kpm[1] = False  # batch 1: every key is padding, so every row is empty
    # causal with N_q > N_k, bottom-right aligned: rows 0..7 of batch 0 see no key either
    out, lse, dq, dk, dv = run_batched(algorithm, q, k, v, do, key_padding_mask=kpm, causal=True, M=4 * d * 3)
    for x in (out, dq, dk, dv):
        assert torch.isfinite(x).all()
    empty = torch.zeros(B, N_q, dtype=torch.bool)
    empty[1] = True
    empty[0, : N_q - N_k] = True
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
    if lse is not None:
        assert (lse.transpose(1, 2)[empty] == float("-inf")).all()
        assert torch.isfinite(lse.transpose(1, 2)[~empty]).all()
    ref = oracle(q, k, v, do, key_padding_mask=kpm, causal=True)
    for g, r in zip((out, dq, dk, dv), (ref[0], *ref[2:])):
        torch.testing.assert_close(g, r, **TOL64)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("algorithm", ["standard", "fa1", "fa2"])
def test_low_precision_inputs_run_and_stay_close_to_float64(algorithm, dtype, atol, seed):
    q, k, v, do, kpm = make_inputs(1, 2, 19, 23, 16, dtype=dtype, padding=True)
    out, _, dq, dk, dv = run_batched(algorithm, q, k, v, do, key_padding_mask=kpm, causal=True, M=4 * 16 * 6)
    ref = oracle(q, k, v, do, key_padding_mask=kpm, causal=True)
    for g, r in zip((out, dq, dk, dv), (ref[0], *ref[2:])):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r, rtol=0, atol=atol)


@settings(max_examples=25, deadline=None)
@given(N_q=st.integers(1, 24), N_k=st.integers(1, 24), d=st.integers(1, 6), Br=st.integers(1, 9),
       Bc=st.integers(1, 9), causal=st.booleans(), rng_seed=st.integers(0, 2**31))
def test_any_block_sizes_give_standard_attention(N_q, N_k, d, Br, Bc, causal, rng_seed):
    torch.manual_seed(rng_seed)
    Q, K, V, dO = (torch.randn(n, d, dtype=torch.float64) for n in (N_q, N_k, N_k, N_q))
    opts = dict(causal=causal, dropout_p=0.25, seed=rng_seed)
    std = run("standard", Q, K, V, dO, **opts)
    for algorithm in ("fa1", "fa2"):
        r = run(algorithm, Q, K, V, dO, M=10**6, block_sizes=(Br, Bc), **opts)
        for g, s in zip((r.O, r.dQ, r.dK, r.dV), (std.O, std.dQ, std.dK, std.dV)):
            torch.testing.assert_close(g, s, **TOL64)


def test_algorithms_run_on_meta_tensors():
    # small: torch's meta elementwise ops are slow (see io_model.count_hbm_accesses)
    Q, K, V, dO = (torch.empty(n, 16, device="meta") for n in (10, 13, 13, 10))
    for algorithm in ALGORITHMS:
        r = run(algorithm, Q, K, V, dO, M=4 * 16 * 4, causal=True, dropout_p=0.1 if algorithm == "fa1" else 0.0,
                key_padding_mask=torch.ones(13, dtype=torch.bool, device="meta"))
        assert r.O.device.type == "meta" and r.O.shape == (10, 16) and r.dK.shape == (13, 16)
        assert r.hbm_fwd.total > 0 and r.hbm_bwd.total > 0


def test_hbm_counter_passed_in_accumulates_fwd_and_bwd(seed):
    Q, K, V, dO = (torch.randn(n, 8, dtype=torch.float64) for n in (20, 30, 30, 20))
    hbm = HBM()
    fwd = fa2_forward(Q, K, V, M=4 * 8 * 4, hbm=hbm)
    after_fwd = hbm.total
    fa2_backward(Q, K, V, fwd.O, dO, fwd.L, M=4 * 8 * 4, hbm=hbm)
    assert 0 < after_fwd < hbm.total
    assert hbm.per_array["L"]["writes"] == 20 and hbm.per_array["L"]["reads"] > 0


def test_forward_results_are_reproducible_and_key_on_the_head_index(seed):
    Q, K, V = (torch.randn(n, 8, dtype=torch.float64) for n in (16, 16, 16))
    a = fa1_forward(Q, K, V, M=128, dropout_p=0.5, seed=seed, h=0, nheads=2).O
    b = fa1_forward(Q, K, V, M=128, dropout_p=0.5, seed=seed, h=0, nheads=2).O
    c = fa1_forward(Q, K, V, M=128, dropout_p=0.5, seed=seed, h=1, nheads=2).O
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)  # another head draws another dropout mask
    assert torch.equal(standard_forward(Q, K, V).O, standard_forward(Q, K, V).O)

"""The HBM/SRAM accounting layer and the access counts it measures, checked against the IO analyses of the
FA1 paper (appendix C, proofs of Theorems 2, 4, 5): standard Theta(Nd + N^2), FlashAttention Theta(N^2 d^2 / M)."""
import math

import pytest
import torch

from flashtile.reference.fa1 import fa1_forward
from flashtile.reference.fa2 import fa2_forward
from flashtile.reference.io_counters import HBM, SRAM, SRAMOverflowError, Tiling, block_sizes, random_block_mask
from flashtile.reference.io_model import count_hbm_accesses

M_100KB_FP16 = 51200  # elements: 100 KB of fp16, about an A100 SM's shared memory


# --- the two memories -----------------------------------------------------------------------------------
def test_hbm_counts_loads_stores_and_initialisation_per_array():
    hbm = HBM()
    hbm.put(Q=torch.randn(10, 4))  # an input: already in HBM, free
    hbm.alloc("O", (10, 4), 0.0, torch.float32, "cpu")  # "Initialize O = (0) in HBM": 40 writes
    tile = hbm.load("Q", slice(2, 5))
    hbm.store("O", slice(2, 5), tile * 2)
    hbm.store("S", ..., torch.ones(3, 3))  # a whole-array first write creates the array
    assert hbm.per_array == {"O": {"reads": 0, "writes": 52}, "Q": {"reads": 12, "writes": 0},
                             "S": {"reads": 0, "writes": 9}}
    assert (hbm.reads, hbm.writes, hbm.total) == (12, 61, 73)
    assert torch.equal(hbm["O"][2:5], tile * 2)


def test_hbm_load_is_a_copy_not_a_view():
    hbm = HBM()
    hbm.put(O=torch.zeros(4))
    tile = hbm.load("O", slice(0, 2))
    hbm.store("O", slice(0, 2), torch.ones(2))
    assert torch.equal(tile, torch.zeros(2))


def test_sram_tracks_working_set_and_raises_past_M():
    sram = SRAM(100, what="test")
    with sram.scope():
        sram.hold("K_j", torch.empty(5, 10))
        with sram.scope():
            sram.hold("Q_i", torch.empty(4, 10))
            sram.hold("Q_i", torch.empty(5, 10))  # re-holding a name replaces its charge
            assert sram.used == 100
            with pytest.raises(SRAMOverflowError, match=r"M=100 .*V_j"):
                sram.hold("V_j", torch.empty(1))
        assert sram.used == 50  # the inner scope released Q_i
    assert (sram.used, sram.peak) == (0, 100)
    assert issubclass(SRAMOverflowError, ValueError)


@pytest.mark.parametrize("M, d, expected", [(51200, 64, (64, 200)), (51200, 128, (100, 100)),
                                            (51200, 96, (96, 134)), (1000, 8, (8, 32)), (10, 64, (1, 1))])
def test_block_sizes_follow_alg2_line2(M, d, expected):
    assert block_sizes(M, d) == expected  # Bc = ceil(M / 4d), Br = min(Bc, d)


def test_forward_working_set_is_exactly_the_four_d_wide_tiles(seed):
    d, Br, Bc = 8, 4, 6
    Q, K, V = torch.randn(12, d), torch.randn(18, d), torch.randn(18, d)
    need = 2 * Bc * d + 2 * Br * d  # K_j, V_j, Q_i, O_i
    for algorithm in (fa1_forward, fa2_forward):
        algorithm(Q, K, V, M=need, block_sizes=(Br, Bc))  # fits exactly
        with pytest.raises(SRAMOverflowError, match=f"M={need - 1} elements"):
            algorithm(Q, K, V, M=need - 1, block_sizes=(Br, Bc))


def test_head_dim_too_large_for_M_raises_value_error_naming_M(seed):
    Q = torch.randn(16, 64)
    with pytest.raises(ValueError, match="M=100 elements"):
        fa1_forward(Q, Q, Q, M=100)  # Br = Bc = 1, yet K_j and V_j alone need 128 elements


# --- counts measured by running the algorithms ------------------------------------------------------------
@pytest.mark.parametrize("N_q, N_k, d", [(1024, 1024, 64), (300, 517, 32)])
def test_standard_attention_counts_are_linear_in_Nd_and_N2(N_q, N_k, d):
    fwd = count_hbm_accesses("standard", N_q, d, M_100KB_FP16, "fwd", N_k=N_k)
    bwd = count_hbm_accesses("standard", N_q, d, M_100KB_FP16, "bwd", N_k=N_k)
    nn = N_q * N_k
    # forward: Q, K -> S; S -> P; P, V -> O
    assert (fwd["reads"], fwd["writes"]) == (N_q * d + 2 * N_k * d + 2 * nn, 2 * nn + N_q * d)
    # backward: P, dO -> dV; dO, V -> dP; P, dP, dO, O -> dS; dS, K -> dQ; dS, Q -> dK
    assert (bwd["reads"], bwd["writes"]) == (5 * nn + 5 * N_q * d + 2 * N_k * d, 2 * nn + N_q * d + 2 * N_k * d)
    if N_q == N_k:
        N = N_q
        assert fwd["total"] == 4 * N * N + 4 * N * d and bwd["total"] == 7 * N * N + 10 * N * d


@pytest.mark.parametrize("N_q, N_k, d, M", [(1000, 1000, 64, M_100KB_FP16), (333, 517, 32, 4096), (97, 61, 16, 640)])
def test_fa1_counts_match_the_theorem_2_and_5_accounting(N_q, N_k, d, M):
    Br, Bc = block_sizes(M, d)
    Tc = math.ceil(N_k / Bc)
    fwd = count_hbm_accesses("fa1", N_q, d, M, "fwd", N_k=N_k)
    bwd = count_hbm_accesses("fa1", N_q, d, M, "bwd", N_k=N_k)
    assert (fwd["Br"], fwd["Bc"], fwd["Tc"]) == (Br, Bc, Tc)
    # forward: K, V once; Q_i, O_i, l_i, m_i read and O_i, l_i, m_i written once per K/V block; O, l, m initialised
    assert fwd["reads"] == 2 * N_k * d + Tc * (2 * N_q * d + 2 * N_q)
    assert fwd["writes"] == (1 + Tc) * (N_q * d + 2 * N_q)
    # backward: K, V once; Q, O, dO, dQ, l, m once per K/V block; dQ written per block; dQ, dK, dV initialised
    assert bwd["reads"] == 2 * N_k * d + Tc * (4 * N_q * d + 2 * N_q)
    assert bwd["writes"] == N_q * d + 2 * N_k * d + Tc * N_q * d + 2 * N_k * d


@pytest.mark.parametrize("N_q, N_k, d, M", [(1000, 1000, 64, M_100KB_FP16), (333, 517, 32, 4096)])
def test_fa2_counts_match_its_loop_order(N_q, N_k, d, M):
    Br, Bc = block_sizes(M, d)
    Tr, Tc = math.ceil(N_q / Br), math.ceil(N_k / Bc)
    fwd = count_hbm_accesses("fa2", N_q, d, M, "fwd", N_k=N_k)
    bwd = count_hbm_accesses("fa2", N_q, d, M, "bwd", N_k=N_k)
    # forward: Q once, K and V once per Q block; O and L written once
    assert (fwd["reads"], fwd["writes"]) == (N_q * d + Tr * 2 * N_k * d, N_q * d + N_q)
    # backward: D from dO, O; K, V once; Q, dO, dQ, L, D per K/V block; dQ written per block; dK, dV once
    assert bwd["reads"] == 2 * N_q * d + 2 * N_k * d + Tc * (3 * N_q * d + 2 * N_q)
    assert bwd["writes"] == N_q + N_q * d + Tc * N_q * d + 2 * N_k * d


def test_fa1_count_scales_as_N2_d2_over_M():
    d = 32
    ratios = []
    for N in (256, 512, 1024):
        for M in (4 * d * 16, 4 * d * 32, 4 * d * 64):  # multiples of 4d, M <= Nd
            total = count_hbm_accesses("fa1", N, d, M, "fwd")["total"]
            ratios.append(total / (N * N * d * d / M))
    assert max(ratios) / min(ratios) < 1.5, ratios  # Theta: a bounded constant across a 4x range of N and M


def test_fa1_needs_fewer_accesses_than_standard_at_gpt2_medium_sizes():
    N, d = 1024, 64  # GPT-2 medium: seqlen 1024, head dim 64
    for pass_ in ("fwd", "bwd"):
        fa1 = count_hbm_accesses("fa1", N, d, M_100KB_FP16, pass_)["total"]
        std = count_hbm_accesses("standard", N, d, M_100KB_FP16, pass_)["total"]
        assert fa1 * 3 < std, (pass_, fa1, std)


def test_causal_skips_blocks_in_fa2_but_fa1_applies_the_mask_everywhere():
    N, d, M = 1024, 64, 4 * 64 * 64  # Br = Bc = 64
    for pass_ in ("fwd", "bwd"):
        fa2 = [count_hbm_accesses("fa2", N, d, M, pass_, causal=c)["total"] for c in (False, True)]
        fa1 = [count_hbm_accesses("fa1", N, d, M, pass_, causal=c)["total"] for c in (False, True)]
        assert fa1[0] == fa1[1]
        assert fa2[1] < 0.6 * fa2[0]  # about half of the blocks, and their traffic, are skipped


@pytest.mark.parametrize("pass_, per_block", [("fwd", lambda Br, d: 3 * Br * d + 4 * Br),
                                              ("bwd", lambda Br, d: 5 * Br * d + 2 * Br)])
def test_blocksparse_counts_are_affine_in_the_nonzero_blocks(pass_, per_block):
    N, d, M = 1024, 64, M_100KB_FP16  # Br = 64 divides N: every Q block is full
    Br = block_sizes(M, d)[0]
    counts = {s: count_hbm_accesses("blocksparse", N, d, M, pass_, block_density=s, seed=3)
              for s in (0.0, 0.1, 0.5, 1.0)}
    base = counts[0.0]["total"]
    for s in (0.1, 0.5, 1.0):
        c = counts[s]
        assert c["total"] == base + c["nnz_blocks"] * per_block(Br, d)  # each zero block costs nothing
    assert counts[0.1]["total"] < counts[0.5]["total"] < counts[1.0]["total"]
    dense = count_hbm_accesses("fa1", N, d, M, pass_)["total"]
    assert counts[1.0]["total"] == dense
    assert counts[0.5]["per_array"]["Q"]["reads"] == counts[0.5]["nnz_blocks"] * Br * d  # Q_i only for M_ij != 0


def test_counts_on_meta_tensors_equal_counts_on_cpu():
    for algorithm in ("standard", "fa1", "fa2"):
        for pass_ in ("fwd", "bwd"):
            meta = count_hbm_accesses(algorithm, 70, 16, 1024, pass_, causal=True, device="meta")
            cpu = count_hbm_accesses(algorithm, 70, 16, 1024, pass_, causal=True, device="cpu")
            assert (meta["reads"], meta["writes"]) == (cpu["reads"], cpu["writes"]), (algorithm, pass_)


def test_random_block_mask_has_the_requested_density():
    mask = random_block_mask(10, 7, 0.3, seed=1)
    assert (len(mask), len(mask[0])) == (10, 7) and sum(map(sum, mask)) == 21
    assert Tiling(4, 4, 40, 28, tuple(map(tuple, mask))).nnz == 21


@pytest.mark.parametrize("kwargs, match", [
    (dict(algorithm="fa3"), "algorithm='fa3'"),
    (dict(pass_="both"), "pass_='both'"),
    (dict(algorithm="fa1", block_density=0.5), "block_density=0.5"),
    (dict(algorithm="blocksparse", block_density=1.5), "block_density=1.5"),
    (dict(M=0), "M=0"),
])
def test_count_hbm_accesses_rejects_bad_arguments(kwargs, match):
    args = dict(algorithm="fa2", N=64, d=16, M=1024, pass_="fwd") | kwargs
    with pytest.raises(ValueError, match=match):
        count_hbm_accesses(**args)

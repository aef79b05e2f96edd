"""Block-sparse FlashAttention (FA1 Alg. 5): equals dense attention with the expanded block mask, and zero
blocks cost no HBM traffic."""
import pytest
import torch

from flashtile.reference.blocksparse import blocksparse_backward, blocksparse_forward, expand_block_mask
from flashtile.reference.io_counters import HBM, Tiling, block_sizes, random_block_mask

from . import TOL64, make_inputs, oracle, run_batched


@pytest.mark.parametrize("causal, padding", [(False, False), (True, True)])
def test_blocksparse_equals_dense_attention_with_the_expanded_mask(causal, padding, seed):
    B, H, N_q, N_k, d, M = 2, 2, 35, 29, 8, 4 * 8 * 6  # Br = Bc = 6: Tr = 6, Tc = 5, ragged last blocks
    Br, Bc = block_sizes(M, d)
    t = Tiling(Br, Bc, N_q, N_k)
    masks = [random_block_mask(t.Tr, t.Tc, 0.5, seed=seed + b) for b in range(B)]
    masks[0][2] = [False] * t.Tc  # a block row with no non-zero block: its rows output 0
    q, k, v, do, kpm = make_inputs(B, H, N_q, N_k, d, padding=padding)
    expanded = torch.stack([expand_block_mask(m, Br, Bc, N_q, N_k) for m in masks]).view(B, 1, N_q, N_k)
    opts = dict(key_padding_mask=kpm, causal=causal, dropout_p=0.2, seed=seed)
    out, lse, dq, dk, dv = run_batched("blocksparse", q, k, v, do, block_masks=masks, M=M, **opts)
    ref = oracle(q, k, v, do, attn_mask=expanded, **opts)
    for g, r in zip((out, lse, dq, dk, dv), ref):
        torch.testing.assert_close(g, r, **TOL64)
    assert torch.equal(out[0, 2 * Br:3 * Br], torch.zeros_like(out[0, 2 * Br:3 * Br]))


def test_zero_blocks_are_never_loaded(seed):
    N, d, Br, Bc = 24, 4, 4, 6  # Tr = 6, Tc = 4
    Q, K, V, dO = (torch.randn(N, d, dtype=torch.float64) for _ in range(4))
    mask = [[(i + j) % 3 == 0 for j in range(4)] for i in range(6)]
    nnz = sum(map(sum, mask))
    hbm_f, hbm_b = HBM(), HBM()
    fwd = blocksparse_forward(Q, K, V, mask, M=10**4, block_sizes=(Br, Bc), hbm=hbm_f)
    blocksparse_backward(Q, K, V, fwd.O, dO, fwd.l, fwd.m, fwd.R, mask, M=10**4, block_sizes=(Br, Bc), hbm=hbm_b)
    for hbm, names in ((hbm_f, ("Q",)), (hbm_b, ("Q", "O", "dO"))):
        for name in names:
            assert hbm.per_array[name]["reads"] == nnz * Br * d  # one Q_i (O_i, dO_i) per non-zero block
    dense_f = HBM()
    blocksparse_forward(Q, K, V, [[True] * 4] * 6, M=10**4, block_sizes=(Br, Bc), hbm=dense_f)
    assert hbm_f.total < dense_f.total


def test_block_mask_as_tensor_or_nested_list_agree(seed):
    Q, K, V = (torch.randn(20, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(5, 4) < 0.6
    a = blocksparse_forward(Q, K, V, mask, M=80).O  # Br = min(ceil(80 / 16), 4) = 4, Bc = 5
    b = blocksparse_forward(Q, K, V, mask.tolist(), M=80).O
    assert torch.equal(a, b)


def test_expand_block_mask_repeats_blocks_and_crops_the_ragged_edge():
    m = expand_block_mask([[True, False], [False, True]], 3, 2, 5, 3)
    expected = torch.tensor([[1, 1, 0]] * 3 + [[0, 0, 1]] * 2, dtype=torch.bool)
    assert torch.equal(m, expected)

"""Bad input raises ValueError naming the argument, its value and what was expected."""
import pytest
import torch

from flashtile.reference.blocksparse import blocksparse_forward
from flashtile.reference.fa1 import fa1_backward, fa1_forward
from flashtile.reference.fa2 import fa2_backward, fa2_forward
from flashtile.reference.standard import standard_backward, standard_forward

N_q, N_k, d = 12, 10, 8
Q, K, V, O, dO = (torch.randn(n, d) for n in (N_q, N_k, N_k, N_q, N_q))
l, m = torch.ones(N_q), torch.zeros(N_q)
P = torch.rand(N_q, N_k)
M = 4 * d * 4  # Br = Bc = 4: Tr = 3, Tc = 3

CASES = {
    "K head dim": (lambda: fa1_forward(Q, torch.randn(N_k, d + 1), V, M=M), r"K=shape \(10, 9\); expected \(10, 8\)"),
    "V length": (lambda: fa2_forward(Q, K, torch.randn(N_k + 1, d), M=M), r"V=shape \(11, 8\)"),
    "Q 1-D": (lambda: standard_forward(torch.randn(d), K, V), r"Q=torch.float32 \(8,\); expected a 2-D float"),
    "Q integer": (lambda: fa1_forward(Q.long(), K, V, M=M), r"Q=torch.int64"),
    "K dtype": (lambda: fa2_forward(Q, K.double(), V, M=M), r"K=dtype torch.float64; expected Q's dtype"),
    "padding shape": (lambda: fa1_forward(Q, K, V, M=M, key_padding_mask=torch.ones(N_q, dtype=torch.bool)),
                      r"key_padding_mask=torch.bool \(12,\); expected a bool tensor of shape \(N_k,\) = \(10,\)"),
    "padding dtype": (lambda: standard_forward(Q, K, V, key_padding_mask=torch.ones(N_k)),
                      r"key_padding_mask=torch.float32"),
    "dropout_p": (lambda: fa2_forward(Q, K, V, M=M, dropout_p=1.0), r"dropout_p=1.0; expected a float in \[0, 1\)"),
    "softmax_scale": (lambda: standard_forward(Q, K, V, softmax_scale=float("nan")), r"softmax_scale=nan"),
    "M zero": (lambda: fa1_forward(Q, K, V, M=0), r"M=0; expected the SRAM size in elements"),
    "M float": (lambda: fa2_forward(Q, K, V, M=512.0), r"M=512.0"),
    "M too small for d": (lambda: fa2_forward(Q, K, V, M=20), r"M=20 elements"),
    "block_sizes": (lambda: fa1_forward(Q, K, V, M=M, block_sizes=(0, 4)), r"block_sizes=\(0, 4\)"),
    "block_mask shape": (lambda: blocksparse_forward(Q, K, V, [[True] * 3] * 2, M=M),
                         r"block_mask=shape \(2, 3\); expected \(Tr, Tc\) = \(3, 3\)"),
    "block_mask ragged": (lambda: blocksparse_forward(Q, K, V, [[True] * 3, [True] * 2, [True] * 3], M=M),
                          r"block_mask=shape"),
    "block_mask meta": (lambda: blocksparse_forward(Q, K, V, torch.ones(3, 3, device="meta"), M=M),
                        r"block_mask=a meta tensor"),
    "O shape": (lambda: fa1_backward(Q, K, V, O[:-1], dO, l, m, (0, 0), M=M), r"O=shape \(11, 8\); expected \(12, 8\)"),
    "l shape": (lambda: fa1_backward(Q, K, V, O, dO, l[:-1], m, (0, 0), M=M), r"l=shape \(11,\)"),
    "R": (lambda: fa1_backward(Q, K, V, O, dO, l, m, 7, M=M), r"R=7; expected the RNG state \(seed, offset\)"),
    "L dtype": (lambda: fa2_backward(Q, K, V, O, dO, torch.zeros(N_q, dtype=torch.long), M=M), r"L=torch.int64"),
    "P shape": (lambda: standard_backward(Q, K, V, O, dO, P.T), r"P=shape \(10, 12\); expected \(12, 10\)"),
    "head index": (lambda: fa1_forward(Q, K, V, M=M, h=2, nheads=2), r"h=2; expected a head index < nheads=2"),
    "seed": (lambda: fa2_forward(Q, K, V, M=M, seed=-1), r"seed=-1"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_raises_value_error_naming_the_argument(case):
    call, match = CASES[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="window_size"):
        fa1_forward(Q, K, V, M=M, window_size=(3, 3))

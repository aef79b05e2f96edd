"""The polynomial exp2 of kernels/exp2.py (FA4's offload of exponentials to the FMA units): the polynomial's
accuracy against float64, masked (-inf) scores, and the inline PTX it generates. The PTX itself runs only on a
GPU (tests/gpu/test_fp8_gluon_gpu.py and the compile check in test_fa3_gluon.py)."""
import pytest
import torch

from flashtile.kernels import exp2


def test_polynomial_relative_error_within_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.linspace(-126, 9, 400_001, dtype=torch.float64),
                   torch.empty(100_000, dtype=torch.float64).uniform_(-30, 9, generator=gen)])
    x = x.float()
    got = exp2.reference(x).double()
    rel = ((got - torch.exp2(x.double())) / torch.exp2(x.double())).abs()
    assert rel.max().item() <= exp2.MAX_REL_ERR
    assert rel.max().item() > exp2.MAX_REL_ERR / 2   # the bound is the polynomial's, not a loose one


def test_masked_scores_give_zero_not_nan():
    got = exp2.reference(torch.tensor([float("-inf"), -1e30, -127.0, -500.0]))
    assert torch.isfinite(got).all() and (got <= 2.0 ** -126).all() and (got >= 0).all()


@pytest.mark.parametrize("pack,n_poly", [(8, 0), (8, 1), (8, 2), (4, 4), (2, 1)])
def test_ptx_takes_n_poly_values_by_polynomial(pack, n_poly):
    asm, constraints = exp2.ptx(pack, n_poly)
    assert asm.count("add.rm.ftz.f32") == n_poly and asm.count("ex2.approx.ftz.f32") == pack - n_poly
    assert constraints.split(",") == ["=r"] * pack + ["r"] * pack
    for i in range(2 * pack):   # every output written, every input read
        assert f"${i}," in asm or f"${i};" in asm


def test_ptx_rejects_bad_count():
    with pytest.raises(ValueError, match="n_poly"):
        exp2.ptx(4, 5)

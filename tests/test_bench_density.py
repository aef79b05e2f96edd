"""benchmarks/bench_density.py without a GPU: the causal tile tables, the block masks both providers get from one set of
tile lists, the least-squares fit on synthetic timings, and main() at a tiny size on the CPU (flashtile through the
Triton interpreter, torch FlexAttention as an eager forward check), the oracle check and the time budget included.

CPU times are single calls through the interpreter and say nothing about the kernels; these tests check the script.
"""
import json

import pytest
import torch

from bench_utils import script_module
from flashtile.flex import causal_mask
from flex_utils import tile_classes

# one batch row, one head of 16, 32 tokens in 16-token tiles: 3 causal tiles, the 2 diagonal ones always kept
TINY = ["--seqlens", "32", "--block", "16", "--batch", "1", "--heads", "1", "--headdim", "16", "--densities",
        "0.6,1.0"]


@pytest.fixture(scope="module")
def bench():
    yield from script_module("bench_density")


def test_tile_tables_are_causal_nested_and_of_the_asked_density(bench):
    n, total = 8, 36
    densities = [0.1, 0.2, 0.5, 0.9, 1.0]
    tables = bench.causal_tile_tables(n, densities, seed=3)
    prev = None
    for x in densities:
        t = tables[x]
        assert t.diagonal().all() and not t.triu(1).any()              # diagonal kept, nothing above it
        assert int(t.sum()) == max(n, round(x * total))
        assert bench.tile_density(t) == int(t.sum()) / total
        if prev is not None:
            assert not (prev & ~t).any()                                # each density contains the previous one
        prev = t
    assert tables[1.0].equal(torch.ones(n, n, dtype=torch.bool).tril())
    assert bench.causal_tile_tables(n, densities, seed=3)[0.5].equal(tables[0.5])   # seeded


def test_both_block_masks_are_the_tile_table_under_causal(bench):
    s, bs = 64, 16
    table = bench.causal_tile_tables(s // bs, [0.5], seed=1)[0.5]
    tab = table.clone()
    ft, tb = bench.block_masks(table, s, bs, "cpu", bench.torch_mask_mod(tab, bs))
    i = torch.arange(s)
    want = (i.view(1, -1) <= i.view(-1, 1)) & table.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    # flashtile's: the diagonal tiles partial (its mask_mod is kv <= q), the other kept tiles full, the rest empty
    eye = torch.eye(s // bs, dtype=torch.long)
    assert tile_classes(ft, 1, 1)[0, 0].equal(eye + 2 * (table.long() - eye))
    assert ft.mask_mod.fn is causal_mask().fn
    assert ft.density() == pytest.approx(int(table.sum()) / table.numel())
    assert bench.visible_pairs(table, bs) == int(want.sum())
    # torch's: the same lists (kv and the transposed q lists) and the whole mask as its mask_mod
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert getattr(tb, name).equal(getattr(ft, name)), name
    for name in ("q_num_blocks", "full_q_num_blocks"):
        assert getattr(tb, name).equal(getattr(ft, name)), name
    assert tb.to_dense()[0, 0].bool().equal(table)
    assert tb.mask_mod(0, 0, i.view(-1, 1), i.view(1, -1)).equal(want)


def test_fit_recovers_a_line_and_reports_residuals_and_the_target(bench):
    xs = [0.1 * i for i in range(1, 11)]
    rows = [dict(provider="p", seqlen=4096, pass_="fwd", density=x, ms=2.0 * x + 0.05) for x in xs]
    rows += [dict(provider="p", seqlen=4096, pass_="fwd+bwd", density=x, ms=5.0 * x + 1.0 + (0.02 if i == 3 else 0))
             for i, x in enumerate(xs)]
    rows += [dict(provider="q", seqlen=4096, pass_="fwd", density=0.5, ms=1.0)]         # one point: no fit
    fits = {(f["provider"], f["pass_"]): f for f in bench.fit_rows(rows)}
    assert set(fits) == {("p", "fwd"), ("p", "fwd+bwd")}
    f = fits[("p", "fwd")]
    assert f["a_ms"] == pytest.approx(2.0) and f["b_ms"] == pytest.approx(0.05)
    assert f["r2"] == pytest.approx(1.0) and f["max_abs_residual_rel"] == pytest.approx(0.0, abs=1e-12)
    assert f["t_dense_ms"] == pytest.approx(2.05) and f["b_over_dense"] == pytest.approx(0.05 / 2.05)
    assert f["meets_target"] is True
    g = fits[("p", "fwd+bwd")]
    assert g["b_over_dense"] == pytest.approx(g["b_ms"] / 6.0) and g["meets_target"] is False   # b ~ 1 of 6 ms
    assert 0.99 < g["r2"] < 1.0
    for p in g["points"]:
        assert p["ms"] == pytest.approx(p["fit_ms"] + p["residual_ms"])
        assert p["residual_rel"] == pytest.approx(p["residual_ms"] / p["ms"])
        assert p["fit_ms"] == pytest.approx(g["a_ms"] * p["density"] + g["b_ms"])
    assert sum(p["residual_ms"] for p in g["points"]) == pytest.approx(0.0, abs=1e-12)   # least squares
    worst = max(g["points"], key=lambda p: abs(p["residual_ms"]))
    assert worst["density"] == pytest.approx(0.4)                           # the perturbed point
    # without density 1.0 timed there is no dense time to compare b with
    part = bench.fit_rows([r for r in rows if r["density"] < 0.95])
    assert all(f["t_dense_ms"] is None and f["meets_target"] is None for f in part)


def test_tiny_cpu_run_checks_times_and_fits(bench, tmp_path):
    assert bench.main(TINY + ["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_density.json").read_text())
    checks = result["checks"]
    assert {c["provider"] for c in checks} == {"flashtile.flex", "torch.flex"}
    assert all(c["ok"] and c["rel_err"] < 0.02 for c in checks) and len(checks) == 4
    assert [c["density"] for c in checks if c["provider"] == "flashtile.flex"] == [2 / 3, 1.0]
    rows = result["rows"]
    assert {(r["provider"], r["pass_"]) for r in rows} == {("flashtile.flex", "fwd"), ("flashtile.flex", "fwd+bwd")}
    assert all(r["ms"] > 0 for r in rows)
    assert {(f["provider"], f["pass_"]) for f in result["fits"]} == {("flashtile.flex", "fwd"),
                                                                     ("flashtile.flex", "fwd+bwd")}
    assert "torch.flex" in result["not_run"] and result["dense"][0]["seqlen"] == 32
    md = (tmp_path / "bench_density.md").read_text()
    assert "b / t(1.0)" in md and "Checks: 4 of 4" in md


def test_a_spent_budget_skips_every_point(bench, tmp_path):
    assert bench.main(TINY + ["--budget-s", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_density.json").read_text())
    assert result["rows"] == [] and result["checks"] == [] and result["fits"] == []
    assert [s["target_density"] for s in result["skipped"]] == [0.6, 1.0]
    assert all("--budget-s 0" in s["reason"] for s in result["skipped"])


def test_seqlens_must_be_whole_tiles(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--seqlens", "40", "--block", "16"])

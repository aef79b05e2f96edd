"""benchmarks/bench_flex.py and its FA4 provider (benchmarks/fa4_masks.py) without a GPU: the float32 row reference
with a score_mod, the check that keeps a wrong provider from being timed, FA4 absent (reported, not a crash), the
torch BlockMask fields FA4 gets, and main() at a tiny size on the CPU (flashtile through the Triton interpreter,
torch FlexAttention as an eager forward check), the time budget included.

CPU times are single calls through the interpreter and say nothing about the kernels; these tests check the script.
"""
import json
import sys

import pytest
import torch

from bench_utils import script_module
from flashtile.bench import measure
from flashtile.reference.dense import attention_ref

TINY = ["--small", "--seqlens", "64", "--heads", "1", "--headdim", "16", "--no-construction"]


@pytest.fixture(scope="module")
def bench():
    yield from script_module("bench_flex")
    sys.modules.pop("fa4_masks", None)


def _qkv(b, s, h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g) for _ in range(3))


def test_reference_rows_apply_the_alibi_score_mod_per_head(bench):
    b, s, h, d = 2, 40, 4, 16
    q, k, v = _qkv(b, s, h, d)
    m = bench.make_masks(s, b, h, window=8, sinks=2, dev="cpu")["alibi"]
    rows = torch.tensor([0, 7, 21, 39])
    got = bench.reference_rows(q, k, v, m["torch_fn"], rows, m["torch_score"])
    want, _, _ = attention_ref(q, k, v, causal=True, alibi_slopes=measure.alibi_slopes(h))
    torch.testing.assert_close(got.double(), want[:, rows], rtol=0, atol=1e-5)


def test_a_wrong_output_is_not_timed_and_a_failing_backward_is_forward_only(bench):
    b, s, h, d = 1, 32, 2, 16
    q, k, v = (t.requires_grad_() for t in _qkv(b, s, h, d))
    m = bench.make_masks(s, b, h, window=8, sinks=2, dev="cpu")["sliding"]
    rows = torch.arange(s)

    def right():
        return attention_ref(q, k, v, attn_mask=m["torch_fn"](0, 0, rows.view(-1, 1), rows.view(1, -1)),
                             upcast=False)[0]

    def no_backward():
        return right().detach().requires_grad_()          # a leaf: autograd.grad(out, (q, k, v)) raises

    base = dict(to_bshd=lambda t: t, grads=[q, k, v], g_out=torch.ones_like(q), mask_fn=m["torch_fn"])
    res, entry = bench.check_provider(dict(base, fn=right), q, k, v, rows, 0.02)
    assert entry["status"] == "ok" and entry["rel_err_vs_fp32_rows"] < 1e-5 and "bwd_error" not in entry
    assert all(g is not None for g in res[1:])
    _, entry = bench.check_provider(dict(base, fn=lambda: 1.5 * right()), q, k, v, rows, 0.02)
    assert entry["status"] == "wrong"
    pv = dict(base, fn=no_backward)
    res, entry = bench.check_provider(pv, q, k, v, rows, 0.02)
    assert entry["status"] == "ok" and entry["bwd_error"].startswith("backward failed: ") and res[1] is None
    assert pv["bwd_error"] == entry["bwd_error"]           # the timing loop reads it: forward only


def test_fa4_absent_says_why_and_refuses_every_row(bench):
    import fa4_masks
    if fa4_masks.IMPORT_ERROR is None:
        pytest.skip("FA4 imports here")
    assert fa4_masks.unavailable("cpu") == "FA4 (CuTe DSL) runs on CUDA GPUs only"
    m = bench.make_masks(64, 1, 2, window=8, sinks=2, dev="cpu")
    for row in fa4_masks.ROWS:
        with pytest.raises(fa4_masks.Unsupported, match="import flash_attn.cute failed"):
            fa4_masks.attention(row, m[row], None, None, None, None)


def test_fa4_block_sparse_fields_are_torch_blockmask_lists(bench):
    fa4_masks = pytest.importorskip("fa4_masks")
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 256, 256, device="cpu", BLOCK_SIZE=128)
    fwd, bwd = fa4_masks.block_sparse_lists(bm)
    assert fwd["mask_block_cnt"] is bm.kv_num_blocks and fwd["mask_block_idx"] is bm.kv_indices
    assert fwd["full_block_cnt"] is bm.full_kv_num_blocks and fwd["full_block_idx"] is bm.full_kv_indices
    assert bwd["mask_block_cnt"] is bm.q_num_blocks and bwd["mask_block_idx"] is bm.q_indices
    assert bwd["full_block_cnt"] is bm.full_q_num_blocks and bwd["full_block_idx"] is bm.full_q_indices
    assert fwd["block_size"] == bwd["block_size"] == (128, 128) == fa4_masks.BLOCK_SIZE


def test_tiny_cpu_run_with_fa4_absent(bench, tmp_path):
    argv = TINY + ["--masks", "alibi", "--providers", "flashtile,torch,fa4", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "bench_flex.json").read_text())
    assert "fa4" in result["not_run"] and "torch.flex" not in result["not_run"]
    checks = {c["provider"]: c for c in result["checks"]}
    assert set(checks) == {"flashtile.flex", "torch.flex"}
    assert all(c["status"] == "ok" and c["rel_err_vs_fp32_rows"] < 0.02 for c in checks.values())
    assert checks["flashtile.flex"]["max_abs_diff_vs_torch.flex_out"] < 0.05
    assert {(r["provider"], r["pass_"]) for r in result["rows"]} == {("flashtile.flex", "fwd"),
                                                                     ("flashtile.flex", "fwd+bwd")}
    assert all(r["ms"] > 0 for r in result["rows"])
    md = (tmp_path / "bench_flex.md").read_text()
    assert "- fa4: FA4 (CuTe DSL) runs on CUDA GPUs only" in md and "| fwd+bwd | flashtile.flex |" in md


def test_a_spent_budget_skips_every_case_and_unknown_names_are_refused(bench, tmp_path):
    assert bench.main(TINY + ["--providers", "flashtile", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_flex.json").read_text())
    assert result["rows"] == [] and result["checks"] == []
    assert [s["mask"] for s in result["skipped"]] == list(bench.MASKS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--providers", "flashtile,fa5"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--masks", "causal"])

"""benchmarks/bench_features.py without a GPU: the FLOP count's visible pairs against a brute-force count, the rows'
shapes and labels, the ALiBi slopes, and main() on the CPU at tiny sizes (flashtile through the Triton interpreter;
FA4 and cuDNN recorded as skipped with the reason), including the correctness gate and the time budget.

CPU times are time.perf_counter medians through the interpreter and say nothing about the kernels; these tests check
the script, not the speed.
"""
import json
import math

import pytest
import torch

from bench_utils import script_module
from flashtile.bench import measure

# One batch row of 128 tokens, 2 heads of 32, float32, one warm-up call and one timed call per point.
TINY = ["--device", "cpu", "--seqlen", "128", "--headdim", "32", "--batch", "1", "--nheads", "2", "--dtype", "fp32",
        "--unaligned-offset", "24", "--windows", "32:0,16:16", "--doc-lens", "64,48", "--groups", "2", "--warmup-ms",
        "0.001", "--rep-ms", "0.001"]
ROWS = ["dense", "dense-causal", "unaligned", "unaligned-causal", "softcap", "softcap-causal", "window-32-0",
        "window-16-16", "varlen-64", "varlen-64-causal", "varlen-48", "varlen-48-causal", "alibi", "alibi-causal",
        "gqa-2", "gqa-2-causal"]


@pytest.fixture(scope="module")
def bench():
    yield from script_module("bench_features")


def brute_force_pairs(sq, sk, left, right, causal):
    """(i, j) pairs with i + sk - sq - left <= j <= i + sk - sq + right (-1: that side unbounded; causal: right 0)."""
    right = 0 if causal else right
    count = 0
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            count += (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
    return count


def test_visible_pairs_is_the_brute_force_count():
    for sq in (1, 2, 5, 9):
        for sk in (1, 3, 5, 8):
            for left in (-1, 0, 1, 3, 12):
                for right in (-1, 0, 2, 12):
                    for causal in (False, True):
                        want = brute_force_pairs(sq, sk, left, right, causal)
                        assert measure.visible_pairs(sq, sk, (left, right), causal) == want, (sq, sk, left, right,
                                                                                              causal)


def test_points_count_pairs_per_document_and_flops_per_mode(bench):
    rows = {r.name: r for r in bench.build_rows(30.0, [(4096, 0), (1024, 1024)], [2048, 1024], [4, 16])}
    assert list(rows) == ["dense", "dense-causal", "unaligned", "unaligned-causal", "softcap", "softcap-causal",
                          "window-4096-0", "window-1024-1024", "varlen-2048", "varlen-2048-causal", "varlen-1024",
                          "varlen-1024-causal", "alibi", "alibi-causal", "gqa-4", "gqa-4-causal", "gqa-16",
                          "gqa-16-causal"]

    def point(name, seqlen=8192):
        return bench.Point(rows[name], 128, seqlen, 2, 16, 192)

    assert point("dense").label() == "dense 8192"
    assert point("unaligned-causal").length == 8000
    assert point("unaligned-causal").label() == "dense 8000 causal (unaligned)"
    assert point("softcap").label() == "softcap 30"
    assert point("window-4096-0").label() == "window (4096, 0)"
    assert point("alibi-causal").label() == "ALiBi 8192 causal"
    assert point("gqa-4-causal").label() == "GQA 16 / 4 heads 8192 causal" and point("gqa-4").nheads_k == 4
    assert point("gqa-16").label() == "MQA 16 / 1 heads 8192" and point("dense").nheads_k == 16
    assert point("gqa-4").pairs() == point("dense").pairs()             # (FLOPs count the query heads)
    assert point("varlen-2048").doc_lens == [2048] * 4 and point("varlen-2048").label() == "varlen 4 docs x 2048"
    assert point("varlen-1024-causal").label() == "varlen 8 docs x 1024 causal"
    assert point("varlen-2048", 16384).doc_lens == [2048] * 8           # the documents scale with --seqlen
    assert point("varlen-2048", 5000).doc_lens == [2048, 2048, 904]     # a shorter last one where L does not divide

    n = 8192
    assert point("dense").pairs() == 2 * n * n
    assert point("dense-causal").pairs() == 2 * n * (n + 1) // 2
    assert point("varlen-1024-causal").pairs() == 2 * 8 * 1024 * 1025 // 2
    assert point("window-4096-0").pairs() == 2 * measure.visible_pairs(n, n, (4096, 0))
    for mode, factor in (("fwd", 1.0), ("bwd", 2.5), ("train", 3.5)):
        p = point("softcap-causal")
        assert p.flops(mode) == 4 * 128 * p.pairs() * 16 * factor


def test_alibi_slopes_are_the_geometric_sequence(bench):
    assert torch.equal(bench.alibi_slopes(16), torch.tensor([2.0 ** (-0.5 * (i + 1)) for i in range(16)]))
    assert bench.alibi_slopes(16).dtype == torch.float32
    # not a power of two: the 8-head slopes, then every other slope of the 16-head sequence
    want = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert torch.allclose(bench.alibi_slopes(12), torch.tensor(want))


def test_peers_refuse_what_they_cannot_express(bench):
    rows = {r.name: r for r in bench.build_rows(30.0, [(32, 0)], [64])}
    avail = {p: {"available": True, "reason": None, "description": ""} for p in ("fa4", "cudnn")}
    for name, fa4, cudnn in (("alibi", "alibi_slopes", "ALiBi slopes"), ("softcap", None, "a softcap"),
                             ("window-32-0", None, "a sliding window"), ("varlen-64-causal", None, "packed documents")):
        point = bench.Point(rows[name], 32, 128, 1, 2, 24)
        if fa4:
            with pytest.raises(bench.Unsupported, match=fa4):
                bench.fa4_call(point, None, "cpu", torch.float32)
        recs = bench.run_point(point, ["cudnn"] + (["fa4"] if fa4 else []), avail, ["fwd", "train"], torch.float32,
                               torch.device("cpu"), 0, 0.001, 0.001, log=lambda text: None)
        assert len(recs) == (4 if fa4 else 2)
        for r in recs:
            assert r["status"] == "skipped" and r["reason"].startswith("unsupported: "), r
            assert (cudnn if r["provider"] == "cudnn" else fa4) in r["reason"]


def _run(bench, tmp_path, argv):
    out = tmp_path / "features.json"
    code = bench.main(TINY + argv + ["--out", str(out)])
    return code, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_cpu_run_records_every_requested_row(bench, tmp_path, capsys):
    code, result, md = _run(bench, tmp_path, ["--mode", "fwd", "--rows", *ROWS])
    assert code == 0
    assert result["schema"] == bench.SCHEMA
    env = result["environment"]
    for key in ("gpu", "torch", "triton", "git_commit", "command"):
        assert key in env, key
    recs = {(r["row"], r["provider"], r["mode"]): r for r in result["results"]}
    assert set(recs) == {(row, p, "fwd") for row in ROWS for p in ("flashtile", "fa4", "cudnn")}
    for row in ROWS:
        ft = recs[(row, "flashtile", "fwd")]
        assert ft["status"] == "ok", ft
        assert math.isfinite(ft["ms"]) and ft["ms"] > 0 and math.isfinite(ft["tflops"]) and ft["tflops"] > 0
        assert ft["errors"]["out_vs_reference"] < ft["tol"]
        assert ft["label"] in md
        for peer in ("fa4", "cudnn"):      # no CUDA here: skipped, with the reason
            r = recs[(row, peer, "fwd")]
            assert r["status"] == "skipped" and r["reason"].startswith("unavailable: ") and r["ms"] is None
    assert recs[("varlen-48", "flashtile", "fwd")]["doc_lens"] == [48, 48, 32]
    assert recs[("unaligned", "flashtile", "fwd")]["length"] == 104
    assert recs[("gqa-2", "flashtile", "fwd")]["nheads_k"] == 1 and recs[("dense", "flashtile", "fwd")]["nheads_k"] == 2
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("|") and "flashtile / FA4" in printed   # the TFLOP/s tables come last


def test_cpu_run_times_backward_and_training(bench, tmp_path):
    code, result, _ = _run(bench, tmp_path, ["--mode", "fwd", "bwd", "train", "--providers", "flashtile",
                                             "--rows", "varlen-48-causal"])
    assert code == 0
    recs = {r["mode"]: r for r in result["results"]}
    assert set(recs) == {"fwd", "bwd", "train"}
    for r in recs.values():
        assert r["status"] == "ok" and math.isfinite(r["tflops"]), r
    assert recs["bwd"]["flops"] == 2.5 * recs["fwd"]["flops"] and recs["train"]["flops"] == 3.5 * recs["fwd"]["flops"]


def test_peers_are_checked_against_flashtile_and_timed_beside_it(bench, tmp_path, monkeypatch):
    """FA4 and cuDNN stood in for by torch SDPA on the CPU, FA4's in flash-attn's layout and cuDNN's in PyTorch's:
    every output and gradient is compared with flashtile's (dK, dV of a GQA row with its K / V heads), and the ratios
    are filled in."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fake_fa4(point, inp, device, dtype):
        return lambda q, k, v: sdpa(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=point.row.causal,
                                    enable_gqa=True).transpose(1, 2)

    def fake_cudnn(point, inp, device, dtype):
        return lambda q, k, v: sdpa(q, k, v, is_causal=point.row.causal, enable_gqa=True)

    monkeypatch.setitem(bench.CALLS, "fa4", (fake_fa4, "bshd"))
    monkeypatch.setitem(bench.CALLS, "cudnn", (fake_cudnn, "bhsd"))
    ready = {"available": True, "reason": None, "description": "", "importable": True, "layout": ""}
    monkeypatch.setattr(bench, "available_providers", lambda device, dtype, registry: {p: ready for p in registry})
    code, result, md = _run(bench, tmp_path, ["--mode", "fwd", "train", "--rows", "unaligned-causal", "gqa-2-causal"])
    assert code == 0
    recs = {(r["row"], r["provider"], r["mode"]): r for r in result["results"]}
    assert set(recs) == {(row, p, m) for row in ("unaligned-causal", "gqa-2-causal")
                         for p in ("flashtile", "fa4", "cudnn") for m in ("fwd", "train")}
    for (row, provider, mode), r in recs.items():
        assert r["status"] == "ok" and math.isfinite(r["tflops"]), r
        names = {"out_vs_reference"} | ({"out_vs_flashtile", "dq_vs_flashtile", "dk_vs_flashtile",
                                         "dv_vs_flashtile"} if provider != "flashtile" else set())
        assert set(r["errors"]) == names
        assert all(e < 1e-4 for e in r["errors"].values()), r["errors"]
    table = md.split("forward + backward: TFLOP/s")[1]
    line = next(ln for ln in table.splitlines() if ln.startswith("| dense 104 causal (unaligned) |"))
    assert line.count("x |") == 2 and "skip" not in line      # flashtile / FA4 and flashtile / cuDNN SDPA


def test_a_wrong_output_is_reported_and_not_timed(bench, tmp_path, monkeypatch):
    make, layout = bench.CALLS["flashtile"]

    def off_by_half(point, inp, device, dtype):
        attn = make(point, inp, device, dtype)
        return lambda q, k, v: 1.5 * attn(q, k, v)

    monkeypatch.setitem(bench.CALLS, "flashtile", (off_by_half, layout))
    code, result, md = _run(bench, tmp_path, ["--mode", "fwd", "--providers", "flashtile", "--rows", "dense"])
    assert code == 1
    (r,) = result["results"]
    assert r["status"] == "wrong" and r["ms"] is None and r["errors"]["out_vs_reference"] > r["tol"]
    assert "differs from the float64 reference" in md


def test_points_past_the_budget_are_skipped(bench, tmp_path):
    code, result, _ = _run(bench, tmp_path, ["--budget-s", "0", "--rows", "dense", "alibi"])
    assert code == 0
    assert len(result["results"]) == 2 * 3 * 2
    assert all(r["status"] == "skipped" and r["reason"] == "budget" for r in result["results"])


def test_bad_arguments_are_refused(bench, tmp_path):
    for argv in (["--rows", "no-such-row"], ["--providers", "flashtile,fa5"], ["--unaligned-offset", "200"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(TINY + argv + ["--out", str(tmp_path / "x.json")])
        assert exc.value.code == 2

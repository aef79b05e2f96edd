"""BENCHMARKS.md and the README's performance table are what benchmarks/make_benchmarks_md.py writes from the
committed reference results, and every figure they print comes from a results file.

Cheap: the generator reads a few hundred KB of JSON and Markdown; nothing is imported from flashtile and no GPU is
needed. When a test here fails after new results were committed, run `python benchmarks/make_benchmarks_md.py`.
"""
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "make_benchmarks_md.py"
RESULTS = ROOT / "benchmarks" / "results"

# A number standing on its own: not part of a name (float64, d128, H200, FA4, cu130) or of a section sign.
NUMBER = re.compile(r"(?<![A-Za-z0-9_.§])\d+(?:\.\d+)*")
# Conventions of the method the report may state without a results file behind them: the FLOP factors of the FA3
# paper's convention (forward 4 n^2 d, backward 2.5x, forward + backward 3.5x) and the FP8 target (1.5x bf16).
CONVENTIONS = {"4", "2.5", "3.5", "1.5"}


def _generator():
    spec = importlib.util.spec_from_file_location("make_benchmarks_md", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _generator()


def _readme_block(gen, text):
    start, end = text.index(gen.README_BEGIN), text.index(gen.README_END)
    return text[start + len(gen.README_BEGIN):end].strip("\n").splitlines()


def test_benchmarks_md_is_what_the_generator_writes(gen):
    text, table, _ = gen.build()
    committed = (ROOT / "BENCHMARKS.md").read_text()
    assert committed == text, "BENCHMARKS.md differs from the results: run python benchmarks/make_benchmarks_md.py"
    readme = (ROOT / "README.md").read_text()
    assert _readme_block(gen, readme) == table, \
        "README.md's performance table differs from the results: run python benchmarks/make_benchmarks_md.py"
    assert gen.main(["--check"]) == 0


def test_benchmarks_md_says_it_is_generated_and_stays_short():
    text = (ROOT / "BENCHMARKS.md").read_text()
    head = "\n".join(text.splitlines()[:8])
    assert "generated" in head.lower() and "python benchmarks/make_benchmarks_md.py" in head
    assert len(text.splitlines()) <= 300
    for word in ("session", "twenty", "eighteenth"):           # no history: git keeps it
        assert word not in text.lower(), word


def test_the_generator_is_deterministic(gen):
    first = gen.build()
    second = gen.build()
    assert first[0] == second[0] and first[1] == second[1]


def test_every_figure_comes_from_a_results_file(gen):
    """Built with each figure marked: outside the marks no number is left but the method's conventions, every
    mark names an existing results file (or is a convention), and the marks change nothing else."""
    plain_text, plain_table, _ = gen.build()
    text, table, doc = gen.build(marked=True)
    left, right = doc.MARK
    for marked, plain in ((text, plain_text), ("\n".join(table), "\n".join(plain_table))):
        assert marked.replace(left, "").replace(right, "") == plain
        outside = re.sub(re.escape(left) + ".*?" + re.escape(right), " ", marked)
        stray = sorted({m.group(0) for m in NUMBER.finditer(outside)})
        assert not stray, f"numbers printed without a results file behind them: {stray}"
    assert doc.sources
    for printed, source in doc.sources:
        if source == "convention":
            assert printed in CONVENTIONS, f"{printed!r} is printed as a convention; conventions are {CONVENTIONS}"
        else:
            assert source.startswith("benchmarks/results/") and (ROOT / source).is_file(), source


def test_the_figures_follow_the_results(gen, tmp_path):
    """Change one measurement in a copy of the results: the report changes with it (nothing is hard-coded)."""
    copy = tmp_path / "benchmarks" / "results"
    shutil.copytree(RESULTS, copy)
    before, table_before, _ = gen.build(copy)
    path = copy / "h200" / "dense-b.json"
    data = json.loads(path.read_text())
    record = next(r for r in data["results"] if (r["provider"], r["mode"], r["causal"], r["headdim"], r["seqlen"])
                  == ("flashtile", "fwd", False, 64, 8192))
    value = record["tflops"] = 2 * record["tflops"]           # flashtile twice as fast at d64, 8k, full
    path.write_text(json.dumps(data))
    after, table_after, _ = gen.build(copy)
    assert after != before and table_after != table_before
    assert f"| 64 | fwd | {value:.0f} / " in "\n".join(table_after)


def test_a_results_file_missing_from_its_readme_is_refused(gen, tmp_path):
    copy = tmp_path / "benchmarks" / "results"
    shutil.copytree(RESULTS, copy)
    readme = copy / "h200" / "README.md"
    readme.write_text("\n".join(line for line in readme.read_text().splitlines()
                                if not line.startswith("| decode.json |")) + "\n")
    with pytest.raises(SystemExit, match="decode.json"):
        gen.build(copy)


H200 = "NVIDIA H200"


def _features_table(text, gpu=H200):
    """(header cells, {input label: cells}) of the feature benchmark's table in the section of one GPU in a
    BENCHMARKS.md text, the rows of its first head dim (column d, left out of the cells)."""
    section = text.split(f"## Inputs models send (feature benchmark), {gpu}")[1].split("\n## ")[0]
    table = section.split("\n| d | input |")[1].split("\n\n")[0]
    rows = [line[2:-2].split(" | ") for line in ("| d | input |" + table).splitlines() if line.startswith("| ")]
    return rows[0][1:], {cells[1]: cells[1:] for cells in rows[1:] if cells[0] == rows[1][0]}


def _misses_of(text, gpu):
    """The clause of the known misses' "Features below FA4" line for one GPU."""
    line = text.split("**Features below FA4.**")[1].split("\n")[0]
    return line.split(f"({gpu},")[1].split("fwd + bwd below FA4")[0].split("Limit:")[0]


def test_the_feature_benchmark_section_follows_its_json(gen, tmp_path):
    """The feature benchmark's table and its known-miss line come from features-*.json: one row per input in the
    benchmark's order, a measurement changed in the JSON changes its cells, a provider the JSON records as skipped
    shows as -, and a row no longer below FA4 in forward + backward leaves the known misses."""
    copy = tmp_path / "benchmarks" / "results"
    shutil.copytree(RESULTS, copy)
    path = copy / "h200" / "features-8k.json"
    data = json.loads(path.read_text())
    first = [r for r in data["results"] if r["headdim"] == data["settings"]["headdims"][0]]   # the first table's
    recs = {(r["row"], r["mode"], r["provider"]): r for r in first}
    dense = recs[("dense", "train", "flashtile")]["label"]
    before, _, _ = gen.build(copy)
    header, rows = _features_table(before)
    assert list(rows) == list(dict.fromkeys(r["label"] for r in first))
    fwd_cudnn = header.index("/ cuDNN")
    train = header.index("fwd + bwd: flashtile TFLOP/s")
    train_fa4 = train + header[train:].index("/ FA4")
    alibi = recs[("alibi", "fwd", "fa4")]
    assert alibi["status"] == "skipped" and rows[alibi["label"]][header.index("FA4")] == "-"
    assert rows[dense][fwd_cudnn] != "-"
    assert f"{dense}: " in _misses_of(before, H200)

    value = recs[("dense", "train", "flashtile")]["tflops"] = 2 * recs[("dense", "train", "fa4")]["tflops"]
    recs[("dense", "fwd", "cudnn")].update(status="skipped", reason="unsupported: a test", ms=None, tflops=None)
    path.write_text(json.dumps(data))
    after, _, _ = gen.build(copy)
    _, rows = _features_table(after)
    assert rows[dense][train] == f"{value:.0f}" and rows[dense][train_fa4] == "2.00"
    assert rows[dense][header.index("cuDNN")] == "-" and rows[dense][fwd_cudnn] == "-"
    assert f"{dense}: " not in _misses_of(after, H200)

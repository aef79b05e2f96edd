"""The README's main command and the small CLI verbs, run in-process."""
import json

from flashtile.cli import main


def test_demo_runs_and_passes_its_checks(capsys):
    assert main(["demo", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert report["ok"] is True
    assert set(report["checks"]) >= {"out", "dq", "dk", "dv", "lse"}
    assert all(c["ok"] for name, c in report["checks"].items() if name != "lse")
    assert report["io"]["ratio"] > 3.0          # standard / FA1 accesses at GPT-2 medium sizes
    assert set(report["side_by_side"]) == {"flashtile", "sdpa", "standard"}


def test_info_json_names_backend_and_versions(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["flashtile"] and info["torch"] and "backend" in info

"""The `flashtile` command as a user runs it: a subprocess, whose stdout under --json is exactly one JSON document
(progress and the human account go to stderr), and `info`, whose every field holds a real value."""
import importlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton

import flashtile
from flashtile.bench.providers import PROVIDERS
from flashtile.cli import main
from flashtile.kernels import support

ROOT = Path(__file__).resolve().parents[1]
# what an error or a missing value looks like in a field that should hold one
ERROR_WORDS = re.compile(r"unavailable|error|cannot import|traceback|exception|not found", re.I)


def run_cli(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "flashtile.cli", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, f"flashtile {' '.join(args)} exited {res.returncode}:\n{res.stderr[-3000:]}"
    return res


def test_demo_json_is_one_document_on_stdout_and_passes_its_checks():
    res = run_cli("demo", "--json")
    report = json.loads(res.stdout)   # the whole of stdout: no line of text before or after the document
    assert isinstance(report, dict)
    assert report["ok"] is True
    assert set(report["checks"]) >= {"out", "dq", "dk", "dv", "lse"}
    assert all(c["ok"] for name, c in report["checks"].items() if name != "lse")
    assert report["io"]["ratio"] > 3.0          # standard / FA1 accesses at GPT-2 medium sizes
    assert set(report["side_by_side"]) == {"flashtile", "sdpa", "standard"}
    assert isinstance(report["seed"], int)
    # the human account went to stderr
    assert "flashtile demo on" in res.stderr and "demo passed" in res.stderr


def test_info_json_is_one_document_of_real_values():
    info = json.loads(run_cli("info", "--json").stdout)
    for key, val in info.items():
        assert val is not None and val != "" and val != [] and val != {}, f"info field {key} is empty: {val!r}"
        if isinstance(val, str):
            assert not ERROR_WORDS.search(val), f"info field {key} holds an error: {val!r}"
    assert info["flashtile"] == flashtile.__version__
    assert info["python"] == platform.python_version()
    assert info["torch"] == torch.__version__
    assert info["triton"] == triton.__version__
    assert info["cuda"] is torch.cuda.is_available()
    if torch.cuda.is_available():
        assert info["device"] == torch.cuda.get_device_name(0)
        assert info["backends"][-1] == "triton" and info["capability"] and info["multiprocessors"] > 0
    else:
        assert info["device"] == "cpu" and info["cpu_count"] == os.cpu_count()
        assert info["backends"] == ["triton-interpreter"]
    assert info["triton_features"] == support.FEATURES

    peers = info["peers"]
    assert set(peers) == set(PROVIDERS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, p in peers.items():
        prov = PROVIDERS[name]
        importable = True
        for module in prov.modules:
            try:
                importlib.import_module(module)
            except Exception:   # noqa: BLE001 - absent or broken: either way not importable
                importable = False
        assert p["importable"] is importable, (name, p)
        assert p["available"] is (p["reason"] is None), (name, p)
        if importable and device in prov.devices:
            assert p["available"], f"peer {name} can run here but info says: {p['reason']}"
        if not p["available"]:
            assert p["reason"].strip(), name
    # the peers every machine has (the CPU ones)
    for name in ("flashtile", "flashtile-triton", "sdpa-math", "eager"):
        assert peers[name] == {"available": True, "importable": True, "reason": None}


def test_info_text_has_a_value_on_every_line(capsys):
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for ln in lines:
        assert len(ln.split(None, 1)) == 2, f"no value: {ln!r}"
        if not ln.startswith(" "):   # peers that cannot run here say why, on their own indented lines
            assert not ERROR_WORDS.search(ln), ln
    keys = {ln.split()[0] for ln in lines if not ln.startswith(" ")}
    assert keys >= {"flashtile", "python", "torch", "triton", "cuda", "device", "backends", "triton_features", "peers"}
    for name in ("flashtile", "sdpa-math", "eager"):
        assert any(re.fullmatch(rf"\s+{name}\s+available", ln) for ln in lines), name

"""Which Triton flashtile needs: the floors pyproject.toml states, and `import flashtile` on a Triton that lacks
triton.knobs or the Gluon the FA3 kernels need (older than 3.4 / 3.6): one warning, then the portable Triton
kernels, instead of an ImportError deep inside the package."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashtile.kernels import support

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: the modules a Triton older than 3.4 / 3.6 lacks (triton.knobs, the Gluon the FA3
# kernels need) are made unimportable for flashtile's modules before flashtile is imported, then a small attention
# call runs on the CPU. Only imports made by flashtile fail: the installed Triton imports those modules itself
# at every launch (argument specialization), so blanking them in sys.modules would break Triton, not flashtile.
_OLD_TRITON = r"""
import builtins, importlib, json, os, sys, warnings
os.environ["TRITON_INTERPRET"] = "1"
BLOCKED = ("triton.knobs", "triton.experimental.gluon")


def blocked(name, fromlist, caller):
    names = [name] + [f"{name}.{x}" for x in (fromlist or ())]
    return caller.startswith("flashtile") and any(n == b or n.startswith(b + ".") for n in names for b in BLOCKED)


real_import, real_import_module = builtins.__import__, importlib.import_module


def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and blocked(name, fromlist, (globals or {}).get("__name__", "")):
        raise ImportError(f"simulated old Triton: no {name} {fromlist or ''}")
    return real_import(name, globals, locals, fromlist, level)


def fake_import_module(name, package=None):
    if blocked(name, (), sys._getframe(1).f_globals.get("__name__", "")):
        raise ImportError(f"simulated old Triton: no {name}")
    return real_import_module(name, package)


builtins.__import__, importlib.import_module = fake_import, fake_import_module
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import flashtile
import torch
from flashtile.kernels import relaunch, support
from flashtile.kernels.gluon import fa3
from flashtile.reference.dense import attention_ref
torch.manual_seed(0)
q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
out = flashtile.flash_attn_func(q, k, v, causal=True)
out.sum().backward()
ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
ro = attention_ref(*ref, causal=True)[0]
ro.sum().backward()
errs = [(out.double() - ro).abs().max().item()] + [(x.grad.double() - r.grad).abs().max().item()
                                                  for x, r in zip((q, k, v), ref)]
print(json.dumps({"warnings": [[w.category.__name__, str(w.message)] for w in caught],
                  "features": support.FEATURES, "fast_launch": relaunch.FAST_LAUNCH, "bind": relaunch.BIND,
                  "gluon_kernels": fa3._kernels.__wrapped__(0), "errors": errs}))
"""


def test_import_on_a_triton_without_knobs_or_gluon_warns_once_and_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _OLD_TRITON], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    ours = [msg for cat, msg in report["warnings"] if cat == "TritonSupportWarning"]
    assert len(ours) == 1, report["warnings"]
    (msg, ) = ours
    assert "\n" not in msg
    for what in ("triton.knobs", "Gluon", "portable Triton kernels", "triton>=3.6"):
        assert what in msg, (what, msg)
    assert report["features"] == {"knobs": False, "gluon": False, "tensor_descriptor": True}
    assert report["fast_launch"] is False and report["bind"] is False   # every launch through Triton's dispatch
    assert report["gluon_kernels"] is None                              # Hopper would run the Triton kernels
    assert max(report["errors"]) < 5e-3, report["errors"]               # out, dq, dk, dv against float64


def test_this_triton_has_every_feature_and_import_is_silent():
    if support.TRITON_VERSION < support.SUPPORTED:
        pytest.skip(f"installed Triton {support.TRITON_VERSION} is older than the supported {support.SUPPORTED}")
    assert support.FEATURES == {"knobs": True, "gluon": True, "tensor_descriptor": True}
    assert support.missing_message() is None
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", "import flashtile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_gluon_needs_triton_3_6(monkeypatch):
    assert support.version_tuple("3.6.0") == (3, 6, 0)
    assert support.version_tuple("3.7.0+git1a2b3c4d") == (3, 7, 0)
    assert support.version_tuple("3.4.0rc1") == (3, 4, 0)
    assert support.GLUON_MIN == (3, 6)
    from flashtile.kernels.gluon import fa3
    monkeypatch.setattr(support, "GLUON", False)
    assert fa3._kernels.__wrapped__(0) is None   # decided before the device is asked


def _requirement(name: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.M | re.S).group(1)
    (spec, ) = [m.group(1) for m in re.finditer(r'"([^"]+)"', deps) if re.match(rf"{name}\b", m.group(1))]
    return spec


def test_pyproject_states_the_supported_floors():
    triton_floor = re.match(r"triton>=([\d.]+)", _requirement("triton")).group(1)
    assert support.version_tuple(triton_floor) == support.SUPPORTED
    # torch: the oldest the suite runs on (the GPU image's 2.11)
    assert re.match(r"torch>=([\d.]+)", _requirement("torch")).group(1) == "2.11"

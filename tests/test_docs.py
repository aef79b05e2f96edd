"""Every command in docs/*.md is real, and the repository stands alone: cheap checks, nothing long is run.

From each ```bash block: a `flashtile <sub> ...` (or `python -m flashtile.cli <sub>`) command must name a
subcommand the CLI's parser accepts (`flashtile.cli.main([sub, "--help"])` exits 0) and only options that
subcommand's help lists; a `python examples/<script>` (or `torchrun ... examples/<script>`) must name an
existing script whose source defines every option used; `python -m pytest <paths>` must name existing paths.
From each ```python block: every `from flashtile... import ...` line must import.
README.md, BENCHMARKS.md and docs/*.md cite only paths of the repository that exist (benchmarks/..., flashtile/...).
No file of the repository points outside it (a sibling folder, the papers' numbered notes it was written from, a
design or anchors file that only exists beside the checkout): papers are cited by title, section and algorithm.
"""
import importlib
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

import flashtile.cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
REQUIRED = {"design.md", "api.md", "performance.md", "semantics.md"}


def _blocks(lang: str):
    """(file name, line) for every line of every ```lang block."""
    out = []
    for path in DOCS:
        for block in re.findall(rf"^```{lang}[ \t]*\n(.*?)^```", path.read_text(), flags=re.M | re.S):
            out += [(path.name, line) for line in block.splitlines() if line.strip()]
    return out


def _commands():
    """(file, argv) of every shell command: lines split at && ; |, comments and VAR=value prefixes dropped."""
    cmds = []
    for name, line in _blocks("bash"):
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|;|\|", line):
            argv = shlex.split(part)
            while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", argv[0]):
                argv = argv[1:]
            if argv:
                cmds.append((name, argv))
    return cmds


def _options(argv):
    return [a.split("=")[0] for a in argv if a.startswith("--")]


def _cli_help(sub: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        flashtile.cli.main([sub, "--help"])
    assert exc.value.code == 0, f"`flashtile {sub} --help` exited {exc.value.code}"
    return capsys.readouterr().out


def test_docs_exist():
    assert REQUIRED <= {p.name for p in DOCS}


def test_flashtile_commands_exist(capsys):
    found = 0
    for name, argv in _commands():
        if argv[0] == "flashtile":
            rest = argv[1:]
        elif argv[:3] in (["python", "-m", "flashtile.cli"], ["python3", "-m", "flashtile.cli"]):
            rest = argv[3:]
        elif argv[:3] == ["python", "-m", "flashtile.bench"]:
            rest = ["bench", *argv[3:]]
        else:
            continue
        assert rest, f"{name}: `{' '.join(argv)}` names no subcommand"
        help_text = _cli_help(rest[0], capsys)
        for opt in _options(rest[1:]):
            assert opt in help_text, f"{name}: `{' '.join(argv)}`: {opt} is not an option of `flashtile {rest[0]}`"
        found += 1
    assert found >= 3, "docs show fewer than 3 flashtile commands: is the ```bash extraction broken?"


def test_example_scripts_exist():
    found = 0
    for name, argv in _commands():
        scripts = [a for a in argv if a.startswith("examples/")]
        if argv[0] not in ("python", "python3", "torchrun") or not scripts:
            continue
        path = ROOT / scripts[0]
        assert path.is_file(), f"{name}: `{' '.join(argv)}`: {scripts[0]} does not exist"
        source = path.read_text()
        after = argv[argv.index(scripts[0]) + 1:]
        for opt in _options(after):
            assert f'"{opt}"' in source, f"{name}: `{' '.join(argv)}`: {scripts[0]} defines no option {opt}"
        found += 1
    assert found >= 1


def test_pytest_paths_exist():
    for name, argv in _commands():
        if argv[:3] != ["python", "-m", "pytest"]:
            continue
        for arg in argv[3:]:
            if not arg.startswith("-"):
                assert (ROOT / arg.split("::")[0]).exists(), f"{name}: `{' '.join(argv)}`: no {arg}"


def test_python_imports_in_docs_resolve():
    lines = [(n, ln.strip()) for n, ln in _blocks("python") if re.match(r"\s*from flashtile[\w.]* import ", ln)]
    assert lines, "docs show no `from flashtile... import` line"
    for name, line in lines:
        m = re.match(r"from (flashtile[\w.]*) import (.+)", line)
        module = importlib.import_module(m.group(1))
        for attr in (a.strip().split(" as ")[0] for a in m.group(2).split("#")[0].strip("() ").split(",")):
            assert hasattr(module, attr), f"{name}: `{line}`: {m.group(1)} has no {attr}"


# References to what lies outside the repository. Spelled in pieces so that this file does not match itself.
OUTSIDE = [
    (re.compile(r"\.\./" + "shared"), "a path into a sibling 'shared' folder"),
    (re.compile("shared/" + "seeds"), "the seed documents' folder"),
    (re.compile("ANCHORS" + r"\.md"), "an anchors file outside the repository (measurements go in BENCHMARKS.md)"),
    (re.compile("DESIGN" + r"\.md"), "a design file outside the repository (the repository's is docs/design.md)"),
    (re.compile(r"\bseeds?\s+0\d\d\b", re.I), "a numbered seed document (cite the paper by title and section)"),
    (re.compile(r"\bthe " + r"lab's\b", re.I), "a lab's files or machines, which a reader of the repository lacks"),
]
SKIP_DIRS = {".git", "__pycache__", ".hypothesis", ".pytest_cache", "build", "dist"}


def _repository_files():
    """Tracked files plus new ones not ignored (git), or every file under the root where git is unavailable."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        return sorted({ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()})
    except (OSError, subprocess.SubprocessError):
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            files += [Path(folder) / n for n in names]
        return sorted(files)


def test_no_file_points_outside_the_repository():
    files = _repository_files()
    assert any(f.name == "pyproject.toml" for f in files) and len(files) > 50, "file listing looks broken"
    found = []
    for path in files:
        data = path.read_bytes()
        if b"\0" in data[:8192]:   # binary (PNG)
            continue
        for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            for pattern, what in OUTSIDE:
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()[:140]}")
    assert not found, "the repository must stand alone; references to outside it:\n" + "\n".join(found)


def test_the_outside_patterns_catch_what_they_should():
    hits = ["see ../" + "shared/" + "seeds/000.txt", "the " + "lab's " + "ANCHORS" + ".md",
            "DESIGN" + ".md 'Semantics'", "(seed " + "001 §3.3)", "seeds " + "002/003", "Seed " + "004, example 1"]
    misses = ["docs/design.md", "seed 2856548130", "a fresh seed per case", "seeds 0 and 1", "shared memory"]
    for text in hits:
        assert any(p.search(text) for p, _ in OUTSIDE), text
    for text in misses:
        assert not any(p.search(text) for p, _ in OUTSIDE), text


# A path into the repository that a document cites: a script, a module, a results file or folder.
CITED = re.compile(r"(?<![\w/.])((?:benchmarks|flashtile|examples|tests|docs)/[\w./*<>-]*[\w/*>])")


def test_paths_the_documents_cite_exist():
    """README.md, BENCHMARKS.md and docs/*.md cite only files and folders the repository has (results folders and
    scripts that were removed live in the git history, which the documents cite by commit)."""
    missing = []
    for path in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in CITED.finditer(line):
                cited = m.group(1).rstrip(".")
                if "<" in cited:                     # a placeholder: benchmarks/results/<gpu>/
                    continue
                if not (any(ROOT.glob(cited)) if "*" in cited else (ROOT / cited).exists()):
                    missing.append(f"{path.name}:{lineno}: {cited}")
    assert not missing, "documents cite paths the repository does not have:\n" + "\n".join(missing)

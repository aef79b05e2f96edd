"""Host time of host_time.py's rows for two trees in one process: a base revision's package beside the working tree's.

    python benchmarks/ab_host.py extract REV [--dir scratch/ab]         (in the git checkout: writes DIR/flashtile_base)
    PYTHONPATH=. python benchmarks/ab_host.py run [--dir scratch/ab] [--only NAME,NAME] [--rounds 21] [--out DIR]

This host's timings drift between processes and with the CPU's load by more than a change to the call path moves
them, so a change is measured against its base in one process: `extract` writes REV's package (`git archive`) as
flashtile_base, its imports, torch.library namespace and custom ops renamed so that both packages load side by side;
`run` (on the GPU machine, the folder carried with the tree) builds host_time.py's rows once per package, each over
its own tensors, and times each row's base call, tree call and SDPA call interleaved round by round, the order of
base and tree alternating. Per row: the medians, tree / base and the interquartile range of the per-round ratios
(what a change must exceed to be seen), and an A/A row (the tree against itself) as the noise floor. Value checks are
off in both packages, as host_time.py has them.
"""
import argparse
import importlib.util
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile

BASE = "flashtile_base"
HERE = os.path.dirname(os.path.abspath(__file__))
# (pattern, replacement) turning the package's own names into BASE's: imports, the custom ops' namespace
RENAMES = (
    (re.compile(r"\bfrom flashtile(\.| import)"), rf"from {BASE}\1"),
    (re.compile(r"^(\s*)import flashtile\.", re.M), rf"\1import {BASE}."),
    (re.compile(r"^(\s*)import flashtile\b(?!\.)", re.M), rf"\1import {BASE} as flashtile"),
    (re.compile(r"Library\(\"flashtile\""), f"Library(\"{BASE}\""),
    (re.compile(r"\bflashtile::"), f"{BASE}::"),
    (re.compile(r"\btorch\.ops\.flashtile\."), f"torch.ops.{BASE}."),
)


def rename(source: str) -> str:
    """A module's source with flashtile's own names made BASE's (RENAMES)."""
    for pattern, replacement in RENAMES:
        source = pattern.sub(replacement, source)
    return source


def extract(rev: str, folder: str, repo: str = os.path.join(HERE, "..")) -> str:
    """REV's flashtile package written as folder/BASE (replacing one there); returns its path."""
    data = subprocess.run(["git", "-C", repo, "archive", "--format=tar", rev, "flashtile"], check=True,
                          capture_output=True).stdout
    target = os.path.join(folder, BASE)
    shutil.rmtree(target, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = os.path.join(target, os.path.relpath(member.name, "flashtile"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            content = tar.extractfile(member).read()
            if member.name.endswith(".py"):
                content = rename(content.decode()).encode()
            with open(path, "wb") as f:
                f.write(content)
    with open(os.path.join(target, "REVISION"), "w") as f:
        f.write(subprocess.run(["git", "-C", repo, "rev-parse", rev], check=True, capture_output=True,
                               text=True).stdout)
    return target


def host_time_module(package, name: str):
    """host_time.py loaded as its own module `name`, its rows calling `package`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "host_time.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.flashtile = package
    package.api.problem.CHECK_VALUES = False
    return module


def rows(module, only: str) -> list:
    """module's (name, flashtile call, SDPA call) rows, those whose names contain one of `only`'s parts."""
    import torch
    torch.manual_seed(0)
    pairs = (module.train_pairs() + module.varlen_pairs() + module.compiled_pairs() + module.generation_pairs()
             + module.decode_pairs())
    return [p for p in pairs if not only or any(s in p[0] for s in only.split(","))]


def run(folder: str, only: str, rounds: int, calls: int, out) -> list:
    sys.path.insert(0, folder)
    import flashtile
    base = __import__(BASE)
    with open(os.path.join(folder, BASE, "REVISION")) as f:
        revision = f.read().strip()
    base_mod, tree_mod = host_time_module(base, "host_time_base"), host_time_module(flashtile, "host_time_tree")
    timer = tree_mod.host_us
    pairs = [(name, fb, ft, sd) for (name, fb, _), (_, ft, sd) in zip(rows(base_mod, only), rows(tree_mod, only))]
    if pairs:   # the noise floor: the first row's tree call against itself
        pairs.append((f"A/A: {pairs[0][0]}", pairs[0][2], pairs[0][2], pairs[0][3]))
    results = []
    for name, fb, ft, sd in pairs:
        for _ in range(10):
            fb(), ft(), sd()
        b, t, s = [], [], []
        for i in range(rounds):
            if i % 2:
                t.append(timer(ft, calls))
                b.append(timer(fb, calls))
            else:
                b.append(timer(fb, calls))
                t.append(timer(ft, calls))
            s.append(timer(sd, calls))
        ratios = sorted(x / y for x, y in zip(t, b))
        row = dict(call=name, base_us=statistics.median(b), tree_us=statistics.median(t), sdpa_us=statistics.median(s),
                   ratio=statistics.median(t) / statistics.median(b),
                   ratio_iqr=(ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]))
        results.append(row)
        print(f"{name:58s} base {row['base_us']:7.1f}  tree {row['tree_us']:7.1f}  tree/base {row['ratio']:.2f} "
              f"(IQR {row['ratio_iqr'][0]:.2f}-{row['ratio_iqr'][1]:.2f})  SDPA {row['sdpa_us']:7.1f} us", flush=True)
    md = ["| call | base (us) | tree (us) | tree / base | IQR of the rounds' ratios | SDPA (us) |",
          "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['call']} | {r['base_us']:.1f} | {r['tree_us']:.1f} | {r['ratio']:.2f} | {r['ratio_iqr'][0]:.2f}-"
           f"{r['ratio_iqr'][1]:.2f} | {r['sdpa_us']:.1f} |" for r in results]
    print(f"\nbase {revision}: host time per call, median of {rounds} rounds of {calls} calls\n" + "\n".join(md))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "ab_host.json"), "w") as f:
            json.dump(dict(base=revision, rounds=rounds, calls=calls, rows=results), f, indent=1)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract")
    ex.add_argument("rev")
    ex.add_argument("--dir", default="scratch/ab")
    rn = sub.add_parser("run")
    rn.add_argument("--dir", default="scratch/ab")
    rn.add_argument("--only", default="")
    rn.add_argument("--rounds", type=int, default=21)
    rn.add_argument("--calls", type=int, default=50)
    rn.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cmd == "extract":
        print(extract(args.rev, args.dir))
    else:
        run(args.dir, args.only, args.rounds, args.calls, args.out)


if __name__ == "__main__":
    main()

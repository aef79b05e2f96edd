"""`python -m flashtile.bench [options]`: the benchmark without the flashtile CLI (same options as `flashtile bench`)."""
import argparse
import sys

from flashtile.bench.runner import add_bench_arguments, run_bench


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench", description=__doc__)
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

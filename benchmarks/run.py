"""Runs every ampfuse benchmark for one device and writes one JSON file and one table.

    PYTHONPATH=python python benchmarks/run.py [--device cpu|cuda] [--out DIR] [bench flags]

DIR defaults to $OUT, else benchmarks/out; it receives bench.json and bench_table.txt. The
table is also printed.
"""

import argparse
import os

import bench_l2norm
import bench_scale
import bench_unscale
from _timing import add_common_args, environment, finish_args, format_table, write_json

BENCHMARKS = (bench_unscale, bench_scale, bench_l2norm)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out"),
        help="folder for bench.json and bench_table.txt (default: $OUT or benchmarks/out)",
    )
    args = finish_args(parser.parse_args(argv))
    rows = []
    for bench in BENCHMARKS:
        rows += bench.run(args)
    env = environment(argv)
    table = format_table(rows, env)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "bench.json"), rows, env)
    with open(os.path.join(args.out, "bench_table.txt"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

"""Runs every ampfuse benchmark for one device and writes one JSON file and one table.

    PYTHONPATH=python python benchmarks/run.py [--device cpu|cuda] [--out DIR]
        [--benchmarks ops adam sgd adagrad train] [flags of the benchmarks]

The benchmarks, each with its own section of the table:
  ops    bench_unscale, bench_scale, bench_l2norm: each op against its torch counterpart
  adam   bench_adam: one mixed-precision Adam step against torch's equivalents
  sgd    bench_sgd: the same for SGD with momentum
  adagrad  bench_adagrad: the same for Adagrad
  train  bench_train: whole training steps of a GPT-2-style transformer and a ResNet-style CNN
         in fp32, torch's AMP, and ampfuse O1 and O2
  overhead  bench_amp_overhead: amp's per-step cost, O1 and O2 against torch autocast +
         GradScaler on models of many small ops, interleaved step by step
  master_modes  bench_master_modes: FusedAdamW on bf16 params per master_weights value
         (False, "stochastic", "kahan", "split") against fp32 masters (True), interleaved

Sizes and step counts not given on the command line are each benchmark's own defaults for the
device (--total-elements applies to ops, adam, sgd and adagrad; --warmup, --repeats and --seed
to all; the training benchmark's defaults are in its own --help).
DIR defaults to $OUT, else benchmarks/out; it receives bench.json (one "results" list: every
row carries "bench", the section it belongs to) and bench_table.txt. The table is also printed.
A benchmark that fails leaves an error row and the others still run; the exit status is then 1.
"""

import argparse
import os
import sys
import traceback

import bench_adagrad
import bench_adam
import bench_amp_overhead
import bench_l2norm
import bench_master_modes
import bench_scale
import bench_sgd
import bench_train
import bench_unscale
from _report import environment, format_table, write_json
from _timing import add_common_args, finish_args


def _ops_run(args):
    args = finish_args(args)
    return [row for bench in (bench_unscale, bench_scale, bench_l2norm) for row in bench.run(args)]


def _optimizer_run(bench):
    def run(args):
        if args.total_elements is None and args.device == "cuda":
            args.total_elements = bench_adam.CUDA_DEFAULT_TOTALS
        return bench.run(finish_args(args))

    return run


# name -> (rows from a copy of the parsed flags, the section's table from its rows)
BENCHMARKS = {
    "ops": (_ops_run, format_table),
    "adam": (_optimizer_run(bench_adam), bench_adam.format_rows),
    "sgd": (_optimizer_run(bench_sgd), bench_adam.format_rows),
    "adagrad": (_optimizer_run(bench_adagrad), bench_adam.format_rows),
    "train": (bench_train.run, bench_train.format_rows),
    "overhead": (bench_amp_overhead.run, bench_amp_overhead.format_rows),
    "master_modes": (bench_master_modes.run, bench_master_modes.format_rows),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out"),
        help="folder for bench.json and bench_table.txt (default: $OUT or benchmarks/out)",
    )
    parser.add_argument("--benchmarks", nargs="+", choices=list(BENCHMARKS),
                        default=list(BENCHMARKS), help="which to run (default: all)")
    bench_train.add_args(parser)
    bench_amp_overhead.add_args(parser, own=False)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        finish_args(argparse.Namespace(**vars(args)))  # fails early without a GPU
    return args


def main(argv=None):
    args = parse_args(argv)
    env = environment(argv)
    rows, sections, failed = [], [], []
    for name in args.benchmarks:
        run, table = BENCHMARKS[name]
        try:
            bench_rows = run(argparse.Namespace(**vars(args)))
        except Exception as error:  # the other benchmarks still run; the exit status says it
            traceback.print_exc()
            failed.append(name)
            message = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}" \
                if str(error).strip() else type(error).__name__
            rows.append({"bench": name, "device": args.device, "error": message})
            sections.append(f"# {name}: FAILED: {message}")
            continue
        for row in bench_rows:
            row["bench"] = name
        rows += bench_rows
        sections.append(table(bench_rows, env))
    text = "\n\n".join(sections)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "bench.json"), rows, env)
    with open(os.path.join(args.out, "bench_table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    if failed:
        print(f"run.py: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

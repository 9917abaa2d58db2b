"""ampfuse against torch on a busy CPU: unscale_, scale_ and l2norm with the calls interleaved.

bench_unscale.py, bench_scale.py and bench_l2norm.py time each implementation in a block and
report medians, which is right on a quiet machine. On a shared one (other builds and tests on
the same cores) the load changes between blocks and the medians mostly measure it. Here the
two implementations alternate call by call on the same rotated argument sets (the data of
_timing.py), and the fastest call of each is reported next to the median: the fastest call is
the one least disturbed, and the ratio of the two fastest is the comparison to read.

    PYTHONPATH=python python benchmarks/interleaved.py [--repeats 30] [--json PATH]
"""

import argparse
import json
import statistics
import time

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from _report import environment
from _timing import (
    DTYPES,
    element_count,
    generator,
    model_like_shapes,
    random_tensors,
    rotation_count,
)


def interleave(sets, ampfuse_call, torch_call, repeats):
    """Times ampfuse_call(set, i) and torch_call(set, i) alternately; returns both lists."""
    for s in sets:  # warm-up: every set once through each
        ampfuse_call(s, 0)
        torch_call(s, 0)
    times = ([], [])
    for i in range(repeats):
        for series, call, s in (
            (0, ampfuse_call, sets[i % len(sets)]),
            (1, torch_call, sets[(i + 1) % len(sets)]),
        ):
            start = time.perf_counter()
            call(s, i)
            times[series].append(time.perf_counter() - start)
    return times


def add_interleaved_args(parser):
    """The flags of the interleaved optimizer benchmarks (bench_skip_nonfinite,
    bench_master_modes)."""
    parser.add_argument("--total-elements", nargs="+", type=float, default=[1e7])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of each (30)")
    parser.add_argument("--sets", type=int, default=2, help="argument sets rotated (2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")


def cases(shapes):
    """(name, element bytes of one set, make_set, ampfuse_call, torch_call) per op and dtype."""
    inv_scales = [torch.full((1,), 0.5), torch.full((1,), 2.0)]
    scale = torch.full((1,), 1.0 / 1024.0)
    for name, dtype in DTYPES.items():
        yield (
            f"unscale_ {name}",
            dtype.itemsize,
            lambda gen, dtype=dtype: (random_tensors(shapes, dtype, "cpu", gen), torch.zeros(1)),
            lambda s, i: torch.ops.ampfuse.multi_tensor_unscale_(s[0], s[1], inv_scales[i % 2]),
            lambda s, i: torch._amp_foreach_non_finite_check_and_unscale_(
                s[0], s[1], inv_scales[i % 2]
            ),
        )
        yield (
            f"scale_ fp32->{name}",
            4 + dtype.itemsize,
            lambda gen, dtype=dtype: (
                random_tensors(shapes, torch.float32, "cpu", gen),
                [torch.zeros(shape, dtype=dtype) for shape in shapes],
                torch.zeros(1),
            ),
            lambda s, i: torch.ops.ampfuse.multi_tensor_scale_(s[0], s[1], scale, s[2]),
            lambda s, i: torch._foreach_copy_(s[1], torch._foreach_mul(s[0], scale.reshape(()))),
        )
        yield (
            f"l2norm {name}",
            dtype.itemsize,
            lambda gen, dtype=dtype: random_tensors(shapes, dtype, "cpu", gen),
            lambda s, i: torch.ops.ampfuse.multi_tensor_l2norm(s, True),
            lambda s, i: torch.linalg.vector_norm(
                torch.stack(torch._foreach_norm(s, 2, dtype=torch.float32))
            ),
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of each (default 30)")
    parser.add_argument("--total-elements", type=float, default=1e7)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    shapes = model_like_shapes(int(args.total_elements))
    gen = generator("cpu", 0)
    rows = []
    for name, element_bytes, make_set, ampfuse_call, torch_call in cases(shapes):
        sets = [
            make_set(gen)
            for _ in range(rotation_count(element_count(shapes) * element_bytes, "cpu"))
        ]
        ampfuse_times, torch_times = interleave(sets, ampfuse_call, torch_call, args.repeats)
        del sets
        row = {"case": name, "tensors": len(shapes), "elements": element_count(shapes)}
        for impl, times in (("ampfuse", ampfuse_times), ("torch", torch_times)):
            row[f"{impl}_min_ms"] = min(times) * 1e3
            row[f"{impl}_median_ms"] = statistics.median(times) * 1e3
        rows.append(row)
    env = environment()
    where = f"CPU x{env['cpu_threads']} threads; torch {env['torch']}"
    print(f"# {where}; {env['date']}; {env['command']}")
    print(
        f"{'case':18} {'ampfuse min':>11} {'median':>8} {'torch min':>10} {'median':>8} "
        f"{'torch/ampfuse (min)':>20}"
    )
    for r in rows:
        print(
            f"{r['case']:18} {r['ampfuse_min_ms']:11.3f} {r['ampfuse_median_ms']:8.3f} "
            f"{r['torch_min_ms']:10.3f} {r['torch_median_ms']:8.3f} "
            f"{r['torch_min_ms'] / r['ampfuse_min_ms']:20.2f}"
        )
    print(
        f"# ms per call over {rows[0]['elements']:,} elements in {rows[0]['tensors']} tensors; "
        "torch/ampfuse > 1: ampfuse faster"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

"""ampfuse's fused Adam and SGD steps on a half model against torch's fused step on fp32, with
the calls interleaved.

bench_adam.py and bench_sgd.py time each row in a block; on a shared machine the load changes
between blocks. Here, as in interleaved.py, the ampfuse step and torch's alternate call by call
on rotated argument sets, and the fastest call of each is reported next to the median. Rows
(bench_adam.py's, with the same argument sets): "ampfuse X" writes the unscaled grads back as
torch does, "ampfuse X scaled" only reads them; both are compared with torch's X(fused=True) on
a plain fp32 model, which also writes its grads back.

    PYTHONPATH=python python benchmarks/interleaved_optim.py [--repeats 40] [--dtype fp16 bf16]
"""

import argparse
import statistics

import torch
from _report import environment
from _timing import DTYPES, element_count, generator, model_like_shapes
from bench_adam import ampfuse_adam, torch_fp32
from bench_sgd import LR as SGD_LR
from bench_sgd import MOMENTUM, ampfuse_sgd
from interleaved import interleave


def pairs(dtype):
    """(ampfuse pipeline, torch pipeline) per optimizer and grad write-back."""
    sgd = {"cls": torch.optim.SGD, "lr": SGD_LR, "momentum": MOMENTUM}
    for write in (True, False):
        yield ampfuse_adam(dtype, "cpu", False, write), torch_fp32("cpu", None)
        yield ampfuse_sgd(dtype, "cpu", False, write), torch_fp32("cpu", None, 24, **sgd)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40, help="timed calls of each (default 40)")
    parser.add_argument("--total-elements", type=float, default=1e7)
    parser.add_argument("--dtype", nargs="+", choices=["fp16", "bf16"], default=["fp16", "bf16"])
    parser.add_argument("--sets", type=int, default=2, help="argument sets rotated (default 2)")
    args = parser.parse_args()
    shapes = model_like_shapes(int(args.total_elements))
    gen = generator("cpu", 0)
    rows = []
    for name in args.dtype:
        for ours, theirs in pairs(DTYPES[name]):
            ours_sets = [ours.make(shapes, gen) for _ in range(args.sets)]
            theirs_sets = [theirs.make(shapes, gen) for _ in range(args.sets)]
            # interleave() hands both calls the same set; pair one of each per set.
            sets = list(zip(ours_sets, theirs_sets))
            times = interleave(
                sets,
                lambda s, i, ours=ours: ours.call(s[0]),
                lambda s, i, theirs=theirs: theirs.call(s[1]),
                args.repeats,
            )
            del sets, ours_sets, theirs_sets
            rows.append(
                (
                    f"{ours.label} {name}",
                    *(f(t) * 1e3 for t in times for f in (min, statistics.median)),
                )
            )
    env = environment()
    print(
        f"# CPU x{env['cpu_threads']} threads; torch {env['torch']}; {env['date']}; "
        f"{env['command']}"
    )
    print(
        f"{'case':28} {'ampfuse min':>11} {'median':>8} {'torch min':>10} {'median':>8} "
        f"{'torch/ampfuse min':>18} {'median':>7}"
    )
    for label, a_min, a_med, t_min, t_med in rows:
        print(
            f"{label:28} {a_min:11.3f} {a_med:8.3f} {t_min:10.3f} {t_med:8.3f} "
            f"{t_min / a_min:18.2f} {t_med / a_med:7.2f}"
        )
    print(
        f"# ms per step over {element_count(shapes):,} params in {len(shapes)} tensors; torch: "
        "X(fused=True) on fp32; torch/ampfuse > 1: ampfuse faster"
    )


if __name__ == "__main__":
    main()

"""What skip_nonfinite costs: one FusedAdamW step on a bf16 model with the check off and on,
and torch's AdamW(fused=True) on the same bf16 params for reference, on the CPU.

skip_nonfinite=True reads every grad once more (multi_tensor_nonfinite_check_, 2 bytes per
bf16 param) before the fused step, which moves 22 bytes per param without masters and 28 with
fp32 masters (plus the grads written back when a scale is divided out; none is here: no
scaler drives these steps, which is exactly when skip_nonfinite=None checks).

The calls are interleaved (interleaved.py's method): the two steps of a pair alternate call
by call on rotated argument sets, and the fastest call of each is reported next to the
median. The first pair, off against off, shows the noise of the comparison itself: an
on/off ratio within it is no measurable cost.

    PYTHONPATH=python python benchmarks/bench_skip_nonfinite.py [--total-elements 1e7 5e7]
        [--repeats 30] [--json PATH]
"""

import argparse
import statistics

import torch
from _report import report
from _timing import element_count, generator, model_like_shapes
from bench_adam import LR, half_model
from interleaved import add_interleaved_args, interleave

from ampfuse.optimizers import FusedAdamW

# name -> (optimizer factory over params, label)
VARIANTS = {
    "off": lambda params, masters: FusedAdamW(params, lr=LR, master_weights=masters,
                                              skip_nonfinite=False),
    "on": lambda params, masters: FusedAdamW(params, lr=LR, master_weights=masters,
                                             skip_nonfinite=None),
    "torch": lambda params, masters: torch.optim.AdamW(params, lr=LR, fused=True),
}
# (row label, first variant, second variant): the ratio printed is second / first.
PAIRS = (("noise: off vs off", "off", "off"), ("cost: on vs off", "off", "on"),
         ("torch AdamW(fused) vs on", "on", "torch"))


def make_set(shapes, masters, gen):
    """bf16 params with bf16 grads, and one optimizer of each variant over them (the steps
    update the same params; lr is small, so they stay finite through any number of calls)."""
    params = half_model(shapes, torch.bfloat16, "cpu", gen)
    optimizers = {name: make(params, masters) for name, make in VARIANTS.items()}
    optimizers["off2"] = VARIANTS["off"](params, masters)
    for optimizer in optimizers.values():
        optimizer.step()  # creates the state (and masters) outside the timed calls
    return optimizers


def run(args):
    """The rows for this script's flags, or for benchmarks/run.py's (whose --total-elements and
    --repeats default to None: this script's defaults then apply)."""
    totals = args.total_elements or [1e7]
    repeats = args.repeats or 30
    rows = []
    for total in totals:
        shapes = model_like_shapes(int(total))
        for masters in (False, True):
            if masters and getattr(args, "no_masters", False):
                continue
            gen = generator("cpu", args.seed)
            sets = [make_set(shapes, masters, gen) for _ in range(getattr(args, "sets", 2))]
            for label, first, second in PAIRS:
                second_key = "off2" if second == first else second
                times = interleave(
                    sets,
                    lambda s, i, name=first: s[name].step(),
                    lambda s, i, name=second_key: s[name].step(),
                    repeats,
                )
                rows.append({
                    "pair": label, "master_weights": masters, "params": element_count(shapes),
                    "tensors": len(shapes), "first": first, "second": second,
                    "first_min_ms": min(times[0]) * 1e3,
                    "first_median_ms": statistics.median(times[0]) * 1e3,
                    "second_min_ms": min(times[1]) * 1e3,
                    "second_median_ms": statistics.median(times[1]) * 1e3,
                })
            del sets
    return rows


def format_rows(rows, env):
    lines = [f"# CPU x{env['cpu_threads']} threads; torch {env['torch']}; {env['date']}; "
             f"{env['command']}",
             f"{'params':>11} {'masters':>7}  {'pair':26} {'first min':>9} {'median':>8} "
             f"{'second min':>10} {'median':>8} {'ratio min':>9} {'median':>7}"]
    for r in rows:
        lines.append(
            f"{r['params']:>11,} {str(r['master_weights']):>7}  {r['pair']:26} "
            f"{r['first_min_ms']:9.2f} {r['first_median_ms']:8.2f} {r['second_min_ms']:10.2f} "
            f"{r['second_median_ms']:8.2f} {r['second_min_ms'] / r['first_min_ms']:9.3f} "
            f"{r['second_median_ms'] / r['first_median_ms']:7.3f}")
    lines.append("# ms per step of bf16 params (FusedAdamW, lr 1e-4, no scaler); ratio: second "
                 "over first (above 1: the second is slower). off = skip_nonfinite=False (the "
                 "default), on = skip_nonfinite=None (checks these bf16 grads), torch = "
                 "AdamW(fused=True) on the same bf16 params (no masters, no guard).")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_interleaved_args(parser)
    parser.add_argument("--no-masters", action="store_true",
                        help="time only master_weights=False")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return report(run(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main()

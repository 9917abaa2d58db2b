"""What each master_weights value of FusedAdamW (or FusedAdagrad, FusedLAMB, FusedNovoGrad)
costs per step on bf16 params, against fp32 masters (master_weights=True), side by side in one
run.

Bytes a step moves per bf16 param without a scaler (grad read 2, moments read and written 16,
param read or written): True 28 (the master read and written, the param only written),
False 22, "stochastic" 22 (plus hashing 32 random bits per element), "kahan" 26 (the
compensation read and written), "split" 26 (the low half read and written). On the CPU every
mode runs 8-lane loops, with AVX2 and F16C where the processor has them (FusedLAMB's bf16
modes: software conversions, cloned for AVX2); on CUDA the bf16 modes move one element per
access where True and False use 16-byte packs. For FusedAdagrad (--optimizer adagrad; one fp32
sum instead of two moments) each
figure is 8 bytes less: True 20, False 14, "stochastic" 14, "kahan" 18, "split" 18. FusedLAMB
(--optimizer lamb) reads the param (or its mode's state) and the moments twice, once per pass,
and clips by the global grad norm, which reads the grads once more. FusedNovoGrad (--optimizer
novograd; one fp32 moment, the grads read by both passes, the param only by the second): True
22, False 16, "stochastic" 16, "kahan" 20, "split" 20.

The calls are interleaved (interleaved.py's method): in each pair the two steps alternate call by
call on rotated argument sets, and the fastest call of each is reported next to the median. The
first pair, True against True, shows the noise of the comparison itself.

    PYTHONPATH=python python benchmarks/bench_master_modes.py [--device cpu|cuda]
        [--optimizer adamw|adagrad|lamb|novograd] [--total-elements 1e7] [--repeats 30]
        [--json PATH]
"""

import argparse
import statistics

import torch
from _report import report
from _timing import element_count, generator, model_like_shapes, synchronize
from bench_adam import LR, half_model
from interleaved import add_interleaved_args, interleave

from ampfuse.optimizers import FusedAdagrad, FusedAdamW, FusedLAMB, FusedNovoGrad

MODES = (True, False, "stochastic", "kahan", "split")
OPTIMIZERS = {"adamw": FusedAdamW, "adagrad": FusedAdagrad, "lamb": FusedLAMB,
              "novograd": FusedNovoGrad}
MODE_NAMES = {True: "True", False: "False"}


def mode_name(mode):
    return MODE_NAMES.get(mode, mode)


def make_set(shapes, device, gen, optimizer_class=FusedAdamW):
    """bf16 params with bf16 grads and one optimizer per mode over them, plus a second True
    one for the noise pair (lr is small: the params stay finite through any number of steps)."""
    params = half_model(shapes, torch.bfloat16, device, gen)
    optimizers = {mode_name(m): optimizer_class(params, lr=LR, master_weights=m) for m in MODES}
    optimizers["True2"] = optimizer_class(params, lr=LR, master_weights=True)
    for optimizer in optimizers.values():
        optimizer.step()  # creates the state outside the timed calls
    return optimizers


def run(args):
    """The rows for this script's flags, or for benchmarks/run.py's (whose --total-elements and
    --repeats default to None: this script's defaults then apply)."""
    device = getattr(args, "device", "cpu") or "cpu"
    totals = args.total_elements or [1e7]
    repeats = args.repeats or 30
    name = getattr(args, "optimizer", "adamw")
    rows = []
    for total in totals:
        shapes = model_like_shapes(int(total))
        gen = generator(device, args.seed)
        sets = [make_set(shapes, device, gen, OPTIMIZERS[name])
                for _ in range(getattr(args, "sets", 2))]
        for mode in MODES:
            second = "True2" if mode is True else mode_name(mode)

            def step(s, i, name):
                s[name].step()
                synchronize(device)

            times = interleave(sets, lambda s, i: step(s, i, "True"),
                               lambda s, i, name=second: step(s, i, name), repeats)
            rows.append({
                "device": device, "optimizer": OPTIMIZERS[name].__name__,
                "mode": mode_name(mode), "params": element_count(shapes),
                "tensors": len(shapes),
                "true_min_ms": min(times[0]) * 1e3,
                "true_median_ms": statistics.median(times[0]) * 1e3,
                "mode_min_ms": min(times[1]) * 1e3,
                "mode_median_ms": statistics.median(times[1]) * 1e3,
            })
        del sets
    return rows


def format_rows(rows, env):
    device = rows[0]["device"] if rows else "cpu"
    where = (f"CPU x{env['cpu_threads']} threads" if device == "cpu"
             else env.get("gpu") or device)
    lines = [f"# {where}; torch {env['torch']}; {env['date']}; {env['command']}",
             f"{'params':>11}  {'master_weights':14} {'True min':>8} {'median':>8} "
             f"{'mode min':>8} {'median':>8} {'ratio min':>9} {'median':>7}"]
    for r in rows:
        lines.append(
            f"{r['params']:>11,}  {r['mode']:14} {r['true_min_ms']:8.2f} "
            f"{r['true_median_ms']:8.2f} {r['mode_min_ms']:8.2f} {r['mode_median_ms']:8.2f} "
            f"{r['mode_min_ms'] / r['true_min_ms']:9.3f} "
            f"{r['mode_median_ms'] / r['true_median_ms']:7.3f}")
    optimizer = rows[0].get("optimizer", "FusedAdamW") if rows else "FusedAdamW"
    lines.append(f"# ms per {optimizer} step of bf16 params (lr 1e-4, no scaler); ratio: the mode "
                 "over master_weights=True (below 1: faster). The True row is the noise of the "
                 "comparison (True against a second True optimizer).")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    add_interleaved_args(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    report(run(args), None, args.json, format_rows)

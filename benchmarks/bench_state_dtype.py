"""What FusedAdamW's (or FusedLAMB's) 8-bit moments (state_dtype "int8" / "fp8") cost per step
against fp32 moments, side by side in one run, with torchao's AdamW8bit beside them where it
imports.

Each pair runs the fp32-state step and the coded one interleaved (interleaved.py's method: the
two alternate call by call on rotated argument sets; the fastest call of each is reported next
to the median). bf16 params with bf16 grads, no scaler, master_weights True (fp32 masters) and
"stochastic" (none). Bytes a step moves per param (grad read 2; moments read and written: 16 in
fp32, 4 in codes plus 16 bytes of scales per 256 elements; with True the master read and
written 8 and the param written 2, with "stochastic" the param read and written 4):

    True + fp32 28          True + int8/fp8 16.06
    stochastic + fp32 22    stochastic + 8-bit 10.06

FusedLAMB (--optimizer lamb, default max_grad_norm=1: the grads' norm read first, 2) runs two
passes; the coded step reads the codes and grads in both (the second forms the moments again):

    True + fp32 42      True + 8-bit 26.1      stochastic + fp32 34      stochastic + 8-bit 18.1

GB/s is those bytes over the fastest call, and %copy compares it with a device copy of the same
bytes (on CUDA; issue 33's goal: >= 90% at 350M params). torchao's AdamW8bit (fp32 params, its
own block-wise codes, no masters) is timed on its own set where torchao imports; its row has no
ratio to ours because it moves other bytes.

    PYTHONPATH=python python benchmarks/bench_state_dtype.py [--device cpu|cuda]
        [--optimizer adamw|lamb] [--total-elements 1e7] [--repeats 30] [--json PATH]
"""

import argparse
import statistics

import torch
from _report import report
from _timing import (
    copy_bandwidth,
    element_count,
    generator,
    model_like_shapes,
    synchronize,
    time_calls,
)
from ampfuse.optimizers import FusedAdamW, FusedLAMB
from bench_adam import LR, half_model
from interleaved import add_interleaved_args, interleave

KINDS = ("int8", "fp8")
MASTER_MODES = (True, "stochastic")
CUDA_TOTAL = 3.5e8
# Bytes per param a step moves besides the moments: the grad read, and the master read and
# written plus the param written (True) or the param read and written ("stochastic").
OTHER_BYTES = {True: 2 + 8 + 2, "stochastic": 2 + 4}
MOMENT_BYTES = {"fp32": 16.0, "int8": 4 + 16 / 256, "fp8": 4 + 16 / 256}
OPTIMIZERS = {"adamw": FusedAdamW, "lamb": FusedLAMB}
# FusedLAMB's bytes per param per step, whole (see the docstring), by (master_weights, state).
_CODED_LAMB = {True: 2 + 6 + 2.03 + 2 + 10 + 4.06, "stochastic": 2 + 4 + 2.03 + 2 + 4 + 4.06}
LAMB_BYTES = {(True, "fp32"): 42.0, ("stochastic", "fp32"): 34.0,
              **{(m, k): b for m, b in _CODED_LAMB.items() for k in KINDS}}


def step_bytes(optimizer, master_weights, state_dtype):
    if optimizer == "lamb":
        return LAMB_BYTES[master_weights, state_dtype]
    return OTHER_BYTES[master_weights] + MOMENT_BYTES[state_dtype]


def make_set(shapes, device, gen, master_weights, name="adamw"):
    """bf16 params with grads, and one optimizer `name` per state_dtype over them (state
    made)."""
    params = half_model(shapes, torch.bfloat16, device, gen)
    optimizers = {kind: OPTIMIZERS[name](params, lr=LR, master_weights=master_weights,
                                         state_dtype=kind) for kind in ("fp32", *KINDS)}
    for optimizer in optimizers.values():
        optimizer.step()  # creates the state outside the timed calls
    return optimizers


def torchao_row(shapes, device, gen, repeats):
    """torchao.optim.AdamW8bit on fp32 params of the same shapes, or None without torchao."""
    try:
        from torchao.optim import AdamW8bit
    except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch
        return None
    params = half_model(shapes, torch.float32, device, gen)
    try:
        optimizer = AdamW8bit(params, lr=LR)
        optimizer.step()
    except (RuntimeError, NotImplementedError, TypeError) as error:  # e.g. no CPU kernel
        return {"error": f"{type(error).__name__}: {error}"}

    def call(i):
        optimizer.step()
        synchronize(device)

    times = time_calls(call, device, 2, repeats)
    return {"min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}


def run(args):
    device = getattr(args, "device", "cpu") or "cpu"
    optimizer = getattr(args, "optimizer", "adamw") or "adamw"
    totals = args.total_elements or [CUDA_TOTAL if device == "cuda" else 1e7]
    repeats = args.repeats or 30
    rows = []
    for total in totals:
        shapes = model_like_shapes(int(total))
        params = element_count(shapes)
        for master_weights in MASTER_MODES:
            gen = generator(device, args.seed)
            sets = [make_set(shapes, device, gen, master_weights, optimizer)
                    for _ in range(getattr(args, "sets", 2))]
            for kind in KINDS:
                def step(s, i, name):
                    s[name].step()
                    synchronize(device)

                times = interleave(sets, lambda s, i: step(s, i, "fp32"),
                                   lambda s, i, kind=kind: step(s, i, kind), repeats)
                moved = {name: params * step_bytes(optimizer, master_weights, name)
                         for name in ("fp32", kind)}
                row = {"device": device, "optimizer": optimizer, "params": params,
                       "master_weights": str(master_weights),
                       "state_dtype": kind,
                       "fp32_min_ms": min(times[0]) * 1e3,
                       "fp32_median_ms": statistics.median(times[0]) * 1e3,
                       "coded_min_ms": min(times[1]) * 1e3,
                       "coded_median_ms": statistics.median(times[1]) * 1e3,
                       "coded_gbps": moved[kind] / min(times[1]) / 1e9,
                       "fp32_gbps": moved["fp32"] / min(times[0]) / 1e9}
                if device == "cuda":
                    for name, key in (("fp32", "fp32"), (kind, "coded")):
                        copy = copy_bandwidth(int(moved[name]), device, 3, 20)
                        row[f"{key}_pct_of_copy"] = 100 * row[f"{key}_gbps"] * 1e9 / copy
                rows.append(row)
            del sets
        ao = (torchao_row(shapes, device, generator(device, args.seed), repeats)
              if optimizer == "adamw" else None)
        if ao is not None:
            rows.append({"device": device, "params": params, "master_weights": "-",
                         "state_dtype": "torchao AdamW8bit", **ao})
    return rows


def format_rows(rows, env):
    device = rows[0]["device"] if rows else "cpu"
    where = (f"CPU x{env['cpu_threads']} threads" if device == "cpu"
             else env.get("gpu") or device)
    lines = [f"# {where}; torch {env['torch']}; {env['date']}; {env['command']}",
             (f"{'params':>11}  {'master':10} {'state':18} {'fp32 min':>8} {'median':>8} "
              f"{'8bit min':>8} {'median':>8} {'ratio min':>9} {'median':>7} {'GB/s':>6} "
              f"{'%copy':>5} {'fp32 %copy':>10}")]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['params']:>11,}  {r['master_weights']:10} {r['state_dtype']:18} "
                         f"did not run: {r['error']}")
            continue
        if "min_ms" in r:  # torchao
            lines.append(f"{r['params']:>11,}  {r['master_weights']:10} {r['state_dtype']:18} "
                         f"{'':8} {'':8} {r['min_ms']:8.2f} {r['median_ms']:8.2f}   "
                         "(fp32 params, its own codes)")
            continue
        pct = f"{r['coded_pct_of_copy']:5.0f}" if "coded_pct_of_copy" in r else f"{'-':>5}"
        fp32_pct = f"{r['fp32_pct_of_copy']:10.0f}" if "fp32_pct_of_copy" in r else f"{'-':>10}"
        lines.append(
            f"{r['params']:>11,}  {r['master_weights']:10} {r['state_dtype']:18} "
            f"{r['fp32_min_ms']:8.2f} {r['fp32_median_ms']:8.2f} {r['coded_min_ms']:8.2f} "
            f"{r['coded_median_ms']:8.2f} {r['coded_min_ms'] / r['fp32_min_ms']:9.3f} "
            f"{r['coded_median_ms'] / r['fp32_median_ms']:7.3f} {r['coded_gbps']:6.1f} {pct} "
            f"{fp32_pct}")
    name = {"adamw": "FusedAdamW", "lamb": "FusedLAMB"}[rows[0].get("optimizer", "adamw")
                                                        if rows else "adamw"]
    lines.append(f"# ms per {name} step of bf16 params (lr 1e-4, no scaler); ratio: 8-bit "
                 "moments over fp32 moments, same master_weights (below 1: faster); GB/s and "
                 "%copy of the 8-bit step's bytes (see the docstring).")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZERS))
    add_interleaved_args(parser)
    parser.set_defaults(total_elements=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    report(run(args), None, args.json, format_rows)

"""Where FP8 starts to pay: an FP8 Linear (forward + backward, current scaling by default)
against a bf16 nn.Linear over GEMM shapes, the data behind the automatic rule that leaves small
Linears in bf16 (issue 31, "Which Linears").

    PYTHONPATH=python python benchmarks/bench_fp8_threshold.py [--device cuda]
        [--tokens 1024 2048 4096 8192 16384] [--features 768 1024 2048 4096 8192]
        [--recipe current|rowwise|delayed] [--reference-tokens 8192] [--budget-s 150]
        [--json PATH]

For every tokens count M and every (in K, out N) pair of --features: a bf16 nn.Linear(K, N,
bias=False) and the same layer converted to FP8 (fp8_setups.convert_layer), input [M, K]
bf16, one call = forward + backward (input and weight gradients) with the weight quantized
again as after an optimizer step (fp8_setups.weight_stepper), CUDA events, median of
--repeats after --warmup. bf16 is timed before and after FP8 (noise: the gap between its two
medians). Cells are bf16 time / FP8 time (> 1: FP8 faster).

The rule (ampfuse.fp8.convert's min_features logic: both in and out features >= a threshold)
is read off the table: for each M, the smallest threshold t such that FP8 wins (ratio > 1) for
every measured (K, N) with min(K, N) >= t. The suggestion is t at --reference-tokens (a
micro-batch of 8 x 1024 or 4 x 2048 tokens). The script names the constant to update: the one
in python/ampfuse/fp8/ whose comment cites this script. Shapes are skipped, and said so, once
--budget-s seconds have gone by. On the CPU the figures say nothing about a GPU.
"""

import argparse
import pathlib
import re
import statistics
import time

import fp8_setups
import torch
from _report import report
from _timing import default_device, time_calls
from fp8_setups import NotAvailable

RECIPES = {"current": "ampfuse fp8 current", "rowwise": "ampfuse fp8 rowwise",
           "delayed": "ampfuse fp8 delayed"}
DEFAULTS = {"cuda": {"tokens": [1024, 2048, 4096, 8192, 16384],
                         "features": [768, 1024, 2048, 4096, 8192], "warmup": 3, "repeats": 10},
            "cpu": {"tokens": [32, 64], "features": [32, 64], "warmup": 1, "repeats": 2}}
FP8_PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "ampfuse" / "fp8"


def _call(layer, x, grad):
    weights_stepped = fp8_setups.weight_stepper(layer)

    def call(_):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        weights_stepped()  # as a training step's new weights would
        layer(x).backward(grad)
    return call


def time_shape(m, k, n, a):
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        bf16 = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        fp8 = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16))
    fp8[0].weight.data.copy_(bf16.weight.data)
    fp8 = fp8_setups.convert_layer(fp8, RECIPES[a.recipe])
    gen = torch.Generator(device=a.device).manual_seed(a.seed + 1)
    x = torch.randn(m, k, device=a.device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(m, n, device=a.device, dtype=torch.bfloat16, generator=gen)
    medians = []
    for layer in (bf16, fp8, bf16):
        medians.append(statistics.median(time_calls(_call(layer, x, grad), a.device, a.warmup,
                                                    a.repeats)))
    base = statistics.fmean((medians[0], medians[2]))
    return {"tokens": m, "in": k, "out": n, "bf16_s": base, "fp8_s": medians[1],
            "ratio": base / medians[1],
            "noise_pct": 100 * abs(medians[0] - medians[2]) / min(medians[0], medians[2]),
            "tflops_fp8": 6 * m * k * n / medians[1] / 1e12}


def thresholds(rows, features):
    """{tokens: smallest t such that FP8 wins for every measured (K, N) with min >= t}."""
    out = {}
    for m in sorted({r["tokens"] for r in rows}):
        at_m = [r for r in rows if r["tokens"] == m and "ratio" in r]
        found = None
        for t in sorted(features, reverse=True):
            covered = [r for r in at_m if min(r["in"], r["out"]) >= t]
            if covered and all(r["ratio"] > 1.0 for r in covered):
                found = t
            else:
                break
        out[m] = found
    return out


def threshold_constant():
    """'file: NAME = value' of the constant in python/ampfuse/fp8/ that cites this script."""
    for path in sorted(FP8_PACKAGE.glob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "bench_fp8_threshold" in line:
                # The constant the comment belongs to: the first assignment after it.
                for nearby in lines[i: i + 20]:
                    match = re.match(r"\s*([A-Z][A-Z0-9_]+)\s*(?::[^=]+)?=\s*(.+)", nearby)
                    if match:
                        return f"{path.name}: {match.group(1)} = {match.group(2).strip()}"
    return None


def run(args):
    a = argparse.Namespace(**vars(args))
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    for key, value in DEFAULTS[a.device].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    rows, start = [], time.perf_counter()
    for m in a.tokens:
        for k in a.features:
            for n in a.features:
                if time.perf_counter() - start > a.budget_s:
                    rows.append({"tokens": m, "in": k, "out": n, "error": "skipped: --budget-s"})
                    continue
                try:
                    rows.append(time_shape(m, k, n, a))
                except NotAvailable as error:
                    raise SystemExit(f"--recipe {a.recipe}: not available: {error}") from None
                except RuntimeError as error:  # OOM at the largest shapes
                    rows.append({"tokens": m, "in": k, "out": n,
                                 "error": str(error).splitlines()[0][:100]})
    for row in rows:
        row.update(device=a.device, recipe=a.recipe)
    found = thresholds(rows, a.features)
    rows.append({"summary": True, "device": a.device, "recipe": a.recipe,
                 "threshold_by_tokens": {str(m): t for m, t in found.items()},
                 "reference_tokens": a.reference_tokens,
                 "suggested_min_features": found.get(a.reference_tokens),
                 "constant": threshold_constant()})
    return rows


def format_rows(rows, env):
    summary = rows[-1]
    shapes = [r for r in rows[:-1]]
    tokens = sorted({r["tokens"] for r in shapes})
    where = env.get("gpu") if summary["device"] == "cuda" else f"CPU x{env['cpu_threads']}"
    lines = [(f"# fp8 threshold ({summary['recipe']} scaling): {where}; torch {env['torch']}; "
              f"{env['date']}; {env['command']}"),
             ("# bf16 / fp8 time of Linear forward+backward (> 1: FP8 faster); rows in x out, "
              "columns tokens"),
             f"{'in x out':>12} " + " ".join(f"{m:>8}" for m in tokens)]
    cells = {(r["tokens"], r["in"], r["out"]): r for r in shapes}
    for k, n in sorted({(r["in"], r["out"]) for r in shapes}):
        line = f"{f'{k}x{n}':>12} "
        for m in tokens:
            r = cells.get((m, k, n), {})
            line += " " + (f"{r['ratio']:8.2f}" if "ratio" in r else f"{'-':>8}")
        lines.append(line)
    noise = [r["noise_pct"] for r in shapes if "noise_pct" in r]
    if noise:
        lines.append(f"# noise (bf16 timed twice): median {statistics.median(noise):.1f}%, "
                     f"max {max(noise):.1f}%")
    skipped = [r for r in shapes if "error" in r]
    if skipped:
        lines.append(f"# {len(skipped)} shapes not measured: {skipped[0]['error']}")
    lines.append("# FP8 wins at every shape with min(in, out) >= t: "
                 + ", ".join(f"{m} tokens: {t if t is not None else 'nowhere measured'}"
                             for m, t in summary["threshold_by_tokens"].items()))
    constant = summary["constant"] or "(no constant in python/ampfuse/fp8/ cites this script yet)"
    lines.append(f"# suggested min_features at {summary['reference_tokens']} tokens: "
                 f"{summary['suggested_min_features']}; the constant to update: {constant}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--recipe", choices=list(RECIPES), default="current")
    parser.add_argument("--tokens", nargs="+", type=int)
    parser.add_argument("--features", nargs="+", type=int)
    parser.add_argument("--reference-tokens", type=int, default=8192)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return report(run(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main()

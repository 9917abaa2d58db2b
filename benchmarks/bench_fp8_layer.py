"""One Llama decoder layer, forward + backward, bf16 against the FP8 recipes (issue 31's
benchmark c: >= 1.4x bf16 at hidden 4096, seq 2048 on an H100).

    PYTHONPATH=python python benchmarks/bench_fp8_layer.py [--device cuda] [--batch 4]
        [--hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --seq 2048] [--json PATH]

The layer is llama_workload.DecoderLayer (RMSNorm, grouped-query SDPA attention, SwiGLU) in
bf16 weights, from the same seed in every row; an input of batch x seq tokens and a fixed
random output gradient. One call = forward + backward (weight and input gradients), timed with
CUDA events after warm-up, median of --repeats. Each call starts with new weights as far as
FP8 is concerned (fp8_setups.weight_stepper): a training step quantizes its weights again,
and so does every row here. Rows: bf16 (eager, run first and again last:
noise%), bf16 under torch.compile (the fair baseline for torchao, which compiles), the ampfuse
recipes (its fp8 Linears swapped in by ampfuse.fp8.convert, or fp8.Linear.from_linear where
convert is not there yet) and torchao float8 tensorwise / rowwise (compiled) where torchao
imports. "vs bf16": eager bf16's median over the row's (> 1: faster). TFLOP/s counts the
Linears' GEMMs (3 per Linear, 2mnk each) and attention's (4 s^2 d per head pair, causal half,
x3 for the backward).
"""

import argparse
import statistics

import fp8_setups
import llama_workload
import torch
from _report import report
from _timing import default_device, time_calls
from fp8_setups import NotAvailable

SETUPS = ("bf16", "bf16 compiled", "ampfuse fp8 current", "ampfuse fp8 rowwise",
          "ampfuse fp8 delayed", "torchao tensorwise", "torchao rowwise")
DEFAULTS = {"cuda": {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "seq": 2048,
                     "batch": 4, "warmup": 5, "repeats": 20},
            "cpu": {"hidden": 64, "ffn": 192, "heads": 4, "kv_heads": 2, "seq": 32, "batch": 2,
                    "warmup": 1, "repeats": 3}}


def layer_flops(a):
    tokens = a.batch * a.seq
    kv = a.kv_heads * (a.hidden // a.heads)
    linear = 2 * tokens * (2 * a.hidden * a.hidden + 2 * a.hidden * kv + 3 * a.hidden * a.ffn)
    attention = 4 * a.batch * a.seq * a.seq * a.hidden / 2  # QK^T and PV, causal half
    return 3 * (linear + attention)


def time_setup(setup, a):
    row = {"setup": setup, "device": a.device, "config": {k: getattr(a, k) for k in (
        "hidden", "ffn", "heads", "kv_heads", "seq", "batch")}}
    try:
        torch.manual_seed(a.seed)
        with torch.device(a.device):
            layer = llama_workload.DecoderLayer(a.hidden, a.ffn, a.heads, a.kv_heads)
        layer = layer.to(torch.bfloat16)
        if setup == "bf16 compiled":
            layer = torch.compile(layer)
        elif setup != "bf16":
            layer = fp8_setups.convert_layer(layer, setup)
        gen = torch.Generator(device=a.device).manual_seed(a.seed + 1)
        x = torch.randn(a.batch, a.seq, a.hidden, device=a.device, generator=gen,
                        dtype=torch.bfloat16).requires_grad_()
        grad = torch.randn(x.shape, device=a.device, generator=gen, dtype=torch.bfloat16)
        cos, sin = llama_workload.rotary_tables(a.seq, a.hidden // a.heads, a.device)

        weights_stepped = fp8_setups.weight_stepper(layer)

        def call(_):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            weights_stepped()  # as a training step's new weights would
            layer(x, cos, sin).backward(grad)

        times = time_calls(call, a.device, a.warmup, a.repeats)
        row["median_s"] = statistics.median(times)
        row["tflops"] = layer_flops(a) / row["median_s"] / 1e12
    except NotAvailable as error:
        row["error"] = f"not available: {error}"
    # AttributeError: an op the recipe calls is missing from this build (one FP8 branch merged
    # without the other); the row says so and the run goes on. OOM is a RuntimeError.
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as error:
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    finally:
        if setup == "bf16 compiled" or setup in fp8_setups.TORCHAO:
            torch._dynamo.reset()  # compiled graphs and their guards hold on to the layer
    return row


def run(args):
    a = argparse.Namespace(**vars(args))
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    for key, value in DEFAULTS[a.device].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    setups = a.setups or SETUPS
    rows = {}
    for setup in ["bf16", *(s for s in setups if s != "bf16"), "bf16"]:
        row = time_setup(setup, a)
        if setup in rows:
            first = rows[setup]
            if "median_s" in first and "median_s" in row:
                first["noise_pct"] = 100 * abs(first["median_s"] - row["median_s"]) / min(
                    first["median_s"], row["median_s"])
            continue
        rows[setup] = row
    base = rows["bf16"]
    for row in rows.values():
        if "median_s" in row and "median_s" in base:
            row["vs_bf16"] = base["median_s"] / row["median_s"]
    return list(rows.values())


def format_rows(rows, env):
    c = rows[0]["config"]
    where = env.get("gpu") if rows[0]["device"] == "cuda" else f"CPU x{env['cpu_threads']}"
    lines = [f"# fp8 layer: {where}; torch {env['torch']}; {env['date']}; {env['command']}",
             "# one decoder layer fwd+bwd: " + ", ".join(f"{k} {v}" for k, v in c.items()),
             f"{'setup':>20} {'ms':>9} {'noise%':>6} {'TFLOP/s':>8} {'vs bf16':>7}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['setup']:>20} {r['error'][:100]}")
            continue
        noise = r.get("noise_pct")
        lines.append(f"{r['setup']:>20} {r['median_s'] * 1e3:9.3f} "
                     f"{'-' if noise is None else format(noise, '.1f'):>6} "
                     f"{r['tflops']:8.1f} {r.get('vs_bf16', float('nan')):7.2f}")
    lines.append("# vs bf16: eager bf16 median / this row's (> 1: faster); noise%: bf16 run twice")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--setups", nargs="+", choices=SETUPS)
    for flag in ("hidden", "ffn", "heads", "kv-heads", "seq", "batch", "warmup", "repeats"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return report(run(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main()

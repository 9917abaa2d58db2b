"""Times training steps of a GPT-2-style transformer and a ResNet-style CNN, side by side.

Whole steps (forward, loss, backward, optimizer step) in four precision set-ups, in one run:
fp32, torch's native AMP, ampfuse O1 and ampfuse O2; for the transformer also O2 with FP8
GEMMs.

    PYTHONPATH=python python benchmarks/bench_train.py [--device cpu|cuda] [--models gpt cnn]
        [--layers N --d-model N --heads N --seq N --batch N --vocab N]
        [--cnn-width N --cnn-blocks N N N N --image-size N --cnn-batch N --classes N]
        [--amp-dtype fp16|bf16] [--warmup N] [--repeats N] [--json PATH]

Models, built from torch.nn, on synthetic data (random tokens or images, fixed seed; every row
starts from the same weights and sees the same batches):
  gpt  pre-norm decoder: token and position embeddings, blocks of LayerNorm, causal
       scaled_dot_product_attention, LayerNorm and a 4x GELU MLP, a final LayerNorm and an
       output head tied to the token embedding; cross-entropy on next-token targets. On CUDA,
       GPT-2 small: 12 layers, d_model 768, 12 heads, vocab 50257, 1024 tokens, batch 8. On the
       CPU a tiny one, so that the whole run takes under a minute on 2 cores: 2 layers, d_model
       256, 4 heads, vocab 8192, 128 tokens, batch 4.
  cnn  ResNet with basic blocks (two 3x3 conv + BatchNorm, ReLU, projection shortcuts) in four
       stages of doubling width, global average pooling and a linear classifier. On CUDA,
       ResNet-18 on 224x224 images (base width 64, 2 blocks per stage, batch 128, 1000 classes,
       channels_last); on the CPU base width 16, 1 block per stage, 32x32 images, batch 16,
       10 classes.

Rows (the low-precision dtype is fp16 on CUDA and bf16 on the CPU unless --amp-dtype says):
  fp32        the fp32 model, torch.optim.AdamW (fused or foreach, as below), true fp32 math.
  torch amp   torch's own recipe: torch.autocast around forward and loss,
              torch.amp.GradScaler, torch.optim.AdamW(fused=True) where torch has a fused
              kernel for the device (foreach otherwise).
  ampfuse O1  amp.initialize(opt_level="O1") with ampfuse.optimizers.FusedAdamW.
  ampfuse O2  amp.initialize(opt_level="O2") with ampfuse.optimizers.FusedAdam: a
              low-precision model with normalization layers in fp32, fp32 master weights kept
              inside the fused optimizer.
  ampfuse O2 fp8  (gpt only) the same with fp8=True: every nn.Linear of the blocks computes
              its three GEMMs in FP8 (e4m3 forward, e5m2 gradients, delayed scaling). FP8
              GEMMs write bf16 or fp32, so with an fp16 model each one adds a cast; compare it
              with O2 in a --amp-dtype bf16 run. On a GPU below compute capability 8.9 the row
              reports the refusal; on the CPU it times the fp32 emulation.
Every row uses AdamW's math with the same hyperparameters; the loss is computed in fp32 from the
model's output in every row.

Method: a step is timed from zero_grad to the end of the optimizer step (and scaler update),
on CUDA with a pair of CUDA events around each step, on the CPU with perf_counter; rows report
the median after warm-up steps. TF32 is off and torch.backends.cudnn.benchmark on for the whole
run, in every row. "torch amp" is timed first and again last; the gap between its
two medians (noise%) is this run's noise, and a ratio closer to 1 than that is not a result.
Throughput is tokens (or images) per second at the median step time; peak memory is
torch.cuda.max_memory_allocated over the row's whole run (model, optimizer state, data,
activations), "n/a" on the CPU. "vs amp" and "vs fp32" are throughput ratios against the
torch amp and fp32 rows (> 1: faster); "mem/amp" is peak memory over torch amp's.

Goals, read from the ratios on a GPU and never asserted: ampfuse O2 at >= 1.1x the throughput
of torch amp and >= 2x fp32 (TF32 off), with less peak memory than torch amp. CPU figures say
only that the scripts run and how the set-ups compare on this CPU; they are not GPU evidence.
"""

import argparse
import gc
import math
import time

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ampfuse import amp
from ampfuse.optimizers import FusedAdam, FusedAdamW
from _report import report
from _timing import default_device, summarize, synchronize
from train_workloads import CNN_DEFAULTS, DATA_BATCHES, GPT_DEFAULTS, Workload

LR = 3e-4
WEIGHT_DECAY = 0.01

STEP_DEFAULTS = {"cuda": dict(warmup=10, repeats=40), "cpu": dict(warmup=5, repeats=30)}
IMPLS = ("fp32", "torch amp", "ampfuse O1", "ampfuse O2", "ampfuse O2 fp8")
# The CNN has no Linear that FP8 takes (its classifier's sizes are not multiples of 16).
FP8_MODELS = ("gpt",)
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in AMP_DTYPES.items()}


def torch_adamw(params, device):
    """AdamW(fused=True) where torch has a fused kernel for the device, foreach otherwise."""
    if device in _get_fused_kernels_supported_devices():
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True), "fused"
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True), "foreach"


def _no_mark(part):
    pass


def make_step(impl, workload, dtype):
    """Builds a fresh model and optimizer for `impl`; returns (step(batch, mark) -> loss,
    optimizer description, parameter count). The step calls mark("forward") after zero_grad,
    forward and loss, mark("backward") after the backward, and mark("step") after the optimizer
    step with its unscale and loss-scale update: profile_gpu.py times the parts by it."""
    device = workload.args.device
    torch.manual_seed(workload.args.seed)
    model = workload.model()
    count = sum(p.numel() for p in model.parameters())
    loss_fn = workload.loss

    if impl == "fp32":
        opt, kind = torch_adamw(model.parameters(), device)

        def step(batch, mark=_no_mark):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch[0]), batch[1])
            mark("forward")
            loss.backward()
            mark("backward")
            opt.step()
            mark("step")
            return loss

        return step, f"AdamW({kind})", count

    if impl == "torch amp":
        opt, kind = torch_adamw(model.parameters(), device)
        scaler = torch.amp.GradScaler(device)

        def step(batch, mark=_no_mark):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                loss = loss_fn(model(batch[0]), batch[1])
            mark("forward")
            scaler.scale(loss).backward()
            mark("backward")
            scaler.step(opt)
            scaler.update()
            mark("step")
            return loss

        return step, f"AdamW({kind}) + GradScaler", count

    if impl == "ampfuse O1":
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        model, opt = amp.initialize(model, opt, opt_level="O1", dtype=dtype, verbosity=0)
        name = "FusedAdamW"
    else:
        fp8 = impl == "ampfuse O2 fp8"
        opt = FusedAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0,
                                    fp8=fp8)
        name = "FusedAdam (fp32 masters)" + (", FP8" if fp8 else "")

    def step(batch, mark=_no_mark):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch[0]), batch[1])
        mark("forward")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            mark("backward")
        opt.step()
        mark("step")
        return loss

    return step, name, count


def time_impl(impl, workload, dtype, args):
    """Runs warm-up and timed steps of one row on a fresh model. Returns a result row."""
    device = args.device
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"op": "train", "model": workload.name, "impl": impl, "device": device,
           "dtype": "fp32" if impl == "fp32" else DTYPE_NAMES[dtype],
           "unit": f"{workload.unit}/s", "items_per_step": workload.items_per_step,
           "config": workload.config}
    try:
        batches = workload.batches()
        step, optimizer, count = make_step(impl, workload, dtype)
        row.update(optimizer=optimizer, params=count)
        for i in range(args.warmup):
            step(batches[i % DATA_BATCHES])
        synchronize(device)
        times = []
        if device == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(args.repeats)]
            for i, (start, end) in enumerate(events):
                start.record()
                loss = step(batches[i % DATA_BATCHES])
                end.record()
            torch.cuda.synchronize()
            times = [start.elapsed_time(end) / 1e3 for start, end in events]
        else:
            for i in range(args.repeats):
                t0 = time.perf_counter()
                loss = step(batches[i % DATA_BATCHES])
                times.append(time.perf_counter() - t0)
        row["final_loss"] = float(loss.detach().float())
        row["times_s"] = times
        row.update(summarize(times))
        row["items_per_s"] = workload.items_per_step / row["median_s"]
        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
    except (RuntimeError, NotImplementedError) as error:  # OOM included: the row says so
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
    return row


def impls_for(workload):
    return tuple(i for i in IMPLS if i != "ampfuse O2 fp8" or workload.name in FP8_MODELS)


def run_workload(workload, dtype, args):
    # torch amp runs first and last: the gap between its two medians is the noise.
    impls = impls_for(workload)
    order = ["torch amp", *(impl for impl in impls if impl != "torch amp"), "torch amp"]
    results = [time_impl(impl, workload, dtype, args) for impl in order]
    native_first, native_second = results[0], results[-1]
    rows = {r["impl"]: r for r in results[1:-1]}
    native = dict(native_first)
    if "median_s" in native_first and "median_s" in native_second:
        m1, m2 = native_first["median_s"], native_second["median_s"]
        native.update(summarize(native_first["times_s"] + native_second["times_s"]))
        native["times_s"] = native_first["times_s"] + native_second["times_s"]
        native["noise_pct"] = 100 * abs(m1 - m2) / min(m1, m2)
        native["items_per_s"] = workload.items_per_step / native["median_s"]
        native["peak_mem_bytes"] = max(native_first["peak_mem_bytes"] or 0,
                                       native_second["peak_mem_bytes"] or 0) or None
        native["final_loss"] = native_second["final_loss"]
    rows["torch amp"] = native
    out = [rows[impl] for impl in impls]
    fp32 = rows["fp32"]
    for row in out:
        if "median_s" not in row:
            continue
        if "median_s" in native:
            row["speedup_vs_torch_amp"] = native["median_s"] / row["median_s"]
            if row.get("peak_mem_bytes") and native.get("peak_mem_bytes"):
                row["mem_vs_torch_amp"] = row["peak_mem_bytes"] / native["peak_mem_bytes"]
        if "median_s" in fp32:
            row["speedup_vs_fp32"] = fp32["median_s"] / row["median_s"]
    return out


def run(args):
    """One row per model and set-up (see the module docstring)."""
    args = finish_args(args)
    dtype = AMP_DTYPES[args.amp_dtype]
    flags = (torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"), \
        (torch.backends.cudnn, "benchmark")
    saved = [getattr(module, name) for module, name in flags]
    # TF32 off: the fp32 row is true fp32. cuDNN picks its fastest convolutions during warm-up.
    for (module, name), value in zip(flags, (False, False, True)):
        setattr(module, name, value)
    try:
        rows = []
        for name in args.models:
            rows += run_workload(Workload(name, args), dtype, args)
    finally:
        for (module, name), value in zip(flags, saved):
            setattr(module, name, value)
    return rows


# ---- command line and table --------------------------------------------------------------------


def add_args(parser):
    """The flags of this benchmark (benchmarks/run.py adds them to its own)."""
    group = parser.add_argument_group("training benchmark (bench_train.py)")
    group.add_argument("--models", nargs="+", choices=["gpt", "cnn"], default=["gpt", "cnn"])
    group.add_argument("--amp-dtype", choices=list(AMP_DTYPES), default=None,
                       help="low-precision dtype (default: fp16 on cuda, bf16 on cpu)")
    for key, flag, what in (("layers", "--layers", "transformer blocks"),
                            ("d_model", "--d-model", "model width"),
                            ("heads", "--heads", "attention heads"),
                            ("seq", "--seq", "tokens per sequence"),
                            ("batch", "--batch", "sequences per step"),
                            ("vocab", "--vocab", "vocabulary size")):
        group.add_argument(flag, type=int, default=None, help=f"gpt: {what} " + _defaults(
            GPT_DEFAULTS, key))
    for key, flag, what in (("cnn_width", "--cnn-width", "width of the first stage"),
                            ("image_size", "--image-size", "image side in pixels"),
                            ("cnn_batch", "--cnn-batch", "images per step"),
                            ("classes", "--classes", "classes")):
        group.add_argument(flag, type=int, default=None, help=f"cnn: {what} " + _defaults(
            CNN_DEFAULTS, key))
    group.add_argument("--cnn-blocks", type=int, nargs=4, default=None, metavar="N",
                       help="cnn: basic blocks in each of the four stages "
                       + _defaults(CNN_DEFAULTS, "cnn_blocks"))
    return parser


def _defaults(table, key):
    def show(value):
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    return f"(default {show(table['cuda'][key])} on cuda, {show(table['cpu'][key])} on cpu)"


def finish_args(args):
    """Fills every size and step count not given with the device's default. Returns a copy."""
    args = argparse.Namespace(**vars(args))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    for defaults in (GPT_DEFAULTS, CNN_DEFAULTS, STEP_DEFAULTS):
        for key, value in defaults[args.device].items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    if args.amp_dtype is None:
        args.amp_dtype = "fp16" if args.device == "cuda" else "bf16"
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    return args


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps per row (default 10 cuda, 5 cpu)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per row (default 40 cuda, 30 cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    add_args(parser)
    return parser.parse_args(argv)


def _describe(row):
    c = row["config"]
    if row["model"] == "gpt":
        return (f"gpt: layers {c['layers']}, d_model {c['d_model']}, heads {c['heads']}, vocab "
                f"{c['vocab']}, seq {c['seq']}, batch {c['batch']}")
    return (f"cnn: ResNet width {c['width']}, blocks {c['blocks']}, images {c['image_size']}px, "
            f"batch {c['batch']}, classes {c['classes']}"
            + (", channels_last" if c["channels_last"] else ""))


def format_rows(rows, env):
    cuda = bool(rows) and rows[0]["device"] == "cuda"
    where = env.get("gpu") if cuda else f"CPU x{env['cpu_threads']} threads"
    lines = [f"# train: {where}; torch {env['torch']}; {env['date']}; {env['command']}"]
    columns = [("impl", 14), ("dtype", 5), ("optimizer", 31), ("ms", 9), ("noise%", 6),
               ("items/s", 10), ("peak MB", 8), ("vs amp", 6), ("vs fp32", 7), ("mem/amp", 7),
               ("loss", 7)]
    model = None
    for row in rows:
        if row["model"] != model:
            model = row["model"]
            params = next((r["params"] for r in rows if r["model"] == model and "params" in r),
                          None)
            lines.append(f"# {_describe(row)}; {params:,} params; items/s are {row['unit']}"
                         if params else f"# {_describe(row)}")
            lines.append("  ".join(name.rjust(width) for name, width in columns))
        peak = row.get("peak_mem_bytes")
        cells = {
            "impl": row["impl"], "dtype": row["dtype"], "optimizer": row.get("optimizer", "-"),
            "ms": _fmt(row.get("median_s"), "{:.2f}", 1e3),
            "noise%": _fmt(row.get("noise_pct"), "{:.1f}"),
            "items/s": _fmt(row.get("items_per_s"), "{:,.0f}"),
            "peak MB": "n/a" if peak is None else f"{peak / 2**20:,.0f}",
            "vs amp": _fmt(row.get("speedup_vs_torch_amp"), "{:.2f}"),
            "vs fp32": _fmt(row.get("speedup_vs_fp32"), "{:.2f}"),
            "mem/amp": _fmt(row.get("mem_vs_torch_amp"), "{:.2f}"),
            "loss": _fmt(row.get("final_loss"), "{:.3f}"),
        }
        if "error" in row:
            cells["ms"] = row["error"][:60]
        lines.append("  ".join(str(cells[name]).rjust(width) for name, width in columns))
    lines.append("# ms: median step (zero_grad to optimizer step); noise%: gap between torch amp's "
                 "two timings; items/s: tokens or images per second; vs amp, vs fp32: throughput "
                 "ratios (> 1: faster); mem/amp: peak memory over torch amp's")
    return "\n".join(lines)


def _fmt(value, fmt, factor=1):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value * factor)


def main(argv=None):
    args = parse_args(argv)
    return report(run(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main()

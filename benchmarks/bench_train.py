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
import torch.nn.functional as F
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ampfuse import amp
from ampfuse.optimizers import FusedAdam, FusedAdamW
from _timing import default_device, report, summarize, synchronize

LR = 3e-4
WEIGHT_DECAY = 0.01
DATA_BATCHES = 2  # distinct batches cycled through, so no step sees the previous one's data

GPT_DEFAULTS = {
    "cuda": dict(layers=12, d_model=768, heads=12, seq=1024, batch=8, vocab=50257),
    "cpu": dict(layers=2, d_model=256, heads=4, seq=128, batch=4, vocab=8192),
}
CNN_DEFAULTS = {
    "cuda": dict(cnn_width=64, cnn_blocks=[2, 2, 2, 2], image_size=224, cnn_batch=128,
                 classes=1000),
    "cpu": dict(cnn_width=16, cnn_blocks=[1, 1, 1, 1], image_size=32, cnn_batch=16, classes=10),
}
STEP_DEFAULTS = {"cuda": dict(warmup=10, repeats=40), "cpu": dict(warmup=5, repeats=30)}
IMPLS = ("fp32", "torch amp", "ampfuse O1", "ampfuse O2", "ampfuse O2 fp8")
# The CNN has no Linear that FP8 takes (its classifier's sizes are not multiples of 16).
FP8_MODELS = ("gpt",)
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in AMP_DTYPES.items()}


# ---- models ------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers, d_model, heads, seq, vocab):
        super().__init__()
        if d_model % heads:
            raise SystemExit(f"--d-model {d_model} is not a multiple of --heads {heads}")
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width, blocks, image_size, classes):
        super().__init__()
        if image_size >= 128:  # ImageNet-style stem: 7x7/2 conv and a 3x3/2 max pool
            stem = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                    nn.MaxPool2d(3, 2, 1)]
        else:  # CIFAR-style stem for small images
            stem = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        layers, cin = [], width
        for stage, count in enumerate(blocks):
            cout = width * 2**stage
            for i in range(count):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.features = nn.Sequential(*stem, *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.features(x))


# ---- workloads ---------------------------------------------------------------------------------


class Workload:
    """A model family at one size: builds the model and the data, computes the loss."""

    def __init__(self, name, args):
        self.name = name
        self.args = args
        self.channels_last = name == "cnn" and args.device == "cuda"
        if name == "gpt":
            self.items_per_step, self.unit = args.batch * args.seq, "tokens"
            self.config = dict(layers=args.layers, d_model=args.d_model, heads=args.heads,
                               seq=args.seq, batch=args.batch, vocab=args.vocab)
        else:
            self.items_per_step, self.unit = args.cnn_batch, "images"
            self.config = dict(width=args.cnn_width, blocks=list(args.cnn_blocks),
                               image_size=args.image_size, batch=args.cnn_batch,
                               classes=args.classes, channels_last=self.channels_last)

    def model(self):
        a = self.args
        if self.name == "gpt":
            model = GPT(a.layers, a.d_model, a.heads, a.seq, a.vocab)
        else:
            model = ResNet(a.cnn_width, a.cnn_blocks, a.image_size, a.classes)
        model = model.to(a.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def batches(self):
        a = self.args
        gen = torch.Generator(device=a.device).manual_seed(a.seed + 1)
        out = []
        for _ in range(DATA_BATCHES):
            if self.name == "gpt":
                tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen,
                                       device=a.device)
                out.append((tokens[:, :-1], tokens[:, 1:]))
            else:
                images = torch.randn(a.cnn_batch, 3, a.image_size, a.image_size, generator=gen,
                                     device=a.device)
                if self.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                labels = torch.randint(0, a.classes, (a.cnn_batch,), generator=gen,
                                       device=a.device)
                out.append((images, labels))
        return out

    @staticmethod
    def loss(output, target):
        # fp32 loss from whatever dtype the model hands out, the same in every row.
        return F.cross_entropy(output.float().flatten(0, -2), target.flatten())


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

"""The amp front end's cost per training step against torch's own mixed-precision loop.

Step time, side by side in one process with the set-ups interleaved step by step, of:
  torch        torch.autocast around forward and loss, torch.amp.GradScaler,
               torch.optim.SGD(momentum=0.9) (foreach)
  torch fused  the same with torch.optim.SGD(fused=True): what O2 with a fused optimizer is
               held to
  O1           amp.initialize(opt_level="O1"), the same torch.optim.SGD, amp.scale_loss
  O1 lists     O1 with custom_white_list=["gelu"]: every GELU then runs through the Autocast
               kernel amp registers for a custom list, on the bf16 tensor it gets in torch's
               loop too, so the row is the cost of a custom list alone. A list that changes
               dtypes changes the arithmetic as well: custom_black_list=["layer_norm"] (fp32
               LayerNorm) cost the mlp 1-4% in benchmarks/RESULTS.md, and white-listing
               layer_norm casts its fp32 weight and bias to bf16 at every call
  O2           amp.initialize(opt_level="O2") with ampfuse.optimizers.FusedSGD (fp32 masters)
  O2 noattr    O2 with attribute_overflow=False: the cost of overflow attribution (on by
               default) is the gap between O2 and this row
on two models built from torch.nn, with many small ops, where per-op and per-step Python decide
the step time:
  mlp  24 blocks of Linear(d, d), LayerNorm, GELU (d 256, batch 16), MSE loss
  gpt  2 pre-norm GPT blocks (LayerNorm, causal scaled_dot_product_attention, 4x GELU MLP;
       d_model 128, 4 heads, 64 tokens, batch 4), MSE loss

    PYTHONPATH=python python benchmarks/bench_amp_overhead.py [--device cpu|cuda]
        [--overhead-models mlp gpt] [--amp-dtype bf16|fp16] [--threads N] [--warmup N] [--repeats N]

Method: one step is zero_grad, forward, loss, backward and the optimizer step (and the scaler's
update), timed with perf_counter after a device synchronize. The set-ups take turns, one step
each, so that a change in the machine's load falls on all of them alike; each reports its
fastest and its median step. "speed" is the median, over the rounds, of torch's step time
over the set-up's in the same round (> 1: faster than torch): steps taken a few milliseconds
apart see the same load, so the ratio holds on a busy machine where medians of their own
drift. "best" is torch's fastest step over the set-up's, the least disturbed ones. The dtype is
bf16 on the CPU and fp16 on CUDA unless --amp-dtype says; with bf16, amp trains unscaled by
default and torch's GradScaler still scales (it is the recipe torch documents).

"py calls" is the Python work of one step, untimed and apart from the timed rounds: the calls
cProfile counts (Python functions and builtins, e.g. list.append or a tensor method) over
five steps, per step. Issue 14 holds O2 with a fused optimizer to at most "torch fused".
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _report import environment
from _timing import synchronize
from ampfuse import amp
from ampfuse.optimizers import FusedSGD
from train_workloads import Block
from torch import nn

LR, MOMENTUM = 0.01, 0.9
IMPLS = ("torch", "torch fused", "O1", "O1 lists", "O2", "O2 noattr")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MLP(nn.Module):
    def __init__(self, width, blocks):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width),
                                                    nn.GELU()) for _ in range(blocks)))

    def forward(self, x):
        return self.blocks(x)


class GPTBlocks(nn.Module):
    def __init__(self, d_model, heads, blocks):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(blocks)))

    def forward(self, x):
        return self.blocks(x)


def workload(name, device, seed):
    """(model, input, target) of one model, the same weights and data for every set-up."""
    torch.manual_seed(seed)
    if name == "mlp":
        model, shape = MLP(256, 24), (16, 256)
    else:
        model, shape = GPTBlocks(128, 4, 2), (4, 64, 128)
    return model.to(device), torch.randn(shape, device=device), torch.randn(shape, device=device)


def torch_recipe_step(model, opt, x, target, device, dtype):
    """One step of torch's recipe: autocast around forward and loss, torch.amp.GradScaler."""
    scaler = torch.amp.GradScaler(device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = F.mse_loss(model(x).float(), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def amp_step(model, opt, x, target):
    """One step of a model and optimizer amp.initialize returned: amp.scale_loss around
    backward."""

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    return step


def make_step(impl, name, device, dtype, seed):
    model, x, target = workload(name, device, seed)
    if impl in ("torch", "torch fused"):
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                              fused=impl == "torch fused" or None)
        return torch_recipe_step(model, opt, x, target, device, dtype)
    if impl in ("O2", "O2 noattr"):
        opt = FusedSGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0,
                                    attribute_overflow=impl == "O2")
    else:
        lists = {"custom_white_list": ["gelu"]} if impl == "O1 lists" else {}
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        model, opt = amp.initialize(model, opt, opt_level="O1", dtype=dtype, verbosity=0,
                                    **lists)
    return amp_step(model, opt, x, target)


def time_interleaved(steps, device, warmup, repeats):
    """{impl: [seconds per step]}, the set-ups taking turns step by step."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {impl: [] for impl in steps}
    for _ in range(repeats):
        for impl, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times[impl].append(time.perf_counter() - start)
    return times


def python_calls_per_step(step, steps=5):
    """The calls cProfile counts (Python functions and builtins) per step, over `steps`."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    return sum(stat[1] for stat in pstats.Stats(profile).stats.values()) / steps


def run(args):
    warmup = 10 if args.warmup is None else args.warmup
    repeats = (200 if args.device == "cuda" else 60) if args.repeats is None else args.repeats
    dtype = DTYPES[args.amp_dtype or ("fp16" if args.device == "cuda" else "bf16")]
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.overhead_models:
        steps = {impl: make_step(impl, name, args.device, dtype, args.seed) for impl in IMPLS}
        times = time_interleaved(steps, args.device, warmup, repeats)
        calls = {impl: python_calls_per_step(step) for impl, step in steps.items()}
        torch_best = min(times["torch"])
        for impl in IMPLS:
            median, best = statistics.median(times[impl]), min(times[impl])
            # Each round's torch step over this set-up's step of the same round: the two ran
            # a few ms apart, so a change in the machine's load cancels out of the ratio.
            paired = statistics.median(t / s for t, s in zip(times["torch"], times[impl]))
            rows.append({"model": name, "impl": impl, "device": args.device,
                         "dtype": str(dtype).replace("torch.", ""),
                         "threads": torch.get_num_threads(), "median_ms": median * 1e3,
                         "best_ms": best * 1e3, "speed": paired,
                         "best_speed": torch_best / best, "python_calls": calls[impl]})
    return rows


def format_rows(rows, env):
    device = rows[0]["device"] if rows else "?"
    title = f"# amp overhead: training steps, set-ups interleaved ({env['torch']}, {device}, "
    lines = [title + f"{env['date']})"]
    lines.append(f"{'model':6} {'impl':11} {'dtype':9} {'thr':>3} {'median ms':>10} "
                 f"{'best ms':>8} {'speed':>6} {'best':>6} {'py calls':>8}")
    for r in rows:
        lines.append(f"{r['model']:6} {r['impl']:11} {r['dtype']:9} {r['threads']:>3} "
                     f"{r['median_ms']:10.3f} {r['best_ms']:8.3f} {r['speed']:6.3f} "
                     f"{r['best_speed']:6.3f} {r['python_calls']:8.0f}")
    lines.append("speed: median over rounds of torch's step time over the set-up's in the same "
                 "round (> 1: faster than torch); best: torch's fastest step over the set-up's; "
                 "py calls: Python calls per step (cProfile).")
    return "\n".join(lines)


def add_args(parser, own=True):
    """This benchmark's flags. benchmarks/run.py (own=False) already has --device, --warmup,
    --repeats, --seed and bench_train's --amp-dtype, which this benchmark shares."""
    group = parser.add_argument_group("amp overhead (bench_amp_overhead.py)")
    group.add_argument("--overhead-models", nargs="+", choices=["mlp", "gpt"],
                       default=["mlp", "gpt"], help="models to time (default: both)")
    group.add_argument("--threads", type=int, default=1,
                       help="torch CPU threads (default 1; 0 leaves torch's choice)")
    if own:
        group.add_argument("--amp-dtype", choices=list(DTYPES), default=None,
                           help="low-precision dtype (default: bf16 on cpu, fp16 on cuda)")
        parser.add_argument("--device", choices=["cpu", "cuda"],
                            default="cuda" if torch.cuda.is_available() else "cpu")
        parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (10)")
        parser.add_argument("--repeats", type=int, default=None,
                            help="timed rounds (60 on cpu, 200 on cuda)")
        parser.add_argument("--seed", type=int, default=0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    rows = run(parser.parse_args(argv))
    print(format_rows(rows, environment(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ampfuse demo: the same small CNN trained on real data in fp32 and at amp's O1 and O2,
with a report of what the hardware it runs on does in low precision.

Data: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes, no download),
split once into a fixed train and test set; the training loop is training.train_run.

First the demo looks at the hardware (hardware.detect): whether bf16 and fp16 arithmetic is
native on this CPU, or the GPU's compute capability. Where the low precision is emulated (a CPU
without AVX512-BF16 or AMX, like most AMD Zen 2/3 servers), the low-precision runs are many
times slower than fp32: the demo says so above its table, shows each run's speed relative to
fp32, and trains EMULATED_STEPS instead of DEFAULT_STEPS (fp32 too, so that the rows still
compare like with like), so that it takes about a minute either way.

An overflow can be injected at one step (an inf written into a gradient after the backward,
which is what an fp16 overflow looks like): every run must skip that step, leaving weights and
optimizer state untouched, and amp.last_overflow() must name the gradient that held the inf.

With bf16, more O2 runs train for a quarter of the steps: one per FusedAdamW master_weights
value (MASTER_MODES), the first, True, keeping fp32 masters in the optimizer as the baseline
that the master-free modes (False, "stochastic", "kahan", "split") compare with at the same
number of steps; the table gives each run's bytes per param (params, grads and optimizer
state), which is where the modes differ. On the CPU, one fp16 O2 run with a dynamic loss scale
follows (bf16 trains unscaled, so without it the loss-scale panel would be flat): its scale
grows every few steps and backs off at each overflow, the injected one included.

With watch=True (`--watch`), a few more O1 steps run under ampfuse.numerics.watch and its table
is printed: the dtype each op of each layer ran in, the values' range against fp16's, and what
would need custom_black_list to train in fp16 at amp's initial loss scale.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import textwrap
from pathlib import Path

import torch

import ampfuse
from ampfuse import amp, numerics
from ampfuse.optimizers import FusedAdamW
from ampfuse.tools.demo import hardware as hw
from ampfuse.tools.demo.report import format_overflows, format_table, save_plot
from ampfuse.tools.demo.training import (
    BATCH_SIZE,
    DTYPES,
    INJECTED_PARAM,
    LR,
    WEIGHT_DECAY,
    batch_order,
    load_digits,
    make_model,
    train_run,
)

# The demo's own dependencies (not ampfuse's), imported where they are used.
REQUIREMENTS = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}

# Steps of the fp32, O1 and O2 runs, where their low dtype is native / emulated. Emulated bf16
# steps take 7-10x fp32's (39 ms on a 2-core EPYC held to AVX2, ~90 ms on the AVX2-only Zen of
# issue 34): a fifth of the steps keeps the whole demo near a minute there. --steps overrides.
DEFAULT_STEPS = 600
EMULATED_STEPS = 120
# The master_weights runs and the CPU's fp16 run: this fraction of the steps, so that the demo
# stays short. True first: fp32 masters, the master-free modes' baseline.
SHORT_RUNS = 0.25
MASTER_MODES = (True, False, "stochastic", "kahan", "split")
# Then FusedAdamW's 8-bit moments (state_dtype), with fp32 masters and with the cheapest mode.
STATE_MODES = ((True, "int8"), (True, "fp8"), ("stochastic", "int8"), ("stochastic", "fp8"))
# The CPU's fp16 run: its dynamic scale may double this many times in the run (amp's growth
# interval is 2000 steps, longer than the run).
FP16_GROWTHS = 8
WATCH_STEPS = 3  # steps of the --watch run
NOTE_WIDTH = 100  # the note above the table is wrapped to about the table's width
FP16_INITIAL_SCALE = 2.0**16  # amp's initial dynamic loss scale for fp16


class DemoUsageError(ValueError):
    """A flag that only the chosen defaults make wrong (an overflow step past the last step of
    the runs' default length): main reports it like argparse would, before anything trains."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One row of the table: what train_run is called with."""

    name: str
    opt_level: str
    dtype: torch.dtype
    steps: int
    inject_overflow: int | None
    master_weights: object = None
    growth_interval: int | None = None
    state_dtype: str = "fp32"

    def options(self) -> dict:
        return {"steps": self.steps, "dtype": self.dtype, "inject_overflow": self.inject_overflow,
                "master_weights": self.master_weights, "growth_interval": self.growth_interval,
                "state_dtype": self.state_dtype}


def default_steps(hardware: hw.Hardware, dtype: torch.dtype) -> int:
    return DEFAULT_STEPS if hardware.is_native(dtype) else EMULATED_STEPS


def plan_runs(hardware, low, steps, opt_levels, inject, master_modes, fp16_run,
              state_modes=()):
    """The runs, in table order, and the notes printed under the table about some of them.
    steps: None (default_steps for `low` on this hardware) or the user's. inject: None, or
    the step of the main runs the inf goes in; shorter runs get it at the same fraction.
    state_modes: (master_weights, state_dtype) pairs of bf16 O2 runs with 8-bit moments, made
    with the master_weights runs."""
    main = steps or default_steps(hardware, low)
    if inject is not None and inject >= main:
        raise DemoUsageError(f"--inject-overflow {inject} is past the last step ({main - 1}) "
                             f"of the {main}-step runs")
    low_name = {v: k for k, v in DTYPES.items()}[low]

    def at(run_steps):
        return None if inject is None else inject * run_steps // main

    runs = [Run("fp32", "O0", low, main, inject)]
    runs += [Run(f"{level} {low_name}", level, low, main, inject) for level in opt_levels]
    notes = []
    short = max(1, int(main * SHORT_RUNS))
    if master_modes and low == torch.bfloat16:
        runs += [Run(f"O2 master={mode}", "O2", low, short, at(short), master_weights=mode)
                 for mode in master_modes]
        notes.append(f"O2 master=...: bf16 weights and FusedAdamW's master_weights, {short} "
                     "steps each: True keeps fp32 masters (the baseline), the others none.")
        if state_modes:
            runs += [Run(f"O2 master={mode} {kind}", "O2", low, short, at(short),
                         master_weights=mode, state_dtype=kind) for mode, kind in state_modes]
            notes.append("O2 master=... int8/fp8: the same with FusedAdamW(state_dtype=...), "
                         "Adam's moments in 8-bit codes per block of 256 (tensors under 256 "
                         "elements keep fp32 moments).")
    elif master_modes:
        notes.append("The master_weights runs are bf16 only (the master-free modes need it): "
                     "not run for this dtype.")
    if fp16_run and hardware.device_type == "cpu" and low == torch.bfloat16:
        # Its own length: fp16 may be emulated where bf16 is not (F16C only converts).
        fp16_steps = max(1, int((steps or default_steps(hardware, torch.float16)) * SHORT_RUNS))
        interval = max(1, fp16_steps // FP16_GROWTHS)
        runs.append(Run("O2 fp16", "O2", torch.float16, fp16_steps,
                        None if inject is None else inject * fp16_steps // main,
                        growth_interval=interval))
        notes.append(f"O2 fp16: dynamic loss scale from {FP16_INITIAL_SCALE:g}, halved at each "
                     f"overflow and doubled after {interval} clean steps (amp's default: 2000), "
                     f"so that its {fp16_steps} steps show both.")
    return runs, notes


def steps_note(hardware, low, steps) -> str:
    """Where the default length was shortened because `low` is emulated, a sentence saying so."""
    if steps is not None or hardware.is_native(low):
        return ""
    return (f"So that the demo takes about a minute, its runs train {EMULATED_STEPS} steps "
            f"instead of {DEFAULT_STEPS} (fp32 too, to compare like with like; the table says "
            f"how many each); --steps {DEFAULT_STEPS} runs the full length.")


def run_demo(steps: int | None = None, device: str | None = None, dtype: str | None = None,
             opt_levels=("O1", "O2"), out: str | Path = "demo_out", seed: int = 0,
             inject_overflow: int | str | None = "middle", progress: bool = True,
             ranks: int = 1, watch: bool = False, master_modes=MASTER_MODES,
             fp16_run: bool = True, state_modes=STATE_MODES) -> list[dict]:
    """Reports the hardware, runs the fp32 baseline and each opt level, prints the table, saves
    the plot under `out` and returns one result dict per run (see training.train_run).
    steps: of the fp32, O1 and O2 runs (None: DEFAULT_STEPS, or EMULATED_STEPS where the low
    dtype is emulated). inject_overflow: "middle" (of each run), a step of those runs (shorter
    runs get it at the same fraction), or None. ranks > 1: FSDP2 on that many CPU processes
    (sharded.py). watch: then prints numerics.watch's table of a short O1 run (in this process,
    unsharded). master_modes: the bf16 O2 runs with FusedAdamW master_weights (MASTER_MODES),
    made when the low precision is bf16 and the run is unsharded; state_modes: more of them
    with FusedAdamW's 8-bit moments, (master_weights, state_dtype) pairs (STATE_MODES).
    fp16_run: on the CPU with bf16, also an fp16 O2 run whose dynamic loss scale moves."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if ranks > 1 and device.type != "cpu":
        raise ValueError("the sharded demo (ranks > 1) runs on CPU processes (gloo); "
                         "use --device cpu")
    hardware = hw.detect(device)
    low = DTYPES[dtype] if dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)
    if inject_overflow == "middle":
        inject_overflow = (steps or default_steps(hardware, low)) // 2
    sharded = ranks > 1
    runs, notes = plan_runs(hardware, low, steps, opt_levels, inject_overflow,
                            () if sharded else master_modes, fp16_run and not sharded,
                            () if sharded or not master_modes else state_modes)
    data = load_digits(device)
    print(f"ampfuse demo: digits ({len(data[0])} train / {len(data[2])} test images), batches "
          f"of {BATCH_SIZE}, FusedAdamW lr {LR:g} cosine, seed {seed}, on {device} "
          f"({torch.get_num_threads()} threads)")
    print(f"  hardware: {hardware.describe()}")
    print(f"  {ampfuse.cuda_status()}")
    if inject_overflow is not None:
        print(f"  an inf is written into a gradient at step {inject_overflow} (in shorter runs "
              "at the same fraction): every run must skip that step")
    options = {"seed": seed, "device": device, "progress": progress}
    if sharded:
        from ampfuse.tools.demo.sharded import train_sharded

        print(f"  FSDP2 (fully_shard) on {ranks} CPU processes (gloo), {BATCH_SIZE // ranks} "
              "rows of each batch per process; memory: one process's shards")
        results = train_sharded([(run.name, run.opt_level) for run in runs], ranks,
                                **options, **runs[0].options())
    else:
        results = [train_run(run.name, run.opt_level, data, **options, **run.options())
                   for run in runs]
    above = " ".join(filter(None, [hardware.emulation_note(low, {run.dtype for run in runs}),
                                   steps_note(hardware, low, steps)]))
    print(f"\n{textwrap.fill(above, width=NOTE_WIDTH)}" if above else "")
    print(format_table(results, device, notes))
    if inject_overflow is not None:
        print(format_overflows(results))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot = out / "loss_curves.png"
    save_plot(results, plot, {run.name: run.inject_overflow for run in runs})
    print(f"loss curves and loss scales saved to {plot}")
    if watch:
        bf16 = device.type == "cpu" or torch.cuda.is_bf16_supported()
        watch_dtype = torch.bfloat16 if bf16 else low
        print_watch(watch_run(data, seed=seed, device=device, dtype=watch_dtype), WATCH_STEPS,
                    "bf16" if bf16 else {v: k for k, v in DTYPES.items()}[low])
    return results


def watch_run(data, *, seed: int, device, dtype, steps: int = WATCH_STEPS):
    """A few O1 steps of the demo model under numerics.watch (the forward and backward; the
    optimizer step outside it). O1, because it is the level whose per-op lists give each layer
    a mix of dtypes. The loss scale is 1 so that the recorded gradients are the true ones, which
    suggest_black_list then scales (run_demo picks bf16 where it can: its range is fp32's, so
    nothing that fp16 would lose is lost before it is recorded)."""
    device = torch.device(device)
    x_train, y_train = data[0], data[1]
    model = make_model(seed).to(device)
    optimizer = FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=dtype,
                                      loss_scale=1.0, verbosity=0)
    order = batch_order(steps, len(x_train), seed, device)
    watch = numerics.watch(model)
    for index in order:
        optimizer.zero_grad(set_to_none=True)
        with watch:
            loss = torch.nn.functional.cross_entropy(model(x_train[index]), y_train[index])
        with amp.scale_loss(loss, optimizer) as scaled_loss, watch:
            scaled_loss.backward()
        optimizer.step()
    return watch


def print_watch(watch, steps: int, dtype_name: str) -> None:
    print(f"\nnumerics.watch: {steps} O1 {dtype_name} steps (forward and backward, loss scale "
          "1)")
    print(watch.report())
    flags = watch.flags(torch.float16, loss_scale=FP16_INITIAL_SCALE)
    print(f"fp16 at loss scale {FP16_INITIAL_SCALE:g} (amp's initial scale; grads times it):")
    for flag in flags:
        amount = (f"absmax {flag.value:.3g}" if flag.problem == "overflow" else
                  f"{flag.value:.1%} below the smallest normal")
        print(f"  {flag.module} {flag.what}: {flag.problem} ({amount})")
    names = watch.suggest_black_list(torch.float16, loss_scale=FP16_INITIAL_SCALE)
    print(f"  suggest_black_list: {names}" if flags else
          "  nothing would overflow or underflow: no custom_black_list needed")


def failures(results: list[dict], inject_overflow: int | None) -> list[str]:
    """What should make the demo exit non-zero: a run whose loss ended as nan/inf, or an
    injected overflow that a run did not skip or whose gradient amp.last_overflow() did not
    name. An fp16 run may also overflow on its own at the injected step (its scale grows until
    it does), so its report may name more gradients; any other run's must name only that one."""
    problems = []
    for r in results:
        if not math.isfinite(r["final_loss"]):
            problems.append(f"{r['name']} diverged: final loss {r['final_loss']}")
        if inject_overflow is None:
            continue
        names = getattr(r["overflow"], "param_names", None) or []
        expected = (INJECTED_PARAM in names if r.get("dtype") == torch.float16
                    else names == [INJECTED_PARAM])
        step = r.get("injected_step", inject_overflow)
        if r["skipped"] < 1:
            problems.append(f"{r['name']} did not skip the overflow injected at step {step}")
        elif not expected:
            problems.append(f"{r['name']}: amp.last_overflow() did not name {INJECTED_PARAM} "
                            f"for the overflow injected at step {step}, it said: "
                            f"{r['overflow']}")
    return problems


def main(steps, device, dtype, opt_levels, out, seed, inject_overflow, ranks=1,
         watch=False) -> int:
    """The `python -m ampfuse demo` command: runs the demo and returns the exit status."""
    missing = [pip for module, pip in REQUIREMENTS.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        print(f"error: the demo needs {', '.join(missing)}: pip install {' '.join(missing)}",
              file=sys.stderr)
        return 2
    try:
        results = run_demo(steps=steps, device=device, dtype=dtype, opt_levels=opt_levels,
                           out=out, seed=seed, inject_overflow=inject_overflow, ranks=ranks,
                           watch=watch)
    except DemoUsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    problems = failures(results, inject_overflow)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0

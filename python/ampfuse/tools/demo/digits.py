"""The ampfuse demo: the same small CNN trained on real data in fp32 and at amp's O1 and O2.

Data: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes, no download),
split once into a fixed train and test set. Every run starts from the same weights, sees the
same batches in the same order and uses the same FusedAdamW hyperparameters; only the
opt_level differs. The fp32 baseline goes through amp too, at O0 (fp32, loss scale 1), so the
training loop is literally the same code for every row of the table.

An overflow can be injected at one step (an inf written into a gradient after the backward,
which is what an fp16 overflow looks like): every run must skip that step, leaving weights and
optimizer state untouched (with fp16 the dynamic loss scale also halves; bf16 trains
unscaled). The table shows the skip, and amp.last_overflow() names the gradient that held the
inf, read once, at that step.

Nothing in the training step reads a value back to the host: losses and loss scales are kept
on the device and read once at the end (the progress bar reads the loss every 50 steps).

With bf16, four more O2 runs update the bf16 weights without fp32 masters, one per
FusedAdamW master_weights value (False, "stochastic", "kahan", "split"), for a quarter of the steps
to keep the demo short; the table gives each run's bytes per param (params, grads and optimizer
state), which is where the modes differ (MASTER_MODE_STEPS_NOTE).

With watch=True (`--watch`), a few more O1 steps run under ampfuse.numerics.watch and its table
is printed: the dtype each op of each layer ran in, the values' range against fp16's, and what
would need custom_black_list to train in fp16 at amp's initial loss scale.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

import torch

import ampfuse
from ampfuse import amp, numerics
from ampfuse.optimizers import FusedAdamW

# The demo's own dependencies (not ampfuse's), imported where they are used.
REQUIREMENTS = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# One set of hyperparameters for every run.
BATCH_SIZE = 64
LR = 3e-3
WEIGHT_DECAY = 1e-2
FINAL_LOSS_STEPS = 20  # the table's train loss is the mean over this many last steps
WARMUP_STEPS = 20  # untimed: the first steps pay one-off costs (allocations, kernel selection)
WATCH_STEPS = 3  # steps of the --watch run
FP16_INITIAL_SCALE = 2.0**16  # amp's initial dynamic loss scale for fp16
INJECTED_PARAM = "0.weight"  # the first convolution's weight: where --inject-overflow writes
# The master-free bf16 runs (FusedAdamW master_weights; O2's row is master_weights=True), each
# for a fraction of the steps so that the demo stays short.
MASTER_MODES = (False, "stochastic", "kahan", "split")
MASTER_MODE_STEPS = 0.25
MASTER_MODE_STEPS_NOTE = ("O2 master=...: bf16 weights without fp32 masters (FusedAdamW "
                          "master_weights), {steps} steps each.")


def load_digits(device) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): 1437 training and 360 test images, stratified, always
    the same split; pixels standardized with the training set's mean and std."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=360, stratify=digits.target, random_state=0)
    x_train, x_test = (torch.tensor(x, dtype=torch.float32).unsqueeze(1) for x in (x_train, x_test))
    mean, std = x_train.mean(), x_train.std()
    tensors = ((x_train - mean) / std, torch.tensor(y_train), (x_test - mean) / std,
               torch.tensor(y_test))
    return tuple(t.to(device) for t in tensors)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),  # 8x8 -> 4x4
        torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 10),
    )


def batch_order(steps: int, n: int, seed: int, device) -> torch.Tensor:
    """steps x BATCH_SIZE indices: a fresh permutation every epoch, from the run's seed."""
    generator = torch.Generator().manual_seed(seed)
    epochs = math.ceil(steps * BATCH_SIZE / n)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(epochs)])
    return order[: steps * BATCH_SIZE].view(steps, BATCH_SIZE).to(device)


def evaluate(model, x, y) -> tuple[float, float]:
    """(accuracy in %, mean cross-entropy) on (x, y), in eval mode."""
    model.eval()
    with torch.no_grad():
        logits = model(x).float()
    model.train()
    loss = torch.nn.functional.cross_entropy(logits, y)
    return 100.0 * (logits.argmax(dim=1) == y).float().mean().item(), loss.item()


def state_bytes(model, optimizer) -> int:
    """Bytes of params, grads and optimizer state (moments, fp32 masters, step counts) that
    this process holds: its own shards of sharded (DTensor) ones."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors
               if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _numel(model) -> int:
    """Elements of the model's params this process holds (its shards of sharded ones)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for p in model.parameters())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(name: str, opt_level: str, data, *, steps: int, seed: int, device, dtype,
              inject_overflow: int | None = None, progress: bool = True,
              sharding=None, master_weights=None) -> dict:
    """Trains one model at `opt_level` ("O0" is the fp32 baseline) and returns its results:
    name, opt_level, test accuracy (%) and loss, final loss (the mean training loss of the
    last FINAL_LOSS_STEPS steps), per-step losses and loss scales, ms per step after warm-up,
    memory (and bytes per param), skipped steps, the final loss scale and amp.last_overflow()
    at the injected step.

    sharding: None, or the FSDP2 set-up of a multi-process run (demo_fsdp2.Sharding), which
    shards the model, gives this process its rows of each batch and averages the losses.
    master_weights: None (amp's choice), or FusedAdamW's master_weights for an O2 run in which
    amp makes no fp32 masters (the master-free bf16 modes)."""
    from tqdm import tqdm

    device = torch.device(device)
    x_train, y_train, x_test, y_test = data
    model = make_model(seed).to(device)
    amp_options = {}
    if sharding is not None:
        model, amp_options = sharding.shard(model, opt_level, dtype)
    if master_weights is not None:
        amp_options["master_weights"] = False  # the optimizer's own mode, not amp's masters
    optimizer = FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                           master_weights=False if master_weights is None else master_weights)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, dtype=dtype,
                                      verbosity=0, **amp_options)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    order = batch_order(steps, len(x_train), seed, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    losses, scaled_losses = [], []
    overflow = None
    warmup = min(WARMUP_STEPS, steps // 4)
    bar = tqdm(range(steps), desc=f"{name:<7}", unit="step", disable=None if progress else True,
               dynamic_ncols=True)
    for step in bar:
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        index = order[step] if sharding is None else sharding.rows(order[step])
        loss = torch.nn.functional.cross_entropy(model(x_train[index]), y_train[index])
        optimizer.zero_grad(set_to_none=True)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if step == inject_overflow:
                grad = model.get_parameter(INJECTED_PARAM).grad
                if sharding is not None:
                    grad = sharding.overflowing_shard(grad)  # one rank's shard only
                if grad is not None:
                    grad.view(-1)[0] = float("inf")
        optimizer.step()
        if step == inject_overflow:
            overflow = amp.last_overflow(optimizer)  # a host read, at this step only
        scheduler.step()
        losses.append(loss.detach())
        scaled_losses.append(scaled_loss.detach())
        if step % 50 == 49:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    _sync(device)
    ms_per_step = 1e3 * (time.perf_counter() - start) / max(steps - warmup, 1)
    bar.close()

    losses, scaled_losses = torch.stack(losses).float(), torch.stack(scaled_losses).float()
    # apex's contract: the scaled loss is loss * loss_scale. The scale is a power of two, so
    # the ratio recovers the scale each step's backward used exactly, without a host read.
    scales = (scaled_losses / losses).cpu()
    if sharding is not None:
        losses = sharding.mean_over_ranks(losses)  # the whole batch's loss
    losses = losses.cpu()
    accuracy, test_loss = evaluate(model, x_test, y_test)
    return {
        "name": name, "opt_level": opt_level, "accuracy": accuracy, "test_loss": test_loss,
        "final_loss": losses[-FINAL_LOSS_STEPS:].mean().item(), "losses": losses.tolist(),
        "loss_scales": scales.tolist(), "ms_per_step": ms_per_step, "warmup_steps": warmup,
        "peak_mib": (torch.cuda.max_memory_allocated(device) / 2**20
                     if device.type == "cuda" else None),
        "state_kib": state_bytes(model, optimizer) / 2**10,
        "bytes_per_param": state_bytes(model, optimizer) / _numel(model),
        "steps": steps,
        "skipped": amp.skipped_steps(optimizer),
        "overflow": overflow,
        "final_scale": amp.state_dict(optimizer)["loss_scaler0"]["scale"],
    }


def format_table(results: list[dict], device) -> str:
    cuda = torch.device(device).type == "cuda"
    memory = "peak MiB (cuda alloc)" if cuda else "KiB params+grads+opt"
    width = max(10, max(len(r["name"]) for r in results) + 1)
    header = (f"{'run':<{width}}{'test acc %':>11}{'train loss':>12}{'ms/step':>9}{memory:>23}"
              f"{'B/param':>9}{'skipped':>9}{'loss scale':>12}")
    lines = [header, "-" * len(header)]
    for r in results:
        used = r["peak_mib"] if cuda else r["state_kib"]
        lines.append(f"{r['name']:<{width}}{r['accuracy']:>11.2f}{r['final_loss']:>12.4f}"
                     f"{r['ms_per_step']:>9.2f}{used:>23.1f}{r['bytes_per_param']:>9.2f}"
                     f"{r['skipped']:>9}{r['final_scale']:>12g}")
    lines.append(f"train loss: mean of the last {FINAL_LOSS_STEPS} steps. ms/step: after "
                 f"{results[0]['warmup_steps']} warm-up steps. skipped: steps with inf/nan "
                 "gradients. B/param: bytes of params, grads and optimizer state per param.")
    mode_steps = [r["steps"] for r in results if "master=" in r["name"]]
    if mode_steps:
        lines.append(MASTER_MODE_STEPS_NOTE.format(steps=mode_steps[0]))
    if not cuda:
        lines.append("Memory on CPU: bytes of params, grads and optimizer state. O2's low-precision"
                     " params and grads\nplus fp32 masters take as many bytes as fp32; mixed "
                     "precision saves activation memory, which the CUDA peak shows.")
    return "\n".join(lines)


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


def save_plot(results: list[dict], path: Path, inject_overflow: int | None = None) -> None:
    """Two panels: training loss per step and the loss scale each step's backward used."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, scale_axes = figure.subplots(1, 2)
    # Dashes of decreasing length, so that runs lying on top of each other stay visible.
    styles = ["-", (0, (6, 3)), (0, (2, 2)), (0, (1, 3))]
    for r, style in zip(results, styles * len(results)):
        loss_axes.plot(r["losses"], linestyle=style, linewidth=0.9, label=r["name"])
        scale_axes.step(range(len(r["loss_scales"])), r["loss_scales"], where="post",
                        linestyle=style, linewidth=1.5, label=r["name"])
    loss_axes.set(title="training loss (cross-entropy)", xlabel="step", yscale="log")
    scale_axes.set(title="loss scale used by each step", xlabel="step", yscale="log",
                   ylabel="scale")
    for axes in (loss_axes, scale_axes):
        if inject_overflow is not None:
            axes.axvline(inject_overflow, color="grey", linewidth=0.8, alpha=0.6,
                         label=f"inf injected (step {inject_overflow})")
        axes.legend()
        axes.grid(alpha=0.3)
    figure.savefig(path, dpi=100)


def run_demo(steps: int = 600, device: str | None = None, dtype: str | None = None,
             opt_levels=("O1", "O2"), out: str | Path = "demo_out", seed: int = 0,
             inject_overflow: int | None = None, progress: bool = True,
             ranks: int = 1, watch: bool = False, master_modes=MASTER_MODES) -> list[dict]:
    """Runs the fp32 baseline and each opt level, prints the table, saves the plot under `out`
    and returns one result dict per run (see train_run). ranks > 1: FSDP2 on that many CPU
    processes (demo_fsdp2). watch: then prints numerics.watch's table of a short O1 run (in
    this process, unsharded). master_modes: the master-free bf16 O2 runs (MASTER_MODES), made
    when the low precision is bf16 and the run is unsharded."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if ranks > 1 and device.type != "cpu":
        raise ValueError("the sharded demo (ranks > 1) runs on CPU processes (gloo); "
                         "use --device cpu")
    low = DTYPES[dtype] if dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)
    low_name = {v: k for k, v in DTYPES.items()}[low]
    data = load_digits(device)
    print(f"ampfuse demo: digits ({len(data[0])} train / {len(data[2])} test images), "
          f"{steps} steps of {BATCH_SIZE}, FusedAdamW lr {LR:g} cosine, seed {seed}, on {device}"
          f" ({torch.get_num_threads()} threads), low precision {low_name}")
    print(f"  {ampfuse.cuda_status()}")
    if device.type == "cpu" and low == torch.float16:
        print("  note: CPUs convert fp16 in software, so fp16 runs are far slower than bf16 here")
    if inject_overflow is not None:
        print(f"  an inf is written into a gradient at step {inject_overflow}: every run must "
              "skip that step")
    runs = [("fp32", "O0")] + [(f"{level} {low_name}", level) for level in opt_levels]
    options = dict(steps=steps, seed=seed, device=device, dtype=low,
                   inject_overflow=inject_overflow, progress=progress)
    if ranks > 1:
        from ampfuse.tools.demo.sharded import train_sharded

        print(f"  FSDP2 (fully_shard) on {ranks} CPU processes (gloo), {BATCH_SIZE // ranks} "
              "rows of each batch per process; memory: one process's shards")
        results = train_sharded(runs, ranks, **options)
    else:
        results = [train_run(name, level, data, **options) for name, level in runs]
        results += master_mode_runs(master_modes, low, data, options, inject_overflow)
    print(format_table(results, device))
    if inject_overflow is not None:
        print("where it overflowed (amp.last_overflow):")
        width = max(len(r["name"]) for r in results) + 2
        for r in results:
            print(f"  {r['name']:<{width}}{r['overflow']}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot = out / "loss_curves.png"
    save_plot(results, plot, inject_overflow)
    print(f"loss curves and loss scales saved to {plot}")
    if watch:
        bf16 = device.type == "cpu" or torch.cuda.is_bf16_supported()
        watch_dtype = torch.bfloat16 if bf16 else low
        print_watch(watch_run(data, seed=seed, device=device, dtype=watch_dtype), WATCH_STEPS,
                    "bf16" if bf16 else low_name)
    return results


def master_mode_runs(modes, low, data, options, inject_overflow) -> list[dict]:
    """O2 runs of bf16 weights without fp32 masters, one per FusedAdamW master_weights value in
    `modes`, for MASTER_MODE_STEPS of the steps (the overflow injected at the same fraction)."""
    if not modes:
        return []
    if low != torch.bfloat16:
        print("  master-free runs (master_weights='stochastic', 'kahan', 'split') need bf16: "
              "skipped for this dtype")
        return []
    steps = max(1, int(options["steps"] * MASTER_MODE_STEPS))
    inject = None if inject_overflow is None else int(inject_overflow * MASTER_MODE_STEPS)
    options = dict(options, steps=steps, inject_overflow=inject)
    return [train_run(f"O2 master={mode}", "O2", data, master_weights=mode, **options)
            for mode in modes]


def failures(results: list[dict], inject_overflow: int | None) -> list[str]:
    """What should make the demo exit non-zero: a run whose loss ended as nan/inf, or an
    injected overflow that a run did not skip or whose gradient amp.last_overflow() did not
    name."""
    problems = []
    for r in results:
        if not math.isfinite(r["final_loss"]):
            problems.append(f"{r['name']} diverged: final loss {r['final_loss']}")
        if inject_overflow is None:
            continue
        if r["skipped"] < 1:
            problems.append(f"{r['name']} did not skip the overflow injected at step "
                            f"{inject_overflow}")
        elif getattr(r["overflow"], "param_names", None) != [INJECTED_PARAM]:
            problems.append(f"{r['name']}: amp.last_overflow() did not name {INJECTED_PARAM} "
                            f"for the overflow injected at step {inject_overflow}, it said: "
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
    results = run_demo(steps=steps, device=device, dtype=dtype, opt_levels=opt_levels, out=out,
                       seed=seed, inject_overflow=inject_overflow, ranks=ranks, watch=watch)
    problems = failures(results, inject_overflow)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0

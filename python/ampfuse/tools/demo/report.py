"""What the demo prints and draws: the table of runs, the overflow attribution and the plot of
losses and loss scales."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from ampfuse.tools.demo.training import FINAL_LOSS_STEPS, WARMUP_STEPS


def speedup(result: dict, results: list[dict]) -> float | None:
    """The run's speed relative to the fp32 (O0) run's: fp32's ms/step over its own, so 0.5
    means twice as slow. None without an fp32 run."""
    fp32 = next((r for r in results if r["opt_level"] == "O0"), None)
    if fp32 is None:
        return None
    return fp32["ms_per_step"] / result["ms_per_step"]


def format_table(results: list[dict], device, notes: list[str] = ()) -> str:
    """The table, one row per run, with its footnotes and then `notes` (what some rows are)."""
    cuda = torch.device(device).type == "cuda"
    memory = "peak MiB" if cuda else "state KiB"
    width = max(10, max(len(r["name"]) for r in results) + 1)
    header = (f"{'run':<{width}}{'steps':>6}{'test acc %':>11}{'train loss':>11}{'ms/step':>9}"
              f"{'vs fp32':>8}{memory:>11}{'B/param':>8}{'skipped':>8}{'loss scale':>11}")
    lines = [header, "-" * len(header)]
    for r in results:
        used = r["peak_mib"] if cuda else r["state_kib"]
        ratio = speedup(r, results)
        lines.append(f"{r['name']:<{width}}{r['steps']:>6}{r['accuracy']:>11.2f}"
                     f"{r['final_loss']:>11.4f}{r['ms_per_step']:>9.2f}"
                     f"{'-' if ratio is None else f'{ratio:.2f}x':>8}{used:>11.1f}"
                     f"{r['bytes_per_param']:>8.2f}{r['skipped']:>8}{r['final_scale']:>11g}")
    footnotes = [
        (f"train loss: mean of the last {FINAL_LOSS_STEPS} steps. ms/step: after a quarter of "
         f"the steps (at most {WARMUP_STEPS}) of warm-up. vs fp32: speed, fp32's ms/step over "
         "the run's. skipped: steps with inf/nan gradients. B/param: bytes of params, grads "
         "and optimizer state per param."),
        ("peak MiB: the CUDA caching allocator's peak during the run." if cuda else
         "state KiB: params, grads and optimizer state. O2's low-precision params and grads "
         "plus fp32 masters take as many bytes as fp32; mixed precision saves activation "
         "memory, which the CUDA peak shows."),
        *notes]
    lines += [textwrap.fill(note, width=len(header)) for note in footnotes]
    return "\n".join(lines)


def format_overflows(results: list[dict]) -> str:
    """Each run's amp.last_overflow() at the injected step."""
    width = max(len(r["name"]) for r in results) + 2
    return "\n".join(["where it overflowed (amp.last_overflow):"]
                     + [f"  {r['name']:<{width}}{r['overflow']}" for r in results])


def save_plot(results: list[dict], path: Path, injected: dict | None = None) -> None:
    """Two panels: training loss per step and the loss scale each step's backward used.
    injected: the step each run (by name) had an inf written into a gradient, marked on its
    curves (runs of different lengths have it at different steps)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, scale_axes = figure.subplots(1, 2)
    # Runs that train unscaled (fp32, bf16) would pin the scale axis to 1 and squash the
    # dynamic scale's steps into a sliver: where a run's scale moves, only such runs are drawn.
    moving = [r for r in results if len(set(r["loss_scales"])) > 1 or r["final_scale"] != 1]
    unscaled = [r["name"] for r in results if r not in moving]
    # Dashes of decreasing length, so that runs lying on top of each other stay visible.
    styles = ["-", (0, (6, 3)), (0, (2, 2)), (0, (1, 3))]
    for r, style in zip(results, styles * len(results)):
        label = f"{r['name']} ({r['steps']} steps)"
        line, = loss_axes.plot(r["losses"], linestyle=style, linewidth=0.9, label=label)
        step = (injected or {}).get(r["name"])
        if step is not None:
            loss_axes.plot(step, r["losses"][step], "x", color=line.get_color())
        if r in moving or not moving:
            scale_axes.step(range(len(r["loss_scales"])), r["loss_scales"], where="post",
                            linestyle=style, linewidth=1.5, label=label, color=line.get_color())
            if step is not None:
                scale_axes.plot(step, r["loss_scales"][step], "x", color=line.get_color(),
                                markersize=9, markeredgewidth=2)
    loss_axes.set(title="training loss (cross-entropy); x: the injected inf", xlabel="step",
                  yscale="log")
    scale_axes.set(title="loss scale used by each step; x: the injected inf", xlabel="step",
                   ylabel="scale")
    scale_axes.set_yscale("log", base=2)
    if moving and unscaled:
        kinds = {r.get("dtype") for r in results if r["name"] in unscaled}
        what = ("the fp32 and bf16 runs" if kinds <= {torch.float32, torch.bfloat16}
                else ", ".join(unscaled))
        scale_axes.text(0.02, 0.02, f"not drawn: {what} (unscaled, 1)",
                        transform=scale_axes.transAxes, fontsize="small")
    for axes in (loss_axes, scale_axes):
        axes.grid(alpha=0.3)
    loss_axes.legend(fontsize="small")
    scale_axes.legend(fontsize="small", loc="upper right")
    figure.savefig(path, dpi=100)

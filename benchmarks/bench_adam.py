"""Times one mixed-precision Adam step of ampfuse against torch's best equivalents on
transformer-shaped parameter sets, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_adam.py [--device cpu|cuda] [--dtype bf16 fp16]
        [--total-elements 1.25e8 3.5e8] [--json PATH]

Defaults: about 10M parameters in 291 tensors on the CPU; GPT-2 small (125M, 12 layers) and
medium (350M, 24 layers) shapes on CUDA; bf16 and fp16 models. Rows, for a model dtype of h
bytes:

  ampfuse FusedAdam         the optimizer step alone: FusedAdamW(master_weights=True) on the
                            half-precision model, grad_scale and found_inf given as tensors (as
                            torch.amp.GradScaler hands them over). It leaves the grads unscaled,
                            as torch does (write_unscaled_grads=True, the default). Floor 24 + 3h
                            bytes/param: grad read and written, master, exp_avg, exp_avg_sq read
                            and written, param written.
  ampfuse FusedAdam scaled  the same with write_unscaled_grads=False: the grads keep their scale
                            and are only read. Floor 24 + 2h. Its ratio to the row above is the
                            cost of writing the grads back.
  ampfuse unscale+FusedAdam the whole AMP step: multi_tensor_unscale_ of the half grads (which
                            also finds inf/nan), then FusedAdamW with found_inf. Floor 24 + 4h.
  torch masters pipeline    what torch offers for fp32 masters of a half model: copy the grads
                            up to fp32 master grads, unscale them with
                            torch._amp_foreach_non_finite_check_and_unscale_, AdamW(fused=True)
                            on the masters, skipping on found_inf without a host sync, copy the
                            masters down to the model. Floor 44 + 2h.
  torch fused fp32          AdamW(fused=True) on a plain fp32 model (no masters needed), grad_scale
                            and found_inf given as GradScaler does; it writes the unscaled grads
                            back too. Floor 32.

Where torch has no fused kernel of the optimizer for the device (Adagrad on CUDA: torch 2.11's
Adagrad(fused=True) takes CPU tensors only), the two torch rows step with foreach=True instead
and say so: "torch foreach masters" and "torch foreach fp32". A foreach step cannot skip on
found_inf without a host sync (GradScaler reads found_inf on the host first), so these rows step
unconditionally and the fp32 one leaves the grads scaled: they time less than torch's AMP step
does, a lower bound of its cost. The fp32 row's floor is then 4 bytes/param less (grads only
read); the masters pipeline's is the same.

Rows whose step writes the grads back are given a loss scale of 1, so that the same data is
timed at every call (the division and the write are the same work for any scale); the others
use 1024.

Each torch row's ratio is its time over the matching ampfuse row's (full AMP step for the masters
pipeline, optimizer step alone for fused fp32); above 1 means ampfuse is faster. ms are medians;
noise% is the gap between ampfuse's timings before and after torch's; GB/s is the byte floor over
the median, and %copy compares it with a device copy of the same bytes. A benchmark reports; it
never asserts a time.
"""

import argparse
import dataclasses
import functools
import statistics

import torch

import ampfuse
from ampfuse.optimizers import FusedAdamW
from _report import report
from _timing import (
    DTYPES,
    add_common_args,
    budget_s,
    copy_bandwidth,
    element_count,
    error_text,
    finish_args,
    generator,
    model_like_shapes,
    random_tensors,
    rotation_count,
    summarize,
    synchronize,
    time_calls,
)

CUDA_DEFAULT_TOTALS = (125_000_000, 350_000_000)
LR = 1e-4
SCALE = 1024.0


def layers_for(total):
    """GPT-2 small's 12 layers near its 125M size; 24 otherwise (GPT-2 medium at 350M, and the
    291-tensor sets the other benchmarks use at other sizes)."""
    return 12 if 100_000_000 <= total < 200_000_000 else 24


@dataclasses.dataclass
class Pipeline:
    label: str
    floor_per_param: int  # bytes moved per parameter at the least
    make: object  # (shapes, gen) -> one argument set
    call: object  # (argument set) -> None: one optimizer step
    baseline: str = None  # label of the ampfuse row a torch row is compared with


def scalars(device, scale=SCALE):
    return torch.full((), scale, device=device), torch.zeros((), device=device)


def half_model(shapes, dtype, device, gen):
    """Params of `dtype` with grads of the same dtype."""
    params = [p.requires_grad_() for p in random_tensors(shapes, dtype, device, gen)]
    for p, g in zip(params, random_tensors(shapes, dtype, device, gen)):
        p.grad = g
    return params


def ampfuse_pipeline(name, make_optimizer, state_bytes, dtype, device, unscale_first,
                     write_unscaled_grads=True):
    """An ampfuse row: make_optimizer(params, write_unscaled_grads) on a half model of `dtype`;
    state_bytes is the fp32 state read and written per param (master and moments)."""
    # A step that writes the grads back divides them by the scale: 1 keeps them as they are.
    writes_back = write_unscaled_grads and not unscale_first

    def make(shapes, gen):
        params = half_model(shapes, dtype, device, gen)
        opt = make_optimizer(params, write_unscaled_grads)
        scale, found_inf = scalars(device, 1.0 if writes_back else SCALE)
        return opt, [p.grad for p in params], scale, found_inf, torch.full((), 1.0, device=device)

    def call(s):
        opt, grads, scale, found_inf, one = s
        if unscale_first:
            # Multiplying by 1 keeps the data unchanged across calls; the pass is the same.
            ampfuse.multi_tensor_unscale_(grads, found_inf, one)
            opt.step(found_inf=found_inf)
        else:
            opt.step(grad_scale=scale, found_inf=found_inf)

    h = dtype.itemsize
    if unscale_first:
        return Pipeline(f"ampfuse unscale+{name}", state_bytes + 4 * h, make, call)
    if writes_back:
        return Pipeline(f"ampfuse {name}", state_bytes + 3 * h, make, call)
    return Pipeline(f"ampfuse {name} scaled", state_bytes + 2 * h, make, call)


def ampfuse_adam(dtype, device, unscale_first, write_unscaled_grads=True):
    def make_optimizer(params, write):
        return FusedAdamW(params, lr=LR, weight_decay=0.01, master_weights=True,
                          write_unscaled_grads=write)

    return ampfuse_pipeline("FusedAdam", make_optimizer, 24, dtype, device, unscale_first,
                            write_unscaled_grads)


@functools.cache
def has_fused(cls, device):
    """Whether cls(fused=True) can step on `device`. torch's list of fused devices
    (_get_fused_kernels_supported_devices) is not per optimizer: Adagrad's fused kernel is CPU
    only in torch 2.11 and raises at the first step on CUDA. So one step on one element tells."""
    p = torch.zeros(1, device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    try:
        cls([p], fused=True).step()
    except RuntimeError:
        return False
    return True


def torch_optimizer(params, fused, cls=torch.optim.AdamW, **kwargs):
    """cls(fused=True), or cls(foreach=True) when not `fused` (see has_fused)."""
    return cls(params, fused=True, **kwargs) if fused else cls(params, foreach=True, **kwargs)


def torch_masters(dtype, device, baseline, floor_per_param=None, **optimizer):
    """copy up + unscale + fused step on the fp32 masters + copy down; `optimizer` picks the torch
    class and its hyperparameters (AdamW by default)."""
    optimizer = optimizer or dict(lr=LR, weight_decay=0.01)
    fused = has_fused(optimizer.get("cls", torch.optim.AdamW), device)

    def make(shapes, gen):
        model = half_model(shapes, dtype, device, gen)
        masters = [p.detach().float() for p in model]
        for m in masters:
            m.grad = torch.empty_like(m)
        opt = torch_optimizer(masters, fused, **optimizer)
        grad_scale, found_inf = scalars(device)
        return opt, model, [p.grad for p in model], masters, [m.grad for m in masters], \
            torch.reciprocal(grad_scale), found_inf

    @torch.no_grad()
    def call(s):
        opt, model, grads, masters, master_grads, inv_scale, found_inf = s
        torch._foreach_copy_(master_grads, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)
        if fused:
            opt.found_inf = found_inf  # the fused kernel skips on the device, no host sync
        opt.step()
        torch._foreach_copy_(model, masters)

    floor = 44 + 2 * dtype.itemsize if floor_per_param is None else floor_per_param
    label = "torch masters pipeline" if fused else "torch foreach masters"
    return Pipeline(label, floor, make, call, baseline)


def torch_fp32(device, baseline, floor_per_param=32, **optimizer):
    """The step on a plain fp32 model; floor_per_param is the fused step's, which writes the
    grads back (a foreach step only reads them: 4 bytes less)."""
    optimizer = optimizer or dict(lr=LR, weight_decay=0.01)
    fused = has_fused(optimizer.get("cls", torch.optim.AdamW), device)

    def make(shapes, gen):
        params = half_model(shapes, torch.float32, device, gen)
        opt = torch_optimizer(params, fused, **optimizer)
        if fused:
            # torch's fused step writes the unscaled grads back: a scale of 1 keeps them.
            opt.grad_scale, opt.found_inf = scalars(device, 1.0)
        return opt

    def call(opt):
        opt.step()

    if fused:
        return Pipeline("torch fused fp32", floor_per_param, make, call, baseline)
    return Pipeline("torch foreach fp32", floor_per_param - 4, make, call, baseline)


def time_pipeline(pipeline, shapes, device, args):
    """Median-ready timings of `pipeline` on rotated argument sets (see _timing)."""
    floor = pipeline.floor_per_param * element_count(shapes)
    sets_n = rotation_count(floor, device, max_sets=4)
    gen = generator(device, args.seed)
    sets = [pipeline.make(shapes, gen) for _ in range(sets_n)]
    synchronize(device)
    times = time_calls(lambda i: pipeline.call(sets[i % sets_n]), device, max(args.warmup, sets_n),
                       args.repeats, budget_s(device))
    sets.clear()  # frees the sets' tensors (the lambda still names the list) before empty_cache
    if device == "cuda":
        torch.cuda.empty_cache()
    return times, sets_n


def compare_pipelines(op, pipelines, shapes, dtype_name, args):
    """Times the ampfuse pipelines, then the torch ones, then the ampfuse ones again. Returns
    one row per pipeline."""
    device = args.device
    elements = element_count(shapes)
    ampfuse_rows = [p for p in pipelines if p.baseline is None]
    torch_rows = [p for p in pipelines if p.baseline is not None]
    first = {p.label: time_pipeline(p, shapes, device, args) for p in ampfuse_rows}
    results = {}
    for p in torch_rows:
        try:
            results[p.label] = time_pipeline(p, shapes, device, args)
        except (RuntimeError, NotImplementedError) as error:
            results[p.label] = error_text(error)
    second = {p.label: time_pipeline(p, shapes, device, args) for p in ampfuse_rows}

    rows = []
    for p in pipelines:
        floor = p.floor_per_param * elements
        row = {"op": op, "device": device, "dtype": dtype_name, "tensors": len(shapes),
               "elements": elements, "impl": p.label, "floor_bytes": floor,
               "bytes_per_param": p.floor_per_param,
               "copy_gbps": copy_bandwidth(floor, device, args.warmup, args.repeats) / 1e9}
        if p.baseline is None:
            (t1, sets_n), (t2, _) = first[p.label], second[p.label]
            m1, m2 = statistics.median(t1), statistics.median(t2)
            row.update(summarize(t1 + t2), rotation_sets=sets_n,
                       noise_pct=100 * abs(m1 - m2) / min(m1, m2))
        elif isinstance(results[p.label], str):
            row["error"] = results[p.label]
        else:
            times, sets_n = results[p.label]
            row.update(summarize(times), rotation_sets=sets_n, baseline=p.baseline)
        if "median_s" in row:
            row["gbps"] = floor / row["median_s"] / 1e9
            row["pct_of_copy"] = 100 * row["gbps"] / row["copy_gbps"]
        rows.append(row)
    by_label = {r["impl"]: r for r in rows}
    for row in rows:
        base = by_label.get(row.get("baseline"))
        if base is not None and "median_s" in base and "median_s" in row:
            row["torch_over_ampfuse"] = row["median_s"] / base["median_s"]
    return rows


def optimizer_rows(args, op, ampfuse_rows, torch_optimizer=None, masters_floor=None,
                   fp32_floor=32, labels=None):
    """The rows of an optimizer benchmark, for each size and half dtype: ampfuse's step alone,
    with the grads kept scaled and after an unscale pass (ampfuse_rows(dtype, device,
    unscale_first, write_unscaled_grads=True) gives each), then torch's masters pipeline and
    fp32 step with `torch_optimizer` (torch_masters' and torch_fp32's keywords; AdamW when
    None). masters_floor(h) is the masters pipeline's byte floor per param for a model dtype of
    h bytes (torch_masters' own when None); `labels` renames the two torch rows."""
    rows = []
    optimizer = torch_optimizer or {}
    half_names = [name for name in args.dtype if name != "fp32"] or ["bf16"]
    for total in args.total_elements:
        shapes = model_like_shapes(total, layers_for(total))
        for name in half_names:
            dtype = DTYPES[name]
            full = ampfuse_rows(dtype, args.device, unscale_first=True)
            alone = ampfuse_rows(dtype, args.device, unscale_first=False)
            scaled = ampfuse_rows(dtype, args.device, unscale_first=False,
                                  write_unscaled_grads=False)
            floor = None if masters_floor is None else masters_floor(dtype.itemsize)
            masters = torch_masters(dtype, args.device, full.label, floor, **optimizer)
            fp32 = torch_fp32(args.device, alone.label, fp32_floor, **optimizer)
            if labels is not None:
                masters = dataclasses.replace(masters, label=labels[0])
                fp32 = dataclasses.replace(fp32, label=labels[1])
            rows += compare_pipelines(op, [alone, scaled, full, masters, fp32], shapes, name,
                                      args)
    return rows


def run(args):
    return optimizer_rows(args, "adam", ampfuse_adam)


# ---- command line and table (shared with bench_sgd.py) ------------------------------------------


def parse_args(description, argv=None):
    parser = argparse.ArgumentParser(description=description)
    add_common_args(parser)
    parser.set_defaults(dtype=["bf16", "fp16"])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.total_elements is None and args.device == "cuda":
        args.total_elements = CUDA_DEFAULT_TOTALS
    return finish_args(args)


def format_rows(rows, env):
    columns = [("dtype", "{}", 5), ("tensors", "{}", 7), ("elements", "{:,}", 12),
               ("impl", "{}", 29), ("ms", "{:.3f}", 9), ("noise%", "{:.1f}", 6),
               ("B/param", "{}", 7), ("GB/s", "{:.1f}", 7), ("%copy", "{:.0f}", 5),
               ("torch/ampfuse", "{:.2f}", 13)]
    keys = {"ms": "median_s", "noise%": "noise_pct", "B/param": "bytes_per_param", "GB/s": "gbps",
            "%copy": "pct_of_copy", "torch/ampfuse": "torch_over_ampfuse"}
    cuda = rows and rows[0]["device"] == "cuda"
    where = env.get("gpu") if cuda else f"CPU x{env['cpu_threads']} threads"
    op = rows[0]["op"] if rows else ""
    lines = [f"# {op}: {where}; torch {env['torch']}; {env['date']}; {env['command']}",
             "  ".join(name.rjust(width) for name, _, width in columns)]
    for row in rows:
        cells = []
        for name, fmt, width in columns:
            value = row.get(keys.get(name, name))
            if name == "ms" and value is not None:
                value *= 1e3
            if value is None:
                value = row["error"][:60] if name == "ms" and "error" in row else "-"
                cells.append(str(value).rjust(width))
            else:
                cells.append(fmt.format(value).rjust(width))
        lines.append("  ".join(cells))
    lines.append("# B/param: byte floor per parameter; torch/ampfuse: a torch row's time over "
                 "the ampfuse row it replaces (> 1: ampfuse faster)")
    return "\n".join(lines)


def main_for(run_fn, description, argv=None):
    args = parse_args(description, argv)
    return report(run_fn(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

"""Where the time goes, for the GPU goals a benchmark missed: host against device, per call.

    PYTHONPATH=python python benchmarks/profile_gpu.py [--device cuda] [--what ops train]
        [--total-elements 1e6 1e8] [--lists model one] [--models gpt cnn] [--steps 4]
        [bench_train's size flags]

The benchmarks (run.py) give one time per call or step. This splits it:
- ops: for unscale_, nonfinite_check_, l2norm and the scale_ cast copy, and torch's
  counterparts, on model-shaped lists (291 tensors) and on one tensor of the same size (the
  call's fixed cost apart from its per-tensor cost): the host time to issue one call (no
  sync), the kernels it launched and their summed device time (torch.profiler), and the
  wall time per call of back-to-back calls. Wall near host: host-bound (validation, launch
  cost); wall near kernels: the kernels are the cost, and their bandwidth is the question.
- train: per training step of bench_train's models (torch amp, ampfuse O1, O2): wall time,
  host time to issue the step, summed kernel time and count, how much of it is copy/cast
  kernels, the synchronizing CUDA calls per step (torch's sync debug mode in "warn", counted;
  torch's GradScaler makes one), the host time of each part of the step (forward with loss,
  backward, and the optimizer step with its unscale and scale update; unprofiled steps), the
  caching allocator's allocations per step (torch.cuda.memory_stats' "allocation.all.allocated"
  count), and the largest kernels. The gpt model also gets two bf16 rows: "O2 bf16" and
  "O2 fp8" (fp8=True, FP8 GEMMs), so FP8's launches, allocations and host time per step stand
  beside the same model without it. Host time near wall time means the step is host-bound or
  waits on the device: the syncs column tells which, and the parts where.
On the CPU the kernel columns are empty ("-"): the host figures still compare ampfuse's
per-call cost with torch's. Figures from a GPU go in RESULTS.md with the command.
"""

import argparse
import statistics
import time
import warnings

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import bench_train
from train_workloads import Workload
from _timing import default_device, generator, model_like_shapes, random_tensors, synchronize

OPS = ("unscale_", "nonfinite_check_", "l2norm", "scale_")


def _op_calls(name, grads, device):
    """(ampfuse call, torch call) for one op on `grads`."""
    found_inf = torch.zeros(1, device=device)
    inv_scale = torch.ones(1, device=device)  # repeated calls leave the values as they are
    ops = torch.ops.ampfuse
    if name == "unscale_":
        return (lambda: ops.multi_tensor_unscale_(grads, found_inf, inv_scale),
                lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                                         inv_scale))
    if name == "nonfinite_check_":
        # torch has no read-only check: its counterpart is the unscale by 1.
        one = torch.ones(1, device=device)
        return (lambda: ops.multi_tensor_nonfinite_check_(grads, found_inf),
                lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one))
    if name == "l2norm":
        return (lambda: ops.multi_tensor_l2norm(grads, False),
                lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    dst = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    return (lambda: ops.multi_tensor_scale_(grads, dst, inv_scale, found_inf),
            lambda: torch._foreach_copy_(dst, torch._foreach_mul(grads, inv_scale[0])))


def _kernels(call, device, calls):
    """(kernel launches per call, summed kernel microseconds per call), or (None, None)."""
    if device != "cuda":
        return None, None
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    return len(kernels) / calls, busy / calls


def _host_and_wall(call, device, calls):
    """Median host microseconds to issue one call, and wall microseconds per call."""
    host = []
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        t = time.perf_counter()
        call()
        host.append(time.perf_counter() - t)
    synchronize(device)
    wall = (time.perf_counter() - start) / calls
    return statistics.median(host) * 1e6, wall * 1e6


def _shapes(lists, total):
    """The tensor shapes of one list layout: "model" (model_like_shapes, 291 tensors) or "one"
    (a single tensor). One tensor leaves a call's fixed cost (the launch, with ampfuse's 31 KB
    table of kernel parameters against torch's smaller one) without the per-tensor part."""
    return model_like_shapes(total) if lists == "model" else [(total,)]


def profile_ops(args):
    rows = []
    for total in args.total_elements:
        for lists in args.lists:
            shapes = _shapes(lists, int(total))
            grads = random_tensors(shapes, torch.float32, args.device, generator(args.device, 0))
            for name in OPS:
                for impl, call in zip(("ampfuse", "torch"), _op_calls(name, grads, args.device)):
                    for _ in range(args.warmup):
                        call()
                    host, wall = _host_and_wall(call, args.device, args.calls)
                    launches, busy = _kernels(call, args.device, args.calls)
                    rows.append((name, f"{int(total):,}", len(shapes), impl, host, wall,
                                 launches, busy))
            del grads
    print(f"# ops on {args.device}: fp32 tensors; us per call; host: median time to issue one "
          "call; wall: back-to-back calls; kernels: launches and summed time")
    print(f"{'op':>17} {'elements':>12} {'tensors':>8} {'impl':>8} {'host us':>9} "
          f"{'wall us':>9} {'launches':>9} {'kernel us':>10}")
    for name, total, tensors, impl, host, wall, launches, busy in rows:
        print(f"{name:>17} {total:>12} {tensors:>8} {impl:>8} {host:9.1f} {wall:9.1f} "
              f"{_fmt(launches, '9.1f')} {_fmt(busy, '10.1f')}")


def _fmt(value, spec):
    return f"{value:{spec}}" if value is not None else f"{'-':>{spec.split('.')[0]}}"


def _syncs_per_step(step, batches, steps):
    """Synchronizing CUDA calls per training step: torch warns on each one in sync debug mode
    "warn" (a warning per call, raised again in this thread for the backward's engine thread).
    The caller has synchronized, and nothing here synchronizes itself."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(steps):
                step(batches[i % len(batches)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught) / steps


def _host_ms_per_part(step, batches, steps, device):
    """Mean host milliseconds of each part of a step, from its marks (bench_train.make_step),
    over unprofiled steps that start on an idle device."""
    totals = dict.fromkeys(("forward", "backward", "step"), 0.0)
    for i in range(steps):
        synchronize(device)
        last = time.perf_counter()

        def mark(part):
            nonlocal last
            now = time.perf_counter()
            totals[part] += now - last
            last = now

        step(batches[i % len(batches)], mark)
    return {part: seconds / steps * 1e3 for part, seconds in totals.items()}


def _allocations(device):
    """The caching allocator's count of allocations so far (CUDA), or None."""
    if device != "cuda":
        return None
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def profile_train(args):
    train_args = bench_train.finish_args(
        bench_train.parse_args(["--device", args.device, *args.train_argv]))
    for name in args.models:
        workload = Workload(name, train_args)
        batches = workload.batches()
        print(f"# train {name} on {args.device}: ms per step, mean of {args.steps} profiled "
              "steps after warm-up")
        print(f"{'impl':>11} {'wall':>8} {'host':>8} {'kernels':>8} {'launches':>9} "
              f"{'copy ms':>8} {'copies':>7} {'syncs':>6} {'host fwd':>8} {'bwd':>6} "
              f"{'step':>6} {'allocs':>7}  largest kernels (ms per step)")
        low = torch.float16 if args.device == "cuda" else torch.bfloat16
        rows = [("torch amp", "torch amp", low), ("ampfuse O1", "ampfuse O1", low),
                ("ampfuse O2", "ampfuse O2", low)]
        if name in bench_train.FP8_MODELS:
            rows += [("O2 bf16", "ampfuse O2", torch.bfloat16),
                     ("O2 fp8", "ampfuse O2 fp8", torch.bfloat16)]
        for label, impl, dtype in rows:
            step, _, _ = bench_train.make_step(impl, workload, dtype)
            for i in range(args.warmup):
                step(batches[i % len(batches)])
            host_s = []
            synchronize(args.device)
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if args.device == "cuda" else [])
            allocations = _allocations(args.device)
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                for i in range(args.steps):
                    t = time.perf_counter()
                    step(batches[i % len(batches)])
                    host_s.append(time.perf_counter() - t)
                synchronize(args.device)
                wall = (time.perf_counter() - start) / args.steps * 1e3
            allocs = _allocations(args.device)
            allocs = None if allocs is None else (allocs - allocations) / args.steps
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            per_kernel = {}
            for e in kernels:
                per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us()
            copies = [e for e in kernels if "copy" in e.name.lower()]
            busy = sum(per_kernel.values()) / args.steps / 1e3
            copy_ms = sum(e.time_range.elapsed_us() for e in copies) / args.steps / 1e3
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:3]
            largest = "; ".join(f"{v / args.steps / 1e3:.2f} {k[:48]}" for k, v in top)
            on_gpu = args.device == "cuda"
            syncs = _syncs_per_step(step, batches, args.steps) if on_gpu else None
            parts = _host_ms_per_part(step, batches, args.steps, args.device)
            print(f"{label:>11} {wall:8.2f} {statistics.mean(host_s) * 1e3:8.2f} "
                  f"{_fmt(busy if on_gpu else None, '8.2f')} "
                  f"{_fmt(len(kernels) / args.steps if on_gpu else None, '9.0f')} "
                  f"{_fmt(copy_ms if on_gpu else None, '8.2f')} "
                  f"{_fmt(len(copies) / args.steps if on_gpu else None, '7.0f')} "
                  f"{_fmt(syncs, '6.1f')} {parts['forward']:8.2f} {parts['backward']:6.2f} "
                  f"{parts['step']:6.2f} {_fmt(allocs, '7.0f')}  {largest}")
            del step
            if args.device == "cuda":
                torch.cuda.empty_cache()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--what", nargs="+", choices=["ops", "train"], default=["ops", "train"])
    parser.add_argument("--total-elements", nargs="+", type=float, default=[1e6, 1e8])
    parser.add_argument("--lists", nargs="+", choices=["model", "one"], default=["model", "one"],
                        help="ops: model-shaped lists (291 tensors), one tensor, or both")
    parser.add_argument("--models", nargs="+", choices=["gpt", "cnn"], default=["gpt", "cnn"])
    parser.add_argument("--calls", type=int, default=50, help="profiled calls per op")
    parser.add_argument("--steps", type=int, default=4, help="profiled training steps")
    parser.add_argument("--warmup", type=int, default=5)
    # Anything else goes to bench_train (its model sizes: --layers, --cnn-width, ...).
    args, args.train_argv = parser.parse_known_args(argv)
    return args


def main(argv=None):
    args = parse_args(argv)
    if "ops" in args.what:
        profile_ops(args)
    if "train" in args.what:
        profile_train(args)


if __name__ == "__main__":
    main()

"""Host and device time of a FusedAdamW step with master_weights="split" against True.

    PYTHONPATH=python python benchmarks/profile_split.py [--device cpu|cuda]
        [--total-elements 3.5e8] [--layers 24] [--steps 20] [--warmup 3] [--top 12]

On the H100, "split" took 1.28-1.37x True's time (RESULTS.md) while moving 26 bytes per param
against 28, and at 10M params both steps were far longer than their bytes take: the step is
host-bound, so the per-call host work of each mode is the question. For a GPT-shaped list of
bf16 params (benchmarks/_timing.py's model_like_shapes: 291 tensors at 24 layers) this prints,
per mode:
- host ms per step: time to issue optimizer.step() (no sync; on the CPU the kernels run inside
  it, so use a tiny --total-elements there to see the host part alone);
- wall ms per step: the same with a device sync after each step;
- device ms per step (CUDA only): the summed self time of the kernels, from torch.profiler;
- the fused op's host time per call and the profiler's key averages (CPU self time per step
  and calls per step of the busiest events): an aten::view or aten::empty per tensor shows up
  as hundreds of calls per step.
A benchmark reports; it asserts nothing about the times. Figures from a GPU go in RESULTS.md.
"""

import argparse
import statistics
import time

import torch
from _timing import generator, model_like_shapes, random_tensors, synchronize
from ampfuse.optimizers import FusedAdamW
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

MODES = {"True": True, "split": "split"}
FUSED_OP = "ampfuse::fused_adam_"


def make_optimizer(shapes, mode, device, seed):
    """bf16 params with bf16 grads and a FusedAdamW over them, its state made by one step."""
    gen = generator(device, seed)
    params = [p.requires_grad_() for p in random_tensors(shapes, torch.bfloat16, device, gen)]
    for p, g in zip(params, random_tensors(shapes, torch.bfloat16, device, gen)):
        p.grad = g
    optimizer = FusedAdamW(params, lr=1e-4, weight_decay=0.01, master_weights=mode)
    optimizer.step()
    synchronize(device)
    return optimizer


def timed_steps(optimizer, device, steps):
    """(host seconds, wall seconds) of each step."""
    host, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        issued = time.perf_counter()
        synchronize(device)
        host.append(issued - start)
        wall.append(time.perf_counter() - start)
    return host, wall


def profiled(optimizer, device, steps):
    """torch.profiler's key averages over `steps` steps, and the summed kernel time."""
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            optimizer.step()
        synchronize(device)
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages()
                    if e.device_type == DeviceType.CUDA)
    return prof.key_averages(), kernel_us


def report_mode(name, optimizer, args):
    for _ in range(args.warmup):
        optimizer.step()
    synchronize(args.device)
    host, wall = timed_steps(optimizer, args.device, args.steps)
    averages, kernel_us = profiled(optimizer, args.device, args.steps)
    fused = [e for e in averages if e.key == FUSED_OP and e.device_type == DeviceType.CPU]
    op_us = fused[0].cpu_time_total / max(1, fused[0].count) if fused else float("nan")
    device_ms = f"{kernel_us / args.steps / 1e3:.3f}" if args.device == "cuda" else "-"
    print(f"{name:6} host ms/step {statistics.median(host) * 1e3:9.3f} (min "
          f"{min(host) * 1e3:.3f})  wall ms/step {statistics.median(wall) * 1e3:9.3f}  device "
          f"ms/step {device_ms}  {FUSED_OP} host us/call {op_us:9.1f}")
    cpu_events = sorted((e for e in averages if e.device_type == DeviceType.CPU),
                        key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    print(f"  {'event':40} {'self CPU us/step':>16} {'calls/step':>10}")
    for e in cpu_events:
        print(f"  {e.key[:40]:40} {e.self_cpu_time_total / args.steps:16.1f} "
              f"{e.count / args.steps:10.1f}")
    return statistics.median(host), statistics.median(wall)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--total-elements", type=float, default=2e4,
                        help="params in the model (3.5e8 for the 350M GPU check)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="profiler events shown per mode")
    parser.add_argument("--elements-per-tensor", type=int, default=None,
                        help="make every tensor this size (1: the kernels take almost no time "
                             "and the step's host cost per tensor shows alone)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = model_like_shapes(int(args.total_elements), layers=args.layers)
    if args.elements_per_tensor is not None:
        shapes = [(args.elements_per_tensor,)] * len(shapes)
    elements = sum(torch.Size(s).numel() for s in shapes)
    print(f"# FusedAdamW on {args.device}, {elements:,} bf16 params in {len(shapes)} tensors, "
          f"torch {torch.__version__}, {args.steps} steps per figure (median)")
    medians = {}
    for name, mode in MODES.items():
        optimizer = make_optimizer(shapes, mode, args.device, args.seed)
        medians[name] = report_mode(name, optimizer, args)
        del optimizer
    host_ratio = medians["split"][0] / medians["True"][0]
    wall_ratio = medians["split"][1] / medians["True"][1]
    print(f"split over True: host {host_ratio:.3f}x, wall {wall_ratio:.3f}x")


if __name__ == "__main__":
    main()

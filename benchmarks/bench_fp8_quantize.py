"""Times the FP8 quantize ops of current scaling against a copy of the same bytes: the fused
cast+amax, fp8_tensor_scale (a read-only reduction), fp8_cast_transpose(_dbias) and
fp8_quantize_rowwise, on one [m, k] activation/grad shape per run.

Each op's byte floor is its input read once plus its outputs written once (fp8 codes 1 byte,
both layouts for the transposes); achieved GB/s is that floor over the median time, and
"of copy" compares it with torch's copy_ of an fp32 tensor measured in the same run (read +
write bytes over its time). The target for fp8_cast_amax on CUDA is >= 85% of copy. Calls
rotate over enough argument sets to exceed the last-level cache. Reports; never asserts.

    PYTHONPATH=python python benchmarks/bench_fp8_quantize.py [--device cpu|cuda] [--m 8192 --k 4096]
"""

import argparse
import statistics
import time

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from ampfuse.ops.fp8 import (
    fp8_cast_amax,
    fp8_cast_transpose,
    fp8_cast_transpose_dbias,
    fp8_quantize_rowwise,
    fp8_tensor_scale,
)

E4M3 = torch.float8_e4m3fn
CACHE_BYTES = 256 << 20  # more than any current L2 / L3


def median_seconds(device, calls, repeats):
    """Median time of one call; calls[i % len(calls)] is called each time."""
    for c in calls:  # every set once: first touches (page faults) are not timed
        c()
    times = []
    for i in range(repeats):
        call = calls[i % len(calls)]
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device, m, k = args.device, args.m, args.k
    sets = max(2, CACHE_BYTES // (m * k * 4) + 1)
    print(f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
          f"[{m}, {k}], {sets} argument sets per op")
    fp32 = [torch.randn(m, k, device=device) for _ in range(sets)]
    copy_dst = [torch.empty_like(x) for x in fp32]
    scale = torch.full((1,), 4.0, device=device)
    amax = torch.zeros(1, device=device)
    copy_s = median_seconds(device, [lambda i=i: copy_dst[i].copy_(fp32[i]) for i in range(sets)],
                            args.repeats)
    copy_gbs = 2 * m * k * 4 / copy_s / 1e9
    print(f"{'op':40s} {'dtype':5s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}")
    print(f"{'copy_ (fp32 -> fp32)':40s} {'fp32':5s} {copy_s * 1e3:8.3f} {copy_gbs:8.1f} {1:8.2f}")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        xs = [x.to(dtype) for x in fp32]
        size = xs[0].element_size()
        cases = {
            "fp8_cast_amax": (lambda x: fp8_cast_amax(x, scale, amax, E4M3), size + 1),
            "fp8_tensor_scale": (lambda x: fp8_tensor_scale(x, E4M3), size),
            "fp8_cast_transpose": (lambda x: fp8_cast_transpose(x, scale, amax, E4M3), size + 2),
            "fp8_cast_transpose_dbias": (lambda x: fp8_cast_transpose_dbias(x, scale, amax, E4M3),
                                         size + 2),
            "fp8_quantize_rowwise": (lambda x: fp8_quantize_rowwise(x, E4M3, False), size + 1),
            "fp8_quantize_rowwise(transpose)": (lambda x: fp8_quantize_rowwise(x, E4M3, True),
                                                size + 1),
        }
        for op, (fn, bytes_per_element) in cases.items():
            s = median_seconds(device, [lambda x=x, fn=fn: fn(x) for x in xs], args.repeats)
            gbs = m * k * bytes_per_element / s / 1e9
            print(f"{op:40s} {name:5s} {s * 1e3:8.3f} {gbs:8.1f} {gbs / copy_gbs:8.2f}")


if __name__ == "__main__":
    main()

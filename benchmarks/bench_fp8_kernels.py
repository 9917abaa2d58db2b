"""Bandwidth of the FP8 cast kernels against a device-to-device copy of the same bytes (issue
31's goal: the fused cast + transpose + amax at >= 85% of copy bandwidth).

    PYTHONPATH=python python benchmarks/bench_fp8_kernels.py [--device cuda] [--json PATH]

Ops (torch.ops.ampfuse):
  fp8_cast_transpose        reads [m, k] once; writes the FP8 copy and its transpose (2mk B)
  fp8_cast_transpose_dbias  as above plus the fp32 column sums (4k B)
  fp8_cast_amax             reads [m, k]; writes the FP8 copy (mk B)
  fp8_tensor_scale          reads [m, k]; writes three fp32 scalars
  fp8_quantize_rowwise      reads [m, k]; writes the FP8 copy and one fp32 scale per row
Byte floor first: each input read once, each output written once (the amax and scale scalars
counted as 4 B each). The copy that sets the 100% mark moves the same number of bytes (half
read, half written) through _timing.copy_bandwidth. Every op cycles through enough independent
argument sets to span twice the L2 (no set is still cached when it comes round again), on
random data; CUDA events, median of --repeats after warm-up. Each op is timed twice, and the
gap between the two medians is the noise. On the CPU the figures say only that the script runs.
"""

import statistics

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from _report import report
from _timing import copy_bandwidth, parse_args, rotation_count, time_calls

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
SHAPES = {"cuda": {"llama x [8192, 4096]": (8192, 4096),
                   "llama ffn [8192, 14336]": (8192, 14336),
                   "llama w [14336, 4096]": (14336, 4096),
                   "gpt2 x [8192, 768]": (8192, 768)},
          "cpu": {"tiny [256, 384]": (256, 384)}}


def _calls(name, op, sets, fp8_dtype):
    """call(i) on argument set i % len(sets), and the bytes it writes beyond the input."""
    if name == "fp8_cast_transpose":
        return (lambda i: op(sets[i % len(sets)][0], sets[i % len(sets)][1],
                             sets[i % len(sets)][2], fp8_dtype)), lambda m, k: 2 * m * k + 4
    if name == "fp8_cast_transpose_dbias":
        return (lambda i: op(sets[i % len(sets)][0], sets[i % len(sets)][1],
                             sets[i % len(sets)][2], fp8_dtype)), lambda m, k: 2 * m * k + 4 * k + 4
    if name == "fp8_cast_amax":
        return (lambda i: op(sets[i % len(sets)][0], sets[i % len(sets)][1],
                             sets[i % len(sets)][2], fp8_dtype)), lambda m, k: m * k + 4
    if name == "fp8_tensor_scale":
        return (lambda i: op(sets[i % len(sets)][0], fp8_dtype, 0.0)), lambda m, k: 12
    return (lambda i: op(sets[i % len(sets)][0], E4M3, False)), lambda m, k: m * k + 4 * m


OPS = {"fp8_cast_transpose": E4M3, "fp8_cast_transpose_dbias": E5M2, "fp8_cast_amax": E4M3,
       "fp8_tensor_scale": E4M3, "fp8_quantize_rowwise": E4M3}


def run(args):
    device = args.device
    dtypes = [torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float32]
    rows = []
    for label, (m, k) in SHAPES[device].items():
        for dtype in dtypes:
            in_bytes = m * k * dtype.itemsize
            sets_n = rotation_count(in_bytes + 2 * m * k, device, max_sets=32)
            gen = torch.Generator(device=device).manual_seed(0)
            sets = [(torch.randn(m, k, device=device, dtype=dtype, generator=gen),
                     torch.full((1,), 0.5, device=device), torch.zeros(1, device=device))
                    for _ in range(sets_n)]
            for name, fp8_dtype in OPS.items():
                row = {"shape": label, "m": m, "k": k, "dtype": str(dtype).replace("torch.", ""),
                       "op": name, "device": device, "sets": sets_n}
                rows.append(row)
                call, written = _calls(name, getattr(torch.ops.ampfuse, name), sets, fp8_dtype)
                floor = in_bytes + written(m, k)
                try:
                    medians = [statistics.median(time_calls(call, device, max(args.warmup, sets_n),
                                                            args.repeats)) for _ in range(2)]
                except (RuntimeError, NotImplementedError) as error:
                    row["error"] = str(error).splitlines()[0][:100]
                    continue
                median = min(medians)
                copy = copy_bandwidth(floor, device, args.warmup, args.repeats)
                row.update(floor_bytes=floor, median_s=median, gbps=floor / median / 1e9,
                           copy_gbps=copy / 1e9, pct_of_copy=100 * floor / median / copy,
                           noise_pct=100 * abs(medians[0] - medians[1]) / min(medians))
            del sets
    return rows


def format_rows(rows, env):
    cuda = rows and rows[0]["device"] == "cuda"
    where = env.get("gpu") if cuda else f"CPU x{env['cpu_threads']}"
    lines = [f"# fp8 kernels: {where}; torch {env['torch']}; {env['date']}; {env['command']}",
             (f"{'shape':>24} {'in':>8} {'op':>25} {'us':>9} {'noise%':>6} {'MB':>8} "
              f"{'GB/s':>8} {'copy GB/s':>9} {'%copy':>6}")]
    for r in rows:
        head = f"{r['shape']:>24} {r['dtype']:>8} {r['op']:>25}"
        if "error" in r:
            lines.append(f"{head} {r['error']}")
            continue
        lines.append(f"{head} {r['median_s'] * 1e6:9.1f} {r['noise_pct']:6.1f} "
                     f"{r['floor_bytes'] / 1e6:8.1f} {r['gbps']:8.1f} {r['copy_gbps']:9.1f} "
                     f"{r['pct_of_copy']:6.0f}")
    lines.append("# MB: byte floor (input read once, outputs written once); %copy: of a device "
                 "copy moving the same bytes; goal: fp8_cast_transpose(_dbias) >= 85%")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    return report(run(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main()

"""Times ampfuse's FP8 GEMM (cuBLASLt) against bf16 F.linear and torch._scaled_mm, the
fused fp8 cast+amax against torch's clamp+cast plus a separate amax, and the FP8 transpose of a
layer's backward against torch's t().contiguous().

GEMM shapes (m, n, k) for out[m, n] = a[m, k] @ b[n, k].T: 4096^3, and the four GEMMs of a
GPT-2-small block at 8 x 1024 tokens (QKV 768->2304, attention out 768->768, MLP up
768->3072, MLP down 3072->768). Reported as median ms and TFLOP/s (2mnk flops); ratios are
bf16 / ampfuse and _scaled_mm / ampfuse (> 1: ampfuse faster). FP8 needs compute capability
8.9+; on the CPU the GEMM rows time the fp32 emulation, which says nothing about GPU speed.

The GEMMs of a shape are timed in interleaved rounds (--repeats rounds, after --warmup calls
of each): every round runs a block of 10 calls (CUDA; 1 on the CPU) of each implementation,
the order rotated round by round, and the ratios are medians over rounds of the two
implementations' times in the same round. ampfuse runs twice in every round; "noise" is how
far the paired ratio of its two copies is from 1.

    PYTHONPATH=python python benchmarks/bench_fp8.py [--device cpu|cuda] [--json PATH]
"""

import statistics
import time

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
import torch.nn.functional as F
from _report import report
from _timing import parse_args, synchronize, time_calls
from ampfuse.ops.fp8 import FP8_MAX, fp8_cast_amax, fp8_gemm, fp8_transpose

TOKENS = 8 * 1024
GEMMS = {
    "4096^3": (4096, 4096, 4096),
    "gpt2 qkv": (TOKENS, 2304, 768),
    "gpt2 attn-out": (TOKENS, 768, 768),
    "gpt2 mlp-up": (TOKENS, 3072, 768),
    "gpt2 mlp-down": (TOKENS, 768, 3072),
}
CPU_GEMMS = {"512^3": (512, 512, 512)}
E4M3 = torch.float8_e4m3fn
AGAIN = "ampfuse fp8_gemm, again"  # a second copy in each round: the noise of the comparison


def _median(call, device, args):
    return statistics.median(time_calls(call, device, args.warmup, args.repeats,
                                        None if device == "cuda" else 2.0))


def interleaved_block_times(calls, device, warmup, rounds, block):
    """{impl: [seconds per call, one value per round]}.

    Each round runs `block` back-to-back calls of every impl, in an order rotated from round
    to round, so that clock and temperature drift fall on all of them alike. On CUDA a pair of
    events brackets each block and nothing synchronizes until the last round, so the queue
    stays full and a block's time is GPU time, not the host's launch latency (with one call
    per event pair, the few microseconds cuBLASLt's heuristic query takes on the host can
    show up in a 0.1 ms GEMM's time)."""
    names = list(calls)
    for name in names:
        for i in range(warmup):
            calls[name](i)
    synchronize(device)
    marks = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            call = calls[name]
            if device == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for i in range(block):
                    call(i)
                end.record()
                marks[name].append((start, end))
            else:
                t0 = time.perf_counter()
                for i in range(block):
                    call(i)
                marks[name].append(time.perf_counter() - t0)
    synchronize(device)
    if device == "cuda":
        return {name: [s.elapsed_time(e) / 1e3 / block for s, e in pairs]
                for name, pairs in marks.items()}
    return {name: [t / block for t in times] for name, times in marks.items()}


def _paired(times, numerator, denominator):
    """The median over rounds of numerator's time over denominator's in the same round."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def gemm_rows(args):
    """Each shape's GEMMs timed in interleaved rounds; ampfuse runs twice per round, and the
    paired ratio of its two copies is the row's noise."""
    device = args.device
    rows = []
    gen = torch.Generator(device=device).manual_seed(args.seed)
    block = 10 if device == "cuda" else 1
    for name, (m, n, k) in (GEMMS if device == "cuda" else CPU_GEMMS).items():
        x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16)
        bias = torch.randn(n, device=device, generator=gen, dtype=torch.bfloat16)
        scale = torch.ones(1, device=device)
        x8 = fp8_cast_amax(x, scale, torch.zeros(1, device=device), E4M3)
        w8 = fp8_cast_amax(w, scale, torch.zeros(1, device=device), E4M3)
        calls = {
            "bf16 F.linear": lambda i: F.linear(x, w, bias),
            "ampfuse fp8_gemm": lambda i: fp8_gemm(x8, w8, scale, scale, bias, torch.bfloat16),
        }
        if device == "cuda":
            # _scaled_mm wants b column-major: w8.t() is that view of the row-major weight.
            calls["torch _scaled_mm"] = lambda i: torch._scaled_mm(
                x8, w8.t(), scale, scale, bias=bias, out_dtype=torch.bfloat16)
        runnable = {}
        for impl, call in calls.items():
            try:
                call(0)
                runnable[impl] = call
            except RuntimeError as error:
                rows.append({"op": "gemm", "shape": name, "impl": impl,
                             "error": str(error).splitlines()[0][:80]})
        if "ampfuse fp8_gemm" in runnable:
            runnable[AGAIN] = runnable["ampfuse fp8_gemm"]
        times = interleaved_block_times(runnable, device, args.warmup, args.repeats, block)
        for impl in calls:
            if impl not in times:
                continue
            seconds = statistics.median(times[impl])
            row = {"op": "gemm", "shape": name, "m": m, "n": n, "k": k, "impl": impl,
                   "device": device, "median_s": seconds, "tflops": 2 * m * n * k / seconds / 1e12,
                   "rounds": len(times[impl]), "calls_per_round": block}
            if impl == "ampfuse fp8_gemm":
                row["noise_pct"] = 100.0 * abs(_paired(times, AGAIN, impl) - 1.0)
                for other in calls:
                    if other != impl and other in times:
                        row[f"{other} / ampfuse"] = _paired(times, other, impl)
            rows.append(row)
    return rows


def cast_rows(args):
    """The fused cast+amax against torch's two passes, on one 64M-element (CUDA) or 1M (CPU)
    bf16 tensor. Byte floor: 2 bytes read and 1 written per element."""
    device = args.device
    numel = (64 << 20) if device == "cuda" else (1 << 20)
    x = torch.randn(numel, device=device, dtype=torch.bfloat16)
    scale, amax = torch.full((1,), 3.0, device=device), torch.zeros(1, device=device)

    def torch_pair(i):
        (x.float() * scale).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3)
        x.abs().amax()

    rows = []
    for impl, call in (("ampfuse fp8_cast_amax", lambda i: fp8_cast_amax(x, scale, amax, E4M3)),
                       ("torch clamp+cast, amax", torch_pair)):
        seconds = _median(call, device, args)
        rows.append({"op": "cast", "shape": f"{numel:,} bf16", "impl": impl, "device": device,
                     "median_s": seconds, "gbps": 3 * numel / seconds / 1e9})
    rows[0]["torch / ampfuse"] = rows[1]["median_s"] / rows[0]["median_s"]
    return rows


TRANSPOSES = {"gpt2 input": (TOKENS, 768), "gpt2 mlp grad": (TOKENS, 3072)}
CPU_TRANSPOSES = {"1024 x 768": (1024, 768)}


def transpose_rows(args):
    """ampfuse's tiled fp8_transpose against torch's t().contiguous() on the FP8 operands an
    FP8 layer's backward transposes (a GPT-2-small activation and MLP grad at 8 x 1024
    tokens). Byte floor: each byte read once and written once."""
    device = args.device
    block = 10 if device == "cuda" else 1
    rows = []
    for name, (m, k) in (TRANSPOSES if device == "cuda" else CPU_TRANSPOSES).items():
        x = torch.randn(m, k, device=device).to(E4M3)
        calls = {"ampfuse fp8_transpose": lambda i: fp8_transpose(x),
                 "torch t().contiguous()": lambda i: x.t().contiguous()}
        times = interleaved_block_times(calls, device, args.warmup, args.repeats, block)
        for impl in calls:
            seconds = statistics.median(times[impl])
            row = {"op": "transpose", "shape": name, "impl": impl, "device": device,
                   "median_s": seconds, "gbps": 2 * m * k / seconds / 1e9}
            if impl == "ampfuse fp8_transpose":
                row["torch / ampfuse"] = _paired(times, "torch t().contiguous()", impl)
            rows.append(row)
    return rows


def run(args):
    return gemm_rows(args) + cast_rows(args) + transpose_rows(args)


def format_rows(rows, env):
    where = env.get("gpu") if rows and rows[0].get("device") == "cuda" else "CPU"
    lines = [f"# {where}; torch {env['torch']}; {env['date']}; {env['command']}"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['op']:9} {row['shape']:16} {row['impl']:24} {row['error']}")
            continue
        rate = (f"{row['tflops']:8.1f} TFLOP/s" if "tflops" in row
                else f"{row['gbps']:8.1f} GB/s   ")
        ratios = "  ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("/ ampfuse"))
        noise = f"  noise {row['noise_pct']:.1f}%" if "noise_pct" in row else ""
        lines.append(f"{row['op']:9} {row['shape']:16} {row['impl']:24} "
                     f"{row['median_s'] * 1e3:9.3f} ms {rate}  {ratios}{noise}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    return report(run(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main()

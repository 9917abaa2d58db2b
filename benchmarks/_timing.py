"""Shared machinery of the ampfuse benchmarks: data, timing and bandwidth (_report.py: tables
and JSON).

Method (see DESIGN.md, Benchmarks):
- The byte floor of an op is each input read once and each output written once; achieved
  bandwidth is that floor over the median time, and it is compared with a copy of the same
  number of bytes measured on the same device in the same run.
- Each call runs on the next of several independent argument sets whose total is larger than
  the last-level cache (the GPU's L2, the CPU's largest cache), so no call finds its data cached
  by the previous one.
- Times are medians of many calls after warm-up; on CUDA they come from CUDA events. ampfuse is
  timed twice, before and after torch, and the gap between the two medians is the noise: a
  difference smaller than it is not a result.
- Data are random and nonzero. A benchmark reports; it never asserts a time.
"""

import argparse
import math
import os
import re
import statistics
import time

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CPU_DEFAULT_TOTALS = (10_000_000,)
CUDA_DEFAULT_TOTALS = (1_000_000, 10_000_000, 100_000_000)


# --- command line ------------------------------------------------------------------------------


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_common_args(parser):
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default_device(),
        help="device to time on (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=list(DTYPES),
        default=list(DTYPES),
        help="gradient dtypes to time (default: all)",
    )
    parser.add_argument(
        "--total-elements",
        nargs="+",
        type=float,
        default=None,
        help="elements in the whole gradient list, e.g. 1e6 1e7 1e8 "
        "(default: 1e7 on cpu; 1e6 1e7 1e8 on cuda)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed calls first (default 3 cpu, 10 cuda)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls (default 15 cpu, 100 cuda)"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_args(description, argv=None):
    parser = argparse.ArgumentParser(description=description)
    add_common_args(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return finish_args(parser.parse_args(argv))


def finish_args(args):
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    cuda = args.device == "cuda"
    if args.total_elements is None:
        args.total_elements = CUDA_DEFAULT_TOTALS if cuda else CPU_DEFAULT_TOTALS
    args.total_elements = [int(t) for t in args.total_elements]
    if args.warmup is None:
        args.warmup = 10 if cuda else 3
    if args.repeats is None:
        args.repeats = 100 if cuda else 15
    return args


# --- data --------------------------------------------------------------------------------------


def model_like_shapes(total_elements, layers=24):
    """Parameter shapes of a GPT-style transformer with about `total_elements` elements.

    Per layer: qkv and output projections, a 4x MLP, two layer norms, biases everywhere (12
    tensors, 12 d^2 + 13 d elements); the token embedding takes what the layers leave, plus a
    final layer norm. With 24 layers that is 291 tensors of many sizes, most not a multiple of
    the 64K chunk.
    """
    d = max(16, int(math.sqrt(0.75 * total_elements / (12 * layers))) // 16 * 16)
    layer = [
        (3 * d, d),
        (3 * d,),
        (d, d),
        (d,),
        (d,),
        (d,),
        (4 * d, d),
        (4 * d,),
        (d, 4 * d),
        (d,),
        (d,),
        (d,),
    ]
    shapes = [s for _ in range(layers) for s in layer]
    used = sum(math.prod(s) for s in shapes) + 2 * d
    vocab = max(1, (total_elements - used) // d)
    return [(vocab, d)] + shapes + [(d,), (d,)]


def random_tensors(shapes, dtype, device, gen):
    """Random values of magnitude 2^-4 to 2^4 and random sign, never zero, so that scaling by
    2 and by 1/2 in turn keeps every value exact and normal however often a benchmark repeats."""
    out = []
    for shape in shapes:
        mantissa = torch.rand(shape, generator=gen, device=device) + 1.0
        exponent = torch.randint(-4, 5, shape, generator=gen, device=device).float()
        sign = torch.randint(0, 2, shape, generator=gen, device=device).float() * 2 - 1
        out.append((sign * mantissa * torch.exp2(exponent)).to(dtype))
    return out


def generator(device, seed):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def element_count(shapes):
    return sum(math.prod(s) for s in shapes)


# --- caches and rotation -----------------------------------------------------------------------


def cache_bytes(device):
    """The last-level cache that a benchmark must not fit in: the GPU's L2, or the CPU's largest
    cache as Linux reports it (32 MiB if it cannot be read)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    largest = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            largest = max(largest, int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return largest or 32 << 20


def rotation_count(bytes_per_set, device, max_sets=64, max_bytes=None):
    """How many independent argument sets to cycle through so that together they span at least
    twice the last-level cache (at least 2, at most max_sets or max_bytes of data)."""
    if max_bytes is None:
        max_bytes = 8 << 30 if device == "cuda" else 1 << 30
    want = math.ceil(2 * cache_bytes(device) / max(bytes_per_set, 1))
    fit = max(1, max_bytes // max(bytes_per_set, 1))
    return int(max(2, min(want, max_sets, fit)) if fit >= 2 else 1)


# --- timing ------------------------------------------------------------------------------------


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(call, device, warmup, repeats, budget_s=None):
    """Times call(i) for i = 0, 1, ...; returns the seconds of each timed call.

    CUDA: a pair of events around each call, read after one final synchronize. CPU: a
    perf_counter pair around each call; with budget_s, timing stops early once that many
    seconds have gone by and at least 5 calls are timed (torch's CPU fp16 unscale takes
    over half a second per call on 10M elements).
    """
    for i in range(warmup):
        call(i)
    synchronize(device)
    if device == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            call(warmup + i)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        call(warmup + i)
        times.append(time.perf_counter() - t0)
        if budget_s is not None and len(times) >= 5 and sum(times) > budget_s:
            break
    return times


def summarize(times):
    ordered = sorted(times)
    return {
        "median_s": statistics.median(ordered),
        "min_s": ordered[0],
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "samples": len(ordered),
    }


def budget_s(device):
    """Seconds one CPU timing run may take (CUDA runs are short enough to run in full)."""
    return None if device == "cuda" else 2.0


_COPY_CACHE = {}


def copy_bandwidth(nbytes, device, warmup, repeats):
    """Bytes per second of a plain device copy that moves `nbytes` in all (nbytes/2 read and
    nbytes/2 written), with the same rotation as the benchmarks. Memoized per size."""
    key = (nbytes, device)
    if key not in _COPY_CACHE:
        half = max(1, nbytes // 2)
        sets = rotation_count(2 * half, device)
        # Both buffers are written first, so no page is first touched inside a timed copy.
        pairs = [
            (
                torch.empty(half, dtype=torch.uint8, device=device).random_(1, 255),
                torch.zeros(half, dtype=torch.uint8, device=device),
            )
            for _ in range(sets)
        ]
        times = time_calls(
            lambda i: pairs[i % sets][1].copy_(pairs[i % sets][0]),
            device,
            max(warmup, sets),
            repeats,
            budget_s(device),
        )
        _COPY_CACHE[key] = 2 * half / statistics.median(times)
        del pairs
    return _COPY_CACHE[key]


# --- one comparison ----------------------------------------------------------------------------


def error_text(error):
    """The first line of a torch row's error, for its table cell. torch's dispatch errors name
    the kernel first, as in "_amp_foreach_non_finite_check_and_unscale_cuda" not implemented
    for 'BFloat16', so a narrow cell would show only the name: the reason goes first."""
    line = (str(error).strip() or type(error).__name__).splitlines()[0]
    match = re.fullmatch(r'"(\w+)" (not implemented for .+)', line)
    return (f"{match[2]}: {match[1]}" if match else line)[:120]


def compare(
    *,
    op,
    device,
    dtype_name,
    shapes,
    floor_bytes,
    make_set,
    ampfuse_call,
    torch_call,
    args,
    torch_label,
    footprint_bytes=None,
):
    """Times ampfuse, then torch, then ampfuse again on the same rotated argument sets.

    make_set(gen) -> one argument set; ampfuse_call(set, i) and torch_call(set, i) run the op on
    it (i is the call number, for ops that alternate their scale). torch_call may raise
    NotImplementedError or RuntimeError where torch lacks the case: its row then says so.
    footprint_bytes is the memory one set occupies (default: floor_bytes; an in-place op reads
    and writes the same bytes, so its floor is twice its footprint). Returns two result rows
    (ampfuse and torch).
    """
    gen = generator(device, args.seed)
    sets_n = rotation_count(footprint_bytes or floor_bytes, device)
    sets = [make_set(gen) for _ in range(sets_n)]
    synchronize(device)

    # Every set is used once before timing starts (warm-up covers them all).
    warmup, budget = max(args.warmup, sets_n), budget_s(device)

    def timed(call):
        return time_calls(
            lambda i: call(sets[i % sets_n], i // sets_n), device, warmup, args.repeats, budget
        )

    first = timed(ampfuse_call)
    torch_times, torch_error = None, None
    try:
        torch_times = timed(torch_call)
    except (NotImplementedError, RuntimeError) as error:
        torch_error = error_text(error)
    second = timed(ampfuse_call)
    sets.clear()  # free the sets before the copy measurement allocates its own
    copy_bps = copy_bandwidth(floor_bytes, device, args.warmup, args.repeats)

    m1, m2 = statistics.median(first), statistics.median(second)
    amp = summarize(first + second)
    base = {
        "op": op,
        "device": device,
        "dtype": dtype_name,
        "tensors": len(shapes),
        "elements": element_count(shapes),
        "floor_bytes": floor_bytes,
        "rotation_sets": sets_n,
        "copy_gbps": copy_bps / 1e9,
    }
    amp_row = dict(base, impl="ampfuse", **amp)
    amp_row["noise_pct"] = 100.0 * abs(m1 - m2) / min(m1, m2)
    rows = [amp_row]
    torch_row = dict(base, impl=torch_label)
    if torch_times is not None:
        torch_row.update(summarize(torch_times))
        amp_row["torch_over_ampfuse"] = torch_row["median_s"] / amp_row["median_s"]
    else:
        torch_row["error"] = torch_error
    rows.append(torch_row)
    for row in rows:
        if "median_s" in row:
            row["gbps"] = floor_bytes / row["median_s"] / 1e9
            row["pct_of_copy"] = 100.0 * floor_bytes / row["median_s"] / copy_bps
    return rows

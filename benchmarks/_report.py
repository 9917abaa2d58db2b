"""The output of the ampfuse benchmarks: the environment a run records, the ops' table, JSON,
and the command line of a bench_*.py (_timing.py holds the data, timing and bandwidth)."""

import datetime
import json
import math
import os
import platform
import sys

import torch
from _timing import parse_args


def environment(argv=None):
    info = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(
            [os.path.basename(sys.executable)] + (argv if argv is not None else sys.argv)
        ),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=props.name, gpu_l2_bytes=props.L2_cache_size, cuda=torch.version.cuda)
    return info


COLUMNS = [
    ("op", "{}", 14),
    ("dtype", "{}", 10),
    ("tensors", "{}", 7),
    ("elements", "{:,}", 11),
    ("impl", "{}", 24),
    ("median_ms", "{:.3f}", 9),
    ("noise_pct", "{:.1f}", 6),
    ("MB_moved", "{:.1f}", 9),
    ("gbps", "{:.1f}", 7),
    ("pct_of_copy", "{:.0f}", 6),
    ("torch/ampfuse", "{:.2f}", 13),
]
HEADERS = {
    "median_ms": "ms",
    "noise_pct": "noise%",
    "MB_moved": "MB",
    "gbps": "GB/s",
    "pct_of_copy": "%copy",
    "elements": "elements",
}


def format_table(rows, env=None):
    def cell(row, name, fmt):
        value = {
            "median_ms": row.get("median_s", math.nan) * 1e3 if "median_s" in row else None,
            "MB_moved": row["floor_bytes"] / 1e6,
            "torch/ampfuse": row.get("torch_over_ampfuse"),
        }.get(name, row.get(name))
        if value is None:
            return row.get("error", "-")[:40] if name == "median_ms" and "error" in row else "-"
        return fmt.format(value)

    lines = []
    if env:
        where = (
            env.get("gpu")
            if rows and rows[0]["device"] == "cuda"
            else f"CPU x{env['cpu_threads']} threads"
        )
        lines.append(f"# {where}; torch {env['torch']}; {env['date']}; {env['command']}")
        copy = sorted({(r["floor_bytes"], r["copy_gbps"]) for r in rows})
        if copy:
            lines.append(
                "# copy bandwidth for the same bytes: "
                + ", ".join(f"{b / 1e6:.0f} MB -> {g:.1f} GB/s" for b, g in copy)
            )
    lines.append("  ".join(HEADERS.get(n, n).rjust(w) for n, _, w in COLUMNS))
    for row in rows:
        lines.append("  ".join(cell(row, n, f).rjust(w) for n, f, w in COLUMNS))
    lines.append(
        "# ms: median; noise%: gap between ampfuse's two timings; MB: byte floor (inputs read "
        "once, outputs written once); %copy: of a device copy of the same bytes; "
        "torch/ampfuse > 1: ampfuse faster"
    )
    return "\n".join(lines)


def write_json(path, rows, env):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, "results": rows}, f, indent=2)
        f.write("\n")


def report(rows, argv, json_path, format_rows=format_table):
    """Prints the rows' table (format_rows(rows, env)) and, if json_path is given, writes them
    there as JSON with the environment; returns the rows."""
    env = environment(argv)
    print(format_rows(rows, env))
    if json_path:
        write_json(json_path, rows, env)
    return rows


def main_for(run, description, argv=None):
    """The command line of one bench_*.py: run it, print the table, write JSON if asked."""
    args = parse_args(description, argv)
    return report(run(args), argv, args.json)

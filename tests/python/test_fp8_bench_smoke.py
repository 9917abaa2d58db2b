"""benchmarks/bench_fp8.py runs end to end on the CPU and writes its JSON: a smoke test of the
script (the GPU check runs it on CUDA), not of speed: nothing here looks at a time."""

import json
import os
import subprocess
import sys
from pathlib import Path
from helpers import AMPFUSE_PATH

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fp8_runs_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    out = tmp_path / "fp8.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fp8.py"), "--device", "cpu",
         "--warmup", "1", "--repeats", "2", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["op"], r["impl"]) for r in rows} == {
        ("gemm", "bf16 F.linear"), ("gemm", "ampfuse fp8_gemm"),
        ("cast", "ampfuse fp8_cast_amax"), ("cast", "torch clamp+cast, amax"),
        ("transpose", "ampfuse fp8_transpose"), ("transpose", "torch t().contiguous()")}
    assert not [r for r in rows if "error" in r], rows
    assert "fp8_gemm" in result.stdout and "TFLOP/s" in result.stdout

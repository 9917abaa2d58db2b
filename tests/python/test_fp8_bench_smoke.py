"""benchmarks/bench_fp8.py runs end to end on the CPU and writes its JSON: a smoke test of the
script (the GPU check runs it on CUDA), not of speed: nothing here looks at a time."""

import json
import os
import re
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


def _run(script, *argv, timeout=120):
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _ampfuse_has(name):
    """Whether this checkout's ampfuse.fp8 has `name` (the FP8 rework's recipes come later)."""
    fp8 = Path(AMPFUSE_PATH) / "ampfuse" / "fp8"
    return any(f"class {name}" in p.read_text() for p in fp8.glob("*.py"))


def _measured_or_unavailable(rows, key):
    """Every row was timed or says, in so many words, that this installation lacks it; the rows
    whose recipe this ampfuse has were timed."""
    for row in rows:
        assert "median_s" in row or row["error"].startswith("not available:"), row
    recipes = {"ampfuse fp8 current": "CurrentScaling", "ampfuse fp8 rowwise": "RowwiseScaling",
               "ampfuse fp8 delayed": "DelayedScaling"}
    for row in rows:
        if row[key] in recipes and _ampfuse_has(recipes[row[key]]):
            assert row["median_s"] > 0, row


def test_bench_fp8_train_llama_runs_every_setup_on_cpu(tmp_path):
    out = tmp_path / "train.json"
    stdout = _run("bench_fp8_train.py", "--device", "cpu", "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [r["setup"] for r in rows] == [
        "ampfuse O2 bf16", "torch amp bf16", "ampfuse fp8 current", "ampfuse fp8 rowwise",
        "ampfuse fp8 delayed", "ampfuse fp8=True", "torchao tensorwise", "torchao rowwise"]
    _measured_or_unavailable(rows, "setup")
    by = {r["setup"]: r for r in rows}
    assert by["ampfuse O2 bf16"]["vs_o2"] == 1.0 and "noise_pct" in by["ampfuse O2 bf16"]
    assert by["ampfuse fp8=True"]["tokens_per_s"] > 0
    assert by["ampfuse O2 bf16"]["config"]["accum"] == 4
    assert by["ampfuse O2 bf16"]["tokens_per_step"] == 2 * 32 * 4
    assert "ampfuse O2 bf16" in stdout and "torchao rowwise" in stdout


def test_bench_fp8_train_loss_falls_alike_over_steps(tmp_path):
    """--steps: the loss comparison at reduced depth; the synthetic walks are learnable."""
    out = tmp_path / "steps.json"
    _run("bench_fp8_train.py", "--device", "cpu", "--steps", "40", "--setups",
         "ampfuse O2 bf16", "ampfuse fp8 delayed", "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    for row in rows:
        assert len(row["losses"]) == 40
        assert row["final_loss"] < row["losses"][0] - 0.3, row["losses"]
    assert abs(rows[1]["dloss_pct"]) < 5, rows[1]


def test_bench_fp8_train_gpt_and_layer_fit():
    stdout = _run("bench_fp8_train.py", "--model", "gpt", "--device", "cpu", "--layers", "1",
                  "--hidden", "32", "--heads", "2", "--seq", "16", "--micro-batch", "2",
                  "--vocab", "64")
    for setup in ("torch amp bf16", "ampfuse O2 bf16", "ampfuse fp8=True"):
        assert any(line.split()[:len(setup.split())] == setup.split()
                   for line in stdout.splitlines()), setup
    fit = _run("bench_fp8_train.py", "--show-fit", "--memory-gib", "80")
    assert re.match(r"\d+ layers fit 80\.0 GiB: 218M params/layer", fit), fit


def test_bench_fp8_layer_runs_on_cpu(tmp_path):
    out = tmp_path / "layer.json"
    _run("bench_fp8_layer.py", "--device", "cpu", "--setups", "bf16", "ampfuse fp8 current",
         "ampfuse fp8 delayed", "torchao tensorwise", "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [r["setup"] for r in rows] == ["bf16", "ampfuse fp8 current", "ampfuse fp8 delayed",
                                          "torchao tensorwise"]
    _measured_or_unavailable(rows, "setup")
    assert rows[0]["vs_bf16"] == 1.0 and rows[0]["tflops"] > 0


def test_bench_fp8_threshold_sweeps_and_names_the_rule(tmp_path):
    out = tmp_path / "threshold.json"
    recipe = "current" if _ampfuse_has("CurrentScaling") else "delayed"
    stdout = _run("bench_fp8_threshold.py", "--device", "cpu", "--recipe", recipe,
                  "--reference-tokens", "64", "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    shapes, summary = rows[:-1], rows[-1]
    assert {(r["tokens"], r["in"], r["out"]) for r in shapes} == {
        (m, k, n) for m in (32, 64) for k in (32, 64) for n in (32, 64)}
    assert all(r["ratio"] > 0 and r["bf16_s"] > 0 for r in shapes), shapes
    assert set(summary["threshold_by_tokens"]) == {"32", "64"}
    assert "the constant to update:" in stdout and "FP8 wins at every shape" in stdout


def test_bench_fp8_kernels_reports_bandwidth_or_absence(tmp_path):
    out = tmp_path / "kernels.json"
    _run("bench_fp8_kernels.py", "--device", "cpu", "--warmup", "1", "--repeats", "2",
         "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [r["op"] for r in rows] == ["fp8_cast_transpose", "fp8_cast_transpose_dbias",
                                       "fp8_cast_amax", "fp8_tensor_scale",
                                       "fp8_quantize_rowwise"]
    for row in rows:
        assert row.get("pct_of_copy", 0) > 0 or row["error"].startswith("not in this build"), row
    assert next(r for r in rows if r["op"] == "fp8_cast_amax")["floor_bytes"] == (
        256 * 384 * 3 + 4)

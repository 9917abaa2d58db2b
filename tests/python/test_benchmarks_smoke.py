"""benchmarks/run.py works end to end: at the smallest sizes on the CPU it runs every benchmark
and writes one valid JSON file and one table with rows for each. A smoke test of the scripts, not
of speed: nothing here looks at a time."""

import json
import os
import subprocess
import sys
from pathlib import Path
from helpers import AMPFUSE_PATH

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "--device", "cpu", "--total-elements", "2e4", "--warmup", "1", "--repeats", "2",
    "--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
    "--vocab", "64", "--cnn-width", "4", "--cnn-blocks", "1", "1", "1", "1", "--image-size", "16",
    "--cnn-batch", "2", "--classes", "4",
]


def test_run_py_runs_every_benchmark_and_writes_json(tmp_path):
    # One thread: on a shared 2-core machine, two OpenMP threads competing with another process
    # can make tiny kernels hundreds of times slower; the scripts, not the speed, are under test.
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), *TINY, "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["environment"]["torch"]
    rows = data["results"]
    assert not [r for r in rows if "error" in r and r.get("bench") == "train"], rows
    by_bench = {}
    for row in rows:
        by_bench.setdefault(row["bench"], []).append(row)
    assert set(by_bench) == {"ops", "adam", "sgd", "adagrad", "train", "overhead", "master_modes"}
    assert {r["impl"] for r in by_bench["adagrad"]} >= {"ampfuse FusedAdagrad",
                                                        "torch masters pipeline"}
    assert [r["mode"] for r in by_bench["master_modes"]] == [
        "True", "False", "stochastic", "kahan", "split"]
    assert all(r["mode_min_ms"] > 0 for r in by_bench["master_modes"])
    assert {(r["model"], r["impl"]) for r in by_bench["overhead"]} == {
        (m, i) for m in ("mlp", "gpt")
        for i in ("torch", "torch fused", "O1", "O1 lists", "O2", "O2 noattr")}
    assert all(r["median_ms"] > 0 and r["speed"] > 0 and r["python_calls"] > 0
               for r in by_bench["overhead"])

    assert {r["op"] for r in by_bench["ops"]} == {
        "unscale_", "unscale_ flags", "check flags", "scale_", "l2norm"}
    for name in ("adam", "sgd"):
        impls = {r["impl"] for r in by_bench[name]}
        assert any(i.startswith("ampfuse") for i in impls) and any(
            i.startswith("torch") for i in impls), impls

    train = by_bench["train"]
    assert {(r["model"], r["impl"]) for r in train} == {
        (m, i) for m in ("gpt", "cnn") for i in ("fp32", "torch amp", "ampfuse O1", "ampfuse O2")
    } | {("gpt", "ampfuse O2 fp8")}
    for row in train:
        assert row["median_s"] > 0 and row["items_per_s"] > 0, row
        assert row["peak_mem_bytes"] is None  # CPU: not measured
        assert row["speedup_vs_torch_amp"] > 0 and row["speedup_vs_fp32"] > 0, row
        assert row["final_loss"] == row["final_loss"], row  # not NaN
    gpt = {r["impl"]: r for r in train if r["model"] == "gpt"}
    assert gpt["fp32"]["config"]["layers"] == 1 and gpt["fp32"]["items_per_step"] == 2 * 16
    assert "noise_pct" in gpt["torch amp"]

    table = (tmp_path / "bench_table.txt").read_text()
    for header in ("# adam:", "# sgd:", "# train:", "# gpt:", "# cnn:", "unscale_",
                   "# amp overhead:"):
        assert header in table, table
    assert table.strip() in result.stdout


def test_standalone_benchmarks_run(tmp_path):
    """The scripts outside run.py, at their smallest sizes: they finish and print their rows."""
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_skip_nonfinite.py"),
         "--total-elements", "2e4", "--repeats", "2", "--json", str(tmp_path / "skip.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "skip.json").read_text())["results"]
    assert {r["master_weights"] for r in rows} == {False, True}
    assert all(r["first_min_ms"] > 0 and r["second_min_ms"] > 0 for r in rows), rows


def test_bench_master_modes_runs_for_adagrad(tmp_path):
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_master_modes.py"), "--optimizer",
         "adagrad", "--total-elements", "2e4", "--repeats", "2", "--json",
         str(tmp_path / "modes.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "modes.json").read_text())["results"]
    assert {r["optimizer"] for r in rows} == {"FusedAdagrad"}
    assert [r["mode"] for r in rows] == ["True", "False", "stochastic", "kahan", "split"]
    assert all(r["mode_min_ms"] > 0 for r in rows), rows


def test_bench_lamb_runs_and_compares_with_torch(tmp_path):
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_lamb.py"), "--total-elements", "2e4",
         "--repeats", "2", "--dtype", "fp16", "--json", str(tmp_path / "lamb.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "lamb.json").read_text())["results"]
    ratios = {r["impl"]: r.get("torch_over_ampfuse") for r in rows}
    assert ratios["torch foreach masters"] > 0 and ratios["torch foreach fp32"] > 0, rows


def test_profile_gpu_runs_on_the_cpu():
    """benchmarks/profile_gpu.py (host against device time, for the next GPU session): on the
    CPU it prints a host-time row per op, implementation and list layout (model-shaped, one
    tensor), and one per training set-up."""
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    train_sizes = TINY[TINY.index("--layers"):]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_gpu.py"), "--device", "cpu",
         "--total-elements", "2e4", "--calls", "2", "--steps", "1", "--warmup", "1",
         *train_sizes],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines]
    for op in ("unscale_", "nonfinite_check_", "l2norm", "scale_"):
        for impl in ("ampfuse", "torch"):
            tensors = {r[2] for r in rows if r[:2] == [op, "20,000"] and r[3:4] == [impl]}
            assert "1" in tensors and len(tensors) == 2, (op, impl, tensors)
    for impl in ("torch amp", "ampfuse O1", "ampfuse O2"):
        assert sum(line.strip().startswith(impl) for line in lines) == 2, impl  # gpt and cnn
    for label in ("O2 bf16", "O2 fp8"):  # gpt only: the same model with and without FP8 GEMMs
        assert sum(line.strip().startswith(label) for line in lines) == 1, label


def test_bench_novograd_runs_and_compares_with_torch(tmp_path):
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_novograd.py"), "--total-elements",
         "2e4", "--repeats", "2", "--dtype", "fp16", "--json", str(tmp_path / "novograd.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "novograd.json").read_text())["results"]
    assert {r["op"] for r in rows} == {"novograd"}
    ratios = {r["impl"]: r.get("torch_over_ampfuse") for r in rows}
    assert ratios["torch foreach masters"] > 0 and ratios["torch foreach fp32"] > 0, rows
    assert all(r["median_s"] > 0 for r in rows), rows
    assert "torch foreach masters" in result.stdout


def test_profile_split_runs_tiny_on_the_cpu():
    """benchmarks/profile_split.py (split against True, host and device time per step, for the
    next GPU session at 350M params): tiny on the CPU it prints both modes' rows, the fused op's
    host time per call and the ratio; the int16 low halves are no longer viewed per tensor."""
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_split.py"), "--device", "cpu",
         "--total-elements", "2e4", "--layers", "2", "--steps", "2", "--warmup", "1",
         "--top", "40"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines if "host ms/step" in line}
    assert set(rows) == {"True", "split"}, result.stdout
    for row in rows.values():
        host = float(row.split("host ms/step")[1].split()[0])
        assert host > 0 and "ampfuse::fused_adam_ host us/call" in row, row
    assert any(line.startswith("split over True: host") for line in lines), result.stdout
    assert not any("aten::view" in line for line in lines), result.stdout


def test_bench_state_dtype_runs_tiny_on_the_cpu(tmp_path):
    """benchmarks/bench_state_dtype.py: 8-bit moments against fp32 moments for both master
    modes, each row timed (torchao's row only where it imports)."""
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_state_dtype.py"), "--total-elements",
         "2e4", "--repeats", "2", "--json", str(tmp_path / "state.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "state.json").read_text())["results"]
    ours = [r for r in rows if r["master_weights"] != "-"]
    assert [(r["master_weights"], r["state_dtype"]) for r in ours] == [
        ("True", "int8"), ("True", "fp8"), ("stochastic", "int8"), ("stochastic", "fp8")]
    assert all(r["coded_min_ms"] > 0 and r["fp32_min_ms"] > 0 for r in ours), rows


def test_bench_state_dtype_runs_lamb_tiny_on_the_cpu(tmp_path):
    """benchmarks/bench_state_dtype.py --optimizer lamb: FusedLAMB's 8-bit moments against its
    fp32 moments, both master modes, no torchao row."""
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_state_dtype.py"), "--optimizer", "lamb",
         "--total-elements", "2e4", "--repeats", "2", "--json", str(tmp_path / "state.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "state.json").read_text())["results"]
    assert [(r["optimizer"], r["master_weights"], r["state_dtype"]) for r in rows] == [
        ("lamb", "True", "int8"), ("lamb", "True", "fp8"), ("lamb", "stochastic", "int8"),
        ("lamb", "stochastic", "fp8")]
    assert all(r["coded_min_ms"] > 0 and r["fp32_min_ms"] > 0 for r in rows), rows
    assert "FusedLAMB step" in result.stdout

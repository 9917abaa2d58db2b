"""`python -m ampfuse demo`: end to end as a subprocess, its flags, and its exit status."""

import inspect
import math
import os
import pathlib
import subprocess
import sys

import pytest

from ampfuse.tools.demo import digits as demo
from ampfuse.overflow import OverflowReport
from ampfuse.tools.cli import main

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[2] / "python"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _table_rows(stdout: str) -> dict:
    """The table's rows by run name: {"fp32": [...], "O1 bf16": [...], ...} (cells as text)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = {}
    for line in lines[start + 2:]:
        cells = line.split()
        if not cells or cells[0] not in ("fp32", "O1", "O2", "O3"):
            break
        name = "fp32" if cells[0] == "fp32" else " ".join(cells[:2])
        rows[name] = cells[1:] if cells[0] == "fp32" else cells[2:]
    return rows


def test_demo_runs_end_to_end(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ampfuse", "demo", "--steps", "30", "--device", "cpu",
         "--out", str(out), "--watch"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rows = _table_rows(proc.stdout)
    assert list(rows) == ["fp32", "O1 bf16", "O2 bf16", "O2 master=False",
                          "O2 master=stochastic", "O2 master=kahan", "O2 master=split"], proc.stdout
    for name, cells in rows.items():
        accuracy, loss, ms, memory, bytes_per_param, skipped, scale = cells
        assert 12.0 < float(bytes_per_param) <= 16.1
        assert 0.0 <= float(accuracy) <= 100.0
        assert math.isfinite(float(loss)) and float(ms) > 0.0 and float(memory) > 0.0
        # The overflow injected by default at the middle step is skipped by every run.
        assert skipped == "1", f"{name}: {cells}"
        assert float(scale) == 1.0  # fp32, and bf16, which amp trains unscaled by default
    assert "at step 15" in proc.stdout
    # amp.last_overflow() names the gradient the inf was written into, for every run.
    named = proc.stdout.split("where it overflowed (amp.last_overflow):\n")[1].splitlines()
    for name, line in zip(rows, named[:len(rows)], strict=True):
        assert line.startswith(f"  {name} "), (name, line)
        # The master-free runs take a quarter of the steps; the overflow goes in their middle.
        step = 3 if name.startswith("O2 master=") else 15
        assert line[len(name) + 2:].strip() == (
            f"overflow at step {step} in 1 tensor: 0.weight (inf)"), (name, line)

    # --watch: numerics.watch's table of a short O1 run follows the demo's own.
    watched = proc.stdout.split("numerics.watch: ")[1].splitlines()
    assert watched[1].split() == ["module", "phase", "op", "dtype", "calls", "absmax",
                                  "underflow", "headroom"]
    assert any(line.split()[:4] == ["0", "forward", "convolution", "bfloat16"]
               for line in watched)

    plot = out / "loss_curves.png"
    assert f"saved to {plot}" in proc.stdout
    data = plot.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)


def test_run_demo_results(tmp_path, capsys):
    results = demo.run_demo(steps=12, device="cpu", dtype="bf16", opt_levels=("O1", "O2"),
                            out=tmp_path, seed=1, inject_overflow=5, progress=False,
                            master_modes=())
    assert [r["opt_level"] for r in results] == ["O0", "O1", "O2"]
    for r in results:
        assert len(r["losses"]) == len(r["loss_scales"]) == 12
        assert r["skipped"] == 1
        assert (r["overflow"].step, r["overflow"].param_names) == (5, ["0.weight"])
        scales = r["loss_scales"]
        # fp32, and bf16, which amp trains unscaled by default: the skip needs no scale.
        assert scales == [1.0] * 12 and r["final_scale"] == 1.0
    assert demo.failures(results, inject_overflow=5) == []
    assert (tmp_path / "loss_curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "KiB params+grads+opt" in capsys.readouterr().out


def test_sharded_demo_on_two_processes_matches_the_single_process_run(tmp_path, capsys):
    """--ranks 2: FSDP2 on two CPU processes. The overflow written into rank 0's shard only is
    skipped by both; each process holds about half of the params, grads and state; and the
    runs train like the single-process ones (BatchNorm's per-process batch statistics apart)."""
    options = dict(steps=16, device="cpu", dtype="bf16", opt_levels=("O1", "O2"), seed=1,
                   inject_overflow=5, progress=False)
    sharded = demo.run_demo(out=tmp_path / "sharded", ranks=2, **options)
    assert "FSDP2 (fully_shard) on 2 CPU processes" in capsys.readouterr().out
    single = demo.run_demo(out=tmp_path / "single", **options)
    assert demo.failures(sharded, inject_overflow=5) == []
    for two, one in zip(sharded, single):
        assert two["opt_level"] == one["opt_level"]
        assert (two["skipped"], two["final_scale"]) == (one["skipped"], one["final_scale"])
        assert two["loss_scales"] == one["loss_scales"]
        # Step counts (one per param) are not sharded; everything else is halved.
        assert 0.5 <= two["state_kib"] / one["state_kib"] < 0.52, two["name"]
        # The first step's loss is the whole batch's, averaged over the processes.
        assert math.isclose(two["losses"][0], one["losses"][0], rel_tol=2e-2), two["name"]
        assert two["losses"][-1] < 0.5 * two["losses"][0], f"{two['name']} did not train"


def test_ranks_need_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(SystemExit):
        main(["demo", "--ranks", "2", "--device", "cuda"])
    assert "--device cpu" in capsys.readouterr().err


def test_watch_run_records_the_demo_model(capsys):
    """The --watch run: O1's per-op dtypes in each layer, forward and backward, and the fp16
    verdict at amp's initial loss scale."""
    import torch

    watch = demo.watch_run(demo.load_digits("cpu"), seed=0, device="cpu", dtype=torch.bfloat16,
                           steps=1)
    rows = {(r.module, r.phase, r.op, r.dtype): r for r in watch.report()}
    assert rows["0", "forward", "convolution", torch.bfloat16].calls == 1
    # batch_norm is left to its kernel, as in apex's O1: bf16 in and out, fp32 statistics.
    assert rows["1", "forward", "native_batch_norm", torch.bfloat16].calls == 1
    assert rows["8", "forward", "addmm", torch.bfloat16].calls == 1
    assert rows["0", "backward", "convolution_backward", torch.bfloat16].calls == 1
    assert rows["8", "backward", "grad", torch.bfloat16].absmax > 0
    assert not watch.active
    demo.print_watch(watch, 1, "bf16")
    out = capsys.readouterr().out
    assert "numerics.watch: 1 O1 bf16 steps" in out
    assert "fp16 at loss scale 65536" in out


def test_same_seed_same_run():
    data = demo.load_digits("cpu")
    first, second = (demo.train_run("O2", "O2", data, steps=5, seed=3, device="cpu",
                                    dtype=demo.DTYPES["bf16"], progress=False)
                     for _ in range(2))
    assert first["losses"] == second["losses"]


def test_failures_name_divergence_missed_skips_and_wrong_attribution():
    named = OverflowReport(3, ["0.weight"], ["inf"])
    ok = {"name": "fp32", "final_loss": 0.1, "skipped": 1, "overflow": named}
    diverged = {"name": "O2 bf16", "final_loss": float("nan"), "skipped": 1, "overflow": named}
    unskipped = {"name": "O1 bf16", "final_loss": 0.1, "skipped": 0, "overflow": None}
    misnamed = {"name": "O1 fp16", "final_loss": 0.1, "skipped": 1,
                "overflow": OverflowReport(3, ["8.bias"], ["nan"])}
    assert demo.failures([ok], inject_overflow=3) == []
    assert demo.failures([ok, unskipped], inject_overflow=None) == []
    problems = demo.failures([ok, diverged, unskipped, misnamed], inject_overflow=3)
    assert len(problems) == 3
    assert "O2 bf16 diverged" in problems[0] and "O1 bf16 did not skip" in problems[1]
    assert "O1 fp16: amp.last_overflow() did not name 0.weight" in problems[2]
    assert "8.bias (nan)" in problems[2]


def test_divergence_exits_nonzero(monkeypatch, capsys):
    diverged = {"name": "O2 bf16", "final_loss": float("nan"), "skipped": 0}
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: [diverged])
    assert main(["demo", "--steps", "4", "--inject-overflow", "off"]) == 1
    assert "error: O2 bf16 diverged" in capsys.readouterr().err


def test_missing_demo_dependency_is_named(monkeypatch, capsys):
    monkeypatch.setitem(demo.REQUIREMENTS, "ampfuse_no_such_module", "no-such-package")
    assert main(["demo", "--steps", "4"]) == 2
    assert "pip install no-such-package" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be a positive integer"),
    (["--steps", "ten"], "argument --steps: expected an integer"),
    (["--opt-levels", "O1,O4"], "argument --opt-levels: unknown opt level 'O4'"),
    (["--opt-levels", ","], "argument --opt-levels: expected a comma-separated list"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["--device", "gpu"], "argument --device: 'gpu' is not a device"),
    (["--device", "meta"], "argument --device: the demo runs on cpu or cuda"),
    (["--inject-overflow", "-1"], "argument --inject-overflow: must be a step >= 0"),
    (["--steps", "10", "--inject-overflow", "10"], "step 10 is past the last step (9)"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_flags_give_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m ampfuse" in err and message in err


def test_cuda_without_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit):
        main(["demo", "--device", "cuda"])
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_flags_reach_the_demo(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "main", lambda **kwargs: calls.append(kwargs) or 0)
    assert main(["demo", "--steps", "40", "--device", "cpu"]) == 0
    assert main(["demo", "--opt-levels", "o2, O1,O2", "--inject-overflow", "off", "--dtype",
                 "fp16", "--seed", "7", "--out", "elsewhere"]) == 0
    assert main(["demo"]) == 0
    assert main(["demo", "--ranks", "4", "--device", "cpu"]) == 0
    assert main(["demo", "--watch", "--steps", "5"]) == 0
    default_steps = inspect.signature(demo.run_demo).parameters["steps"].default
    assert calls[2]["steps"] == default_steps and calls[2]["inject_overflow"] == default_steps // 2
    assert calls[0] == dict(steps=40, device="cpu", dtype=None, opt_levels=("O1", "O2"),
                            out="demo_out", seed=0, inject_overflow=20, ranks=1, watch=False)
    assert calls[3]["ranks"] == 4
    assert calls[4]["watch"] is True and calls[4]["steps"] == 5
    assert calls[1]["opt_levels"] == ("O2", "O1") and calls[1]["inject_overflow"] is None
    assert (calls[1]["dtype"], calls[1]["seed"], calls[1]["out"]) == ("fp16", 7, "elsewhere")


def test_master_free_runs_show_their_bytes_per_param(tmp_path, capsys):
    """One O2 run per master_weights value without fp32 masters, for a quarter of the steps,
    each skipping the injected overflow; the table's bytes per param fall with the extra state."""
    results = demo.run_demo(steps=8, device="cpu", dtype="bf16", opt_levels=("O2",),
                            out=tmp_path, seed=1, inject_overflow=6, progress=False)
    names = [r["name"] for r in results]
    assert names == ["fp32", "O2 bf16", "O2 master=False", "O2 master=stochastic",
                     "O2 master=kahan", "O2 master=split"]
    assert demo.failures(results, inject_overflow=6) == []
    by_name = {r["name"]: r for r in results}
    assert all(by_name[n]["steps"] == 8 * demo.MASTER_MODE_STEPS and by_name[n]["skipped"] == 1
               for n in names[2:])
    per_param = {n: by_name[n]["bytes_per_param"] for n in names}
    # fp32 and O2 (fp32 masters): 16 bytes per param; bf16 weights without masters: 12, plus
    # 2 for kahan's compensation or split's low halves (BatchNorm stays fp32 at O2: a little
    # more, and the step counts a few bytes).
    assert 16 <= per_param["fp32"] < 16.1 and 16 <= per_param["O2 bf16"] < 16.1
    assert per_param["O2 master=False"] == per_param["O2 master=stochastic"]
    assert per_param["O2 master=kahan"] == per_param["O2 master=split"]
    assert 12 < per_param["O2 master=False"] < 12.1
    assert 1.95 < per_param["O2 master=kahan"] - per_param["O2 master=False"] < 2.0
    out = capsys.readouterr().out
    assert "B/param" in out and "bf16 weights without fp32 masters" in out

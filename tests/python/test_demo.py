"""`python -m ampfuse demo`: end to end as a subprocess, its flags, and its exit status."""

import inspect
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from ampfuse.overflow import OverflowReport
from ampfuse.tools import cli
from ampfuse.tools.cli import main
from ampfuse.tools.demo import digits as demo
from ampfuse.tools.demo import hardware, training
from helpers import AMPFUSE_PATH

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _table_rows(stdout: str) -> dict:
    """The table's rows by run name: {"fp32": [...], "O1 bf16": [...], ...} (cells as text:
    steps, test acc %, train loss, ms/step, vs fp32, memory, B/param, skipped, loss scale)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = {}
    for line in lines[start + 2:]:
        cells = line.split()
        if not cells or cells[0] not in ("fp32", "O1", "O2", "O3"):
            break
        # A name is "fp32", "<level> <what>" or "O2 master=<mode> <state_dtype>".
        words = 1 if cells[0] == "fp32" else 3 if cells[2] in ("int8", "fp8") else 2
        rows[" ".join(cells[:words])] = cells[words:]
    return rows


def test_demo_runs_end_to_end(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [AMPFUSE_PATH, env.get("PYTHONPATH")]))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ampfuse", "demo", "--steps", "30", "--device", "cpu",
         "--out", str(out), "--watch"],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    assert "  hardware: " in proc.stdout and "bf16 " in proc.stdout.split("  hardware: ")[1]
    rows = _table_rows(proc.stdout)
    assert list(rows) == ["fp32", "O1 bf16", "O2 bf16", "O2 master=True", "O2 master=False",
                          "O2 master=stochastic", "O2 master=kahan", "O2 master=split",
                          "O2 master=True int8", "O2 master=True fp8",
                          "O2 master=stochastic int8", "O2 master=stochastic fp8",
                          "O2 fp16"], proc.stdout
    for name, cells in rows.items():
        steps, accuracy, loss, ms, speed, memory, bytes_per_param, skipped, scale = cells
        # --steps 30: the fp32, O1 and O2 runs; the master_weights and fp16 runs a quarter.
        assert int(steps) == (30 if name in ("fp32", "O1 bf16", "O2 bf16") else 7), name
        if name.endswith(("int8", "fp8")):  # 8-bit moments: 6 bytes per param fewer
            assert 6.0 < float(bytes_per_param) <= 10.2, name
        else:
            assert 12.0 < float(bytes_per_param) <= 16.1, name
        assert 0.0 <= float(accuracy) <= 100.0
        assert math.isfinite(float(loss)) and float(ms) > 0.0 and float(memory) > 0.0
        assert speed.endswith("x") and float(speed[:-1]) > 0.0
        if name == "O2 fp16":
            # The dynamic scale: a power of two; the injected overflow and its own ones skipped.
            assert math.log2(float(scale)).is_integer() and int(skipped) >= 1, cells
            continue
        # The overflow injected by default at the middle step is skipped by every run.
        assert skipped == "1", f"{name}: {cells}"
        assert float(scale) == 1.0  # fp32, and bf16, which amp trains unscaled by default
    assert rows["fp32"][4] == "1.00x"
    assert "at step 15" in proc.stdout
    # amp.last_overflow() names the gradient the inf was written into, for every run.
    named = proc.stdout.split("where it overflowed (amp.last_overflow):\n")[1].splitlines()
    for name, line in zip(rows, named[:len(rows)], strict=True):
        assert line.startswith(f"  {name} "), (name, line)
        # The shorter runs take a quarter of the steps; the overflow goes in their middle.
        step = 15 if name in ("fp32", "O1 bf16", "O2 bf16") else 3
        said = line[len(name) + 2:].strip()
        if name == "O2 fp16":  # it may overflow on its own at that step too
            assert said.startswith(f"overflow at step {step} in ") and "0.weight (inf)" in said
            continue
        assert said == f"overflow at step {step} in 1 tensor: 0.weight (inf)", (name, line)

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
                            master_modes=(), fp16_run=False)
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
    assert "state KiB: params, grads and optimizer state" in capsys.readouterr().out


def test_sharded_demo_on_two_processes_matches_the_single_process_run(tmp_path, capsys):
    """--ranks 2: FSDP2 on two CPU processes. The overflow written into rank 0's shard only is
    skipped by both; each process holds about half of the params, grads and state; and the
    runs train like the single-process ones (BatchNorm's per-process batch statistics apart)."""
    options = {"steps": 16, "device": "cpu", "dtype": "bf16", "opt_levels": ("O1", "O2"),
               "seed": 1, "inject_overflow": 5, "progress": False}
    sharded = demo.run_demo(out=tmp_path / "sharded", ranks=2, **options)
    assert "FSDP2 (fully_shard) on 2 CPU processes" in capsys.readouterr().out
    single = demo.run_demo(out=tmp_path / "single", master_modes=(), fp16_run=False, **options)
    assert len(sharded) == len(single) == 3
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
    watch = demo.watch_run(training.load_digits("cpu"), seed=0, device="cpu",
                           dtype=torch.bfloat16, steps=1)
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
    data = training.load_digits("cpu")
    first, second = (training.train_run("O2", "O2", data, steps=5, seed=3, device="cpu",
                                        dtype=training.DTYPES["bf16"], progress=False)
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
    # No --steps: the demo picks the length for the hardware, and the overflow goes in the
    # middle of each run.
    assert inspect.signature(demo.run_demo).parameters["steps"].default is None
    assert calls[2]["steps"] is None and calls[2]["inject_overflow"] == "middle"
    assert calls[0] == {"steps": 40, "device": "cpu", "dtype": None, "opt_levels": ("O1", "O2"),
                        "out": "demo_out", "seed": 0, "inject_overflow": "middle", "ranks": 1,
                        "watch": False}
    assert calls[3]["ranks"] == 4
    assert calls[4]["watch"] is True and calls[4]["steps"] == 5
    assert calls[1]["opt_levels"] == ("O2", "O1") and calls[1]["inject_overflow"] is None
    assert (calls[1]["dtype"], calls[1]["seed"], calls[1]["out"]) == ("fp16", 7, "elsewhere")


def test_master_free_runs_show_their_bytes_per_param(tmp_path, capsys):
    """One O2 run per master_weights value, for a quarter of the steps, each skipping the
    injected overflow: True (fp32 masters in the optimizer), the baseline at the same steps,
    then the master-free modes; the table's bytes per param fall with the extra state."""
    results = demo.run_demo(steps=8, device="cpu", dtype="bf16", opt_levels=("O2",),
                            out=tmp_path, seed=1, inject_overflow=6, progress=False,
                            fp16_run=False)
    names = [r["name"] for r in results]
    assert names == ["fp32", "O2 bf16", "O2 master=True", "O2 master=False",
                     "O2 master=stochastic", "O2 master=kahan", "O2 master=split",
                     "O2 master=True int8", "O2 master=True fp8", "O2 master=stochastic int8",
                     "O2 master=stochastic fp8"]
    assert demo.failures(results, inject_overflow=6) == []
    by_name = {r["name"]: r for r in results}
    assert all(by_name[n]["steps"] == 8 * demo.SHORT_RUNS and by_name[n]["skipped"] == 1
               for n in names[2:])
    per_param = {n: by_name[n]["bytes_per_param"] for n in names}
    # fp32 and O2 (fp32 masters): 16 bytes per param; bf16 weights without masters: 12, plus
    # 2 for kahan's compensation or split's low halves (BatchNorm stays fp32 at O2: a little
    # more, and the step counts a few bytes).
    assert 16 <= per_param["fp32"] < 16.1 and 16 <= per_param["O2 bf16"] < 16.1
    assert per_param["O2 master=True"] == per_param["O2 bf16"]
    assert per_param["O2 master=False"] == per_param["O2 master=stochastic"]
    assert per_param["O2 master=kahan"] == per_param["O2 master=split"]
    assert 12 < per_param["O2 master=False"] < 12.1
    assert 1.95 < per_param["O2 master=kahan"] - per_param["O2 master=False"] < 2.0
    # 8-bit moments: 2 bytes and a scale per 256 instead of 8 bytes, except in tensors under
    # one block (the CNN's biases and norms keep fp32 moments): close to 6 bytes fewer.
    for mode in ("True", "stochastic"):
        assert per_param[f"O2 master={mode} int8"] == per_param[f"O2 master={mode} fp8"]
        saved = per_param[f"O2 master={mode}"] - per_param[f"O2 master={mode} int8"]
        assert 5.8 < saved < 5.98, (mode, saved)
    out = capsys.readouterr().out
    assert "B/param" in out and "O2 master=...: bf16 weights and FusedAdamW's master_weights" in out
    assert "O2 master=... int8/fp8: the same with FusedAdamW(state_dtype=...)" in out


# ---- the hardware report (torch's queries mocked) and what it changes in the demo ----

_AVX2_ONLY = {"cpu_name": "AMD EPYC 7B12", "architecture": "x86_64", "avx2": True, "f16c": True,
              "avx512_f": False, "avx512_bf16": False, "amx_bf16": False, "avx512_fp16": False,
              "amx_fp16": False}
_SAPPHIRE_RAPIDS = dict(_AVX2_ONLY, cpu_name="Intel Xeon Platinum 8480+", avx512_f=True,
                        avx512_bf16=True, amx_bf16=True, avx512_fp16=True, amx_fp16=True)


def _mock_cpu(monkeypatch, flags, kernels, onednn_bf16, onednn_fp16=False):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: kernels)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: onednn_fp16)


@pytest.mark.parametrize("flags, kernels, onednn_bf16, onednn_fp16, native", [
    # AVX2 only (AMD Zen 2/3): oneDNN has no bf16 here; F16C converts only.
    (_AVX2_ONLY, "AVX2", False, False, set()),
    # AMX and AVX512-FP16: both native.
    (_SAPPHIRE_RAPIDS, "AVX512", True, True, {"bf16", "fp16"}),
    # The CPU has AVX512-BF16, but oneDNN is held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2): emulated.
    (dict(_AVX2_ONLY, avx512_f=True, avx512_bf16=True), "AVX2", False, False, set()),
    # AVX-512 without bf16 instructions (Skylake-X): oneDNN "supports" bf16 by converting.
    (dict(_AVX2_ONLY, avx512_f=True), "AVX512", True, False, set()),
    # AVX512-BF16 without fp16 arithmetic (AMD Zen 4).
    (dict(_AVX2_ONLY, avx512_f=True, avx512_bf16=True), "AVX512", True, False, {"bf16"}),
])
def test_cpu_hardware_report(monkeypatch, flags, kernels, onednn_bf16, onednn_fp16, native):
    _mock_cpu(monkeypatch, flags, kernels, onednn_bf16, onednn_fp16)
    found = hardware.detect("cpu")
    assert {name for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))
            if found.is_native(dtype)} == native
    line = found.describe()
    assert line.startswith(f"{flags['cpu_name']} (torch kernels {kernels}; oneDNN bf16 "
                           f"{'yes' if onednn_bf16 else 'no'}, ")
    assert ("bf16 native" if "bf16" in native else "bf16 emulated") in line
    assert ("fp16 native" if "fp16" in native else "fp16 emulated") in line
    note = found.emulation_note(torch.bfloat16, {torch.float16})
    if "bf16" not in native:
        assert note.startswith("Note: bf16 and fp16 are emulated on this CPU" if not native
                               else "Note: bf16 is emulated")
        assert "not speed" in note and "on a GPU, or on a CPU with AVX512-BF16 or AMX" in note
    elif "fp16" not in native:
        assert note.startswith("Note: fp16 is emulated on this CPU")
        assert "the O2 fp16 run shows the dynamic loss scale, not speed" in note
        # --dtype fp16 here: the note points at the dtype that is native.
        assert found.emulation_note(torch.float16).endswith(
            "AVX512-FP16 or AMX-FP16 (here bf16 is native: --dtype bf16).")
    else:
        assert note == ""


def test_cpu_without_onednn_reports_emulation(monkeypatch):
    _mock_cpu(monkeypatch, _SAPPHIRE_RAPIDS, "AVX512", True, True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert hardware.detect("cpu").native == frozenset()


@pytest.mark.parametrize("capability, native", [
    ((6, 1), set()), ((7, 5), {"fp16"}), ((8, 0), {"fp16", "bf16"}), ((9, 0), {"fp16", "bf16"})])
def test_cuda_hardware_report(monkeypatch, capability, native):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    found = hardware.detect("cuda:0")
    assert found.describe().startswith(
        f"NVIDIA Test GPU (compute capability {capability[0]}.{capability[1]}): ")
    assert {n for d, n in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))
            if found.is_native(d)} == native
    assert bool(found.emulation_note(torch.float16)) == ("fp16" not in native)


def _hardware(native):
    return hardware.Hardware("cpu", "test CPU", ("mocked",), frozenset(native))


def test_run_lengths_follow_the_hardware():
    """Where bf16 is emulated, the default run is shorter, fp32 included (like for like); the
    master_weights runs train a quarter of it, True (fp32 masters) beside the master-free ones;
    the CPU's fp16 run has its own length (fp16 may be emulated where bf16 is not) and a
    growth interval that lets its scale double a few times."""

    def plan(native, steps):
        runs, notes = demo.plan_runs(_hardware(native), torch.bfloat16, steps, ("O1", "O2"),
                                     inject=None, master_modes=demo.MASTER_MODES, fp16_run=True)
        return {run.name: run for run in runs}, notes

    emulated, _ = plan((), None)
    assert [run.steps for run in emulated.values()] == (
        [demo.EMULATED_STEPS] * 3 + [int(demo.EMULATED_STEPS * demo.SHORT_RUNS)] * 6)
    assert emulated["O2 master=True"].master_weights is True
    zen4, notes = plan({torch.bfloat16}, None)
    assert zen4["fp32"].steps == zen4["O2 bf16"].steps == demo.DEFAULT_STEPS
    assert zen4["O2 master=split"].steps == zen4["O2 master=True"].steps == 150
    fp16 = zen4["O2 fp16"]
    assert (fp16.dtype, fp16.steps) == (torch.float16, int(demo.EMULATED_STEPS * demo.SHORT_RUNS))
    assert fp16.growth_interval == fp16.steps // demo.FP16_GROWTHS
    assert f"doubled after {fp16.growth_interval} clean steps" in notes[-1]
    # --steps is the user's: no shortening anywhere.
    given, _ = plan((), 40)
    assert [run.steps for run in given.values()] == [40] * 3 + [10] * 6
    assert demo.steps_note(_hardware(()), torch.bfloat16, None)
    assert not demo.steps_note(_hardware(()), torch.bfloat16, 40)
    assert not demo.steps_note(_hardware({torch.bfloat16}), torch.bfloat16, None)
    with pytest.raises(demo.DemoUsageError, match="past the last step"):
        demo.plan_runs(_hardware(()), torch.bfloat16, None, ("O2",), demo.EMULATED_STEPS, (),
                       False)


def test_emulated_bf16_is_said_above_the_table(monkeypatch, tmp_path, capsys):
    """On an AVX2-only CPU (mocked) the note and the shortened length come before the table,
    which gives each run's steps and speed relative to fp32."""
    monkeypatch.setattr(demo.hw, "detect", lambda device: _hardware(()))
    monkeypatch.setattr(demo, "EMULATED_STEPS", 8)
    results = demo.run_demo(device="cpu", opt_levels=("O2",), out=tmp_path, progress=False,
                            master_modes=(), fp16_run=False)
    assert [r["steps"] for r in results] == [8, 8]
    out = capsys.readouterr().out
    assert out.split("\nrun ")[1].split()[:7] == ["steps", "test", "acc", "%", "train", "loss",
                                                  "ms/step"]
    flat = " ".join(out.split())  # the note is wrapped
    note = flat.index("Note: bf16 is emulated on this CPU")
    assert note < flat.index("runs train 8 steps instead of 600") < flat.index(" run steps ")
    assert "not speed" in flat and " vs fp32 " in flat


def test_fp16_run_shows_the_dynamic_scale():
    """The CPU's fp16 O2 run: its loss scale doubles after each growth interval of clean steps
    and halves at the injected overflow, which it skips."""
    result = training.train_run("O2 fp16", "O2", training.load_digits("cpu"), steps=16, seed=0,
                                device="cpu", dtype=torch.float16, inject_overflow=10,
                                progress=False, growth_interval=2)
    scales = result["loss_scales"]
    assert scales[11] == scales[10] / 2  # the back-off after the injected inf
    assert any(b == 2 * a for a, b in itertools.pairwise(scales))  # growth
    assert result["skipped"] >= 1 and "0.weight" in result["overflow"].param_names


def test_the_cli_states_the_demos_defaults():
    assert (cli._DEMO_STEPS, cli._DEMO_EMULATED_STEPS) == (demo.DEFAULT_STEPS,
                                                           demo.EMULATED_STEPS)

"""`python -m ampfuse doctor`: passes on a working install, and on a broken one says what is wrong
and how to fix it, with a non-zero exit status.

The broken states are faked by handing the doctor's checks a fake environment: a kernel
registry without CUDA kernels on a machine with a GPU, a native library that does not import,
an op that computes the wrong thing or raises."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import ampfuse
from ampfuse import ops
from ampfuse.ops._archs import CudaCode
from ampfuse.tools.doctor import report as doctor
from helpers import AMPFUSE_PATH

ROOT = Path(__file__).resolve().parents[2]
OPS = list(ops.OP_NAMES)
FAKE_GPU = doctor.Gpu(index=0, name="NVIDIA Fake H100", capability=(9, 0),
                      memory_bytes=80 * 2**30, bf16=True)


def test_doctor_passes_here():
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH)
    result = subprocess.run([sys.executable, "-m", "ampfuse", "doctor"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert torch.__version__ in out
    for op in OPS:
        assert f"{op}:" in out and "cpu ok" in out.split(f"{op}:")[1].splitlines()[0], out
    lines = out.strip().splitlines()
    assert lines[-1] == "ok", out
    assert "problem" not in out


def test_every_op_has_a_smoke_test():
    assert set(doctor.SMOKE_TESTS) == set(OPS)


def test_gpu_without_cuda_kernels_is_a_problem_with_the_fix(monkeypatch, capsys):
    # The registry answers "no CUDA kernel" for every op while torch pretends to see a GPU.
    real = doctor._has_kernel
    monkeypatch.setattr(doctor, "_has_kernel", lambda op, key: key != "CUDA" and real(op, key))
    monkeypatch.setattr(doctor, "probe_gpus", lambda: ([FAKE_GPU], None))

    status = doctor.run()

    out = capsys.readouterr().out
    assert status == 1, out
    assert out.strip().splitlines()[-1] == "problems found (1)", out
    assert "NVIDIA Fake H100" in out and "compute capability 9.0" in out
    assert "built without CUDA kernels" in out
    assert f"install the CUDA toolkit matching torch.version.cuda ({torch.version.cuda})" in out
    assert "pip install --no-build-isolation" in out
    # With no CUDA kernels the ops are checked on the CPU only.
    assert "cuda ok" not in out and "cuda FAILED" not in out


def test_no_gpu_and_no_cuda_kernels_is_fine():
    report = doctor.Report()
    usable = doctor.check_kernels(report, OPS, gpus=[], has_kernel=lambda op, key: key == "CPU")
    assert usable is False
    assert report.exit_code == 0
    assert "CPU-only build" in report.render()


def test_missing_cpu_kernel_is_a_problem():
    report = doctor.Report()
    doctor.check_kernels(report, OPS, gpus=[],
                         has_kernel=lambda op, key: key == "CPU" and op != "fused_sgd_")
    assert report.exit_code == 1
    text = report.render()
    assert "no CPU kernel registered for fused_sgd_" in text
    assert "pip install --no-build-isolation" in text


def test_native_library_that_fails_to_import_gives_the_rebuild_command():
    def broken_import(name):
        raise ImportError(f"{name}: undefined symbol: _ZN3c104cuda9SetDeviceEa")

    report = doctor.Report()
    ops, code = doctor.check_native(report, import_module=broken_import)
    assert ops is None and not code
    assert report.exit_code == 1
    text = report.render()
    assert "undefined symbol" in text
    assert "pip install --no-build-isolation" in text
    assert text.splitlines()[-1] == "problems found (1)"


def _ops_with(**replacements):
    """The real op wrappers, with some replaced."""
    fake = types.SimpleNamespace(**{name: getattr(ops, name) for name in OPS})
    for name, fn in replacements.items():
        setattr(fake, name, fn)
    return fake


def test_wrong_result_is_reported_as_a_bug():
    def unscale_that_forgets_bf16(grads, found_inf, inv_scale, tensor_flags=None):
        ops.multi_tensor_unscale_([g for g in grads if g.dtype != torch.bfloat16], found_inf,
                                   inv_scale)

    def adam_that_ignores_grad_scale(*args, grad_scale=None, **kwargs):
        ops.fused_adam_(*args, **kwargs)

    fake = _ops_with(multi_tensor_unscale_=unscale_that_forgets_bf16,
                     fused_adam_=adam_that_ignores_grad_scale)
    report = doctor.Report()
    doctor.check_ops(report, fake, OPS, ["cpu"])
    text = report.render()
    assert report.exit_code == 1
    assert "multi_tensor_unscale_ on cpu gives a wrong result: grads[1] (torch.bfloat16)" in text
    assert "fused_adam_ on cpu gives a wrong result" in text
    assert "report it" in text
    assert text.splitlines()[-1] == "problems found (2)"
    for op in ("multi_tensor_scale_", "multi_tensor_l2norm", "update_scale_", "fused_sgd_"):
        assert f"{op}:" in text and "cpu ok" in text.split(f"{op}:")[1].splitlines()[0]


def test_step_that_ignores_found_inf_is_caught():
    def sgd_without_skip(*args, found_inf=None, **kwargs):
        ops.fused_sgd_(*args, **kwargs)

    ok, problem, _ = doctor.smoke_test(_ops_with(fused_sgd_=sgd_without_skip), "fused_sgd_", "cpu")
    assert not ok
    assert "found_inf set changed" in problem


def test_op_that_raises_is_reported():
    def raising(*args, **kwargs):
        raise RuntimeError("ampfuse.multi_tensor_l2norm: something broke\nsecond line")

    ok, problem, fix = doctor.smoke_test(_ops_with(multi_tensor_l2norm=raising),
                                         "multi_tensor_l2norm", "cpu")
    assert not ok
    assert problem == ("multi_tensor_l2norm on cpu raised RuntimeError: "
                       "ampfuse.multi_tensor_l2norm: something broke")
    assert "report it" in fix


def test_gpu_lines_show_capability_and_tensor_core_support():
    old = doctor.Gpu(0, "Tesla P100", (6, 0), 16 * 2**30, bf16=False)
    report = doctor.Report()
    doctor.check_gpus(report, [old], code=CudaCode(sass=(80, 90), ptx=(90,)))
    text = report.render()
    assert "Tesla P100, compute capability 6.0" in text
    assert "fp16 no (compute capability < 7.0); bf16 no (use dtype=torch.float16)" in text
    assert "no code that runs on sm_60" in text
    assert report.exit_code == 0  # an old GPU is information, not a broken install


def test_native_line_names_the_built_code_and_the_step_scanner():
    report = doctor.Report()
    ops_module, code = doctor.check_native(report)
    assert ops_module is not None
    text = report.render()
    assert "step scanner:" in text
    assert ("code for " + code.describe()) in text if code else "CPU-only build" in text


@pytest.mark.cuda
def test_doctor_checks_the_ops_on_the_gpu(capsys):
    assert ampfuse.cuda_available(), ampfuse.cuda_status()
    assert doctor.run() == 0
    out = capsys.readouterr().out
    for op in OPS:
        assert "cuda ok" in out.split(f"{op}:")[1].splitlines()[0], out

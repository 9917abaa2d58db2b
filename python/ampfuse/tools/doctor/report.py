"""`python -m ampfuse doctor`: says whether ampfuse works in this environment and, when it does
not, what to run to fix it.

It reports the Python, torch and CUDA versions, the nvcc release and GPU architectures (machine
code and PTX) the op library was compiled with, whether the C++ step scanner is in use, which
backends have kernels for every op, the CPU and GPUs (and whether the library has code for
each) and their fp16/bf16 support, and then calls every op once on tiny tensors (on the CPU, and
on the GPU when there is one), comparing each result with the same computation done by torch. Exit
status 0 means every check passed; 1 means at least one problem, each listed with its fix.

Each check is a function that takes what it inspects as arguments (the ops module, the GPUs
found, the kernel-registry query), so the tests can hand it a broken environment.
"""

from __future__ import annotations

import dataclasses
import importlib
import platform
import sys
import warnings
from pathlib import Path

import torch

from ampfuse.ops._archs import CudaCode, rebuild_hint, runs_on
from ampfuse.tools.doctor.smoke_adagrad import SMOKE_TESTS as ADAGRAD_SMOKE_TESTS
from ampfuse.tools.doctor.smoke_adam_coded import SMOKE_TESTS as ADAM_CODED_SMOKE_TESTS
from ampfuse.tools.doctor.smoke_fp8 import SMOKE_TESTS as FP8_SMOKE_TESTS
from ampfuse.tools.doctor.smoke_lamb import SMOKE_TESTS as LAMB_SMOKE_TESTS
from ampfuse.tools.doctor.smoke_lamb_coded import SMOKE_TESTS as LAMB_CODED_SMOKE_TESTS
from ampfuse.tools.doctor.smoke_novograd import SMOKE_TESTS as NOVOGRAD_SMOKE_TESTS
from ampfuse.tools.doctor.smoke_core import SMOKE_TESTS as CORE_SMOKE_TESTS

# The installed package (ampfuse/), two folders above this file.
_PACKAGE_DIR = Path(__file__).resolve().parents[2]


# ---- the report ------------------------------------------------------------------------------


@dataclasses.dataclass
class Finding:
    """One "name: value" line; a finding with a problem also carries its fix."""

    name: str
    value: str
    problem: str | None = None
    fix: str | None = None


@dataclasses.dataclass
class Report:
    findings: list = dataclasses.field(default_factory=list)

    def add(self, name, value, problem=None, fix=None):
        self.findings.append(Finding(name, value, problem, fix))

    @property
    def problems(self):
        return [f for f in self.findings if f.problem]

    @property
    def exit_code(self):
        return 1 if self.problems else 0

    def render(self):
        width = max((len(f.name) for f in self.findings), default=0) + 2
        lines = ["ampfuse doctor"]
        for f in self.findings:
            mark = "  <- problem" if f.problem else ""
            lines.append(f"  {f.name + ':':<{width}}{f.value}{mark}")
        problems = self.problems
        if problems:
            lines.append("")
            for number, f in enumerate(problems, 1):
                lines.append(f"problem {number}: {f.problem}")
                lines.append(f"  fix: {f.fix}")
            lines.append(f"problems found ({len(problems)})")
        else:
            lines.append("ok")
        return "\n".join(lines)


# ---- environment queries (the tests replace these to fake a broken machine) -------------------


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple
    memory_bytes: int
    bf16: bool


def probe_gpus():
    """(GPUs torch can use, why there are none or None). Never raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = torch.cuda.is_available()
        except Exception as error:  # a broken driver can raise instead of returning False
            return [], f"torch.cuda.is_available() raised {type(error).__name__}: {error}"
    if not available:
        why = "; ".join(str(w.message).strip().splitlines()[0] for w in caught)
        return [], why or "torch.cuda.is_available() is False"
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        with torch.cuda.device(index):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        gpus.append(Gpu(index, props.name, (props.major, props.minor), props.total_memory, bf16))
    return gpus, None


def _has_kernel(op, dispatch_key):
    """Whether ampfuse::op has a kernel registered for dispatch_key ("CPU" or "CUDA")."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"ampfuse::{op}", dispatch_key)
    except RuntimeError:  # the op itself is not defined
        return False


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def rebuild_command():
    """The command that rebuilds ampfuse._C against the torch of this interpreter."""
    root = _PACKAGE_DIR.parent.parent
    if (root / "setup.py").is_file() and (root / "CMakeLists.txt").is_file():
        # A source checkout: rebuild in place, where this package is imported from.
        return f"cd {root} && {sys.executable} -m pip install --no-build-isolation -e ."
    return "pip install --no-build-isolation .  (in the ampfuse source folder, with this Python)"


# ---- checks ----------------------------------------------------------------------------------


def check_versions(report):
    report.add("python", f"{platform.python_version()} ({sys.executable})")
    cuda = torch.version.cuda
    report.add("torch", f"{torch.__version__} (" + (f"CUDA {cuda})" if cuda else "no CUDA)"))


def check_native(report, import_module=importlib.import_module):
    """Loads ampfuse's op library and the op wrappers. Returns (the ampfuse.ops module, the GPU
    code the library holds), or (None, an empty CudaCode) when it cannot be loaded."""
    try:
        ops = import_module("ampfuse.ops")
    except ImportError as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        report.add(
            "native library", "not loaded",
            problem=f"ampfuse's op library could not be loaded: {message}",
            fix="rebuild it against the installed torch (needed after every torch upgrade), or "
            "install the ampfuse wheel built for this torch: " + rebuild_command(),
        )
        return None, CudaCode()
    from ampfuse import __version__
    from ampfuse.ops import _library, step_scan

    path = _library.LIBRARY_PATH
    report.add("ampfuse", f"{__version__} ({_PACKAGE_DIR})")
    report.add("native library", f"loaded ({path.name}, built for torch "
                                 f"{_library.BUILD_INFO.get('torch', '?')})")
    report.add("step scanner", "C++ (ampfuse.ops._step_scan)" if step_scan.NATIVE else
               "Python (no _step_scan extension for this Python: a wheel install; same results)")
    code = _library.cuda_code()
    if code.nvcc is None and not code:
        report.add("built with nvcc", "no (CPU-only build)")
    else:
        value = f"{code.nvcc or 'unknown release'}, code for {code.describe()}"
        torch_cuda = torch.version.cuda
        if torch_cuda and code.nvcc and code.nvcc.split(".")[0] != torch_cuda.split(".")[0]:
            report.add(
                "built with nvcc", value,
                problem=f"ampfuse was compiled with CUDA {code.nvcc} but torch uses CUDA "
                f"{torch_cuda}; the major versions must match",
                fix=f"install the CUDA toolkit {torch_cuda} and rebuild: {rebuild_command()}",
            )
        else:
            report.add("built with nvcc", value)
    return ops, code


def check_kernels(report, op_names, gpus, has_kernel=None):
    """Which backends have a kernel for every op. Returns whether the CUDA kernels are usable
    (all registered and a GPU present)."""
    has_kernel = has_kernel or _has_kernel
    n = len(op_names)
    cpu = [op for op in op_names if has_kernel(op, "CPU")]
    cuda = [op for op in op_names if has_kernel(op, "CUDA")]
    missing_cpu = sorted(set(op_names) - set(cpu))
    if missing_cpu:
        report.add(
            "CPU kernels", f"{len(cpu)}/{n} ops",
            problem=f"no CPU kernel registered for {', '.join(missing_cpu)}: the native library "
            "is incomplete or older than the Python package",
            fix=f"rebuild: {rebuild_command()}",
        )
    else:
        report.add("CPU kernels", f"{n}/{n} ops")

    torch_cuda = torch.version.cuda
    if not cuda:
        if gpus:
            report.add(
                "CUDA kernels", "none (built without CUDA)",
                problem=f"torch sees {len(gpus)} CUDA device(s) ({gpus[0].name}) but ampfuse was "
                "built without CUDA kernels (no nvcc was found when it was built)",
                fix=f"install the CUDA toolkit matching torch.version.cuda ({torch_cuda}), with "
                f"nvcc on PATH or in /usr/local/cuda, then rebuild: {rebuild_command()}",
            )
        else:
            report.add("CUDA kernels", "none (CPU-only build; fine without a GPU)")
        return False
    if len(cuda) < n:
        report.add(
            "CUDA kernels", f"{len(cuda)}/{n} ops",
            problem="CUDA kernels are missing for "
            f"{', '.join(sorted(set(op_names) - set(cuda)))}: the build is incomplete",
            fix=f"rebuild: {rebuild_command()}",
        )
        return False
    report.add("CUDA kernels", f"{n}/{n} ops" + ("" if gpus else " (no GPU here to run them)"))
    return bool(gpus)


def check_cpu(report):
    capability = torch.backends.cpu.get_cpu_capability()
    report.add("CPU", f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                      f"{capability} kernels in torch")
    flags = _cpu_flags()
    if flags is not None:
        native = sorted(flags & {"avx512_bf16", "amx_bf16", "sve_bf16", "bf16"})
    else:
        try:
            native = ["oneDNN"] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else []
        except (AttributeError, RuntimeError):
            native = []
    if native:
        report.add("CPU bf16", f"native ({', '.join(native)})")
    else:
        report.add("CPU bf16", "works, converted to fp32 in software (no bf16 instructions)")


def check_gpus(report, gpus, why_none=None, code=CudaCode()):
    if not gpus:
        report.add("GPU", "none" + (f" ({why_none})" if why_none else ""))
        return
    for gpu in gpus:
        major, minor = gpu.capability
        label = "GPU" if len(gpus) == 1 else f"GPU {gpu.index}"
        note = ""
        if code and not runs_on(code, gpu.capability):
            note = (f"; ampfuse has no code that runs on sm_{major}{minor} (the op check below "
                    "decides)")
        report.add(label, f"{gpu.name}, compute capability {major}.{minor}, "
                          f"{gpu.memory_bytes / 2**30:.0f} GiB{note}")
        fp16 = "yes" if (major, minor) >= (7, 0) else "no (compute capability < 7.0)"
        bf16 = "yes" if gpu.bf16 and major >= 8 else "no (use dtype=torch.float16)"
        report.add(f"{label} tensor cores", f"fp16 {fp16}; bf16 {bf16}")


# ---- op smoke tests (each op's own module: smoke_core for the scaler ops, Adam and SGD) ----

SMOKE_TESTS = {
    **CORE_SMOKE_TESTS,
    **ADAGRAD_SMOKE_TESTS,
    **ADAM_CODED_SMOKE_TESTS,
    **LAMB_SMOKE_TESTS,
    **LAMB_CODED_SMOKE_TESTS,
    **NOVOGRAD_SMOKE_TESTS,
    **FP8_SMOKE_TESTS,
}


def smoke_test(ops, op, device):
    """(ok, problem, fix) for one call of `op` on `device`."""
    test = SMOKE_TESTS.get(op)
    if test is None:
        return False, f"doctor has no smoke test for {op}", "report a bug: doctor.SMOKE_TESTS " \
                                                          "is missing an op"
    try:
        wrong = test(ops, device)
    except Exception as error:  # any failure of the op is the finding
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        problem = f"{op} on {device} raised {type(error).__name__}: {message}"
        if "no kernel image" in message or "has no GPU code" in message:
            return False, problem, (
                "ampfuse has no GPU code for this device: rebuild for it with "
                f"{rebuild_hint(torch.cuda.get_device_capability())}")
        return False, problem, _bug_fix()
    if wrong:
        return False, f"{op} on {device} gives a wrong result: {wrong}", _bug_fix()
    return True, None, None


def _bug_fix():
    return ("this is a bug in ampfuse (or a miscompiled build): try a clean rebuild (rm -rf build; "
            f"{rebuild_command()}); if it persists, report it with this output")


def check_ops(report, ops, op_names, devices):
    """Runs every op's smoke test on each device and adds one line per op."""
    report.add("op checks", "each op called on tiny fp32/bf16/fp16 tensors, compared with torch")
    for op in op_names:
        cells, problems = [], []
        for device in devices:
            ok, problem, fix = smoke_test(ops, op, device)
            cells.append(f"{device} {'ok' if ok else 'FAILED'}")
            if not ok:
                problems.append((problem, fix))
        if problems:
            report.add(op, ", ".join(cells), problem="; ".join(p for p, _ in problems),
                       fix=problems[0][1])
        else:
            report.add(op, ", ".join(cells))


# ---- entry point -----------------------------------------------------------------------------


def run(import_module=importlib.import_module):
    """Runs every check, prints the report and returns the exit status."""
    report = Report()
    check_versions(report)
    ops, code = check_native(report, import_module)
    gpus, why_none = probe_gpus()
    if ops is not None:
        cuda_usable = check_kernels(report, list(ops.OP_NAMES), gpus)
    check_cpu(report)
    check_gpus(report, gpus, why_none, code)
    if ops is not None:
        devices = ["cpu"] + (["cuda"] if cuda_usable else [])
        check_ops(report, ops, list(ops.OP_NAMES), devices)
    print(report.render())
    sys.stdout.flush()
    return report.exit_code


if __name__ == "__main__":
    sys.exit(run())

"""Builds ampfuse's native parts by driving CMake (CMakeLists.txt is the one description of the
native build), against the torch already installed in the environment: build with
`pip install --no-build-isolation ...`.

Two kinds of build:
  wheel     (`make wheel`, `pip wheel`, `pip install .`): the op library libampfuse_ops.so, which
            uses no Python API, for every GPU architecture torch's wheels cover. The wheel is
            tagged py3-none-<platform>, so one file serves every Python that torch supports.
  editable  (`make build`, `pip install -e .`): the same plus ampfuse.ops._step_scan, a CPython
            extension for this Python that makes a fused step's host-side checks faster. When
            torch sees a GPU, only that GPU's architecture is built, which is much quicker.

Build knobs, both standard in the torch extension world:
  TORCH_CUDA_ARCH_LIST  CUDA architectures, e.g. "8.0;9.0+PTX" (default: see CMakeLists.txt)
  MAX_JOBS              parallel compile jobs (default: 2)
"""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools 70.1+ carries bdist_wheel; older ones take it from the wheel package
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

try:
    import torch
except ImportError:
    raise SystemExit("ampfuse is compiled against the torch installed in this environment: "
                     "install torch 2.11 first (pip install 'torch==2.11.*'), then build with "
                     "`pip install --no-build-isolation .` (pip's default isolated build "
                     "environment has no torch).") from None

ROOT = Path(__file__).resolve().parent
BASE_VERSION = "0.2.0"


def local_version():
    """The torch and CUDA the native library is compiled against, as a version's local part:
    "pt211cu130" for torch 2.11 with CUDA 13.0, "pt211cpu" without CUDA."""
    major, minor = torch.__version__.split(".")[:2]
    cuda = torch.version.cuda
    return f"pt{major}{minor}" + (f"cu{cuda.replace('.', '')}" if cuda else "cpu")


def source_digest():
    """The sources' digest (cmake/source_digest.py), recorded in build_info.json: a carried wheel
    then says which sources it was built from (benchmarks/gpu_check.sh checks it)."""
    return runpy.run_path(str(ROOT / "cmake" / "source_digest.py"))["source_digest"](ROOT)


def cuda_architectures(arch_list):
    """Maps TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX") to CMake's form ("80-real;90"): machine code
    for each entry, and PTX too for those marked +PTX."""
    archs = []
    for entry in re.split(r"[;\s]+", arch_list.strip()):
        if not entry:
            continue
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", entry)
        if match is None:
            raise SystemExit(f"ampfuse: TORCH_CUDA_ARCH_LIST entry {entry!r} is not a compute "
                             'capability such as "8.0" or "9.0+PTX".')
        major, minor, suffix, ptx = match.groups()
        archs.append(f"{major}{minor}{suffix}" + ("" if ptx else "-real"))
    return ";".join(archs)


def local_gpu_architectures():
    """The architectures of the GPUs torch sees here ("86-real"), or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    found = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}{minor}-real" for major, minor in found)


class CMakeBuild(build_ext):
    def run(self):
        # An editable install builds in place (setuptools sets inplace for it) and for this
        # Python only; a wheel carries nothing tied to one Python.
        editable = bool(self.inplace)
        if editable:
            output_dir = ROOT / "python" / "ampfuse" / "ops"
        else:
            output_dir = Path(self.build_lib).resolve() / "ampfuse" / "ops"
        output_dir.mkdir(parents=True, exist_ok=True)
        # One build folder per kind and interpreter keeps rebuilds incremental.
        kind = f"editable-py{sys.version_info.major}{sys.version_info.minor}" if editable \
            else "wheel"
        build_dir = ROOT / "build" / kind
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DAMPFUSE_OUTPUT_DIR={output_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DAMPFUSE_BUILD_STEP_SCAN={'ON' if editable else 'OFF'}",
            f"-DAMPFUSE_VERSION={self.distribution.get_version()}",
            f"-DAMPFUSE_SOURCE_DIGEST={source_digest()}",
        ]
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if arch_list:
            archs, why = cuda_architectures(arch_list), "from TORCH_CUDA_ARCH_LIST"
        elif editable and local_gpu_architectures():
            archs, why = local_gpu_architectures(), "the GPUs torch sees here"
        else:
            archs, why = None, None
        if archs:
            configure.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
            print(f"ampfuse: CUDA architectures {archs} ({why})", flush=True)
        else:
            # A cached configure keeps what it had; say the default again explicitly.
            configure.append("-UCMAKE_CUDA_ARCHITECTURES")
        subprocess.run(configure, check=True)
        targets = ["ampfuse_ops"] + (["_step_scan"] if editable else [])
        jobs = os.environ.get("MAX_JOBS", "2")
        subprocess.run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", jobs],
                       check=True)


class PortableWheel(bdist_wheel):
    """Tags the wheel py3-none-<platform>: it holds Python code and a shared library that uses no
    Python API, so it installs into any Python on this platform."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    version=f"{BASE_VERSION}+{local_version()}",
    install_requires=[f"torch=={'.'.join(torch.__version__.split('.')[:2])}.*"],
    # The one entry marks the distribution as platform-specific; CMakeBuild builds what it needs.
    ext_modules=[Extension("ampfuse.ops._step_scan", sources=[])],
    cmdclass={"build_ext": CMakeBuild, "bdist_wheel": PortableWheel},
)

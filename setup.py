"""Builds ampfuse._C by driving CMake (CMakeLists.txt is the one description of
the native build). Use `pip install --no-build-isolation .` (or `-e .`) so the
extension is compiled against the torch already installed in the environment.

Build knobs, both standard in the torch extension world:
  TORCH_CUDA_ARCH_LIST  CUDA architectures, e.g. "8.0;9.0" (default: sm_80 and sm_90)
  MAX_JOBS              parallel compile jobs (default: 2)
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cuda_architectures():
    """Maps TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX") to CMake's form ("80;90")."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch_list:
        return None
    archs = []
    for arch in arch_list.replace(" ", ";").split(";"):
        if arch:
            archs.append(arch.replace("+PTX", "").replace(".", ""))
    return ";".join(archs)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        output_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        # A fixed build folder per interpreter keeps rebuilds incremental.
        build_dir = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DAMPFUSE_OUTPUT_DIR={output_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        archs = cuda_architectures()
        if archs:
            configure.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
        subprocess.run(configure, check=True)
        jobs = os.environ.get("MAX_JOBS", "2")
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs],
                       check=True)


setup(
    ext_modules=[Extension("ampfuse._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)

"""The CUDA kernels round as the CPU kernels do: nvcc contracts no a * b + c of ours into an FMA.

The CPU library is built with -ffp-contract=off, and the CUDA kernels promise the same numbers
bit for bit (issue 10, item 1): every product that feeds a sum goes through mul() (__fmul_rn /
__dmul_rn), which nvcc never fuses. nvcc contracts by default, so one plain `a * b + c` in an
element-wise formula would make CUDA differ from the CPU by an ulp now and then, which only a
GPU run with the unlucky values would show (Adagrad's `1 + t * lr_decay` did, in a helper's
test). This check needs no GPU: it compiles every kernel file to PTX twice, as the build does
and with --fmad=false, and requires the same FMAs per function both ways. An FMA that is meant
(the sums of squares of the norms, written as __fmaf_rn) survives --fmad=false; a contracted
one does not.

The one exception is CUDA's own pow (libdevice's __internal_accurate_pow), which the bias
corrections call in double: its internals contract, and its error bound is CUDA's to keep.
"""

import concurrent.futures
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "csrc" / "kernels"
# Functions whose contractions are not ours (see the module docstring).
NOT_OURS = {"__internal_accurate_pow"}
FUNCTION = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.(?:entry|func)\s+(?:\([^)]*\)\s*)?"
                      r"([\w$]+)")


def _nvcc():
    for candidate in (shutil.which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit), not a GPU")


def _ptx(source, fmad, out_dir):
    """PTX for sm_90 with the build's flags (CMakeLists.txt), FMA contraction on or off."""
    out = out_dir / f"{source.stem}.{'on' if fmad else 'off'}.ptx"
    cuda_home = Path(NVCC).resolve().parent.parent
    command = [NVCC, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-arch=sm_90",
               f"--fmad={'true' if fmad else 'false'}", f"-I{KERNELS}",
               "-isystem", str(cuda_home / "targets" / "x86_64-linux" / "include" / "cccl"),
               "-ptx", str(source), "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    return out.read_text()


def fma_counts(ptx):
    """{function name: number of fma.rn instructions in its body}."""
    counts = {}
    name = None
    for line in ptx.splitlines():
        match = FUNCTION.match(line)
        if match:
            name = match.group(1)
            counts.setdefault(name, 0)
        elif name is not None and "fma.rn" in line:
            counts[name] += 1
    return counts


def test_the_parser_sees_fmas_and_the_functions_they_are_in():
    ptx = """
.visible .entry kernel_a(
\t.param .u64 p
)
{
\tfma.rn.f32 \t%f3, %f1, %f2, %f0;
}
.func  (.param .b64 func_retval0) __internal_accurate_pow(
\t.param .b64 x
)
{
\tfma.rn.f64 \t%fd3, %fd1, %fd2, %fd0;
\tfma.rn.f64 \t%fd4, %fd1, %fd2, %fd3;
}
"""
    assert fma_counts(ptx) == {"kernel_a": 1, "__internal_accurate_pow": 2}


def test_no_kernel_of_ours_has_a_contracted_fma(tmp_path):
    sources = sorted(KERNELS.glob("*.cu"))
    assert len(sources) >= 10, f"only {len(sources)} .cu files under {KERNELS}"
    jobs = [(source, fmad) for source in sources for fmad in (True, False)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        ptx = dict(zip(jobs, pool.map(lambda job: _ptx(*job, tmp_path), jobs)))
    contracted = []
    for source in sources:
        with_fmad = fma_counts(ptx[(source, True)])
        without = fma_counts(ptx[(source, False)])
        assert with_fmad.keys() == without.keys(), f"{source.name}: different functions"
        for name, count in with_fmad.items():
            if count != without[name] and name not in NOT_OURS:
                contracted.append(f"{source.name}: {name}: {count - without[name]} FMA(s) "
                                  "that --fmad=false removes")
    assert not contracted, (
        "nvcc fused a * b + c in these functions, so CUDA rounds differently from the CPU. "
        "Write the product with mul() (optimizer_math.h), or __fmaf_rn where an FMA is "
        "meant:\n" + "\n".join(contracted))

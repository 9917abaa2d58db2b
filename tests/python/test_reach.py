"""Which GPUs and torch versions a build serves (issue 32): the device-code reader, the decision
whether a device can run it, with capabilities faked (no GPU needed), the message a device
without code gets, and the torch-version check made before the op library is loaded."""

import struct

import pytest
import torch

import ampfuse
from ampfuse.ops import _archs, _library
from ampfuse.ops._archs import CudaCode

# The default build (CMakeLists.txt): machine code for Turing to Blackwell, PTX for the newest.
DEFAULT = CudaCode(sass=(75, 80, 86, 89, 90, 100, 120), ptx=(120,))


def _fatbin(entries):
    """A fat binary as nvcc lays it out: (kind, arch) entries, 1 = PTX, 2 = ELF."""
    body = b""
    for kind, arch in entries:
        payload = b"\x7fELF" if kind == 2 else b".version 9.0"
        header = struct.pack("<HHIQIIHHI", kind, 0x101, 64, len(payload), 0, 0, 0, 0, arch)
        header += b"\0" * (64 - len(header))
        body += header + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_reads_machine_code_and_ptx_from_fat_binaries(tmp_path):
    library = tmp_path / "libampfuse_ops.so"
    library.write_bytes(b"\0ELF junk\xba\x55\xed\x50 not a header" + _fatbin([(1, 120), (2, 120)])
                        + b"\0Cuda compilation tools, release 13.0, V13.0.88\0"
                        + _fatbin([(2, 75), (2, 90)]) + _fatbin([(2, 120)]))
    code = _archs.read_cuda_code(library)
    assert code == CudaCode(sass=(75, 90, 120), ptx=(120,), nvcc="13.0.88")
    assert code.describe() == "sm_75, sm_90, sm_120 + PTX compute_120"


def test_a_cpu_only_library_has_no_cuda_code(tmp_path):
    plain = tmp_path / "cpu_only.so"
    plain.write_bytes(b"\0no cuda here\0")
    assert not _archs.read_cuda_code(plain)
    assert not _archs.read_cuda_code(tmp_path / "missing.so")


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0),
                                        (10, 0), (10, 3), (12, 0), (12, 1)])
def test_every_gpu_torch_211_supports_runs_the_default_build(capability):
    assert _archs.runs_on(DEFAULT, capability)


@pytest.mark.parametrize("capability", [(13, 0), (15, 2)])
def test_a_gpu_newer_than_the_build_runs_its_ptx(capability):
    assert _archs.runs_on(DEFAULT, capability)
    assert not _archs.runs_on(CudaCode(sass=DEFAULT.sass), capability)


@pytest.mark.parametrize("capability", [(6, 1), (7, 0), (11, 0)])
def test_gpus_the_default_build_does_not_cover(capability):
    # Pascal and Volta (CUDA 13 dropped them), and sm_110 (machine code for 10.x and 12.x does
    # not run on 11.x, and compute_120 PTX is newer than it).
    assert not _archs.runs_on(DEFAULT, capability)


def test_machine_code_runs_on_its_major_version_at_the_same_or_a_higher_minor():
    old_build = CudaCode(sass=(80, 90))
    assert _archs.runs_on(old_build, (8, 6)) and _archs.runs_on(old_build, (9, 0))
    # Issue 32's cases: Blackwell and Turing had nothing to run.
    for capability in [(10, 0), (12, 0), (7, 5)]:
        assert not _archs.runs_on(old_build, capability)
    assert not _archs.runs_on(CudaCode(sass=(86,)), (8, 0))


def test_a_device_without_code_is_told_what_to_run():
    message = _archs.no_code_message("CUDA device 0", "NVIDIA GeForce RTX 5090", (12, 0),
                                     CudaCode(sass=(80, 90), ptx=(90,)))
    assert "CUDA device 0 (NVIDIA GeForce RTX 5090, compute capability 12.0, sm_120)" in message
    assert "sm_80, sm_90 + PTX compute_90" in message
    assert 'TORCH_CUDA_ARCH_LIST="12.0" pip install --no-build-isolation .' in message


def test_cuda_status_names_uncovered_devices_and_the_built_code():
    if not _library._has_cuda_kernels():
        pytest.skip("a CPU-only build says so before looking at devices")
    t4 = ("CUDA device 0", "Tesla T4", (7, 5))
    status = _library.cuda_status(devices=[t4], code=CudaCode(sass=(80, 90)))
    assert "no GPU code for CUDA device 0 (Tesla T4, compute capability 7.5" in status
    assert 'TORCH_CUDA_ARCH_LIST="7.5"' in status
    covered = _library.cuda_status(devices=[t4], code=DEFAULT)
    assert "run on this machine's 1 device(s): Tesla T4 (sm_75)" in covered
    assert DEFAULT.describe() in covered


def test_the_built_library_holds_the_code_cmake_was_asked_for():
    # The reader and the build agree: build_info.json has CMake's list, the file has the code.
    code = _library.cuda_code()
    assert code.describe() == _library.BUILD_INFO["cuda_architectures"] if code else \
        not _library.BUILD_INFO["cuda_architectures"]


BUILT = {"version": "0.2.0+pt211cu130", "torch": "2.11.0+cu130", "torch_cuda": "13.0"}


@pytest.mark.parametrize("running", ["2.11.0", "2.11.1+cu130", "2.11.0+cu130"])
def test_the_same_torch_minor_version_loads(running):
    assert _library.version_problem(BUILT, running, "13.0") is None


@pytest.mark.parametrize("running", ["2.10.0+cu128", "2.12.0", "3.0.0"])
def test_another_torch_minor_version_is_refused_naming_both(running):
    problem = _library.version_problem(BUILT, running, "13.0")
    assert "ampfuse 0.2.0+pt211cu130 was built for torch 2.11.0+cu130" in problem
    assert f"this environment has torch {running}" in problem
    assert "pip install 'torch==2.11.*'" in problem


def test_a_cuda_build_refuses_a_cpu_only_torch():
    problem = _library.version_problem(BUILT, "2.11.0+cpu", None)
    assert "has no CUDA support" in problem and "2.11.0+cpu" in problem


def test_a_cuda_build_refuses_another_cuda_major_version():
    problem = _library.version_problem(BUILT, "2.11.0+cu126", "12.6")
    assert "CUDA 13.0" in problem and "CUDA 12.6" in problem


def test_a_cpu_build_loads_into_any_torch_of_its_minor_version():
    cpu_build = dict(BUILT, torch="2.11.0+cpu", torch_cuda="")
    assert _library.version_problem(cpu_build, "2.11.0+cu130", "13.0") is None


def test_this_build_matches_this_torch_and_names_it_in_its_version():
    assert _library.version_problem(_library.BUILD_INFO, torch.__version__,
                                    torch.version.cuda) is None
    major, minor = torch.__version__.split(".")[:2]
    assert f"+pt{major}{minor}" in ampfuse.__version__

"""Loads ampfuse's op library and says what it holds.

The op library, ``libampfuse_ops.so`` beside this file, is a plain shared library: it uses no
Python API, so one build serves every Python. Loading it with ``torch.ops.load_library`` runs
its C++ static registrations: every op becomes ``torch.ops.ampfuse.*`` (the schemas and their
one list are in csrc/registration.cpp). It is linked against one torch release, so
``build_info.json``, written beside it by the build, is compared with the running torch first: a
mismatch is an error naming both versions, not an undefined-symbol crash.

This is the only module that loads the native library; the rest of ampfuse reaches it through
the op wrappers of this package.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ampfuse.ops import _archs

_HERE = Path(__file__).resolve().parent
LIBRARY_PATH = _HERE / "libampfuse_ops.so"
_BUILD_INFO_PATH = _HERE / "build_info.json"

_NOT_BUILT = (
    "ampfuse's op library ({path}) is missing: this is a source checkout that has not been "
    "built, or a broken install. Build it against the installed torch with `make build` (or "
    "`pip install --no-build-isolation -e .`) in the source folder, or install an ampfuse wheel."
)


def _minor_version(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def version_problem(built: dict, torch_version: str, torch_cuda: str | None) -> str | None:
    """Why a library built as `built` (build_info.json) cannot load into a torch of
    `torch_version` with CUDA `torch_cuda` (None without CUDA); None when it can."""
    built_torch = built.get("torch", "")
    built_cuda = built.get("torch_cuda") or None
    ours = f"ampfuse {built.get('version', '')}".strip()
    if _minor_version(built_torch) != _minor_version(torch_version):
        return (
            f"{ours} was built for torch {built_torch}, but this environment has torch "
            f"{torch_version}. Its native library only loads into the torch minor version it was "
            f"compiled against. Install torch {_minor_version(built_torch)} (pip install "
            f"'torch=={_minor_version(built_torch)}.*'), or an ampfuse built for torch "
            f"{_minor_version(torch_version)}: rebuild from source against this torch with "
            "`pip install --no-build-isolation .`."
        )
    if built_cuda and not torch_cuda:
        return (
            f"{ours} was built for torch {built_torch} with CUDA {built_cuda}, but this torch "
            f"({torch_version}) has no CUDA support. Install the CUDA build of torch "
            f"{_minor_version(built_torch)} (pip install 'torch=={_minor_version(built_torch)}.*' "
            "from PyPI), or build ampfuse from source against this torch."
        )
    if built_cuda and torch_cuda and built_cuda.split(".")[0] != torch_cuda.split(".")[0]:
        return (
            f"{ours} was built with CUDA {built_cuda}, but this torch ({torch_version}) uses CUDA "
            f"{torch_cuda}; the CUDA major versions must match. Install torch with CUDA "
            f"{built_cuda}, or rebuild ampfuse from source against this torch."
        )
    return None


def _load() -> dict:
    if not LIBRARY_PATH.is_file() or not _BUILD_INFO_PATH.is_file():
        raise ImportError(_NOT_BUILT.format(path=LIBRARY_PATH))
    built = json.loads(_BUILD_INFO_PATH.read_text())
    problem = version_problem(built, torch.__version__, torch.version.cuda)
    if problem:
        raise ImportError(problem)
    try:
        torch.ops.load_library(str(LIBRARY_PATH))
    except OSError as error:  # pragma: no cover - exercised only on a broken install
        raise ImportError(
            f"ampfuse's op library ({LIBRARY_PATH}) could not be loaded: {error}. Rebuild it "
            "against the installed torch (`pip install --no-build-isolation .` in the source "
            "folder) or reinstall the ampfuse wheel built for this torch."
        ) from error
    return built


BUILD_INFO: dict = _load()
"""What the library was built with: the torch version and its CUDA, the ampfuse version and the
CUDA architectures (build_info.json)."""


def _registered_tensor_ops() -> tuple[str, ...]:
    # Read back from the dispatcher, so the C++ registration is the one list of ops. The ops
    # with a CPU kernel are the tensor ops; the O1 policy helpers (csrc/autocast/registry.cpp)
    # share the namespace but are host-side functions with one catch-all kernel.
    prefix = "ampfuse::"
    return tuple(sorted(
        name[len(prefix):] for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(prefix) and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    ))


OP_NAMES: tuple[str, ...] = _registered_tensor_ops()
"""The name of every tensor op in torch.ops.ampfuse (each has a CPU, a CUDA and a fake kernel),
as the native library registered them."""


def _has_cuda_kernels() -> bool:
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"ampfuse::{name}", "CUDA")
        for name in OP_NAMES
    )


_CUDA_CODE: list[_archs.CudaCode] = []


def cuda_code() -> _archs.CudaCode:
    """The GPU architectures the op library has machine code and PTX for (read once)."""
    if not _CUDA_CODE:
        _CUDA_CODE.append(_archs.read_cuda_code(LIBRARY_PATH))
    return _CUDA_CODE[0]


def _devices() -> list[Device]:
    return [(f"CUDA device {i}", torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())]


Device = tuple[str, str, tuple[int, int]]  # (label, name, (major, minor))


def cuda_status(devices: list[Device] | None = None, code: _archs.CudaCode | None = None) -> str:
    """Says whether ampfuse's CUDA kernels can run here and, if not, why and how to fix it.

    `devices` ((label, name, (major, minor)) per GPU) and `code` default to this machine's GPUs
    and the op library's code; the tests pass their own."""
    if not _has_cuda_kernels():
        return (
            "ampfuse was built without CUDA kernels (no CUDA toolkit was found at build time, "
            "or torch has no CUDA support). Install the CUDA toolkit matching "
            f"torch.version.cuda ({torch.version.cuda}) and rebuild with "
            "`pip install --no-build-isolation .`."
        )
    code = cuda_code() if code is None else code
    built = f"ampfuse has CUDA kernels for {code.describe()}"
    if devices is None:
        if not torch.cuda.is_available():
            return (f"{built}, but torch sees no CUDA device on this machine; the CPU kernels "
                    "are used for CPU tensors.")
        devices = _devices()
    uncovered = [d for d in devices if not _archs.runs_on(code, d[2])]
    if uncovered:
        return " ".join(_archs.no_code_message(label, name, capability, code)
                        for label, name, capability in uncovered)
    seen = ", ".join(f"{name} (sm_{major}{minor})" for _, name, (major, minor) in devices)
    return f"{built}; they run on this machine's {len(devices)} device(s): {seen}."


def cuda_available() -> bool:
    """True when ampfuse has CUDA kernels and torch sees a CUDA device they run on."""
    if not (_has_cuda_kernels() and torch.cuda.is_available()):
        return False
    return all(_archs.runs_on(cuda_code(), capability) for _, _, capability in _devices())

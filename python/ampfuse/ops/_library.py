"""Loads ampfuse's native library and says what it holds.

Importing ``ampfuse._C`` runs the C++ static registrations: every op becomes
``torch.ops.ampfuse.*`` (the schemas and their one list are in csrc/registration.cpp). This is
the only module that imports the native library; the rest of ampfuse reaches it through the
op wrappers of this package.
"""

from __future__ import annotations

import torch

try:
    import ampfuse._C as native  # noqa: F401  (importing it registers torch.ops.ampfuse.*)
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ampfuse's native library (ampfuse._C) could not be loaded: "
        f"{error}. Build it against the installed torch with "
        "`pip install --no-build-isolation .` (or `make build` in a source checkout); "
        "it must be rebuilt whenever torch is upgraded."
    ) from error


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


def cuda_status() -> str:
    """Says whether ampfuse's CUDA kernels can run here and, if not, why and how to fix it."""
    if not _has_cuda_kernels():
        return (
            "ampfuse was built without CUDA kernels (no CUDA toolkit was found at build time, "
            "or torch has no CUDA support). Install the CUDA toolkit matching "
            f"torch.version.cuda ({torch.version.cuda}) and rebuild with "
            "`pip install --no-build-isolation .`."
        )
    if not torch.cuda.is_available():
        return (
            "ampfuse has CUDA kernels, but torch sees no CUDA device on this machine; "
            "the CPU kernels are used for CPU tensors."
        )
    return f"ampfuse CUDA kernels are available ({torch.cuda.device_count()} device(s))."


def cuda_available() -> bool:
    """True when ampfuse has CUDA kernels and torch sees a CUDA device."""
    return _has_cuda_kernels() and torch.cuda.is_available()

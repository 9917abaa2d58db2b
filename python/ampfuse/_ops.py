"""Loads the native library and gives the ops typed Python wrappers and fake
(meta) kernels, so torch.compile, FakeTensor and opcheck can trace them.

This module is the only door between Python and the C++ ops: every other
module calls torch.ops.ampfuse.* through the functions defined here.
"""

from __future__ import annotations

import torch

try:
    from ampfuse import _C  # noqa: F401  (importing it registers torch.ops.ampfuse.*)
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ampfuse's native library (ampfuse._C) could not be loaded: "
        f"{error}. Build it against the installed torch with "
        "`pip install --no-build-isolation .` (or `make build` in a source checkout); "
        "it must be rebuilt whenever torch is upgraded."
    ) from error

_OPS = ("multi_tensor_unscale_", "multi_tensor_scale_", "multi_tensor_l2norm", "update_scale_")


def _has_cuda_kernels() -> bool:
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"ampfuse::{name}", "CUDA")
        for name in _OPS
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


# ---- typed wrappers ----------------------------------------------------------------


def multi_tensor_unscale_(grads, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """In place ``g *= inv_scale`` (fp32 math); ``found_inf`` set to 1 on any inf/nan."""
    torch.ops.ampfuse.multi_tensor_unscale_(list(grads), found_inf, inv_scale)


def multi_tensor_scale_(src, dst, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``dst[i] = src[i] * scale`` cast to ``dst[i].dtype``; flags non-finite sources."""
    torch.ops.ampfuse.multi_tensor_scale_(list(src), list(dst), scale, found_inf)


def multi_tensor_l2norm(tensors, per_tensor: bool = False):
    """Returns ``(global_norm, per_tensor_norms)`` in fp32."""
    return torch.ops.ampfuse.multi_tensor_l2norm(list(tensors), per_tensor)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = float("inf"),
) -> None:
    """One step of the dynamic loss-scale rule, on the scale's device."""
    torch.ops.ampfuse.update_scale_(
        scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
        growth_interval, hysteresis, min_scale, max_scale,
    )


# ---- fake kernels --------------------------------------------------------------------
# In-place ops write into existing tensors and return nothing, so their fake kernels
# have nothing to allocate; the real kernels' argument checks run on real tensors.


@torch.library.register_fake("ampfuse::multi_tensor_unscale_")
def _unscale_fake(grads, found_inf, inv_scale):
    return None


@torch.library.register_fake("ampfuse::multi_tensor_scale_")
def _scale_fake(src, dst, scale, found_inf):
    if len(src) != len(dst):
        raise RuntimeError(
            f"ampfuse.multi_tensor_scale_: src has {len(src)} tensors but dst has {len(dst)}; "
            "pass one destination per source."
        )
    return None


@torch.library.register_fake("ampfuse::multi_tensor_l2norm")
def _l2norm_fake(tensors, per_tensor):
    device = tensors[0].device if tensors else torch.device("cpu")
    global_norm = torch.empty((), dtype=torch.float32, device=device)
    per_tensor_norms = torch.empty(
        (len(tensors) if per_tensor else 0,), dtype=torch.float32, device=device
    )
    return global_norm, per_tensor_norms


@torch.library.register_fake("ampfuse::update_scale_")
def _update_scale_fake(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                       backoff_factor, growth_interval, hysteresis, min_scale, max_scale):
    return None

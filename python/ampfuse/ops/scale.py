"""Unscale, scale-and-cast and the non-finite check over tensor lists: typed wrappers and fake
kernels (schemas in csrc/registration.cpp; C++ in csrc/ops/scale.cpp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ampfuse.ops._checks import check_list, check_scalar, check_tensor_flags
from ampfuse.ops._dtensor_hook import register_dtensor_rules
from ampfuse.ops import _library  # noqa: F401  (registers the ops first)


def multi_tensor_unscale_(grads: Iterable[torch.Tensor], found_inf: torch.Tensor,
                          inv_scale: torch.Tensor,
                          tensor_flags: torch.Tensor | None = None) -> None:
    """In place ``g *= inv_scale`` (fp32 math); ``found_inf`` set to 1 on any inf/nan."""
    register_dtensor_rules()
    torch.ops.ampfuse.multi_tensor_unscale_(list(grads), found_inf, inv_scale, tensor_flags)


def multi_tensor_nonfinite_check_(tensors: Iterable[torch.Tensor], found_inf: torch.Tensor,
                                  tensor_flags: torch.Tensor | None = None) -> None:
    """Sets ``found_inf`` to 1 if any element of ``tensors`` is inf/nan; reads them only and
    never clears the flag. For DTensors the flag is all-reduced (MAX) over their device meshes,
    so every rank gets the same verdict (see ampfuse.ops.dtensor)."""
    register_dtensor_rules()
    torch.ops.ampfuse.multi_tensor_nonfinite_check_(list(tensors), found_inf, tensor_flags)


def multi_tensor_scale_(src: Iterable[torch.Tensor], dst: Iterable[torch.Tensor],
                        scale: torch.Tensor, found_inf: torch.Tensor,
                        tensor_flags: torch.Tensor | None = None) -> None:
    """``dst[i] = src[i] * scale`` cast to ``dst[i].dtype``; flags non-finite sources."""
    register_dtensor_rules()
    torch.ops.ampfuse.multi_tensor_scale_(list(src), list(dst), scale, found_inf, tensor_flags)


@torch.library.register_fake("ampfuse::multi_tensor_unscale_")
def _unscale_fake(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                  inv_scale: torch.Tensor, tensor_flags: torch.Tensor | None = None) -> None:
    device = check_list("multi_tensor_unscale_", "grads", grads)
    check_scalar("multi_tensor_unscale_", "found_inf", found_inf, torch.float32, device)
    check_scalar("multi_tensor_unscale_", "inv_scale", inv_scale, torch.float32, device)
    check_tensor_flags("multi_tensor_unscale_", tensor_flags, len(grads), "grads", found_inf)


@torch.library.register_fake("ampfuse::multi_tensor_nonfinite_check_")
def _nonfinite_check_fake(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor,
                          tensor_flags: torch.Tensor | None = None) -> None:
    op = "multi_tensor_nonfinite_check_"
    device = check_list(op, "tensors", tensors)
    check_scalar(op, "found_inf", found_inf, torch.float32, device)
    check_tensor_flags(op, tensor_flags, len(tensors), "tensors", found_inf)


@torch.library.register_fake("ampfuse::multi_tensor_scale_")
def _scale_fake(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], scale: torch.Tensor,
                found_inf: torch.Tensor, tensor_flags: torch.Tensor | None = None) -> None:
    op = "multi_tensor_scale_"
    if len(src) != len(dst):
        raise RuntimeError(
            f"ampfuse.{op}: src has {len(src)} tensors but dst has {len(dst)}; "
            "pass one destination per source."
        )
    device = check_list(op, "dst", dst, check_list(op, "src", src))
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.shape != d.shape:
            raise RuntimeError(
                f"ampfuse.{op}: src[{i}] has shape {tuple(s.shape)} but dst[{i}] has shape "
                f"{tuple(d.shape)}; each destination must match its source's shape."
            )
    check_scalar(op, "scale", scale, torch.float32, device)
    check_scalar(op, "found_inf", found_inf, torch.float32, device)
    check_tensor_flags(op, tensor_flags, len(src), "src", found_inf)

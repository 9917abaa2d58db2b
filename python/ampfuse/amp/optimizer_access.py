"""Where amp finds an optimizer's params and grads: the param list, the grads the unscale ops
work on (sparse COO grads by their values), and the torch.optim.Optimizer whose step hooks see
a wrapped optimizer's steps."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def dense_grad(grad: torch.Tensor, what: str) -> torch.Tensor:
    """The tensor the unscale ops work on for `grad`: the grad itself, or a sparse grad's values
    (coalesced first for fp16, whose duplicate indices could overflow once summed)."""
    if grad.layout == torch.strided:
        return grad
    if grad.layout == torch.sparse_coo:
        return grad._values()
    raise RuntimeError(
        f"amp.{what}: a gradient has layout {grad.layout}; amp unscales dense (strided) and "
        "sparse COO gradients."
    )


def params_and_grads(params: Iterable[torch.Tensor], what: str = "scale_loss"
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The params that have a grad, and the tensors the unscale ops work on for those grads."""
    # This runs at every scale_loss: comprehensions and a plain loop cost no Python call per
    # param; the general loop below only runs when some grad is sparse.
    with_grads = [p for p in params if p.grad is not None]
    grads: list[Any] = [p.grad for p in with_grads]  # none of them None
    strided = torch.strided
    for grad in grads:
        if grad.layout is not strided:
            break
    else:
        return with_grads, grads
    out = []
    for p in with_grads:
        grad = cast(torch.Tensor, p.grad)  # with_grads: not None
        if grad.layout == torch.sparse_coo and grad.dtype == torch.float16:
            p.grad = grad = grad.coalesce()
        out.append(dense_grad(grad, what))
    return with_grads, out


def grads_of(params: Iterable[torch.Tensor], what: str = "scale_loss") -> list[torch.Tensor]:
    return params_and_grads(params, what)[1]


def hookable(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch.optim.Optimizer whose step hooks see `optimizer`'s steps: the optimizer itself,
    or the one a duck-typed wrapper (such as LARC) steps with the same param groups."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    for name in ("optim", "optimizer", "_optimizer", "base_optimizer"):
        inner = getattr(optimizer, name, None)
        shares_groups = getattr(inner, "param_groups", None) is optimizer.param_groups
        if isinstance(inner, torch.optim.Optimizer) and shares_groups:
            return inner
    return None

"""Param groups and their options: what a fused optimizer's group may hold, and the checks that
refuse the rest with a message naming the group, the param and the fix.

The checks run when a group is added (add_param_group, the constructor), when a state dict is
loaded (before anything changes) and, for the hyperparameters, at every step, since a scheduler
or the user may change a group between steps. Kept apart from the step launcher (``_base``) so
that the rules a group must follow are read in one place.
"""

from __future__ import annotations

from typing import Any

import torch

from ampfuse.optimizers._host import OptimizerHost
from ampfuse.optimizers._precision import check_master_weights
from ampfuse.optimizers._skip import check_skip_nonfinite
from ampfuse.overflow import param_name
from ampfuse.optimizers._torch_switches import (IMPLEMENTATION_SWITCHES,
                                                check_implementation_switches)

# The param dtypes the fused ops update; a complex64 param is updated as its real view (_base).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PARAM_DTYPES = FLOAT_DTYPES + (torch.complex64,)


def check_flag(optimizer: object, index: int, group: dict[str, Any], key: str) -> None:
    """A group option that is a switch must be True or False: 1, "yes" or None would silently
    pick a behaviour the caller may not have meant."""
    value = group[key]
    if not isinstance(value, bool):
        raise ValueError(
            f"{type(optimizer).__name__}: param_groups[{index}] has {key}={value!r}; it must be "
            "True or False."
        )


def float_betas(betas: Any) -> Any:
    """A (beta1, beta2) pair, tensors included, as two Python floats, read once at construction
    rather than at every step; anything else is returned as it is, for _check_betas to refuse."""
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        return (float(betas[0]), float(betas[1]))
    return betas


class ParamGroupsMixin(OptimizerHost):
    """add_param_group() with FusedOptimizer's checks, and the checks the subclasses' own
    _check_hyperparameters() builds on."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._check_group(index, self.param_groups[index])
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for key in self._FOREIGN_GROUP_KEYS:
            if key in group:
                raise ValueError(
                    f"{name}: param_groups[{index}] sets {key!r}, which {name} does not have; "
                    f"remove it from the group (it belongs to another optimizer)."
                )
        if any(key in group for key in IMPLEMENTATION_SWITCHES):
            # A group handed to add_param_group may carry torch's switches too.
            check_implementation_switches(
                f"{name}: param_groups[{index}]", self._torch_counterpart(group),
                group.get("foreach"), group.get("fused"), group.get("differentiable", False))
        for i, p in enumerate(group["params"]):
            self._check_param_dtype(index, i, p)
        self._check_hyperparameters(index, group)
        check_master_weights(self, index, group)
        check_skip_nonfinite(self, index, group)

    def _torch_counterpart(self, group: dict[str, Any]) -> str:
        """The torch.optim class this optimizer stands in for, as messages name it."""
        return self._TORCH_COUNTERPART or "a torch.optim optimizer"

    def _check_param_dtype(self, group_index: int, param_index: int, p: torch.Tensor) -> None:
        if p.dtype not in PARAM_DTYPES:
            raise ValueError(
                f"{type(self).__name__}: {param_name(group_index, param_index)} has dtype "
                f"{p.dtype}; fused optimizers update torch.float32, torch.float16, "
                "torch.bfloat16 and torch.complex64 parameters only (no float64, complex128, "
                "complex32 or integer ones)."
            )

    def _check_lr(self, index: int, lr: float | torch.Tensor) -> None:
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1 or not lr.is_floating_point():
                raise ValueError(
                    f"{type(self).__name__}: param_groups[{index}]['lr'] is a tensor of shape "
                    f"{tuple(lr.shape)} and dtype {lr.dtype}; a tensor lr must be one "
                    "floating-point element."
                )
            return
        if not lr >= 0.0:
            raise ValueError(
                f"{type(self).__name__}: param_groups[{index}] has lr={lr}; the learning rate "
                "must be >= 0."
            )

    def _check_betas(self, index: int, group: dict[str, Any]) -> None:
        """Adam's, LAMB's and NovoGrad's betas: a pair, each in [0, 1)."""
        name = type(self).__name__
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(
                f"{name}: param_groups[{index}] has betas={betas!r}; betas must be a pair "
                "(beta1, beta2)."
            )
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(
                    f"{name}: param_groups[{index}] has betas[{i}]={float(beta)}; each beta "
                    "must be in [0, 1)."
                )

    def _check_nonnegative(self, index: int, group: dict[str, Any], key: str) -> None:
        if not group[key] >= 0.0:
            raise ValueError(
                f"{type(self).__name__}: param_groups[{index}] has {key}={group[key]}; it must "
                "be >= 0."
            )

    def _reject(self, group_index: int, param_index: int, p: torch.Tensor,
                grad: torch.Tensor) -> None:
        """Raises for a grad or param that no fused op takes (a complex64 param with a dense
        grad is taken, as its real view); _calls only comes here when its cheap test failed."""
        if grad.layout != torch.strided:
            name = type(self).__name__
            raise RuntimeError(
                f"{name}: {param_name(group_index, param_index)} has a {grad.layout} gradient; "
                f"{name} takes dense gradients only (FusedSGD and FusedAdagrad also take "
                "sparse COO ones of float32 params). Give the params with sparse gradients "
                "(e.g. an nn.Embedding(sparse=True)) an optimizer of their own (FusedSGD, "
                "FusedAdagrad, torch.optim.SparseAdam), or make their gradients dense."
            )
        self._check_param_dtype(group_index, param_index, p)

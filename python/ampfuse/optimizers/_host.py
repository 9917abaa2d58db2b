"""What FusedOptimizer's mixins use of one another and of torch.optim.Optimizer, for the type
checker only: at run time each mixin's base is `object`, and FusedOptimizer, which derives from
all of them and from torch.optim.Optimizer, brings these members together.

The records are typed Any: naming their classes here would import _masters and _skip back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    class OptimizerHost(torch.optim.Optimizer):
        _TORCH_GROUP_KEYS: dict[str, Any]
        _FOREIGN_GROUP_KEYS: tuple[str, ...]
        _TORCH_COUNTERPART: str | None
        _param_records: dict[torch.Tensor, Any]  # ParamRecord (_masters)
        _skips: Any  # SkipRecord (_skip)
        _lr_tensors: dict[tuple[int, torch.device], list[Any]]
        _first_step_count: float
        _TAKES_SPARSE: bool
        step_on_master_grads: bool

        def _record(self, p: torch.Tensor) -> Any: ...
        def _check_group(self, index: int, group: dict[str, Any]) -> None: ...
        def _check_hyperparameters(self, index: int, group: dict[str, Any]) -> None: ...
        def _export_state(self, group: dict[str, Any], state: dict[str, Any],
                          step_value: torch.Tensor | None) -> dict[str, Any]: ...
        def _import_state(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                          where: str) -> tuple[dict[str, Any], float | None]: ...
        def get_skipped_steps(self) -> int: ...
        def _capturing(self, compiling: bool | None = None) -> bool: ...
        def _check_not_capturing(self, group_index: int, param_index: int) -> None: ...
        def _reject(self, group_index: int, param_index: int, p: torch.Tensor,
                    grad: torch.Tensor) -> None: ...
        def _follow(self, p: torch.Tensor, master: torch.Tensor,
                    record: Any = None) -> None: ...
        def _written_since_step(self, p: torch.Tensor, record: Any) -> bool: ...
        def _match_layout(self, group_index: int, param_index: int, p: torch.Tensor,
                          state: dict[str, Any], record: Any) -> None: ...
else:
    OptimizerHost = object

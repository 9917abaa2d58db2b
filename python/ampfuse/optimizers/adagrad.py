"""FusedAdagrad: torch.optim.Adagrad's update (and apex FusedAdagrad's decoupled mode) over whole
param lists in one op call per device, with optional fp32 master weights or bf16 params without
them, on top of torch.ops.ampfuse.fused_adagrad_."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from ampfuse import ops
from ampfuse.optimizers._base import FusedOptimizer
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._groups import check_flag
from ampfuse.optimizers._precision import export_extra
from ampfuse.optimizers._sparse import adagrad_step
from ampfuse.optimizers._state import fp32_copy, state_dtype
from ampfuse.optimizers._torch_switches import check_implementation_switches


class FusedAdagrad(FusedOptimizer):
    """torch.optim.Adagrad's update in one fused op per param group and device.

    Args:
        params: params or param groups, as for any torch.optim optimizer.
        lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize: as in
            torch.optim.Adagrad, same order of operations (the decay is added to the grad,
            sum += g * g, param -= clr * g / (sqrt(sum) + eps), clr = lr / (1 + (t - 1) *
            lr_decay)).
        adagrad_w_mode: apex FusedAdagrad's option: the decay moves out of the adaptive step,
            param -= clr * (g / (sqrt(sum) + eps) + weight_decay * param), AdamW-style.
        master_weights: True (fp32 masters), False, "stochastic", "kahan" or "split", as in
            FusedAdam. The bf16 modes suit large bf16 embedding tables, where fp32 masters would
            double the params' memory: "split" (2 bytes per param) gives exactly True's
            masters, "stochastic" (0 bytes) and "kahan" (2 bytes) follow them closely.
        rounding_seed: the seed of master_weights="stochastic", as in FusedAdam.
        set_grad_none, write_unscaled_grads, skip_nonfinite: as in FusedAdam.
        foreach, fused, differentiable: torch.optim.Adagrad's implementation switches (foreach
            in torch's seventh place), as in FusedAdam: the fused step runs whatever foreach and
            fused say; differentiable=True is refused.

    The sums are fp32 whatever the params' dtype, also in state_dict(), which has torch's
    layout ('sum' and 'step' per param): torch.optim.Adagrad loads it and the other way round.
    The saved 'step' also keys master_weights="stochastic"'s random bits, so a resumed run
    draws the same ones.
    An apex FusedAdagrad checkpoint (a 'sum' per param, no step) loads too. GradScaler and
    grad_scale/found_inf work as for FusedAdam; like torch.optim.Adagrad, step() may be captured
    in a CUDA graph. Sparse gradients of fp32 params (nn.Embedding(sparse=True)) are stepped as
    torch.optim.Adagrad steps them, touching only their rows (see optimizers/_sparse.py), and
    complex64 params as their real views, as torch does.
    """

    _TORCH_GROUP_KEYS = {"foreach": None, "fused": None, "differentiable": False}
    _TORCH_COUNTERPART = "torch.optim.Adagrad"
    _TAKES_SPARSE = True
    _FOREIGN_GROUP_KEYS = ("betas", "momentum", "dampening", "nesterov", "amsgrad",
                           "adam_w_mode", "bias_correction", "max_grad_norm", "norm_type")

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        adagrad_w_mode: bool = False,
        master_weights: bool | str = False,
        set_grad_none: bool = True,
        write_unscaled_grads: bool = True,
        skip_nonfinite: bool | None = False,
        rounding_seed: int = 0,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        check_implementation_switches(type(self).__name__, self._TORCH_COUNTERPART, foreach,
                                      fused, differentiable)
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "maximize": maximize,
            "adagrad_w_mode": adagrad_w_mode,
            "master_weights": master_weights,
            "write_unscaled_grads": write_unscaled_grads,
            "skip_nonfinite": skip_nonfinite,
            "rounding_seed": rounding_seed,
        }
        super().__init__(params, defaults, set_grad_none)

    def _check_hyperparameters(self, index: int, group: dict[str, Any]) -> None:
        self._check_lr(index, group["lr"])
        for key in ("maximize", "adagrad_w_mode", "write_unscaled_grads"):
            check_flag(self, index, group, key)
        for key in ("lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            self._check_nonnegative(index, group, key)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def _prepare_state(self, group: dict[str, Any], p: torch.Tensor,
                       state: dict[str, Any]) -> None:
        if "sum" not in state:
            value: float | complex = float(group["initial_accumulator_value"])
            if p.is_complex():
                # Both parts of the real view start from it, as in torch.optim.Adagrad.
                value = complex(value, value)
            state["sum"] = torch.full_like(p, value, dtype=state_dtype(p),
                                           memory_format=torch.preserve_format)

    def _sparse_step(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor,
                     state: dict[str, Any], lr: float) -> None:
        self._prepare_state(group, p, state)  # the sum, on a param's first step
        adagrad_step(group, p, grad, state, lr)

    def _launch(self, group: dict[str, Any], call: OpCall, lr: torch.Tensor,
                grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        ops.fused_adagrad_(
            call.op_params(),
            call.grads,
            call.state_list("sum"),
            call.masters(),
            call.step,
            lr,
            float(group["lr_decay"]),
            float(group["weight_decay"]),
            float(group["eps"]),
            bool(group["adagrad_w_mode"]),
            bool(group["maximize"]),
            grad_scale,
            found_inf,
            write_unscaled_grads=bool(group["write_unscaled_grads"]),
            **call.master_args(group),
        )

    def _export_state(self, group: dict[str, Any], state: dict[str, Any],
                      step_value: torch.Tensor | None) -> dict[str, Any]:
        if step_value is None or "sum" not in state:
            return {}
        out = {"step": step_value, "sum": state["sum"]}
        export_extra(state, out)
        return out

    def _import_state(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                      where: str) -> tuple[dict[str, Any], float | None]:
        if not saved:
            return {}, None
        if "sum" not in saved:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state of {where} has keys "
                f"{sorted(saved)}; an Adagrad state needs 'sum' (and 'step', which apex's "
                "FusedAdagrad did not keep: 0 is taken then)."
            )
        self._check_saved_shape(where, "sum", saved["sum"], p)
        imported = {"sum": fp32_copy(saved["sum"], p)}
        self._import_master(group, p, saved, imported, where)
        step = saved.get("step", 0.0)
        return imported, float(step.item() if isinstance(step, torch.Tensor) else step)

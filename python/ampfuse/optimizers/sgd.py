"""FusedSGD: SGD with momentum, dampening, Nesterov and weight decay over whole param lists in one
op call per device, with optional fp32 master weights, on top of torch.ops.ampfuse.fused_sgd_."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from ampfuse import ops
from ampfuse.optimizers._base import FusedOptimizer
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._groups import check_flag
from ampfuse.optimizers._precision import export_extra
from ampfuse.optimizers._sparse import sgd_step
from ampfuse.optimizers._state import fp32_copy
from ampfuse.optimizers._torch_switches import check_implementation_switches


class FusedSGD(FusedOptimizer):
    """torch.optim.SGD's update in one fused op per param group and device.

    Args:
        params: params or param groups, as for any torch.optim optimizer.
        lr: learning rate; may be a one-element tensor. The default is torch.optim.SGD's
            (1e-3); apex required it. A param group's own 'lr' overrides it, as in torch.
        momentum, dampening, weight_decay, nesterov, maximize: as in torch.optim.SGD, same order
            of operations (weight decay is added to the grad before the momentum; the first
            step seeds the momentum buffer with the grad, without dampening).
        wd_after_momentum: apex's option: add weight_decay * param to the update after the
            momentum step instead of to the grad before it, so the momentum buffer never holds
            the decay. Without momentum both give the same update.
        materialize_master_grads: accepted for apex scripts, and must be True or False. In apex
            it chose whether amp's fp32 master grads were made (True) or the fp16 model grads
            were read directly (False). ampfuse never needs them for a step: the optimizer
            keeps its own fp32 masters and reads the model's grads with the loss scale divided
            out in the kernel (apex's False), so both values give the same update. fp32 master
            grads are made only when a caller asks for them, e.g. to clip
            amp.master_params(optimizer).
        master_weights: True (fp32 masters), False, "stochastic", "kahan" or "split", as in
            FusedAdam.
        rounding_seed: the seed of master_weights="stochastic", as in FusedAdam.
        set_grad_none: zero_grad()'s default for set_to_none (apex's spelling).
        write_unscaled_grads: leave p.grad unscaled after a step that divides out a loss scale,
            as torch does (default); see FusedAdam.
        skip_nonfinite: False (default), None or True: skip a step whose grads hold inf/nan,
            on the device; see FusedAdam (None checks fp16/bf16 groups when no loss scaler
            drives the step). `last_step_skipped` and get_skipped_steps() as in FusedAdam.
        foreach, fused, differentiable: torch.optim.SGD's implementation switches, as in
            FusedAdam (the fused step runs whatever foreach and fused say; differentiable=True
            is refused).

    Momentum buffers are fp32 whatever the params' dtype, also in state_dict(). The optimizer
    keeps one device-side step count per group and device (the op needs it to tell the first
    step); state_dict() leaves it out, as torch.optim.SGD has none, and load_state_dict() infers
    it from whether a momentum buffer exists. With master_weights="stochastic" the count keys
    the random bits, so state_dict() saves it as each param's 'step' and a resumed run draws
    the same bits. GradScaler and grad_scale/found_inf work as for
    FusedAdam. Like torch.optim.SGD, step() may be captured in a CUDA graph; the learning rate
    is then fixed unless it is a CUDA tensor changed in place. Sparse gradients of fp32 params
    (nn.Embedding(sparse=True)) are stepped as torch.optim.SGD steps them, with the dense fp32
    momentum buffer (see optimizers/_sparse.py), and complex64 params as their real views.
    """

    _TORCH_GROUP_KEYS = {"foreach": None, "fused": None, "differentiable": False}
    _TORCH_COUNTERPART = "torch.optim.SGD"
    _TAKES_SPARSE = True
    _FOREIGN_GROUP_KEYS = ("betas", "eps", "amsgrad", "adam_w_mode", "bias_correction")

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        *,
        maximize: bool = False,
        master_weights: bool | str = False,
        set_grad_none: bool = True,
        write_unscaled_grads: bool = True,
        skip_nonfinite: bool | None = False,
        rounding_seed: int = 0,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        check_implementation_switches(type(self).__name__, self._TORCH_COUNTERPART, foreach,
                                      fused, differentiable)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "master_weights": master_weights,
            "wd_after_momentum": wd_after_momentum,
            "materialize_master_grads": materialize_master_grads,
            "write_unscaled_grads": write_unscaled_grads,
            "skip_nonfinite": skip_nonfinite,
            "rounding_seed": rounding_seed,
        }
        super().__init__(params, defaults, set_grad_none)

    def _check_hyperparameters(self, index: int, group: dict[str, Any]) -> None:
        self._check_lr(index, group["lr"])
        for key in ("wd_after_momentum", "materialize_master_grads", "write_unscaled_grads"):
            check_flag(self, index, group, key)
        self._check_nonnegative(index, group, "momentum")
        self._check_nonnegative(index, group, "weight_decay")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                f"{type(self).__name__}: param_groups[{index}] has nesterov=True with "
                f"momentum={group['momentum']} and dampening={group['dampening']}; Nesterov "
                "momentum needs momentum > 0 and dampening == 0."
            )

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _implied_step_count(self, state: dict[str, Any]) -> float:
        # torch.optim.SGD keeps no count: a state holding a momentum buffer has stepped (the
        # op would otherwise seed the buffer from the grad again), as load_state_dict infers.
        return 1.0 if "momentum_buffer" in state else self._first_step_count

    def _starts_over(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        # A buffer made after the param's first step (momentum switched on later) is seeded
        # from the grad like torch's, which needs the op to see step == 0.
        return group["momentum"] != 0 and "momentum_buffer" not in state

    def _launch(self, group: dict[str, Any], call: OpCall, lr: torch.Tensor,
                grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        with_momentum = group["momentum"] != 0
        ops.fused_sgd_(
            call.op_params(),
            call.grads,
            call.state_list("momentum_buffer") if with_momentum else [],
            call.masters(),
            call.step,
            lr,
            float(group["momentum"]),
            float(group["dampening"]),
            float(group["weight_decay"]),
            bool(group["nesterov"]),
            bool(group["maximize"]),
            grad_scale,
            found_inf,
            write_unscaled_grads=bool(group["write_unscaled_grads"]),
            wd_after_momentum=bool(group["wd_after_momentum"]),
            **call.master_args(group),
        )

    def _sparse_step(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor,
                     state: dict[str, Any], lr: float) -> None:
        sgd_step(group, p, grad, state, lr)

    def _export_state(self, group: dict[str, Any], state: dict[str, Any],
                      step_value: torch.Tensor | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if group["master_weights"] == "stochastic" and step_value is not None:
            # The step keys the random bits: a resumed run draws the same ones only with it.
            out["step"] = step_value
        if "momentum_buffer" in state:
            out["momentum_buffer"] = state["momentum_buffer"]
        export_extra(state, out)
        return out

    def _import_state(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                      where: str) -> tuple[dict[str, Any], float | None]:
        imported: dict[str, Any] = {}
        buffer = saved.get("momentum_buffer")
        if buffer is not None:
            self._check_saved_shape(where, "momentum_buffer", buffer, p)
            imported["momentum_buffer"] = fp32_copy(buffer, p)
        self._import_master(group, p, saved, imported, where)
        step = saved.get("step")
        if step is not None:  # saved by master_weights="stochastic"
            return imported, float(step.item() if isinstance(step, torch.Tensor) else step)
        if not imported:
            return {}, None
        # The op only asks whether any step was taken: a buffer exists after the first one.
        return imported, self._implied_step_count(imported)

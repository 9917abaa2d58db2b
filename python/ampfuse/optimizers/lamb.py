"""FusedLAMB: apex.optimizers.FusedLAMB's LAMB (layer-wise adaptive moments, You et al. 2019)
over whole param lists, with optional fp32 master weights or the master-free bf16 modes, on top
of torch.ops.ampfuse.fused_lamb_ (fused_lamb_coded_ for 8-bit moments, state_dtype)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from ampfuse import ops
from ampfuse.scaling.global_norm import l2norm_on_each_device
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._coded_optimizer import CodedMomentsOptimizer, coded_call_lists
from ampfuse.optimizers._groups import check_flag, float_betas
from ampfuse.optimizers._state_codes import check_state_dtype
from ampfuse.optimizers._state_codes_sharded import is_dtensor, local
from ampfuse.optimizers._state import add_group_steps, spread_group_steps


class FusedLAMB(CodedMomentsOptimizer):
    """LAMB in two fused passes per param group and device, in apex's FusedLAMB arithmetic.

    Each step: the global L2 norm of every grad of the step (all groups) is taken once; each
    grad is divided by max(1, norm / max_grad_norm); Adam moments are updated (the grad enters
    the first moment times 1 - beta1 with grad_averaging, else times 1); the update is the
    bias-corrected Adam direction plus weight_decay * param (adam_w_mode, the default) or the
    direction of the grad plus weight_decay * param (adam_w_mode=False, L2); and each param
    moves by lr * ||param|| / ||update|| times its update (the trust ratio; lr alone where
    either norm is 0, and for groups without weight decay unless use_nvlamb).

    Args:
        params: params or param groups, as for any torch.optim optimizer.
        lr, bias_correction, betas, eps, weight_decay, adam_w_mode, grad_averaging,
            max_grad_norm, use_nvlamb: as in apex.optimizers.FusedLAMB, with its defaults
            (eps=1e-6, weight_decay=0.01, max_grad_norm=1.0). max_grad_norm=None or 0 turns the
            clipping off. A param group may carry its own max_grad_norm; the norm it is compared
            with is always the global one.
        amsgrad: must be False (LAMB has no AMSGrad variant; apex refuses it too).
        master_weights: True keeps an fp32 master of every fp16/bf16 param (as amp's O2
            masters), False updates params in place. For bf16 params without fp32 masters,
            "stochastic", "kahan" and "split" as in FusedAdam (docs/optimizers.md):
            both passes see the value the mode holds (the param plus its compensation, or the
            master the param and its low half make up), so the trust ratio's ||param|| is that
            value's norm, and "split" steps exactly as True does (masters, moments and trust
            ratios bit for bit). fp16 params are refused by these modes.
        rounding_seed: the seed of master_weights="stochastic", as in FusedAdam; the random bits
            are keyed as FusedAdam's and FusedSGD's (seed, step, param index, element).
        set_grad_none, write_unscaled_grads, skip_nonfinite, capturable: as in FusedAdam.
        state_dtype: how the moments are stored, as in FusedAdam: "fp32" (default), "int8" or
            "fp8" (8-bit codes in blocks of 256 elements with an fp32 scale per block, about
            2.03 bytes per param instead of 8). The coded step equals decoding the moments,
            LAMB's fp32 step and coding the new moments again, bit for bit (CPU and CUDA), with
            every master_weights mode and the global-norm clipping; params under 256 elements
            and complex ones keep fp32 moments. Checkpoints convert both ways at each param's
            next step (docs/optimizers.md, "8-bit moments"). A param-group option.

    Differences from apex: moments are fp32 for fp16 params too (apex kept them in the param's
    dtype), the update is not written into p.grad (apex left it there), the step count is kept
    per param as torch.optim does (state_dict() also writes apex's per-group 'step', and
    load_state_dict() reads it), and fp16 grads may come scaled (GradScaler, amp): the norm and
    the grads are unscaled on the device. Params may be DTensors (FSDP2): the trust ratios are
    then formed from norms summed over the shards (ampfuse.ops.dtensor), as one process would.
    """

    _TORCH_GROUP_KEYS = {"foreach": None, "fused": None, "differentiable": False}
    _FOREIGN_GROUP_KEYS = ("momentum", "dampening", "nesterov", "wd_after_momentum",
                           "materialize_master_grads", "maximize")

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float | None = 1.0,
        use_nvlamb: bool = False,
        *,
        master_weights: bool | str = False,
        capturable: bool = False,
        write_unscaled_grads: bool = True,
        skip_nonfinite: bool | None = False,
        rounding_seed: int = 0,
        state_dtype: str = "fp32",
    ) -> None:
        if amsgrad:
            raise ValueError("FusedLAMB: amsgrad=True has no LAMB variant; leave it False.")
        betas = float_betas(betas)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
            "grad_averaging": grad_averaging,
            "max_grad_norm": max_grad_norm,
            "use_nvlamb": use_nvlamb,
            "master_weights": master_weights,
            "capturable": capturable,
            "write_unscaled_grads": write_unscaled_grads,
            "skip_nonfinite": skip_nonfinite,
            "rounding_seed": rounding_seed,
            "state_dtype": check_state_dtype(type(self).__name__, state_dtype),
        }
        # The step's global grad norm per device, set by _before_launches.
        self._grad_norms: dict[torch.device, torch.Tensor] = {}
        super().__init__(params, defaults, set_grad_none)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_grad_norms", {})

    # ---- checks ---------------------------------------------------------------------------

    def _check_hyperparameters(self, index: int, group: dict[str, Any]) -> None:
        name = type(self).__name__
        self._check_lr(index, group["lr"])
        for key in ("bias_correction", "adam_w_mode", "grad_averaging", "use_nvlamb",
                    "write_unscaled_grads"):
            check_flag(self, index, group, key)
        self._check_betas(index, group)
        self._check_nonnegative(index, group, "eps")
        self._check_nonnegative(index, group, "weight_decay")
        check_state_dtype(f"{name}: param_groups[{index}]", group.get("state_dtype", "fp32"))
        clip = group["max_grad_norm"]
        if clip is not None and (isinstance(clip, bool) or not 0.0 <= clip < float("inf")):
            raise ValueError(
                f"{name}: param_groups[{index}] has max_grad_norm={clip!r}; it must be a finite "
                "number >= 0, or None (0 and None turn the global grad-norm clipping off)."
            )

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    # ---- step -----------------------------------------------------------------------------

    def _before_launches(
        self, plans: Sequence[tuple[int, dict[str, Any], Sequence[OpCall]]]
    ) -> None:
        """The global L2 norm of every grad of the step, once, on each device that steps.
        (The dict is refilled, not replaced: torch.compile traces step() whole, and Dynamo
        refuses to set an attribute of the optimizer.)"""
        self._grad_norms.clear()
        if not any(_clip_value(group) for _, group, _ in plans):
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, calls in plans:
            for call in calls:
                by_device.setdefault(call.step.device, []).extend(call.grads)
        if not by_device:
            return
        self._grad_norms.update(l2norm_on_each_device(by_device))

    def _launch(self, group: dict[str, Any], call: OpCall, lr: torch.Tensor,
                grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        if call.coded is not None:
            self._launch_coded(group, call, lr, grad_scale, found_inf)
            return
        beta1, beta2 = group["betas"]
        clip = _clip_value(group)
        ops.fused_lamb_(
            call.op_params(),
            call.grads,
            call.state_list("exp_avg"),
            call.state_list("exp_avg_sq"),
            call.masters(),
            call.step,
            lr,
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group["adam_w_mode"]),
            bool(group["bias_correction"]),
            bool(group["grad_averaging"]),
            bool(group["use_nvlamb"]),
            clip,
            self._grad_norms.get(call.step.device) if clip > 0.0 else None,
            grad_scale,
            found_inf,
            write_unscaled_grads=bool(group["write_unscaled_grads"]),
            **call.master_args(group),
        )

    def _launch_coded(self, group: dict[str, Any], call: OpCall, lr: torch.Tensor,
                      grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """The step of params whose moments are block-coded (call.coded, see state_dtype). For
        DTensor params each rank steps its local shards in the op's two halves, with each
        param's sums of squares added over the shards between them (the trust ratio is a
        whole param's), as fused_lamb_'s DTensor rule does."""
        beta1, beta2 = group["betas"]
        clip = _clip_value(group)
        params, grads, masters, codes, scales = coded_call_lists(call, ("exp_avg", "exp_avg_sq"))
        norm = self._grad_norms.get(call.step.device) if clip > 0.0 else None
        args = (
            params, grads, codes[0], scales[0], codes[1], scales[1], masters, call.step, lr,
            float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            bool(group["adam_w_mode"]), bool(group["bias_correction"]),
            bool(group["grad_averaging"]), bool(group["use_nvlamb"]), clip,
            None if norm is None else local(norm), grad_scale, found_inf,
            bool(group["write_unscaled_grads"]),
        )
        options = dict(state_dtype=call.coded, **call.master_args(group))
        if not (call.params and is_dtensor(call.params[0])):
            ops.fused_lamb_coded_(*args, **options)
            return
        from ampfuse.ops.dtensor import combine_over_shards  # loaded: DTensors exist

        sums = torch.zeros((len(params), 2), dtype=torch.float64, device=call.step.device)
        ops.fused_lamb_coded_(*args, sums, "moments", **options)
        combine_over_shards(sums, call.params, "sum")
        ops.fused_lamb_coded_(*args, sums, "apply", **options)

    # ---- state_dict -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout with each param's 'step', plus apex's per-group 'step' (an
        int) where every param of the group has taken the same number of steps, so apex's
        FusedLAMB resumes from it too."""
        return add_group_steps(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads ours, or apex FusedLAMB's (whose step count is one int per group)."""
        super().load_state_dict(spread_group_steps(state_dict))

    def _export_state(self, group: dict[str, Any], state: dict[str, Any],
                      step_value: torch.Tensor | None) -> dict[str, Any]:
        return self._export_moments(state, step_value)

    def _import_state(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                      where: str) -> tuple[dict[str, Any], float | None]:
        return self._import_moments(
            group, p, saved, where, "a LAMB state needs 'exp_avg' and 'exp_avg_sq', and a 'step' "
            "of its own or in its param group.",
        )


def _clip_value(group: dict[str, Any]) -> float:
    clip = group["max_grad_norm"]
    return 0.0 if clip is None else float(clip)

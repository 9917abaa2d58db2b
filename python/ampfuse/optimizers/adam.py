"""FusedAdam and FusedAdamW: Adam/AdamW over whole param lists in one op call per device, with
optional fp32 master weights for fp16/bf16 params, on top of torch.ops.ampfuse.fused_adam_."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from ampfuse import ops
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._coded_optimizer import CodedMomentsOptimizer, coded_call_lists
from ampfuse.optimizers._groups import check_flag, float_betas
from ampfuse.optimizers._state_codes import check_state_dtype
from ampfuse.optimizers._torch_switches import check_implementation_switches


def _resolve_adam_w_mode(name: str, adam_w_mode: bool | None,
                         decoupled_weight_decay: bool | None) -> bool:
    """adam_w_mode (apex's spelling) or decoupled_weight_decay (torch.optim.Adam's), whichever
    was given; decoupled decay when neither was, as in apex. Both given must agree."""
    for key, value in (("adam_w_mode", adam_w_mode),
                       ("decoupled_weight_decay", decoupled_weight_decay)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name}: {key}={value!r}; it must be True or False.")
    if adam_w_mode is None:
        return True if decoupled_weight_decay is None else decoupled_weight_decay
    if decoupled_weight_decay is not None and decoupled_weight_decay != adam_w_mode:
        raise ValueError(
            f"{name}: adam_w_mode={adam_w_mode} and decoupled_weight_decay="
            f"{decoupled_weight_decay} disagree; they are two names (apex's and torch's) for "
            "the same choice. Pass one of them."
        )
    return adam_w_mode


class FusedAdam(CodedMomentsOptimizer):
    """Adam and AdamW in one fused op per param group and device.

    The math and its order are torch.optim.Adam's (adam_w_mode=False: L2 weight decay added to
    the grad) and torch.optim.AdamW's (adam_w_mode=True: decoupled decay, the default here, as in
    apex). Moments are kept in fp32 whatever the params' dtype (or block-coded in 8 bits, see
    state_dtype), and params of several dtypes and devices may share a group.

    Args:
        params: params or param groups, as for any torch.optim optimizer.
        lr, betas, eps, weight_decay, amsgrad, maximize: as in torch.optim.Adam. lr may be a
            one-element tensor (see capturable).
        adam_w_mode: decoupled weight decay (AdamW) when True (the default, as in apex), L2
            (Adam) when False. decoupled_weight_decay is torch.optim.Adam's name for the same
            switch: pass either. A torch.optim.Adam call with weight decay and neither keyword
            therefore gets AdamW here; pass decoupled_weight_decay=False for torch's Adam.
        foreach, fused, differentiable: torch.optim's implementation switches, accepted so
            that a call written for torch's class runs unchanged. foreach and fused pick among
            torch's implementations of the same math; the fused step runs for every value torch
            accepts (not both True). differentiable=True is refused: autograd cannot see
            through a fused in-place step.
        bias_correction: divide by 1 - beta^t as Adam does; False leaves the moments uncorrected.
        master_weights: how low-precision params keep the bits of their updates. True: an
            fp32 master of every fp16/bf16 param in the optimizer state ('master_param'),
            updated and written back rounded to the param's dtype (4 bytes per param). False:
            none, the param is updated in place and rounded to nearest. For bf16 params
            without fp32 masters: "stochastic" rounds stochastically (0 bytes), "kahan" keeps
            a bf16 compensation ('kahan_compensation', 2 bytes), "split" keeps the low 16 bits
            of the fp32 master ('master_low_bits', int16, 2 bytes; the param is the master
            rounded to nearest, True's param but at an even tie, and the master equals True's
            exactly). fp32 params are updated in fp32
            whatever the value; fp16 params are refused by the bf16 modes. Extra state is made
            at a param's first step, and state of another mode (a checkpoint) is converted
            then (docs/optimizers.md, "Master-free bf16 modes").
        state_dtype: how the moments are stored. "fp32" (default): fp32 tensors, as torch keeps
            them (8 bytes per param). "int8": 8-bit codes in blocks of 256 elements with one
            fp32 scale per block (about 2.03 bytes per param): the first moment linear, the
            second as sqrt(v) in an 8-bit float code that keeps its small values. "fp8": both
            as e4m3 codes of blocks of 256 with a scale per block. The codes are decoded,
            updated and coded again inside the fused step (CPU and CUDA give the same bits),
            with every master_weights mode. A param with fewer than 256 elements (a bias, a
            norm) or a complex one keeps fp32 moments. state_dict() holds the codes
            ('exp_avg_codes', 'exp_avg_scales', ...); a checkpoint with fp32 moments loads into
            a coded optimizer and the other way round, converted at each param's next step
            (docs/optimizers.md, "8-bit moments"). A param-group option.
        rounding_seed: the seed of master_weights="stochastic"'s random bits, which depend only
            on (seed, step, param index, element), so runs are reproducible and resume bit for
            bit. A param-group option, saved in state_dict().
        capturable: allow step() to be captured in a CUDA graph. Every step is free of host
            syncs either way; for a learning rate that changes between replays, give lr as a
            CUDA tensor and change it in place (torch's LR schedulers do so for tensor lrs).
        set_grad_none: zero_grad()'s default for set_to_none (apex's spelling).
        write_unscaled_grads: after a step that divides a loss scale out of the grads
            (torch.amp.GradScaler, ampfuse.GradScaler, ampfuse.amp, step(grad_scale=...)),
            leave p.grad unscaled, as torch's optimizers do (default). False keeps the scaled
            grads and saves writing them, one pass over the grads' bytes per step; a skipped
            step leaves them scaled either way, as torch does.
        skip_nonfinite: skip the whole step (params, moments, masters, step counts all left as
            they were) when any grad holds inf/nan, decided on the device with no host sync.
            False (default): never check; the check is one more read of every grad, measurably
            slower (docs/design/optimizers.md). None: check a param group with fp16/bf16 params when
            no loss scaler drives the step (step() gets no found_inf; a GradScaler or amp has
            already checked the grads and hands over its verdict instead), not fp32 groups: the
            guard a bf16 run without a scaler wants. True: check every step, also on top of a
            scaler's found_inf. If any checked grad of any group is non-finite, every group
            skips: one verdict per step.

    Skipped steps: `last_step_skipped` is a 0-dim bool tensor on the params' device saying
    whether the last step() was skipped (by skip_nonfinite or a scaler's found_inf; None before
    the first step), and get_skipped_steps() counts them (on the device; reading syncs).
    state_dict() saves the count as 'skipped_steps'.

    The positional arguments are torch.optim.Adam's, amsgrad the sixth; the rest are
    keyword-only. apex's FusedAdam has another order (bias_correction third, then betas): a
    positional call in apex's order stops at the betas check rather than mixing up the math
    (ampfuse.apex_compat's FusedAdam takes apex's order).

    The fused step honours torch.amp.GradScaler without unscaling the grads first
    (_step_supports_amp_scaling): the scale is divided out inside the op (and the unscaled
    grads are written back, see write_unscaled_grads), and a step with inf/nan grads writes
    nothing at all. step(grad_scale=..., found_inf=...) does the same for
    callers that manage their own loss scale.
    """

    _TORCH_GROUP_KEYS = {
        "decoupled_weight_decay": lambda group: bool(group["adam_w_mode"]),
        "foreach": None,
        "fused": None,
        "differentiable": False,
    }
    _FOREIGN_GROUP_KEYS = ("momentum", "dampening", "nesterov", "wd_after_momentum",
                           "materialize_master_grads")

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        adam_w_mode: bool | None = None,
        bias_correction: bool = True,
        maximize: bool = False,
        master_weights: bool | str = False,
        capturable: bool = False,
        set_grad_none: bool = True,
        write_unscaled_grads: bool = True,
        skip_nonfinite: bool | None = False,
        rounding_seed: int = 0,
        state_dtype: str = "fp32",
        decoupled_weight_decay: bool | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        adam_w_mode = _resolve_adam_w_mode(type(self).__name__, adam_w_mode,
                                           decoupled_weight_decay)
        check_implementation_switches(
            type(self).__name__, self._torch_counterpart({"adam_w_mode": adam_w_mode}),
            foreach, fused, differentiable)
        betas = float_betas(betas)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "capturable": capturable,
            "adam_w_mode": adam_w_mode,
            "bias_correction": bias_correction,
            "master_weights": master_weights,
            "write_unscaled_grads": write_unscaled_grads,
            "skip_nonfinite": skip_nonfinite,
            "rounding_seed": rounding_seed,
            "state_dtype": check_state_dtype(type(self).__name__, state_dtype),
        }
        super().__init__(params, defaults, set_grad_none)

    def _torch_counterpart(self, group: dict[str, Any]) -> str:
        return "torch.optim.AdamW" if group.get("adam_w_mode", True) else "torch.optim.Adam"

    def _check_hyperparameters(self, index: int, group: dict[str, Any]) -> None:
        self._check_lr(index, group["lr"])
        check_flag(self, index, group, "write_unscaled_grads")
        self._check_betas(index, group)
        self._check_nonnegative(index, group, "eps")
        self._check_nonnegative(index, group, "weight_decay")
        check_state_dtype(f"{type(self).__name__}: param_groups[{index}]",
                          group.get("state_dtype", "fp32"))

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        if group["amsgrad"]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def _launch(self, group: dict[str, Any], call: OpCall, lr: torch.Tensor,
                grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        amsgrad = bool(group["amsgrad"])
        # The arguments after the tensor lists, which both ops take alike.
        beta1, beta2 = group["betas"]
        step_args = (call.step, lr, float(beta1), float(beta2), float(group["eps"]),
                     float(group["weight_decay"]), bool(group["adam_w_mode"]),
                     bool(group["bias_correction"]), amsgrad, bool(group["maximize"]),
                     grad_scale, found_inf)
        options = {"write_unscaled_grads": bool(group["write_unscaled_grads"]),
                   **call.master_args(group)}
        if call.coded is None:
            ops.fused_adam_(
                call.op_params(), call.grads, call.state_list("exp_avg"),
                call.state_list("exp_avg_sq"),
                call.state_list("max_exp_avg_sq") if amsgrad else [], call.masters(),
                *step_args, **options)
            return
        # Block-coded moments (state_dtype); FSDP2: each rank's own shards, as plain tensors.
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg",
                                                                             "exp_avg_sq")
        params, grads, masters, codes, scales = coded_call_lists(call, keys)
        if not amsgrad:
            codes.append([])
            scales.append([])
        ops.fused_adam_coded_(
            params, grads, codes[0], scales[0], codes[1], scales[1], codes[2], scales[2],
            masters, *step_args, state_dtype=str(call.coded), **options)

    def _export_state(self, group: dict[str, Any], state: dict[str, Any],
                      step_value: torch.Tensor | None) -> dict[str, Any]:
        return self._export_moments(state, step_value, optional=("max_exp_avg_sq",))

    def _import_state(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                      where: str) -> tuple[dict[str, Any], float | None]:
        return self._import_moments(
            group, p, saved, where, "an Adam state needs 'step', 'exp_avg' and 'exp_avg_sq'.",
            optional=("max_exp_avg_sq",),
        )

    def _import_group(self, saved: dict[str, Any], current: dict[str, Any],
                      new: dict[str, Any]) -> None:
        # A torch.optim checkpoint says Adam or AdamW through decoupled_weight_decay.
        if "adam_w_mode" not in saved and "decoupled_weight_decay" in saved:
            new["adam_w_mode"] = bool(saved["decoupled_weight_decay"])
        super()._import_group(saved, current, new)  # keeps this run's state_dtype


class FusedAdamW(FusedAdam):
    """FusedAdam with decoupled weight decay, defaulting to weight_decay=1e-2 as
    torch.optim.AdamW does. Loading any state dict keeps it AdamW."""

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        maximize: bool = False,
        master_weights: bool | str = False,
        capturable: bool = False,
        set_grad_none: bool = True,
        write_unscaled_grads: bool = True,
        skip_nonfinite: bool | None = False,
        rounding_seed: int = 0,
        state_dtype: str = "fp32",
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            adam_w_mode=True,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
            maximize=maximize,
            master_weights=master_weights,
            capturable=capturable,
            set_grad_none=set_grad_none,
            write_unscaled_grads=write_unscaled_grads,
            skip_nonfinite=skip_nonfinite,
            rounding_seed=rounding_seed,
            state_dtype=state_dtype,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["adam_w_mode"] = True

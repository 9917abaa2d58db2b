"""FusedNovoGrad: apex.optimizers.FusedNovoGrad's NovoGrad (layer-wise adaptive moments, Ginsburg
et al. 2019; the optimizer of Jasper and QuartzNet) over whole param lists, with optional fp32
master weights or the master-free bf16 modes, on top of torch.ops.ampfuse.fused_novograd_."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from ampfuse import ops
from ampfuse.optimizers._base import FusedOptimizer
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._groups import check_flag, float_betas
from ampfuse.optimizers._precision import export_extra
from ampfuse.optimizers._state import (
    add_group_steps,
    fp32_copy,
    fp32_like,
    spread_group_steps,
)

# apex's norm_type values: 2 is the L2 norm, 0 the max (infinity) norm.
NORM_TYPES = (2, 0)


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad in two fused passes per param group and device, in apex's FusedNovoGrad
    arithmetic.

    Each param (layer) keeps one running norm of its grads instead of Adam's per-element second
    moment: the L2 norm blends as sqrt(beta2 * avg^2 + (1 - beta2) * ||g||^2), the max norm
    (norm_type=0) as beta2 * avg + (1 - beta2) * max|g|, starting from the first step's own norm
    (or from 0 with init_zero). With bias_correction the step divides by
    avg / sqrt(1 - beta2^t) + eps and by 1 - beta1^t. By default (reg_inside_moment=False) the
    first moment takes the raw grad and the update is m / denom + weight_decay * param;
    reg_inside_moment=True normalizes the grad and adds the decay before the moment, as the
    NovoGrad paper does. The grad enters the moment times 1 - beta1 with grad_averaging, else
    times 1.

    Args:
        params: params or param groups, as for any torch.optim optimizer.
        lr, bias_correction, betas, eps, weight_decay, reg_inside_moment, grad_averaging,
            norm_type, init_zero: as in apex.optimizers.FusedNovoGrad, in its order with its
            defaults.
        amsgrad: must be False (apex refuses it too).
        master_weights: True keeps an fp32 master of every fp16/bf16 param (as amp's O2
            masters), False updates params in place. For bf16 params without fp32 masters,
            "stochastic", "kahan" and "split" as in FusedAdam (docs/optimizers.md). The
            running norms come from the grads alone, so a mode changes only how the update is
            applied: the value it starts from (the param plus its compensation, or the master
            the param and its low half make up) and how the result is stored. "split" steps
            exactly as True does (masters, moments and running norms bit for bit). fp16 params
            are refused by these modes.
        rounding_seed: the seed of master_weights="stochastic", as in FusedAdam; the random bits
            are keyed as FusedAdam's (seed, step, param index, element).
        set_grad_none, write_unscaled_grads, skip_nonfinite, capturable: as in FusedAdam.

    Differences from apex: the first moment is fp32 for fp16 params too (apex kept it in the
    param's dtype), bf16 params work (apex refused them), and the step count and running norm
    are kept per param, as torch.optim keeps state: a param without a grad in some step neither
    counts that step nor breaks the next (apex asserted that every param had a grad). The saved
    per-param 'step' also keys master_weights="stochastic"'s random bits, so a resumed run draws
    the same ones.
    state_dict() also writes apex's per-group 'step' and 'exp_avg_sq' (the running norms of the
    group's fp16 and fp32 params) where every param of the group has state, and
    load_state_dict() reads them from apex's checkpoints. fp16 grads may come scaled
    (GradScaler, amp): the norms and the update are taken of the unscaled grads, on the device.
    Params may be DTensors (FSDP2): each param's norm is then reduced over its shards
    (ampfuse.ops.dtensor), as one process would.
    """

    _TORCH_GROUP_KEYS = {"foreach": None, "fused": None, "differentiable": False}
    _FOREIGN_GROUP_KEYS = ("momentum", "dampening", "nesterov", "wd_after_momentum",
                           "materialize_master_grads", "maximize", "adam_w_mode", "use_nvlamb",
                           "max_grad_norm", "amsgrad")

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
        *,
        master_weights: bool | str = False,
        capturable: bool = False,
        write_unscaled_grads: bool = True,
        skip_nonfinite: bool | None = False,
        rounding_seed: int = 0,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedNovoGrad: amsgrad=True has no NovoGrad variant (apex refuses "
                             "it too); leave it False.")
        betas = float_betas(betas)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "reg_inside_moment": reg_inside_moment,
            "grad_averaging": grad_averaging,
            "norm_type": norm_type,
            "init_zero": init_zero,
            "master_weights": master_weights,
            "capturable": capturable,
            "write_unscaled_grads": write_unscaled_grads,
            "skip_nonfinite": skip_nonfinite,
            "rounding_seed": rounding_seed,
        }
        super().__init__(params, defaults, set_grad_none)

    # ---- checks ---------------------------------------------------------------------------

    def _check_hyperparameters(self, index: int, group: dict[str, Any]) -> None:
        name = type(self).__name__
        self._check_lr(index, group["lr"])
        for key in ("bias_correction", "reg_inside_moment", "grad_averaging", "init_zero",
                    "write_unscaled_grads"):
            check_flag(self, index, group, key)
        self._check_betas(index, group)
        self._check_nonnegative(index, group, "eps")
        self._check_nonnegative(index, group, "weight_decay")
        norm_type = group["norm_type"]
        if isinstance(norm_type, bool) or norm_type not in NORM_TYPES:
            raise ValueError(
                f"{name}: param_groups[{index}] has norm_type={norm_type!r}; use 2 (the L2 "
                "norm) or 0 (the max norm), as apex.optimizers.FusedNovoGrad."
            )

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "norm_avg")

    def _prepare_state(self, group: dict[str, Any], p: torch.Tensor,
                       state: dict[str, Any]) -> None:
        if "exp_avg" not in state:
            state["exp_avg"] = fp32_like(p)
        if "norm_avg" not in state:
            # One running norm per param, replicated on every rank for a DTensor param: the
            # op reduces its grads over the shards before blending it (ampfuse.ops.dtensor).
            state["norm_avg"] = torch.zeros((), dtype=torch.float32, device=_local_device(p))

    # ---- step -----------------------------------------------------------------------------

    def _launch(self, group: dict[str, Any], call: OpCall, lr: torch.Tensor,
                grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        ops.fused_novograd_(
            call.op_params(),
            call.grads,
            call.state_list("exp_avg"),
            call.state_list("norm_avg"),
            call.masters(),
            call.step,
            lr,
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group["bias_correction"]),
            bool(group["grad_averaging"]),
            bool(group["reg_inside_moment"]),
            int(group["norm_type"]),
            bool(group["init_zero"]),
            grad_scale,
            found_inf,
            write_unscaled_grads=bool(group["write_unscaled_grads"]),
            **call.master_args(group),
        )

    # ---- state_dict -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout, each param's state holding 'step', 'exp_avg' and 'norm_avg'
        (its running grad norm), plus apex's per-group 'step' and 'exp_avg_sq' where every
        param of the group has the same step count, so apex's FusedNovoGrad resumes from it
        too."""
        state_dict = add_group_steps(super().state_dict())
        for group in state_dict["param_groups"]:
            if "step" in group:
                norms = _apex_group_norms(group["params"], state_dict["state"],
                                          self._params_by_index())
                if norms is not None:
                    group["exp_avg_sq"] = norms
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads ours, or apex FusedNovoGrad's (a step count and the running norms of the
        group's fp16 and fp32 params per group, only 'exp_avg' per param)."""
        state_dict = dict(state_dict)
        saved_state = dict(state_dict["state"])
        groups = []
        for index, (saved, group) in enumerate(zip(state_dict["param_groups"],
                                                   self.param_groups)):
            saved = dict(saved)
            norms = saved.pop("exp_avg_sq", None)
            if norms is not None:
                _spread_apex_norms(type(self).__name__, index, norms, saved["params"],
                                   group["params"], saved_state)
            groups.append(saved)
        state_dict["state"] = saved_state
        state_dict["param_groups"] = groups + list(state_dict["param_groups"][len(groups):])
        super().load_state_dict(spread_group_steps(state_dict))

    def _params_by_index(self) -> dict[int, torch.Tensor]:
        params: dict[int, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                params.setdefault(len(params), p)
        return params

    def _export_state(self, group: dict[str, Any], state: dict[str, Any],
                      step_value: torch.Tensor | None) -> dict[str, Any]:
        if step_value is None or "exp_avg" not in state:
            return {}
        out = {"step": step_value, "exp_avg": state["exp_avg"], "norm_avg": state["norm_avg"]}
        export_extra(state, out)
        return out

    def _import_state(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                      where: str) -> tuple[dict[str, Any], float | None]:
        if not saved:
            return {}, None
        if "step" not in saved or "exp_avg" not in saved or "norm_avg" not in saved:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state of {where} has keys "
                f"{sorted(saved)}; a NovoGrad state needs 'exp_avg', 'norm_avg' (or apex's "
                "per-group 'exp_avg_sq') and a 'step' of its own or in its param group."
            )
        self._check_saved_shape(where, "exp_avg", saved["exp_avg"], p)
        norm = saved["norm_avg"]
        if not isinstance(norm, torch.Tensor):
            norm = torch.tensor(float(norm))
        if norm.numel() != 1:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state of {where} has 'norm_avg' of "
                f"shape {tuple(norm.shape)}; it is one running norm per param (one element)."
            )
        imported = {
            "exp_avg": fp32_copy(saved["exp_avg"], p),
            "norm_avg": norm.detach().reshape(()).to(_local_device(p), torch.float32, copy=True),
        }
        self._import_master(group, p, saved, imported, where)
        step = saved["step"]
        return imported, float(step.item() if isinstance(step, torch.Tensor) else step)


def _local_device(p: torch.Tensor) -> torch.device:
    """The device a param's own tensors live on (a DTensor's local shard's)."""
    local = getattr(p, "_local_tensor", None)
    return local.device if local is not None else p.device


def _apex_group_norms(indices: Iterable[int], saved_state: Mapping[Any, dict[str, Any]],
                      params_by_index: Mapping[int, torch.Tensor]) -> list[torch.Tensor] | None:
    """apex's group 'exp_avg_sq': [the running norms of the group's fp16 params, of its fp32
    params], each a float32 tensor in param order; None unless every param has a norm and is
    fp16 or fp32 (apex's only dtypes)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {torch.float16: [], torch.float32: []}
    for i in indices:
        p = params_by_index.get(i)
        norm = saved_state.get(i, {}).get("norm_avg")
        if p is None or norm is None or p.dtype not in by_dtype:
            return None
        by_dtype[p.dtype].append(norm.reshape(1))
    device = next((n.device for n in by_dtype[torch.float32] + by_dtype[torch.float16]), None)
    return [torch.cat(norms) if norms else torch.zeros(0, device=device)
            for norms in by_dtype.values()]


def _spread_apex_norms(name: str, index: int, norms: object, saved_ids: Sequence[int],
                       params: Sequence[torch.Tensor], saved_state: dict[Any, Any]) -> None:
    """Gives each saved param state without a 'norm_avg' its entry of apex's group
    'exp_avg_sq' ([fp16 params' norms, fp32 params' norms], in param order)."""
    if not (isinstance(norms, (list, tuple)) and len(norms) == 2):
        raise ValueError(
            f"{name}.load_state_dict: param_groups[{index}] has 'exp_avg_sq' of type "
            f"{type(norms).__name__}; apex's FusedNovoGrad saves a pair [fp16 norms, fp32 norms]."
        )
    if all("norm_avg" in saved_state[i] for i in saved_ids if saved_state.get(i)):
        return  # ours: each state has its own norm, and the group's copy is only for apex
    lists: dict[torch.dtype, list[int]] = {torch.float16: [], torch.float32: []}
    for i, p in zip(saved_ids, params):
        entry = saved_state.get(i)
        if entry and "norm_avg" not in entry:
            if p.dtype not in lists:
                raise ValueError(
                    f"{name}.load_state_dict: param_groups[{index}] holds apex's 'exp_avg_sq', "
                    f"which keeps norms for fp16 and fp32 params only, but a param is {p.dtype}."
                )
            lists[p.dtype].append(i)
    for (dtype, ids), saved_norms in zip(lists.items(), norms):
        count = 0 if saved_norms is None else int(saved_norms.numel())
        if count != len(ids):
            raise ValueError(
                f"{name}.load_state_dict: param_groups[{index}] has {count} saved {dtype} norms "
                f"in 'exp_avg_sq' but {len(ids)} {dtype} params with state; the checkpoint "
                "belongs to another model (apex keeps one norm per param that had a grad)."
            )
        for k, i in enumerate(ids):
            saved_state[i] = dict(saved_state[i], norm_avg=saved_norms.reshape(-1)[k])


"""apex.optimizers on ampfuse: FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad and
FusedMixedPrecisionLamb with apex's constructors (apex's argument order and defaults) over
ampfuse.optimizers' fused optimizers, so amp takes its fused, sync-free path with them. apex's
submodules (``apex.optimizers.fused_adam`` and the like) are this module too.

Every optimizer of apex.optimizers is here; a name apex did not have raises AttributeError
(ImportError for ``from apex.optimizers import ...``), as with apex.
"""

from __future__ import annotations

import inspect
import numbers

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import required

from ampfuse import optimizers as _fused
from ampfuse.apex_compat.apex._grad_clip import GroupNormClipMixin, check_max_grad_norm
# apex.optimizers.FP16_Optimizer (apex 0.1, imported by pytorch-pretrained-BERT's examples) was
# the wrapper apex.fp16_utils.FP16_Optimizer later became; the alias gives that one.
from ampfuse.apex_compat.apex._fp16_optimizer import FP16_Optimizer  # noqa: F401

__all__ = ["FP16_Optimizer", "FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb",
           "FusedNovoGrad", "FusedSGD"]

# A package to the import system, as apex.contrib.optimizers is (see there): an apex submodule
# the alias lacks then gets the alias's message, not "is not a package".
__path__ = []


class FusedAdam(GroupNormClipMixin, _fused.FusedAdam):
    """apex.optimizers.FusedAdam's signature on ampfuse.optimizers.FusedAdam.

    Same meaning as in apex: AdamW by default (adam_w_mode=False gives Adam's L2 decay), no
    weight decay by default, and zero_grad() sets grads to None. Differences: amsgrad=True works
    here (apex refused it), and master_weights=True needs no capturable=True.

    Two keywords of apex 0.1's FusedAdam, which BERT fine-tuning scripts of that era still pass:
    max_grad_norm > 0 clips each param group's grads by their L2 norm inside the step
    (_grad_clip.py), and eps_inside_sqrt must be False (ampfuse adds eps after the square root,
    as apex's later FusedAdam and torch do).
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False, master_weights=False, *, eps_inside_sqrt=False,
                 max_grad_norm=0.0):
        if eps_inside_sqrt:
            raise ValueError(
                "FusedAdam: eps_inside_sqrt=True (apex 0.1) divides by sqrt(v + eps); ampfuse's "
                "FusedAdam divides by sqrt(v) + eps, as apex's later FusedAdam and torch do. "
                "Leave it False.")
        self._max_grad_norm = check_max_grad_norm(max_grad_norm)
        self._init_clip()
        super().__init__(params, lr, betas, eps, weight_decay, adam_w_mode=adam_w_mode,
                         bias_correction=bias_correction, amsgrad=amsgrad,
                         master_weights=master_weights, capturable=capturable,
                         set_grad_none=set_grad_none)
        # In the defaults too, so that a pickled or copied optimizer keeps it for later groups.
        self.defaults["max_grad_norm"] = self._max_grad_norm

    def add_param_group(self, param_group):
        default = self.__dict__.get("_max_grad_norm", self.defaults.get("max_grad_norm", 0.0))
        param_group.setdefault("max_grad_norm", default)
        check_max_grad_norm(param_group["max_grad_norm"])
        super().add_param_group(param_group)


def _accepts(cls, name) -> bool:
    return name in inspect.signature(cls.__init__).parameters


class FusedSGD(_fused.FusedSGD):
    """apex.optimizers.FusedSGD's signature on ampfuse.optimizers.FusedSGD.

    As in apex, lr may be left out when every param group carries its own, and zero_grad()
    zeroes grads rather than dropping them (set_grad_none=False).
    """

    def __init__(self, params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=False):
        extra = {}
        if _accepts(_fused.FusedSGD, "wd_after_momentum"):
            extra["wd_after_momentum"] = wd_after_momentum
        elif wd_after_momentum:
            raise NotImplementedError(
                "apex.optimizers.FusedSGD: wd_after_momentum=True is not supported by this "
                "ampfuse version; leave it False (torch.optim.SGD's order).")
        # Where ampfuse lacks the flag, leaving it out changes no result: it only chooses
        # whether amp's O2 masters get fp32 grads of their own before the step.
        if _accepts(_fused.FusedSGD, "materialize_master_grads"):
            extra["materialize_master_grads"] = materialize_master_grads
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov,
                         set_grad_none=set_grad_none, **extra)


class FusedLAMB(_fused.FusedLAMB):
    """apex.optimizers.FusedLAMB on ampfuse.optimizers.FusedLAMB, which already takes apex's
    arguments in apex's order with apex's defaults (see its docstring for the differences:
    fp32 moments, p.grad left as it was, per-param step counts)."""


class FusedNovoGrad(_fused.FusedNovoGrad):
    """apex.optimizers.FusedNovoGrad's signature on ampfuse.optimizers.FusedNovoGrad (which
    takes apex's arguments in apex's order, plus keyword-only options; see its docstring for
    the differences: fp32 moments, bf16 params, per-param step counts and running norms)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True,
                 norm_type=2, init_zero=False, set_grad_none=True):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         reg_inside_moment, grad_averaging, norm_type, init_zero, set_grad_none)


class FusedMixedPrecisionLamb(_fused.FusedLAMB):
    """apex.optimizers.FusedMixedPrecisionLamb on ampfuse.optimizers.FusedLAMB: the same LAMB,
    with apex's constructor and its ways of driving it.

    - reduced_precision_dtype=torch.float16 or torch.bfloat16 keeps fp32 masters of the
      low-precision params (FusedLAMB's master_weights=True; apex made them only for params of
      exactly that dtype, here every fp16/bf16 param gets one); None or torch.float32 updates
      params in place. Any other value is refused. As in apex, the attribute may also be set
      after the constructor, up to the first step() (apex's own tests do); later, when the
      masters exist or not already, it is refused.
    - step: the step count each param starts from (an int >= 0), as apex's group count did.
    - Each param group's lr is a float32 tensor on the params' device, as in apex (schedulers
      fill it in place); assigning a float works too.
    - step(closure, grad_scaler): a torch.amp.GradScaler (or ampfuse.GradScaler) passes itself
      here; its scale and inf check go to the fused step, which skips an overflowing step on
      the device. After scaler.unscale_(optimizer) the grads are taken as unscaled (apex would
      have divided them again).
    - max_grad_norm: a param group may carry its own (apex used the constructor's for all).
    """

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True,
                 grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False,
                 reduced_precision_dtype=None):
        _check_reduced_precision_dtype(reduced_precision_dtype)
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"FusedMixedPrecisionLamb: step={step!r}; the step count to start "
                             "from must be an int >= 0.")
        self._first_step_count = float(step)
        self._reduced_precision_dtype = reduced_precision_dtype
        masters = reduced_precision_dtype in (torch.float16, torch.bfloat16)
        super().__init__(params, float(lr), bias_correction, betas, eps, weight_decay, amsgrad,
                         adam_w_mode, grad_averaging, True, max_grad_norm, use_nvlamb,
                         master_weights=masters)

    @property
    def reduced_precision_dtype(self):
        return self._reduced_precision_dtype

    @reduced_precision_dtype.setter
    def reduced_precision_dtype(self, dtype):
        # apex read the attribute at the first step(), when it made the fp32 copies.
        _check_reduced_precision_dtype(dtype)
        if self.state:
            raise ValueError(
                f"FusedMixedPrecisionLamb: reduced_precision_dtype={dtype!r} set after the first "
                "step(); it decides whether fp32 masters are made, which happened at that step. "
                "Set it in the constructor or before the first step().")
        masters = dtype in (torch.float16, torch.bfloat16)
        self.defaults["master_weights"] = masters
        for group in self.param_groups:
            group["master_weights"] = masters
        self._reduced_precision_dtype = dtype

    def __getstate__(self):
        state = super().__getstate__()
        state["first_step_count"] = self._first_step_count
        state["reduced_precision_dtype"] = self.reduced_precision_dtype
        return state

    def __setstate__(self, state):
        self._first_step_count = state.pop("first_step_count", 0.0)
        self._reduced_precision_dtype = state.pop("reduced_precision_dtype", None)
        super().__setstate__(state)

    def add_param_group(self, param_group):
        """As torch's, then the group's lr becomes a float32 tensor of its own on its params'
        device (apex cloned its tensor defaults per group, so groups never share one)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        lr = group["lr"]
        value = lr.detach().clone() if isinstance(lr, torch.Tensor) else torch.tensor(float(lr))
        group["lr"] = value.to(device=device, dtype=torch.float32).reshape(())

    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is None:
            return super().step(closure)
        grad_scale, found_inf = _scaler_arguments(grad_scaler, self)
        return super().step(closure, grad_scale=grad_scale, found_inf=found_inf)


def _check_reduced_precision_dtype(dtype):
    if dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"FusedMixedPrecisionLamb: reduced_precision_dtype={dtype!r}; use torch.float16 or "
            "torch.bfloat16 (fp32 masters for those params) or None.")


def _scaler_arguments(scaler, optimizer):
    """What a GradScaler that passes itself to step() means for the fused step: its scale (None
    when scaler.unscale_(optimizer) already divided it out) and its overflow flag, summed over
    the devices onto the first one (None when no param has a grad). Checking the grads here
    records the flags, which scaler.update() reads, as apex's optimizer did."""
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        grad_scale, flags = None, state["found_inf_per_device"]
    else:
        flags = scaler._check_inf_per_device(optimizer)
        grad_scale = scaler._get_scale_async()
    if not flags:
        return grad_scale, None
    home = optimizer._first_device()
    found_inf = sum(flag.to(home, non_blocking=True) for flag in flags.values())
    return grad_scale, found_inf.reshape(1).float()


class FusedAdagrad(_fused.FusedAdagrad):
    """apex.optimizers.FusedAdagrad's signature on ampfuse.optimizers.FusedAdagrad: apex's
    defaults (lr=1e-2, eps=1e-10, no decay), adagrad_w_mode for the decoupled decay, and
    zero_grad() dropping grads. Differences: the sums are fp32 for fp16 params too (apex kept
    them in the param's dtype), and bf16 params work (apex refused them)."""

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True,
                 adagrad_w_mode=False):
        super().__init__(params, lr, weight_decay=weight_decay, eps=eps,
                         adagrad_w_mode=adagrad_w_mode, set_grad_none=set_grad_none)

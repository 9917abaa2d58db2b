"""apex.fp16_utils.FP16_Optimizer on ampfuse: wraps any torch optimizer of an fp16/bf16 model with
fp32 master params and a static or dynamic loss scale, with apex's methods (backward,
update_master_grads, step, clip_master_grads, zero_grad, state_dict, inspect_master_grad_data,
loss_scale).

Each backward's grads are unscaled into the masters' fp32 grads in one fused op that also finds
inf/nan (ampfuse.scaling.LossScaler, apex's dynamic rule: init 2**16, x2 after 2000 clean
steps, /2 on an overflow, within [min_loss_scale, 2**24]); an overflowing step is skipped with
the masters, the optimizer state and the model as they were. As in apex, whether it overflowed
is read on the host once per step.
"""

from __future__ import annotations

import torch

from ampfuse.apex_compat.apex._master_copies import master_params_to_model_params
from ampfuse.scaling.loss_scaler import LossScaler

_LOW = (torch.float16, torch.bfloat16)
# dynamic_loss_args that apex's FP16_Optimizer passed on to its loss scaler, and ours.
_DYNAMIC_ARGS = {"init_scale": "init_scale", "scale_factor": None, "scale_window":
                 "growth_interval", "min_loss_scale": "min_scale", "max_loss_scale": "max_scale"}


def _dynamic_scaler(args, device):
    options = {"init_scale": 2.0**16, "growth_interval": 2000, "max_scale": 2.0**24}
    factor = 2.0
    for key, value in (args or {}).items():
        if key not in _DYNAMIC_ARGS:
            raise ValueError(
                f"FP16_Optimizer: dynamic_loss_args has {key!r}; it takes "
                f"{sorted(_DYNAMIC_ARGS)} (apex's names).")
        if key == "scale_factor":
            factor = float(value)
        elif value is not None:
            options[_DYNAMIC_ARGS[key]] = value
    return LossScaler(dynamic=True, growth_factor=factor, backoff_factor=1.0 / factor,
                      device=device, **options)


class FP16_Optimizer:  # noqa: N801  (apex's name)
    """apex.fp16_utils.FP16_Optimizer(init_optimizer, static_loss_scale=1.0,
    dynamic_loss_scale=False, dynamic_loss_args=None, verbose=True)."""

    def __init__(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                 dynamic_loss_args=None, verbose=True):
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups = [], [], []
        device = None
        for index, group in enumerate(self.optimizer.param_groups):
            low, masters, full = [], [], []
            for i, param in enumerate(group["params"]):
                device = device or param.device
                if not param.requires_grad:
                    continue
                if param.dtype in _LOW:
                    master = param.detach().clone().float().requires_grad_()
                    group["params"][i] = master
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                    low.append(param)
                    masters.append(master)
                elif param.dtype == torch.float32:
                    full.append(param)
                else:
                    raise TypeError(
                        f"FP16_Optimizer: param_groups[{index}] holds a {param.dtype} param; it "
                        "wraps float16, bfloat16 and float32 params only.")
            self.fp16_groups.append(low)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(full)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        # Recasts moved state to the masters, as apex did.
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        device = device or torch.device("cpu")
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        if self.dynamic_loss_scale:
            self.loss_scaler = _dynamic_scaler(dynamic_loss_args, device)
        else:
            self.loss_scaler = LossScaler(static_loss_scale, dynamic=False, device=device)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def maybe_print(self, msg):
        if self.verbose:
            print(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # ---- gradients --------------------------------------------------------------------------

    def zero_grad(self, set_grads_to_None=False):  # noqa: N803  (apex's name)
        """Zeroes (or drops) the masters' and the fp16 model's grads."""
        for param in [p for g in self.optimizer.param_groups for p in g["params"]] + \
                self.all_fp16_params:
            if set_grads_to_None:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()

    def backward(self, loss, update_master_grads=True, retain_graph=False):
        """Backpropagates loss.float() * loss_scale; then, unless update_master_grads=False
        (several losses per step), update_master_grads()."""
        (loss.float() * self.loss_scaler.scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Unscales the fp16 grads into the masters' fp32 grads and the fp32 params' grads in
        place, flags inf/nan, reads the flag (self.overflow) and updates a dynamic scale."""
        scaler = self.loss_scaler
        scaler.begin_step()
        src, dst = [], []
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model.grad is not None:
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                src.append(model.grad)
                dst.append(master.grad)
        if src:
            scaler.unscale_into_(src, dst)
        full = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
        if full:
            scaler.unscale_(full)
        self.overflow = bool(scaler.found_inf.item())
        scaler.update()

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clips the fp32 master grads; returns their total norm, or -1 after an overflow."""
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def inspect_master_grad_data(self):
        """The masters' grads per param group (None after an overflow)."""
        if self.overflow:
            print("Warning: calling FP16_Optimizer.inspect_master_grad_data while in an overflow "
                  "state. Gradients are currently invalid (may be inf, nan, or stale). "
                  "Returning None.")
            return None
        return [[None if p.grad is None else p.grad.data for p in g["params"]]
                for g in self.optimizer.param_groups]

    # ---- step -------------------------------------------------------------------------------

    def step(self, closure=None):
        """Steps the wrapped optimizer on the masters and copies them into the model, unless the
        last update_master_grads() found inf/nan (then nothing changes)."""
        if self.overflow:
            self.maybe_print("Gradient overflow. Skipping step, reducing loss scale to "
                             f"{self.loss_scaler.scale_value()}")
            return None
        if closure is not None:
            retval = self._step_with_closure(closure)
        else:
            retval = self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure):
        def wrapped_closure():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                self.maybe_print("OVERFLOW within closure! Skipping step, reducing loss scale "
                                 f"to {self.loss_scaler.scale_value()}")
                loss = closure()
            return loss

        retval = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        return retval

    def _master_params_to_model_params(self):
        if self.all_fp16_params:
            master_params_to_model_params(self.all_fp16_params, self.all_fp32_from_fp16_params)

    # ---- checkpoints and apex's attributes ----------------------------------------------------

    def state_dict(self):
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict):
        """Loads state_dict(); call model.load_state_dict() first, as with apex. An apex
        checkpoint's pickled scaler gives its scale (its cur_scale or _loss_scale)."""
        saved = state_dict["loss_scaler"]
        if isinstance(saved, dict):
            self.loss_scaler.load_state_dict(saved)
        else:
            scale = getattr(saved, "cur_scale", getattr(saved, "_loss_scale", None))
            if scale is None:
                raise ValueError(
                    "FP16_Optimizer.load_state_dict: 'loss_scaler' is neither a dict nor an apex "
                    f"loss scaler with a cur_scale or _loss_scale ({type(saved).__name__}).")
            self.loss_scaler.scale.fill_(float(scale))
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        for current_group, saved_group in zip(self.fp32_from_fp16_groups,
                                              state_dict["fp32_from_fp16"]):
            for current, saved_master in zip(current_group, saved_group):
                current.data.copy_(saved_master.data)

    @property
    def loss_scale(self):
        return self.loss_scaler.scale_value()

    @loss_scale.setter
    def loss_scale(self, value):
        self.loss_scaler.scale.fill_(float(value))

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

"""AmpHandle: everything amp.initialize sets up for one set of models and optimizers.

The handle owns the loss scalers (one per loss), the hooks it installed, and one binding per
optimizer that says how that optimizer's gradients are unscaled and how an overflowing step is
skipped:

- "fold": an ampfuse fused optimizer with a single loss. Gradients are only checked for
  inf/nan; the optimizer divides the scale out inside its fused step and skips it on the
  device (optimizer.grad_scale / optimizer.found_inf, torch's GradScaler protocol). No host sync.
- "inplace": gradients are unscaled in place at the end of scale_loss. For a torch.optim
  optimizer, skipping needs the overflow flag on the host (one read per step, as with
  torch.amp.GradScaler and non-fused optimizers): the grads of an overflowing step are
  dropped (set to None), so torch.optim leaves params and state untouched.
- "masters": a torch.optim optimizer at O2. It steps on fp32 master params that amp made
  from the fp32 weights before the model was cast; gradients are unscaled into the masters'
  grads, and a step post-hook copies the masters back into the model.

The handle is attached to its models and optimizers (attribute `_ampfuse_amp`), which is how
amp.scale_loss and the other module-level functions find it: no module-level state.
"""

from __future__ import annotations

import logging

import torch

from ampfuse import _ops
from ampfuse.loss_scaler import LossScaler
from ampfuse.optimizers._base import FusedOptimizer

log = logging.getLogger("ampfuse.amp")

# Overflows are summarized at most once per this many steps, on rank 0 only.
REPORT_EVERY = 100


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


def _optimizer_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


class _Binding:
    def __init__(self, optimizer, kind, masters=None):
        self.optimizer = optimizer
        self.kind = kind
        self.masters = masters or []  # (model param, fp32 master) pairs, "masters" kind only
        self.unscaled_pending = False  # grads hold unscaled values since the last step
        self.skip_step = False  # an overflow was seen since the last step (host-side kinds)
        self.found_inf = None  # device flag across several losses ("inplace" fused)
        self.fold_pending = False  # "fold": grads still carry the scale the step will divide out
        self.skipped = None  # device count of skipped optimizer steps
        self.hook = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs):
        if self.kind == "masters":
            models = [p for p, _ in self.masters]
            masters = [m for _, m in self.masters]
            _ops.multi_tensor_scale_(masters, models, _one(masters), _flag(masters))
        self._count_skip()
        if isinstance(optimizer, FusedOptimizer):
            # Master grads made for clipping (materialize_unscaled_grads) serve one step only.
            optimizer._step_on_master_grads = False
            for p in _optimizer_params(optimizer):
                master = optimizer.state.get(p, {}).get("master_param")
                if master is not None:
                    master.grad = None
        self.unscaled_pending = False
        self.skip_step = False
        self.found_inf = None
        self.fold_pending = False

    def _count_skip(self):
        flag = None
        if self.kind in ("masters", "inplace") and not isinstance(self.optimizer, FusedOptimizer):
            flag = 1.0 if self.skip_step else None
        elif self.kind == "fold" and self.fold_pending:
            flag = getattr(self.optimizer, "found_inf", None)
        elif self.found_inf is not None:
            flag = self.found_inf
        if flag is None:
            return
        if self.skipped is None:
            params = _optimizer_params(self.optimizer)
            self.skipped = _flag(params)
        self.skipped += flag if isinstance(flag, float) else flag.reshape(1).clamp(max=1.0)

    def materialize_unscaled_grads(self):
        """For "fold": turns the still-scaled grads into unscaled ones that a caller can read
        and change (apex's clip_grad_norm_(amp.master_params(opt)) recipe): fp32 grads on the
        masters for low-precision params, the params' own grads unscaled in place otherwise.
        The fused step then uses them and divides nothing out."""
        if self.kind != "fold" or not self.fold_pending:
            return
        optimizer = self.optimizer
        inv = optimizer.grad_scale.double().reciprocal().float().reshape(1)
        flag = torch.zeros_like(inv)
        sources, targets, in_place = [], [], []
        for p in _optimizer_params(optimizer):
            if p.grad is None:
                continue
            master = optimizer.state.get(p, {}).get("master_param")
            if master is not None:
                master.grad = torch.empty_like(master)
                sources.append(p.grad)
                targets.append(master.grad)
            else:
                in_place.append(p.grad)
        if sources:
            _ops.multi_tensor_scale_(sources, targets, inv, flag)
        if in_place:
            _ops.multi_tensor_unscale_(in_place, flag, inv)
        optimizer.grad_scale = None
        optimizer._step_on_master_grads = bool(sources)
        self.fold_pending = False
        self.found_inf = optimizer.found_inf

    def params_with_grads(self):
        if self.kind == "masters":
            # The model's grads arrive on the low-precision params; masters get them unscaled.
            return [p for p, _ in self.masters] + self._unmastered()
        return _optimizer_params(self.optimizer)

    def _unmastered(self):
        mastered = {id(m) for _, m in self.masters}
        return [p for p in _optimizer_params(self.optimizer) if id(p) not in mastered]


def _one(tensors):
    device = tensors[0].device if tensors else "cpu"
    return torch.ones(1, device=device)


def _flag(tensors):
    device = tensors[0].device if tensors else "cpu"
    return torch.zeros(1, device=device)


class AmpHandle:
    def __init__(self, props, low, device, num_losses, min_loss_scale, max_loss_scale,
                 hysteresis, verbosity, enabled=True, growth_interval=2000):
        self.props = props
        self.low = low
        self.device = device
        self.verbosity = verbosity
        self.enabled = enabled
        self.bindings = []
        self.hooks = []
        self.steps = 0
        self._reported_skips = 0
        dynamic = props.loss_scale == "dynamic"
        init = 2.0**16 if dynamic else float(props.loss_scale)
        self.scalers = [
            LossScaler(init, dynamic=dynamic, hysteresis=hysteresis, min_scale=min_loss_scale,
                       max_scale=max_loss_scale, growth_interval=growth_interval, device=device)
            for _ in range(num_losses)
        ]

    # ---- binding optimizers ------------------------------------------------------------

    def bind(self, optimizer, fp32_originals):
        """Decides how `optimizer` is unscaled and skipped; `fp32_originals` maps each model
        param cast to the low dtype to a copy of its fp32 value from before the cast."""
        fused = isinstance(optimizer, FusedOptimizer)
        wants_masters = self.props.master_weights and fp32_originals
        if fused:
            if wants_masters:
                for group in optimizer.param_groups:
                    group["master_weights"] = True
                    for p in group["params"]:
                        if p in fp32_originals:
                            optimizer.state[p]["master_param"] = fp32_originals[p]
            kind = "fold" if len(self.scalers) == 1 else "inplace"
            binding = _Binding(optimizer, kind)
        elif wants_masters:
            binding = _Binding(optimizer, "masters", self._swap_in_masters(optimizer,
                                                                           fp32_originals))
        else:
            binding = _Binding(optimizer, "inplace")
        self.bindings.append(binding)
        return binding

    @staticmethod
    def _swap_in_masters(optimizer, fp32_originals):
        pairs = []
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p not in fp32_originals:
                    continue
                master = torch.nn.Parameter(fp32_originals[p], requires_grad=p.requires_grad)
                group["params"][i] = master
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                pairs.append((p, master))
        return pairs

    def binding_of(self, optimizer):
        for binding in self.bindings:
            if binding.optimizer is optimizer:
                return binding
        raise RuntimeError("amp: this optimizer was not passed to amp.initialize.")

    # ---- scale_loss ---------------------------------------------------------------------

    def before_backward(self, bindings, loss_id):
        """Grads still holding unscaled values from an earlier loss of this step are brought to
        this loss's scale, so that the backward adds like to like."""
        scaler = self.scalers[loss_id]
        for b in bindings:
            if b.unscaled_pending and b.kind == "inplace":
                grads = _grads(b.params_with_grads())
                if grads:
                    _ops.multi_tensor_scale_(grads, grads, scaler.scale, _flag(grads))

    def after_backward(self, bindings, loss_id):
        scaler = self.scalers[loss_id]
        scaler.begin_step()
        for b in bindings:
            self._unscale(b, scaler)
        scaler.update()
        self.steps += 1
        self._maybe_report()

    def _unscale(self, b, scaler):
        if b.kind == "fold":
            scaler.check_(_grads(b.params_with_grads()))
            # The optimizer divides by this scale inside its step; the scaler's own scale may
            # change in update() before the step runs, so the optimizer gets a copy.
            b.optimizer.grad_scale = scaler.scale.clone()
            b.optimizer.found_inf = scaler.found_inf.clone()
            b.fold_pending = True
            return
        if b.kind == "inplace":
            grads = _grads(b.params_with_grads())
            scaler.unscale_(grads)
            b.unscaled_pending = True
            if isinstance(b.optimizer, FusedOptimizer):
                b.found_inf = (scaler.found_inf.clone() if b.found_inf is None
                               else torch.maximum(b.found_inf, scaler.found_inf))
                b.optimizer.grad_scale = None
                b.optimizer.found_inf = b.found_inf
            else:
                self._skip_on_host(b, scaler, [p for p in b.params_with_grads()])
            return
        # "masters": unscale the low-precision grads into fp32 master grads, accumulating over
        # several losses of one step, then release the model's grads.
        sources, targets, fresh = [], [], []
        for p, master in b.masters:
            if p.grad is None:
                continue
            sources.append(p.grad)
            if master.grad is None:
                master.grad = torch.empty_like(master)
                targets.append(master.grad)
            elif not b.unscaled_pending:
                targets.append(master.grad)  # first loss of this step: overwrite
            else:
                buffer = torch.empty_like(master)
                targets.append(buffer)
                fresh.append((master.grad, buffer))
        if sources:
            scaler.unscale_into_(sources, targets)
        if fresh:
            torch._foreach_add_([a for a, _ in fresh], [t for _, t in fresh])
        for p, _ in b.masters:
            p.grad = None
        others = _grads(b._unmastered())
        if others:
            scaler.unscale_(others)
        b.unscaled_pending = True
        self._skip_on_host(b, scaler, [m for _, m in b.masters] + b._unmastered())

    @staticmethod
    def _skip_on_host(b, scaler, params):
        # torch.optim cannot skip on the device: read the flag once, and drop the grads of an
        # overflowing step so that step() leaves every param and its state untouched.
        if b.skip_step or scaler.found_inf.item() != 0.0:
            b.skip_step = True
            for p in params:
                p.grad = None

    def _maybe_report(self):
        if self.verbosity <= 0 or self.steps % REPORT_EVERY != 0:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_rank() != 0:
                return
        skipped = self.skipped_steps()
        if skipped > self._reported_skips:
            scales = ", ".join(f"{s.scale_value():g}" for s in self.scalers)
            log.warning(
                "ampfuse.amp: %d step(s) skipped for gradient overflow in the last %d steps "
                "(%d in all); loss scale now %s.",
                skipped - self._reported_skips, REPORT_EVERY, skipped, scales,
            )
            self._reported_skips = skipped

    # ---- reading and checkpoints ---------------------------------------------------------

    def skipped_steps(self) -> int:
        """Optimizer steps skipped for overflow (the most over this handle's optimizers: they
        skip together). Several overflowing losses in one step count once."""
        counts = [int(b.skipped.item()) for b in self.bindings if b.skipped is not None]
        return max(counts, default=0)

    def state_dict(self) -> dict:
        state = {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.scalers)}
        masters = [[m.detach().clone() for _, m in b.masters] for b in self.bindings]
        if any(masters):
            state["master_params"] = masters
        state["skipped_steps"] = [0 if b.skipped is None else int(b.skipped.item())
                                  for b in self.bindings]
        unstepped = [self._unstepped_fused_masters(b) for b in self.bindings]
        if any(unstepped):
            state["unstepped_fused_masters"] = unstepped
        return state

    @staticmethod
    def _unstepped_fused_masters(b) -> dict:
        """Masters amp seeded into a fused optimizer for params that have not stepped yet. The
        optimizer's own state_dict leaves them out (torch.optim would read a state without
        'step' as corrupt), so amp's checkpoint carries them, by position in the param groups."""
        if not isinstance(b.optimizer, FusedOptimizer):
            return {}
        out = {}
        for i, p in enumerate(_optimizer_params(b.optimizer)):
            st = b.optimizer.state.get(p, {})
            if "master_param" in st and "step" not in st:
                out[i] = st["master_param"].detach().clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        for i, s in enumerate(self.scalers):
            key = f"loss_scaler{i}"
            if key not in state:
                raise KeyError(
                    f"amp.load_state_dict: the state has no {key!r}; it was saved with fewer "
                    "losses (num_losses) than this run uses."
                )
            s.load_state_dict(state[key])
        for b, count in zip(self.bindings, state.get("skipped_steps", [])):
            if b.skipped is None:
                b.skipped = _flag(_optimizer_params(b.optimizer))
            b.skipped.fill_(float(count))
        saved = state.get("master_params", [])
        for b, values in zip(self.bindings, saved):
            if len(values) != len(b.masters):
                raise ValueError(
                    f"amp.load_state_dict: the checkpoint holds {len(values)} master params for "
                    f"an optimizer that has {len(b.masters)}; was it saved from another model?"
                )
            with torch.no_grad():
                for (p, master), value in zip(b.masters, values):
                    master.copy_(value)
                    p.copy_(value)
        for b, entries in zip(self.bindings, state.get("unstepped_fused_masters", [])):
            params = _optimizer_params(b.optimizer)
            for i, value in entries.items():
                if i >= len(params) or params[i].shape != value.shape:
                    raise ValueError(
                        "amp.load_state_dict: the checkpoint's fp32 masters do not match this "
                        "optimizer's params; was it saved from another model?"
                    )
                state_of_p = b.optimizer.state[params[i]]
                if "step" not in state_of_p:
                    state_of_p["master_param"] = value.to(params[i].device, torch.float32).clone()

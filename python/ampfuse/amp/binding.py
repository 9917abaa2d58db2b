"""Binding: how amp unscales one optimizer's gradients and skips its overflowing steps.

Three kinds, chosen at amp.initialize:

- "fold": an ampfuse fused optimizer and a single loss. Gradients are only checked for inf/nan;
  the optimizer divides the scale out inside its fused step and skips it on the device (its
  `grad_scale` / `found_inf` attributes, torch's GradScaler protocol). No host sync. All the
  micro-batches of one step are scaled by the same scale (the "window" scale, taken at the
  first scale_loss after a step), so gradients accumulated over them add up exactly even when
  the dynamic scale changes in between.
- "inplace": gradients are unscaled in place at the end of each scale_loss. Gradients unscaled
  by an earlier scale_loss of the same step are stashed during the next backward and added back
  after it is unscaled, so each micro-batch is divided by its own scale exactly once (apex's
  "stashed gradients"). For a torch.optim optimizer, skipping needs the overflow flag on the
  host (one read per step, as with torch.amp.GradScaler): the grads of an overflowing step are
  dropped (set to None), so torch.optim leaves params and state untouched.
- "masters": a torch.optim optimizer at O2. It steps on fp32 master params that amp swapped into
  its param groups; gradients are unscaled into the masters' grads (accumulated over the
  micro-batches of a step), and a step post-hook copies the masters back into the model.

Everything set for one step (window scale, overflow flags, stashes, the attributes set on the
optimizer) is cleared by the optimizer's step, so none of it leaks into the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from ampfuse import ops
from ampfuse.amp.attribution import StepAttribution, place_in_optimizer
from ampfuse.amp.masters import MasterTracker, refresh_master
from ampfuse.amp.optimizer_access import hookable, optimizer_params, params_and_grads
from ampfuse.optimizers import FusedOptimizer
from ampfuse.scaling.loss_scaler import LossScaler

_LOW = (torch.float16, torch.bfloat16)


def _flag_like(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    if tensors:
        device = tensors[0].device
    return torch.zeros(1, device=device)


class Binding:
    def __init__(self, optimizer: Any, kind: str, device: torch.device,
                 masters: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 attribute_overflow: bool = False) -> None:
        self.optimizer = optimizer  # a torch.optim.Optimizer, or a wrapper of one (LARC)
        # A FusedOptimizer where self.fused, else a torch.optim.Optimizer.
        self.inner: Any = cast(Any, hookable(optimizer))
        self.fused = isinstance(self.inner, FusedOptimizer)
        self.kind = kind
        self.device = device
        self.masters = masters or []  # (model param, fp32 master) pairs, "masters" kind only
        # Writes to the model params behind the "masters" kind's masters; a fused optimizer
        # keeps its own marks and follows the model in its step.
        self.tracker = MasterTracker()
        self.skipped: torch.Tensor | None = None  # device count of skipped optimizer steps
        # Which grads held inf/nan (amp.last_overflow, the summary); None when turned off.
        self.attribution = StepAttribution(device) if attribute_overflow else None
        self._param_count = len(optimizer_params(optimizer))
        self._end_step()
        self._mark(p for p, _ in self.master_pairs())
        self._hooks = [
            self.inner.register_step_pre_hook(self._before_step),
            self.inner.register_step_post_hook(self._after_step),
        ]

    # ---- per-step state -----------------------------------------------------------------

    def _end_step(self) -> None:
        self.window: torch.Tensor | None = None  # "fold": the scale the accumulated grads carry
        # "fold": overflow flag of this step's micro-batches
        self.window_inf: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None  # "inplace" fused: overflow flag of this step
        self.skip_step = False  # torch.optim kinds: an overflow was seen (host)
        self.unscaled_pending = False  # grads hold unscaled values since the last step
        self.delayed = False  # the last scale_loss used delay_unscale=True
        # (param, unscaled grad) of earlier losses, during a backward
        self.stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        # (grad_scale, found_inf) amp put on the optimizer
        self._set_on_optimizer: tuple[torch.Tensor | None, torch.Tensor | None] | None = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    # ---- params -------------------------------------------------------------------------

    def params_with_grads(self) -> list[torch.Tensor]:
        if self.kind == "masters":
            # The model's grads arrive on the low-precision params; masters get them unscaled.
            return [p for p, _ in self.masters] + self.unmastered()
        return optimizer_params(self.optimizer)

    def unmastered(self) -> list[torch.Tensor]:
        mastered = {id(m) for _, m in self.masters}
        return [p for p in optimizer_params(self.optimizer) if id(p) not in mastered]

    def master_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, fp32 master) for every low-precision param this optimizer updates
        through a master."""
        if self.kind == "masters":
            return list(self.masters)
        if not self.fused:
            return []
        return list(self.inner.masters().items())

    def adopt_new_params(self, make_master: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Params added with add_param_group since the last look: a low-precision one gets an
        fp32 master at O2, as apex gave it (`make_master(param)` returns the master)."""
        count = len(optimizer_params(self.optimizer))
        if count == self._param_count:
            return
        self._param_count = count
        if self.kind != "masters":
            return
        known = {id(m) for _, m in self.masters}
        for group in self.optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in known or p.dtype not in _LOW:
                    continue
                master = make_master(p)
                group["params"][i] = master
                self.masters.append((p, master))
                self.tracker.mark([p])

    def _mark(self, params: Iterable[torch.Tensor]) -> None:
        """Records `params` as in step with their masters."""
        if self.kind == "masters":
            self.tracker.mark(params)
        elif self.fused:
            self.inner.mark_masters(params)

    def follow_model(self) -> None:
        """Remakes the masters of model params that something other than a step wrote (a
        fused optimizer does this itself, in its step)."""
        if self.kind != "masters" or not self.masters:
            return
        pairs = self.masters
        changed = {id(p) for p in self.tracker.changed(p for p, _ in pairs)}
        for p, master in pairs:
            if id(p) in changed:
                refresh_master(master, p)
        if changed:
            self.tracker.mark(p for p, _ in pairs if id(p) in changed)

    def load_into_masters(self, loaded: dict[int, torch.Tensor]) -> None:
        """`loaded`: {id(model param): the tensor model.load_state_dict wrote into it}."""
        done = []
        for p, master in self.master_pairs():
            value = loaded.get(id(p))
            if value is not None:
                refresh_master(master, p, value)
                done.append(p)
        self._mark(done)

    # ---- scale_loss ---------------------------------------------------------------------

    def before_backward(self) -> None:
        """Moves grads unscaled by an earlier loss of this step out of the way of the next
        backward; they are added back once its grads are unscaled."""
        if self.kind == "fold" or not self.unscaled_pending or self.stash:
            return
        params = self.unmastered() if self.kind == "masters" else self.params_with_grads()
        for p in params:
            if p.grad is not None:
                self.stash.append((p, p.grad))
                p.grad = None

    def _tensor_flags(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """The device flags the kernels fill for the grads of `params` (None: attribution off)."""
        return None if self.attribution is None else self.attribution.flags_for(params)

    def unscale(self, scaler: LossScaler, scale: torch.Tensor) -> None:
        """Checks (and for the unscaling kinds, unscales by `scale`) this optimizer's grads into
        scaler.found_inf. The skip decision comes later, once every optimizer of the
        scale_loss call is checked (decide)."""
        if self.kind == "fold":
            params, grads = params_and_grads(self.params_with_grads())
            if self.window_inf is None:
                scaler.check_(grads, self._tensor_flags(params))
                return
            # The grads still hold this step's earlier micro-batches, so an inf they held then
            # is seen again: only an overflow where there was none is news for this call
            # (apex checked the incoming grads alone). Otherwise this optimizer, already
            # skipping, would make the call's other optimizers skip a clean step and back the
            # scale off a second time.
            seen = torch.zeros_like(scaler.found_inf)
            ops.multi_tensor_nonfinite_check_(grads, seen, self._tensor_flags(params))
            before = self.window_inf.reshape(seen.shape).to(seen.device)
            torch.maximum(scaler.found_inf, seen * (1.0 - before), out=scaler.found_inf)
            return
        inv_scale = scale.double().reciprocal().float().reshape(1)
        if self.kind == "masters":
            self._unscale_into_masters(scaler, inv_scale)
            params, grads = params_and_grads(self.unmastered())
        else:
            params, grads = params_and_grads(self.params_with_grads())
        if grads:
            ops.multi_tensor_unscale_(grads, scaler.found_inf, inv_scale,
                                       self._tensor_flags(params))
        self._restore_stash()
        self.unscaled_pending = True

    def _unscale_into_masters(self, scaler: LossScaler, inv_scale: torch.Tensor) -> None:
        sources, targets, fresh, read = [], [], [], []
        for p, master in self.masters:
            if p.grad is None:
                continue
            if p.grad.layout != torch.strided:
                raise RuntimeError(
                    "amp.scale_loss: a low-precision param has a sparse gradient, which O2's "
                    "fp32 master grads cannot take. Use dense gradients (e.g. "
                    "nn.Embedding(sparse=False)) at O2, or O1, which keeps the model fp32."
                )
            sources.append(p.grad)
            read.append(p)
            if master.grad is None:
                master.grad = torch.empty_like(master)
                targets.append(master.grad)
            elif not self.unscaled_pending:
                targets.append(master.grad)  # first loss of this step: overwrite
            else:
                buffer = torch.empty_like(master)
                targets.append(buffer)
                fresh.append((master.grad, buffer))
        if sources:
            ops.multi_tensor_scale_(sources, targets, inv_scale, scaler.found_inf,
                                     self._tensor_flags(read))
        if fresh:
            torch._foreach_add_([a for a, _ in fresh], [t for _, t in fresh])
        for p, _ in self.masters:
            p.grad = None

    def _restore_stash(self) -> None:
        stash, self.stash = self.stash, []
        dense_old, dense_new = [], []
        for p, old in stash:
            if p.grad is None:
                p.grad = old
            elif old.layout == torch.strided and p.grad.layout == torch.strided:
                dense_new.append(p.grad)
                dense_old.append(old)
            else:
                p.grad = p.grad + old
        if dense_new:
            torch._foreach_add_(dense_new, dense_old)

    def decide(self, scaler: LossScaler, scale: torch.Tensor, any_inf_on_host: bool | None) -> None:
        """After every optimizer of a scale_loss call is checked: scaler.found_inf holds the
        verdict for all of them (item of apex: an overflow in one skips them all).
        any_inf_on_host is the flag read once for the call when a torch.optim optimizer needs
        it (else None)."""
        if self.kind == "fold":
            self.window_inf = (scaler.found_inf.clone() if self.window_inf is None
                               else torch.maximum(self.window_inf, scaler.found_inf))
            self._put_on_optimizer(self.window, self.window_inf)
            self._note_verdict(self.window_inf)
            return
        if self.fused:
            self.found_inf = (scaler.found_inf.clone() if self.found_inf is None
                              else torch.maximum(self.found_inf, scaler.found_inf))
            self._put_on_optimizer(None, self.found_inf)
            self._note_verdict(self.found_inf)
            return
        self._note_verdict(bool(self.skip_step or any_inf_on_host))
        if self.skip_step or any_inf_on_host:
            # torch.optim cannot skip on the device: drop the grads of an overflowing step so
            # that step() leaves every param and its state untouched.
            self.skip_step = True
            params = [m for _, m in self.masters] + self.unmastered()
            for p in params:
                p.grad = None

    def _note_verdict(self, flag: torch.Tensor | bool) -> None:
        if self.attribution is not None:
            self.attribution.set_verdict(flag)

    def _put_on_optimizer(self, grad_scale: torch.Tensor | None,
                          found_inf: torch.Tensor | None) -> None:
        self.inner.grad_scale = grad_scale
        self.inner.found_inf = found_inf
        self._set_on_optimizer = (grad_scale, found_inf)

    # ---- the optimizer's step -------------------------------------------------------------

    # Outside Dynamo, as AmpHandle.before_backward and after_backward (handle.py says why).
    @torch._disable_dynamo
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.delayed:
            raise RuntimeError(
                "optimizer.step(): the last amp.scale_loss before this step used "
                "delay_unscale=True, so the gradients still carry the loss scale. Use "
                "delay_unscale=True only on the micro-batches before the last one."
            )
        self.follow_model()

    @torch._disable_dynamo
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.kind == "masters" and self.masters:
            models = [p for p, _ in self.masters]
            masters = [m for _, m in self.masters]
            one = torch.ones(1, device=masters[0].device)
            ops.multi_tensor_scale_(masters, models, one, torch.zeros_like(one))
            # The master grads served this step. Cleared, as apex cleared them: a user who
            # zeroes grads through the model (model.zero_grad()) never reaches them, and a
            # param with no grad next step would be stepped again with this one.
            for master in masters:
                master.grad = None
        self._count_skip()
        if self._set_on_optimizer is not None:
            # Only what amp set: a GradScaler driving the same optimizer manages its own.
            for name, value in zip(("grad_scale", "found_inf"), self._set_on_optimizer):
                if getattr(self.inner, name, None) is value:
                    delattr(self.inner, name)
        if self.fused:
            # Master grads made for clipping (materialize_unscaled_grads) serve one step only.
            # Only that method makes them, and it sets the flag, so a step without it walks no
            # params here.
            if self.inner.step_on_master_grads:
                self.inner.step_on_master_grads = False
                for _, master in self.master_pairs():
                    master.grad = None
        elif self.kind == "masters":
            self.tracker.mark(p for p, _ in self.masters)
        if self.attribution is not None:
            self.attribution.end_step()
        self._end_step()

    def _count_skip(self) -> None:
        flag: torch.Tensor | float | None
        if self.kind == "fold":
            flag = self.window_inf
        elif self.fused:
            flag = self.found_inf
        else:
            flag = 1.0 if self.skip_step else None
        if flag is None:
            return
        if self.skipped is None:
            self.skipped = torch.zeros(1, device=self.device)
        if isinstance(flag, float):
            self.skipped += flag
        else:
            self.skipped += flag.reshape(1).clamp(max=1.0).to(self.skipped.device)

    def locate(self, param: torch.Tensor) -> tuple[int, int]:
        """Where the optimizer holds a param whose grad amp reads (overflow reports)."""
        return place_in_optimizer(self.optimizer, self.masters, param)

    # ---- clipping -----------------------------------------------------------------------

    @torch._disable_dynamo  # sets attributes of the optimizer (see _before_step)
    def materialize_unscaled_grads(self) -> None:
        """Makes the grads readable and changeable unscaled before the step (apex's
        clip_grad_norm_(amp.master_params(opt)) recipe). "fold": fp32 grads on the masters for
        low-precision params, the params' own grads unscaled in place otherwise; the fused step
        then uses them and divides nothing out. "inplace" fused with masters: the grads are
        already unscaled; the masters get fp32 copies for the step to use."""
        if not self.fused:
            return
        if self.kind == "fold":
            if self.window is None or self._set_on_optimizer is None:
                return
            inv = self.window.double().reciprocal().float().reshape(1)
        elif self.unscaled_pending:
            inv = torch.ones(1, device=self.device)
        else:
            return
        masters = self.inner.masters()
        flag = torch.zeros_like(inv)
        sources, targets, in_place = [], [], []
        for p in optimizer_params(self.inner):
            if p.grad is None:
                continue
            master = masters.get(p)
            if master is not None:
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                    sources.append(p.grad)
                    targets.append(master.grad)
            elif self.kind == "fold":
                in_place.append(p.grad)
        if sources:
            ops.multi_tensor_scale_(sources, targets, inv, flag)
        if in_place:
            ops.multi_tensor_unscale_(in_place, flag, inv)
        self.inner.step_on_master_grads = bool(sources) or any(
            m.grad is not None for _, m in self.master_pairs())
        if self.kind == "fold":
            # the grads no longer carry a scale
            self.window = torch.ones_like(cast(torch.Tensor, self.window))
            self._put_on_optimizer(None, self.window_inf)

"""What the fused optimizers (FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad) share:
grouping parameters into op calls, the shared step count, fp32 master weights or the bf16
master-free modes, device-side learning rates, the GradScaler protocol, and a state_dict in
torch.optim's layout.

FusedOptimizer is assembled from one module per concern; this one holds the step launcher
(step(), choosing between the last step's plan and a full sort, the device-side lr, pickling)
and the public contract (FusedOptimizer's docstring): ``_sort`` (the full sort of params into
op calls, creating state on a param's first step), ``_groups`` (what a param group may hold and
its checks), ``_masters`` (fp32 master weights that follow their params, and the public methods
for them), ``_state`` (state layout and torch.optim's state_dict), ``_skip`` (whether a step is
skipped, and the public record of skipped steps), ``_capture`` (CUDA-graph rules), ``_call``
(one op call's tensors, complex params as real views) and ``_sparse`` (sparse grads, stepped
beside the op calls).

How a step is laid out
----------------------
The fused ops update whole lists of tensors in one launch and take ONE step counter for the list.
Every parameter's state therefore holds a reference to a step tensor (a 0-dim float32 tensor on
the parameter's device) that it shares with the other parameters of its group and device: the
params sharing one step tensor form one op call. Params with and without an fp32 master never
share one (the op takes masters for all of its params or for none), so a group with master
weights and mixed dtypes makes two calls per device.

torch.optim counts steps per parameter, and a parameter whose grad is None skips the step
without counting it. To keep that meaning, a step tensor shared with a parameter that has no
grad this time is cloned (on the device) for the parameters that do step, and params whose state
is created later start a step tensor of their own at zero. Params that always step together,
the usual case, keep sharing one counter forever.

Nothing on this path reads a device value back to the host. Whether the step is skipped
(found_inf from a loss scaler, skip_nonfinite's check of the grads) is decided on the device
for the whole step before any op call updates a param (see _skip).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import ParamsT

from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._capture import CaptureRulesMixin
from ampfuse.optimizers._groups import ParamGroupsMixin
from ampfuse.optimizers._masters import MasterWeightsMixin
from ampfuse.optimizers._plan import StepPlan
from ampfuse.optimizers._precision import EXTRA_KEYS, check_master_weights
from ampfuse.optimizers._skip import (
    SkipRecord,
    SkipReportMixin,
    check_skip_nonfinite,
    on_device,
    step_verdicts,
)
from ampfuse.optimizers._sort import CallSortingMixin
from ampfuse.optimizers._state import OptimizerStateMixin


class FusedOptimizer(
    ParamGroupsMixin, MasterWeightsMixin, OptimizerStateMixin, SkipReportMixin,
    CaptureRulesMixin, CallSortingMixin, torch.optim.Optimizer
):
    """The base class of the fused optimizers, and the contract between them and their callers.

    A FusedOptimizer is a torch.optim.Optimizer: param groups, add_param_group(), LR
    schedulers, zero_grad(), and state_dict()/load_state_dict() in torch.optim's layout (which
    torch's counterpart loads, and the other way round). Beyond that, a caller (ampfuse.amp,
    the integrations, a GradScaler, user code) relies on the methods below and nothing else:
    how `optimizer.state` keeps masters and step counts is the optimizers' own business and may
    change; code outside ampfuse.optimizers never reads or writes its entries.

    Stepping and skipping:

    - `step(closure=None, *, grad_scale=None, found_inf=None)`: one fused step of every param
      that has a grad. The grads are divided by `grad_scale` inside the op; a nonzero
      `found_inf` skips the whole step on the device, writing nothing. torch.amp.GradScaler
      drives it through the same two values (the `grad_scale` / `found_inf` attributes it sets).
    - `last_step_skipped`, `get_skipped_steps()`, `last_overflow()`: whether, how often and
      (for the optimizer's own skip_nonfinite check) why steps were skipped.
    - `step_on_master_grads`: a caller that put fp32 grads on the masters (`master.grad`, for
      clipping them unscaled) sets it True for the next step, which then uses those grads in
      place of their params' and divides no scale out of them; the caller sets it back to
      False and drops those grads after that step.

    fp32 masters (`master_weights=True` keeps one per fp16/bf16 param; the step updates the
    master and writes it back, rounded, into the param):

    - `set_master_weights(mode)`: the precision knob for every group and for groups added later.
    - `master_params() -> list[Tensor]`: what the optimizer updates, one per param: its master
      (made now if missing) or the param itself.
    - `masters_for(params) -> list[Tensor]`: the masters of the given params, made now as their
      first step would make them; a param never gets a second master. ValueError for a tensor
      the optimizer does not hold, or a param it keeps no master for.
    - `masters(*, unstepped_only=False) -> dict[Tensor, Tensor]`: {param: master} as they are
      now, making none; `unstepped_only` gives the ones state_dict() leaves out.
    - `set_masters(values, *, keep_stepped=False)`: makes given fp32 tensors the masters (amp's
      fp32 weights from before its cast, masters saved beside a checkpoint).
    - `mark_masters(params)`, `follow_masters()`: a master follows its param when anything but
      a step writes the param (the model's load_state_dict, a `p.copy_`). `mark_masters`
      records that the params and their masters agree now; `follow_masters` does at once what
      the next step would do for every master.

    A subclass supplies the per-family parts: _check_hyperparameters(index, group);
    _state_keys(group), the fp32 state entries of a param (which _prepare_state creates);
    _launch(group, call, lr, grad_scale, found_inf); _export_state(group, state, step_value) ->
    the torch-layout dict; _import_state(group, p, saved, where) -> (state, step value or None);
    _import_group(saved, current, new); and the class attributes below.
    """

    # torch.amp.GradScaler leaves unscaling to step() and hands over `grad_scale` and `found_inf`.
    _step_supports_amp_scaling = True
    # Public (see above): set for one step by a caller that put fp32 grads on the masters.
    step_on_master_grads = False
    # The count a param's step starts from when its state is made (apex's
    # FusedMixedPrecisionLamb takes it as an argument, to resume a schedule without a checkpoint).
    _first_step_count = 0.0
    # Keys that torch.optim's counterpart keeps in its param groups but that mean nothing here:
    # written into state_dict() (so torch can load it) and dropped by load_state_dict().
    _TORCH_GROUP_KEYS: dict[str, Any] = {}
    # Hyperparameters of the other optimizer family: a group holding one is a mistake.
    _FOREIGN_GROUP_KEYS: tuple[str, ...] = ()
    # The torch.optim class this optimizer stands in for (None: torch has none), as messages
    # about torch's implementation switches name it (_torch_switches).
    _TORCH_COUNTERPART: str | None = None
    # Whether sparse COO grads are stepped (_sparse; the class then has _sparse_step(group, p,
    # grad, state, lr)), as torch.optim.SGD and Adagrad step them, or refused.
    _TAKES_SPARSE = False

    if TYPE_CHECKING:
        # What each subclass supplies besides _check_hyperparameters, _export_state and
        # _import_state (_host): declared for the type checker only.
        def _launch(self, group: dict[str, Any], call: OpCall, lr: torch.Tensor,
                    grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None: ...
        def _sparse_step(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor,
                         state: dict[str, Any], lr: float) -> None: ...

    def __init__(self, params: ParamsT, defaults: dict[str, Any],
                 set_grad_none: bool = True) -> None:
        self.set_grad_none = set_grad_none
        # (group index, device) -> [last lr value, 0-dim fp32 lr tensor on that device]
        self._lr_tensors = {}
        # param -> its ParamRecord (_masters): the mark that tells whether someone else wrote
        # it since the last step, and the strides its state was last laid out for.
        self._param_records = {}
        # last_step_skipped and the skipped-step count (see _skip).
        self._skips = SkipRecord()
        # group index -> the StepPlan of its last full sort (see _plan), or None.
        self._step_plans: dict[int, StepPlan | None] = {}
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["set_grad_none"] = self.set_grad_none
        state["skipped_steps"] = self.get_skipped_steps()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch.optim adds this default on unpickling; no fused optimizer is differentiable.
        self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("set_grad_none", True)
        self.__dict__.setdefault("_lr_tensors", {})
        self.__dict__.setdefault("_param_records", {})
        self.__dict__["_step_plans"] = {}
        skipped = self.__dict__.pop("skipped_steps", 0)
        self.__dict__.setdefault("_skips", SkipRecord(skipped))
        # Pickled before the option existed: such optimizers never checked.
        self.defaults.setdefault("skip_nonfinite", False)
        for group in self.param_groups:
            group.setdefault("skip_nonfinite", False)

    # ---- step ---------------------------------------------------------------------------------

    # torch types step() as two overloads on the closure; this one signature says the same.
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *,  # type: ignore[override]
             grad_scale: torch.Tensor | float | None = None,
             found_inf: torch.Tensor | None = None) -> float | None:
        """One optimization step of every param that has a grad.

        grad_scale: the loss scale the grads carry; they are divided by it inside the op.
        found_inf: a nonzero value skips the step entirely: no param, master, moment or step
        count is written. Both are one-element tensors (a float is accepted for grad_scale),
        read on the device. When they are not given, the `grad_scale` and `found_inf`
        attributes that torch.amp.GradScaler sets on the optimizer during its step() are used.
        A step with no found_inf checks the grads itself where skip_nonfinite says so.
        """
        # Asked once per step: each of these is a few Python calls (issue 14 counts them).
        compiling = torch.compiler.is_compiling()
        capturing = self._capturing(compiling)
        self._check_capture(capturing)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        plans: list[tuple[int, dict[str, Any], list[Any]]] = []  # OpCalls and SparseCalls
        for index, group in enumerate(self.param_groups):
            self._check_hyperparameters(index, group)
            check_master_weights(self, index, group, check_params=False)
            check_skip_nonfinite(self, index, group)
            plans.append((index, group, self._calls(index, group, follow_params=not compiling)))
        # Every check before any update: one verdict for the whole step.
        own_check = self._skips.new_check(attribute=not (compiling or capturing))
        verdicts = step_verdicts(plans, found_inf, own_check)
        home = self._first_device()
        self._skips.prepare(verdicts, home, capturing, type(self).__name__)
        self._before_launches(plans)
        scales: dict[torch.device, torch.Tensor] = {}
        for index, group, calls in plans:
            for call in calls:
                device = call.step.device
                if call.mode == "sparse":
                    call.run(self, group, on_device(grad_scale, device, scales, "grad_scale"),
                             verdicts.get(device))
                    continue
                self._launch(
                    group,
                    call,
                    self._lr_tensor(index, group, device),
                    on_device(grad_scale, device, scales, "grad_scale"),
                    verdicts.get(device),
                )
                if call.mode in EXTRA_KEYS and not compiling:
                    self._mark_stepped(call)
                # The step plan keeps its calls for the next step (see _plan), but not this
                # step's grads: zero_grad(set_to_none=True) must free them.
                call.grads = []
        self._skips.record(verdicts, home, own_check)
        return loss

    def _first_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def _calls(self, index: int, group: dict[str, Any], follow_params: bool = True) -> list[Any]:
        """The op calls of `group` for this step: the last step's plan when it still holds (see
        _plan), else a full sort (_sort_into_calls), which plans the next step. Compiled steps
        (follow_params=False) always sort: their trace must not depend on host-side caches."""
        plannable = follow_params and not self.step_on_master_grads
        if plannable:
            plan = self._step_plans.get(index)
            if plan is not None:
                calls = plan.calls_if_unchanged(self, index, group)
                if calls is not None:
                    return calls
                del self._step_plans[index]  # a sort that raises leaves no stale plan behind
        calls = self._sort_into_calls(index, group, follow_params)
        if plannable:
            self._step_plans[index] = StepPlan.build(self, index, calls)
        return calls

    def _before_launches(
        self, plans: Sequence[tuple[int, dict[str, Any], Sequence[OpCall]]]
    ) -> None:
        """Called once per step with every group's calls, after the step's checks and before
        the first launch: for work that needs the whole step's grads (FusedLAMB's global grad
        norm)."""

    def _lr_tensor(self, index: int, group: dict[str, Any], device: torch.device) -> torch.Tensor:
        """group['lr'] as a 0-dim fp32 tensor on `device`. A float lr lives in a tensor kept per
        group and device and refilled (a device-side fill, no copy from the host) when it
        changes, so LR schedulers work; a tensor lr on the device is used as it is."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.device == device and lr.dtype == torch.float32:
                return lr
            return lr.to(device=device, dtype=torch.float32, non_blocking=True)
        key = (index, device)
        entry = self._lr_tensors.get(key)
        if entry is None:
            value = torch.full((), lr, dtype=torch.float32, device=device)
            entry = self._lr_tensors[key] = [lr, value]
        elif entry[0] != lr:
            entry[1].fill_(lr)
            entry[0] = lr
        return entry[1]

    # ---- gradients ----------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Resets every grad: to None when set_to_none (default: the optimizer's set_grad_none),
        else to zeros."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

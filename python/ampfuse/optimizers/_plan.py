"""A param group's step plan: the op calls FusedOptimizer._calls sorted its params into at the
last step, reused while nothing they depend on has changed.

Sorting a group into op calls looks at every param at every step: its grad, its state, whether
something else wrote it since the last step (its fp32 master then follows it), its memory
layout. In Python that is several attribute reads and two tensor-keyed dict lookups per param
(Tensor.__hash__ is itself a Python function), which took longer than the fused SGD op on a
CPU model of 291 small tensors. A plan keeps what the last full sort found, per param, and
``ampfuse.ops.step_scan.scan_step`` confirms in one C++ pass per group that each param still
matches it (where the C++ scanner is built: in-place source builds; a wheel makes no plans and
sorts every step):

- the group's params list, the optimizer's state dict, master_weights and the state keys of the
  group's options are the objects (values) the plan was made from;
- each param is the same object as before and has a grad exactly when it had one then (a plain
  strided tensor of the dtype it had);
- each stepping param's state is the same dict holding the same step tensor, with the entries
  its mode needs and none of another mode's; its strides are those its state was laid out for;
- a param with an extra tensor (an fp32 master; a bf16 mode's compensation or low half) was
  not written since its last step (same version and storage);
- with master_weights="stochastic", the groups before this one hold as many params as before
  (a param's index in the optimizer keys its random bits).

Then the plan's calls are returned with this step's grads; the state tensors they pass are read
from the state dicts at launch, as before. Anything else runs the full sort, which then makes a
new plan; groups holding Tensor subclasses such as DTensor are never planned. The plan decides
nothing the full sort would not: it only skips re-deriving what is already known.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ampfuse.ops import step_scan
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._precision import EXTRA_KEYS, LEGACY_LOW_BITS

# Param types a plan covers. Subclasses (DTensor under FSDP2, FakeTensor, user subclasses) may
# override what the scan reads, so their groups always take the full sort.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _mode_keys(mode: str, state_keys: Iterable[str], other_keys: Iterable[str] = ()
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the state entries a param stepped in `mode` must hold, those it must not hold): its own
    extra tensor (a master, a compensation, a low half) besides its state keys, and none of
    another mode's, nor `other_keys` (the moments in their other form, fp32 or coded), which
    the full sort would convert first."""
    own = EXTRA_KEYS.get(mode)
    required = tuple(state_keys) + ((own,) if own is not None else ())
    absent = tuple(key for key in (*EXTRA_KEYS.values(), LEGACY_LOW_BITS) if key != own)
    return required, absent + tuple(other_keys)


def first_param_id(optimizer: torch.optim.Optimizer, index: int) -> int:
    """The index in the optimizer of group `index`'s first param: stochastic rounding keys its
    random bits by it. The full sort numbers the params with it, and a plan checks it has not
    moved."""
    return sum(len(g["params"]) for g in optimizer.param_groups[:index])


class StepPlan:
    """What one group's last full sort found (see the module docstring)."""

    __slots__ = (
        "calls",
        "coded_layout",
        "entries",
        "first_id",
        "group",
        "master_weights",
        "params",
        "picks",
        "state_keys",
        "state_map",
    )

    group: dict[str, Any]
    params: list[torch.Tensor]
    state_map: Any  # the optimizer's state
    master_weights: bool | str
    state_keys: tuple[str, ...]
    coded_layout: tuple[str, tuple[str, ...] | None]
    entries: tuple[tuple[Any, ...], ...]
    calls: list[OpCall]
    picks: list[list[int]] | None
    first_id: int | None

    @classmethod
    # optimizer: a FusedOptimizer (_base, which imports this module).
    def build(cls, optimizer: Any, index: int, calls: list[OpCall]) -> StepPlan | None:
        """A plan for group `index` of `optimizer` after the full sort made `calls` from it, or
        None when its params are Tensor subclasses or there is no C++ scanner to confirm it."""
        if not step_scan.NATIVE:
            return None  # a wheel install: the stand-in would decline it at every step
        group = optimizer.param_groups[index]
        params = group["params"]
        if not all(type(p) in _PLAIN_TYPES for p in params):
            return None  # scan_step would refuse them at every step; don't build one each time
        if any(call.has_complex or call.mode == "sparse" for call in calls):
            return None  # the sort hands these grads on converted; scan_step would not
        plan = cls()
        state_keys = optimizer._state_keys(group)
        plan.group = group
        plan.params = params
        plan.state_map = optimizer.state
        plan.master_weights = group["master_weights"]
        plan.state_keys = state_keys
        plan.coded_layout = optimizer._coded_layout(group)
        plan.calls = calls
        # Stochastic rounding's param ids count the params of the groups before this one.
        stochastic = any(call.mode == "stochastic" for call in calls)
        plan.first_id = first_param_id(optimizer, index) if stochastic else None
        # Where each stepping param sits: id() is safe here, every param is alive in the group.
        stepping: dict[int, tuple[OpCall, dict[str, Any]]] = {}
        for call in calls:
            for p, state in zip(call.params, call.states):
                stepping[id(p)] = (call, state)
        coded_keys = plan.coded_layout[1] or ()
        keys = {(call.mode, call.coded): _mode_keys(call.mode, coded_keys, state_keys)
                if call.coded else _mode_keys(call.mode, state_keys, coded_keys)
                for call in calls}
        records = optimizer._param_records
        entries: list[tuple[Any, ...]] = []
        order: dict[int, list[int]] = {id(call): [] for call in calls}
        position = 0  # among the stepping params
        for p in plan.params:
            found = stepping.get(id(p))
            if found is None:
                entries.append((p,))
                continue
            call, state = found
            order[id(call)].append(position)
            position += 1
            # A param with an extra tensor (master, compensation, low half) must not have been
            # written since its step: the extra tensor then no longer belongs to its value.
            follows = call.mode in EXTRA_KEYS
            entries.append((p, state, call.step, records[p], p.dtype, follows,
                            *keys[call.mode, call.coded]))
        plan.entries = tuple(entries)
        # The grads scan_step returns are those of the stepping params in group order; each call
        # takes its own positions (all of them, in order, for the usual single call).
        plan.picks = None if len(calls) == 1 else [order[id(call)] for call in calls]
        return plan

    def calls_if_unchanged(self, optimizer: Any, index: int,
                           group: dict[str, Any]) -> list[OpCall] | None:
        """The plan's calls with this step's grads when nothing they depend on changed, else
        None."""
        if (group is not self.group or group["params"] is not self.params
                or optimizer.state is not self.state_map
                or group["master_weights"] != self.master_weights
                or optimizer._state_keys(group) != self.state_keys
                or optimizer._coded_layout(group) != self.coded_layout):
            return None
        if self.first_id is not None and first_param_id(optimizer, index) != self.first_id:
            return None
        grads = step_scan.scan_step(self.params, self.state_map, self.entries)
        if grads is None:
            return None
        if self.picks is None:
            self.calls[0].grads = grads
        else:
            for call, picks in zip(self.calls, self.picks):
                call.grads = [grads[j] for j in picks]
        return self.calls

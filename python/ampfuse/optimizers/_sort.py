"""Sorting a param group into the op calls of one step: FusedOptimizer's full sort.

Which params share a step counter and a mode, and so one fused launch, is laid out in _base's
docstring; this module does the sorting, and creates each param's state on its first step (the
subclass hooks below say what state a param holds). A step whose plan still holds skips it
(see _plan). Kept apart from the step launcher (_base) because it is the longest piece of the
step and the one every per-family change touches.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._groups import FLOAT_DTYPES
from ampfuse.optimizers._host import OptimizerHost
from ampfuse.optimizers._masters import ParamRecord, make_master
from ampfuse.optimizers._plan import first_param_id
from ampfuse.optimizers._precision import (
    BF16_MODES,
    EXTRA_KEYS,
    check_param_for_mode,
    has_foreign_state,
    prepare_extra,
    reset_extra,
)
from ampfuse.optimizers._sparse import SparseCall, add_sparse
from ampfuse.optimizers._state import fp32_like
from ampfuse.optimizers._state_codes import BLOCK as CODE_BLOCK
from ampfuse.optimizers._state_codes import FIRST_MOMENT_CODES


class CallSortingMixin(OptimizerHost):
    """The full sort of a group's params into op calls, and the state hooks a subclass fills."""

    def _sort_into_calls(self, index: int, group: dict[str, Any], follow_params: bool = True
                         ) -> list[Any]:
        """Sorts the params of `group` that have grads into op calls (see _base's docstring),
        creating state on a param's first step.

        This runs for every param at every compiled step, and at every eager step whose plan
        does not hold (see _plan: Tensor subclasses, changed state), so it stays lean: torch
        already guarantees that a grad has its param's dtype, shape and device. Step tensors
        are told apart with `is` and plain lists, not id() and dicts, so that torch.compile
        traces step() whole."""
        calls: list[Any] = []  # OpCalls, then SparseCalls
        idle_steps: list[torch.Tensor] = []  # step tensors of params that have no grad this time
        # (device, mode, count, coded kind) -> the step tensor of params starting now
        new_steps: dict[tuple[torch.device, str, float, str | None], torch.Tensor] = {}
        all_state = self.state
        master_weights = group["master_weights"]
        # Modes per param, decided here once per group: the loop below runs for every param
        # at every step. fp32 params always step as "none"; see _precision.param_mode.
        low_mode = "fp32" if master_weights is True else "none"
        bf16_mode = master_weights if master_weights in BF16_MODES else low_mode
        # Param ids key stochastic rounding: a param's index in the optimizer, as state_dict()
        # numbers it, so a resumed optimizer draws the same bits.
        first_id = first_param_id(self, index) if master_weights == "stochastic" else 0
        # follow_params: host-side bookkeeping that torch.compile cannot trace; compiled steps
        # skip it.
        records = self._param_records
        state_keys = self._state_keys(group)
        # Block-coded moments (state_dtype, FusedAdam): the kind and the state keys of a coded
        # param; params under one block keep state_keys (see _state_codes).
        coded_kind, coded_keys = self._coded_layout(group)
        coded_dtype = FIRST_MOMENT_CODES.get(coded_kind)
        call = None
        key: Any  # a state key, then a (device, mode, count, coded kind) tuple
        # device -> SparseCall: params with sparse grads (FusedSGD, Adagrad)
        sparse_calls: dict[torch.device, SparseCall] = {}
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                state = all_state.get(p)
                if state and "step" in state:
                    idle_steps.append(state["step"])
                continue
            dtype = p.dtype
            complex_param = False
            if grad.layout != torch.strided or dtype not in FLOAT_DTYPES:
                if grad.layout == torch.sparse_coo and self._TAKES_SPARSE:
                    add_sparse(self, index, i, p, group, sparse_calls)
                    continue
                self._reject(index, i, p, grad)  # returns for a complex64 param
                complex_param = True
                grad = torch.view_as_real(grad)
            if dtype == torch.bfloat16:
                mode = bf16_mode
            elif dtype == torch.float16:
                if bf16_mode is not low_mode:
                    check_param_for_mode(self, index, i, p, master_weights)  # raises
                mode = low_mode
            else:
                mode = "none"
            state = all_state[p]
            record = records.get(p)  # self._record(p), inline: no call per param
            if record is None:
                record = records[p] = ParamRecord()
            keys = state_keys
            coded = None
            if coded_keys is not None and not complex_param and p.numel() >= CODE_BLOCK:
                keys = coded_keys
                coded = coded_kind
            prepared = True  # a loop, not all(): no Python call per param in the steady state
            for key in keys:
                if key not in state:
                    prepared = False
                    break
            if coded is not None and prepared and state[keys[0]].dtype != coded_dtype:
                prepared = False  # codes of the other kind: state_dtype changed since
            if "step" not in state or (not prepared and self._starts_over(group, state)):
                self._check_not_capturing(index, i)
                count = self._implied_step_count(state)
                key = (p.device, mode, count, coded)
                if key not in new_steps:
                    new_steps[key] = torch.full((), count, dtype=torch.float32,
                                                device=p.device)
                state["step"] = new_steps[key]
            if not prepared:
                self._prepare_state(group, p, state)
            if mode == "fp32":
                if "master_param" not in state:
                    self._check_not_capturing(index, i)
                    if has_foreign_state(state, mode):
                        prepare_extra(p, state, mode)
                    else:
                        state["master_param"] = make_master(p)
                elif follow_params:
                    mark = record.mark  # _follow's test, inline: it runs for every master
                    if mark is not None and (mark[0] != p._version or mark[1] != p.data_ptr()):
                        self._follow(p, state["master_param"], record)
                # amp may have put unscaled fp32 grads on the masters (apex's clipping recipe);
                # they then take the place of the params' low-precision ones for this step.
                if self.step_on_master_grads and state["master_param"].grad is not None:
                    grad = state["master_param"].grad
            elif mode in EXTRA_KEYS:  # "kahan", "split"
                if EXTRA_KEYS[mode] not in state or has_foreign_state(state, mode):
                    self._check_not_capturing(index, i)
                    prepare_extra(p, state, mode)
                elif follow_params and self._written_since_step(p, record):
                    reset_extra(state, mode)
            elif has_foreign_state(state, mode):  # "none"/"stochastic" keep no extra tensor
                self._check_not_capturing(index, i)
                prepare_extra(p, state, mode)
            if record.strides != p.stride():
                self._match_layout(index, i, p, state, record)
            step = state["step"]
            if call is None or call.step is not step or call.mode != mode or call.coded != coded:
                call = None
                for candidate in calls:
                    if (candidate.step is step and candidate.mode == mode
                            and candidate.coded == coded):
                        call = candidate
                        break
                if call is None:
                    call = OpCall(step, mode, coded)
                    calls.append(call)
            if complex_param:
                call.has_complex = True
            if mode == "stochastic":
                call.param_ids.append(first_id + i)
            call.entries.append((p, grad, state, record))
        # A step tensor must advance once per step, for exactly the params that stepped.
        launched: list[torch.Tensor] = []
        for call in calls:
            call.seal()
            shared = call.step
            # (the emptiness tests first: no call at all for the usual one or two op calls)
            if ((idle_steps and _holds(idle_steps, shared))
                    or (launched and _holds(launched, shared))):
                call.step = shared.clone()
                for state in call.states:
                    state["step"] = call.step
            launched.append(shared)
        calls.extend(sparse_calls.values())  # stepped after the fused calls (see _sparse)
        return calls

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The fp32 state entries each param of `group` holds (moments, momentum buffers):
        _prepare_state makes the missing ones, and a param holding them all is not passed to
        _prepare_state or _starts_over again."""
        return ()

    def _prepare_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        """Creates the entries of _state_keys(group) that `state` lacks, zeroed, in fp32."""
        for key in self._state_keys(group):
            if key not in state:
                state[key] = fp32_like(p)

    def _coded_layout(self, group: dict[str, Any]) -> tuple[str, tuple[str, ...] | None]:
        """(state_dtype, the state keys of a param whose moments are block-coded) for `group`,
        or ("fp32", None) when no param of it codes its moments (every optimizer but FusedAdam;
        see _state_codes)."""
        return "fp32", None

    def _starts_over(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """True when a param's existing state must count steps from zero again."""
        return False

    def _implied_step_count(self, state: dict[str, Any]) -> float:
        """The step count of a param whose state has no 'step' yet: the first count for a new
        param; subclasses whose torch counterpart keeps no count (SGD) tell a state written
        from outside (ZeroRedundancyOptimizer.load_state_dict sets optimizer.state[p]
        directly) by what it holds."""
        return self._first_step_count


def _holds(tensors: Iterable[torch.Tensor], t: torch.Tensor) -> bool:
    for candidate in tensors:
        if candidate is t:
            return True
    return False

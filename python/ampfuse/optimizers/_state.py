"""A param's optimizer state: kept fp32 and laid out like the param, and saved and loaded in
torch.optim's state_dict layout.

The fused ops walk a param and its state tensors flat, so the state must share the param's
element order (``same_layout``); a checkpoint or a model changed to channels_last after some
steps is re-laid out here. state_dict()/load_state_dict() translate between that state (one step
tensor shared by params that step together, fp32 moments and masters) and torch.optim's format
(a 'step' per param, torch's group keys), so checkpoints move both ways between ampfuse's and
torch's optimizers. Kept apart from the step launcher (``_base``) because none of it runs on
the per-step path except the layout check.

OptimizerStateMixin relies on what FusedOptimizer gathers: the subclasses' _export_state and
_import_state, _check_group, _capturing, get_skipped_steps, _TORCH_GROUP_KEYS, and the
_param_records, _lr_tensors and _skips caches that a load starts afresh.
"""

from __future__ import annotations

import collections
import copy
import numbers
from collections.abc import Callable
from typing import Any

import torch

from ampfuse.optimizers._host import OptimizerHost
from ampfuse.optimizers._precision import (
    LEGACY_LOW_BITS,
    export_extra,
    import_extras,
    param_mode,
)
from ampfuse.optimizers._skip import SkipRecord
from ampfuse.optimizers._state_codes import (
    MOMENT_KEYS,
    codes_kind,
    convert_moments,
    is_dense,
    loaded_codes,
)
from ampfuse.overflow import param_name


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of p's optimizer state: fp32, or complex64 (fp32 pairs) for a complex param,
    as torch.optim keeps it; the ops see a complex tensor as its real view."""
    return torch.complex64 if p.is_complex() else torch.float32


def fp32_like(p: torch.Tensor) -> torch.Tensor:
    """Zeros in fp32 (complex64 for a complex param) with p's shape, device and (dense)
    strides."""
    return torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)


def same_layout(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether state tensor `t` walks memory in the same order as param `p`, the rule the fused
    ops apply to the tensors they write (one element or none has no order). A param that is not
    dense (a strided slice) is stepped through a contiguous copy of itself, so its state is
    contiguous."""
    if t.numel() <= 1 or t.stride() == p.stride():
        return True
    return t.is_contiguous() and not is_dense(p)


def fp32_copy(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor as fp32 (complex64 for a complex param) on p's device, laid out
    like p (a checkpoint saved from contiguous params loads into a channels_last model). A
    tensor that already is so is used as it is, as torch.optim does."""
    dtype = state_dtype(p)
    if value.dtype == dtype and value.device == p.device and same_layout(value, p):
        return value
    out = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return out.copy_(value)


class OptimizerStateMixin(OptimizerHost):
    """state_dict() and load_state_dict() in torch.optim's layout, and state that follows its
    param's memory layout."""

    # ---- state laid out like its param --------------------------------------------------------

    def _match_layout(self, group_index: int, param_index: int, p: torch.Tensor,
                      state: dict[str, Any], record: Any) -> None:
        """Lays p's state tensors out like p when p's layout changed since they were made, e.g.
        by model.to(memory_format=torch.channels_last) after some steps: the fused ops walk a
        param and its state flat, so both must share one element order. Runs when p's strides
        differ from those recorded at the last check (one stride comparison per param and
        step otherwise). The tensors are changed in place (same objects, same values), so
        references held elsewhere, such as amp's list of masters, stay valid. A param that
        is not dense is stepped through a contiguous copy (the ops do it), so its state stays
        contiguous; one whose elements share memory (expand()) is refused here, before any
        param of the step is written."""
        strides = p.stride()
        if any(stride == 0 and size > 1 for size, stride in zip(p.shape, strides)):
            raise ValueError(
                f"{type(self).__name__}: {param_name(group_index, param_index)} has strides "
                f"{strides} for shape {tuple(p.shape)}, so several of its elements share one "
                "memory location (e.g. an expand()); an optimizer cannot write it. Give the "
                "parameter memory of its own (.clone())."
            )
        kind = codes_kind(state)
        if kind != "fp32" and not all(same_layout(state[f"{key}_codes"], p)
                                      for key in MOMENT_KEYS if f"{key}_codes" in state):
            # Block-coded moments: blocks follow memory order, so the codes are decoded in the
            # old order and coded again in the new one (not copied element by element).
            self._check_relayout_outside_capture(group_index, param_index)
            decoded = convert_moments(state, "fp32")
            for key in MOMENT_KEYS:
                if key in decoded:
                    decoded[key] = torch.empty_like(p, dtype=torch.float32).copy_(decoded[key])
            recoded = convert_moments(decoded, kind)
            state.clear()  # the same dict: a step plan holds on to it
            state.update(recoded)
        for value in state.values():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == p.shape
                and not same_layout(value, p)
            ):
                self._check_relayout_outside_capture(group_index, param_index)
                # torch's stubs list set_(storage) only; set_(tensor) is as old and documented.
                relaid = torch.empty_like(p, dtype=value.dtype).copy_(value)
                value.set_(relaid)  # type: ignore[call-overload]
        record.strides = strides

    def _check_relayout_outside_capture(self, group_index: int, param_index: int) -> None:
        if self._capturing():
            raise RuntimeError(
                f"{type(self).__name__}: {param_name(group_index, param_index)} changed "
                "its memory layout (e.g. model.to(memory_format=...)) since its optimizer "
                "state was made, and the state cannot be re-laid out during CUDA graph "
                "capture; run one step eagerly after changing the layout, then capture."
            )

    # ---- state_dict in torch.optim's layout ---------------------------------------------------

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """The state in torch.optim's layout, loadable by torch.optim's counterpart.

        Each param's 'step' is its own float32 0-dim tensor (on the CPU, or on the param's device
        for capturable groups), as torch.optim keeps it; moments stay fp32 whatever the param's
        dtype, and 'master_param' (fp32) is included so a resumed run continues from the exact
        masters. Param groups carry torch's keys (e.g. 'decoupled_weight_decay', 'foreach',
        'fused') besides ours. State tensors other than 'step' are the live ones, as in torch.
        """
        hook: Callable[..., Any]  # torch's pre- and post-hooks take different arguments
        key: Any  # a group key, then a param (or whatever else torch keeps state under)
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        index_of: dict[int, int] = {}
        packed_groups: list[dict[str, Any]] = []
        group_of: dict[int, dict[str, Any]] = {}
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for key, value in self._TORCH_GROUP_KEYS.items():
                packed[key] = value(group) if callable(value) else value
            ids: list[int] = []
            for p in group["params"]:
                if id(p) not in index_of:
                    index_of[id(p)] = len(index_of)
                ids.append(index_of[id(p)])
                group_of[id(p)] = group
            packed["params"] = ids
            packed_groups.append(packed)
        # id(step tensor) -> its value, read once per tensor
        step_values: dict[int, torch.Tensor] = {}
        packed_state: dict[Any, Any] = {}
        for key, state in self.state.items():
            if not isinstance(key, torch.Tensor):
                packed_state[key] = state
                continue
            if id(key) not in index_of:
                continue  # a tensor no group holds any more has no index to be saved under
            group = group_of[id(key)]
            step = state.get("step")
            step_value = None
            if step is not None:
                if id(step) not in step_values:
                    where = step.device if group.get("capturable", False) else "cpu"
                    step_values[id(step)] = step.detach().to(where, torch.float32, copy=True)
                step_value = step_values[id(step)].clone()
            exported = self._export_state(group, state, step_value)
            if exported:
                packed_state[index_of[id(key)]] = exported
        state_dict: dict[str, Any] = {
            "state": packed_state,
            "param_groups": packed_groups,
            "skipped_steps": self.get_skipped_steps(),
        }
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this optimizer or of torch.optim's counterpart.

        Unlike torch.optim, which casts state to each param's dtype, moments and masters are
        kept (or made) fp32. Params whose saved step counts are equal share one step tensor
        again; unequal counts simply make more op calls. Hyperparameters come from the saved
        groups; keys of ours that a torch checkpoint lacks keep their current values.
        master_weights keeps its current value: a checkpoint saved with another value is
        converted to it at each param's next step (see ampfuse.optimizers._precision).
        """
        hook: Callable[..., Any]  # torch's pre- and post-hooks take different arguments
        key: Any  # a (device, mode, step) triple, then an index in the saved state
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        skipped_steps = state_dict.get("skipped_steps")
        if skipped_steps is None:  # a torch or older checkpoint: the count goes on from its value
            skipped_steps = self.get_skipped_steps()
        elif isinstance(skipped_steps, bool) or not (
            isinstance(skipped_steps, numbers.Integral) and int(skipped_steps) >= 0
        ):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: skipped_steps must be an int >= 0, got "
                f"{skipped_steps!r}."
            )
        skipped_steps = int(skipped_steps)
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state dict has {len(saved_groups)} "
                f"param groups but the optimizer has {len(groups)}."
            )
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: param_groups[{index}] has "
                    f"{len(saved['params'])} params in the state dict but "
                    f"{len(group['params'])} in the optimizer."
                )
        new_groups: list[dict[str, Any]] = []
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            new_group = {k: v for k, v in saved.items() if k not in self._TORCH_GROUP_KEYS}
            self._import_group(saved, group, new_group)
            # master_weights is this run's precision choice, not a hyperparameter to resume:
            # a checkpoint of another mode is converted to it (_precision).
            new_group["master_weights"] = group["master_weights"]
            for key, value in group.items():
                new_group.setdefault(key, value)
            new_group["params"] = group["params"]
            self._check_group(index, new_group)  # before anything of the optimizer changes
            new_groups.append(new_group)

        saved_state = state_dict["state"]
        state: collections.defaultdict[Any, dict[str, Any]] = collections.defaultdict(dict)
        param_ids: set[int] = set()
        for group_index, (group, saved) in enumerate(zip(new_groups, saved_groups)):
            # (device, mode, value) -> one step tensor
            shared_steps: dict[tuple[Any, ...], torch.Tensor] = {}
            for param_index, (index_in_dict, p) in enumerate(zip(saved["params"], group["params"])):
                param_ids.add(index_in_dict)
                if index_in_dict not in saved_state:
                    continue
                imported, step_value = self._import_state(
                    group, p, saved_state[index_in_dict], param_name(group_index, param_index)
                )
                if step_value is not None:
                    key = (p.device, param_mode(group["master_weights"], p), step_value)
                    if key not in shared_steps:
                        shared_steps[key] = torch.full(
                            (), step_value, dtype=torch.float32, device=p.device
                        )
                    imported["step"] = shared_steps[key]
                if imported:
                    state[p] = imported
        for key, value in saved_state.items():
            if key not in param_ids:
                state[key] = value  # state not tied to a param is kept as it is, as torch does

        # A loaded compensation or low half goes with the param as the checkpoint left it,
        # which the model is loaded with too, before or after: not a foreign write.
        for p, entry in state.items():
            if isinstance(p, torch.Tensor) and ("kahan_compensation" in entry
                                                or "master_low_bits" in entry
                                                or LEGACY_LOW_BITS in entry):
                self._record(p).mark = None
        self.__setstate__({"state": state, "param_groups": new_groups})
        self._lr_tensors = {}
        for record in self._param_records.values():
            record.strides = None  # loaded tensors are laid out afresh at the next step
        self._skips = SkipRecord(skipped_steps)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _import_group(self, saved: dict[str, Any], current: dict[str, Any],
                      new: dict[str, Any]) -> None:
        """Adjusts a loaded group `new` (saved keys minus torch-only ones) before the current
        group's missing keys are filled in. Betas saved as a list (JSON, some checkpoint tools)
        come back as the tuple they were."""
        if isinstance(new.get("betas"), list):
            new["betas"] = tuple(new["betas"])

    # The state of the optimizers with Adam's moments (FusedAdam, FusedLAMB): a 'step', fp32
    # 'exp_avg' and 'exp_avg_sq', the family's optional moments, and the precision extras.

    def _export_moments(self, state: dict[str, Any], step_value: torch.Tensor | None,
                        optional: tuple[str, ...] = ()) -> dict[str, Any]:
        """_export_state of a moments optimizer; `optional` keys are saved where present."""
        if step_value is None:
            # Only a master made by master_params() before any step: torch.optim.Adam would read
            # a state without 'step' as corrupt, and the next step remakes the same master.
            return {}
        out: dict[str, Any] = {"step": step_value}
        for key in ("exp_avg", "exp_avg_sq", *optional):
            # fp32 moments, or block-coded ones (state_dtype): each as the state holds it.
            for held in (key, f"{key}_codes", f"{key}_scales"):
                if held in state:
                    out[held] = state[held]
        export_extra(state, out)
        return out

    def _import_moments(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                        where: str, needs: str, optional: tuple[str, ...] = ()
                        ) -> tuple[dict[str, Any], float | None]:
        """_import_state of a moments optimizer; `needs` is the sentence a state without 'step',
        'exp_avg' or 'exp_avg_sq' is refused with."""
        if not saved:
            return {}, None
        def held(key: str) -> bool:  # fp32, or block-coded (state_dtype)
            return key in saved or f"{key}_codes" in saved

        if "step" not in saved or not held("exp_avg") or not held("exp_avg_sq"):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state of {where} has keys "
                f"{sorted(saved)}; {needs}"
            )
        imported: dict[str, Any] = {}
        for key in ("exp_avg", "exp_avg_sq", *optional):
            if saved.get(key) is not None:
                self._check_saved_shape(where, key, saved[key], p)
                imported[key] = fp32_copy(saved[key], p)
            elif saved.get(f"{key}_codes") is not None:
                imported.update(loaded_codes(saved, key, p, where, type(self).__name__))
        self._import_master(group, p, saved, imported, where)
        step = saved["step"]
        return imported, float(step.item() if isinstance(step, torch.Tensor) else step)

    def _import_master(self, group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any],
                       imported: dict[str, Any], where: str) -> None:
        """Takes over a saved fp32 master, kahan compensation or split low half, to be
        converted at p's next step if the group's master_weights is another (_precision)."""
        extras = import_extras(group, p, saved, where, type(self).__name__)
        if "master_param" in extras:
            # torch.optim's rule for a loaded tensor already right: use it as it is.
            extras["master_param"] = fp32_copy(saved["master_param"], p)
        imported.update(extras)

    def _check_saved_shape(self, where: str, key: str, value: torch.Tensor,
                           p: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state of {where} has {key!r} of shape "
                f"{tuple(value.shape)} but the param has shape {tuple(p.shape)}; the state dict "
                "belongs to another model."
            )


# apex's FusedLAMB and FusedNovoGrad count steps per param group (an int in the group); ours
# count per param, as torch.optim does. state_dict() of both writes the group's count too and
# load_state_dict() reads it, so checkpoints move both ways.

def add_group_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Writes apex's per-group 'step' (an int) into each saved group whose params all took the
    same number of steps."""
    for group in state_dict["param_groups"]:
        steps = {
            float(state_dict["state"][i]["step"])
            for i in group["params"]
            if "step" in state_dict["state"].get(i, {})
        }
        if len(steps) == 1:
            group["step"] = int(steps.pop())
    return state_dict


def spread_group_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of `state_dict` whose groups hold no 'step', each saved param state without one
    of its own taking its group's."""
    state_dict = dict(state_dict)
    saved_state = dict(state_dict["state"])
    groups = []
    for group in state_dict["param_groups"]:
        group = dict(group)
        group_step = group.pop("step", None)
        if group_step is not None:
            for i in group["params"]:
                if i in saved_state and "step" not in saved_state[i]:
                    saved_state[i] = dict(saved_state[i], step=float(group_step))
        groups.append(group)
    state_dict["state"] = saved_state
    state_dict["param_groups"] = groups
    return state_dict

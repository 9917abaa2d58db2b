"""fp32 masters that follow their low-precision params when someone else writes those.

A master is the value the optimizer updates; every step writes it back, rounded, into the param.
When anything else writes the param in between (``model.load_state_dict``, a ``p.copy_`` under
``no_grad``, ``p.data = ...``), the master is stale and the next step would write the old
weights back. Such writes are noticed with no device sync: the param's version counter and data
pointer are recorded after each step, and any other write bumps the counter or replaces the
storage. Only then is a value compared (refresh_master).

The helpers serve ampfuse.amp's masters of torch.optim optimizers as well; MasterWeightsMixin
is the fused optimizers' side: which params keep a master, following them at each step, and the
public methods through which others (ampfuse.amp) read, make and set masters without knowing
where the state keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ampfuse.ops import step_scan
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._host import OptimizerHost
from ampfuse.optimizers._precision import (
    BF16_MODES,
    MASTER_WEIGHTS_VALUES,
    check_param_for_mode,
)
from ampfuse.overflow import param_name

# The param dtypes that get an fp32 master when a group sets master_weights.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def keeps_master(group: dict[str, Any], p: torch.Tensor) -> bool:
    """Whether the fused optimizers keep an fp32 master for param `p` of `group`
    (master_weights=True; the bf16 modes of _precision keep none)."""
    return group["master_weights"] is True and p.dtype in LOW_PRECISION


def make_master(p: torch.Tensor) -> torch.Tensor:
    """A new fp32 master for `p`: a copy of its value, so the first step starts from it."""
    return p.detach().to(torch.float32, copy=True)


def param_mark(param: torch.Tensor) -> tuple[int, int]:
    """What changes when anyone but the fused step writes `param` (host-side, no sync)."""
    return (param._version, param.data_ptr())


@torch.no_grad()
def refresh_master(master: torch.Tensor, model_param: torch.Tensor,
                   source: torch.Tensor | None = None) -> None:
    """Makes `master` follow the model: from `source` (a tensor loaded into the model, any
    float dtype) when given, else from the model param's value. A source that is exactly the
    master rounded to the model's dtype is the model's own state coming back (a checkpoint of
    this model, an identical copy), so the master keeps its extra bits."""
    if source is None:
        source = model_param.detach()
    source = source.to(device=master.device)
    if source.shape != master.shape:
        raise ValueError(
            f"amp: a model param of shape {tuple(master.shape)} was replaced by a tensor of "
            f"shape {tuple(source.shape)}; load weights of the same architecture."
        )
    rounded = master.to(model_param.dtype)
    if source.dtype == model_param.dtype and torch.equal(source, rounded):
        return
    if source.dtype == torch.float32 and torch.equal(source, rounded.float()):
        return
    master.copy_(source)


class ParamRecord:
    """What a fused optimizer remembers of one param between steps, kept outside its state so
    that state_dict() keeps torch's layout. One record per param means one dict lookup per param
    and step, the step loop's main Python cost.

    mark: param_mark(param) right after the last step (or amp) wrote it, or None while nothing
    is followed; a different mark at the next step means someone else wrote the param.
    strides: the param's strides when its state was last checked to share its layout (see
    _match_layout), or None when it must be checked again."""

    __slots__ = ("mark", "strides")

    def __init__(self) -> None:
        self.mark: tuple[int, int] | None = None
        self.strides: tuple[int, ...] | None = None


class MasterWeightsMixin(OptimizerHost):
    """A fused optimizer's fp32 masters: following writes to their params, and the public
    methods that hand them out and set them (the contract is FusedOptimizer's docstring)."""

    def _record(self, p: torch.Tensor) -> ParamRecord:
        record = self._param_records.get(p)
        if record is None:
            record = self._param_records[p] = ParamRecord()
        return record

    def _follow(self, p: torch.Tensor, master: torch.Tensor,
                record: ParamRecord | None = None) -> None:
        """Remakes `master` if something other than a step wrote `p` since it was marked."""
        record = self._param_records.get(p) if record is None else record
        if record is not None and record.mark is not None and record.mark != param_mark(p):
            refresh_master(master, p)
            record.mark = param_mark(p)

    def _written_since_step(self, p: torch.Tensor, record: ParamRecord) -> bool:
        """Whether something other than a step wrote `p` since it was marked (then marks it):
        a kahan compensation or split low half no longer belongs to its value."""
        if record.mark is None or record.mark == param_mark(p):
            return False
        record.mark = param_mark(p)
        return True

    def follow_masters(self) -> None:
        """What each step does for the params it updates, for every param with a master now
        (before its masters are saved, say)."""
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state.get(p, {}).get("master_param")
                if master is not None:
                    self._follow(p, master)

    def mark_masters(self, params: Iterable[torch.Tensor]) -> None:
        """Records that `params` now hold what their masters say (the step just wrote them, or
        a caller such as amp set the masters from them): until something else writes one of
        them, its master is not looked at again."""
        for p in params:
            self._record(p).mark = param_mark(p)

    def _mark_stepped(self, call: OpCall) -> None:
        """mark_masters for the params of an op call that just ran, through their records: no
        dict lookup per param, and one C++ pass where every param is a plain tensor."""
        if step_scan.mark_params(call.params, call.records):
            return
        for p, record in zip(call.params, call.records):  # a subclass such as DTensor
            record.mark = (p._version, p.data_ptr())  # param_mark(p), inline

    # ---- the public contract for masters (FusedOptimizer's docstring) -------------------------

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer actually updates, one per param in param-group order: the
        fp32 master of each fp16/bf16 param of a group with master_weights=True (created now
        from the param if no step has created it yet), else the param itself."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                out.append(self._master_made(p) if keeps_master(group, p) else p)
        return out

    def masters_for(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The fp32 masters of `params`, in their order: the master a param has, else one made
        now from its value, as its first step would make it and then update (never a second
        master for one param). Each must be an fp16/bf16 param of this optimizer in a group
        with master_weights=True; anything else raises ValueError, before any master is made."""
        params = list(params)
        places = self._places(params, "masters_for", lambda i: f"params[{i}]")
        for (group_index, param_index), p in zip(places, params):
            group = self.param_groups[group_index]
            if keeps_master(group, p):
                continue
            where = f"{type(self).__name__}.masters_for: {param_name(group_index, param_index)}"
            if p.dtype in LOW_PRECISION:
                raise ValueError(
                    f"{where} keeps no fp32 master: its group has master_weights="
                    f"{group['master_weights']!r}. set_master_weights(True) (or "
                    "master_weights=True in its group) keeps masters for its fp16/bf16 params."
                )
            raise ValueError(
                f"{where} is {p.dtype}, which the optimizer updates directly: only "
                "torch.float16 and torch.bfloat16 params get fp32 masters. master_params() "
                "gives the tensor the optimizer updates for every param."
            )
        return [self._master_made(p) for p in params]

    def masters(self, *, unstepped_only: bool = False) -> dict[torch.Tensor, torch.Tensor]:
        """{param: fp32 master} for the params that have a master now, in param-group order;
        makes none. unstepped_only: only the masters of params that have not stepped yet,
        which state_dict() leaves out (torch.optim would read a saved state without a 'step'
        as corrupt), so whoever made them saves them."""
        out = {}
        state = self.state
        for group in self.param_groups:
            for p in group["params"]:
                entry = state.get(p)
                if entry is None or "master_param" not in entry:
                    continue
                if unstepped_only and "step" in entry:
                    continue
                out[p] = entry["master_param"]
        return out

    def set_masters(self, values: Mapping[torch.Tensor, torch.Tensor], *,
                    keep_stepped: bool = False) -> None:
        """Makes values[p] the fp32 master of each param p (replacing the one it has): the
        tensor itself, which the optimizer then updates in place, so pass one it may own. Each
        value must be float32 with its param's shape and device; use it for values more exact
        than the param holds (its fp32 weights from before a cast to bf16). keep_stepped: a
        param that has stepped keeps the state it has (one that load_state_dict() just gave
        it, say). Everything is checked before anything is set."""
        items = list(values.items())
        places = self._places([p for p, _ in items], "set_masters", lambda i: "a key of values")
        for (group_index, param_index), (p, value) in zip(places, items):
            if not isinstance(value, torch.Tensor) or (
                value.dtype != torch.float32 or value.shape != p.shape or value.device != p.device
            ):
                got = (f"of type {type(value).__name__}" if not isinstance(value, torch.Tensor)
                       else f"{value.dtype} of shape {tuple(value.shape)} on {value.device}")
                raise ValueError(
                    f"{type(self).__name__}.set_masters: the master given for "
                    f"{param_name(group_index, param_index)} is {got}; a master is a "
                    f"torch.float32 tensor of its param's shape {tuple(p.shape)} on its device "
                    f"({p.device})."
                )
        state = self.state
        for p, value in items:
            if keep_stepped and "step" in state.get(p, ()):
                continue
            state[p]["master_param"] = value

    def set_master_weights(self, mode: bool | str) -> None:
        """Sets master_weights to `mode` (True, False, "stochastic", "kahan" or "split") for
        every param group, and for groups added later (add_param_group takes the defaults).
        Each param's state is converted to the new mode at its next step, as a checkpoint
        saved in another mode is."""
        if not any(mode is v if isinstance(v, bool) else mode == v
                   for v in MASTER_WEIGHTS_VALUES):
            raise ValueError(
                f"{type(self).__name__}.set_master_weights: mode={mode!r}; it must be True "
                "(fp32 masters), False (none, round to nearest), 'stochastic', 'kahan' or "
                "'split' (bf16 params without fp32 masters)."
            )
        if mode in BF16_MODES:
            for group_index, group in enumerate(self.param_groups):
                for param_index, p in enumerate(group["params"]):
                    check_param_for_mode(self, group_index, param_index, p, mode)
        self.defaults["master_weights"] = mode
        for group in self.param_groups:
            group["master_weights"] = mode

    def _master_made(self, p: torch.Tensor) -> torch.Tensor:
        """p's master, made now (as its first step would) if it has none."""
        state = self.state[p]
        if "master_param" not in state:
            state["master_param"] = make_master(p)
        return state["master_param"]

    def _places(self, params: Iterable[Any], method: str,
                label: Callable[[int], str]) -> list[tuple[int, int]]:
        """(group index, param index) of each of `params`; ValueError naming `method` and the
        argument (label(i) for the i-th) for a tensor the optimizer does not hold."""
        where = {id(p): (group_index, param_index)
                 for group_index, group in enumerate(self.param_groups)
                 for param_index, p in enumerate(group["params"])}
        places: list[tuple[int, int]] = []
        for i, p in enumerate(params):
            place = where.get(id(p))
            if place is None:
                what = (f"a {p.dtype} tensor of shape {tuple(p.shape)}"
                        if isinstance(p, torch.Tensor) else f"a {type(p).__name__}")
                raise ValueError(
                    f"{type(self).__name__}.{method}: {label(i)} ({what}) is not a param of this "
                    "optimizer; pass params from its param_groups (add_param_group() adds one)."
                )
            places.append(place)
        return places

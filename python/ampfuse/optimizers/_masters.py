"""fp32 masters that follow their low-precision params when someone else writes those.

A master is the value the optimizer updates; every step writes it back, rounded, into the param.
When anything else writes the param in between (``model.load_state_dict``, a ``p.copy_`` under
``no_grad``, ``p.data = ...``), the master is stale and the next step would write the old
weights back. Such writes are noticed with no device sync: the param's version counter and data
pointer are recorded after each step, and any other write bumps the counter or replaces the
storage. Only then is a value compared (refresh_master).

The helpers serve ampfuse.amp's masters of torch.optim optimizers as well; MasterWeightsMixin
is the fused optimizers' side: which params keep a master, and following them at each step.
"""

from __future__ import annotations

import torch

from ampfuse.ops import step_scan

# The param dtypes that get an fp32 master when a group sets master_weights.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def keeps_master(group, p):
    """Whether the fused optimizers keep an fp32 master for param `p` of `group`
    (master_weights=True; the bf16 modes of _precision keep none)."""
    return group["master_weights"] is True and p.dtype in LOW_PRECISION


def make_master(p):
    """A new fp32 master for `p`: a copy of its value, so the first step starts from it."""
    return p.detach().to(torch.float32, copy=True)


def param_mark(param):
    """What changes when anyone but the fused step writes `param` (host-side, no sync)."""
    return (param._version, param.data_ptr())


@torch.no_grad()
def refresh_master(master: torch.Tensor, model_param: torch.Tensor, source=None) -> None:
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

    def __init__(self):
        self.mark = None
        self.strides = None


class MasterWeightsMixin:
    """A fused optimizer's fp32 masters: following writes to their params, and handing them out
    (master_params(), for amp and for clipping the tensors that are updated)."""

    def _record(self, p):
        record = self._param_records.get(p)
        if record is None:
            record = self._param_records[p] = ParamRecord()
        return record

    def _follow(self, p, master, record=None):
        """Remakes `master` if something other than a step wrote `p` since it was marked."""
        record = self._param_records.get(p) if record is None else record
        if record is not None and record.mark is not None and record.mark != param_mark(p):
            refresh_master(master, p)
            record.mark = param_mark(p)

    def _written_since_step(self, p, record):
        """Whether something other than a step wrote `p` since it was marked (then marks it):
        a kahan compensation or split low half no longer belongs to its value."""
        if record.mark is None or record.mark == param_mark(p):
            return False
        record.mark = param_mark(p)
        return True

    def follow_masters(self):
        """What each step does for the params it updates, for every param with a master now
        (before its masters are saved, say)."""
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state.get(p, {}).get("master_param")
                if master is not None:
                    self._follow(p, master)

    def mark_masters(self, params):
        """Records that `params` now hold what their masters say (the step just wrote them, or
        a caller such as amp set the masters from them): until something else writes one of
        them, its master is not looked at again."""
        for p in params:
            self._record(p).mark = param_mark(p)

    def _mark_stepped(self, call):
        """mark_masters for the params of an op call that just ran, through their records: no
        dict lookup per param, and one C++ pass where every param is a plain tensor."""
        if step_scan.mark_params(call.params, call.records):
            return
        for p, record in zip(call.params, call.records):  # a subclass such as DTensor
            record.mark = (p._version, p.data_ptr())  # param_mark(p), inline

    def master_params(self):
        """The tensors the optimizer actually updates, one per param in param-group order: the
        fp32 master of each fp16/bf16 param of a group with master_weights=True (created now
        from the param if no step has created it yet), else the param itself."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if keeps_master(group, p):
                    state = self.state[p]
                    if "master_param" not in state:
                        state["master_param"] = make_master(p)
                    out.append(state["master_param"])
                else:
                    out.append(p)
        return out

"""fp32 masters that follow their low-precision params when someone else writes those.

A master is the value the optimizer updates; every step writes it back, rounded, into the param.
When anything else writes the param in between (``model.load_state_dict``, a ``p.copy_`` under
``no_grad``, ``p.data = ...``), the master is stale and the next step would write the old
weights back. Such writes are noticed with no device sync: the param's version counter and data
pointer are recorded after each step, and any other write bumps the counter or replaces the
storage. Only then is a value compared (refresh_master).
"""

from __future__ import annotations

import torch


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

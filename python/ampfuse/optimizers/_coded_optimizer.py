"""state_dtype for the optimizers that keep Adam's moments (FusedAdam, FusedLAMB): which params
code their moments, how their state is made or converted, the lists a coded op call takes, and
a loaded group keeping this run's choice. The format and conversions are _state_codes'."""

from __future__ import annotations

from typing import Any

import torch

from ampfuse.optimizers._base import FusedOptimizer
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._state_codes import coded_keys, keeps_fp32_moments, prepare_moments
from ampfuse.optimizers._state_codes_sharded import is_dtensor, local, local_scales


class CodedMomentsOptimizer(FusedOptimizer):
    """A FusedOptimizer whose groups carry 'state_dtype' ("fp32", "int8", "fp8"): params of at
    least one block (256 elements), not complex, then hold their moments as codes and scales
    (sorted into calls of their own, call.coded); the others keep fp32 moments."""

    def _coded_layout(self, group: dict[str, Any]) -> tuple[str, tuple[str, ...] | None]:
        kind = group.get("state_dtype", "fp32")
        return (kind, None) if kind == "fp32" else (kind, coded_keys(self._state_keys(group)))

    def _prepare_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        kind = group.get("state_dtype", "fp32")
        if kind == "fp32" or p.is_complex() or keeps_fp32_moments(p.numel()):
            prepare_moments(p, state, "fp32", ())  # decodes a coded checkpoint's moments
            super()._prepare_state(group, p, state)
        else:
            prepare_moments(p, state, kind, self._state_keys(group))

    def _import_group(self, saved: dict[str, Any], current: dict[str, Any],
                      new: dict[str, Any]) -> None:
        # state_dtype is this run's storage choice, like master_weights: a checkpoint's moments
        # are converted to it at each param's next step, not the other way round.
        new["state_dtype"] = current.get("state_dtype", "fp32")
        super()._import_group(saved, current, new)


def coded_call_lists(call: OpCall, keys: tuple[str, ...]) -> tuple[
        list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
        list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """(params, grads, masters, codes per moment key, scales per moment key) of a coded call,
    as the coded ops take them. For FSDP2 (DTensor params) every rank steps its own shards,
    whose blocks and scales are its own (_state_codes_sharded): the lists are then its local
    tensors (a step that reduces over whole params, LAMB's, adds its sums over the shards)."""
    codes = [call.state_list(f"{key}_codes") for key in keys]
    scales = [call.state_list(f"{key}_scales") for key in keys]
    params, grads, masters = call.params, call.grads, call.masters()
    if params and is_dtensor(params[0]):
        params, grads, masters = ([local(t) for t in ts] for ts in (params, grads, masters))
        scales = [[local_scales(s, c) for s, c in zip(ss, cs)] for ss, cs in zip(scales, codes)]
        codes = [[local(c) for c in cs] for cs in codes]
    return list(params), list(grads), list(masters), codes, scales

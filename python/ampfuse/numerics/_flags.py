"""Which modules of a watched model would overflow or underflow in fp16/bf16, and the functions
they call that a custom_black_list can name: what Watch.flags() and suggest_black_list()
answer, from the counts the watch read back (Watch._read) and the torch functions each module
called (Watch._called)."""

from __future__ import annotations

import functools
import math

import torch

from ampfuse.amp.aten_lists import FP32_FUNCTIONS, aten_names, check_entry
from ampfuse.numerics._stats import Counts, Flag, StatKey


def find_flags(counts: dict[StatKey, Counts], called: dict[str, set[str]], dtype: torch.dtype,
               loss_scale: float, underflow: float) -> list[Flag]:
    """Watch.flags() on checked arguments (check_limits): `counts` per (module, phase, op,
    dtype), `called` the function names per module."""
    info = torch.finfo(dtype)
    by_module: dict[tuple[str, str], list[Counts]] = {}
    for (module, _phase, op, _), c in counts.items():
        if op in ("input", "output", "grad"):
            by_module.setdefault((module, op), []).append(c)

    def problems(module: str, what: str, scale: float) -> list[tuple[str, float]]:
        found = []
        cs = by_module.get((module, what), [])
        absmax = max((c.absmax * scale for c in cs), default=0.0)
        if absmax > info.max:
            found.append(("overflow", absmax))
        shares = (c.below(info.smallest_normal / scale) for c in cs)
        share = max((v for v in shares if not math.isnan(v)), default=0.0)
        if share > underflow:
            found.append(("underflow", share))
        return found

    result = []
    for module, what in by_module:
        if what == "input":
            continue
        scale = loss_scale if what == "grad" else 1.0
        found = problems(module, what, scale)
        if what == "output":
            came_in = {p for p, _ in problems(module, "input", 1.0)}
            found = [(p, v) for p, v in found if p not in came_in]
        for problem, value in found:
            result.append(Flag(module, what, problem, value, _names(called, module)))
    return result


def _names(called: dict[str, set[str]], module: str) -> tuple[str, ...]:
    names = []
    for name in sorted(called.get(module, ())):
        if name in FP32_FUNCTIONS or not _computes(name):
            continue
        try:
            check_entry(name, "numerics")
        except ValueError:
            continue
        names.append(name)
    return tuple(names)


def check_limits(dtype: torch.dtype, loss_scale: float | torch.Tensor,
                 underflow: float) -> tuple[torch.dtype, float, float]:
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"numerics: dtype must be torch.float16 or torch.bfloat16, the dtypes "
                         f"amp runs in, got {dtype!r}.")
    if isinstance(loss_scale, torch.Tensor) and loss_scale.numel() == 1:
        loss_scale = loss_scale.item()
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise TypeError(f"numerics: loss_scale must be a number, got {loss_scale!r}.")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"numerics: loss_scale must be positive and finite, got {loss_scale}.")
    if isinstance(underflow, bool) or not isinstance(underflow, (int, float)) \
            or not 0 <= underflow < 1:
        raise ValueError(f"numerics: underflow is the share of values allowed below the "
                         f"smallest normal, in [0, 1), got {underflow!r}.")
    return dtype, float(loss_scale), float(underflow)


@functools.cache
def _computes(name: str) -> bool:
    """Whether a list entry's aten ops compute new tensors (not views, shapes or copies of
    metadata), so that running it in fp32 changes something."""
    for aten in aten_names(name):
        packet = getattr(torch.ops.aten, aten, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            returns = getattr(packet, overload)._schema.returns
            if returns and str(returns[0].type) == "Tensor" and returns[0].alias_info is None:
                return True
    return False

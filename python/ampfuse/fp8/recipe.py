"""The FP8 recipes: how each FP8 tensor of a Linear gets its scale.

``CurrentScaling`` (the default, what ``fp8=True`` means): one scale per tensor from its own
amax in the same step. ``RowwiseScaling``: one scale per row of activations and output grads
and per output feature of the weight, all e4m3. ``DelayedScaling``: a scale from the amaxes of
earlier steps (an amax history per tensor, updated once per optimizer step).
"""

from __future__ import annotations

import dataclasses

import torch

from ampfuse.fp8.rowwise_gemm import GEMM_BACKENDS
from ampfuse.ops.fp8 import AMAX_COMPUTE

_FORMATS = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    torch.float8_e4m3fn: torch.float8_e4m3fn,
    torch.float8_e5m2: torch.float8_e5m2,
}


def _format(field: str, value: object,
            name: str = "ampfuse.fp8.DelayedScaling") -> torch.dtype:
    try:
        return _FORMATS[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"{name}: {field}={value!r} is not an FP8 format; use \"e4m3\" "
            "(torch.float8_e4m3fn) or \"e5m2\" (torch.float8_e5m2)."
        ) from None


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each FP8 tensor (a layer's input, weight and output gradient) is cast
    with a scale computed from the amaxes of earlier steps, so the cast needs no pass over the
    tensor before it.

    margin: the scale is ``fp8_max / amax / 2**margin`` (0 to 64); a margin leaves headroom
    for values that grow between updates.
    amax_history_len: how many steps' amaxes each tensor remembers (>= 1).
    amax_compute: "max" (the largest amax of the history) or "most_recent" (the last step's).
    fwd_format: the format of inputs and weights. Only "e4m3": the forward GEMM multiplies
    two forward tensors, and cuBLASLt's FP8 GEMMs take at most one e5m2 operand.
    bwd_format: the format of output gradients, "e5m2" (range, the usual choice) or "e4m3"
    (precision).
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute: str = "max"
    # A name or a torch dtype; __post_init__ stores the torch dtype.
    fwd_format: str | torch.dtype = "e4m3"
    bwd_format: str | torch.dtype = "e5m2"

    def __post_init__(self) -> None:
        name = "ampfuse.fp8.DelayedScaling"
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not (
                0 <= self.margin <= 64):
            raise ValueError(f"{name}: margin must be an int from 0 to 64, got {self.margin!r}.")
        if (isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int)
                or self.amax_history_len < 1):
            raise ValueError(f"{name}: amax_history_len must be an int >= 1, got "
                             f"{self.amax_history_len!r}.")
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(f"{name}: amax_compute must be \"max\" or \"most_recent\", got "
                             f"{self.amax_compute!r}.")
        fwd = _format("fwd_format", self.fwd_format)
        if fwd != torch.float8_e4m3fn:
            raise ValueError(
                f"{name}: fwd_format must be \"e4m3\": the forward GEMM multiplies the input "
                "by the weight, and cuBLASLt's FP8 GEMMs take at most one e5m2 operand. Use "
                "bwd_format for e5m2 gradients."
            )
        object.__setattr__(self, "fwd_format", fwd)
        object.__setattr__(self, "bwd_format", _format("bwd_format", self.bwd_format))


def _check_flag(name: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: {field} must be True or False, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Current (per-tensor, dynamic) scaling: each FP8 tensor is cast with
    ``fp8_max / amax`` of its own values in the same step, so no history is kept and there is
    nothing to update between steps. The weight's FP8 copies are made once per optimizer step
    and reused by every micro-batch (see ampfuse.fp8.weight_cache).

    fwd_format: inputs and weights, only "e4m3" (cuBLASLt's FP8 GEMMs take at most one e5m2
    operand). bwd_format: output gradients, "e5m2" (range, the usual choice) or "e4m3".
    fast_accum_fwd / fast_accum_bwd: cuBLASLt's fast FP8 accumulation for the forward GEMM
    (on by default, as TransformerEngine and torchao do) and for the two backward GEMMs (off:
    gradients sum over many more products). The CPU emulation ignores them.
    fsdp_fp8_all_gather: under FSDP2's ``fully_shard``, all-gather the weight's FP8 codes (1
    byte per element) instead of its high-precision values (see ampfuse.fp8.fsdp_all_gather);
    off by default. Each rank casts its own shard with the scale of the whole weight (one
    all-reduce of the shard amaxes per weight), so the numbers are those of the unsharded layer.
    Only current scaling offers it: rowwise scaling's weight scales are per output feature and
    the backward's per input feature, which a row shard cannot give alone, and delayed scaling
    is the legacy recipe.
    """

    fwd_format: str | torch.dtype = "e4m3"
    bwd_format: str | torch.dtype = "e5m2"
    fast_accum_fwd: bool = True
    fast_accum_bwd: bool = False
    fsdp_fp8_all_gather: bool = False

    def __post_init__(self) -> None:
        name = "ampfuse.fp8.CurrentScaling"
        fwd = _format("fwd_format", self.fwd_format, name)
        if fwd != torch.float8_e4m3fn:
            raise ValueError(f"{name}: fwd_format must be \"e4m3\": the forward GEMM multiplies "
                             "two forward tensors, and cuBLASLt's FP8 GEMMs take at most one "
                             "e5m2 operand. Use bwd_format for e5m2 gradients.")
        object.__setattr__(self, "fwd_format", fwd)
        object.__setattr__(self, "bwd_format", _format("bwd_format", self.bwd_format, name))
        _check_flag(name, "fast_accum_fwd", self.fast_accum_fwd)
        _check_flag(name, "fast_accum_bwd", self.fast_accum_bwd)
        _check_flag(name, "fsdp_fp8_all_gather", self.fsdp_fp8_all_gather)


@dataclasses.dataclass(frozen=True)
class RowwiseScaling:
    """Rowwise scaling: one scale per row of each GEMM operand (per token for activations and
    output gradients, per output feature of the weight; the backward GEMMs take per-column
    scales of the transposed operands), every tensor e4m3. More accurate than one scale per
    tensor when rows differ in range, a little slower.

    fast_accum_fwd / fast_accum_bwd: as in CurrentScaling.
    gemm_backend: which library runs the GEMMs (ampfuse.fp8.rowwise_gemm). "auto" (the
    default): ampfuse's fp8_gemm (cuBLASLt's outer-vector scales; the emulation on the CPU)
    wherever it runs, else torch._scaled_mm's rowwise path (e.g. on Ada), decided once per
    device and kind of GEMM; a GPU where neither runs is an error that says what to use
    instead. "ampfuse" or "torch" force one (for tests and comparisons).
    """

    fast_accum_fwd: bool = True
    fast_accum_bwd: bool = False
    gemm_backend: str = "auto"

    def __post_init__(self) -> None:
        name = "ampfuse.fp8.RowwiseScaling"
        _check_flag(name, "fast_accum_fwd", self.fast_accum_fwd)
        _check_flag(name, "fast_accum_bwd", self.fast_accum_bwd)
        if not isinstance(self.gemm_backend, str) or self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"{name}: gemm_backend must be \"auto\", \"ampfuse\" or "
                             f"\"torch\", got {self.gemm_backend!r}.")

    @property
    def fwd_format(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_format(self) -> torch.dtype:
        return torch.float8_e4m3fn


# Every recipe ampfuse knows; anything else is refused by checked_recipe.
Recipe = CurrentScaling | RowwiseScaling | DelayedScaling
RECIPES = (CurrentScaling, RowwiseScaling, DelayedScaling)


def checked_recipe(recipe: object, where: str) -> Recipe:
    """`recipe` if it is one of ampfuse's recipes, CurrentScaling() for None; else TypeError."""
    if recipe is None:
        return CurrentScaling()
    if isinstance(recipe, RECIPES):
        return recipe
    raise TypeError(
        f"{where}: recipe must be ampfuse.fp8.CurrentScaling, ampfuse.fp8.RowwiseScaling or "
        f"ampfuse.fp8.DelayedScaling, got {type(recipe).__module__}.{type(recipe).__qualname__}.")

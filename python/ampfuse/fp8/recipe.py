"""The FP8 recipe: how delayed scaling picks each FP8 tensor's scale."""

from __future__ import annotations

import dataclasses

import torch

from ampfuse.ops.fp8 import AMAX_COMPUTE

_FORMATS = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    torch.float8_e4m3fn: torch.float8_e4m3fn,
    torch.float8_e5m2: torch.float8_e5m2,
}


def _format(field: str, value: object) -> torch.dtype:
    try:
        return _FORMATS[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"ampfuse.fp8.DelayedScaling: {field}={value!r} is not an FP8 format; use \"e4m3\" "
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

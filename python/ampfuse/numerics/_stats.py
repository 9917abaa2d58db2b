"""The statistics behind ampfuse.numerics: running values kept on the device, read back to
the host in one transfer per device, and the report's rows and table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # fp16's smallest normal: smaller nonzero values lose precision or vanish

# A value's histogram bin is its biased binary exponent as fp32 and bf16 store it: 1..254 for
# normal values (floor(log2|x|) = bin - 127), 0 for zeros (and fp32/bf16 subnormals, below
# 2**-126), 255 for inf and nan. Read from the bits, which costs no conversion for fp32 and bf16.
_BINS = 256
_BIAS = 127
_EXPONENT_BITS = {torch.float32: (torch.int32, 23), torch.bfloat16: (torch.int16, 7)}


class Row(NamedTuple):
    """One line of the report: an op (aten name) that ran in `dtype`, or a module's "output" or
    "grad" (the gradient of its output). absmax is nan where nothing was recorded; underflow is
    the fraction of values with 0 < |x| < 2**-14, and headroom_bits log2(65504 / absmax)."""
    module: str
    phase: str
    op: str
    dtype: torch.dtype
    calls: int
    absmax: float
    underflow: float
    headroom_bits: float


class Flag(NamedTuple):
    """A module whose "output" or "grad" would overflow or underflow in the checked dtype."""
    module: str
    what: str  # "output" or "grad"
    problem: str  # "overflow" or "underflow"
    value: float  # the scaled absmax (overflow) or the fraction of values below the smallest normal
    names: tuple[str, ...]  # the functions it called that a custom_black_list can name


class Report(list[Row]):
    """report()'s rows; str() (and print) gives a table."""

    def __str__(self) -> str:
        return format_rows(self)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def format_rows(rows: Iterable[Row]) -> str:
    """The rows as a table, one line each."""
    header = ("module", "phase", "op", "dtype", "calls", "absmax", "underflow", "headroom")
    cells = [header] + [
        (r.module, r.phase, r.op, _dtype_name(r.dtype), str(r.calls),
         "-" if math.isnan(r.absmax) else f"{r.absmax:.3g}",
         "-" if math.isnan(r.underflow) else f"{r.underflow:.2%}",
         "-" if math.isnan(r.headroom_bits) else f"{r.headroom_bits:+.1f}")
        for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = []
    for n, c in enumerate(cells):
        left = [c[i].ljust(widths[i]) for i in range(4)]
        right = [c[i].rjust(widths[i]) for i in range(4, len(header))]
        lines.append("  ".join(left + right).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))
    lines.append("underflow: share of values with 0 < |x| < 2**-14 (fp16's smallest normal); "
                 "headroom: log2(65504 / absmax), bits left below fp16's max.")
    return "\n".join(lines)


def measure(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax as a 0-dim fp32 tensor, int64 histogram of binary exponents) of one tensor, on
    its device, with nothing read back to the host."""
    x = tensor.detach()
    if x.dtype not in _EXPONENT_BITS:
        x = x.float()  # fp16 (its subnormals become fp32 normals) and fp64
    low, high = torch.aminmax(x)
    absmax = torch.maximum(high, low.neg()).float()
    int_type, shift = _EXPONENT_BITS[x.dtype]
    bins = ((x.view(int_type) >> shift) & 0xFF).flatten().long()
    # scatter_add_, not bincount: bincount reads its maximum back to size its output.
    hist = torch.zeros(_BINS, dtype=torch.int64, device=x.device)
    hist.scatter_add_(0, bins, torch.ones(1, dtype=torch.int64, device=x.device).expand_as(bins))
    return absmax, hist


class Stat:
    """Running statistics of one (module, phase, op, dtype), on the device of its tensors."""

    __slots__ = ("calls", "numel", "absmax", "hist")

    def __init__(self) -> None:
        self.calls = self.numel = 0
        self.absmax: torch.Tensor | None = None
        self.hist: torch.Tensor | None = None

    def add(self, numel: int, measured: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Adds one call; `measured` is measure()'s result, or None for an op whose output was
        not measured (no floating output, or not an ordinary tensor)."""
        self.calls += 1
        if measured is None or not numel:
            return
        absmax, hist = measured
        if self.absmax is None:
            self.absmax, self.hist = absmax.clone(), hist.clone()
            self.numel = numel
            return
        device = self.absmax.device
        torch.maximum(self.absmax, absmax.to(device, non_blocking=True), out=self.absmax)
        # hist is set whenever absmax is.
        self.hist.add_(hist.to(device, non_blocking=True))  # type: ignore[union-attr]
        self.numel += numel


# What a Stat is kept per: (module, phase, op, dtype).
StatKey = tuple[str, str, str, torch.dtype]


class Counts(NamedTuple):
    """A Stat read back to the host."""
    calls: int
    numel: int
    absmax: float
    hist: list[int] | None

    def below(self, threshold: float) -> float:
        """Share of the values with 0 < |x| < threshold (to the power of two above threshold:
        exact when it is one). nan when nothing was measured."""
        if not self.numel or self.hist is None:
            return math.nan
        edge = min(max(math.ceil(math.log2(threshold)) + _BIAS, 1), _BINS - 1)
        return sum(self.hist[1:edge]) / self.numel

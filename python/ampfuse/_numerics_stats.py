"""The statistics behind ampfuse.numerics: running values kept on the device, read back to
the host in one transfer per device, and the report's rows and table."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # fp16's smallest normal: smaller nonzero values lose precision or vanish

# Binary exponents floor(log2|x|) from _EXP_MIN to _EXP_MAX get a bin each (fp64's subnormals
# and largest values excepted), then one bin for zeros and one for inf/nan.
_EXP_MIN, _EXP_MAX = -160, 160
_ZERO_BIN = _EXP_MAX - _EXP_MIN + 1
_NONFINITE_BIN = _ZERO_BIN + 1
_BINS = _NONFINITE_BIN + 1


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
    names: tuple  # the functions it called that a custom_black_list can name


class Report(list):
    """report()'s rows; str() (and print) gives a table."""

    def __str__(self):
        return format_rows(self)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def format_rows(rows) -> str:
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


class Stat:
    """Running statistics of one (module, phase, op, dtype), on the device of its tensors."""

    __slots__ = ("calls", "numel", "absmax", "tiny", "hist")

    def __init__(self):
        self.calls = self.numel = 0
        self.absmax = self.tiny = self.hist = None

    def add(self, tensor, histogram):
        self.calls += 1
        if tensor.numel() == 0:
            return
        device = self.absmax.device if self.absmax is not None else tensor.device
        x = tensor.detach().to(device, non_blocking=True).abs()
        absmax = x.amax().float()
        tiny = ((x > 0) & (x < FP16_TINY)).sum()
        if self.absmax is None:
            self.absmax, self.tiny = absmax, tiny
        else:
            torch.maximum(self.absmax, absmax, out=self.absmax)
            self.tiny.add_(tiny)
        self.numel += x.numel()
        if histogram:
            if self.hist is None:
                self.hist = torch.zeros(_BINS, dtype=torch.int64, device=device)
            x = x.float() if x.dtype != torch.float64 else x
            exponent = torch.frexp(x).exponent.long() - 1  # floor(log2 |x|) for x > 0
            bins = torch.where(x > 0, exponent.clamp(_EXP_MIN, _EXP_MAX) - _EXP_MIN, _ZERO_BIN)
            bins = torch.where(torch.isfinite(x), bins, _NONFINITE_BIN).flatten()
            # scatter_add_, not bincount: bincount reads its maximum back to size its output.
            self.hist.scatter_add_(0, bins, torch.ones_like(bins))


class Counts(NamedTuple):
    """A Stat read back to the host."""
    calls: int
    numel: int
    absmax: float
    tiny: int
    hist: list | None

    def below(self, threshold: float) -> float:
        """Share of the values with 0 < |x| * 1 < threshold, from the exponent histogram (exact
        when threshold is a power of two)."""
        if not self.numel:
            return math.nan
        if self.hist is None:
            return self.tiny / self.numel
        edge = min(max(math.ceil(math.log2(threshold)) - _EXP_MIN, 0), _ZERO_BIN)
        return sum(self.hist[:edge]) / self.numel

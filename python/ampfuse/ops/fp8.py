"""Typed wrappers and fake (meta) kernels of the FP8 ops (schemas in csrc/registration.cpp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ampfuse.ops import _library  # noqa: F401  (registers the ops first)
from ampfuse.ops._checks import check_scalar

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The largest finite value of each format: the cast saturates to it.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
AMAX_COMPUTE = ("max", "most_recent")

_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fp8_cast_amax(input: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """``(input * scale)`` in fp32, saturated to ``dtype``'s range and cast (inf becomes the
    largest finite value, nan stays nan), returned contiguous; in the same pass
    ``amax = max(amax, input.abs().amax())`` with nan propagating (amax must hold a value >= 0
    or nan; several casts of one step accumulate into it)."""
    return torch.ops.ampfuse.fp8_cast_amax(input, scale, amax, dtype)


def fp8_update_scales_(amaxes: Iterable[torch.Tensor], amax_histories: Iterable[torch.Tensor],
                       scales: Iterable[torch.Tensor], scale_invs: Iterable[torch.Tensor],
                       fp8_maxes: Iterable[float], margin: int = 0, amax_compute: str = "max",
                       found_inf: torch.Tensor | None = None) -> None:
    """Delayed scaling for every FP8 tensor of a step in one call (see the schema's comment)."""
    torch.ops.ampfuse.fp8_update_scales_(
        list(amaxes), list(amax_histories), list(scales), list(scale_invs),
        [float(m) for m in fp8_maxes], int(margin), amax_compute, found_inf,
    )


GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
             b_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16,
             use_fast_accum: bool = False) -> torch.Tensor:
    """``(a @ b.T) * scales + bias`` for fp8 ``a`` [m, k] and ``b`` [n, k] (both contiguous;
    m, n, k multiples of 16), accumulated in fp32 and rounded once to ``out_dtype``.

    Scales: tensorwise (``a_scale_inv`` and ``b_scale_inv`` one element each) or rowwise
    (``a_scale_inv`` [m], one per row of ``a``, and ``b_scale_inv`` [n], one per row of ``b``;
    both operands float8_e4m3fn; on CUDA compute capability 9.0 or newer).
    ``out_dtype``: torch.bfloat16, torch.float16 or torch.float32; ``bias`` [n] has
    ``out_dtype`` and is fused into cuBLASLt's epilogue for bf16 and fp16 outputs (an fp32 bias
    is added after the GEMM: cuBLASLt's FP8 kernels take only a bf16 bias with an fp32 output).
    ``use_fast_accum``: cuBLASLt's FP8 fast accumulation on CUDA (faster, partial sums kept in
    lower precision along K); the CPU emulation, the fp32-accumulated reference, ignores it.

    A problem the GPU or its cuBLASLt cannot run (compute capability below 8.9, rowwise scales
    below 9.0, no cuBLASLt algorithm, a refused scale mode or first launch) raises
    NotImplementedError, and only such a problem does; other errors are RuntimeError.
    """
    return torch.ops.ampfuse.fp8_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype,
                                      use_fast_accum)


class Fp8GemmPlanStats(NamedTuple):
    """Counters of ``fp8_gemm``'s cuBLASLt plan cache over the process (all threads)."""

    built: int
    """Plans (descriptors, layouts and the heuristic's algorithm) built."""
    reused: int
    """CUDA calls that found their plan cached."""
    evicted: int
    """Plans dropped as the least recently used of a full cache (a later call of that problem
    builds it again)."""
    capacity: int
    """The most plans one host thread keeps (0 in a build without CUDA)."""


def fp8_gemm_plan_stats() -> Fp8GemmPlanStats:
    """``(built, reused, evicted, capacity)`` of ``fp8_gemm``'s plan cache: how many cuBLASLt
    plans it has built in this process, how many CUDA calls found theirs cached, how many
    plans it dropped, and how many one thread keeps. Each host thread caches up to
    ``capacity`` plans and drops the least recently used when full: a plan's key holds the
    problem's m (the tokens of a batch), so variable sequence lengths would otherwise grow the
    cache without end. The counters stay 0 without CUDA calls. For tests and benchmarks."""
    built, reused, evicted, capacity = torch.ops.ampfuse.fp8_gemm_plan_stats()
    return Fp8GemmPlanStats(int(built), int(reused), int(evicted), int(capacity))


def fp8_transpose(input: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[k, m]`` copy of the 2-D fp8 tensor ``input`` ``[m, k]``, codes unchanged:
    the K-contiguous operand an FP8 GEMM of the backward takes (tiled in shared memory on
    CUDA, where a strided copy of one-byte elements is slow)."""
    return torch.ops.ampfuse.fp8_transpose(input)


def fp8_tensor_scale(input: torch.Tensor, dtype: torch.dtype, margin: float = 0.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling of one tensor: ``(amax, scale, scale_inv)``, each a fresh fp32 ``[1]``
    on ``input``'s device, computed there (no host sync). ``amax = input.abs().amax()`` with
    nan winning; ``scale = FP8_MAX[dtype] / amax / 2**margin`` in fp32; ``scale_inv = 1 / scale``.
    An all-zero (or empty) input gives scale 1; an inf or nan anywhere gives a nan scale and
    scale_inv, so that everything computed from them is nan and an overflow check sees it; a
    quotient beyond fp32's range is clamped to the largest finite / smallest normal fp32."""
    return torch.ops.ampfuse.fp8_tensor_scale(input, dtype, float(margin))


def fp8_cast_transpose(input: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For a 2-D ``input`` ``[m, k]``: its fp8 codes as :func:`fp8_cast_amax` gives them
    (``[m, k]``) and the same codes transposed (``[k, m]``, contiguous), with ``amax`` folded
    as :func:`fp8_cast_amax` folds it, in one pass over ``input``."""
    return torch.ops.ampfuse.fp8_cast_transpose(input, scale, amax, dtype)


def fp8_cast_transpose_dbias(input: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fp8_cast_transpose` plus ``dbias = input.sum(0)`` accumulated in fp32 (fp32 ``[k]``),
    the bias gradient of a linear layer whose output gradient is ``input``."""
    return torch.ops.ampfuse.fp8_cast_transpose_dbias(input, scale, amax, dtype)


def fp8_quantize_rowwise(input: torch.Tensor, dtype: torch.dtype, transpose: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise current scaling of a 2-D ``input`` ``[m, k]``: ``transpose=False`` gives the codes
    ``[m, k]`` and one ``scale_inv`` per row (``[m]``); ``transpose=True`` gives the codes of
    ``input.T`` (``[k, m]``, contiguous) and one ``scale_inv`` per column of ``input`` (``[k]``).
    Each row's (column's) scale follows :func:`fp8_tensor_scale`'s rule, without margin."""
    return torch.ops.ampfuse.fp8_quantize_rowwise(input, dtype, bool(transpose))


# ---- fake kernels: the checks that need no data, with the real kernels' wording ----------


def _check_fp8_dtype(op: str, what: str, dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise RuntimeError(
            f"ampfuse.{op}: {what} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}."
        )


@torch.library.register_fake("ampfuse::fp8_cast_amax")
def _cast_amax_fake(input: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    op = "fp8_cast_amax"
    if input.dtype not in _INPUT_DTYPES:
        raise RuntimeError(
            f"ampfuse.{op}: input has dtype {input.dtype}; ampfuse ops take torch.float32, "
            "torch.float16 or torch.bfloat16 tensors."
        )
    _check_fp8_dtype(op, "dtype", dtype)
    check_scalar(op, "scale", scale, torch.float32, input.device, device_owner="input")
    check_scalar(op, "amax", amax, torch.float32, input.device, device_owner="input")
    return input.new_empty(input.shape, dtype=dtype)


@torch.library.register_fake("ampfuse::fp8_update_scales_")
def _update_scales_fake(amaxes: Sequence[torch.Tensor], amax_histories: Sequence[torch.Tensor],
                        scales: Sequence[torch.Tensor], scale_invs: Sequence[torch.Tensor],
                        fp8_maxes: Sequence[float], margin: int, amax_compute: str,
                        found_inf: torch.Tensor | None = None) -> None:
    op = "fp8_update_scales_"
    n = len(amaxes)
    if not (len(amax_histories) == len(scales) == len(scale_invs) == len(fp8_maxes) == n):
        raise RuntimeError(
            f"ampfuse.{op}: amaxes, amax_histories, scales, scale_invs and fp8_maxes must have "
            "one entry per FP8 tensor."
        )
    if amax_compute not in AMAX_COMPUTE:
        raise RuntimeError(f"ampfuse.{op}: amax_compute must be \"max\" or \"most_recent\", "
                           f"got \"{amax_compute}\".")
    device = amaxes[0].device if n else None
    for i in range(n):
        for name, t in (("amaxes", amaxes[i]), ("scales", scales[i]),
                        ("scale_invs", scale_invs[i])):
            check_scalar(op, f"{name}[{i}]", t, torch.float32, device, "amaxes[0]")
        h = amax_histories[i]
        if h.dtype != torch.float32 or h.dim() != 1 or h.numel() < 1 or h.device != device:
            raise RuntimeError(f"ampfuse.{op}: amax_histories[{i}] must be a 1-D torch.float32 "
                               f"tensor of >= 1 entries on {device}.")
    if found_inf is not None:
        check_scalar(op, "found_inf", found_inf, torch.float32, device, "amaxes")


@torch.library.register_fake("ampfuse::fp8_gemm")
def _gemm_fake(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
               b_scale_inv: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    op = "fp8_gemm"
    _check_fp8_dtype(op, "a", a.dtype)
    _check_fp8_dtype(op, "b", b.dtype)
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise RuntimeError(f"ampfuse.{op}: a and b are both float8_e5m2; cuBLASLt's FP8 GEMMs "
                           "take at most one e5m2 operand. Quantize one of them to "
                           "float8_e4m3fn.")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise RuntimeError(f"ampfuse.{op}: a [m, k] and b [n, k] must be 2-D with the same k, "
                           f"got {tuple(a.shape)} and {tuple(b.shape)}.")
    m, n = a.shape[0], b.shape[0]
    for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if t.dtype != torch.float32 or t.device != a.device:
            raise RuntimeError(f"ampfuse.{op}: {name} must be a torch.float32 tensor on "
                               f"{a.device} (the device of a), got {t.dtype} on {t.device}.")
    if not (a_scale_inv.numel() == 1 and b_scale_inv.numel() == 1):
        if not (a_scale_inv.dim() == 1 and a_scale_inv.shape[0] == m
                and b_scale_inv.dim() == 1 and b_scale_inv.shape[0] == n):
            raise RuntimeError(
                f"ampfuse.{op}: a_scale_inv has shape {tuple(a_scale_inv.shape)} and "
                f"b_scale_inv has shape {tuple(b_scale_inv.shape)}; they must be either one "
                f"element each (tensorwise scaling) or 1-D of m={m} and n={n} elements "
                "(rowwise scaling).")
        if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
            raise RuntimeError(f"ampfuse.{op}: rowwise scales (a_scale_inv [m], b_scale_inv "
                               "[n]) need both a and b in torch.float8_e4m3fn.")
    if out_dtype not in GEMM_OUT_DTYPES:
        raise RuntimeError(f"ampfuse.{op}: out_dtype must be torch.bfloat16, torch.float16 or "
                           f"torch.float32, got {out_dtype}.")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype != out_dtype
                             or bias.device != a.device):
        raise RuntimeError(f"ampfuse.{op}: bias must be a 1-D tensor of n={n} elements with "
                           f"dtype out_dtype ({out_dtype}) on {a.device}, got shape "
                           f"{tuple(bias.shape)}, dtype {bias.dtype} on {bias.device}.")
    return a.new_empty((m, n), dtype=out_dtype)


@torch.library.register_fake("ampfuse::fp8_transpose")
def _transpose_fake(input: torch.Tensor) -> torch.Tensor:
    op = "fp8_transpose"
    _check_fp8_dtype(op, "input", input.dtype)
    if input.dim() != 2:
        raise RuntimeError(f"ampfuse.{op}: input must be 2-D (rows x columns), got shape "
                           f"{tuple(input.shape)}; reshape it to 2-D first (an FP8 GEMM operand "
                           "is a matrix).")
    return input.new_empty((input.shape[1], input.shape[0]))


def _check_input_dtype(op: str, input: torch.Tensor) -> None:
    if input.dtype not in _INPUT_DTYPES:
        raise RuntimeError(
            f"ampfuse.{op}: input has dtype {input.dtype}; ampfuse ops take torch.float32, "
            "torch.float16 or torch.bfloat16 tensors."
        )


def _check_matrix(op: str, input: torch.Tensor) -> None:
    if input.dim() != 2:
        raise RuntimeError(f"ampfuse.{op}: input must be 2-D [m, k], got shape "
                           f"{tuple(input.shape)}; flatten the leading dimensions first "
                           "(x.reshape(-1, x.shape[-1])).")
    _check_input_dtype(op, input)


@torch.library.register_fake("ampfuse::fp8_tensor_scale")
def _tensor_scale_fake(input: torch.Tensor, dtype: torch.dtype, margin: float = 0.0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "fp8_tensor_scale"
    _check_input_dtype(op, input)
    _check_fp8_dtype(op, "dtype", dtype)
    if not (0.0 <= margin <= 64.0):
        raise RuntimeError(f"ampfuse.{op}: margin must be a finite number between 0 and 64, "
                           f"got {margin}.")
    return tuple(input.new_empty((1,), dtype=torch.float32) for _ in range(3))  # type: ignore[return-value]


def _cast_transpose_common(op: str, input: torch.Tensor, scale: torch.Tensor,
                           amax: torch.Tensor,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check_matrix(op, input)
    _check_fp8_dtype(op, "dtype", dtype)
    check_scalar(op, "scale", scale, torch.float32, input.device, device_owner="input")
    check_scalar(op, "amax", amax, torch.float32, input.device, device_owner="input")
    m, k = input.shape
    return input.new_empty((m, k), dtype=dtype), input.new_empty((k, m), dtype=dtype)


@torch.library.register_fake("ampfuse::fp8_cast_transpose")
def _cast_transpose_fake(input: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _cast_transpose_common("fp8_cast_transpose", input, scale, amax, dtype)


@torch.library.register_fake("ampfuse::fp8_cast_transpose_dbias")
def _cast_transpose_dbias_fake(input: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                               dtype: torch.dtype
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, out_t = _cast_transpose_common("fp8_cast_transpose_dbias", input, scale, amax, dtype)
    return out, out_t, input.new_empty((input.shape[1],), dtype=torch.float32)


@torch.library.register_fake("ampfuse::fp8_quantize_rowwise")
def _quantize_rowwise_fake(input: torch.Tensor, dtype: torch.dtype, transpose: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    op = "fp8_quantize_rowwise"
    _check_matrix(op, input)
    _check_fp8_dtype(op, "dtype", dtype)
    m, k = input.shape
    if transpose:
        return input.new_empty((k, m), dtype=dtype), input.new_empty((k,), dtype=torch.float32)
    return input.new_empty((m, k), dtype=dtype), input.new_empty((m,), dtype=torch.float32)

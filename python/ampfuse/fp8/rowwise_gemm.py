"""Which library runs the GEMMs of the rowwise FP8 Linear: ampfuse's ``fp8_gemm`` or
``torch._scaled_mm``.

Both take the same problem: ``out = (a @ b.T) * a_scale_inv[:, None] * b_scale_inv[None, :]
(+ bias)`` with e4m3 ``a`` [m, k] and ``b`` [n, k]. ampfuse's op runs cuBLASLt's outer-vector
scales (compute capability 9.0+, a cuBLASLt of CUDA 12.9 or newer) and, on the CPU, the exact
emulation; torch's rowwise path runs cuBLASLt on Hopper and newer and its own CUTLASS kernel on
Ada (8.9), and has no CPU kernel. ``RowwiseScaling(gemm_backend=...)`` picks: ``"ampfuse"``,
``"torch"`` or ``"auto"`` (the default), ampfuse's op where it runs and torch's elsewhere.

"auto" decides once per problem kind (device, output dtype, bias or not, fast accumulation):
the first time a kind is met, a 16 x 16 x 16 GEMM of that kind goes through ampfuse's op, which
raises NotImplementedError, and only then, when the GPU or its cuBLASLt cannot run the problem
(csrc/ops/fp8_gemm.cpp). Only then is torch._scaled_mm tried the same way, with a warning; if it
refuses too, the error names the device, its compute capability and what to use instead. The
answers describe the machine and its libraries, not a model, so they are kept for the process
(``clear_backend_choices`` forgets them, for tests).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from ampfuse.ops import fp8 as fp8_ops

GEMM_BACKENDS = ("auto", "ampfuse", "torch")
_E4M3 = torch.float8_e4m3fn
_NAME = "ampfuse.fp8.RowwiseScaling"
# (a, b, a_scale_inv, b_scale_inv, bias, out_dtype, fast_accum) -> out: ampfuse_gemm, torch_gemm
GemmFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                   torch.dtype, bool], torch.Tensor]


class GemmKind(NamedTuple):
    """What the choice of library depends on (shapes do not: any multiple of 16 runs where a
    16 x 16 x 16 problem of the same kind does)."""

    device: torch.device
    out_dtype: torch.dtype
    bias: bool
    fast_accum: bool

    def describe(self) -> str:
        return (f"{str(self.out_dtype).removeprefix('torch.')} output, "
                f"{'with' if self.bias else 'no'} bias, use_fast_accum={self.fast_accum}")


class RowwiseBackends(NamedTuple):
    """The library of each GEMM of one rowwise Linear call: "ampfuse" or "torch"."""

    forward: str
    dgrad: str
    wgrad: str


def ampfuse_gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                 b_scale_inv: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                 fast_accum: bool) -> torch.Tensor:
    return fp8_ops.fp8_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, fast_accum)


def torch_gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
               b_scale_inv: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
               fast_accum: bool) -> torch.Tensor:
    """fp8_gemm's contract through torch._scaled_mm. torch wants its first operand row-major and
    its second column-major: ``b.t()`` of our contiguous [n, k] ``b`` is exactly that, with no
    copy. Its rowwise scales are 2-D and contiguous, (m, 1) and (1, n) fp32: views of our 1-D
    ones. It takes a bias only for bf16 and fp16 outputs (of the output's dtype, as ours is);
    an fp32 output gets the bias added after the GEMM, as fp8_gemm does on CUDA."""
    fused = bias is not None and out_dtype != torch.float32
    out = torch._scaled_mm(a, b.t(), a_scale_inv.contiguous().view(-1, 1),
                           b_scale_inv.contiguous().view(1, -1),
                           bias=bias if fused else None, out_dtype=out_dtype,
                           use_fast_accum=fast_accum)
    if bias is not None and not fused:
        out = out + bias
    return out


def gemm(backend: str, a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
         b_scale_inv: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
         fast_accum: bool) -> torch.Tensor:
    """One rowwise GEMM through `backend` ("ampfuse" or "torch", as ``choose_backend`` gave)."""
    if backend == "ampfuse":
        return ampfuse_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, fast_accum)
    try:
        return torch_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, fast_accum)
    except (RuntimeError, ValueError) as error:
        kind = GemmKind(a.device, out_dtype, bias is not None, fast_accum)
        raise RuntimeError(
            f"{_NAME}: torch._scaled_mm refused a rowwise-scaled FP8 GEMM ({kind.describe()}) "
            f"on {_device_words(a.device)} ({_reason(error)}). "
            "Use gemm_backend=\"auto\" (ampfuse's "
            "fp8_gemm wherever it runs: on the CPU and on CUDA compute capability 9.0+) or "
            "ampfuse.fp8.CurrentScaling().") from error


def _reason(error: BaseException) -> str:
    """An error's message to quote inside a sentence (no trailing period)."""
    return str(error).strip().rstrip(".")


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _device_words(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    major, minor = _capability(device)
    return (f"{device} ({torch.cuda.get_device_name(device)}, compute capability "
            f"{major}.{minor})")


def _probe(run: GemmFn, kind: GemmKind) -> None:
    """One 16 x 16 x 16 GEMM of `kind` through `run` (ampfuse_gemm or torch_gemm): raises what
    that library raises for the kind. Enqueues a tiny GEMM; never waits for the device."""
    codes = torch.zeros(16, 16, device=kind.device).to(_E4M3)
    ones = torch.ones(16, device=kind.device)
    bias = torch.zeros(16, dtype=kind.out_dtype, device=kind.device) if kind.bias else None
    run(codes, codes, ones, ones, bias, kind.out_dtype, kind.fast_accum)


class BackendChoices:
    """gemm_backend="auto"'s answer per GemmKind, found once (see the module docstring)."""

    def __init__(self) -> None:
        self._chosen: dict[GemmKind, str] = {}
        self._warned: set[torch.device] = set()

    def choose(self, requested: str, kind: GemmKind) -> str:
        if requested != "auto":
            return requested
        chosen = self._chosen.get(kind)
        if chosen is None:
            chosen = self._chosen[kind] = self._find(kind)
        return chosen

    def clear(self) -> None:
        self._chosen.clear()
        self._warned.clear()

    def _find(self, kind: GemmKind) -> str:
        if kind.device.type != "cuda":
            # The CPU emulation (exact; torch._scaled_mm has no rowwise CPU kernel), or the
            # fake kernel of a meta tensor.
            return "ampfuse"
        where = _device_words(kind.device)
        if _capability(kind.device) < (8, 9):
            raise RuntimeError(
                f"{_NAME}: {where} has no FP8 GEMMs (they need compute capability 8.9 or "
                "newer: Ada, Hopper, Blackwell), in ampfuse and in torch._scaled_mm alike. "
                "Train this model without fp8 (plain O2 in bf16 or fp16) on this GPU.")
        try:
            _probe(ampfuse_gemm, kind)
            return "ampfuse"
        except NotImplementedError as refusal:
            ampfuse_refusal = refusal
        try:
            _probe(torch_gemm, kind)
        except (RuntimeError, ValueError) as torch_refusal:
            raise RuntimeError(
                f"{_NAME}: neither ampfuse's fp8_gemm nor torch._scaled_mm runs a rowwise-"
                f"scaled FP8 GEMM ({kind.describe()}) on {where}. ampfuse: "
                f"{_reason(ampfuse_refusal)}. torch: {_reason(torch_refusal)}. Use "
                "ampfuse.fp8.CurrentScaling() (one scale per tensor, no rowwise kernel needed) "
                "or train without fp8.") from torch_refusal
        if kind.device not in self._warned:
            self._warned.add(kind.device)
            warnings.warn(
                f"{_NAME}: ampfuse's fp8_gemm cannot run rowwise scales on {where} "
                f"({_reason(ampfuse_refusal)}); its rowwise GEMMs run through torch._scaled_mm "
                "instead.",
                stacklevel=4)
        return "torch"


_CHOICES = BackendChoices()


@torch.compiler.assume_constant_result
def choose_backend(requested: str, device: torch.device, out_dtype: torch.dtype, bias: bool,
                   fast_accum: bool) -> str:
    """"ampfuse" or "torch" for a GEMM of this kind under ``gemm_backend=requested``. A
    constant for torch.compile: the choice is made (and probed) eagerly while tracing."""
    return _CHOICES.choose(requested, GemmKind(device, out_dtype, bias, fast_accum))


def clear_backend_choices() -> None:
    """Forgets every "auto" choice (tests; a process that changes its CUDA libraries)."""
    _CHOICES.clear()


def backends_for(requested: str, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                 fast_accum: tuple[bool, bool]) -> RowwiseBackends:
    """The library of each GEMM of a rowwise Linear on x [m, k] (forward out in x's dtype with
    the bias; dgrad in x's dtype; wgrad in the weight's dtype; the backward ones without bias).
    A backward GEMM that will not run (no grad needed) is not looked up: it could only raise
    for a kind that never runs."""
    device = x.device
    forward = choose_backend(requested, device, x.dtype, has_bias, fast_accum[0])
    grad = torch.is_grad_enabled()
    dgrad = wgrad = forward
    if grad and x.requires_grad:
        dgrad = choose_backend(requested, device, x.dtype, False, fast_accum[1])
    if grad and weight.requires_grad:
        wgrad = choose_backend(requested, device, weight.dtype, False, fast_accum[1])
    return RowwiseBackends(forward, dgrad, wgrad)

"""The FP8 Linear's autograd Function for rowwise scaling (every tensor e4m3).

Each GEMM operand [rows, K] gets one scale per row, so the scales run along the dimensions the
GEMM keeps (M and N) and the sum over K needs none: per token for x and the output gradient,
per output feature for the weight in the forward; per input feature (w transposed), per
output feature (g transposed) and per input feature (x transposed) in the backward.
``fp8_quantize_rowwise(t, dtype, transpose=True)`` quantizes t.T row by row in one pass.
x's transposed copy is made in the forward and saved in FP8 for the weight gradient.
Each GEMM runs through the library ``backends`` names for it (ampfuse.fp8.rowwise_gemm: ampfuse's
fp8_gemm or torch._scaled_mm, chosen by the layer before the call).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ampfuse.fp8.rowwise_gemm import RowwiseBackends, gemm

_ops = torch.ops.ampfuse
_E4M3 = torch.float8_e4m3fn


class RowwiseWeight(NamedTuple):
    """A weight [n, k]: w8 [n, k] with scale_inv [n], w8t [k, n] with scale_inv_t [k]."""

    w8: torch.Tensor
    scale_inv: torch.Tensor
    w8t: torch.Tensor
    scale_inv_t: torch.Tensor


def quantize_weight_rowwise(weight: torch.Tensor) -> RowwiseWeight:
    w = weight.detach()
    w8, w_si = _ops.fp8_quantize_rowwise(w, _E4M3, False)
    w8t, w_si_t = _ops.fp8_quantize_rowwise(w, _E4M3, True)
    return RowwiseWeight(w8, w_si, w8t, w_si_t)


class RowwiseLinear(torch.autograd.Function):
    """x [m, k] (m a multiple of 16) -> x @ weight.T + bias [m, n]; see the module docstring.
    ``weight`` is passed for its gradient; its FP8 copies come in ``wq``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                wq: RowwiseWeight, fast_accum: tuple[bool, bool],
                backends: RowwiseBackends) -> torch.Tensor:
        x8, x_si = _ops.fp8_quantize_rowwise(x, _E4M3, False)
        gemm_bias = None if bias is None else bias.to(x.dtype)
        out = gemm(backends.forward, x8, wq.w8, x_si, wq.scale_inv, gemm_bias, x.dtype,
                   fast_accum[0])
        x8t = x_si_t = w8t = w_si_t = None
        if ctx.needs_input_grad[1]:
            x8t, x_si_t = _ops.fp8_quantize_rowwise(x, _E4M3, True)
        if ctx.needs_input_grad[0]:
            w8t, w_si_t = wq.w8t, wq.scale_inv_t
        ctx.save_for_backward(x8t, x_si_t, w8t, w_si_t)
        ctx.fast_accum_bwd = fast_accum[1]
        ctx.backends = backends
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8t, x_si_t, w8t, w_si_t = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        fast = ctx.fast_accum_bwd
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            g8, g_si = _ops.fp8_quantize_rowwise(grad_out, _E4M3, False)
            grad_x = gemm(ctx.backends.dgrad, g8, w8t, g_si, w_si_t, None, x_dtype, fast)
        if ctx.needs_input_grad[1]:
            g8t, g_si_t = _ops.fp8_quantize_rowwise(grad_out, _E4M3, True)
            grad_w = gemm(ctx.backends.wgrad, g8t, x8t, g_si_t, x_si_t, None, w_dtype, fast)
        if ctx.needs_input_grad[2]:
            # Summed in fp32 without an fp32 copy of grad_out (tokens x out_features).
            grad_b = grad_out.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None

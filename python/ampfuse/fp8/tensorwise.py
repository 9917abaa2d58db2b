"""The FP8 Linear's autograd Function for one scale per tensor: current and delayed scaling.

Forward: one pass over x writes its FP8 copy, the transposed FP8 copy the weight gradient needs
and x's amax (``fp8_cast_transpose``); the weight comes quantized in both layouts from the
layer's weight cache; ``fp8_gemm`` adds the bias in its epilogue and writes the model's dtype.
Only x's transposed FP8 copy is saved for the backward (1 byte per element, not 2).
Backward: one pass over the output gradient writes both FP8 layouts, its amax and the bias
gradient (``fp8_cast_transpose_dbias``); dgrad = g8 @ w8t.T, wgrad = g8t @ x8t.T.

Current scaling computes each scale on the device from the tensor itself
(``fp8_tensor_scale``), just before the cast; delayed scaling casts with the layer's stored
scale and folds the amax into its buffer (``update_scales`` moves the scales once per step).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

_ops = torch.ops.ampfuse


class TensorwiseWeight(NamedTuple):
    """A weight [n, k] in FP8: w8 [n, k], w8t [k, n] (contiguous), and its scale_inv [1]."""

    w8: torch.Tensor
    w8t: torch.Tensor
    scale_inv: torch.Tensor


def quantize_weight_current(weight: torch.Tensor, dtype: torch.dtype) -> TensorwiseWeight:
    amax, scale, scale_inv = _ops.fp8_tensor_scale(weight.detach(), dtype, 0.0)
    w8, w8t = _ops.fp8_cast_transpose(weight.detach(), scale, amax, dtype)
    return TensorwiseWeight(w8, w8t, scale_inv)


def quantize_weight_delayed(weight: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                            amax: torch.Tensor, dtype: torch.dtype) -> TensorwiseWeight:
    w8, w8t = _ops.fp8_cast_transpose(weight.detach(), scale, amax, dtype)
    return TensorwiseWeight(w8, w8t, scale_inv)


class DelayedState(NamedTuple):
    """Delayed scaling's per-layer state used inside the Function (the layer's buffers; the
    amaxes may be scratch tensors in eval mode)."""

    x_scale: torch.Tensor
    x_scale_inv: torch.Tensor
    x_amax: torch.Tensor
    g_scale: torch.Tensor
    g_scale_inv: torch.Tensor
    g_amax: torch.Tensor


class Options(NamedTuple):
    fwd_format: torch.dtype
    bwd_format: torch.dtype
    fast_accum_fwd: bool
    fast_accum_bwd: bool


def _gemm_out(dtype: torch.dtype) -> torch.dtype:
    # fp8_gemm writes bf16, fp16 or fp32 directly: every float dtype a model uses.
    return dtype


class TensorwiseLinear(torch.autograd.Function):
    """x [m, k] (m a multiple of 16) -> x @ weight.T + bias [m, n], every GEMM in FP8.

    ``weight`` is passed for its gradient only; its FP8 copies come in ``wq``. ``delayed``:
    None for current scaling. Inputs and the output are whole 2-D tensors: the caller pads and
    reshapes outside (under torch.compile an output that is a view lost its gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                wq: TensorwiseWeight, delayed: DelayedState | None,
                opts: Options) -> torch.Tensor:
        if delayed is None:
            x_amax, x_scale, x_scale_inv = _ops.fp8_tensor_scale(x, opts.fwd_format, 0.0)
        else:
            x_amax, x_scale, x_scale_inv = delayed.x_amax, delayed.x_scale, delayed.x_scale_inv
        x8, x8t = _ops.fp8_cast_transpose(x, x_scale, x_amax, opts.fwd_format)
        out_dtype = _gemm_out(x.dtype)
        gemm_bias = None if bias is None else bias.to(out_dtype)
        out = _ops.fp8_gemm(x8, wq.w8, x_scale_inv, wq.scale_inv, gemm_bias, out_dtype,
                            use_fast_accum=opts.fast_accum_fwd)
        # Only what the backward reads: x's transposed copy for wgrad, w's for dgrad. The
        # scales ride on ctx (delayed scaling's buffers change in place in update_scales, and
        # a second graph through the layer must not see a "modified saved tensor" error).
        ctx.save_for_backward(x8t if ctx.needs_input_grad[1] else None,
                              wq.w8t if ctx.needs_input_grad[0] else None)
        ctx.scales = (x_scale_inv, wq.scale_inv)
        ctx.delayed = delayed
        ctx.opts = opts
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8t, w8t = ctx.saved_tensors
        x_scale_inv, w_scale_inv = ctx.scales
        delayed: DelayedState | None = ctx.delayed
        opts: Options = ctx.opts
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_out = grad_out.contiguous()
        if delayed is None:
            g_amax, g_scale, g_scale_inv = _ops.fp8_tensor_scale(grad_out, opts.bwd_format, 0.0)
        else:
            g_amax, g_scale, g_scale_inv = delayed.g_amax, delayed.g_scale, delayed.g_scale_inv
        grad_b = None
        if ctx.needs_input_grad[2]:
            g8, g8t, dbias = _ops.fp8_cast_transpose_dbias(grad_out, g_scale, g_amax,
                                                           opts.bwd_format)
            grad_b = dbias.to(b_dtype)
        else:
            g8, g8t = _ops.fp8_cast_transpose(grad_out, g_scale, g_amax, opts.bwd_format)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _ops.fp8_gemm(g8, w8t, g_scale_inv, w_scale_inv, None, _gemm_out(x_dtype),
                                   use_fast_accum=opts.fast_accum_bwd)
        if ctx.needs_input_grad[1]:
            grad_w = _ops.fp8_gemm(g8t, x8t, g_scale_inv, x_scale_inv, None, _gemm_out(w_dtype),
                                   use_fast_accum=opts.fast_accum_bwd)
        return grad_x, grad_w, grad_b, None, None, None

"""The FP8 recipes written with plain torch ops, as the exact reference of the fp8 tests.

Each function mirrors one op of the FP8 Linear (``torch.ops.ampfuse.fp8_*``): casts are
``sat(x * scale)`` to the format, scales come from amaxes as ``fp8_max / amax`` (1 for a zero
amax), GEMMs multiply the FP8 values in fp32 (every product of two FP8 values is exact in fp32),
then apply the two scale_invs and the bias, and round once to the output dtype.
"""

import torch

MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def scale_from_amax(amax, dtype, margin=0.0):
    """fp32 scale and scale_inv from fp32 amaxes (any shape), each division correctly rounded
    to fp32 (done in fp64, which rounds a quotient of fp32 values once more exactly: torch's
    vectorized fp32 division and reciprocal may differ by an ulp)."""
    quotient = (MAX[dtype] / amax.double()).float()
    scale = torch.where(amax > 0, (quotient.double() / 2.0**margin).float(),
                        torch.ones_like(amax))
    return scale, (1.0 / scale.double()).float()


def tensor_scale(x, dtype, margin=0.0):
    amax = x.detach().float().abs().max().reshape(1)
    scale, scale_inv = scale_from_amax(amax, dtype, margin)
    return amax, scale, scale_inv


def cast(x, scale, dtype):
    """sat(x * scale) in `dtype` (scale: [1], or [rows, 1] for rowwise; on any device)."""
    return (x.float() * scale.float().to(x.device)).clamp(-MAX[dtype], MAX[dtype]).to(dtype)


def cast_transpose(x, scale, dtype):
    q = cast(x, scale, dtype)
    return q, q.T.contiguous()


def quantize_rowwise(x, dtype, transpose):
    t = x.float().T if transpose else x.float()
    amax = t.abs().amax(dim=1)
    scale, scale_inv = scale_from_amax(amax, dtype)
    return cast(t, scale[:, None], dtype).contiguous(), scale_inv


def gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype):
    """(a @ b.T) * scales (+ bias) for a [m, k], b [n, k]; scales [1] or rowwise [m] / [n]."""
    acc = a.float() @ b.float().T
    a_si = a_scale_inv.reshape(-1, 1) if a_scale_inv.numel() > 1 else a_scale_inv
    b_si = b_scale_inv.reshape(1, -1) if b_scale_inv.numel() > 1 else b_scale_inv
    out = acc * (a_si * b_si)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def pad16(t):
    extra = -t.shape[0] % 16
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def current_linear(x, w, b, grad_out, fwd=torch.float8_e4m3fn, bwd=torch.float8_e5m2):
    """out, grad_x, grad_w, grad_b of an FP8 Linear with current scaling (2-D x)."""
    m = x.shape[0]
    x, grad_out = pad16(x), pad16(grad_out)
    _, xs, xsi = tensor_scale(x, fwd)
    _, ws, wsi = tensor_scale(w, fwd)
    x8, w8 = cast(x, xs, fwd), cast(w, ws, fwd)
    out = gemm(x8, w8, xsi, wsi, None if b is None else b.to(x.dtype), x.dtype)
    _, gs, gsi = tensor_scale(grad_out, bwd)
    g8 = cast(grad_out, gs, bwd)
    grad_x = gemm(g8, w8.T.contiguous(), gsi, wsi, None, x.dtype)
    grad_w = gemm(g8.T.contiguous(), x8.T.contiguous(), gsi, xsi, None, w.dtype)
    grad_b = None if b is None else grad_out.float().sum(0).to(b.dtype)
    return out[:m], grad_x[:m], grad_w, grad_b


def rowwise_linear(x, w, b, grad_out):
    e4m3 = torch.float8_e4m3fn
    m = x.shape[0]
    x, grad_out = pad16(x), pad16(grad_out)
    x8, xsi = quantize_rowwise(x, e4m3, False)
    w8, wsi = quantize_rowwise(w, e4m3, False)
    out = gemm(x8, w8, xsi, wsi, None if b is None else b.to(x.dtype), x.dtype)
    g8, gsi = quantize_rowwise(grad_out, e4m3, False)
    w8t, wsit = quantize_rowwise(w, e4m3, True)
    grad_x = gemm(g8, w8t, gsi, wsit, None, x.dtype)
    g8t, gsit = quantize_rowwise(grad_out, e4m3, True)
    x8t, xsit = quantize_rowwise(x, e4m3, True)
    grad_w = gemm(g8t, x8t, gsit, xsit, None, w.dtype)
    grad_b = None if b is None else grad_out.float().sum(0).to(b.dtype)
    return out[:m], grad_x[:m], grad_w, grad_b


class Ops:
    """Stand-ins for the torch.ops.ampfuse FP8 ops, built on the functions above."""

    @staticmethod
    def fp8_tensor_scale(x, dtype, margin=0.0):
        return tensor_scale(x, dtype, margin)

    @staticmethod
    def fp8_cast_transpose(x, scale, amax, dtype):
        amax.copy_(torch.maximum(amax, x.detach().float().abs().max().reshape(1)))
        return cast_transpose(x, scale, dtype)

    @staticmethod
    def fp8_cast_transpose_dbias(x, scale, amax, dtype):
        q, qt = Ops.fp8_cast_transpose(x, scale, amax, dtype)
        return q, qt, x.float().sum(0)

    @staticmethod
    def fp8_quantize_rowwise(x, dtype, transpose):
        return quantize_rowwise(x, dtype, transpose)

    @staticmethod
    def fp8_gemm(a, b, a_si, b_si, bias, out_dtype, use_fast_accum=False):
        return gemm(a, b, a_si, b_si, bias, out_dtype)

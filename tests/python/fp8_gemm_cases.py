"""Operands, the float64 reference and error bounds shared by the fp8_gemm tests
(test_fp8_gemm.py on the CPU, test_fp8_gemm_cuda.py on a GPU)."""

import torch
from helpers import make_generator

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Unit roundoff of each output type: the final rounding of the result.
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# fp32 accumulation; Hopper's FP8 fast accumulation keeps partial sums with about 13 bits of
# mantissa between promotions (a bound, not a measurement: used for the flag's CUDA test).
ACCUMULATION = {False: 2.0**-24, True: 2.0**-13}


def operands(m, n, k, a_dtype=E4M3, b_dtype=E4M3, rowwise=False, seed=0, device="cpu"):
    """a [m, k], b [n, k] in fp8 (|x| up to ~200, inside both formats' range), scale_invs
    (one element each, or [m] and [n] for rowwise) and an fp32 bias [n]."""
    gen = make_generator(seed)
    a = (torch.randn(m, k, generator=gen) * 50).to(a_dtype)
    b = (torch.randn(n, k, generator=gen) * 50).to(b_dtype)
    if rowwise:
        a_scale_inv = torch.rand(m, generator=gen) * 0.02 + 1e-3
        b_scale_inv = torch.rand(n, generator=gen) * 4e-3 + 1e-4
    else:
        a_scale_inv = torch.tensor([0.013])
        b_scale_inv = torch.tensor([2.5e-3])
    bias = torch.randn(n, generator=gen)
    return [t.to(device) for t in (a, b, a_scale_inv, b_scale_inv, bias)]


def scale_product(a_scale_inv, b_scale_inv, m, n):
    """The scale each output element gets, in float64, [m, n] or broadcastable to it."""
    if a_scale_inv.numel() == 1 and b_scale_inv.numel() == 1:
        return a_scale_inv.double().reshape(()) * b_scale_inv.double().reshape(())
    return a_scale_inv.double().reshape(m, 1) * b_scale_inv.double().reshape(1, n)


def float64_reference(a, b, a_scale_inv, b_scale_inv, bias):
    a, b = a.cpu(), b.cpu()
    m, n = a.shape[0], b.shape[0]
    out = (a.double() @ b.double().T) * scale_product(a_scale_inv.cpu(), b_scale_inv.cpu(), m, n)
    return out if bias is None else out + bias.cpu().double()


def error_bound(a, b, a_scale_inv, b_scale_inv, expected, out_dtype, fast_accum=False):
    """Per output element: the summation error (k * u * sum |a_i b_i|, scaled), the rounding of
    the scale product and of the scaled sum in fp32 (4 units), and the output's rounding."""
    a, b = a.cpu(), b.cpu()
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    magnitude = (a.double().abs() @ b.double().abs().T) * scale_product(
        a_scale_inv.cpu().abs(), b_scale_inv.cpu().abs(), m, n)
    return (k * ACCUMULATION[fast_accum] * magnitude + 4 * 2.0**-24 * magnitude
            + ROUNDING[out_dtype] * expected.abs())


def assert_matches(out, expected, bound):
    """Same non-finite values in the same places (nan for nan, inf of the same sign), and every
    finite value within its bound."""
    out = out.double().cpu()
    assert out.shape == expected.shape
    assert torch.equal(out.isnan(), expected.isnan()), "nan in other places than the reference"
    assert torch.equal(out.isinf(), expected.isinf()), "inf in other places than the reference"
    infinite = expected.isinf()
    assert torch.equal(out[infinite].sign(), expected[infinite].sign())
    finite = expected.isfinite()
    excess = (out[finite] - expected[finite]).abs() - bound[finite]
    assert (excess <= 0).all(), f"max error over the bound: {excess.max().item()}"

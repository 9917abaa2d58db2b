"""The one tolerance table of the Python tests, and the comparison that reports its failures.

Every op under test computes in fp32 and rounds once to the stored dtype, so an elementwise
result may differ from a float64 reference by at most one unit in the last place of its dtype:
`rtol` is that unit relative to the value (2**-(mantissa bits)), and `atol` is the dtype's
smallest subnormal, which only matters at the very bottom of the range. Where the op's fp32
arithmetic can be reproduced exactly, the tests compare bit for bit (`exact=True`) instead.

`reduction_rtol` bounds fp32-accumulated reductions (L2 norms) of inputs of that dtype against
float64. Inputs are upcast exactly, so it is the same for every dtype; 1e-5 holds for millions of
elements with any blocked or pairwise summation, and fails a naive running fp32 sum of them.
"""

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    reduction_rtol: float


TOLERANCES = {
    torch.float32: Tolerance(rtol=2.0**-23, atol=2.0**-149, reduction_rtol=1e-5),
    torch.float16: Tolerance(rtol=2.0**-10, atol=2.0**-24, reduction_rtol=1e-5),
    torch.bfloat16: Tolerance(rtol=2.0**-7, atol=2.0**-133, reduction_rtol=1e-5),
}

_BITS_DTYPE = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.int16: torch.int16,  # bit patterns kept as integers (split's low halves)
}


def tolerance(dtype):
    return TOLERANCES[dtype]


def _describe_worst(index_flat, shape, actual, expected, err, n_bad, n_total, what):
    index = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(index_flat), shape)) if shape else ()
    )
    return (
        f"{what}: {n_bad} of {n_total} elements ({100.0 * n_bad / max(n_total, 1):.4g}%) differ; "
        f"worst at index {index}: actual {actual!r}, expected {expected!r}, {err}"
    )


def assert_close_report(actual, expected, *, dtype=None, exact=False, rtol=None, atol=None, msg=""):
    """Asserts that `actual` matches `expected`, element by element.

    exact=True: same dtype, same bits (+0 and -0 differ); NaN matches NaN whatever its payload.
    Otherwise: |actual - expected| <= atol + rtol * |expected| with the table's entry for `dtype`
    (default actual.dtype) unless rtol/atol are given; inf must match inf of the same sign and NaN
    must match NaN. On failure the message gives the failing fraction and the worst element with
    its index, both values and its error.
    """
    what = msg or "tensors"
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor), what
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a = actual.detach().cpu()
    e = expected.detach().cpu()
    shape = tuple(a.shape)
    n_total = a.numel()
    if n_total == 0:
        return

    if exact:
        assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
        a_nan, e_nan = torch.isnan(a), torch.isnan(e)
        int_dtype = _BITS_DTYPE[a.dtype]
        a_bits = a.contiguous().view(int_dtype).to(torch.int64)
        e_bits = e.contiguous().view(int_dtype).to(torch.int64)
        bad = (a_nan != e_nan) | (~a_nan & ~e_nan & (a_bits != e_bits))
        n_bad = int(bad.sum())
        if n_bad:
            # The worst element is the one furthest apart in units of the last place; for values
            # of the same sign that is the distance between their bit patterns.
            ulps = (a_bits - e_bits).abs().masked_fill(~bad, -1)
            ulps = torch.where(a_nan != e_nan, torch.full_like(ulps, 1 << 40), ulps)
            flat = int(ulps.reshape(-1).argmax())
            av, ev = a.reshape(-1)[flat].item(), e.reshape(-1)[flat].item()
            raise AssertionError(
                _describe_worst(
                    flat,
                    shape,
                    av,
                    ev,
                    f"{int(ulps.reshape(-1)[flat])} ulp apart (bitwise)",
                    n_bad,
                    n_total,
                    what + " [exact]",
                )
            )
        return

    tol = TOLERANCES[dtype if dtype is not None else a.dtype]
    rtol = tol.rtol if rtol is None else rtol
    atol = tol.atol if atol is None else atol
    a64 = a.to(torch.float64)
    e64 = e.to(torch.float64)
    a_nan, e_nan = torch.isnan(a64), torch.isnan(e64)
    a_inf, e_inf = torch.isinf(a64), torch.isinf(e64)
    finite = ~(a_nan | e_nan | a_inf | e_inf)
    abs_err = torch.where(finite, (a64 - e64).abs(), torch.zeros_like(a64))
    allowed = atol + rtol * e64.abs()
    bad = (a_nan != e_nan) | ((a_inf | e_inf) & ~(a_nan | e_nan) & (a64 != e64))
    bad |= finite & (abs_err > allowed)
    n_bad = int(bad.sum())
    if n_bad:
        # Rank by how many times over its allowance each element is; non-finite mismatches first.
        excess = torch.where(finite, abs_err / allowed, torch.full_like(a64, math.inf))
        excess = excess.masked_fill(~bad, -1.0)
        flat = int(excess.reshape(-1).argmax())
        av, ev = a64.reshape(-1)[flat].item(), e64.reshape(-1)[flat].item()
        err = abs(av - ev) if math.isfinite(av) and math.isfinite(ev) else math.nan
        rel = err / abs(ev) if ev != 0 and math.isfinite(err) else math.inf
        raise AssertionError(
            _describe_worst(
                flat,
                shape,
                av,
                ev,
                f"abs err {err:.6g}, rel err {rel:.6g} (rtol {rtol:.3g}, atol {atol:.3g})",
                n_bad,
                n_total,
                what,
            )
        )


def assert_lists_exact(actual, expected, keys, msg=""):
    """assert_close_report(exact=True) on every tensor of actual[key] against expected[key]'s,
    for each key (dicts of tensor lists, as the optimizer-op tests build them)."""
    for key in keys:
        for i, (a, e) in enumerate(zip(actual[key], expected[key])):
            assert_close_report(a, e, exact=True, msg=f"{key}[{i}]{msg}")


def relative_error(actual, reference):
    """|actual - reference| / |reference| for scalars or 0-dim tensors, in float64."""
    a = float(actual)
    r = float(reference)
    if r == 0.0:
        return abs(a)
    return abs(a - r) / abs(r)

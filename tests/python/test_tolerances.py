"""The comparison every op test relies on must fail where it should, and say where."""

import math

import pytest
import torch
from helpers import FLOAT_DTYPES, dtype_id
from tolerances import TOLERANCES, assert_close_report


def one_ulp_up(t):
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return (t.view(bits[t.dtype]) + 1).view(t.dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_one_ulp_passes_the_table_and_fails_exact(dtype):
    expected = torch.linspace(1.0, 2.0, 1000).to(dtype)
    actual = expected.clone()
    actual[617] = one_ulp_up(actual[617 : 617 + 1])[0]
    assert_close_report(actual, expected, dtype=dtype)
    with pytest.raises(AssertionError, match=r"1 of 1000 elements \(0\.1%\).*index \(617,\)"):
        assert_close_report(actual, expected, exact=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_three_ulps_fail_the_table(dtype):
    expected = torch.full((4, 5), 1.5, dtype=dtype)
    actual = expected.clone()
    actual[2, 3] = one_ulp_up(one_ulp_up(one_ulp_up(actual[2, 3].reshape(1))))[0]
    with pytest.raises(AssertionError, match=r"index \(2, 3\)"):
        assert_close_report(actual, expected, dtype=dtype)


@pytest.mark.parametrize(
    ("a", "e"),
    [(math.nan, 1.0), (1.0, math.nan), (math.inf, -math.inf), (math.inf, 3.0), (3.0, -math.inf)],
)
def test_non_finite_mismatches_fail(a, e):
    expected = torch.tensor([0.5, e, 0.25])
    actual = torch.tensor([0.5, a, 0.25])
    for exact in (False, True):
        with pytest.raises(AssertionError, match=r"index \(1,\)"):
            assert_close_report(actual, expected, exact=exact)


def test_matching_non_finite_values_pass():
    values = torch.tensor([math.nan, math.inf, -math.inf, 0.0])
    assert_close_report(values.clone(), values, exact=True)
    assert_close_report(values.clone(), values)


def test_signed_zero_differs_bitwise():
    with pytest.raises(AssertionError):
        assert_close_report(torch.tensor([-0.0]), torch.tensor([0.0]), exact=True)


def test_shape_and_dtype_mismatches_fail():
    with pytest.raises(AssertionError, match="shape"):
        assert_close_report(torch.zeros(3), torch.zeros(4))
    with pytest.raises(AssertionError, match="dtype"):
        assert_close_report(torch.zeros(3), torch.zeros(3, dtype=torch.float16), exact=True)


def test_table_is_one_ulp_per_dtype():
    for dtype, tol in TOLERANCES.items():
        info = torch.finfo(dtype)
        assert tol.rtol == info.eps and tol.atol == info.tiny * info.eps
        assert tol.reduction_rtol == 1e-5

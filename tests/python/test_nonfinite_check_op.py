"""torch.ops.ampfuse.multi_tensor_nonfinite_check_(tensors, found_inf).

Reference: torch.isfinite over each tensor. The op reads the tensors only, sets found_inf to 1
when any element is inf/nan, and never clears it (like multi_tensor_unscale_).
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from helpers import (
    BAD_DTYPES,
    CHUNK,
    CHUNK_SIZES,
    FLOAT_DTYPES,
    INJECTION_SIZES,
    NON_FINITE,
    POSITIONS,
    dtype_id,
    filled,
    make_generator,
    non_dense_2d,
    other_device,
    position_index,
    raises_naming,
    random_list,
    scalar_tensor,
)

check_ = torch.ops.ampfuse.multi_tensor_nonfinite_check_


def run_check(tensors, start=0.0):
    """Runs the op on `tensors` and returns the flag, after checking that no tensor changed."""
    device = tensors[0].device if tensors else "cpu"
    before = [t.clone() for t in tensors]
    found_inf = scalar_tensor(start, device)
    check_(tensors, found_inf)
    for i, (t, b) in enumerate(zip(tensors, before)):
        same_bits = torch.equal(t.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        assert same_bits, f"tensors[{i}] was written"
    return found_inf.item()


def expected_flag(tensors, start=0.0):
    return 1.0 if start or any(not bool(torch.isfinite(t).all()) for t in tensors) else 0.0


@pytest.mark.parametrize("size", CHUNK_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_finite_tensors_leave_found_inf_clear(device, dtype, size):
    tensors = random_list([size, 5, size + 1], dtype, device, make_generator(size))
    info = torch.finfo(dtype)
    tensors.append(torch.tensor([info.max, -info.max, info.tiny * info.eps, 0.0, -0.0],
                                dtype=dtype, device=device))
    assert run_check(tensors) == 0.0


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("value", NON_FINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_sets_found_inf(device, dtype, value, position):
    """The first element of the first tensor, the middle one of the middle tensor (which spans
    three chunks), the last one of the last tensor."""
    tensors = random_list(INJECTION_SIZES, dtype, device, make_generator(7))
    target = tensors[position_index(position, len(tensors))]
    target[position_index(position, target.numel())] = value
    assert run_check(tensors) == 1.0 == expected_flag(tensors)


@pytest.mark.parametrize("index", range(4))
def test_non_finite_in_a_mixed_dtype_list_with_empties(device, index):
    tensors = random_list([CHUNK + 3, 0, 2 * CHUNK + 1, 9], FLOAT_DTYPES, device,
                          make_generator(index))
    if tensors[index].numel():
        tensors[index][-1] = float("nan")
    assert run_check(tensors) == expected_flag(tensors)


def test_set_found_inf_stays_set_and_empty_lists_change_nothing(device):
    tensors = random_list([CHUNK + 1, 10], FLOAT_DTYPES, device, make_generator(11))
    assert run_check(tensors, start=1.0) == 1.0
    for start in (0.0, 1.0):
        assert run_check([], start=start) == start
        empties = [torch.empty(0, dtype=d, device=device) for d in FLOAT_DTYPES]
        assert run_check(empties, start=start) == start


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "strided_slice"])
def test_any_layout_is_read(device, layout):
    gen = make_generator(12)
    base = random_list([(4, 6, 5, 3)], torch.bfloat16, device, gen)[0]
    view = {
        "transposed": base[0, 0].t(),
        "channels_last": base.to(memory_format=torch.channels_last),
        "strided_slice": non_dense_2d(torch.bfloat16, device, gen),
    }[layout]
    assert run_check([view]) == 0.0
    view[(1, 2) if view.dim() == 2 else (1, 2, 3, 1)] = float("inf")
    assert run_check([view]) == 1.0


def test_zero_dim_found_inf(device):
    found_inf = torch.zeros((), device=device)
    check_([torch.full((3,), float("-inf"), device=device)], found_inf)
    assert found_inf.item() == 1.0


# --- misuse ------------------------------------------------------------------------------------


def _valid_list(device):
    return random_list([10, CHUNK + 1, 3], FLOAT_DTYPES, device, make_generator(20))


@pytest.mark.parametrize("bad_dtype", BAD_DTYPES, ids=dtype_id)
def test_rejects_tensor_dtype(device, bad_dtype):
    tensors = _valid_list(device) + [filled((4,), bad_dtype, device)]
    with raises_naming(r"tensors\[3\]", "float32"):
        check_(tensors, scalar_tensor(0.0, device))


def test_rejects_mixed_devices(device):
    tensors = _valid_list(device)
    tensors[2] = tensors[2].to(other_device(device))
    with raises_naming(r"tensors\[2\]", "same device"):
        check_(tensors, scalar_tensor(0.0, device))


BAD_FOUND_INF = {
    "float64": (lambda d: torch.zeros(1, dtype=torch.float64, device=d), "float32"),
    "float16": (lambda d: torch.zeros(1, dtype=torch.float16, device=d), "float32"),
    "int32": (lambda d: torch.zeros(1, dtype=torch.int32, device=d), "float32"),
    "bool": (lambda d: torch.zeros(1, dtype=torch.bool, device=d), "float32"),
    "two_elements": (lambda d: torch.zeros(2, device=d), "one element"),
    "other_device": (lambda d: torch.zeros(1, device=other_device(d)), "move found_inf"),
}


@pytest.mark.parametrize("case", list(BAD_FOUND_INF))
def test_rejects_bad_found_inf(device, case):
    make, reason = BAD_FOUND_INF[case]
    tensors = _valid_list(device)
    tensors[0][0] = float("nan")
    if case == "other_device" and device == "cpu":
        reason = "meta"  # a meta flag with CPU tensors runs the fake kernel, which names it
    with raises_naming("found_inf", reason):
        check_(tensors, make(device))


def test_sparse_tensor_gets_the_fix():
    with raises_naming(r"multi_tensor_nonfinite_check_: tensors\[1\] is a sparse COO",
                       r"coalesce\(\).*_values\(\)"):
        check_([torch.randn(3), torch.randn(4, 4).to_sparse()], torch.zeros(1))


# --- dispatcher contract -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mixed", "with_inf", "with_empty", "empty_list"])
def test_opcheck(device, case):
    tensors = random_list([5, CHUNK + 1, 7], FLOAT_DTYPES, device, make_generator(27))
    if case == "with_inf":
        tensors[1][100] = float("inf")
    if case == "with_empty":
        tensors.insert(1, torch.empty(0, device=device))
    if case == "empty_list":
        tensors = []
    torch.library.opcheck(check_, (tensors, scalar_tensor(0.0, device)))


def test_fake_kernel_checks_like_the_real_one():
    with torch._subclasses.FakeTensorMode():
        tensors = [torch.empty(4), torch.empty(3, dtype=torch.bfloat16)]
        check_(tensors, torch.zeros(1))  # no error, no data read
        with raises_naming("found_inf"):
            check_(tensors, torch.zeros(1, dtype=torch.float64))
        with raises_naming(r"tensors\[1\]"):
            check_([tensors[0], torch.empty(2, dtype=torch.int32)], torch.zeros(1))

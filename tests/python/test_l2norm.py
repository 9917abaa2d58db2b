"""torch.ops.ampfuse.multi_tensor_l2norm(tensors, per_tensor) -> (global_norm, per_tensor_norms).

Reference: float64 sums of squares of the (exactly upcast) inputs. The bound is the table's
reduction_rtol; for scale, torch's own fp32 norm misses 1e-5 beyond about a million elements
(its CPU error grows with the length), so the messages quote torch's error too.
"""

import math

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from helpers import (
    BAD_DTYPES,
    CHUNK,
    CHUNK_SIZES,
    FLOAT_DTYPES,
    MANY_TENSORS,
    Guarded,
    chunks_past_the_block_cap,
    dtype_id,
    filled,
    make_generator,
    mixed_shapes,
    non_dense_2d,
    other_device,
    raises_naming,
    random_list,
    random_values,
)
from tolerances import relative_error, tolerance

l2norm = torch.ops.ampfuse.multi_tensor_l2norm


def sums_of_squares(tensors):
    return [t.detach().cpu().double().square().sum().item() for t in tensors]


def torch_fp32_error(tensors, reference):
    if not tensors:
        return 0.0
    norms = torch._foreach_norm([t.float() for t in tensors])
    return relative_error(torch.linalg.vector_norm(torch.stack(norms)).item(), reference)


def check_norms(result, tensors, per_tensor, device):
    total, per = result
    assert total.dtype == torch.float32 and total.shape == () and total.device.type == device
    assert per.dtype == torch.float32 and per.device.type == device
    assert per.shape == ((len(tensors),) if per_tensor else (0,))
    rtol = min(tolerance(t.dtype).reduction_rtol for t in tensors)

    squares = sums_of_squares(tensors)
    reference = math.sqrt(sum(squares))
    err = relative_error(total.item(), reference)
    assert math.isfinite(total.item()) and err <= rtol, (
        f"global norm {total.item()!r} vs float64 {reference!r}: "
        f"relative error {err:.3g} > {rtol:.1g} "
        f"(torch's fp32 norm: {torch_fp32_error(tensors, reference):.3g})"
    )
    if per_tensor:
        for i, (norm, sq) in enumerate(zip(per.tolist(), squares)):
            if sq == 0.0:
                assert norm == 0.0, (
                    f"per-tensor norm [{i}] of an all-zero or empty tensor is {norm!r}"
                )
                continue
            err = relative_error(norm, math.sqrt(sq))
            assert err <= rtol, (
                f"per-tensor norm [{i}]: {norm!r} vs float64 {math.sqrt(sq)!r}, rel err {err:.3g}"
            )


@pytest.mark.parametrize("per_tensor", [True, False], ids=["per_tensor", "global_only"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("size", CHUNK_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_norms_at_chunk_boundaries(device, dtype, size, offset, per_tensor):
    gen = make_generator(size + offset)
    values = random_values(size, dtype, device, gen)
    # The NaN guards beside the view make any read past its ends show up as a NaN norm.
    guarded = Guarded(values, offset)
    other = random_values(CHUNK + 3, dtype, device, gen)
    tensors = [guarded.view, other]

    result = l2norm(tensors, per_tensor)

    check_norms(result, tensors, per_tensor, device)
    guarded.assert_guards_intact()


@pytest.mark.parametrize("count", [1, 3, 230, MANY_TENSORS])
def test_lists_of_mixed_dtypes_with_empty_tensors(device, count):
    gen = make_generator(count)
    shapes = mixed_shapes(count, gen)
    tensors = random_list(shapes, FLOAT_DTYPES, device, gen)
    before = [t.clone() for t in tensors]

    check_norms(l2norm(tensors, True), tensors, True, device)
    check_norms(l2norm(tensors, False), tensors, False, device)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), "l2norm must not write its inputs"


def test_empty_tensors_give_zero(device):
    tensors = [
        torch.empty(0, device=device),
        torch.empty(0, 3, dtype=torch.float16, device=device),
        torch.ones(5, dtype=torch.bfloat16, device=device),
        torch.empty(0, dtype=torch.bfloat16, device=device),
    ]
    total, per = l2norm(tensors, True)
    assert per[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    assert relative_error(per[2].item(), math.sqrt(5.0)) <= 2.0**-23
    assert relative_error(total.item(), math.sqrt(5.0)) <= 2.0**-23

    total, per = l2norm(tensors[:2], True)
    assert total.item() == 0.0 and total.device.type == device
    assert per.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("per_tensor", [True, False])
def test_empty_list(per_tensor):
    total, per = l2norm([], per_tensor)
    assert total.shape == () and total.dtype == torch.float32 and total.device.type == "cpu"
    assert total.item() == 0.0
    assert per.shape == (0,) and per.dtype == torch.float32 and per.device.type == "cpu"


@pytest.mark.parametrize("distribution", ["normal", "uniform_0.5_1.5"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_millions_of_elements_stay_accurate(device, dtype, distribution):
    # 4M elements: a single running fp32 sum is off by ~1e-3 here, torch's CPU norm by ~1e-4.
    gen = make_generator(40)
    n = 4 * 1024 * 1024
    if distribution == "normal":
        big = torch.randn(n, generator=gen)
    else:
        big = torch.rand(n, generator=gen) + 0.5
    tensors = [big.to(dtype).to(device), random_values(1000, dtype, device, gen, magnitude=1.0)]
    check_norms(l2norm(tensors, True), tensors, True, device)


def test_tensor_past_the_per_launch_block_cap(device):
    gen = make_generator(41)
    tensors = [
        random_values(3, torch.float32, device, gen),
        random_values(
            chunks_past_the_block_cap(device) * CHUNK + 3, torch.float16, device, gen,
            magnitude=1.0,
        ),
    ]
    check_norms(l2norm(tensors, True), tensors, True, device)


def test_fp16_extremes_do_not_overflow(device):
    # 2^20 values of 65504: the sum of squares (4.5e15) is far past fp16's range, not fp32's.
    n = 1 << 20
    tensors = [
        torch.full((n,), 65504.0, dtype=torch.float16, device=device),
        torch.full((n,), -65504.0, dtype=torch.float16, device=device),
    ]
    check_norms(l2norm(tensors, True), tensors, True, device)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"]
)
def test_non_finite_inputs_give_non_finite_norms(device, value, dtype):
    # What clipping relies on: a bad gradient must not vanish from the norm (torch: inf -> inf).
    gen = make_generator(42)
    tensors = random_list([CHUNK + 1, 2 * CHUNK + 5, 9], dtype, device, gen)
    tensors[1][CHUNK + 7] = value
    total, per = l2norm(tensors, True)
    expected = torch.linalg.vector_norm(tensors[1].float()).item()
    if math.isnan(value):
        assert math.isnan(total.item()) and math.isnan(per[1].item())
    else:
        assert total.item() == math.inf and per[1].item() == math.inf == expected
    assert math.isfinite(per[0].item()) and math.isfinite(per[2].item())


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_dense_permuted_layouts(device, layout):
    gen = make_generator(43)
    if layout == "transposed":
        t = random_values((300, 257), torch.bfloat16, device, gen).t()
    else:
        t = random_values((4, 3, 33, 65), torch.float16, device, gen).to(
            memory_format=torch.channels_last
        )
    tensors = [t, random_values(77, torch.float32, device, gen)]
    check_norms(l2norm(tensors, True), tensors, True, device)


def test_non_dense_input_is_refused_or_computed_correctly(device):
    # Inputs are only read: copying a strided view is as good as refusing it; a wrong norm is not.
    gen = make_generator(44)
    tensors = [
        random_values(10, torch.float32, device, gen),
        non_dense_2d(torch.float16, device, gen),
    ]
    try:
        result = l2norm(tensors, True)
    except (RuntimeError, ValueError) as error:
        assert "tensors[1]" in str(error) and "contiguous" in str(error), str(error)
        return
    check_norms(result, tensors, True, device)


@pytest.mark.cuda
def test_more_than_2_pow_31_elements_cuda():
    if torch.cuda.get_device_properties(0).total_memory < 16 * 2**30:
        pytest.skip("needs 16 GiB of GPU memory for a 4 GiB fp16 tensor and temporaries")
    n = 2**31 + 4099
    gen = torch.Generator(device="cuda")
    gen.manual_seed(45)
    t = torch.rand(n, generator=gen, device="cuda", dtype=torch.float16)
    t[-1] = 300.0
    reference = 0.0
    for piece in t.split(2**28):
        reference += piece.double().square().sum().item()
    total, per = l2norm([t], True)
    for value in (total.item(), per[0].item()):
        err = relative_error(value, math.sqrt(reference))
        assert err <= tolerance(torch.float16).reduction_rtol, (
            f"{value!r} vs {math.sqrt(reference)!r}: {err:.3g}"
        )


# --- misuse ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_dtype", BAD_DTYPES, ids=dtype_id)
def test_rejects_dtype(device, bad_dtype):
    gen = make_generator(50)
    tensors = random_list([10, 3], FLOAT_DTYPES, device, gen) + [filled((4,), bad_dtype, device)]
    with raises_naming(r"tensors\[2\]"):
        l2norm(tensors, True)


def test_rejects_tensor_on_another_device(device):
    gen = make_generator(51)
    tensors = random_list([10, 3, 5], FLOAT_DTYPES, device, gen)
    tensors[2] = tensors[2].to(other_device(device))
    with raises_naming(r"tensors\[2\]"):
        l2norm(tensors, False)


# --- dispatcher contract -----------------------------------------------------------------------


@pytest.mark.parametrize("per_tensor", [True, False])
def test_opcheck(device, per_tensor):
    gen = make_generator(52)
    tensors = random_list([5, CHUNK + 1, 0, 7], FLOAT_DTYPES, device, gen)
    torch.library.opcheck(l2norm, (tensors, per_tensor))

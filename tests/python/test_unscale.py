"""torch.ops.ampfuse.multi_tensor_unscale_(grads, found_inf, inv_scale).

Reference: torch._amp_foreach_non_finite_check_and_unscale_, compared bit for bit (it also does
fp32 math and checks the input values), and the float64 product rounded through fp32.
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
    MANY_TENSORS,
    NON_FINITE,
    POSITIONS,
    Guarded,
    chunks_past_the_block_cap,
    dtype_id,
    filled,
    make_generator,
    mixed_shapes,
    mul_f64,
    mul_fp32,
    non_dense_2d,
    other_device,
    position_index,
    raises_naming,
    random_list,
    random_values,
    scalar_tensor,
)
from tolerances import assert_close_report

unscale_ = torch.ops.ampfuse.multi_tensor_unscale_

INV_SCALES = {"pow2": 2.0**-16, "non_pow2": 1.0 / 3000.0, "one": 1.0}


def torch_unscale(grads, found_inf, inv_scale):
    """torch's op applied to clones; returns (unscaled clones, found_inf clone).

    torch's CUDA op has no bf16, so there bf16 tensors get the same fp32 math from float64."""
    outs = [g.clone() for g in grads]
    flag = found_inf.clone()
    for out in outs:
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([out], flag, inv_scale)
        except (RuntimeError, NotImplementedError):
            if out.dtype != torch.bfloat16 or out.device.type == "cpu":
                raise
            if not bool(torch.isfinite(out).all()):
                flag.fill_(1.0)
            out.copy_(mul_fp32(out, inv_scale, out.dtype))
    return outs, flag


def assert_matches_torch(grads, before, found_inf, found_inf_before, inv_scale):
    expected, expected_flag = torch_unscale(before, found_inf_before, inv_scale)
    for i, (g, e) in enumerate(zip(grads, expected)):
        assert g.stride() == e.stride(), f"grads[{i}] changed layout"
        assert_close_report(g, e, exact=True, msg=f"grads[{i}] vs torch")
    assert_close_report(found_inf, expected_flag, exact=True, msg="found_inf vs torch")


@pytest.mark.parametrize("inv", list(INV_SCALES.values()), ids=list(INV_SCALES))
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("size", CHUNK_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_matches_torch_at_chunk_boundaries(device, dtype, size, offset, inv):
    gen = make_generator(size + offset)
    values = random_values(size, dtype, device, gen)
    guarded = Guarded(values, offset)
    grad = guarded.view
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(inv, device)

    unscale_([grad], found_inf, inv_scale)

    assert found_inf.item() == 0.0
    guarded.assert_guards_intact()
    assert_matches_torch([grad], [values], found_inf, scalar_tensor(0.0, device), inv_scale)
    assert_close_report(grad, mul_fp32(values, inv_scale, dtype), exact=True, msg="vs fp32 math")
    # Against float64 rounded once: within one ulp, and exact for a power of two.
    reference = mul_f64(values, inv_scale, dtype)
    assert_close_report(grad, reference, dtype=dtype, msg="vs float64")
    if inv != INV_SCALES["non_pow2"]:
        assert_close_report(grad, reference, exact=True, msg="power of two vs float64")


@pytest.mark.parametrize("count", [1, 3, 230, MANY_TENSORS])
def test_lists_of_mixed_dtypes_and_shapes(device, count):
    gen = make_generator(count)
    shapes = mixed_shapes(count, gen)
    grads = random_list(shapes, FLOAT_DTYPES, device, gen)
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(1.0 / 1000.0, device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 0.0
    assert_matches_torch(grads, before, found_inf, scalar_tensor(0.0, device), inv_scale)


@pytest.mark.parametrize("elem_pos", POSITIONS)
@pytest.mark.parametrize("tensor_pos", POSITIONS)
@pytest.mark.parametrize("value", NON_FINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_sets_found_inf(device, dtype, value, tensor_pos, elem_pos):
    gen = make_generator(7)
    grads = random_list(INJECTION_SIZES, dtype, device, gen)
    target = grads[position_index(tensor_pos, len(grads))]
    target[position_index(elem_pos, target.numel())] = value
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(2.0**-10, device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 1.0
    # Every element is still unscaled, the non-finite one included, as torch does.
    assert_matches_torch(grads, before, found_inf, scalar_tensor(0.0, device), inv_scale)


@pytest.mark.parametrize("index", range(6))
def test_non_finite_in_a_mixed_dtype_list(device, index):
    gen = make_generator(index)
    grads = random_list([CHUNK + 3, 100, 5, CHUNK, 2 * CHUNK + 1, 9], FLOAT_DTYPES, device, gen)
    grads[index][grads[index].numel() - 1] = float("nan")
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(0.5, device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 1.0
    assert_matches_torch(grads, before, found_inf, scalar_tensor(0.0, device), inv_scale)


def _extremes(dtype):
    info = torch.finfo(dtype)
    subnormal = info.tiny * info.eps
    values = [info.max, -info.max, info.tiny, -info.tiny, subnormal, -subnormal, 0.0, -0.0]
    if dtype == torch.float32:
        values += [3e38, -3e38]
    return values


@pytest.mark.parametrize("inv", [1.0, 2.0**-16, 1.0 / 3000.0], ids=["one", "pow2", "non_pow2"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_largest_finite_values_are_not_overflow(device, dtype, inv):
    gen = make_generator(3)
    extremes = torch.tensor(_extremes(dtype), dtype=dtype)
    middle = random_values(CHUNK + 17, dtype, "cpu", gen)
    n = middle.numel()
    for at in (0, n // 2, n - extremes.numel()):
        middle[at : at + extremes.numel()] = extremes
    full_of_max = torch.full((CHUNK + 1,), torch.finfo(dtype).max, dtype=dtype)
    grads = [middle.to(device), full_of_max.to(device), (-full_of_max).to(device)]
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(inv, device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 0.0
    assert_matches_torch(grads, before, found_inf, scalar_tensor(0.0, device), inv_scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_found_inf_checks_inputs_not_products(device, dtype):
    # inv_scale > 1 turns the largest finite value into inf; torch flags only non-finite inputs.
    grad = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype, device=device)
    before = grad.clone()
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(4.0, device)

    unscale_([grad], found_inf, inv_scale)

    assert found_inf.item() == 0.0
    assert bool(torch.isinf(grad).all())
    assert_matches_torch([grad], [before], found_inf, scalar_tensor(0.0, device), inv_scale)


def test_found_inf_already_set_stays_set(device):
    gen = make_generator(11)
    grads = random_list([CHUNK + 1, 10], FLOAT_DTYPES, device, gen)
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(1.0, device)
    inv_scale = scalar_tensor(0.25, device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 1.0
    assert_matches_torch(grads, before, found_inf, scalar_tensor(1.0, device), inv_scale)


def test_zero_dim_found_inf_and_inv_scale(device):
    gen = make_generator(12)
    grads = random_list([33, 70000], FLOAT_DTYPES, device, gen)
    before = [g.clone() for g in grads]
    found_inf = torch.zeros((), device=device)
    inv_scale = torch.full((), 0.125, device=device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 0.0
    assert_matches_torch(grads, before, found_inf, torch.zeros((), device=device), inv_scale)


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_dense_permuted_layouts_are_accepted(device, dtype, layout):
    gen = make_generator(13)
    if layout == "transposed":
        grad = random_values((300, 257), dtype, device, gen).t()
    else:
        grad = random_values((4, 3, 33, 65), dtype, device, gen).to(
            memory_format=torch.channels_last
        )
    assert not grad.is_contiguous()
    plain = random_values((CHUNK + 1,), dtype, device, gen)
    grads = [plain, grad]
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(1.0 / 3000.0, device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 0.0
    assert_matches_torch(grads, before, found_inf, scalar_tensor(0.0, device), inv_scale)

    # A non-finite value anywhere in the permuted tensor is found.
    if layout == "transposed":
        grad[-1, 0] = float("inf")
    else:
        grad[-1, 1, -1, 0] = float("inf")
    found_inf.zero_()
    unscale_([grad], found_inf, inv_scale)
    assert found_inf.item() == 1.0


def test_tensor_past_the_per_launch_block_cap(device):
    # More chunks than the blocks one CUDA launch carries (on CUDA; see helpers).
    gen = make_generator(14)
    big = random_values(chunks_past_the_block_cap(device) * CHUNK + 3, torch.float16, device, gen)
    grads = [random_values(5, torch.float32, device, gen), big]
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(0.0, device)
    inv_scale = scalar_tensor(2.0**-7, device)

    unscale_(grads, found_inf, inv_scale)

    assert found_inf.item() == 0.0
    assert_matches_torch(grads, before, found_inf, scalar_tensor(0.0, device), inv_scale)

    big[-1] = float("nan")
    unscale_([big], found_inf, inv_scale)
    assert found_inf.item() == 1.0


@pytest.mark.cuda
def test_more_than_2_pow_31_elements_cuda():
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory for two 4 GiB fp16 tensors and temporaries")
    n = 2**31 + 4099
    gen = torch.Generator(device="cuda")
    gen.manual_seed(15)
    grad = torch.rand(n, generator=gen, device="cuda", dtype=torch.float16).add_(0.5)
    grad[2**31 + 5] = float("inf")
    found_inf = scalar_tensor(0.0, "cuda")
    inv_scale = scalar_tensor(2.0**-3, "cuda")
    expected = grad.clone()
    expected_flag = scalar_tensor(0.0, "cuda")
    torch._amp_foreach_non_finite_check_and_unscale_([expected], expected_flag, inv_scale)

    unscale_([grad], found_inf, inv_scale)

    assert found_inf.item() == 1.0 == expected_flag.item()
    assert torch.equal(grad, expected)


def test_empty_list_and_empty_tensors_are_no_ops(device):
    inv_scale = scalar_tensor(0.5, device)
    for start in (0.0, 1.0):
        found_inf = scalar_tensor(start, device)
        unscale_([], found_inf, inv_scale)
        assert found_inf.item() == start
        empties = [torch.empty(0, dtype=d, device=device) for d in FLOAT_DTYPES]
        empties.append(torch.empty(0, 5, device=device))
        unscale_(empties, found_inf, inv_scale)
        assert found_inf.item() == start
        assert all(e.numel() == 0 for e in empties)


# --- misuse ------------------------------------------------------------------------------------


def _valid_call(device, gen):
    grads = random_list([10, CHUNK + 1, 3], FLOAT_DTYPES, device, gen)
    return grads, scalar_tensor(0.0, device), scalar_tensor(0.5, device)


@pytest.mark.parametrize("bad_dtype", BAD_DTYPES, ids=dtype_id)
def test_rejects_grad_dtype(device, bad_dtype):
    grads, found_inf, inv_scale = _valid_call(device, make_generator(20))
    grads.append(filled((4,), bad_dtype, device))
    with raises_naming(r"grads\[3\]"):
        unscale_(grads, found_inf, inv_scale)


def test_rejects_grad_on_another_device(device):
    grads, found_inf, inv_scale = _valid_call(device, make_generator(21))
    grads[2] = grads[2].to(other_device(device))
    with raises_naming(r"grads\[2\]"):
        unscale_(grads, found_inf, inv_scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_dense_grad_is_unscaled_through_its_view(device, dtype):
    # A grad the user set to a strided slice (every other column of a buffer) is unscaled like
    # any other, and the buffer's elements outside the view are not written.
    gen = make_generator(22)
    grads, found_inf, inv_scale = _valid_call(device, gen)
    base = random_values((8, 12), dtype, device, gen)
    grads[1] = base[:, ::2]
    before = [g.clone() for g in grads]
    outside = base[:, 1::2].clone()
    unscale_(grads, found_inf, inv_scale)
    for i, (g, b) in enumerate(zip(grads, before)):
        assert_close_report(g, mul_fp32(b, inv_scale, g.dtype), exact=True, msg=f"grads[{i}]")
    assert_close_report(base[:, 1::2], outside, exact=True, msg="the buffer outside the view")
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("position", POSITIONS)
def test_non_dense_grad_reports_inf(device, position):
    gen = make_generator(23)
    grads, found_inf, inv_scale = _valid_call(device, gen)
    grads[1] = non_dense_2d(torch.float16, device, gen)
    row, col = divmod(position_index(position, grads[1].numel()), grads[1].shape[1])
    grads[1][row, col] = float("inf")
    unscale_(grads, found_inf, inv_scale)
    assert found_inf.item() == 1.0


def test_rejects_grad_with_overlapping_elements(device):
    grads, found_inf, inv_scale = _valid_call(device, make_generator(22))
    grads[1] = torch.ones(8, 1, device=device).expand(8, 6)
    with raises_naming(r"grads\[1\]", "memory location", "expand"):
        unscale_(grads, found_inf, inv_scale)


def test_refused_call_leaves_every_tensor_untouched(device):
    # Validation happens before any write: no half-unscaled gradient list after an error.
    gen = make_generator(24)
    grads = random_list([CHUNK + 1, 10, 3], FLOAT_DTYPES, device, gen)
    grads[0][0] = float("inf")
    grads.append(non_dense_2d(torch.float32, device, gen))  # accepted, written through a copy
    grads.append(filled((4,), torch.int32, device))
    before = [g.clone() for g in grads]
    found_inf = scalar_tensor(0.0, device)
    with raises_naming(r"grads\[4\]", "dtype"):
        unscale_(grads, found_inf, scalar_tensor(0.5, device))
    for i, (g, b) in enumerate(zip(grads, before)):
        assert torch.equal(g, b), f"grads[{i}] after a refused call"
    assert found_inf.item() == 0.0


BAD_SCALARS = {
    "float64": lambda d: torch.zeros(1, dtype=torch.float64, device=d),
    "float16": lambda d: torch.zeros(1, dtype=torch.float16, device=d),
    "int32": lambda d: torch.zeros(1, dtype=torch.int32, device=d),
    "two_elements": lambda d: torch.zeros(2, device=d),
    "no_elements": lambda d: torch.zeros(0, device=d),
    "other_device": lambda d: torch.zeros(1, device=other_device(d)),
}


@pytest.mark.parametrize("case", list(BAD_SCALARS))
def test_rejects_bad_found_inf(device, case):
    grads, _, inv_scale = _valid_call(device, make_generator(25))
    with raises_naming(r"found_inf"):
        unscale_(grads, BAD_SCALARS[case](device), inv_scale)


@pytest.mark.parametrize("case", list(BAD_SCALARS))
def test_rejects_bad_inv_scale(device, case):
    grads, found_inf, _ = _valid_call(device, make_generator(26))
    bad = BAD_SCALARS[case](device)
    if bad.numel() and bad.dtype != torch.bool:
        bad.fill_(1)
    with raises_naming(r"inv_scale"):
        unscale_(grads, found_inf, bad)


# --- dispatcher contract -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mixed", "with_inf", "with_empty"])
def test_opcheck(device, case):
    gen = make_generator(27)
    grads = random_list([5, CHUNK + 1, 7], FLOAT_DTYPES, device, gen)
    if case == "with_inf":
        grads[1][100] = float("inf")
    if case == "with_empty":
        grads.insert(1, torch.empty(0, device=device))
    torch.library.opcheck(unscale_, (grads, scalar_tensor(0.0, device), scalar_tensor(0.5, device)))

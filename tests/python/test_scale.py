"""torch.ops.ampfuse.multi_tensor_scale_(src, dst, scale, found_inf).

dst[i] = (src[i] in fp32 * scale) cast to dst[i].dtype. The reference is the float64 product
rounded through fp32 (bit for bit: that is the fp32 multiplication exactly) and, within one ulp,
the float64 product rounded once to the destination dtype.
"""

import itertools

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

scale_ = torch.ops.ampfuse.multi_tensor_scale_

PAIRS = list(itertools.product(FLOAT_DTYPES, FLOAT_DTYPES))
PAIR_IDS = [f"{dtype_id(s)}->{dtype_id(d)}" for s, d in PAIRS]


def assert_scaled(dst, src_before, scale, msg=""):
    """dst holds exactly the fp32 product of src and scale, cast to dst's dtype."""
    for i, (d, s) in enumerate(zip(dst, src_before)):
        assert_close_report(
            d, mul_fp32(s, scale, d.dtype), exact=True, msg=f"{msg}dst[{i}] vs fp32 math"
        )


def fresh_dst(src, dtypes, device, gen):
    """Destinations of the same shapes holding unrelated random values (never the answer)."""
    return [
        random_values(s.shape, dtypes[i % len(dtypes)], device, gen, magnitude=7.0)
        for i, s in enumerate(src)
    ]


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("size", CHUNK_SIZES)
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), PAIRS, ids=PAIR_IDS)
def test_pairings_at_chunk_boundaries(device, src_dtype, dst_dtype, size, offset):
    gen = make_generator(size + 2 * offset)
    src_values = random_values(size, src_dtype, device, gen)
    src = Guarded(src_values, offset)
    dst = Guarded(random_values(size, dst_dtype, device, gen, magnitude=7.0), offset)
    scale = scalar_tensor(0.3, device)
    found_inf = scalar_tensor(0.0, device)

    scale_([src.view], [dst.view], scale, found_inf)

    assert found_inf.item() == 0.0
    src.assert_guards_intact()
    dst.assert_guards_intact()
    assert_close_report(src.view, src_values, exact=True, msg="src must not change")
    assert_scaled([dst.view], [src_values], scale)
    assert_close_report(
        dst.view, mul_f64(src_values, scale, dst_dtype), dtype=dst_dtype, msg="vs float64"
    )


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), PAIRS, ids=PAIR_IDS)
def test_scale_one_is_a_plain_cast(device, src_dtype, dst_dtype):
    gen = make_generator(1)
    src = random_list([CHUNK + 5, 3, 1], src_dtype, device, gen)
    dst = fresh_dst(src, [dst_dtype], device, gen)
    found_inf = scalar_tensor(0.0, device)

    scale_(src, dst, scalar_tensor(1.0, device), found_inf)

    assert found_inf.item() == 0.0
    for i, (d, s) in enumerate(zip(dst, src)):
        assert_close_report(d, s.to(dst_dtype), exact=True, msg=f"dst[{i}] vs Tensor.to")


@pytest.mark.parametrize("factor", [2.0**-12, 16.0], ids=["2^-12", "2^4"])
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), PAIRS, ids=PAIR_IDS)
def test_power_of_two_is_exact_against_float64(device, src_dtype, dst_dtype, factor):
    gen = make_generator(2)
    src = random_list([2 * CHUNK + 9], src_dtype, device, gen)
    dst = fresh_dst(src, [dst_dtype], device, gen)
    scale = scalar_tensor(factor, device)
    found_inf = scalar_tensor(0.0, device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 0.0
    assert_close_report(dst[0], mul_f64(src[0], scale, dst_dtype), exact=True, msg="vs float64")


@pytest.mark.parametrize("size", CHUNK_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_in_place_when_dst_is_src(device, dtype, size):
    gen = make_generator(size)
    tensors = random_list([size, 17], dtype, device, gen)
    before = [t.clone() for t in tensors]
    scale = scalar_tensor(1.0 / 3000.0, device)
    found_inf = scalar_tensor(0.0, device)

    scale_(tensors, tensors, scale, found_inf)

    assert found_inf.item() == 0.0
    assert_scaled(tensors, before, scale)


def test_some_pairs_in_place_others_not(device):
    gen = make_generator(3)
    src = random_list([CHUNK + 1, 100, 2 * CHUNK, 7], FLOAT_DTYPES, device, gen)
    before = [s.clone() for s in src]
    dst = [
        src[0],
        random_values(100, torch.float16, device, gen),
        src[2],
        random_values(7, torch.float32, device, gen),
    ]
    scale = scalar_tensor(0.7, device)
    found_inf = scalar_tensor(0.0, device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 0.0
    assert_scaled(dst, before, scale)
    for i in (1, 3):
        assert_close_report(src[i], before[i], exact=True, msg=f"src[{i}] must not change")


@pytest.mark.parametrize("count", [1, 3, 230, MANY_TENSORS])
def test_lists_of_mixed_pairings(device, count):
    gen = make_generator(count)
    shapes = mixed_shapes(count, gen)
    src = random_list(shapes, FLOAT_DTYPES, device, gen)
    before = [s.clone() for s in src]
    # Cycle the destination dtypes out of step with the sources so every pairing occurs.
    dst = fresh_dst(src, (torch.float16, torch.float32, torch.bfloat16, torch.float32), device, gen)
    scale = scalar_tensor(65536.0 / 3.0, device)
    found_inf = scalar_tensor(0.0, device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 0.0
    assert_scaled(dst, before, scale)
    for i, (s, b) in enumerate(zip(src, before)):
        assert_close_report(s, b, exact=True, msg=f"src[{i}] must not change")


NEXT_DTYPE = {
    torch.float32: torch.float16,
    torch.float16: torch.bfloat16,
    torch.bfloat16: torch.float32,
}


@pytest.mark.parametrize("elem_pos", POSITIONS)
@pytest.mark.parametrize("tensor_pos", POSITIONS)
@pytest.mark.parametrize("value", NON_FINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_source_sets_found_inf(device, dtype, value, tensor_pos, elem_pos):
    gen = make_generator(4)
    src = random_list(INJECTION_SIZES, dtype, device, gen)
    target = src[position_index(tensor_pos, len(src))]
    target[position_index(elem_pos, target.numel())] = value
    dst = fresh_dst(src, [NEXT_DTYPE[dtype]], device, gen)
    scale = scalar_tensor(2.0**-10, device)
    found_inf = scalar_tensor(0.0, device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 1.0
    assert_scaled(dst, src, scale)


def _extremes(dtype):
    info = torch.finfo(dtype)
    subnormal = info.tiny * info.eps
    values = [info.max, -info.max, info.tiny, -info.tiny, subnormal, -subnormal, 0.0, -0.0]
    if dtype == torch.float32:
        values += [3e38, -3e38]
    return values


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_largest_finite_values_are_not_overflow(device, dtype):
    gen = make_generator(5)
    extremes = torch.tensor(_extremes(dtype), dtype=dtype)
    values = random_values(CHUNK + 17, dtype, "cpu", gen)
    n = values.numel()
    for at in (0, n // 2, n - extremes.numel()):
        values[at : at + extremes.numel()] = extremes
    src = [
        values.to(device),
        torch.full((CHUNK + 1,), torch.finfo(dtype).max, dtype=dtype, device=device),
    ]
    for dst_dtype in (dtype, torch.float32):
        dst = fresh_dst(src, [dst_dtype], device, gen)
        found_inf = scalar_tensor(0.0, device)
        scale_(src, dst, scalar_tensor(1.0, device), found_inf)
        assert found_inf.item() == 0.0
        for i, (d, s) in enumerate(zip(dst, src)):
            assert_close_report(
                d, s.to(dst_dtype), exact=True, msg=f"dst[{i}] ({dtype_id(dst_dtype)})"
            )


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype", "value", "factor"),
    [
        (torch.float32, torch.float16, 1e5, 1.0),  # finite fp32, too large for fp16
        (torch.float32, torch.bfloat16, 3e38, 2.0),  # the fp32 product itself overflows
        (torch.float16, torch.float16, 60000.0, 2.0),
        (torch.bfloat16, torch.float32, 3e38, 4.0),
    ],
    ids=["fp32->fp16_cast", "fp32_product", "fp16_product", "bf16->fp32_product"],
)
def test_found_inf_checks_sources_not_results(device, src_dtype, dst_dtype, value, factor):
    src = [torch.full((CHUNK + 3,), value, dtype=src_dtype, device=device)]
    dst = [torch.zeros(CHUNK + 3, dtype=dst_dtype, device=device)]
    scale = scalar_tensor(factor, device)
    found_inf = scalar_tensor(0.0, device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 0.0
    assert bool(torch.isinf(dst[0]).all())
    assert_scaled(dst, src, scale)


def test_found_inf_already_set_stays_set(device):
    gen = make_generator(6)
    src = random_list([CHUNK + 1, 10], FLOAT_DTYPES, device, gen)
    dst = fresh_dst(src, [torch.float32], device, gen)
    scale = scalar_tensor(0.25, device)
    found_inf = scalar_tensor(1.0, device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 1.0
    assert_scaled(dst, src, scale)


def test_zero_dim_scale_and_found_inf(device):
    gen = make_generator(7)
    src = random_list([33, 70000], FLOAT_DTYPES, device, gen)
    dst = fresh_dst(src, [torch.bfloat16], device, gen)
    scale = torch.full((), 3.0, device=device)
    found_inf = torch.zeros((), device=device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 0.0
    assert_scaled(dst, src, scale)


def _layout(values, layout):
    if layout == "contiguous":
        return values.contiguous()
    if layout == "transposed":
        return values.t().contiguous().t()
    return values.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    ("src_layout", "dst_layout", "shape"),
    [
        ("transposed", "transposed", (257, 300)),
        ("transposed", "contiguous", (257, 300)),
        ("contiguous", "transposed", (257, 300)),
        ("channels_last", "channels_last", (4, 3, 33, 65)),
        ("channels_last", "contiguous", (4, 3, 33, 65)),
        ("contiguous", "channels_last", (4, 3, 33, 65)),
    ],
)
@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"),
    [(torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
    ids=["fp32->bf16", "fp16->fp16"],
)
def test_dense_permuted_layouts_are_accepted(
    device, src_dtype, dst_dtype, src_layout, dst_layout, shape
):
    gen = make_generator(8)
    src = _layout(random_values(shape, src_dtype, device, gen), src_layout)
    dst = _layout(random_values(shape, dst_dtype, device, gen, magnitude=7.0), dst_layout)
    dst_stride = dst.stride()
    scale = scalar_tensor(0.3, device)
    found_inf = scalar_tensor(0.0, device)

    scale_([src], [dst], scale, found_inf)

    assert found_inf.item() == 0.0
    assert dst.stride() == dst_stride
    # Element (i, j, ...) of dst comes from element (i, j, ...) of src, whatever the layouts.
    assert_scaled([dst], [src], scale)


def test_tensor_past_the_per_launch_block_cap(device):
    gen = make_generator(9)
    src = [
        random_values(5, torch.float16, device, gen),
        random_values(chunks_past_the_block_cap(device) * CHUNK + 3, torch.float32, device, gen),
    ]
    dst = fresh_dst(src, [torch.bfloat16], device, gen)
    scale = scalar_tensor(1.0 / 3.0, device)
    found_inf = scalar_tensor(0.0, device)

    scale_(src, dst, scale, found_inf)

    assert found_inf.item() == 0.0
    assert_scaled(dst, src, scale)

    src[1][-1] = float("-inf")
    scale_(src, dst, scale, found_inf)
    assert found_inf.item() == 1.0
    assert dst[1][-1].item() == float("-inf")


def test_empty_list_and_empty_tensors_are_no_ops(device):
    scale = scalar_tensor(0.5, device)
    for start in (0.0, 1.0):
        found_inf = scalar_tensor(start, device)
        scale_([], [], scale, found_inf)
        assert found_inf.item() == start
        src = [torch.empty(0, dtype=d, device=device) for d in FLOAT_DTYPES] + [
            torch.empty(3, 0, device=device)
        ]
        dst = [torch.empty(0, dtype=d, device=device) for d in reversed(FLOAT_DTYPES)] + [
            torch.empty(3, 0, device=device)
        ]
        scale_(src, dst, scale, found_inf)
        assert found_inf.item() == start


# --- misuse ------------------------------------------------------------------------------------


def _valid_call(device, gen):
    src = random_list([10, CHUNK + 1, 3], FLOAT_DTYPES, device, gen)
    dst = fresh_dst(src, [torch.float16, torch.float32], device, gen)
    return src, dst, scalar_tensor(0.5, device), scalar_tensor(0.0, device)


def test_rejects_lists_of_different_lengths(device):
    src, dst, scale, found_inf = _valid_call(device, make_generator(20))
    with raises_naming(r"\bsrc\b", r"\bdst\b"):
        scale_(src, dst[:2], scale, found_inf)
    with raises_naming(r"\bsrc\b", r"\bdst\b"):
        scale_(src[:2], dst, scale, found_inf)


@pytest.mark.parametrize(
    "dst_shape", [(11,), (2, 5)], ids=["other_numel", "same_numel_other_shape"]
)
def test_rejects_mismatched_sizes(device, dst_shape):
    src, dst, scale, found_inf = _valid_call(device, make_generator(21))
    dst[0] = torch.zeros(dst_shape, device=device)
    with raises_naming(r"(src|dst)\[0\]"):
        scale_(src, dst, scale, found_inf)


@pytest.mark.parametrize("which", ["src", "dst"])
@pytest.mark.parametrize("bad_dtype", BAD_DTYPES, ids=dtype_id)
def test_rejects_dtype(device, bad_dtype, which):
    src, dst, scale, found_inf = _valid_call(device, make_generator(22))
    (src if which == "src" else dst)[2] = filled((3,), bad_dtype, device)
    with raises_naming(rf"{which}\[2\]"):
        scale_(src, dst, scale, found_inf)


@pytest.mark.parametrize("which", ["src", "dst"])
def test_rejects_tensor_on_another_device(device, which):
    src, dst, scale, found_inf = _valid_call(device, make_generator(23))
    lst = src if which == "src" else dst
    lst[1] = lst[1].to(other_device(device))
    with raises_naming(rf"{which}\[1\]"):
        scale_(src, dst, scale, found_inf)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_dense_dst_is_written_through_its_view(device, dtype):
    # A destination that is a strided slice (every other column of a buffer) gets the product,
    # and the buffer's elements outside the view are not written.
    gen = make_generator(24)
    src, dst, scale, found_inf = _valid_call(device, gen)
    base = random_values((8, 12), dtype, device, gen)
    dst[1] = base[:, ::2]
    src[1] = random_values((8, 6), torch.float16, device, gen)
    outside = base[:, 1::2].clone()
    scale_(src, dst, scale, found_inf)
    assert_scaled(dst, src, scale)
    assert_close_report(base[:, 1::2], outside, exact=True, msg="the buffer outside the view")
    assert found_inf.item() == 0.0


def test_in_place_scale_of_a_non_dense_tensor(device):
    gen = make_generator(25)
    t = non_dense_2d(torch.bfloat16, device, gen)
    before = t.clone()
    found_inf = scalar_tensor(0.0, device)
    scale_([t], [t], scalar_tensor(0.5, device), found_inf)
    assert_scaled([t], [before], scalar_tensor(0.5, device))


def test_rejects_dst_with_overlapping_elements(device):
    src, dst, scale, found_inf = _valid_call(device, make_generator(24))
    dst[1] = torch.zeros(8, 1, device=device).expand(8, 6)
    src[1] = random_values((8, 6), torch.float16, device, make_generator(26))
    with raises_naming(r"dst\[1\]", "memory location", "expand"):
        scale_(src, dst, scale, found_inf)


def test_non_dense_src_is_refused_or_computed_correctly(device):
    # src is only read, so copying it is as good as refusing it; a wrong answer is not.
    src, dst, scale, found_inf = _valid_call(device, make_generator(27))
    src[1] = non_dense_2d(torch.bfloat16, device, make_generator(28))
    dst[1] = torch.zeros((8, 6), dtype=torch.float32, device=device)
    try:
        scale_(src, dst, scale, found_inf)
    except (RuntimeError, ValueError) as error:
        assert "src[1]" in str(error) and "contiguous" in str(error), str(error)
        return
    assert found_inf.item() == 0.0
    assert_scaled(dst, src, scale)


def test_refused_call_leaves_every_tensor_untouched(device):
    src, dst, scale, found_inf = _valid_call(device, make_generator(29))
    src[0][0] = float("nan")
    src.append(random_values((8, 6), torch.float32, device, make_generator(30)))
    dst.append(non_dense_2d(torch.float16, device, make_generator(31)))  # written via a copy
    src.append(random_values((4,), torch.float32, device, make_generator(32)))
    dst.append(filled((4,), torch.int32, device))
    before = [d.clone() for d in dst]
    with raises_naming(r"dst\[4\]", "dtype"):
        scale_(src, dst, scale, found_inf)
    for i, (d, b) in enumerate(zip(dst, before)):
        assert torch.equal(d, b), f"dst[{i}] after a refused call"
    assert found_inf.item() == 0.0


BAD_SCALARS = {
    "float64": lambda d: torch.ones(1, dtype=torch.float64, device=d),
    "float16": lambda d: torch.ones(1, dtype=torch.float16, device=d),
    "int32": lambda d: torch.ones(1, dtype=torch.int32, device=d),
    "two_elements": lambda d: torch.ones(2, device=d),
    "no_elements": lambda d: torch.ones(0, device=d),
    "other_device": lambda d: torch.ones(1, device=other_device(d)),
}


@pytest.mark.parametrize("case", list(BAD_SCALARS))
def test_rejects_bad_scale(device, case):
    src, dst, _, found_inf = _valid_call(device, make_generator(32))
    with raises_naming(r"\bscale\b"):
        scale_(src, dst, BAD_SCALARS[case](device), found_inf)


@pytest.mark.parametrize("case", list(BAD_SCALARS))
def test_rejects_bad_found_inf(device, case):
    src, dst, scale, _ = _valid_call(device, make_generator(33))
    bad = BAD_SCALARS[case](device)
    if bad.numel():
        bad.zero_()
    with raises_naming(r"found_inf"):
        scale_(src, dst, scale, bad)


# --- dispatcher contract -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mixed", "with_inf", "with_empty"])
def test_opcheck(device, case):
    gen = make_generator(34)
    src = random_list([5, CHUNK + 1, 7], FLOAT_DTYPES, device, gen)
    dst = fresh_dst(src, [torch.float16, torch.bfloat16, torch.float32], device, gen)
    if case == "with_inf":
        src[1][100] = float("nan")
    if case == "with_empty":
        src.insert(1, torch.empty(0, device=device))
        dst.insert(1, torch.empty(0, dtype=torch.bfloat16, device=device))
    torch.library.opcheck(
        scale_, (src, dst, scalar_tensor(0.5, device), scalar_tensor(0.0, device))
    )

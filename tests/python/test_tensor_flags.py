"""The optional `tensor_flags` of multi_tensor_unscale_, multi_tensor_scale_ and
multi_tensor_nonfinite_check_: one int32 per tensor of the list read, OR-ed with 1 (held an inf)
and 2 (held a nan) by the same kernel pass that raises found_inf.

Reference: torch.isinf / torch.isnan per tensor of the input values.
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops import HELD_INF, HELD_NAN
from helpers import (
    CHUNK,
    FLOAT_DTYPES,
    MANY_TENSORS,
    POSITIONS,
    chunks_past_the_block_cap,
    make_generator,
    other_device,
    position_index,
    raises_naming,
    random_list,
    scalar_tensor,
)

unscale_ = torch.ops.ampfuse.multi_tensor_unscale_
scale_ = torch.ops.ampfuse.multi_tensor_scale_
check_ = torch.ops.ampfuse.multi_tensor_nonfinite_check_

OPS = ("unscale", "scale", "check")


def run(op, tensors, found_inf, tensor_flags, factor=0.5):
    """Runs one of the three ops on `tensors` (scale_ writes fp32 copies)."""
    device = found_inf.device
    if op == "unscale":
        unscale_(tensors, found_inf, scalar_tensor(factor, device), tensor_flags)
    elif op == "scale":
        dst = [torch.empty(t.shape, dtype=torch.float32, device=device) for t in tensors]
        scale_(tensors, dst, scalar_tensor(factor, device), found_inf, tensor_flags)
    else:
        check_(tensors, found_inf, tensor_flags)


def expected_flags(tensors):
    return [
        (HELD_INF if bool(t.isinf().any()) else 0) | (HELD_NAN if bool(t.isnan().any()) else 0)
        for t in tensors
    ]


def flags_for(tensors, device):
    return torch.zeros(len(tensors), dtype=torch.int32, device=device)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("position", POSITIONS)
def test_names_the_tensors_that_hold_inf_nan_or_both(device, op, position):
    # Mixed dtypes, a tensor over one chunk, an empty one; only tensors 1, 3 and 4 overflow.
    gen = make_generator(1)
    tensors = random_list([7, CHUNK + 3, 0, 40, 2 * CHUNK + 1, 5], FLOAT_DTYPES, device, gen)
    planted = {1: [float("inf")], 3: [float("nan")], 4: [float("-inf"), float("nan")]}
    for i, values in planted.items():
        n = tensors[i].numel()
        where = position_index(position, n)
        for k, value in enumerate(values):
            tensors[i].view(-1)[(where + k) % n] = value
    want = expected_flags(tensors)
    assert want == [0, HELD_INF, 0, HELD_NAN, HELD_INF | HELD_NAN, 0]
    found_inf = scalar_tensor(0.0, device)
    flags = flags_for(tensors, device)
    run(op, tensors, found_inf, flags)
    assert flags.tolist() == want
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_clean_list_writes_no_flag(device, op, dtype):
    tensors = random_list([3, CHUNK + 1, 16], dtype, device, make_generator(2))
    found_inf = scalar_tensor(0.0, device)
    flags = flags_for(tensors, device)
    run(op, tensors, found_inf, flags)
    assert flags.tolist() == [0, 0, 0]
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("op", OPS)
def test_flags_are_or_ed_in_and_never_cleared(device, op):
    tensors = random_list([9, 9, 9], torch.float32, device, make_generator(3))
    tensors[1][4] = float("nan")
    found_inf = scalar_tensor(0.0, device)
    flags = torch.tensor([HELD_NAN, HELD_INF, 0], dtype=torch.int32, device=device)
    run(op, tensors, found_inf, flags)
    assert flags.tolist() == [HELD_NAN, HELD_INF | HELD_NAN, 0]


@pytest.mark.parametrize("op", ["unscale", "scale"])
def test_the_flags_do_not_change_the_result(device, op):
    gen = make_generator(4)
    tensors = random_list([CHUNK + 5, 33], FLOAT_DTYPES, device, gen)
    tensors[0][CHUNK + 2] = float("inf")
    plain = [t.clone() for t in tensors]
    found_plain, found_flagged = scalar_tensor(0.0, device), scalar_tensor(0.0, device)
    if op == "unscale":
        unscale_(plain, found_plain, scalar_tensor(0.25, device))
        unscale_(tensors, found_flagged, scalar_tensor(0.25, device), flags_for(tensors, device))
        outputs = (plain, tensors)
    else:
        dsts = [[torch.empty_like(t, dtype=torch.float16) for t in tensors] for _ in range(2)]
        scale_(tensors, dsts[0], scalar_tensor(3.0, device), found_plain)
        scale_(tensors, dsts[1], scalar_tensor(3.0, device), found_flagged,
               flags_for(tensors, device))
        outputs = dsts
    for a, b in zip(*outputs):
        assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32))
    assert found_plain.item() == found_flagged.item() == 1.0


def test_check_names_tensors_even_when_found_inf_was_already_set(device):
    # Without flags a set found_inf lets the check skip the read; with them every tensor is
    # still read, or a second call (another group, device or loss) would name nothing.
    tensors = random_list([5, 5], torch.bfloat16, device, make_generator(5))
    tensors[1][0] = float("inf")
    found_inf = scalar_tensor(1.0, device)
    flags = flags_for(tensors, device)
    check_(tensors, found_inf, flags)
    assert flags.tolist() == [0, HELD_INF]


@pytest.mark.parametrize("op", OPS)
def test_many_tensors_and_a_tensor_past_the_launch_caps(device, op):
    # More tensors than one CUDA launch holds, and a tensor continued into a second launch:
    # the flag must land on the tensor's index in the caller's list, not its launch slot.
    gen = make_generator(6)
    tensors = random_list([3] * MANY_TENSORS, FLOAT_DTYPES, device, gen)
    tensors.append(torch.zeros(chunks_past_the_block_cap(device) * CHUNK, device=device,
                               dtype=torch.bfloat16))
    tensors.append(torch.ones(4, device=device))
    tensors[MANY_TENSORS - 1][2] = float("nan")
    tensors[MANY_TENSORS][-1] = float("inf")
    flags = flags_for(tensors, device)
    run(op, tensors, scalar_tensor(0.0, device), flags)
    nonzero = {i: v for i, v in enumerate(flags.tolist()) if v}
    assert nonzero == {MANY_TENSORS - 1: HELD_NAN, MANY_TENSORS: HELD_INF}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda n, d: torch.zeros(n, dtype=torch.int64, device=d), r"torch\.int32"),
        (lambda n, d: torch.zeros(n + 1, dtype=torch.int32, device=d), r"one\s+element per"),
        (lambda n, d: torch.zeros(n, 1, dtype=torch.int32, device=d), r"1-D"),
        (lambda n, d: torch.zeros(2 * n, dtype=torch.int32, device=d)[::2], r"contiguous"),
        (lambda n, d: torch.zeros(n, dtype=torch.int32, device=other_device(d)), r"move"),
    ],
    ids=["int64", "length", "2d", "strided", "device"],
)
def test_bad_tensor_flags_are_refused_with_the_fix(device, op, bad, message):
    tensors = random_list([4, 4], torch.float32, device, make_generator(7))
    with raises_naming(r"tensor_flags", message):
        run(op, tensors, scalar_tensor(0.0, device), bad(len(tensors), device))


@pytest.mark.parametrize("op", OPS)
def test_the_fake_kernels_refuse_what_the_real_ones_do(op):
    tensors = [torch.empty(4, device="meta"), torch.empty(3, device="meta", dtype=torch.float16)]
    found_inf = torch.zeros(1, device="meta")
    with raises_naming(r"tensor_flags", r"one element per tensor", r"\(2\)"):
        run(op, tensors, found_inf, torch.zeros(3, dtype=torch.int32, device="meta"))
    run(op, tensors, found_inf, torch.zeros(2, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("op", OPS)
def test_opcheck_with_tensor_flags(device, op):
    gen = make_generator(8)
    tensors = random_list([5, CHUNK + 1, 7], FLOAT_DTYPES, device, gen)
    tensors[1][100] = float("nan")
    flags = flags_for(tensors, device)
    found_inf = scalar_tensor(0.0, device)
    factor = scalar_tensor(0.5, device)
    if op == "unscale":
        torch.library.opcheck(unscale_, (tensors, found_inf, factor, flags))
    elif op == "scale":
        dst = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
        torch.library.opcheck(scale_, (tensors, dst, factor, found_inf, flags))
    else:
        torch.library.opcheck(check_, (tensors, found_inf, flags))

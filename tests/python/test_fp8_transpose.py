"""torch.ops.ampfuse.fp8_transpose(input): a contiguous [k, m] copy of a 2-D fp8 tensor.

Reference: torch's ``input.t().contiguous()``, compared as raw bytes, so the NaN codes (and
e5m2's inf codes) must come through as they are. CUDA must give the CPU's bytes for shapes that
leave partial tiles on both edges.
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops.fp8 import fp8_transpose
from helpers import FP8, FP8_IDS, POSITIONS, make_generator, position_index, raises_naming

# Special codes: NaN in e4m3fn is S.1111.111; e5m2 has NaN (S.11111.xx, xx != 0) and inf
# (S.11111.00).
SPECIAL_CODES = {torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e5m2: (0x7C, 0xFC, 0x7E, 0xFF)}


def random_codes(rows, cols, dtype, device, seed=0):
    """Every byte value, so any code a cast can write is moved at least once."""
    gen = make_generator(seed)
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    return codes.view(dtype).to(device)


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (32, 32), (33, 31), (64, 7), (100, 300)])
def test_matches_torch_transpose(device, shape, fp8):
    x = random_codes(*shape, fp8, device)
    y = fp8_transpose(x)
    assert y.dtype == fp8 and y.is_contiguous() and y.device == x.device
    assert same_bytes(y, x.t().contiguous())


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
def test_nan_and_inf_codes_move_unchanged(device, fp8, position):
    rows, cols = 40, 70
    x = random_codes(rows, cols, fp8, "cpu", seed=1).view(torch.uint8)
    flat = x.reshape(-1)
    index = position_index(position, flat.numel())
    for offset, code in enumerate(SPECIAL_CODES[fp8]):
        flat[min(index + offset, flat.numel() - 1) if position != "last" else index - offset] = code
    x = x.view(fp8).to(device)
    y = fp8_transpose(x)
    assert same_bytes(y, x.t().contiguous())
    r, c = divmod(index, cols)
    assert y.cpu().view(torch.uint8)[c, r].item() == SPECIAL_CODES[fp8][0]


def test_views_and_empty_inputs(device):
    x = random_codes(48, 40, torch.float8_e4m3fn, device, seed=2)
    for view in (x[3:20], x[:, 5:37], x.t()):  # a row slice, a column slice, a transpose
        assert same_bytes(fp8_transpose(view), view.t().contiguous())
    for shape in ((0, 5), (5, 0)):
        empty = torch.empty(shape, dtype=torch.float8_e5m2, device=device)
        assert fp8_transpose(empty).shape == (shape[1], shape[0])


def test_opcheck(device):
    """As for fp8_gemm: opcheck's test_schema multiplies the inputs, which torch does not
    implement for float8, so it is left out and the input is compared byte for byte here (the
    schema says it is not written). Finite values only: opcheck compares outputs as numbers,
    and a NaN code never equals itself."""
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for fp8 in FP8:
        x = (torch.randn(20, 36, generator=make_generator(3)) * 8).to(fp8).to(device)
        before = x.clone()
        torch.library.opcheck(torch.ops.ampfuse.fp8_transpose, (x,), test_utils=utils)
        assert same_bytes(x, before)


def test_refuses_bad_arguments():
    with raises_naming(r"ampfuse\.fp8_transpose: input must be torch\.float8_e4m3fn",
                       "float8_e5m2"):
        fp8_transpose(torch.ones(4, 4))
    with raises_naming(r"ampfuse\.fp8_transpose: input must be 2-D", "reshape"):
        fp8_transpose(torch.ones(2, 3, 4).to(torch.float8_e4m3fn))
    with raises_naming(r"ampfuse\.fp8_transpose: input is a sparse COO tensor", "to_dense"):
        fp8_transpose(torch.ones(4, 4).to_sparse())
    with raises_naming(r"ampfuse\.fp8_transpose: input is a nested tensor", "unbind"):
        fp8_transpose(torch.nested.nested_tensor([torch.ones(2, 2), torch.ones(3, 2)]))


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
def test_cuda_gives_the_cpu_bytes(fp8):
    """Partial tiles on both edges, and (at 8192 x 3072, a GPT-2 MLP grad) many full ones."""
    for rows, cols in ((8192 + 17, 3072 + 5), (31, 2049)):
        x = random_codes(rows, cols, fp8, "cpu", seed=rows)
        assert same_bytes(fp8_transpose(x.cuda()), fp8_transpose(x))


@pytest.mark.cuda
def test_cuda_taller_than_one_grid():
    """More tile rows than gridDim.y takes (65535 tiles of 32 rows): the bands' seam and the
    last partial tile must land where the CPU puts them."""
    x = random_codes(65535 * 32 + 7, 5, torch.float8_e4m3fn, "cpu", seed=11)
    assert same_bytes(fp8_transpose(x.cuda()), fp8_transpose(x))

"""Current scaling: torch.ops.ampfuse.fp8_tensor_scale (one scale per tensor from its own amax)
and fp8_quantize_rowwise (one scale per row, or per column written transposed).

Reference: the rule computed with torch in fp32 (fp8_max / amax / 2**margin, one IEEE division
at a time, so the same bits), torch's own cast of the scaled input, and a float64 check that
the dequantized values are within the format's half ulp of the input. CUDA must give the
CPU's bits.
"""

import math

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops.fp8 import FP8_MAX, fp8_quantize_rowwise, fp8_tensor_scale
from helpers import (
    DTYPE_IDS,
    FLOAT_DTYPES,
    FP8,
    FP8_IDS,
    POSITIONS,
    make_generator,
    position_index,
    raises_naming,
)

MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
SHAPES = [(1, 1), (3, 5), (64, 128), (67, 129), (300, 17)]


def reference_scale(amax, fp8, margin=0.0):
    """The rule in fp32: amax 0 -> 1; inf/nan -> nan; else (max / amax) / 2**margin, clamped to
    fp32's finite normal range."""
    amax = amax.float().cpu()
    q = ((torch.tensor(FP8_MAX[fp8], dtype=torch.float32) / amax)
         / torch.tensor(2.0**margin, dtype=torch.float32))
    q = q.clamp(torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)
    q = torch.where(amax == 0, torch.ones_like(q), q)
    return torch.where(torch.isfinite(amax), q, torch.full_like(q, math.nan))


def cast(x, scale, fp8):
    m = FP8_MAX[fp8]
    return (x.float().cpu() * scale).clamp(-m, m).to(fp8)


def matrix(shape, dtype, device, seed=0):
    """Rows of very different magnitudes (1e-6 .. 1e3), so one scale per row matters."""
    gen = make_generator(seed)
    row_mag = torch.logspace(-6, 3, shape[0])[torch.randperm(shape[0], generator=gen)]
    x = torch.randn(shape, generator=gen) * row_mag[:, None]
    return x.to(dtype).to(device)


def assert_same_bits(actual, expected):
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()
    assert a.shape == e.shape
    differ = (a != e).nonzero()
    assert differ.numel() == 0, (f"{differ.shape[0]} of {a.numel()} codes differ, "
                                 f"first at {differ[0].tolist()}")


def same_floats(a, b):
    """Equal bits, nan included."""
    return torch.equal(a.float().cpu().view(torch.int32), b.float().cpu().view(torch.int32)) or (
        torch.equal(a.isnan().cpu(), b.isnan().cpu())
        and torch.equal(a[~a.isnan()].cpu(), b[~b.isnan()].cpu())
    )


# ---- fp8_tensor_scale ---------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("margin", [0.0, 1.0, 2.5])
def test_tensor_scale_rule(device, src, fp8, margin):
    x = matrix((70, 33), src, device, seed=1).reshape(10, 7, 33)  # any rank
    amax, scale, scale_inv = fp8_tensor_scale(x, fp8, margin)
    for t in (amax, scale, scale_inv):
        assert t.dtype == torch.float32 and t.shape == (1,) and t.device == x.device
    assert amax.item() == x.float().abs().amax().item()
    assert same_floats(scale, reference_scale(amax, fp8, margin))
    assert same_floats(scale_inv, 1.0 / scale.cpu())
    # The scaled amax lands on fp8_max / 2**margin (within fp32 rounding).
    assert math.isclose(amax.item() * scale.item(), FP8_MAX[fp8] / 2**margin, rel_tol=1e-6)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_tensor_scale_nonfinite_gives_nan_scale(device, fp8, position, bad):
    """An inf or nan anywhere: amax inf / nan, scale and scale_inv nan (so the GEMM output is
    nan and the overflow check skips the step)."""
    x = matrix((129, 65), torch.float32, device, seed=2).flatten()
    x[position_index(position, x.numel())] = bad
    amax, scale, scale_inv = fp8_tensor_scale(x, fp8)
    assert math.isnan(amax.item()) if math.isnan(bad) else amax.item() == math.inf
    assert math.isnan(scale.item()) and math.isnan(scale_inv.item())


def test_tensor_scale_nan_wins_over_inf(device):
    x = torch.tensor([1.0, math.inf, math.nan, -math.inf], device=device)
    amax, _, _ = fp8_tensor_scale(x, torch.float8_e4m3fn)
    assert math.isnan(amax.item())


@pytest.mark.parametrize("x", [torch.zeros(5, 3), torch.empty(0), torch.zeros(())],
                         ids=["zeros", "empty", "0-d"])
def test_tensor_scale_zero_gives_one(device, x):
    amax, scale, scale_inv = fp8_tensor_scale(x.to(device), torch.float8_e5m2)
    assert (amax.item(), scale.item(), scale_inv.item()) == (0.0, 1.0, 1.0)


def test_tensor_scale_clamps_to_finite(device):
    """A subnormal amax would give an inf quotient: the scale is the largest finite fp32."""
    tiny = torch.tensor([1e-45, -1e-45], device=device)
    _, scale, scale_inv = fp8_tensor_scale(tiny, torch.float8_e4m3fn)
    assert scale.item() == torch.finfo(torch.float32).max
    assert math.isfinite(scale_inv.item()) and scale_inv.item() > 0
    huge = torch.tensor([3e38], device=device)
    _, scale, _ = fp8_tensor_scale(huge, torch.float8_e4m3fn, margin=64.0)
    assert scale.item() == torch.finfo(torch.float32).tiny


def test_tensor_scale_refuses_bad_arguments():
    x = torch.ones(4)
    with raises_naming(r"ampfuse\.fp8_tensor_scale: input has dtype torch\.int32", "float32"):
        fp8_tensor_scale(x.int(), torch.float8_e4m3fn)
    with raises_naming(r"\bdtype\b", "e4m3fn", "fnuz"):
        fp8_tensor_scale(x, torch.float8_e4m3fnuz)
    with raises_naming(r"\bmargin\b", "between 0 and 64"):
        fp8_tensor_scale(x, torch.float8_e4m3fn, margin=-1.0)
    with raises_naming(r"\bmargin\b"):
        fp8_tensor_scale(x, torch.float8_e4m3fn, margin=math.nan)
    with raises_naming(r"ampfuse\.fp8_tensor_scale: input is a sparse COO tensor", "to_dense"):
        fp8_tensor_scale(x.to_sparse(), torch.float8_e4m3fn)


def test_tensor_scale_opcheck(device):
    x = matrix((12, 20), torch.bfloat16, device)
    for fp8 in FP8:
        torch.library.opcheck(torch.ops.ampfuse.fp8_tensor_scale, (x, fp8, 1.0))
        torch.library.opcheck(torch.ops.ampfuse.fp8_tensor_scale, (x, fp8))


# ---- fp8_quantize_rowwise -----------------------------------------------------------------


def rowwise_reference(x, fp8, transpose):
    """Codes and scale_inv computed with torch, one scale per row of x (of x.T if transpose)."""
    rows = x.float().cpu().t() if transpose else x.float().cpu()
    amax = rows.abs().amax(1) if rows.shape[1] else torch.zeros(rows.shape[0])
    scale = reference_scale(amax, fp8)
    return cast(rows, scale[:, None], fp8).contiguous(), 1.0 / scale


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rowwise_matches_reference(device, src, fp8, shape, transpose):
    # Transposed: columns of very different magnitudes, so one scale per column matters.
    x = (matrix(shape[::-1], src, device, seed=3).t().contiguous() if transpose
         else matrix(shape, src, device, seed=3))
    out, scale_inv = fp8_quantize_rowwise(x, fp8, transpose)
    expected, expected_inv = rowwise_reference(x, fp8, transpose)
    assert out.dtype == fp8 and out.is_contiguous()
    assert out.shape == (shape[::-1] if transpose else shape)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (out.shape[0],)
    assert_same_bits(out, expected)
    assert same_floats(scale_inv, expected_inv)
    # float64 check: each dequantized value is within half an fp8 ulp (relative) of the input,
    # or below the smallest normal's ulp, or the row's max saturates exactly.
    deq = out.float().double().cpu() * scale_inv.double().cpu()[:, None]
    ref = (x.double().cpu().t() if transpose else x.double().cpu())
    ulp_rel = 2.0 ** -(MANTISSA_BITS[fp8] + 1)
    floor = (2.0 ** (-9 if fp8 == torch.float8_e4m3fn else -16)) * scale_inv.double().cpu()[:, None]
    assert ((deq - ref).abs() <= ref.abs() * ulp_rel + floor).all()


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_rowwise_nonfinite_poisons_only_its_row(device, transpose, position, bad):
    x = matrix((33, 40), torch.float32, device, seed=4)
    r, c = divmod(position_index(position, x.numel()), x.shape[1])
    x[r, c] = bad
    out, scale_inv = fp8_quantize_rowwise(x, torch.float8_e4m3fn, transpose)
    hit = c if transpose else r
    assert math.isnan(scale_inv[hit].item())
    assert (out.view(torch.uint8)[hit] & 0x7F == 0x7F).all()  # every code of that row is nan
    others = torch.cat([scale_inv[:hit], scale_inv[hit + 1:]])
    assert torch.isfinite(others).all()
    expected, _ = rowwise_reference(x, torch.float8_e4m3fn, transpose)
    assert_same_bits(out, expected)


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "columns"])
def test_rowwise_zero_rows_and_empty(device, transpose):
    x = matrix((8, 16), torch.bfloat16, device)
    x[3] = 0
    x[:, 5] = 0
    out, scale_inv = fp8_quantize_rowwise(x, torch.float8_e5m2, transpose)
    assert scale_inv[5 if transpose else 3].item() == 1.0
    assert (out.view(torch.uint8)[5 if transpose else 3] == 0).all()
    for shape in ((0, 4), (4, 0)):
        out, scale_inv = fp8_quantize_rowwise(torch.empty(shape, device=device),
                                              torch.float8_e4m3fn, transpose)
        assert out.shape == (shape[::-1] if transpose else shape)
        assert scale_inv.shape == (out.shape[0],) and (scale_inv == 1).all()


def test_rowwise_opcheck(device):
    x = matrix((24, 40), torch.float16, device)
    for transpose in (False, True):
        torch.library.opcheck(torch.ops.ampfuse.fp8_quantize_rowwise,
                              (x, torch.float8_e4m3fn, transpose))


def test_rowwise_refuses_bad_arguments():
    x = torch.ones(4, 4)
    with raises_naming(r"ampfuse\.fp8_quantize_rowwise: input has dtype torch\.float64"):
        fp8_quantize_rowwise(x.double(), torch.float8_e4m3fn)
    with raises_naming(r"\binput must be 2-D", "reshape"):
        fp8_quantize_rowwise(torch.ones(2, 2, 2), torch.float8_e4m3fn)
    with raises_naming(r"\bdtype\b", "e4m3fn"):
        fp8_quantize_rowwise(x, torch.float16)
    with raises_naming(r"ampfuse\.fp8_quantize_rowwise: input is a sparse COO tensor", "to_dense"):
        fp8_quantize_rowwise(x.to_sparse(), torch.float8_e4m3fn)


# ---- CUDA against the CPU, bit for bit ------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_cuda_tensor_scale_gives_the_cpu_bits(src, fp8):
    gen = make_generator(5)
    x = (torch.randn(3 * 65536 + 11, generator=gen) * 40).to(src)
    for margin in (0.0, 3.0):
        cpu = fp8_tensor_scale(x, fp8, margin)
        gpu = fp8_tensor_scale(x.cuda(), fp8, margin)
        for a, b in zip(gpu, cpu):
            assert same_floats(a, b)
    x[-1] = math.nan
    assert all(math.isnan(t.item()) for t in fp8_tensor_scale(x.cuda(), fp8))


@pytest.mark.cuda
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", [(512, 1024), (1000, 1030), (3, 70000), (4099, 77)], ids=str)
def test_cuda_rowwise_gives_the_cpu_bits(src, shape, transpose):
    x = matrix(shape, src, "cpu", seed=6)
    x[1, 2] = math.inf
    for fp8 in FP8:
        out_c, inv_c = fp8_quantize_rowwise(x, fp8, transpose)
        out_g, inv_g = fp8_quantize_rowwise(x.cuda(), fp8, transpose)
        assert_same_bits(out_g, out_c)
        assert same_floats(inv_g, inv_c)


def test_rowwise_device_of_results(device):
    out, scale_inv = fp8_quantize_rowwise(torch.ones(2, 3, device=device), torch.float8_e4m3fn)
    assert out.device.type == scale_inv.device.type == torch.device(device).type


@pytest.mark.cuda
def test_cuda_rowwise_columns_taller_than_one_grid():
    """Transposed: more tile rows than gridDim.y takes (65535 tiles of 64 rows), so the tiles
    go in bands; the column amaxes span both."""
    x = matrix((65535 * 64 + 5, 3), torch.float32, "cpu", seed=8)
    for fp8 in FP8:
        out_c, inv_c = fp8_quantize_rowwise(x, fp8, True)
        out_g, inv_g = fp8_quantize_rowwise(x.cuda(), fp8, True)
        assert_same_bits(out_g, out_c)
        assert same_floats(inv_g, inv_c)


@pytest.mark.cuda
def test_cuda_rowwise_more_rows_than_grid_blocks():
    """2**31 + 5 rows: one block per row would need more blocks than gridDim.x takes
    (2**31 - 1), and the launch failed; at 2**32 rows and more the grid size wrapped and rows
    were left unwritten. Each block now moves on by gridDim.x rows; the rows past 2**31 - 1
    must get their codes and scale_inv. Built on the GPU (about 20 GB in all); skipped on a
    smaller GPU."""
    rows = 2**31 + 5
    if torch.cuda.mem_get_info()[0] < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory for a 2**31-row input")
    special = torch.tensor([[-3.0], [0.0], [math.nan], [5.0]], dtype=torch.bfloat16)
    x = torch.full((rows, 1), 2.0, dtype=torch.bfloat16, device="cuda")
    x[-4:] = special.cuda()
    out, scale_inv = fp8_quantize_rowwise(x, torch.float8_e4m3fn)
    del x
    small = torch.cat([torch.tensor([[2.0]], dtype=torch.bfloat16), special])
    out_c, inv_c = fp8_quantize_rowwise(small, torch.float8_e4m3fn)
    codes = out.view(torch.uint8).flatten()
    assert (codes[:-4] == out_c.view(torch.uint8)[0, 0].item()).all()
    assert torch.equal(codes[-4:].cpu(), out_c.view(torch.uint8).flatten()[1:])
    assert (scale_inv[:-4] == inv_c[0].item()).all()
    assert same_floats(scale_inv[-4:], inv_c[1:])

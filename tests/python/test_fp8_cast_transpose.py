"""torch.ops.ampfuse.fp8_cast_transpose / fp8_cast_transpose_dbias: one pass giving the fp8
codes of a 2-D input [m, k], the same codes transposed [k, m], the amax folded into `amax`
and (dbias) the fp32 column sums.

Reference: torch's own cast of ``(x.float() * scale).clamp(-max, max)``, the rounding
fp8_cast_amax is bit-exact with (tests/python/test_fp8_cast.py), its ``.t()``, and float64
column sums. CUDA must give the CPU's codes and amax bit for bit.
"""

import math

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops.fp8 import FP8_MAX, fp8_cast_amax, fp8_cast_transpose, fp8_cast_transpose_dbias
from fp8_emulation import cast
from helpers import (
    DTYPE_IDS,
    FLOAT_DTYPES,
    FP8,
    FP8_IDS,
    POSITIONS,
    make_generator,
    other_device,
    position_index,
    raises_naming,
)

# Odd sizes (scalar tails), tile multiples and a shape past one tile in both directions.
SHAPES = [(1, 1), (3, 5), (16, 16), (64, 128), (67, 129), (130, 48), (256, 33)]


def wide_matrix(shape, dtype, device, seed=0):
    """Values spread over 14-16 decades: subnormals, normals and saturation all occur (fp16's
    top stays below its largest finite value, 65504)."""
    gen = make_generator(seed)
    n = shape[0] * shape[1]
    top = 4 if dtype == torch.float16 else 6
    spread = torch.logspace(-10, top, max(n, 1))[torch.randperm(max(n, 1), generator=gen)][:n]
    x = torch.randn(n, generator=gen) * spread
    return x.reshape(shape).to(dtype).to(device)


def assert_same_bits(actual, expected):
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()
    assert a.shape == e.shape
    differ = (a != e).nonzero()
    assert differ.numel() == 0, (f"{differ.shape[0]} of {a.numel()} codes differ, "
                                 f"first at {differ[0].tolist()}")


def both_ops(x, scale, amax, fp8):
    """Runs both ops; checks they agree on the codes and each folds the same amax."""
    amax2 = amax.clone()
    out, out_t = fp8_cast_transpose(x, scale, amax, fp8)
    out2, out_t2, dbias = fp8_cast_transpose_dbias(x, scale, amax2, fp8)
    assert_same_bits(out2, out)
    assert_same_bits(out_t2, out_t)
    assert amax.view(torch.int32).item() == amax2.view(torch.int32).item()
    return out, out_t, dbias


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codes_transpose_amax_and_dbias(device, src, fp8, shape):
    x = wide_matrix(shape, src, device)
    scale = torch.tensor([3.5], device=device)
    amax = torch.zeros(1, device=device)
    out, out_t, dbias = both_ops(x, scale, amax, fp8)
    assert out.dtype == fp8 and out.shape == shape and out.is_contiguous()
    assert out_t.dtype == fp8 and out_t.shape == shape[::-1] and out_t.is_contiguous()
    expected = cast(x, scale, fp8)
    assert_same_bits(out, expected)
    assert_same_bits(out_t, expected.t().contiguous())
    assert amax.item() == x.float().abs().amax().item()
    # dbias: fp32 accumulation of m terms; error <= m * eps32 * sum |x| (a standard bound).
    assert dbias.dtype == torch.float32 and dbias.shape == (shape[1],)
    exact = x.double().sum(0).cpu()
    bound = shape[0] * 2.0**-24 * x.double().abs().sum(0).cpu()
    assert ((dbias.double().cpu() - exact).abs() <= bound).all()


def test_matches_fp8_cast_amax(device):
    """The row-major codes are fp8_cast_amax's, bit for bit."""
    x = wide_matrix((96, 80), torch.bfloat16, device, seed=4)
    scale = torch.tensor([0.01], device=device)
    amax_a, amax_b = torch.zeros(1, device=device), torch.zeros(1, device=device)
    out, _ = fp8_cast_transpose(x, scale, amax_a, torch.float8_e4m3fn)
    assert_same_bits(out, fp8_cast_amax(x, scale, amax_b, torch.float8_e4m3fn))
    assert amax_a.item() == amax_b.item()


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite(device, fp8, position, bad):
    """inf saturates to the largest finite code of its sign, nan gives the nan code; amax
    becomes inf / nan; dbias gets the column's inf / nan; other columns stay finite."""
    x = wide_matrix((65, 70), torch.float32, device, seed=1)
    flat = position_index(position, x.numel())
    r, c = divmod(flat, x.shape[1])
    x[r, c] = bad
    scale = torch.tensor([0.5], device=device)
    amax = torch.zeros(1, device=device)
    out, out_t, dbias = both_ops(x, scale, amax, fp8)
    expected = cast(x, scale, fp8)
    assert_same_bits(out, expected)
    assert_same_bits(out_t, expected.t().contiguous())
    if math.isnan(bad):
        assert out.view(torch.uint8)[r, c].item() & 0x7F == 0x7F and math.isnan(amax.item())
        assert math.isnan(dbias[c].item())
    else:
        assert out[r, c].float().item() == math.copysign(FP8_MAX[fp8], bad)
        assert amax.item() == math.inf and dbias[c].item() == bad
    others = torch.cat([dbias[:c], dbias[c + 1:]])
    assert torch.isfinite(others).all()


def test_amax_folds_with_nan_winning(device):
    one = torch.ones(1, device=device)
    amax = torch.full((1,), 5.0, device=device)
    fp8_cast_transpose(torch.tensor([[1.0, -2.0]], device=device), one, amax, torch.float8_e4m3fn)
    assert amax.item() == 5.0
    fp8_cast_transpose(torch.tensor([[-7.0]], device=device), one, amax, torch.float8_e4m3fn)
    assert amax.item() == 7.0
    fp8_cast_transpose_dbias(torch.tensor([[math.nan]], device=device), one, amax,
                             torch.float8_e4m3fn)
    fp8_cast_transpose(torch.tensor([[math.inf]], device=device), one, amax, torch.float8_e4m3fn)
    assert math.isnan(amax.item())


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0)], ids=str)
def test_empty_and_zero_inputs(device, shape):
    one = torch.ones(1, device=device)
    amax = torch.full((1,), 2.0, device=device)
    out, out_t, dbias = fp8_cast_transpose_dbias(torch.empty(shape, device=device), one, amax,
                                                 torch.float8_e4m3fn)
    assert out.shape == shape and out_t.shape == shape[::-1]
    assert dbias.shape == (shape[1],) and (dbias == 0).all()
    assert amax.item() == 2.0
    # The fold of nothing still clears a -0.0 amax's sign, as the CPU's max(|amax|, 0) does.
    amax = torch.tensor([-0.0], device=device)
    fp8_cast_transpose_dbias(torch.empty(shape, device=device), one, amax, torch.float8_e4m3fn)
    assert amax.cpu().view(torch.int32).item() == 0
    zeros = torch.zeros(33, 17, device=device)
    amax.zero_()
    out, out_t, dbias = fp8_cast_transpose_dbias(zeros, one, amax, torch.float8_e5m2)
    assert (out.view(torch.uint8) == 0).all() and (out_t.view(torch.uint8) == 0).all()
    assert (dbias == 0).all() and amax.item() == 0.0


def test_non_contiguous_input_is_copied(device):
    base = wide_matrix((40, 64), torch.float16, device, seed=5)
    one = torch.ones(1, device=device)
    for x in (base.t(), base[:, ::2]):
        out, out_t = fp8_cast_transpose(x, one, torch.zeros(1, device=device), torch.float8_e4m3fn)
        assert_same_bits(out, cast(x, one, torch.float8_e4m3fn))
        assert_same_bits(out_t, cast(x, one, torch.float8_e4m3fn).t().contiguous())


def test_opcheck(device):
    x = wide_matrix((24, 40), torch.bfloat16, device, seed=2)
    for fp8 in FP8:
        args = (x, torch.tensor([2.0], device=device), torch.zeros(1, device=device), fp8)
        torch.library.opcheck(torch.ops.ampfuse.fp8_cast_transpose, args)
        torch.library.opcheck(torch.ops.ampfuse.fp8_cast_transpose_dbias, args)


@pytest.mark.parametrize("op", [fp8_cast_transpose, fp8_cast_transpose_dbias])
def test_refuses_bad_arguments(op):
    x, one, amax = torch.ones(4, 4), torch.ones(1), torch.zeros(1)
    name = op.__name__
    with raises_naming(rf"ampfuse\.{name}: input has dtype torch\.float64", "float32"):
        op(x.double(), one, amax, torch.float8_e4m3fn)
    with raises_naming(r"\binput must be 2-D", "reshape"):
        op(torch.ones(2, 2, 2), one, amax, torch.float8_e4m3fn)
    with raises_naming(r"\binput must be 2-D"):
        op(torch.ones(4), one, amax, torch.float8_e4m3fn)
    with raises_naming(r"\bdtype\b", "e4m3fn", "fnuz"):
        op(x, one, amax, torch.bfloat16)
    with raises_naming(r"\bscale\b", "float32"):
        op(x, one.double(), amax, torch.float8_e4m3fn)
    with raises_naming(r"\bamax\b", "one element"):
        op(x, one, torch.zeros(2), torch.float8_e4m3fn)
    with raises_naming(r"\bamax\b", "meta"):
        op(x, one, amax.to(other_device("cpu")), torch.float8_e4m3fn)
    with raises_naming(r"\bscale\b", "meta"):
        op(x, one.to(other_device("cpu")), amax, torch.float8_e4m3fn)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", [(1024, 2048), (1000, 1030), (4099, 77), (17, 4096)], ids=str)
def test_cuda_gives_the_cpu_bits(src, fp8, shape):
    """Aligned shapes take the 16-byte vector path, the others the scalar tail path."""
    x = wide_matrix(shape, src, "cpu", seed=3)
    x[5, 7] = math.nan
    scale = torch.tensor([0.125])
    amax_cpu, amax_gpu = torch.zeros(1), torch.zeros(1, device="cuda")
    out_c, out_t_c, _ = fp8_cast_transpose_dbias(x, scale, amax_cpu, fp8)
    out_g, out_t_g, _ = fp8_cast_transpose_dbias(x.cuda(), scale.cuda(), amax_gpu, fp8)
    assert_same_bits(out_g, out_c)
    assert_same_bits(out_t_g, out_t_c)
    assert math.isnan(amax_gpu.item())
    x[5, 7] = 0.0
    amax_cpu.zero_(), amax_gpu.zero_()
    fp8_cast_transpose_dbias(x, scale, amax_cpu, fp8)
    _, _, dbias_g = fp8_cast_transpose_dbias(x.cuda(), scale.cuda(), amax_gpu, fp8)
    assert amax_gpu.item() == amax_cpu.item()
    # Sums in another order: both within the fp32 bound of the float64 sum.
    exact = x.double().sum(0)
    bound = shape[0] * 2.0**-24 * x.double().abs().sum(0)
    assert ((dbias_g.double().cpu() - exact).abs() <= bound).all()
    # Deterministic: a second run gives the same bits.
    _, _, again = fp8_cast_transpose_dbias(x.cuda(), scale.cuda(), amax_gpu, fp8)
    assert torch.equal(again.view(torch.int32), dbias_g.view(torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [3, 16])
def test_cuda_taller_than_one_grid(cols):
    """More tile rows than gridDim.y takes (65535 tiles of 64 rows): CUDA launches the tiles
    in bands, the second starting at row 65535 * 64, and dbias's workspace rows follow the
    global tile row. 16 columns (and rows a multiple of 16) take the 16-byte paths, 3 the
    element ones. amax starts at -0.0 (a valid "amax >= 0"), which the CPU folds as |amax|."""
    rows = 65535 * 64 + 80
    x = wide_matrix((rows, cols), torch.bfloat16, "cpu", seed=7)
    scale = torch.tensor([0.25])
    amax_cpu = torch.tensor([-0.0])
    amax_gpu = amax_cpu.cuda()
    out_c, out_t_c, dbias_c = fp8_cast_transpose_dbias(x, scale, amax_cpu, torch.float8_e5m2)
    out_g, out_t_g, dbias_g = fp8_cast_transpose_dbias(x.cuda(), scale.cuda(), amax_gpu,
                                                       torch.float8_e5m2)
    assert_same_bits(out_g, out_c)
    assert_same_bits(out_t_g, out_t_c)
    assert amax_gpu.cpu().view(torch.int32).item() == amax_cpu.view(torch.int32).item()
    assert amax_cpu.item() == x.float().abs().amax().item()
    exact = x.double().sum(0)
    bound = rows * 2.0**-24 * x.double().abs().sum(0)
    assert ((dbias_g.double().cpu() - exact).abs() <= bound).all()
    assert ((dbias_c.double() - exact).abs() <= bound).all()

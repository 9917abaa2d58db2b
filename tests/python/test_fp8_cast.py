"""torch.ops.ampfuse.fp8_cast_amax(input, scale, amax, dtype): the scaled, saturating cast to
float8_e4m3fn / float8_e5m2 and the input's amax in one pass.

Reference: torch's own cast of ``(x.float() * scale).clamp(-max, max)`` (bit for bit, nan
codes included) and ``x.float().abs().amax()``. CUDA must give the CPU's bits.
"""

import math

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops.fp8 import FP8_MAX, fp8_cast_amax
from fp8_emulation import cast
from helpers import (
    CHUNK,
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


def wide_values(n, dtype, device, seed=0):
    """Normal values spread over 20 decades, so a cast meets subnormals, normals and
    saturation at any scale."""
    gen = make_generator(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-12, 8, n)[torch.randperm(n, generator=gen)]
    return x.to(dtype).to(device)


def assert_same_bits(actual, expected):
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()
    differ = (a != e).nonzero()
    assert differ.numel() == 0, (
        f"{differ.numel()} of {a.numel()} codes differ, first at {differ[0].tolist()}: "
        f"{a.flatten()[differ[0, 0]].item():#x} != {e.flatten()[differ[0, 0]].item():#x}"
    )


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("scale", [1.0, 3.7, 2.0**-20, 1e6])
def test_matches_torch_cast_and_amax(device, src, fp8, scale):
    x = wide_values(CHUNK + 17, src, device)
    s = torch.tensor([scale], device=device)
    amax = torch.zeros(1, device=device)
    y = fp8_cast_amax(x, s, amax, fp8)
    assert y.dtype == fp8 and y.shape == x.shape and y.device == x.device
    assert_same_bits(y, cast(x, s, fp8))
    assert amax.item() == x.float().abs().amax().item()


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_saturates_or_stays_nan_and_sets_amax(device, fp8, position, bad):
    """inf saturates to the largest finite code of its sign; nan gives the nan code; amax is
    inf for an inf and nan for a nan, wherever it sits."""
    x = wide_values(3 * CHUNK + 5, torch.float32, device, seed=1)
    i = position_index(position, x.numel())
    x[i] = bad
    amax = torch.zeros(1, device=device)
    y = fp8_cast_amax(x, torch.tensor([0.5], device=device), amax, fp8)
    assert_same_bits(y, cast(x, torch.tensor([0.5]), fp8))
    code = y.view(torch.uint8)[i].item()
    if math.isnan(bad):
        assert code & 0x7F == 0x7F and math.isnan(amax.item())
    else:
        assert y[i].float().item() == math.copysign(FP8_MAX[fp8], bad)
        assert amax.item() == math.inf


def test_amax_accumulates_over_casts(device):
    """Several casts of one step fold into one amax: the larger value stays, nan sticks."""
    amax = torch.full((1,), 5.0, device=device)
    one = torch.ones(1, device=device)
    fp8_cast_amax(torch.tensor([1.0, -2.0], device=device), one, amax, torch.float8_e4m3fn)
    assert amax.item() == 5.0
    fp8_cast_amax(torch.tensor([-7.0], device=device), one, amax, torch.float8_e4m3fn)
    assert amax.item() == 7.0
    fp8_cast_amax(torch.tensor([math.nan], device=device), one, amax, torch.float8_e4m3fn)
    fp8_cast_amax(torch.tensor([math.inf], device=device), one, amax, torch.float8_e4m3fn)
    assert math.isnan(amax.item())


def test_layouts_empty_and_zero_dim(device):
    gen = make_generator(2)
    one = torch.ones(1, device=device)
    base = torch.randn(8, 12, generator=gen).to(device)
    for x in (base.t(), base[:, ::2], base[2, 3], torch.empty(0, 4, device=device)):
        amax = torch.zeros(1, device=device)
        y = fp8_cast_amax(x, one, amax, torch.float8_e4m3fn)
        assert y.shape == x.shape and y.is_contiguous()
        assert_same_bits(y, cast(x, one, torch.float8_e4m3fn))
        expected = x.abs().amax().item() if x.numel() else 0.0
        assert amax.item() == expected


def test_empty_input_clears_the_sign_of_its_amax(device):
    """A cast of no element still folds its amax (max(|amax|, nothing)): a -0.0 amax comes out
    +0.0 and a positive one unchanged, on CUDA as on the CPU."""
    one = torch.ones(1, device=device)
    for start, expected in ((-0.0, 0), (2.0, torch.tensor([2.0]).view(torch.int32).item())):
        amax = torch.tensor([start], device=device)
        fp8_cast_amax(torch.empty(0, device=device), one, amax, torch.float8_e4m3fn)
        assert amax.cpu().view(torch.int32).item() == expected


def test_opcheck(device):
    x = wide_values(1000, torch.bfloat16, device).reshape(10, 100)
    for fp8 in FP8:
        torch.library.opcheck(
            torch.ops.ampfuse.fp8_cast_amax,
            (x, torch.tensor([2.0], device=device), torch.zeros(1, device=device), fp8),
        )


def test_refuses_bad_arguments():
    x, one, amax = torch.ones(4), torch.ones(1), torch.zeros(1)
    with raises_naming(r"\binput\b", "float64"):
        fp8_cast_amax(x.double(), one, amax, torch.float8_e4m3fn)
    with raises_naming(r"\bdtype\b", "e4m3fn", "fnuz"):
        fp8_cast_amax(x, one, amax, torch.float16)
    with raises_naming(r"\bdtype\b"):
        fp8_cast_amax(x, one, amax, torch.float8_e4m3fnuz)
    with raises_naming(r"\bscale\b", "float32"):
        fp8_cast_amax(x, one.half(), amax, torch.float8_e4m3fn)
    with raises_naming(r"\bamax\b", "one element"):
        fp8_cast_amax(x, one, torch.zeros(2), torch.float8_e4m3fn)
    with raises_naming(r"\bamax\b", "meta"):
        fp8_cast_amax(x, one, amax.to(other_device("cpu")), torch.float8_e4m3fn)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_cuda_gives_the_cpu_bits(src, fp8):
    """Large enough for every block and the unrolled and tail loops of the CUDA kernel."""
    x = wide_values(5 * CHUNK * 17 + 3, src, "cpu", seed=3)
    x[7] = math.nan
    scale = torch.tensor([0.125])
    amax_cpu, amax_gpu = torch.zeros(1), torch.zeros(1, device="cuda")
    y_cpu = fp8_cast_amax(x, scale, amax_cpu, fp8)
    y_gpu = fp8_cast_amax(x.cuda(), scale.cuda(), amax_gpu, fp8)
    assert_same_bits(y_gpu, y_cpu)
    assert math.isnan(amax_gpu.item())
    x[7] = 0.0
    amax_cpu.zero_(), amax_gpu.zero_()
    fp8_cast_amax(x, scale, amax_cpu, fp8)
    fp8_cast_amax(x.cuda(), scale.cuda(), amax_gpu, fp8)
    assert amax_gpu.item() == amax_cpu.item()


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS.get)
def test_cuda_reads_an_fp16_nan_as_the_canonical_nan(fp8):
    """docs/design/fp8.md: CUDA reads fp16 through the hardware's conversion, which gives the
    canonical nan 0x7fffffff for every fp16 nan (sign and payload dropped), where the CPU keeps
    both. From an fp16 input holding a negative nan with a payload, CUDA then writes the amax
    and code the CPU writes for the fp32 canonical nan in its place, and the CPU keeps the
    payload (in the amax) and the sign (in the code). Both nans; this pins down which bits."""
    # 1.0, the nan 0xfe01, 2.0
    x = torch.tensor([0x3C00, -511, 0x4000], dtype=torch.int16).view(torch.float16)
    canonical = x.float()
    canonical.view(torch.int32)[1] = 0x7FFFFFFF
    one = torch.ones(1)
    amax_cpu, amax_canonical = torch.zeros(1), torch.zeros(1)
    amax_gpu = torch.zeros(1, device="cuda")
    y_cpu = fp8_cast_amax(x, one, amax_cpu, fp8)
    y_canonical = fp8_cast_amax(canonical, one, amax_canonical, fp8)
    y_gpu = fp8_cast_amax(x.cuda(), one.cuda(), amax_gpu, fp8)
    assert amax_cpu.view(torch.int32).item() == 0x7FC02000  # |nan 0xfe01| widened, payload kept
    assert amax_canonical.view(torch.int32).item() == 0x7FFFFFFF
    assert amax_gpu.cpu().view(torch.int32).item() == 0x7FFFFFFF
    assert_same_bits(y_gpu, y_canonical)
    assert y_cpu.view(torch.uint8)[1].item() & 0x80  # the CPU's nan code keeps the sign
    assert not y_canonical.view(torch.uint8)[1].item() & 0x80


def test_sparse_and_nested_inputs_get_ampfuse_errors():
    """Tensors no kernel takes reach the ops' refusal, which names the argument and the fix."""
    sparse = torch.ones(4, 4).to_sparse()
    one = torch.ones(1)
    with raises_naming(r"ampfuse\.fp8_cast_amax: input is a sparse COO tensor", "to_dense"):
        fp8_cast_amax(sparse, one, torch.zeros(1), torch.float8_e4m3fn)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with raises_naming(r"ampfuse\.fp8_cast_amax: input is a nested tensor"):
        fp8_cast_amax(nested, one, torch.zeros(1), torch.float8_e4m3fn)
    with raises_naming(r"ampfuse\.fp8_update_scales_: amaxes\[0\] is a sparse COO tensor"):
        torch.ops.ampfuse.fp8_update_scales_([one.to_sparse()], [torch.zeros(2)], [one], [one],
                                             [448.0], 0, "max")
    with raises_naming(r"ampfuse\.fp8_gemm: a is a sparse COO tensor"):
        torch.ops.ampfuse.fp8_gemm(sparse, torch.ones(16, 4), one, one, None, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_cuda_negative_zero_amax_and_misaligned_views(src, offset):
    """A contiguous view one element into its storage is not 16-byte aligned, so CUDA takes
    the element-per-thread kernel (whose unrolled and tail loops no other test reaches on
    CUDA); aligned, the vector kernel. Both must give the CPU's codes and amax bits.

    amax starts at -0.0, a valid "amax >= 0": the CPU folds |amax|, while an integer
    atomicMax on the raw bits kept -0.0 forever (0x80000000 is above every |x| pattern), so
    the cast never raised the amax. An all-zero input must leave +0.0, as on the CPU."""
    n = 5 * CHUNK * 17 + 3
    base = wide_values(n + offset, src, "cpu", seed=6)
    scale = torch.tensor([0.5])
    for values in (base, torch.zeros_like(base)):
        amax_cpu = torch.tensor([-0.0])
        amax_gpu = amax_cpu.cuda()
        y_cpu = fp8_cast_amax(values[offset:], scale, amax_cpu, torch.float8_e4m3fn)
        view = values.cuda()[offset:]
        assert (view.data_ptr() % 16 == 0) == (offset == 0)
        y_gpu = fp8_cast_amax(view, scale.cuda(), amax_gpu, torch.float8_e4m3fn)
        assert_same_bits(y_gpu, y_cpu)
        assert amax_gpu.cpu().view(torch.int32).item() == amax_cpu.view(torch.int32).item()
        assert amax_cpu.item() == values[offset:].float().abs().amax().item()

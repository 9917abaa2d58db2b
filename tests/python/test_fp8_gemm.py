"""torch.ops.ampfuse.fp8_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype,
use_fast_accum=False): ``(a @ b.T) * scales + bias`` for fp8 a [m, k] and b [n, k], on the CPU.

The CPU emulation is checked against float64 (fp8 products are exact, so the only error is
fp32 summation, the scale's rounding and the final rounding) for tensorwise and rowwise scales,
every output dtype, with and without bias; its refusals and the fake kernel's; opcheck; and
inf/nan at the first, a middle and the last element. The CUDA path is in test_fp8_gemm_cuda.py.
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops.fp8 import fp8_gemm
from fp8_gemm_cases import (
    E4M3,
    E5M2,
    OUT_DTYPES,
    OUT_IDS,
    assert_matches,
    error_bound,
    float64_reference,
    operands,
)
from helpers import POSITIONS, raises_naming

SCALINGS = [((E4M3, E4M3), False), ((E4M3, E5M2), False), ((E5M2, E4M3), False),
            ((E4M3, E4M3), True)]
SCALING_IDS = ["tensorwise-e4m3-e4m3", "tensorwise-e4m3-e5m2", "tensorwise-e5m2-e4m3",
               "rowwise-e4m3-e4m3"]


@pytest.mark.parametrize(("formats", "rowwise"), SCALINGS, ids=SCALING_IDS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS.get)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_cpu_emulation_against_float64(formats, rowwise, out_dtype, with_bias):
    a, b, sa, sb, bias = operands(48, 32, 256, *formats, rowwise=rowwise)
    bias = bias.to(out_dtype) if with_bias else None
    out = fp8_gemm(a, b, sa, sb, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (48, 32)
    expected = float64_reference(a, b, sa, sb, bias)
    assert_matches(out, expected, error_bound(a, b, sa, sb, expected, out_dtype))


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=OUT_IDS.get)
def test_one_rounding_to_out_dtype(rowwise, out_dtype):
    """A 16-bit output is the fp32 result (bias included) rounded once: exactly the fp32
    output with the same bias, cast."""
    a, b, sa, sb, bias = operands(32, 48, 128, rowwise=rowwise, seed=3)
    bias = bias.to(out_dtype)
    out = fp8_gemm(a, b, sa, sb, bias, out_dtype)
    out32 = fp8_gemm(a, b, sa, sb, bias.float(), torch.float32)
    assert torch.equal(out, out32.to(out_dtype))


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_fast_accum_is_accepted_and_ignored_on_the_cpu(rowwise):
    """use_fast_accum picks cuBLASLt's fast accumulation on a GPU; the CPU emulation is the
    fp32-accumulated reference either way, so its result does not change."""
    a, b, sa, sb, bias = operands(16, 32, 64, rowwise=rowwise)
    plain = fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16)
    fast = fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16, use_fast_accum=True)
    assert torch.equal(plain, fast)
    # The schema's default keeps six-argument calls working.
    assert torch.equal(torch.ops.ampfuse.fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16),
                       plain)


def test_rowwise_scales_apply_per_row_of_a_and_per_row_of_b():
    """Rowwise equals tensorwise per block: rows of a scaled by a_scale_inv[i] and columns of
    the output by b_scale_inv[j] (powers of two, so every product is exact)."""
    a, b, _, _, _ = operands(32, 16, 64, rowwise=True, seed=5)
    sa = 2.0 ** (torch.arange(32, dtype=torch.float32) % 5 - 2)
    sb = 2.0 ** (torch.arange(16, dtype=torch.float32) % 3 - 1)
    out = fp8_gemm(a, b, sa, sb, None, torch.float32)
    one = torch.ones(1)
    base = fp8_gemm(a, b, one, one, None, torch.float32)
    assert torch.equal(out, base * sa[:, None] * sb[None, :])


@pytest.mark.parametrize("formats", [(E4M3, E4M3), (E4M3, E5M2)], ids=["e4m3-e4m3", "e4m3-e5m2"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS.get)
def test_cpu_emulation_agrees_with_torch_scaled_mm(formats, out_dtype):
    """torch's own CPU _scaled_mm (tensorwise only on the CPU in torch 2.11; its second operand
    column-major, hence b.t()): both within their bound of the exact value."""
    a, b, sa, sb, bias = operands(32, 48, 256, *formats, seed=9)
    bias = bias.to(out_dtype)
    ours = fp8_gemm(a, b, sa, sb, bias, out_dtype)
    theirs = torch._scaled_mm(a, b.t(), sa.reshape(()), sb.reshape(()), bias=bias,
                              out_dtype=out_dtype)
    expected = float64_reference(a, b, sa, sb, bias)
    bound = 2 * error_bound(a, b, sa, sb, expected, out_dtype)
    assert ((ours.double() - theirs.double()).abs() <= bound).all()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_strided_bias_and_scales_are_read_as_values(rowwise):
    """A bias or rowwise scale that is a strided view gives the same result as its copy."""
    a, b, sa, sb, bias = operands(32, 48, 64, rowwise=rowwise, seed=12)
    wide_bias = torch.stack([bias, -bias], 1).flatten().half()      # bias = wide_bias[::2]
    strided = [t if t.numel() == 1 else torch.stack([t, t + 1], 1).flatten()[::2]
               for t in (sa, sb)]
    expected = fp8_gemm(a, b, sa, sb, bias.half(), torch.float16)
    assert torch.equal(fp8_gemm(a, b, *strided, wide_bias[::2], torch.float16), expected)


# (m, n, k) with a zero: an empty batch gives m = 0 in a Linear's forward and dgrad GEMMs and
# k = 0 in its wgrad GEMM.
EMPTY_PROBLEMS = [(0, 32, 64), (16, 0, 64), (16, 32, 0)]


@pytest.mark.parametrize(("m", "n", "k"), EMPTY_PROBLEMS, ids=["m0", "n0", "k0"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_empty_problems(m, n, k, rowwise):
    """An empty output, or for k = 0 the empty sum: zeros plus the bias."""
    a, b, sa, sb, bias = operands(m, n, k, rowwise=rowwise)
    out = fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.equal(out, bias.bfloat16().expand(m, n))


def test_opcheck(device):
    """opcheck's test_schema cannot run on fp8 inputs: its mutation check multiplies the
    inputs, which torch does not implement for float8 dtypes. The other three checks run,
    and the inputs are compared bit for bit here instead (the schema says none is written)."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    a, b, sa, sb, bias = operands(16, 32, 64, device=device)
    _, _, ra, rb, _ = operands(16, 32, 64, rowwise=True, device=device)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    calls = [(a, b, sa, sb, None, torch.float32, False),
             (a, b, sa, sb, bias.bfloat16(), torch.bfloat16, True),
             (a, b, sa, sb, bias.half(), torch.float16, False),
             (a, b, sa, sb, bias, torch.float32, False)]
    if device == "cpu" or torch.cuda.get_device_capability() >= (9, 0):
        calls.append((a, b, ra, rb, bias.bfloat16(), torch.bfloat16, False))
    for args in calls:
        before = [t.clone() for t in args[:4]]
        torch.library.opcheck(torch.ops.ampfuse.fp8_gemm, args, test_utils=utils)
        torch.ops.ampfuse.fp8_gemm(*args)
        for t, saved in zip(args[:4], before):
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               saved.view(torch.uint8) if t.element_size() == 1 else saved)


def _flat_index(position, numel):
    return {"first": 0, "middle": numel // 2, "last": numel - 1}[position]


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize(("target", "value"),
                         [("a", float("nan")), ("b", float("nan")), ("a_e5m2", float("inf")),
                          ("a_e5m2", float("-inf")), ("a_scale_inv", float("inf")),
                          ("b_scale_inv", float("nan")), ("bias", float("inf"))])
def test_non_finite_values_reach_their_outputs_only(position, target, value):
    """An inf/nan in an operand, a rowwise scale or the bias makes exactly the outputs it feeds
    non-finite, as in float64; the rest stays within the usual bound."""
    rowwise = target.endswith("scale_inv")
    a_dtype = E5M2 if target == "a_e5m2" else E4M3
    a, b, sa, sb, bias = operands(48, 32, 64, a_dtype=a_dtype, rowwise=rowwise, seed=11)
    tensors = {"a": a, "a_e5m2": a, "b": b, "a_scale_inv": sa, "b_scale_inv": sb, "bias": bias}
    t = tensors[target]
    wide = t.float().flatten()
    wide[_flat_index(position, wide.numel())] = value
    tensors[target].copy_(wide.view(t.shape).to(t.dtype))
    out = fp8_gemm(a, b, sa, sb, bias, torch.float32)
    expected = float64_reference(a, b, sa, sb, bias)
    assert not expected.isfinite().all()
    assert_matches(out, expected, error_bound(a, b, sa, sb, expected, torch.float32))


def test_refuses_what_cublaslt_refuses():
    """The CPU takes exactly the arguments the GPU takes, so a model that runs here runs there."""
    a, b, sa, sb, bias = operands(16, 32, 64)
    with raises_naming("both float8_e5m2", "e4m3fn"):
        fp8_gemm(a.to(E5M2), b.to(E5M2), sa, sb)
    with raises_naming("multiples of 16", "pad"):
        fp8_gemm(a[:8], b, sa, sb)
    with raises_naming("k=40", "multiples of 16"):
        fp8_gemm(a[:, :40].contiguous(), b[:, :40].contiguous(), sa, sb)
    with raises_naming("contiguous", "transposed copy"):
        fp8_gemm(a, b.T.contiguous().T, sa, sb)
    with raises_naming(r"\bb\b", "float8_e4m3fn"):
        fp8_gemm(a, b.float(), sa, sb)
    with raises_naming("dimension 1"):
        fp8_gemm(a, b[:, :32].contiguous(), sa, sb)
    for bad in (torch.float64, torch.float8_e4m3fn, torch.int32):
        with raises_naming("out_dtype", "bfloat16", "float16"):
            fp8_gemm(a, b, sa, sb, None, bad)
    with raises_naming("bias", "dtype"):
        fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    with raises_naming("bias", "dtype", "Half"):
        fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.float16)
    with raises_naming("bias", "n=32"):
        fp8_gemm(a, b, sa, sb, bias[:16], torch.float32)
    with raises_naming("a_scale_inv", "float32"):
        fp8_gemm(a, b, sa.double(), sb)


def test_refuses_scale_shapes_other_than_tensorwise_or_rowwise():
    a, b, sa, sb, _ = operands(16, 32, 64)
    _, _, ra, rb, _ = operands(16, 32, 64, rowwise=True)
    for bad_a, bad_b in ((torch.ones(2), sb),    # neither one element nor [m]
                         (ra, sb),               # rowwise a with a tensorwise b
                         (sa, rb),               # and the other way round
                         (rb, ra),               # [n] and [m]: swapped
                         (ra.view(16, 1), rb),   # [m, 1]: must be 1-D
                         (ra, rb[:16])):
        with raises_naming("a_scale_inv", "b_scale_inv", "one element each", "m=16", "n=32"):
            fp8_gemm(a, b, bad_a, bad_b)


@pytest.mark.parametrize("formats", [(E5M2, E4M3), (E4M3, E5M2)], ids=["a-e5m2", "b-e5m2"])
def test_refuses_e5m2_with_rowwise_scales(formats):
    a, b, sa, sb, _ = operands(16, 32, 64, *formats, rowwise=True)
    with raises_naming("rowwise", "float8_e4m3fn", "e5m2"):
        fp8_gemm(a, b, sa, sb)


def test_fake_kernel_refuses_what_the_cpu_refuses():
    """Meta tensors run the fake kernel: a traced call fails where an eager one does."""
    a, b, sa, sb, bias = (t.to("meta") for t in operands(16, 32, 64))
    _, _, ra, rb, _ = (t.to("meta") for t in operands(16, 32, 64, rowwise=True))
    out = fp8_gemm(a, b, ra, rb, bias.half(), torch.float16, use_fast_accum=True)
    assert out.shape == (16, 32) and out.dtype == torch.float16
    with raises_naming("one element each", "m=16"):
        fp8_gemm(a, b, ra, sb)
    with raises_naming("rowwise", "float8_e4m3fn"):
        fp8_gemm(a.to(E5M2), b, ra, rb)
    with raises_naming("bias", "dtype"):
        fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    with raises_naming("out_dtype", "float16"):
        fp8_gemm(a, b, sa, sb, None, torch.float64)
    with raises_naming("both float8_e5m2"):
        fp8_gemm(a.to(E5M2), b.to(E5M2), sa, sb)

"""torch.ops.ampfuse.fp8_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype):
``(a @ b.T) * a_scale_inv * b_scale_inv + bias`` for fp8 a [m, k] and b [n, k].

The CPU emulation is checked against float64 (fp8 products are exact, so the only error is
fp32 summation plus the final rounding); the CUDA path (cuBLASLt) against the CPU emulation
on a GPU of compute capability 8.9 or newer, and its refusal below that.
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops.fp8 import fp8_gemm
from helpers import make_generator, raises_naming

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def operands(m, n, k, a_dtype=E4M3, b_dtype=E4M3, seed=0, device="cpu"):
    gen = make_generator(seed)
    a = (torch.randn(m, k, generator=gen) * 50).to(a_dtype)
    b = (torch.randn(n, k, generator=gen) * 50).to(b_dtype)
    a_scale_inv = torch.tensor([0.013])
    b_scale_inv = torch.tensor([2.5e-3])
    bias = torch.randn(n, generator=gen)
    return [t.to(device) for t in (a, b, a_scale_inv, b_scale_inv, bias)]


def float64_reference(a, b, a_scale_inv, b_scale_inv, bias):
    out = (a.double() @ b.double().T) * (a_scale_inv.double() * b_scale_inv.double())
    return out if bias is None else out + bias.double()


def sum_bound(a, b, a_scale_inv, b_scale_inv):
    """fp32 summation error bound: k * eps * sum |a_i b_i| (scaled), per output element."""
    k = a.shape[1]
    magnitude = (a.double().abs() @ b.double().abs().T) * (a_scale_inv * b_scale_inv).double()
    return k * 2.0**-24 * magnitude


@pytest.mark.parametrize("formats", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)],
                         ids=["e4m3-e4m3", "e4m3-e5m2", "e5m2-e4m3"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_emulation_against_float64(formats, with_bias):
    a, b, sa, sb, bias = operands(48, 32, 256, *formats)
    expected = float64_reference(a, b, sa, sb, bias if with_bias else None)
    bound = sum_bound(a, b, sa, sb) + expected.abs() * 2.0**-23
    out32 = fp8_gemm(a, b, sa, sb, bias if with_bias else None, torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == (48, 32)
    assert ((out32.double() - expected).abs() <= bound).all()
    out16 = fp8_gemm(a, b, sa, sb, bias.bfloat16() if with_bias else None, torch.bfloat16)
    expected16 = float64_reference(a, b, sa, sb, bias.bfloat16() if with_bias else None)
    # bf16 rounding of the result (8 bits) dominates.
    assert ((out16.double() - expected16).abs()
            <= sum_bound(a, b, sa, sb) + expected16.abs() * 2.0**-8).all()


def test_opcheck(device):
    """opcheck's test_schema cannot run on fp8 inputs: its mutation check multiplies the
    inputs, which torch does not implement for float8 dtypes. The other three checks run,
    and the inputs are compared bit for bit here instead (the schema says none is written)."""
    a, b, sa, sb, bias = operands(16, 32, 64, device=device)
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for args in ((a, b, sa, sb, None, torch.float32),
                 (a, b, sa, sb, bias.bfloat16(), torch.bfloat16)):
        before = [t.clone() for t in args[:4]]
        torch.library.opcheck(torch.ops.ampfuse.fp8_gemm, args, test_utils=utils)
        torch.ops.ampfuse.fp8_gemm(*args)
        for t, saved in zip(args[:4], before):
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               saved.view(torch.uint8) if t.element_size() == 1 else saved)


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
    with raises_naming("out_dtype", "bfloat16"):
        fp8_gemm(a, b, sa, sb, None, torch.float16)
    with raises_naming("bias", "dtype"):
        fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    with raises_naming("bias", "n=32"):
        fp8_gemm(a, b, sa, sb, bias[:16], torch.float32)
    with raises_naming("a_scale_inv", "one element"):
        fp8_gemm(a, b, torch.ones(2), sb)


@pytest.mark.cuda
@pytest.mark.parametrize("formats", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
                         ids=["e4m3-e4m3", "e5m2-e4m3", "e4m3-e5m2"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_matches_the_cpu_emulation(formats, out_dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    a, b, sa, sb, bias = operands(256, 768, 1024, *formats, seed=7)
    bias = bias.to(out_dtype)
    cpu = fp8_gemm(a, b, sa, sb, bias, out_dtype)
    gpu = fp8_gemm(a.cuda(), b.cuda(), sa.cuda(), sb.cuda(), bias.cuda(), out_dtype).cpu()
    # Same products, different summation order: within the fp32 summation bound, plus one
    # rounding of the output type on each side.
    unit = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
    bound = 2 * sum_bound(a, b, sa, sb) + 2 * unit * cpu.double().abs() + 1e-30
    assert ((gpu.double() - cpu.double()).abs() <= bound).all()


@pytest.mark.cuda
def test_cuda_refuses_devices_below_sm89():
    if torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has FP8 GEMMs")
    a, b, sa, sb, _ = operands(16, 16, 16, device="cuda")
    with raises_naming("compute capability", "8.9"):
        fp8_gemm(a, b, sa, sb)

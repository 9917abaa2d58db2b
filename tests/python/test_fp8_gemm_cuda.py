"""fp8_gemm on CUDA (cuBLASLt) against the CPU emulation (test_fp8_gemm.py checks that one
against float64): tensorwise and rowwise scales, every output dtype, bias, fast accumulation;
the plan cache and the persistent workspace; the refusals of GPUs without FP8 (or rowwise)
GEMMs. Every test needs a GPU and is skipped without one.
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.ops.fp8 import fp8_gemm, fp8_gemm_plan_stats
from fp8_gemm_cases import (
    E4M3,
    E5M2,
    OUT_DTYPES,
    OUT_IDS,
    ROUNDING,
    assert_matches,
    error_bound,
    float64_reference,
    operands,
)
from helpers import raises_naming

pytestmark = pytest.mark.cuda


def _need(capability):
    if torch.cuda.get_device_capability() < capability:
        pytest.skip(f"needs compute capability {capability[0]}.{capability[1]} or newer")


def _on_cuda(tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize(("formats", "rowwise"),
                         [((E4M3, E4M3), False), ((E5M2, E4M3), False), ((E4M3, E5M2), False),
                          ((E4M3, E4M3), True)],
                         ids=["tensorwise-e4m3-e4m3", "tensorwise-e5m2-e4m3",
                              "tensorwise-e4m3-e5m2", "rowwise-e4m3-e4m3"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS.get)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["fp32-accum", "fast-accum"])
def test_cuda_matches_the_cpu_emulation(formats, rowwise, out_dtype, with_bias, fast_accum):
    _need((9, 0) if rowwise else (8, 9))
    a, b, sa, sb, bias = operands(256, 768, 1024, *formats, rowwise=rowwise, seed=7)
    bias = bias.to(out_dtype) if with_bias else None
    cpu = fp8_gemm(a, b, sa, sb, bias, out_dtype)
    gpu = fp8_gemm(*_on_cuda([a, b, sa, sb]), None if bias is None else bias.cuda(), out_dtype,
                   use_fast_accum=fast_accum)
    assert gpu.dtype == out_dtype and gpu.is_cuda
    # Same products, another summation order (and, with fast accumulation, coarser partial
    # sums): each side within its bound of the exact value, so within the sum of the two.
    # One more rounding of the product alone: where cuBLASLt has no bias epilogue for a problem
    # the bias is added after the GEMM's output is rounded.
    exact = cpu.double()
    product = float64_reference(a, b, sa, sb, None)
    bound = (error_bound(a, b, sa, sb, exact, out_dtype, fast_accum)
             + error_bound(a, b, sa, sb, exact, out_dtype) + ROUNDING[out_dtype] * exact.abs()
             + ROUNDING[out_dtype] * product.abs())
    assert ((gpu.cpu().double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_cuda_agrees_with_torch_scaled_mm(rowwise):
    """torch._scaled_mm on the same operands: its second operand column-major (b.t()), rowwise
    scales shaped [m, 1] and [1, n], bf16 output for rowwise."""
    _need((9, 0) if rowwise else (8, 9))
    m, n = 256, 512
    a, b, sa, sb, bias = _on_cuda(operands(m, n, 1024, rowwise=rowwise, seed=8))
    bias = bias.bfloat16()
    ours = fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    scale_a, scale_b = (sa.view(m, 1), sb.view(1, n)) if rowwise else (sa[0], sb[0])
    theirs = torch._scaled_mm(a, b.t(), scale_a, scale_b, bias=bias, out_dtype=torch.bfloat16)
    expected = float64_reference(a, b, sa, sb, bias)
    bound = 2 * error_bound(a, b, sa, sb, expected, torch.bfloat16) + \
        2 * ROUNDING[torch.bfloat16] * float64_reference(a, b, sa, sb, None).abs()
    assert ((ours.cpu().double() - theirs.cpu().double()).abs() <= bound).all()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_strided_bias_and_scales_are_read_as_values(rowwise):
    """A bias or rowwise scale that is a strided view gives the same result as its copy."""
    _need((9, 0) if rowwise else (8, 9))
    a, b, sa, sb, bias = _on_cuda(operands(64, 128, 256, rowwise=rowwise, seed=12))
    wide_bias = torch.stack([bias, -bias], 1).flatten().bfloat16()      # bias = wide_bias[::2]
    strided = [t if t.numel() == 1 else torch.stack([t, t + 1], 1).flatten()[::2]
               for t in (sa, sb)]
    expected = fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16)
    got = fp8_gemm(a, b, *strided, wide_bias[::2], torch.bfloat16)
    assert not wide_bias[::2].is_contiguous()
    assert torch.equal(got, expected)


def _assert_close(got, expected, a, b, sa, sb):
    """Two bf16 GEMM results of the same operands, maybe by different cuBLASLt algorithms
    (another alignment is another plan): each within its bound of the exact value."""
    product = float64_reference(a, b, sa, sb, None)
    bound = 2 * (error_bound(a, b, sa, sb, product, torch.bfloat16)
                 + ROUNDING[torch.bfloat16] * product.abs())
    assert ((got.cpu().double() - expected.cpu().double()).abs() <= bound).all()


def _at_offset(t, offset_bytes):
    """A copy of contiguous `t` that starts `offset_bytes` past a fresh (512-byte aligned)
    allocation: a view into a bigger buffer, as a slice of a packed parameter is."""
    nbytes = t.numel() * t.element_size()
    buffer = torch.zeros(nbytes + offset_bytes, dtype=torch.uint8, device=t.device)
    view = buffer[offset_bytes:].view(t.dtype).view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 512 == offset_bytes
    return view


@pytest.mark.parametrize("offset_bytes", [2, 16, 64], ids=["2B", "16B", "64B"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_bias_view_at_an_offset(rowwise, offset_bytes):
    """A fused bias that is a view at an offset (a slice of a packed bias) agrees with its
    aligned copy. cuBLASLt's heuristic takes the bias's alignment from the pointer it is
    shown; shown null, it may pick a kernel that reads the bias with wider loads than such a
    view allows. A bias off a 16-byte boundary is copied (else the plan's alignment would drop
    below what FP8 kernels take for a and b)."""
    _need((9, 0) if rowwise else (8, 9))
    a, b, sa, sb, bias = _on_cuda(operands(64, 128, 256, rowwise=rowwise, seed=13))
    bias = bias.bfloat16()
    expected = fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    got = fp8_gemm(a, b, sa, sb, _at_offset(bias, offset_bytes), torch.bfloat16)
    _assert_close(got, expected, a, b, sa, sb)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_operands_aligned_to_16_bytes_only(rowwise):
    """a, b and rowwise scales that start 16 bytes (not 256) past an allocation: the plan is
    built for that alignment (another plan than the aligned call's) and agrees with the aligned
    call."""
    _need((9, 0) if rowwise else (8, 9))
    # A shape no other test uses, so that no plan of it is cached yet.
    a, b, sa, sb, bias = _on_cuda(operands(80, 144, 256, rowwise=rowwise, seed=14))
    bias = bias.bfloat16()
    expected = fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    built = fp8_gemm_plan_stats().built
    scales = [t if t.numel() == 1 else _at_offset(t, 4) for t in (sa, sb)]
    got = fp8_gemm(_at_offset(a, 16), _at_offset(b, 16), *scales, bias, torch.bfloat16)
    assert fp8_gemm_plan_stats().built == built + 1
    _assert_close(got, expected, a, b, sa, sb)


@pytest.mark.parametrize(("m", "n", "k"), [(0, 32, 64), (16, 0, 64), (16, 32, 0)],
                         ids=["m0", "n0", "k0"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_empty_problems_match_the_cpu(m, n, k, rowwise):
    """m, n or k = 0 (an empty batch through a Linear) never reaches cuBLASLt: the CPU's
    result, zeros plus the bias for k = 0."""
    _need((9, 0) if rowwise else (8, 9))
    cpu_args = operands(m, n, k, rowwise=rowwise)
    cpu_args[4] = cpu_args[4].bfloat16()
    expected = fp8_gemm(*cpu_args, torch.bfloat16)
    got = fp8_gemm(*_on_cuda(cpu_args), torch.bfloat16)
    assert got.is_cuda and got.shape == (m, n)
    assert torch.equal(got.cpu(), expected)


def test_the_same_problem_reuses_its_plan():
    """The second call of a shape builds no plan (no heuristic query): it reuses the first's."""
    _need((8, 9))
    a, b, sa, sb, bias = _on_cuda(operands(64, 96, 128, seed=2))
    fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16)
    built, reused = fp8_gemm_plan_stats()[:2]
    fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16)
    assert fp8_gemm_plan_stats()[:2] == (built, reused + 1)
    # Another problem (here: the output type) is another plan.
    fp8_gemm(a, b, sa, sb, None, torch.float32)
    assert fp8_gemm_plan_stats()[:2] == (built + 1, reused + 1)


def test_more_shapes_than_the_plan_cache_holds():
    """More distinct m (as variable sequence lengths give) than one thread's plan cache holds:
    the least recently used plans are evicted, the cache stops growing, and every result,
    including those of problems whose plan was evicted and built again, stays within the error
    bound of the CPU emulation."""
    _need((8, 9))
    capacity = fp8_gemm_plan_stats().capacity
    assert capacity > 0
    # n and k no other test uses, so that none of these problems is cached yet. Rows are
    # independent, so the first m rows of one big operand are the m-row problem, and the
    # emulation of the big one holds every expected result.
    shapes = capacity + 8
    n, k = 48, 112
    a, b, sa, sb, _ = operands(16 * shapes, n, k, seed=15)
    expected = fp8_gemm(a, b, sa, sb, None, torch.bfloat16).double()
    # As _assert_close: each side (another algorithm per m, maybe) within its bound.
    product = float64_reference(a, b, sa, sb, None)
    bound = 2 * (error_bound(a, b, sa, sb, product, torch.bfloat16)
                 + ROUNDING[torch.bfloat16] * product.abs())
    a, b, sa, sb = _on_cuda([a, b, sa, sb])
    before = fp8_gemm_plan_stats()

    def run(rows):
        got = fp8_gemm(a[:rows], b, sa, sb, None, torch.bfloat16)
        assert got.shape == (rows, n)
        assert_matches(got, expected[:rows], bound[:rows])

    for i in range(1, shapes + 1):
        run(16 * i)
    after = fp8_gemm_plan_stats()
    assert after.built - before.built == shapes
    # This thread's cache held at most `capacity` plans, some possibly of earlier tests: at
    # least the surplus of these problems over the capacity went.
    assert after.evicted - before.evicted >= shapes - capacity
    # The newest plan is still cached; the oldest of this test was evicted and is built again.
    run(16 * shapes)
    assert fp8_gemm_plan_stats().reused == after.reused + 1
    run(16)
    assert fp8_gemm_plan_stats().built == after.built + 1


def test_no_workspace_is_allocated_per_call():
    """cuBLASLt's workspace is torch's persistent one for the stream: once warm, a call
    allocates only its output."""
    _need((8, 9))
    a, b, sa, sb, bias = _on_cuda(operands(256, 512, 1024, seed=4))
    fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fp8_gemm(a, b, sa, sb, bias.bfloat16(), torch.bfloat16)
    torch.cuda.synchronize()
    output_bytes = out.numel() * out.element_size()
    assert torch.cuda.max_memory_allocated() - before <= output_bytes + 4096


def test_calls_from_several_threads_agree():
    """Calls from several threads at once (each with its own plans) agree with one thread's."""
    _need((8, 9))
    import concurrent.futures

    a, b, sa, sb, _ = _on_cuda(operands(128, 256, 512, seed=6))
    expected = fp8_gemm(a, b, sa, sb, None, torch.float32)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fp8_gemm(a, b, sa, sb, None, torch.float32),
                                range(16)))
    torch.cuda.synchronize()
    for r in results:
        assert torch.equal(r, expected)


def test_cuda_refuses_devices_below_sm89():
    """A GPU that cannot run the problem raises NotImplementedError (ampfuse.fp8's rowwise
    Linear reads it as "use torch._scaled_mm"), not a plain RuntimeError."""
    if torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has FP8 GEMMs")
    a, b, sa, sb, _ = _on_cuda(operands(16, 16, 16))
    with raises_naming("compute capability", "8.9") as info:
        fp8_gemm(a, b, sa, sb)
    assert info.type is NotImplementedError


def test_cuda_refuses_rowwise_below_sm90():
    if not (8, 9) <= torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("only GPUs with tensorwise FP8 GEMMs but no rowwise ones (Ada) refuse")
    a, b, sa, sb, _ = _on_cuda(operands(16, 16, 16, rowwise=True))
    with raises_naming("rowwise", "9.0", "tensorwise", "torch._scaled_mm") as info:
        fp8_gemm(a, b, sa, sb)
    assert info.type is NotImplementedError

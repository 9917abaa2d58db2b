"""The rowwise FP8 Linear's two GEMM libraries (ampfuse.fp8.rowwise_gemm): ampfuse's fp8_gemm
and torch._scaled_mm. On the CPU: RowwiseScaling(gemm_backend=) validation; "auto"'s choice
with the probes, the capability and the device faked (once per kind, the warning, the errors);
which GEMM kinds a Linear looks up; the torch backend's call checked against torch's own CUDA
rules (its meta kernel on fake CUDA tensors) and its numbers, with _scaled_mm replaced by its
definition (torch has no rowwise CPU kernel), against the plain-torch emulation. On a GPU (skipped
here): both backends against the CPU emulation and each other, and the refusals."""

import contextlib
import copy
import re
import warnings

import fp8_emulation as emu
import pytest
import torch
from ampfuse import fp8
from ampfuse.fp8 import rowwise_gemm
from ampfuse.fp8.rowwise_gemm import GemmKind, choose_backend
from helpers import make_generator, raises_naming
from torch._subclasses.fake_tensor import FakeTensorMode

E4M3 = torch.float8_e4m3fn
FAKE_GPU = torch.device("cuda", 0)
KIND = GemmKind(FAKE_GPU, torch.bfloat16, True, True)
REAL_SCALED_MM = torch._scaled_mm  # the tests below may replace torch._scaled_mm


@pytest.fixture(autouse=True)
def fresh_choices():
    rowwise_gemm.clear_backend_choices()
    yield
    rowwise_gemm.clear_backend_choices()


# ---- the option ------------------------------------------------------------------------


def test_gemm_backend_option():
    assert fp8.RowwiseScaling().gemm_backend == "auto"
    for backend in ("auto", "ampfuse", "torch"):
        assert fp8.RowwiseScaling(gemm_backend=backend).gemm_backend == backend
    for bad in ("cublas", "Auto", "", None, 1, ["torch"]):
        with raises_naming("gemm_backend", '"auto", "ampfuse" or "torch"', re.escape(repr(bad))):
            fp8.RowwiseScaling(gemm_backend=bad)


# ---- "auto"'s choice, with a fake GPU ----------------------------------------------------


class FakeGpu:
    """A CUDA device of a given capability whose two libraries answer the probes as told:
    None (runs) or the exception to raise. Counts the probes per library."""

    def __init__(self, monkeypatch, capability, ampfuse=None, torch_error=None):
        self.answers = {"ampfuse": ampfuse, "torch": torch_error}
        self.probes = {"ampfuse": [], "torch": []}
        monkeypatch.setattr(rowwise_gemm, "_capability", lambda device: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        monkeypatch.setattr(rowwise_gemm, "_probe", self.probe)

    def probe(self, run, kind):
        library = {rowwise_gemm.ampfuse_gemm: "ampfuse", rowwise_gemm.torch_gemm: "torch"}[run]
        self.probes[library].append(kind)
        if self.answers[library] is not None:
            raise self.answers[library]


def choose(kind=KIND, requested="auto"):
    return choose_backend(requested, kind.device, kind.out_dtype, kind.bias, kind.fast_accum)


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_auto_uses_ampfuse_where_it_runs_and_asks_once(monkeypatch):
    gpu = FakeGpu(monkeypatch, (9, 0))
    with no_warnings():
        assert choose() == "ampfuse"
        assert choose() == "ampfuse"
    assert gpu.probes == {"ampfuse": [KIND], "torch": []}
    other = KIND._replace(out_dtype=torch.float16, bias=False)
    assert choose(other) == "ampfuse"
    assert gpu.probes["ampfuse"] == [KIND, other]


def test_auto_falls_back_to_torch_when_ampfuse_says_it_cannot(monkeypatch):
    refusal = NotImplementedError("ampfuse.fp8_gemm: cuBLASLt 12.8.0 cannot run m=16 ...")
    gpu = FakeGpu(monkeypatch, (8, 9), ampfuse=refusal)
    with pytest.warns(UserWarning) as record:
        assert choose() == "torch"
    assert len(record) == 1
    message = str(record[0].message)
    for part in ("Fake GPU", "compute capability 8.9", "cuBLASLt 12.8.0 cannot run",
                 "torch._scaled_mm"):
        assert part in message, (part, message)
    with no_warnings():  # cached; another kind on the same device probes but warns no more
        assert choose() == "torch"
        assert choose(KIND._replace(bias=False)) == "torch"
    assert gpu.probes["torch"] == [KIND, KIND._replace(bias=False)]
    assert len(gpu.probes["ampfuse"]) == 2


def test_a_real_failure_of_ampfuse_is_not_taken_for_a_refusal(monkeypatch):
    """Only NotImplementedError means "cannot"; any other error is a bug to see, not a reason
    to switch libraries silently."""
    gpu = FakeGpu(monkeypatch, (9, 0), ampfuse=RuntimeError("cublasLtMatmul failed"))
    with pytest.raises(RuntimeError, match="cublasLtMatmul failed"):
        choose()
    assert gpu.probes["torch"] == []


@pytest.mark.parametrize("torch_error", [RuntimeError("torch._scaled_mm is only supported "
                                                      "on 9.0 or 8.9"),
                                         ValueError("Only bf16 and fp16 high precision output"),
                                         NotImplementedError("not on this device")],
                         ids=["RuntimeError", "ValueError", "NotImplementedError"])
def test_neither_library_is_a_clear_error(monkeypatch, torch_error):
    FakeGpu(monkeypatch, (8, 9), ampfuse=NotImplementedError("ampfuse says no"),
            torch_error=torch_error)
    with raises_naming("neither", "cuda:0", "Fake GPU", "compute capability 8.9",
                       "ampfuse says no", re.escape(str(torch_error)), "CurrentScaling",
                       "without fp8"):
        choose(KIND._replace(out_dtype=torch.float32))


def test_gpus_without_fp8_are_refused_before_any_probe(monkeypatch):
    gpu = FakeGpu(monkeypatch, (8, 0))
    with raises_naming("cuda:0", "Fake GPU", "compute capability 8.0", "8.9", "without fp8"):
        choose()
    assert gpu.probes == {"ampfuse": [], "torch": []}


def test_a_forced_backend_is_used_without_asking(monkeypatch):
    gpu = FakeGpu(monkeypatch, (8, 0))  # would refuse everything if asked
    assert choose(requested="ampfuse") == "ampfuse"
    assert choose(requested="torch") == "torch"
    assert gpu.probes == {"ampfuse": [], "torch": []}


def test_the_cpu_is_ampfuse_s_emulation_without_a_probe(monkeypatch):
    gpu = FakeGpu(monkeypatch, (8, 0))
    assert choose(KIND._replace(device=torch.device("cpu"))) == "ampfuse"
    assert gpu.probes == {"ampfuse": [], "torch": []}


def test_the_probes_run_each_library_for_real():
    """The real probe on the CPU: ampfuse's emulation runs every kind; torch._scaled_mm refuses
    rowwise scales on the CPU, with an error (what "auto" would read as torch's refusal)."""
    cpu = torch.device("cpu")
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bias in (False, True):
            rowwise_gemm._probe(rowwise_gemm.ampfuse_gemm,
                                GemmKind(cpu, out_dtype, bias, True))
    with pytest.raises(RuntimeError):
        rowwise_gemm._probe(rowwise_gemm.torch_gemm, GemmKind(cpu, torch.bfloat16, True, False))


# ---- which GEMM kinds a Linear looks up --------------------------------------------------


def test_a_linear_looks_up_the_kind_of_each_gemm_it_runs(monkeypatch):
    asked = []

    def find(self, kind):
        asked.append(kind)
        return "ampfuse"

    monkeypatch.setattr(rowwise_gemm.BackendChoices, "_find", find)
    cpu = torch.device("cpu")
    recipe = fp8.RowwiseScaling(fast_accum_fwd=True, fast_accum_bwd=False)
    layer = fp8.Linear(32, 16, recipe=recipe).to(torch.bfloat16)
    layer.weight.data = layer.weight.data.float()  # an fp32 weight: wgrad writes fp32
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
    assert asked == [GemmKind(cpu, torch.bfloat16, True, True)]  # no backward, no lookup
    asked.clear()
    layer(x.requires_grad_()).float().sum().backward()
    assert asked == [GemmKind(cpu, torch.bfloat16, False, False),  # dgrad
                     GemmKind(cpu, torch.float32, False, False)]  # wgrad (forward: cached)


# ---- the torch backend on the CPU --------------------------------------------------------


def checked_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm as its CUDA rowwise path defines it, for the CPU. The arguments go
    through torch's own checks for CUDA (its meta kernel, on fake CUDA tensors of the same
    shapes and strides: a row-major, b column-major, scales (m, 1) and (1, n) fp32) and through
    the bias rules of its CUDA kernel; the result is the exact fp8 products summed in fp32,
    times both scales, plus the bias, rounded once (fp8_emulation.gemm)."""
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t).to("cuda") if t is not None else None
                 for t in (a, b, scale_a, scale_b, bias)]
        for fake, real in zip(fakes, (a, b, scale_a, scale_b, bias)):
            assert fake is None or fake.stride() == real.stride()
        REAL_SCALED_MM(*fakes[:4], bias=fakes[4], out_dtype=out_dtype,
                       use_fast_accum=use_fast_accum)
    if bias is not None:
        assert out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    return emu.gemm(a, b.t(), scale_a.view(-1), scale_b.view(-1), bias, out_dtype)


def test_the_checked_stand_in_refuses_what_torch_refuses():
    """The stand-in above is strict: the layouts torch's CUDA path refuses fail in it too."""
    a = torch.zeros(32, 64).to(E4M3)
    b = torch.zeros(48, 64).to(E4M3)
    sa, sb = torch.ones(32, 1), torch.ones(1, 48)
    checked_scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16)
    for args in ((a, b.t().contiguous(), sa, sb), (a, b.t(), sa.view(-1), sb.view(-1)),
                 (a, b.t(), sa.t(), sb.t())):
        with pytest.raises(RuntimeError):
            checked_scaled_mm(*args, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_torch_backend_matches_the_emulation_and_ampfuse(monkeypatch, dtype):
    """A rowwise Linear (15 rows, padded inside; bias) with gemm_backend="torch", _scaled_mm
    replaced by checked_scaled_mm: output and grads equal the plain-torch emulation's and the
    ampfuse backend's (bit for bit for bf16/fp16; fp32 within the few ulps of the existing
    recipe test, the GEMMs' summation order)."""
    monkeypatch.setattr(torch, "_scaled_mm", checked_scaled_mm)
    torch.manual_seed(0)
    by_torch = fp8.Linear(64, 32, recipe=fp8.RowwiseScaling(gemm_backend="torch")).to(dtype)
    by_ampfuse = copy.deepcopy(by_torch)
    by_ampfuse.fp8_recipe = fp8.RowwiseScaling(gemm_backend="ampfuse")
    gen = make_generator(3)
    x = (torch.randn(15, 64, generator=gen) * torch.logspace(-3, 0, 15)[:, None]).to(dtype)
    g = (torch.randn(15, 32, generator=gen) * 1e-2).to(dtype)
    want = emu.rowwise_linear(x, by_torch.weight.detach(), by_torch.bias.detach(), g)
    results = []
    for layer in (by_torch, by_ampfuse):
        xr = x.clone().requires_grad_()
        out = layer(xr)
        out.backward(g)
        results.append((out, xr.grad, layer.weight.grad, layer.bias.grad))
    tol = 1e-6 if dtype == torch.float32 else 0
    for got in results:
        for name, a, b in zip(("out", "x.grad", "weight.grad", "bias.grad"), got, want):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


def test_torch_backend_forced_on_the_cpu_is_a_clear_error():
    layer = fp8.Linear(32, 16, recipe=fp8.RowwiseScaling(gemm_backend="torch"))
    with raises_naming("torch._scaled_mm refused", "cpu", 'gemm_backend="auto"',
                       "CurrentScaling"):
        layer(torch.randn(16, 32))


# ---- on a GPU ----------------------------------------------------------------------------


def _gpu_runs(library, kind):
    """None if `library` runs `kind` on this GPU, else its refusal."""
    try:
        rowwise_gemm._probe(library, kind)
        torch.cuda.synchronize()
    except (RuntimeError, ValueError) as refusal:
        return refusal
    return None


def _data(dtype, seed):
    gen = make_generator(seed)
    x = torch.randn(40, 256, generator=gen) * 3
    if seed == 2:
        x = x * torch.logspace(-3, 0, 40)[:, None]
    return x.to(dtype), (torch.randn(40, 512, generator=gen) * 1e-2).to(dtype)


def _train_steps(layer, device, dtype):
    results = []
    for seed in range(3):
        x, g = _data(dtype, seed)
        x = x.to(device).requires_grad_()
        out = layer(x)
        out.backward(g.to(device))
        results.append([t.detach().cpu().float() for t in (out, x.grad, layer.weight.grad,
                                                           layer.bias.grad)])
        layer.weight.grad = layer.bias.grad = None
    return results


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_both_backends_match_the_cpu_emulation_and_each_other(dtype):
    """Each library that runs rowwise scales on this GPU: the same layer and data as the CPU
    emulation within the GEMM-summation tolerance of test_fp8_recipes' CUDA test; the two
    libraries within that tolerance of each other (same FP8 codes and scales)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 GEMMs")
    kind = GemmKind(torch.device("cuda"), dtype, True, True)
    refusals = {name: _gpu_runs(run, kind) for name, run in
                (("ampfuse", rowwise_gemm.ampfuse_gemm), ("torch", rowwise_gemm.torch_gemm))}
    runs = [name for name, refusal in refusals.items() if refusal is None]
    assert runs, f"neither library runs rowwise FP8 here: {refusals}"
    assert refusals["ampfuse"] is None or isinstance(refusals["ampfuse"], NotImplementedError)
    torch.manual_seed(8)
    cpu = fp8.Linear(256, 512, recipe=fp8.RowwiseScaling(gemm_backend="ampfuse")).to(dtype)
    want = _train_steps(cpu, "cpu", dtype)
    got = {}
    for name in runs:
        gpu = copy.deepcopy(cpu).cuda()
        gpu.fp8_recipe = fp8.RowwiseScaling(gemm_backend=name)
        got[name] = _train_steps(gpu, "cuda", dtype)
    tol = 2**-6
    for name, steps in got.items():
        for step, (results, reference) in enumerate(zip(steps, want)):
            for what, d, c in zip(("out", "x.grad", "weight.grad", "bias.grad"), results,
                                  reference):
                torch.testing.assert_close(d, c, rtol=tol, atol=tol * c.abs().max().item(),
                                           msg=f"{name} step {step} {what}")
    if len(runs) < 2:
        pytest.skip(f"only {runs[0]} runs rowwise FP8 on this GPU ({refusals}); the "
                    "comparison of the two libraries needs both")
    for step, (a, b) in enumerate(zip(got["ampfuse"], got["torch"])):
        for what, x, y in zip(("out", "x.grad", "weight.grad", "bias.grad"), a, b):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol * y.abs().max().item(),
                                       msg=f"step {step} {what}")


@pytest.mark.cuda
def test_cuda_auto_chooses_a_library_that_runs():
    """"auto" on this GPU: ampfuse where its probe runs, else torch with one warning, else the
    clear error; the layer then trains."""
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        with raises_naming("compute capability", "without fp8"):
            choose(GemmKind(torch.device("cuda"), torch.bfloat16, True, True))
        return
    kind = GemmKind(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, True,
                    True)
    ampfuse_refusal = _gpu_runs(rowwise_gemm.ampfuse_gemm, kind)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        chosen = choose(kind)
    assert chosen == ("ampfuse" if ampfuse_refusal is None else "torch")
    assert len(record) == (0 if chosen == "ampfuse" else 1)
    layer = fp8.Linear(256, 512, recipe=fp8.RowwiseScaling(), device="cuda",
                       dtype=torch.bfloat16)
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().square().mean().backward()
    assert torch.isfinite(layer.weight.grad).all() and torch.isfinite(x.grad).all()


@pytest.mark.cuda
def test_cuda_rowwise_fp8_gemm_runs_or_says_it_cannot():
    """ampfuse's contract on this GPU: a rowwise fp8_gemm either gives the emulation's result
    or raises NotImplementedError naming the reason; never another error."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 GEMMs")
    gen = make_generator(4)
    a8, sa = emu.quantize_rowwise(torch.randn(64, 128, generator=gen), E4M3, False)
    b8, sb = emu.quantize_rowwise(torch.randn(32, 128, generator=gen), E4M3, False)
    want = emu.gemm(a8, b8, sa, sb, None, torch.float32)
    try:
        got = rowwise_gemm.ampfuse_gemm(a8.cuda(), b8.cuda(), sa.cuda(), sb.cuda(), None,
                                        torch.float32, False)
    except NotImplementedError as refusal:
        assert "rowwise" in str(refusal) or "cuBLASLt" in str(refusal), str(refusal)
        return
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

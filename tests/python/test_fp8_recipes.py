"""ampfuse.fp8's recipes on the CPU: CurrentScaling (fp8=True), RowwiseScaling and
DelayedScaling against an exact emulation in plain torch (tests/python/fp8_emulation.py);
recipe validation; delayed-scaling checkpoints saved with the old buffer names; torch.compile
of a model with FP8 Linears (fullgraph) against eager."""

import copy

import fp8_emulation as emu
import pytest
import torch
from ampfuse import fp8
from helpers import make_generator, raises_naming

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


def data(seed, dtype, rows=(5, 3), k=64, n=32, spread=0):
    gen = make_generator(seed)
    x = torch.randn(*rows, k, generator=gen) * 3
    if spread:  # rows whose ranges differ by 10**spread: where one scale per row pays
        x = x * torch.logspace(-spread, 0, x.shape[-2])[:, None]
    g = torch.randn(*rows, n, generator=gen) * 1e-2
    return x.to(dtype), g.to(dtype)


def run(layer, x, g):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(g)
    return out, x.grad, layer.weight.grad, layer.bias.grad


def emulated(recipe, layer, x, g):
    w, b = layer.weight.detach(), layer.bias.detach()
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if isinstance(recipe, fp8.RowwiseScaling):
        out, gx, gw, gb = emu.rowwise_linear(x2, w, b, g2)
    else:
        out, gx, gw, gb = emu.current_linear(x2, w, b, g2, bwd=recipe.bwd_format)
    return out.reshape(*x.shape[:-1], -1), gx.reshape(x.shape), gw, gb


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.CurrentScaling(bwd_format="e4m3"),
                                    fp8.RowwiseScaling()],
                         ids=["current", "current-e4m3-grads", "rowwise"])
def test_matches_the_plain_torch_emulation(recipe, dtype):
    """15 rows (padded to 16 inside), 3-D input; every output bit for bit (the CPU GEMM sums
    in the same order as the emulation's fp32 matmul up to rounding, hence the fp32 tolerance
    of a few ulps; bf16/fp16 results round once and match)."""
    torch.manual_seed(0)
    layer = fp8.Linear(64, 32, recipe=recipe).to(dtype)
    for seed in range(2):
        x, g = data(seed, dtype, spread=3 * seed)
        want = emulated(recipe, layer, x, g)
        got = run(layer, x, g)
        for name, a, b in zip(("out", "x.grad", "weight.grad", "bias.grad"), got, want):
            assert a.dtype == b.dtype, name
            tol = 1e-6 if dtype == torch.float32 else 0
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
        layer.weight.grad = layer.bias.grad = None


def test_rowwise_keeps_small_rows_that_one_scale_flushes():
    """Rows 1e6 apart (more than e4m3's range): one scale per tensor flushes the small rows
    to zero, one scale per row keeps them."""
    torch.manual_seed(1)
    dense = torch.nn.Linear(64, 32, bias=False)
    x, _ = data(2, torch.float32, rows=(32,), spread=6)
    exact = dense(x)
    errors = {}
    for recipe in (fp8.CurrentScaling(), fp8.RowwiseScaling()):
        layer = fp8.Linear.from_linear(copy.deepcopy(dense), recipe)
        with torch.no_grad():
            errors[type(recipe).__name__] = ((layer(x) - exact).abs()[:4].max()
                                             / exact[:4].abs().max()).item()
    assert errors["RowwiseScaling"] < errors["CurrentScaling"] / 2, errors


def test_no_bias_and_frozen_weight():
    torch.manual_seed(2)
    layer = fp8.Linear(32, 16, bias=False)
    layer.weight.requires_grad_(False)
    x = torch.randn(16, 32, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    want = emu.current_linear(x.detach(), layer.weight, None, torch.ones(16, 16))
    torch.testing.assert_close(out, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, want[1], rtol=1e-6, atol=1e-6)


def test_current_scaling_keeps_no_state():
    layer = fp8.Linear(32, 32)
    assert isinstance(layer.fp8_recipe, fp8.CurrentScaling)
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert set(fp8.Linear(32, 32, recipe=fp8.RowwiseScaling()).state_dict()) == {"weight",
                                                                                 "bias"}


def test_recipe_validation():
    with pytest.raises(TypeError, match="CurrentScaling.*RowwiseScaling.*DelayedScaling"):
        fp8.Linear(32, 32, recipe={"margin": 0})
    with pytest.raises(TypeError, match="CurrentScaling.*RowwiseScaling.*DelayedScaling"):
        fp8.convert(torch.nn.Linear(32, 32), recipe="tensorwise")
    with raises_naming("fwd_format", "at most one e5m2"):
        fp8.CurrentScaling(fwd_format="e5m2")
    with raises_naming("bwd_format", "e4m3.*e5m2"):
        fp8.CurrentScaling(bwd_format="e3m4")
    for recipe in (fp8.CurrentScaling, fp8.RowwiseScaling):
        for flag in ("fast_accum_fwd", "fast_accum_bwd"):
            with pytest.raises(TypeError, match=f"{flag} must be True or False"):
                recipe(**{flag: 1})
    assert fp8.CurrentScaling(bwd_format=E4M3).bwd_format == E4M3
    assert fp8.RowwiseScaling().fwd_format == fp8.RowwiseScaling().bwd_format == E4M3


def old_delayed_checkpoint():
    """A state_dict as the delayed-scaling fp8.Linear of before the recipes wrote it: the
    weight, the bias and four fp32 buffers per role (input, weight, grad_output)."""
    gen = make_generator(3)
    state = {"weight": torch.randn(32, 64, generator=gen), "bias": torch.randn(32, generator=gen)}
    for role in ("input", "weight", "grad_output"):
        state[f"fp8_{role}_amax"] = torch.zeros(1)
        state[f"fp8_{role}_amax_history"] = torch.rand(16, generator=gen) * 10
        state[f"fp8_{role}_scale"] = torch.rand(1, generator=gen) * 100 + 1
        state[f"fp8_{role}_scale_inv"] = 1 / state[f"fp8_{role}_scale"]
    return state


def test_delayed_scaling_loads_existing_checkpoints():
    state = old_delayed_checkpoint()
    layer = fp8.Linear(64, 32, recipe=fp8.DelayedScaling(amax_history_len=16))
    layer.load_state_dict(state)  # strict: every old name is still there, nothing new
    for key, value in state.items():
        assert torch.equal(layer.state_dict()[key], value), key
    # ...and computes with the loaded scales (the emulation with the scales given).
    x, _ = data(4, torch.float32)
    x2 = emu.pad16(x.reshape(-1, 64))
    xq = emu.cast(x2, state["fp8_input_scale"], E4M3)
    wq = emu.cast(state["weight"], state["fp8_weight_scale"], E4M3)
    want = emu.gemm(xq, wq, state["fp8_input_scale_inv"], state["fp8_weight_scale_inv"],
                    state["bias"], torch.float32)[:15]
    with torch.no_grad():
        torch.testing.assert_close(layer(x).reshape(15, 32), want, rtol=1e-6, atol=1e-6)


def small_model(recipe):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    fp8.convert(model, recipe, min_features=0)
    return model


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.RowwiseScaling(),
                                    fp8.DelayedScaling(amax_history_len=4)],
                         ids=["current", "rowwise", "delayed"])
def test_compiles_fullgraph_like_eager(recipe):
    """torch.compile(fullgraph=True) of a model with FP8 Linears: same outputs, grads (and
    delayed scaling's amaxes) as eager over two steps."""
    eager = small_model(recipe)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    for seed in range(2):
        x, _ = data(7 + seed, torch.float32, rows=(16,))
        out_e, out_c = eager(x), compiled(x)
        out_e.square().sum().backward()
        out_c.square().sum().backward()
        torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
        for (name, p_e), p_c in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(p_c.grad, p_e.grad, rtol=0, atol=0, msg=name)
        for key, value in eager.state_dict().items():
            assert torch.equal(compiled_model.state_dict()[key], value), key
        for model in (eager, compiled_model):
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            fp8.update_scales(model)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.RowwiseScaling(),
                                    fp8.DelayedScaling(amax_history_len=4)],
                         ids=["current", "rowwise", "delayed"])
def test_cuda_matches_the_cpu_emulation(recipe, dtype):
    """The same layer and data on the GPU (fused kernels, cuBLASLt) and the CPU: the FP8 codes
    and scales are the same, so results differ by GEMM summation order (and fast
    accumulation in the forward) only."""
    # Rowwise runs on Ada too: through torch._scaled_mm where ampfuse's cuBLASLt path cannot.
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 GEMMs")
    torch.manual_seed(8)
    cpu = fp8.Linear(256, 512, recipe=recipe).to(dtype)
    gpu = copy.deepcopy(cpu).cuda()
    for seed in range(3):
        x, g = data(seed, dtype, rows=(40,), k=256, n=512, spread=3 * (seed == 2))
        results = []
        for layer, device in ((cpu, "cpu"), (gpu, "cuda")):
            got = run(layer, x.to(device), g.to(device))
            assert all(t is not None for t in got), device
            results.append([t.cpu().float() for t in got])
            layer.weight.grad = layer.bias.grad = None
            fp8.update_scales(layer)
        for name, c, d in zip(("out", "x.grad", "weight.grad", "bias.grad"), *results):
            tol = 2**-6
            torch.testing.assert_close(d, c, rtol=tol, atol=tol * c.abs().max().item(),
                                       msg=name)

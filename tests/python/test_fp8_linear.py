"""ampfuse.fp8: the DelayedScaling recipe, fp8.Linear and update_scales, on the CPU (the
other recipes: test_fp8_recipes.py).

fp8.Linear is checked against the same quantization written with torch ops (torch's float8
casts and an fp32 matmul), forward and backward, with scales that are not 1; its amaxes and
scale updates against the delayed-scaling formula; checkpoints for a bit-for-bit resume; and
torch.compile around it.
"""

import copy

import ampfuse  # noqa: F401
import pytest
import torch
from ampfuse import fp8
from helpers import make_generator, raises_naming

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def quantize(t, scale, dtype):
    """What the fused cast gives, dequantized: (t * scale) saturated, cast, back to fp32."""
    q = (t.float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.float()


def reference(layer, x, grad_out):
    """fp8.Linear's forward and backward written with torch ops: products of fp8 values
    summed in fp32, times the two scale_invs, rounded once to the output dtype."""
    s = {role: getattr(layer, f"fp8_{role}_scale") for role in ("input", "weight",
                                                                "grad_output")}
    si = {role: getattr(layer, f"fp8_{role}_scale_inv") for role in s}
    bwd = layer.fp8_recipe.bwd_format
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    xq, wq = quantize(x2, s["input"], E4M3), quantize(layer.weight, s["weight"], E4M3)
    gq = quantize(g2, s["grad_output"], bwd)
    out = (xq @ wq.T) * (si["input"] * si["weight"]) + layer.bias.float()
    grad_x = (gq @ wq) * (si["grad_output"] * si["weight"])
    grad_w = (gq.T @ xq) * (si["grad_output"] * si["input"])
    return (out.to(x.dtype).reshape(*x.shape[:-1], -1), grad_x.to(x.dtype).reshape(x.shape),
            grad_w.to(layer.weight.dtype), g2.float().sum(0).to(layer.bias.dtype))


def make_layer(seed=0, dtype=torch.float32, **recipe):
    torch.manual_seed(seed)
    layer = fp8.Linear(64, 32, recipe=fp8.DelayedScaling(amax_history_len=4, **recipe))
    return layer.to(dtype)


def step_data(seed, dtype=torch.float32, rows=(5, 3)):
    gen = make_generator(seed)
    x = (torch.randn(*rows, 64, generator=gen) * 3).to(dtype)
    g = (torch.randn(*rows, 32, generator=gen) * 1e-3).to(dtype)
    return x, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bwd_format", ["e5m2", "e4m3"])
def test_matches_the_torch_quantization_reference(dtype, bwd_format):
    """15 rows (padded to 16 inside), after two updates so that every scale is far from 1."""
    layer = make_layer(dtype=dtype, bwd_format=bwd_format)
    for seed in range(3):
        x, g = step_data(seed, dtype)
        x.requires_grad_()
        expected = reference(layer, x.detach(), g)
        out = layer(x)
        out.backward(g)
        for actual, want in zip((out, x.grad, layer.weight.grad, layer.bias.grad), expected):
            assert actual.dtype == want.dtype
            torch.testing.assert_close(actual, want, rtol=1e-5 if dtype == torch.float32
                                       else 2**-7, atol=1e-6)
        layer.weight.grad = layer.bias.grad = None
        fp8.update_scales(layer)
    assert layer.fp8_grad_output_scale.item() > 1e3  # grads of 1e-3 are scaled far up


def test_records_amaxes_and_updates_by_the_formula():
    layer = make_layer(margin=1, amax_compute="most_recent")
    x, g = step_data(4)
    layer(x).backward(g)
    amaxes = {"input": x.abs().max(), "weight": layer.weight.detach().abs().max(),
              "grad_output": g.abs().max()}
    for role, amax in amaxes.items():
        assert getattr(layer, f"fp8_{role}_amax").item() == amax.item()
    fp8.update_scales(layer)
    for role, amax in amaxes.items():
        fp8_max = MAX[E5M2] if role == "grad_output" else MAX[E4M3]
        want = (torch.tensor(fp8_max) / amax.float()) / 2.0
        assert getattr(layer, f"fp8_{role}_scale").item() == want.item()
        assert getattr(layer, f"fp8_{role}_scale_inv").item() == (1 / want).item()
        assert getattr(layer, f"fp8_{role}_amax").item() == 0.0
        assert getattr(layer, f"fp8_{role}_amax_history")[0].item() == amax.item()


def assert_only_amaxes_dropped(before, after):
    """A skipped step's update_scales: the amaxes are reset, everything else is as it was."""
    for key in before:
        if key.endswith("_amax"):
            assert after[key].item() == 0.0
        else:
            assert torch.equal(before[key], after[key]), key


def test_update_scales_finds_every_layer_and_skips_with_found_inf():
    model = torch.nn.Sequential(make_layer(1), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                fp8.Linear(32, 64, recipe=fp8.DelayedScaling()))
    x, _ = step_data(5)
    model(x).sum().backward()
    assert len(fp8.fp8_modules(model)) == 2
    before = copy.deepcopy(model.state_dict())
    fp8.update_scales(model, found_inf=torch.ones(1))
    assert_only_amaxes_dropped(before, model.state_dict())
    model(x).sum().backward()
    fp8.update_scales(model)
    assert model[3].fp8_input_scale.item() != 1.0 and model[0].fp8_weight_scale.item() != 1.0


@pytest.mark.cuda
def test_cuda_update_scales_takes_a_found_inf_from_another_device():
    """A CPU overflow flag with CUDA layers still skips the step: the amaxes are dropped, the
    histories and scales stay."""
    layer = make_layer(1).cuda()
    for role in ("input", "weight", "grad_output"):
        getattr(layer, f"fp8_{role}_amax").fill_(3.0)
    before = copy.deepcopy(layer.state_dict())
    fp8.update_scales(layer, found_inf=torch.ones(1))
    assert_only_amaxes_dropped(before, layer.state_dict())


def test_resume_is_bit_for_bit():
    def train(model, opt, seeds):
        for seed in seeds:
            x, g = step_data(seed)
            model(x).backward(g)
            opt.step()
            opt.zero_grad()
            fp8.update_scales(model)

    model = make_layer(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(3))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, range(3, 6))

    resumed = make_layer(9)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    train(resumed, resumed_opt, range(3, 6))
    for (key, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), key


def test_eval_mode_uses_the_scales_and_records_nothing():
    layer = make_layer(5)
    x, g = step_data(6)
    layer(x).backward(g)
    fp8.update_scales(layer)
    before = copy.deepcopy(layer.state_dict())
    layer.eval()
    with torch.no_grad():
        out = layer(x * 100)
    torch.testing.assert_close(out, reference(layer, x * 100, g)[0], rtol=1e-5, atol=1e-6)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_state_stays_fp32_when_the_model_is_cast():
    layer = make_layer(3).to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for n, b in layer.named_buffers())
    assert layer(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_from_linear_keeps_the_module_and_its_parameters():
    linear = torch.nn.Linear(16, 48)
    weight = linear.weight
    converted = fp8.Linear.from_linear(linear)
    assert converted is linear and isinstance(linear, fp8.Linear) and linear.weight is weight
    with pytest.raises(TypeError, match="got ampfuse.fp8.linear.Linear; subclasses"):
        fp8.Linear.from_linear(fp8.Linear(16, 16))
    odd = torch.nn.Linear(16, 10)
    with raises_naming("out_features=10"):
        fp8.Linear.from_linear(odd)
    assert type(odd) is torch.nn.Linear and not list(odd.buffers())  # left as it was


def test_compiles_around_the_fp8_linear():
    """torch.compile of a model with an fp8.Linear: same output, grads and amaxes as eager."""
    eager = torch.nn.Sequential(make_layer(6), torch.nn.GELU())
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x, _ = step_data(7)
    out_e, out_c = eager(x), compiled(x)
    out_e.sum().backward()
    out_c.sum().backward()
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    torch.testing.assert_close(compiled_model[0].weight.grad, eager[0].weight.grad, rtol=0,
                               atol=0)
    for key, value in eager.state_dict().items():
        assert torch.equal(compiled_model.state_dict()[key], value), key


def test_refusals():
    for bad, pattern in ((dict(amax_compute="mean"), "amax_compute"),
                         (dict(margin=-1), "margin"), (dict(margin=True), "margin"),
                         (dict(amax_history_len=0), "amax_history_len"),
                         (dict(fwd_format="e5m2"), "fwd_format.*at most one e5m2"),
                         (dict(bwd_format="e3m4"), "bwd_format.*e4m3.*e5m2")):
        with raises_naming(pattern):
            fp8.DelayedScaling(**bad)
    with raises_naming("in_features=24", "multiple of 16"):
        fp8.Linear(24, 32)
    with raises_naming("out_features=8"):
        fp8.Linear(32, 8)
    with pytest.raises(TypeError, match="recipe must be ampfuse.fp8.CurrentScaling, "
                       "ampfuse.fp8.RowwiseScaling or ampfuse.fp8.DelayedScaling"):
        fp8.Linear(32, 32, recipe={"margin": 0})
    with raises_naming("48 features", "64"):
        make_layer()(torch.randn(2, 48))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_the_cpu_emulation(dtype):
    """The same layer and data on the GPU (cuBLASLt) and the CPU (emulation): casts, amaxes and
    scales give the same bits; GEMM results differ only by summation order."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    torch.manual_seed(8)
    cpu = fp8.Linear(256, 512, recipe=fp8.DelayedScaling(amax_history_len=4)).to(dtype)
    gpu = copy.deepcopy(cpu).cuda()
    gen = make_generator(9)
    for _ in range(3):
        x = (torch.randn(40, 256, generator=gen) * 4).to(dtype)
        g = (torch.randn(40, 512, generator=gen) * 1e-4).to(dtype)
        outs = []
        for layer, device in ((cpu, "cpu"), (gpu, "cuda")):
            xd = x.to(device, copy=True).requires_grad_()  # never x itself
            out = layer(xd)
            out.backward(g.to(device))
            got = {"out": out, "x.grad": xd.grad, "weight.grad": layer.weight.grad,
                   "bias.grad": layer.bias.grad}
            missing = [name for name, t in got.items() if t is None]
            assert not missing, f"{device}: no {', '.join(missing)} after backward"
            outs.append([t.cpu().float() for t in got.values()])
            layer.weight.grad = layer.bias.grad = None
            fp8.update_scales(layer)
        for c, d in zip(*outs):
            # bf16: the output's own rounding. fp32: Hopper's FP8 tensor cores keep fewer bits
            # than fp32 while accumulating (measured on an H100: 2.4e-4 of the largest output
            # at k=256), so fp32 outputs cannot match the fp32 emulation to 1e-5.
            tol = 2**-7 if dtype == torch.bfloat16 else 2**-9
            torch.testing.assert_close(d, c, rtol=tol, atol=tol * c.abs().max().item())
        for key, value in cpu.state_dict().items():
            if key.startswith("fp8_"):
                assert torch.equal(gpu.state_dict()[key].cpu(), value), key

"""The torch NovoGrad that benchmarks/bench_novograd.py times (ForeachNovoGrad, written with
torch's _foreach ops) against FusedNovoGrad and the float64 reference of apex's arithmetic
(novograd_reference.py): it must take the same steps, or the benchmark's ratio compares
different work."""

import pathlib
import sys

import pytest
import torch

from ampfuse.optimizers import FusedNovoGrad
from novograd_reference import NovoGradConfig, ReferenceNovoGrad
from test_adam import assert_parity, clone_params, make_params, set_grads, step_grads

SHAPES = [(64, 33), (1000,), (7,), (3, 5, 2), (0,), (129, 2)]
STEPS = 6
PARAM_SCALE = 1e-3


def _bench():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import bench_novograd
    finally:
        sys.path.pop(0)
    return bench_novograd


def _run_both(device, config, scale, param_scale=1.0):
    """ForeachNovoGrad and FusedNovoGrad on the same fp32 params (N(0, param_scale^2)) and grads;
    returns their params and the float64 reference's."""
    bench = _bench()
    params = make_params(SHAPES, torch.float32, device)
    if param_scale != 1.0:
        params = [(p.detach() * param_scale).requires_grad_() for p in params]
    ours = clone_params(params)
    reference = ReferenceNovoGrad(params, config)
    betas = (config.beta1, config.beta2)
    torch_opt = bench.ForeachNovoGrad(params, lr=config.lr, betas=betas, eps=config.eps,
                                      weight_decay=config.weight_decay)
    fused = FusedNovoGrad(ours, lr=config.lr, betas=betas, eps=config.eps,
                          weight_decay=config.weight_decay)
    for s in range(STEPS):
        grads = step_grads(params, s, scale=scale)
        set_grads(params, grads)
        set_grads(ours, grads)
        torch_opt.step()
        fused.step()
        reference.step(grads)
    return params, ours, reference.params


def test_the_bench_defaults_are_what_the_fused_rows_use():
    bench = _bench()
    torch_opt = bench.ForeachNovoGrad([torch.zeros(3, requires_grad=True)])
    fused = FusedNovoGrad([torch.zeros(3, requires_grad=True)], lr=bench.LR,
                          weight_decay=bench.WEIGHT_DECAY)
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert torch_opt.defaults[key] == fused.defaults[key], key
    assert fused.defaults["norm_type"] == 2 and fused.defaults["grad_averaging"]
    assert fused.defaults["bias_correction"] and not fused.defaults["reg_inside_moment"]


CONFIGS = {
    # The benchmark's hyperparameters (apex's defaults, weight decay 0.01).
    "bench": NovoGradConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
    # Larger steps and quicker averages, so that a slip in the blend or the bias corrections
    # shows within a few steps.
    "large_steps": NovoGradConfig(lr=1e-2, beta1=0.95, beta2=0.98, weight_decay=0.0),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_benchmarks_torch_novograd_computes_the_same_step(device, config):
    """Over several steps (the first seeds the running norms, later ones blend them), with grads
    of a large magnitude so that the norms are far from eps."""
    params, ours, reference = _run_both(device, config, scale=4.0)
    for a, b, e in zip(ours, params, reference):
        assert_parity(b, e, "bench_novograd.ForeachNovoGrad against the float64 reference")
        assert_parity(a, b, "FusedNovoGrad against bench_novograd.ForeachNovoGrad")


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_moves_agree_too(device, config):
    """NovoGrad's normalized steps move N(0, 1) params by about lr / sqrt(numel) a step, a few
    ulps of the params: on params of 1e-3 the moves themselves are compared, so that an error
    of a part in 1e4 of the update shows."""
    start = [(p.detach() * PARAM_SCALE).double()
             for p in make_params(SHAPES, torch.float32, device)]
    params, ours, reference = _run_both(device, config, scale=4.0, param_scale=PARAM_SCALE)
    for a, b, e, p0 in zip(ours, params, reference, start):
        moved = e - p0
        assert moved.numel() == 0 or float(moved.abs().max()) > 0
        assert_parity(b.detach().double() - p0, moved, "ForeachNovoGrad's move", rtol=1e-4)
        assert_parity(a.detach().double() - p0, moved, "FusedNovoGrad's move", rtol=1e-4)


def test_eps_is_added_where_apex_adds_it(device):
    """Grads so small that eps outweighs avg / sqrt(1 - beta2^t) in the denominator (the moves,
    about lr * g / eps, are then far smaller: so are the params)."""
    config = CONFIGS["bench"]
    start = [(p.detach() * 1e-6).double() for p in make_params(SHAPES, torch.float32, device)]
    params, ours, reference = _run_both(device, config, scale=1e-12, param_scale=1e-6)
    for a, b, e, p0 in zip(ours, params, reference, start):
        moved = e - p0
        assert_parity(b.detach().double() - p0, moved, "ForeachNovoGrad's move", rtol=1e-4)
        assert_parity(a.detach().double() - p0, moved, "FusedNovoGrad's move", rtol=1e-4)


def test_the_running_norms_agree(device):
    bench = _bench()
    params = make_params(SHAPES, torch.float32, device)
    ours = clone_params(params)
    config = CONFIGS["large_steps"]
    reference = ReferenceNovoGrad(params, config)
    options = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                   weight_decay=config.weight_decay)
    torch_opt = bench.ForeachNovoGrad(params, **options)
    fused = FusedNovoGrad(ours, **options)
    for s in range(STEPS):
        grads = step_grads(params, s, scale=0.5)
        set_grads(params, grads)
        set_grads(ours, grads)
        torch_opt.step()
        fused.step()
        reference.step(grads)
    for i, (p, q) in enumerate(zip(params, ours)):
        expected = torch.tensor(reference.norms[i], dtype=torch.float64)
        assert_parity(torch_opt.state[p]["norm_avg"], expected, f"torch norm {i}")
        assert_parity(fused.state[q]["norm_avg"], expected, f"fused norm {i}")
        assert_parity(torch_opt.state[p]["exp_avg"], reference.moments[i], f"torch moment {i}")

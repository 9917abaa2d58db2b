"""complex64 params step as torch.optim steps them.

torch.optim updates a complex param as its real view (torch.view_as_real: each element's real
and imaginary parts side by side) in its for-loop, foreach and fused paths, and keeps its state
complex. The fused optimizers do the same: the ops get the real views, the state stays
complex64 in state_dict() (torch's layout, loadable both ways). So a complex param must give
the bits of its real view stepped as a float32 param, and torch.optim's numbers to the usual
fused-vs-torch rounding.
"""

import copy
import functools

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedNovoGrad,
                                FusedSGD)
from helpers import make_generator, raises_naming
from tolerances import assert_close_report

# name: (ours, torch's counterpart or None, kwargs)
CASES = {
    "adam_l2": (functools.partial(FusedAdam, decoupled_weight_decay=False), torch.optim.Adam,
                dict(lr=1e-2, weight_decay=0.1)),
    "adamw_amsgrad_maximize": (FusedAdamW, torch.optim.AdamW,
                               dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    "sgd_nesterov": (FusedSGD, torch.optim.SGD,
                     dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "adagrad": (FusedAdagrad, torch.optim.Adagrad,
                dict(lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1)),
    "lamb": (FusedLAMB, None, dict(lr=1e-2, weight_decay=0.01)),
    "novograd": (FusedNovoGrad, None, dict(lr=1e-2, weight_decay=0.01)),
}
STEPS = 5


def start_values(device="cpu"):
    """A complex param, a real one beside it in the same group (torch's test_complex mixes
    them), and a second complex one."""
    gen = make_generator(7)
    return [torch.randn(6, 4, dtype=torch.complex64, generator=gen).to(device),
            torch.randn(5, generator=gen).to(device),
            torch.randn(3, dtype=torch.complex64, generator=gen).to(device)]


def step_grads(step, device="cpu"):
    gen = make_generator(50 + step)
    return [torch.randn(v.shape, dtype=v.dtype, generator=gen).to(device)
            for v in start_values()]


def assert_close(actual, expected, **kwargs):
    """assert_close_report on complex tensors' real views (it compares real dtypes)."""
    if actual.is_complex():
        actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
    assert_close_report(actual, expected, **kwargs)


def train(make_opt, params, first=0, steps=STEPS, as_real=False):
    opt = make_opt(params)
    for step in range(first, first + steps):
        for p, g in zip(params, step_grads(step, params[0].device)):
            p.grad = torch.view_as_real(g).clone() if as_real and g.is_complex() else g.clone()
        opt.step()
    return opt


def parameters(as_real=False, device="cpu"):
    return [torch.nn.Parameter(torch.view_as_real(v).clone() if as_real and v.is_complex()
                               else v.clone()) for v in start_values(device)]


@pytest.mark.parametrize("case", list(CASES))
def test_complex_param_steps_as_its_real_view(case, device):
    cls, _, kwargs = CASES[case]
    complex_params = parameters(device=device)
    real_params = parameters(as_real=True, device=device)
    complex_opt = train(lambda p: cls(p, **kwargs), complex_params)
    real_opt = train(lambda p: cls(p, **kwargs), real_params, as_real=True)
    for i, (c, r) in enumerate(zip(complex_params, real_params)):
        view = torch.view_as_real(c.detach()) if c.is_complex() else c.detach()
        assert_close_report(view, r.detach(), exact=True, msg=f"param {i}")
        for key, value in real_opt.state[r].items():
            ours = complex_opt.state[c][key]
            if c.is_complex() and value.dim():
                assert ours.dtype == torch.complex64 and ours.shape == c.shape, key
                ours = torch.view_as_real(ours)
            assert_close_report(ours, value, exact=True, msg=f"param {i} {key}")


@pytest.mark.parametrize("case", [c for c, (_, theirs, _) in CASES.items() if theirs])
def test_complex_param_matches_torch(case, device):
    cls, torch_cls, kwargs = CASES[case]
    ours, theirs = parameters(device=device), parameters(device=device)
    ours_opt = train(lambda p: cls(p, **kwargs), ours)
    theirs_opt = train(lambda p: torch_cls(p, **kwargs), theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, msg=f"param {i}")
        for key, value in theirs_opt.state[b].items():
            if key != "step":
                assert ours_opt.state[a][key].dtype == value.dtype, key


@pytest.mark.parametrize("case", [c for c, (_, theirs, _) in CASES.items() if theirs])
@pytest.mark.parametrize("saved_by", ["torch", "ampfuse"])
def test_checkpoints_load_both_ways_with_torch(case, saved_by):
    """Half a run by one, saved, loaded by the other and run to the end: the params end where
    ours do without the interruption, to torch's rounding, and the loaded state is complex."""
    cls, torch_cls, kwargs = CASES[case]
    first_cls, second_cls = (torch_cls, cls) if saved_by == "torch" else (cls, torch_cls)
    straight = parameters()
    train(lambda p: cls(p, **kwargs), straight, steps=2 * STEPS)
    params = parameters()
    saved = copy.deepcopy(train(lambda p: first_cls(p, **kwargs), params).state_dict())
    second = train(lambda p: second_cls(p, **kwargs), params, first=STEPS, steps=0)
    second.load_state_dict(saved)
    for key, value in second.state[params[0]].items():
        if key != "step":
            assert value.dtype == torch.complex64 and value.shape == params[0].shape, key
    for step in range(STEPS, 2 * STEPS):
        for p, g in zip(params, step_grads(step)):
            p.grad = g.clone()
        second.step()
    for i, (a, b) in enumerate(zip(params, straight)):
        assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, msg=f"param {i}")


def test_loss_scale_is_divided_out_of_complex_grads():
    scale = 1024.0
    plain, scaled = parameters(), parameters()
    opt_plain, opt_scaled = FusedAdamW(plain, lr=1e-2), FusedAdamW(scaled, lr=1e-2)
    for step in range(STEPS):
        for p, q, g in zip(plain, scaled, step_grads(step)):
            p.grad, q.grad = g.clone(), g * scale
        opt_plain.step()
        opt_scaled.step(grad_scale=torch.tensor(scale))
    for i, (a, b) in enumerate(zip(scaled, plain)):
        assert_close(a.detach(), b.detach(), exact=True, msg=f"param {i}")
        assert_close(a.grad, b.grad, exact=True, msg=f"param {i} unscaled grad")


def test_grad_scaler_drives_complex_params():
    """ampfuse.GradScaler takes complex grads (torch's refuses them): a scaled FusedAdamW run
    equals the unscaled one, with an overflowing step skipped."""
    scaled, plain = parameters(), parameters()
    opt_scaled, opt_plain = FusedAdamW(scaled, lr=1e-2), FusedAdamW(plain, lr=1e-2)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**10)
    for step in range(STEPS):
        grads = step_grads(step)
        scaler.scale(torch.ones(()))  # as the loss would be (the grads are set below)
        for p, g in zip(scaled, grads):
            p.grad = g * scaler.get_scale()
        if step == 2:
            scaled[0].grad[0, 0] = complex(float("nan"), 0.0)
        scaler.step(opt_scaled)
        scaler.update()
        if step != 2:
            for p, g in zip(plain, grads):
                p.grad = g.clone()
            opt_plain.step()
    assert opt_scaled.get_skipped_steps() == 1
    for i, (a, b) in enumerate(zip(scaled, plain)):
        assert_close(a.detach(), b.detach(), exact=True, msg=f"param {i}")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32])
def test_other_complex_dtypes_are_refused(dtype):
    with raises_naming(r"param_groups\[0\]\['params'\]\[0\]", str(dtype).replace(".", r"\.")):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=dtype))])

"""The apex alias's FusedMixedPrecisionLamb: apex's constructor and ways of driving it (a
GradScaler passed to step(), a tensor lr per group, a starting step count) over FusedLAMB, with
the same bits as FusedLAMB driven the ampfuse way."""

import math
import pickle
import warnings

import pytest
import torch

from ampfuse.apex_compat.apex.optimizers import FusedMixedPrecisionLamb
from ampfuse.optimizers import FusedLAMB
from helpers import raises_naming
from test_adam import clone_params, make_params, set_grads, step_grads

SHAPES = [(64, 33), (1000,), (7,), (129, 2)]


def _scaled_backward(params, grads, scaler):
    # d/dp of sum(p * g) is g: the scaled loss leaves g * scale in p.grad.
    loss = sum((p.float() * g.float()).sum() for p, g in zip(params, grads))
    scaler.scale(loss).backward()


def _assert_steps_like_fused_lamb_with_masters(make_apex_style, dtype, steps):
    """Steps an optimizer built by make_apex_style(params) beside FusedLAMB with fp32 masters
    on the same grads; params and masters must stay identical. Returns it and its params."""
    params = make_params(SHAPES, dtype, "cpu")
    twins = clone_params(params)
    apex_style = make_apex_style(params)
    ours = FusedLAMB(twins, lr=1e-2, master_weights=True)
    for s in range(steps):
        grads = step_grads(params, s)
        set_grads(params, grads)
        set_grads(twins, grads)
        apex_style.step()
        ours.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
        assert torch.equal(apex_style.state[p]["master_param"], ours.state[q]["master_param"])
    return apex_style, params


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_params_step_on_fp32_masters_like_fused_lamb(dtype):
    _assert_steps_like_fused_lamb_with_masters(
        lambda params: FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=dtype),
        dtype, steps=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_dtype_set_before_the_first_step_takes_effect(dtype):
    # apex's own test_lamb.py sets the attribute after the constructor; apex read it at the
    # first step(), when it made the fp32 copies.
    def set_late(params):
        opt = FusedMixedPrecisionLamb(params, lr=1e-2)
        opt.reduced_precision_dtype = dtype
        return opt

    late, params = _assert_steps_like_fused_lamb_with_masters(set_late, dtype, steps=3)
    with raises_naming("reduced_precision_dtype", "after the first step"):
        late.reduced_precision_dtype = None
    with raises_naming("reduced_precision_dtype"):
        FusedMixedPrecisionLamb(clone_params(params)).reduced_precision_dtype = torch.int8


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, "ampfuse"])
def test_a_grad_scaler_passing_itself_drives_it_and_skips_overflows(scaler_class):
    """torch's GradScaler hands itself to a step() that takes grad_scaler (with a warning that
    the contract is retiring); the scale is divided out on the device, an overflow skips the
    step, and update() sees it and backs the scale off."""
    import ampfuse

    make_scaler = ampfuse.GradScaler if scaler_class == "ampfuse" else scaler_class
    params = make_params(SHAPES, torch.float16, "cpu")
    twins = clone_params(params)
    apex_style = FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=torch.float16)
    ours = FusedLAMB(twins, lr=1e-2, master_weights=True)
    scalers = [make_scaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    for s in range(4):
        grads = step_grads(params, s)
        if s == 2:
            grads[1][5] = float("inf")
        for ps, opt, scaler in ((params, apex_style, scalers[0]), (twins, ours, scalers[1])):
            _scaled_backward(ps, grads, scaler)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** 9
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
    assert float(apex_style.state[params[0]]["step"]) == 3.0


def test_grads_unscaled_by_the_scaler_are_not_divided_again():
    """scaler.unscale_(optimizer) then clipping, apex's recipe for clipping: step() must take the
    grads as they are (apex divided them by the scale a second time)."""
    params = make_params(SHAPES, torch.float32, "cpu")
    twins = clone_params(params)
    apex_style = FusedMixedPrecisionLamb(params, lr=1e-2)
    ours = FusedLAMB(twins, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    grads = step_grads(params, 0)
    _scaled_backward(params, grads, scaler)
    scaler.unscale_(apex_style)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scaler.step(apex_style)
    set_grads(twins, [p.grad for p in params])
    ours.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


def test_step_argument_sets_the_first_count():
    """step=5: the first update uses the bias corrections of step 6, as apex's group count."""
    param = make_params([(50,)], torch.float32, "cpu")[0]
    start = param.detach().double().clone()
    opt = FusedMixedPrecisionLamb([param], lr=1e-2, step=5, max_grad_norm=0.0)
    grad = step_grads([param], 0)[0]
    set_grads([param], [grad])
    opt.step()
    assert float(opt.state[param]["step"]) == 6.0
    g, (beta1, beta2), eps, decay, t = grad.double(), (0.9, 0.999), 1e-6, 0.01, 6
    m, v = (1 - beta1) * g, (1 - beta2) * g * g
    update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps) + decay * start
    expected = start - 1e-2 * float(start.norm()) / float(update.norm()) * update
    torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_each_group_has_its_own_lr_tensor_which_schedulers_fill():
    params = make_params([(8,), (9,)], torch.float32, "cpu")
    opt = FusedMixedPrecisionLamb([{"params": params[:1]}, {"params": params[1:]}], lr=0.5)
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 for lr in lrs)
    assert lrs[0] is not lrs[1]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.1 ** epoch)
    set_grads(params, step_grads(params, 0))
    opt.step()
    scheduler.step()
    assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([0.05, 0.05])
    assert opt.param_groups[0]["lr"] is lrs[0], "filled in place"


BAD = {
    "dtype": ({"reduced_precision_dtype": torch.int8}, ["reduced_precision_dtype", "float16"]),
    "step": ({"step": -1}, ["step=-1", "int >= 0"]),
    "float_step": ({"step": 1.5}, ["step=1.5"]),
    "amsgrad": ({"amsgrad": True}, ["amsgrad"]),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_arguments_are_refused_by_name(case):
    options, patterns = case
    with raises_naming(*patterns):
        FusedMixedPrecisionLamb(make_params([(4,)], torch.float32, "cpu"), **options)


def test_constructed_as_nvidia_bert_recipes_do():
    """The call of NVIDIA's BERT/MLPerf recipes: positional params and keyword options."""
    params = make_params([(16, 4)], torch.bfloat16, "cpu")
    opt = FusedMixedPrecisionLamb(params, lr=4e-3, betas=(0.9, 0.999), eps=1e-6,
                                  weight_decay=0.01, max_grad_norm=1.0, step=3,
                                  reduced_precision_dtype=torch.bfloat16, use_nvlamb=False)
    set_grads(params, step_grads(params, 0))
    opt.step()
    assert math.isfinite(float(params[0].detach().float().sum()))
    assert opt.state[params[0]]["master_param"].dtype == torch.float32
    copy = pickle.loads(pickle.dumps(opt))
    assert copy.reduced_precision_dtype is torch.bfloat16 and copy._first_step_count == 3.0

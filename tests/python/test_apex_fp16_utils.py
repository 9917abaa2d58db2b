"""The apex alias's apex.fp16_utils (FP16_Optimizer, the master-param helpers, network_to_half)
and apex.multi_tensor_apply (test_apex_alias.py imports them as apex's ImageNet example
does): FP16_Optimizer gives the fp32-master step written out by hand, skips overflowing steps
and resumes from its checkpoints."""

import pytest
import torch

from ampfuse.apex_compat.apex import fp16_utils
from ampfuse.apex_compat.apex.fp16_utils import FP16_Optimizer
from ampfuse.apex_compat.apex.multi_tensor_apply import multi_tensor_applier
from helpers import raises_naming


def test_multi_tensor_applier_says_there_are_no_amp_c_kernels():
    with raises_naming("no amp_C kernels", "multi_tensor_scale_"):
        multi_tensor_applier(None, torch.zeros(1, dtype=torch.int), [[]])


def _model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model.to(dtype)


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_static_scale_step_is_the_fp32_master_step_written_out(dtype):
    """FP16_Optimizer equals: fp32 masters, grads / scale copied up, SGD on the masters, masters
    copied down (the recipe prep_param_lists & co. spell out), bit for bit."""
    model, twin = _model(dtype), _model(dtype)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         static_loss_scale=128.0, verbose=False)
    model_params, masters = fp16_utils.prep_param_lists(twin)
    by_hand = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))
        opt.step()
        twin.zero_grad()
        (torch.nn.functional.mse_loss(twin(x.to(dtype)).float(), y) * 128.0).backward()
        fp16_utils.model_grads_to_master_grads(model_params, masters)
        for m in masters:
            m.grad.div_(128.0)
        by_hand.step()
        fp16_utils.master_params_to_model_params(model_params, masters)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for m, n in zip(opt.all_fp32_from_fp16_params, masters):
        assert torch.equal(m, n)


def test_an_overflow_skips_the_step_and_a_dynamic_scale_backs_off_then_grows():
    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         dynamic_loss_scale=True, verbose=False,
                         dynamic_loss_args={"init_scale": 1024.0, "scale_window": 2})
    x, y = _batch(0)
    opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
    opt.step()
    before = [p.clone() for p in model.parameters()]
    masters = [m.clone() for m in opt.all_fp32_from_fp16_params]
    momenta = [opt.state[m]["momentum_buffer"].clone() for m in opt.all_fp32_from_fp16_params]
    opt.zero_grad()
    opt.backward(model(x.half()).float().sum() * float("inf"))
    assert opt.overflow and opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None
    opt.step()
    assert opt.loss_scale == 512.0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    for m, b, mom in zip(opt.all_fp32_from_fp16_params, masters, momenta):
        assert torch.equal(m, b) and torch.equal(opt.state[m]["momentum_buffer"], mom)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
        assert not opt.overflow
        assert opt.clip_master_grads(1e9) > 0
        opt.step()
    assert opt.loss_scale == 1024.0, "two clean steps (scale_window) grow it back"


def test_a_checkpoint_resumes_the_run_exactly():
    def run(steps, opt=None, model=None):
        model = model or _model(torch.bfloat16)
        opt = opt or FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                    dynamic_loss_scale=True, verbose=False)
        for step in steps:
            x, y = _batch(step)
            opt.zero_grad()
            opt.backward(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y))
            opt.step()
        return model, opt

    whole, _ = run(range(4))
    first, opt = run(range(2))
    saved_model, saved_opt = first.state_dict(), opt.state_dict()
    resumed = _model(torch.bfloat16)
    resumed.load_state_dict(saved_model)
    fresh = FP16_Optimizer(torch.optim.Adam(resumed.parameters(), lr=1e-2),
                           dynamic_loss_scale=True, verbose=False)
    fresh.load_state_dict(saved_opt)
    resumed, _ = run(range(2, 4), fresh, resumed)
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_bad_arguments_are_refused_by_name():
    with raises_naming("dynamic_loss_args has 'growth'", "scale_window"):
        FP16_Optimizer(torch.optim.SGD(_model(torch.float16).parameters(), lr=0.1),
                       dynamic_loss_scale=True, dynamic_loss_args={"growth": 2}, verbose=False)
    with pytest.raises(TypeError, match="float64"):
        FP16_Optimizer(torch.optim.SGD(_model(torch.float64).parameters(), lr=0.1),
                       verbose=False)
    with pytest.raises(RuntimeError, match="state_dict"):
        import pickle
        pickle.dumps(FP16_Optimizer(torch.optim.SGD(_model(torch.float16).parameters(), lr=0.1),
                                    verbose=False))


@pytest.mark.parametrize("flat", [False, True])
def test_master_param_helpers_copy_both_ways(flat):
    model = _model(torch.float16)
    model_params, masters = fp16_utils.prep_param_lists(model, flat_master=flat)
    assert all(m.dtype == torch.float32 for m in masters) and len(masters) == (1 if flat else 4)
    for p in model_params:
        p.grad = torch.full_like(p, 0.5)
    fp16_utils.model_grads_to_master_grads(model_params, masters, flat_master=flat)
    assert all(bool((m.grad == 0.5).all()) for m in masters)
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    before = [p.detach().float().clone() for p in model_params]
    fp16_utils.master_params_to_model_params(model_params, masters, flat_master=flat)
    for p, b in zip(model_params, before):
        assert torch.allclose(p.float(), b + 1.0, atol=1e-2)


def test_network_to_half_keeps_affine_batch_norms_fp32():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                              torch.nn.BatchNorm1d(4, affine=False))
    half = fp16_utils.network_to_half(net)
    assert half[1][0].weight.dtype == torch.float16
    assert half[1][1].weight.dtype == torch.float32
    assert half[1][2].running_mean.dtype == torch.float16
    model = fp16_utils.FP16Model(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                     torch.nn.BatchNorm1d(4)))
    assert model.network[0].weight.dtype == torch.float16
    assert model.network[1].weight.dtype == torch.float32
    assert fp16_utils.tofp16()(torch.ones(2)).dtype == torch.float16


def test_apexs_legacy_dynamic_loss_scaler_rule():
    scaler = fp16_utils.DynamicLossScaler(init_scale=8.0, scale_window=2)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert scaler.has_overflow([p])
    scales = []
    for overflow in (True, False, False, True, True, True, True):
        scaler.update_scale(overflow)
        scales.append(scaler.loss_scale)
    assert scales == [4.0, 4.0, 8.0, 4.0, 2.0, 1.0, 1]
    assert fp16_utils.LossScaler(16).loss_scale == 16

"""What p.grad holds after a fused optimizer step that divided out a loss scale.

torch's fused optimizers (and its for-loop ones, through GradScaler.unscale_) leave p.grad
unscaled after a clean step, and leave it untouched (still scaled) when the step is skipped for
inf/nan. ampfuse's fused optimizers match that bit for bit, unless constructed with
write_unscaled_grads=False, which keeps the scaled grads and saves one write of them per step.
"""

import pytest
import torch

import ampfuse
from ampfuse.optimizers import FusedAdam, FusedAdamW, FusedSGD
from helpers import dtype_id, raises_naming, torch_scaler_class
from test_adam import LOW_DTYPES, SHAPES, clone_params, make_params, set_grads, step_grads

# (ampfuse optimizer, torch optimizer, shared keyword arguments)
PAIRS = {
    "adamw": (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    "adam_maximize": (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1,
                                                        maximize=True)),
    "sgd_momentum": (FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
}
DTYPES = (torch.float32,) + LOW_DTYPES
# A power of two unscales exactly; 3 and 1000 show that the grad is divided as torch divides.
SCALES = (1024.0, 3.0, 1000.0)


def _fused_and_torch(case, dtype, device, ref_device=None, **extra):
    """The same params for an ampfuse optimizer (on `device`) and torch's fused one (on
    ref_device, default the same)."""
    fused_cls, torch_cls, kwargs = PAIRS[case]
    params = make_params(SHAPES, dtype, device)
    ref_params = clone_params([p.detach().to(ref_device or device) for p in params])
    fused = fused_cls(params, **kwargs, **extra)
    ref = torch_cls(ref_params, fused=True, **kwargs)
    return params, fused, ref_params, ref


def _scaled_grads(params, step, scale):
    return [(g.float() * scale).to(g.dtype) for g in step_grads(params, step)]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(PAIRS))
def test_clean_step_leaves_grads_unscaled_like_torch(device, case, dtype, scale):
    params, fused, ref_params, ref = _fused_and_torch(case, dtype, device)
    for step in range(3):
        grads = _scaled_grads(params, step, scale)
        set_grads(params, grads)
        set_grads(ref_params, grads)
        fused.step(grad_scale=torch.full((), scale, device=device))
        # torch's optimizers take the loss scale as attributes (GradScaler's protocol).
        ref.grad_scale = torch.full((), scale, device=device)
        ref.found_inf = torch.zeros((), device=device)
        ref.step()
        for i, (p, q) in enumerate(zip(params, ref_params)):
            assert torch.equal(p.grad, q.grad), f"step {step}: params[{i}].grad differs from torch"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(PAIRS))
def test_skipped_step_leaves_grads_scaled_like_torch(device, case, dtype):
    params, fused, ref_params, ref = _fused_and_torch(case, dtype, device)
    grads = _scaled_grads(params, 0, 1024.0)
    grads[1].view(-1)[3] = float("inf")
    set_grads(params, grads)
    set_grads(ref_params, grads)
    fused.step(grad_scale=torch.full((), 1024.0, device=device),
               found_inf=torch.ones((), device=device))
    ref.grad_scale = torch.full((), 1024.0, device=device)
    ref.found_inf = torch.ones((), device=device)
    ref.step()
    for i, (p, q, g) in enumerate(zip(params, ref_params, grads)):
        assert torch.equal(p.grad, g), f"params[{i}].grad was written on a skipped step"
        assert torch.equal(q.grad, g), "torch's behaviour changed: a skipped step wrote the grad"


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, ampfuse.GradScaler],
                         ids=["torch_scaler", "ampfuse_scaler"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_grad_scaler_step_leaves_grads_unscaled(device, scaler_cls, dtype):
    """Over clean and overflowing steps, p.grad after scaler.step() equals what torch's fused
    AdamW driven by torch's GradScaler leaves. torch's CUDA unscale does not take bf16 grads:
    there the reference runs on the CPU, and torch's scaler on our optimizer must fail as it
    does on torch's own."""
    torch_unscales = torch_scaler_class(device, dtype) is torch.amp.GradScaler
    ref_device = device if torch_unscales else "cpu"
    params, fused, ref_params, ref = _fused_and_torch("adamw", dtype, device, ref_device)
    scaler = scaler_cls(device, init_scale=2.0 ** 12, growth_interval=2)
    if not torch_unscales and scaler_cls is torch.amp.GradScaler:
        scaler.scale(sum(p.float().sum() for p in params)).backward()
        with pytest.raises(NotImplementedError, match="BFloat16"):
            scaler.step(fused)
        return
    ref_scaler = torch.amp.GradScaler(ref_device, init_scale=2.0 ** 12, growth_interval=2)
    for step in range(6):
        targets = [g.float() for g in step_grads(params, step)]
        if step == 3:
            targets[0].view(-1)[5] = float("inf")
        for opt, ps, sc in ((fused, params, scaler), (ref, ref_params, ref_scaler)):
            opt.zero_grad()
            loss = sum((p.float() * t.to(p.device)).sum() for p, t in zip(ps, targets))
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        for i, (p, q) in enumerate(zip(params, ref_params)):
            assert torch.equal(p.grad.cpu(), q.grad.cpu()), (
                f"step {step}: params[{i}].grad differs")


@pytest.mark.parametrize("case", list(PAIRS))
def test_opt_out_keeps_the_scaled_grads(device, case):
    params, fused, _, _ = _fused_and_torch(case, torch.bfloat16, device,
                                           write_unscaled_grads=False)
    assert all(g["write_unscaled_grads"] is False for g in fused.param_groups)
    grads = _scaled_grads(params, 0, 1000.0)
    set_grads(params, grads)
    fused.step(grad_scale=torch.full((), 1000.0, device=device))
    for i, (p, g) in enumerate(zip(params, grads)):
        assert torch.equal(p.grad, g), f"params[{i}].grad was unscaled despite the opt-out"


def test_opt_out_is_per_group_and_survives_state_dict():
    a, b = make_params([(4,), (5,)], torch.float32, "cpu")
    opt = FusedAdamW([{"params": [a]}, {"params": [b], "write_unscaled_grads": False}])
    assert [g["write_unscaled_grads"] for g in opt.param_groups] == [True, False]
    restored = FusedAdamW([{"params": [a]}, {"params": [b]}])
    restored.load_state_dict(opt.state_dict())
    assert [g["write_unscaled_grads"] for g in restored.param_groups] == [True, False]
    # A torch.optim checkpoint has no such key: the optimizer's own setting stays.
    torch_sd = torch.optim.AdamW([a.detach().clone(), b.detach().clone()]).state_dict()
    torch_sd["param_groups"] = [dict(torch_sd["param_groups"][0], params=[0]),
                                dict(torch_sd["param_groups"][0], params=[1])]
    restored.load_state_dict(torch_sd)
    assert [g["write_unscaled_grads"] for g in restored.param_groups] == [True, False]


@pytest.mark.parametrize("cls", [FusedAdam, FusedAdamW, FusedSGD])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_opt_out_must_be_a_bool(cls, value):
    p = make_params([(3,)], torch.float32, "cpu")
    with raises_naming("write_unscaled_grads", "True or False"):
        cls(p, lr=0.1, write_unscaled_grads=value)


def test_grads_without_a_loss_scale_are_not_written(device):
    """Without grad_scale there is nothing to divide out: the grads keep their exact bits (and
    cost no write)."""
    params = make_params(SHAPES, torch.float16, device)
    grads = step_grads(params, 0)
    set_grads(params, grads)
    FusedAdamW(params, lr=1e-2, master_weights=True).step()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_op_writes_back_into_grads_laid_out_unlike_their_param(op):
    """A grad that is a transposed view (or otherwise not laid out like its param) is computed in
    a temporary and copied back, so the caller's tensor still ends up unscaled."""
    param = torch.randn(6, 5)
    grad = (torch.randn(5, 6) * 8.0).t()  # strides (1, 6): not the param's (5, 1)
    expected = grad / 8.0
    step, lr = torch.zeros(()), torch.full((), 0.1)
    scale, found = torch.full((), 8.0), torch.zeros(())
    if op == "adam":
        torch.ops.ampfuse.fused_adam_([param], [grad], [torch.zeros(6, 5)], [torch.zeros(6, 5)],
                                      [], [], step, lr, 0.9, 0.999, 1e-8, 0.0, True, True, False,
                                      False, scale, found, True)
    else:
        torch.ops.ampfuse.fused_sgd_([param], [grad], [], [], step, lr, 0.0, 0.0, 0.0, False,
                                     False, scale, found, True)
    assert torch.equal(grad, expected)

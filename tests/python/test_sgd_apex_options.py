"""FusedSGD's apex options and torch's optional lr.

- wd_after_momentum (apex): weight decay joins the update after the momentum step, so the
  momentum buffer never holds it; checked against a float64 model of apex's kernel.
- materialize_master_grads (apex): accepted, validated, and changes nothing here (see the
  docstring of FusedSGD).
- lr: optional, 1e-3 by default, as in torch.optim.SGD.
"""

import pytest
import torch

from ampfuse.optimizers import FusedSGD
from helpers import raises_naming
from test_adam import SHAPES, clone_params, make_params, set_grads, step_grads

STEPS = 20
LR = 0.05
CASES = {
    "momentum": dict(momentum=0.9, weight_decay=0.1),
    "dampening": dict(momentum=0.9, dampening=0.3, weight_decay=0.1),
    "nesterov": dict(momentum=0.9, nesterov=True, weight_decay=0.1),
    "maximize": dict(momentum=0.8, weight_decay=0.1, maximize=True),
}


def apex_sgd_reference(params, grads_per_step, lr, momentum=0.0, dampening=0.0,
                       weight_decay=0.0, nesterov=False, maximize=False):
    """apex's multi_tensor_sgd with wd_after_momentum=True, in float64."""
    ps = [p.detach().double().clone() for p in params]
    bufs = [None] * len(ps)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(ps, grads)):
            d = g.double() * (-1.0 if maximize else 1.0)
            if momentum != 0:
                bufs[i] = d.clone() if bufs[i] is None else bufs[i] * momentum + (1 - dampening) * d
                d = d + momentum * bufs[i] if nesterov else bufs[i]
            p -= lr * (d + weight_decay * p)
    return ps, bufs


@pytest.mark.parametrize("case", list(CASES))
def test_wd_after_momentum_matches_apex_math(device, case):
    kwargs = CASES[case]
    params = make_params(SHAPES, torch.float32, device)
    start = clone_params(params)
    opt = FusedSGD(params, lr=LR, wd_after_momentum=True, **kwargs)
    grads_per_step = []
    for step in range(STEPS):
        grads = step_grads(params, step)
        grads_per_step.append(grads)
        set_grads(params, grads)
        opt.step()
    expected, bufs = apex_sgd_reference(start, grads_per_step, LR, **kwargs)
    for i, (p, e, b) in enumerate(zip(params, expected, bufs)):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, i=i: f"params[{i}]: {m}")
        if p.numel():
            # The buffer holds only the grads: decay is added after it.
            torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), b, rtol=1e-5,
                                       atol=1e-5)


def test_wd_after_momentum_changes_the_update_only_with_momentum(device):
    for momentum, same in ((0.0, True), (0.9, False)):
        params = make_params(SHAPES, torch.float32, device)
        other = clone_params(params)
        before = FusedSGD(params, lr=LR, momentum=momentum, weight_decay=0.1)
        after = FusedSGD(other, lr=LR, momentum=momentum, weight_decay=0.1,
                         wd_after_momentum=True)
        for step in range(3):
            grads = step_grads(params, step)
            set_grads(params, grads)
            set_grads(other, grads)
            before.step()
            after.step()
        equal = all(torch.equal(p, q) for p, q in zip(params, other))
        assert equal is same, f"momentum={momentum}"


def test_apex_positional_order_and_materialize_master_grads_change_nothing():
    """apex's signature: (params, lr, momentum, dampening, weight_decay, nesterov,
    wd_after_momentum, materialize_master_grads)."""
    results = []
    for materialize in (True, False):
        params = make_params(SHAPES, torch.bfloat16, "cpu")
        opt = FusedSGD(params, 0.1, 0.9, 0.0, 1e-4, False, True, materialize,
                       master_weights=True)
        group = opt.param_groups[0]
        assert (group["wd_after_momentum"], group["materialize_master_grads"]) == (True,
                                                                                  materialize)
        for step in range(3):
            set_grads(params, step_grads(params, step))
            opt.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("key", ["wd_after_momentum", "materialize_master_grads"])
@pytest.mark.parametrize("value", [1, "true", None])
def test_apex_flags_must_be_bools(key, value):
    with raises_naming(r"param_groups\[0\]", key, "True or False"):
        FusedSGD(make_params(SHAPES[:2], torch.float32, "cpu"), lr=LR, **{key: value})


def test_apex_flags_round_trip_through_state_dict():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    opt = FusedSGD(params, lr=LR, momentum=0.9, wd_after_momentum=True)
    restored = FusedSGD(params, lr=LR, momentum=0.9)
    restored.load_state_dict(opt.state_dict())
    assert restored.param_groups[0]["wd_after_momentum"] is True


def test_lr_defaults_to_torchs():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    ref_params = clone_params(params)
    start = clone_params(params)
    opt, ref = FusedSGD(params), torch.optim.SGD(ref_params)
    assert opt.defaults["lr"] == ref.defaults["lr"] == 1e-3
    grads = step_grads(params, 0)
    set_grads(params, grads)
    set_grads(ref_params, grads)
    opt.step()
    ref.step()
    for p, q, p0 in zip(params, ref_params, start):
        assert not torch.equal(p, p0)
        # torch's CPU add may fuse the multiply-add: equal to within rounding.
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_groups_that_each_carry_lr_need_no_default():
    a, b = make_params(SHAPES[:2], torch.float32, "cpu")
    opt = FusedSGD([{"params": [a], "lr": 0.5}, {"params": [b], "lr": 0.25}], momentum=0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.25]


def test_adam_group_rejects_sgd_only_options():
    from ampfuse.optimizers import FusedAdam

    params = make_params(SHAPES[:2], torch.float32, "cpu")
    opt = FusedAdam(params[:1])
    with raises_naming(r"param_groups\[1\]", "wd_after_momentum"):
        opt.add_param_group({"params": params[1:], "wd_after_momentum": True})

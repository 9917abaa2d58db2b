"""Optimizer state is laid out like the param it belongs to.

The fused ops walk a param and its state (moments, momentum buffer, fp32 master) flat, so both
must have the same strides. A checkpoint saved from contiguous params must load into a
channels_last model, and a model switched to channels_last (or back) between steps must keep
stepping. Element-wise updates do not depend on the layout, so both runs are compared bit for
bit with one that stays contiguous throughout.
"""

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import FusedAdam, FusedSGD
from test_adam import step_grads
from test_optimizer_state import through_bytes
from tolerances import assert_close_report

CASES = {
    "adam_amsgrad": (FusedAdam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1), torch.float32),
    "sgd_momentum": (FusedSGD, dict(lr=1e-2, momentum=0.9, nesterov=True), torch.float32),
    "adam_bf16_masters": (FusedAdam, dict(lr=1e-2, master_weights=True), torch.bfloat16),
}
STEPS_BEFORE, STEPS_AFTER = 3, 3
CL = torch.channels_last


def make_conv_params(dtype):
    """Two 4-D weights (they take channels_last) and a bias (which stays as it is)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 3, 3, 3), (4, 8, 1, 1), (8,)]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def to_layout(params, memory_format):
    """What module.to(memory_format=...) does: the same Parameter objects get new strides."""
    for p in params:
        if p.dim() == 4:
            p.data = p.data.contiguous(memory_format=memory_format)


def train(opt, params, first, steps):
    for step in range(first, first + steps):
        for p, g in zip(params, step_grads(params, step)):
            # The grad is laid out like its param, as autograd makes it.
            p.grad = torch.empty_like(p).copy_(g)
        opt.step()


def assert_laid_out_like_params(opt, params):
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            if value.dim():
                assert value.stride() == p.stride(), f"param {i} {key}: {value.stride()}"


def assert_same_run(opt, params, ref_opt, ref_params):
    for i, (p, ref) in enumerate(zip(params, ref_params)):
        assert_close_report(p.detach(), ref.detach(), exact=True, msg=f"param {i}")
        for key, value in ref_opt.state[ref].items():
            if key == "step" and isinstance(opt, FusedSGD):
                continue  # SGD's op only asks whether a step was taken; a load sets it to 1
            assert_close_report(opt.state[p][key], value, exact=True, msg=f"param {i} {key}")


def trained(case, steps):
    """An optimizer of `case` and its contiguous params after `steps` steps."""
    cls, kwargs, dtype = CASES[case]
    params = make_conv_params(dtype)
    opt = cls(params, **kwargs)
    train(opt, params, 0, steps)
    return opt, params


def reference_run(case):
    return trained(case, STEPS_BEFORE + STEPS_AFTER)


@pytest.mark.parametrize("case", list(CASES))
def test_contiguous_checkpoint_loads_into_a_channels_last_model(case):
    cls, kwargs, _ = CASES[case]
    opt, params = trained(case, STEPS_BEFORE)
    saved = through_bytes(opt.state_dict())

    resumed = [p.detach().clone().requires_grad_() for p in params]
    to_layout(resumed, CL)
    resumed_opt = cls(resumed, **kwargs)
    resumed_opt.load_state_dict(saved)
    assert_laid_out_like_params(resumed_opt, resumed)
    for i, p in enumerate(resumed):  # the loaded values themselves are kept exactly
        for key, value in saved["state"][i].items():
            if key != "step":
                assert_close_report(resumed_opt.state[p][key], value, exact=True,
                                    msg=f"param {i} {key}")

    train(resumed_opt, resumed, STEPS_BEFORE, STEPS_AFTER)
    assert resumed[0].is_contiguous(memory_format=CL)
    assert_laid_out_like_params(resumed_opt, resumed)
    assert_same_run(resumed_opt, resumed, *reference_run(case))


@pytest.mark.parametrize("case", list(CASES))
def test_state_follows_a_layout_change_between_steps(case):
    opt, params = trained(case, STEPS_BEFORE)
    live = {(i, k): v for i, p in enumerate(params) for k, v in opt.state[p].items()}
    before = {key: value.clone() for key, value in live.items()}
    saved_before = opt.state_dict()

    to_layout(params, CL)
    train(opt, params, STEPS_BEFORE, 1)
    assert_laid_out_like_params(opt, params)
    # Re-laid out in place: the state holds the same tensor objects, so references kept
    # elsewhere (a state_dict() taken earlier, amp's masters) still see the live state.
    for (i, key), value in live.items():
        assert opt.state[params[i]][key] is value
    assert saved_before["state"][0]["exp_avg" if "adam" in case else "momentum_buffer"] is (
        opt.state[params[0]]["exp_avg" if "adam" in case else "momentum_buffer"])

    train(opt, params, STEPS_BEFORE + 1, STEPS_AFTER - 1)
    assert_same_run(opt, params, *reference_run(case))
    assert any(not torch.equal(before[key], value) for key, value in live.items())

    # ... and back to contiguous.
    to_layout(params, torch.contiguous_format)
    train(opt, params, 0, 1)
    assert_laid_out_like_params(opt, params)


def test_relayout_keeps_values_exactly():
    """The re-layout alone changes no value of any state tensor (masters included)."""
    params = make_conv_params(torch.bfloat16)
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    train(opt, params, 0, 2)
    state = opt.state[params[0]]
    before = {key: value.clone() for key, value in state.items()}
    to_layout(params, CL)
    opt._match_layout(0, 0, params[0], state, opt._record(params[0]))
    assert state.keys() == before.keys()
    for key, value in state.items():
        assert_close_report(value, before[key], exact=True, msg=key)
    assert state["exp_avg"].is_contiguous(memory_format=CL)
    assert state["master_param"].is_contiguous(memory_format=CL)

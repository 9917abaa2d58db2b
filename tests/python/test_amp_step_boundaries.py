"""What one optimizer step leaves for the next, found by running apex's own amp tests
(tests/L0/run_amp: test_multiple_models_optimizers_losses, test_fused_sgd) on the alias.

- O2 with a torch.optim optimizer: the fp32 master grads serve one step. apex cleared them
  after it; a user who zeroes grads through the model (model.zero_grad()) never reaches them,
  so a param with no grad next step was stepped again with the old grad, and a grad that first
  appeared in a later scale_loss of the step was added to the old one.
- Fused optimizers with one loss scaler keep grads scaled and accumulating until their step,
  so an inf from an earlier scale_loss of the step is seen again by a later call's check. apex
  checked only the incoming grads: an optimizer that already overflowed skips alone, the other
  optimizers of the later call step when their grads are clean, and the scale backs off once.
"""

import pytest
import torch
from torch import nn

from ampfuse import amp
from ampfuse.optimizers import FusedAdam, FusedSGD


def two_layers(dtype):
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=dtype,
                                      loss_scale=1.0, verbosity=0)
    return model, optimizer, torch.randn(2, 4, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o2_master_grads_do_not_outlive_the_step(dtype):
    model, optimizer, x = two_layers(dtype)
    with amp.scale_loss(model["a"](x).float().sum() + model["b"](x).float().sum(),
                        optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert all(m.grad is None for m in amp.master_params(optimizer))

    # Next step: layer b gets no grad, and the grads are zeroed through the model.
    b_before = model["b"].weight.detach().clone()
    model.zero_grad()
    with amp.scale_loss(model["a"](x).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert torch.equal(model["b"].weight.detach(), b_before), "an unused layer moved"


def test_o2_grad_first_seen_in_a_later_loss_is_not_added_to_the_last_step():
    model, optimizer, x = two_layers(torch.bfloat16)
    with amp.scale_loss(model["b"](x).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    model.zero_grad()
    with amp.scale_loss(model["a"](x).float().sum(), optimizer) as scaled:
        scaled.backward()
    loss = model["b"](x).float().pow(2).sum()
    expected = torch.autograd.grad(loss, model["b"].weight, retain_graph=True)[0].float()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    masters = list(amp.master_params(optimizer))
    master_b = masters[2]  # a.weight, a.bias, b.weight, b.bias
    assert torch.equal(master_b.grad, expected)


def two_models_two_fused_optimizers(cls):
    """apex's test_fused_sgd set-up: two models, an optimizer each, one dynamic loss scaler.
    Returns the models, optimizers, the scale and an input."""
    torch.manual_seed(0)
    m0, m1 = nn.Linear(3, 1), nn.Linear(3, 1)
    o0, o1 = cls(m0.parameters(), lr=0.1), cls(m1.parameters(), lr=0.1)
    [m0, m1], [o0, o1] = amp.initialize([m0, m1], [o0, o1], opt_level="O1",
                                        dtype=torch.bfloat16, loss_scale="dynamic",
                                        verbosity=0)
    return m0, m1, o0, o1, amp._amp_state.loss_scalers[0].loss_scale(), torch.randn(4, 3)


def first_loss_overflows(m0, o0, x):
    with amp.scale_loss(m0(x).sum(), o0) as scaled:
        scaled.backward()
        m0.weight.grad[0, 0] = float("inf")


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
def test_fused_optimizer_that_overflowed_earlier_does_not_skip_the_others(cls):
    m0, m1, o0, o1, scale_before, x = two_models_two_fused_optimizers(cls)
    m0_before, m1_before = m0.weight.detach().clone(), m1.weight.detach().clone()
    first_loss_overflows(m0, o0, x)
    with amp.scale_loss(m0(x).sum() + m1(x).sum(), [o0, o1]) as scaled:
        scaled.backward()
    o0.step()
    o1.step()
    assert torch.equal(m0.weight.detach(), m0_before), "the overflowing optimizer stepped"
    assert not torch.equal(m1.weight.detach(), m1_before), "the clean optimizer was skipped"
    assert amp._amp_state.loss_scalers[0].loss_scale() == scale_before / 2  # backed off once
    assert o0.get_skipped_steps() == 1 and o1.get_skipped_steps() == 0


def test_a_new_overflow_in_a_later_call_still_skips_every_optimizer_of_that_call():
    m0, m1, o0, o1, scale_before, x = two_models_two_fused_optimizers(FusedSGD)
    before = [m.weight.detach().clone() for m in (m0, m1)]
    first_loss_overflows(m0, o0, x)
    with amp.scale_loss(m0(x).sum() + m1(x).sum(), [o0, o1]) as scaled:
        scaled.backward()
        m1.weight.grad[0, 1] = float("nan")
    o0.step()
    o1.step()
    for m, b in zip((m0, m1), before):
        assert torch.equal(m.weight.detach(), b)
    assert amp._amp_state.loss_scalers[0].loss_scale() == scale_before / 4  # two overflows


def test_apex_pre_1_0_init_names_initialize():
    with pytest.raises(RuntimeError, match=r"amp\.initialize\(model, optimizer"):
        amp.init(enabled=True)

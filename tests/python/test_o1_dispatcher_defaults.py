"""Loss-scale defaults by dtype (issue 14): bf16 trains unscaled at O1 and O2 (scale 1.0, as torch
and DeepSpeed recommend for bf16) while a step with inf/nan gradients is still skipped; fp16
keeps the dynamic scale; an explicit loss_scale wins either way."""

import pytest
import torch
import torch.nn.functional as F
from amp_models import make_model, make_optimizer
from ampfuse import amp


def scale_of(optimizer):
    return amp.state_dict(optimizer)["loss_scaler0"]["scale"]


def initialize(opt_level, dtype, optimizer_name="FusedAdam", **options):
    model, batches = make_model("mlp", seed=0)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, dtype=dtype,
                                      verbosity=0, **options)
    return model, optimizer, batches


def step(model, optimizer, batches, i, poison=False):
    inputs, targets = batches(i)
    loss = F.cross_entropy(model(inputs), targets)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        if poison:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("optimizer_name", ["FusedAdam", "SGD"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_bf16_is_unscaled_and_still_skips_a_bad_step(opt_level, optimizer_name):
    model, optimizer, batches = initialize(opt_level, torch.bfloat16, optimizer_name)
    assert scale_of(optimizer) == 1.0
    step(model, optimizer, batches, 0)
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()}
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    step(model, optimizer, batches, 1, poison=True)
    assert amp.skipped_steps(optimizer) == 1
    for name, value in model.state_dict(keep_vars=True).items():
        assert torch.equal(value, before[name]), f"{name} changed on a skipped step"
    for master, kept in zip(amp.master_params(optimizer), masters):
        assert torch.equal(master, kept)
    step(model, optimizer, batches, 2)
    assert scale_of(optimizer) == 1.0  # static: a skip does not move it


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp16_keeps_the_dynamic_scale(opt_level):
    model, optimizer, batches = initialize(opt_level, torch.float16)
    assert scale_of(optimizer) == 2.0**16
    step(model, optimizer, batches, 0, poison=True)
    assert scale_of(optimizer) == 2.0**15


@pytest.mark.parametrize("loss_scale, expected", [("dynamic", 2.0**16), (128.0, 128.0)])
def test_an_explicit_loss_scale_wins_over_the_bf16_default(loss_scale, expected):
    _, optimizer, _ = initialize("O2", torch.bfloat16, loss_scale=loss_scale)
    assert scale_of(optimizer) == expected


def test_levels_without_scaling_stay_at_one():
    for opt_level in ("O0", "O3"):
        _, optimizer, _ = initialize(opt_level, torch.float16)
        assert scale_of(optimizer) == 1.0

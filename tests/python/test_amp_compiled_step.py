"""A whole apex-style training step (forward, amp.scale_loss, backward, clipping over
amp.master_params, optimizer.step) under torch.compile trains as the eager step does.

amp's bookkeeping around the backward and the step sets and deletes attributes of the
optimizer, which Dynamo cannot trace on an optimizer reached through amp's objects (torch 2.11
raised an AssertionError from inside Dynamo); it runs outside Dynamo, one graph break per call.
With an ampfuse fused optimizer the compiled run is the eager run bit for bit, an overflowing
step skipped in both. torch.optim's own steps round differently when compiled (torch's eager
and compiled AdamW differ without amp too), so those are compared to a tolerance."""

import pytest
import torch
import torch.nn.functional as F

from ampfuse import amp
from amp_models import make_model, make_optimizer

STEPS = 5
OVERFLOW_STEP = 2


def _train(compiled, level, optimizer_name, dtype, clip=False, num_losses=1):
    model, batches = make_model("mlp")
    optimizer = make_optimizer(optimizer_name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, dtype=dtype,
                                      loss_scale="dynamic", num_losses=num_losses, verbosity=0)

    def step(inputs, targets, factor):
        logits = model(inputs).float()
        losses = [F.cross_entropy(logits, targets) * factor, logits.square().mean()]
        optimizer.zero_grad()
        for loss_id in range(num_losses):
            with amp.scale_loss(losses[loss_id], optimizer, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id + 1 < num_losses)
        if clip:
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.5)
        optimizer.step()
        return losses[0].detach()

    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="aot_eager")
    losses = []
    for s in range(STEPS):
        inputs, targets = batches(s)
        factor = torch.tensor(float("inf") if s == OVERFLOW_STEP else 1.0)
        losses.append(float(step(inputs, targets, factor)))
    params = [p.detach().float().clone() for p in model.parameters()]
    return losses, params, amp.skipped_steps(optimizer)


CASES = {
    "O1-fp16-FusedAdam": ("O1", "FusedAdam", torch.float16, False, 1),
    "O2-fp16-FusedAdam-clip": ("O2", "FusedAdam", torch.float16, True, 1),
    "O2-bf16-FusedSGD-two-losses": ("O2", "FusedSGD", torch.bfloat16, False, 2),
    "O3-bf16-FusedAdam-clip": ("O3", "FusedAdam", torch.bfloat16, True, 1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_compiled_step_with_a_fused_optimizer_is_the_eager_step(case):
    level, name, dtype, clip, num_losses = case
    eager = _train(False, level, name, dtype, clip, num_losses)
    compiled = _train(True, level, name, dtype, clip, num_losses)
    assert compiled[0] == eager[0], "losses"
    for i, (c, e) in enumerate(zip(compiled[1], eager[1])):
        assert torch.equal(c, e), f"param {i}"
    assert compiled[2] == eager[2] == 1  # the overflowing step, skipped in both


def test_compiled_step_with_a_torch_optimizer_tracks_the_eager_step():
    """amp's fp32 masters for torch.optim.SGD at O2: the same skips, params within the rounding
    that compiling torch's own SGD step brings."""
    eager = _train(False, "O2", "SGD", torch.float16, clip=True)
    compiled = _train(True, "O2", "SGD", torch.float16, clip=True)
    assert compiled[2] == eager[2] == 1
    torch.testing.assert_close(torch.tensor(compiled[0][:OVERFLOW_STEP]),
                               torch.tensor(eager[0][:OVERFLOW_STEP]), rtol=1e-6, atol=0)
    for c, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5)

"""ampfuse.GradScaler in a torch.compile'd training step (autocast, scale, backward, unscale_ and
clipping, step, update) trains as the eager step does, as torch's GradScaler does.

With unscale_() and clipping before step(), setting grad_scale/found_inf on a fused optimizer
inside the compiled frame raised an AssertionError from Dynamo (torch 2.11); the scaler's fused
step now runs outside Dynamo, one graph break."""

import pytest
import torch
import torch.nn.functional as F

import ampfuse
from ampfuse.optimizers import FusedAdamW, FusedSGD

STEPS = 5
OVERFLOW_STEP = 2

OPTIMIZERS = {
    "FusedAdamW": lambda params: FusedAdamW(params, lr=1e-2),
    "FusedSGD": lambda params: FusedSGD(params, lr=1e-2, momentum=0.9),
    "torch AdamW fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
}


def _train(compiled, optimizer_name, clip, dtype=torch.float16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**8)

    def step(inputs, targets, factor):
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(inputs).float(), targets) * factor
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    losses = []
    for s in range(STEPS):
        inputs = torch.randn(8, 16, generator=gen)
        targets = torch.randint(0, 4, (8,), generator=gen)
        factor = torch.tensor(float("inf") if s == OVERFLOW_STEP else 1.0)
        losses.append(float(step(inputs, targets, factor)))
    params = [p.detach().clone() for p in model.parameters()]
    return losses, params, scaler.get_scale(), scaler.get_skipped_steps()


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_compiled_step_is_the_eager_step(optimizer_name, clip):
    eager = _train(False, optimizer_name, clip)
    compiled = _train(True, optimizer_name, clip)
    assert compiled[0] == eager[0], "losses"
    for i, (c, e) in enumerate(zip(compiled[1], eager[1])):
        assert torch.equal(c, e), f"param {i}"
    assert compiled[2] == eager[2] == 2.0**7  # backed off once, for the overflowing step
    assert compiled[3] == eager[3] == 1

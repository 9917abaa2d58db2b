"""A whole O2 training step captured in one CUDA graph (issue 10): forward through the fp16
model and its fp32 LayerNorm, amp.scale_loss, backward, FusedAdam's fused unscale and step with
fp32 masters, and the dynamic loss-scale update, all on the device. Replayed for 100 steps
with new batches (one of them overflowing), it must leave what 100 eager steps leave."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampfuse import amp
from ampfuse.optimizers import FusedAdam

STEPS = 100
WARMUP = 3
OVERFLOW_STEP = 50


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))
    optimizer = FusedAdam(model.cuda().parameters(), lr=1e-3, capturable=True)
    return amp.initialize(model, optimizer, opt_level="O2", verbosity=0)


def train_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=False)  # a graph needs its grads where it left them
    loss = F.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


@pytest.mark.cuda
def test_a_captured_o2_step_replays_like_eager_steps():
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(16, 32, device="cuda", generator=gen),
                torch.randn(16, 8, device="cuda", generator=gen))
               for _ in range(WARMUP + STEPS)]
    batches[OVERFLOW_STEP][0][0, 0] = float("inf")
    graphed_model, graphed_opt = build()
    eager_model, eager_opt = build()

    static_x, static_y = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps off the capture stream, as torch asks
        for x, y in batches[:WARMUP]:
            static_x.copy_(x)
            static_y.copy_(y)
            train_step(graphed_model, graphed_opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(graphed_model, graphed_opt, static_x, static_y)

    for x, y in batches[:WARMUP]:
        train_step(eager_model, eager_opt, x, y)
    # The captured step is the graph's first replay: it has not run yet.
    for x, y in batches[WARMUP:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        train_step(eager_model, eager_opt, x, y)
    torch.cuda.synchronize()

    assert amp.skipped_steps(eager_opt) == 1  # the inf batch, and nothing else
    assert amp.skipped_steps(graphed_opt) == amp.skipped_steps(eager_opt)
    graphed_state, eager_state = graphed_opt.state_dict(), eager_opt.state_dict()
    for (name, p), q in zip(graphed_model.named_parameters(), eager_model.parameters()):
        assert torch.equal(p, q), f"{name} differs after {STEPS} replays"
    for i, state in graphed_state["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, eager_state["state"][i][key]), (i, key)
    assert (amp.state_dict(graphed_opt)["loss_scaler0"]["loss_scale"]
            == amp.state_dict(eager_opt)["loss_scaler0"]["loss_scale"])

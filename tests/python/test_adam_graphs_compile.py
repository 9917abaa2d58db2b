"""FusedAdam across devices and compilers: params on two GPUs in one group, CUDA graph capture
(capturable) replayed bit for bit, and torch.compile of the step on CPU and CUDA. The helpers
and the torch reference are test_adam.py's."""


import pytest
import torch

from ampfuse.optimizers import FusedAdam, FusedAdamW
from helpers import dtype_id, make_generator
from test_adam import (SHAPES, assert_parity, clone_params, make_pair, make_params, run_both,
                       set_grads, step_grads)
from tolerances import assert_close_report


@pytest.mark.cuda
def test_params_on_two_devices_in_one_group():
    params = make_params(SHAPES, torch.float32, "cpu")
    params[1::2] = [p.detach().cuda().requires_grad_() for p in params[1::2]]
    ref_params = clone_params(params)
    fused, ref = make_pair("adamw_amsgrad", params, ref_params)
    run_both(fused, ref, params, ref_params, 30)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}] on {p.device}")
        assert fused.state[p]["step"].device == p.device
    assert len({id(fused.state[p]["step"]) for p in params}) == 2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_cuda_graph_capture(dtype):
    """Capture one step with capturable=True and replay it: bit-identical to eager steps, with a
    tensor lr changed in place between replays and a skipped step (found_inf) in between."""
    params = make_params(SHAPES, dtype, "cuda")
    eager_params = clone_params(params)
    lr = torch.full((), 1e-2, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    graphed = FusedAdamW(params, lr=lr, master_weights=True, capturable=True)
    eager = FusedAdamW(eager_params, lr=1e-2, master_weights=True)
    static_grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static_grads):
        p.grad = g

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(3):
            for g, new in zip(static_grads, step_grads(params, step)):
                g.copy_(new)
            graphed.step(found_inf=found_inf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step(found_inf=found_inf)

    for step in range(3):
        set_grads(eager_params, step_grads(params, step))
        eager.step()
    for step in range(3, 20):
        new_lr = 1e-2 * 0.9 ** step
        skip = step == 10
        for g, new in zip(static_grads, step_grads(params, step)):
            g.copy_(new)
        lr.fill_(new_lr)
        found_inf.fill_(1.0 if skip else 0.0)
        graph.replay()
        if not skip:
            eager.param_groups[0]["lr"] = new_lr
            set_grads(eager_params, step_grads(params, step))
            eager.step()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(params, eager_params)):
        assert_close_report(p.detach(), q.detach(), exact=True, msg=f"graphed params[{i}]")
    assert float(graphed.state[params[0]]["step"]) == 19


@pytest.mark.cuda
def test_cuda_graph_capture_needs_capturable():
    params = make_params(SHAPES[:2], torch.float32, "cuda")
    opt = FusedAdam(params)
    set_grads(params, step_grads(params, 0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    with pytest.raises(RuntimeError, match="capturable"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()


def compiled_training_matches_eager(device, backend, dtype):
    """A model trained with a torch.compile(fullgraph=True) optimizer step (forward and backward
    eager) matches the same model trained with eager steps, bit for bit."""
    # Each call compiles the same code object anew (new optimizers): without a reset the cases
    # of a full run add up to Dynamo's recompile limit, past which fullgraph=True raises.
    torch._dynamo.reset()
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                          torch.nn.Linear(32, 4)).to(device, dtype))
    opts = [FusedAdamW(m.parameters(), lr=1e-2, master_weights=True) for m in models]

    @torch.compile(backend=backend, fullgraph=True)
    def compiled_step():
        opts[0].step()

    gen = make_generator(3)
    for _ in range(6):
        x = torch.randn(8, 16, generator=gen).to(device, dtype)
        for model, opt, step in zip(models, opts, (compiled_step, opts[1].step)):
            opt.zero_grad()
            model(x).float().square().mean().backward()
            step()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert_close_report(p.detach(), q.detach(), exact=True, msg=f"compiled {name}")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_traces_without_graph_breaks_cpu(backend):
    compiled_training_matches_eager("cpu", backend, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_compiled_step_cuda(dtype):
    compiled_training_matches_eager("cuda", "inductor", dtype)

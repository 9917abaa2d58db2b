"""ampfuse.optimizers.FusedSGD against torch.optim.SGD: 100-step parity (max relative difference
1e-5), fp32 master weights, skipped steps bit-identical, GradScaler, groups, and bad input.
Helpers come from test_adam.py."""

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import FusedSGD
from helpers import dtype_id, raises_naming, torch_scaler_class
from test_adam import (
    LOW_DTYPES,
    SHAPES,
    STEPS,
    assert_parity,
    assert_rounded,
    assert_unchanged,
    clone_params,
    make_params,
    run_both,
    scaler_training,
    set_grads,
    snapshot,
    step_grads,
)
from tolerances import assert_close_report

SGD_CASES = {
    "plain": dict(),
    "momentum": dict(momentum=0.9),
    "dampening": dict(momentum=0.9, dampening=0.3),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "weight_decay": dict(weight_decay=0.05),
    "momentum_weight_decay": dict(momentum=0.8, weight_decay=0.05, dampening=0.1),
    "nesterov_weight_decay_maximize": dict(momentum=0.9, nesterov=True, weight_decay=0.05,
                                           maximize=True),
    "maximize": dict(momentum=0.5, maximize=True),
}
LR = 1e-2


def assert_buffers_match(fused, ref, params, ref_params):
    for i, (p, q) in enumerate(zip(params, ref_params)):
        buf = fused.state[p].get("momentum_buffer")
        expected = ref.state[q].get("momentum_buffer") if q in ref.state else None
        assert (buf is None) == (expected is None), f"params[{i}] momentum_buffer presence"
        if buf is not None:
            assert buf.dtype == torch.float32
            assert_parity(buf, expected, f"params[{i}] momentum_buffer")


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_fp32_parity_with_torch(device, case):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    fused = FusedSGD(params, lr=LR, **SGD_CASES[case])
    ref = torch.optim.SGD(ref_params, lr=LR, **SGD_CASES[case])
    run_both(fused, ref, params, ref_params, STEPS)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"{case}: params[{i}] after {STEPS} steps")
    assert_buffers_match(fused, ref, params, ref_params)


@pytest.mark.parametrize("case", ["momentum", "nesterov_weight_decay_maximize", "dampening"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_master_weights_follow_fp32_torch(device, dtype, case):
    params = make_params(SHAPES, dtype, device)
    ref_params = clone_params(params, torch.float32)
    fused = FusedSGD(params, lr=LR, master_weights=True, **SGD_CASES[case])
    ref = torch.optim.SGD(ref_params, lr=LR, **SGD_CASES[case])

    def check(step):
        masters = [fused.state[p]["master_param"] for p in params]
        assert_rounded(params, masters)
        if step % 10 == 9:
            for i, (m, q) in enumerate(zip(masters, ref_params)):
                assert_parity(m, q, f"{dtype_id(dtype)} {case}: master {i} after {step + 1} steps")

    run_both(fused, ref, params, ref_params, STEPS, after_step=check)
    assert_buffers_match(fused, ref, params, ref_params)


def test_master_weights_without_momentum_keep_only_masters(device):
    params = make_params(SHAPES, (torch.bfloat16, torch.float32), device)
    opt = FusedSGD(params, lr=LR, master_weights=True)
    set_grads(params, step_grads(params, 0))
    opt.step()
    for p in params:
        assert "momentum_buffer" not in opt.state[p]
        assert ("master_param" in opt.state[p]) == (p.dtype == torch.bfloat16)


def test_mixed_dtypes_and_groups_with_scheduler(device):
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    params = make_params(SHAPES, dtypes, device)
    ref_params = clone_params(params, torch.float32)

    def groups(ps):
        return [{"params": ps[:3], "momentum": 0.9},
                {"params": ps[3:], "lr": 3e-2, "weight_decay": 0.01}]

    fused = FusedSGD(groups(params), lr=LR, master_weights=True)
    ref = torch.optim.SGD(groups(ref_params), lr=LR)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5) for o in (fused, ref)]
    def advance(step):
        for scheduler in schedulers:
            scheduler.step()

    run_both(fused, ref, params, ref_params, 40, after_step=advance)
    for i, (m, q) in enumerate(zip(fused.master_params(), ref_params)):
        assert_parity(m, q, f"params[{i}] ({dtype_id(params[i].dtype)})")
    assert_rounded(params, fused.master_params())


def test_params_without_grad_are_skipped_like_torch(device):
    """params[1] misses every third step (its momentum must not decay meanwhile) and params[3]
    gets its first grad at step 5 (its buffer is seeded from that grad, without dampening)."""
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    kwargs = SGD_CASES["momentum_weight_decay"]
    fused = FusedSGD(params, lr=LR, **kwargs)
    ref = torch.optim.SGD(ref_params, lr=LR, **kwargs)

    def grads_for(step, ps):
        grads = step_grads(ps, step)
        if step % 3 == 0:
            grads[1] = None
        if step < 5:
            grads[3] = None
        return grads

    run_both(fused, ref, params, ref_params, 30, grads_for=grads_for)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}]")
    assert_buffers_match(fused, ref, params, ref_params)


def test_momentum_switched_on_later_seeds_the_buffer(device):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    fused = FusedSGD(params, lr=LR, dampening=0.5)
    ref = torch.optim.SGD(ref_params, lr=LR, dampening=0.5)

    def switch(step):
        if step == 4:
            for opt in (fused, ref):
                opt.param_groups[0]["momentum"] = 0.9

    run_both(fused, ref, params, ref_params, 15, after_step=switch)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}]")
    assert_buffers_match(fused, ref, params, ref_params)


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW_DTYPES, ids=dtype_id)
def test_found_inf_kwarg_skips_everything(device, dtype):
    """Skipping the first step also keeps it the first: the buffer is seeded by the next one."""
    skipped = {0, 1, 8, 14}
    params = make_params(SHAPES, dtype, device)
    ref_params = clone_params(params, torch.float32)
    kwargs = SGD_CASES["momentum_weight_decay"]
    fused = FusedSGD(params, lr=LR, master_weights=True, **kwargs)
    ref = torch.optim.SGD(ref_params, lr=LR, **kwargs)
    found_inf = torch.zeros((), device=device)
    for step in range(15):
        grads = step_grads(params, step)
        set_grads(params, grads)
        if step in skipped:
            before = snapshot(fused, params)
            fused.step(found_inf=found_inf.fill_(float("nan") if step == 8 else 1.0))
            assert_unchanged(fused, params, before, f"skipped step {step}")
            continue
        fused.step(found_inf=found_inf.fill_(0.0))
        set_grads(ref_params, grads)
        ref.step()
    for i, (m, q) in enumerate(zip(fused.master_params(), ref_params)):
        assert_parity(m, q, f"params[{i}]")
    assert_buffers_match(fused, ref, params, ref_params)


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW_DTYPES, ids=dtype_id)
def test_grad_scale_kwarg_divides_the_grads(device, dtype):
    params = make_params(SHAPES, dtype, device)
    plain_params = clone_params(params)
    kwargs = SGD_CASES["nesterov"]
    scaled = FusedSGD(params, lr=LR, master_weights=True, **kwargs)
    plain = FusedSGD(plain_params, lr=LR, master_weights=True, **kwargs)
    for step in range(10):
        grads = step_grads(params, step)
        set_grads(params, [g * 512 for g in grads])
        set_grads(plain_params, grads)
        scaled.step(grad_scale=512.0)
        plain.step()
    for p, q in zip(params, plain_params):
        assert_close_report(p.detach(), q.detach(), exact=True, msg="scaled vs unscaled grads")


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW_DTYPES, ids=dtype_id)
def test_grad_scaler_drives_the_optimizer(device, dtype):
    poison = {0: float("nan"), 5: float("inf"), 9: float("nan")}
    params = make_params(SHAPES[:4], dtype, device)
    ref_params = clone_params(params, torch.float32)
    kwargs = SGD_CASES["momentum"]
    fused = FusedSGD(params, lr=LR, master_weights=True, **kwargs)
    ref = torch.optim.SGD(ref_params, lr=LR, **kwargs)
    scaler = torch_scaler_class(device, dtype)(device, init_scale=1024.0, growth_interval=1000)
    for step, skipped in scaler_training(fused, params, 10, poison, scaler):
        if not skipped:
            set_grads(ref_params, [g.float() for g in step_grads(params, step)])
            ref.step()
    for i, (m, q) in enumerate(zip(fused.master_params(), ref_params)):
        assert_parity(m, q, f"params[{i}]")
    assert_buffers_match(fused, ref, params, ref_params)


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad(set_grad_none):
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    opt = FusedSGD(params, lr=LR, set_grad_none=set_grad_none)
    set_grads(params, step_grads(params, 0))
    opt.zero_grad()
    assert all((p.grad is None) == set_grad_none for p in params)
    assert all(p.grad is None or not p.grad.any() for p in params)


@pytest.mark.cuda
def test_cuda_graph_capture():
    params = make_params(SHAPES, torch.bfloat16, "cuda")
    eager_params = clone_params(params)
    kwargs = SGD_CASES["nesterov"]
    graphed = FusedSGD(params, lr=LR, master_weights=True, **kwargs)
    eager = FusedSGD(eager_params, lr=LR, master_weights=True, **kwargs)
    static_grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static_grads):
        p.grad = g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(2):
            for g, new in zip(static_grads, step_grads(params, step)):
                g.copy_(new)
            graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for step in range(12):
        set_grads(eager_params, step_grads(params, step))
        eager.step()
        if step >= 2:
            for g, new in zip(static_grads, step_grads(params, step)):
                g.copy_(new)
            graph.replay()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(params, eager_params)):
        assert_close_report(p.detach(), q.detach(), exact=True, msg=f"graphed params[{i}]")


# ---- bad input ---------------------------------------------------------------------------------

BAD_HYPERPARAMETERS = {
    "negative_lr": (dict(lr=-0.1), "lr"),
    "negative_momentum": (dict(lr=0.1, momentum=-0.9), "momentum"),
    "negative_weight_decay": (dict(lr=0.1, weight_decay=-1e-4), "weight_decay"),
    "nesterov_without_momentum": (dict(lr=0.1, nesterov=True), "[Nn]esterov"),
    "nesterov_with_dampening": (dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
                                "dampening"),
}


@pytest.mark.parametrize("case", list(BAD_HYPERPARAMETERS))
def test_bad_hyperparameters_fail_at_construction(case):
    kwargs, what = BAD_HYPERPARAMETERS[case]
    with raises_naming(r"param_groups\[0\]", what):
        FusedSGD(make_params(SHAPES[:2], torch.float32, "cpu"), **kwargs)


@pytest.mark.parametrize("key, value", [("amsgrad", True), ("betas", (0.9, 0.99)), ("eps", 1e-8)])
def test_adam_hyperparameters_in_an_sgd_group_are_rejected(key, value):
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    opt = FusedSGD(params[:2], lr=LR)
    with raises_naming(r"param_groups\[1\]", key):
        opt.add_param_group({"params": params[2:], key: value})
    assert len(opt.param_groups) == 1


def test_adam_arguments_are_not_accepted():
    with pytest.raises(TypeError):
        FusedSGD(make_params(SHAPES[:2], torch.float32, "cpu"), lr=LR, amsgrad=True)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.int32, torch.float64],
                         ids=["complex128", "int32", "float64"])
def test_unsupported_param_dtype_is_named(dtype):
    params = make_params(SHAPES[:4], torch.float32, "cpu")
    params[3] = torch.ones(3, dtype=dtype)
    with raises_naming(r"param_groups\[0\]\['params'\]\[3\]", str(dtype)):
        FusedSGD(params, lr=LR)


def test_sparse_grad_of_a_low_precision_param_is_named_at_step():
    # Sparse grads of fp32 params are stepped (test_sparse_grads.py); of others, refused before
    # any param of the step is written.
    params = make_params(SHAPES[:3], torch.bfloat16, "cpu")
    opt = FusedSGD([{"params": params[:1]}, {"params": params[1:]}], lr=LR, momentum=0.9)
    set_grads(params, step_grads(params, 0))
    params[2].grad = params[2].grad.to_sparse()
    before = [p.detach().clone() for p in params]
    with raises_naming(r"param_groups\[1\]\['params'\]\[1\]", "sparse", "bfloat16"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_buffer_written_into_state_directly_is_continued(nesterov):
    """ZeroRedundancyOptimizer.load_state_dict (and checkpoint converters) set
    optimizer.state[p] = {"momentum_buffer": ...} directly, with no step count (torch's SGD keeps
    none). The step must continue from that buffer, as torch's does, not seed it from the grad
    as on a first step."""
    results = []
    for cls in (torch.optim.SGD, FusedSGD):
        param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        opt = cls([param], lr=0.1, momentum=0.9, nesterov=nesterov)
        opt.state[param] = {"momentum_buffer": torch.tensor([1.0, 0.5, -0.25])}
        for step in range(2):
            param.grad = torch.tensor([1.0, 2.0, -1.0]) * (step + 1)
            opt.step()
        results.append((param.detach().clone(), opt.state[param]["momentum_buffer"].clone()))
    (theirs, their_buffer), (ours, our_buffer) = results
    assert_close_report(ours, theirs, rtol=1e-6, atol=1e-7, msg="param")
    assert_close_report(our_buffer, their_buffer, rtol=1e-6, atol=1e-7, msg="momentum buffer")

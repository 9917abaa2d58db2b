"""ampfuse.GradScaler against torch.amp.GradScaler.

- Parity: 200 steps of a small model with inf/nan injected into the grads at random steps give
  the same scale at every step and bit-identical params, with torch.optim optimizers (the
  unscale-then-maybe-step path) and with fused ones (ampfuse's FusedAdam and torch's fused
  AdamW: the grad_scale/found_inf path), also through unscale_() + clip_grad_norm_().
- bf16 grads (which torch's CUDA op does not take), fp16 grads (refused where torch refuses).
- state_dict both ways with torch's GradScaler, pickling, enabled=False.
- On a GPU (cuda marker): the same parity, and a fused step with no host sync.
The extended rule (hysteresis, min_scale, max_scale) is in test_grad_scaler_rule.py, what
step() hands a fused optimizer in test_grad_scaler_protocol.py, misuse errors in
test_grad_scaler_misuse.py, and the all-reduced found_inf on two gloo ranks in
test_grad_scaler_all_reduce.py, which trains with this file's model and loop.
"""

import math
import pickle
from collections import namedtuple

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.scaling.grad_scaler import GradScaler
from ampfuse.optimizers import FusedAdam, FusedSGD
from helpers import raises_naming
from tolerances import assert_close_report

STEPS = 200
GROWTH_INTERVAL = 12  # small enough for the scale to grow several times in STEPS steps
INIT_SCALE = 2.0**12


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """The tensors here are tiny: torch's intra-op thread pool only adds wake-up latency, and
    on a loaded 2-core machine that made the 200-step runs 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- a small model and a training loop that runs the same with either scaler ---------------


def make_model(device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(device=device, dtype=dtype)


def make_batches(device, steps, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 16, generator=gen).to(device, dtype),
         torch.randn(8, 4, generator=gen).to(device))
        for _ in range(steps)
    ]


def overflow_schedule(steps, rate=0.05, seed=2):
    """step -> (param index, flat element index, inf or nan) for ~rate of the steps."""
    gen = torch.Generator().manual_seed(seed)
    hits = torch.rand(steps, generator=gen) < rate
    values = (math.inf, math.nan, -math.inf)
    return {
        step: (step % 4, step * 7, values[i % 3])
        for i, step in enumerate(torch.nonzero(hits).flatten().tolist())
    }


def train(model, optimizer, scaler, batches, overflows, *, clip=None, autocast=None):
    """The usual AMP loop; returns the scale after every update()."""
    params = list(model.parameters())
    device = params[0].device.type
    scales = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        if step in overflows:
            index, element, value = overflows[step]
            grad = params[index].grad.view(-1)
            grad[element % grad.numel()] = value
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(optimizer)
        assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2),
    "ampfuse_fused_adam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=1e-2),
    "ampfuse_fused_sgd": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    "torch_fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}


def autocast_dtype(device):
    return torch.bfloat16 if device == "cpu" else torch.float16


def run_pair(device, make_optimizer, steps=STEPS, overflows=None, dtype=torch.float32,
             clip=None, autocast=None, **extra):
    """The same run under torch.amp.GradScaler and ampfuse.GradScaler."""
    overflows = overflow_schedule(steps) if overflows is None else overflows
    batches = make_batches(device, steps, dtype)
    runs = []
    for scaler_class in (torch.amp.GradScaler, GradScaler):
        model = make_model(device, dtype)
        optimizer = make_optimizer(list(model.parameters()))
        kwargs = extra if scaler_class is GradScaler else {}
        scaler = scaler_class(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                              **kwargs)
        scales = train(model, optimizer, scaler, batches, overflows, clip=clip,
                       autocast=autocast)
        runs.append((scales, list(model.parameters()), scaler))
    return runs


def assert_same_run(torch_run, ours_run):
    (torch_scales, torch_params, torch_scaler), (scales, params, scaler) = torch_run, ours_run
    assert scales == torch_scales
    for i, (p, q) in enumerate(zip(params, torch_params)):
        assert_close_report(p.detach(), q.detach(), exact=True, msg=f"params[{i}]")
    theirs = torch_scaler.state_dict()
    ours = scaler.state_dict()
    assert {k: ours[k] for k in theirs} == theirs


# ---- parity with torch.amp.GradScaler -------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parity_with_torch(device, name):
    """Same scales and bit-identical params over 200 steps with ~5% overflowing steps."""
    overflows = overflow_schedule(STEPS)
    assert len(overflows) >= 5
    torch_run, ours_run = run_pair(device, OPTIMIZERS[name], overflows=overflows,
                                   autocast=autocast_dtype(device))
    assert_same_run(torch_run, ours_run)
    scales = ours_run[0]
    # The run exercised both directions of the rule.
    assert min(scales) < INIT_SCALE < max(scales)


@pytest.mark.parametrize("name", ["sgd", "ampfuse_fused_adam", "torch_fused_adamw"])
def test_unscale_clip_step_parity(device, name):
    """torch's documented pattern: unscale_(), clip_grad_norm_() on the true grads, step()."""
    torch_run, ours_run = run_pair(device, OPTIMIZERS[name], steps=60, clip=0.05)
    assert_same_run(torch_run, ours_run)


def test_two_optimizers_parity(device):
    """One scaler for two optimizers (one fused, one not): update() backs off when either
    overflowed, and each step() skips only on its own optimizer's grads."""
    overflows = overflow_schedule(80, rate=0.1, seed=5)
    batches = make_batches(device, 80)
    results = []
    for scaler_class in (torch.amp.GradScaler, GradScaler):
        model = make_model(device)
        first = torch.optim.SGD(model[0].parameters(), lr=1e-2)
        second = FusedAdam(model[2].parameters(), lr=1e-3)
        scaler = scaler_class(device, init_scale=INIT_SCALE, growth_interval=5)
        params = list(model.parameters())
        scales = []
        for step, (x, y) in enumerate(batches):
            for opt in (first, second):
                opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step in overflows:
                index, element, value = overflows[step]
                params[index].grad.view(-1)[element % params[index].numel()] = value
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append((scales, params))
    (torch_scales, torch_params), (scales, params) = results
    assert scales == torch_scales
    for i, (p, q) in enumerate(zip(params, torch_params)):
        assert_close_report(p.detach(), q.detach(), exact=True, msg=f"params[{i}]")


def test_fp16_params_through_a_fused_optimizer(device):
    """fp16 params and grads: no in-place unscale, FusedAdam with fp32 masters takes the scale;
    the same as under torch's scaler, and overflowing steps write nothing."""
    overflows = {3: (0, 1, math.inf), 9: (2, 5, math.nan)}
    torch_run, ours_run = run_pair(
        device, lambda ps: FusedAdam(ps, lr=1e-3, master_weights=True), steps=20,
        overflows=overflows, dtype=torch.float16,
    )
    assert_same_run(torch_run, ours_run)


# ---- dtypes ---------------------------------------------------------------------------------


def test_bf16_and_mixed_grads_unscale_exactly(device):
    """bf16 and fp32 grads of one optimizer are unscaled in one pass, exactly (power-of-two
    scale); an inf in the bf16 grad is flagged."""
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.nn.Parameter(torch.randn(1000, generator=gen).to(device, torch.bfloat16)),
        torch.nn.Parameter(torch.randn(37, generator=gen).to(device)),
    ]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler(device, init_scale=2.0**14)
    for overflow in (False, True):
        loss = sum((p.float() * torch.arange(p.numel(), device=device)).sum() for p in params)
        for p in params:
            p.grad = None
        scaler.scale(loss).backward()
        if overflow:
            params[0].grad[500] = math.inf
        scaled = [p.grad.clone() for p in params]
        scale = scaler.get_scale()
        scaler.unscale_(opt)
        found = sum(float(f) for f in scaler._found_inf_per_device(opt).values())
        assert found == float(overflow)
        for i, (p, g) in enumerate(zip(params, scaled)):
            expected = (g.double() / scale).to(g.dtype)
            assert_close_report(p.grad, expected, exact=True, msg=f"grads[{i}]")
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**13


def test_bf16_model_parity_with_torch_on_cpu():
    """A bf16 model (bf16 params and grads) under torch's CPU scaler and ours."""
    torch_run, ours_run = run_pair("cpu", OPTIMIZERS["sgd"], steps=60, dtype=torch.bfloat16)
    assert_same_run(torch_run, ours_run)


@pytest.mark.parametrize("explicit", [True, False], ids=["unscale_", "step"])
def test_fp16_grads_are_not_unscaled_in_place(explicit):
    """As torch: fp16 grads are refused by unscale_(), explicit or inside step() of an
    optimizer that does not take the scale itself (the message names the param)."""
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2).half())]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.ones_like(p)
    call = scaler.unscale_ if explicit else scaler.step
    with raises_naming("Attempting to unscale FP16 gradients",
                       r"param_groups\[0\]\['params'\]\[1\]", "FusedAdam"):
        call(opt)


# ---- scale() --------------------------------------------------------------------------------


def test_scale_keeps_structure_shape_and_dtype_like_torch():
    Pair = namedtuple("Pair", "a b")
    ours, theirs = GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)
    for value in (torch.tensor(1.5, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16),
                  torch.ones(2, 2)):
        a, b = ours.scale(value), theirs.scale(value)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert_close_report(a, b, exact=True)
    nested = [torch.ones(1), (torch.full((2,), 2.0), [torch.ones(())])]
    scaled = ours.scale(nested)
    assert isinstance(scaled, list) and isinstance(scaled[1], tuple)
    assert isinstance(scaled[1][1], list)
    assert float(scaled[1][0][1]) == 8.0 and float(scaled[1][1][0]) == 4.0
    pair = ours.scale(Pair(torch.ones(1), torch.ones(1)))
    assert isinstance(pair, Pair) and float(pair.b) == 4.0
    assert float(ours.scale({"loss": torch.ones(())})["loss"]) == 4.0
    lazy = ours.scale(t for t in [torch.ones(1)])
    assert [float(t) for t in lazy] == [4.0]


def test_state_is_created_on_the_first_outputs_device():
    scaler = GradScaler("cpu", init_scale=2.0)
    assert scaler._scale is None and scaler.get_scale() == 2.0
    scaler.scale(torch.ones(1))
    assert scaler._scale.device.type == "cpu" and scaler._scale.shape == ()


# ---- state_dict and pickling ----------------------------------------------------------------


def _run_some(scaler, steps, overflows, seed=0):
    model = make_model("cpu", seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train(model, opt, scaler, make_batches("cpu", steps, seed=seed), overflows)


@pytest.mark.parametrize("loaded_before_first_scale", [True, False], ids=["lazy", "live"])
def test_state_dict_torch_to_ours_and_back(loaded_before_first_scale):
    overflows = {1: (0, 0, math.inf), 5: (1, 3, math.nan)}
    later = {2: (3, 1, math.inf)}
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)
    _run_some(torch_scaler, 8, overflows)
    saved = torch_scaler.state_dict()
    assert saved["_growth_tracker"] > 0  # a mid-interval count is carried over

    ours = GradScaler("cpu", init_scale=1.0, growth_factor=4.0, growth_interval=100)
    if not loaded_before_first_scale:
        ours.scale(torch.ones(()))
    ours.load_state_dict(saved)
    assert {k: ours.state_dict()[k] for k in saved} == saved
    assert _run_some(ours, 10, later, seed=1) == _run_some(torch_scaler, 10, later, seed=1)

    # ... and ours back into a fresh torch scaler, which ignores our extra keys.
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(ours.state_dict())
    assert fresh.state_dict() == torch_scaler.state_dict()
    assert _run_some(fresh, 10, later, seed=2) == _run_some(ours, 10, later, seed=2)


def test_state_dict_keeps_our_extras_and_torch_dicts_keep_them_unchanged():
    ours = GradScaler("cpu", init_scale=2.0**10, hysteresis=3, min_scale=4.0, max_scale=2.0**12)
    _run_some(ours, 3, {0: (0, 0, math.inf)})
    saved = ours.state_dict()
    assert saved["hysteresis"] == 3 and saved["_hysteresis_tracker"] == 2
    assert (saved["min_scale"], saved["max_scale"]) == (4.0, 2.0**12)
    other = GradScaler("cpu")
    other.load_state_dict(saved)
    assert other.state_dict() == saved
    # A torch dict: our extras keep their current values, the hysteresis count restarts.
    other.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    state = other.state_dict()
    assert state["hysteresis"] == 3 and state["_hysteresis_tracker"] == 3
    assert state["scale"] == 2.0**12  # torch's 2**16, clamped to our max_scale


def test_pickle_round_trip():
    scaler = GradScaler("cpu", init_scale=2.0**10, hysteresis=2, growth_interval=3)
    _run_some(scaler, 5, {1: (0, 0, math.inf)})
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.state_dict() == scaler.state_dict()
    assert copy._scale is None  # recreated by the next scale()
    later = {1: (2, 2, math.nan)}
    assert _run_some(copy, 6, later) == _run_some(scaler, 6, later)


# ---- enabled=False --------------------------------------------------------------------------


def test_disabled_scaler_passes_everything_through():
    scaler = GradScaler("cpu", enabled=False)
    assert not scaler.is_enabled()
    loss = torch.ones((), requires_grad=True)
    outputs = [loss, (loss,)]
    assert scaler.scale(loss) is loss and scaler.scale(outputs) is outputs
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=1.0)
    param.grad = torch.tensor([1.0, math.inf])
    scaler.unscale_(opt)
    assert_close_report(param.grad, torch.tensor([1.0, math.inf]), exact=True)
    calls = []
    scaler.step(opt, closure=lambda: calls.append(1))  # stepped, inf or not; closure passed on
    assert calls == [1] and float(param.detach()[1]) == -math.inf
    scaler.update()
    scaler.update(new_scale=3.0)
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.load_state_dict({})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_scaler_without_cuda_disables_itself_with_a_warning():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler()
    assert not scaler.is_enabled()


# ---- CUDA: no host sync on the fused path ---------------------------------------------------


@pytest.mark.cuda
def test_fused_step_makes_no_host_sync():
    """scale(), backward, step() through FusedAdam and update(), an overflowing step included,
    with torch's sync debug mode set to raise on any device-to-host sync."""
    device = "cuda"
    model = make_model(device)
    opt = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    scaler = GradScaler(device, init_scale=2.0**10, growth_interval=2)
    batches = make_batches(device, 6)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    # The overflow is copied in from a device tensor: `grad[0, 0] = math.inf` would copy a
    # host scalar, itself a sync that the debug mode reports.
    inf = torch.full((), math.inf, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                out = model(x)
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
            if step == 2:
                params[0].grad[0, 0].copy_(inf)
            scaler.step(opt)
            scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # grows after steps 1 and 4 (interval 2), backs off after step 2
    assert scaler.get_scale() == 2.0**10 * 2 * 0.5 * 2
    assert scaler.get_skipped_steps() == 1
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


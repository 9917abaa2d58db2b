"""ampfuse.GradScaler against torch.amp.GradScaler.

- Parity: 200 steps of a small model with inf/nan injected into the grads at random steps give
  the same scale at every step and bit-identical params, with torch.optim optimizers (the
  unscale-then-maybe-step path) and with fused ones (ampfuse's FusedAdam and torch's fused
  AdamW: the grad_scale/found_inf path), also through unscale_() + clip_grad_norm_().
- The extended rule (hysteresis, min_scale, max_scale) step by step against plain Python.
- bf16 grads (which torch's CUDA op does not take), fp16 grads (refused where torch refuses).
- state_dict both ways with torch's GradScaler, pickling, enabled=False, misuse errors.
- Two gloo processes where only rank 1 overflows: with the flag all-reduced both ranks skip.
- On a GPU (cuda marker): the same parity, and a fused step with no host sync.
"""

import contextlib
import datetime
import math
import os
import pickle
import socket
import time
from collections import namedtuple

import pytest
import torch
import torch.multiprocessing as mp

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.grad_scaler import GradScaler
from ampfuse.optimizers import FusedAdam, FusedSGD
from helpers import raises_naming
from ranks import leave_group
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


# ---- what step() hands over to an optimizer that takes the scale itself ----------------------


class RecordingOptimizer(torch.optim.SGD):
    """Records the grad_scale and found_inf attributes its step() sees; can fail on demand."""

    _step_supports_amp_scaling = True

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen = []
        self.fail = False

    def step(self, closure=None):
        scale = getattr(self, "grad_scale", "absent")
        found_inf = getattr(self, "found_inf", "absent")
        self.seen.append(tuple(
            v if isinstance(v, str) or v is None else (tuple(v.shape), v.dtype, float(v))
            for v in (scale, found_inf)
        ))
        if self.fail:
            raise RuntimeError("step failed on purpose")
        return "stepped"


def test_fused_protocol_matches_torch():
    """READY: grad_scale is the scale, found_inf the flag (both 0-dim fp32); after unscale_():
    grad_scale is None; a grad_scale of the caller's own is multiplied in. Both attributes are
    gone afterwards. The same as torch hands over."""
    seen = []
    for scaler_class in (torch.amp.GradScaler, GradScaler):
        param = torch.nn.Parameter(torch.ones(3))
        opt = RecordingOptimizer([param])
        scaler = scaler_class("cpu", init_scale=8.0)
        for mode in ("ready", "unscaled", "own_scale", "overflow"):
            param.grad = scaler.scale(torch.full((3,), 1.0))
            if mode == "overflow":
                param.grad[1] = math.inf
            if mode == "unscaled":
                scaler.unscale_(opt)
            if mode == "own_scale":
                opt.grad_scale = torch.tensor(0.5)
            assert scaler.step(opt) == "stepped"
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            scaler.update()
        seen.append(opt.seen)
    assert seen[1] == seen[0]
    assert seen[1][0] == (((), torch.float32, 8.0), ((), torch.float32, 0.0))
    assert seen[1][1][0] is None
    assert seen[1][3][1] == ((), torch.float32, 1.0)


def test_fused_step_leaves_scaled_grads_and_cleans_up_after_a_failure():
    param = torch.nn.Parameter(torch.ones(5))
    opt = RecordingOptimizer([param])
    scaler = GradScaler("cpu", init_scale=4.0)
    param.grad = scaler.scale(torch.arange(5.0))
    opt.fail = True
    with pytest.raises(RuntimeError, match="on purpose"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    # The grads were only checked: they still carry the scale, as under torch.
    assert_close_report(param.grad, torch.arange(5.0) * 4.0, exact=True)


class LegacyOptimizer(torch.optim.SGD):
    """An optimizer of torch's older contract: step() takes the scaler itself."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        found_inf = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
        if not found_inf:
            inv = 1.0 / grad_scaler._get_scale_async().item()
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(inv)
            super().step()


def test_grad_scaler_kwarg_contract_is_honoured_with_a_warning():
    param = torch.nn.Parameter(torch.ones(2))
    opt = LegacyOptimizer([param], lr=1.0)
    scaler = GradScaler("cpu", init_scale=16.0)
    param.grad = scaler.scale(torch.ones(2))
    with pytest.warns(FutureWarning, match="grad_scaler"):
        scaler.step(opt)
    scaler.update()
    assert_close_report(param.detach(), torch.zeros(2), exact=True)


# ---- the extended rule: hysteresis, min_scale, max_scale ------------------------------------


def f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


class Rule:
    """ampfuse's scale rule in plain Python (hysteresis=1, no bounds: torch's rule)."""

    def __init__(self, scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                 min_scale, max_scale):
        self.scale, self.growth_tracker, self.hysteresis_tracker = f32(scale), 0, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.max_scale = min_scale, max_scale

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:
                return
            self.scale = max(f32(self.scale * self.backoff_factor), f32(self.min_scale))
            self.hysteresis_tracker = self.hysteresis
            return
        self.growth_tracker += 1
        if self.growth_tracker < self.growth_interval:
            return
        grown = f32(self.scale * self.growth_factor)
        if math.isfinite(grown):
            self.scale = min(grown, self.max_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis


RULE_CASES = {
    "hysteresis3": dict(hysteresis=3, min_scale=0.0, max_scale=math.inf),
    "bounds": dict(hysteresis=1, min_scale=2.0**9, max_scale=2.0**14),
    "hysteresis2_bounds": dict(hysteresis=2, min_scale=2.0**10, max_scale=2.0**13),
}
# Runs of overflows long enough to reach min_scale, runs of clean steps long enough to grow to
# max_scale, and isolated overflows that hysteresis absorbs.
RULE_PATTERN = [1, 0, 1, 1, 1, 0, 0, 1] + [1] * 9 + [0] * 20 + [1, 0, 0, 0, 1, 1] + [0] * 25


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_hysteresis_and_bounds_follow_the_rule(device, case):
    options = RULE_CASES[case]
    rule = Rule(2.0**12, 2.0, 0.5, 3, **options)
    scaler = GradScaler(device, init_scale=2.0**12, growth_interval=3, **options)
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = torch.optim.SGD([param], lr=1.0)
    reached = set()
    for step, overflow in enumerate(RULE_PATTERN):
        grad = scaler.scale(torch.full((4,), 1.0, device=device))
        if overflow:
            grad[2] = math.nan if step % 2 else math.inf
        param.grad = grad
        before = param.detach().clone()
        scaler.step(opt)
        if overflow:  # skipped whether or not hysteresis holds the scale
            assert_close_report(param.detach(), before, exact=True, msg=f"step {step}")
        scaler.update()
        rule.update(overflow)
        state = scaler.state_dict()
        assert (state["scale"], state["_growth_tracker"], state["_hysteresis_tracker"]) == (
            rule.scale, rule.growth_tracker, rule.hysteresis_tracker
        ), f"step {step}"
        reached.add(state["scale"])
    if options["min_scale"] > 0:
        assert {options["min_scale"], options["max_scale"]} <= reached
    else:
        assert 2.0**12 in reached and min(reached) < 2.0**12


def test_scale_never_leaves_the_bounds():
    scaler = GradScaler("cpu", init_scale=2.0**20, min_scale=1.0, max_scale=2.0**16)
    assert scaler.get_scale() == 2.0**16  # the initial scale is clamped too
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=0.25)
    assert scaler.get_scale() == 1.0
    scaler.update(new_scale=torch.tensor(2.0**30))
    assert scaler.get_scale() == 2.0**16
    scaler.update(new_scale=512)
    assert scaler.get_scale() == 512.0


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


# ---- misuse ---------------------------------------------------------------------------------


@pytest.fixture
def setup():
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu")
    return param, opt, scaler


def _backward(param, scaler):
    scaler.scale((param * 2).sum()).backward()


@pytest.mark.parametrize("call", ["unscale_", "step", "update"])
def test_calls_before_scale(setup, call):
    param, opt, scaler = setup
    param.grad = torch.ones(3)
    args = () if call == "update" else (opt,)
    with raises_naming(rf"{call}\(\) was called before any scale\(\)", r"scaler\.scale\(loss\)"):
        getattr(scaler, call)(*args)


def test_unscale_twice(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    scaler.unscale_(opt)
    with raises_naming(r"unscale_\(\) has already been called on this optimizer since the last "
                       r"update\(\)"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    scaler.unscale_(opt)  # allowed again after update()


def test_unscale_after_step_and_step_twice(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    scaler.step(opt)
    with raises_naming(r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    with raises_naming(r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)


def test_closures_are_refused(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    with raises_naming("Closure", r"scaler\.scale\(loss\)\.backward\(\)"):
        scaler.step(opt, closure=lambda: None)
    with raises_naming("Closure"):
        scaler.step(opt, lambda: None)


def test_update_without_any_step(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    with raises_naming(r"no gradients were checked", r"scaler\.step\(optimizer\)"):
        scaler.update()


def test_step_with_no_grads(setup):
    param, opt, scaler = setup
    scaler.scale(torch.ones(()))
    with raises_naming("none of the optimizer's params has a gradient"):
        scaler.step(opt)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(growth_factor=1.0), "growth_factor must be a finite number > 1.0"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval must be an int"),
    (dict(hysteresis=0), "hysteresis must be an int >= 1"),
    (dict(min_scale=4.0, max_scale=2.0), "need 0 <= min_scale <= max_scale"),
    (dict(init_scale=math.inf), "init_scale must be a finite number > 0"),
    (dict(init_scale=0.0), "init_scale must be a finite number > 0"),
])
def test_bad_constructor_arguments(kwargs, pattern):
    with raises_naming(pattern):
        GradScaler("cpu", **kwargs)
    GradScaler("cpu", enabled=False, **kwargs)  # not checked when disabled, as in torch


def test_init_scale_in_the_device_place_is_named():
    """torch.cuda.amp.GradScaler(65536.0) moved to torch.amp's signature (device first)."""
    with pytest.raises(TypeError, match=r"device=65536\.0 is not a device.*init_scale"):
        GradScaler(65536.0)
    with pytest.raises(TypeError, match=r"device=None"):
        GradScaler(None)


def test_bad_setters_and_new_scale(setup):
    param, opt, scaler = setup
    with raises_naming("growth_factor"):
        scaler.set_growth_factor(0.5)
    with raises_naming("backoff_factor"):
        scaler.set_backoff_factor(2.0)
    with raises_naming("growth_interval"):
        scaler.set_growth_interval(-1)
    scaler.scale(torch.ones(()))
    for bad in (torch.ones(2), torch.ones(1, requires_grad=True), "1024"):
        with raises_naming("new_scale should be a float or a one-element tensor"):
            scaler.update(new_scale=bad)


def test_bad_state_dicts(setup):
    _, _, scaler = setup
    with raises_naming("state dict is empty", "disabled"):
        scaler.load_state_dict({})
    with pytest.raises(KeyError, match="_growth_tracker"):
        scaler.load_state_dict({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 10})
    good = GradScaler("cpu").state_dict()
    with raises_naming("growth_factor"):
        scaler.load_state_dict({**good, "growth_factor": 0.5})
    assert scaler.state_dict() == good  # nothing changed by the failed loads


def test_bad_outputs_and_devices(setup):
    _, _, scaler = setup
    for bad in ("loss", 3.0, [torch.ones(1), None]):
        with raises_naming("outputs must be a Tensor"):
            scaler.scale(bad)
    with raises_naming("meta", "CPU and CUDA"):
        GradScaler("cpu").scale(torch.ones(1, device="meta"))


def test_pickling_mid_iteration_is_refused(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    scaler.step(opt)
    with raises_naming("pickled", r"after scaler\.update\(\)"):
        pickle.dumps(scaler)


def test_all_reduce_without_a_process_group(setup):
    param, opt, _ = setup
    scaler = GradScaler("cpu", all_reduce_found_inf=True)
    _backward(param, scaler)
    with raises_naming("torch.distributed is not initialized", "init_process_group"):
        scaler.step(opt)


# ---- found_inf all-reduced over a process group ---------------------------------------------

DIST_STEPS = 6
DIST_OVERFLOW_STEP = 3


def _dist_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=30))
    try:
        results = {}
        variants = {
            "sgd_default_group": (OPTIMIZERS["sgd"], dict(all_reduce_found_inf=True)),
            "fused_adam_group": (OPTIMIZERS["ampfuse_fused_adam"],
                                 dict(process_group=dist.new_group([0, 1]))),
            "sgd_not_reduced": (OPTIMIZERS["sgd"], {}),
        }
        batches = make_batches("cpu", DIST_STEPS)  # the same data on both ranks
        for name, (make_optimizer, extra) in variants.items():
            model = make_model("cpu")
            opt = make_optimizer(list(model.parameters()))
            scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100, **extra)
            # Only rank 1 sees an overflow.
            overflows = {DIST_OVERFLOW_STEP: (0, 0, math.inf)} if rank == 1 else {}
            scales = train(model, opt, scaler, batches, overflows)
            results[name] = (scales, [p.detach().clone() for p in model.parameters()])
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()  # see ranks.leave_group: gloo's teardown can abort a finished rank


def _free_port():
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_found_inf_is_all_reduced_across_ranks(tmp_path):
    """2 gloo processes, same data and model; rank 1 alone injects an inf. With the flag
    all-reduced both ranks skip that step and back off, so params and scales stay identical;
    without it (the control) the ranks diverge."""
    context = mp.start_processes(_dist_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + 60
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("the distributed workers did not finish within 60 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    backed_off = [2.0**10] * DIST_OVERFLOW_STEP + [2.0**9] * (DIST_STEPS - DIST_OVERFLOW_STEP)
    for name in ("sgd_default_group", "fused_adam_group"):
        (scales0, params0), (scales1, params1) = ranks[0][name], ranks[1][name]
        assert scales0 == scales1 == backed_off, name
        for i, (p, q) in enumerate(zip(params0, params1)):
            assert_close_report(p, q, exact=True, msg=f"{name}: params[{i}], rank 0 vs 1")
    (scales0, params0), (scales1, params1) = (r["sgd_not_reduced"] for r in ranks)
    assert scales0 == [2.0**10] * DIST_STEPS and scales1 == backed_off
    assert not torch.equal(params0[0], params1[0])


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


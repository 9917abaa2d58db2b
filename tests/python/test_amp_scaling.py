"""amp's loss scaling: skipped steps, the dynamic rule, static scales, several losses, gradient
accumulation, and how overflows are reported.

The central test injects inf/nan into the loss or into a gradient at random steps of a 500-step
run and checks that every poisoned step is skipped bit for bit, that the scale follows a plain
Python model of the dynamic rule, and that the clean steps are exactly those of a run that
never saw the poisoned steps.

Why the poisoned run can match the clean one bit for bit although their loss scales differ:
every scale is a power of two (2**16 times powers of 2 and 1/2), and multiplying by a power of
two commutes with floating-point rounding as long as nothing overflows or becomes subnormal.
So the scaled backward computes exactly scale times the unscaled gradients, and dividing the
scale out again is exact, in fp32, bf16 and fp16 alike. The tiny models' gradients stay far
from both ends of the range at every scale the runs reach (bf16 has fp32's range).
"""

import itertools
import logging
import random

import pytest
import torch
import torch.nn.functional as F

from amp_models import (
    all_finite,
    assert_same_snapshot,
    make_model,
    make_optimizer,
    snapshot,
)
from ampfuse import amp
from tolerances import assert_close_report

INF, NAN = float("inf"), float("nan")


def scale_of(optimizer, loss_id=0):
    return amp.state_dict(optimizer)[f"loss_scaler{loss_id}"]["scale"]


def set_growth_interval(optimizer, interval):
    """amp.initialize takes no growth_interval (apex's does not either; it is fixed at 2000).
    The tests shorten it on the handle's loss scalers so that growth happens within a few dozen
    steps; LossScaler.growth_interval is a public attribute of ampfuse.scaling.LossScaler."""
    for scaler in optimizer._ampfuse_amp.scalers:
        scaler.growth_interval = interval


class ScaleRule:
    """The dynamic loss-scale rule as documented: x0.5 on the hysteresis-th overflow since the
    last change, x2 after growth_interval clean steps in a row, within [min_scale, max_scale]."""

    def __init__(
        self, scale=2.0**16, growth_interval=2000, hysteresis=1, min_scale=0.0, max_scale=2.0**24
    ):
        self.scale = scale
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.clean_in_a_row = 0
        self.overflows_left = hysteresis

    def update(self, overflow):
        if overflow:
            self.clean_in_a_row = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.clean_in_a_row += 1
        if self.clean_in_a_row == self.growth_interval:
            self.scale = min(self.scale * 2.0, self.max_scale)
            self.clean_in_a_row = 0
            self.overflows_left = self.hysteresis


def setup(opt_level="O2", optimizer_name="FusedAdam", seed=0, model_name="mlp", **options):
    model, batches = make_model(model_name, seed=seed)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    options.setdefault("verbosity", 0)
    options.setdefault("loss_scale", "dynamic")  # bf16 (the CPU default) is unscaled otherwise
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, **options)
    return model, optimizer, batches


def poison_grad(model, value, rng):
    params = [p for p in model.parameters() if p.grad is not None]
    p = params[rng.randrange(len(params))]
    p.grad.view(-1)[rng.randrange(p.numel())] = value


def train_step(model, optimizer, batch, poison=None, rng=None):
    """One apex-style step; `poison` puts inf/nan into the loss or into one gradient element."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    if poison == "loss_inf":
        loss = loss * INF
    elif poison == "loss_nan":
        # A nan that arises inside the loss's computation, so that it reaches the gradients.
        # (loss + nan would not: its gradient is still finite, and amp, like apex and
        # torch.amp.GradScaler, looks at the gradients.)
        loss = loss * NAN
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
        if poison == "grad_inf":
            poison_grad(model, -INF if rng.random() < 0.5 else INF, rng)
        elif poison == "grad_nan":
            poison_grad(model, NAN, rng)
    optimizer.step()
    return float(loss.detach())


def flat_masters(optimizer):
    return torch.cat([m.detach().reshape(-1).clone() for m in amp.master_params(optimizer)])


# ---- 500 steps with faults injected -----------------------------------------------------------

STEPS = 500
GROWTH_INTERVAL = 20
POISONS = ("loss_inf", "loss_nan", "grad_inf", "grad_nan")


def poison_schedule(seed, steps=STEPS, rate=0.05):
    rng = random.Random(seed)
    schedule = {s: rng.choice(POISONS) for s in range(steps) if rng.random() < rate}
    # Two poisoned steps in a row, one at the very start and one at the end, whatever the draw.
    schedule.update({0: "grad_nan", 100: "loss_inf", 101: "grad_inf", steps - 1: "loss_nan"})
    return schedule


@pytest.mark.parametrize(
    "opt_level,optimizer_name",
    [("O2", "FusedAdam"), ("O2", "AdamW"), ("O1", "FusedAdam"), ("O2", "SGD")],
)
def test_fault_injection_500_steps(opt_level, optimizer_name):
    schedule = poison_schedule(seed=1234)
    assert 20 <= len(schedule) <= 50
    rng = random.Random(99)

    model, optimizer, batches = setup(opt_level, optimizer_name)
    set_growth_interval(optimizer, GROWTH_INTERVAL)
    rule = ScaleRule(growth_interval=GROWTH_INTERVAL)
    clean_trajectory, scales = [], []
    for step in range(STEPS):
        poison = schedule.get(step)
        before = snapshot(model, optimizer, amp) if poison else None
        train_step(model, optimizer, batches(step), poison, rng)
        rule.update(overflow=poison is not None)
        scales.append(scale_of(optimizer))
        assert scales[-1] == rule.scale, f"step {step} ({poison or 'clean'})"
        if poison:
            assert_same_snapshot(
                snapshot(model, optimizer, amp),
                before,
                f"step {step} poisoned with {poison}",
                allow_fresh_state=True,
            )
        else:
            clean_trajectory.append(flat_masters(optimizer))
    final = snapshot(model, optimizer, amp)
    assert all_finite(final), "inf/nan reached the params or the optimizer state"
    assert amp.skipped_steps(optimizer) == len(schedule)
    # The scale really grew and backed off along the way.
    growths = sum(b > a for a, b in itertools.pairwise(scales))
    backoffs = sum(b < a for a, b in itertools.pairwise(scales))
    assert growths >= 3 and backoffs >= 20, (growths, backoffs)

    # The reference run never sees the poisoned steps; the batch of each step is a function of
    # the step number alone, so it replays the clean steps' batches exactly.
    ref_model, ref_optimizer, _ = setup(opt_level, optimizer_name)
    set_growth_interval(ref_optimizer, GROWTH_INTERVAL)
    ref_trajectory = []
    for step in range(STEPS):
        if step in schedule:
            continue
        train_step(ref_model, ref_optimizer, batches(step))
        ref_trajectory.append(flat_masters(ref_optimizer))
    assert amp.skipped_steps(ref_optimizer) == 0
    assert len(ref_trajectory) == len(clean_trajectory)
    for i, (got, want) in enumerate(zip(clean_trajectory, ref_trajectory)):
        if not torch.equal(got, want):
            assert_close_report(got, want, exact=True, msg=f"masters after clean step #{i}")
    assert_same_snapshot(final, snapshot(ref_model, ref_optimizer, amp), "final state")


def test_scale_trajectory_grows_and_backs_off():
    """The scale moves both ways on a short run, and its trajectory is the rule's."""
    model, optimizer, batches = setup()
    set_growth_interval(optimizer, 3)
    rule = ScaleRule(growth_interval=3)
    pattern = [None] * 7 + ["loss_inf"] + [None] * 4 + ["grad_nan", "grad_inf"] + [None] * 3
    seen = []
    rng = random.Random(0)
    for step, poison in enumerate(pattern):
        train_step(model, optimizer, batches(step), poison, rng)
        rule.update(poison is not None)
        seen.append(scale_of(optimizer))
        assert seen[-1] == rule.scale, f"step {step}"
    assert max(seen) == 2.0**18 and min(seen) < max(seen)


# ---- static scales ----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", ["FusedAdam", "AdamW"])
def test_static_loss_scale(optimizer_name):
    static_model, static_opt, batches = setup(optimizer_name=optimizer_name, loss_scale=128.0)
    dynamic_model, dynamic_opt, _ = setup(optimizer_name=optimizer_name)
    assert scale_of(static_opt) == 128.0
    rng = random.Random(0)
    for step in range(12):
        poison = "loss_inf" if step == 5 else None
        before = snapshot(static_model, static_opt, amp)
        train_step(static_model, static_opt, batches(step), poison, rng)
        if poison:
            assert_same_snapshot(snapshot(static_model, static_opt, amp), before, "static skip")
            continue
        train_step(dynamic_model, dynamic_opt, batches(step))
        assert scale_of(static_opt) == 128.0
    assert amp.skipped_steps(static_opt) == 1
    # Static 128 and dynamic 2**16 are both powers of two: the same training, bit for bit.
    assert_same_snapshot(
        snapshot(static_model, static_opt, amp),
        snapshot(dynamic_model, dynamic_opt, amp),
        "static vs dynamic",
    )


# ---- the rule's options -----------------------------------------------------------------------


def run_pattern(pattern, **options):
    model, optimizer, batches = setup(**options)
    scales = []
    rng = random.Random(0)
    for step, poison in enumerate(pattern):
        before = snapshot(model, optimizer, amp) if poison else None
        train_step(model, optimizer, batches(step), poison, rng)
        if poison:
            assert_same_snapshot(
                snapshot(model, optimizer, amp), before, f"step {step}", allow_fresh_state=True
            )
        scales.append(scale_of(optimizer))
    return scales, optimizer


def test_hysteresis_delays_backoff():
    pattern = ["loss_inf", None, "grad_nan", "loss_nan", "grad_inf"]
    scales, optimizer = run_pattern(pattern, hysteresis=2)
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**14]
    assert amp.skipped_steps(optimizer) == 4
    scales, _ = run_pattern(pattern, hysteresis=1)
    assert scales == [2.0**15, 2.0**15, 2.0**14, 2.0**13, 2.0**12]


def test_min_loss_scale_is_respected():
    scales, optimizer = run_pattern(["loss_inf"] * 5, min_loss_scale=2.0**14)
    assert scales == [2.0**15, 2.0**14, 2.0**14, 2.0**14, 2.0**14]
    assert amp.skipped_steps(optimizer) == 5


def test_max_loss_scale_is_respected():
    model, optimizer, batches = setup(max_loss_scale=2.0**17)
    set_growth_interval(optimizer, 2)
    for step in range(8):
        train_step(model, optimizer, batches(step))
    assert scale_of(optimizer) == 2.0**17


# ---- several losses ---------------------------------------------------------------------------


def two_losses(model, batch):
    """Two losses from two forward passes, so each has a graph of its own."""
    inputs, targets = batch
    loss0 = F.cross_entropy(model(inputs[:8]), targets[:8])
    loss1 = 0.1 * model(inputs[8:]).float().pow(2).mean()
    return loss0, loss1


def assert_same_training(got, want, start, what, rtol=0.01):
    """The two runs moved the masters the same way, up to gradients rounded differently in
    the low dtype: ||got - want|| is a small fraction of how far the masters moved."""
    moved = (want - start).norm()
    assert moved > 0, what
    diff = (got - want).norm()
    assert diff <= rtol * moved, f"{what}: ||got - want|| = {diff:.3g}, moved {moved:.3g}"


@pytest.mark.parametrize("optimizer_name", ["SGD", "FusedSGD", "FusedAdam", "AdamW"])
def test_two_losses_with_loss_ids(optimizer_name):
    """num_losses=2: each loss has its own scaler. An overflow in loss 1 skips the step, backs
    off scaler 1 only, and the run matches one that sums the two losses and leaves out that
    step."""
    model, optimizer, batches = setup(optimizer_name=optimizer_name, num_losses=2)
    ref_model, ref_optimizer, _ = setup(optimizer_name=optimizer_name)
    start = flat_masters(optimizer)
    for step in range(6):
        loss0, loss1 = two_losses(model, batches(step))
        if step == 2:
            loss1 = loss1 * INF
        before = snapshot(model, optimizer, amp)
        optimizer.zero_grad()
        with amp.scale_loss(loss0, optimizer, loss_id=0) as scaled_loss:
            scaled_loss.backward()
        with amp.scale_loss(loss1, optimizer, loss_id=1) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step == 2:
            assert_same_snapshot(snapshot(model, optimizer, amp), before, "overflow in loss 1")
            assert scale_of(optimizer, 0) == 2.0**16
            assert scale_of(optimizer, 1) == 2.0**15
            continue
        ref_loss = sum(two_losses(ref_model, batches(step)))
        ref_optimizer.zero_grad()
        with amp.scale_loss(ref_loss, ref_optimizer) as scaled_loss:
            scaled_loss.backward()
        ref_optimizer.step()
    assert amp.skipped_steps(optimizer) == 1
    assert_same_training(
        flat_masters(optimizer),
        flat_masters(ref_optimizer),
        start,
        f"two losses with {optimizer_name}",
    )


def test_skipped_steps_counts_steps_not_overflowing_losses():
    """Both losses overflowing in one step is one skipped step."""
    model, optimizer, batches = setup(num_losses=2)
    loss0, loss1 = two_losses(model, batches(0))
    optimizer.zero_grad()
    for loss_id, loss in enumerate((loss0 * INF, loss1 * INF)):
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
            scaled_loss.backward()
    optimizer.step()
    assert amp.skipped_steps(optimizer) == 1


def test_loss_id_out_of_range():
    model, optimizer, batches = setup(num_losses=2)
    loss0, _ = two_losses(model, batches(0))
    with pytest.raises(ValueError, match="loss_id"):
        with amp.scale_loss(loss0, optimizer, loss_id=2) as scaled_loss:
            scaled_loss.backward()


# ---- gradient accumulation --------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", ["SGD", "FusedSGD", "FusedAdam", "AdamW"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_delay_unscale_accumulation_equals_the_whole_batch(opt_level, optimizer_name):
    """Two micro-batches (the first with delay_unscale=True) then one step == one step on the
    concatenated batch."""
    model, optimizer, batches = setup(opt_level, optimizer_name)
    ref_model, ref_optimizer, _ = setup(opt_level, optimizer_name)
    start = flat_masters(optimizer)
    for step in range(5):
        inputs, targets = batches(step)
        optimizer.zero_grad()
        for micro in range(2):
            part = slice(8 * micro, 8 * micro + 8)
            loss = F.cross_entropy(model(inputs[part]), targets[part]) / 2
            with amp.scale_loss(loss, optimizer, delay_unscale=micro == 0) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
        train_step(ref_model, ref_optimizer, (inputs, targets))
    assert amp.skipped_steps(optimizer) == 0
    assert_same_training(
        flat_masters(optimizer),
        flat_masters(ref_optimizer),
        start,
        f"delay_unscale at {opt_level} with {optimizer_name}",
    )


# ---- gradients for clipping ----------------------------------------------------------------


def master_grad_norm_after_scale_loss(opt_level, optimizer_name):
    model, optimizer, batches = setup(opt_level, optimizer_name)
    inputs, targets = batches(0)
    loss = F.cross_entropy(model(inputs), targets)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    masters = list(amp.master_params(optimizer))
    missing = [i for i, m in enumerate(masters) if m.grad is None]
    assert not missing, f"master params {missing} have no grad after scale_loss"
    return float(torch.nn.utils.clip_grad_norm_(masters, max_norm=float("inf")))


@pytest.mark.parametrize("optimizer_name", ["FusedAdam", "FusedSGD", "AdamW"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_master_params_hold_unscaled_grads_for_clipping(opt_level, optimizer_name):
    """apex's recipe for gradient clipping clips amp.master_params(optimizer) between
    scale_loss and step(), so once scale_loss has exited their grads must be there and
    unscaled: their norm is the one torch.optim.SGD's fp32 masters see."""
    expected = master_grad_norm_after_scale_loss(opt_level, "SGD")
    got = master_grad_norm_after_scale_loss(opt_level, optimizer_name)
    assert abs(got - expected) <= 0.01 * expected, (
        f"{optimizer_name} at {opt_level}: grad norm of amp.master_params after scale_loss is "
        f"{got:.6g}, expected {expected:.6g} (the unscaled grads)"
    )


@pytest.mark.parametrize("optimizer_name", ["FusedAdam", "FusedSGD"])
def test_master_grads_made_for_clipping_serve_one_step(optimizer_name):
    """The fp32 master grads amp.master_params() makes for clipping are dropped after the step
    they served: the next step, without clipping, steps on that step's own grads, as the plain
    loop with torch.optim.SGD does."""
    model, optimizer, batches = setup("O2", optimizer_name)
    ref_model, ref_optimizer, _ = setup("O2", optimizer_name)
    for step in range(3):
        for m, opt in ((model, optimizer), (ref_model, ref_optimizer)):
            inputs, targets = batches(step)
            with amp.scale_loss(F.cross_entropy(m(inputs), targets), opt) as scaled_loss:
                scaled_loss.backward()
            if step == 0 and m is model:
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=float("inf"))
            opt.step()
            opt.zero_grad()
        assert all(m.grad is None for m in amp.master_params(optimizer)), step
    for got, expected in zip(amp.master_params(optimizer), amp.master_params(ref_optimizer)):
        assert torch.equal(got, expected)


# ---- reporting overflows ----------------------------------------------------------------------


def overflow_messages(text_lines):
    return [line for line in text_lines if "overflow" in line.lower() or "skip" in line.lower()]


@pytest.mark.parametrize("verbosity", [1, 0])
def test_overflow_reports_are_rare(caplog, capsys, verbosity):
    steps = 250
    model, optimizer, batches = setup(verbosity=verbosity, min_loss_scale=1.0)
    with caplog.at_level(logging.DEBUG):
        for step in range(steps):
            train_step(model, optimizer, batches(step), "loss_inf")
    assert amp.skipped_steps(optimizer) == steps
    assert scale_of(optimizer) == 1.0
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines() + [r.getMessage() for r in caplog.records]
    messages = overflow_messages(lines)
    if verbosity == 0:
        assert messages == []
    else:
        # The user hears about it, but not once per step.
        assert 1 <= len(messages) <= steps // 50, messages


# ---- no host sync --------------------------------------------------------------------------


@pytest.mark.cuda
def test_no_host_sync_in_an_o2_step_with_fused_adam():
    """With sync debug mode "error", any host sync in the step raises."""
    model, batches = make_model("mlp", device="cuda")
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    data = [batches(step, device="cuda") for step in range(5)]

    def step(inputs, targets, overflow=False):
        loss = F.cross_entropy(model(inputs), targets)
        if overflow:
            loss = loss * float("inf")
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    step(*data[0])  # creates the optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1, 5):
            step(*data[i], overflow=i == 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert amp.skipped_steps(optimizer) == 1

"""ampfuse.GradScaler's extended scale rule (hysteresis, min_scale, max_scale) step by step
against the same rule in plain Python; with hysteresis=1 and no bounds it is torch's rule."""

import math

import pytest
import torch

from ampfuse.scaling.grad_scaler import GradScaler
from tolerances import assert_close_report


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

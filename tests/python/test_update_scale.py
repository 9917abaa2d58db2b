"""torch.ops.ampfuse.update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf,
growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale).

Checked step by step against a plain-Python model of the rule, and bit for bit against
torch._amp_update_scale_ where the two rules coincide (hysteresis 1, no bounds).
"""

import math

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import numpy as np
import pytest
import torch
from helpers import other_device, raises_naming

update_scale_ = torch.ops.ampfuse.update_scale_

INF = math.inf


def f32(x):
    """Rounds a Python float to the nearest float32 (overflowing to inf), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


class ScaleRule:
    """The loss-scale rule, one step at a time, in plain Python.

    Products are formed in double and rounded to float32. When the grown scale is not finite it
    is kept, but the growth interval still restarts (torch does the same).
    """

    def __init__(
        self,
        scale,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        max_scale,
    ):
        self.scale = f32(scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.events = dict.fromkeys(
            ["held", "backoff", "min_clamp", "growth", "max_clamp", "inf_guard"], 0
        )

    def step(self, found_inf):
        if found_inf != 0.0:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:
                self.events["held"] += 1
                return
            backed_off = f32(self.scale * self.backoff_factor)
            if backed_off < self.min_scale:
                backed_off = f32(self.min_scale)
                self.events["min_clamp"] += 1
            self.scale = backed_off
            self.hysteresis_tracker = self.hysteresis
            self.events["backoff"] += 1
            return
        successful = self.growth_tracker + 1
        if successful < self.growth_interval:
            self.growth_tracker = successful
            return
        grown = f32(self.scale * self.growth_factor)
        if math.isfinite(grown):
            if grown > self.max_scale:
                grown = f32(self.max_scale)
                self.events["max_clamp"] += 1
            self.scale = grown
            self.events["growth"] += 1
        else:
            self.events["inf_guard"] += 1
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def args(self):
        return (
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.hysteresis,
            self.min_scale,
            self.max_scale,
        )


def make_state(scale, hysteresis, device, shape=(1,)):
    return (
        torch.full(shape, scale, dtype=torch.float32, device=device),
        torch.zeros(shape, dtype=torch.int32, device=device),
        torch.full(shape, hysteresis, dtype=torch.int32, device=device),
    )


def overflow_sequence(seed, steps=1000):
    """Random found_inf values in phases: 125 mostly clean steps, then 125 mostly overflowing,
    so that both the growth and the backoff bounds are reached."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    draws = torch.rand(steps, generator=gen).tolist()
    return [1.0 if u < (0.9 if (i // 125) % 2 else 0.03) else 0.0 for i, u in enumerate(draws)]


def assert_state(scale, growth_tracker, hysteresis_tracker, rule, step):
    got = (scale.item(), growth_tracker.item(), hysteresis_tracker.item())
    want = (rule.scale, rule.growth_tracker, rule.hysteresis_tracker)
    assert got == want, (
        f"step {step}: (scale, growth_tracker, hysteresis_tracker) = {got}, model says {want}"
    )


# name: (initial scale, growth_factor, backoff_factor, growth_interval, hysteresis, min, max), and
# the events the sequence must produce for the setting to be tested at all.
SETTINGS = {
    "h1_interval1_unbounded": (
        (2.0**16, 2.0, 0.5, 1, 1, 0.0, INF),
        ["backoff", "growth", "inf_guard"],
    ),
    "h3_interval5_bounded": (
        (2.0**16, 2.0, 0.5, 5, 3, 1.0, 2.0**24),
        ["held", "min_clamp", "max_clamp"],
    ),
    "h1_interval5_odd_factors": (
        (1000.0, 1.1, 0.7, 5, 1, 0.25, 1500.0),
        ["min_clamp", "max_clamp"],
    ),
    "h3_interval1_odd_factors": ((3.7, 3.0, 0.3, 1, 3, 2.0**-4, 2.0**100), ["held", "max_clamp"]),
    "h2_interval2_tight": (
        (2.0**16, 2.0, 0.5, 2, 2, 2.0**10, 2.0**20),
        ["held", "min_clamp", "max_clamp"],
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_thousand_steps_follow_the_rule(device, name):
    (start, *rule_args), required_events = SETTINGS[name]
    rule = ScaleRule(start, *rule_args)
    scale, growth_tracker, hysteresis_tracker = make_state(start, rule.hysteresis, device)
    for step, found in enumerate(overflow_sequence(seed=len(name))):
        found_inf = torch.full((1,), found, device=device)
        update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, *rule.args())
        rule.step(found)
        assert found_inf.item() == found, "update_scale_ must not write found_inf"
        assert_state(scale, growth_tracker, hysteresis_tracker, rule, step)
        value = scale.item()
        assert math.isfinite(value) and rule.min_scale <= value <= rule.max_scale, (
            f"step {step}: scale {value!r}"
        )
    missing = [e for e in required_events if rule.events[e] == 0]
    assert not missing, f"the sequence never exercised {missing}: {rule.events}"


TORCH_SETTINGS = {
    "default": (2.0**16, 2.0, 0.5, 1),
    "interval3_odd_factors": (3.3, 1.1, 0.7, 3),
    "near_float_max": (1e38, 2.0, 0.5, 1),
    "factor4_interval2": (12345.678, 4.0, 0.9, 2),
}


@pytest.mark.parametrize("name", list(TORCH_SETTINGS))
def test_bit_exact_against_torch_with_hysteresis_1(device, name):
    start, growth_factor, backoff_factor, growth_interval = TORCH_SETTINGS[name]
    scale, growth_tracker, hysteresis_tracker = make_state(start, 1, device)
    torch_scale, torch_growth, _ = make_state(start, 1, device)
    rule = ScaleRule(start, growth_factor, backoff_factor, growth_interval, 1, 0.0, INF)
    for step, found in enumerate(overflow_sequence(seed=len(name) + 1)):
        found_inf = torch.full((1,), found, device=device)
        update_scale_(
            scale,
            growth_tracker,
            hysteresis_tracker,
            found_inf,
            growth_factor,
            backoff_factor,
            growth_interval,
            1,
            0.0,
            INF,
        )
        torch._amp_update_scale_(
            torch_scale, torch_growth, found_inf, growth_factor, backoff_factor, growth_interval
        )
        rule.step(found)
        assert scale.view(torch.int32).item() == torch_scale.view(torch.int32).item(), (
            f"step {step}: scale {scale.item()!r}, torch {torch_scale.item()!r}"
        )
        assert growth_tracker.item() == torch_growth.item(), f"step {step}: growth_tracker"
        assert hysteresis_tracker.item() == 1, f"step {step}: hysteresis_tracker"
        assert_state(scale, growth_tracker, hysteresis_tracker, rule, step)


def test_products_are_rounded_from_double(device):
    # 3.3 * 1.1 differs by one float32 ulp between double and float32 arithmetic.
    start, factor = 3.3, 1.1
    assert f32(f32(start) * factor) != float(np.float32(start) * np.float32(factor))
    scale, growth_tracker, hysteresis_tracker = make_state(start, 1, device)
    update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        torch.zeros(1, device=device),
        factor,
        0.5,
        1,
        1,
        0.0,
        INF,
    )
    assert scale.item() == f32(f32(start) * factor)


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_growth_from_3e38_stays_finite(device, hysteresis):
    scale, growth_tracker, hysteresis_tracker = make_state(3e38, hysteresis, device)
    torch_scale, torch_growth, _ = make_state(3e38, 1, device)
    clean = torch.zeros(1, device=device)
    for _ in range(10):
        update_scale_(
            scale, growth_tracker, hysteresis_tracker, clean, 2.0, 0.5, 1, hysteresis, 0.0, INF
        )
        torch._amp_update_scale_(torch_scale, torch_growth, clean, 2.0, 0.5, 1)
        assert scale.item() == f32(3e38) == torch_scale.item()
        assert growth_tracker.item() == 0 == torch_growth.item()


def test_backoff_stops_at_min_scale(device):
    scale, growth_tracker, hysteresis_tracker = make_state(1.5, 1, device)
    overflow = torch.ones(1, device=device)
    update_scale_(scale, growth_tracker, hysteresis_tracker, overflow, 2.0, 0.5, 100, 1, 1.0, INF)
    assert scale.item() == 1.0
    update_scale_(scale, growth_tracker, hysteresis_tracker, overflow, 2.0, 0.5, 100, 1, 1.0, INF)
    assert scale.item() == 1.0


def test_growth_stops_at_max_scale(device):
    scale, growth_tracker, hysteresis_tracker = make_state(0.75 * 2.0**20, 1, device)
    clean = torch.zeros(1, device=device)
    update_scale_(scale, growth_tracker, hysteresis_tracker, clean, 2.0, 0.5, 1, 1, 0.0, 2.0**20)
    assert scale.item() == 2.0**20
    update_scale_(scale, growth_tracker, hysteresis_tracker, clean, 2.0, 0.5, 1, 1, 0.0, 2.0**20)
    assert scale.item() == 2.0**20


def test_hysteresis_delays_backoff(device):
    scale, growth_tracker, hysteresis_tracker = make_state(1024.0, 3, device)
    args = (2.0, 0.5, 5, 3, 0.0, INF)

    def step(found):
        update_scale_(
            scale, growth_tracker, hysteresis_tracker, torch.full((1,), found, device=device), *args
        )
        return scale.item(), growth_tracker.item(), hysteresis_tracker.item()

    assert step(0.0) == (1024.0, 1, 3)
    assert step(1.0) == (1024.0, 0, 2)
    assert step(1.0) == (1024.0, 0, 1)
    assert step(0.0) == (1024.0, 1, 1)  # a clean step short of growth keeps the count
    assert step(1.0) == (512.0, 0, 3)  # third overflow: back off, count again
    for _ in range(4):
        step(0.0)
    assert step(1.0) == (512.0, 0, 2)  # growth_tracker had reached 4: an overflow restarts it
    for _ in range(4):
        step(0.0)
    assert step(0.0) == (1024.0, 0, 3)  # growth resets the hysteresis count too


@pytest.mark.parametrize("found", [2.0, -1.0, 0.5, -0.0], ids=["2", "-1", "0.5", "-0"])
def test_any_nonzero_found_inf_is_an_overflow(device, found):
    scale, growth_tracker, hysteresis_tracker = make_state(1024.0, 1, device)
    growth_tracker.fill_(3)
    update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        torch.full((1,), found, device=device),
        2.0,
        0.5,
        5,
        1,
        0.0,
        INF,
    )
    expected = (1024.0, 4) if found == 0.0 else (512.0, 0)
    assert (scale.item(), growth_tracker.item()) == expected


def test_zero_dim_state_tensors(device):
    # torch.amp.GradScaler keeps its scale and growth tracker as 0-dim tensors.
    scale, growth_tracker, hysteresis_tracker = make_state(1024.0, 1, device, shape=())
    update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        torch.ones((), device=device),
        2.0,
        0.5,
        5,
        1,
        0.0,
        INF,
    )
    assert scale.shape == () and scale.item() == 512.0
    update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        torch.zeros((), device=device),
        2.0,
        0.5,
        1,
        1,
        0.0,
        INF,
    )
    assert scale.item() == 1024.0 and growth_tracker.item() == 0


# --- misuse ------------------------------------------------------------------------------------

VALID_ARGS = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 5,
    "hysteresis": 2,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
}
NAN = math.nan


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"growth_interval": 0}, r"growth_interval"),
        ({"growth_interval": -3}, r"growth_interval"),
        ({"hysteresis": 0}, r"\bhysteresis\b"),
        ({"hysteresis": -1}, r"\bhysteresis\b"),
        ({"growth_factor": 0.5}, r"growth_factor"),
        ({"growth_factor": NAN}, r"growth_factor"),
        ({"backoff_factor": 0.0}, r"backoff_factor"),
        ({"backoff_factor": -0.5}, r"backoff_factor"),
        ({"backoff_factor": 1.5}, r"backoff_factor"),
        ({"backoff_factor": NAN}, r"backoff_factor"),
        ({"min_scale": -1.0}, r"min_scale"),
        ({"min_scale": 10.0, "max_scale": 5.0}, r"min_scale|max_scale"),
        ({"max_scale": NAN}, r"max_scale"),
    ],
    ids=lambda v: "-".join(f"{k}={w}" for k, w in v.items()) if isinstance(v, dict) else None,
)
def test_rejects_bad_arguments(device, changes, pattern):
    scale, growth_tracker, hysteresis_tracker = make_state(1024.0, 2, device)
    args = dict(VALID_ARGS, **changes)
    with raises_naming(pattern):
        update_scale_(
            scale, growth_tracker, hysteresis_tracker, torch.zeros(1, device=device), *args.values()
        )
    assert (scale.item(), growth_tracker.item(), hysteresis_tracker.item()) == (1024.0, 0, 2)


def test_accepts_boundary_arguments(device):
    # growth_factor 1, backoff_factor 1, min_scale 0 == max_scale... the edges of the valid ranges.
    scale, growth_tracker, hysteresis_tracker = make_state(8.0, 1, device)
    update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        torch.ones(1, device=device),
        1.0,
        1.0,
        1,
        1,
        8.0,
        8.0,
    )
    assert scale.item() == 8.0
    update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        torch.zeros(1, device=device),
        1.0,
        1.0,
        1,
        1,
        0.0,
        INF,
    )
    assert scale.item() == 8.0


BAD_STATE = {
    "scale": [torch.float64, torch.float16, torch.int32],
    "growth_tracker": [torch.int64, torch.float32, torch.int16],
    "hysteresis_tracker": [torch.int64, torch.float32],
    "found_inf": [torch.float64, torch.int32, torch.bool],
}
STATE_CASES = [(arg, dtype) for arg, dtypes in BAD_STATE.items() for dtype in dtypes]
STATE_CASES += [
    (arg, problem)
    for arg in BAD_STATE
    for problem in ("two_elements", "no_elements", "other_device")
]


@pytest.mark.parametrize(
    ("arg", "problem"),
    STATE_CASES,
    ids=[f"{a}-{str(p).replace('torch.', '')}" for a, p in STATE_CASES],
)
def test_rejects_bad_state_tensors(device, arg, problem):
    scale, growth_tracker, hysteresis_tracker = make_state(1024.0, 2, device)
    tensors = {
        "scale": scale,
        "growth_tracker": growth_tracker,
        "hysteresis_tracker": hysteresis_tracker,
        "found_inf": torch.zeros(1, device=device),
    }
    good = tensors[arg]
    if isinstance(problem, torch.dtype):
        tensors[arg] = good.to(problem)
    elif problem == "two_elements":
        tensors[arg] = good.repeat(2)
    elif problem == "no_elements":
        tensors[arg] = good[:0]
    else:
        tensors[arg] = good.to(other_device(device))
    with raises_naming(rf"\b{arg}\b"):
        update_scale_(*tensors.values(), *VALID_ARGS.values())


def test_opcheck(device):
    for found in (0.0, 1.0):
        scale, growth_tracker, hysteresis_tracker = make_state(1024.0, 2, device)
        torch.library.opcheck(
            update_scale_,
            (
                scale,
                growth_tracker,
                hysteresis_tracker,
                torch.full((1,), found, device=device),
                *VALID_ARGS.values(),
            ),
        )

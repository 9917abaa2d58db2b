"""torch.ops.ampfuse.fp8_update_scales_(amaxes, amax_histories, scales, scale_invs, fp8_maxes,
margin, amax_compute, found_inf): delayed scaling for all FP8 tensors of a step in one call.

Checked step by step against the delayed-scaling formula written in plain float32 numpy:
history rolled one slot older with the step's amax in front, amax = max(history) or the
newest entry, scale = fp8_max / amax / 2**margin, kept when amax is 0 or not finite.
"""

import math

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import numpy as np
import pytest
import torch
from ampfuse.ops.fp8 import fp8_update_scales_
from helpers import make_generator, other_device, raises_naming

E4M3, E5M2 = 448.0, 57344.0


class State:
    """One FP8 tensor's state on `device`, and the same state as numpy float32 for the model."""

    def __init__(self, history_len, fp8_max, device, scale=1.0):
        self.fp8_max = fp8_max
        self.amax = torch.zeros(1, device=device)
        self.history = torch.zeros(history_len, device=device)
        self.scale = torch.full((1,), scale, device=device)
        self.scale_inv = torch.full((1,), 1.0 / scale, device=device)
        self.model_history = np.zeros(history_len, np.float32)
        self.model_scale = np.float32(scale)

    def model_step(self, amax, margin, amax_compute, skipped=False):
        if skipped:
            return
        self.model_history = np.roll(self.model_history, 1)
        self.model_history[0] = amax
        chosen = np.max(self.model_history) if amax_compute == "max" else self.model_history[0]
        with np.errstate(all="ignore"):
            candidate = np.float32(np.float32(self.fp8_max) / chosen) / np.float32(2.0**margin)
        if 0 < chosen < np.inf and 0 < candidate < np.inf:
            self.model_scale = candidate

    def check(self):
        np.testing.assert_array_equal(self.history.cpu().numpy(), self.model_history)
        assert self.scale.item() == self.model_scale
        assert self.scale_inv.item() == np.float32(1.0) / self.model_scale
        assert self.amax.item() == 0.0


def update(states, margin, amax_compute, found_inf=None):
    fp8_update_scales_([s.amax for s in states], [s.history for s in states],
                       [s.scale for s in states], [s.scale_inv for s in states],
                       [s.fp8_max for s in states], margin, amax_compute, found_inf)


@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_follows_the_formula_over_steps(device, amax_compute, margin):
    """Mixed formats and history lengths (1 to 40) in one call; more states than one CUDA
    launch takes (64), so the launch loop is crossed too."""
    gen = make_generator(4)
    states = [State(1 + i % 40, E4M3 if i % 3 else E5M2, device) for i in range(150)]
    for _ in range(6):
        amaxes = (torch.rand(len(states), generator=gen) * 10.0 ** torch.randint(
            -6, 6, (len(states),), generator=gen)).tolist()
        for s, a in zip(states, amaxes):
            s.amax.fill_(a)
            s.model_step(np.float32(a), margin, amax_compute)
        update(states, margin, amax_compute)
        for s in states:
            s.check()


@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan])
def test_zero_or_nonfinite_amax_keeps_the_scale(device, amax_compute, bad):
    """A 0, inf or nan amax enters the history but leaves the scale alone; with "max" the scale
    stays frozen while a non-finite entry is in the window, then resumes."""
    s = State(3, E4M3, device, scale=2.0)
    for step, amax in enumerate([4.0, bad, 1.0, 1.0, 1.0]):
        s.amax.fill_(amax)
        s.model_step(np.float32(amax), 0, amax_compute)
        update([s], 0, amax_compute)
        s.check()
        if step == 1:
            assert s.scale.item() == np.float32(E4M3 / 4.0)
    assert s.scale.item() == np.float32(E4M3 / 1.0)


def test_a_tiny_amax_whose_scale_overflows_keeps_the_scale(device):
    s = State(2, E5M2, device, scale=8.0)
    s.amax.fill_(1e-44)
    update([s], 0, "max")
    assert s.scale.item() == 8.0


def test_found_inf_drops_the_step(device):
    s = State(2, E4M3, device)
    s.amax.fill_(3.0)
    s.model_step(np.float32(3.0), 0, "max")
    update([s], 0, "max", torch.zeros(1, device=device))
    s.check()
    s.amax.fill_(100.0)
    update([s], 0, "max", torch.ones(1, device=device))
    s.check()  # history and scale unchanged, the step's amax reset


def test_empty_list_is_a_no_op(device):
    update([], 0, "max")


def test_opcheck(device):
    states = [State(4, E4M3, device), State(1, E5M2, device)]
    for s, a in zip(states, (3.0, 0.5)):
        s.amax.fill_(a)
    args = ([s.amax for s in states], [s.history for s in states], [s.scale for s in states],
            [s.scale_inv for s in states], [E4M3, E5M2], 1, "most_recent")
    torch.library.opcheck(torch.ops.ampfuse.fp8_update_scales_, args)
    torch.library.opcheck(torch.ops.ampfuse.fp8_update_scales_,
                          args + (torch.ones(1, device=device),))


def test_refuses_bad_arguments():
    s = State(3, E4M3, "cpu")
    good = dict(amaxes=[s.amax], amax_histories=[s.history], scales=[s.scale],
                scale_invs=[s.scale_inv], fp8_maxes=[E4M3], margin=0, amax_compute="max")

    def call(**change):
        args = {**good, **change}
        fp8_update_scales_(*args.values())

    with raises_naming("amax_compute", "most_recent", "mean"):
        call(amax_compute="mean")
    with raises_naming("margin", "-1"):
        call(margin=-1)
    with raises_naming("one entry per FP8 tensor"):
        call(scales=[s.scale, s.scale])
    with raises_naming(r"fp8_maxes\[0\]", "448", "57344"):
        call(fp8_maxes=[240.0])
    with raises_naming(r"amax_histories\[0\]", "1-D"):
        call(amax_histories=[torch.zeros(2, 2)])
    with raises_naming(r"amax_histories\[0\]", "1-D"):
        call(amax_histories=[torch.zeros(0)])
    with raises_naming(r"scale_invs\[0\]", "float32"):
        call(scale_invs=[s.scale_inv.double()])
    with raises_naming(r"scales\[0\]", "meta"):
        call(scales=[s.scale.to(other_device("cpu"))])


def test_refuses_states_that_share_memory(device):
    """CUDA updates every state at once, so two states sharing a tensor (or a scale that is a
    view into a history) would race there: both devices refuse it, before writing anything."""
    a, b = State(3, E4M3, device), State(2, E5M2, device)
    a.amax.fill_(2.0)
    b.amax.fill_(4.0)
    history_view = a.history[1:2]
    cases = {
        (r"amaxes\[0\]", r"amaxes\[1\]"): ([a.amax, a.amax], [a.history, b.history],
                                          [a.scale, b.scale], [a.scale_inv, b.scale_inv]),
        ("amax_histories", r"scales\[1\]"): ([a.amax, b.amax], [a.history, b.history],
                                            [a.scale, history_view], [a.scale_inv, b.scale_inv]),
        (r"scales\[0\]", r"scale_invs\[0\]"): ([a.amax, b.amax], [a.history, b.history],
                                              [a.scale, b.scale], [a.scale, b.scale_inv]),
    }
    for names, (amaxes, histories, scales, scale_invs) in cases.items():
        with raises_naming(*names, "share memory"):
            fp8_update_scales_(amaxes, histories, scales, scale_invs, [E4M3, E5M2], 0, "max")
    for state, amax in ((a, 2.0), (b, 4.0)):
        assert state.amax.item() == amax
        assert not state.history.any()
        assert state.scale.item() == 1.0 and state.scale_inv.item() == 1.0


@pytest.mark.cuda
def test_cuda_matches_cpu_with_nonfinite_amaxes():
    gen = make_generator(5)
    cpu = [State(1 + i % 7, E4M3 if i % 2 else E5M2, "cpu") for i in range(70)]
    gpu = [State(1 + i % 7, E4M3 if i % 2 else E5M2, "cuda") for i in range(70)]
    for _ in range(4):
        values = torch.rand(70, generator=gen) * 100
        values[0], values[35], values[69] = math.inf, math.nan, 0.0
        for c, g, v in zip(cpu, gpu, values.tolist()):
            c.amax.fill_(v)
            g.amax.fill_(v)
        update(cpu, 1, "max")
        update(gpu, 1, "max")
        for c, g in zip(cpu, gpu):
            torch.testing.assert_close(g.history.cpu(), c.history, rtol=0, atol=0,
                                       equal_nan=True)
            assert g.scale.item() == c.scale.item() and g.scale_inv.item() == c.scale_inv.item()


@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
def test_long_histories_and_many_states(device, amax_compute):
    """Histories longer than a CUDA block (128 threads roll 128 entries per pass) and more
    states than one launch's table (512) follow the model exactly, a skipped step included."""
    lengths = [1, 2, 127, 128, 129, 300, 1024]
    states = [State(lengths[i % len(lengths)], E4M3 if i % 3 else E5M2, device)
              for i in range(600)]
    gen = make_generator(9)
    for step in range(3):
        values = (torch.rand(len(states), generator=gen) * 50).tolist()
        for s, v in zip(states, values):
            s.amax.fill_(v)
        skipped = step == 1
        found_inf = torch.full((1,), 1.0 if skipped else 0.0, device=device)
        update(states, 1, amax_compute, found_inf)
        for s, v in zip(states, values):
            s.model_step(np.float32(v), 1, amax_compute, skipped=skipped)
            s.check()

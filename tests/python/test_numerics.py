"""ampfuse.numerics.watch: per-module op dtypes, value ranges and gradients, and the black-list
suggestions made from them.

- A layer whose activations pass 65504 is flagged as an fp16 overflow and one whose values sit
  below 6e-5 as an underflow; the layers after them, which only pass the values on, are not.
- Op dtype counts come from what ran: under O1 and plain torch.autocast the matmul is counted
  in bf16, ampfuse's fp32-list softmax in fp32 (O1) and autocast's casts are counted too.
- Gradients are recorded, scaled by loss_scale for the suggestions.
- Nothing stays installed after the `with` (hooks, modes), also after an exception; results are
  bit-identical with and without the watch; suggestions pass amp.initialize's list check.
"""

import contextlib
import copy
import math
import threading

import pytest
import torch
from torch import nn

import ampfuse.numerics as numerics
from ampfuse import amp
from ampfuse.numerics._stats import Counts, measure
from ampfuse.amp import aten_lists
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class Net(nn.Module):
    """Two branches: `big` multiplies by 1e6 (past fp16's max), `tiny` by 1e-6 (below its
    smallest normal); each is followed by a layer that only passes the values on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.big = Scale(1e6)
        self.relu = nn.ReLU()
        self.tiny = Scale(1e-6)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc(x)
        a = self.relu(self.big(h))
        b = self.drop(self.tiny(h))
        return torch.softmax(self.head(torch.cat([a * 1e-6, b * 1e6], dim=1)), dim=-1)


def make(seed=0):
    torch.manual_seed(seed)
    return Net(), torch.randn(8, 16)


def rows_of(watch):
    return {(r.module, r.phase, r.op, r.dtype): r for r in watch.report()}


def step(model, x):
    out = model(x)
    loss = nn.functional.cross_entropy(out, torch.arange(len(x), device=x.device) % 4)
    loss.backward()
    return out


def watched_step():
    """A watch over one forward and backward of a fresh Net, and the input it ran on."""
    model, x = make()
    with numerics.watch(model) as w:
        step(model, x)
    return w, x


def installed(model):
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return hooks, len(_get_current_dispatch_mode_stack()), len(_get_current_function_mode_stack())


def test_overflow_and_underflow_layers_are_flagged():
    w, x = watched_step()
    flags = {(f.module, f.what, f.problem): f for f in w.flags(torch.float16)}
    assert ("big", "output", "overflow") in flags
    assert flags["big", "output", "overflow"].value > 65504
    assert ("tiny", "output", "underflow") in flags
    assert flags["tiny", "output", "underflow"].value > 0.9
    # The layers after them only pass the values on: not flagged.
    assert not any(m in ("relu", "drop", "fc") and what == "output" for m, what, _ in flags)
    assert flags["big", "output", "overflow"].names == ("mul",)
    # bf16 has fp32's range: nothing in the forward is beyond it.
    assert not [f for f in w.flags(torch.bfloat16) if f.what == "output"]

    rows = rows_of(w)
    big = rows["big", "forward", "output", torch.float32]
    assert big.absmax > 65504 and big.headroom_bits < 0
    assert big.headroom_bits == pytest.approx(math.log2(65504 / big.absmax))
    tiny = rows["tiny", "forward", "output", torch.float32]
    assert tiny.absmax < 6e-5 and tiny.underflow > 0.9


def test_o1_op_dtypes_are_what_ran():
    model, x = make()
    model = amp.initialize(model, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    with numerics.watch(model) as w:
        step(model, x)
    rows = rows_of(w)
    assert rows["fc", "forward", "addmm", torch.bfloat16].calls == 1
    assert ("fc", "forward", "addmm", torch.float32) not in rows
    assert rows["fc", "forward", "output", torch.bfloat16].calls == 1
    # autocast's casts ran too: the weight, bias and input of fc to bf16.
    assert rows["fc", "forward", "_to_copy", torch.bfloat16].calls == 3
    # softmax is on ampfuse's fp32 list: it ran in fp32 on bf16 input.
    assert rows["(model)", "forward", "_softmax", torch.float32].calls == 1
    assert ("(model)", "forward", "_softmax", torch.bfloat16) not in rows
    # The backward's ops, attributed to the module whose forward made them.
    assert rows["fc", "backward", "mm", torch.bfloat16].calls >= 1
    assert rows["head", "backward", "mm", torch.bfloat16].calls == 2


def test_plain_autocast_op_dtypes():
    model, x = make()
    with numerics.watch(model) as w, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    rows = rows_of(w)
    assert rows["head", "forward", "addmm", torch.bfloat16].calls == 1
    # torch's CPU autocast leaves softmax alone: it runs in the dtype it gets.
    assert rows["(model)", "forward", "_softmax", torch.bfloat16].calls == 1
    assert not any(r.phase == "backward" for r in w.report())


def test_grads_are_recorded_and_scaled_for_the_suggestions():
    w, x = watched_step()
    rows = rows_of(w)
    for name in ("fc", "big", "tiny", "head", "(model)"):
        assert rows[name, "backward", "grad", torch.float32].calls == 1, name
    grad = rows["head", "backward", "grad", torch.float32]
    assert 0 < grad.absmax < 1
    # At a loss scale that pushes the head's gradient past 65504, it is flagged.
    scale = 2.0 ** math.ceil(math.log2(65504 / grad.absmax) + 1)
    assert ("head", "grad", "overflow") not in {(f.module, f.what, f.problem)
                                                for f in w.flags(loss_scale=1.0)}
    flagged = {(f.module, f.what, f.problem): f for f in w.flags(loss_scale=scale)}
    assert flagged["head", "grad", "overflow"].value == pytest.approx(grad.absmax * scale)
    assert "linear" in w.suggest_black_list(loss_scale=scale)


def test_the_watch_changes_no_result():
    def run(watched):
        model, x = make(seed=3)
        model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          opt_level="O1", dtype=torch.bfloat16, verbosity=0)
        watch = numerics.watch(model)
        with watch if watched else contextlib.nullcontext():
            out = step(model, x)
        optimizer.step()
        return [out.detach()] + [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_nothing_is_left_installed():
    model, x = make()
    before = installed(model)
    with numerics.watch(model) as w:
        assert installed(model) != before and w.active
        out = model(x)
    assert installed(model) == before and not w.active
    # A gradient computed after the `with` is not recorded.
    out.sum().backward()
    assert not any(r.op == "grad" for r in w.report())

    with pytest.raises(ZeroDivisionError):
        with numerics.watch(model):
            model(x)
            1 / 0  # noqa: B018  (raises inside the watch)
    assert installed(model) == before

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("inside the forward")

    failing = nn.Sequential(nn.Linear(16, 16), Fails())
    before = installed(failing)
    with pytest.raises(ValueError, match="inside the forward"):
        with numerics.watch(failing) as w:
            failing(x)
    assert installed(failing) == before
    assert rows_of(w)["0", "forward", "output", torch.float32].calls == 1


def test_a_watch_records_again_when_reentered():
    model, x = make()
    w = numerics.watch(model)
    for _ in range(2):
        with w:
            out = model(x)
        with w:  # the backward in a later `with` than its forward
            out.sum().backward()
    rows = rows_of(w)
    assert rows["fc", "forward", "addmm", torch.float32].calls == 2
    assert rows["fc", "backward", "grad", torch.float32].calls == 2
    assert rows["head", "backward", "mm", torch.float32].calls == 4


def test_a_long_watch_keeps_the_segments_of_live_graphs_only():
    """The backward attribution marks two points per module call; a watch left on for a long
    run must not keep them for graphs that were freed (it kept every mark before), while a
    graph still alive is attributed right however many forwards ran since."""
    model, x = make()
    with numerics.watch(model) as w:
        kept = model(x)  # backwarded at the end, after 40 other steps
        bound = len(w._segments)
        for _ in range(40):
            step(model, x)
            with torch.no_grad():
                model(x)
        assert len(w._segments) <= bound + 2 * len(list(model.modules())) + 2
        kept.sum().backward()
    rows = rows_of(w)
    assert rows["head", "backward", "mm", torch.float32].calls == 2 * 41
    assert rows["fc", "backward", "mm", torch.float32].calls == 41
    del kept
    assert len(w._segments) <= bound


def test_suggestions_pass_amp_initialize():
    w, x = watched_step()
    names = w.suggest_black_list(dtype=torch.float16, loss_scale=1.0)
    assert names and "mul" in names
    for name in names:
        aten_lists.check_entry(name, "test")
    fresh, _ = make()
    model = amp.initialize(fresh, opt_level="O1", dtype=torch.bfloat16, verbosity=0,
                           custom_black_list=names)
    with numerics.watch(model) as w:
        model(x)
    # mul is now on the model's fp32 list: the overflowing multiply ran in fp32.
    assert rows_of(w)["big", "forward", "mul", torch.float32].calls == 1


def test_report_prints_a_table():
    w, x = watched_step()
    text = str(w.report())
    assert text == w.format()
    header = text.splitlines()[0].split()
    assert header == ["module", "phase", "op", "dtype", "calls", "absmax", "underflow",
                      "headroom"]
    assert any(line.split()[:4] == ["big", "forward", "output", "float32"]
               for line in text.splitlines())


def test_a_backward_on_another_thread_is_attributed():
    """Sequence numbers count per thread; the backward may run on another one (CUDA's)."""
    model, x = make()
    w = numerics.watch(model)
    with w:
        out = model(x)

    def backward():
        with w:
            out.sum().backward()

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    rows = rows_of(w)
    assert rows["head", "backward", "mm", torch.float32].calls == 2
    assert rows["fc", "backward", "mm", torch.float32].calls == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_measure_reads_exponents_from_the_bits(dtype):
    values = [0.0, -0.0, 3e-6, -2.0**-15, 2.0**-14, 1.0, -3.0, 1000.0]
    x = torch.tensor(values, dtype=dtype)
    absmax, hist = measure(x)
    counts = Counts(1, x.numel(), absmax.item(), hist.tolist())
    assert counts.absmax == 1000.0
    assert counts.below(2.0**-14) == 2 / 8  # 3e-6 and 2**-15 (fp16 subnormals included)
    assert counts.below(2.0**-15) == 1 / 8
    assert counts.below(2.0**-60) == 0.0
    assert counts.below(2.0**10) == 6 / 8  # zeros are never counted
    assert sum(counts.hist) == 8
    nonfinite = measure(torch.tensor([float("inf"), 1.0, float("nan")], dtype=dtype))[1]
    assert nonfinite[255].item() == 2


def test_in_place_relu_after_a_watched_layer():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with numerics.watch(model) as w:
        model(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert rows_of(w)["0", "backward", "grad", torch.float32].calls == 1


def test_bad_arguments():
    model, x = make()
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        numerics.watch(lambda x: x)
    before = installed(model)
    w = numerics.watch(model)
    with w:
        with pytest.raises(RuntimeError, match="already active"):
            w.__enter__()
        with pytest.raises(RuntimeError, match="already being watched"):
            numerics.watch(model).__enter__()
    assert installed(model) == before
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        w.suggest_black_list(dtype=torch.float32)
    with pytest.raises(ValueError, match="positive and finite"):
        w.suggest_black_list(loss_scale=0)
    with pytest.raises(TypeError, match="must be a number"):
        w.suggest_black_list(loss_scale="65536")
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        w.flags(underflow=1.5)


@pytest.mark.cuda
def test_no_host_sync_while_watching_on_cuda():
    """The statistics stay on the device: a watched fp16 autocast step makes no host sync."""
    model, x = make()
    model, x = model.cuda(), x.cuda()
    w = numerics.watch(model)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with w, torch.autocast("cuda", dtype=torch.float16):
            step(model, x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rows = rows_of(w)
    assert rows["fc", "forward", "addmm", torch.float16].calls == 1
    assert rows["fc", "backward", "grad", torch.float16].calls == 1
    # The backward ran on CUDA's autograd thread: still attributed to the modules.
    assert rows["head", "backward", "mm", torch.float16].calls == 2
    assert ("big", "output", "overflow") in {(f.module, f.what, f.problem) for f in w.flags()}



def test_a_layer_that_overflowed_to_inf_reports_negative_infinite_headroom():
    """A tensor that already holds inf (fp16 overflowed in the layer itself) has no headroom
    left: -inf, not a math error; an all-zero output keeps all of it (+inf)."""
    for factor, expected in ((1e6, -math.inf), (0.0, math.inf)):
        model = nn.Sequential(Scale(factor)).half()
        with numerics.watch(model) as w:
            model(torch.ones(4, 8, dtype=torch.float16))
        row = rows_of(w)["0", "forward", "mul", torch.float16]
        assert row.absmax == factor * math.inf if factor else row.absmax == 0.0
        assert row.headroom_bits == expected, (factor, row)

"""amp.last_overflow() and the overflow summary name the gradients that held inf/nan."""

import logging

import ampfuse
import pytest
import torch
from ampfuse import amp
from ampfuse.amp.reporting import OverflowReporter
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleDict({"layer3": nn.ModuleDict({"fc1": nn.Linear(6, 8)})})
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder["layer3"]["fc1"](x).relu())


# (opt_level, optimizer, num_losses): each of amp's ways to unscale (see amp/binding.py).
SETUPS = {
    "fold": ("O2", lambda p: ampfuse.optimizers.FusedAdamW(p, lr=1e-3), 1),
    "inplace fused": ("O2", lambda p: ampfuse.optimizers.FusedAdamW(p, lr=1e-3), 2),
    "inplace torch": ("O1", lambda p: torch.optim.SGD(p, lr=1e-2), 1),
    "masters": ("O2", lambda p: torch.optim.SGD(p, lr=1e-2), 1),
}


def setup(kind, **kwargs):
    torch.manual_seed(0)
    opt_level, make, num_losses = SETUPS[kind]
    model = Net()
    optimizer = make(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      num_losses=num_losses, verbosity=0, **kwargs)
    return model, optimizer


def backward(model, optimizer, plant=None, seed=0):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    loss = model(x).float().square().mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        if plant is not None:
            plant(model)


def train_step(model, optimizer, plant=None, seed=0):
    optimizer.zero_grad()
    backward(model, optimizer, plant, seed)
    optimizer.step()


def plant_inf(model):
    model.encoder["layer3"]["fc1"].weight.grad.view(-1)[-1] = float("inf")


@pytest.mark.parametrize("kind", SETUPS)
def test_names_the_layer_that_overflowed_by_its_module_qualified_name(kind):
    model, optimizer = setup(kind)
    train_step(model, optimizer)
    assert amp.last_overflow(optimizer) is None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, optimizer, plant_inf)
    report = amp.last_overflow(optimizer)
    assert (report.step, report.param_names, report.kinds) == (
        1, ["encoder.layer3.fc1.weight"], ["inf"]
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # skipped
    assert amp.last_overflow() == report  # the only optimizer of the latest initialize
    train_step(model, optimizer, seed=1)
    assert amp.last_overflow(optimizer) is None


def test_a_check_since_the_last_step_is_reported_before_the_step():
    model, optimizer = setup("fold")
    train_step(model, optimizer)
    optimizer.zero_grad()

    def plant(m):
        m.head.bias.grad[0] = float("nan")
        m.head.weight.grad[1, 1] = float("inf")

    backward(model, optimizer, plant)
    report = amp.last_overflow(optimizer)
    assert (report.step, report.param_names, report.kinds) == (
        1, ["head.weight", "head.bias"], ["inf", "nan"]
    )


def test_micro_batches_accumulate_into_one_report():
    # The fold kind checks the accumulated grads at every scale_loss: an inf from the first
    # micro-batch is seen twice but named once, with what the second added.
    model, optimizer = setup("fold")
    optimizer.zero_grad()
    backward(model, optimizer, plant_inf)
    backward(model, optimizer, lambda m: m.head.bias.grad.fill_(float("nan")), seed=1)
    optimizer.step()
    report = amp.last_overflow(optimizer)
    assert report.param_names == ["encoder.layer3.fc1.weight", "head.bias"]
    assert report.kinds == ["inf", "nan"]


def test_a_param_no_model_holds_is_named_by_its_place_in_the_optimizer():
    torch.manual_seed(0)
    model = Net()
    extra = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([{"params": model.parameters()}, {"params": [extra]}], lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    optimizer.zero_grad()
    loss = model(torch.randn(2, 6)).float().sum() + extra.sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        extra.grad[2] = float("nan")
    optimizer.step()
    assert amp.last_overflow(optimizer).param_names == ["group1.param0"]


def test_an_optimizer_skipped_for_another_ones_overflow_names_nothing_of_its_own():
    torch.manual_seed(0)
    model = Net()
    first = ampfuse.optimizers.FusedSGD(model.encoder.parameters(), lr=0.1)
    second = ampfuse.optimizers.FusedSGD(model.head.parameters(), lr=0.1)
    model, (first, second) = amp.initialize(model, [first, second], opt_level="O2", verbosity=0)
    x = torch.randn(2, 6)
    with amp.scale_loss(model(x).float().sum(), [first, second]) as scaled:
        scaled.backward()
        plant_inf(model)
    first.step()
    second.step()
    assert amp.last_overflow(first).param_names == ["encoder.layer3.fc1.weight"]
    report = amp.last_overflow(second)
    assert report.param_names == [] and "another rank or optimizer" in str(report)
    with pytest.raises(ValueError, match="2\\s+optimizers; pass the optimizer"):
        amp.last_overflow()


def test_turned_off_and_bad_values_are_refused():
    model, optimizer = setup("fold", attribute_overflow=False)
    train_step(model, optimizer, plant_inf)
    assert amp.skipped_steps(optimizer) == 1  # still skipped, just not attributed
    with pytest.raises(RuntimeError, match="attribute_overflow=False"):
        amp.last_overflow(optimizer)
    with pytest.raises(ValueError, match="attribute_overflow must be True or False"):
        amp.initialize(Net(), opt_level="O1", attribute_overflow=1)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("kind", ["fold", "masters"])
def test_the_summary_names_the_tensors_that_overflowed_most_often(kind):
    model, optimizer = setup(kind)
    handle = optimizer._ampfuse_amp
    handle.verbosity = 1
    records = _Records()
    log = logging.getLogger(f"test_amp_overflow.{kind}")
    log.addHandler(records)
    log.propagate = False
    handle.reporter = OverflowReporter(handle, log, every=6)

    def head_bias(m):
        m.head.bias.grad.fill_(float("nan"))

    plants = {1: plant_inf, 2: plant_inf, 4: head_bias, 5: plant_inf, 8: head_bias}
    for step in range(14):
        train_step(model, optimizer, plants.get(step), seed=step)
    # A summary is taken at the 6th and 12th scale_loss, before that call's optimizer step.
    assert records.messages == [
        "ampfuse.amp: 3 step(s) skipped for gradient overflow in the last 6 steps (3 in all); "
        "loss scale now 1. Most often: encoder.layer3.fc1.weight (2 steps), head.bias (1 step).",
        "ampfuse.amp: 2 step(s) skipped for gradient overflow in the last 6 steps (5 in all); "
        "loss scale now 1. Most often: encoder.layer3.fc1.weight (1 step), head.bias (1 step).",
    ]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", SETUPS)
def test_cuda_names_the_layer_that_overflowed(kind):
    torch.manual_seed(0)
    opt_level, make, num_losses = SETUPS[kind]
    model = Net().cuda()
    optimizer = make(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      num_losses=num_losses, verbosity=0)
    for step in range(3):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 6, device="cuda")).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
            if step == 1:
                plant_inf(model)
        optimizer.step()
    optimizer.zero_grad()
    loss = model(torch.randn(4, 6, device="cuda")).float().square().mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        plant_inf(model)
    report = amp.last_overflow(optimizer)
    assert (report.step, report.param_names) == (3, ["encoder.layer3.fc1.weight"])


@pytest.mark.parametrize("kind", ["inplace torch", "fold"], ids=["O1", "O2"])
def test_a_pickled_or_deep_copied_model_names_its_own_params(kind):
    # EMA helpers deepcopy the model and checkpoints pickle it, amp's handle included.
    import copy
    import io

    model, optimizer = setup(kind)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        handle = clone._ampfuse_amp
        names = handle.param_names.lookup()
        assert names[id(clone.head.bias)] == "head.bias"
        assert id(model.head.bias) not in names

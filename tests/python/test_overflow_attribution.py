"""GradScaler(attribute_overflow=True): last_overflow() names the gradients that held inf/nan."""

import copy
import pickle

import ampfuse
import pytest
import torch
from ampfuse.overflow import OverflowReport
from torch import nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(6, 8)
        self.layer3 = nn.ModuleDict({"fc1": nn.Linear(8, 8)})
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layer3["fc1"](self.layer1(x).relu()).relu())


OPTIMIZERS = {
    "FusedAdamW": lambda params: ampfuse.optimizers.FusedAdamW(params, lr=1e-3),
    "torch SGD": lambda params: torch.optim.SGD(params, lr=1e-2),
}


def backward(model, scaler, seed=0):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    scaler.scale(model(x).square().mean()).backward()


def step(model, optimizer, scaler, plant=None, seed=0):
    """One iteration; plant(model) may write inf/nan into grads after the backward."""
    optimizer.zero_grad()
    backward(model, scaler, seed)
    if plant is not None:
        plant(model)
    scaler.step(optimizer)
    scaler.update()


def set_grad(param, index, value):
    param.grad.view(-1)[index] = value


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_names_the_layer_whose_gradient_overflowed(name, where):
    torch.manual_seed(0)
    model = Encoder()
    optimizer = OPTIMIZERS[name](model.parameters())
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model)
    weight = model.layer3["fc1"].weight
    index = {"first": 0, "middle": weight.numel() // 2, "last": weight.numel() - 1}[where]
    step(model, optimizer, scaler)
    assert scaler.last_overflow() is None
    before = weight.detach().clone()
    step(model, optimizer, scaler, lambda m: set_grad(weight, index, float("inf")))
    report = scaler.last_overflow()
    assert isinstance(report, OverflowReport)
    assert report.param_names == ["layer3.fc1.weight"]
    assert report.kinds == ["inf"]
    assert report.step == 1
    assert torch.equal(weight.detach(), before)  # the step was skipped
    step(model, optimizer, scaler)
    assert scaler.last_overflow() is None  # a clean step: the report is gone


def test_inf_nan_and_both_in_several_tensors_of_mixed_dtypes():
    torch.manual_seed(0)
    model = Encoder()
    model.layer1.to(torch.bfloat16)
    model.head.to(torch.float16)
    optimizer = ampfuse.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model.named_parameters())

    def plant(m):
        set_grad(m.layer1.bias, 0, float("nan"))
        set_grad(m.head.weight, 3, float("-inf"))
        set_grad(m.head.weight, 5, float("nan"))

    optimizer.zero_grad()
    x = torch.randn(4, 6)
    h = model.layer1(x.bfloat16()).float().relu()
    out = model.head(model.layer3["fc1"](h).relu().half())
    scaler.scale(out.float().square().mean()).backward()
    plant(model)
    scaler.step(optimizer)
    scaler.update()
    report = scaler.last_overflow()
    assert report.param_names == ["layer1.bias", "head.weight"]
    assert report.kinds == ["nan", "inf and nan"]
    assert str(report) == (
        "overflow at step 0 in 2 tensors: layer1.bias (nan), head.weight (inf and nan)"
    )


def test_unnamed_params_are_named_by_their_place_in_the_optimizer():
    model = Encoder()
    optimizer = torch.optim.SGD(
        [{"params": model.layer1.parameters()}, {"params": model.head.parameters(), "lr": 0.1}],
        lr=1e-2,
    )
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    step(model, optimizer, scaler, lambda m: set_grad(m.head.bias, 1, float("nan")))
    assert scaler.last_overflow().param_names == ["group1.param1"]


def test_step_counts_every_step_of_the_optimizer_taken_or_skipped():
    model = Encoder()
    optimizer = ampfuse.optimizers.FusedSGD(model.parameters(), lr=1e-2)
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    steps = []
    for i in range(5):
        plant = (lambda m: set_grad(m.head.bias, 0, float("inf"))) if i in (1, 3) else None
        step(model, optimizer, scaler, plant, seed=i)
        report = scaler.last_overflow()
        steps.append(None if report is None else report.step)
    assert steps == [None, 1, None, 3, None]


def test_unscale_then_last_overflow_before_step_describes_the_pending_step():
    model = Encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model)
    step(model, optimizer, scaler)
    optimizer.zero_grad()
    backward(model, scaler)
    set_grad(model.layer1.weight, 0, float("inf"))
    scaler.unscale_(optimizer)
    report = scaler.last_overflow(optimizer)
    assert (report.step, report.param_names) == (1, ["layer1.weight"])
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_overflow(optimizer).step == 1


def test_float64_and_strided_gradients_are_named_too():
    # float64 grads go to torch's op and strided ones to ours (through a copy): both attributed.
    a = nn.Parameter(torch.ones(4, dtype=torch.float64))
    b = nn.Parameter(torch.ones(4, 6))
    optimizer = torch.optim.SGD([a, b], lr=0.1)
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters([("a", a), ("b", b)])
    scaler.scale((a.sum() + b.sum()).float())
    a.grad = torch.full_like(a, float("nan"))
    b.grad = torch.ones(4, 12)[:, ::2]
    b.grad[2, 3] = float("inf")
    assert b.grad.stride() == (12, 2)  # not dense
    scaler.step(optimizer)
    scaler.update()
    report = scaler.last_overflow()
    assert (report.param_names, report.kinds) == (["a", "b"], ["nan", "inf"])


def test_off_by_default_and_misuse_is_refused_with_the_fix():
    scaler = ampfuse.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="attribute_overflow=True"):
        scaler.last_overflow()
    with pytest.raises(RuntimeError, match="attribute_overflow=True"):
        scaler.name_parameters(Encoder())
    with pytest.raises(ValueError, match="attribute_overflow must be True or False"):
        ampfuse.GradScaler("cpu", attribute_overflow="yes")
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    with pytest.raises(TypeError, match=r"\(name, param\) pairs"):
        scaler.name_parameters("encoder")
    with pytest.raises(TypeError, match=r"item 0 .* not a \(name, param\) pair"):
        scaler.name_parameters([torch.ones(1)])


def test_several_optimizers_need_the_optimizer_named():
    model = Encoder()
    first = torch.optim.SGD(model.layer1.parameters(), lr=0.1)
    second = ampfuse.optimizers.FusedAdamW(model.head.parameters(), lr=0.1)
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model)
    first.zero_grad()
    second.zero_grad()
    backward(model, scaler)
    set_grad(model.head.weight, 0, float("nan"))
    scaler.step(first)
    scaler.step(second)
    scaler.update()
    assert scaler.last_overflow(first) is None
    assert scaler.last_overflow(second).param_names == ["head.weight"]
    with pytest.raises(ValueError, match="2 optimizers were checked; pass the optimizer"):
        scaler.last_overflow()


def test_names_follow_the_model_as_it_is_when_the_report_is_made():
    model = Encoder()
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model)
    model.head = nn.Linear(8, 2)  # replaced after naming: looked up at report time
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer, scaler, lambda m: set_grad(m.head.weight, 0, float("inf")))
    assert scaler.last_overflow().param_names == ["head.weight"]


def test_a_copy_of_the_scaler_keeps_the_option_and_no_history():
    model = Encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model)
    step(model, optimizer, scaler, lambda m: set_grad(m.head.weight, 0, float("inf")))
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.last_overflow() is None
        step(model, optimizer, clone, lambda m: set_grad(m.head.bias, 0, float("nan")))
        assert clone.last_overflow().param_names == ["group0.param5"]


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cuda_names_the_layer_whose_gradient_overflowed(name):
    model = Encoder().cuda()
    optimizer = OPTIMIZERS[name](model.parameters())
    scaler = ampfuse.GradScaler("cuda", attribute_overflow=True)
    scaler.name_parameters(model)
    for i in range(3):
        optimizer.zero_grad()
        x = torch.randn(4, 6, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if i == 1:
            model.layer3["fc1"].weight.grad[2, 3] = float("nan")
            model.head.bias.grad[1] = float("-inf")
        scaler.step(optimizer)
        scaler.update()
        report = scaler.last_overflow()
        if i == 1:
            assert (report.step, report.param_names, report.kinds) == (
                1, ["layer3.fc1.weight", "head.bias"], ["nan", "inf"]
            )
        else:
            assert report is None


def test_a_scaler_pickled_before_attribution_existed_loads_with_it_off():
    state = ampfuse.GradScaler("cpu").__getstate__()
    del state["_overflow"]
    scaler = ampfuse.GradScaler.__new__(ampfuse.GradScaler)
    scaler.__setstate__(state)
    model = Encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer, scaler)
    with pytest.raises(RuntimeError, match="attribute_overflow=True"):
        scaler.last_overflow()


def test_recording_reads_nothing_back_until_last_overflow_is_called(monkeypatch):
    # The fused path takes no host read; attribution must not add one, even on an overflow.
    model = Encoder()
    optimizer = ampfuse.optimizers.FusedAdamW(model.parameters(), lr=1e-3)
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model)

    def forbidden(*args, **kwargs):
        raise AssertionError("a host read while recording overflow attribution")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for i in range(4):
        plant = (lambda m: set_grad(m.layer1.bias, 2, float("nan"))) if i == 2 else None
        step(model, optimizer, scaler, plant, seed=i)
    monkeypatch.undo()
    assert scaler.last_overflow() is None  # step 3 was clean


# ---- the optimizers' own check (skip_nonfinite, no scaler): last_overflow() on the optimizer ----


def _own_check_step(model, optimizer, plant=None, seed=0):
    optimizer.zero_grad()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    device = next(model.parameters()).device
    model(x.to(device, torch.bfloat16)).float().square().mean().backward()
    if plant is not None:
        plant(model)
    optimizer.step()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("cls", ["FusedAdamW", "FusedSGD"])
def test_optimizer_own_check_names_the_grads_it_skipped_for(device, cls, where):
    """bf16 training without a scaler: skip_nonfinite's check flags the grads in its own pass,
    and last_overflow() names them by the names torch keeps for named parameters."""
    torch.manual_seed(0)
    model = Encoder().to(device=device, dtype=torch.bfloat16)
    optimizer = getattr(ampfuse.optimizers, cls)(model.named_parameters(), lr=1e-3,
                                                 skip_nonfinite=None)
    assert optimizer.last_overflow() is None  # before any step
    _own_check_step(model, optimizer)
    assert optimizer.last_overflow() is None  # a clean step
    weight = model.layer3["fc1"].weight
    index = {"first": 0, "middle": weight.numel() // 2, "last": weight.numel() - 1}[where]

    def plant(m):
        set_grad(m.layer3["fc1"].weight, index, float("nan"))
        set_grad(m.head.bias, 0, float("inf"))
        set_grad(m.head.bias, 1, float("nan"))

    _own_check_step(model, optimizer, plant)
    report = optimizer.last_overflow()
    assert isinstance(report, OverflowReport) and bool(optimizer.last_step_skipped)
    assert report.step == 1
    assert report.param_names == ["layer3.fc1.weight", "head.bias"]
    assert report.kinds == ["nan", "inf and nan"]
    assert "layer3.fc1.weight (nan)" in str(report)
    _own_check_step(model, optimizer, seed=1)
    assert optimizer.last_overflow() is None  # the next clean step does not keep the last one


def test_optimizer_own_check_names_unnamed_params_by_place():
    model = Encoder().to(torch.bfloat16)
    groups = [{"params": list(model.layer1.parameters())},
              {"params": list(model.head.parameters()), "lr": 1e-4}]
    optimizer = ampfuse.optimizers.FusedAdam(groups, lr=1e-3, skip_nonfinite=True)
    _own_check_step(model, optimizer, lambda m: set_grad(m.head.bias, 1, float("-inf")))
    assert optimizer.last_overflow().param_names == ["group1.param1"]


def test_optimizer_leaves_a_scaler_driven_step_to_the_scaler():
    """With a found_inf handed over, the scaler decided; the optimizer reports nothing, even
    when skip_nonfinite=True checked on top of it."""
    model = Encoder().to(torch.bfloat16)
    optimizer = ampfuse.optimizers.FusedAdamW(model.named_parameters(), skip_nonfinite=True)
    optimizer.zero_grad()
    model(torch.randn(4, 6).to(torch.bfloat16)).float().sum().backward()
    set_grad(model.head.weight, 0, float("inf"))
    optimizer.step(found_inf=torch.ones(()))
    assert bool(optimizer.last_step_skipped) and optimizer.last_overflow() is None


@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy", "pickle"])
def test_optimizer_overflow_report_does_not_travel(how):
    """A report belongs to the step that made it: a loaded or copied optimizer has none."""
    model = Encoder().to(torch.bfloat16)
    optimizer = ampfuse.optimizers.FusedAdamW(model.named_parameters(), skip_nonfinite=None)
    _own_check_step(model, optimizer, lambda m: set_grad(m.head.bias, 0, float("nan")))
    assert optimizer.last_overflow().param_names == ["head.bias"]
    if how == "load_state_dict":
        optimizer.load_state_dict(optimizer.state_dict())
        other = optimizer
    elif how == "deepcopy":
        other = copy.deepcopy(optimizer)
    else:
        other = pickle.loads(pickle.dumps(optimizer))
    assert other.last_overflow() is None


def test_optimizer_report_survives_its_param_leaving_the_optimizer():
    """A param removed from the optimizer after the skipped step is still reported, under the
    place amp's reports give such a param."""
    model = Encoder().to(torch.bfloat16)
    groups = [{"params": list(model.layer1.parameters())},
              {"params": list(model.head.parameters())}]
    optimizer = ampfuse.optimizers.FusedAdamW(groups, skip_nonfinite=True)
    _own_check_step(model, optimizer, lambda m: set_grad(m.head.weight, 3, float("inf")))
    optimizer.param_groups.pop()
    assert optimizer.last_overflow().param_names == ["group-1.param-1"]


def test_one_rule_names_a_param_in_every_report():
    """GradScaler's, the optimizers' and amp's reports and amp's summaries name a param with one
    function: the model's name for it when known, else its place in the optimizer."""
    from ampfuse.overflow import place_in_groups, report_name

    a, b, c = (torch.zeros(1) for _ in range(3))
    groups = [{"params": [a]}, {"params": [b, c]}]
    assert place_in_groups(groups, c) == (1, 1)
    assert place_in_groups(groups, torch.zeros(1)) == (-1, -1)
    assert report_name({id(c): "head.bias"}, c, 1, 1) == "head.bias"
    assert report_name({id(a): "layer1.weight"}, c, *place_in_groups(groups, c)) == "group1.param1"
    assert report_name({id(c): ""}, c, 1, 1) == "group1.param1"  # an empty name is no name

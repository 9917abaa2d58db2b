"""Masters that follow the model, checkpoints apex wrote, and re-running initialize.

Real resume code calls amp.initialize first and loads the model's weights after it; fine-tuning
code loads pretrained weights after it. The fp32 masters must follow whatever the model holds
when the next step runs, and the exact fp32 values when a checkpoint brings them.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from amp_models import make_model, make_optimizer, train_steps
from ampfuse import amp
from helpers import raises_naming

OPTIMIZERS = ("FusedAdam", "AdamW", "SGD")


def _o2(seed, name, **options):
    options.setdefault("loss_scale", "dynamic")  # bf16 (the CPU default) is unscaled otherwise
    model, batches = make_model("mlp", seed=seed)
    optimizer = make_optimizer(name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0, **options)
    return model, optimizer, batches


def _fp32_state(model):
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("load_optimizer", [False, True], ids=["model-only", "with-optimizer"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_order_initialize_then_load_keeps_the_loaded_weights(name, load_optimizer):
    model, optimizer, batches = _o2(0, name)
    train_steps(model, optimizer, amp, batches, 0, 6)
    saved_model, saved_optimizer = _fp32_state(model), copy.deepcopy(optimizer.state_dict())

    resumed, resumed_optimizer, _ = _o2(99, name)  # other initial weights: all must be loaded
    resumed.load_state_dict(saved_model)
    if load_optimizer:
        resumed_optimizer.load_state_dict(saved_optimizer)
    loaded = [p.detach().float().clone() for p in resumed.parameters()]
    train_steps(resumed, resumed_optimizer, amp, batches, 6, 7)
    for i, (p, before) in enumerate(zip(resumed.parameters(), loaded)):
        moved = (p.float() - before).abs().max().item()
        # One step moves a weight by about lr (0.01-0.05); the stale masters of the bug put
        # back the fresh initial weights, which are about 0.3 away.
        assert moved < 0.08, f"param {i} moved by {moved} in one step: masters were stale"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_loading_fp32_weights_gives_the_masters_their_exact_values(name):
    model, optimizer, _ = _o2(0, name)
    pretrained = {k: torch.randn_like(v, dtype=torch.float32) for k, v in
                  model.state_dict().items()}
    model.load_state_dict(pretrained)
    masters = list(amp.master_params(optimizer))
    for (key, value), master in zip(pretrained.items(), masters):
        assert master.dtype == torch.float32
        assert torch.equal(master, value), f"{key}: the master is not the loaded fp32 value"


@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_masters_follow_weights_written_in_place(name, steps_before):
    """A weight written under no_grad (weight surgery, EMA swap-in) before or between steps."""
    model, optimizer, batches = _o2(0, name)
    train_steps(model, optimizer, amp, batches, 0, steps_before)
    with torch.no_grad():
        model.fc1.weight.fill_(0.5)
    train_steps(model, optimizer, amp, batches, steps_before, steps_before + 1)
    assert (model.fc1.weight.float() - 0.5).abs().max().item() < 0.08


def test_own_checkpoint_loaded_back_keeps_the_masters_bits():
    """Loading the model's own (rounded) weights must not throw away the masters' extra bits."""
    model, optimizer, batches = _o2(0, "FusedAdam")
    train_steps(model, optimizer, amp, batches, 0, 4)
    before = [m.clone() for m in amp.master_params(optimizer)]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in before)
    model.load_state_dict(model.state_dict())
    for m, b in zip(amp.master_params(optimizer), before):
        assert torch.equal(m, b)


@pytest.mark.parametrize("name", ("FusedAdam", "AdamW"))
def test_add_param_group_after_initialize_gets_fp32_masters(name):
    model, optimizer, batches = _o2(0, name)
    extra = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    optimizer.add_param_group({"params": [extra], "lr": 1e-4, "weight_decay": 0.0})
    masters = [m for m in amp.master_params(optimizer) if m.shape == extra.shape]
    for step in range(3):
        x, y = batches(step)
        loss = F.cross_entropy(model(x), y) + (extra.float() * 1e-3).sum()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    masters = [m for m in amp.master_params(optimizer) if m.shape == extra.shape]
    assert masters and masters[-1].dtype == torch.float32
    # lr 1e-4 moves the weight less than bf16 can show at 1.0: only an fp32 master keeps it.
    assert masters[-1][0].item() < 1.0
    assert torch.equal(extra, masters[-1].to(torch.bfloat16))


# ---- amp.state_dict / load_state_dict -------------------------------------------------------


def test_state_dict_has_apex_entries_and_loads_an_apex_checkpoint():
    model, optimizer, _ = _o2(0, "FusedAdam")
    state = amp.state_dict()
    assert state["loss_scaler0"]["loss_scale"] == 2.0**16
    assert state["loss_scaler0"]["unskipped"] == 0
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17}})
    after = amp.state_dict()["loss_scaler0"]
    assert after["scale"] == 1024.0 and after["growth_tracker"] == 17
    assert amp._amp_state.loss_scalers[0].loss_scale() == 1024.0
    assert amp._amp_state.loss_scalers[0]._unskipped == 17


@pytest.mark.parametrize("bad", [
    {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}, "master_params": [[torch.zeros(3)]]},
    {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}, "model": {}},
    {"loss_scaler0": {"loss_scale": 8.0}, "loss_scaler1": {"loss_scale": 8.0}},
    {"loss_scaler0": {"loss_scale": float("inf"), "unskipped": 0}},
    {"loss_scaler0": {"scales": 8.0}},
], ids=["masters-mismatch", "foreign-key", "two-losses", "inf-scale", "unknown-entry"])
def test_a_wrong_amp_state_is_refused_and_changes_nothing(bad):
    model, optimizer, batches = _o2(0, "AdamW")
    train_steps(model, optimizer, amp, batches, 0, 2, overflow_steps=(1,))
    before = amp.state_dict()
    with raises_naming("amp.load_state_dict", "nothing was loaded"):
        amp.load_state_dict(bad)
    after = amp.state_dict()
    assert after["loss_scaler0"] == before["loss_scaler0"]
    for m, b in zip(after["master_params"][0], before["master_params"][0]):
        assert torch.equal(m, b)


def test_initialize_again_in_a_notebook_latest_wins():
    _o2(0, "FusedAdam")
    model, optimizer, batches = _o2(1, "AdamW")  # the first model is still alive
    train_steps(model, optimizer, amp, batches, 0, 2, overflow_steps=(0,))
    state = amp.state_dict()  # no optimizer: the latest initialize
    assert state["loss_scaler0"]["scale"] == 2.0**15
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 64.0, "unskipped": 0}})
    assert amp.state_dict(optimizer)["loss_scaler0"]["scale"] == 64.0

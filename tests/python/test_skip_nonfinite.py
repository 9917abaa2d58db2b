"""skip_nonfinite in FusedAdam/FusedAdamW/FusedSGD: a step whose grads hold inf/nan is skipped
whole on the device, with `last_step_skipped` and get_skipped_steps() reporting it.

Without a loss scaler (every bf16 run in the frameworks), one inf grad would otherwise turn
every param into NaN; with a scaler driving the step, the scaler's found_inf is the verdict and
the grads are not checked a second time. The default is off (False); None is the bf16 guard."""

import copy
import pickle

import ampfuse
import pytest
import torch
import torch.distributed as dist
from ampfuse.optimizers import FusedAdam, FusedAdamW, FusedSGD
from helpers import raises_naming
from ranks import run_on_ranks
from torch import nn

OPTIMIZERS = {
    "adamw": lambda params, **kw: FusedAdamW(params, lr=1e-2, **kw),
    "adamw_masters": lambda params, **kw: FusedAdamW(params, lr=1e-2, master_weights=True, **kw),
    "adam_amsgrad": lambda params, **kw: FusedAdam(params, lr=1e-2, amsgrad=True,
                                                   adam_w_mode=False, weight_decay=0.1, **kw),
    "sgd_momentum": lambda params, **kw: FusedSGD(params, lr=1e-2, momentum=0.9,
                                                  master_weights=True, **kw),
}


def make_model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def backward(model, step, scaler=None):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(6, 8, generator=gen).to(next(model.parameters()).dtype)
    loss = model(x).float().square().mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()


def snapshot(model, optimizer):
    """Every param and every state tensor, cloned (step counts included)."""
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    return params, state


def assert_same(a, b, what):
    (params_a, state_a), (params_b, state_b) = a, b
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        assert torch.equal(p, q), f"{what}: param {i} differs"
    for i, (s, t) in enumerate(zip(state_a, state_b)):
        assert sorted(s) == sorted(t), f"{what}: state {i} keys"
        for key in s:
            assert torch.equal(s[key], t[key]), f"{what}: state {i} {key} differs"


def plant(model, where, value):
    params = list(model.parameters())
    grad = params[{"first": 0, "middle": len(params) // 2, "last": -1}[where]].grad
    grad.view(-1)[{"first": 0, "middle": grad.numel() // 2, "last": -1}[where]] = value


@pytest.fixture
def check_calls(monkeypatch):
    """How many times the optimizers ran the non-finite check op."""
    from ampfuse.optimizers import _skip

    calls = []
    real = _skip.ops.multi_tensor_nonfinite_check_

    def counting(tensors, found_inf, tensor_flags=None):
        calls.append(len(tensors))
        real(tensors, found_inf, tensor_flags)

    monkeypatch.setattr(_skip.ops, "multi_tensor_nonfinite_check_", counting)
    return calls


@pytest.mark.parametrize(("where", "value"), [("first", float("inf")), ("middle", float("nan")),
                                              ("last", float("-inf"))], ids=["first", "middle",
                                                                            "last"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_planted_non_finite_grad_skips_the_whole_step(name, where, value):
    model = make_model()
    optimizer = OPTIMIZERS[name](model.parameters(), skip_nonfinite=None)
    assert optimizer.last_step_skipped is None
    backward(model, 0)
    optimizer.step()
    assert optimizer.last_step_skipped.dtype == torch.bool
    assert optimizer.last_step_skipped.shape == () and not optimizer.last_step_skipped
    optimizer.zero_grad()
    backward(model, 1)
    plant(model, where, value)
    before = snapshot(model, optimizer)

    optimizer.step()

    assert_same(snapshot(model, optimizer), before, "after the skipped step")
    assert bool(optimizer.last_step_skipped) and optimizer.get_skipped_steps() == 1


@pytest.mark.parametrize("bad_step", [0, 1])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_next_clean_step_equals_a_run_that_never_saw_the_bad_step(name, bad_step):
    runs = []
    for with_bad_step in (True, False):
        model = make_model()
        optimizer = OPTIMIZERS[name](model.parameters(), skip_nonfinite=None)
        for step in range(3):
            if step == bad_step and with_bad_step:
                backward(model, 50)
                plant(model, "middle", float("nan"))
                optimizer.step()
                optimizer.zero_grad()
            backward(model, step)
            optimizer.step()
            optimizer.zero_grad()
        runs.append(snapshot(model, optimizer))
        assert optimizer.get_skipped_steps() == int(with_bad_step)
    assert_same(runs[0], runs[1], "with a skipped step vs without")


def test_a_bad_grad_in_one_group_skips_every_group():
    model = make_model()
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    optimizer = FusedAdamW([{"params": first}, {"params": second, "lr": 0.1}],
                           skip_nonfinite=None)
    backward(model, 0)
    optimizer.step()
    backward(model, 1)
    second[-1].grad[0] = float("inf")
    before = snapshot(model, optimizer)
    optimizer.step()
    assert_same(snapshot(model, optimizer), before, "both groups")
    assert optimizer.get_skipped_steps() == 1


@pytest.mark.parametrize(("dtype", "skip"), [(torch.float32, None), (torch.bfloat16, False)])
def test_none_leaves_fp32_unchecked_and_the_default_checks_nothing(dtype, skip, check_calls):
    # The default is off: the check is one more read of every grad (docs/design/optimizers.md).
    model = make_model(dtype)
    optimizer = FusedAdamW(model.parameters()) if skip is False else FusedAdamW(
        model.parameters(), skip_nonfinite=skip)
    assert optimizer.param_groups[0]["skip_nonfinite"] is skip
    backward(model, 0)
    plant(model, "first", float("inf"))
    optimizer.step()
    assert check_calls == []
    assert not torch.isfinite(next(model.parameters())).all()  # as torch.optim.AdamW does
    assert not optimizer.last_step_skipped and optimizer.get_skipped_steps() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("bad_device", ["cpu", "cuda"])
def test_one_verdict_for_params_on_two_devices(bad_device):
    """An inf on one device skips the params on the other too (the verdict is summed across
    devices, and copied to the CPU before its kernels read it)."""
    model = make_model()
    params = list(model.parameters())
    for p in params[1::2]:
        p.data = p.data.cuda()
    optimizer = FusedAdamW(params, skip_nonfinite=None)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    next(p for p in params if p.device.type == bad_device).grad[0] = float("inf")
    before = [p.detach().clone() for p in params]
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert optimizer.last_step_skipped.device == params[0].device
    assert bool(optimizer.last_step_skipped) and optimizer.get_skipped_steps() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_true_and_false_force_the_check(dtype):
    for skip, expect_skipped in ((True, True), (False, False)):
        model = make_model(dtype)
        optimizer = FusedSGD(model.parameters(), lr=0.1, skip_nonfinite=skip)
        backward(model, 0)
        plant(model, "last", float("nan"))
        before = snapshot(model, optimizer)[0]
        optimizer.step()
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert unchanged == expect_skipped == bool(optimizer.last_step_skipped), skip


@pytest.mark.parametrize("driver", ["ampfuse", "torch", "found_inf_argument"])
def test_a_scaler_driving_the_step_is_the_verdict_without_a_second_check(driver, check_calls):
    model = make_model(torch.float16)
    optimizer = FusedAdamW(model.parameters(), skip_nonfinite=None)
    scaler = {"ampfuse": lambda: ampfuse.GradScaler("cpu", init_scale=2.0**8),
              "torch": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8)}.get(driver)
    scaler = scaler() if scaler else None
    for step in range(2):
        backward(model, step, scaler)
        if step == 1:
            plant(model, "middle", float("inf"))
        before = snapshot(model, optimizer)
        if scaler is None:
            found_inf = torch.full((1,), float(step == 1))
            optimizer.step(found_inf=found_inf)
            assert found_inf.item() == float(step == 1)  # the caller's flag is only read
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        assert bool(optimizer.last_step_skipped) == (step == 1)
    assert_same(snapshot(model, optimizer), before, "the step the scaler skipped")
    assert check_calls == [], "the grads were checked again"
    assert optimizer.get_skipped_steps() == 1


def test_true_checks_on_top_of_a_scaler_and_leaves_its_flag_alone(check_calls):
    model = make_model()
    optimizer = FusedAdamW(model.parameters(), skip_nonfinite=True)
    backward(model, 0)
    plant(model, "first", float("inf"))
    found_inf = torch.zeros(())
    before = snapshot(model, optimizer)[0]
    optimizer.step(found_inf=found_inf)
    assert check_calls == [4] and found_inf.item() == 0.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_last_step_skipped_is_a_new_tensor_each_step():
    model = make_model()
    optimizer = FusedAdamW(model.parameters(), skip_nonfinite=None)
    backward(model, 0)
    plant(model, "first", float("inf"))
    optimizer.step()
    first = optimizer.last_step_skipped
    optimizer.zero_grad()
    backward(model, 1)
    optimizer.step()
    assert bool(first) and not optimizer.last_step_skipped  # state of one step does not leak
    assert optimizer.get_skipped_steps() == 1


def test_capture_before_an_eager_step_with_a_verdict_is_refused_before_any_update():
    model = make_model()
    optimizer = FusedAdamW(model.parameters(), capturable=True)
    backward(model, 0)
    optimizer.step()  # eager: the state exists, and the default makes no verdict
    optimizer.param_groups[0]["skip_nonfinite"] = None
    optimizer._capturing = lambda compiling=None: True  # as in CUDA graph capture (needs a GPU)
    before = snapshot(model, optimizer)
    with raises_naming("captured in a CUDA graph", "run one step eagerly"):
        optimizer.step()
    assert_same(snapshot(model, optimizer), before, "after the refused capture")


@pytest.mark.parametrize("bad", ["yes", 1, 0, "auto"])
def test_unknown_values_are_refused_with_the_allowed_ones(bad):
    model = make_model()
    with raises_naming(r"skip_nonfinite=", "None", "True", "False"):
        FusedAdamW(model.parameters(), skip_nonfinite=bad)
    optimizer = FusedSGD(model.parameters())
    with raises_naming(r"param_groups\[1\] has skip_nonfinite="):
        optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))],
                                   "skip_nonfinite": bad})
    optimizer.param_groups[0]["skip_nonfinite"] = bad
    backward(model, 0)
    with raises_naming(r"param_groups\[0\] has skip_nonfinite="):
        optimizer.step()


def test_state_dict_keeps_the_option_and_the_count():
    model = make_model()
    optimizer = FusedAdamW(model.parameters(), skip_nonfinite=True)
    backward(model, 0)
    plant(model, "first", float("nan"))
    optimizer.step()
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["skip_nonfinite"] is True
    assert saved["skipped_steps"] == 1

    fresh = FusedAdamW(model.parameters(), skip_nonfinite=False)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["skip_nonfinite"] is True and fresh.get_skipped_steps() == 1
    optimizer.load_state_dict(saved)
    assert optimizer.last_step_skipped is None  # it described the step before the load

    # A checkpoint from before the option: the optimizer keeps its own value and count.
    old = copy.deepcopy(saved)
    del old["skipped_steps"]
    for group in old["param_groups"]:
        del group["skip_nonfinite"]
    older = FusedAdamW(model.parameters(), skip_nonfinite=False)
    older.load_state_dict(old)
    assert older.param_groups[0]["skip_nonfinite"] is False and older.get_skipped_steps() == 0
    torch.optim.AdamW(model.parameters()).load_state_dict(saved)  # torch takes it too

    restored = pickle.loads(pickle.dumps(fresh))
    assert restored.get_skipped_steps() == 1
    # An optimizer pickled before the option existed never checked, and still does not.
    state = fresh.__getstate__()
    del state["skipped_steps"], state["defaults"]["skip_nonfinite"]
    for group in state["param_groups"]:
        del group["skip_nonfinite"]
    unpickled = FusedAdamW.__new__(FusedAdamW)
    unpickled.__setstate__(state)
    unpickled.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    assert [g["skip_nonfinite"] for g in unpickled.param_groups] == [False, False]
    assert unpickled.get_skipped_steps() == 0
    with raises_naming("skipped_steps must be an int >= 0"):
        fresh.load_state_dict({**saved, "skipped_steps": -1})


def test_compiled_step_skips_like_the_eager_one():
    models = [make_model(), make_model()]
    optimizers = [FusedAdamW(m.parameters(), master_weights=True, skip_nonfinite=None)
                  for m in models]

    @torch.compile(backend="eager", fullgraph=True)
    def compiled_step():
        optimizers[0].step()

    for step in range(3):
        for model, optimizer, run in zip(models, optimizers, (compiled_step, optimizers[1].step)):
            backward(model, step)
            if step == 1:
                plant(model, "last", float("inf"))
            run()
            optimizer.zero_grad()
    assert_same(snapshot(models[0], optimizers[0]), snapshot(models[1], optimizers[1]), "compiled")
    assert optimizers[0].get_skipped_steps() == optimizers[1].get_skipped_steps() == 1


# ---- FSDP2: an inf in one rank's shard skips the step on every rank ---------------------------


def _fsdp2_skips():
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = make_model()
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    optimizer = FusedAdamW(model.named_parameters(), lr=1e-2, skip_nonfinite=None)
    unchanged, named = [], []
    for step in range(3):
        backward(model, step)
        if step == 1 and rank == 1:  # the reduce-scatter gave the inf to this rank only
            next(model.parameters()).grad.to_local()[0, 0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        unchanged.append(all(torch.equal(p.to_local(), b)
                             for p, b in zip(model.parameters(), before)))
        report = optimizer.last_overflow()
        named.append(report.param_names if report is not None else None)
    return {"unchanged": unchanged, "skipped": optimizer.get_skipped_steps(), "named": named}


def test_fsdp2_inf_in_one_shard_skips_every_rank(tmp_path):
    """...and both ranks name the sharded grad that held it (last_overflow(): the per-tensor
    flags are OR-ed over the shards in the collective that decides the step)."""
    ranks = run_on_ranks(_fsdp2_skips, world_size=2, timeout_s=60, out_dir=tmp_path)
    for rank, result in enumerate(ranks):
        assert result == {"unchanged": [False, True, False], "skipped": 1,
                          "named": [None, ["0.weight"], None]}, f"rank {rank}"

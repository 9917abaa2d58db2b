"""state_dict / load_state_dict of the fused optimizers: torch.optim's layout both ways, and exact
resumption (masters included). Helpers come from test_adam.py."""

import copy
import io

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import FusedAdam, FusedAdamW, FusedSGD
from helpers import dtype_id, raises_naming
from test_adam import (
    SHAPES,
    assert_parity,
    clone_params,
    make_params,
    run_both,
    set_grads,
    state_tensors,
    step_grads,
)
from tolerances import assert_close_report


def through_bytes(obj):
    """What torch.save + torch.load (weights_only, the default) give back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def train(opt, params, steps, first=0, grads_for=None):
    for step in range(first, first + steps):
        set_grads(params, grads_for(step, params) if grads_for else step_grads(params, step))
        opt.step()


def assert_torch_layout(state_dict, reference):
    """Same per-param keys as the torch.optim state dict `reference`, 'step' a float32 0-dim CPU
    tensor of its own per param, and every torch group key present."""
    assert state_dict["state"].keys() == reference["state"].keys()
    steps = []
    for index, entry in state_dict["state"].items():
        expected = reference["state"][index]
        assert set(expected) <= set(entry), f"state {index}: {sorted(entry)} vs {sorted(expected)}"
        if "step" in entry:
            step = entry["step"]
            assert step.dtype == torch.float32 and step.dim() == 0 and step.device.type == "cpu"
            assert float(step) == float(expected["step"])
            steps.append(step)
    assert len({id(s) for s in steps}) == len(steps), "params share a 'step' tensor"
    for group, expected in zip(state_dict["param_groups"], reference["param_groups"]):
        assert set(expected) <= set(group), f"group lacks {set(expected) - set(group)}"


ROUND_TRIPS = {
    "adam": (FusedAdam, dict(adam_w_mode=False), torch.optim.Adam, dict(weight_decay=0.1)),
    "adamw_amsgrad": (FusedAdamW, {}, torch.optim.AdamW, dict(amsgrad=True, weight_decay=0.05)),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_torch_to_fused_to_torch(case):
    """torch trains 10 steps; its checkpoint continues in the fused optimizer for 10 steps and
    the fused checkpoint in torch again for 10: all along it tracks one uninterrupted torch run."""
    fused_cls, fused_kwargs, torch_cls, torch_kwargs = ROUND_TRIPS[case]
    params = make_params(SHAPES, torch.float32, "cpu")
    ref_params = clone_params(params)
    ref = torch_cls(ref_params, lr=1e-2, **torch_kwargs)
    first = torch_cls(params, lr=1e-2, **torch_kwargs)
    run_both(first, ref, params, ref_params, 10)

    fused = fused_cls(params, lr=0.5, **fused_kwargs)  # lr and the rest come from the checkpoint
    fused.load_state_dict(through_bytes(first.state_dict()))
    assert fused.param_groups[0]["lr"] == 1e-2
    assert fused.param_groups[0]["adam_w_mode"] == (torch_cls is torch.optim.AdamW)
    train_pair = lambda a, b, start: [  # noqa: E731
        (set_grads(params, step_grads(params, s)), set_grads(ref_params, step_grads(params, s)),
         a.step(), b.step()) for s in range(start, start + 10)]
    train_pair(fused, ref, 10)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}] after 10 torch + 10 fused steps")

    saved = fused.state_dict()
    assert_torch_layout(saved, ref.state_dict())
    last = torch_cls(params, lr=0.5, **torch_kwargs)
    last.load_state_dict(through_bytes(saved))
    train_pair(last, ref, 20)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}] after 10 torch + 10 fused + 10 torch steps")
    assert float(last.state[params[0]]["step"]) == 30


def test_unequal_steps_in_a_torch_checkpoint_are_kept():
    """torch counts steps per param; a checkpoint in which params[1] missed steps loads with
    its own count and continues exactly as torch does."""
    params = make_params(SHAPES, torch.float32, "cpu")
    ref_params = clone_params(params)

    def grads_for(step, ps):
        grads = step_grads(ps, step)
        if step % 2:
            grads[1] = None
        return grads

    first = torch.optim.Adam(params, lr=1e-2)
    ref = torch.optim.Adam(ref_params, lr=1e-2)
    run_both(first, ref, params, ref_params, 9, grads_for=grads_for)
    fused = FusedAdam(params, adam_w_mode=False)
    fused.load_state_dict(through_bytes(first.state_dict()))
    assert float(fused.state[params[0]]["step"]) == 9 and float(fused.state[params[1]]["step"]) == 5
    run_both(fused, ref, params, ref_params, 10)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}]")
        assert float(fused.state[p]["step"]) == float(ref.state[q]["step"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_low_precision_torch_state_is_loaded_as_fp32(dtype):
    params = make_params(SHAPES[:3], dtype, "cpu")
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    train(torch_opt, params, 3)
    saved = torch_opt.state_dict()
    fused = FusedAdamW(params, master_weights=True)
    fused.load_state_dict(saved)
    for i, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            value = fused.state[p][key]
            assert value.dtype == torch.float32
            assert_close_report(value, saved["state"][i][key].float(), exact=True, msg=key)
        assert "master_param" not in fused.state[p]  # made from the param at the next step
    train(fused, params, 1, first=3)
    assert_close_report(params[0].detach(), fused.state[params[0]]["master_param"].to(dtype),
                        exact=True, msg="param vs master")


def test_fused_state_dict_keeps_fp32_moments_of_low_precision_params():
    params = make_params(SHAPES[:3], torch.bfloat16, "cpu")
    fused = FusedAdamW(params)
    train(fused, params, 2)
    for entry in fused.state_dict()["state"].values():
        assert entry["exp_avg"].dtype == torch.float32 and "master_param" not in entry


def make_model(dtype, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    return model.to(dtype)


def model_step(model, opt, step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 12, generator=gen).to(next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


RESUME_CASES = {
    "adamw_amsgrad_bf16": (FusedAdamW, dict(lr=1e-2, amsgrad=True, master_weights=True),
                           torch.bfloat16),
    "adam_fp16": (FusedAdam,
                  dict(lr=1e-2, adam_w_mode=False, weight_decay=0.01, master_weights=True),
                  torch.float16),
    "adam_fp32": (FusedAdam, dict(lr=1e-2), torch.float32),
    "sgd_bf16": (FusedSGD, dict(lr=1e-2, momentum=0.9, nesterov=True, master_weights=True),
                 torch.bfloat16),
}


@pytest.mark.parametrize("load_optimizer_first", [False, True],
                         ids=["model_first", "optimizer_first"])
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_from_checkpoint_is_bit_exact(case, load_optimizer_first):
    """20 steps in one go equal 10 steps, a checkpoint through torch.save/torch.load into a new
    model and optimizer, and 10 more: params, masters, moments and steps, bit for bit."""
    cls, kwargs, dtype = RESUME_CASES[case]
    straight = make_model(dtype, 0)
    straight_opt = cls(straight.parameters(), **kwargs)
    for step in range(20):
        model_step(straight, straight_opt, step)

    first = make_model(dtype, 0)
    first_opt = cls(first.parameters(), **kwargs)
    for step in range(10):
        model_step(first, first_opt, step)
    checkpoint = through_bytes({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    resumed = make_model(dtype, 1)
    resumed_opt = cls(resumed.parameters(), **kwargs)
    if load_optimizer_first:
        resumed_opt.load_state_dict(checkpoint["optimizer"])
        resumed.load_state_dict(checkpoint["model"])
    else:
        resumed.load_state_dict(checkpoint["model"])
        resumed_opt.load_state_dict(checkpoint["optimizer"])
    if kwargs.get("master_weights") and dtype != torch.float32:
        # The masters are the saved fp32 ones, not the rounded params upcast again.
        for i, p in enumerate(resumed.parameters()):
            master = resumed_opt.state[p]["master_param"]
            assert_close_report(master, checkpoint["optimizer"]["state"][i]["master_param"],
                                exact=True, msg="loaded master")
            assert not torch.equal(master, p.detach().float()), "master lost its low bits"
    for step in range(10, 20):
        model_step(resumed, resumed_opt, step)

    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert_close_report(q.detach(), p.detach(), exact=True, msg=f"resumed {name}")
    straight_state, resumed_state = state_tensors(straight_opt), state_tensors(resumed_opt)
    assert straight_state.keys() == resumed_state.keys()
    for key, value in straight_state.items():
        if cls is FusedSGD and key[2] == "step":
            # torch.optim.SGD saves no step count; FusedSGD's only tells the first step apart.
            assert float(resumed_state[key]) > 0
            continue
        assert_close_report(resumed_state[key], value, exact=True, msg=f"resumed state {key}")


def test_sgd_torch_to_fused_to_torch():
    kwargs = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)
    params = make_params(SHAPES, torch.float32, "cpu")
    ref_params = clone_params(params)
    ref = torch.optim.SGD(ref_params, **kwargs)
    first = torch.optim.SGD(params, **kwargs)
    run_both(first, ref, params, ref_params, 5)
    fused = FusedSGD(params, lr=1.0)
    fused.load_state_dict(through_bytes(first.state_dict()))
    assert fused.param_groups[0]["momentum"] == 0.9
    run_both(fused, ref, params, ref_params, 5)
    saved = fused.state_dict()
    assert_torch_layout(saved, ref.state_dict())
    last = torch.optim.SGD(params, lr=1.0)
    last.load_state_dict(through_bytes(saved))
    run_both(last, ref, params, ref_params, 5)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}]")


def test_sgd_without_momentum_saves_no_state_like_torch():
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    fused = FusedSGD(params, lr=1e-2)
    train(fused, params, 2)
    assert fused.state_dict()["state"] == {}


def test_checkpoint_from_before_the_first_step_loads_and_starts_fresh():
    params = make_params(SHAPES[:3], torch.bfloat16, "cpu")
    fused = FusedAdamW(params, master_weights=True)
    fused.master_params()  # makes masters, no step state yet
    saved = fused.state_dict()
    assert saved["state"] == {}
    torch.optim.AdamW(clone_params(params)).load_state_dict(saved)
    again = FusedAdamW(params, master_weights=True)
    again.load_state_dict(saved)
    train(again, params, 1)
    assert float(again.state[params[0]]["step"]) == 1


def test_state_dict_is_a_snapshot_of_the_step_count():
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    fused = FusedAdam(params)
    train(fused, params, 2)
    saved = fused.state_dict()
    saved["state"][0]["step"].fill_(100.0)
    train(fused, params, 1, first=2)
    assert float(fused.state[params[0]]["step"]) == 3
    assert float(saved["state"][1]["step"]) == 2


def test_torch_adamw_checkpoint_sets_adam_w_mode_and_fused_adamw_stays_adamw():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    adamw = torch.optim.AdamW(params)
    adam = torch.optim.Adam(params)
    fused = FusedAdam(params, adam_w_mode=False)
    fused.load_state_dict(adamw.state_dict())
    assert fused.param_groups[0]["adam_w_mode"] is True
    assert "decoupled_weight_decay" not in fused.param_groups[0]
    fused_w = FusedAdamW(params)
    fused_w.load_state_dict(adam.state_dict())
    assert fused_w.param_groups[0]["adam_w_mode"] is True
    assert fused_w.state_dict()["param_groups"][0]["decoupled_weight_decay"] is True


def test_state_dict_hooks_still_run():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    fused = FusedAdam(params)
    train(fused, params, 1)
    calls = []
    fused.register_state_dict_pre_hook(lambda opt: calls.append("save_pre"))
    fused.register_state_dict_post_hook(lambda opt, sd: calls.append("save_post"))
    fused.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("load_pre"))
    fused.register_load_state_dict_post_hook(lambda opt: calls.append("load_post"))
    fused.load_state_dict(fused.state_dict())
    assert calls == ["save_pre", "save_post", "load_pre", "load_post"]


# ---- bad checkpoints ---------------------------------------------------------------------------


def test_wrong_number_of_groups_or_params():
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    one_group = FusedAdam(params)
    train(one_group, params, 1)
    two_groups = FusedAdam([{"params": params[:1]}, {"params": params[1:]}])
    with raises_naming("param groups"):
        two_groups.load_state_dict(one_group.state_dict())
    fewer = FusedAdam(params[:2])
    with raises_naming(r"param_groups\[0\]", "params"):
        fewer.load_state_dict(one_group.state_dict())


def test_state_of_another_shape_is_named():
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    fused = FusedAdam(params)
    train(fused, params, 1)
    saved = fused.state_dict()
    saved["state"][2]["exp_avg"] = torch.zeros(5)
    with raises_naming(r"param_groups\[0\]\['params'\]\[2\]", "exp_avg", "shape"):
        FusedAdam(params).load_state_dict(saved)


def test_adam_state_missing_keys_is_named():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    fused = FusedAdam(params)
    train(fused, params, 1)
    saved = fused.state_dict()
    del saved["state"][1]["exp_avg_sq"]
    with raises_naming(r"param_groups\[0\]\['params'\]\[1\]", "exp_avg_sq"):
        FusedAdam(params).load_state_dict(saved)


def test_sgd_checkpoint_into_adam_is_rejected_and_changes_nothing():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    train(sgd, params, 1)
    fused = FusedAdam(params, lr=1e-2)
    train(fused, params, 1)
    before = {k: v.clone() for k, v in state_tensors(fused).items()}
    with raises_naming(r"param_groups\[0\]", "momentum"):
        fused.load_state_dict(sgd.state_dict())
    assert fused.param_groups[0]["lr"] == 1e-2 and "momentum" not in fused.param_groups[0]
    after = state_tensors(fused)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert_close_report(after[key], value, exact=True, msg=str(key))


def test_deepcopy_keeps_shared_steps_and_options():
    params = make_params(SHAPES, torch.bfloat16, "cpu")
    fused = FusedAdamW(params, lr=1e-2, master_weights=True, set_grad_none=False)
    train(fused, params, 3)
    twin = copy.deepcopy(fused)
    twin_params = [p for group in twin.param_groups for p in group["params"]]
    assert twin.set_grad_none is False
    assert len({id(twin.state[p]["step"]) for p in twin_params}) == 1
    train(fused, params, 2, first=3)
    train(twin, twin_params, 2, first=3)
    for p, q in zip(params, twin_params):
        assert_close_report(q.detach(), p.detach(), exact=True, msg="deep-copied optimizer")


@pytest.mark.cuda
def test_capturable_groups_save_the_step_on_the_device():
    params = make_params(SHAPES[:2], torch.float32, "cuda")
    fused = FusedAdam(params, capturable=True)
    train(fused, params, 2)
    saved = fused.state_dict()
    for entry in saved["state"].values():
        assert entry["step"].device.type == "cuda" and float(entry["step"]) == 2
    torch_opt = torch.optim.Adam(clone_params(params), capturable=True)
    torch_opt.load_state_dict(saved)


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD"])
def test_masters_follow_weights_loaded_into_the_model_between_steps(name):
    """A torch user's FusedAdam(master_weights=True): weights loaded into the model after some
    steps (fine-tuning from a checkpoint) must not be overwritten by the stale masters."""
    from ampfuse.optimizers import FusedAdam, FusedSGD

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    cls = {"FusedAdam": FusedAdam, "FusedSGD": FusedSGD}[name]
    optimizer = cls(model.parameters(), lr=1e-3, master_weights=True)
    for _ in range(2):
        model(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    pretrained = {k: torch.full_like(v, 0.25, dtype=torch.float32)
                  for k, v in model.state_dict().items()}
    model.load_state_dict(pretrained)
    model(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    optimizer.step()
    for p in model.parameters():
        assert (p.float() - 0.25).abs().max().item() < 0.01, "stale masters were written back"
    # The model's own rounded weights loaded back: the masters keep their extra bits, so the
    # next step is the one a run without the load takes.
    twin_model, twin_optimizer = copy.deepcopy((model, optimizer))
    model.load_state_dict(model.state_dict())
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    for m, o in ((model, optimizer), (twin_model, twin_optimizer)):
        o.zero_grad()
        m(x).float().pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), twin_model.parameters()):
        master, twin = optimizer.state[p]["master_param"], twin_optimizer.state[q]["master_param"]
        assert torch.equal(master, twin)

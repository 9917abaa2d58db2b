"""FusedAdam/FusedAdamW/FusedSGD/FusedAdagrad/FusedLAMB/FusedNovoGrad with master_weights
"stochastic", "kahan" and "split": bf16 params without fp32 masters (issue 11, part 2). The ops
themselves: test_bf16_master_ops.py; what is Adagrad's, LAMB's and NovoGrad's own:
test_adagrad_bf16_modes.py, test_lamb_bf16_modes.py and test_novograd_bf16_modes.py."""

import copy
import io

import pytest
import torch

from ampfuse.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedAdamW,
    FusedLAMB,
    FusedNovoGrad,
    FusedSGD,
)
from ampfuse.optimizers._precision import EXTRA_BYTES_PER_PARAM, precise_value, split_halves
from helpers import raises_naming
from tolerances import assert_close_report

BF16_MODES = ["stochastic", "kahan", "split"]
ALL_MODES = [True, False] + BF16_MODES
MODE_IDS = {True: "True", False: "False"}


def mode_id(mode):
    return MODE_IDS.get(mode, mode)


def make_model(seed=0, dtype=torch.bfloat16):
    """A small MLP whose weights all have magnitudes in [0.5, 1): a bf16 ulp there is 2^-8, so
    an update's size says at once how far below bf16's resolution it is."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.where(p < 0, -1.0, 1.0) * (0.5 + 0.5 * torch.rand_like(p)))
    return model.to(dtype)


def batches(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen))
            for _ in range(steps)]


KINDS = ["adamw", "sgd", "adagrad", "lamb", "novograd"]


def make_optimizer(kind, params, mode, lr, **extra):
    if kind == "lamb":  # weight decay on, so every step scales by a trust ratio
        return FusedLAMB(params, lr=lr, master_weights=mode, **{"weight_decay": 0.01, **extra})
    if kind == "novograd":  # weight decay on: split's decay must see the joined master
        return FusedNovoGrad(params, lr=lr, master_weights=mode,
                             **{"weight_decay": 0.01, **extra})
    if kind == "adamw":
        return FusedAdamW(params, lr=lr, weight_decay=0.0, master_weights=mode, **extra)
    if kind == "adagrad":
        # L2 decay and an lr decay, so that the update reads the param and the step count:
        # split's decay must see the joined master, not the truncated param.
        return FusedAdagrad(params, lr=lr, master_weights=mode,
                            **{"weight_decay": 0.01, "lr_decay": 0.01, **extra})
    return FusedSGD(params, lr=lr, momentum=0.9, master_weights=mode, **extra)


def train(model, optimizer, data):
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def values(model, optimizer):
    """Each param's precise value: its fp32 master, or what its mode's state stands for."""
    return [precise_value(p, optimizer.state[p]) for p in model.parameters()]


def linear_model():
    """Linear(64, 32) with every weight's magnitude in [0.5, 1), where a bf16 ulp is 2^-8."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.where(p < 0, -1.0, 1.0) * (0.5 + 0.5 * torch.rand_like(p)))
    return model.to(torch.bfloat16)


# Per-step updates of at most 8e-5 (Adam), 2.5e-4 (SGD with momentum), 7.7e-5 (LAMB, about
# lr * ||p|| / ||update||) and 3.3e-4 (NovoGrad, about lr * |g| / ||g|| times its bias
# corrections), measured: 1/24, 1/8, 1/25 and 1/6 of half a bf16 ulp at these weights, so each
# one alone rounds away. Adagrad's steps are at most clr (the first is clr * sign(g)),
# shrinking as 1 / sqrt(t): all below half an ulp.
TINY_LR = {"adamw": 8e-5, "sgd": 1.6e-3, "adagrad": 8e-4, "lamb": 1e-4, "novograd": 3e-3}


@pytest.mark.parametrize("kind", KINDS)
def test_updates_below_bf16_resolution(kind):
    """False stalls; stochastic and kahan follow the fp32-master run; split's masters and the
    rest of its state (moments, momentum buffers, sums) are True's bit for bit. The loss is
    linear in the outputs, so the grads do not depend on the weights and every run sees the
    same ones (split's params are its masters rounded, ties away from zero, which could
    otherwise change its grads at a tie)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    target = torch.randn(64, 32, generator=gen)
    start = linear_model()
    runs = {}
    for mode in ALL_MODES:
        model = copy.deepcopy(start)
        optimizer = make_optimizer(kind, model.parameters(), mode, TINY_LR[kind])
        for _ in range(100):
            optimizer.zero_grad()
            (model(x).float() * target).mean().backward()
            optimizer.step()
        runs[mode] = (model, optimizer)
    reference = values(*runs[True])
    initial = [p.detach().float() for p in start.parameters()]
    moved = sum((r - i).abs().sum() for r, i in zip(reference, initial))

    for p, q in zip(runs[False][0].parameters(), start.parameters()):
        assert torch.equal(p, q), "master_weights=False should stall: updates below half an ulp"

    def along_reference(mode):
        """Movement in the reference's direction, relative to the reference's (1: the same)."""
        return sum(((v - i) * torch.sign(r - i)).sum() for v, i, r in
                   zip(values(*runs[mode]), initial, reference)) / moved

    def distance(mode):
        return sum((v - r).abs().sum() for v, r in zip(values(*runs[mode]), reference)) / moved

    # Measured (Adam / SGD / Adagrad / LAMB / NovoGrad): stochastic 1.00 / 1.02 / 1.02 / 1.00 /
    # 1.02 along the reference (noisy per element: distance 0.54 / 0.67 / 0.44 / 0.55 / 0.95),
    # kahan 0.98 / 1.00 / 1.00 / 1.00 / 1.00 (distance 0.02 / 0.01 / 0.0007 / 0.006 / 0.018; its
    # compensation has 8 bits).
    assert 0.9 < along_reference("stochastic") < 1.1
    assert 0.9 < along_reference("kahan") < 1.1 and distance("kahan") < 0.1

    split_model, split_opt = runs["split"]
    true_model, true_opt = runs[True]
    for i, (p, master) in enumerate(zip(split_model.parameters(), reference)):
        assert_close_report(precise_value(p, split_opt.state[p]), master, exact=True,
                            msg=f"split master {i}")
        high, _ = split_halves(master)
        assert torch.equal(p.detach().view(torch.int16), high), "param is the master rounded"
        true_state = true_opt.state[list(true_model.parameters())[i]]
        shared = [k for k in true_state if k != "master_param" and k in split_opt.state[p]]
        assert shared, f"param {i}: no state to compare"
        for key in shared:
            assert_close_report(split_opt.state[p][key], true_state[key], exact=True,
                                msg=f"split {key} {i}")


@pytest.mark.parametrize("kind", KINDS)
def test_stochastic_is_reproducible_and_resumes_bit_for_bit(kind):
    data = batches(6)
    start = make_model()

    def run(seed, steps, checkpoint_at=None):
        model = copy.deepcopy(start)
        optimizer = make_optimizer(kind, model.parameters(), "stochastic", 1e-3,
                                   rounding_seed=seed)
        saved = None
        for step, batch in enumerate(data[:steps]):
            if step == checkpoint_at:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, buffer)
                saved = buffer.getvalue()
            train(model, optimizer, [batch])
        return model, saved

    first, saved = run(7, 6, checkpoint_at=3)
    again, _ = run(7, 6)
    other_seed, _ = run(8, 6)
    for p, q in zip(first.parameters(), again.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    assert any(not torch.equal(p, q) for p, q in zip(first.parameters(), other_seed.parameters()))

    checkpoint = torch.load(io.BytesIO(saved))
    resumed = make_model(seed=99)
    resumed.load_state_dict(checkpoint["model"])
    optimizer = make_optimizer(kind, resumed.parameters(), "stochastic", 1e-3, rounding_seed=0)
    optimizer.load_state_dict(checkpoint["opt"])
    assert optimizer.param_groups[0]["rounding_seed"] == 7  # the seed comes with the groups
    train(resumed, optimizer, data[3:6])
    for p, q in zip(first.parameters(), resumed.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


def _snapshot(model, optimizer):
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ALL_MODES, ids=mode_id)
def test_overflow_skips_every_mode(kind, mode):
    """A set found_inf writes nothing: params, moments, sums, compensations, low halves, step."""
    model = make_model()
    optimizer = make_optimizer(kind, model.parameters(), mode, 1e-2)
    data = batches(3)
    train(model, optimizer, data[:2])
    before = _snapshot(model, optimizer)
    loss = torch.nn.functional.mse_loss(model(data[2][0].to(torch.bfloat16)).float(), data[2][1])
    loss.backward()
    optimizer.step(found_inf=torch.ones(()))
    after = _snapshot(model, optimizer)
    assert len(before) == len(after)
    for i, (b, a) in enumerate(zip(before, after)):
        assert_close_report(a, b, exact=True, msg=f"tensor {i} after a skipped step")
    assert bool(optimizer.last_step_skipped)


def _step_nothing(model, optimizer):
    """One step whose update is the identity (lr 0, no decay): the state it leaves is the loaded
    state converted to the optimizer's mode."""
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()


# The state besides the param's value, which a checkpoint carries over unchanged.
KEPT_STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",),
              "lamb": ("exp_avg", "exp_avg_sq"), "novograd": ("exp_avg", "norm_avg")}


@pytest.mark.parametrize("kind", list(KEPT_STATE))
@pytest.mark.parametrize("target", ALL_MODES, ids=mode_id)
@pytest.mark.parametrize("source", ALL_MODES, ids=mode_id)
def test_checkpoints_convert_between_modes(source, target, kind):
    """A checkpoint of any mode loads into any other: the precise value is kept exactly where the
    target can hold it (True, split), to about 16 bits by kahan, rounded to nearest otherwise;
    the moments (sums) come along unchanged."""
    model = make_model()
    optimizer = make_optimizer(kind, model.parameters(), source, 3e-3)
    train(model, optimizer, batches(4))
    saved = [v.clone() for v in values(model, optimizer)]
    kept = [{k: optimizer.state[p][k].clone() for k in KEPT_STATE[kind]}
            for p in model.parameters()]
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": optimizer.state_dict()})

    loaded = make_model(seed=5)
    loaded.load_state_dict(checkpoint["model"])
    target_opt = make_optimizer(kind, loaded.parameters(), target, 0.0)
    target_opt.load_state_dict(checkpoint["opt"])
    assert target_opt.param_groups[0]["master_weights"] == target  # this run's choice stays
    for i, p in enumerate(loaded.parameters()):
        for key, value in kept[i].items():
            assert torch.equal(target_opt.state[p][key], value), f"{key} {i}"
    target_opt.param_groups[0]["lr"] = 0.0
    _step_nothing(loaded, target_opt)
    for i, (p, x) in enumerate(zip(loaded.parameters(), saved)):
        state = target_opt.state[p]
        got = precise_value(p, state)
        if target in (True, "split"):
            assert_close_report(got, x, exact=True, msg=f"{i}: {source} -> {target}")
        elif target == "kahan":
            # The param within bf16's rounding of the value (a compensation of exactly half an
            # ulp makes a tie that may move it to its even neighbour), the pair to ~16 bits.
            assert_close_report(p.detach().float(), x, dtype=torch.bfloat16, msg=f"param {i}")
            assert_close_report(got, x, rtol=2.0**-15, atol=0.0, msg=f"{i}: {source} -> kahan")
        else:
            assert_close_report(p.detach(), x.to(torch.bfloat16), exact=True, msg=f"param {i}")
            assert state.keys() <= {"step", *KEPT_STATE[kind]}


def test_state_dict_carries_each_mode_state():
    expected = {True: {"master_param": torch.float32}, False: {}, "stochastic": {},
                "kahan": {"kahan_compensation": torch.bfloat16},
                "split": {"master_low_bits": torch.int16, "master_low_bits_layout": torch.int64}}
    for mode in ALL_MODES:
        model = make_model()
        optimizer = make_optimizer("adamw", model.parameters(), mode, 1e-3)
        train(model, optimizer, batches(1))
        for entry in optimizer.state_dict()["state"].values():
            extra = {k: v.dtype for k, v in entry.items()
                     if k not in ("step", "exp_avg", "exp_avg_sq")}
            assert extra == expected[mode], mode


def test_split_low_halves_load_from_int32_and_refuse_what_is_not_int16():
    """A sharded (FSDP2) state_dict() gives split's low halves as int32, which collectives can
    gather; a load takes them back, and refuses int32 values outside int16 and other dtypes."""
    model = make_model()
    optimizer = make_optimizer("adamw", model.parameters(), "split", 3e-3)
    train(model, optimizer, batches(2))
    saved = optimizer.state_dict()
    widened = copy.deepcopy(saved)
    for entry in widened["state"].values():
        entry["master_low_bits"] = entry["master_low_bits"].to(torch.int32)
    twin = make_optimizer("adamw", model.parameters(), "split", 3e-3)
    twin.load_state_dict(widened)
    for p in model.parameters():
        assert twin.state[p]["master_low_bits"].dtype == torch.int16
        assert torch.equal(twin.state[p]["master_low_bits"], optimizer.state[p]["master_low_bits"])
    out_of_range = copy.deepcopy(widened)
    out_of_range["state"][0]["master_low_bits"][0] = 0x8000
    with raises_naming("'master_low_bits' as int32 with values outside int16"):
        twin.load_state_dict(out_of_range)
    as_float = copy.deepcopy(saved)
    as_float["state"][0]["master_low_bits"] = as_float["state"][0]["master_low_bits"].float()
    with raises_naming("torch.float32", "must be torch.int16", "or int32"):
        twin.load_state_dict(as_float)
    for p in model.parameters():  # a refused load changed nothing
        assert torch.equal(twin.state[p]["master_low_bits"], optimizer.state[p]["master_low_bits"])


@pytest.mark.parametrize("mode", ALL_MODES, ids=mode_id)
def test_extra_bytes_per_param(mode):
    model = make_model()
    optimizer = make_optimizer("adamw", model.parameters(), mode, 1e-3)
    train(model, optimizer, batches(1))
    numel = sum(p.numel() for p in model.parameters())
    extra = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                for k, v in s.items() if k not in ("step", "exp_avg", "exp_avg_sq"))
    assert extra == EXTRA_BYTES_PER_PARAM[mode] * numel


@pytest.mark.parametrize("mode", BF16_MODES)
def test_fp32_params_of_a_bf16_mode_group_update_in_fp32(mode):
    """fp32 params have nothing to recover: they step exactly as with master_weights=False."""
    model = make_model(dtype=torch.float32)
    twin = copy.deepcopy(model)
    data = [(x.float(), y) for x, y in batches(3)]
    for m, value in ((model, mode), (twin, False)):
        optimizer = make_optimizer("adamw", m.parameters(), value, 1e-2)
        for x, y in data:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            optimizer.step()
        assert all(k in ("step", "exp_avg", "exp_avg_sq") for s in optimizer.state.values()
                   for k in s)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mode", ["kahan", "split"])
def test_writing_a_param_resets_its_extra_state(mode):
    """A compensation or low half belongs to the value the step left; after someone else writes
    the param (p.copy_, model.load_state_dict) the written value rules."""
    model = make_model()
    optimizer = make_optimizer("adamw", model.parameters(), mode, 3e-3)
    train(model, optimizer, batches(3))
    key = "kahan_compensation" if mode == "kahan" else "master_low_bits"
    p = next(model.parameters())
    assert optimizer.state[p][key].count_nonzero() > 0
    with torch.no_grad():
        p.copy_(torch.full_like(p, 0.5))
    optimizer.param_groups[0]["lr"] = 0.0
    _step_nothing(model, optimizer)
    assert optimizer.state[p][key].count_nonzero() == 0
    assert torch.equal(p, torch.full_like(p, 0.5))


def test_bad_master_weights_values_are_refused():
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    for value in ("Kahan", 1, None, "fp32"):
        with raises_naming(f"master_weights={value!r}", "'stochastic', 'kahan' or 'split'"):
            FusedAdam(params, master_weights=value)
    with raises_naming("rounding_seed=-1", r"\[0, 2\*\*63\)"):
        FusedSGD(params, master_weights="stochastic", rounding_seed=-1)
    optimizer = FusedAdam(params, master_weights="kahan")
    optimizer.param_groups[0]["master_weights"] = "kahn"
    params[0].grad = torch.ones_like(params[0])
    with raises_naming("master_weights='kahn'"):
        optimizer.step()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", BF16_MODES)
def test_fp16_params_are_refused_by_bf16_modes(mode, kind):
    fp16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with raises_naming(r"param_groups\[0\]\['params'\]\[0\]", "torch.float16",
                       "master_weights=True"):
        make_optimizer(kind, [fp16], mode, 0.1)
    # A param made fp16 after the optimizer was built is caught at the step.
    bf16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    optimizer = make_optimizer(kind, [bf16], mode, 0.1)
    bf16.data = bf16.data.half()
    bf16.grad = torch.ones_like(bf16)
    with raises_naming("torch.float16", "bfloat16 params only"):
        optimizer.step()

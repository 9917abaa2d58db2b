"""master_weights="split" with a rounded param (issue 33): the bf16 param is the fp32 master
rounded to nearest and the int16 low bits its signed remainder, so the pair holds the master
exactly and the model runs with master_weights=True's weights. The one exception, by counting:
an even bf16 value is the nearest (ties to even) of 2^16 + 1 fp32 values, one more than 16 bits
tell apart, so split rounds a master exactly halfway above an even bf16 value away from zero
where True rounds it to the even value. Old checkpoints (param truncated toward zero, unsigned
low bits: layout 1) still load and are converted at the param's next step."""

import copy

import pytest
import torch
from ampfuse.ops.sgd import fused_sgd_
from ampfuse.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedAdamW,
    FusedLAMB,
    FusedNovoGrad,
    FusedSGD,
)
from ampfuse.optimizers._precision import (
    SPLIT_LAYOUT,
    SPLIT_LAYOUT_KEY,
    joined_master,
    precise_value,
    split_halves,
)
from helpers import raises_naming

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def bits(t):
    """int64 bit patterns of an fp32 tensor, as unsigned 32-bit values."""
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def bf16_bits(t):
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def sampled_patterns(random_count=1 << 20, seed=0):
    """fp32 patterns: every high half with the low halves where rounding turns, runs around
    zero, the subnormals, the largest finite values and infinity, and random patterns."""
    high = torch.arange(0x10000, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    grid = ((high[:, None] << 16) | lows[None, :]).flatten()
    runs = [torch.arange(start, start + 0x30000, dtype=torch.int64)
            for start in (0x00000000, 0x80000000, 0x7F7E0000, 0xFF7E0000, 0x3F7F0000)]
    gen = torch.Generator().manual_seed(seed)
    random = torch.randint(0, 1 << 32, (random_count,), generator=gen, dtype=torch.int64)
    u = torch.cat([grid, *runs, random]) & 0xFFFFFFFF
    return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32).view(torch.float32)


def expected_param_bits(x):
    """split's param: round to nearest (torch's, which True's kernels match), but at a tie
    above an even bf16 value, which rounds away from zero; NaN to the canonical NaN 0x7fc0 as
    the kernels round it (torch's vectorized cast gives 0xffff)."""
    u = bits(x)
    nearest = bf16_bits(x.to(torch.bfloat16))
    even_tie = ((u & 0xFFFF) == 0x8000) & (((u >> 16) & 1) == 0)
    rounded = torch.where(even_tie, (u >> 16) + 1, nearest)
    return torch.where(torch.isnan(x), torch.full_like(rounded, 0x7FC0), rounded)


def test_split_halves_hold_every_sampled_fp32_exactly():
    x = sampled_patterns()
    param, low = split_halves(x)
    back = joined_master(param.view(torch.bfloat16), low)
    finite_or_inf = ~torch.isnan(x)
    assert torch.equal(bits(back)[finite_or_inf], bits(x)[finite_or_inf])
    assert torch.isnan(back[~torch.isnan(x) == 0]).all(), "a NaN master stays a NaN"
    assert torch.equal(bf16_bits(param.view(torch.bfloat16)), expected_param_bits(x))
    # The edge cases by name: bf16's largest value and the masters just below the rounding
    # boundary keep a finite param; from the tie 0x7f7f8000 up to fp32's largest value the
    # param is inf, as True's is, and the master is kept; infinities, signed zeros and
    # subnormals are themselves.
    edges = torch.tensor([0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000 - (1 << 32),
                          0x7F800000, 0xFF800000 - (1 << 32), 0, 0x80000000 - (1 << 32), 1,
                          0x00008000, 0x807FFFFF - (1 << 32)], dtype=torch.int64)
    edges = edges.to(torch.int32).view(torch.float32)
    param, low = split_halves(edges)
    assert torch.equal(bits(joined_master(param.view(torch.bfloat16), low)), bits(edges))
    assert torch.isfinite(param.view(torch.bfloat16)[:2]).all()
    assert torch.isinf(param.view(torch.bfloat16)[2:7]).all()
    assert torch.equal(bf16_bits(param.view(torch.bfloat16)), expected_param_bits(edges))
    true_params = edges.to(torch.bfloat16)
    assert torch.equal(param.view(torch.bfloat16)[2:10], true_params[2:10])
    # 0x00008000, halfway between +0 and the smallest subnormal bf16: True's param is +0,
    # split's rounds away from zero (the even tie it cannot keep).
    assert bf16_bits(true_params[10:11]).item() == 0 and param[10].item() == 1


def test_even_ties_are_the_only_params_unlike_true():
    """The counting argument, checked: the two ties around an even bf16 value (its value -+
    half a bf16 step) would share one remainder; split keeps both exact by rounding the upper
    one away from zero."""
    even = torch.tensor([0x3F80_0000 - 0x8000, 0x3F80_0000 + 0x8000], dtype=torch.int32)
    x = even.view(torch.float32)
    param, low = split_halves(x)
    assert torch.equal(bits(joined_master(param.view(torch.bfloat16), low)), bits(x))
    assert bf16_bits(x.to(torch.bfloat16)).tolist() == [0x3F80, 0x3F80]  # True: both to 1.0
    assert bf16_bits(param.view(torch.bfloat16)).tolist() == [0x3F80, 0x3F81]


# ---- the fused step against master_weights=True, bit for bit --------------------------------

KINDS = {
    "adamw": lambda ps, mode, lr: FusedAdamW(ps, lr=lr, weight_decay=0.1, master_weights=mode,
                                             skip_nonfinite=True),
    "adam_l2": lambda ps, mode, lr: FusedAdam(ps, lr=lr, weight_decay=0.01, adam_w_mode=False,
                                              master_weights=mode, skip_nonfinite=True),
    "sgd": lambda ps, mode, lr: FusedSGD(ps, lr=lr, momentum=0.9, nesterov=True,
                                         weight_decay=0.01, master_weights=mode,
                                         skip_nonfinite=True),
    "adagrad": lambda ps, mode, lr: FusedAdagrad(ps, lr=lr, weight_decay=0.01, lr_decay=0.01,
                                                 master_weights=mode, skip_nonfinite=True),
    "lamb": lambda ps, mode, lr: FusedLAMB(ps, lr=lr, weight_decay=0.01, master_weights=mode,
                                           skip_nonfinite=True),
    "novograd": lambda ps, mode, lr: FusedNovoGrad(ps, lr=lr, weight_decay=0.01,
                                                   master_weights=mode, skip_nonfinite=True),
}
# Updates far below bf16's resolution (at weights of magnitude ~1 a bf16 step is 2^-7) and
# ordinary ones. NovoGrad divides each grad by its tensor's norm (about 265 for 70000 unit
# elements), so its tiny lr is larger: 1e-6 would fall below fp32's resolution too.
LRS = {"tiny": 1e-6, "ordinary": 1e-3}
TINY_NOVOGRAD_LR = 1e-4
SKIPPED_STEPS = {17, 18, 101}  # inf or NaN grads: the step is skipped, nothing is written


def start_params(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (17,), (4, 8, 3), (1,), (70000,)]  # one past a 64K chunk
    return [torch.randn(s, generator=gen).to(device=device, dtype=torch.bfloat16)
            for s in shapes]


def grads_for(step, params, device):
    """The same grads for every run (not from the params, whose rounding may differ at a
    tie), inf or NaN at a first, middle or last element on the skipped steps."""
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=gen).to(device=device, dtype=torch.bfloat16)
             for p in params]
    if step in SKIPPED_STEPS:
        flat = grads[step % len(grads)].view(-1)
        flat[[0, flat.numel() // 2, -1][step % 3]] = float("inf") if step % 2 else float("nan")
    return grads


def run(kind, mode, lr, device, steps):
    params = [p.clone().requires_grad_() for p in start_params(device)]
    optimizer = KINDS[kind](params, mode, lr)
    for step in range(steps):
        for p, g in zip(params, grads_for(step, params, device)):
            p.grad = g
        optimizer.step()
        assert optimizer.last_step_skipped == (step in SKIPPED_STEPS), step
    return params, optimizer


def check_split_equals_true(kind, lr, device, steps=200):
    true_params, true_opt = run(kind, True, lr, device, steps)
    split_params, split_opt = run(kind, "split", lr, device, steps)
    ties = 0
    for i, (p, q) in enumerate(zip(true_params, split_params)):
        master = true_opt.state[p]["master_param"]
        joined = precise_value(q, split_opt.state[q])
        assert torch.equal(bits(joined), bits(master)), f"{kind}: master {i}"
        assert torch.equal(bf16_bits(q.detach()), expected_param_bits(master)), f"param {i}"
        same = bf16_bits(q.detach()) == bf16_bits(p.detach())
        ties += int((~same).sum())
        for key, value in true_opt.state[p].items():
            if key not in ("master_param", "step"):
                assert torch.equal(split_opt.state[q][key], value), f"{kind}: {key} {i}"
    # The updates reached the masters (with a tiny lr they may move no param at all).
    start = start_params(device)
    moved = sum(int((true_opt.state[p]["master_param"] != s.float()).sum())
                for p, s in zip(true_params, start))
    assert moved > 0.5 * sum(s.numel() for s in start), moved
    return ties


def lr_for(kind, name):
    return TINY_NOVOGRAD_LR if (kind, name) == ("novograd", "tiny") else LRS[name]


@pytest.mark.parametrize("lr", list(LRS), ids=list(LRS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_split_steps_exactly_as_true(kind, lr):
    """200 steps (3 skipped) from the same start with the same grads: split's joined masters
    and state are True's bit for bit and its params are True's masters rounded (True's params
    but at an even tie). With lr "tiny" every update is far below half a bf16 step."""
    ties = check_split_equals_true(kind, lr_for(kind, lr), "cpu")
    assert ties <= 0.001 * 70000, ties  # even ties: about one master in 2^17 per step


@cuda
@needs_cuda
@pytest.mark.parametrize("lr", list(LRS), ids=list(LRS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_split_steps_exactly_as_true_on_cuda(kind, lr):
    check_split_equals_true(kind, lr_for(kind, lr), "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, needs_cuda])])
def test_kernel_split_halves_match_split_halves(device):
    """The kernels' split_master and join_master (bf16_modes.h, one header for CPU and CUDA)
    against split_halves: a step with lr 0 rewrites every sampled finite pattern's halves as
    they were."""
    x = sampled_patterns(random_count=1 << 16)
    x = x[~torch.isnan(x)]
    param, low = split_halves(x)
    p = param.view(torch.bfloat16).to(device)
    low = low.to(device)
    fused_sgd_([p], [torch.zeros_like(p)], [], [low], torch.zeros(1, device=device),
               torch.zeros(1, device=device), master_mode="split")
    assert torch.equal(bits(joined_master(p.cpu(), low.cpu())), bits(x))
    assert torch.equal(p.cpu().view(torch.int16), param)


# ---- checkpoints of the old layout ---------------------------------------------------------


def old_layout(master):
    """(param, low bits) as split saved them before layout 2: the high half truncated toward
    zero and the low half's bits as int16."""
    u = bits(master)
    high = u >> 16
    low = u & 0xFFFF

    def as16(v):
        return torch.where(v >= 0x8000, v - 0x10000, v).to(torch.int16)

    return as16(high).view(torch.bfloat16), as16(low)


@pytest.mark.parametrize("resume_as", ["split", True])
@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
def test_old_split_checkpoints_load_and_are_converted(resume_as, model_first):
    """A layout-1 checkpoint built from known fp32 masters: after loading (model before or after
    the optimizer) and one step with lr 0, split holds the masters exactly with the rounded
    param and True holds them as its masters; saving again gives layout 2."""
    gen = torch.Generator().manual_seed(3)
    masters = [torch.randn(300, generator=gen), torch.randn(5, 7, generator=gen)]
    masters[0][:4] = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x0000FFFF],
                                  dtype=torch.int32).view(torch.float32)
    halves = [old_layout(m) for m in masters]
    params = [torch.nn.Parameter(torch.zeros_like(m, dtype=torch.bfloat16)) for m in masters]
    saved_state = {i: {"step": torch.tensor(5.0), "exp_avg": torch.zeros_like(m),
                       "exp_avg_sq": torch.zeros_like(m), "master_low_bits": low}
                   for i, (m, (_, low)) in enumerate(zip(masters, halves))}
    source = FusedAdamW(params, lr=0.0, master_weights="split")
    checkpoint = {"state": saved_state,
                  "param_groups": [dict(source.state_dict()["param_groups"][0])]}

    def load_model():
        with torch.no_grad():
            for p, (high, _) in zip(params, halves):
                p.copy_(high)

    optimizer = FusedAdamW(params, lr=0.0, master_weights=resume_as)
    if model_first:
        load_model()
    optimizer.load_state_dict(copy.deepcopy(checkpoint))
    if not model_first:
        load_model()
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, m in zip(params, masters):
        assert torch.equal(bits(precise_value(p, optimizer.state[p])), bits(m))
        if resume_as == "split":
            assert torch.equal(bf16_bits(p.detach()), expected_param_bits(m))
        else:
            assert torch.equal(p.detach(), m.to(torch.bfloat16))
    if resume_as == "split":
        for entry in optimizer.state_dict()["state"].values():
            assert entry[SPLIT_LAYOUT_KEY].item() == SPLIT_LAYOUT


def test_old_layout_resaved_before_a_step_stays_old():
    """A layout-1 checkpoint loaded and saved again before any step still says layout 1 (its
    param is still the truncated one), and loads as such."""
    master = torch.tensor([1.0 + 2.0**-9 + 2.0**-20, -3.0 - 2.0**-8 - 2.0**-22])
    high, low = old_layout(master)
    p = torch.nn.Parameter(high.clone())
    optimizer = FusedAdamW([p], lr=0.0, master_weights="split")
    optimizer.load_state_dict({
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2),
                      "exp_avg_sq": torch.zeros(2), "master_low_bits": low}},
        "param_groups": optimizer.state_dict()["param_groups"]})
    resaved = optimizer.state_dict()
    assert resaved["state"][0][SPLIT_LAYOUT_KEY].item() == 1
    twin = FusedAdamW([p], lr=0.0, master_weights="split")
    twin.load_state_dict(resaved)
    p.grad = torch.zeros_like(p)
    twin.step()
    assert torch.equal(bits(precise_value(p, twin.state[p])), bits(master))


def test_unknown_split_layout_is_refused():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    optimizer = FusedAdamW([p], lr=1e-3, master_weights="split")
    p.grad = torch.ones_like(p)
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0][SPLIT_LAYOUT_KEY] = torch.tensor(7)
    with raises_naming(f"{SPLIT_LAYOUT_KEY}=7", "layouts 1 and 2"):
        optimizer.load_state_dict(saved)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_optimizer_converts_an_old_split_checkpoint(kind):
    """The old layout made from a run of each optimizer (the same low bits as layout 2, the
    param truncated, no layout key): after loading and a step with lr 0, the masters are the
    run's exactly and the params rounded; the rest of the state comes along unchanged."""
    params, optimizer = run(kind, "split", 1e-3, "cpu", steps=3)
    masters = [precise_value(p, optimizer.state[p]).clone() for p in params]
    saved = copy.deepcopy(optimizer.state_dict())
    for entry in saved["state"].values():
        del entry[SPLIT_LAYOUT_KEY]
    with torch.no_grad():
        for p, master in zip(params, masters):
            p.copy_(old_layout(master)[0])
    resumed = KINDS[kind](params, "split", 0.0)
    resumed.load_state_dict(saved)
    for group in resumed.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    resumed.step()
    for i, (p, master) in enumerate(zip(params, masters)):
        assert torch.equal(bits(precise_value(p, resumed.state[p])), bits(master)), i
        assert torch.equal(bf16_bits(p.detach()), expected_param_bits(master)), i

"""FusedAdagrad and fused_adagrad_ with master_weights "stochastic", "kahan" and "split": bf16
params without fp32 masters, for bf16 embedding tables trained with Adagrad. The same contract
as FusedAdam's and FusedSGD's: test_bf16_master_modes.py runs Adagrad with them (below bf16's
resolution, stochastic resume, skipped steps, checkpoints converted between modes, fp16
refused); here is what is Adagrad's own, with test_bf16_master_ops.py's op helpers."""


import pytest
import torch

from ampfuse.optimizers._precision import joined_master

from fused_optimizer_usage import check_cuda_steps_are_the_cpu_steps
from helpers import POSITIONS, clone_args, position_index, raises_naming
from test_adam import make_params, set_grads, step_grads
from test_bf16_master_modes import (
    BF16_MODES,
    make_optimizer,
)
from test_bf16_master_ops import _args
from tolerances import assert_close_report, assert_lists_exact

def make_adagrad(params, mode, lr, **extra):
    """test_bf16_master_modes' Adagrad (with L2 decay and an lr decay)."""
    return make_optimizer("adagrad", params, mode, lr, **extra)


def _state_snapshot(params, optimizer):
    tensors = [p.detach().clone() for p in params]
    for p in params:
        tensors += [v.clone() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return tensors


# ---- the optimizer -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("mode", BF16_MODES)
def test_a_non_finite_grad_skips_the_step_bit_for_bit(mode, position, bad):
    """skip_nonfinite: inf/nan at the first, a middle or the last element of a three-chunk grad
    leaves every param, sum and extra tensor (and the step) as it was."""
    params = make_params([(100,), (2 * 65536 + 3,), (9,)], torch.bfloat16, "cpu")
    optimizer = make_adagrad(params, mode, 1e-2, skip_nonfinite=True)
    set_grads(params, step_grads(params, 0))
    optimizer.step()
    before = _state_snapshot(params, optimizer)
    grads = step_grads(params, 1)
    grads[1][position_index(position, grads[1].numel())] = bad
    set_grads(params, grads)
    optimizer.step()
    assert bool(optimizer.last_step_skipped)
    after = _state_snapshot(params, optimizer)
    assert len(before) == len(after) == (3 if mode == "stochastic" else 4) * len(params)
    for i, (b, a) in enumerate(zip(before, after)):
        assert_close_report(a, b, exact=True, msg=f"tensor {i} after a skipped step")


# ---- the op ------------------------------------------------------------------------------
# _args (test_bf16_master_ops) gives bf16 params over and under a chunk, grads of every dtype,
# fp32 'state' used here as the sums, the mode's extra tensors and param ids.


def _adagrad(a, mode, found_inf=None, seed=5, write_grads=True):
    torch.ops.ampfuse.fused_adagrad_(
        a["params"], a["grads"], a["state"], a["extra"], a["step"], a["lr"], 0.01, 0.01, 1e-10,
        False, False, torch.full_like(a["lr"], 4.0), found_inf, write_grads, mode, a["ids"],
        seed)


@pytest.mark.parametrize("mode", BF16_MODES)
def test_opcheck(device, mode):
    a = _args(device, mode, shapes=[(5,), (257,), (3, 4), (0,)])  # opcheck runs many times
    scale, found_inf = torch.full((1,), 8.0, device=device), torch.zeros(1, device=device)
    for decoupled in (False, True):
        torch.library.opcheck(
            torch.ops.ampfuse.fused_adagrad_.default,
            (a["params"], a["grads"], a["state"], a["extra"], a["step"], a["lr"], 0.01, 0.1,
             1e-10, decoupled, False, scale, found_inf, True, mode, a["ids"], 3),
        )


@pytest.mark.parametrize("mode", BF16_MODES)
def test_split_and_the_others_step_from_the_same_value(mode):
    """One op step from a bf16 value's exact state (no low half, no compensation) gives, in
    every mode, the fp32-master result: joined (split), to ~16 bits (kahan), or one of the two
    bf16 neighbours of it (stochastic); the sums are the fp32-master run's bit for bit."""
    a = _args("cpu", mode)
    for t in a["extra"]:
        t.zero_()
    master = [p.float() for p in a["params"]]
    fp32 = {**clone_args({k: v for k, v in a.items() if k != "ids"}), "extra": master, "ids": []}
    _adagrad(a, mode)
    _adagrad(fp32, "fp32")
    for i, (p, m) in enumerate(zip(a["params"], master)):
        assert_close_report(a["state"][i], fp32["state"][i], exact=True, msg=f"sum {i}")
        if mode == "split":
            assert_close_report(joined_master(p, a["extra"][i]), m, exact=True,
                                msg=f"master {i}")
        elif mode == "kahan":
            got = p.float() + a["extra"][i].float()
            assert_close_report(got, m, rtol=2.0**-15, atol=0.0, msg=f"value {i}")
        else:  # the master's high half (toward zero) or the next bf16 away from zero
            high = (m.view(torch.int32) >> 16).to(torch.int16)
            bits = p.view(torch.int16)
            assert ((bits == high) | (bits == high + 1)).all(), f"param {i}"


@pytest.mark.parametrize("mode", BF16_MODES)
def test_op_found_inf_writes_nothing(device, mode):
    a = _args(device, mode)
    before = clone_args({k: v for k, v in a.items() if k != "ids"})
    _adagrad(a, mode, found_inf=torch.ones(1, device=device))
    assert_lists_exact(a, before, ("params", "grads", "state", "extra"))
    assert torch.equal(a["step"], before["step"])


@pytest.mark.cuda
@pytest.mark.parametrize("mode", BF16_MODES)
def test_cuda_matches_cpu_bit_for_bit(mode):
    """Same update math, same bit-level rounding, same counter-based random bits."""
    results = []
    for device in ("cpu", "cuda"):
        a = _args(device, mode)
        for _ in range(3):
            _adagrad(a, mode)
        results.append(a)
    assert_lists_exact(results[1], results[0], ("params", "grads", "state", "extra"),
                       " cuda vs cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", BF16_MODES)
def test_cuda_optimizer_matches_cpu_bit_for_bit(mode):
    check_cuda_steps_are_the_cpu_steps(lambda ps: make_adagrad(ps, mode, 1e-2))


# master_args' refusals (csrc/ops/master_args.h) as fused_adagrad_ reports them: (the mode of
# the arguments, the mode called, changes to them, what the message names).
OP_ERRORS = {
    "unknown_mode": ("kahan", "kahn", {}, ["fused_adagrad_", "master_mode='kahn'", "'split'"]),
    "split_extra_bf16": ("kahan", "split", {}, [r"master_params\[0\]", "torch.int16"]),
    "kahan_extra_count": ("kahan", "kahan", {"extra": 2}, ["one torch.bfloat16 compensation"]),
    "ids_count": ("stochastic", "stochastic", {"ids": [1, 2]}, ["one param id per param"]),
    "ids_range": ("stochastic", "stochastic", {"ids": [1, 2, 3, -4]},
                  [r"param_ids\[3\]", r"\[0, 2\^31\)"]),
    "ids_with_fp32": ("stochastic", "fp32", {}, ["param_ids", "master_mode='stochastic' only"]),
    "stochastic_extra": ("kahan", "stochastic", {"ids": [1, 2, 3, 4]},
                         ["keeps no state", r"master_params=\[\]"]),
    "fp16_param": ("stochastic", "stochastic", {"half": True},
                   [r"params\[0\]", "torch.float16", "master_mode='fp32'"]),
}


@pytest.mark.parametrize("case", OP_ERRORS.values(), ids=OP_ERRORS.keys())
def test_op_argument_errors_name_the_argument(case):
    made_as, called_as, changes, patterns = case
    a = _args("cpu", made_as)
    if "extra" in changes:
        a["extra"] = a["extra"][:changes["extra"]]
    if "ids" in changes:
        a["ids"] = changes["ids"]
    if changes.get("half"):
        a["params"][0] = a["params"][0].half()
    with raises_naming(*patterns):
        _adagrad(a, called_as)

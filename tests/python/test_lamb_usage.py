"""FusedLAMB in use: torch.compile, checkpoints (its own and apex FusedLAMB's), amp O1/O2, the
apex alias's constructor, refused options, DTensor params on one rank (two ranks:
test_fsdp2.py), and the torch LAMB that bench_lamb.py times. The math against a float64 LAMB is
test_lamb.py's; the op's own contract is test_lamb_op.py's."""

import pathlib
import sys

import pytest
import torch

import ampfuse
from ampfuse.optimizers import FusedLAMB
from fused_optimizer_usage import (
    check_amp_trains_like_fp32,
    check_bad_options_are_refused_by_name,
    check_compiled_steps_match_eager,
    check_dtensor_params_step_like_plain_ones,
)
from helpers import raises_naming
from test_adam import assert_parity, clone_params, make_params, set_grads, step_grads
from test_lamb import SHAPES, make_lamb, run_fused


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_matches_eager_cpu(backend):
    check_compiled_steps_match_eager(make_lamb, SHAPES, "cpu", backend)


@pytest.mark.cuda
def test_compiled_step_matches_eager_cuda():
    check_compiled_steps_match_eager(make_lamb, SHAPES, "cuda", "inductor")


def test_state_dict_resume_is_bit_for_bit(device):
    params = make_params(SHAPES, torch.bfloat16, device)
    resumed = clone_params(params)
    grads = [step_grads(params, s) for s in range(6)]
    opt = run_fused(params, [[0, 1, 2], [3, 4, 5]], grads, lr=1e-2, master_weights=True)

    first = run_fused(resumed, [[0, 1, 2], [3, 4, 5]], grads[:3], lr=1e-2, master_weights=True)
    saved = first.state_dict()
    assert [g["step"] for g in saved["param_groups"]] == [3, 3], "apex's per-group step"
    again = FusedLAMB([{"params": resumed[:3]}, {"params": resumed[3:]}], lr=1e-2,
                      master_weights=True)
    again.load_state_dict(saved)
    for g in grads[3:]:
        set_grads(resumed, g)
        again.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    assert torch.equal(opt.state[params[0]]["master_param"],
                       again.state[resumed[0]]["master_param"])


def test_loads_an_apex_fused_lamb_checkpoint(device):
    """apex keeps the step count as an int in each param group and moments in the param's
    dtype; loading it continues with fp32 moments and the right bias correction."""
    params = make_params([(30,), (4, 5)], torch.float32, device)
    resumed = clone_params(params)
    grads = [step_grads(params, s) for s in range(4)]
    run_fused(params, [[0, 1]], grads, lr=1e-2)
    first = run_fused(resumed, [[0, 1]], grads[:2], lr=1e-2)
    ours = first.state_dict()
    apex_style = {
        "state": {i: {"exp_avg": s["exp_avg"].half(), "exp_avg_sq": s["exp_avg_sq"].clone()}
                  for i, s in ours["state"].items()},
        "param_groups": [dict({k: v for k, v in g.items() if k != "step"}, step=2)
                         for g in ours["param_groups"]],
    }
    again = FusedLAMB(resumed, lr=1e-2)
    again.load_state_dict(apex_style)
    assert float(again.state[resumed[0]]["step"]) == 2.0
    assert "step" not in again.param_groups[0]
    assert again.state[resumed[0]]["exp_avg"].dtype == torch.float32
    for g in grads[2:]:
        set_grads(resumed, g)
        again.step()
    for a, b in zip(params, resumed):
        assert_parity(b, a, "resumed from an apex checkpoint", rtol=1e-3)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_trains_like_fp32(opt_level):
    check_amp_trains_like_fp32(lambda params: FusedLAMB(params, lr=5e-2), opt_level)


def test_apex_alias_gives_fused_lamb_with_apex_positional_order():
    from ampfuse.apex_compat.apex import optimizers as apex_optimizers

    params = make_params([(8,)], torch.float32, "cpu")
    opt = apex_optimizers.FusedLAMB(params, 1e-3, True, (0.8, 0.9), 1e-5, 0.1, False, False,
                                    True, False, 2.0, True)
    group = opt.param_groups[0]
    assert isinstance(opt, FusedLAMB)
    assert (group["bias_correction"], group["betas"], group["eps"], group["weight_decay"]) == (
        True, (0.8, 0.9), 1e-5, 0.1)
    assert (group["adam_w_mode"], group["grad_averaging"], group["max_grad_norm"],
            group["use_nvlamb"]) == (False, True, 2.0, True)
    assert opt.set_grad_none is False


BAD_OPTIONS = {
    "amsgrad": ({"amsgrad": True}, ["amsgrad"]),
    "negative_clip": ({"max_grad_norm": -1.0}, ["max_grad_norm", ">= 0"]),
    "bool_clip": ({"max_grad_norm": True}, ["max_grad_norm"]),
    "bad_mode": ({"master_weights": "kahn"}, ["master_weights=.kahn.", "'split'"]),
    "beta": ({"betas": (0.9, 1.0)}, ["betas", r"\[0, 1\)"]),
    "flag": ({"use_nvlamb": 1}, ["use_nvlamb", "True or False"]),
    "foreign_key": ({"momentum": 0.9}, None),
}


@pytest.mark.parametrize("case", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_are_refused_by_name(case):
    check_bad_options_are_refused_by_name(FusedLAMB, *case)


def test_dtensor_params_step_like_plain_ones(one_rank):
    """On one rank a DTensor step runs both halves of the op with the sums all-reduced between
    them (a no-op here): the same bits as plain tensors. Two ranks: test_fsdp2.py."""
    _, sharded, _ = check_dtensor_params_step_like_plain_ones(
        lambda ps: FusedLAMB(ps, lr=1e-2), grad_scale=4.0)
    with raises_naming("part and tensor_sums", "part='both'"):
        ampfuse.ops.fused_lamb_([sharded[1].data], [sharded[1].grad], [sharded[1].data],
                                 [sharded[1].data], [], torch.zeros(()), 1e-3, 0.9, 0.999, 1e-6,
                                 0.0, tensor_sums=torch.zeros(1, 2, dtype=torch.float64),
                                 part="moments")


def test_the_benchmarks_torch_lamb_computes_the_same_step():
    """bench_lamb.py times ForeachLamb, written with torch's _foreach ops, as torch's side of
    the comparison: it must be the same LAMB, or the ratio compares different work."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from bench_lamb import ForeachLamb
    finally:
        sys.path.pop(0)
    params = make_params(SHAPES, torch.float32, "cpu")
    ours = clone_params(params)
    torch_opt, fused = ForeachLamb(params), FusedLAMB(ours, lr=1e-3)
    for s in range(5):
        grads = step_grads(params, s, scale=4.0)
        set_grads(params, grads)
        set_grads(ours, grads)
        torch_opt.step()
        fused.step()
    for a, b in zip(ours, params):
        assert_parity(a, b, "FusedLAMB against bench_lamb.ForeachLamb")

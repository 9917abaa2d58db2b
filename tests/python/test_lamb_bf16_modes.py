"""FusedLAMB and fused_lamb_ with master_weights / master_mode "stochastic", "kahan" and "split"
(bf16 params without fp32 masters). test_bf16_master_modes.py runs LAMB beside the other
optimizers (below bf16's resolution, stochastic resume, skipped steps, checkpoints converted
between modes, fp16 refused); here is what is LAMB's own, with test_bf16_master_ops.py's op
arguments and checks."""

import copy

import pytest
import torch

import ampfuse
from ampfuse.optimizers import FusedLAMB
from ampfuse.optimizers._precision import joined_master, precise_value
from fused_optimizer_usage import (
    check_dtensor_params_step_like_plain_ones,
    check_dtensor_state_is_the_plain_state,
    check_skip_nonfinite_leaves_everything_as_it_was,
    check_split_steps_exactly_as_fp32_masters,
)
from helpers import POSITIONS, clone_args, raises_naming
from test_adam import clone_params, make_params, set_grads, step_grads
from test_bf16_master_modes import BF16_MODES, make_optimizer, mode_id
from test_bf16_master_ops import _args, _sgd_one, check_argument_errors
from tolerances import assert_close_report, assert_lists_exact

# A chunk and one element (CUDA chunks, CPU spans), a tail of n % 8 (the CPU lanes), a 3-d one.
SHAPES = [(64, 33), (65537,), (7,), (3, 5, 2)]


def make_lamb(params, mode, lr=1e-2, **extra):
    """Weight decay on, so every step scales by a trust ratio; clipping at max_grad_norm=1 (the
    default). The Adam tests this file runs on LAMB make the same."""
    return make_optimizer("lamb", params, mode, lr, **extra)


def _clone(a):
    return dict(clone_args({k: v for k, v in a.items() if k != "ids"}), ids=list(a["ids"]))


def _sums(a):
    return torch.zeros((len(a["params"]), 2), dtype=torch.float64, device=a["step"].device)


def _lamb(a, mode, masters=None, sums=None, part="both", found_inf=None, seed=5, norm=None):
    """One clipped, loss-scaled step of the op over test_bf16_master_ops's arguments (moments in
    'state' and 'state2'); `masters` replaces the mode's extra list (fp32 masters). The grads'
    norm, for the clip, is theirs unless `norm` is given."""
    if norm is None and part != "apply":
        norm = ampfuse.ops.multi_tensor_l2norm(a["grads"], False)[0]
    torch.ops.ampfuse.fused_lamb_(
        a["params"], a["grads"], a["state"], a["state2"],
        a["extra"] if masters is None else masters, a["step"], a["lr"], 0.9, 0.999, 1e-6, 0.01,
        True, True, True, False, 1.0, norm, torch.full_like(a["lr"], 4.0), found_inf, True,
        sums, part, mode, a["ids"], seed)


# ---- the op ---------------------------------------------------------------------------------


def test_split_op_is_the_fp32_master_op_bit_for_bit(device):
    """Both passes read the master the param and its low half make up: every step's sums of
    squares (hence trust ratios), moments and masters are those of the op with fp32 masters."""
    split = _args(device, "split")
    fp32 = _clone(split)
    masters = [joined_master(p, low) for p, low in zip(split["params"], split["extra"])]
    for step in range(3):
        sums = {"split": _sums(split), "fp32": _sums(fp32)}
        _lamb(split, "split", sums=sums["split"])
        _lamb(fp32, "fp32", masters=masters, sums=sums["fp32"])
        assert sums["split"].any()
        bits = {k: v.view(torch.int64) for k, v in sums.items()}  # float64, bit for bit
        assert torch.equal(bits["split"], bits["fp32"]), f"sums, step {step}"
    for i, (p, low, master) in enumerate(zip(split["params"], split["extra"], masters)):
        assert_close_report(joined_master(p, low), master, exact=True, msg=f"master {i}")
        for key in ("state", "state2", "grads"):
            assert_close_report(split[key][i], fp32[key][i], exact=True, msg=f"{key}[{i}]")


@pytest.mark.parametrize("mode", BF16_MODES)
def test_the_two_halves_are_one_step_bit_for_bit(device, mode):
    """part="moments" then part="apply" (FSDP2's split, ampfuse.ops.dtensor) reads and writes
    the mode's state as part="both" does, with the same stochastic bits."""
    both = _args(device, mode)
    halves = _clone(both)
    _lamb(both, mode, sums=_sums(both))
    sums = _sums(halves)
    _lamb(halves, mode, sums=sums, part="moments")
    _lamb(halves, mode, sums=sums, part="apply")
    assert_lists_exact(halves, both, ("params", "grads", "state", "state2", "extra"))
    assert torch.equal(both["step"], halves["step"])


@pytest.mark.parametrize("mode", BF16_MODES)
def test_found_inf_writes_nothing(device, mode):
    a = _args(device, mode)
    before = _clone(a)
    _lamb(a, mode, found_inf=torch.ones(1, device=device))
    for key in ("params", "grads", "state", "state2", "extra", "step"):
        pairs = zip(a[key], before[key]) if key != "step" else [(a[key], before[key])]
        for i, (x, y) in enumerate(pairs):
            assert_close_report(x, y, exact=True, msg=f"{key}[{i}]")


def test_stochastic_bits_are_keyed_as_sgds():
    """A LAMB step whose update is exactly SGD's (beta1 = beta2 = 0, eps = 0, no bias
    correction, decay or clip: the direction is sign(g) and the step size lr) rounds with the
    very bits fused_sgd_ draws for the same seed, step and param id."""
    n, delta = 3 * 65536 + 7, 2.0**-9
    for seed, step, param_id in ((0, 0.0, 0), (3, 5.0, 17)):
        p = torch.ones(n, dtype=torch.bfloat16)
        torch.ops.ampfuse.fused_lamb_(
            [p], [torch.full((n,), -1.0)], [torch.zeros(n)], [torch.zeros(n)], [],
            torch.full((1,), step), torch.full((1,), delta), 0.0, 0.0, 0.0, 0.0, True, False,
            True, False, 0.0, None, None, None, False, None, "both", "stochastic", [param_id],
            seed)
        sgd = _sgd_one(1.0, delta, n, param_id=param_id, seed=seed, step=step)
        assert ((p == 1.0) | (p == 1.0 + 2.0**-7)).all() and (p != 1.0).any()
        assert torch.equal(p, sgd)


@pytest.mark.parametrize("part", ["both", "moments", "apply"])
@pytest.mark.parametrize("mode", BF16_MODES)
def test_opcheck(device, mode, part):
    a = _args(device, mode, shapes=[(5,), (257,), (3, 4), (0,)])  # opcheck runs many times
    sums = torch.rand((4, 2), dtype=torch.float64, device=device) if part != "both" else None
    torch.library.opcheck(
        torch.ops.ampfuse.fused_lamb_.default,
        (a["params"], a["grads"], a["state"], a["state2"], a["extra"], a["step"], a["lr"], 0.9,
         0.999, 1e-6, 0.01, True, True, True, False, 1.0, torch.full((), 40.0, device=device),
         torch.full((1,), 8.0, device=device), torch.zeros(1, device=device), True, sums, part,
         mode, a["ids"], 3),
    )


def test_argument_errors():
    """fused_adam_'s and fused_sgd_'s refusals of the master modes, on LAMB."""
    check_argument_errors(_lamb, _lamb)
    with raises_naming("ampfuse.fused_lamb_", "master_mode='fp32.'"):
        _lamb(_args("cpu", "split"), "fp32 ")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", BF16_MODES)
def test_cuda_matches_the_cpu(mode):
    """Three steps, each in halves: from one grad norm, the moments half gives the same moments
    and grads and each tensor's sums of squares to their last bits (the GPU adds them in another
    order), and the apply half runs on both devices from the GPU's sums, so that params, the
    mode's extra array and everything else are the same bits
    (test_the_two_halves_are_one_step_bit_for_bit holds the one-call step to the halves). After
    each side's own sums, a trust ratio a few ulps apart would reach split's value, and
    near-cancelling updates by many of its ulps."""
    cpu = _args("cpu", mode)
    cuda = _args("cuda", mode)
    for _ in range(3):
        # The clip's global norm, too, is a sum the GPU adds in another order: one for both.
        norm = ampfuse.ops.multi_tensor_l2norm(cpu["grads"], False)[0]
        cpu_sums, cuda_sums = _sums(cpu), _sums(cuda)
        for a, sums in ((cpu, cpu_sums), (cuda, cuda_sums)):
            _lamb(a, mode, sums=sums, part="moments", norm=norm.to(sums.device))
        torch.testing.assert_close(cuda_sums.cpu(), cpu_sums, rtol=1e-6, atol=0)
        for a, sums in ((cpu, cuda_sums.cpu()), (cuda, cuda_sums)):
            _lamb(a, mode, sums=sums, part="apply")
    assert_lists_exact(cuda, cpu, ("params", "extra", "grads", "state", "state2"), " cuda vs cpu")
    assert torch.equal(cuda["step"].cpu(), cpu["step"])


# ---- FusedLAMB ------------------------------------------------------------------------------


def test_split_steps_exactly_as_fp32_masters(device):
    """Masters and moments of "split" are True's at every step (with decay, so trust ratios,
    and grads of norm ~800 clipped to 1); the param is the master rounded (split_halves)."""
    check_split_steps_exactly_as_fp32_masters(make_lamb, ("exp_avg", "exp_avg_sq"), SHAPES,
                                              device)


@pytest.mark.parametrize("source, target", [(True, "split"), ("split", True)], ids=mode_id)
def test_a_checkpoint_converted_between_true_and_split_steps_on_exactly(source, target):
    params = make_params(SHAPES, torch.bfloat16, "cpu")
    straight = clone_params(params)
    opt, straight_opt = make_lamb(params, source), make_lamb(straight, target)
    for s in range(3):
        for ps, o in ((params, opt), (straight, straight_opt)):
            set_grads(ps, step_grads(ps, s, scale=3.0))
            o.step()
    resumed = [p.detach().clone().requires_grad_() for p in params]
    resumed_opt = make_lamb(resumed, target)
    resumed_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(3, 6):
        for ps, o in ((resumed, resumed_opt), (straight, straight_opt)):
            set_grads(ps, step_grads(ps, s, scale=3.0))
            o.step()
    for i, (p, q) in enumerate(zip(resumed, straight)):
        assert_close_report(precise_value(p, resumed_opt.state[p]),
                            precise_value(q, straight_opt.state[q]), exact=True, msg=f"param {i}")


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("mode", BF16_MODES)
def test_skip_nonfinite_leaves_everything_as_it_was(mode, position, bad):
    check_skip_nonfinite_leaves_everything_as_it_was(
        lambda ps, **kw: FusedLAMB(ps, lr=1e-2, **kw), ("exp_avg", "exp_avg_sq"), "cpu", bad,
        position, dtype=torch.bfloat16, master_weights=mode)


@pytest.mark.parametrize("mode", BF16_MODES)
def test_dtensor_params_step_like_plain_ones(one_rank, mode):
    """The DTensor rule runs the two halves with the mode's arguments (ampfuse.ops.dtensor)."""
    check_dtensor_state_is_the_plain_state(*check_dtensor_params_step_like_plain_ones(
        lambda ps: make_lamb(ps, mode), grad_scale=4.0, dtype=torch.bfloat16))

"""FusedNovoGrad and fused_novograd_ with master_weights / master_mode "stochastic", "kahan" and
"split" (bf16 params without fp32 masters). test_bf16_master_modes.py runs NovoGrad beside the
other optimizers (below bf16's resolution, stochastic resume, skipped steps, checkpoints
converted between modes, fp16 refused); here is what is NovoGrad's own, with
test_bf16_master_ops.py's op arguments and checks. The norms pass reads only the grads, so a
mode changes the apply pass alone: the running norms of every mode are the fp32 run's."""

import pytest
import torch

from ampfuse.optimizers import FusedNovoGrad
from ampfuse.optimizers._precision import joined_master, split_halves
from fused_optimizer_usage import (
    check_cuda_steps_are_the_cpu_steps,
    check_dtensor_params_step_like_plain_ones,
    check_dtensor_state_is_the_plain_state,
    check_skip_nonfinite_leaves_everything_as_it_was,
    check_split_steps_exactly_as_fp32_masters,
)
from helpers import POSITIONS, raises_naming
from test_bf16_master_modes import BF16_MODES, make_optimizer
from test_bf16_master_ops import _args, check_argument_errors
from test_lamb_bf16_modes import _clone
from tolerances import assert_close_report, assert_lists_exact

# A chunk and one element (CUDA chunks, CPU spans), a tail of n % 8 (the CPU lanes), a 3-d one.
SHAPES = [(64, 33), (65537,), (7,), (3, 5, 2)]
NORM_TYPES = {"l2": 2, "max": 0}


def make_novograd(params, mode, lr=1e-2, **extra):
    """test_bf16_master_modes' NovoGrad (weight decay on, so the update reads the param)."""
    return make_optimizer("novograd", params, mode, lr, **extra)


def _running_norms(a):
    """A running norm per param in [0.5, 1.5), as after some steps (the step count is 3)."""
    gen = torch.Generator().manual_seed(9)
    return [(torch.rand((), generator=gen) + 0.5).to(a["step"].device) for _ in a["params"]]


def _novo_args(device, mode, **kw):
    """test_bf16_master_ops' arguments ('state' as the first moments) with running norms."""
    a = _args(device, mode, **kw)
    a["norms"] = _running_norms(a)
    return a


def _reductions(a):
    return torch.zeros(len(a["params"]), dtype=torch.float64, device=a["step"].device)


def _novograd(a, mode, masters=None, reductions=None, part="both", found_inf=None, seed=5,
              norm_type=2, reg_inside_moment=False):
    """One loss-scaled, decayed step of the op; `masters` replaces the mode's extra list (fp32
    masters). Arguments without running norms (check_argument_errors') get them here."""
    a.setdefault("norms", _running_norms(a))
    torch.ops.ampfuse.fused_novograd_(
        a["params"], a["grads"], a["state"], a["norms"],
        a["extra"] if masters is None else masters, a["step"], a["lr"], 0.9, 0.98, 1e-8, 0.01,
        True, True, reg_inside_moment, norm_type, False, torch.full_like(a["lr"], 4.0),
        found_inf, True, reductions, part, mode, a["ids"], seed)


# ---- the op ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reg_inside_moment", [False, True], ids=["apex", "inside"])
@pytest.mark.parametrize("norm_type", NORM_TYPES.values(), ids=NORM_TYPES.keys())
def test_split_op_is_the_fp32_master_op_bit_for_bit(device, norm_type, reg_inside_moment):
    """The apply pass reads the master the param and its low half make up: every step's
    reductions, running norms, moments, grads and masters are the fp32-master op's."""
    split = _novo_args(device, "split")
    fp32 = _clone(split)
    masters = [joined_master(p, low) for p, low in zip(split["params"], split["extra"])]
    options = dict(norm_type=norm_type, reg_inside_moment=reg_inside_moment)
    for step in range(3):
        sums = {"split": _reductions(split), "fp32": _reductions(fp32)}
        _novograd(split, "split", reductions=sums["split"], **options)
        _novograd(fp32, "fp32", masters=masters, reductions=sums["fp32"], **options)
        assert sums["split"].any()  # the last param (of test_bf16_master_ops) is empty
        bits = {k: v.view(torch.int64) for k, v in sums.items()}  # float64, bit for bit
        assert torch.equal(bits["split"], bits["fp32"]), f"reductions, step {step}"
    for i, (p, low, master) in enumerate(zip(split["params"], split["extra"], masters)):
        assert_close_report(joined_master(p, low), master, exact=True, msg=f"master {i}")
        high, _ = split_halves(master)
        assert torch.equal(p.view(torch.int16), high), f"param {i} is the master rounded"
        for key in ("state", "norms", "grads"):
            assert_close_report(split[key][i], fp32[key][i], exact=True, msg=f"{key}[{i}]")


@pytest.mark.parametrize("mode", BF16_MODES)
def test_the_two_halves_are_one_step_bit_for_bit(device, mode):
    """part="norms" then part="apply" (FSDP2's split, ampfuse.ops.dtensor) reads and writes the
    mode's state as part="both" does, with the same stochastic bits."""
    both = _novo_args(device, mode)
    halves = _clone(both)
    _novograd(both, mode)
    reductions = _reductions(halves)
    _novograd(halves, mode, reductions=reductions, part="norms")
    _novograd(halves, mode, reductions=reductions, part="apply")
    assert_lists_exact(halves, both, ("params", "grads", "state", "norms", "extra"))
    assert torch.equal(both["step"], halves["step"])


@pytest.mark.parametrize("mode", BF16_MODES)
def test_found_inf_writes_nothing(device, mode):
    a = _novo_args(device, mode)
    before = _clone(a)
    _novograd(a, mode, found_inf=torch.ones(1, device=device))
    assert_lists_exact(a, before, ("params", "grads", "state", "norms", "extra"))
    assert torch.equal(a["step"], before["step"])


@pytest.mark.parametrize("part", ["both", "norms", "apply"])
@pytest.mark.parametrize("mode", BF16_MODES)
def test_opcheck(device, mode, part):
    a = _novo_args(device, mode, shapes=[(5,), (257,), (3, 4), (0,)])  # opcheck runs many times
    reductions = (torch.rand(4, dtype=torch.float64, device=device) if part != "both"
                  else None)
    torch.library.opcheck(
        torch.ops.ampfuse.fused_novograd_.default,
        (a["params"], a["grads"], a["state"], a["norms"], a["extra"], a["step"], a["lr"], 0.9,
         0.98, 1e-8, 0.01, True, True, False, 2, False, torch.full((1,), 8.0, device=device),
         torch.zeros(1, device=device), True, reductions, part, mode, a["ids"], 3),
    )


def test_argument_errors():
    """fused_adam_'s and fused_sgd_'s refusals of the master modes, on NovoGrad; each half
    checks them too, though the norms half does not read the param."""
    check_argument_errors(_novograd, _novograd)
    for part in ("norms", "apply"):
        a = _novo_args("cpu", "kahan")
        a["extra"] = a["extra"][:2]
        with raises_naming("fused_novograd_", "one torch.bfloat16 compensation per param"):
            _novograd(a, "kahan", reductions=_reductions(a), part=part)


@pytest.mark.cuda
@pytest.mark.parametrize("norm_type", NORM_TYPES.values(), ids=NORM_TYPES.keys())
@pytest.mark.parametrize("mode", BF16_MODES)
def test_cuda_matches_the_cpu(mode, norm_type):
    """Three steps, each in halves: the norms half gives each tensor's grad-norm reduction on
    both devices (an L2 sum to its last bits, the GPU adding in another order; a max exactly),
    and the apply half runs on both from the GPU's reductions, so that params, the mode's extra
    array, moments, running norms and grads are the same bits (test_the_two_halves_... holds
    the one-call step to the halves). After each side's own reductions a few ulps of a norm
    would reach split's value, and stochastic's rounding near a threshold."""
    cpu = _novo_args("cpu", mode)
    cuda = _novo_args("cuda", mode)
    for _ in range(3):
        cpu_reductions, cuda_reductions = _reductions(cpu), _reductions(cuda)
        for a, reductions in ((cpu, cpu_reductions), (cuda, cuda_reductions)):
            _novograd(a, mode, norm_type=norm_type, reductions=reductions, part="norms")
        if norm_type == 0:
            assert torch.equal(cuda_reductions.cpu(), cpu_reductions)
        else:
            torch.testing.assert_close(cuda_reductions.cpu(), cpu_reductions, rtol=1e-6, atol=0)
        for a, reductions in ((cpu, cuda_reductions.cpu()), (cuda, cuda_reductions)):
            _novograd(a, mode, norm_type=norm_type, reductions=reductions, part="apply")
    assert_lists_exact(cuda, cpu, ("params", "grads", "state", "norms", "extra"), " cuda vs cpu")
    assert torch.equal(cuda["step"].cpu(), cpu["step"])


# ---- FusedNovoGrad --------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES.values(), ids=NORM_TYPES.keys())
def test_split_steps_exactly_as_fp32_masters(device, norm_type):
    """Masters, first moments and running norms of "split" are True's at every step (with
    weight decay, which reads the param); the param is the master rounded (split_halves)."""
    check_split_steps_exactly_as_fp32_masters(
        lambda ps, mode: make_novograd(ps, mode, norm_type=norm_type), ("exp_avg", "norm_avg"),
        SHAPES, device)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("mode", BF16_MODES)
def test_skip_nonfinite_leaves_everything_as_it_was(mode, position, bad):
    check_skip_nonfinite_leaves_everything_as_it_was(
        lambda ps, **kw: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01, **kw),
        ("exp_avg", "norm_avg"), "cpu", bad, position, dtype=torch.bfloat16,
        master_weights=mode)


@pytest.mark.parametrize("mode", BF16_MODES)
def test_dtensor_params_step_like_plain_ones(one_rank, mode):
    """The DTensor rule runs the two halves with the mode's arguments (ampfuse.ops.dtensor)."""
    check_dtensor_state_is_the_plain_state(*check_dtensor_params_step_like_plain_ones(
        lambda ps: make_novograd(ps, mode), grad_scale=4.0, dtype=torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", BF16_MODES)
def test_cuda_optimizer_matches_cpu_with_the_max_norm(mode):
    """The max norm is exact in any order, so the GPU's steps are the CPU's bit for bit."""
    check_cuda_steps_are_the_cpu_steps(lambda ps: make_novograd(ps, mode, norm_type=0))

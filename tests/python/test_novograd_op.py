"""The fused_novograd_ op itself (FusedNovoGrad, built on it, is tested in test_novograd.py):
the math against apex's in float64, opcheck, the skip contract, inf/nan at the first, a middle
and the last element, the two halves of a sharded step, results independent of the thread
count, CUDA against the CPU, and argument errors."""

import dataclasses

import pytest
import torch

import ampfuse
from helpers import (
    POSITIONS,
    assert_lists_equal,
    call_with_one_and_more_threads,
    clone_args,
    position_index,
    raises_naming,
)
from novograd_reference import NovoGradConfig, ReferenceNovoGrad

SHAPES = [(5,), (65537,), (3, 4), (0,), (9, 17)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float16]


def _args(device, dtypes=DTYPES, shapes=SHAPES, masters=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(d).to(device) for s, d in zip(shapes, dtypes)]
    grads = [torch.randn(s, generator=gen).to(d).to(device) for s, d in zip(shapes, dtypes)]
    return {
        "params": params,
        "grads": grads,
        "exp_avgs": [torch.zeros(s, device=device) for s in shapes],
        "norm_avgs": [torch.zeros((), device=device) for _ in shapes],
        "master_params": [p.float() for p in params] if masters else [],
        "step": torch.zeros((), device=device),
        "lr": torch.full((1,), 1e-2, device=device),
    }


def _call(a, config=NovoGradConfig(), *, grad_scale=None, found_inf=None, write_grads=False,
          reductions=None, part="both"):
    c = config
    ampfuse.ops.fused_novograd_(
        a["params"], a["grads"], a["exp_avgs"], a["norm_avgs"], a["master_params"], a["step"],
        c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.bias_correction, c.grad_averaging,
        c.reg_inside_moment, c.norm_type, c.init_zero, grad_scale, found_inf,
        write_unscaled_grads=write_grads, tensor_reductions=reductions, part=part)


def _reductions(a):
    return torch.zeros(len(a["params"]), dtype=torch.float64, device=a["step"].device)




def _assert_same(a, b, keys=("params", "grads", "exp_avgs", "norm_avgs", "master_params")):
    assert_lists_equal(a, b, keys)


CONFIGS = {
    "apex_defaults": NovoGradConfig(),
    "decay": NovoGradConfig(weight_decay=0.1),
    "reg_inside_moment": NovoGradConfig(weight_decay=0.1, reg_inside_moment=True),
    "max_norm": NovoGradConfig(weight_decay=0.05, norm_type=0),
    "max_norm_inside": NovoGradConfig(norm_type=0, reg_inside_moment=True, weight_decay=0.05),
    "init_zero": NovoGradConfig(init_zero=True, weight_decay=0.01),
    "no_bias_correction": NovoGradConfig(bias_correction=False, grad_averaging=False),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_apex_math_in_float64(config):
    """Four steps with fresh grads each (the running norms and moments carry over), fp32 masters
    of fp16/bf16 params, a loss scale divided out: every master, moment and running norm tracks
    apex's arithmetic done in float64, and each param is its master rounded."""
    a = _args("cpu")
    reference = ReferenceNovoGrad(a["master_params"], config)
    gen = torch.Generator().manual_seed(1)
    scale = 64.0
    for _ in range(4):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        a["grads"] = [(g * scale).to(d) for g, d in zip(grads, DTYPES)]
        reference.step([g.float() for g in a["grads"]], grad_scale=scale)
        _call(a, config, grad_scale=torch.full((1,), scale))
    assert float(a["step"]) == 4.0
    for i in range(len(SHAPES)):
        torch.testing.assert_close(a["master_params"][i].double(), reference.params[i],
                                   rtol=2e-6, atol=2e-7)
        # A moment sums rounded terms of its own size: its error is relative to that.
        atol = 1e-6 * max(1.0, float(reference.moments[i].abs().max())) if SHAPES[i][0] else 0
        torch.testing.assert_close(a["exp_avgs"][i].double(), reference.moments[i],
                                   rtol=2e-6, atol=atol)
        torch.testing.assert_close(float(a["norm_avgs"][i]), reference.norms[i], rtol=2e-6,
                                   atol=0.0)
        assert torch.equal(a["params"][i], a["master_params"][i].to(DTYPES[i]))


def test_params_without_masters_are_updated_in_place():
    a = _args("cpu", dtypes=[torch.float32] * len(SHAPES), masters=False)
    config = CONFIGS["decay"]
    reference = ReferenceNovoGrad(a["params"], config)
    for _ in range(2):
        reference.step(a["grads"])
        _call(a, config)
    for p, r in zip(a["params"], reference.params):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-7)


def test_first_step_seeds_the_running_norm_with_the_grads_own():
    """Without init_zero the first blend starts from the step's norm, so avg is that norm; with
    init_zero it is sqrt(1 - beta2) times it, which the bias correction then undoes."""
    a, zero = _args("cpu", masters=False), _args("cpu", masters=False)
    _call(a)
    _call(zero, dataclasses.replace(NovoGradConfig(), init_zero=True))
    beta2 = NovoGradConfig().beta2
    for i, g in enumerate(a["grads"]):
        norm = float(g.double().norm())
        torch.testing.assert_close(float(a["norm_avgs"][i]), norm, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(float(zero["norm_avgs"][i]), (1 - beta2) ** 0.5 * norm,
                                   rtol=1e-6, atol=0.0)


def test_found_inf_writes_nothing(device):
    a = _args(device)
    _call(a)  # a second step: the running norms are not zero
    before = clone_args(a)
    _call(a, found_inf=torch.ones(1, device=device),
          grad_scale=torch.full((1,), 4.0, device=device), write_grads=True)
    _assert_same(a, before)
    assert float(a["step"]) == 1.0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("norm_type", [2, 0], ids=["l2", "max"])
@pytest.mark.parametrize("position", POSITIONS)
def test_a_non_finite_grad_reaches_its_tensors_norm(device, bad, norm_type, position):
    """apex lets inf/nan through (a scaler's found_inf or skip_nonfinite is what skips a step),
    and so does the op: the tensor's running norm turns inf (NaN). Dividing by it, the bad
    element turns NaN and the others of its tensor stand still (all turn NaN); the other
    tensors step as if nothing happened."""
    config = NovoGradConfig(norm_type=norm_type)
    a = _args(device, masters=True)
    clean = clone_args(a)
    start = a["master_params"][1].clone()
    i = position_index(position, a["grads"][1].numel())
    a["grads"][1][i] = bad
    for args in (a, clean):
        _call(args, config)
    norm, master = a["norm_avgs"][1], a["master_params"][1]
    if bad == float("inf"):
        assert torch.isinf(norm)
        assert torch.isnan(master[i])
        keep = torch.ones(master.numel(), dtype=torch.bool, device=device)
        keep[i] = False
        assert torch.equal(master[keep], start[keep]), "the rest is divided by an inf norm"
    else:
        assert torch.isnan(norm) and torch.isnan(master).all()
    for t in (0, 2, 3, 4):
        assert torch.equal(a["master_params"][t], clean["master_params"][t])
        assert torch.equal(a["norm_avgs"][t], clean["norm_avgs"][t])


def test_results_do_not_depend_on_the_thread_count():
    a = _args("cpu", shapes=[(300_000,), (70_000,), (3,)], dtypes=DTYPES[:3])
    b = clone_args(a)
    call_with_one_and_more_threads(_call, a, b)
    _assert_same(a, b)


@pytest.mark.parametrize("norm_type", [2, 0], ids=["l2", "max"])
def test_scale_is_divided_out_of_grads_and_norms(norm_type):
    config = NovoGradConfig(norm_type=norm_type, weight_decay=0.01)
    a = _args("cpu", dtypes=[torch.float32] * len(SHAPES))
    scaled = clone_args(a)
    scaled["grads"] = [g * 64 for g in scaled["grads"]]
    _call(a, config)
    _call(scaled, config, grad_scale=torch.full((1,), 64.0), write_grads=True)
    _assert_same(a, scaled)


def test_grads_stay_scaled_without_write_grads():
    a = _args("cpu")
    before = [g.clone() for g in a["grads"]]
    _call(a, grad_scale=torch.full((1,), 8.0))
    for g, b in zip(a["grads"], before):
        assert torch.equal(g, b)


@pytest.mark.parametrize("norm_type", [2, 0], ids=["l2", "max"])
@pytest.mark.parametrize("masters", [True, False])
def test_the_two_halves_give_the_whole_step_bit_for_bit(device, masters, norm_type):
    """part="norms" then part="apply" (what a sharded step runs, with the reductions combined
    in between) equals one part="both" call; "both" leaves the same reductions when asked, and
    the first half alone writes nothing but them."""
    config = NovoGradConfig(norm_type=norm_type, weight_decay=0.01)
    whole = _args(device, masters=masters)
    _call(whole, config)  # a second step: blending with the running norms
    halves = clone_args(whole)
    whole_reductions, reductions = _reductions(whole), _reductions(halves)
    scale = torch.full((1,), 8.0, device=device)
    _call(whole, config, grad_scale=scale, write_grads=True, reductions=whole_reductions)
    before = clone_args(halves)
    _call(halves, config, grad_scale=scale, write_grads=True, reductions=reductions,
          part="norms")
    _assert_same(halves, before)  # the grads too: the first half only reads them
    assert float(halves["step"]) == 1.0
    assert torch.equal(reductions, whole_reductions)
    assert bool((reductions[[0, 1, 2, 4]] > 0).all()) and reductions[3] == 0  # 3 is empty
    _call(halves, config, grad_scale=scale, write_grads=True, reductions=reductions,
          part="apply")
    _assert_same(halves, whole)
    assert float(halves["step"]) == 2.0


def test_the_second_half_blends_the_reductions_it_is_given():
    """Reductions from elsewhere (other shards) change the step: four times the sum of squares
    on a seeded first step is twice the norm, so half the step."""
    a = _args("cpu", masters=True)
    b = clone_args(a)
    reductions_a, reductions_b = _reductions(a), _reductions(b)
    for args, reductions in ((a, reductions_a), (b, reductions_b)):
        _call(args, reductions=reductions, part="norms")
    reductions_b *= 4
    start = [m.clone() for m in a["master_params"]]
    _call(a, reductions=reductions_a, part="apply")
    _call(b, reductions=reductions_b, part="apply")
    for i in (0, 1, 2, 4):  # tensor 3 is empty
        torch.testing.assert_close(float(b["norm_avgs"][i]), 2 * float(a["norm_avgs"][i]),
                                   rtol=1e-6, atol=0.0)
        moved_a, moved_b = a["master_params"][i] - start[i], b["master_params"][i] - start[i]
        atol = 1e-6 * float(start[i].abs().max())
        torch.testing.assert_close(moved_b, moved_a / 2, rtol=1e-5, atol=atol)


def test_found_inf_skips_each_half():
    a = _args("cpu")
    before = clone_args(a)
    reductions = _reductions(a)
    for part in ("norms", "apply"):
        _call(a, found_inf=torch.ones(1), reductions=reductions, part=part)
    _assert_same(a, before)
    assert float(a["step"]) == 0.0 and not reductions.any()


def test_an_empty_list_still_counts_the_step(device):
    step = torch.zeros((), device=device)
    ampfuse.ops.fused_novograd_([], [], [], [], [], step, 0.1, 0.9, 0.99, 1e-8, 0.0)
    assert float(step) == 1.0


def _opcheck_args(a, part="both", reductions=None, write_grads=False, scale=None):
    return (a["params"], a["grads"], a["exp_avgs"], a["norm_avgs"], a["master_params"],
            a["step"], a["lr"], 0.95, 0.98, 1e-8, 0.01, True, True, False, 2, False, scale,
            torch.zeros(1, device=a["step"].device), write_grads, reductions, part)


@pytest.mark.parametrize("write_grads", [True, False], ids=["write_grads", "read_grads"])
@pytest.mark.parametrize("masters", [True, False])
def test_opcheck(device, masters, write_grads):
    a = _args(device, masters=masters)
    scale = torch.full((1,), 8.0, device=device)
    torch.library.opcheck(torch.ops.ampfuse.fused_novograd_.default,
                          _opcheck_args(a, write_grads=write_grads, scale=scale))


@pytest.mark.parametrize("part", ["norms", "apply"])
def test_opcheck_halves(device, part):
    a = _args(device, masters=True)
    reductions = torch.rand(len(a["params"]), dtype=torch.float64, device=device)
    torch.library.opcheck(torch.ops.ampfuse.fused_novograd_.default,
                          _opcheck_args(a, part=part, reductions=reductions))


@pytest.mark.cuda
@pytest.mark.parametrize("norm_type", [2, 0], ids=["l2", "max"])
@pytest.mark.parametrize("masters", [True, False])
def test_cuda_matches_the_cpu(masters, norm_type):
    """Two steps, each in halves: the first gives each tensor's grad-norm reduction on both
    devices (an L2 sum to its last bits: the GPU adds in another order; a max exactly); from
    the GPU's reductions the second half writes the same bits on both. Comparing after each
    side's own reductions cannot be tight: a norm a few ulps apart moves a 16-bit param near a
    rounding boundary by a whole ulp. test_the_two_halves_give_the_whole_step_bit_for_bit
    holds the one-call step to the halves on each device."""
    config = NovoGradConfig(norm_type=norm_type, weight_decay=0.01)
    cpu = _args("cpu", masters=masters)
    cuda = {k: ([t.cuda() for t in v] if isinstance(v, list) else v.cuda())
            for k, v in clone_args(cpu).items()}
    for _ in range(2):
        cpu_reductions, cuda_reductions = _reductions(cpu), _reductions(cuda)
        for args, reductions in ((cpu, cpu_reductions), (cuda, cuda_reductions)):
            _call(args, config, grad_scale=torch.full((1,), 2.0, device=reductions.device),
                  write_grads=True, reductions=reductions, part="norms")
        if norm_type == 0:
            assert torch.equal(cuda_reductions.cpu(), cpu_reductions)
        else:
            torch.testing.assert_close(cuda_reductions.cpu(), cpu_reductions, rtol=1e-6, atol=0)
        for args, shared in ((cpu, cuda_reductions.cpu()), (cuda, cuda_reductions)):
            _call(args, config, grad_scale=torch.full((1,), 2.0, device=shared.device),
                  write_grads=True, reductions=shared, part="apply")
    _assert_same(cpu, cuda)
    assert float(cpu["step"]) == float(cuda["step"]) == 2.0


ERRORS = {
    "norm_type": ({"norm_type": 1}, ["norm_type=1", "2 .the L2 norm. or 0"]),
    "negative_decay": ({"weight_decay": -0.1}, ["weight_decay", ">= 0"]),
    "beta2": ({"beta2": 1.0}, ["beta2", r"\[0, 1\)"]),
    "unknown_part": ({"part": "first"}, ["part='first'", "'norms'"]),
    "half_without_reductions": ({"part": "norms"}, ["tensor_reductions", "float64"]),
    "reductions_wrong_shape": (
        {"part": "apply", "tensor_reductions": torch.zeros(2, dtype=torch.float64)},
        ["tensor_reductions", r"shape \(5,\)"]),
    "reductions_wrong_dtype": ({"tensor_reductions": torch.zeros(5)},
                               ["tensor_reductions", "float64"]),
    "norm_avg_missing": ({"norm_avgs": "short"}, ["norm_avgs has 4", "one running grad norm"]),
    "norm_avg_shape": ({"norm_avgs": "shape"}, [r"norm_avgs\[2\]", "one element"]),
    "norm_avg_dtype": ({"norm_avgs": "dtype"}, [r"norm_avgs\[2\]", "float32"]),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_argument_errors_name_the_argument(case):
    changes, patterns = case
    a = _args("cpu")
    norms = a["norm_avgs"]
    if changes.get("norm_avgs") == "short":
        norms = norms[:4]
    elif changes.get("norm_avgs") == "shape":
        norms = norms[:2] + [torch.zeros(2)] + norms[3:]
    elif changes.get("norm_avgs") == "dtype":
        norms = norms[:2] + [torch.zeros((), dtype=torch.float64)] + norms[3:]
    before = clone_args(a)
    with raises_naming(*patterns):
        ampfuse.ops.fused_novograd_(
            a["params"], a["grads"], a["exp_avgs"], norms, a["master_params"], a["step"],
            a["lr"], 0.95, changes.get("beta2", 0.98), 1e-8, changes.get("weight_decay", 0.0),
            norm_type=changes.get("norm_type", 2),
            tensor_reductions=changes.get("tensor_reductions"), part=changes.get("part", "both"))
    _assert_same(a, before)


def test_moments_must_be_fp32():
    a = _args("cpu")
    a["exp_avgs"][0] = a["exp_avgs"][0].half()
    with raises_naming("exp_avgs", "float32"):
        _call(a)

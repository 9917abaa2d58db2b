"""ampfuse.optimizers.FusedNovoGrad against NovoGrad in float64 as apex.optimizers.FusedNovoGrad
computes it (novograd_reference.py), and in use: fp32 masters, params without grads, loss
scales (GradScaler, amp O1/O2), skip_nonfinite, checkpoints (its own and apex's), the apex
alias (including the import line of timm-derived training scripts), torch.compile, refused
options and DTensor params on one rank (two ranks: test_fsdp2.py). The op's own contract is
test_novograd_op.py's.

Parity: 20 steps, params within 1e-5 of the largest magnitude of the reference (test_adam's
assert_parity). With master_weights the fp32 masters follow the reference fed the upcast
low-precision grads, and the params are the masters rounded, bit for bit.
"""

import dataclasses

import pytest
import torch

import ampfuse
from ampfuse.optimizers import FusedNovoGrad
from fused_optimizer_usage import (
    check_a_torch_grad_scaler_drives_it,
    check_amp_trains_like_fp32,
    check_bad_options_are_refused_by_name,
    check_compiled_steps_match_eager,
    check_dtensor_params_step_like_plain_ones,
    check_scaled_grads_give_the_unscaled_result,
    check_skip_nonfinite_leaves_everything_as_it_was,
)
from helpers import dtype_id, raises_naming
from novograd_reference import NovoGradConfig, reference_step
from test_adam import assert_parity, clone_params, make_params, set_grads, step_grads

STEPS = 20
SHAPES = [(64, 33), (1000,), (7,), (3, 5, 2), (0,), (129, 2)]


def reference_novograd(params, grads_per_step, config):
    """float64 NovoGrad, each param counting its own steps: grads_per_step[s][i] is param i's
    grad at step s (None: no grad, the param does not step). Returns the params."""
    p64 = [p.detach().double().clone() for p in params]
    moments = [torch.zeros_like(p) for p in p64]
    norms = [0.0] * len(p64)
    steps = [0] * len(p64)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            if g is None:
                continue
            steps[i] += 1
            p64[i], moments[i], norms[i] = reference_step(p64[i], g.double(), moments[i],
                                                          norms[i], steps[i], config)
    return p64


def _options(config):
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("beta1", "beta2")}


def run_fused(params, grads_per_step, config, **options):
    opt = FusedNovoGrad(params, betas=(config.beta1, config.beta2), **_options(config), **options)
    for grads in grads_per_step:
        set_grads(params, grads)
        opt.step()
    return opt


CONFIGS = {
    "apex_defaults": NovoGradConfig(lr=1e-3, beta1=0.9, beta2=0.999),
    "decay": NovoGradConfig(weight_decay=0.01),
    "reg_inside_moment": NovoGradConfig(weight_decay=0.01, reg_inside_moment=True),
    "max_norm": NovoGradConfig(norm_type=0, weight_decay=0.01),
    "init_zero": NovoGradConfig(init_zero=True),
    "no_averaging_no_bias": NovoGradConfig(grad_averaging=False, bias_correction=False),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fp32_matches_the_float64_reference(device, config):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    grads = [step_grads(params, s) for s in range(STEPS)]
    run_fused(params, grads, config)
    for p, e in zip(params, reference_novograd(ref_params, grads, config)):
        assert_parity(p, e, "param")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_fp32_masters_follow_the_reference_and_params_are_them_rounded(device, dtype):
    params = make_params(SHAPES, dtype, device)
    masters = clone_params(params, torch.float32)
    grads = [step_grads(params, s) for s in range(STEPS)]
    config = CONFIGS["decay"]
    opt = run_fused(params, grads, config, master_weights=True)
    expected = reference_novograd(masters, grads, config)
    for p, e in zip(params, expected):
        master = opt.state[p]["master_param"]
        assert_parity(master, e, "master")
        assert torch.equal(p.detach(), master.to(dtype))


def test_params_without_grads_keep_their_state_and_count(device):
    """A param without a grad neither steps nor counts the step (apex asserted instead); its
    running norm is seeded from its own first grad, whenever that comes."""
    params = make_params([(10,), (20,)], torch.float32, device)
    ref_params = clone_params(params)
    grads = [step_grads(params, s) for s in range(4)]
    grads[0][1] = None
    grads[2][1] = None
    config = CONFIGS["decay"]
    opt = run_fused(params, grads, config)
    assert float(opt.state[params[0]]["step"]) == 4.0
    assert float(opt.state[params[1]]["step"]) == 2.0
    for p, e in zip(params, reference_novograd(ref_params, grads, config)):
        assert_parity(p, e, "param")


def make_novograd(params, **options):
    return FusedNovoGrad(params, lr=1e-2, weight_decay=0.01, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_scaled_grads_give_the_unscaled_result_bit_for_bit(device, dtype):
    check_scaled_grads_give_the_unscaled_result(make_novograd, SHAPES, dtype, device)


def test_a_torch_grad_scaler_drives_it(device):
    check_a_torch_grad_scaler_drives_it(make_novograd, SHAPES, device)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_skip_nonfinite_leaves_everything_as_it_was(device, bad, position):
    check_skip_nonfinite_leaves_everything_as_it_was(make_novograd, ("exp_avg", "norm_avg"),
                                                     device, bad, position)


def test_state_dict_resume_is_bit_for_bit(device):
    params = make_params(SHAPES, torch.bfloat16, device)
    resumed = clone_params(params)
    grads = [step_grads(params, s) for s in range(6)]
    config = CONFIGS["decay"]
    run_fused(params, grads, config, master_weights=True)
    first = run_fused(resumed, grads[:3], config, master_weights=True)
    saved = first.state_dict()
    assert saved["param_groups"][0]["step"] == 3, "apex's per-group step"
    again = FusedNovoGrad(resumed, betas=(config.beta1, config.beta2), **_options(config),
                          master_weights=True)
    again.load_state_dict(saved)
    for g in grads[3:]:
        set_grads(resumed, g)
        again.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


def test_loads_and_writes_apex_fused_novograd_checkpoints(device):
    """apex keeps the step count and, per group, the running norms of its fp16 params and of its
    fp32 params (in param order) as 'exp_avg_sq'; only 'exp_avg' per param. Both directions."""
    params = make_params([(30,), (4, 5), (6,)], [torch.float32, torch.float16], device)
    resumed = clone_params(params)
    grads = [step_grads(params, s) for s in range(4)]
    config = CONFIGS["decay"]
    run_fused(params, grads, config, master_weights=True)
    first = run_fused(resumed, grads[:2], config, master_weights=True)
    ours = first.state_dict()
    fp16_norms, fp32_norms = ours["param_groups"][0]["exp_avg_sq"]
    norms = [first.state[p]["norm_avg"] for p in resumed]
    assert torch.equal(fp32_norms, torch.stack([norms[0], norms[2]]))
    assert torch.equal(fp16_norms, norms[1].reshape(1))
    apex_style = {
        "state": {i: {"exp_avg": s["exp_avg"].to(params[i].dtype)}
                  for i, s in ours["state"].items()},
        "param_groups": [dict(g) for g in ours["param_groups"]],
    }
    again = FusedNovoGrad(resumed, betas=(config.beta1, config.beta2), **_options(config),
                          master_weights=True)
    again.load_state_dict(apex_style)
    assert float(again.state[resumed[1]]["step"]) == 2.0
    assert torch.equal(again.state[resumed[1]]["norm_avg"], norms[1])
    assert "exp_avg_sq" not in again.param_groups[0] and "step" not in again.param_groups[0]
    for g in grads[2:]:
        set_grads(resumed, g)
        again.step()
    for a, b in zip(params, resumed):
        assert_parity(b, a, "resumed from an apex checkpoint", rtol=1e-3)
    wrong = dict(apex_style, param_groups=[dict(apex_style["param_groups"][0],
                                                exp_avg_sq=[fp16_norms, fp32_norms[:1]])])
    with raises_naming("1 saved torch.float32 norms", "2 torch.float32 params"):
        FusedNovoGrad(clone_params(params)).load_state_dict(wrong)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_trains_like_fp32(opt_level):
    # NovoGrad moves each layer by about lr per step whatever its grads' size: a larger lr and
    # more steps than LAMB's to lose a fifth of the loss.
    check_amp_trains_like_fp32(
        lambda params: FusedNovoGrad(params, lr=0.1, weight_decay=1e-3), opt_level, steps=80)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_matches_eager(backend):
    check_compiled_steps_match_eager(make_novograd, SHAPES, "cpu", backend)


@pytest.mark.cuda
def test_compiled_step_matches_eager_cuda():
    check_compiled_steps_match_eager(make_novograd, SHAPES, "cuda", "inductor")


def test_apex_alias_takes_apex_positional_order_and_the_timm_import_line():
    """timm before 1.0 and the training scripts derived from its optim_factory (DeiT, Swin,
    ConvNeXt, BEiT...) import four apex optimizers in one statement; with NovoGrad missing the
    whole import failed and every fused optimizer looked absent."""
    namespace = {}
    exec("from ampfuse.apex_compat.apex.optimizers import FusedNovoGrad, FusedAdam, FusedLAMB, "
         "FusedSGD", namespace)
    params = make_params([(8,)], torch.float32, "cpu")
    opt = namespace["FusedNovoGrad"](params, 1e-3, False, (0.8, 0.9), 1e-5, 0.1, False, True,
                                     False, 0, True, False)
    group = opt.param_groups[0]
    assert isinstance(opt, FusedNovoGrad)
    assert (group["bias_correction"], group["betas"], group["eps"], group["weight_decay"]) == (
        False, (0.8, 0.9), 1e-5, 0.1)
    assert (group["reg_inside_moment"], group["grad_averaging"], group["norm_type"],
            group["init_zero"]) == (True, False, 0, True)
    assert opt.set_grad_none is False


BAD_OPTIONS = {
    "amsgrad": ({"amsgrad": True}, ["amsgrad"]),
    "norm_type": ({"norm_type": 1}, ["norm_type=1", "2 .the L2 norm. or 0"]),
    "norm_type_inf": ({"norm_type": float("inf")}, ["norm_type=inf"]),
    "bool_norm_type": ({"norm_type": True}, ["norm_type=True"]),
    "master_weights": ({"master_weights": "Kahan"}, ["master_weights='Kahan'", "'kahan'"]),
    "beta": ({"betas": (0.9, 1.0)}, ["betas", r"\[0, 1\)"]),
    "flag": ({"init_zero": 1}, ["init_zero", "True or False"]),
    "negative_decay": ({"weight_decay": -1.0}, ["weight_decay", ">= 0"]),
    "foreign_key": ({"momentum": 0.9}, None),
}


@pytest.mark.parametrize("case", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_are_refused_by_name(case):
    check_bad_options_are_refused_by_name(FusedNovoGrad, *case)


@pytest.mark.parametrize("norm_type", [2, 0], ids=["l2", "max"])
def test_dtensor_params_step_like_plain_ones(one_rank, norm_type):
    """On one rank a DTensor step runs both halves of the op with the reductions combined
    between them (a no-op here): the same bits as plain tensors, running norms included."""
    plain, sharded, opts = check_dtensor_params_step_like_plain_ones(
        lambda ps: FusedNovoGrad(ps, lr=1e-2, norm_type=norm_type), grad_scale=4.0)
    for p, q in zip(plain, sharded):
        assert torch.equal(opts[0].state[p]["norm_avg"], opts[1].state[q]["norm_avg"])
    with raises_naming("part and tensor_reductions", "part='both'"):
        ampfuse.ops.fused_novograd_(
            [sharded[1].data], [sharded[1].grad], [sharded[1].data], [torch.zeros(())], [],
            torch.zeros(()), 1e-3, 0.9, 0.999, 1e-8, 0.0,
            tensor_reductions=torch.zeros(1, dtype=torch.float64), part="norms")

"""ampfuse.optimizers.FusedAdagrad and its op fused_adagrad_: against torch.optim.Adagrad (fused
and single-tensor) and a float64 Adagrad with apex FusedAdagrad's decoupled mode; checkpoints
both ways with torch and from apex; masters; the checks every fused optimizer shares
(fused_optimizer_usage.py); and the op's own contract (opcheck, skip, inf/nan positions,
errors).

Parity with torch: torch fuses `sum += g * g` into one FMA where ampfuse rounds the product
(so that CPU and CUDA agree bit for bit), so the two differ by an ulp or so per step: params
stay within 1e-5 of the largest magnitude over 20 steps (test_adam's assert_parity).
"""

import copy

import pytest
import torch

import ampfuse
from ampfuse.apex_compat.apex import optimizers as apex_optimizers
from ampfuse.optimizers import FusedAdagrad
from fused_optimizer_usage import (
    check_a_torch_grad_scaler_drives_it,
    check_amp_trains_like_fp32,
    check_bad_options_are_refused_by_name,
    check_compiled_steps_match_eager,
    check_dtensor_params_step_like_plain_ones,
    check_scaled_grads_give_the_unscaled_result,
    check_skip_nonfinite_leaves_everything_as_it_was,
)
from helpers import POSITIONS, clone_args, dtype_id, position_index, raises_naming
from test_adam import assert_parity, clone_params, make_params, set_grads, step_grads

STEPS = 20
SHAPES = [(64, 33), (1000,), (7,), (3, 5, 2), (0,), (129, 2)]

TORCH_OPTIONS = {
    "defaults": {},
    "decay": {"weight_decay": 0.1},
    "lr_decay": {"lr_decay": 0.05, "weight_decay": 0.01},
    "initial_accumulator": {"initial_accumulator_value": 0.5},
    "maximize": {"maximize": True, "weight_decay": 0.01},
}


def torch_fused_or_foreach(device):
    """The switch for torch's multi-tensor Adagrad on `device`: fused on the CPU; foreach on
    CUDA, where torch 2.11's Adagrad(fused=True) refuses CUDA params (its fused kernel is CPU
    only: _device_dtype_check_for_fused(p, cuda_unsupported=True) in torch/optim/adagrad.py)."""
    return {"fused": True} if torch.device(device).type == "cpu" else {"foreach": True}


@pytest.mark.parametrize("torch_fused", [True, False], ids=["torch_fused", "torch_single"])
@pytest.mark.parametrize("options", TORCH_OPTIONS.values(), ids=TORCH_OPTIONS.keys())
def test_fp32_tracks_torch_adagrad(device, options, torch_fused):
    params = make_params(SHAPES, torch.float32, device)
    twins = clone_params(params)
    ours = FusedAdagrad([{"params": params[:3]}, {"params": params[3:], "lr": 0.05}], lr=0.1,
                        **options)
    kind = torch_fused_or_foreach(device) if torch_fused else {"foreach": False}
    theirs = torch.optim.Adagrad([{"params": twins[:3]}, {"params": twins[3:], "lr": 0.05}],
                                 lr=0.1, **kind, **options)
    for s in range(STEPS):
        grads = step_grads(params, s)
        set_grads(params, grads)
        set_grads(twins, grads)
        ours.step()
        theirs.step()
    for i, (p, q) in enumerate(zip(params, twins)):
        assert_parity(p, q, f"param {i}")
        if p.numel():
            assert_parity(ours.state[p]["sum"], theirs.state[q]["sum"], f"sum {i}")


def reference_decoupled(params, grads_per_step, lr, eps, weight_decay):
    """apex FusedAdagrad's adagrad_w_mode in float64: p -= lr * (g / (sqrt(h) + eps) + wd * p)."""
    p64 = [p.detach().double().clone() for p in params]
    sums = [torch.zeros_like(p) for p in p64]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = g.double()
            sums[i] = sums[i] + g * g
            p64[i] = p64[i] - lr * (g / (sums[i].sqrt() + eps) + weight_decay * p64[i])
    return p64


def test_apex_decoupled_mode_matches_the_float64_reference(device):
    params = make_params(SHAPES, torch.float32, device)
    start = clone_params(params)
    grads = [step_grads(params, s) for s in range(STEPS)]
    opt = apex_optimizers.FusedAdagrad(params, lr=0.05, weight_decay=0.1, adagrad_w_mode=True)
    for g in grads:
        set_grads(params, g)
        opt.step()
    for i, (p, e) in enumerate(zip(params, reference_decoupled(start, grads, 0.05, 1e-10, 0.1))):
        assert_parity(p, e, f"param {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_fp32_masters_follow_torch_and_params_are_them_rounded(device, dtype):
    params = make_params(SHAPES, dtype, device)
    masters = clone_params(params, torch.float32)
    ours = FusedAdagrad(params, lr=0.1, weight_decay=0.01, master_weights=True)
    theirs = torch.optim.Adagrad(masters, lr=0.1, weight_decay=0.01,
                                 **torch_fused_or_foreach(device))
    for s in range(STEPS):
        grads = step_grads(params, s)
        set_grads(params, grads)
        set_grads(masters, [g.float() for g in grads])
        ours.step()
        theirs.step()
    for p, m in zip(params, masters):
        master = ours.state[p]["master_param"]
        assert_parity(master, m, "master")
        assert torch.equal(p.detach(), master.to(dtype))


def test_checkpoints_move_both_ways_with_torch_and_load_from_apex(device):
    params = make_params([(30,), (4, 5)], torch.float32, device)
    grads = [step_grads(params, s) for s in range(4)]
    options = {"lr": 0.1, "lr_decay": 0.1}
    ours = FusedAdagrad(params, **options)
    for g in grads[:2]:
        set_grads(params, g)
        ours.step()
    # Ours into torch's and on, against ours on.
    twins = clone_params(params)
    theirs = torch.optim.Adagrad(twins, **torch_fused_or_foreach(device), **options)
    # state_dict() hands out the live tensors, and a loader may keep them: copies, so that the
    # three optimizers below do not share their sums.
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    # torch's back into ours.
    again_params = clone_params(params)
    again = FusedAdagrad(again_params, **options)
    again.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert float(again.state[again_params[0]]["step"]) == 2.0
    for g in grads[2:]:
        for ps, opt in ((params, ours), (twins, theirs), (again_params, again)):
            set_grads(ps, g)
            opt.step()
    for p, q, r in zip(params, twins, again_params):
        assert_parity(q, p, "torch resumed from ours")
        assert torch.equal(r, p), "ours resumed through torch's state dict"
    # apex kept the sums in the param's dtype and no step count.
    apex_style = {"state": {i: {"sum": s["sum"].half()} for i, s in ours.state_dict()["state"]
                            .items()},
                  "param_groups": [{k: v for k, v in g.items() if k not in ("lr_decay",)}
                                   for g in ours.state_dict()["param_groups"]]}
    loaded = FusedAdagrad(clone_params(params), **options)
    loaded.load_state_dict(apex_style)
    state = next(iter(loaded.state.values()))
    assert state["sum"].dtype == torch.float32 and float(state["step"]) == 0.0


def make_adagrad(params, **options):
    return FusedAdagrad(params, lr=0.1, weight_decay=0.01, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_scaled_grads_give_the_unscaled_result_bit_for_bit(device, dtype):
    check_scaled_grads_give_the_unscaled_result(make_adagrad, SHAPES, dtype, device)


def test_a_torch_grad_scaler_drives_it(device):
    check_a_torch_grad_scaler_drives_it(make_adagrad, SHAPES, device)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", POSITIONS)
def test_skip_nonfinite_leaves_everything_as_it_was(device, bad, position):
    check_skip_nonfinite_leaves_everything_as_it_was(make_adagrad, ("sum",), device, bad,
                                                     position)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_matches_eager(backend):
    check_compiled_steps_match_eager(make_adagrad, SHAPES, "cpu", backend)


@pytest.mark.cuda
def test_compiled_step_matches_eager_cuda():
    check_compiled_steps_match_eager(make_adagrad, SHAPES, "cuda", "inductor")


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_trains_like_fp32(opt_level):
    check_amp_trains_like_fp32(lambda params: FusedAdagrad(params, lr=0.05), opt_level)


BAD_OPTIONS = {
    "lr_decay": ({"lr_decay": -0.1}, ["lr_decay", ">= 0"]),
    "accumulator": ({"initial_accumulator_value": -1.0}, ["initial_accumulator_value"]),
    "eps": ({"eps": -1e-10}, ["eps", ">= 0"]),
    "master_weights": ({"master_weights": "Kahan"}, ["master_weights='Kahan'", "'kahan'"]),
    "flag": ({"adagrad_w_mode": 1}, ["adagrad_w_mode", "True or False"]),
    "foreign_key": ({"betas": (0.9, 0.99)}, None),
}


@pytest.mark.parametrize("case", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_are_refused_by_name(case):
    check_bad_options_are_refused_by_name(FusedAdagrad, *case)


def test_dtensor_params_step_like_plain_ones(one_rank):
    check_dtensor_params_step_like_plain_ones(make_adagrad)


# ---- the op ------------------------------------------------------------------------------


def _op_args(device, masters=True):
    params = make_params([(5,), (65537,), (0,), (9, 17)],
                         [torch.float32, torch.float16, torch.float32, torch.bfloat16], device)
    params = [p.detach() for p in params]
    return {
        "params": params,
        "grads": [g for g in step_grads(params, 0)],
        "sums": [torch.rand(p.shape).to(device) for p in params],
        "masters": [p.float() for p in params] if masters else [],
        "step": torch.full((), 2.0, device=device),
    }


def _op_call(a, **options):
    ampfuse.ops.fused_adagrad_(a["params"], a["grads"], a["sums"], a["masters"], a["step"], 0.1,
                                **options)


@pytest.mark.parametrize("write_grads", [True, False], ids=["write_grads", "read_grads"])
@pytest.mark.parametrize("masters", [True, False])
def test_opcheck(device, masters, write_grads):
    a = _op_args(device, masters)
    torch.library.opcheck(
        torch.ops.ampfuse.fused_adagrad_.default,
        (a["params"], a["grads"], a["sums"], a["masters"], a["step"],
         torch.full((1,), 0.1, device=device), 0.01, 0.1, 1e-10, False, False,
         torch.full((1,), 8.0, device=device), torch.zeros(1, device=device), write_grads))


def test_found_inf_writes_nothing(device):
    a = _op_args(device)
    before = clone_args(a)
    _op_call(a, grad_scale=torch.full((1,), 4.0, device=device),
             found_inf=torch.ones(1, device=device), write_unscaled_grads=True)
    for key, value in before.items():
        for x, y in zip(value if isinstance(value, list) else [value],
                        a[key] if isinstance(value, list) else [a[key]]):
            assert torch.equal(x, y), key


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", POSITIONS)
def test_a_non_finite_grad_reaches_only_its_element(device, bad, position):
    a = _op_args(device)
    clean = clone_args(a)
    i = position_index(position, a["grads"][1].numel())
    a["grads"][1][i] = bad
    clean["grads"][1][i] = 0.0
    for args in (a, clean):
        _op_call(args, weight_decay=0.1)
    assert torch.isnan(a["masters"][1][i])
    keep = torch.ones(a["grads"][1].numel(), dtype=torch.bool, device=device)
    keep[i] = False
    assert torch.equal(a["masters"][1][keep], clean["masters"][1][keep])
    for t in (0, 2, 3):
        assert torch.equal(a["masters"][t], clean["masters"][t])


def test_an_empty_list_still_counts_the_step(device):
    step = torch.zeros((), device=device)
    ampfuse.ops.fused_adagrad_([], [], [], [], step, 0.1)
    assert float(step) == 1.0


@pytest.mark.cuda
@pytest.mark.parametrize("masters", [True, False])
def test_cuda_matches_the_cpu_bit_for_bit(masters):
    cpu = _op_args("cpu", masters)
    cuda = {k: [t.cuda() for t in v] if isinstance(v, list) else v.cuda() for k, v in cpu.items()}
    for args in (cpu, cuda):
        _op_call(args, lr_decay=0.01, weight_decay=0.1,
                 grad_scale=torch.full((1,), 2.0, device=args["step"].device),
                 write_unscaled_grads=True)
    for key in ("params", "grads", "sums", "masters"):
        for x, y in zip(cpu[key], cuda[key]):
            assert torch.equal(x, y.cpu()), key


OP_ERRORS = {
    "lr_decay": ({"lr_decay": -1.0}, ["lr_decay", ">= 0"]),
    "sums_fp16": ({"sums": "half"}, ["state_sums", "float32"]),
    "sums_missing": ({"sums": "short"}, ["state_sums has 3", "one per param"]),
}


@pytest.mark.parametrize("case", OP_ERRORS.values(), ids=OP_ERRORS.keys())
def test_op_argument_errors_name_the_argument(case):
    changes, patterns = case
    a = _op_args("cpu")
    if changes.get("sums") == "half":
        a["sums"][1] = a["sums"][1].half()
    elif changes.get("sums") == "short":
        a["sums"] = a["sums"][:3]
    with raises_naming(*patterns):
        _op_call(a, **{k: v for k, v in changes.items() if k != "sums"})

"""ampfuse.optimizers.FusedLAMB against a float64 LAMB written from apex.optimizers.FusedLAMB's
kernels (csrc/multi_tensor_lamb.cu in apex): the global grad norm over every group, the clip
max(1, norm / max_grad_norm), Adam moments with grad_averaging, the L2 or decoupled decay, and the
per-tensor trust ratio ||p|| / ||update||, applied only with weight decay unless use_nvlamb.

Parity: 20 steps, params and moments within 1e-5 of the largest magnitude of the reference.
With master_weights the fp32 masters follow the reference fed the upcast low-precision grads,
and the params equal the masters rounded, bit for bit. The op itself (opcheck, errors, inf/nan
positions, threads) is tested in test_lamb_op.py.
"""

import itertools
import math

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import FusedLAMB
from fused_optimizer_usage import (
    check_a_torch_grad_scaler_drives_it,
    check_scaled_grads_give_the_unscaled_result,
    check_skip_nonfinite_leaves_everything_as_it_was,
)
from helpers import dtype_id
from test_adam import assert_parity, clone_params, make_params, set_grads, step_grads

STEPS = 20
SHAPES = [(64, 33), (1000,), (7,), (3, 5, 2), (0,), (129, 2)]


def reference_lamb(params, groups, grads_per_step, lr, betas=(0.9, 0.999), eps=1e-6,
                   weight_decay=0.01, adam_w_mode=True, bias_correction=True,
                   grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False):
    """float64 LAMB in apex's order of operations. `groups` lists the param indices of each
    group (one step count per group, as apex keeps it); grads_per_step[s][i] is param i's grad
    at step s (None: no grad, the param does not step, as in apex). Returns params, m, v."""
    p64 = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in p64]
    v = [torch.zeros_like(p) for p in p64]
    steps = [0] * len(groups)
    beta1, beta2 = betas
    for grads in grads_per_step:
        g64 = [None if g is None else g.double() for g in grads]
        norm = math.sqrt(sum(float(g.square().sum()) for g in g64 if g is not None))
        clip = norm / max_grad_norm if max_grad_norm and norm > max_grad_norm else 1.0
        for gi, members in enumerate(groups):
            steps[gi] += 1
            t = steps[gi]
            bc1 = 1 - beta1 ** t if bias_correction else 1.0
            bc2 = 1 - beta2 ** t if bias_correction else 1.0
            beta3 = 1 - beta1 if grad_averaging else 1.0
            for i in members:
                if g64[i] is None:
                    continue
                g = g64[i] / clip
                if not adam_w_mode:
                    g = g + weight_decay * p64[i]
                m[i] = m[i] * beta1 + beta3 * g
                v[i] = v[i] * beta2 + (1 - beta2) * g * g
                update = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
                if adam_w_mode:
                    update = update + weight_decay * p64[i]
                ratio = lr
                if use_nvlamb or weight_decay != 0:
                    pn, un = float(p64[i].norm()), float(update.norm())
                    if pn != 0 and un != 0:
                        ratio = lr * pn / un
                p64[i] = p64[i] - ratio * update
    return p64, m, v


def run_fused(params, groups, grads_per_step, **options):
    param_groups = [{"params": [params[i] for i in members]} for members in groups]
    opt = FusedLAMB(param_groups, **options)
    for grads in grads_per_step:
        set_grads(params, grads)
        opt.step()
    return opt


OPTION_SETS = {
    "apex_defaults": {},
    "l2_mode": {"adam_w_mode": False},
    "no_decay": {"weight_decay": 0.0},
    "nvlamb_no_decay": {"weight_decay": 0.0, "use_nvlamb": True},
    "no_averaging_no_bias": {"grad_averaging": False, "bias_correction": False},
    "no_clip": {"max_grad_norm": None},
    "tight_clip": {"max_grad_norm": 0.05},
}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_fp32_matches_the_float64_reference(device, options):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    grads = [step_grads(params, s, scale=3.0) for s in range(STEPS)]
    groups = [[0, 1, 2], [3, 4, 5]]
    opt = run_fused(params, groups, grads, lr=1e-2, **options)
    expected, m, v = reference_lamb(ref_params, groups, grads, lr=1e-2, **options)
    for i, p in enumerate(params):
        assert_parity(p, expected[i], f"param {i}")
        if p.numel():
            assert_parity(opt.state[p]["exp_avg"], m[i], f"exp_avg {i}")
            assert_parity(opt.state[p]["exp_avg_sq"], v[i], f"exp_avg_sq {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_fp32_masters_follow_the_reference_and_params_are_them_rounded(device, dtype):
    params = make_params(SHAPES, dtype, device)
    grads = [step_grads(params, s) for s in range(STEPS)]
    opt = run_fused(params, [list(range(len(params)))], grads, lr=1e-2, master_weights=True)
    expected, _, _ = reference_lamb(params_at_start(dtype, device), [list(range(len(params)))],
                                    grads, lr=1e-2)
    for i, p in enumerate(params):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert_parity(master, expected[i], f"master {i}")
        assert torch.equal(p.detach(), master.to(dtype)), f"param {i} is not its master rounded"


def params_at_start(dtype, device):
    return make_params(SHAPES, dtype, device)


def test_a_zero_param_moves_by_lr_not_by_a_zero_trust_ratio(device):
    """Zero-initialized params (biases) have ||p|| = 0: the trust ratio falls back to lr, as in
    apex, rather than 0, which would pin them at zero forever."""
    params = [torch.zeros(12, device=device, requires_grad=True),
              torch.ones(5, device=device, requires_grad=True)]
    ref_params = clone_params(params)
    grads = [step_grads(params, s) for s in range(3)]
    run_fused(params, [[0, 1]], grads, lr=1e-2)
    expected, _, _ = reference_lamb(ref_params, [[0, 1]], grads, lr=1e-2)
    assert params[0].abs().min() > 0
    for p, e in zip(params, expected):
        assert_parity(p, e, "param")


def test_params_without_grads_keep_their_state_and_count(device):
    """apex's lists skip params without a grad; their moments and step count stay."""
    params = make_params([(10,), (20,)], torch.float32, device)
    ref_params = clone_params(params)
    grads = [step_grads(params, s) for s in range(4)]
    grads[1][1] = None
    grads[2][1] = None
    opt = run_fused(params, [[0, 1]], grads, lr=1e-2)
    assert float(opt.state[params[0]]["step"]) == 4.0
    assert float(opt.state[params[1]]["step"]) == 2.0
    # The reference counts one step per group, as apex does: only param 0, which always steps,
    # is comparable. The grad norm of steps 1 and 2 is param 0's alone in both.
    expected, _, _ = reference_lamb(ref_params, [[0, 1]], grads, lr=1e-2)
    assert_parity(params[0], expected[0], "param 0")


def test_the_grad_norm_spans_every_group(device):
    """One global norm for the whole step: splitting the params into groups changes nothing."""
    params = make_params(SHAPES, torch.float32, device)
    split = clone_params(params)
    grads = [step_grads(params, s, scale=5.0) for s in range(5)]
    run_fused(params, [list(range(len(params)))], grads, lr=1e-2)
    run_fused(split, [[0, 1], [2, 3], [4, 5]], grads, lr=1e-2)
    for a, b in zip(params, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_scaled_grads_give_the_unscaled_result_bit_for_bit(device, dtype):
    """A power-of-two loss scale divides out exactly: the norm and every grad."""
    check_scaled_grads_give_the_unscaled_result(make_lamb, SHAPES, dtype, device)


def test_a_torch_grad_scaler_drives_it(device):
    check_a_torch_grad_scaler_drives_it(make_lamb, SHAPES, device)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_skip_nonfinite_leaves_everything_as_it_was(device, bad, position):
    check_skip_nonfinite_leaves_everything_as_it_was(make_lamb, ("exp_avg", "exp_avg_sq"),
                                                     device, bad, position)


def make_lamb(params, **options):
    return FusedLAMB(params, lr=1e-2, **options)


def test_option_sets_cover_each_switch_both_ways():
    switches = ("adam_w_mode", "grad_averaging", "bias_correction", "use_nvlamb")
    seen = {(k, v) for options in OPTION_SETS.values() for k, v in options.items()}
    defaults = {"adam_w_mode": True, "grad_averaging": True, "bias_correction": True,
                "use_nvlamb": False}
    for switch, value in itertools.product(switches, (True, False)):
        assert (switch, value) in seen or defaults[switch] == value, (switch, value)

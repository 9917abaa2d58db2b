"""The fused_adam_ and fused_sgd_ ops themselves (the optimizers built on them are tested in
test_adam.py and test_sgd.py): opcheck, mixed dtypes in one call, float or tensor lr, the
skip contract at the op level, and argument errors."""

import pytest
import torch

import ampfuse
from helpers import clone_args, raises_naming
from tolerances import assert_close_report

SHAPES = [(5,), (65537,), (3, 4), (0,)]


def _adam_args(device, param_dtypes, amsgrad=False, masters=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(device=device, dtype=d)
              for s, d in zip(SHAPES, param_dtypes)]
    grads = [torch.randn(s, generator=gen).to(device=device, dtype=d)
             for s, d in zip(SHAPES, reversed(param_dtypes))]
    fp32 = [torch.zeros(s, device=device) for s in SHAPES]
    return dict(
        params=params,
        grads=grads,
        exp_avgs=[t.clone() for t in fp32],
        exp_avg_sqs=[t.clone() for t in fp32],
        max_exp_avg_sqs=[t.clone() for t in fp32] if amsgrad else [],
        master_params=[p.float() for p in params] if masters else [],
        step=torch.zeros(1, device=device),
        lr=torch.full((1,), 1e-2, device=device),
    )


def _call_adam(a, amsgrad=False, grad_scale=None, found_inf=None):
    torch.ops.ampfuse.fused_adam_(
        a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["max_exp_avg_sqs"],
        a["master_params"], a["step"], a["lr"], 0.9, 0.999, 1e-8, 0.01, True, True, amsgrad,
        False, grad_scale, found_inf,
    )


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("write_grads", [True, False], ids=["write_grads", "read_grads"])
@pytest.mark.parametrize("masters", [True, False])
@pytest.mark.parametrize("amsgrad", [True, False])
def test_opcheck_adam(device, amsgrad, masters, write_grads):
    a = _adam_args(device, DTYPES, amsgrad=amsgrad, masters=masters)
    scale, found_inf = torch.full((1,), 8.0, device=device), torch.zeros(1, device=device)
    torch.library.opcheck(
        torch.ops.ampfuse.fused_adam_.default,
        (a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["max_exp_avg_sqs"],
         a["master_params"], a["step"], a["lr"], 0.9, 0.999, 1e-8, 0.01, True, True, amsgrad,
         False, scale, found_inf, write_grads),
    )


@pytest.mark.parametrize("wd_after_momentum", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_opcheck_sgd(device, momentum, wd_after_momentum):
    a = _adam_args(device, DTYPES)
    buffers = a["exp_avgs"] if momentum else []
    scale = torch.full((1,), 8.0, device=device)
    torch.library.opcheck(
        torch.ops.ampfuse.fused_sgd_.default,
        (a["params"], a["grads"], buffers, a["master_params"], a["step"], a["lr"], momentum,
         0.0, 0.01, momentum > 0, False, scale, None, True, wd_after_momentum),
    )


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_empty_params_check_scalars_against_steps_device(op):
    """With no params, step decides the device: a found_inf elsewhere is refused, not read as if
    it lived there (on CUDA a CPU pointer would have been dereferenced on the GPU). Meta tensors
    run the fake kernel, which checks the same."""
    step, lr = torch.zeros((), device="meta"), torch.full((), 0.1, device="meta")
    found_inf = torch.zeros(())
    with raises_naming("found_inf", "step, as params is empty"):
        if op == "adam":
            torch.ops.ampfuse.fused_adam_([], [], [], [], [], [], step, lr, 0.9, 0.999, 1e-8,
                                          0.0, True, True, False, False, None, found_inf)
        else:
            torch.ops.ampfuse.fused_sgd_([], [], [], [], step, lr, 0.0, 0.0, 0.0, False, False,
                                         None, found_inf)


@pytest.mark.cuda
def test_empty_params_on_cuda_refuse_a_cpu_found_inf_and_still_count_the_step():
    step, lr = torch.zeros((), device="cuda"), torch.full((), 0.1, device="cuda")
    with raises_naming("found_inf", "step, as params is empty"):
        torch.ops.ampfuse.fused_adam_([], [], [], [], [], [], step, lr, 0.9, 0.999, 1e-8, 0.0,
                                      True, True, False, False, None, torch.ones(()))
    torch.ops.ampfuse.fused_sgd_([], [], [], [], step, lr, 0.0, 0.0, 0.0, False, False, None,
                                 torch.zeros((), device="cuda"))
    assert step.item() == 1.0


def test_mixed_dtypes_with_masters_match_per_tensor_calls(device):
    together = _adam_args(device, DTYPES)
    _call_adam(together)
    for i in range(len(SHAPES)):
        alone = _adam_args(device, DTYPES)
        one = {k: (v[i:i + 1] if isinstance(v, list) else v) for k, v in alone.items()}
        _call_adam(one)
        assert_close_report(together["params"][i], alone["params"][i], exact=True)
        assert_close_report(together["master_params"][i], alone["master_params"][i], exact=True)
        assert torch.equal(together["params"][i], alone["master_params"][i].to(DTYPES[i]))
    assert together["step"].item() == 1.0


def test_float_lr_equals_tensor_lr(device):
    with_tensor, with_float = _adam_args(device, DTYPES), _adam_args(device, DTYPES)
    _call_adam(with_tensor)
    a = with_float
    ampfuse.fused_adam_(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"],
                        a["max_exp_avg_sqs"], a["master_params"], a["step"], 1e-2, 0.9, 0.999,
                        1e-8, 0.01)
    for x, y in zip(with_tensor["master_params"], with_float["master_params"]):
        assert_close_report(x, y, exact=True)


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_found_inf_leaves_every_tensor_bit_identical(device, op):
    a = _adam_args(device, DTYPES, amsgrad=True)
    before = clone_args(a)
    found_inf = torch.ones(1, device=device)
    scale = torch.full((1,), 4.0, device=device)
    # The grads are asked to be written back unscaled: a skipped step leaves them too.
    if op == "adam":
        ampfuse.fused_adam_(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"],
                            a["max_exp_avg_sqs"], a["master_params"], a["step"], a["lr"], 0.9,
                            0.999, 1e-8, 0.01, amsgrad=True, grad_scale=scale,
                            found_inf=found_inf, write_unscaled_grads=True)
    else:
        ampfuse.fused_sgd_(a["params"], a["grads"], a["exp_avgs"], a["master_params"], a["step"],
                           a["lr"], 0.9, 0.0, 0.0, True, False, scale, found_inf,
                           write_unscaled_grads=True)
    for key, value in a.items():
        for x, y in zip(value if isinstance(value, list) else [value],
                        before[key] if isinstance(value, list) else [before[key]]):
            assert torch.equal(x, y), key


def test_power_of_two_grad_scale_is_exact(device):
    plain, scaled = _adam_args(device, DTYPES, seed=3), _adam_args(device, DTYPES, seed=3)
    scaled["grads"] = [g * 1024 for g in scaled["grads"]]
    _call_adam(plain)
    _call_adam(scaled, grad_scale=torch.full((1,), 1024.0, device=device))
    for x, y in zip(plain["master_params"], scaled["master_params"]):
        assert_close_report(x, y, exact=True)


def test_moments_must_be_fp32(device):
    a = _adam_args(device, DTYPES)
    a["exp_avgs"][1] = a["exp_avgs"][1].half()
    with raises_naming(r"exp_avgs\[1\]", "float32"):
        _call_adam(a)


def test_list_lengths_must_match(device):
    a = _adam_args(device, DTYPES)
    a["grads"] = a["grads"][:2]
    with raises_naming("grads", "params"):
        _call_adam(a)


def test_max_exp_avg_sqs_must_be_empty_without_amsgrad(device):
    a = _adam_args(device, DTYPES, amsgrad=True)
    with raises_naming("max_exp_avg_sqs", "amsgrad"):
        _call_adam(a, amsgrad=False)


def test_bad_betas_are_refused(device):
    a = _adam_args(device, DTYPES)
    with raises_naming("beta1"):
        torch.ops.ampfuse.fused_adam_(
            a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], [], a["master_params"],
            a["step"], a["lr"], 1.0, 0.999, 1e-8, 0.0, True, True, False, False, None, None)


def test_nesterov_needs_momentum(device):
    a = _adam_args(device, DTYPES)
    with raises_naming("nesterov"):
        torch.ops.ampfuse.fused_sgd_(a["params"], a["grads"], [], a["master_params"], a["step"],
                                     a["lr"], 0.0, 0.0, 0.0, True, False, None, None)

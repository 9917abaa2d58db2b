"""FusedAdam refuses bad input by name: hyperparameters at construction and at step, groups
added later, SGD options in an Adam group, param dtypes, sparse grads, apex's positional order,
a grad_scale that is not one element. Nothing of the optimizer changes on a refusal."""


import pytest
import torch

from ampfuse.optimizers import FusedAdam, FusedAdamW, FusedLAMB, FusedNovoGrad
from helpers import raises_naming
from test_adam import (SHAPES, make_params, set_grads, step_grads)


BAD_HYPERPARAMETERS = {
    "negative_lr": (dict(lr=-1e-3), "lr"),
    "beta1_one": (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    "beta1_negative": (dict(betas=(-0.1, 0.999)), r"betas\[0\]"),
    "beta2_one": (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
    "betas_not_a_pair": (dict(betas=(0.9,)), "betas"),
    "negative_eps": (dict(eps=-1e-8), "eps"),
    "negative_weight_decay": (dict(weight_decay=-0.1), "weight_decay"),
    "nan_lr": (dict(lr=float("nan")), "lr"),
}


@pytest.mark.parametrize("case", list(BAD_HYPERPARAMETERS))
def test_bad_hyperparameters_fail_at_construction(case):
    kwargs, what = BAD_HYPERPARAMETERS[case]
    with raises_naming(r"param_groups\[0\]", what):
        FusedAdam(make_params(SHAPES[:2], torch.float32, "cpu"), **kwargs)


def test_bad_group_added_later_is_named_and_not_added():
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    opt = FusedAdam(params[:2])
    with raises_naming(r"param_groups\[1\]", r"betas\[1\]"):
        opt.add_param_group({"params": params[2:], "betas": (0.9, 1.5)})
    assert len(opt.param_groups) == 1


def test_sgd_hyperparameters_in_an_adam_group_are_rejected():
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    opt = FusedAdam(params[:2])
    with raises_naming(r"param_groups\[1\]", "momentum"):
        opt.add_param_group({"params": params[2:], "momentum": 0.9})


@pytest.mark.parametrize("dtype", [torch.complex128, torch.int64, torch.float64],
                         ids=["complex128", "int64", "float64"])
def test_unsupported_param_dtype_is_named(dtype):
    params = make_params(SHAPES[:4], torch.float32, "cpu")
    params[2] = torch.ones(3, dtype=dtype)
    with raises_naming(r"param_groups\[0\]\['params'\]\[2\]", str(dtype)):
        FusedAdam(params)


@pytest.mark.parametrize("cls", [FusedAdam, FusedAdamW, FusedLAMB, FusedNovoGrad])
def test_sparse_grad_is_named_at_step_with_the_optimizers_that_take_it(cls):
    # (FusedSGD and FusedAdagrad step them: test_sparse_grads.py.)
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    opt = cls(params)
    set_grads(params, step_grads(params, 0))
    params[1].grad = params[1].grad.to_sparse()
    before = [p.detach().clone() for p in params]
    with raises_naming(r"param_groups\[0\]\['params'\]\[1\]", "sparse",
                       r"nn\.Embedding\(sparse=True\)", r"FusedSGD, FusedAdagrad"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "a param was written"


def test_negative_lr_set_after_construction_fails_at_step():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    opt = FusedAdam([{"params": params[:1]}, {"params": params[1:]}])
    opt.param_groups[1]["lr"] = -0.5
    set_grads(params, step_grads(params, 0))
    with raises_naming(r"param_groups\[1\]", "lr"):
        opt.step()


def test_torch_positional_amsgrad_and_apex_order_are_never_mixed_up():
    """amsgrad is torch.optim.Adam's sixth positional argument here too; a positional call in
    apex's order (bias_correction third) stops at the betas check."""
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    assert FusedAdam(params, 1e-3, (0.9, 0.999), 1e-8, 0.0, True).param_groups[0]["amsgrad"]
    assert FusedAdamW(params, 1e-3, (0.9, 0.999), 1e-8, 0.0, True).param_groups[0]["amsgrad"]
    with raises_naming(r"betas=True", "pair"):
        FusedAdam(params, 1e-3, True, (0.9, 0.999), 1e-8, True)
    with pytest.raises(TypeError):
        FusedAdam(params, 1e-3, True, (0.9, 0.999), 1e-8, True, 0.01)


def test_grad_scale_must_be_one_element():
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    opt = FusedAdam(params)
    set_grads(params, step_grads(params, 0))
    with raises_naming("grad_scale", "one-element"):
        opt.step(grad_scale=torch.ones(2))

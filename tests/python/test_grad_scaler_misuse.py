"""ampfuse.GradScaler misused: calls out of order, closures, bad constructor arguments,
setters, state dicts, outputs and devices. Each gets an error that names the problem and the
fix, and a failed call changes nothing."""

import math
import pickle

import pytest
import torch

from ampfuse.scaling.grad_scaler import GradScaler
from helpers import raises_naming


@pytest.fixture
def setup():
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu")
    return param, opt, scaler


def _backward(param, scaler):
    scaler.scale((param * 2).sum()).backward()


@pytest.mark.parametrize("call", ["unscale_", "step", "update"])
def test_calls_before_scale(setup, call):
    param, opt, scaler = setup
    param.grad = torch.ones(3)
    args = () if call == "update" else (opt,)
    with raises_naming(rf"{call}\(\) was called before any scale\(\)", r"scaler\.scale\(loss\)"):
        getattr(scaler, call)(*args)


def test_unscale_twice(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    scaler.unscale_(opt)
    with raises_naming(r"unscale_\(\) has already been called on this optimizer since the last "
                       r"update\(\)"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    scaler.unscale_(opt)  # allowed again after update()


def test_unscale_after_step_and_step_twice(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    scaler.step(opt)
    with raises_naming(r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    with raises_naming(r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)


def test_closures_are_refused(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    with raises_naming("Closure", r"scaler\.scale\(loss\)\.backward\(\)"):
        scaler.step(opt, closure=lambda: None)
    with raises_naming("Closure"):
        scaler.step(opt, lambda: None)


def test_update_without_any_step(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    with raises_naming(r"no gradients were checked", r"scaler\.step\(optimizer\)"):
        scaler.update()


def test_step_with_no_grads(setup):
    param, opt, scaler = setup
    scaler.scale(torch.ones(()))
    with raises_naming("none of the optimizer's params has a gradient"):
        scaler.step(opt)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(growth_factor=1.0), "growth_factor must be a finite number > 1.0"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval must be an int"),
    (dict(hysteresis=0), "hysteresis must be an int >= 1"),
    (dict(min_scale=4.0, max_scale=2.0), "need 0 <= min_scale <= max_scale"),
    (dict(init_scale=math.inf), "init_scale must be a finite number > 0"),
    (dict(init_scale=0.0), "init_scale must be a finite number > 0"),
])
def test_bad_constructor_arguments(kwargs, pattern):
    with raises_naming(pattern):
        GradScaler("cpu", **kwargs)
    GradScaler("cpu", enabled=False, **kwargs)  # not checked when disabled, as in torch


def test_init_scale_in_the_device_place_is_named():
    """torch.cuda.amp.GradScaler(65536.0) moved to torch.amp's signature (device first)."""
    with pytest.raises(TypeError, match=r"device=65536\.0 is not a device.*init_scale"):
        GradScaler(65536.0)
    with pytest.raises(TypeError, match=r"device=None"):
        GradScaler(None)


def test_bad_setters_and_new_scale(setup):
    param, opt, scaler = setup
    with raises_naming("growth_factor"):
        scaler.set_growth_factor(0.5)
    with raises_naming("backoff_factor"):
        scaler.set_backoff_factor(2.0)
    with raises_naming("growth_interval"):
        scaler.set_growth_interval(-1)
    scaler.scale(torch.ones(()))
    for bad in (torch.ones(2), torch.ones(1, requires_grad=True), "1024"):
        with raises_naming("new_scale should be a float or a one-element tensor"):
            scaler.update(new_scale=bad)


def test_bad_state_dicts(setup):
    _, _, scaler = setup
    with raises_naming("state dict is empty", "disabled"):
        scaler.load_state_dict({})
    with pytest.raises(KeyError, match="_growth_tracker"):
        scaler.load_state_dict({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 10})
    good = GradScaler("cpu").state_dict()
    with raises_naming("growth_factor"):
        scaler.load_state_dict({**good, "growth_factor": 0.5})
    assert scaler.state_dict() == good  # nothing changed by the failed loads


def test_bad_outputs_and_devices(setup):
    _, _, scaler = setup
    for bad in ("loss", 3.0, [torch.ones(1), None]):
        with raises_naming("outputs must be a Tensor"):
            scaler.scale(bad)
    with raises_naming("meta", "CPU and CUDA"):
        GradScaler("cpu").scale(torch.ones(1, device="meta"))


def test_pickling_mid_iteration_is_refused(setup):
    param, opt, scaler = setup
    _backward(param, scaler)
    scaler.step(opt)
    with raises_naming("pickled", r"after scaler\.update\(\)"):
        pickle.dumps(scaler)


def test_all_reduce_without_a_process_group(setup):
    param, opt, _ = setup
    scaler = GradScaler("cpu", all_reduce_found_inf=True)
    _backward(param, scaler)
    with raises_naming("torch.distributed is not initialized", "init_process_group"):
        scaler.step(opt)

"""The inputs PyTorch's own optimizer tests run Adam, AdamW, SGD and Adagrad with, on ampfuse's
drop-ins.

torch.testing._internal.common_optimizers lists, per optimizer and device type, the constructor
kwargs torch's test_optim.py exercises (``optim_inputs_func_adam`` etc.): learning rates,
weight decay, maximize, amsgrad, momentum, dampening, nesterov, lr_decay, an initial
accumulator, and on CUDA capturable with a tensor lr and tensor betas (0-d, 2-d and 3-d). A
torch user who swaps in FusedAdam, FusedAdamW, FusedSGD or FusedAdagrad may pass any of them.
Each is run here on both optimizers with the same fp32 params and grads: the params, the state
and the step count must follow torch's, and the state dict must load into torch's optimizer and
back. The list is read from the installed torch, so a kwarg torch adds to its tests is tried
here too.
"""

import copy
import functools

import pytest
import torch
from torch.testing._internal import common_optimizers

from ampfuse.optimizers import FusedAdagrad, FusedAdam, FusedAdamW, FusedSGD
from test_adam import SHAPES, assert_parity, clone_params, make_params, run_both

STEPS = 8
PAIRS = {
    # torch's name: (torch class, ampfuse class with torch's semantics)
    "adam": (torch.optim.Adam, functools.partial(FusedAdam, adam_w_mode=False)),
    "adamw": (torch.optim.AdamW, FusedAdamW),
    "sgd": (torch.optim.SGD, FusedSGD),
    "adagrad": (torch.optim.Adagrad, FusedAdagrad),
}
STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
              "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
              "sgd": ("momentum_buffer",),
              "adagrad": ("sum",)}


def _cases():
    """(optimizer name, device, kwargs, id) for every input torch lists for the device type;
    CUDA's list holds CPU's and adds its own. The kwargs are built once, at collection."""
    cases = []
    for device in ("cpu", "cuda"):
        marks = (pytest.mark.cuda,) if device == "cuda" else ()
        for name in PAIRS:
            make_inputs = getattr(common_optimizers, f"optim_inputs_func_{name}")
            for optim_input in make_inputs(device=device, dtype=torch.float32):
                cases.append(pytest.param(name, device, optim_input.kwargs, marks=marks,
                                          id=f"{name}-{device}-{optim_input.desc}"))
    return cases


@pytest.mark.parametrize("name, device, kwargs", _cases())
def test_torch_optimizer_inputs_give_torch_results(name, device, kwargs):
    # The kwargs' tensors stay on the CPU, as torch's list makes them and its tests pass them,
    # whatever the params' device.
    torch_cls, fused_cls = PAIRS[name]
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    fused = fused_cls(params, **copy.deepcopy(kwargs))
    ref = torch_cls(ref_params, **copy.deepcopy(kwargs))
    run_both(fused, ref, params, ref_params, STEPS)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"{name} {kwargs}: params[{i}] after {STEPS} steps")
        for key in STATE_KEYS[name]:
            if key in ref.state[q]:
                assert_parity(fused.state[p][key], ref.state[q][key], f"params[{i}] {key}")
        if "step" in ref.state[q]:
            assert float(fused.state[p]["step"]) == float(ref.state[q]["step"])

    # The state dict goes into torch's optimizer and back, and both go on alike.
    into_torch = torch_cls(clone_params(params), **copy.deepcopy(kwargs))
    into_torch.load_state_dict(copy.deepcopy(fused.state_dict()))
    back = fused_cls(clone_params(params), **copy.deepcopy(kwargs))
    back.load_state_dict(copy.deepcopy(into_torch.state_dict()))
    torch_params = into_torch.param_groups[0]["params"]
    back_params = back.param_groups[0]["params"]
    run_both(back, into_torch, back_params, torch_params, 2)
    for i, (p, q) in enumerate(zip(back_params, torch_params)):
        assert_parity(p, q, f"{name} {kwargs}: params[{i}] after a state-dict round trip")

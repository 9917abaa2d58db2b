"""A constructor call written for torch.optim's Adam, AdamW, SGD or Adagrad runs unchanged on
ampfuse's drop-in, and what torch refuses, ampfuse refuses.

- Every keyword of the installed torch class's signature is accepted by the drop-in, so
  ``torch.optim.AdamW(params, lr=3e-4, fused=True)`` (nanoGPT's `configure_optimizers`, the HF
  Trainer's `adamw_torch_fused`) becomes ``FusedAdamW(..., fused=True)`` and nothing else.
- torch's implementation switches: every foreach/fused pair torch accepts (torchtitan passes
  both, as bools, for each of its "fused", "foreach" and "for-loop" settings) runs the fused
  step, the same numbers as without them; what torch refuses (both True, a non-bool) and
  differentiable=True are refused with a message naming the torch class, also when they come
  in a group given to add_param_group.
- FusedAdam takes torch.optim.Adam's decoupled_weight_decay beside apex's adam_w_mode.
- torch's own error inputs (``optim_error_inputs_func_*`` in
  torch.testing._internal.common_optimizers, the list torch's test_optim.py checks its
  optimizers against) raise the same exception type here. Three of them are refused by torch
  only because its foreach path cannot take tensor hyperparameters; the fused step can, so they
  are accepted here and must step as torch's default path does.
"""

import copy
import functools
import inspect
import warnings

import pytest
import torch
from torch.testing._internal import common_optimizers
from torch.testing._internal.common_optimizers import OptimizerErrorEnum

from ampfuse.optimizers import FusedAdagrad, FusedAdam, FusedAdamW, FusedSGD
from helpers import raises_naming
from test_adam import SHAPES, assert_parity, clone_params, make_params, run_both

# torch's name: (torch class, the drop-in with torch's semantics)
PAIRS = {
    "adam": (torch.optim.Adam, functools.partial(FusedAdam, decoupled_weight_decay=False)),
    "adamw": (torch.optim.AdamW, FusedAdamW),
    "sgd": (torch.optim.SGD, FusedSGD),
    "adagrad": (torch.optim.Adagrad, FusedAdagrad),
}
DROP_INS = {"adam": FusedAdam, "adamw": FusedAdamW, "sgd": FusedSGD, "adagrad": FusedAdagrad}
# Error inputs torch refuses only for its foreach implementation (tensor lr or betas without
# capturable) or for mixing a float beta with a tensor one; the fused step reads either. (The
# third desc is escaped in torch's list, as a regex.)
ACCEPTED_HERE = (
    "lr as Tensor doesn't work with foreach & not capturable",
    "betas must be either both floats or both Tensors",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
)
STEPS = 4


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_every_keyword_of_torchs_signature_is_accepted(name):
    torch_cls = PAIRS[name][0]
    ours = inspect.signature(DROP_INS[name]).parameters
    theirs = inspect.signature(torch_cls).parameters
    missing = [key for key in theirs if key not in ours]
    assert not missing, f"{DROP_INS[name].__name__} lacks {torch_cls.__name__}'s {missing}"
    # Where torch takes an argument by position, so do we, at the same place.
    for index, (key, param) in enumerate(theirs.items()):
        if param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert list(ours)[index] == key, f"{key} is not argument {index} of ours"
            assert ours[key].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("switches", [
    {"fused": True}, {"foreach": True}, {"fused": None}, {"foreach": None, "differentiable": False},
    # torchtitan's build_optimizers, for implementation = "fused", "foreach" and "for-loop".
    {"fused": True, "foreach": False}, {"fused": False, "foreach": True},
    {"fused": False, "foreach": False},
], ids=["fused", "foreach", "fused-none", "foreach-none", "titan-fused", "titan-foreach",
        "titan-for-loop"])
def test_accepted_switches_step_as_torch_does(name, switches):
    """The switches torch was given go to both: torch runs the implementation they pick, ours
    its fused step, and the two agree as in test_torch_optim_inputs."""
    torch_cls, fused_cls = PAIRS[name]
    params = make_params(SHAPES, torch.float32, "cpu")
    ref_params = clone_params(params)
    kwargs = {"lr": 0.01, "weight_decay": 0.1, **switches}
    fused = fused_cls(params, **kwargs)
    ref = torch_cls(ref_params, **kwargs)
    run_both(fused, ref, params, ref_params, STEPS)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"{name} {switches}: params[{i}]")


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_switches_change_nothing_in_the_fused_step(name):
    """Any switches torch accepts give the same step, bit for bit, as none at all."""
    fused_cls = PAIRS[name][1]
    for switches in ({"fused": True, "foreach": False}, {"fused": False, "foreach": False}):
        params = make_params(SHAPES, torch.float32, "cpu")
        plain_params = clone_params(params)
        with_switches = fused_cls(params, lr=0.01, **switches)
        plain = fused_cls(plain_params, lr=0.01)
        run_both(with_switches, plain, params, plain_params, STEPS)
        for p, q in zip(params, plain_params):
            assert torch.equal(p, q), switches
        assert with_switches.state_dict()["param_groups"] == plain.state_dict()["param_groups"]


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("switches, patterns", [
    ({"fused": True, "foreach": True}, [r"foreach=True and fused=True", r"at most one"]),
    ({"differentiable": True}, [r"differentiable=True", r"differentiable=True\) for that"]),
    ({"fused": "yes"}, [r"fused='yes'", r"None, True or False"]),
    ({"foreach": 1}, [r"foreach=1", r"None, True or False"]),
    ({"differentiable": None}, [r"differentiable=None", r"True or False"]),
], ids=["both", "differentiable", "fused-str", "foreach-int", "differentiable-none"])
def test_switches_a_fused_step_cannot_honour_are_refused(name, switches, patterns):
    torch_name = PAIRS[name][0].__name__
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    with raises_naming(*patterns, DROP_INS[name].__name__):
        PAIRS[name][1](params, lr=0.01, **switches)
    if switches in ({"fused": True, "foreach": True}, {"differentiable": True}):
        with raises_naming(rf"torch\.optim\.{torch_name}\b"):
            PAIRS[name][1](params, lr=0.01, **switches)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_group_with_a_refused_switch_is_not_added(name):
    params = make_params(SHAPES[:3], torch.float32, "cpu")
    optimizer = PAIRS[name][1](params[:2], lr=0.01)
    before = copy.deepcopy(optimizer.state_dict())
    with raises_naming(r"param_groups\[1\]", r"differentiable=True"):
        optimizer.add_param_group({"params": [params[2]], "differentiable": True})
    assert len(optimizer.param_groups) == 1
    assert optimizer.state_dict() == before
    # torch's accepted values are fine in a group; state_dict() writes torch's defaults.
    optimizer.add_param_group({"params": [params[2]], "fused": True})
    assert optimizer.state_dict()["param_groups"][1]["fused"] is None


def test_adam_takes_torchs_decoupled_weight_decay():
    """decoupled_weight_decay=False is torch.optim.Adam's L2 decay, True its AdamW; either
    agrees with apex's adam_w_mode of the same meaning, and the two disagreeing is an error."""
    for decoupled in (False, True):
        params = make_params(SHAPES, torch.float32, "cpu")
        ref_params = clone_params(params)
        kwargs = {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": decoupled}
        fused = FusedAdam(params, **kwargs)
        ref = torch.optim.Adam(ref_params, **kwargs)
        assert fused.param_groups[0]["adam_w_mode"] is decoupled
        run_both(fused, ref, params, ref_params, STEPS)
        for i, (p, q) in enumerate(zip(params, ref_params)):
            assert_parity(p, q, f"decoupled_weight_decay={decoupled}: params[{i}]")
        assert fused.state_dict()["param_groups"][0]["decoupled_weight_decay"] is decoupled
    params = make_params(SHAPES[:1], torch.float32, "cpu")
    assert FusedAdam(params).param_groups[0]["adam_w_mode"] is True  # apex's default
    assert FusedAdam(params, adam_w_mode=False,
                     decoupled_weight_decay=False).param_groups[0]["adam_w_mode"] is False
    with raises_naming(r"adam_w_mode=False and decoupled_weight_decay=True disagree"):
        FusedAdam(params, adam_w_mode=False, decoupled_weight_decay=True)
    with raises_naming(r"decoupled_weight_decay=1\b", r"True or False"):
        FusedAdam(params, decoupled_weight_decay=1)


def test_adagrads_positional_foreach():
    """torch.optim.Adagrad takes foreach as its seventh positional argument."""
    params = make_params(SHAPES[:2], torch.float32, "cpu")
    optimizer = FusedAdagrad(params, 0.1, 0.0, 0.0, 0.0, 1e-10, True)
    assert optimizer.param_groups[0]["eps"] == 1e-10
    with raises_naming(r"foreach='yes'"):
        FusedAdagrad(params, 0.1, 0.0, 0.0, 0.0, 1e-10, "yes")


def _error_cases():
    cases = []
    for name in PAIRS:
        make_inputs = getattr(common_optimizers, f"optim_error_inputs_func_{name}")
        for error_input in make_inputs(device="cpu", dtype=torch.float32):
            desc = error_input.optimizer_error_input.desc
            cases.append(pytest.param(name, error_input, id=f"{name}-{desc}"))
    return cases


@pytest.mark.parametrize("name, error_input", _error_cases())
def test_torchs_error_inputs(name, error_input):
    torch_cls, fused_cls = PAIRS[name]
    optim_input = error_input.optimizer_error_input
    kwargs = optim_input.kwargs
    params = optim_input.params
    if params is None:
        params = make_params(SHAPES[:2], torch.float32, "cpu")

    def construct_and_step():
        optimizer = fused_cls(copy.copy(params), **copy.deepcopy(kwargs))
        if error_input.error_on == OptimizerErrorEnum.STEP_ERROR:
            optimizer.step()

    if optim_input.desc in ACCEPTED_HERE:
        # torch's default path (no foreach, float betas) gives the numbers to match.
        ref_kwargs = {k: v for k, v in kwargs.items() if k != "foreach"}
        if "betas" in ref_kwargs:
            ref_kwargs["betas"] = tuple(float(b) for b in ref_kwargs["betas"])
        fused_params = clone_params(params)
        ref_params = clone_params(params)
        fused = fused_cls(fused_params, **copy.deepcopy(kwargs))
        ref = torch_cls(ref_params, **ref_kwargs)
        run_both(fused, ref, fused_params, ref_params, STEPS)
        for i, (p, q) in enumerate(zip(fused_params, ref_params)):
            assert_parity(p, q, f"{optim_input.desc}: params[{i}]")
        return
    if issubclass(error_input.error_type, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            construct_and_step()
        assert any(issubclass(w.category, error_input.error_type) for w in caught), (
            f"no {error_input.error_type.__name__} for {optim_input.desc!r}")
        return
    with pytest.raises(error_input.error_type) as info:
        construct_and_step()
    # Our messages are our own; they still name what was wrong.
    assert str(info.value), f"an empty message for {optim_input.desc!r}"

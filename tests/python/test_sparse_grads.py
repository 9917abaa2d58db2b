"""Sparse gradients in FusedSGD and FusedAdagrad, as torch.optim.SGD and Adagrad take them.

A model with an nn.Embedding(sparse=True) trained by torch.optim.SGD or Adagrad must train the
same with the drop-in (see ampfuse/optimizers/_sparse.py): the embedding's sparse grad is
stepped with torch's arithmetic after the fused step of the dense params, under the same skip
verdict, with a loss scale divided out. What torch refuses (weight decay) and what the sparse
step does not take (low-precision params) is refused before anything is written.
"""

import copy

import pytest
import torch

import ampfuse
from ampfuse.optimizers import FusedAdagrad, FusedSGD
from helpers import make_generator, raises_naming
from tolerances import assert_close_report

# name: (ours, torch's, kwargs)
CASES = {
    "sgd": (FusedSGD, torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum_dampening": (FusedSGD, torch.optim.SGD,
                               dict(lr=0.1, momentum=0.9, dampening=0.1)),
    "sgd_nesterov_maximize": (FusedSGD, torch.optim.SGD,
                              dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    "adagrad": (FusedAdagrad, torch.optim.Adagrad,
                dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    "adagrad_maximize": (FusedAdagrad, torch.optim.Adagrad, dict(lr=0.1, maximize=True)),
}
STEPS = 6
ROWS, WIDTH = 30, 8
# torch's own sparse Adagrad (the reference) builds sparse tensors without choosing whether
# their invariants are checked, and torch warns about that.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")


def make_model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(ROWS, WIDTH, sparse=True),
                               torch.nn.Linear(WIDTH, 3)).to(device)


def batch(step, device="cpu"):
    # Repeated rows: the sparse grad holds duplicate indices until coalesced.
    return torch.randint(0, ROWS, (12,), generator=make_generator(300 + step)).to(device)


def train(model, opt, steps=range(STEPS), scaler=None, poison_step=None):
    for step in steps:
        hook = None
        if step == poison_step:  # an inf in the embedding's (sparse) grad only
            hook = model[0].weight.register_hook(_with_inf)
        loss = model(batch(step, model[1].weight.device)).pow(2).mean()
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if hook is not None:
            hook.remove()
    return model


def _with_inf(grad):
    grad = grad.coalesce().clone()
    grad._values()[0, 0] = float("inf")
    return grad


def assert_models_close(actual, expected, **kwargs):
    for (name, a), b in zip(actual.named_parameters(), expected.parameters()):
        assert_close_report(a.detach(), b.detach(), msg=name, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_embedding_trains_as_with_torch(case, device):
    ours_cls, torch_cls, kwargs = CASES[case]
    ours, theirs = make_model(device), make_model(device)
    train(ours, ours_cls(ours.parameters(), **kwargs))
    train(theirs, torch_cls(theirs.parameters(), **kwargs))
    # Coalescing first sums duplicate rows before they reach the param (torch's SGD adds them
    # one by one), so the two agree to rounding.
    assert_models_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaler_cls", [ampfuse.GradScaler, torch.amp.GradScaler])
@pytest.mark.parametrize("case", ["sgd_momentum_dampening", "adagrad"])
def test_loss_scale_and_an_overflow_in_the_sparse_grad(case, scaler_cls, device):
    """A scaled run matches the unscaled one, and an inf in the sparse grad alone skips the
    whole step: the run equals one that never took it."""
    ours_cls, _, kwargs = CASES[case]
    scaled, plain = make_model(device), make_model(device)
    opt = ours_cls(scaled.parameters(), **kwargs)
    train(scaled, opt, scaler=scaler_cls(device, init_scale=2.0**10), poison_step=2)
    train(plain, ours_cls(plain.parameters(), **kwargs),
          steps=[s for s in range(STEPS) if s != 2])
    assert_models_close(scaled, plain, exact=True)
    assert opt.get_skipped_steps() == 1
    # The last step was clean: its grads were left unscaled, the sparse one too (the scale is
    # a power of two: exact).
    assert scaled[0].weight.grad.is_sparse
    for name, p in scaled.named_parameters():
        expected = plain.get_parameter(name).grad
        assert_close_report(p.grad.to_dense(), expected.to_dense(), exact=True, msg=name)


def test_skip_nonfinite_checks_the_sparse_grad():
    model = make_model()
    opt = FusedAdagrad(model.parameters(), lr=0.1, skip_nonfinite=True)
    train(model, opt, steps=range(2))
    before = copy.deepcopy(model)
    train(model, opt, steps=[2], poison_step=2)
    assert opt.get_skipped_steps() == 1
    assert_models_close(model, before, exact=True)


@pytest.mark.parametrize("case", ["sgd_momentum_dampening", "adagrad"])
def test_checkpoint_resumes_exactly_and_loads_into_torch(case):
    ours_cls, torch_cls, kwargs = CASES[case]
    straight = make_model()
    train(straight, ours_cls(straight.parameters(), **kwargs))
    model = make_model()
    opt = ours_cls(model.parameters(), **kwargs)
    train(model, opt, steps=range(STEPS // 2))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for cls in (ours_cls, torch_cls):
        resumed = make_model()
        resumed.load_state_dict(saved[0])
        resumed_opt = cls(resumed.parameters(), **kwargs)
        resumed_opt.load_state_dict(copy.deepcopy(saved[1]))
        train(resumed, resumed_opt, steps=range(STEPS // 2, STEPS))
        if cls is ours_cls:
            assert_models_close(resumed, straight, exact=True)
        else:
            assert_models_close(resumed, straight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdagrad])
def test_weight_decay_with_sparse_grads_is_refused_before_any_write(cls):
    model = make_model()
    opt = cls([{"params": model[1].parameters()},
               {"params": model[0].parameters(), "weight_decay": 0.01}], lr=0.1)
    model(batch(0)).pow(2).mean().backward()
    before = copy.deepcopy(model)
    with raises_naming(r"param_groups\[1\]\['params'\]\[0\]", "weight_decay=0.01",
                       "weight_decay=0"):
        opt.step()
    assert_models_close(model, before, exact=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_param_with_a_sparse_grad_is_refused(dtype):
    model = make_model().to(dtype)
    opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, master_weights=True)
    model(batch(0)).float().pow(2).mean().backward()
    before = copy.deepcopy(model)
    with raises_naming(r"param_groups\[0\]\['params'\]\[0\]", str(dtype), "float32"):
        opt.step()
    assert_models_close(model, before, exact=True)

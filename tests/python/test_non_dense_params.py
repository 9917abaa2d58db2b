"""Params that are not dense step like any other.

A Parameter may be a strided slice whose elements do not fill one block of memory (torch's own
test_optim.py steps `torch.randn(10, 5, 2)[..., 0]`). torch.optim updates it in place; the fused
ops walk memory flat, so they update it through a contiguous copy that is copied back after the
kernel (csrc/ops/checks.h, WrittenList), with its state kept contiguous. Element-wise updates do
not depend on where the elements live, so a run with a non-dense param must give the bits of a
run with the same values held densely, and must not write the buffer's elements outside the
view. A param whose elements share memory (expand()) cannot be written and is refused before
any param of the step is.
"""

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedNovoGrad,
                                FusedSGD)
from helpers import make_generator, raises_naming
from tolerances import assert_close_report

FAMILIES = {
    "adam": (FusedAdam, dict(lr=1e-2, weight_decay=0.1)),
    "adam_amsgrad": (FusedAdam, dict(lr=1e-2, amsgrad=True)),
    "sgd_nesterov": (FusedSGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "adagrad": (FusedAdagrad, dict(lr=1e-2)),
    "lamb": (FusedLAMB, dict(lr=1e-2, weight_decay=0.01)),
    "novograd": (FusedNovoGrad, dict(lr=1e-2)),
}
# (param dtype, master_weights)
PRECISIONS = {
    "fp32": (torch.float32, False),
    "fp16_masters": (torch.float16, True),
    "bf16_split": (torch.bfloat16, "split"),
}
STEPS = 4
GRAD_SCALE = 1024.0


def strided_slice(values):
    """`values` (8, 6) as every other column of an (8, 12) buffer whose other columns hold
    a marker that must survive the steps; returns (slice, buffer)."""
    buffer = torch.full((8, 12), 7.0, dtype=values.dtype, device=values.device)
    buffer[:, ::2] = values
    return buffer[:, ::2], buffer


def start_values(dtype, device="cpu"):
    gen = make_generator(3)
    return [torch.randn(8, 6, generator=gen).to(device, dtype),
            torch.randn(5, generator=gen).to(device, dtype)]


def step_grads(step, dtype, device):
    gen = make_generator(100 + step)
    return [(torch.randn(8, 6, generator=gen) * GRAD_SCALE).to(device, dtype),
            (torch.randn(5, generator=gen) * GRAD_SCALE).to(device, dtype)]


def run(family, precision, non_dense, non_dense_grad=False, device="cpu"):
    cls, kwargs = FAMILIES[family]
    dtype, master_weights = PRECISIONS[precision]
    values = start_values(dtype, device)
    buffer = None
    if non_dense:
        weight, buffer = strided_slice(values[0])
        params = [torch.nn.Parameter(weight), torch.nn.Parameter(values[1])]
    else:
        params = [torch.nn.Parameter(v.clone()) for v in values]
    opt = cls(params, master_weights=master_weights, **kwargs)
    grads = []
    for step in range(STEPS):
        grads = step_grads(step, dtype, device)
        for p, g in zip(params, grads):
            p.grad = strided_slice(g)[0] if (non_dense_grad and p.dim() == 2) else g
        # grads are written back unscaled
        opt.step(grad_scale=torch.tensor(GRAD_SCALE, device=device))
    return opt, params, buffer


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_non_dense_param_steps_like_a_dense_one(family, precision, device):
    ref_opt, ref_params, _ = run(family, precision, non_dense=False, device=device)
    opt, params, buffer = run(family, precision, non_dense=True, device=device)
    assert params[0].stride() == (12, 2), "the param must still be the view"
    for i, (p, ref) in enumerate(zip(params, ref_params)):
        assert_close_report(p.detach(), ref.detach(), exact=True, msg=f"param {i}")
        assert_close_report(p.grad, ref.grad, exact=True, msg=f"param {i} unscaled grad")
        for key, value in ref_opt.state[ref].items():
            if isinstance(value, torch.Tensor) and value.dim():
                assert_close_report(opt.state[p][key], value, exact=True, msg=f"{i} {key}")
    assert (buffer[:, 1::2] == 7.0).all(), "the buffer outside the param's view was written"


@pytest.mark.parametrize("family", ["adam", "sgd_nesterov"])
def test_non_dense_grad_of_a_non_dense_param(family):
    ref_opt, ref_params, _ = run(family, "fp16_masters", non_dense=False)
    opt, params, buffer = run(family, "fp16_masters", non_dense=True, non_dense_grad=True)
    for i, (p, ref) in enumerate(zip(params, ref_params)):
        assert_close_report(p.detach(), ref.detach(), exact=True, msg=f"param {i}")
        assert_close_report(p.grad, ref.grad, exact=True, msg=f"param {i} unscaled grad")
    assert (buffer[:, 1::2] == 7.0).all()


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD])
def test_skipped_step_leaves_a_non_dense_param_as_it_was(cls, device):
    weight, buffer = strided_slice(start_values(torch.float32, device)[0])
    param = torch.nn.Parameter(weight)
    opt = cls([param], lr=0.1, momentum=0.9) if cls is FusedSGD else cls([param], lr=0.1)
    before = buffer.clone()
    param.grad = torch.ones_like(param)
    opt.step(found_inf=torch.ones((), device=device))
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("family", ["adam", "sgd_nesterov", "adagrad"])
def test_non_dense_param_matches_torch(family):
    """The drop-ins against torch.optim on the same non-dense fp32 param (torch's
    test_forloop_goes_right_direction shape), to torch's parity tolerance."""
    cls, kwargs = FAMILIES[family]
    cls, torch_cls = {"adam": (FusedAdamW, torch.optim.AdamW),
                      "sgd_nesterov": (FusedSGD, torch.optim.SGD),
                      "adagrad": (FusedAdagrad, torch.optim.Adagrad)}[family]
    start = torch.randn(10, 5, generator=make_generator(5))
    ours, theirs = (torch.nn.Parameter(torch.empty(10, 5, 2)[..., 0].copy_(start))
                    for _ in range(2))
    opt_ours, opt_theirs = cls([ours], **kwargs), torch_cls([theirs], **kwargs)
    for step in range(STEPS):
        grad = torch.randn(10, 5, generator=make_generator(200 + step))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert ours.stride() == theirs.stride() == (10, 2)
    assert_close_report(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)


def test_param_whose_elements_share_memory_is_refused_before_any_write():
    dense = torch.nn.Parameter(torch.randn(4))
    shared = torch.nn.Parameter(torch.randn(4, 1).expand(4, 3))
    opt = FusedAdam([{"params": [dense]}, {"params": [shared]}], lr=0.1)
    dense.grad, shared.grad = torch.ones(4), torch.ones(4, 3)
    before = dense.detach().clone()
    with raises_naming(r"param_groups\[1\]\['params'\]\[0\]", "memory location", r"\.clone\(\)"):
        opt.step()
    assert torch.equal(dense.detach(), before), "a param was written before the refusal"

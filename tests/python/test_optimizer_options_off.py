"""An optimizer option that is off does no arithmetic at all, as in torch.

Until 2026-11 the fused kernels applied options as multipliers that are no-ops for finite
values (grad + 0 * param for no weight decay). On an inf param that made NaN, where torch, which
skips the term, keeps inf. These steps put inf, -inf and -0.0 in the params and compare every
element with torch's optimizer, non-finite ones bit for bit.
"""

import pytest
import torch

from ampfuse.optimizers import FusedAdam, FusedAdamW, FusedSGD

SPECIALS = [float("inf"), float("-inf"), -0.0]

CASES = {
    "adam, no weight decay": (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.0)),
    "adamw, no weight decay": (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0)),
    "adamw, maximize off": (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd momentum, no decay or dampening": (
        FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    "sgd nesterov, no decay": (FusedSGD, torch.optim.SGD,
                               dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "sgd plain": (FusedSGD, torch.optim.SGD, dict(lr=1e-2)),
}


def params_with_specials(device):
    """Two params of 37 elements (past an 8-lane block and into the scalar tail), with the special
    values at the first, a middle and the last element of each."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        p = torch.randn(37, generator=gen)
        for value, index in zip(SPECIALS, (0, 18, 36)):
            p[index] = value
        out.append(p.to(device))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_params_with_inf_keep_torchs_values(device, case):
    ours_cls, torch_cls, kwargs = CASES[case]
    ours_params = [p.clone().requires_grad_() for p in params_with_specials(device)]
    torch_params = [p.clone().requires_grad_() for p in params_with_specials(device)]
    ours = ours_cls(ours_params, **kwargs)
    theirs = torch_cls(torch_params, foreach=False, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(ours_params, torch_params):
            g = torch.randn(a.shape, generator=gen).to(device)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for i, (a, b) in enumerate(zip(ours_params, torch_params)):
        a, b = a.detach(), b.detach()
        finite = torch.isfinite(b)
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{case}: params[{i}] NaN places"
        infinite = torch.isinf(b)
        assert torch.equal(a[infinite], b[infinite]), (
            f"{case}: params[{i}] infinities differ from torch's")
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, i=i: f"{case}: params[{i}]: {m}")

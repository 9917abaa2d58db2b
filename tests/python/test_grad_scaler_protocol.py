"""What ampfuse.GradScaler.step() hands over to an optimizer that takes the loss scale itself
(torch's `_step_supports_amp_scaling` protocol): grad_scale and found_inf as torch hands them
over, gone afterwards, also after a failed step; and the older `grad_scaler=` keyword."""

import math

import pytest
import torch

from ampfuse.scaling.grad_scaler import GradScaler
from tolerances import assert_close_report


class RecordingOptimizer(torch.optim.SGD):
    """Records the grad_scale and found_inf attributes its step() sees; can fail on demand."""

    _step_supports_amp_scaling = True

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen = []
        self.fail = False

    def step(self, closure=None):
        scale = getattr(self, "grad_scale", "absent")
        found_inf = getattr(self, "found_inf", "absent")
        self.seen.append(tuple(
            v if isinstance(v, str) or v is None else (tuple(v.shape), v.dtype, float(v))
            for v in (scale, found_inf)
        ))
        if self.fail:
            raise RuntimeError("step failed on purpose")
        return "stepped"


def test_fused_protocol_matches_torch():
    """READY: grad_scale is the scale, found_inf the flag (both 0-dim fp32); after unscale_():
    grad_scale is None; a grad_scale of the caller's own is multiplied in. Both attributes are
    gone afterwards. The same as torch hands over."""
    seen = []
    for scaler_class in (torch.amp.GradScaler, GradScaler):
        param = torch.nn.Parameter(torch.ones(3))
        opt = RecordingOptimizer([param])
        scaler = scaler_class("cpu", init_scale=8.0)
        for mode in ("ready", "unscaled", "own_scale", "overflow"):
            param.grad = scaler.scale(torch.full((3,), 1.0))
            if mode == "overflow":
                param.grad[1] = math.inf
            if mode == "unscaled":
                scaler.unscale_(opt)
            if mode == "own_scale":
                opt.grad_scale = torch.tensor(0.5)
            assert scaler.step(opt) == "stepped"
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            scaler.update()
        seen.append(opt.seen)
    assert seen[1] == seen[0]
    assert seen[1][0] == (((), torch.float32, 8.0), ((), torch.float32, 0.0))
    assert seen[1][1][0] is None
    assert seen[1][3][1] == ((), torch.float32, 1.0)


def test_fused_step_leaves_scaled_grads_and_cleans_up_after_a_failure():
    param = torch.nn.Parameter(torch.ones(5))
    opt = RecordingOptimizer([param])
    scaler = GradScaler("cpu", init_scale=4.0)
    param.grad = scaler.scale(torch.arange(5.0))
    opt.fail = True
    with pytest.raises(RuntimeError, match="on purpose"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    # The grads were only checked: they still carry the scale, as under torch.
    assert_close_report(param.grad, torch.arange(5.0) * 4.0, exact=True)


class LegacyOptimizer(torch.optim.SGD):
    """An optimizer of torch's older contract: step() takes the scaler itself."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        found_inf = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
        if not found_inf:
            inv = 1.0 / grad_scaler._get_scale_async().item()
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(inv)
            super().step()


def test_grad_scaler_kwarg_contract_is_honoured_with_a_warning():
    param = torch.nn.Parameter(torch.ones(2))
    opt = LegacyOptimizer([param], lr=1.0)
    scaler = GradScaler("cpu", init_scale=16.0)
    param.grad = scaler.scale(torch.ones(2))
    with pytest.warns(FutureWarning, match="grad_scaler"):
        scaler.step(opt)
    scaler.update()
    assert_close_report(param.detach(), torch.zeros(2), exact=True)

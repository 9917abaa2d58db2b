"""apex.parallel.LARC: layer-wise adaptive rate clipping/scaling around any optimizer
(You, Gitman and Ginsburg, https://arxiv.org/abs/1708.03888), as self-supervised training
repositories import it: ``from apex.parallel.LARC import LARC``."""

from __future__ import annotations

import torch

__all__ = ["LARC"]


class LARC:
    """Wraps an optimizer and, before each of its steps, rescales every param's gradient by its
    local learning rate

        local = trust_coefficient * |p| / (|g| + weight_decay * |p| + eps)

    (clip=True: the effective rate is min(local, lr); clip=False: local * lr). The group's
    weight decay is folded into the gradient before the rescaling and set to 0 for the inner
    step, then restored. A param whose weight or gradient norm is 0 keeps its gradient and gets
    no weight decay on that step. This is apex's LARC; here the norms are computed in fp32 with
    one multi-tensor call per group and nothing is read back to the host.

    Like apex's, it is not a torch.optim.Optimizer subclass: it forwards param_groups, state,
    state_dict, load_state_dict, zero_grad and add_param_group to the wrapped optimizer.
    """

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        if not trust_coefficient > 0:
            raise ValueError(f"LARC: trust_coefficient must be > 0, got {trust_coefficient}.")
        if not eps >= 0:
            raise ValueError(f"LARC: eps must be >= 0, got {eps}.")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    @property
    def state(self):
        return self.optim.state

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    @property
    def defaults(self):
        return self.optim.defaults

    def __repr__(self):
        return f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, " \
               f"eps={self.eps}, optimizer={self.optim!r})"

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def _rescale(self, group, weight_decay):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("LARC: sparse gradients have no layer-wise norm here; use a "
                               "dense embedding (sparse=False) or leave LARC out.")
        p_norms = torch._foreach_norm(params, 2, dtype=torch.float32)
        g_norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        for p, g, p_norm, g_norm in zip(params, grads, p_norms, g_norms):
            active = (p_norm != 0) & (g_norm != 0)
            local = self.trust_coefficient * p_norm / (g_norm + p_norm * weight_decay + self.eps)
            if self.clip:
                local = torch.clamp(local / group["lr"], max=1.0)
            if weight_decay != 0:
                g.add_(p * torch.where(active, weight_decay, 0.0).to(p.dtype))
            g.mul_(torch.where(active, local, 1.0).to(g.dtype))

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LARC.step: a closure would recompute the gradients after LARC "
                             "rescaled them; compute the loss and backward() before step().")
        decays = [group.get("weight_decay", 0.0) for group in self.optim.param_groups]
        for group, weight_decay in zip(self.optim.param_groups, decays):
            self._rescale(group, weight_decay)
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        try:
            return self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, decays):
                if "weight_decay" in group:
                    group["weight_decay"] = weight_decay

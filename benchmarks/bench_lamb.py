"""Times one mixed-precision LAMB step of ampfuse against torch's best equivalent on
transformer-shaped parameter sets, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_lamb.py [--device cpu|cuda] [--dtype bf16 fp16]
        [--total-elements 1.25e8 3.5e8] [--json PATH]

torch has no LAMB, so its row is LAMB written with torch's multi-tensor (_foreach) ops, the
fastest composition torch offers (ForeachLamb below: the same math as FusedLAMB, checked in
tests/python/test_lamb.py). Same sizes, rows and method as bench_adam.py (read its docstring).
Byte floors for a model dtype of h bytes: ampfuse FusedLAMB 36 + 4h (the global grad norm reads
the grads; first pass: grad read and written back unscaled, master read, both moments read and
written; second pass: moments and master read, master and param written); with
write_unscaled_grads=False 36 + 3h; with the unscale pass 36 + 5h; torch's masters pipeline
(copy up, unscale, ForeachLamb on the masters, copy down) 60 + 2h, counting ForeachLamb at the
44 bytes of a norm pass and two passes, though it makes more; ForeachLamb on fp32 params 44.
"""


import torch

from ampfuse.optimizers import FusedLAMB
from bench_adam import (
    ampfuse_pipeline,
    main_for,
    optimizer_rows,
)

LR = 1e-3
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0


class ForeachLamb(torch.optim.Optimizer):
    """apex FusedLAMB's defaults and math (AdamW mode, grad averaging, bias correction, global
    grad-norm clipping) in torch _foreach ops, for fp32 params; no host sync."""

    def __init__(self, params, lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=WEIGHT_DECAY,
                 max_grad_norm=MAX_GRAD_NORM, fused=None, foreach=None):
        # fused/foreach: bench_adam's helpers pass one; this class is always foreach. Its steps
        # are never skipped: the benchmark's found_inf is always 0.
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      max_grad_norm=max_grad_norm))

    @torch.no_grad()
    def step(self, closure=None):
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        grads_all = [p.grad for _, params in groups for p in params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads_all)))
        max_norm = self.defaults["max_grad_norm"]
        clip = torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm))
        for group, params in groups:
            beta1, beta2 = group["betas"]
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
            states = [self.state[p] for p in params]
            for s in states:
                s["step"] += 1
            t = states[0]["step"]
            m = [s["exp_avg"] for s in states]
            v = [s["exp_avg_sq"] for s in states]
            g = torch._foreach_div([p.grad for p in params], clip)
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, g, alpha=1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, g, g, value=1 - beta2)
            denom = torch._foreach_div(v, 1 - beta2 ** t)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(m, 1 - beta1 ** t)
            torch._foreach_div_(update, denom)
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
            param_norms = torch.stack(torch._foreach_norm(params))
            update_norms = torch.stack(torch._foreach_norm(update))
            trusted = (param_norms > 0) & (update_norms > 0)
            ratios = torch.where(trusted, param_norms / update_norms,
                                 torch.ones_like(param_norms)) * -group["lr"]
            torch._foreach_mul_(update, list(ratios.unbind()))
            torch._foreach_add_(params, update)


def ampfuse_lamb(dtype, device, unscale_first, write_unscaled_grads=True):
    def make_optimizer(params, write):
        return FusedLAMB(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
                         master_weights=True, write_unscaled_grads=write)

    # 36 bytes of fp32 state and master traffic, plus the global norm's read of the grads.
    return ampfuse_pipeline("FusedLAMB", make_optimizer, 36 + dtype.itemsize, dtype, device,
                            unscale_first, write_unscaled_grads)


def run(args):
    return optimizer_rows(args, "lamb", ampfuse_lamb, dict(cls=ForeachLamb),
                          masters_floor=lambda h: 60 + 2 * h, fp32_floor=44,
                          labels=("torch foreach masters", "torch foreach fp32"))


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

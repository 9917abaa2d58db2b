"""Times one mixed-precision NovoGrad step of ampfuse against torch's best equivalent on
transformer-shaped parameter sets, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_novograd.py [--device cpu|cuda] [--dtype bf16 fp16]
        [--total-elements 1.25e8 3.5e8] [--json PATH]

torch has no NovoGrad, so its row is NovoGrad written with torch's multi-tensor (_foreach) ops,
the fastest composition torch offers (ForeachNovoGrad below: the same math as FusedNovoGrad,
checked in tests/python/test_novograd_bench.py). Same sizes, rows and method as bench_adam.py
(read its docstring) and bench_lamb.py. All rows use apex FusedNovoGrad's defaults (L2 norm, grad
averaging, bias correction, the moment taking the raw grad) with lr 1e-3 and weight decay 0.01.
Byte floors for a model dtype of h bytes: ampfuse FusedNovoGrad 16 + 4h (a first pass reads the
grads for each tensor's norm; the second reads them again and writes them back unscaled, reads
and writes the first moment and the master, and writes the param); with
write_unscaled_grads=False 16 + 3h; with the unscale pass 16 + 5h; torch's masters pipeline (copy
up, unscale, ForeachNovoGrad on the masters, copy down) 40 + 2h, counting ForeachNovoGrad at the
24 bytes of a norm pass and one update pass (grad read twice, moment and param read and
written), though it makes more passes; ForeachNovoGrad on fp32 params 24. The running norms (one
float per tensor) are left out of every floor.
"""

import math

import torch

from ampfuse.optimizers import FusedNovoGrad
from bench_adam import (
    ampfuse_pipeline,
    main_for,
    optimizer_rows,
)

LR = 1e-3
WEIGHT_DECAY = 0.01


class ForeachNovoGrad(torch.optim.Optimizer):
    """apex FusedNovoGrad's defaults and math (L2 norm, grad averaging, bias correction, the
    moment taking the raw grad: apex's moment_mode 1) in torch _foreach ops, for fp32 params; no
    host sync.

    Each param keeps one running norm of its grads (state 'norm_avg', a 0-dim tensor) that blends
    as sqrt(beta2 * avg^2 + (1 - beta2) * ||g||^2), seeded by the first step's own norm; the step
    is m = beta1 * m + (1 - beta1) * g, p -= lr * ((m / bc1) / (avg / bc2 + eps) + wd * p) with
    bc1 = 1 - beta1^t and bc2 = sqrt(1 - beta2^t). As apex, the step count is the group's: every
    param is expected to have a grad at every step (as in the benchmark)."""

    def __init__(self, params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY,
                 fused=None, foreach=None):
        # fused/foreach: bench_adam's helpers pass one; this class is always foreach. Its steps
        # are never skipped: the benchmark's found_inf is always 0.
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(p),
                                     "norm_avg": torch.zeros((), dtype=p.dtype, device=p.device)}
            states = [self.state[p] for p in params]
            for s in states:
                s["step"] += 1
            t = states[0]["step"]
            grads = [p.grad for p in params]
            m = [s["exp_avg"] for s in states]
            avgs = [s["norm_avg"] for s in states]

            # The running norms, one per tensor, as one vector: seeded by the first step's norm.
            norms = torch.stack(torch._foreach_norm(grads))
            old = norms if t == 1 else torch.stack(avgs)
            avg = torch.sqrt(beta2 * old * old + (1 - beta2) * norms * norms)
            torch._foreach_copy_(avgs, list(avg.unbind()))
            denom = avg / math.sqrt(1 - beta2 ** t) + group["eps"]

            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, grads, alpha=1 - beta1)
            update = torch._foreach_div(m, 1 - beta1 ** t)
            torch._foreach_div_(update, list(denom.unbind()))
            if group["weight_decay"] != 0:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])


def ampfuse_novograd(dtype, device, unscale_first, write_unscaled_grads=True):
    def make_optimizer(params, write):
        return FusedNovoGrad(params, lr=LR, weight_decay=WEIGHT_DECAY, master_weights=True,
                             write_unscaled_grads=write)

    # 16 bytes of fp32 state and master traffic (first moment and master, each read and
    # written), plus the norm pass's read of the grads; ampfuse_pipeline adds the second pass's
    # grad read, the param write and (when written back) the grad write.
    return ampfuse_pipeline("FusedNovoGrad", make_optimizer, 16 + dtype.itemsize, dtype, device,
                            unscale_first, write_unscaled_grads)


def run(args):
    # masters floor: copy up (h + 4), unscale (4 + 4), ForeachNovoGrad (24), copy down (4 + h).
    return optimizer_rows(args, "novograd", ampfuse_novograd, dict(cls=ForeachNovoGrad),
                          masters_floor=lambda h: 40 + 2 * h, fp32_floor=24,
                          labels=("torch foreach masters", "torch foreach fp32"))


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

"""Times one mixed-precision SGD step (momentum 0.9) of ampfuse against torch's best equivalents
on transformer-shaped parameter sets, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_sgd.py [--device cpu|cuda] [--dtype bf16 fp16]
        [--total-elements 1.25e8 3.5e8] [--json PATH]

Same sizes, rows and method as bench_adam.py (read its docstring), with SGD's byte floors for a
model dtype of h bytes: ampfuse FusedSGD 16 + 3h (grad read and written back unscaled, master
and momentum buffer read and written, param written); with write_unscaled_grads=False 16 + 2h;
with the unscale pass 16 + 4h; torch's masters pipeline (copy up, unscale, SGD(fused=True) on
the masters, copy down) 36 + 2h; SGD(fused=True) on fp32 params 24 (it writes the grads back).
"""

import torch

from ampfuse.optimizers import FusedSGD
from bench_adam import (
    ampfuse_pipeline,
    main_for,
    optimizer_rows,
)

LR = 1e-4
MOMENTUM = 0.9


def ampfuse_sgd(dtype, device, unscale_first, write_unscaled_grads=True):
    def make_optimizer(params, write):
        return FusedSGD(params, lr=LR, momentum=MOMENTUM, master_weights=True,
                        write_unscaled_grads=write)

    return ampfuse_pipeline("FusedSGD", make_optimizer, 16, dtype, device, unscale_first,
                            write_unscaled_grads)


def run(args):
    # masters floor: copy up (h + 4), unscale (8), SGD(fused=True) on the masters (16), copy
    # down (4 + h).
    return optimizer_rows(args, "sgd", ampfuse_sgd,
                          dict(cls=torch.optim.SGD, lr=LR, momentum=MOMENTUM),
                          masters_floor=lambda h: 36 + 2 * h, fp32_floor=24)


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

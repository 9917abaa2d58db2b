"""Times one mixed-precision Adagrad step of ampfuse against torch's best equivalents on
transformer-shaped parameter sets, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_adagrad.py [--device cpu|cuda] [--dtype bf16 fp16]
        [--total-elements 1.25e8 3.5e8] [--json PATH]

Same sizes, rows and method as bench_adam.py (read its docstring); torch's side is
torch.optim.Adagrad(fused=True) on the CPU. torch 2.11's fused Adagrad takes CPU tensors only, so
on CUDA torch's rows are Adagrad(foreach=True), "torch foreach masters" and "torch foreach fp32"
(bench_adam.py says what they leave out). Adagrad moves as many bytes as SGD with momentum
(one fp32 state array, the sum of squared grads), so the byte floors are bench_sgd.py's, for a
model dtype of h bytes: ampfuse FusedAdagrad 16 + 3h (grad read and written back unscaled, master
and sum read and written, param written); with write_unscaled_grads=False 16 + 2h; with the
unscale pass 16 + 4h; torch's masters pipeline (copy up, unscale, Adagrad(fused=True) on the
masters, copy down) 36 + 2h; Adagrad(fused=True) on fp32 params 24 (it writes the grads back),
Adagrad(foreach=True) 20 (it only reads them).
"""

import torch

from ampfuse.optimizers import FusedAdagrad
from bench_adam import (
    ampfuse_pipeline,
    main_for,
    optimizer_rows,
)

LR = 1e-2
WEIGHT_DECAY = 1e-4


def ampfuse_adagrad(dtype, device, unscale_first, write_unscaled_grads=True):
    def make_optimizer(params, write):
        return FusedAdagrad(params, lr=LR, weight_decay=WEIGHT_DECAY, master_weights=True,
                            write_unscaled_grads=write)

    return ampfuse_pipeline("FusedAdagrad", make_optimizer, 16, dtype, device, unscale_first,
                            write_unscaled_grads)


def run(args):
    return optimizer_rows(args, "adagrad", ampfuse_adagrad,
                          dict(cls=torch.optim.Adagrad, lr=LR, weight_decay=WEIGHT_DECAY),
                          masters_floor=lambda h: 36 + 2 * h, fp32_floor=24)


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

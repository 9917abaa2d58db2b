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
    compare_pipelines,
    layers_for,
    main_for,
    model_like_shapes,
    torch_fp32,
    torch_masters,
)
from _timing import DTYPES

LR = 1e-4
MOMENTUM = 0.9


def ampfuse_sgd(dtype, device, unscale_first, write_unscaled_grads=True):
    def make_optimizer(params, write):
        return FusedSGD(params, lr=LR, momentum=MOMENTUM, master_weights=True,
                        write_unscaled_grads=write)

    return ampfuse_pipeline("FusedSGD", make_optimizer, 16, dtype, device, unscale_first,
                            write_unscaled_grads)


def run(args):
    rows = []
    half_names = [name for name in args.dtype if name != "fp32"] or ["bf16"]
    sgd = dict(cls=torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    for total in args.total_elements:
        shapes = model_like_shapes(total, layers_for(total))
        for name in half_names:
            dtype = DTYPES[name]
            full = ampfuse_sgd(dtype, args.device, unscale_first=True)
            alone = ampfuse_sgd(dtype, args.device, unscale_first=False)
            scaled = ampfuse_sgd(dtype, args.device, unscale_first=False,
                                 write_unscaled_grads=False)
            masters_floor = 36 + 2 * dtype.itemsize
            pipelines = [alone, scaled, full,
                         torch_masters(dtype, args.device, full.label, masters_floor, **sgd),
                         torch_fp32(args.device, alone.label, 24, **sgd)]
            rows += compare_pipelines("sgd", pipelines, shapes, name, args)
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

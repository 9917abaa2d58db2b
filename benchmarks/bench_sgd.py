"""Times one mixed-precision SGD step (momentum 0.9) of ampfuse against torch's best equivalents
on transformer-shaped parameter sets, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_sgd.py [--device cpu|cuda] [--dtype bf16 fp16]
        [--total-elements 1.25e8 3.5e8] [--json PATH]

Same sizes, rows and method as bench_adam.py (read its docstring), with SGD's byte floors for a
model dtype of h bytes: ampfuse FusedSGD 16 + 2h (grad read, master and momentum buffer read and
written, param written); with the unscale pass 16 + 4h; torch's masters pipeline (copy up,
unscale, SGD(fused=True) on the masters, copy down) 36 + 2h; SGD(fused=True) on fp32 params 20.
"""

import torch

import ampfuse
from ampfuse.optimizers import FusedSGD
from bench_adam import (
    Pipeline,
    compare_pipelines,
    half_model,
    layers_for,
    main_for,
    model_like_shapes,
    scalars,
    torch_fp32,
    torch_masters,
)
from _timing import DTYPES

LR = 1e-4
MOMENTUM = 0.9


def ampfuse_sgd(dtype, device, unscale_first):
    def make(shapes, gen):
        params = half_model(shapes, dtype, device, gen)
        opt = FusedSGD(params, lr=LR, momentum=MOMENTUM, master_weights=True)
        return opt, [p.grad for p in params], *scalars(device), torch.full((), 1.0, device=device)

    def call(s):
        opt, grads, scale, found_inf, one = s
        if unscale_first:
            ampfuse.multi_tensor_unscale_(grads, found_inf, one)
            opt.step(found_inf=found_inf)
        else:
            opt.step(grad_scale=scale, found_inf=found_inf)

    h = dtype.itemsize
    label = "ampfuse unscale+FusedSGD" if unscale_first else "ampfuse FusedSGD"
    return Pipeline(label, 16 + (4 if unscale_first else 2) * h, make, call)


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
            masters_floor = 36 + 2 * dtype.itemsize
            pipelines = [alone, full,
                         torch_masters(dtype, args.device, full.label, masters_floor, **sgd),
                         torch_fp32(args.device, alone.label, 20, **sgd)]
            rows += compare_pipelines("sgd", pipelines, shapes, name, args)
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

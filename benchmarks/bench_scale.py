"""Times ampfuse.multi_tensor_scale_ against torch._foreach_mul followed by torch._foreach_copy_
(the cast) on model-shaped lists. --dtype names the destination: fp16/bf16 time the fp32 master
to low-precision model copy, fp32 an fp32 to fp32 scale. Byte floor: src read once, dst written
once. ampfuse also checks every source for inf/nan; torch's pair does not.

    PYTHONPATH=python python benchmarks/bench_scale.py [--device cpu|cuda] [--dtype bf16 ...]
        [--total-elements 1e7 ...] [--json PATH]
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from _report import main_for
from _timing import DTYPES, compare, element_count, model_like_shapes, random_tensors


def run(args):
    device = args.device
    scale = torch.full((1,), 1.0 / 1024.0, device=device)
    scale_0dim = scale.reshape(())  # torch._foreach_mul takes a 0-dim tensor scalar only
    rows = []
    for total in args.total_elements:
        shapes = model_like_shapes(total)
        for name in args.dtype:
            dst_dtype = DTYPES[name]
            src_dtype = torch.float32
            floor = element_count(shapes) * (src_dtype.itemsize + dst_dtype.itemsize)

            def make_set(gen, src_dtype=src_dtype, dst_dtype=dst_dtype, shapes=shapes):
                src = random_tensors(shapes, src_dtype, device, gen)
                # zeros, not empty: no page may be first touched inside a timed call
                dst = [torch.zeros(s, dtype=dst_dtype, device=device) for s in shapes]
                return src, dst, torch.zeros(1, device=device)

            def ampfuse_call(s, i):
                torch.ops.ampfuse.multi_tensor_scale_(s[0], s[1], scale, s[2])

            def torch_call(s, i):
                torch._foreach_copy_(s[1], torch._foreach_mul(s[0], scale_0dim))

            rows += compare(
                op="scale_",
                device=device,
                dtype_name=f"fp32->{name}",
                shapes=shapes,
                floor_bytes=floor,
                make_set=make_set,
                ampfuse_call=ampfuse_call,
                torch_call=torch_call,
                args=args,
                torch_label="torch _foreach_mul+copy_",
            )
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

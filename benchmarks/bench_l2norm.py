"""Times ampfuse.multi_tensor_l2norm (global and per-tensor norms) against torch._foreach_norm
(fp32 results) followed by torch.linalg.vector_norm of the stacked norms, which is what
torch.nn.utils.clip_grad_norm_ computes. Byte floor: every tensor read once.

    PYTHONPATH=python python benchmarks/bench_l2norm.py [--device cpu|cuda] [--dtype fp16 ...]
        [--total-elements 1e7 ...] [--json PATH]
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from _report import main_for
from _timing import DTYPES, compare, element_count, model_like_shapes, random_tensors


def run(args):
    device = args.device
    rows = []
    for total in args.total_elements:
        shapes = model_like_shapes(total)
        for name in args.dtype:
            dtype = DTYPES[name]
            floor = element_count(shapes) * dtype.itemsize

            def make_set(gen, dtype=dtype, shapes=shapes):
                return random_tensors(shapes, dtype, device, gen)

            def ampfuse_call(s, i):
                return torch.ops.ampfuse.multi_tensor_l2norm(s, True)

            def torch_call(s, i):
                norms = torch._foreach_norm(s, 2, dtype=torch.float32)
                return torch.linalg.vector_norm(torch.stack(norms)), norms

            rows += compare(
                op="l2norm",
                device=device,
                dtype_name=name,
                shapes=shapes,
                floor_bytes=floor,
                make_set=make_set,
                ampfuse_call=ampfuse_call,
                torch_call=torch_call,
                args=args,
                torch_label="torch _foreach_norm+norm",
            )
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

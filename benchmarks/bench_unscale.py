"""Times ampfuse.multi_tensor_unscale_ against torch._amp_foreach_non_finite_check_and_unscale_
on model-shaped gradient lists. Byte floor: every gradient read once and written once.

    PYTHONPATH=python python benchmarks/bench_unscale.py [--device cpu|cuda] [--dtype fp16 ...]
        [--total-elements 1e7 ...] [--json PATH]
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from _timing import DTYPES, compare, element_count, main_for, model_like_shapes, random_tensors


def run(args):
    device = args.device
    # Alternating 1/2 and 2 keeps the in-place data unchanged in the long run (see random_tensors).
    inv_scales = [torch.full((1,), 0.5, device=device), torch.full((1,), 2.0, device=device)]
    rows = []
    for total in args.total_elements:
        shapes = model_like_shapes(total)
        for name in args.dtype:
            dtype = DTYPES[name]
            floor = 2 * element_count(shapes) * dtype.itemsize

            def make_set(gen, dtype=dtype, shapes=shapes):
                return random_tensors(shapes, dtype, device, gen), torch.zeros(1, device=device)

            def ampfuse_call(s, i):
                torch.ops.ampfuse.multi_tensor_unscale_(s[0], s[1], inv_scales[i % 2])

            def torch_call(s, i):
                torch._amp_foreach_non_finite_check_and_unscale_(s[0], s[1], inv_scales[i % 2])

            rows += compare(
                op="unscale_",
                device=device,
                dtype_name=name,
                shapes=shapes,
                floor_bytes=floor,
                footprint_bytes=floor // 2,
                make_set=make_set,
                ampfuse_call=ampfuse_call,
                torch_call=torch_call,
                args=args,
                torch_label="torch._amp_foreach_*",
            )
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

"""Times ampfuse.multi_tensor_unscale_ against torch._amp_foreach_non_finite_check_and_unscale_
on model-shaped gradient lists. Byte floor: every gradient read once and written once. torch
2.11 has no bf16 kernel of its op on CUDA (so GradScaler cannot unscale bf16 grads there): the
bf16 torch row then says "not implemented for 'BFloat16'", and ampfuse's row has no ratio.

Overflow attribution, side by side: rows "unscale_ flags" and "check flags" time the unscale
and the read-only check (multi_tensor_nonfinite_check_) with a fresh tensor_flags each call, as
GradScaler(attribute_overflow=True) and amp make one per step, against the same op without it
(the row labelled "no flags"; its torch/ampfuse column is then without/with). The grads are
clean: this is the cost on a step that does not overflow.

    PYTHONPATH=python python benchmarks/bench_unscale.py [--device cpu|cuda] [--dtype fp16 ...]
        [--total-elements 1e7 ...] [--json PATH]
"""

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from _report import main_for
from _timing import DTYPES, compare, element_count, model_like_shapes, random_tensors


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
            rows += _attribution_rows(args, name, shapes, floor, make_set, inv_scales)
    return rows


def _attribution_rows(args, dtype_name, shapes, floor, make_set, inv_scales):
    device = args.device

    def flags():
        return torch.zeros(len(shapes), dtype=torch.int32, device=device)

    def unscale_with(s, i):
        torch.ops.ampfuse.multi_tensor_unscale_(s[0], s[1], inv_scales[i % 2], flags())

    def unscale_without(s, i):
        torch.ops.ampfuse.multi_tensor_unscale_(s[0], s[1], inv_scales[i % 2])

    def check_with(s, i):
        torch.ops.ampfuse.multi_tensor_nonfinite_check_(s[0], s[1], flags())

    def check_without(s, i):
        torch.ops.ampfuse.multi_tensor_nonfinite_check_(s[0], s[1])

    common = dict(device=device, dtype_name=dtype_name, shapes=shapes, make_set=make_set,
                  args=args)
    return compare(op="unscale_ flags", floor_bytes=floor, footprint_bytes=floor // 2,
                   ampfuse_call=unscale_with, torch_call=unscale_without,
                   torch_label="ampfuse, no flags", **common) + compare(
        op="check flags", floor_bytes=floor // 2, ampfuse_call=check_with,
        torch_call=check_without, torch_label="ampfuse, no flags", **common)


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])

"""The kernels issue 10's GPU run found below their bandwidth goals, each run once inside its own
NVTX range for Nsight Compute (benchmarks/ncu_profile.sh runs this under ncu).

Targets, on model-shaped lists of 291 tensors (_timing.model_like_shapes) of about 100M
elements, after two untimed calls of each, with what the first H100 run measured (before
fed9776 batched the list kernels' loads):
  l2norm fp32/fp16/bf16       fp16/bf16 ran at 70% of copy bandwidth, fp32 at 93%
  check fp32/fp16             the read-only inf/nan check: 102% for fp32, 56% for fp16
  unscale fp16                in-place read and write: 95% (the contrast)
  scale fp32->bf16            the master-to-model cast copy: 80%
  sgd bf16 (masters)          FusedSGD with fp32 masters, 125M params: 80% for bf16

Only the calls inside torch.cuda.profiler.start()/stop() are profiled (ncu
--profile-from-start off). Without ncu it still runs, as a smoke test of the targets.

    PYTHONPATH=python python benchmarks/ncu_targets.py [--device cuda] [--elements 1e8]
"""

import argparse

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import torch
from _timing import generator, model_like_shapes, random_tensors, synchronize

OPS = torch.ops.ampfuse


def targets(elements, device):
    """[(name, call)] for every target, tensors made once per dtype."""
    gen = generator(device, 0)
    shapes = model_like_shapes(elements)
    lists = {dtype: random_tensors(shapes, dtype, device, gen)
             for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    found_inf = torch.zeros(1, device=device)
    one = torch.ones(1, device=device)
    out = []
    for dtype, tag in ((torch.float32, "fp32"), (torch.float16, "fp16"),
                       (torch.bfloat16, "bf16")):
        out.append((f"l2norm {tag}", lambda t=lists[dtype]: OPS.multi_tensor_l2norm(t, False)))
    for dtype, tag in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        out.append((f"check {tag}",
                    lambda t=lists[dtype]: OPS.multi_tensor_nonfinite_check_(t, found_inf)))
    out.append(("unscale fp16",
                lambda: OPS.multi_tensor_unscale_(lists[torch.float16], found_inf, one)))
    model = [torch.empty_like(t, dtype=torch.bfloat16) for t in lists[torch.float32]]
    out.append(("scale fp32->bf16",
                lambda: OPS.multi_tensor_scale_(lists[torch.float32], model, one, found_inf)))
    # 58% of copy bandwidth in session 16's run, where fp32->fp16/bf16 reached 86-90%.
    fp32_out = [torch.empty_like(t) for t in lists[torch.float32]]
    out.append(("scale fp32->fp32",
                lambda: OPS.multi_tensor_scale_(lists[torch.float32], fp32_out, one, found_inf)))
    out.append(("sgd bf16 (masters)", _sgd_step(shapes, device, gen)))
    return out


def _sgd_step(shapes, device, gen):
    """One FusedSGD step with fp32 masters and momentum on bf16 params (grads left as they
    are, so every call does the same work)."""
    from ampfuse.optimizers import FusedSGD

    params = [torch.nn.Parameter(t) for t in random_tensors(shapes, torch.bfloat16, device, gen)]
    for p, g in zip(params, random_tensors(shapes, torch.bfloat16, device, gen)):
        p.grad = g
    optimizer = FusedSGD(params, lr=1e-4, momentum=0.9, master_weights=True,
                         write_unscaled_grads=False)
    return optimizer.step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--elements", type=float, default=1e8)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for name, call in targets(int(args.elements), args.device):
        for _ in range(2):
            call()
        synchronize(args.device)
        if cuda:
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push(name)
        call()
        if cuda:
            torch.cuda.nvtx.range_pop()
            synchronize(args.device)
            torch.cuda.profiler.stop()
        print(f"ran {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

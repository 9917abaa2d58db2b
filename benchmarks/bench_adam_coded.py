"""Times fused_adam_coded_ (8-bit block-coded moments, int8 and fp8) against fused_adam_ with fp32
moments on one param, the same update with fp32 masters, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_adam_coded.py [--device cpu|cuda]
        [--numel 4e6] [--dtype fp32 bf16] [--calls 10]

Each row is the fastest of --calls steps (after one warm-up step) on the same tensors, so the
ratio compares the kernels, not the cache state (on a CPU whose cache holds the tensors, as
with --numel 4e6 on a large last-level cache, it is compute that is compared). Bytes moved per
element, grads and params of h bytes (fp32 masters for bf16, read and written): fp32 moments
16 + 2h (+ 8), coded moments 4 + 2h (+ 8) plus 4 bytes of scales read and written per 256.
A benchmark reports; it never asserts a time.
"""

import argparse
import time

import torch
from ampfuse import ops
from ampfuse.optimizers._state_codes import quantize_moment

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HYPER = (0.9, 0.999, 1e-8, 0.01)


def _setup(numel, dtype, device):
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen).to(dtype).to(device)
    grad = torch.randn(numel, generator=gen).to(dtype).to(device)
    master = param.float() if dtype != torch.float32 else None
    exp_avg = (torch.randn(numel, generator=gen) * 1e-2).to(device)
    exp_avg_sq = (torch.rand(numel, generator=gen) * 1e-3).to(device)
    return param, grad, master, exp_avg, exp_avg_sq


def _fastest(step, calls, device):
    step()  # warm-up
    best = float("inf")
    for _ in range(calls):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def bench(numel, dtype_name, device, calls):
    dtype = DTYPES[dtype_name]
    param, grad, master, exp_avg, exp_avg_sq = _setup(numel, dtype, device)
    masters = [master] if master is not None else []
    step = torch.zeros(1, device=device)
    lr = torch.full((1,), 1e-3, device=device)

    def fp32_step():
        ops.fused_adam_([param], [grad], [exp_avg], [exp_avg_sq], [], masters, step, lr, *HYPER)

    rows = [("fp32 moments (fused_adam_)", _fastest(fp32_step, calls, device))]
    for kind in ("int8", "fp8"):
        m_codes, m_scales = quantize_moment(exp_avg, kind, False)
        v_codes, v_scales = quantize_moment(exp_avg_sq, kind, True)

        def coded_step(m_codes=m_codes, m_scales=m_scales, v_codes=v_codes, v_scales=v_scales,
                       kind=kind):
            ops.fused_adam_coded_([param], [grad], [m_codes], [m_scales], [v_codes], [v_scales],
                                  [], [], masters, step, lr, *HYPER, state_dtype=kind)

        rows.append((f"{kind} codes (fused_adam_coded_)", _fastest(coded_step, calls, device)))
    base = rows[0][1]
    print(f"{device} {dtype_name} param, {numel} elements, threads={torch.get_num_threads()}, "
          f"fastest of {calls}:")
    for name, seconds in rows:
        print(f"  {name:32s} {seconds * 1e3:9.3f} ms   {seconds / base:5.2f}x fp32 moments")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--numel", type=float, default=4e6)
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    for dtype_name in args.dtype:
        bench(int(args.numel), dtype_name, args.device, args.calls)


if __name__ == "__main__":
    main()

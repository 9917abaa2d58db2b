"""The fused optimizer op on one large bf16 param, master_weights=True against "split".

    PYTHONPATH=python python benchmarks/time_split_op.py
        [--optimizer adam|sgd|adagrad|lamb|novograd] [--mode split|kahan|stochastic]
        [--elements 4194304] [--calls 15] [--rounds 2] [--threads 1]

Calls the op itself (no optimizer class) on one bf16 param with bf16 grads: with fp32 masters
(master_mode="fp32", the True mode) and with int16 low halves (master_mode="split"; or bf16
compensations, or nothing, with --mode kahan or stochastic), in one process, the two alternated
round by round, and prints the fastest of `--calls` calls of each
(ms) and their ratio. A 4M-element param (8 MB of bf16) with its state is larger than the CPU's
caches, so the time is the kernel's (the per-call host work is microseconds). This is the
measurement behind RESULTS.md's "split / True" for issue 33. A benchmark reports; it asserts
nothing about the times.
"""

import argparse
import time

import torch
from ampfuse import ops


def make_state(optimizer, mode, n, seed):
    """Arguments of one op call; master_params hold True's fp32 masters or split's low halves."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    param = master.to(torch.bfloat16)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    if mode == "fp32":
        extra = [master]
    elif mode == "split":
        # The low 16 bits of the master's pattern (the param is its rounded high half).
        extra = [(master.view(torch.int32) & 0xFFFF).to(torch.int16)]
    elif mode == "kahan":
        extra = [torch.zeros(n, dtype=torch.bfloat16)]  # the compensations
    else:
        extra = []  # stochastic rounding keeps nothing
    state = [torch.rand(n, generator=gen) for _ in range(2)]
    return {"param": param, "grad": grad, "extra": extra, "state": state,
            "norm": torch.zeros(()), "step": torch.zeros(1), "mode": mode, "optimizer": optimizer}


def call(a):
    mode = a["mode"]
    ids = {"param_ids": [0]} if mode == "stochastic" else {}
    if a["optimizer"] == "adam":
        ops.fused_adam_([a["param"]], [a["grad"]], [a["state"][0]], [a["state"][1]], [],
                        a["extra"], a["step"], 1e-4, 0.9, 0.999, 1e-8, 0.01,
                        master_mode=mode, **ids)
    elif a["optimizer"] == "sgd":
        ops.fused_sgd_([a["param"]], [a["grad"]], [a["state"][0]], a["extra"], a["step"],
                       1e-4, momentum=0.9, weight_decay=0.01, master_mode=mode, **ids)
    elif a["optimizer"] == "lamb":
        ops.fused_lamb_([a["param"]], [a["grad"]], [a["state"][0]], [a["state"][1]],
                        a["extra"], a["step"], 1e-4, 0.9, 0.999, 1e-6, 0.01,
                        master_mode=mode, **ids)
    elif a["optimizer"] == "novograd":
        ops.fused_novograd_([a["param"]], [a["grad"]], [a["state"][0]], [a["norm"]],
                            a["extra"], a["step"], 1e-4, 0.95, 0.98, 1e-8, 0.01,
                            master_mode=mode, **ids)
    else:
        ops.fused_adagrad_([a["param"]], [a["grad"]], [a["state"][0]], a["extra"],
                           a["step"], 1e-4, weight_decay=0.01, master_mode=mode, **ids)


def fastest_ms(a, calls):
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        call(a)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=["adam", "sgd", "adagrad", "lamb", "novograd"],
                        default="adam")
    parser.add_argument("--mode", choices=["split", "kahan", "stochastic"], default="split",
                        help="the master-free mode timed against fp32 masters")
    parser.add_argument("--elements", type=int, default=4_194_304)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = {m: make_state(args.optimizer, m, args.elements, 0) for m in ("fp32", args.mode)}
    for a in runs.values():
        call(a)  # warm-up: first touch of the pages
    print(f"fused_{args.optimizer}_, {args.elements} bf16 params, {args.threads} thread(s), "
          f"fastest of {args.calls} calls, ms")
    print(f"round  True    {args.mode}  {args.mode} / True")
    for r in range(args.rounds):
        true_ms = fastest_ms(runs["fp32"], args.calls)
        split_ms = fastest_ms(runs[args.mode], args.calls)
        print(f"{r:5d}  {true_ms:6.3f}  {split_ms:6.3f}  {split_ms / true_ms:.3f}")


if __name__ == "__main__":
    main()

"""Bytes per parameter that each FSDP2 rank holds, for the mixed-precision set-ups that
docs/distributed.md compares, measured on 1, 2 and 4 CPU processes (gloo).

What is counted: after one training step, the bytes of every tensor the rank keeps between
steps, i.e. its local shards of the params, their grads and the optimizer state (moments, fp32
masters, step counts), divided by the model's parameter count. Not counted: activations and
FSDP2's transient all-gathered (unsharded) params, which live only during forward/backward.

    python benchmarks/fsdp2_memory.py            # prints a markdown table
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampfuse

RANKS = (1, 2, 4)
WIDTH = 512  # 4 square layers: about 1.05M params, every dim divisible by 4


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).to(dtype)


def _setups():
    """name -> (param dtype, MixedPrecisionPolicy kwargs or None, optimizer factory)."""
    bf16 = torch.bfloat16
    policy = {"param_dtype": bf16, "reduce_dtype": torch.float32}
    return {
        "fp32 (torch AdamW, fused)": (
            torch.float32, None,
            lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        "torch AMP: MixedPrecisionPolicy(bf16), fp32 params as masters, torch AdamW": (
            torch.float32, policy,
            lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        "ampfuse, FSDP2 recipe: MixedPrecisionPolicy(bf16) + FusedAdamW": (
            torch.float32, policy,
            lambda ps: ampfuse.optimizers.FusedAdamW(ps, lr=1e-3)),
        "ampfuse O2-style: bf16 params + FusedAdamW(master_weights=True)": (
            bf16, None,
            lambda ps: ampfuse.optimizers.FusedAdamW(ps, lr=1e-3, master_weights=True)),
        "ampfuse bf16, no masters: FusedAdamW(master_weights=False)": (
            bf16, None,
            lambda ps: ampfuse.optimizers.FusedAdamW(ps, lr=1e-3, master_weights=False)),
    }


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes_per_param(dtype, policy, make_optimizer):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(dtype)
    count = sum(p.numel() for p in model.parameters())
    mp_policy = MixedPrecisionPolicy(**policy) if policy else MixedPrecisionPolicy()
    for layer in model:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    optimizer = make_optimizer(model.parameters())
    inputs = torch.randn(8, WIDTH)
    model(inputs.to(dtype)).float().square().mean().backward()
    optimizer.step()
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    held = sum(_local(t).numel() * _local(t).element_size() for t in tensors
               if isinstance(t, torch.Tensor))
    return held / count


def _worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        results = {name: _bytes_per_param(*setup) for name, setup in _setups().items()}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "bytes.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(ranks=RANKS) -> dict:
    """{setup name: {world size: bytes per param on rank 0}}."""
    table = {}
    for world_size in ranks:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_worker, args=(world_size, _free_port(), out_dir), nprocs=world_size)
            for name, value in torch.load(os.path.join(out_dir, "bytes.pt")).items():
                table.setdefault(name, {})[world_size] = value
    return table


def main() -> int:
    table = measure()
    print(f"torch {torch.__version__}, {sum(p.numel() for p in _model().parameters()):,} params")
    print("| set-up | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in RANKS) + " |")
    print("|---|" + "---:|" * len(RANKS))
    for name, by_ranks in table.items():
        print(f"| {name} | " + " | ".join(f"{by_ranks[n]:.2f}" for n in RANKS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

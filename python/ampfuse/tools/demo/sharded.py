"""The demo on several CPU processes with FSDP2 (`python -m ampfuse demo --ranks N`).

Each process (gloo on loopback) shards the demo model with torch's fully_shard, takes its
1/N of the rows of every batch and trains with the same FusedAdamW. FSDP2 averages the
gradients over the processes; the table shows the same runs, its memory column counting one
process's shards. The numbers differ a little from the single-process run's: BatchNorm takes
its batch statistics over each process's rows (as under DDP without SyncBatchNorm, which
needs a GPU), and the test accuracy uses rank 0's running statistics.

The amp levels follow the FSDP2 recipe (see ampfuse.amp.sharded): FSDP2 does the casting,
amp the loss scaling.
- O0: fp32 shards, loss scale 1.
- O1: fp32 shards, autocast inside the forward (amp's per-op casting), dynamic loss scale.
- O2: fp32 shards (the masters) under FSDP2's MixedPrecisionPolicy(param_dtype=low,
  reduce_dtype=fp32), amp.initialize(..., cast_model_type=False) for the loss scale.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch

from ampfuse.tools.demo import training


class Sharding:
    """One process's part of a sharded run; training.train_run calls it."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    def shard(self, model, opt_level: str, dtype):
        """fully_shards `model` (each block with weights, then the root) for `opt_level`;
        returns it and the extra amp.initialize options the level needs."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        options = {}
        policy = MixedPrecisionPolicy()
        if opt_level == "O2":
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                          output_dtype=torch.float32)
            options = {"cast_model_type": False}
        elif opt_level not in ("O0", "O1"):
            raise ValueError(f"the sharded demo runs O0, O1 and O2, not {opt_level}")
        for module in model:
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                # fp32 normalization, as O2 keeps it unsharded (keep_batchnorm_fp32).
                fully_shard(module, mp_policy=MixedPrecisionPolicy())
            elif any(True for _ in module.parameters(recurse=False)):
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, options

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """This process's rows of a batch (training.BATCH_SIZE is a multiple of world_size)."""
        return index.view(self.world_size, -1)[self.rank]

    def overflowing_shard(self, grad):
        """The local shard of `grad` on rank 0, None elsewhere: an overflow only one process
        sees, which the unscale's reduction must make every process skip."""
        return grad.to_local() if self.rank == 0 else None

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        values = values.clone()
        torch.distributed.all_reduce(values)
        return values / self.world_size


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, threads, port, runs, options, out_dir):
    torch.set_num_threads(threads)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        data = training.load_digits("cpu")
        sharding = Sharding(rank, world_size)
        progress = options.pop("progress", True) and rank == 0  # one progress bar
        results = [training.train_run(name, level, data, sharding=sharding, progress=progress,
                                  **options) for name, level in runs]
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    # Every rank meets at a barrier, tears the gloo group down and exits without the
    # interpreter's finalization: gloo's threads may still hold work whose release during
    # finalization aborts the process ("terminate called without an active exception"), a rare
    # failure seen in CI runs. The results are saved; the parent reads them.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_sharded(runs, world_size: int, **options) -> list[dict]:
    """training.train_run for each (name, opt level) of `runs` on `world_size` CPU processes;
    returns rank 0's results (losses averaged over the processes)."""
    if training.BATCH_SIZE % world_size:
        raise ValueError(f"--ranks {world_size} must divide the batch size, {training.BATCH_SIZE}")
    import torch.multiprocessing as mp

    threads = max(1, torch.get_num_threads() // world_size)  # the cores, shared out
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, threads, _free_port(), runs, options, out_dir),
                 nprocs=world_size)
        return torch.load(os.path.join(out_dir, "results.pt"), weights_only=False)

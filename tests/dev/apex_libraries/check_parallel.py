"""Dev check: apex.parallel.DistributedDataParallel from the alias across two CPU processes.

The unit tests run the alias's DDP on one rank, where an average and a sum are the same thing.
Here two gloo ranks each backpropagate their own batch, and every rank's gradients must equal
what apex's options ask for, computed locally from both batches:

* the defaults: the mean over ranks;
* ``gradient_average=False``: the sum;
* ``gradient_predivide_factor=2.0, allreduce_always_fp32=True`` on a bf16 model: the mean,
  reduced in fp32 (apex's recipe against fp16 overflow in the all-reduce);
* timm's train.py order, ``amp.initialize(model, optimizer, opt_level="O2")`` then
  ``ApexDDP(model, delay_allreduce=True)``: the ranks' weights stay identical while training.

Run it from the repository root (about 20 s; no extra packages)::

    python tests/dev/apex_libraries/check_parallel.py
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _checks import Checks

WORLD = 2
CASES = {
    "defaults (mean)": ({}, torch.float32, "mean"),
    "gradient_average=False (sum)": ({"gradient_average": False}, torch.float32, "sum"),
    "predivide 2, fp32 all-reduce, bf16 model (mean)": (
        {"gradient_predivide_factor": 2.0, "allreduce_always_fp32": True}, torch.bfloat16,
        "mean"),
}


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3)).to(dtype)


def _batch(rank, dtype):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 8, generator=gen).to(dtype), torch.randint(0, 3, (6,), generator=gen)


def _local_grads(rank, dtype):
    model = _model(dtype)
    x, y = _batch(rank, dtype)
    F.cross_entropy(model(x).float(), y).backward()
    return [p.grad.float() for p in model.parameters()]


def _worker(rank, port, results):
    from ampfuse.apex_compat import install_apex_alias

    install_apex_alias()
    from apex import amp
    from apex.parallel import DistributedDataParallel as ApexDDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        for name, (options, dtype, _) in CASES.items():
            model = _model(dtype)
            ddp = ApexDDP(model, **options)
            x, y = _batch(rank, dtype)
            F.cross_entropy(ddp(x).float(), y).backward()
            results[(rank, name)] = [p.grad.float() for p in model.parameters()]
        model = _model(torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        ddp = ApexDDP(model, delay_allreduce=True)
        for step in range(5):
            x, y = _batch(rank * 10 + step, torch.float32)
            loss = F.cross_entropy(ddp(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        results[(rank, "O2 train")] = [p.detach().float() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(port, results), nprocs=WORLD, join=True)
    check = Checks("apex.parallel")
    for name, (_, dtype, reduction) in CASES.items():
        per_rank = [_local_grads(rank, dtype) for rank in range(WORLD)]
        expected = [sum(gs) / (WORLD if reduction == "mean" else 1) for gs in zip(*per_rank)]
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        check(all(torch.allclose(g, e, rtol=tolerance, atol=tolerance)
                  for rank in range(WORLD) for g, e in zip(results[(rank, name)], expected)),
              f"{name}: every rank holds the expected grads")
    check(all(torch.equal(a, b) for a, b in zip(results[(0, "O2 train")],
                                                results[(1, "O2 train")])),
          "amp O2 + ApexDDP(delay_allreduce=True): ranks stay identical over 5 steps")
    return check.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

"""Running a test's work on several CPU processes (torch.multiprocessing, gloo on loopback)."""

import os
import socket
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, args, nprocs, timeout_s):
    """Runs worker(rank, *args) on `nprocs` processes and waits for them at most `timeout_s`
    seconds. A rank that raises makes this raise; ranks still running at the deadline are
    killed and the test fails, so a hung collective cannot hang the test run."""
    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        # join() returns as soon as one more process is done (and raises if one failed).
        while not finished and time.monotonic() < deadline:
            finished = context.join(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert finished, f"the {nprocs} ranks did not finish within {timeout_s} s"


def leave_group():
    """Ends a rank once its results are saved: every rank meets at a barrier, tears its gloo
    group down, and exits without the interpreter's finalization. gloo's threads may still hold
    work (FSDP2's buffers among it) whose release during finalization aborts the process with
    "terminate called without an active exception": a rare failure, seen twice in full CI runs
    of this suite, and once with a barrier alone. Errors do not come here: a rank that raised
    tears down in its worker and lets torch.multiprocessing report the exception."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

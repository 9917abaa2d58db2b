"""Running a test's work on several processes (torch.multiprocessing; gloo on loopback, or NCCL
with one GPU a rank)."""

import datetime
import os
import socket
import sys
import time

import torch
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


def run_on_ranks(scenario, *args, world_size, timeout_s, out_dir, backend="gloo",
                 collective_timeout_s=None):
    """Runs scenario(*args) on `world_size` processes, each a rank of one process group on
    loopback, and returns each rank's result in rank order (through torch.save files in
    `out_dir`). scenario must be a module-level function (or a partial of one): spawn pickles it
    by module and name. A rank reads its rank with dist.get_rank(). backend "nccl" puts rank r
    on GPU r. collective_timeout_s, when given, bounds each collective (else torch's default).
    A rank that raises makes this raise with its traceback; see spawn_ranks for the deadline."""
    spawn_ranks(_rank_worker,
                (world_size, free_port(), backend, collective_timeout_s, str(out_dir), scenario,
                 args),
                world_size, timeout_s)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            for rank in range(world_size)]


def _rank_worker(rank, world_size, port, backend, collective_timeout_s, out_dir, scenario, args):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = None if collective_timeout_s is None else datetime.timedelta(
        seconds=collective_timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        torch.save(scenario(*args), os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()

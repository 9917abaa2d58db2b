"""apex.parallel on torch.distributed: DistributedDataParallel is torch's DDP taking apex's
arguments, SyncBatchNorm is torch.nn.SyncBatchNorm, and LARC wraps any optimizer.

apex's DDP options either keep apex's meaning here or are refused: the ones that only tuned
apex's own scheduling of all-reduces (delay_allreduce, num_allreduce_streams, prof) change
nothing in the result and are accepted; the ones that change what is reduced
(gradient_average, gradient_predivide_factor, allreduce_always_fp32) are carried out by a DDP
communication hook; the ones tied to apex's internals are refused with the alternative.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ampfuse.apex_compat.apex.parallel import LARC  # noqa: F401  (apex.parallel.LARC)

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model", "ReduceOp", "LARC",
           "Reducer"]

ReduceOp = dist.ReduceOp


def _reduce_hook(state, bucket):
    """All-reduces one DDP bucket as apex did: optionally in fp32, divided by
    gradient_predivide_factor before the sum and by world_size / factor after it (or only
    multiplied back by the factor when gradient_average=False)."""
    group, in_fp32, predivide, average = state
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    work = buffer.to(torch.float32) if in_fp32 else buffer.clone()
    if predivide != 1.0:
        work.div_(predivide)
    future = dist.all_reduce(work, group=group, async_op=True).get_future()

    def finish(done):
        total = done.value()[0]
        post = predivide / world if average else predivide
        if post != 1.0:
            total.mul_(post)
        return buffer.copy_(total)

    return future.then(finish)


def _refuse(option, why):
    raise NotImplementedError(f"apex.parallel.DistributedDataParallel: {option} is not "
                              f"supported by ampfuse's apex alias; {why}.")


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch.nn.parallel.DistributedDataParallel with apex's constructor.

    Like apex's, it needs torch.distributed initialized, broadcasts rank 0's weights at
    construction and averages gradients across ranks in backward(). message_size (elements
    per all-reduce) becomes torch's bucket_cap_mb.
    """

    def __init__(self, module, message_size=10000000, delay_allreduce=False, shared_param=None,
                 allreduce_trigger_params=None, retain_allreduce_buffers=False,
                 allreduce_always_fp32=False, num_allreduce_streams=1,
                 allreduce_communicators=None, gradient_average=True,
                 gradient_predivide_factor=1.0, gradient_average_split_factor=None, prof=False):
        if shared_param is not None:
            _refuse("shared_param", "apex refused it too; leave it None (shared params need "
                    "nothing special)")
        if allreduce_trigger_params is not None:
            _refuse("allreduce_trigger_params", "torch's DDP starts an all-reduce when a bucket "
                    "of grads is ready; leave it None and tune message_size instead")
        if retain_allreduce_buffers:
            _refuse("retain_allreduce_buffers=True", "read the averaged grads from "
                    "param.grad after backward()")
        if allreduce_communicators is not None:
            _refuse("allreduce_communicators", "torch's DDP reduces over one process group; "
                    "build the model's group with torch.distributed.new_group")
        if gradient_average_split_factor is not None:
            # apex's earlier name for the same option.
            gradient_predivide_factor = gradient_average_split_factor
        if not gradient_predivide_factor > 0:
            raise ValueError("apex.parallel.DistributedDataParallel: gradient_predivide_factor "
                             f"must be > 0, got {gradient_predivide_factor}.")
        if message_size <= 0:
            raise ValueError("apex.parallel.DistributedDataParallel: message_size must be a "
                             f"positive number of elements, got {message_size}.")
        first = next(module.parameters(), None)
        element_size = first.element_size() if first is not None else 4
        super().__init__(module, bucket_cap_mb=message_size * element_size / 2**20)
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.allreduce_always_fp32 = allreduce_always_fp32
        if allreduce_always_fp32 or not gradient_average or gradient_predivide_factor != 1.0:
            self.register_comm_hook((self.process_group, bool(allreduce_always_fp32),
                                     float(gradient_predivide_factor), bool(gradient_average)),
                                    _reduce_hook)


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """torch.nn.SyncBatchNorm with apex's constructor. apex's fused NHWC kernel options
    (channel_last, fuse_relu) are refused: pass channels_last tensors in NCHW shape and apply
    the ReLU after the layer instead."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, channel_last=False,
                 fuse_relu=False):
        if channel_last:
            raise NotImplementedError(
                "apex.parallel.SyncBatchNorm: channel_last=True (inputs shaped N,...,C) is not "
                "supported by ampfuse's apex alias; give NCHW-shaped inputs (a "
                "torch.channels_last memory format is fine) and leave channel_last False.")
        if fuse_relu:
            raise NotImplementedError(
                "apex.parallel.SyncBatchNorm: fuse_relu=True is not supported by ampfuse's apex "
                "alias; apply torch.relu to the layer's output instead.")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group)


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Replaces every BatchNorm layer of `module` by a SyncBatchNorm holding the same weights
    and running statistics, and returns the converted module (apex's function, done by
    torch.nn.SyncBatchNorm.convert_sync_batchnorm)."""
    if channel_last:
        raise NotImplementedError(
            "apex.parallel.convert_syncbn_model: channel_last=True is not supported by ampfuse's "
            "apex alias; leave it False (NCHW-shaped inputs in any memory format work).")
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)


# apex.parallel.Reducer lives in apex.parallel.distributed, as in apex; that module imports the
# DistributedDataParallel above, so it comes last.
from ampfuse.apex_compat.apex.parallel.distributed import Reducer  # noqa: E402

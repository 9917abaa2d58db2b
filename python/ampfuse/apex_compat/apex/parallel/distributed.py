"""apex.parallel.distributed on torch.distributed: the module's DistributedDataParallel (the
alias's, apex.parallel's), Reducer, and the flat collective helpers that scripts import from it
directly. NVIDIA's BERT fine-tuning and pretraining scripts, for one, broadcast their initial
weights with ``flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))``.

flat_dist_call groups the tensors by dtype and device, flattens each group into one buffer,
runs the collective once per buffer and copies the result back, as apex did; after
``dist.all_reduce`` (and only then) it divides by the world size, so a reduced buffer holds the
average, as apex's did. torch's flatten and unflatten do what apex's C++ ones (apex_C) did.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ampfuse.apex_compat.apex.parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel", "Reducer", "apply_flat_dist_call", "extract_tensors",
           "flat_dist_call", "flatten", "split_by_type", "split_half_float_double",
           "unflatten"]


def flatten(bucket):
    """One contiguous 1-D tensor holding every tensor of `bucket` (all of one dtype and device),
    in order."""
    return _flatten_dense_tensors(bucket)


def unflatten(coalesced, bucket):
    """Views of `coalesced` shaped like the tensors of `bucket`."""
    return _unflatten_dense_tensors(coalesced, bucket)


def split_by_type(tensors):
    """The tensors grouped by their type (dtype and device type, as ``Tensor.type()`` names it),
    in order of first appearance; a collective is run once per group."""
    buckets = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def split_half_float_double(tensors):
    """The CUDA fp16, fp32 and fp64 tensors among `tensors`, one list per dtype that occurs, in
    that order (apex's helper; tensors of other types are left out, as apex left them)."""
    buckets = []
    for dtype in (torch.float16, torch.float32, torch.float64):
        bucket = [t for t in tensors if t.is_cuda and t.dtype == dtype]
        if bucket:
            buckets.append(bucket)
    return buckets


def apply_flat_dist_call(bucket, call, extra_args=None):
    """Runs ``call(flat, *extra_args)`` on the tensors of `bucket` (one dtype and device)
    flattened into one buffer and copies the result back into them; after dist.all_reduce the
    buffer is divided by the world size first (the average)."""
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args if extra_args is not None else ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for tensor, synced in zip(bucket, unflatten(coalesced, bucket)):
        tensor.copy_(synced)


def flat_dist_call(tensors, call, extra_args=None):
    """apply_flat_dist_call on each group of `tensors` of one type (split_by_type)."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor, tensor_list):
    """Appends to `tensor_list` every tensor in `maybe_tensor`, a tensor or any nesting of
    iterables of them; anything else is skipped (strings too, which apex's version recursed
    into without end)."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    if isinstance(maybe_tensor, (str, bytes)):
        return
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        extract_tensors(item, tensor_list)


class Reducer:
    """Averages gradients across ranks when reduce() is called, not during backward() (apex's
    Reducer: for all-reducing every few steps, say).

    Given a module, it broadcasts rank 0's parameters at construction and reduce() averages the
    grads its parameters have; given tensors (any nesting of lists of them), reduce() averages
    those, and syncing the weights is left to the caller.
    """

    def __init__(self, module_or_grads_list):
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module = module_or_grads_list
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self):
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)

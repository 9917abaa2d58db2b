"""Block-coded moments (state_dtype) of DTensor params (FSDP2): each rank codes its local shard.

A rank's blocks are cut from its own shard (in the shard's memory order), so no block spans two
ranks and the step needs no communication. The codes are a DTensor laid out like the param.
The scales are a 1-D DTensor whose local part on every rank has the same length, the block
count of the largest shard any rank can hold (a shorter shard's last entries are unused
zeros): even shards are what a Shard(0) DTensor of that global length means, so torch's
distributed checkpoint saves and loads them shard for shard. Where the param is sharded on a
mesh dimension, the scales are Shard(0) on it; where replicated, Replicate().

The codes of a param sharded this way depend on how it is sharded: loading them into the same
sharding continues bit for bit; a different sharding (or an unsharded model) is refused by the
scales' length, and decode_moments does not apply to such a gathered state (its blocks are the
ranks' shards).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

BLOCK = 256


def is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # only loaded where DTensors exist
    return module is not None and isinstance(t, module.DTensor)


def local(t: Any) -> torch.Tensor:
    """A DTensor's local shard, or t itself."""
    return t.to_local() if is_dtensor(t) else t


def local_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def padded_blocks(p: Any) -> int:
    """The scales each rank keeps for DTensor ``p``: the blocks of the largest shard of it."""
    shape = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            dim = placement.dim
            shape[dim] = -(-shape[dim] // p.device_mesh.size(mesh_dim))
    return local_blocks(math.prod(shape))


def scales_shape(p: Any) -> tuple[int]:
    """The shape of p's scales: one per block for a plain tensor; for a DTensor, every rank's
    padded_blocks side by side along the mesh dimensions that shard it."""
    if not is_dtensor(p):
        return (local_blocks(p.numel()),)
    ranks = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard())
    return (padded_blocks(p) * ranks,)


def wrap_codes(local_codes: torch.Tensor, like: Any) -> Any:
    """Local codes (or decoded moments) as a tensor sharded like ``like`` (a DTensor param or
    state tensor), or themselves when ``like`` is a plain tensor."""
    if not is_dtensor(like):
        return local_codes
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_codes, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def wrap_scales(local_scales: torch.Tensor, like: Any) -> Any:
    """A rank's scales (its shard's blocks) as the scales of ``like``: padded with zeros to
    padded_blocks and wrapped as a 1-D DTensor (see the module docstring); plain ones as they
    are."""
    if not is_dtensor(like):
        return local_scales
    from torch.distributed.tensor import DTensor, Replicate, Shard

    padded = torch.zeros(padded_blocks(like), dtype=torch.float32, device=local_scales.device)
    padded[: local_scales.numel()] = local_scales
    placements = [Shard(0) if pl.is_shard() else Replicate() for pl in like.placements]
    return DTensor.from_local(padded, like.device_mesh, placements, run_check=False,
                              shape=torch.Size(scales_shape(like)), stride=(1,))


def local_scales(scales: Any, codes: Any) -> torch.Tensor:
    """The scales of the blocks of ``codes``' local shard: a view of the local part of a
    DTensor's padded scales, which the step writes through."""
    if not is_dtensor(scales):
        return scales
    return scales.to_local()[: local_blocks(local(codes).numel())]

"""amp.initialize on models that FSDP2 (torch.distributed.fsdp.fully_shard) manages.

FSDP2 owns such a model's parameters: the module holds DTensor shards that FSDP2 all-gathers
(and casts, under its MixedPrecisionPolicy) for each forward. Casting the module's params, as O2
and O3 do, replaces tensors FSDP2 keeps its own references to: the forward then silently
computes with weights that are not the ones being trained. So amp leaves the casting to FSDP2:
O0, O1 (autocast inside the forward) and O2/O3 with cast_model_type=False (loss scaling and
masters for params that are already low precision) are accepted; casting levels are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch


def _is_fsdp2_managed(model: torch.nn.Module) -> bool:
    if "torch.distributed.fsdp" not in sys.modules:
        return False  # nothing can have called fully_shard
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def refuse_casting_sharded_models(models: Iterable[torch.nn.Module], cast_model_type: object,
                                  opt_level: str) -> None:
    """Raises if amp would cast the params of a model FSDP2 manages."""
    if cast_model_type not in (torch.float16, torch.bfloat16):
        return
    for model in models:
        if not _is_fsdp2_managed(model):
            continue
        name = "fp16" if cast_model_type == torch.float16 else "bf16"
        raise RuntimeError(
            f"amp.initialize: opt_level={opt_level!r} casts the model's weights to {name}, but "
            "FSDP2 (fully_shard) manages this model's parameters, and a cast would replace "
            "tensors FSDP2 keeps its own references to. Let FSDP2 cast: "
            f"fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype={cast_model_type}, "
            "reduce_dtype=torch.float32)) on each block and the root, then "
            f"amp.initialize(model, optimizer, opt_level={opt_level!r}, cast_model_type=False) "
            "for loss scaling (the sharded fp32 params are the masters). Or use "
            "ampfuse.GradScaler with the fused optimizer, or opt_level='O1'."
        )

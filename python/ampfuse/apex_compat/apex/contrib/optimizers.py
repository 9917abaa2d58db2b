"""apex.contrib.optimizers on ampfuse: the optimizers apex moved here from apex 0.1's
apex.optimizers, which BERT-era fine-tuning scripts import (``from apex.contrib.optimizers import
FP16_Optimizer``), as the alias's versions: FP16_Optimizer is apex.fp16_utils', FusedAdam the
alias's (with apex 0.1's max_grad_norm clipping), FusedLAMB and FusedSGD too.

One difference stays: apex 0.1's FusedAdam folded both bias corrections into one step size, so
its eps and weight decay were scaled by sqrt(1 - beta2^t) / (1 - beta1^t); ampfuse's follows
torch's AdamW, as apex's later FusedAdam does. Without bias_correction (what the BERT recipes
pass) the two are the same math. DistributedFusedAdam and DistributedFusedLAMB fail to import
with the replacement named. apex's submodule names (fp16_optimizer, fused_adam, fused_lamb,
fused_sgd) are this module.
"""

from __future__ import annotations

from ampfuse.apex_compat.apex._fp16_optimizer import FP16_Optimizer
from ampfuse.apex_compat.apex.optimizers import FusedAdam, FusedLAMB, FusedSGD

__all__ = ["FP16_Optimizer", "FusedAdam", "FusedLAMB", "FusedSGD"]

# A package to the import system (with no directory of its own), so that importing one of
# apex's submodules that the alias lacks reaches the alias's finder and its message, rather
# than Python's "is not a package".
__path__ = []

_DISTRIBUTED = {
    "DistributedFusedAdam": "FusedAdam",
    "DistributedFusedLAMB": "FusedLAMB",
}


def __getattr__(name):
    if name in _DISTRIBUTED:
        raise ImportError(
            f"apex.contrib.optimizers.{name} has no ampfuse version (apex here is ampfuse's "
            "compatibility alias); shard the model and its optimizer state with FSDP2 "
            "(torch.distributed.fsdp.fully_shard) and use ampfuse.optimizers."
            f"{_DISTRIBUTED[name]}, which steps sharded (DTensor) params.",
            name="apex.contrib.optimizers")
    raise AttributeError(f"module 'apex.contrib.optimizers' has no attribute {name!r}")

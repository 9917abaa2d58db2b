"""Fused torch.optim optimizers with fp32 master weights and device-side loss-scale handling.

    from ampfuse.optimizers import FusedAdam, FusedAdamW, FusedSGD
    from ampfuse.optimizers import FusedAdagrad, FusedLAMB, FusedNovoGrad

Each is a torch.optim.Optimizer: param groups, add_param_group, LR schedulers, zero_grad and
state_dict in torch.optim's layout all work as with torch's own optimizers, and
torch.amp.GradScaler drives them without a separate unscale pass. Their base class,
FusedOptimizer, states what callers may rely on (stepping, skipping, fp32 masters); code that
works with any of them (isinstance checks, amp) uses it rather than their state's layout.
decode_moments turns a state_dict with 8-bit moments (FusedAdam's state_dtype) into one with
fp32 moments for torch's optimizers.
"""

from ampfuse.optimizers._base import FusedOptimizer
from ampfuse.optimizers._state_codes import decode_moments
from ampfuse.optimizers.adagrad import FusedAdagrad
from ampfuse.optimizers.adam import FusedAdam, FusedAdamW
from ampfuse.optimizers.lamb import FusedLAMB
from ampfuse.optimizers.novograd import FusedNovoGrad
from ampfuse.optimizers.sgd import FusedSGD

__all__ = [
    "FusedAdagrad",
    "FusedAdam",
    "FusedAdamW",
    "FusedLAMB",
    "FusedNovoGrad",
    "FusedOptimizer",
    "FusedSGD",
    "decode_moments",
]

"""apex.optimizers on ampfuse: FusedAdam, FusedSGD, FusedLAMB and FusedNovoGrad with apex's
constructors (apex's argument order and defaults) over ampfuse.optimizers' fused optimizers, so
amp takes its fused, sync-free path with them.

Importing an apex optimizer that ampfuse does not have raises ImportError naming the
replacement. An ImportError (rather than a name that fails when used) keeps every script that
runs without apex running with the alias: ``try: from apex.optimizers import FusedAdagrad`` /
``except ImportError:`` falls back to the script's own optimizer exactly as it does with no apex.
"""

from __future__ import annotations

import inspect

from torch.optim.optimizer import required

from ampfuse import optimizers as _fused

__all__ = ["FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]


class FusedAdam(_fused.FusedAdam):
    """apex.optimizers.FusedAdam's signature on ampfuse.optimizers.FusedAdam.

    Same meaning as in apex: AdamW by default (adam_w_mode=False gives Adam's L2 decay), no
    weight decay by default, and zero_grad() sets grads to None. Differences: amsgrad=True works
    here (apex refused it), and master_weights=True needs no capturable=True.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False, master_weights=False):
        super().__init__(params, lr, betas, eps, weight_decay, adam_w_mode=adam_w_mode,
                         bias_correction=bias_correction, amsgrad=amsgrad,
                         master_weights=master_weights, capturable=capturable,
                         set_grad_none=set_grad_none)


def _accepts(cls, name) -> bool:
    return name in inspect.signature(cls.__init__).parameters


class FusedSGD(_fused.FusedSGD):
    """apex.optimizers.FusedSGD's signature on ampfuse.optimizers.FusedSGD.

    As in apex, lr may be left out when every param group carries its own, and zero_grad()
    zeroes grads rather than dropping them (set_grad_none=False).
    """

    def __init__(self, params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=False):
        extra = {}
        if _accepts(_fused.FusedSGD, "wd_after_momentum"):
            extra["wd_after_momentum"] = wd_after_momentum
        elif wd_after_momentum:
            raise NotImplementedError(
                "apex.optimizers.FusedSGD: wd_after_momentum=True is not supported by this "
                "ampfuse version; leave it False (torch.optim.SGD's order).")
        # Where ampfuse lacks the flag, leaving it out changes no result: it only chooses
        # whether amp's O2 masters get fp32 grads of their own before the step.
        if _accepts(_fused.FusedSGD, "materialize_master_grads"):
            extra["materialize_master_grads"] = materialize_master_grads
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov,
                         set_grad_none=set_grad_none, **extra)


class FusedLAMB(_fused.FusedLAMB):
    """apex.optimizers.FusedLAMB on ampfuse.optimizers.FusedLAMB, which already takes apex's
    arguments in apex's order with apex's defaults (see its docstring for the differences:
    fp32 moments, p.grad left as it was, per-param step counts)."""


class FusedNovoGrad(_fused.FusedNovoGrad):
    """apex.optimizers.FusedNovoGrad on ampfuse.optimizers.FusedNovoGrad, which already takes
    apex's arguments in apex's order with apex's defaults (see its docstring for the
    differences: fp32 moments, bf16 params, per-param step counts and running norms)."""


# apex optimizers without an ampfuse version, and what to use instead.
_MISSING = {
    "FusedMixedPrecisionLamb": "use timm.optim.Lamb with amp.initialize(..., opt_level='O2') "
    "for fp32 masters, or the real apex",
    "FusedAdagrad": "use torch.optim.Adagrad(params, lr, weight_decay=..., eps=..., fused=True) "
    "(apex's adagrad_w_mode=False math), or the real apex",
}


def __getattr__(name):
    if name in _MISSING:
        raise ImportError(f"apex.optimizers.{name} has no ampfuse version (apex here is "
                          f"ampfuse's compatibility alias); {_MISSING[name]}.",
                          name="apex.optimizers")
    raise AttributeError(f"module 'apex.optimizers' has no attribute {name!r}")

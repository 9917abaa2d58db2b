"""torch.optim's implementation switches (foreach, fused, differentiable) on the fused optimizers
that stand in for a torch.optim class, so that a constructor call written for torch's class runs
unchanged: ``torch.optim.AdamW(params, lr=3e-4, fused=True)`` becomes
``FusedAdamW(params, lr=3e-4, fused=True)`` and nothing else.

These switches choose how torch runs the same math, not what the math is. None leaves the
choice to the optimizer, and True asks for a multi-tensor step: the fused step is one, so both
are accepted. False asks torch for a step that is not fused (fused=False) or that goes one tensor
at a time (foreach=False), and differentiable=True for a step autograd can see through; a fused
optimizer does none of these, so they are refused, naming the torch class that does them, rather
than quietly running the fused step instead. None of them is kept in the param groups:
state_dict() writes torch's defaults for them (_TORCH_GROUP_KEYS), whatever was passed here.
"""

from __future__ import annotations

IMPLEMENTATION_SWITCHES = ("foreach", "fused", "differentiable")


def check_implementation_switches(name, torch_class, foreach, fused, differentiable):
    """Refuses the switch values a fused optimizer cannot honour; `name` is the optimizer's class
    name and `torch_class` the torch.optim class it stands in for, as the messages name them."""
    for key, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(
                f"{name}: {key}={value!r}; it must be None, True or False, as in {torch_class}."
            )
        if value is False:
            raise ValueError(
                f"{name}: {key}=False asks for {torch_class}'s step without "
                f"{'multi-tensor kernels' if key == 'foreach' else 'its fused kernel'}, but "
                f"{name} always runs one fused step per param group and device. Drop {key} "
                f"(None and True are accepted), or use {torch_class} itself for that step."
            )
    if foreach and fused:
        raise ValueError(
            f"{name}: foreach=True and fused=True were both given; {torch_class} refuses the "
            f"pair too. Pass at most one of them: {name} runs its fused step either way."
        )
    if not isinstance(differentiable, bool):
        raise ValueError(
            f"{name}: differentiable={differentiable!r}; it must be True or False, as in "
            f"{torch_class}."
        )
    if differentiable:
        raise ValueError(
            f"{name}: differentiable=True asks for a step that autograd can differentiate "
            f"through, but {name} updates the params in place outside autograd. Use "
            f"{torch_class}(..., differentiable=True) for that."
        )

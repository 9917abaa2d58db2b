"""torch.optim's implementation switches (foreach, fused, differentiable) on the fused optimizers
that stand in for a torch.optim class, so that a constructor call written for torch's class runs
unchanged: ``torch.optim.AdamW(params, lr=3e-4, fused=True)`` becomes
``FusedAdamW(params, lr=3e-4, fused=True)`` and nothing else.

foreach and fused choose which of torch's implementations runs the same math (one tensor at a
time, multi-tensor kernels, or one fused kernel); the drop-in has one implementation, the fused
step, and runs it for every value torch accepts. That is what a config written for torch
expects: torchtitan, for one, passes fused=True with foreach=False, or fused=False with
foreach=True, and a user who turned torch's fused kernel off for its own reasons chose the fused
step by choosing this class. Values torch refuses are refused here too: anything but None, True
or False, and foreach=True with fused=True. differentiable=True changes what the step is (one
autograd can see through), which a fused step updating params in place cannot be, so it is
refused naming the torch class that does it. None of them is kept in the param groups:
state_dict() writes torch's defaults for them (_TORCH_GROUP_KEYS), whatever was passed here.
"""

from __future__ import annotations

IMPLEMENTATION_SWITCHES = ("foreach", "fused", "differentiable")


def check_implementation_switches(name: str, torch_class: str, foreach: object, fused: object,
                                  differentiable: object) -> None:
    """Refuses the switch values torch refuses, and differentiable=True; `name` is the
    optimizer's class name and `torch_class` the torch.optim class it stands in for, as the
    messages name them."""
    for key, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(
                f"{name}: {key}={value!r}; it must be None, True or False, as in {torch_class}."
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

"""Sparse gradients in FusedSGD and FusedAdagrad, stepped as torch.optim.SGD and Adagrad step
them.

An nn.Embedding(sparse=True) gives its weight a sparse COO gradient that holds only the rows
the batch looked up. torch.optim.SGD and Adagrad take such grads (Adam refuses them; SparseAdam
is its own class), so their drop-ins do too, with torch's arithmetic:

- They are not fused: the fused ops walk dense memory, and a sparse update touches only the
  gradient's rows, which is the point of a sparse embedding. They run after the fused calls of
  the same step, under the same verdict: a step a loss scaler's found_inf or skip_nonfinite's
  check skips leaves them as they were too. Reading that verdict on the host is one sync per
  step that has sparse grads (torch's own sparse path reads its step count on the host too).
- Only float32 params (where sparse embeddings train; torch steps a sparse grad in the
  param's dtype), without master weights. Anything else, and weight decay (torch's Adagrad
  refuses it and its SGD fails on it), is refused before any param of the step is written.
- The gradient is coalesced first (duplicate rows summed, as a dense grad holds them). A loss
  scale is divided out of its values on the device, and p.grad is then left unscaled, as the
  fused path leaves dense grads (write_unscaled_grads).
- SGD's momentum buffer is the fused path's: dense fp32 in the param's layout, seeded with the
  first grad as torch seeds its own (torch keeps that one sparse, and it fills up as rows are
  seen). Adagrad's sum and step count are its usual state; the update reads and writes the
  gradient's rows only, as torch's sparse path does.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ampfuse.overflow import param_name
from ampfuse.optimizers._state import fp32_like


class SparseCall:
    """The params of one group and device that have sparse grads this step. Sorted and
    checked with the op calls (step_verdicts reads `step`, `params` and `grads`, the values it
    checks for inf/nan), stepped by `run` after them."""

    mode = "sparse"
    has_complex = False

    def __init__(self, step: torch.Tensor) -> None:
        self.step = step  # a step tensor on the params' device: only its device is read
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.sparse_grads: list[torch.Tensor] = []
        self.states: list[dict[str, Any]] = []

    def add(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
        grad = grad.coalesce()
        self.params.append(p)
        self.sparse_grads.append(grad)
        self.grads.append(grad._values())
        self.states.append(state)

    def seal(self) -> None:
        pass

    # optimizer: a FusedOptimizer (_base, which imports this module).
    def run(self, optimizer: Any, group: dict[str, Any], grad_scale: torch.Tensor | None,
            verdict: torch.Tensor | None) -> None:
        """Steps every param unless `verdict` (the step's device flag, or None) says skip."""
        if verdict is not None and bool(verdict.reshape(()).item()):
            return
        lr = group["lr"]
        lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
        inv_scale = None if grad_scale is None else torch.reciprocal(grad_scale.reshape(()))
        for p, grad, state in zip(self.params, self.sparse_grads, self.states):
            if inv_scale is not None:
                grad = grad * inv_scale  # still coalesced: the same rows
                if group.get("write_unscaled_grads", True):
                    p.grad = grad
            optimizer._sparse_step(group, p, grad, state, lr)


def add_sparse(optimizer: Any, group_index: int, param_index: int, p: torch.Tensor,
               group: dict[str, Any], sparse_calls: dict[torch.device, SparseCall]) -> None:
    """Sorts param `p`, whose grad is sparse, into the SparseCall of its device in
    `sparse_calls` (device -> SparseCall), after the checks that refuse what the sparse step
    cannot take. The param counts its steps on its own: its step tensor is not shared."""
    check_sparse_param(optimizer, group_index, param_index, p, group)
    state = optimizer.state[p]
    step = state.get("step")
    state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if step is None
                     else step.clone())
    if p.device not in sparse_calls:
        sparse_calls[p.device] = SparseCall(state["step"])
    sparse_calls[p.device].add(p, cast(torch.Tensor, p.grad), state)  # sorted for its grad


def check_sparse_param(optimizer: Any, group_index: int, param_index: int, p: torch.Tensor,
                       group: dict[str, Any]) -> None:
    """Refuses a sparse grad the sparse step cannot take, naming the param and the fix."""
    name = f"{type(optimizer).__name__}: {param_name(group_index, param_index)}"
    if group["weight_decay"] != 0:
        raise RuntimeError(
            f"{name} has a sparse gradient and its group has weight_decay="
            f"{group['weight_decay']}; weight decay is not compatible with sparse gradients "
            f"(torch.optim.Adagrad refuses it and torch.optim.SGD fails on it). Put the sparse "
            "params in a group with weight_decay=0."
        )
    if p.dtype != torch.float32:
        raise RuntimeError(
            f"{name} has a sparse gradient and dtype {p.dtype}; sparse gradients are stepped "
            "for torch.float32 params (keep the sparse embedding in fp32, or make its "
            "gradient dense with sparse=False)."
        )
    if optimizer._capturing():
        raise RuntimeError(
            f"{name} has a sparse gradient, whose step reads the skip verdict on the host and "
            "cannot be captured in a CUDA graph; capture models with dense gradients."
        )


def sgd_step(group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
             lr: float) -> None:
    """torch.optim.SGD's single-tensor step of a sparse grad, with a dense fp32 momentum
    buffer (see the module docstring)."""
    momentum = float(group["momentum"])
    if group["maximize"]:
        grad = -grad
    if momentum != 0:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = fp32_like(p)
            buf.copy_(grad.to_dense())
        else:
            buf.mul_(momentum).add_(grad, alpha=1.0 - float(group["dampening"]))
        # torch adds the buffer to the grad; with a dense buffer the sum is dense.
        grad = torch.add(grad.to_dense(), buf, alpha=momentum) if group["nesterov"] else buf
    p.add_(grad, alpha=-lr)
    state["step"] += 1  # the fused op tells the first step by it, should the grad turn dense


def adagrad_step(group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                 lr: float) -> None:
    """torch.optim.Adagrad's single-tensor step of a sparse grad (weight decay refused)."""
    step = state["step"]
    step += 1
    clr = lr / (1 + (float(step.item()) - 1) * float(group["lr_decay"]))
    if group["maximize"]:
        grad = -grad
    state_sum = state["sum"]
    state_sum.add_(grad.pow(2))
    # The sum at the grad's rows, in the grad's (coalesced) order, as torch's sparse path.
    std = state_sum.sparse_mask(grad)._values().sqrt_().add_(float(group["eps"]))
    update = grad.clone()
    update._values().div_(std)
    p.add_(update, alpha=-clr)

"""One op call of a fused optimizer's step: the params that share one step tensor and master
mode, with their grads and state, as the op takes them (see _base's "How a step is laid out")."""

from __future__ import annotations

from typing import Any

import torch

from ampfuse.optimizers._precision import BF16_MODES, EXTRA_KEYS


class OpCall:
    """The tensors of one op call: params sharing one step tensor and master mode ("fp32",
    "none" or a bf16 mode, see _precision).

    A complex param (complex64) is updated as its real view, each element's real and imaginary
    parts side by side, as torch.optim steps complex params: its grad is that view already, and
    op_params() and state_list() view it and its (complex) state so."""

    __slots__ = (
        "coded",
        "entries",
        "grads",
        "has_complex",
        "mode",
        "param_ids",
        "params",
        "records",
        "states",
        "step",
    )

    def __init__(self, step: torch.Tensor, mode: str, coded: str | None = None) -> None:
        self.step = step
        self.mode = mode
        # "int8"/"fp8": the params' moments are block-coded (state_dtype); None: fp32 moments.
        self.coded = coded
        self.has_complex = False
        # (param, grad, state, ParamRecord) per param while _calls sorts them: one append per
        # param instead of four; seal() turns them into the lists the op takes.
        self.entries: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], Any]] = []
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.states: list[dict[str, Any]] = []
        self.records: list[Any] = []  # ParamRecord (_masters)
        self.param_ids: list[int] = []  # each param's index in the optimizer ("stochastic" only)

    def seal(self) -> None:
        if self.entries:
            self.params, self.grads, self.states, self.records = map(list, zip(*self.entries))
            self.entries = []  # a StepPlan keeps the call: it must not keep the grads alive

    def op_params(self) -> list[torch.Tensor]:
        """The params as the op takes them."""
        if not self.has_complex:
            return self.params
        return [torch.view_as_real(p) if p.is_complex() else p for p in self.params]

    def state_list(self, key: str) -> list[torch.Tensor]:
        """Each param's state[key], as the op takes it."""
        values = [s[key] for s in self.states]
        if not self.has_complex:
            return values
        return [torch.view_as_real(t) if t.is_complex() else t for t in values]

    @property
    def has_master(self) -> bool:
        return self.mode == "fp32"

    def masters(self) -> list[torch.Tensor]:
        """The op's master_params: fp32 masters, compensations, low halves, or none."""
        key = EXTRA_KEYS.get(self.mode)
        return [s[key] for s in self.states] if key is not None else []

    def master_args(self, group: dict[str, Any]) -> dict[str, Any]:
        """The op's master_mode, param_ids and seed for this call."""
        if self.mode not in BF16_MODES:
            return {}
        return {"master_mode": self.mode, "param_ids": self.param_ids,
                "seed": int(group.get("rounding_seed", 0))}

"""ampfuse.fp8.Linear: nn.Linear whose GEMMs run in FP8 with delayed scaling.

Forward: the input and the weight are cast to e4m3 with their current scales (each cast also
records the tensor's amax), and ``fp8_gemm`` computes ``x @ w.T + bias``. Backward: the output
gradient is cast to the recipe's bwd_format, and dgrad (``g @ w``) and wgrad (``g.T @ x``) are
FP8 GEMMs on the saved FP8 tensors. The scales move only in ``update_scales`` (once per
optimizer step, see ampfuse.fp8.scaling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ampfuse.ops import fp8 as fp8_ops
from ampfuse.fp8.recipe import DelayedScaling

# The tensors of a layer that are cast to FP8, in the order of the state lists.
ROLES = ("input", "weight", "grad_output")
# cuBLASLt's FP8 GEMMs need every dimension to be a multiple of this.
ALIGN = 16


def _pad_rows(x2d: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of ALIGN: they add nothing to either GEMM, nor to an amax."""
    extra = -x2d.shape[0] % ALIGN
    return F.pad(x2d, (0, 0, 0, extra)) if extra else x2d


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp8_gemm writes bf16 or fp32; other dtypes (fp16) get fp32, then a cast."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


class _Fp8LinearFunction(torch.autograd.Function):
    """x [m, k] (m a multiple of ALIGN) -> x @ weight.T + bias [m, n], every GEMM in FP8.

    Inputs and outputs are whole 2-D tensors: the caller pads and reshapes outside, because
    under torch.compile an output that is a view or alias lost its gradient (torch 2.11)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                state: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
                fwd_format: torch.dtype, bwd_format: torch.dtype) -> torch.Tensor:
        amax, scale, scale_inv = state
        x8 = fp8_ops.fp8_cast_amax(x, scale[0], amax[0], fwd_format)
        w8 = fp8_ops.fp8_cast_amax(weight, scale[1], amax[1], fwd_format)
        out_dtype = _gemm_dtype(x.dtype)
        gemm_bias = None if bias is None else bias.to(out_dtype)
        out = fp8_ops.fp8_gemm(x8, w8, scale_inv[0], scale_inv[1], gemm_bias, out_dtype)
        ctx.save_for_backward(x8, w8)
        # The state tensors ride on ctx, not in save_for_backward: the grad cast writes the
        # amax during backward, and a second graph through this layer must not then see a
        # "modified saved tensor" error. Their values at backward are what the step uses.
        ctx.fp8 = (scale_inv[0], scale_inv[1], scale[2], scale_inv[2], amax[2])
        ctx.bwd_format = bwd_format
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        # No .to() when the dtype already matches: under torch.compile an output that
        # aliases another tensor of the forward lost its gradient.
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8, w8 = ctx.saved_tensors
        x_scale_inv, w_scale_inv, g_scale, g_scale_inv, g_amax = ctx.fp8
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g8 = fp8_ops.fp8_cast_amax(grad_out, g_scale, g_amax, ctx.bwd_format)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # fp8_transpose: the FP8 GEMM takes both operands K-contiguous.
            grad_x = fp8_ops.fp8_gemm(g8, fp8_ops.fp8_transpose(w8), g_scale_inv, w_scale_inv,
                                       None, _gemm_dtype(x_dtype)).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_ops.fp8_gemm(fp8_ops.fp8_transpose(g8), fp8_ops.fp8_transpose(x8),
                                       g_scale_inv, x_scale_inv, None,
                                       _gemm_dtype(w_dtype)).to(w_dtype)
        if ctx.needs_input_grad[2]:
            # Summed in fp32 without an fp32 copy of grad_out (tokens x out_features).
            grad_b = grad_out.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` computing its GEMMs in FP8 (see the module docstring).

    in_features and out_features must be multiples of 16 (cuBLASLt's FP8 rule); any batch
    shape works (rows are padded internally). The FP8 state is fp32 buffers, so
    ``state_dict`` and checkpoints carry it: ``fp8_{input,weight,grad_output}_{amax,
    amax_history,scale,scale_inv}``. Call ``ampfuse.fp8.update_scales(model)`` once per
    optimizer step (amp.initialize(..., fp8=True) does it for you). Amaxes are recorded in
    training mode only; in eval mode the layer uses the current scales and changes nothing.
    """

    fp8_recipe: DelayedScaling
    # The FP8 state buffers (registered by _init_fp8), fp32 whatever the module's dtype.
    fp8_input_amax: torch.Tensor
    fp8_input_amax_history: torch.Tensor
    fp8_input_scale: torch.Tensor
    fp8_input_scale_inv: torch.Tensor
    fp8_weight_amax: torch.Tensor
    fp8_weight_amax_history: torch.Tensor
    fp8_weight_scale: torch.Tensor
    fp8_weight_scale_inv: torch.Tensor
    fp8_grad_output_amax: torch.Tensor
    fp8_grad_output_amax_history: torch.Tensor
    fp8_grad_output_scale: torch.Tensor
    fp8_grad_output_scale_inv: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 recipe: DelayedScaling | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe)

    @classmethod
    def from_linear(cls, module: torch.nn.Linear, recipe: DelayedScaling | None = None) -> Linear:
        """Turns an nn.Linear into an fp8.Linear in place (same object, same Parameters, same
        hooks, so optimizers and wrappers keep pointing at it) and returns it."""
        if type(module) is not torch.nn.Linear:
            name = f"{type(module).__module__}.{type(module).__qualname__}"
            raise TypeError(f"ampfuse.fp8.Linear.from_linear: expected a torch.nn.Linear, got "
                            f"{name}; subclasses may change forward, so they are not converted.")
        recipe = cls._checked(module, recipe)  # before the class changes: no half conversion
        module.__class__ = cls
        # module is a cls now, which mypy cannot follow through the __class__ assignment.
        module._init_fp8(recipe)  # type: ignore[operator]
        return module  # type: ignore[return-value]

    @staticmethod
    def _checked(module: torch.nn.Linear, recipe: DelayedScaling | None) -> DelayedScaling:
        recipe = DelayedScaling() if recipe is None else recipe
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"ampfuse.fp8.Linear: recipe must be an ampfuse.fp8.DelayedScaling, "
                            f"got {type(recipe).__name__}.")
        bad = [f"{n}={v}" for n, v in (("in_features", module.in_features),
                                       ("out_features", module.out_features)) if v % ALIGN]
        if bad:
            raise ValueError(f"ampfuse.fp8.Linear: {', '.join(bad)} must be a multiple of "
                             f"{ALIGN} (cuBLASLt's FP8 GEMM rule); keep this layer an "
                             "nn.Linear or pad its features.")
        return recipe

    def _init_fp8(self, recipe: DelayedScaling | None) -> None:
        recipe = self._checked(self, recipe)
        self.fp8_recipe = recipe
        device = self.weight.device
        for role in ROLES:
            # Always fp32, whatever the model's dtype (see _apply).
            self.register_buffer(f"fp8_{role}_amax", torch.zeros(1, device=device))
            self.register_buffer(f"fp8_{role}_amax_history",
                                 torch.zeros(recipe.amax_history_len, device=device))
            self.register_buffer(f"fp8_{role}_scale", torch.ones(1, device=device))
            self.register_buffer(f"fp8_{role}_scale_inv", torch.ones(1, device=device))

    @property
    def fp32_buffers(self) -> tuple[str, ...]:
        """Buffers that amp's O2/O3 model cast leaves in fp32 (ampfuse.amp.casting)."""
        return tuple(n for n in self._buffers if n.startswith("fp8_"))

    def fp8_state(self, kind: str) -> list[torch.Tensor]:
        """The buffers of one kind ("amax", "amax_history", "scale", "scale_inv") per role."""
        return [getattr(self, f"fp8_{role}_{kind}") for role in ROLES]

    def fp8_maxes(self) -> list[float]:
        r = self.fp8_recipe
        # __post_init__ made the recipe's formats torch dtypes.
        return ([fp8_ops.FP8_MAX[r.fwd_format]] * 2  # type: ignore[index]
                + [fp8_ops.FP8_MAX[r.bwd_format]])  # type: ignore[index]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        # module.to(dtype) / .half() would round the scales and histories: the FP8 state
        # follows the module's device only, and stays fp32.
        names = [n for n in self._buffers if n.startswith("fp8_")]
        saved = {n: self._buffers.pop(n) for n in names}
        try:
            super()._apply(fn, recurse)
        finally:
            for n, t in saved.items():
                # (the fp8_ buffers are tensors, never None)
                self._buffers[n] = t.to(device=fn(t[:0]).device)  # type: ignore[union-attr,index]
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ampfuse.fp8.Linear: input has {x.shape[-1]} features in its "
                             f"last dimension, the layer takes {self.in_features}.")
        # In eval mode the casts record into scratch amaxes: evaluation data must not steer
        # the scales of the next training step.
        amax = (self.fp8_state("amax") if self.training
                else [torch.zeros(1, device=self.fp8_input_amax.device) for _ in ROLES])
        state = (amax, self.fp8_state("scale"), self.fp8_state("scale_inv"))
        r = self.fp8_recipe
        x2d = x.reshape(-1, self.in_features)
        out = _Fp8LinearFunction.apply(_pad_rows(x2d), self.weight, self.bias, state,
                                       r.fwd_format, r.bwd_format)
        return out[: x2d.shape[0]].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        r = self.fp8_recipe
        return (f"{super().extra_repr()}, margin={r.margin}, amax_history_len="
                f"{r.amax_history_len}, amax_compute={r.amax_compute!r}")

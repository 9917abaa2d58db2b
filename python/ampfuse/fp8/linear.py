"""ampfuse.fp8.Linear: nn.Linear whose three GEMMs (forward, dgrad, wgrad) run in FP8.

The recipe picks the autograd Function: current and delayed scaling (one scale per tensor)
run ampfuse.fp8.tensorwise, rowwise scaling ampfuse.fp8.rowwise. The weight's FP8 copies come
from the layer's WeightCache: made once per optimizer step, reused by every micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ampfuse.fp8 import fsdp_all_gather, rowwise, rowwise_gemm, tensorwise
from ampfuse.fp8.recipe import (
    CurrentScaling,
    DelayedScaling,
    Recipe,
    RowwiseScaling,
    checked_recipe,
)
from ampfuse.fp8.weight_cache import WeightCache
from ampfuse.ops import fp8 as fp8_ops

# The tensors of a layer that are cast to FP8, in the order of delayed scaling's state lists.
ROLES = ("input", "weight", "grad_output")
# cuBLASLt's FP8 GEMMs need every dimension to be a multiple of this.
ALIGN = 16


def _pad_rows(x2d: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of ALIGN (the wgrad GEMM's K is the row count): they add
    nothing to either GEMM, an amax or the bias gradient. Aligned inputs pass untouched."""
    extra = -x2d.shape[0] % ALIGN
    return F.pad(x2d, (0, 0, 0, extra)) if extra else x2d


def check_shape(module: torch.nn.Linear) -> None:
    bad = [f"{n}={v}" for n, v in (("in_features", module.in_features),
                                   ("out_features", module.out_features)) if v % ALIGN]
    if bad:
        raise ValueError(f"ampfuse.fp8.Linear: {', '.join(bad)} must be a multiple of "
                         f"{ALIGN} (cuBLASLt's FP8 GEMM rule); keep this layer an "
                         "nn.Linear or pad its features.")


def _is_fsdp_module(module: torch.nn.Module) -> bool:
    fsdp = getattr(torch.distributed, "fsdp", None)
    return fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ()))


def _plain_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                      local_metadata: Any) -> None:
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is None or value is module._parameters.get("weight"):
        return  # state_dict(keep_vars=True) asked for the live Parameter itself
    state_dict[key] = fsdp_all_gather.plain(value)


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` computing its GEMMs in FP8 (see the module docstring).

    in_features and out_features must be multiples of 16 (cuBLASLt's FP8 rule); any batch
    shape works (rows are padded internally when needed). recipe: CurrentScaling() (the
    default), RowwiseScaling() or DelayedScaling(). Only delayed scaling keeps state: fp32
    buffers ``fp8_{input,weight,grad_output}_{amax,amax_history,scale,scale_inv}`` that
    checkpoints carry, moved by ``ampfuse.fp8.update_scales(model)`` once per optimizer step
    (amp.initialize does it for you); in eval mode it uses the current scales and records
    nothing. With the other recipes the state_dict is exactly nn.Linear's.

    ``CurrentScaling(fsdp_fp8_all_gather=True)`` makes the weight an
    ``ampfuse.fp8.fsdp_all_gather.FP8AllGatherWeight`` Parameter (the same Parameter object),
    which FSDP2's ``fully_shard`` all-gathers as FP8 codes; outside FSDP2 it computes, trains,
    saves and loads exactly like the plain weight.
    """

    fp8_recipe: Recipe
    _fp8_weight_cache: WeightCache
    # Delayed scaling's state buffers (registered by _init_fp8), fp32 whatever the module's dtype.
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
                 recipe: Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe)

    @classmethod
    def from_linear(cls, module: torch.nn.Linear, recipe: Recipe | None = None) -> Linear:
        """Turns an nn.Linear into an fp8.Linear in place (same object, same Parameters, same
        hooks, so optimizers and wrappers keep pointing at it) and returns it."""
        if type(module) is not torch.nn.Linear:
            name = f"{type(module).__module__}.{type(module).__qualname__}"
            raise TypeError(f"ampfuse.fp8.Linear.from_linear: expected a torch.nn.Linear, got "
                            f"{name}; subclasses may change forward, so they are not converted.")
        recipe = checked_recipe(recipe, "ampfuse.fp8.Linear")  # before the class changes
        check_shape(module)
        module.__class__ = cls
        # module is a cls now, which mypy cannot follow through the __class__ assignment.
        module._init_fp8(recipe)  # type: ignore[operator]
        return module  # type: ignore[return-value]

    def _init_fp8(self, recipe: Recipe | None) -> None:
        recipe = checked_recipe(recipe, "ampfuse.fp8.Linear")
        check_shape(self)
        self.fp8_recipe = recipe
        self._fp8_weight_cache = WeightCache()
        if self._all_gathers_fp8():
            self._wrap_weight_if_needed()
            # The wrapper never reaches a checkpoint: state_dict holds the plain weight.
            self.register_state_dict_post_hook(_plain_state_dict)
        if not isinstance(recipe, DelayedScaling):
            return
        device = self.weight.device
        for role in ROLES:
            # Always fp32, whatever the model's dtype (see _apply).
            self.register_buffer(f"fp8_{role}_amax", torch.zeros(1, device=device))
            self.register_buffer(f"fp8_{role}_amax_history",
                                 torch.zeros(recipe.amax_history_len, device=device))
            self.register_buffer(f"fp8_{role}_scale", torch.ones(1, device=device))
            self.register_buffer(f"fp8_{role}_scale_inv", torch.ones(1, device=device))

    def _all_gathers_fp8(self) -> bool:
        r = self.fp8_recipe
        return isinstance(r, CurrentScaling) and r.fsdp_fp8_all_gather

    def _wrap_weight_if_needed(self) -> None:
        if self._all_gathers_fp8():
            fsdp_all_gather.wrap_weight(self.weight,
                                        self.fp8_recipe.fwd_format)  # type: ignore[arg-type]

    def invalidate(self) -> None:
        """Drops the cached FP8 weight: the next forward quantizes the weight again."""
        self._fp8_weight_cache.invalidate()

    @property
    def fp32_buffers(self) -> tuple[str, ...]:
        """Buffers that amp's O2/O3 model cast leaves in fp32 (ampfuse.amp.casting)."""
        return tuple(n for n in self._buffers if n.startswith("fp8_"))

    def fp8_state(self, kind: str) -> list[torch.Tensor]:
        """Delayed scaling: the buffers of one kind ("amax", "amax_history", "scale",
        "scale_inv") per role."""
        return [getattr(self, f"fp8_{role}_{kind}") for role in ROLES]

    def fp8_maxes(self) -> list[float]:
        r = self.fp8_recipe
        # __post_init__ made the recipe's formats torch dtypes.
        return ([fp8_ops.FP8_MAX[r.fwd_format]] * 2  # type: ignore[index]
                + [fp8_ops.FP8_MAX[r.bwd_format]])  # type: ignore[index]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        # module.to(dtype) / .half() would round the scales and histories: the FP8 state
        # follows the module's device only, and stays fp32.
        self.invalidate()
        names = [n for n in self._buffers if n.startswith("fp8_")]
        saved = {n: self._buffers.pop(n) for n in names}

        def keep_wrapper(t: torch.Tensor) -> torch.Tensor:
            # .to(dtype) of the FP8AllGatherWeight is a plain copy (as for an optimizer's
            # masters); the module's own weight stays wrapped, and the same Parameter.
            return fsdp_all_gather.wrapped_like(t, fn(t))

        try:
            super()._apply(keep_wrapper, recurse)
        finally:
            for n, t in saved.items():
                # (the fp8_ buffers are tensors, never None)
                self._buffers[n] = t.to(device=fn(t[:0]).device)  # type: ignore[union-attr,index]
        if isinstance(self.weight, fsdp_all_gather.FP8AllGatherWeight):
            fsdp_all_gather.mark_replaced(self.weight)
        return self

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.invalidate()
        super()._load_from_state_dict(*args, **kwargs)
        self._wrap_weight_if_needed()  # load_state_dict(assign=True) put a plain Parameter

    def _quantized_weight(self) -> Any:
        r = self.fp8_recipe
        if isinstance(self.weight, fsdp_all_gather.FP8GatheredWeight):
            # FSDP2 all-gathered the FP8 codes: nothing left to quantize.
            return self.weight.tensorwise_weight()
        cache = self._fp8_weight_cache
        if _is_fsdp_module(self):
            # fully_shard: the weight here is the all-gathered one, freed after the forward;
            # caching its FP8 copies would keep the whole layer's weight (2 bytes a param)
            # alive between micro-batches, undoing the sharding's memory saving.
            cache = WeightCache(enabled=False)
        if isinstance(r, RowwiseScaling):
            return cache.get(self.weight, rowwise.quantize_weight_rowwise)
        if isinstance(r, CurrentScaling):
            return cache.get(self.weight, lambda w: tensorwise.quantize_weight_current(
                w, r.fwd_format))  # type: ignore[arg-type]
        # Delayed: the weight's amax goes to its buffer in training mode only (eval records
        # nothing), so the mode is part of what the cached copy depends on.
        amax = (self.fp8_weight_amax if self.training
                else torch.zeros(1, device=self.fp8_weight_amax.device))
        return cache.get(self.weight, lambda w: tensorwise.quantize_weight_delayed(
            w, self.fp8_weight_scale, self.fp8_weight_scale_inv, amax,
            r.fwd_format), extra=self.training)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ampfuse.fp8.Linear: input has {x.shape[-1]} features in its "
                             f"last dimension, the layer takes {self.in_features}.")
        x2d = x.reshape(-1, self.in_features)
        padded = _pad_rows(x2d)
        wq = self._quantized_weight()
        r = self.fp8_recipe
        out: torch.Tensor
        if isinstance(r, RowwiseScaling):
            fast_accum = (r.fast_accum_fwd, r.fast_accum_bwd)
            backends = rowwise_gemm.backends_for(r.gemm_backend, padded, self.weight,
                                                 self.bias is not None, fast_accum)
            out = rowwise.RowwiseLinear.apply(padded, self.weight, self.bias, wq, fast_accum,
                                              backends)
        else:
            delayed = self._delayed_state() if isinstance(r, DelayedScaling) else None
            fast = isinstance(r, CurrentScaling)
            opts = tensorwise.Options(r.fwd_format, r.bwd_format,  # type: ignore[arg-type]
                                      fast and r.fast_accum_fwd,  # type: ignore[union-attr]
                                      fast and r.fast_accum_bwd)  # type: ignore[union-attr]
            out = tensorwise.TensorwiseLinear.apply(padded, self.weight, self.bias, wq,
                                                    delayed, opts)
        if padded.shape[0] != x2d.shape[0]:
            out = out[: x2d.shape[0]]
        return out.reshape(*x.shape[:-1], self.out_features)

    def _delayed_state(self) -> tensorwise.DelayedState:
        # In eval mode the casts record into scratch amaxes: evaluation data must not steer
        # the scales of the next training step.
        if self.training:
            x_amax, g_amax = self.fp8_input_amax, self.fp8_grad_output_amax
        else:
            x_amax, g_amax = (torch.zeros(1, device=self.fp8_input_amax.device) for _ in "xg")
        return tensorwise.DelayedState(self.fp8_input_scale, self.fp8_input_scale_inv, x_amax,
                                       self.fp8_grad_output_scale,
                                       self.fp8_grad_output_scale_inv, g_amax)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.fp8_recipe!r}"

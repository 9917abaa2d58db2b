"""FSDP2 all-gathers the FP8 codes of an fp8.Linear's weight (``CurrentScaling(
fsdp_fp8_all_gather=True)``), 1 byte per element instead of the weight's 2 or 4.

Two tensor subclasses carry it:

- ``FP8AllGatherWeight`` wraps the layer's high-precision weight from ``convert`` on. It behaves
  like the tensor inside it for every op (the op runs on the inner tensor and gives a plain
  tensor back), except the few ops FSDP2 shards with (views, ``new_zeros``, ``copy_``,
  ``clone``...), which keep the wrapper, so that FSDP2's sharded local tensor is one and carries
  ``fsdp_pre_all_gather``/``fsdp_post_all_gather``. Copies in another dtype or on another device
  (``p.float()``, an optimizer's master weights) and new tensors like it (``zeros_like``, an
  optimizer's moments) are plain tensors: outside FSDP2 nothing sees the wrapper.
- ``FP8GatheredWeight`` is FSDP2's unsharded weight: the gathered codes [n, k] and their
  scale_inv, with the weight's shape and dtype. fp8.Linear's forward takes its codes as they are;
  any other op reads the dequantized values (codes * scale_inv, the weight the FP8 GEMM sees),
  and an in-place write is an error.

Before the all-gather each rank takes the amax of its shard, all-reduces it with MAX over the
shard group (one one-element collective per weight), computes the scale with
``fp8_tensor_scale`` of that global amax (the same op and formula as the unsharded layer, so the
scale is bit for bit the one of the whole weight) and casts its shard with it: the cast is
elementwise, so the gathered codes are exactly the unsharded weight's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ampfuse.fp8.tensorwise import TensorwiseWeight

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+: for the type checker only, so 3.10 imports this

# The two tensor types; the functions below are fp8.Linear's helpers.
__all__ = ["FP8AllGatherWeight", "FP8GatheredWeight"]

_ops = torch.ops.ampfuse
_aten = torch.ops.aten

# Ops whose result stays an FP8AllGatherWeight: what FSDP2 shards and pads with (chunk and
# narrow decompose to split and slice), what .data, detach, deepcopy and CPU offload's pinning
# do. In-place ops give back the wrapper they wrote through (see __torch_dispatch__).
_KEEP_WRAPPER = frozenset({
    _aten.detach.default, _aten.alias.default, _aten.view.default, _aten._unsafe_view.default,
    _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default,
    _aten.as_strided.default, _aten.new_zeros.default, _aten.new_empty.default,
    _aten.clone.default, _aten._pin_memory.default,
})
# torch.Tensor's own .data (get: a detached alias; set: swap the tensor's contents).
_TENSOR_DATA: Any = torch._C.TensorBase.__dict__["data"]
# Ops on the gathered weight that need no values: FSDP2 makes its unsharded Parameter with them.
_GATHERED_VIEWS = frozenset({_aten.detach.default, _aten.alias.default,
                             _aten.as_strided.default, _aten.view.default})


def _wrapper_meta(like: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    return {"strides": like.stride(), "storage_offset": like.storage_offset(), "dtype": dtype,
            "layout": like.layout, "device": like.device, "requires_grad": False}


class FP8AllGatherWeight(torch.Tensor):
    """The high-precision weight of an fp8.Linear whose recipe all-gathers FP8 under FSDP2
    (see the module docstring). ``fp8_format``: the weight's FP8 dtype (the recipe's
    fwd_format)."""

    _inner: torch.Tensor
    fp8_format: torch.dtype
    # Results of ordinary torch functions stay plain: only __torch_dispatch__ decides.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, inner: torch.Tensor, fp8_format: torch.dtype) -> Self:
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), **_wrapper_meta(inner, inner.dtype))

    def __init__(self, inner: torch.Tensor, fp8_format: torch.dtype) -> None:
        if isinstance(inner, FP8AllGatherWeight) or inner.requires_grad:
            raise TypeError("ampfuse.fp8: an FP8AllGatherWeight wraps a plain tensor that "
                            "needs no grad (wrap weight.detach()).")
        self._inner = inner
        self.fp8_format = fp8_format

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FP8AllGatherWeight({self._inner!r}, fp8_format={self.fp8_format})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Iterable[type],  # type: ignore[override]
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                           ) -> Any:
        fp8_format = torch.float8_e4m3fn  # every wrapper in a call tells its own below
        wrappers: dict[int, FP8AllGatherWeight] = {}

        def unwrap(t: FP8AllGatherWeight) -> torch.Tensor:
            nonlocal fp8_format
            fp8_format = t.fp8_format
            wrappers[id(t._inner)] = t
            return t._inner

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            # An in-place op returns the tensor it wrote: give the wrapper back, not its inside.
            return pytree.tree_map_only(torch.Tensor, lambda t: wrappers.get(id(t), t), out)
        if func in _KEEP_WRAPPER:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, fp8_format), out)
        return out

    # torch.compile and nn.Module._apply's tensor swap see through it with these.
    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_inner"], self.fp8_format

    @staticmethod
    def __tensor_unflatten__(inner_tensors: dict[str, torch.Tensor], fp8_format: torch.dtype,
                             outer_size: Any, outer_stride: Any) -> FP8AllGatherWeight:
        return FP8AllGatherWeight(inner_tensors["_inner"], fp8_format)

    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # p.data = new (amp's model cast does it): the wrapper takes the new tensor inside it.
        if not isinstance(value, FP8AllGatherWeight):
            value = FP8AllGatherWeight(value.detach(), self.fp8_format)
        _TENSOR_DATA.__set__(self, value)
        self._inner = value._inner
        mark_replaced(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (torch.save of a whole module) as what it wraps, and wrapped again on load.
        return (_rebuild, (self._inner, self.fp8_format, self.requires_grad,
                           isinstance(self, torch.nn.Parameter)))

    # ---- FSDP2's all-gather extension (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size,
                            outer_stride: tuple[int, ...], module: torch.nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's shard cast to FP8 with the whole weight's scale, as uint8 (gloo and NCCL
        gather bytes), padded with zero rows to FSDP2's padded shard size; the metadata is the
        scale_inv."""
        shard = self._inner
        if tuple(shard.shape[1:]) != tuple(outer_size[1:]):
            raise NotImplementedError(
                f"ampfuse.fp8: fsdp_fp8_all_gather shards the weight by rows (FSDP2's default "
                f"Shard(0)); this shard is {tuple(shard.shape)} of {tuple(outer_size)}. Drop "
                "the shard_placement_fn for this weight or turn fsdp_fp8_all_gather off.")
        param_dtype = getattr(mp_policy, "param_dtype", None)
        if param_dtype is not None and param_dtype != shard.dtype:
            shard = shard.to(param_dtype)  # what the layer would see all-gathered
        group = mesh.get_group()
        amax, _, _ = _ops.fp8_tensor_scale(shard, self.fp8_format, 0.0)
        # A nan must win the MAX as it wins fp8_tensor_scale's amax; a collective's MAX may
        # drop it, inf does not, and fp8_tensor_scale gives inf the same nan scale.
        amax = torch.where(amax.isnan(), torch.full_like(amax, float("inf")), amax)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        _, scale, scale_inv = _ops.fp8_tensor_scale(amax, self.fp8_format, 0.0)
        codes = _ops.fp8_cast_amax(shard, scale, torch.zeros_like(amax), self.fp8_format)
        padded_rows = -(-outer_size[0] // mesh.size())  # torch.chunk's size, FSDP2's padding
        if codes.shape[0] != padded_rows:
            # Zero codes decode to 0.0 and are cut off after the gather.
            codes = torch.cat([codes, codes.new_zeros(padded_rows - codes.shape[0],
                                                      *codes.shape[1:])])
        return (codes.view(torch.uint8),), (scale_inv, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None,
                             ) -> tuple[FP8GatheredWeight, tuple[torch.Tensor, ...]] | None:
        """The gathered weight as an FP8GatheredWeight; with ``out`` (FSDP2's unsharded
        Parameter from an earlier gather, whose codes view the same all-gather buffer, refilled
        in place) only its scale_inv is replaced."""
        (gathered,) = all_gather_outputs
        scale_inv, size = metadata
        if scale_inv.is_cuda:
            # Made on FSDP2's copy-in stream, read by the forward on this one: its memory must
            # not be reused on the copy-in stream before this stream is done with it.
            scale_inv.record_stream(torch.cuda.current_stream(scale_inv.device))
        if out is not None:
            if not isinstance(out, FP8GatheredWeight):
                raise TypeError(f"ampfuse.fp8: FSDP2 passed out={type(out).__qualname__}, "
                                "expected the FP8GatheredWeight of an earlier all-gather.")
            out._scale_inv = scale_inv
            return None
        codes = gathered[: size[0]].view(self.fp8_format).view(size)
        return FP8GatheredWeight(codes, scale_inv, param_dtype), (gathered,)


def mark_replaced(weight: FP8AllGatherWeight) -> None:
    """Tells the caches keyed on (version, data_ptr) (the FP8 weight cache, master weights)
    that `weight` holds a new tensor: a wrapper's data_ptr is always 0 (it has no storage of
    its own; torch's deepcopy and checkpoint code rely on that), so its version moves."""
    torch.autograd.graph.increment_version(weight)


def _rebuild(inner: torch.Tensor, fp8_format: torch.dtype, requires_grad: bool,
             is_param: bool) -> torch.Tensor:
    wrapped = FP8AllGatherWeight(inner, fp8_format)
    return torch.nn.Parameter(wrapped, requires_grad) if is_param else wrapped


class FP8GatheredWeight(torch.Tensor):
    """FSDP2's unsharded weight of an fp8.Linear that all-gathers FP8: the codes [n, k] and
    scale_inv [1], standing for a weight of shape [n, k] and dtype ``dtype``."""

    _codes: torch.Tensor
    _scale_inv: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale_inv: torch.Tensor,
                dtype: torch.dtype) -> Self:
        return torch.Tensor._make_wrapper_subclass(
            cls, codes.size(), **_wrapper_meta(codes, dtype))

    def __init__(self, codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        self._codes = codes
        self._scale_inv = scale_inv

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"FP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={self._codes.dtype})")

    def tensorwise_weight(self) -> TensorwiseWeight:
        """The FP8 weight for TensorwiseLinear: the codes, their transpose and scale_inv."""
        return TensorwiseWeight(self._codes, _ops.fp8_transpose(self._codes), self._scale_inv)

    def dequantize(self) -> torch.Tensor:
        """The values the codes stand for (codes * scale_inv) in the weight's dtype."""
        return (self._codes.to(torch.float32) * self._scale_inv).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Iterable[type],  # type: ignore[override]
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                           ) -> Any:
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS:
            return _gathered_view(func, args, kwargs)
        if func._schema.is_mutable:
            raise RuntimeError(
                f"ampfuse.fp8: {func} writes into the all-gathered FP8 weight of an "
                "fp8.Linear under FSDP2 (CurrentScaling(fsdp_fp8_all_gather=True)), which holds "
                "FP8 codes, not the weight. Write the sharded parameter outside the forward, "
                "or turn fsdp_fp8_all_gather off.")
        # Any other use reads the weight's values: dequantize, never the raw codes.
        args, kwargs = pytree.tree_map_only(cls, FP8GatheredWeight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


def _gathered_view(func: Any, args: Any, kwargs: dict[str, Any]) -> FP8GatheredWeight:
    weight: FP8GatheredWeight = args[0]
    if func in (_aten.as_strided.default, _aten.view.default):
        size = list(args[1])
        stride = list(args[2]) if len(args) > 2 else None
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
        if (size != list(weight.shape) or (stride is not None and stride != list(weight.stride()))
                or offset not in (0, None)):
            raise RuntimeError(f"ampfuse.fp8: {func} with size {size} on the all-gathered FP8 "
                               f"weight {tuple(weight.shape)}: only the whole weight can be "
                               "viewed; call .dequantize() for its values.")
    return FP8GatheredWeight(weight._codes, weight._scale_inv, weight.dtype)


def wrap_weight(param: torch.Tensor, fp8_format: torch.dtype) -> None:
    """Makes `param` (in place: the same object, so optimizers keep it) an FP8AllGatherWeight
    Parameter, or, for FSDP2's sharded DTensor parameter (after ``load_state_dict(...,
    assign=True)`` of a sharded model), its local tensor one; a no-op where it is one."""
    if isinstance(param, FP8AllGatherWeight):
        return
    local = getattr(param, "_local_tensor", None)
    if local is not None:
        if type(local) is torch.Tensor:
            # FSDP2 itself swaps _local_tensor so (reset_sharded_param, after the load).
            param._local_tensor = FP8AllGatherWeight(  # type: ignore[attr-defined]
                local.detach(), fp8_format)
        return
    if type(param) not in (torch.Tensor, torch.nn.Parameter):
        return  # another subclass: not ours to change
    wrapped = torch.nn.Parameter(FP8AllGatherWeight(param.detach(), fp8_format),
                                 requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, wrapped)


def wrapped_like(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """`after` (what nn.Module._apply's function made of `before`: ``.to(dtype)``,
    ``to_empty``) wrapped again if `before` was an FP8AllGatherWeight, directly or as the local
    tensor of FSDP2's sharded DTensor (a model made on the meta device, sharded, then
    ``to_empty``)."""
    if isinstance(before, FP8AllGatherWeight) and type(after) is torch.Tensor:
        return FP8AllGatherWeight(after.detach(), before.fp8_format)
    local_before = getattr(before, "_local_tensor", None)
    local_after = getattr(after, "_local_tensor", None)
    if isinstance(local_before, FP8AllGatherWeight) and type(local_after) is torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = FP8AllGatherWeight(local_after.detach(), local_before.fp8_format)
        return DTensor(local, after._spec,  # type: ignore[attr-defined]
                       requires_grad=after.requires_grad)
    return after


def plain(value: torch.Tensor) -> torch.Tensor:
    """`value` with an FP8AllGatherWeight inside it (directly or as a DTensor's local tensor)
    replaced by the tensor it wraps: what a state_dict holds."""
    if isinstance(value, FP8AllGatherWeight):
        return value._inner
    local = getattr(value, "_local_tensor", None)
    if isinstance(local, FP8AllGatherWeight):
        from torch.distributed.tensor import DTensor

        return DTensor(local._inner, value._spec,  # type: ignore[attr-defined]
                       requires_grad=False)
    return value

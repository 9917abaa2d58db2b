"""The apex-compatible amp front end: change ``from apex import amp`` to
``from ampfuse import amp`` and the script runs.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Differences from apex, on purpose: no torch function or forward is replaced (O1 uses the
dispatcher's autocast, scoped to the model's forward by hooks); state lives in a handle attached
to the models and optimizers, so separately initialized models do not interfere; with ampfuse's
fused optimizers an overflowing step is skipped on the device with no host sync; fp32 master
weights are part of the checkpoint (amp.state_dict, or the fused optimizer's state_dict); bf16
is supported (the default on CPU); the dynamic loss scale has hysteresis and never leaves
[min_loss_scale, max_loss_scale]. Overflows are summarized at most once per 100 steps on rank 0
instead of printed every time, naming the gradients that overflowed most often, and
amp.last_overflow() says which gradients held inf/nan at the latest checked step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ampfuse.amp import casting, fp8_layers, per_op
from ampfuse.amp.apex_state import AmpStash, AmpStateView
from ampfuse.amp.casting import register_norm_type
from ampfuse.amp.handle import AmpHandle
from ampfuse.amp.initialize_checks import (
    ATTR,
    OptimizerLike,
    as_list,
    check_lists,
    check_models,
    check_optimizers,
    check_param_dtypes,
    low_dtype,
    model_device,
)
from ampfuse.amp.opt_levels import resolve
from ampfuse.amp.optimizer_access import hookable, optimizer_params
from ampfuse.amp.sharded import refuse_casting_sharded_models
from ampfuse.amp.registered import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampfuse.amp.registered import pending_lists as _pending_lists

if TYPE_CHECKING:
    from ampfuse.fp8 import Recipe
    from ampfuse.overflow import OverflowReport

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "skipped_steps", "last_overflow", "register_half_function", "register_float_function",
    "register_promote_function", "half_function", "float_function", "promote_function",
    "disable_casts", "register_norm_type",
]

# The latest enabled initialize, weakly held: what amp.state_dict() and load_state_dict()
# without an optimizer, and apex's amp._amp_state, refer to (apex: the latest initialize wins).
_latest: weakref.ref[AmpHandle] | None = None

# One model or optimizer, or a list or tuple of them, as amp.initialize and scale_loss take them.
_Models = torch.nn.Module | list[torch.nn.Module] | tuple[torch.nn.Module, ...]
_Optimizers = OptimizerLike | list[OptimizerLike] | tuple[OptimizerLike, ...]


def _latest_handle() -> AmpHandle | None:
    return None if _latest is None else _latest()


# apex's amp._amp_state, which scripts and trainers read (loss_scalers[0].loss_scale(), ...): a
# view of the latest initialize, holding no state of its own.
_amp_state = AmpStateView(_latest_handle)


def initialize(
    models: _Models,
    optimizers: _Optimizers | None = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | torch.Tensor | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = 2.0**24,
    dtype: torch.dtype | None = None,
    hysteresis: int = 1,
    custom_white_list: list[str] | tuple[str, ...] | set[str] | frozenset[str] | None = None,
    custom_black_list: list[str] | tuple[str, ...] | set[str] | frozenset[str] | None = None,
    growth_interval: int = 2000,
    all_reduce_found_inf: bool = False,
    process_group: torch.distributed.ProcessGroup | None = None,
    attribute_overflow: bool = True,
    fp8: bool | Recipe | None = False,
    fp8_module_filter: Callable[[str, torch.nn.Module], bool] | None = None,
    fp8_min_features: int | None = None,
    fp8_include: Collection[str] | None = None,
    fp8_exclude: Collection[str] | None = None,
) -> Any:
    """Sets models and optimizers up for mixed precision and returns them in the shapes given
    (a model or a list; an optimizer, a list, or nothing).

    apex's arguments keep apex's meaning. Also: dtype (torch.float16, the default on CUDA, or
    torch.bfloat16, the default on CPU), hysteresis (the dynamic scale backs off on the
    hysteresis-th overflow since the last change), growth_interval (clean steps before the
    dynamic scale doubles; apex fixes it at 2000), and custom_white_list / custom_black_list:
    names of torch functions (e.g. "matmul", "softmax"; each stands for the aten op of that
    name) that this model runs in the low dtype or in fp32 under O1, inside composite ops too;
    all_reduce_found_inf / process_group: the overflow flag is all-reduced (MAX) over the
    default group / this group before each skip decision, so ranks whose local gradients
    differ (DDP under no_sync, sharded gradients) skip together. With dtype=torch.bfloat16, O1
    and O2 default to loss_scale=1.0 (bad steps are still skipped); fp16 to "dynamic".
    attribute_overflow (default True): the unscale/check kernels also record which gradients
    held inf/nan, in the same pass, for amp.last_overflow() and the overflow summary; False
    turns that off.
    fp8: True (ampfuse.fp8.CurrentScaling()) or a recipe (ampfuse.fp8.CurrentScaling,
    RowwiseScaling or DelayedScaling), at O2 only: the nn.Linear layers large enough to gain
    compute their GEMMs in FP8 (see ampfuse.fp8.convert); fp8_module_filter(fqn, module),
    fp8_min_features, fp8_include and fp8_exclude override that choice as convert's
    module_filter, min_features, include and exclude do. verbosity >= 1 prints each Linear's
    decision and its reason.
    """
    global _latest
    model_list, models_were_list = as_list(models)
    optimizer_list, optimizers_were_list = as_list(optimizers)
    check_models(model_list)
    check_optimizers(optimizer_list)
    casting.check_custom_lists(custom_white_list, custom_black_list)
    device = model_device(model_list)
    low = low_dtype(dtype, device)
    # apex: False leaves the model's dtype alone at every level (None takes the level's own).
    leave_model_dtype = cast_model_type is False
    if leave_model_dtype:
        cast_model_type = None
    if cast_model_type is not None and cast_model_type not in (torch.float16, torch.bfloat16,
                                                               torch.float32):
        raise ValueError(f"amp.initialize: cast_model_type {cast_model_type} is not a float type.")
    props = resolve(opt_level, low, dict(
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs))
    if leave_model_dtype:
        # No model cast means no input or output casts either, unless outputs are asked for.
        props = dataclasses.replace(props, cast_model_type=None,
                                    cast_model_outputs=cast_model_outputs)
    if num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be >= 1, got {num_losses}.")
    if not isinstance(attribute_overflow, bool):
        raise ValueError(
            f"amp.initialize: attribute_overflow must be True or False, got "
            f"{attribute_overflow!r}."
        )
    fp8_layers.check_filter_options(fp8, fp8_module_filter=fp8_module_filter,
                                    fp8_min_features=fp8_min_features, fp8_include=fp8_include,
                                    fp8_exclude=fp8_exclude)
    fp8_recipe = fp8_layers.resolve(fp8, props.opt_level, device)
    if enabled:
        check_param_dtypes(model_list, props)
        refuse_casting_sharded_models(model_list, props.cast_model_type, props.opt_level)
        check_lists(props, custom_white_list, custom_black_list)
    handle = AmpHandle(props, low, device, num_losses, min_loss_scale, max_loss_scale,
                       hysteresis, verbosity, enabled=enabled, growth_interval=growth_interval,
                       all_reduce_found_inf=all_reduce_found_inf, process_group=process_group,
                       attribute_overflow=attribute_overflow)

    if enabled:
        originals = {}
        model_dtype = props.cast_model_type
        for model in model_list:
            handle.watch_no_sync(model)
            handle.name_model(model)
            if model_dtype in (torch.float16, torch.bfloat16):
                for p in model.parameters():
                    # A lazy param has no value yet; cast_model says what to do about it.
                    lazy = isinstance(p, torch.nn.parameter.UninitializedParameter)
                    if p.dtype == torch.float32 and not lazy:
                        originals[p] = p.detach().clone()
                keep_norms = bool(props.keep_batchnorm_fp32)
                handle.hooks += casting.cast_model(model, model_dtype, keep_norms)
                handle.hooks += casting.cast_model_io(model, model_dtype,
                                                      props.cast_model_outputs)
            elif model_dtype == torch.float32:
                model.float()
            elif props.master_weights:
                # cast_model_type=False: params the user made low precision get fp32 masters,
                # as apex gave them.
                originals.update((p, p.detach().float()) for p in model.parameters()
                                 if p.dtype in (torch.float16, torch.bfloat16))
            if (leave_model_dtype and props.cast_model_outputs is not None
                    and not props.patch_torch_functions):
                handle.hooks += casting.cast_model_io(model, None, props.cast_model_outputs)
            if props.patch_torch_functions:
                lists = casting.CastLists(
                    low=_pending_lists["low"] | set(custom_white_list or ()),
                    fp32=_pending_lists["fp32"] | set(custom_black_list or ()),
                    promote=_pending_lists["promote"])
                handle.hooks.append(casting.AutocastHooks(model, lists, low, device.type))
                if props.cast_model_outputs is not None:
                    handle.hooks += casting.cast_model_io(model, None, props.cast_model_outputs)
        if fp8_recipe is not None:
            fp8_layers.convert_linears(model_list, fp8_recipe, verbosity,
                                       module_filter=fp8_module_filter,
                                       min_features=fp8_min_features, include=fp8_include,
                                       exclude=fp8_exclude)
        # Only params that were actually cast down need fp32 masters.
        cast_down = {p: v for p, v in originals.items() if p.dtype != torch.float32}
        for optimizer in optimizer_list:
            binding = handle.bind(optimizer, cast_down)
            optimizer._amp_stash = AmpStash(binding)
        if cast_down:
            for model in model_list:
                handle.watch_model(model)
        if (fp8_recipe is not None and optimizer_list
                and fp8_layers.ScaleUpdates.needed(model_list)):
            handle.hooks.append(fp8_layers.ScaleUpdates(
                model_list, handle.binding_of(optimizer_list[0])))

    for obj in model_list + optimizer_list:
        setattr(obj, ATTR, handle)
    _latest = weakref.ref(handle)

    out_models = model_list if models_were_list else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (optimizer_list if optimizers_were_list else optimizer_list[0])


def init(*args: Any, **kwargs: Any) -> NoReturn:
    """apex's pre-1.0 API (``amp_handle = amp.init()``, then ``amp_handle.wrap_optimizer`` and
    ``amp_handle.scale_loss``), which patched torch's functions for the whole process. ampfuse
    patches nothing: it raises, naming the call that replaces it."""
    raise RuntimeError(
        "amp.init() is apex's pre-1.0 API, which patched torch's functions process-wide; "
        "ampfuse does not patch torch. Use amp.initialize(model, optimizer, opt_level=\"O1\") "
        "(what amp.init plus amp_handle.wrap_optimizer did) and amp.scale_loss(loss, optimizer)."
    )


def _handle_of(optimizers: Iterable[object]) -> AmpHandle:
    handles: dict[int, Any] = {id(getattr(o, ATTR, None)): getattr(o, ATTR, None)
                               for o in optimizers}
    if None in handles.values():
        raise RuntimeError(
            "amp.scale_loss: the optimizer was not passed to amp.initialize. Call "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) first."
        )
    if len(handles) != 1:
        raise RuntimeError("amp.scale_loss: the optimizers come from different amp.initialize "
                           "calls; scale each loss with the optimizers of one initialization.")
    return next(iter(handles.values()))


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers: _Optimizers, loss_id: int = 0,
               model: torch.nn.Module | None = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """Yields loss * loss_scale for backward(). On exit the gradients are checked for inf/nan
    and unscaled (or handed to the fused optimizer to unscale), the loss scale is updated,
    and an overflowing step is arranged to be skipped by the next optimizer.step().

    delay_unscale=True leaves the gradients scaled (gradient accumulation): only the last
    micro-batch's scale_loss before step() may unscale.
    """
    optimizer_list, _ = as_list(optimizers)
    handle = _handle_of(optimizer_list)
    if not handle.enabled:
        yield loss
        return
    if not 0 <= loss_id < len(handle.scalers):
        raise ValueError(
            f"amp.scale_loss: loss_id={loss_id}, but amp.initialize was given "
            f"num_losses={len(handle.scalers)}."
        )
    bindings = [handle.binding_of(o) for o in optimizer_list]
    scale = handle.before_backward(bindings, loss_id)
    yield loss.float() * scale.view(())
    handle.after_backward(bindings, loss_id, scale, delayed=bool(delay_unscale))


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Inside an O1 forward, runs the enclosed code with no casting at all (apex's
    amp.disable_casts): neither torch's autocast nor amp's function lists apply, so tensors
    keep the dtypes they have. Outside an O1 forward it changes nothing."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        # No policy set either, should the block enter torch.autocast itself; and functions
        # decorated with @amp.half_function & co. look at the stack of O1 forwards.
        active = per_op._active_stack()
        suspended = active[:]
        active.clear()
        previous_set = per_op.exchange_active_set(0)
        try:
            yield
        finally:
            per_op.exchange_active_set(previous_set)
            active[:] = suspended


def _handle_for(optimizer: object | None, what: str) -> AmpHandle:
    if optimizer is not None:
        handle = getattr(optimizer, ATTR, None)
        if handle is None:
            raise RuntimeError(f"amp.{what}: the optimizer was not passed to amp.initialize.")
        return handle
    handle = _latest_handle()
    if handle is None:
        raise RuntimeError(f"amp.{what}: call amp.initialize first.")
    return handle


def master_params(optimizer: OptimizerLike) -> Iterator[torch.Tensor]:
    """Yields the params the optimizer updates in fp32: the masters where amp or a fused
    optimizer keeps them, the params themselves elsewhere.

    Between scale_loss and step() their grads are unscaled, so apex's clipping recipe,
    clip_grad_norm_(amp.master_params(optimizer), max_norm), works. With a fused optimizer this
    costs one extra pass (fp32 grads are made for the masters), which is skipped when
    master_params is not called."""
    from ampfuse.optimizers import FusedOptimizer

    handle = getattr(optimizer, ATTR, None)
    if handle is not None and handle.enabled:
        handle.binding_of(optimizer).materialize_unscaled_grads()
    inner = hookable(optimizer)
    if isinstance(inner, FusedOptimizer):
        yield from inner.master_params()
        return
    yield from optimizer_params(optimizer)


def state_dict(optimizer: OptimizerLike | None = None,
               destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The amp state to checkpoint with the model's and the optimizer's: every loss scaler (under
    apex's keys, with apex's entries "loss_scale" and "unskipped" too) and the fp32 masters amp
    keeps for torch.optim optimizers at O2. Without an optimizer: the latest amp.initialize."""
    state = _handle_for(optimizer, "state_dict").state_dict()
    if destination is not None:
        destination.update(state)
        return destination
    return state


def load_state_dict(state: dict[str, Any], optimizer: OptimizerLike | None = None) -> None:
    """Restores amp.state_dict() (or a state apex wrote); call it after amp.initialize and after
    loading the model's and the optimizer's state. The whole state is checked first: a state
    that does not fit raises ValueError and changes nothing."""
    _handle_for(optimizer, "load_state_dict").load_state_dict(state)


def skipped_steps(optimizer: OptimizerLike | None = None) -> int:
    """How many steps were skipped for inf/nan gradients (reads device counters)."""
    return _handle_for(optimizer, "skipped_steps").skipped_steps()


def last_overflow(optimizer: OptimizerLike | None = None) -> OverflowReport | None:
    """None if the optimizer's latest checked step was clean, else an
    ampfuse.overflow.OverflowReport naming the gradients that held inf or nan by their
    module-qualified names ("encoder.layer3.fc1.weight"; "group0.param7" for a param no model
    given to amp.initialize holds). Its .step is the 0-based index of the optimizer step the
    overflow skipped (how many optimizer.step() calls came before it). The latest checked step
    is the one in progress if scale_loss checked the grads since the last optimizer.step(),
    else the last step. Reads device flags (a sync): call it on demand. Without an optimizer:
    the latest amp.initialize, which must have been given one optimizer."""
    return _handle_for(optimizer, "last_overflow").last_overflow(optimizer)

"""How amp changes the precision a model computes in, without replacing torch
functions or a model's forward:

- O1: forward hooks enter torch.autocast (the dispatcher's per-op casting) for the model's
  forward, together with a TorchFunctionMode, scoped to that forward, that enforces
  ampfuse's fp32 list and the model's custom lists (functions forced to fp32, to the low
  dtype, or promoted to their widest input).
- O2/O3: the model's parameters and buffers are cast to the low dtype except, when asked,
  normalization layers, which stay fp32 and get hooks that run them on fp32 inputs and
  hand low-precision outputs on.
- Inputs and outputs are cast at the model's boundary by forward hooks.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

NORM_TYPES = (
    torch.nn.modules.batchnorm._BatchNorm,  # BatchNorm1d/2d/3d and SyncBatchNorm
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)

# Functions O1 always runs in fp32, on every device: softmax, norms, reductions, exp/log/pow
# and losses, where low precision loses accuracy. (CUDA autocast already keeps most of them
# in fp32; CPU autocast leaves several in bf16, so this list makes both devices agree.)
FP32_FUNCTIONS = frozenset({
    "softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "batch_norm",
    "instance_norm", "rms_norm", "normalize", "norm", "exp", "expm1", "log", "log1p", "log2",
    "log10", "pow", "__pow__", "__rpow__", "sum", "mean", "prod", "cumsum", "cumprod",
    "logsumexp", "var", "std", "softplus", "cross_entropy", "nll_loss", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_similarity",
})

_active_modes = threading.local()


def _active_stack():
    if not hasattr(_active_modes, "stack"):
        _active_modes.stack = []
    return _active_modes.stack


def _cast_floats(value, dtype):
    """Casts every floating tensor inside nested lists/tuples/dicts to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        cast = [_cast_floats(v, dtype) for v in value]
        return type(value)(cast) if not hasattr(value, "_fields") else type(value)(*cast)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _widest_float(values):
    dtypes = set()

    def collect(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            dtypes.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)

    collect(values)
    if len(dtypes) < 2:
        return None
    return functools.reduce(torch.promote_types, dtypes)  # fp16 with bf16 gives fp32


class CastLists:
    """The function names one model casts: to the low dtype, to fp32, or to the widest input."""

    def __init__(self, low=(), fp32=(), promote=()):
        self.low = frozenset(low)
        self.fp32 = (FP32_FUNCTIONS | frozenset(fp32)) - self.low
        self.promote = frozenset(promote) - self.low - self.fp32


class CastMode(TorchFunctionMode):
    """Enforces a model's CastLists while its forward runs (O1)."""

    def __init__(self, lists: CastLists, low: torch.dtype, device_type: str):
        super().__init__()
        self.lists = lists
        self.low = low
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name in self.lists.fp32:
            target = torch.float32
        elif name in self.lists.low:
            target = self.low
        elif name in self.lists.promote:
            target = _widest_float((args, list(kwargs.values())))
            if target is None:
                return func(*args, **kwargs)
        else:
            return func(*args, **kwargs)
        # Autocast is switched off for this call so that it does not recast the inputs.
        with torch.autocast(self.device_type, enabled=False):
            return func(*_cast_floats(args, target), **_cast_floats(kwargs, target))


class AutocastHooks:
    """Forward hooks that run a model's forward under autocast and a CastMode (O1)."""

    def __init__(self, model, lists: CastLists, low: torch.dtype, device_type: str):
        self.low = low
        self.device_type = device_type
        self.lists = lists
        self._contexts = []  # one (autocast, mode) pair per forward in flight (re-entrancy)
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module, args):
        autocast = torch.autocast(self.device_type, dtype=self.low)
        mode = CastMode(self.lists, self.low, self.device_type)
        autocast.__enter__()
        mode.__enter__()
        _active_stack().append(mode)
        self._contexts.append((autocast, mode))

    def _exit(self, module, args, output):
        autocast, mode = self._contexts.pop()
        _active_stack().pop()
        mode.__exit__(None, None, None)
        autocast.__exit__(None, None, None)
        return output

    def remove(self):
        for handle in self._handles:
            handle.remove()


def cast_model(model: torch.nn.Module, dtype: torch.dtype, keep_norm_fp32: bool):
    """Casts floating parameters and buffers to `dtype` in place (the Parameter objects stay
    the same, so optimizers keep pointing at them). With keep_norm_fp32, normalization layers
    stay fp32 and get hooks that feed them fp32 inputs and hand `dtype` outputs on. Returns the
    hook handles."""
    handles = []
    for module in model.modules():
        if keep_norm_fp32 and isinstance(module, NORM_TYPES):
            handles.append(module.register_forward_pre_hook(
                lambda m, args: _cast_floats(args, torch.float32)))
            handles.append(module.register_forward_hook(
                lambda m, args, out, dtype=dtype: _cast_floats(out, dtype)))
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))
    return handles


def cast_model_io(model, input_dtype, output_dtype):
    """Hooks casting the model's floating inputs to input_dtype and outputs to output_dtype
    (either may be None)."""
    handles = []
    if input_dtype is not None:
        handles.append(model.register_forward_pre_hook(
            lambda m, args, kwargs: (_cast_floats(args, input_dtype),
                                     _cast_floats(kwargs, input_dtype)),
            with_kwargs=True))
    if output_dtype is not None:
        handles.append(model.register_forward_hook(
            lambda m, args, out: _cast_floats(out, output_dtype)))
    return handles


def cast_decorator(kind: str):
    """amp.half_function / float_function / promote_function: while an O1 forward is running,
    the decorated function's floating tensor arguments are cast to the low dtype, to fp32, or to
    the widest of them; outside one, it runs unchanged."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            stack = _active_stack()
            if not stack:
                return fn(*args, **kwargs)
            mode = stack[-1]
            if kind == "half":
                target = mode.low
            elif kind == "float":
                target = torch.float32
            else:
                target = _widest_float((args, list(kwargs.values())))
                if target is None:
                    return fn(*args, **kwargs)
            with torch.autocast(mode.device_type, enabled=False):
                return fn(*_cast_floats(args, target), **_cast_floats(kwargs, target))

        return wrapper

    return decorate

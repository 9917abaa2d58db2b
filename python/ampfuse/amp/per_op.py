"""O1: per-op casting inside a model's forward, with no torch function replaced.

Forward hooks enter torch.autocast (the dispatcher's per-op casting) for the model's forward,
together with a CastMode (a TorchFunctionMode) that enforces ampfuse's fp32 list and the
model's custom lists: functions forced to fp32, to the low dtype, or promoted to their widest
input. The mode also looks inside Python-level torch functions (composite.body_of), so the
lists hold for what F.multi_head_attention_forward and its like call, not only for the calls
written in the model's own code.
"""

from __future__ import annotations

import difflib
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

from ampfuse.amp.composite import body_of
from ampfuse.amp.tensor_casts import LOW_DTYPES, cast_floats, widest_float

# Functions O1 always runs in fp32, on every device: softmax, norms, reductions, exp/log/pow
# and losses, where low precision loses accuracy. (CUDA autocast already keeps most of them
# in fp32; CPU autocast leaves several in bf16, so this list makes both devices agree.)
# "cpu": a low-precision tensor copied to the host arrives as fp32, as in apex's O1.
FP32_FUNCTIONS = frozenset({
    "softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "batch_norm",
    "instance_norm", "rms_norm", "normalize", "norm", "exp", "expm1", "log", "log1p", "log2",
    "log10", "pow", "__pow__", "__rpow__", "sum", "mean", "prod", "cumsum", "cumprod",
    "logsumexp", "var", "std", "softplus", "cross_entropy", "nll_loss", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_similarity", "cpu",
})

# Python-level torch functions whose bodies are not forward computation: backward runs the
# autograd graph, which must not be recast by a forward's lists.
_NOT_ENTERED = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})

_active_modes = threading.local()


def _active_stack():
    if not hasattr(_active_modes, "stack"):
        _active_modes.stack = []
    return _active_modes.stack


def _inplace_base(name):
    """"exp" for "exp_"; None for a function that is not in place. (Operators such as x **= y
    reach a TorchFunctionMode under their method names, pow_.)"""
    if name.endswith("_") and not name.endswith("__"):
        return name[:-1]
    return None


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
        self._entered = []  # the Python torch functions whose bodies run now, outermost first

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None) or ""
        base = _inplace_base(name)
        if base is not None:
            # In place, the result keeps its tensor's dtype whatever the lists say.
            self._check_inplace(name, base, args)
            target = None
        elif name in self.lists.fp32:
            target = torch.float32
        elif name in self.lists.low:
            target = self.low
        elif name in self.lists.promote:
            target = widest_float((args, list(kwargs.values())))
        else:
            target = None
        if target is not None:
            return self._call_cast(func, args, kwargs, target)
        body = self._enterable_body(func, types)
        if body is None:
            return func(*args, **kwargs)
        # func is Python: run its body with this mode pushed again, so that the lists reach
        # the torch functions it calls.
        self._entered.append(func)
        try:
            with self:
                return body(*args, **kwargs)
        finally:
            self._entered.pop()

    def _enterable_body(self, func, types):
        if any(t is not torch.Tensor for t in types):
            return None  # a tensor subclass claims the call: leave it to its __torch_function__
        if func in _NOT_ENTERED or func in self._entered:
            # A body that reaches its own C implementation (Tensor.unflatten calls
            # super().unflatten()) comes back here with the same func: this time run it.
            return None
        return body_of(func)

    def _call_cast(self, func, args, kwargs, target):
        # `out=` is where the result goes: a cast copy of it would receive the result instead.
        kwargs = dict(kwargs)
        out = kwargs.pop("out", None)
        kwargs = cast_floats(kwargs, target)
        if out is not None:
            kwargs["out"] = out
        # Autocast is switched off for this call so that it does not recast the inputs.
        with torch.autocast(self.device_type, enabled=False):
            return func(*cast_floats(args, target), **kwargs)

    def _check_inplace(self, name, base, args):
        """An in-place op keeps its tensor's dtype, so one from the fp32 list cannot run in
        fp32 on a low-precision tensor; apex refused it, and so do we, rather than compute it
        in low precision behind the list's back."""
        if name not in self.lists.fp32 and base not in self.lists.fp32:
            return
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.dtype in LOW_DTYPES:
            raise NotImplementedError(
                f"amp O1: in-place {name}() on a {target.dtype} tensor. {base}() is on the fp32 "
                "list, so it runs in fp32, but an in-place op cannot change its tensor's dtype. "
                f"To fix, use the out-of-place {base}() (x = x.{base}(...)), which gives an fp32 "
                "result, or call it outside the model's forward."
            )


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
                target = widest_float((args, list(kwargs.values())))
                if target is None:
                    return fn(*args, **kwargs)
            with torch.autocast(mode.device_type, enabled=False):
                return fn(*cast_floats(args, target), **cast_floats(kwargs, target))

        return wrapper

    return decorate


# ---- checking custom lists ---------------------------------------------------------------------


@functools.cache
def _visible_names():
    """The names of every function CastMode can be handed: torch's overridable functions and
    Tensor methods (a custom list entry matches these by name)."""
    names = set()
    for funcs in torch.overrides.get_overridable_functions().values():
        names.update(getattr(f, "__name__", None) for f in funcs)
    names.discard(None)
    return frozenset(names)


def _entries(value, what):
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(
            f"amp.initialize: {what} must be a list of function names, e.g. "
            f"{what}=['softmax'], got {value!r}."
        )
    for entry in value:
        if not isinstance(entry, str):
            named = getattr(entry, "__name__", None)
            hint = f" Write its name instead: {named!r}." if named in _visible_names() else ""
            raise TypeError(
                f"amp.initialize: {what} entries are function names (strings); got {entry!r}."
                + hint
            )
    return list(value)


def check_custom_lists(white, black):
    """Checks amp.initialize's custom_white_list and custom_black_list: lists of names, each the
    name of a torch function or Tensor method (an entry that matches nothing would silently do
    nothing), and no name in both. Raises TypeError or ValueError naming the entry."""
    white_names = _entries(white, "custom_white_list")
    black_names = _entries(black, "custom_black_list")
    known = _visible_names()
    for what, names in (("custom_white_list", white_names), ("custom_black_list", black_names)):
        for name in names:
            if name in known:
                continue
            close = difflib.get_close_matches(name, known, n=3)
            hint = (f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else
                    " Entries are names as torch calls them, e.g. 'linear', 'matmul', 'softmax'.")
            raise ValueError(
                f"amp.initialize: {what} entry {name!r} is not the name of any torch function or "
                f"Tensor method, so it would never match anything.{hint}"
            )
    both = sorted(set(white_names) & set(black_names))
    if both:
        raise ValueError(
            f"amp.initialize: {both} in both custom_white_list and custom_black_list; a function "
            "runs either in the low dtype (white) or in fp32 (black), so keep each name in one."
        )

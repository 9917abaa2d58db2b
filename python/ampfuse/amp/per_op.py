"""O1: per-op casting inside a model's forward, in the dispatcher, with no torch function
replaced and no Python work per op.

A model's lists (ampfuse's fp32 list plus its custom lists, see aten_lists.py) become a policy
set in C++ (csrc/autocast/): kernels on the AutocastCPU/AutocastCUDA keys of exactly the listed
aten ops. The model's forward hooks enter torch.autocast and make the set active on the
calling thread; the kernels act only under it. Elsewhere (another model, a user's own
torch.autocast, no autocast at all) every op does exactly what torch does. Because the kernels
sit in the dispatcher, the lists hold inside composite functions (nn.MultiheadAttention's
projections and softmax) as well as in the model's own code.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import torch

from ampfuse.amp import aten_lists
from ampfuse.amp.aten_lists import FP32_FUNCTIONS
from ampfuse.amp.tensor_casts import cast_floats, widest_float

_active = threading.local()

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _active_stack() -> list[tuple[AutocastHooks, torch.autocast, int]]:
    """The O1 forwards running on this thread, innermost last: (hooks, autocast, set before)."""
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    return stack


def exchange_active_set(set_id: int) -> int:
    """Makes `set_id` (0: none) this thread's active policy set; returns the previous one."""
    return torch.ops.ampfuse.o1_exchange_active_set.default(set_id)


class CastLists:
    """The function names one model casts: to the low dtype, to fp32, or to the widest input."""

    def __init__(self, low: Iterable[str] = (), fp32: Iterable[str] = (),
                 promote: Iterable[str] = ()) -> None:
        self.low = frozenset(low)
        self.fp32 = (FP32_FUNCTIONS | frozenset(fp32)) - self.low
        self.promote = frozenset(promote) - self.low - self.fp32

    def policy_table(self) -> dict[str, str]:
        return aten_lists.policy_table(self.low, self.fp32, self.promote)


class PolicySet:
    """A model's lists registered in the dispatcher, released by release() or when this object
    is collected; ops no other set lists get torch's kernels back. A copy (copy.deepcopy of the
    model, as EMA helpers make, or pickling) registers a set of its own."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table
        self._register()

    def _register(self) -> None:
        ops = sorted(self.table)
        self.id = torch.ops.ampfuse.o1_policy_set_create(ops, [self.table[op] for op in ops])
        self._finalizer = weakref.finalize(self, torch.ops.ampfuse.o1_policy_set_release,
                                           self.id)
        self._finalizer.atexit = False  # the registrations go with the process

    def release(self) -> None:
        self._finalizer()  # runs once, whichever comes first

    def __getstate__(self) -> dict[str, Any]:
        return {"table": self.table}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.table = state["table"]
        self._register()


class AutocastHooks:
    """Forward hooks that run a model's forward under autocast with its policy set active."""

    def __init__(self, model: torch.nn.Module, lists: CastLists, low: torch.dtype,
                 device_type: str) -> None:
        self.low = low
        self.device_type = device_type
        self.lists = lists
        self.policy_set = PolicySet(lists.policy_table())
        # Released with the model, even while an optimizer still holds amp's handle.
        weakref.finalize(model, self.policy_set.release).atexit = False
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    # The hooks run eagerly under torch.compile (a graph break on each side of the forward):
    # autocast entered in one hook and left in another is not something dynamo can trace,
    # and the kernels read the set id when the compiled graph is traced.
    @torch._disable_dynamo
    def _enter(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        autocast = torch.autocast(self.device_type, dtype=self.low)
        autocast.__enter__()
        previous = exchange_active_set(self.policy_set.id)
        _active_stack().append((self, autocast, previous))

    @torch._disable_dynamo
    def _exit(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        stack = _active_stack()
        if not stack or stack[-1][0] is not self:
            return output  # a pre-hook before ours raised, so _enter never ran
        _, autocast, previous = stack.pop()
        exchange_active_set(previous)
        autocast.__exit__(None, None, None)
        return output

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.policy_set.release()


def cast_decorator(kind: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """amp.half_function / float_function / promote_function: while an O1 forward is running,
    the decorated function's floating tensor arguments are cast to the low dtype, to fp32, or to
    the widest of them; outside one, it runs unchanged."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            stack = _active_stack()
            if not stack:
                return fn(*args, **kwargs)
            hooks = stack[-1][0]
            target: torch.dtype | None
            if kind == "half":
                target = hooks.low
            elif kind == "float":
                target = torch.float32
            else:
                target = widest_float((args, list(kwargs.values())))
                if target is None:
                    return fn(*args, **kwargs)
            with torch.autocast(hooks.device_type, enabled=False):
                return fn(*cast_floats(args, target), **cast_floats(kwargs, target))

        return wrapper

    return decorate


check_custom_lists = aten_lists.check_custom_lists

"""The body of a Python-level torch function, to run with a TorchFunctionMode still pushed.

torch pops a TorchFunctionMode while its ``__torch_function__`` runs, so the torch functions
that a Python-level torch function calls are never seen by the mode: under O1,
``F.multi_head_attention_forward`` would run its ``F.linear`` and ``softmax`` calls past the
custom lists (pytorch/pytorch#131947). torch has no call that runs a function with the mode
pushed but without dispatching that same call to the mode again: the function starts by
asking ``has_torch_function(...)``, which is True while any mode is pushed.

``body_of(func)`` is a second function object made from func's own code, closure and defaults.
It reads func's module globals live, except the three ``has_torch_function*`` checks, which
answer False: it is func's implementation without its own dispatch step. Called with the mode
pushed, every torch function it calls is dispatched to the mode as usual. Nothing in torch is
changed; func itself still dispatches normally everywhere else.

Only functions that call those checks as module globals qualify, which is how torch's own
Python functions (``torch.nn.functional``, ``torch.functional``, Tensor's Python methods) are
written. For anything else (C functions, and functions that reach the checks some other way,
where a copy would dispatch to the mode again and recurse) body_of returns None, and the caller
runs the function as before, with the mode popped.
"""

from __future__ import annotations

import builtins
import dis
import threading
import types
import weakref

_DISPATCH_CHECKS = frozenset(
    {"has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"}
)
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _no_override(*args):
    return False


class _BodyGlobals(dict):
    """A module's globals as a body copy sees them: the dispatch checks answer False, every
    other name is looked up in the live module dict (so later changes to the module show)."""

    def __init__(self, live):
        super().__init__(dict.fromkeys(_DISPATCH_CHECKS, _no_override))
        self["__builtins__"] = live.get("__builtins__", builtins)
        self.live = live

    def __missing__(self, name):
        return self.live[name]


_lock = threading.Lock()
_bodies = weakref.WeakKeyDictionary()  # func -> its body copy, or None if it has none
_globals_of_module = {}  # id(module dict) -> _BodyGlobals; holds the dict, so ids stay unique


def _checks_dispatch_through_globals(code) -> bool:
    globals_read, attributes_read = set(), set()
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            globals_read.add(instruction.argval)
        elif instruction.opname in _ATTRIBUTE_OPS:
            attributes_read.add(instruction.argval)
    return bool(globals_read & _DISPATCH_CHECKS) and not attributes_read & _DISPATCH_CHECKS


def _make_body(func):
    if not _checks_dispatch_through_globals(func.__code__):
        return None
    live = func.__globals__
    body_globals = _globals_of_module.get(id(live))
    if body_globals is None:
        body_globals = _globals_of_module[id(live)] = _BodyGlobals(live)
    body = types.FunctionType(
        func.__code__, body_globals, func.__name__, func.__defaults__, func.__closure__
    )
    body.__kwdefaults__ = func.__kwdefaults__
    body.__qualname__ = func.__qualname__
    return body


def body_of(func):
    """func's implementation without its own __torch_function__ dispatch, or None (see the
    module docstring). Cached per function."""
    if type(func) is not types.FunctionType:
        return None
    try:
        return _bodies[func]
    except KeyError:
        pass
    with _lock:
        if func not in _bodies:
            _bodies[func] = _make_body(func)
        return _bodies[func]

"""The fused optimizers' host-side helpers (csrc/python/step_scan.cpp), or their pure-Python
stand-ins.

They are not ops: they touch no tensor data and never reach the dispatcher. They read Python
objects in one C++ pass where a Python loop over every param would cost a step its host time.
That needs CPython's full API and torch's Python bindings, so they live in a per-Python
extension, ``ampfuse.ops._step_scan``, which source builds (``make build``) add and the wheel,
built once for every Python, leaves out. Without it the stand-ins below decline every time and
the optimizers run the same checks in Python (``FusedOptimizer._calls``): the same results,
about 2.5 us more host time per param and step.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_native: ModuleType | None
try:
    # Imported by name at run time: it is optional, and absent from wheels.
    _native = importlib.import_module("ampfuse.ops._step_scan")
except ImportError:  # a wheel install, or an extension built for another Python or torch
    _native = None

NATIVE = _native is not None
"""Whether the C++ step scanner is in use (False: the Python path)."""


def _python_scan_step(params: Any, state_map: Any, entries: Any) -> None:
    """scan_step(params, state_map, entries) -> None: "take the Python path", always."""
    return None


def _python_mark_params(params: Any, records: Any) -> bool:
    """mark_params(params, records) -> False: "marked none, mark them in Python", always."""
    return False


scan_step = _python_scan_step if _native is None else _native.scan_step
mark_params = _python_mark_params if _native is None else _native.mark_params

"""The fused optimizers' host-side helpers from the native library (csrc/python/step_scan.cpp).

They are not ops: they touch no tensor data and never reach the dispatcher. They read Python
objects in one C++ pass where a Python loop over every param would cost a step its host time.
"""

from __future__ import annotations

from ampfuse.ops._library import native

scan_step = native.scan_step
mark_params = native.mark_params

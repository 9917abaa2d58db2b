// ampfuse.ops._step_scan's Python functions that speed up a fused optimizer's step (see
// step_scan.cpp).
#pragma once

#include <Python.h>

namespace ampfuse::python {

// The method table: scan_step and mark_params, ending with a null entry.
PyMethodDef* step_scan_methods();

}  // namespace ampfuse::python

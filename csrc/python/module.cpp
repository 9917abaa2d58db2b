// ampfuse.ops._step_scan: the fused optimizers' host-side step helpers
// (csrc/python/step_scan.cpp), built for one Python in source builds. The ops themselves live in
// libampfuse_ops.so, which uses no Python API; this module is optional, and without it
// ampfuse.ops.step_scan runs the same checks in Python.
#include <Python.h>

#include "step_scan.h"

PyMODINIT_FUNC PyInit__step_scan(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_step_scan", nullptr, -1,
                               ampfuse::python::step_scan_methods()};
  return PyModule_Create(&module);
}

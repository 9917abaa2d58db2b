// The Python module shell of ampfuse._C. Importing it runs the static registrations in
// registration.cpp: every op is reached through torch.ops.ampfuse, where torch.compile and
// opcheck can see it. Its own functions are host-side helpers of the fused optimizers' step
// loop (csrc/python/step_scan.cpp), not ops: they touch no tensor data.
#include <Python.h>

#include "python/step_scan.h"

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                               ampfuse::python::step_scan_methods()};
  return PyModule_Create(&module);
}

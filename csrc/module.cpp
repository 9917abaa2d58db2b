// The Python module shell of ampfuse._C. It has no functions: importing it runs
// the static registrations in registration.cpp, and every op is then reached
// through torch.ops.ampfuse, where torch.compile and opcheck can see it.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

// The per-param checks of a fused optimizer's step, in one C++ pass per param group.
//
// FusedOptimizer._calls (python/ampfuse/optimizers/_base.py) sorts a group's params into op
// calls and checks, for every param at every step, what may have changed since the last step:
// whether it has a grad, its state, whether someone else wrote it (its master then follows), its
// memory layout. Done in Python that is several attribute reads and two tensor-keyed dict lookups
// per param (Tensor.__hash__ is a Python function): about 2.5 us per param, more than the fused
// op itself takes on a CPU model of small tensors, and the host time a GPU step waits on.
//
// A group whose last step went through that Python loop keeps what it found (a _StepPlan,
// python/ampfuse/optimizers/_plan.py). scan_step() checks, here, that nothing it depends on
// changed and returns the grads; anything unexpected makes it return None and the Python loop
// runs instead, so this file only ever confirms the common case and decides nothing else.
#include "step_scan.h"

#include <Python.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace ampfuse::python {
namespace {

// A plain dense tensor: no Python subclass dispatch (DTensor and other wrappers keep the
// Python path, whose attribute reads they may override).
bool plain_tensor(PyObject* obj) {
  if (!THPVariable_Check(obj)) return false;
  return !THPVariable_Unpack(obj).unsafeGetTensorImpl()->is_python_dispatch();
}

// What param_mark(p) returns in Python: (p._version, p.data_ptr()). New reference.
PyObject* param_mark(const at::Tensor& t) {
  PyObject* version = PyLong_FromLongLong(static_cast<long long>(t._version()));
  PyObject* pointer = version == nullptr ? nullptr : PyLong_FromVoidPtr(t.data_ptr());
  PyObject* mark = pointer == nullptr ? nullptr : PyTuple_Pack(2, version, pointer);
  Py_XDECREF(version);
  Py_XDECREF(pointer);
  return mark;
}

// Whether `mark` (a param_mark tuple) still describes `t`.
bool mark_holds(PyObject* mark, const at::Tensor& t) {
  if (!PyTuple_Check(mark) || PyTuple_GET_SIZE(mark) != 2) return false;
  const long long version = PyLong_AsLongLong(PyTuple_GET_ITEM(mark, 0));
  const void* pointer = PyLong_AsVoidPtr(PyTuple_GET_ITEM(mark, 1));
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return version == static_cast<long long>(t._version()) && pointer == t.data_ptr();
}

// Whether `strides` (a tuple of ints, record.strides) equals t.stride().
bool strides_hold(PyObject* strides, const at::Tensor& t) {
  if (!PyTuple_Check(strides)) return false;
  const auto actual = t.strides();
  if (PyTuple_GET_SIZE(strides) != static_cast<Py_ssize_t>(actual.size())) return false;
  for (std::size_t d = 0; d < actual.size(); ++d) {
    const long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, static_cast<Py_ssize_t>(d)));
    if (s != actual[d]) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// The attribute `name` of `obj` (new reference), or nullptr with no error set.
PyObject* attribute(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) PyErr_Clear();
  return value;
}

// Whether every key of the tuple `keys` is (want = true) or is not (false) in dict `state`.
bool keys_are(PyObject* state, PyObject* keys, bool want) {
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); ++k) {
    const int found = PyDict_Contains(state, PyTuple_GET_ITEM(keys, k));
    if (found < 0) {
      PyErr_Clear();
      return false;
    }
    if ((found == 1) != want) return false;
  }
  return true;
}

// One stepping param's entry of the plan (see _plan.py for the tuple's layout):
// (param, state, step, record, dtype, follows, required_keys, absent_keys).
bool stepping_param_holds(PyObject* entry, PyObject* param, const at::Tensor& t,
                          const at::Tensor& grad, PyObject* state_map, PyObject* step_key,
                          PyObject* mark_name, PyObject* strides_name) {
  if (!grad.defined() || grad.layout() != at::kStrided) return false;
  if (reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())) !=
      PyTuple_GET_ITEM(entry, 4)) {
    return false;
  }
  PyObject* state = PyDict_GetItemWithError(state_map, param);  // borrowed
  if (state == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (state != PyTuple_GET_ITEM(entry, 1) || !PyDict_Check(state)) return false;
  PyObject* step = PyDict_GetItemWithError(state, step_key);  // borrowed
  if (step == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (step != PyTuple_GET_ITEM(entry, 2)) return false;
  if (!keys_are(state, PyTuple_GET_ITEM(entry, 6), true) ||
      !keys_are(state, PyTuple_GET_ITEM(entry, 7), false)) {
    return false;
  }
  PyObject* record = PyTuple_GET_ITEM(entry, 3);
  PyObject* strides = attribute(record, strides_name);
  if (strides == nullptr) return false;
  const bool same_strides = strides_hold(strides, t);
  Py_DECREF(strides);
  if (!same_strides) return false;
  if (PyTuple_GET_ITEM(entry, 5) != Py_True) return true;
  // A param with an extra tensor (an fp32 master, a kahan compensation, a split low half):
  // unchanged since its last step, else the extra tensor must follow it.
  PyObject* mark = attribute(record, mark_name);
  if (mark == nullptr) return false;
  const bool unchanged = mark == Py_None || mark_holds(mark, t);
  Py_DECREF(mark);
  return unchanged;
}

// Whether `param` still matches its plan entry: (param,) for a param that had no grad, the
// stepping tuple above for one that stepped. A stepping param's grad is appended to `grads`.
// Returns -1 with a Python error set only when appending fails.
int entry_holds(PyObject* entry, PyObject* param, PyObject* state_map, PyObject* grads) {
  static PyObject* step_key = PyUnicode_InternFromString("step");
  static PyObject* mark_name = PyUnicode_InternFromString("mark");
  static PyObject* strides_name = PyUnicode_InternFromString("strides");
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 1 || PyTuple_GET_ITEM(entry, 0) != param ||
      !plain_tensor(param)) {
    return 0;
  }
  const at::Tensor& t = THPVariable_Unpack(param);
  const at::Tensor& grad = t.grad();
  if (PyTuple_GET_SIZE(entry) == 1) return grad.defined() ? 0 : 1;
  try {
    if (PyTuple_GET_SIZE(entry) != 8 || !stepping_param_holds(entry, param, t, grad, state_map,
                                                              step_key, mark_name, strides_name)) {
      return 0;
    }
  } catch (const c10::Error&) {
    return 0;  // e.g. an inference tensor keeps no version: the Python loop reports it
  }
  PyObject* wrapped = THPVariable_Wrap(grad);
  if (wrapped == nullptr) return -1;
  const int status = PyList_Append(grads, wrapped);
  Py_DECREF(wrapped);
  return status < 0 ? -1 : 1;
}

// scan_step(params, state_map, entries) -> [grads] or None. `params` is the group's list,
// `entries` the plan's tuple with one entry per param (see entry_holds). Returns the grads of
// the stepping params in order when every param still matches its entry, else None.
PyObject* scan_step(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* params = nullptr;
  PyObject* state_map = nullptr;
  PyObject* entries = nullptr;
  if (!PyArg_ParseTuple(args, "OOO", &params, &state_map, &entries)) return nullptr;
  // Anything but torch.optim's own containers (a list of params, a dict of states) is left to
  // the Python loop, which knows what to do with it.
  if (!PyList_Check(params) || !PyDict_Check(state_map) || !PyTuple_Check(entries)) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t n = PyList_GET_SIZE(params);
  if (PyTuple_GET_SIZE(entries) != n) Py_RETURN_NONE;
  PyObject* grads = PyList_New(0);
  if (grads == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int holds =
        entry_holds(PyTuple_GET_ITEM(entries, i), PyList_GET_ITEM(params, i), state_map, grads);
    if (holds != 1) {
      Py_DECREF(grads);
      if (holds < 0) return nullptr;
      Py_RETURN_NONE;
    }
  }
  return grads;
  END_HANDLE_TH_ERRORS
}

// mark_params(params, records) -> bool: record.mark = param_mark(p) for each pair, as
// MasterWeightsMixin._mark_stepped does in Python. Returns False, having marked none, when a
// param is not a plain tensor (the caller then marks them in Python).
PyObject* mark_params(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* params = nullptr;
  PyObject* records = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &params, &PyList_Type, &records)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(params);
  if (PyList_GET_SIZE(records) != n) {
    PyErr_SetString(PyExc_ValueError, "ampfuse.ops._step_scan.mark_params: one record per param");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!plain_tensor(PyList_GET_ITEM(params, i))) Py_RETURN_FALSE;
  }
  static PyObject* mark_name = PyUnicode_InternFromString("mark");
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* mark = param_mark(THPVariable_Unpack(PyList_GET_ITEM(params, i)));
    if (mark == nullptr) return nullptr;
    const int status = PyObject_SetAttr(PyList_GET_ITEM(records, i), mark_name, mark);
    Py_DECREF(mark);
    if (status < 0) return nullptr;
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef kMethods[] = {
    {"scan_step", scan_step, METH_VARARGS,
     "scan_step(params, state_map, entries) -> list of grads, or None when the step plan no "
     "longer holds (see ampfuse.optimizers._plan)."},
    {"mark_params", mark_params, METH_VARARGS,
     "mark_params(params, records) -> bool: sets each record.mark to (p._version, "
     "p.data_ptr()); False, marking none, when a param is not a plain tensor."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMethodDef* step_scan_methods() { return kMethods; }

}  // namespace ampfuse::python

/* acompile's bridge to PyTorch's tensors, for the launcher (_launch.c).
 *
 * A launch reads every tensor argument's address. PyTorch's own way, `tensor.data_ptr()`, is a
 * Python method call that makes an int object: about 0.1 µs a tensor, the largest part of a
 * launch's host cost once the launcher is in C. Here the address is read as that method reads
 * it, from the tensor's C++ object, in a few nanoseconds.
 *
 * Built against the headers of the PyTorch installed (its structures change between versions),
 * into acompile's cache, keyed by PyTorch's version and build; `_launcher.py` builds and loads
 * it. Taken only where `data_ptr()` would do nothing else:
 * - a `torch.Tensor` or `torch.nn.Parameter` exactly (a subclass may define `data_ptr` or
 *   `__torch_function__`), with no torch function mode active (a mode sees every method call);
 * - a tensor whose address PyTorch gives without error (one with no storage raises).
 * Anything else is answered "not taken", and the launcher calls `data_ptr()` as before: the
 * same result or the same error, by the same path.
 */
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/PythonTorchFunctionTLS.h>

#include <cstdint>

namespace {

/* 0: *out is the tensor's address. 1: not taken (call data_ptr()). Never raises, never throws,
 * needs the GIL. */
int tensor_pointer(PyObject *obj, uint64_t *out) noexcept {
  if (!THPVariable_CheckExact(obj))
    return 1;
  try {
    if (at::impl::torch_function_mode_enabled())
      return 1;
    *out = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(THPVariable_Unpack(obj).data_ptr()));
  } catch (...) {
    return 1;
  }
  return 0;
}

/* tensor_pointer(obj) -> the address, or None where the launcher would call data_ptr(). For
 * tests: the launcher itself calls the C function through the capsule. */
PyObject *py_tensor_pointer(PyObject *, PyObject *obj) {
  uint64_t address = 0;
  if (tensor_pointer(obj, &address) != 0)
    Py_RETURN_NONE;
  return PyLong_FromUnsignedLongLong(address);
}

PyMethodDef methods[] = {
    {"tensor_pointer", py_tensor_pointer, METH_O,
     "tensor_pointer(obj): obj's address as data_ptr() gives it, or None where not taken"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_torch_bridge",
                          "acompile's bridge to PyTorch's tensors, for its launcher.", -1, methods};

} // namespace

PyMODINIT_FUNC PyInit__torch_bridge(void) {
  PyObject *m = PyModule_Create(&module_def);
  if (m == nullptr)
    return nullptr;
  /* The launcher takes the function through this capsule (its name is checked there). */
  PyObject *capsule = PyCapsule_New(reinterpret_cast<void *>(&tensor_pointer),
                                    "acompile._torch_bridge.tensor_pointer", nullptr);
  int failed = capsule == nullptr || PyModule_AddObjectRef(m, "TENSOR_POINTER", capsule) < 0 ||
               PyModule_AddIntConstant(m, "ABI", 1) < 0;
  Py_XDECREF(capsule);
  if (failed) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}

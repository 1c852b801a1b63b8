/* acompile's launcher for Triton kernels on CUDA.
 *
 * Triton's launcher takes, at every launch, the grid, the stream, the function, the kernel's
 * metadata, the launch hooks, the scratch buffers and every argument, parses them, and checks
 * the launch flags again; its Python half allocates scratch it rarely needs. Here everything
 * that cannot change between two launches of one kernel is read once, when the kernel is
 * loaded (`Kernel`), and a launch (`Kernel.bind` for a grid of ints; for a grid function, called
 * here with the arguments by name, a `Binder` made once by `Kernel.grid_function_binder`) takes
 * only the kernel's runtime arguments: a vectorcall, one pass over the arguments, cuLaunchKernelEx.
 *
 * Safety over speed where they meet:
 * - `Kernel` compares the parameter list the driver reports for the loaded function
 *   (cuFuncGetParamInfo) with the one this launcher would pass; any difference (another Triton
 *   version's ABI, an argument kind not handled here) refuses, and the caller keeps Triton's
 *   launcher. A driver too old to report it refuses too.
 * - A pointer argument that is not GPU memory (a CPU tensor) is an error naming the argument,
 *   as in Triton, never a launch that faults on the GPU.
 * - An integer that does not fit its parameter's type is an OverflowError, not a silent wrap.
 * - Anything this launcher does not take (an argument by name, a wrong count, an installed
 *   launch hook) goes to the Python launch function given to `bind` (or made by the function given
 *   to `grid_function_binder`), which behaves as before.
 *
 * The driver is opened with dlopen at the first `Kernel`: importing this module needs no GPU.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "cuda.h"

/* Not in every cuda.h yet; the values Triton's launcher uses. */
#ifndef CU_LAUNCH_ATTRIBUTE_SHARED_MEMORY_MODE
#define CU_LAUNCH_ATTRIBUTE_SHARED_MEMORY_MODE 18
#endif
#ifndef CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED_SHARED_MEMORY
#define CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED_SHARED_MEMORY 3
#endif

#define MAX_PARAMS 256

enum {
  ARG_POINTER = 0,
  ARG_I8, ARG_I16, ARG_I32, ARG_I64,
  ARG_U8, ARG_U16, ARG_U32, ARG_U64,
  ARG_FP16, ARG_BF16, ARG_FP32, ARG_FP64,
  ARG_KINDS
};

static const size_t arg_size[ARG_KINDS] = {8, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8};

typedef CUresult (*ctx_get_current_t)(CUcontext *);
typedef CUresult (*ctx_set_current_t)(CUcontext);
typedef CUresult (*device_get_t)(CUdevice *, int);
typedef CUresult (*primary_ctx_retain_t)(CUcontext *, CUdevice);
typedef CUresult (*launch_kernel_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*pointer_get_attribute_t)(void *, CUpointer_attribute, CUdeviceptr);
typedef CUresult (*func_get_param_info_t)(CUfunction, size_t, size_t *, size_t *);
typedef CUresult (*func_set_attribute_t)(CUfunction, CUfunction_attribute, int);
typedef CUresult (*get_error_string_t)(CUresult, const char **);

static struct {
  int loaded;
  ctx_get_current_t ctx_get_current;
  ctx_set_current_t ctx_set_current;
  device_get_t device_get;
  primary_ctx_retain_t primary_ctx_retain;
  launch_kernel_ex_t launch_kernel_ex;
  pointer_get_attribute_t pointer_get_attribute;
  func_get_param_info_t func_get_param_info; /* NULL before CUDA 12.4's driver */
  func_set_attribute_t func_set_attribute;
  get_error_string_t get_error_string;
} cu;

static PyObject *data_ptr_name, *stream_name, *enter_hook_name, *exit_hook_name, *calls_name;

static int load_driver(void) {
  if (cu.loaded)
    return 0;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    PyErr_Format(PyExc_RuntimeError, "cannot open the CUDA driver: %s", dlerror());
    return -1;
  }
#define LOAD(field, symbol)                                                              \
  cu.field = (void *)dlsym(lib, symbol);                                                 \
  if (cu.field == NULL) {                                                                \
    PyErr_Format(PyExc_RuntimeError, "the CUDA driver has no %s", symbol);              \
    return -1;                                                                           \
  }
  LOAD(ctx_get_current, "cuCtxGetCurrent");
  LOAD(ctx_set_current, "cuCtxSetCurrent");
  LOAD(device_get, "cuDeviceGet");
  LOAD(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
  LOAD(launch_kernel_ex, "cuLaunchKernelEx");
  LOAD(pointer_get_attribute, "cuPointerGetAttribute");
  LOAD(func_set_attribute, "cuFuncSetAttribute");
  LOAD(get_error_string, "cuGetErrorString");
#undef LOAD
  cu.func_get_param_info = (func_get_param_info_t)dlsym(lib, "cuFuncGetParamInfo");
  cu.loaded = 1;
  return 0;
}

static PyObject *cuda_error(CUresult status, const char *what) {
  const char *text = NULL;
  if (cu.get_error_string == NULL || cu.get_error_string(status, &text) != CUDA_SUCCESS || text == NULL)
    text = "unknown error";
  PyErr_Format(PyExc_RuntimeError, "%s failed: CUDA error %d: %s", what, (int)status, text);
  return NULL;
}

/* --- Kernel: one loaded function and what its launches share ------------------------------ */

/* The launch hooks as a launch last read them with none installed (see hooks_installed): each
 * one None, or a HookChain with no calls, and the versions of what getattr read them from. */
typedef struct {
  PyObject *hook;        /* None, or the HookChain */
  PyObject *dict;        /* the HookChain's own dict, where its `calls` is (NULL for None) */
  uint64_t dict_version;
  PyObject *calls;       /* its `calls`: an empty list then */
} KeptHook;

typedef struct {
  PyTypeObject *knobs_type; /* NULL: nothing kept */
  unsigned int knobs_type_version;
  PyObject *knobs_dict;     /* the knobs object's own dict */
  uint64_t knobs_dict_version;
  unsigned int chain_type_version;
  KeptHook hooks[2];        /* the enter hook, the exit hook */
} KeptHooks;

typedef struct {
  PyObject_HEAD
  CUfunction function;
  int device;
  PyObject *device_obj;   /* int: the argument of stream_of */
  PyObject *stream_of;    /* device -> the current stream, as an int */
  PyObject *knobs;        /* triton.knobs.runtime: the launch hooks are read at each launch */
  PyObject *chain_type;   /* triton.knobs.HookChain, or None */
  KeptHooks kept;         /* the hooks as last read with none installed */
  PyObject *tensor_type;  /* torch.Tensor, or None: whose pointers' allocations are remembered */
  PyObject *names;        /* tuple of str: the runtime arguments' names, for errors */
  Py_ssize_t nargs;       /* runtime arguments */
  Py_ssize_t nparams;     /* the function's parameters: the arguments, then null pointers */
  unsigned int block;
  unsigned int num_ctas;
  unsigned int shared;
  int cooperative;
  int pdl;
  unsigned char kinds[MAX_PARAMS];
} KernelObject;

static PyTypeObject KernelType;

static int kernel_traverse(KernelObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->device_obj);
  Py_VISIT(self->stream_of);
  Py_VISIT(self->knobs);
  Py_VISIT(self->chain_type);
  Py_VISIT(self->tensor_type);
  Py_VISIT(self->names);
  Py_VISIT(self->kept.knobs_type);
  Py_VISIT(self->kept.knobs_dict);
  for (int i = 0; i < 2; i++) {
    Py_VISIT(self->kept.hooks[i].hook);
    Py_VISIT(self->kept.hooks[i].dict);
    Py_VISIT(self->kept.hooks[i].calls);
  }
  return 0;
}

static void forget_hooks(KeptHooks *kept) {
  Py_CLEAR(kept->knobs_type);
  Py_CLEAR(kept->knobs_dict);
  for (int i = 0; i < 2; i++) {
    Py_CLEAR(kept->hooks[i].hook);
    Py_CLEAR(kept->hooks[i].dict);
    Py_CLEAR(kept->hooks[i].calls);
  }
}

static int kernel_clear(KernelObject *self) {
  forget_hooks(&self->kept);
  Py_CLEAR(self->device_obj);
  Py_CLEAR(self->stream_of);
  Py_CLEAR(self->knobs);
  Py_CLEAR(self->chain_type);
  Py_CLEAR(self->tensor_type);
  Py_CLEAR(self->names);
  return 0;
}

static void kernel_dealloc(KernelObject *self) {
  PyObject_GC_UnTrack(self);
  kernel_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Kernel(function, device, kinds, names, trailing_pointers, num_warps, num_ctas, shared,
 *        cooperative, pdl, stream_of, knobs, chain_type, tensor_type=None) */
static PyObject *kernel_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  unsigned long long function;
  int device, trailing, num_warps, num_ctas, shared, cooperative, pdl;
  Py_buffer kinds;
  PyObject *names, *stream_of, *knobs, *chain_type, *tensor_type = Py_None;
  static char *keywords[] = {"function", "device", "kinds", "names", "trailing_pointers",
                             "num_warps", "num_ctas", "shared", "cooperative", "pdl",
                             "stream_of", "knobs", "chain_type", "tensor_type", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Kiy*O!iiiippOOO|O", keywords, &function, &device,
                                   &kinds, &PyTuple_Type, &names, &trailing, &num_warps,
                                   &num_ctas, &shared, &cooperative, &pdl, &stream_of, &knobs,
                                   &chain_type, &tensor_type))
    return NULL;
  if (tensor_type != Py_None && !PyType_Check(tensor_type)) {
    PyBuffer_Release(&kinds);
    PyErr_SetString(PyExc_TypeError, "Kernel: tensor_type must be a type or None");
    return NULL;
  }
  Py_ssize_t nargs = kinds.len;
  const unsigned char *codes = kinds.buf;
  if (function == 0 || nargs != PyTuple_GET_SIZE(names) || trailing < 0 ||
      nargs + trailing > MAX_PARAMS || num_warps < 1 || num_warps > 32 || num_ctas < 1 ||
      shared < 0 || !PyCallable_Check(stream_of)) {
    PyBuffer_Release(&kinds);
    PyErr_SetString(PyExc_ValueError, "Kernel: an argument is out of range");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) {
    if (codes[i] >= ARG_KINDS) {
      PyBuffer_Release(&kinds);
      PyErr_Format(PyExc_ValueError, "Kernel: unknown argument kind %d", (int)codes[i]);
      return NULL;
    }
  }
  if (load_driver() < 0) {
    PyBuffer_Release(&kinds);
    return NULL;
  }
  /* The parameters the driver reports must be those this launcher passes, one for one. */
  if (cu.func_get_param_info == NULL) {
    PyBuffer_Release(&kinds);
    PyErr_SetString(PyExc_RuntimeError,
                    "this CUDA driver cannot report a kernel's parameters (cuFuncGetParamInfo)");
    return NULL;
  }
  Py_ssize_t nparams = nargs + trailing;
  for (Py_ssize_t i = 0; i <= nparams; i++) {
    size_t offset = 0, size = 0;
    CUresult status = cu.func_get_param_info((CUfunction)(uintptr_t)function, (size_t)i, &offset, &size);
    if (i == nparams) {
      if (status == CUDA_SUCCESS) {
        PyBuffer_Release(&kinds);
        PyErr_Format(PyExc_RuntimeError, "the kernel has more than %zd parameters", nparams);
        return NULL;
      }
      break;
    }
    size_t want = i < nargs ? arg_size[codes[i]] : sizeof(CUdeviceptr);
    if (status != CUDA_SUCCESS || size != want) {
      PyBuffer_Release(&kinds);
      if (status != CUDA_SUCCESS)
        return cuda_error(status, "cuFuncGetParamInfo");
      PyErr_Format(PyExc_RuntimeError, "parameter %zd of the kernel has %zu bytes, not %zu", i,
                   size, want);
      return NULL;
    }
  }
  if (num_ctas == 16) { /* as Triton's launcher: a cluster of 16 is non-portable (H100, B200) */
    CUresult status = cu.func_set_attribute((CUfunction)(uintptr_t)function,
                                            CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1);
    if (status != CUDA_SUCCESS) {
      PyBuffer_Release(&kinds);
      return cuda_error(status, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)");
    }
  }
  KernelObject *self = (KernelObject *)type->tp_alloc(type, 0);
  if (self == NULL) {
    PyBuffer_Release(&kinds);
    return NULL;
  }
  self->function = (CUfunction)(uintptr_t)function;
  self->device = device;
  self->device_obj = PyLong_FromLong(device);
  self->stream_of = Py_NewRef(stream_of);
  self->knobs = Py_NewRef(knobs);
  self->chain_type = Py_NewRef(chain_type);
  self->tensor_type = Py_NewRef(tensor_type);
  self->names = Py_NewRef(names);
  self->nargs = nargs;
  self->nparams = nparams;
  self->block = 32u * (unsigned)num_warps;
  self->num_ctas = (unsigned)num_ctas;
  self->shared = (unsigned)shared;
  self->cooperative = cooperative;
  self->pdl = pdl;
  memcpy(self->kinds, codes, (size_t)nargs);
  PyBuffer_Release(&kinds);
  if (self->device_obj == NULL) {
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static const char *arg_name(KernelObject *k, Py_ssize_t i) {
  const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(k->names, i));
  if (name == NULL) {
    PyErr_Clear();
    return "?";
  }
  return name;
}

/* GPU allocations a PyTorch tensor's pointer was found in, by the driver's check below: a
 * tensor's pointer inside one needs no check again. A tensor holds its memory while it lives,
 * and an address that was GPU memory in this process stays in the range the driver reserves
 * for the GPU (unified addressing): it is GPU memory again or nothing, never a CPU tensor's.
 * A bare int, or another object with data_ptr() (which may not hold its memory), is checked at
 * every launch: it may point into memory freed since, and the check says so where a launch would
 * fault. Read and written under the GIL. */
#define KNOWN_RANGES 16
static struct {
  uint64_t start, end;
} known_ranges[KNOWN_RANGES];
static unsigned int next_known_range;

static int in_known_range(uint64_t pointer) {
  for (unsigned int i = 0; i < KNOWN_RANGES; i++)
    if (pointer - known_ranges[i].start < known_ranges[i].end - known_ranges[i].start)
      return 1;
  return 0;
}

/* Remember the allocation a checked pointer is in (once per allocation: three driver calls).
 * GPU memory only: host memory the GPU can reach (pinned, registered) has the same address on
 * both sides too, but once freed its addresses may hold an ordinary CPU allocation. */
static void remember_range(uint64_t pointer) {
  CUdeviceptr start = 0;
  size_t size = 0;
  unsigned int memory_type = 0;
  if (cu.pointer_get_attribute(&memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)pointer) !=
          CUDA_SUCCESS ||
      memory_type != CU_MEMORYTYPE_DEVICE ||
      cu.pointer_get_attribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, (CUdeviceptr)pointer) !=
          CUDA_SUCCESS ||
      cu.pointer_get_attribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, (CUdeviceptr)pointer) !=
          CUDA_SUCCESS ||
      size == 0 || (uint64_t)start > pointer || pointer - (uint64_t)start >= size)
    return;
  unsigned int slot = next_known_range++ % KNOWN_RANGES;
  known_ranges[slot].start = (uint64_t)start;
  known_ranges[slot].end = (uint64_t)start + size;
}

/* PyTorch's tensor address read in C (acompile's bridge to PyTorch, `_torch_bridge.cpp`), set
 * by `use_tensor_pointer` once that is built: 0 with *out the address data_ptr() would return,
 * 1 where data_ptr() must be called instead (a subclass, a torch function mode, an error). NULL:
 * data_ptr() for every tensor. Read and written under the GIL. */
typedef int (*tensor_pointer_t)(PyObject *, uint64_t *);
static tensor_pointer_t tensor_pointer;
#define TENSOR_POINTER_CAPSULE "acompile._torch_bridge.tensor_pointer"

static int extract_pointer(KernelObject *k, Py_ssize_t i, PyObject *obj, uint64_t *out) {
  int tensor = 0;
  if (obj == Py_None) {
    *out = 0;
    return 0;
  }
  if (tensor_pointer != NULL && tensor_pointer(obj, out) == 0) {
    tensor = 1; /* exactly torch.Tensor (or Parameter): it holds its memory while it lives */
  } else if (PyLong_Check(obj)) {
    *out = PyLong_AsUnsignedLongLong(obj);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
      PyErr_Format(PyExc_OverflowError, "argument %s: a pointer must fit 64 bits", arg_name(k, i));
      return -1;
    }
  } else {
    PyObject *value = PyObject_CallMethodNoArgs(obj, data_ptr_name);
    if (value == NULL) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError,
                   "argument %s: a pointer parameter takes a tensor (anything with data_ptr()), "
                   "an int or None, got %.100s",
                   arg_name(k, i), Py_TYPE(obj)->tp_name);
      return -1;
    }
    if (!PyLong_Check(value)) {
      PyErr_Format(PyExc_TypeError, "argument %s: data_ptr() returned %.100s, not an int",
                   arg_name(k, i), Py_TYPE(value)->tp_name);
      Py_DECREF(value);
      return -1;
    }
    *out = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    if (*out == (uint64_t)-1 && PyErr_Occurred())
      return -1;
    tensor = k->tensor_type != Py_None && PyObject_TypeCheck(obj, (PyTypeObject *)k->tensor_type);
  }
  if (*out == 0 || (tensor && in_known_range(*out)))
    return 0;
  CUdeviceptr device_pointer;
  CUresult status = cu.pointer_get_attribute(&device_pointer, CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                             (CUdeviceptr)*out);
  if (status == CUDA_ERROR_INVALID_VALUE) {
    char address[32]; /* PyErr_Format has no %llx */
    snprintf(address, sizeof(address), "0x%llx", (unsigned long long)*out);
    PyErr_Format(PyExc_ValueError,
                 "argument %s: pointer %s is not memory the GPU can access (a CPU tensor?)",
                 arg_name(k, i), address);
    return -1;
  }
  if (status != CUDA_SUCCESS) {
    cuda_error(status, "cuPointerGetAttribute");
    return -1;
  }
  /* The same address on the GPU (unified addressing): its allocation needs no check again. */
  if (tensor && (uint64_t)device_pointer == *out)
    remember_range(*out);
  *out = (uint64_t)device_pointer;
  return 0;
}

static int extract_int(KernelObject *k, Py_ssize_t i, PyObject *obj, unsigned char kind, uint64_t *out) {
  if (kind >= ARG_U8 && kind <= ARG_U64) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
      if (PyErr_ExceptionMatches(PyExc_TypeError) && !PyLong_Check(obj)) {
        /* PyLong_AsUnsignedLongLong takes only ints: an object with __index__ goes through it */
        PyErr_Clear();
        PyObject *index = PyNumber_Index(obj);
        if (index == NULL)
          goto failed;
        v = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
          goto failed;
      } else {
        goto failed;
      }
    }
    unsigned long long limit = kind == ARG_U8 ? 0xffull : kind == ARG_U16 ? 0xffffull
                             : kind == ARG_U32 ? 0xffffffffull : ~0ull;
    if (v > limit)
      goto overflow;
    *out = v; /* little-endian: the parameter's bytes are the low ones, the rest zero */
    return 0;
  }
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred())
    goto failed;
  long long low = kind == ARG_I8 ? INT8_MIN : kind == ARG_I16 ? INT16_MIN : kind == ARG_I32 ? INT32_MIN : INT64_MIN;
  long long high = kind == ARG_I8 ? INT8_MAX : kind == ARG_I16 ? INT16_MAX : kind == ARG_I32 ? INT32_MAX : INT64_MAX;
  if (v < low || v > high)
    goto overflow;
  /* Its low bytes, as memcpy of the parameter's size into a zeroed value would leave them, in a
   * register (a memcpy of a size known only here is a call to libc's). */
  *out = (uint64_t)v & (kind == ARG_I8 ? 0xffull : kind == ARG_I16 ? 0xffffull
                        : kind == ARG_I32 ? 0xffffffffull : ~0ull);
  return 0;
failed: /* our message for a wrong type or size; any other error (an interrupt) as it is */
  if (PyErr_ExceptionMatches(PyExc_OverflowError))
    goto overflow;
  if (!PyErr_ExceptionMatches(PyExc_TypeError))
    return -1;
  PyErr_Clear();
  PyErr_Format(PyExc_TypeError, "argument %s: an integer parameter takes an int, got %.100s",
               arg_name(k, i), Py_TYPE(obj)->tp_name);
  return -1;
overflow:
  PyErr_Clear();
  {
    static const char *type_names[ARG_KINDS] = {"*", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"};
    PyErr_Format(PyExc_OverflowError, "argument %s: %R does not fit the kernel's %s parameter",
                 arg_name(k, i), obj, type_names[kind]);
  }
  return -1;
}

static int extract_float(KernelObject *k, Py_ssize_t i, PyObject *obj, unsigned char kind, uint64_t *out) {
  double v = PyFloat_AsDouble(obj);
  if (v == -1.0 && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError))
      return -1; /* an interrupt, a tensor's own error: as it is */
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "argument %s: a float parameter takes a number, got %.100s",
                 arg_name(k, i), Py_TYPE(obj)->tp_name);
    return -1;
  }
  *out = 0;
  if (kind == ARG_FP64) {
    memcpy(out, &v, 8);
  } else if (kind == ARG_FP32) {
    float f = (float)v;
    memcpy(out, &f, 4);
  } else if (kind == ARG_BF16) {
    /* As Triton's launcher: the float's high half. */
    float f = (float)v;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t half = (uint16_t)(bits >> 16);
    memcpy(out, &half, 2);
  } else {
#if PY_VERSION_HEX < 0x030B0000
    if (_PyFloat_Pack2(v, (unsigned char *)out, 1) < 0)
      return -1;
#else
    if (PyFloat_Pack2(v, (char *)out, 1) < 0)
      return -1;
#endif
  }
  return 0;
}

static int hook_installed(KernelObject *k, PyObject *name) {
  PyObject *hook = PyObject_GetAttr(k->knobs, name);
  if (hook == NULL)
    return -1;
  int installed = hook != Py_None;
  if (installed && (PyObject *)Py_TYPE(hook) == k->chain_type) {
    PyObject *calls = PyObject_GetAttr(hook, calls_name);
    if (calls == NULL) {
      Py_DECREF(hook);
      return -1;
    }
    Py_ssize_t n = PyObject_Length(calls);
    Py_DECREF(calls);
    installed = n != 0; /* -1 (an error) counts as installed: the Python path will say */
    PyErr_Clear();
  }
  Py_DECREF(hook);
  return installed;
}

/* Whether a launch hook is installed (1; -1 with an error set): hook_installed for each hook.
 *
 * Read so, that is four generic look-ups a launch (each hook, then its HookChain's `calls`),
 * some 50 ns. Their answer depends only on the knobs' class and own dict, each hook's class and
 * own dict, and each `calls` list, and CPython versions classes and dicts: a class's version tag
 * changes whenever it or a base does (CPython's attribute cache relies on it), a dict's version
 * (PEP 509) whenever the dict does. So once a launch finds no hook installed, and the objects are
 * plain ones (the generic getattr, each hook the knobs' own attribute or its class's, None or a
 * HookChain, no descriptor on the way), what the reads went through is kept with those versions
 * (keep_hooks), and the next launches compare the versions and the lists' lengths
 * (kept_hooks_current), a few nanoseconds: a hook installed, or any of those objects changed,
 * is a difference, and the hooks are read again as above.
 *
 * CPython 3.10 to 3.12 only: from 3.13 an object's attribute can change without a new version of
 * its dict (where the dict shares the object's inline values), and 3.14 drops dicts' versions;
 * nor on a free-threaded build. Every launch reads the hooks there. */
#if PY_VERSION_HEX < 0x030D0000 && !defined(Py_GIL_DISABLED)
#define KEEP_HOOKS 1
#else
#define KEEP_HOOKS 0
#endif

#if KEEP_HOOKS
static int type_version_current(PyTypeObject *type, unsigned int version) {
  return PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) && version != 0 &&
         type->tp_version_tag == version;
}

static uint64_t dict_version(PyObject *dict) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations" /* deprecated in 3.12, still kept */
  return ((PyDictObject *)dict)->ma_version_tag;
#pragma GCC diagnostic pop
}

/* Whether obj's own dict is still `dict`, at `version`. */
static int dict_current(PyObject *obj, PyObject *dict, uint64_t version) {
  PyObject *now = PyObject_GenericGetDict(obj, NULL);
  if (now == NULL) {
    PyErr_Clear();
    return 0;
  }
  Py_DECREF(now); /* obj holds it */
  return now == dict && dict_version(dict) == version;
}

static int kept_hooks_current(KernelObject *k) {
  KeptHooks *kept = &k->kept;
  if (Py_TYPE(k->knobs) != kept->knobs_type ||
      !type_version_current(kept->knobs_type, kept->knobs_type_version) ||
      !dict_current(k->knobs, kept->knobs_dict, kept->knobs_dict_version))
    return 0;
  for (int i = 0; i < 2; i++) {
    KeptHook *h = &kept->hooks[i];
    if (h->hook != Py_None &&
        ((PyObject *)Py_TYPE(h->hook) != k->chain_type ||
         !type_version_current((PyTypeObject *)k->chain_type, kept->chain_type_version) ||
         !dict_current(h->hook, h->dict, h->dict_version) || PyList_GET_SIZE(h->calls) != 0))
      return 0;
  }
  return 1;
}

/* obj.name (a new reference) as the generic getattr reads it, `dict` being obj's own dict, where
 * the class's attribute of that name, if any, is None or a `chain` (the caller checks that it is
 * no descriptor): the dict's entry, else the class's. NULL otherwise, or where there is neither. */
static PyObject *plain_attribute(PyObject *obj, PyObject *dict, PyObject *name, PyTypeObject *chain) {
  PyObject *of_class = _PyType_Lookup(Py_TYPE(obj), name);
  if (of_class != NULL && of_class != Py_None && (chain == NULL || Py_TYPE(of_class) != chain))
    return NULL;
  Py_XINCREF(of_class); /* the dict's look-up may run Python code */
  PyObject *own = PyDict_GetItemWithError(dict, name);
  if (own != NULL) {
    Py_XDECREF(of_class);
    return Py_NewRef(own);
  }
  if (PyErr_Occurred())
    Py_CLEAR(of_class);
  return of_class;
}

/* Called when the launch's reads found no hook installed: keep what they went through, with its
 * versions, where all of it is plain (see above); else keep nothing. */
static void keep_hooks(KernelObject *k) {
  PyObject *knobs = k->knobs, *names[2] = {enter_hook_name, exit_hook_name};
  PyTypeObject *type = Py_TYPE(knobs);
  PyTypeObject *chain = PyType_Check(k->chain_type) ? (PyTypeObject *)k->chain_type : NULL;
  forget_hooks(&k->kept);
  if (type->tp_getattro != PyObject_GenericGetAttr || type->tp_dictoffset == 0)
    return;
  if (chain != NULL && (chain->tp_getattro != PyObject_GenericGetAttr || chain->tp_dictoffset == 0 ||
                        chain->tp_descr_get != NULL))
    chain = NULL; /* a HookChain would not be a plain attribute, or its `calls` not one */
  /* Each version is taken before the look-ups that depend on it: one that runs Python code (a
   * dict key other than a str, compared with the name) and changes what it reads leaves a version
   * that the next launch finds out of date. A class gets its version tag at its first look-up. */
  (void)_PyType_Lookup(type, names[0]);
  if (chain != NULL)
    (void)_PyType_Lookup(chain, calls_name);
  if (!type_version_current(type, type->tp_version_tag) ||
      (chain != NULL && !type_version_current(chain, chain->tp_version_tag)))
    return; /* no version: a class changed too often */
  KeptHooks fresh;
  memset(&fresh, 0, sizeof(fresh));
  fresh.knobs_type = (PyTypeObject *)Py_NewRef((PyObject *)type);
  fresh.knobs_type_version = type->tp_version_tag;
  fresh.chain_type_version = chain != NULL ? chain->tp_version_tag : 0;
  fresh.knobs_dict = PyObject_GenericGetDict(knobs, NULL);
  if (fresh.knobs_dict == NULL || !PyDict_CheckExact(fresh.knobs_dict))
    goto nothing;
  fresh.knobs_dict_version = dict_version(fresh.knobs_dict);
  for (int i = 0; i < 2; i++) {
    KeptHook *h = &fresh.hooks[i];
    PyObject *hook = h->hook = plain_attribute(knobs, fresh.knobs_dict, names[i], chain);
    if (hook == NULL || (hook != Py_None && (chain == NULL || Py_TYPE(hook) != chain)))
      goto nothing;
    if (hook == Py_None)
      continue;
    h->dict = PyObject_GenericGetDict(hook, NULL);
    if (h->dict == NULL || !PyDict_CheckExact(h->dict))
      goto nothing;
    h->dict_version = dict_version(h->dict);
    if (_PyType_Lookup(chain, calls_name) != NULL) /* `calls` must be the chain's own */
      goto nothing;
    PyObject *calls = PyDict_GetItemWithError(h->dict, calls_name);
    if (calls == NULL || !PyList_CheckExact(calls) || PyList_GET_SIZE(calls) != 0)
      goto nothing;
    h->calls = Py_NewRef(calls);
  }
  forget_hooks(&k->kept); /* what a launch made from Python code run above kept, if any */
  k->kept = fresh;
  return;
nothing:
  PyErr_Clear();
  forget_hooks(&fresh);
}
#endif

static int hooks_installed(KernelObject *k) {
#if KEEP_HOOKS
  if (k->kept.knobs_type != NULL && kept_hooks_current(k))
    return 0;
#endif
  int installed = hook_installed(k, enter_hook_name);
  if (installed == 0)
    installed = hook_installed(k, exit_hook_name);
#if KEEP_HOOKS
  if (installed == 0)
    keep_hooks(k);
  else
    forget_hooks(&k->kept);
#endif
  return installed;
}

static int grid_dimension(PyObject *value, unsigned int *out, const char *axis) {
  int overflow;
  long v = PyLong_AsLongAndOverflow(value, &overflow);
  if (v == -1 && PyErr_Occurred())
    return -1;
  if (overflow) { /* an int past a C long: out of range as well, said so by name */
    PyErr_Format(PyExc_ValueError, "grid %s dimension %S is out of range", axis, value);
    return -1;
  }
  if (v < 0 || v > 0x7fffffffL) {
    PyErr_Format(PyExc_ValueError, "grid %s dimension %ld is out of range", axis, v);
    return -1;
  }
  *out = (unsigned int)v;
  return 0;
}

/* The stream a launch goes to: the one given, or the current stream of the kernel's device. */
static int stream_for(KernelObject *k, PyObject *stream_obj, CUstream *stream) {
  unsigned long long handle;
  if (stream_obj == NULL || stream_obj == Py_None) {
    PyObject *current = PyObject_CallOneArg(k->stream_of, k->device_obj);
    if (current == NULL)
      return -1;
    handle = PyLong_AsUnsignedLongLong(current);
    Py_DECREF(current);
  } else {
    handle = PyLong_AsUnsignedLongLong(stream_obj);
  }
  *stream = (CUstream)(uintptr_t)handle;
  if (handle == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_SetString(PyExc_TypeError, "stream must be a CUDA stream handle (an int), or None");
    return -1;
  }
  return 0;
}

/* As Triton's launcher: a thread with no current context gets the device's primary one. */
static int make_context_current(KernelObject *k) {
  CUcontext context = NULL;
  CUresult status = cu.ctx_get_current(&context);
  if (status == CUDA_SUCCESS && context == NULL) {
    CUdevice device;
    status = cu.device_get(&device, k->device);
    if (status == CUDA_SUCCESS)
      status = cu.primary_ctx_retain(&context, device);
    if (status == CUDA_SUCCESS)
      status = cu.ctx_set_current(context);
  }
  if (status != CUDA_SUCCESS) {
    cuda_error(status, "making the kernel's CUDA context current");
    return -1;
  }
  return 0;
}

/* Every runtime argument packed as the driver takes it (values[i], pointed to by params[i]),
 * then a null pointer for each trailing scratch parameter. */
static int pack(KernelObject *k, PyObject *const *args, uint64_t *values, void **params) {
  Py_ssize_t i = 0;
  for (; i < k->nargs; i++) {
    unsigned char kind = k->kinds[i];
    int failed;
    if (kind == ARG_POINTER)
      failed = extract_pointer(k, i, args[i], &values[i]);
    else if (kind <= ARG_U64)
      failed = extract_int(k, i, args[i], kind, &values[i]);
    else
      failed = extract_float(k, i, args[i], kind, &values[i]);
    if (failed)
      return -1;
    params[i] = &values[i];
  }
  for (; i < k->nparams; i++) { /* scratch buffers: none (the kernel needs none) */
    values[i] = 0;
    params[i] = &values[i];
  }
  return 0;
}

/* The launch's configuration: the grid, the block, shared memory and the launch attributes
 * (attributes: room for 5). A grid whose x dimension, counted in CTAs (x times the CTAs of a
 * cluster), does not fit the driver's is a ValueError, never a smaller grid. */
static int configure(KernelObject *k, unsigned int gx, unsigned int gy, unsigned int gz,
                     CUstream stream, CUlaunchConfig *out, CUlaunchAttribute *attributes) {
  if ((unsigned long long)gx * k->num_ctas > 0x7fffffffULL) {
    PyErr_Format(PyExc_ValueError, "grid x dimension %u is out of range for clusters of %u CTAs", gx,
                 k->num_ctas);
    return -1;
  }
  unsigned int n = 0;
  if (k->shared > 228 * 1024) {
    memset(&attributes[n], 0, sizeof(attributes[n]));
    attributes[n].id = (CUlaunchAttributeID)CU_LAUNCH_ATTRIBUTE_SHARED_MEMORY_MODE;
    int mode = CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED_SHARED_MEMORY;
    memcpy(&attributes[n++].value, &mode, sizeof(mode));
  }
  if (k->pdl) {
    memset(&attributes[n], 0, sizeof(attributes[n]));
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[n++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (k->cooperative) {
    memset(&attributes[n], 0, sizeof(attributes[n]));
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attributes[n++].value.cooperative = 1;
  }
  if (k->num_ctas != 1) {
    memset(&attributes[n], 0, sizeof(attributes[n]));
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attributes[n].value.clusterDim.x = k->num_ctas;
    attributes[n].value.clusterDim.y = 1;
    attributes[n++].value.clusterDim.z = 1;
    memset(&attributes[n], 0, sizeof(attributes[n]));
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attributes[n++].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
  }
  /* Every field set here: no copy of a zeroed config, at every launch. */
  out->gridDimX = gx * k->num_ctas;
  out->gridDimY = gy;
  out->gridDimZ = gz;
  out->blockDimX = k->block;
  out->blockDimY = 1;
  out->blockDimZ = 1;
  out->sharedMemBytes = k->shared;
  out->hStream = stream;
  out->attrs = attributes;
  out->numAttrs = n;
  return 0;
}

static PyObject *launch(KernelObject *k, unsigned int gx, unsigned int gy, unsigned int gz,
                        PyObject *stream_obj, PyObject *const *args) {
  uint64_t values[MAX_PARAMS];
  void *params[MAX_PARAMS];
  CUstream stream;
  if (stream_for(k, stream_obj, &stream) < 0 || make_context_current(k) < 0 ||
      pack(k, args, values, params) < 0)
    return NULL;
  if ((unsigned long long)gx * gy * gz == 0)
    Py_RETURN_NONE;
  CUlaunchAttribute attributes[5];
  CUlaunchConfig config;
  if (configure(k, gx, gy, gz, stream, &config, attributes) < 0)
    return NULL;
  CUresult status;
  Py_BEGIN_ALLOW_THREADS;
  status = cu.launch_kernel_ex(&config, k->function, params, NULL);
  Py_END_ALLOW_THREADS;
  if (status != CUDA_SUCCESS)
    return cuda_error(status, "cuLaunchKernelEx");
  Py_RETURN_NONE;
}

static double seconds_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* kernel.time_parts(count, gx, gy, gz, stream, *args) -> (driver, pack): seconds per call of
 * the driver's cuLaunchKernelEx alone (the arguments packed once before, `count` launches in a
 * C loop), and of packing the arguments alone (`count` times, no launch). For benchmarks: what a
 * launch costs the driver, against what a whole `kernel[grid](*args)` costs. */
static PyObject *kernel_time_parts(KernelObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 5 + self->nargs) {
    PyErr_Format(PyExc_TypeError, "time_parts() takes %zd arguments, got %zd", 5 + self->nargs, nargs);
    return NULL;
  }
  long count = PyLong_AsLong(args[0]);
  if (count == -1 && PyErr_Occurred())
    return NULL;
  if (count < 1) {
    PyErr_SetString(PyExc_ValueError, "time_parts: count must be at least 1");
    return NULL;
  }
  unsigned int gx, gy, gz;
  if (grid_dimension(args[1], &gx, "x") < 0 || grid_dimension(args[2], &gy, "y") < 0 ||
      grid_dimension(args[3], &gz, "z") < 0)
    return NULL;
  uint64_t values[MAX_PARAMS];
  void *params[MAX_PARAMS];
  CUstream stream;
  if (stream_for(self, args[4], &stream) < 0 || make_context_current(self) < 0)
    return NULL;
  double t0 = seconds_now();
  for (long i = 0; i < count; i++) {
    if (pack(self, args + 5, values, params) < 0)
      return NULL;
  }
  double packing = (seconds_now() - t0) / (double)count;
  CUlaunchAttribute attributes[5];
  CUlaunchConfig config;
  if (configure(self, gx, gy, gz, stream, &config, attributes) < 0)
    return NULL;
  CUresult status = CUDA_SUCCESS;
  double driver;
  Py_BEGIN_ALLOW_THREADS;
  double t1 = seconds_now();
  for (long i = 0; i < count && status == CUDA_SUCCESS; i++)
    status = cu.launch_kernel_ex(&config, self->function, params, NULL);
  driver = (seconds_now() - t1) / (double)count;
  Py_END_ALLOW_THREADS;
  if (status != CUDA_SUCCESS)
    return cuda_error(status, "cuLaunchKernelEx");
  return Py_BuildValue("(dd)", driver, packing);
}

/* --- DriverCall: the driver's call alone, called from Python -------------------------------- */

/* kernel.driver_call(gx, gy, gz, stream, *args) -> a callable whose every call is one
 * cuLaunchKernelEx of the kernel with those arguments, packed once here: for benchmarks, the
 * floor of any launch made from Python (the call into C, the driver's call, nothing else; the
 * GIL is kept). It holds the arguments, so their memory lives as long as it does.
 *
 * call(grid_function, meta) calls grid_function(meta) first, from C, and drops what it returns:
 * the floor of any launch through a grid function (a launcher must call it, and the driver),
 * with the grid function's cost as it is between two driver calls rather than in a loop of its
 * own. */
typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  KernelObject *kernel;
  PyObject *args; /* tuple: what the packed values point into */
  CUlaunchConfig config;
  CUlaunchAttribute attributes[5];
  uint64_t values[MAX_PARAMS];
  void *params[MAX_PARAMS];
} DriverCallObject;

static PyTypeObject DriverCallType;

static PyObject *driver_call_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
  DriverCallObject *self = (DriverCallObject *)callable;
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if ((n != 0 && n != 2) || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "a driver call takes no arguments, or a grid function and its meta");
    return NULL;
  }
  if (n == 2) {
    PyObject *grid = PyObject_CallOneArg(args[0], args[1]);
    if (grid == NULL)
      return NULL;
    Py_DECREF(grid);
  }
  CUresult status = cu.launch_kernel_ex(&self->config, self->kernel->function, self->params, NULL);
  if (status != CUDA_SUCCESS)
    return cuda_error(status, "cuLaunchKernelEx");
  Py_RETURN_NONE;
}

static PyObject *kernel_driver_call(KernelObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4 + self->nargs) {
    PyErr_Format(PyExc_TypeError, "driver_call() takes %zd arguments, got %zd", 4 + self->nargs, nargs);
    return NULL;
  }
  unsigned int gx, gy, gz;
  CUstream stream;
  if (grid_dimension(args[0], &gx, "x") < 0 || grid_dimension(args[1], &gy, "y") < 0 ||
      grid_dimension(args[2], &gz, "z") < 0 || stream_for(self, args[3], &stream) < 0 ||
      make_context_current(self) < 0)
    return NULL;
  DriverCallObject *call = PyObject_GC_New(DriverCallObject, &DriverCallType);
  if (call == NULL)
    return NULL;
  call->vectorcall = driver_call_vectorcall;
  call->kernel = (KernelObject *)Py_NewRef(self);
  call->args = PyTuple_New(self->nargs);
  for (Py_ssize_t i = 0; call->args != NULL && i < self->nargs; i++)
    PyTuple_SET_ITEM(call->args, i, Py_NewRef(args[4 + i]));
  if (call->args == NULL || pack(self, args + 4, call->values, call->params) < 0) {
    Py_DECREF(call);
    return NULL;
  }
  if (configure(self, gx, gy, gz, stream, &call->config, call->attributes) < 0) {
    Py_DECREF(call);
    return NULL;
  }
  PyObject_GC_Track(call);
  return (PyObject *)call;
}

static int driver_call_traverse(DriverCallObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->kernel);
  Py_VISIT(self->args);
  return 0;
}

static int driver_call_clear(DriverCallObject *self) {
  Py_CLEAR(self->kernel);
  Py_CLEAR(self->args);
  return 0;
}

static void driver_call_dealloc(DriverCallObject *self) {
  PyObject_GC_UnTrack(self);
  driver_call_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef driver_call_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(DriverCallObject, vectorcall), READONLY, NULL},
    {NULL}};

static PyTypeObject DriverCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "acompile._launch.DriverCall",
    .tp_basicsize = sizeof(DriverCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "call(), call(grid_function, meta): the driver's launch alone, its arguments packed once.",
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(DriverCallObject, vectorcall),
    .tp_dealloc = (destructor)driver_call_dealloc,
    .tp_traverse = (traverseproc)driver_call_traverse,
    .tp_clear = (inquiry)driver_call_clear,
    .tp_members = driver_call_members,
};

/* kernel.launch(gx, gy, gz, stream, *args): a launch of a grid computed by the caller. */
static PyObject *kernel_launch(KernelObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4 + self->nargs) {
    PyErr_Format(PyExc_TypeError, "launch() takes %zd arguments, got %zd", 4 + self->nargs, nargs);
    return NULL;
  }
  unsigned int gx, gy, gz;
  if (grid_dimension(args[0], &gx, "x") < 0 || grid_dimension(args[1], &gy, "y") < 0 ||
      grid_dimension(args[2], &gz, "z") < 0)
    return NULL;
  return launch(self, gx, gy, gz, args[3], args + 4);
}

static PyObject *kernel_bind(KernelObject *self, PyObject *args);
static PyObject *kernel_grid_function_binder(KernelObject *self, PyObject *args);

static PyMethodDef kernel_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))kernel_launch, METH_FASTCALL,
     "launch(gx, gy, gz, stream, *args): launch on a grid; stream None is the current one"},
    {"driver_call", (PyCFunction)(void (*)(void))kernel_driver_call, METH_FASTCALL,
     "driver_call(gx, gy, gz, stream, *args): a callable making the driver's call alone, the "
     "arguments packed once"},
    {"time_parts", (PyCFunction)(void (*)(void))kernel_time_parts, METH_FASTCALL,
     "time_parts(count, gx, gy, gz, stream, *args) -> (driver, pack): seconds per launch of "
     "cuLaunchKernelEx alone, and per packing of the arguments alone"},
    {"bind", (PyCFunction)kernel_bind, METH_VARARGS,
     "bind(gx, gy, gz, fallback, name, qualname): the launch function of a grid"},
    {"grid_function_binder", (PyCFunction)kernel_grid_function_binder, METH_VARARGS,
     "grid_function_binder(make, meta, name, qualname): binder(grid) is the launch function of "
     "a grid function"},
    {NULL}};

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "acompile._launch.Kernel",
    .tp_basicsize = sizeof(KernelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A loaded Triton kernel, as this launcher launches it.",
    .tp_new = kernel_new,
    .tp_dealloc = (destructor)kernel_dealloc,
    .tp_traverse = (traverseproc)kernel_traverse,
    .tp_clear = (inquiry)kernel_clear,
    .tp_methods = kernel_methods,
};

/* --- Bound: kernel[grid], a launch function of one grid ----------------------------------- */

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  KernelObject *kernel;
  PyObject *fallback; /* the Python launch function of the same grid; with a grid function,
                         the Python function making it from the grid function */
  PyObject *name;     /* __name__ */
  PyObject *qualname; /* __qualname__ */
  PyObject *grid_fn;  /* NULL: the grid is (gx, gy, gz) */
  PyObject *binder;   /* with grid_fn: the Binder that made it (what the grid function is given) */
  unsigned int gx, gy, gz;
} BoundObject;

static PyTypeObject BoundType;

/* --- Binder: kernel[grid function], made once per kernel ---------------------------------- */

/* A grid function is given every parameter by name, in the kernel's order: a copy of
 * `template` (the constexprs' values in place, None where a runtime argument goes) with each
 * runtime argument set by name. Library code often writes its grid as a lambda made at every
 * call, so kernel[grid function] is made at every launch: calling a Binder is that, one object
 * and no parsing. */
typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  KernelObject *kernel;
  PyObject *make;     /* make(grid function): the Python launch function it falls back to */
  PyObject *name;
  PyObject *qualname;
  PyObject *template_;      /* dict */
  PyObject *runtime_names;  /* tuple of str: the runtime arguments the grid function sees */
  Py_ssize_t runtime_index[MAX_PARAMS];
} BinderObject;

static PyTypeObject BinderType;

/* The grid a grid function returned: an int, or a tuple or list of 1 to 3 ints. */
static int parse_grid(PyObject *grid, unsigned int dims[3]) {
  dims[0] = dims[1] = dims[2] = 1;
  static const char *axes[3] = {"x", "y", "z"};
  if (PyLong_Check(grid))
    return grid_dimension(grid, &dims[0], "x");
  if (PyTuple_CheckExact(grid) && PyTuple_GET_SIZE(grid) >= 1 && PyTuple_GET_SIZE(grid) <= 3) {
    /* The usual grid function's result: a tuple of ints, read as it is. */
    Py_ssize_t n = PyTuple_GET_SIZE(grid), i = 0;
    while (i < n && PyLong_CheckExact(PyTuple_GET_ITEM(grid, i)))
      i++;
    if (i == n) {
      for (i = 0; i < n; i++)
        if (grid_dimension(PyTuple_GET_ITEM(grid, i), &dims[i], axes[i]) < 0)
          return -1;
      return 0;
    }
  }
  if (!PyTuple_Check(grid) && !PyList_Check(grid))
    goto wrong;
  /* A list becomes a tuple first: an item's __index__ may change the list under the loop. */
  PyObject *items = PySequence_Tuple(grid);
  if (items == NULL)
    return -1;
  Py_ssize_t n = PyTuple_GET_SIZE(items);
  if (n < 1 || n > 3) {
    Py_DECREF(items);
    goto wrong;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *index = PyNumber_Index(PyTuple_GET_ITEM(items, i));
    if (index == NULL) {
      Py_DECREF(items);
      if (!PyErr_ExceptionMatches(PyExc_TypeError))
        return -1;
      PyErr_Clear();
      goto wrong;
    }
    int failed = grid_dimension(index, &dims[i], axes[i]);
    Py_DECREF(index);
    if (failed) {
      Py_DECREF(items);
      return -1;
    }
  }
  Py_DECREF(items);
  return 0;
wrong:
  PyErr_Format(PyExc_TypeError, "grid must be an int or a tuple of 1 to 3 ints, got %R", grid);
  return -1;
}

/* The grid function's argument: every parameter by name (runtime arguments and constexprs),
 * in the kernel's order, as Triton's JIT gives it. */
static PyObject *grid_meta(BoundObject *self, PyObject *const *args) {
  BinderObject *binder = (BinderObject *)self->binder;
  PyObject *meta = PyDict_Copy(binder->template_);
  if (meta == NULL)
    return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(binder->runtime_names);
  for (Py_ssize_t i = 0; i < n; i++) { /* keys already there: their order stays the kernel's */
    if (PyDict_SetItem(meta, PyTuple_GET_ITEM(binder->runtime_names, i), args[binder->runtime_index[i]]) < 0) {
      Py_DECREF(meta);
      return NULL;
    }
  }
  return meta;
}

static PyObject *bound_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
  BoundObject *self = (BoundObject *)callable;
  KernelObject *k = self->kernel;
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  PyObject *stream = NULL;
  if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0) {
    PyObject *key = PyTuple_GET_ITEM(kwnames, 0);
    if (PyTuple_GET_SIZE(kwnames) != 1 ||
        (key != stream_name && PyUnicode_Compare(key, stream_name) != 0))
      goto python;
    stream = args[n];
  }
  if (n != k->nargs)
    goto python; /* its message names the missing or extra arguments */
  if (hooks_installed(k) != 0)
    goto python_or_error;
  if (self->grid_fn == NULL)
    return launch(k, self->gx, self->gy, self->gz, stream, args);
  PyObject *meta = grid_meta(self, args);
  if (meta == NULL)
    return NULL;
  PyObject *grid = PyObject_CallOneArg(self->grid_fn, meta);
  Py_DECREF(meta);
  if (grid == NULL)
    return NULL;
  unsigned int dims[3];
  int failed = parse_grid(grid, dims);
  Py_DECREF(grid);
  if (failed)
    return NULL;
  return launch(k, dims[0], dims[1], dims[2], stream, args);
python_or_error:
  if (PyErr_Occurred())
    return NULL;
python:
  if (self->grid_fn == NULL)
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  PyObject *function = PyObject_CallOneArg(self->fallback, self->grid_fn);
  if (function == NULL)
    return NULL;
  PyObject *result = PyObject_Vectorcall(function, args, nargsf, kwnames);
  Py_DECREF(function);
  return result;
}

static BoundObject *new_bound(KernelObject *kernel, PyObject *fallback, PyObject *name, PyObject *qualname) {
  if (!PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "bind: fallback must be callable");
    return NULL;
  }
  BoundObject *bound = PyObject_GC_New(BoundObject, &BoundType);
  if (bound == NULL)
    return NULL;
  bound->vectorcall = bound_vectorcall;
  bound->kernel = (KernelObject *)Py_NewRef(kernel);
  bound->fallback = Py_NewRef(fallback);
  bound->name = Py_NewRef(name);
  bound->qualname = Py_NewRef(qualname);
  bound->grid_fn = NULL;
  bound->binder = NULL;
  bound->gx = bound->gy = bound->gz = 0;
  return bound;
}

static PyObject *binder_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames);

/* kernel.grid_function_binder(make, meta, name, qualname) -> Binder: binder(grid) is
 * kernel[grid] for a grid function; make(grid) is the Python launch function it falls back to.
 * meta: ((name, index of a runtime argument | (constant,)), ...) in the kernel's order, each
 * name once; checked here, trusted at each launch. */
static PyObject *kernel_grid_function_binder(KernelObject *self, PyObject *args) {
  PyObject *make, *meta, *name, *qualname;
  if (!PyArg_ParseTuple(args, "OO!UU", &make, &PyTuple_Type, &meta, &name, &qualname))
    return NULL;
  if (!PyCallable_Check(make)) {
    PyErr_SetString(PyExc_TypeError, "grid_function_binder: make must be callable");
    return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(meta);
  PyObject *template_ = PyDict_New();
  PyObject *names = PyList_New(0);
  BinderObject *binder = NULL;
  if (template_ == NULL || names == NULL)
    goto failed;
  Py_ssize_t runtime_index[MAX_PARAMS];
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *pair = PyTuple_GET_ITEM(meta, i);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0))) {
      PyErr_SetString(PyExc_TypeError, "grid_function_binder: meta must hold (name, source) pairs");
      goto failed;
    }
    PyObject *key = PyTuple_GET_ITEM(pair, 0), *source = PyTuple_GET_ITEM(pair, 1), *value;
    int seen = PyDict_Contains(template_, key);
    if (seen != 0) {
      if (seen > 0)
        PyErr_Format(PyExc_ValueError, "grid_function_binder: %R is named twice", key);
      goto failed;
    }
    if (PyLong_Check(source)) {
      Py_ssize_t index = PyLong_AsSsize_t(source);
      if (index < 0 || index >= self->nargs || PyList_GET_SIZE(names) >= MAX_PARAMS) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "grid_function_binder: an argument index is out of range");
        goto failed;
      }
      runtime_index[PyList_GET_SIZE(names)] = index;
      if (PyList_Append(names, key) < 0)
        goto failed;
      value = Py_None;
    } else if (PyTuple_Check(source) && PyTuple_GET_SIZE(source) == 1) {
      value = PyTuple_GET_ITEM(source, 0);
    } else {
      PyErr_SetString(PyExc_TypeError, "grid_function_binder: a source is an index or (constant,)");
      goto failed;
    }
    if (PyDict_SetItem(template_, key, value) < 0)
      goto failed;
  }
  binder = PyObject_GC_New(BinderObject, &BinderType);
  if (binder == NULL)
    goto failed;
  binder->vectorcall = NULL; /* set below, once every field is */
  binder->kernel = (KernelObject *)Py_NewRef(self);
  binder->make = Py_NewRef(make);
  binder->name = Py_NewRef(name);
  binder->qualname = Py_NewRef(qualname);
  binder->template_ = template_;
  binder->runtime_names = PyList_AsTuple(names);
  memcpy(binder->runtime_index, runtime_index, sizeof(Py_ssize_t) * (size_t)PyList_GET_SIZE(names));
  Py_DECREF(names);
  if (binder->runtime_names == NULL) {
    Py_DECREF(binder);
    return NULL;
  }
  binder->vectorcall = binder_vectorcall;
  PyObject_GC_Track(binder);
  return (PyObject *)binder;
failed:
  Py_XDECREF(template_);
  Py_XDECREF(names);
  return NULL;
}

static PyObject *kernel_bind(KernelObject *self, PyObject *args) {
  PyObject *x, *y, *z, *fallback, *name, *qualname;
  if (!PyArg_ParseTuple(args, "OOOOUU", &x, &y, &z, &fallback, &name, &qualname))
    return NULL;
  unsigned int gx, gy, gz;
  if (grid_dimension(x, &gx, "x") < 0 || grid_dimension(y, &gy, "y") < 0 ||
      grid_dimension(z, &gz, "z") < 0)
    return NULL;
  BoundObject *bound = new_bound(self, fallback, name, qualname);
  if (bound == NULL)
    return NULL;
  bound->gx = gx;
  bound->gy = gy;
  bound->gz = gz;
  PyObject_GC_Track(bound);
  return (PyObject *)bound;
}

static int bound_traverse(BoundObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->kernel);
  Py_VISIT(self->fallback);
  Py_VISIT(self->name);
  Py_VISIT(self->qualname);
  Py_VISIT(self->grid_fn);
  Py_VISIT(self->binder);
  return 0;
}

static int bound_clear(BoundObject *self) {
  Py_CLEAR(self->kernel);
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->name);
  Py_CLEAR(self->qualname);
  Py_CLEAR(self->grid_fn);
  Py_CLEAR(self->binder);
  return 0;
}

static void bound_dealloc(BoundObject *self) {
  PyObject_GC_UnTrack(self);
  bound_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *bound_repr(BoundObject *self) {
  if (self->grid_fn != NULL)
    return PyUnicode_FromFormat("<launch %U grid=%R>", self->qualname, self->grid_fn);
  return PyUnicode_FromFormat("<launch %U grid=(%u, %u, %u)>", self->qualname, self->gx, self->gy,
                              self->gz);
}

static PyObject *bound_grid(BoundObject *self, void *closure) {
  if (self->grid_fn != NULL)
    return Py_NewRef(self->grid_fn);
  return Py_BuildValue("(III)", self->gx, self->gy, self->gz);
}

static PyMemberDef bound_members[] = {
    {"__name__", T_OBJECT, offsetof(BoundObject, name), READONLY, NULL},
    {"__qualname__", T_OBJECT, offsetof(BoundObject, qualname), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(BoundObject, vectorcall), READONLY, NULL},
    {NULL}};

static PyGetSetDef bound_getset[] = {{"grid", (getter)bound_grid, NULL, "the grid (x, y, z), or the grid function", NULL},
                                     {NULL}};

static PyTypeObject BoundType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "acompile._launch.Bound",
    .tp_basicsize = sizeof(BoundObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "kernel[grid]: call it with the kernel's runtime arguments (and stream=).",
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(BoundObject, vectorcall),
    .tp_dealloc = (destructor)bound_dealloc,
    .tp_traverse = (traverseproc)bound_traverse,
    .tp_clear = (inquiry)bound_clear,
    .tp_repr = (reprfunc)bound_repr,
    .tp_members = bound_members,
    .tp_getset = bound_getset,
};

/* binder(grid) -> kernel[grid] for the grid function grid. */
static PyObject *binder_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
  BinderObject *self = (BinderObject *)callable;
  if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "a binder takes one grid function");
    return NULL;
  }
  PyObject *grid = args[0];
  if (!PyCallable_Check(grid)) {
    PyErr_SetString(PyExc_TypeError, "kernel[grid]: a binder takes a callable grid");
    return NULL;
  }
  BoundObject *bound = new_bound(self->kernel, self->make, self->name, self->qualname);
  if (bound == NULL)
    return NULL;
  bound->grid_fn = Py_NewRef(grid);
  bound->binder = Py_NewRef(callable);
  PyObject_GC_Track(bound);
  return (PyObject *)bound;
}

static int binder_traverse(BinderObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->kernel);
  Py_VISIT(self->make);
  Py_VISIT(self->name);
  Py_VISIT(self->qualname);
  Py_VISIT(self->template_);
  Py_VISIT(self->runtime_names);
  return 0;
}

static int binder_clear(BinderObject *self) {
  Py_CLEAR(self->kernel);
  Py_CLEAR(self->make);
  Py_CLEAR(self->name);
  Py_CLEAR(self->qualname);
  Py_CLEAR(self->template_);
  Py_CLEAR(self->runtime_names);
  return 0;
}

static void binder_dealloc(BinderObject *self) {
  PyObject_GC_UnTrack(self);
  binder_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *binder_repr(BinderObject *self) {
  return PyUnicode_FromFormat("<launch binder %U>", self->qualname);
}

static PyMemberDef binder_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(BinderObject, vectorcall), READONLY, NULL},
    {NULL}};

static PyTypeObject BinderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "acompile._launch.Binder",
    .tp_basicsize = sizeof(BinderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "binder(grid): kernel[grid] for a grid function.",
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(BinderObject, vectorcall),
    .tp_dealloc = (destructor)binder_dealloc,
    .tp_traverse = (traverseproc)binder_traverse,
    .tp_clear = (inquiry)binder_clear,
    .tp_repr = (reprfunc)binder_repr,
    .tp_members = binder_members,
};

/* --- kernel[grid]: the subscript of a kernel class, in C --------------------------------- */

/* A library launches with `kernel[grid](*args)`, the subscript at every launch: as a Python
 * `__getitem__`, a frame and a dict look-up, about 0.2 µs (a twentieth of a launch). `subscript`
 * makes the class's `__getitem__` a method of C doing what that Python one does: the launch
 * function kept in the instance's table (`table_name`, a dict) for this grid; else, for a grid
 * function, the launch the instance's binder (`binder_name`, None until loaded) makes for it;
 * else the result of the instance's `miss_name` method (which loads, makes and keeps the launch,
 * or raises). One class per process: a second call naming other attributes is refused. */
static PyObject *table_name, *miss_name, *binder_name;

static PyObject *kernel_subscript(PyObject *self, PyObject *grid) {
  PyObject *table = PyObject_GetAttr(self, table_name);
  if (table == NULL)
    return NULL;
  if (PyDict_CheckExact(table)) {
    PyObject *found = PyDict_GetItemWithError(table, grid); /* borrowed: the table is held */
    if (found != NULL && found != Py_None) { /* None kept: a miss, as for the Python one */
      Py_INCREF(found);
      Py_DECREF(table);
      return found;
    }
    if (PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) { /* an unhashable grid (a list) misses */
        Py_DECREF(table);
        return NULL;
      }
      PyErr_Clear();
    }
  }
  Py_DECREF(table);
  if (PyCallable_Check(grid)) { /* a grid function: never kept (it often holds the caller's tensors) */
    PyObject *binder = PyObject_GetAttr(self, binder_name);
    if (binder == NULL)
      return NULL;
    if (binder != Py_None) {
      PyObject *launch = PyObject_CallOneArg(binder, grid);
      Py_DECREF(binder);
      return launch;
    }
    Py_DECREF(binder);
  }
  return PyObject_CallMethodOneArg(self, miss_name, grid);
}

static PyMethodDef subscript_def = {
    "__getitem__", (PyCFunction)kernel_subscript, METH_O,
    "kernel[grid]: the kernel's launch function for grid (see the class's documentation)."};

/* subscript(cls, table, binder, miss) -> a `__getitem__` for cls (a method descriptor) doing in
 * C what `self.<table>.get(grid) or (callable(grid) and self.<binder> and self.<binder>(grid)) or
 * self.<miss>(grid)` does (a grid that cannot be hashed: not in the table). */
static PyObject *subscript(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyType_Check(args[0]) || !PyUnicode_CheckExact(args[1]) ||
      !PyUnicode_CheckExact(args[2]) || !PyUnicode_CheckExact(args[3])) {
    PyErr_SetString(PyExc_TypeError, "subscript(cls, table, binder, miss) takes a class and three names");
    return NULL;
  }
  if (table_name != NULL) { /* every descriptor made reads these names: they stay */
    for (int i = 0; i < 3; i++) {
      PyObject *kept = i == 0 ? table_name : i == 1 ? binder_name : miss_name;
      int same = PyUnicode_Compare(kept, args[1 + i]);
      if (same == -1 && PyErr_Occurred())
        return NULL;
      if (same != 0) {
        PyErr_Format(PyExc_ValueError,
                     "subscript: this process's kernel subscripts read (%R, %R, %R), not (%R, %R, %R)",
                     table_name, binder_name, miss_name, args[1], args[2], args[3]);
        return NULL;
      }
    }
    return PyDescr_NewMethod((PyTypeObject *)args[0], &subscript_def);
  }
  PyObject *table = Py_NewRef(args[1]), *binder = Py_NewRef(args[2]), *miss = Py_NewRef(args[3]);
  PyUnicode_InternInPlace(&table);
  PyUnicode_InternInPlace(&binder);
  PyUnicode_InternInPlace(&miss);
  table_name = table;
  binder_name = binder;
  miss_name = miss;
  return PyDescr_NewMethod((PyTypeObject *)args[0], &subscript_def);
}

/* --- module ------------------------------------------------------------------------------- */

/* use_tensor_pointer(capsule or None): read tensors' addresses through acompile's bridge to
 * PyTorch (its TENSOR_POINTER capsule), or through data_ptr() again (None). */
static PyObject *use_tensor_pointer(PyObject *module, PyObject *capsule) {
  if (capsule == Py_None) {
    tensor_pointer = NULL;
    Py_RETURN_NONE;
  }
  if (!PyCapsule_CheckExact(capsule)) {
    PyErr_Format(PyExc_TypeError, "use_tensor_pointer takes the bridge's TENSOR_POINTER or None, got %.100s",
                 Py_TYPE(capsule)->tp_name);
    return NULL;
  }
  void *function = PyCapsule_GetPointer(capsule, TENSOR_POINTER_CAPSULE);
  if (function == NULL)
    return NULL; /* another capsule: a ValueError names it */
  tensor_pointer = (tensor_pointer_t)function;
  Py_RETURN_NONE;
}

static PyObject *tensor_pointer_in_use(PyObject *module, PyObject *unused) {
  return PyBool_FromLong(tensor_pointer != NULL);
}

static PyMethodDef module_methods[] = {
    {"use_tensor_pointer", use_tensor_pointer, METH_O,
     "use_tensor_pointer(capsule): read tensors' addresses through the bridge to PyTorch "
     "(None: through data_ptr())"},
    {"tensor_pointer_in_use", tensor_pointer_in_use, METH_NOARGS,
     "tensor_pointer_in_use(): whether tensors' addresses are read through the bridge"},
    {"subscript", (PyCFunction)(void (*)(void))subscript, METH_FASTCALL,
     "subscript(cls, table, binder, miss): a __getitem__ for cls returning self.<table>[grid], "
     "else self.<binder>(grid) for a grid function where the binder is not None, else "
     "self.<miss>(grid)"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_launch",
                                        "acompile's launcher for Triton kernels on CUDA.", -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__launch(void) {
  data_ptr_name = PyUnicode_InternFromString("data_ptr");
  stream_name = PyUnicode_InternFromString("stream");
  enter_hook_name = PyUnicode_InternFromString("launch_enter_hook");
  exit_hook_name = PyUnicode_InternFromString("launch_exit_hook");
  calls_name = PyUnicode_InternFromString("calls");
  if (!data_ptr_name || !stream_name || !enter_hook_name || !exit_hook_name || !calls_name)
    return NULL;
  if (PyType_Ready(&KernelType) < 0 || PyType_Ready(&BoundType) < 0 || PyType_Ready(&BinderType) < 0 ||
      PyType_Ready(&DriverCallType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&module_def);
  if (m == NULL)
    return NULL;
  if (PyModule_AddObjectRef(m, "Kernel", (PyObject *)&KernelType) < 0 ||
      PyModule_AddIntConstant(m, "ABI", 8) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  static const char *kind_names = "*,i8,i16,i32,i64,u8,u16,u32,u64,fp16,bf16,fp32,fp64";
  if (PyModule_AddStringConstant(m, "KINDS", kind_names) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}

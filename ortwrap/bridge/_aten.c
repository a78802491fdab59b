/*
 * ortwrap's native ATen-op executor.
 *
 * ONNX Runtime's `org.pytorch.aten::ATen` kernel (onnxruntime/contrib_ops/cpu/aten_ops/aten_op.cc) calls two raw
 * function pointers registered with onnxruntime.capi._pybind_state.register_aten_op_executor(str, str):
 *
 *   bool is_tensor_argument(const char* op, const char* overload, size_t index, bool is_input);
 *   void execute(const char* op, const char* overload,
 *                size_t n_in,  DLManagedTensor** in,     // owned by us; NULL = absent optional input
 *                size_t n_out, DLManagedTensor** out);   // we fill; ORT takes ownership; NULL = not produced
 *
 * This file only does plumbing: take the GIL, wrap each incoming DLManagedTensor* in a PyCapsule named "dltensor",
 * call a Python function, and turn the returned "dltensor" capsules back into DLManagedTensor* for ORT.
 * All ATen logic (schema lookup, argument decoding, the op call) lives in aten.py.
 *
 * Errors: the ORT signature returns void and ORT is C++, so there is no status to return and a C file cannot
 * throw.  On any failure we hand ORT, as output 0, a static DLManagedTensor whose strides are not contiguous.
 * ORT's DlpackToOrtValue() then fails ORT_ENFORCE(IsContiguousTensor(..)) *inside* ATen::Compute, before taking
 * ownership, so ORT turns it into a normal failed-Run status ("... ATen node ... ORT only supports contiguous
 * tensor for now.") and the process keeps running.  The real Python exception is kept by aten.py, which re-raises it after the run.
 *
 * Only Python.h is needed, and _dlpack.h (the stable, unversioned v0.x DLPack ABI, shared with kernels/_cpu.c).
 * Built as the extension module ortwrap.bridge._aten by setup.py, or on first use by _native.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_dlpack.h"

static const char kCapsuleName[] = "dltensor";

static const char kUsedCapsuleName[] = "used_dltensor";

/* Python callables installed by ortwrap_aten_init (strong references, never released). */
static PyObject* g_execute = NULL;   /* execute(op:str, overload:str, inputs:tuple, n_out:int) -> tuple | None */
static PyObject* g_is_tensor = NULL; /* is_tensor(op:str, overload:str, index:int, is_input:bool) -> bool    */

/* ---- error "poison": a 1-D, 2-element float tensor with stride 2 (non-contiguous) ---- */
static float g_poison_data[4];
static int64_t g_poison_shape[1] = {2};
static int64_t g_poison_strides[1] = {2};
static void poison_deleter(DLManagedTensor* self) { (void)self; /* static storage, nothing to free */ }
static DLManagedTensor g_poison = {
    {g_poison_data, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, g_poison_shape, g_poison_strides, 0},
    NULL,
    poison_deleter};

/* Destructor of the input capsules: if Python never consumed the tensor (torch renames consumed capsules to
 * "used_dltensor"), give it back to ORT by calling its deleter. */
static void input_capsule_destructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kCapsuleName)) {
    DLManagedTensor* t = (DLManagedTensor*)PyCapsule_GetPointer(capsule, kCapsuleName);
    if (t != NULL && t->deleter != NULL) t->deleter(t);
  }
}

static void release_inputs(size_t n, DLManagedTensor** in, size_t from) {
  for (size_t i = from; i < n; ++i) {
    if (in[i] != NULL && in[i]->deleter != NULL) in[i]->deleter(in[i]);
  }
}

/* ortwrap's own CPU kernels (kernels/_cpu.c): ops named "ortwrap_cpu::<name>" run there, without the GIL.
 * int run(const char* name, const char* overload, size_t n_in, DLManagedTensor** in, size_t n_out,
 *         DLManagedTensor** out, char* err, size_t err_len): 0, or -1 with a message. Inputs stay ours to release.
 * (The overload name says which outputs the graph uses; see bridge/aten.py mark_used_outputs.) */
typedef int (*native_run_fn)(const char*, const char*, size_t, DLManagedTensor**, size_t, DLManagedTensor**, char*,
                             size_t);
static native_run_fn g_native_run = NULL;
static PyObject* g_native_error = NULL; /* native_error(op:str, message:str): parks the error for the caller */
static const char kNativePrefix[] = "ortwrap_cpu::";

/* Called once from Python with the kernels' entry point (an address) and the error callback. */
int ortwrap_aten_set_native(void* run, PyObject* on_error) {
  if (run == NULL || !PyCallable_Check(on_error)) return -1;
  Py_INCREF(on_error);
  Py_XDECREF(g_native_error);
  g_native_error = on_error;
  g_native_run = (native_run_fn)run;
  return 0;
}

static void run_native(const char* op_name, const char* overload_name, size_t n_in, DLManagedTensor** in, size_t n_out,
                       DLManagedTensor** out) {
  char err[512];
  err[0] = 0;
  int rc = g_native_run(op_name + sizeof kNativePrefix - 1, overload_name ? overload_name : "", n_in, in, n_out, out,
                        err, sizeof err);
  release_inputs(n_in, in, 0);
  if (rc == 0) return;
  for (size_t i = 0; i < n_out; ++i) out[i] = NULL;
  if (n_out > 0) out[0] = &g_poison;
  if (!Py_IsInitialized()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* r = PyObject_CallFunction(g_native_error, "ss", op_name, err);
  if (r == NULL) PyErr_WriteUnraisable(g_native_error);
  Py_XDECREF(r);
  PyGILState_Release(gil);
}

/* Called once from Python (through ctypes.PyDLL, so the GIL is held). Returns 0 on success. */
int ortwrap_aten_init(PyObject* execute, PyObject* is_tensor) {
  if (!PyCallable_Check(execute) || !PyCallable_Check(is_tensor)) return -1;
  Py_INCREF(execute);
  Py_INCREF(is_tensor);
  Py_XDECREF(g_execute);
  Py_XDECREF(g_is_tensor);
  g_execute = execute;
  g_is_tensor = is_tensor;
  return 0;
}

bool ortwrap_is_tensor_argument(const char* op_name, const char* overload_name, size_t index, bool is_input) {
  bool answer = true; /* safest default: treat as tensor */
  if (!Py_IsInitialized()) return answer;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (g_is_tensor != NULL) {
    PyObject* r = PyObject_CallFunction(g_is_tensor, "ssnO", op_name, overload_name ? overload_name : "",
                                        (Py_ssize_t)index, is_input ? Py_True : Py_False);
    if (r == NULL) {
      PyErr_WriteUnraisable(g_is_tensor);
    } else {
      int t = PyObject_IsTrue(r);
      if (t >= 0) answer = (t != 0);
      else PyErr_Clear();
      Py_DECREF(r);
    }
  }
  PyGILState_Release(gil);
  return answer;
}

void ortwrap_execute(const char* op_name, const char* overload_name, size_t n_in, DLManagedTensor** in,
                     size_t n_out, DLManagedTensor** out) {
  for (size_t i = 0; i < n_out; ++i) out[i] = NULL;
  if (g_native_run != NULL && strncmp(op_name, kNativePrefix, sizeof kNativePrefix - 1) == 0) {
    run_native(op_name, overload_name, n_in, in, n_out, out);
    return;
  }
  if (!Py_IsInitialized() || g_execute == NULL) {
    release_inputs(n_in, in, 0);
    if (n_out > 0) out[0] = &g_poison;
    return;
  }

  PyGILState_STATE gil = PyGILState_Ensure();
  int ok = 0;
  PyObject* result = NULL;
  PyObject* args = PyTuple_New((Py_ssize_t)n_in);
  if (args == NULL) {
    release_inputs(n_in, in, 0);
    goto done;
  }
  for (size_t i = 0; i < n_in; ++i) {
    PyObject* item;
    if (in[i] == NULL) {
      item = Py_None;
      Py_INCREF(item);
    } else {
      item = PyCapsule_New(in[i], kCapsuleName, input_capsule_destructor);
      if (item == NULL) {
        release_inputs(n_in, in, i); /* tensors < i are owned by capsules already in `args` */
        Py_DECREF(args);
        goto done;
      }
    }
    PyTuple_SET_ITEM(args, (Py_ssize_t)i, item); /* steals */
  }

  result = PyObject_CallFunction(g_execute, "ssOn", op_name, overload_name ? overload_name : "", args,
                                 (Py_ssize_t)n_out);
  Py_DECREF(args); /* unconsumed input capsules die here -> ORT deleters run */
  if (result == NULL) goto done;
  if (result == Py_None) goto done; /* aten.py already recorded the exception */
  if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != (Py_ssize_t)n_out) {
    PyErr_SetString(PyExc_TypeError, "ortwrap ATen executor must return a tuple with one entry per output");
    goto done;
  }
  /* Validate everything first, then take ownership, so a bad entry leaks nothing. */
  for (size_t i = 0; i < n_out; ++i) {
    PyObject* item = PyTuple_GET_ITEM(result, (Py_ssize_t)i);
    if (item != Py_None && !PyCapsule_IsValid(item, kCapsuleName)) {
      PyErr_Format(PyExc_TypeError, "output %zd is not an unconsumed 'dltensor' capsule", (Py_ssize_t)i);
      goto done;
    }
  }
  for (size_t i = 0; i < n_out; ++i) {
    PyObject* item = PyTuple_GET_ITEM(result, (Py_ssize_t)i);
    if (item == Py_None) continue;
    out[i] = (DLManagedTensor*)PyCapsule_GetPointer(item, kCapsuleName);
    /* DLPack protocol: renaming marks the capsule consumed, so its destructor will not free the tensor. */
    PyCapsule_SetName(item, kUsedCapsuleName);
  }
  ok = 1;

done:
  if (!ok) {
    if (PyErr_Occurred()) PyErr_WriteUnraisable(g_execute);
    for (size_t i = 0; i < n_out; ++i) out[i] = NULL;
    if (n_out > 0) out[0] = &g_poison;
  }
  Py_XDECREF(result);
  PyGILState_Release(gil);
}

/* ---- as an extension module ----
 * setup.py builds this file as the extension module ortwrap.bridge._aten (so an installed wheel needs no C compiler);
 * ortwrap loads it with ctypes.PyDLL (bridge/_native.py), never imports it, so the module itself is empty.
 * ORTWRAP_SOURCE_SHA256, set by setup.py, names the source the build came from: _native.py compiles the source
 * instead when it has changed since (a source checkout edited after `pip install -e .`). */
#ifndef ORTWRAP_SOURCE_SHA256
#define ORTWRAP_SOURCE_SHA256 ""
#endif
const char ortwrap_source_sha256[] = ORTWRAP_SOURCE_SHA256;

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_aten",
                                         "ortwrap's native ATen-op executor; loaded with ctypes.", -1, NULL};
PyMODINIT_FUNC PyInit__aten(void) { return PyModule_Create(&module_def); }

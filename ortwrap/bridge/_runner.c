/*
 * Native forward/backward runners for ORT 1.19.2's com.microsoft::PythonOp / PythonOpGrad kernels.
 *
 * Only Python.h is used. ORT calls a runner through a C++ function pointer of type
 *
 *   std::vector<PyObject*> (*)(const char* func_name, void* callback,
 *                              const std::vector<int64_t>& requires_grad_flags,
 *                              const std::vector<int64_t>& tensor_type_flags,
 *                              bool is_training_mode,
 *                              const std::vector<int64_t>& inplace_map,
 *                              const char* kernel_invoke_id,
 *                              bool safe_run_mode_enabled,
 *                              const std::vector<PyObject*>& args);
 *
 * (the type is spelled out in the wheel's symbol strings). Under the x86-64 System V
 * C++ ABI a std::vector is not trivially copyable, so it is returned through a hidden pointer that
 * arrives as the first argument and is handed back in %rax; `const std::vector&` arguments are
 * plain pointers; bool is a one-byte integer argument. With libstdc++ a std::vector<T> is three
 * pointers {begin, end, end_of_storage}. The C prototype below is therefore call-compatible with
 * the C++ one. The returned buffer is released by ORT with ::operator delete, so it is allocated
 * with the ::operator new of the libstdc++ that ORT itself links (looked up with dlsym), falling
 * back to malloc (which is what libstdc++'s operator new uses).
 *
 * The runner does the minimum: take the GIL, turn ORT's arguments into Python objects, call the
 * Python function registered with ortwrap_bridge_set_handlers(), and copy the list it returns into
 * the vector (one new reference per item, owned by ORT from then on). The Python side never
 * raises; if the call fails anyway (or does not return a list), the error is handed to the Python
 * `on_error` hook and an EMPTY vector is returned, which makes ORT fail the kernel with its own
 * error (forward: "The returned tuple should have at least one element."; backward: "backward
 * output count mismatch."). A C++ exception cannot be thrown from C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    void *begin;
    void *end;
    void *end_of_storage;
} cxx_vector; /* libstdc++ std::vector<T> */

static PyObject *g_forward = NULL;  /* Python callables (strong references) */
static PyObject *g_backward = NULL;
static PyObject *g_forward_fast = NULL;  /* (invoke_id, args) for kernels Python already knows */
static PyObject *g_backward_fast = NULL;
static PyObject *g_known_forward = NULL;  /* sets of invoke ids seen by each runner */
static PyObject *g_known_backward = NULL;
static PyObject *g_on_error = NULL;

typedef void *(*nothrow_new_fn)(size_t, const void *);
static nothrow_new_fn g_new = NULL;
static char g_nothrow_tag; /* std::nothrow_t is empty; operator new never reads it */

static void *vector_alloc(size_t bytes) {
    return g_new ? g_new(bytes, &g_nothrow_tag) : malloc(bytes);
}

static PyObject *int64_tuple(const cxx_vector *v) {
    const int64_t *p = (const int64_t *)v->begin;
    Py_ssize_t n = (Py_ssize_t)((const int64_t *)v->end - p);
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *x = PyLong_FromLongLong((long long)p[i]);
        if (!x) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

static PyObject *object_tuple(const cxx_vector *v) {
    PyObject *const *p = (PyObject *const *)v->begin;
    Py_ssize_t n = (Py_ssize_t)((PyObject *const *)v->end - p);
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *x = p[i] ? p[i] : Py_None; /* borrowed from ORT; the tuple takes its own ref */
        Py_INCREF(x);
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* Hand the pending Python error to the on_error hook (or print it) and clear it. */
static void report_error(const char *where) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!type) { /* no Python error: a result of the wrong type */
        PyErr_Format(PyExc_TypeError, "ortwrap bridge: %s handler must return a list", where);
        PyErr_Fetch(&type, &value, &tb);
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    if (g_on_error && value) {
        PyObject *r = PyObject_CallOneArg(g_on_error, value);
        if (!r) PyErr_WriteUnraisable(g_on_error);
        Py_XDECREF(r);
    } else if (value) {
        PyErr_Restore(type, value, tb);
        PyErr_WriteUnraisable(NULL);
        return;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static cxx_vector *run(cxx_vector *ret, PyObject *handler, PyObject *fast, PyObject *known, int is_forward,
                       const char *where, const char *func_name, void *callback, const cxx_vector *requires_grad,
                       const cxx_vector *tensor_flags, _Bool training, const cxx_vector *inplace_map,
                       const char *invoke_id, _Bool safe_mode, const cxx_vector *args) {
    ret->begin = ret->end = ret->end_of_storage = NULL;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *call = NULL, *result = NULL, *key = NULL, *x;
    if (!handler || !fast || !known) goto fail;
    if (!(key = PyUnicode_FromString(invoke_id))) goto fail;
    int seen = PySet_Contains(known, key);
    if (seen < 0) goto fail;
    if (seen) {
        /* Fast path: the node's constants were handed over on its first call. */
        if (!(call = PyTuple_New(2))) goto fail;
        Py_INCREF(key);
        PyTuple_SET_ITEM(call, 0, key);
        if (!(x = object_tuple(args))) goto fail;
        PyTuple_SET_ITEM(call, 1, x);
        result = PyObject_Call(fast, call, NULL);
    } else {
        if (!(call = PyTuple_New(9))) goto fail;
        PyObject *cb = callback ? (PyObject *)callback : Py_None;
        Py_INCREF(cb);
        PyTuple_SET_ITEM(call, 1, cb);
        PyObject *b = training ? Py_True : Py_False;
        Py_INCREF(b);
        PyTuple_SET_ITEM(call, 4, b);
        b = safe_mode ? Py_True : Py_False;
        Py_INCREF(b);
        PyTuple_SET_ITEM(call, 7, b);
        if (!(x = PyUnicode_FromString(func_name))) goto fail;
        PyTuple_SET_ITEM(call, 0, x);
        if (!(x = int64_tuple(requires_grad))) goto fail;
        PyTuple_SET_ITEM(call, 2, x);
        if (!(x = int64_tuple(tensor_flags))) goto fail;
        PyTuple_SET_ITEM(call, 3, x);
        if (!(x = int64_tuple(inplace_map))) goto fail;
        PyTuple_SET_ITEM(call, 5, x);
        Py_INCREF(key);
        PyTuple_SET_ITEM(call, 6, key);
        if (!(x = object_tuple(args))) goto fail;
        PyTuple_SET_ITEM(call, 8, x);
        result = PyObject_Call(handler, call, NULL);
        if (result && PyList_CheckExact(result) && PySet_Add(known, key) < 0) goto fail;
    }
    Py_CLEAR(key);
    Py_CLEAR(call); /* drops our references to ORT's argument capsules before ORT checks counts */
    if (!result || !PyList_CheckExact(result)) goto fail;
    Py_ssize_t n = PyList_GET_SIZE(result);
    /* ORT passes every item after the forward context to PyCapsule_GetPointer(item, "dltensor")
     * without checking the result (a NULL would be dereferenced): only capsules or None. */
    for (Py_ssize_t i = is_forward ? 1 : 0; i < n; ++i) {
        PyObject *item = PyList_GET_ITEM(result, i);
        if (item != Py_None && !PyCapsule_IsValid(item, "dltensor")) {
            PyErr_Format(PyExc_TypeError, "ortwrap bridge: %s result %zd is %.100s, not a DLPack "
                         "capsule or None", where, i, Py_TYPE(item)->tp_name);
            goto fail;
        }
    }
    if (n > 0) {
        PyObject **buf = (PyObject **)vector_alloc((size_t)n * sizeof(PyObject *));
        if (!buf) { PyErr_NoMemory(); goto fail; }
        for (Py_ssize_t i = 0; i < n; ++i) {
            buf[i] = PyList_GET_ITEM(result, i);
            Py_INCREF(buf[i]); /* this reference belongs to ORT */
        }
        ret->begin = buf;
        ret->end = ret->end_of_storage = buf + n;
        /* ORT stores a None context in its context map WITHOUT taking a reference, and drops one
         * when the entry goes (after PythonOpGrad, or unregister_python_functions): give it one. */
        if (is_forward && buf[0] == Py_None) Py_INCREF(Py_None);
    }
    Py_DECREF(result); /* list gone: each item now holds exactly the references ORT checks */
    PyGILState_Release(gil);
    return ret;

fail:
    Py_XDECREF(key);
    Py_XDECREF(call);
    Py_XDECREF(result);
    report_error(where);
    PyGILState_Release(gil);
    return ret; /* empty vector: ORT raises its own error */
}

cxx_vector *ortwrap_forward_runner(cxx_vector *ret, const char *func_name, void *callback,
                                   const cxx_vector *requires_grad, const cxx_vector *tensor_flags,
                                   _Bool training, const cxx_vector *inplace_map,
                                   const char *invoke_id, _Bool safe_mode, const cxx_vector *args) {
    return run(ret, g_forward, g_forward_fast, g_known_forward, 1, "forward", func_name, callback, requires_grad, tensor_flags,
               training, inplace_map, invoke_id, safe_mode, args);
}

cxx_vector *ortwrap_backward_runner(cxx_vector *ret, const char *func_name, void *callback,
                                    const cxx_vector *requires_grad, const cxx_vector *tensor_flags,
                                    _Bool training, const cxx_vector *inplace_map,
                                    const char *invoke_id, _Bool safe_mode, const cxx_vector *args) {
    return run(ret, g_backward, g_backward_fast, g_known_backward, 0, "backward", func_name, callback, requires_grad, tensor_flags,
               training, inplace_map, invoke_id, safe_mode, args);
}

/* Called through ctypes.PyDLL (GIL held). Returns 0 on success. */
int ortwrap_bridge_set_handlers(PyObject *forward, PyObject *backward, PyObject *on_error,
                                PyObject *forward_fast, PyObject *backward_fast) {
    if (!g_known_forward && !(g_known_forward = PySet_New(NULL))) return -1;
    if (!g_known_backward && !(g_known_backward = PySet_New(NULL))) return -1;
    Py_XINCREF(forward_fast);
    Py_XINCREF(backward_fast);
    Py_XSETREF(g_forward_fast, forward_fast);
    Py_XSETREF(g_backward_fast, backward_fast);
    if (!g_new) {
        void *h = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_NOLOAD);
        if (h) g_new = (nothrow_new_fn)dlsym(h, "_ZnwmRKSt9nothrow_t");
    }
    Py_XINCREF(forward);
    Py_XINCREF(backward);
    Py_XINCREF(on_error);
    Py_XSETREF(g_forward, forward);
    Py_XSETREF(g_backward, backward);
    Py_XSETREF(g_on_error, on_error);
    return 0;
}

/* 1 when the vector buffer comes from libstdc++'s operator new, 0 when from malloc. */
int ortwrap_bridge_uses_operator_new(void) { return g_new != NULL; }

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
 * The runner does the minimum: take the GIL, turn ORT's arguments into Python objects, call Python
 * (bridge/runner.py), and copy the list it returns into the vector (one new reference per item,
 * owned by ORT from then on). The Python side never raises; if the call fails anyway (or does not
 * return a list), the error is handed to the Python `on_error` hook and an EMPTY vector is returned,
 * which makes ORT fail the kernel with its own error (forward: "The returned tuple should have at
 * least one element."; backward: "backward output count mismatch."). A C++ exception cannot be
 * thrown from C.
 *
 * Per-call cost matters (it is paid once per Function call per step), so the node constants
 * (function name, flags, inplace map) cross to Python only on a node's FIRST forward call, through
 * the generic `forward` handler. After it, Python hands back a callable specialised for that node
 * (`lookup(invoke_id)`), cached here by the address of ORT's invoke-id string (and checked against
 * a copy of the string: a kernel's id lives as long as the kernel, and an address may be reused by
 * a later kernel); later calls pass only ORT's arguments, as positional arguments without a tuple.
 * The backward needs no lookup: the context ORT hands back (a bridge Handle) carries its node's
 * generated backward, called as `handle.backward(handle, grad, ...)`; any other context (None, a
 * released one) goes to the generic `backward(ctx, grad, ...)`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    void *begin;
    void *end;
    void *end_of_storage;
} cxx_vector; /* libstdc++ std::vector<T> */

static PyObject *g_forward = NULL;  /* Python callables (strong references) */
static PyObject *g_backward = NULL;
static PyObject *g_lookup = NULL;   /* invoke_id -> the node's forward callable, or None */
static PyObject *g_on_error = NULL;
static PyTypeObject *g_handle_type = NULL; /* bridge.runner.Handle (strong reference) */
static PyObject *g_str_backward = NULL;    /* interned "backward" */

typedef void *(*nothrow_new_fn)(size_t, const void *);
static nothrow_new_fn g_new = NULL;
static char g_nothrow_tag; /* std::nothrow_t is empty; operator new never reads it */

static void *vector_alloc(size_t bytes) {
    return g_new ? g_new(bytes, &g_nothrow_tag) : malloc(bytes);
}

/* Cache: invoke-id address -> the node's forward callable, 4-way. When a key's ways are all taken,
 * it evicts one (that node takes the generic path once more and comes back). GIL held. */
#define CACHE_SIZE 1024
typedef struct {
    const char *key;  /* ORT's invoke_id.c_str() */
    char *copy;       /* its content when cached */
    PyObject *fn;     /* strong reference */
} cache_entry;
static cache_entry g_cache[CACHE_SIZE];

#define CACHE_WAYS 4 /* a key lives in one of the 4 slots from its hash on */

static size_t cache_slot(const char *key) {
    uintptr_t k = (uintptr_t)key;
    return (size_t)((k >> 4) ^ (k >> 14)) % CACHE_SIZE;
}

static PyObject *cache_get(const char *key) {
    size_t s = cache_slot(key);
    for (size_t w = 0; w < CACHE_WAYS; ++w) {
        cache_entry *e = &g_cache[(s + w) % CACHE_SIZE];
        if (e->key == key && e->fn && strcmp(e->copy, key) == 0) return e->fn; /* borrowed */
    }
    return NULL;
}

static void cache_put(const char *key, PyObject *fn) {
    size_t s = cache_slot(key);
    cache_entry *e = &g_cache[s]; /* evicted when every way is taken by another key */
    for (size_t w = 0; w < CACHE_WAYS; ++w) {
        cache_entry *c = &g_cache[(s + w) % CACHE_SIZE];
        if (!c->fn || c->key == key) { e = c; break; }
    }
    char *copy = strdup(key);
    if (!copy) return; /* not cached: the node keeps taking the generic path */
    PyObject *old = e->fn;
    free(e->copy);
    Py_INCREF(fn);
    e->key = key;
    e->copy = copy;
    e->fn = fn;
    Py_XDECREF(old);
}

static void cache_clear(void) {
    for (size_t i = 0; i < CACHE_SIZE; ++i) {
        cache_entry *e = &g_cache[i];
        PyObject *old = e->fn;
        free(e->copy);
        e->key = NULL;
        e->copy = NULL;
        e->fn = NULL;
        Py_XDECREF(old);
    }
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

/* fn(*args) with ORT's argument objects (borrowed) as positional arguments. ORT never passes NULL
 * (a missing tensor is None), but a NULL would crash the callee: it is passed as None. */
static PyObject *call_with_args(PyObject *fn, const cxx_vector *args) {
    PyObject *const *p = (PyObject *const *)args->begin;
    size_t n = (size_t)((PyObject *const *)args->end - p);
    for (size_t i = 0; i < n; ++i) {
        if (!p[i]) {
            PyObject *t = object_tuple(args);
            if (!t) return NULL;
            PyObject *r = PyObject_Call(fn, t, NULL);
            Py_DECREF(t);
            return r;
        }
    }
    return PyObject_Vectorcall(fn, p, n, NULL);
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

/* The node's first forward call (or one whose callable was evicted): everything ORT passes. */
static PyObject *call_generic(PyObject *handler, const char *func_name, void *callback,
                              const cxx_vector *requires_grad, const cxx_vector *tensor_flags, _Bool training,
                              const cxx_vector *inplace_map, const char *invoke_id, _Bool safe_mode,
                              const cxx_vector *args) {
    PyObject *call = PyTuple_New(9), *x, *result = NULL;
    if (!call) return NULL;
    PyObject *cb = callback ? (PyObject *)callback : Py_None;
    Py_INCREF(cb);
    PyTuple_SET_ITEM(call, 1, cb);
    PyObject *b = training ? Py_True : Py_False;
    Py_INCREF(b);
    PyTuple_SET_ITEM(call, 4, b);
    b = safe_mode ? Py_True : Py_False;
    Py_INCREF(b);
    PyTuple_SET_ITEM(call, 7, b);
    if (!(x = PyUnicode_FromString(func_name))) goto done;
    PyTuple_SET_ITEM(call, 0, x);
    if (!(x = int64_tuple(requires_grad))) goto done;
    PyTuple_SET_ITEM(call, 2, x);
    if (!(x = int64_tuple(tensor_flags))) goto done;
    PyTuple_SET_ITEM(call, 3, x);
    if (!(x = int64_tuple(inplace_map))) goto done;
    PyTuple_SET_ITEM(call, 5, x);
    if (!(x = PyUnicode_FromString(invoke_id))) goto done;
    PyTuple_SET_ITEM(call, 6, x);
    if (!(x = object_tuple(args))) goto done;
    PyTuple_SET_ITEM(call, 8, x);
    result = PyObject_Call(handler, call, NULL);
    if (result && PyList_CheckExact(result) && g_lookup) {
        /* Ask for the node's specialised callable; a failure here only costs speed. */
        PyObject *fn = PyObject_CallOneArg(g_lookup, PyTuple_GET_ITEM(call, 6));
        if (fn && fn != Py_None) cache_put(invoke_id, fn);
        if (!fn) PyErr_Clear();
        Py_XDECREF(fn);
    }
done:
    Py_DECREF(call); /* drops our references to ORT's argument capsules before ORT checks counts */
    return result;
}

/* Move the handler's list into ORT's vector. Returns 0, or -1 with a Python error set. */
static int fill_vector(cxx_vector *ret, PyObject *result, int is_forward, const char *where) {
    Py_ssize_t n = PyList_GET_SIZE(result);
    /* ORT passes every item after the forward context to PyCapsule_GetPointer(item, "dltensor")
     * without checking the result (a NULL would be dereferenced): only capsules or None. */
    for (Py_ssize_t i = is_forward ? 1 : 0; i < n; ++i) {
        PyObject *item = PyList_GET_ITEM(result, i);
        if (item != Py_None && !PyCapsule_IsValid(item, "dltensor")) {
            PyErr_Format(PyExc_TypeError, "ortwrap bridge: %s result %zd is %.100s, not a DLPack "
                         "capsule or None", where, i, Py_TYPE(item)->tp_name);
            return -1;
        }
    }
    if (n > 0) {
        PyObject **buf = (PyObject **)vector_alloc((size_t)n * sizeof(PyObject *));
        if (!buf) { PyErr_NoMemory(); return -1; }
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
    return 0;
}

static cxx_vector *finish(cxx_vector *ret, PyObject *result, int is_forward, const char *where,
                          PyGILState_STATE gil) {
    if (!result || !PyList_CheckExact(result) || fill_vector(ret, result, is_forward, where) < 0) {
        Py_XDECREF(result);
        report_error(where);
    } else {
        Py_DECREF(result); /* list gone: each item now holds exactly the references ORT checks */
    }
    PyGILState_Release(gil);
    return ret; /* empty on failure: ORT raises its own error */
}

cxx_vector *ortwrap_forward_runner(cxx_vector *ret, const char *func_name, void *callback,
                                   const cxx_vector *requires_grad, const cxx_vector *tensor_flags,
                                   _Bool training, const cxx_vector *inplace_map,
                                   const char *invoke_id, _Bool safe_mode, const cxx_vector *args) {
    ret->begin = ret->end = ret->end_of_storage = NULL;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *result = NULL;
    PyObject *fn = cache_get(invoke_id);
    if (fn) {
        Py_INCREF(fn); /* the call may evict it */
        result = call_with_args(fn, args);
        Py_DECREF(fn);
    } else if (g_forward) {
        result = call_generic(g_forward, func_name, callback, requires_grad, tensor_flags, training, inplace_map,
                              invoke_id, safe_mode, args);
    }
    return finish(ret, result, 1, "forward", gil);
}

cxx_vector *ortwrap_backward_runner(cxx_vector *ret, const char *func_name, void *callback,
                                    const cxx_vector *requires_grad, const cxx_vector *tensor_flags,
                                    _Bool training, const cxx_vector *inplace_map,
                                    const char *invoke_id, _Bool safe_mode, const cxx_vector *args) {
    (void)func_name; (void)callback; (void)requires_grad; (void)tensor_flags; (void)training;
    (void)inplace_map; (void)invoke_id; (void)safe_mode;
    ret->begin = ret->end = ret->end_of_storage = NULL;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *const *p = (PyObject *const *)args->begin;
    PyObject *fn = NULL, *result = NULL;
    if (p != (PyObject *const *)args->end && p[0] && Py_TYPE(p[0]) == g_handle_type) {
        fn = PyObject_GetAttr(p[0], g_str_backward); /* the node's generated backward, or None */
        if (!fn) PyErr_Clear();
        else if (fn == Py_None) Py_CLEAR(fn);
    }
    if (fn || g_backward) result = call_with_args(fn ? fn : g_backward, args);
    Py_XDECREF(fn);
    return finish(ret, result, 0, "backward", gil);
}

/* Called through ctypes.PyDLL (GIL held). Returns 0 on success. */
int ortwrap_bridge_set_handlers(PyObject *forward, PyObject *backward, PyObject *lookup, PyObject *on_error,
                                PyObject *handle_type) {
    if (!PyType_Check(handle_type)) return -1;
    if (!g_str_backward && !(g_str_backward = PyUnicode_InternFromString("backward"))) return -1;
    Py_INCREF(handle_type);
    Py_XSETREF(g_handle_type, (PyTypeObject *)handle_type);
    if (!g_new) {
        void *h = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_NOLOAD);
        if (h) g_new = (nothrow_new_fn)dlsym(h, "_ZnwmRKSt9nothrow_t");
    }
    cache_clear();
    Py_XINCREF(forward);
    Py_XINCREF(backward);
    Py_XINCREF(lookup);
    Py_XINCREF(on_error);
    Py_XSETREF(g_forward, forward);
    Py_XSETREF(g_backward, backward);
    Py_XSETREF(g_lookup, lookup);
    Py_XSETREF(g_on_error, on_error);
    return 0;
}

/* 1 when the vector buffer comes from libstdc++'s operator new, 0 when from malloc. */
int ortwrap_bridge_uses_operator_new(void) { return g_new != NULL; }

/* ---- as an extension module ----
 * setup.py builds this file as the extension module ortwrap.bridge._runner (so an installed wheel needs no C compiler);
 * ortwrap loads it with ctypes.PyDLL (bridge/_native.py), never imports it, so the module itself is empty.
 * ORTWRAP_SOURCE_SHA256, set by setup.py, names the source the build came from: _native.py compiles the source
 * instead when it has changed since (a source checkout edited after `pip install -e .`). */
#ifndef ORTWRAP_SOURCE_SHA256
#define ORTWRAP_SOURCE_SHA256 ""
#endif
const char ortwrap_source_sha256[] = ORTWRAP_SOURCE_SHA256;

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_runner",
                                         "ortwrap's native PythonOp runners; loaded with ctypes.", -1, NULL};
PyMODINIT_FUNC PyInit__runner(void) { return PyModule_Create(&module_def); }

/* _nf4deq_launch: the eager CUDA call of the Python package without ctypes.
 *
 * Why: an eager dequantization's host time is what a QLoRA training loop pays
 * on every weight, and ctypes' per-call argument conversion costs 0.4-0.8 us
 * of it on an H200 host (four pointer-sized integers; docs/PERFORMANCE.md).
 * A METH_FASTCALL function takes the same four integers for a fraction of that.
 *
 * It does not link libnf4deq. nf4deq/_torch.py hands bind() the addresses of
 * nf4deq_dequantize_cuda_state and nf4deq_empty_cuda in the library ctypes
 * loaded, so both routes always call one library, and the ABI check stays in
 * _lib.py. Built by `make` when the Python headers are found (pkg-config
 * python3); without it the package uses ctypes, with the same results.
 *
 * The stable ABI of Python 3.10 (METH_FASTCALL is part of it from 3.10): one
 * build serves every later Python. */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#define EXT_API_VERSION 1 /* what nf4deq/_lib.py checks before using the module */
#define STATE_ARGS 4

/* include/nf4deq.h's signatures; struct nf4deq_state is passed through opaque. */
typedef int (*state_fn)(const void *state, const void *packed, void *out, void *stream);
typedef int (*empty_fn)(void *stream);

static state_fn dequantize_state;
static empty_fn launch_empty;

/* A pointer-sized integer (ctypes' c_void_p rules: an int; None is NULL). */
static int as_pointer(PyObject *o, void **p)
{
    if (o == Py_None) {
        *p = NULL;
        return 0;
    }
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "_nf4deq_launch: expected an address (an int or None)");
        return -1;
    }
    *p = PyLong_AsVoidPtr(o);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    void *a = NULL, *b = NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_nf4deq_launch.bind(state_fn, empty_fn): two addresses");
        return NULL;
    }
    if (as_pointer(args[0], &a) || as_pointer(args[1], &b))
        return NULL;
    if (!a || !b) {
        PyErr_SetString(PyExc_ValueError, "_nf4deq_launch.bind: a NULL function address");
        return NULL;
    }
    dequantize_state = (state_fn)a;
    launch_empty = (empty_fn)b;
    Py_RETURN_NONE;
}

static int require_bound(void)
{
    if (dequantize_state && launch_empty)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "_nf4deq_launch: bind() was not called");
    return -1;
}

/* dequantize_cuda_state(state, packed, out, stream) -> int status. The GIL is
 * released around the call, as ctypes does: a launch blocks while the
 * device's launch queue is full. */
static PyObject *dequantize_cuda_state(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    void *p[STATE_ARGS];
    if (nargs != STATE_ARGS) {
        PyErr_SetString(PyExc_TypeError, "dequantize_cuda_state(state, packed, out, stream): four addresses");
        return NULL;
    }
    for (int i = 0; i < STATE_ARGS; i++)
        if (as_pointer(args[i], &p[i]))
            return NULL;
    if (require_bound())
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dequantize_state(p[0], p[1], p[2], p[3]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* empty_cuda(stream) -> int status: the launch floor through this route. */
static PyObject *empty_cuda(PyObject *self, PyObject *stream_arg)
{
    (void)self;
    void *stream = NULL;
    if (as_pointer(stream_arg, &stream) || require_bound())
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = launch_empty(stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

#define FASTCALL(f) ((PyCFunction)(void (*)(void))(f))

static PyMethodDef METHODS[] = {
    {"bind", FASTCALL(bind), METH_FASTCALL, "bind(state_fn, empty_fn): the library's function addresses"},
    {"dequantize_cuda_state", FASTCALL(dequantize_cuda_state), METH_FASTCALL,
     "dequantize_cuda_state(state, packed, out, stream) -> status (nf4deq_dequantize_cuda_state)"},
    {"empty_cuda", empty_cuda, METH_O, "empty_cuda(stream) -> status (nf4deq_empty_cuda)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_nf4deq_launch", "The eager CUDA call of nf4deq without ctypes.", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nf4deq_launch(void)
{
    PyObject *m = PyModule_Create(&MODULE);
    if (m && PyModule_AddIntConstant(m, "API_VERSION", EXT_API_VERSION) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

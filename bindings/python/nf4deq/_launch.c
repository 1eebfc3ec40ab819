/* _nf4deq_launch: the eager CUDA call of the Python package without ctypes.
 *
 * Why: an eager dequantization's host time is what a QLoRA training loop pays
 * on every weight. ctypes' per-call argument conversion costs 0.4-0.8 us of it
 * on an H200 host (four pointer-sized integers; docs/PERFORMANCE.md), and the
 * Python wrapper around the call another 1.5-2 us.
 *
 * Two entry points:
 * - dequantize_cuda_state(): the library call alone, four integers in
 *   (METH_FASTCALL), for the Python path in nf4deq/_torch.py;
 * - eager_cached(): the whole cached call. nf4deq/_torch.py keeps, per quant
 *   state it has launched for, a tuple with everything the launch needs and
 *   everything the Python path would check (see FAST_* below): one cache for
 *   calls that return a new tensor, one for calls into the per-device global
 *   buffer (fast_dequantize's use_global_buffer=True, Unsloth's matmul_lora
 *   call). This function makes those checks in C, gets the output through
 *   PyTorch (a new tensor, or a view of the global buffer), launches, and
 *   returns the tensor. Anything it does not find as cached returns None, and
 *   the Python path takes the call, so what a call returns or raises is the
 *   Python path's by construction.
 *
 * It does not link libnf4deq or libtorch. nf4deq/_lib.py hands bind() the
 * addresses of nf4deq_dequantize_cuda_state and nf4deq_empty_cuda in the
 * library ctypes loaded, so both routes always call one library, and the ABI
 * check stays in _lib.py; nf4deq/_torch.py hands bind_eager() the PyTorch
 * callables. Built by `make` when the Python headers are found (pkg-config
 * python3); without it the package uses ctypes, with the same results.
 *
 * The stable ABI of Python 3.10 (METH_FASTCALL, PyObject_CallNoArgs and
 * PyObject_GenericGetDict are part of it from 3.10): one build serves every
 * later Python. */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#define EXT_API_VERSION 4 /* what nf4deq/_lib.py checks before using the module */
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

/* ---- The cached eager call ------------------------------------------------ */

/* A fast entry: the tuple nf4deq/_torch.py (_register_fast) builds, in this
 * order, after a Python-path call whose quant state and weight it cached. */
enum {
    FAST_QS_REF,           /* weakref to the quant state */
    FAST_ABSMAX,           /* the quant state's attributes when its entry was built: */
    FAST_SHAPE,            /*   absmax, shape, dtype, state2, offset and state2's absmax and */
    FAST_DTYPE,            /*   code compared by identity, the block sizes and quant_type */
    FAST_BLOCKSIZE,        /*   by equality, as _Entry.sources_match does */
    FAST_QUANT_TYPE,
    FAST_STATE2,           /* None for single quant; the next four are then None */
    FAST_OFFSET,
    FAST_NESTED_ABSMAX,
    FAST_NESTED_CODE,
    FAST_NESTED_BLOCKSIZE,
    FAST_SOURCE_PTRS,      /* (absmax, offset, nested absmax, nested code): their data pointers (int, or None
                              where not a tensor), _Entry.src_ptrs: a tensor given new storage is a miss */
    FAST_WEIGHT_REF,       /* weakref to the packed weight */
    FAST_WEIGHT_PTR,       /* its data pointer when it was bound (int) */
    FAST_WEIGHT_LAYOUT,    /* its (shape, stride(), dtype, get_device()), _torch.py's _layout: another
                              tensor over the same bytes with this layout is taken as the bound one */
    FAST_ALLOC,            /* returns the output: FAST_ALLOC(*FAST_ALLOC_ARGS, **FAST_ALLOC_KWARGS), a new
                              tensor, or for the global buffer its cached view's detach() */
    FAST_ALLOC_ARGS,       /* tuple */
    FAST_ALLOC_KWARGS,     /* dict, or None */
    FAST_STATE_ADDR,       /* address of the entry's struct nf4deq_state (int) */
    FAST_DEVICE,           /* CUDA device index (int) */
    FAST_TRANSPOSED,       /* True: return out.t(), as bitsandbytes does for a [1, n] weight (a global-buffer
                              entry's view is transposed already, and says False) */
    FAST_KEEP,             /* the Python entry: keeps the state struct and its tensors alive */
    FAST_FIELDS
};

/* What nf4deq/_torch.py binds: the cache and PyTorch's callables. */
static struct {
    PyObject *cache;             /* dict: id(quant state) -> fast entry, calls that return a new tensor */
    PyObject *global_cache;      /* the same for calls into the global buffer */
    PyObject *tensor_type;       /* torch.Tensor */
    PyObject *parameter_type;    /* torch.nn.Parameter */
    PyObject *data_ptr;          /* torch.Tensor.data_ptr, unbound */
    PyObject *current_device;    /* () -> the current CUDA device index */
    PyObject *raw_stream;        /* (device) -> the current stream's cudaStream_t */
    PyObject *no_torch_function; /* torch._C.DisableTorchFunctionSubclass */
    PyObject *check;             /* nf4deq._lib.check(status, what): raises */
} torch_fns;

enum { BIND_EAGER_ARGS = 9, LAYOUT_FIELDS = 4 };

static PyObject *s_absmax, *s_shape, *s_dtype, *s_blocksize, *s_quant_type, *s_state2, *s_offset, *s_code,
    *s_enter, *s_exit, *s_t, *s_stride, *s_get_device;

static int intern_names(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_absmax, "absmax"},         {&s_shape, "shape"},   {&s_dtype, "dtype"},   {&s_blocksize, "blocksize"},
        {&s_quant_type, "quant_type"}, {&s_state2, "state2"}, {&s_offset, "offset"}, {&s_code, "code"},
        {&s_enter, "__enter__"},       {&s_exit, "__exit__"}, {&s_t, "t"},       {&s_stride, "stride"},
        {&s_get_device, "get_device"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!*names[i].slot && !(*names[i].slot = PyUnicode_InternFromString(names[i].text)))
            return -1;
    return 0;
}

/* bind_eager(cache, global_cache, Tensor, Parameter, data_ptr, current_device,
 * raw_stream, DisableTorchFunctionSubclass, check) */
static PyObject *bind_eager(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != BIND_EAGER_ARGS) {
        PyErr_SetString(PyExc_TypeError, "_nf4deq_launch.bind_eager: nine arguments (cache, global_cache, Tensor, "
                                         "Parameter, data_ptr, current_device, raw_stream, no_torch_function, check)");
        return NULL;
    }
    if (!PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_nf4deq_launch.bind_eager: the caches must be dicts");
        return NULL;
    }
    for (Py_ssize_t i = 2; i < nargs; i++)
        if (!PyCallable_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "_nf4deq_launch.bind_eager: argument %d is not callable", (int)i + 1);
            return NULL;
        }
    PyObject **slots[BIND_EAGER_ARGS] = {
        &torch_fns.cache,          &torch_fns.global_cache,   &torch_fns.tensor_type,
        &torch_fns.parameter_type, &torch_fns.data_ptr,       &torch_fns.current_device,
        &torch_fns.raw_stream,     &torch_fns.no_torch_function, &torch_fns.check,
    };
    for (int i = 0; i < BIND_EAGER_ARGS; i++) {
        PyObject *old = *slots[i];
        Py_INCREF(args[i]);
        *slots[i] = args[i];
        Py_XDECREF(old);
    }
    Py_RETURN_NONE;
}

static PyObject *field(PyObject *entry, int i)
{
    return PyTuple_GetItem(entry, i); /* borrowed; the entry's size was checked */
}

static PyObject *call1(PyObject *fn, PyObject *arg)
{
    return PyObject_CallFunctionObjArgs(fn, arg, NULL);
}

/* The checks below never raise: a failure is a miss, and the Python path,
 * which makes the same checks, raises what it has to. */

static int item_is(PyObject *dict, PyObject *key, PyObject *want)
{
    PyObject *v = PyDict_GetItemWithError(dict, key); /* borrowed */
    if (!v)
        PyErr_Clear();
    return v && v == want;
}

static int item_equals(PyObject *dict, PyObject *key, PyObject *want)
{
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (!v) {
        PyErr_Clear();
        return 0;
    }
    if (v == want)
        return 1;
    Py_INCREF(v); /* __eq__ may run Python code */
    int eq = PyObject_RichCompareBool(v, want, Py_EQ);
    Py_DECREF(v);
    if (eq < 0)
        PyErr_Clear();
    return eq == 1;
}

/* tensor's data pointer is want (an int), or want is None. */
static int pointer_is(PyObject *tensor, PyObject *want)
{
    void *have = NULL, *expect = NULL;
    if (want == Py_None)
        return 1;
    PyObject *p = call1(torch_fns.data_ptr, tensor);
    int ok = p && as_pointer(p, &have) == 0 && as_pointer(want, &expect) == 0 && have == expect;
    Py_XDECREF(p);
    if (!ok)
        PyErr_Clear();
    return ok;
}

/* The source tensors, already known to be the entry's own objects (which the
 * entry keeps alive), still keep their data where the entry points:
 * _Entry._same_storage. */
static int same_storage(PyObject *entry)
{
    PyObject *ptrs = field(entry, FAST_SOURCE_PTRS);
    if (!PyTuple_Check(ptrs) || PyTuple_Size(ptrs) != 4)
        return 0;
    if (!pointer_is(field(entry, FAST_ABSMAX), PyTuple_GetItem(ptrs, 0)))
        return 0;
    if (field(entry, FAST_STATE2) == Py_None)
        return 1;
    return pointer_is(field(entry, FAST_OFFSET), PyTuple_GetItem(ptrs, 1)) &&
           pointer_is(field(entry, FAST_NESTED_ABSMAX), PyTuple_GetItem(ptrs, 2)) &&
           pointer_is(field(entry, FAST_NESTED_CODE), PyTuple_GetItem(ptrs, 3));
}

/* The quant state still holds what its entry was built from: _Entry.sources_match's
 * route through the instance dictionaries (QuantState defines __getattr__, so
 * attribute reads would be slower; an object without a dictionary is a miss). */
static int sources_match(PyObject *entry, PyObject *qs)
{
    PyObject *d = PyObject_GenericGetDict(qs, NULL);
    if (!d) {
        PyErr_Clear();
        return 0;
    }
    int ok = item_is(d, s_absmax, field(entry, FAST_ABSMAX)) && item_is(d, s_shape, field(entry, FAST_SHAPE)) &&
             item_is(d, s_dtype, field(entry, FAST_DTYPE)) &&
             item_equals(d, s_blocksize, field(entry, FAST_BLOCKSIZE)) &&
             item_equals(d, s_quant_type, field(entry, FAST_QUANT_TYPE));
    if (ok) {
        PyObject *state2 = PyDict_GetItemWithError(d, s_state2), *want2 = field(entry, FAST_STATE2);
        if (!state2) {
            PyErr_Clear();
            ok = 0;
        } else if (state2 == Py_None) {
            ok = want2 == Py_None;
        } else if (state2 != want2 || !item_is(d, s_offset, field(entry, FAST_OFFSET))) {
            ok = 0;
        } else { /* state2 is the entry's own object, which the entry keeps alive */
            PyObject *d2 = PyObject_GenericGetDict(state2, NULL);
            if (!d2) {
                PyErr_Clear();
                ok = 0;
            } else {
                ok = item_is(d2, s_absmax, field(entry, FAST_NESTED_ABSMAX)) &&
                     item_is(d2, s_code, field(entry, FAST_NESTED_CODE)) &&
                     item_equals(d2, s_blocksize, field(entry, FAST_NESTED_BLOCKSIZE));
                Py_DECREF(d2);
            }
        }
    }
    Py_DECREF(d);
    return ok && same_storage(entry);
}

/* A weakref still points at obj. */
static int ref_is(PyObject *ref, PyObject *obj)
{
    PyObject *target = PyObject_CallNoArgs(ref);
    if (!target)
        PyErr_Clear();
    int ok = target == obj;
    Py_XDECREF(target);
    return ok;
}

/* One part of the weight's layout equals the bound one's, compared as the
 * tuple comparison in _torch.py compares items. Takes the reference to got. */
static int part_equals(PyObject *got, PyObject *want)
{
    if (!got)
        return 0;
    int eq = got == want ? 1 : PyObject_RichCompareBool(got, want, Py_EQ);
    Py_DECREF(got);
    return eq == 1;
}

/* w's (shape, stride(), dtype, get_device()) equals want, _torch.py's _layout. */
static int layout_matches(PyObject *w, PyObject *want)
{
    if (!PyTuple_Check(want) || PyTuple_Size(want) != LAYOUT_FIELDS)
        return 0;
    return part_equals(PyObject_GetAttr(w, s_shape), PyTuple_GetItem(want, 0)) &&
           part_equals(PyObject_CallMethodObjArgs(w, s_stride, NULL), PyTuple_GetItem(want, 1)) &&
           part_equals(PyObject_GetAttr(w, s_dtype), PyTuple_GetItem(want, 2)) &&
           part_equals(PyObject_CallMethodObjArgs(w, s_get_device, NULL), PyTuple_GetItem(want, 3));
}

/* The weight is at the bound address and, where it is not the bound object
 * itself (layout != NULL), has the bound layout. */
static int weight_reads_as_bound(PyObject *w, void *bound, PyObject *layout)
{
    void *ptr = NULL;
    PyObject *p = call1(torch_fns.data_ptr, w);
    int ok = p && as_pointer(p, &ptr) == 0 && ptr == bound && (!layout || layout_matches(w, layout));
    Py_XDECREF(p);
    return ok;
}

/* The weight, read as the Python path reads it: directly for a plain Tensor or
 * Parameter; with torch functions off for a subclass (bitsandbytes' Params4bit
 * overrides __torch_function__, which would route even data_ptr() and shape
 * through Python). 0: not a tensor, a read failed, or it does not match. */
static int weight_is_bound(PyObject *w, void *bound, PyObject *layout)
{
    PyObject *type = (PyObject *)Py_TYPE(w);
    int ok = 0;
    if (type == torch_fns.tensor_type || type == torch_fns.parameter_type) {
        ok = weight_reads_as_bound(w, bound, layout);
    } else if (PyObject_IsInstance(w, torch_fns.tensor_type) == 1) {
        PyObject *guard = PyObject_CallNoArgs(torch_fns.no_torch_function);
        PyObject *entered = guard ? PyObject_CallMethodObjArgs(guard, s_enter, NULL) : NULL;
        if (entered) {
            Py_DECREF(entered);
            ok = weight_reads_as_bound(w, bound, layout);
            PyErr_Clear(); /* nothing may be pending across __exit__ */
            PyObject *exited = PyObject_CallMethodObjArgs(guard, s_exit, Py_None, Py_None, Py_None, NULL);
            if (!exited)
                ok = 0;
            Py_XDECREF(exited);
        }
        Py_XDECREF(guard);
    }
    PyErr_Clear();
    return ok;
}

/* The quant state and the weight are the ones the entry was built for (the
 * weight object itself, or a tensor over the same bytes with the same layout,
 * such as the W.t() view Unsloth's matmul_lora makes on every call), the
 * entry's device is current, and its stream is known. */
static int entry_holds(PyObject *entry, PyObject *w, PyObject *qs, void **wptr, void **stream)
{
    /* The identities first: the cheapest way to miss. */
    if (!ref_is(field(entry, FAST_QS_REF), qs) || !sources_match(entry, qs))
        return 0;
    PyObject *layout = ref_is(field(entry, FAST_WEIGHT_REF), w) ? NULL : field(entry, FAST_WEIGHT_LAYOUT);
    if (layout == Py_None || as_pointer(field(entry, FAST_WEIGHT_PTR), wptr) || !weight_is_bound(w, *wptr, layout)) {
        PyErr_Clear();
        return 0;
    }
    PyObject *dev = field(entry, FAST_DEVICE), *cur = PyObject_CallNoArgs(torch_fns.current_device);
    int same_dev = cur ? PyObject_RichCompareBool(cur, dev, Py_EQ) : -1;
    Py_XDECREF(cur);
    PyObject *s = same_dev == 1 ? call1(torch_fns.raw_stream, dev) : NULL;
    int ok = s && as_pointer(s, stream) == 0;
    Py_XDECREF(s);
    if (!ok)
        PyErr_Clear();
    return ok;
}

/* The output (FAST_ALLOC) and the launch; from here on, failures raise. */
static PyObject *launch_into_output(PyObject *entry, void *wptr, void *stream)
{
    void *state = NULL, *optr = NULL;
    if (as_pointer(field(entry, FAST_STATE_ADDR), &state))
        return NULL;
    PyObject *args = field(entry, FAST_ALLOC_ARGS), *kwargs = field(entry, FAST_ALLOC_KWARGS);
    if (!PyTuple_Check(args) || (kwargs != Py_None && !PyDict_Check(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "_nf4deq_launch: a cache entry's allocation needs a tuple and a dict or None");
        return NULL;
    }
    PyObject *out = PyObject_Call(field(entry, FAST_ALLOC), args, kwargs == Py_None ? NULL : kwargs);
    if (!out)
        return NULL;
    PyObject *p = call1(torch_fns.data_ptr, out);
    int bad = !p || as_pointer(p, &optr);
    Py_XDECREF(p);
    if (bad) {
        Py_DECREF(out);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dequantize_state(state, wptr, optr, stream);
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(out);
        PyObject *r = PyObject_CallFunction(torch_fns.check, "is", rc, "nf4deq_dequantize_cuda");
        if (r) { /* check() returns only for OK */
            Py_DECREF(r);
            PyErr_Format(PyExc_RuntimeError, "nf4deq_dequantize_cuda: status %d", rc);
        }
        return NULL;
    }
    if (field(entry, FAST_TRANSPOSED) == Py_True) {
        PyObject *t = PyObject_CallMethodObjArgs(out, s_t, NULL);
        Py_DECREF(out);
        return t;
    }
    return out;
}

/* eager_cached(weight, quant_state[, use_global_buffer]) -> the dequantized
 * tensor, or None when the call is not cached (the caller then takes the
 * Python path). use_global_buffer is taken by its truth, as the Python path
 * takes it. */
static PyObject *eager_cached(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "eager_cached(weight, quant_state[, use_global_buffer]): two or three "
                                         "arguments");
        return NULL;
    }
    if (require_bound())
        return NULL;
    if (!torch_fns.cache) {
        PyErr_SetString(PyExc_RuntimeError, "_nf4deq_launch: bind_eager() was not called");
        return NULL;
    }
    const int global = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (global < 0)
        return NULL;
    PyObject *key = PyLong_FromVoidPtr(args[1]); /* id(quant_state) */
    if (!key)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(global ? torch_fns.global_cache : torch_fns.cache, key);
    Py_DECREF(key);
    if (!entry) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    if (!PyTuple_Check(entry) || PyTuple_Size(entry) != FAST_FIELDS) {
        PyErr_Format(PyExc_TypeError, "_nf4deq_launch: a cache entry must be a tuple of %d items", FAST_FIELDS);
        return NULL;
    }
    Py_INCREF(entry); /* the checks call Python code, which may drop it from the cache */
    void *wptr = NULL, *stream = NULL;
    PyObject *res;
    if (entry_holds(entry, args[0], args[1], &wptr, &stream)) {
        res = launch_into_output(entry, wptr, stream);
    } else {
        res = Py_None;
        Py_INCREF(res);
    }
    Py_DECREF(entry);
    return res;
}

#define FASTCALL(f) ((PyCFunction)(void (*)(void))(f))

static PyMethodDef METHODS[] = {
    {"bind", FASTCALL(bind), METH_FASTCALL, "bind(state_fn, empty_fn): the library's function addresses"},
    {"dequantize_cuda_state", FASTCALL(dequantize_cuda_state), METH_FASTCALL,
     "dequantize_cuda_state(state, packed, out, stream) -> status (nf4deq_dequantize_cuda_state)"},
    {"empty_cuda", empty_cuda, METH_O, "empty_cuda(stream) -> status (nf4deq_empty_cuda)"},
    {"bind_eager", FASTCALL(bind_eager), METH_FASTCALL,
     "bind_eager(cache, global_cache, Tensor, Parameter, data_ptr, current_device, raw_stream, "
     "no_torch_function, check)"},
    {"eager_cached", FASTCALL(eager_cached), METH_FASTCALL,
     "eager_cached(weight, quant_state[, use_global_buffer]) -> the output tensor, or None when the call is "
     "not cached"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_nf4deq_launch", "The eager CUDA call of nf4deq without ctypes.", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nf4deq_launch(void)
{
    if (intern_names())
        return NULL;
    PyObject *m = PyModule_Create(&MODULE);
    /* The fast entry's size and the positions a caller may need to read or patch
     * (bench.py swaps the state, tests/ the allocation and its arguments), from
     * the enum itself. */
    if (m && (PyModule_AddIntConstant(m, "API_VERSION", EXT_API_VERSION) != 0 ||
              PyModule_AddIntConstant(m, "FAST_FIELDS", FAST_FIELDS) != 0 ||
              PyModule_AddIntConstant(m, "FAST_ALLOC", FAST_ALLOC) != 0 ||
              PyModule_AddIntConstant(m, "FAST_ALLOC_ARGS", FAST_ALLOC_ARGS) != 0 ||
              PyModule_AddIntConstant(m, "FAST_STATE_ADDR", FAST_STATE_ADDR) != 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

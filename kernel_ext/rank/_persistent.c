/* MPI's persistent collectives (persistent.py), started and waited for in C.
 *
 * Why C: between hosts a broadcast of 4 KiB takes some 10-15 µs, and the Python around
 * it (the tensor's plan, the lookup of its persistent request, two NumPy copies, Start,
 * the wait loop) took 2-3 µs more a call on each rank; ranks that share a core pay each
 * other's (a rank's peer completes only once it is back asking MPI). Here, for a tensor
 * with a plan (`Planned`), one call does all of it: copy in, MPI_Start, ask MPI_Test
 * until done or for at most `spin_s`, copy out. A wait longer than that goes to the
 * plan's Python wait (waiting.drive / wait_interruptibly), where the stop button and an
 * abort land as they do for every other wait.
 *
 * MPI_Start and MPI_Test are called through the addresses of the MPI library that
 * mpi4py loaded (`bind`), on the request handle inside mpi4py's own object, so this
 * module needs no MPI headers and works with whichever MPI mpi4py uses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <sched.h>
#include <string.h>
#include <time.h>

/* How long a wait asks MPI here before the plan's Python wait takes over: waiting.py's
 * spin (SPIN_S, given to `bind`), within which a small collective between hosts
 * completes. An abort is seen once the Python wait runs. */
static double spin_s;
/* Between asks, at most this often, the core is yielded with the GIL released and
 * Python's signal handlers run. Yielding after every ask (as waiting.drive, whose asks
 * cost more) made ranks that share a core hand it back and forth for nothing: 4 ranks on
 * 2 emulated hosts, µs a call at 4 KiB, broadcast / allgather 16.1 / 51.8 yielding after
 * every ask, 10.9 / 48.4 every 2 µs, 10.3 / 44.9 every 5 µs (mpi4py 12.2 / 43.3). */
#define YIELD_EVERY_S 0.000005

typedef int (*start_fn)(void *request);
typedef int (*test_fn)(void *request, int *flag, void *status);

static start_fn mpi_start;
static test_fn mpi_test;
static PyObject *mpi_exception; /* mpi4py's MPI.Exception: raised with MPI's error code */
static PyObject *s_broadcast, *s_allgather;

static inline double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* ---- Kept: one persistent request with its own buffers ---------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *request;            /* the mpi4py request */
    void *handle;                 /* its MPI_Request, inside it */
    PyObject *send_owner, *recv_owner;
    char *send, *recv;
    Py_ssize_t send_n, recv_n;
    int started;                  /* started and not yet seen complete */
    int alive;                    /* not yet closed */
} Kept;

static int buffer_of(PyObject *owner, char **data, Py_ssize_t *n)
{
    Py_buffer view;
    if (PyObject_GetBuffer(owner, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    *data = view.buf; /* the owner (a NumPy array of its own) keeps the memory */
    *n = view.len;
    PyBuffer_Release(&view);
    return 0;
}

static int kept_init(Kept *self, PyObject *args, PyObject *kwds)
{
    PyObject *request, *address, *send, *recv;
    if (!PyArg_ParseTuple(args, "OOOO:Kept", &request, &address, &send, &recv))
        return -1;
    void *handle = PyLong_AsVoidPtr(address);
    if (handle == NULL)
        return PyErr_Occurred() ? -1 : (PyErr_SetString(PyExc_ValueError, "no handle"), -1);
    if (buffer_of(send, &self->send, &self->send_n) < 0 ||
        buffer_of(recv, &self->recv, &self->recv_n) < 0)
        return -1;
    Py_XSETREF(self->request, Py_NewRef(request));
    Py_XSETREF(self->send_owner, Py_NewRef(send));
    Py_XSETREF(self->recv_owner, Py_NewRef(recv));
    self->handle = handle;
    self->alive = 1;
    self->started = 0;
    return 0;
}

static void kept_dealloc(Kept *self)
{
    Py_XDECREF(self->request);
    Py_XDECREF(self->send_owner);
    Py_XDECREF(self->recv_owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int raise_mpi(int code)
{
    PyObject *e = PyObject_CallFunction(mpi_exception, "i", code);
    if (e != NULL) {
        PyErr_SetObject(mpi_exception, e);
        Py_DECREF(e);
    }
    return -1;
}

/* Copy `in_n` bytes from `in` into the send buffer, run the collective, copy `out_n`
 * bytes of the receive buffer to `out`. An exception from `wait` (an abort, the stop
 * button) leaves the request started: `close` then keeps it. */
static int kept_run(Kept *self, const char *in, Py_ssize_t in_n, char *out, Py_ssize_t out_n,
                    PyObject *wait)
{
    if (!self->alive) {
        PyErr_SetString(PyExc_RuntimeError, "a closed persistent request was run");
        return -1;
    }
    if (mpi_start == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a persistent request was run before bind()");
        return -1;
    }
    if (in_n > self->send_n || out_n > self->recv_n) {
        PyErr_SetString(PyExc_ValueError, "more bytes than the persistent request's buffers");
        return -1;
    }
    if (in_n)
        memcpy(self->send, in, in_n);
    int code = mpi_start(self->handle);
    if (code != 0)
        return raise_mpi(code);
    self->started = 1;
    int flag = 0;
    char status[256]; /* larger than any MPI's MPI_Status */
    double started = now(), yielded = started;
    for (;;) {
        code = mpi_test(self->handle, &flag, status);
        if (code != 0 || flag)
            break;
        double t = now();
        if (t - started > spin_s)
            break;
        if (t - yielded >= YIELD_EVERY_S) {
            if (PyErr_CheckSignals() < 0)
                return -1; /* Ctrl-C lands here as between two asks of waiting.drive */
            Py_BEGIN_ALLOW_THREADS
            sched_yield();
            Py_END_ALLOW_THREADS
            yielded = now();
        }
    }
    if (!flag) { /* a long wait, or MPI's error, which the Python Test raises */
        PyObject *r = PyObject_CallOneArg(wait, self->request);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    self->started = 0;
    if (out_n)
        memcpy(out, self->recv, out_n);
    return 0;
}

static int optional_buffer(PyObject *obj, Py_buffer *view, int writable)
{
    if (obj == Py_None) {
        view->obj = NULL;
        view->buf = NULL;
        view->len = 0;
        return 0;
    }
    return PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS);
}

PyDoc_STRVAR(kept_run_doc,
"run(send, recv, wait): `send` (a buffer, or None) copied in, the collective started and\n"
"waited for (`wait(request)` past a short spin), then the result copied to `recv` (a\n"
"writable buffer, or None): as many bytes as each holds.");

static PyObject *kept_run_method(Kept *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run(send, recv, wait)");
        return NULL;
    }
    Py_buffer in, out;
    if (optional_buffer(args[0], &in, 0) < 0)
        return NULL;
    if (optional_buffer(args[1], &out, 1) < 0) {
        if (in.obj != NULL)
            PyBuffer_Release(&in);
        return NULL;
    }
    int r = kept_run(self, in.buf, in.len, out.buf, out.len, args[2]);
    if (in.obj != NULL)
        PyBuffer_Release(&in);
    if (out.obj != NULL)
        PyBuffer_Release(&out);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(kept_close_doc,
"close(): this request is no longer run; freed unless an abort left it started (freeing\n"
"an active persistent request is erroneous in MPI). True where it was left started: the\n"
"caller then keeps it, with its buffers, until MPI completes it (waiting.abandon).");

static PyObject *kept_close(Kept *self, PyObject *unused)
{
    self->alive = 0;
    if (self->started)
        Py_RETURN_TRUE;
    PyObject *r = PyObject_CallMethod(self->request, "Free", NULL);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyMethodDef kept_methods[] = {
    {"run", (PyCFunction)(void (*)(void))kept_run_method, METH_FASTCALL, kept_run_doc},
    {"close", (PyCFunction)kept_close, METH_NOARGS, kept_close_doc},
    {NULL},
};

static PyMemberDef kept_members[] = {
    {"alive", T_INT, offsetof(Kept, alive), READONLY, "not yet closed"},
    {"request", T_OBJECT, offsetof(Kept, request), READONLY, "the mpi4py request"},
    {NULL},
};

static PyTypeObject KeptType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpilab.rank._persistent.Kept",
    .tp_doc = PyDoc_STR("Kept(request, handle_address, send, recv): a persistent "
                        "collective on buffers of its own (NumPy arrays)."),
    .tp_basicsize = sizeof(Kept),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)kept_init,
    .tp_dealloc = (destructor)kept_dealloc,
    .tp_methods = kept_methods,
    .tp_members = kept_members,
};

/* ---- Planned: a tensor's small broadcast or allgather ------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *resolve;   /* key -> Kept, or None where this MPI has none (Persistent._entry) */
    PyObject *wait;      /* the plan's wait, for a long one */
    PyObject *fallback;  /* where resolve gives None: fallback(arg) */
    Kept *kept;          /* the request of the last call, while alive */
    long root;           /* a broadcast's, of that call */
    char *address;       /* the tensor's memory */
    Py_ssize_t nbytes;
    int gather, rank, size;
} Planned;

static void planned_dealloc(Planned *self)
{
    Py_XDECREF(self->resolve);
    Py_XDECREF(self->wait);
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->kept);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The request for this call: the last one while it is alive (and, for a broadcast, of
 * the same root), else the one resolve gives (made now, where new: every rank asks at
 * the same call). 0 where resolve gave None. */
static int planned_kept(Planned *self, long root)
{
    if (self->kept != NULL && self->kept->alive && (self->gather || root == self->root))
        return 1;
    PyObject *key = self->gather ?
        Py_BuildValue("(On)", s_allgather, self->nbytes) :
        Py_BuildValue("(Onl)", s_broadcast, self->nbytes, root);
    if (key == NULL)
        return -1;
    PyObject *kept = PyObject_CallOneArg(self->resolve, key);
    Py_DECREF(key);
    if (kept == NULL)
        return -1;
    if (kept == Py_None) {
        Py_DECREF(kept);
        Py_CLEAR(self->kept);
        return 0;
    }
    if (!Py_IS_TYPE(kept, &KeptType)) {
        Py_DECREF(kept);
        PyErr_SetString(PyExc_TypeError, "resolve must give a Kept or None");
        return -1;
    }
    Py_XSETREF(self->kept, (Kept *)kept);
    self->root = root;
    return 1;
}

static PyObject *planned_call(Planned *self, PyObject *const *args, size_t nargsf,
                              PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, self->gather ? "gather(address)" : "broadcast(root)");
        return NULL;
    }
    long root = 0;
    char *out = NULL;
    if (self->gather) {
        out = PyLong_AsVoidPtr(args[0]);
        if (out == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "no receive address");
            return NULL;
        }
    } else {
        root = PyLong_AsLong(args[0]);
        if (root == -1 && PyErr_Occurred())
            return NULL;
    }
    int found = planned_kept(self, root);
    if (found < 0)
        return NULL;
    if (found == 0)
        return PyObject_CallOneArg(self->fallback, args[0]);
    int r;
    Kept *kept = (Kept *)Py_NewRef(self->kept); /* held while Python code may run */
    if (self->gather)
        r = kept_run(kept, self->address, self->nbytes, out, self->nbytes * self->size,
                     self->wait);
    else if (root == self->rank)
        r = kept_run(kept, self->address, self->nbytes, NULL, 0, self->wait);
    else
        r = kept_run(kept, NULL, 0, self->address, self->nbytes, self->wait);
    Py_DECREF(kept);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int planned_init(Planned *self, PyObject *args, PyObject *kwds)
{
    PyObject *resolve, *wait, *fallback, *address;
    Py_ssize_t nbytes;
    int gather, rank, size;
    if (!PyArg_ParseTuple(args, "OOOOnpii:Planned", &resolve, &wait, &fallback, &address,
                          &nbytes, &gather, &rank, &size))
        return -1;
    self->address = PyLong_AsVoidPtr(address);
    if (self->address == NULL && PyErr_Occurred())
        return -1;
    Py_XSETREF(self->resolve, Py_NewRef(resolve));
    Py_XSETREF(self->wait, Py_NewRef(wait));
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    Py_CLEAR(self->kept);
    self->nbytes = nbytes;
    self->gather = gather;
    self->rank = rank;
    self->size = size;
    self->vectorcall = (vectorcallfunc)planned_call;
    return 0;
}

static PyTypeObject PlannedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpilab.rank._persistent.Planned",
    .tp_doc = PyDoc_STR(
        "Planned(resolve, wait, fallback, address, nbytes, gather, rank, size): the small "
        "broadcast (called with the root) or allgather (called with the receive buffer's "
        "address) of the `nbytes` at `address`, by a persistent request."),
    .tp_basicsize = sizeof(Planned),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Planned, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)planned_init,
    .tp_dealloc = (destructor)planned_dealloc,
};

/* ---- the module ---------------------------------------------------------------- */

PyDoc_STRVAR(bind_doc,
"bind(start_address, test_address, exception, spin_s): MPI_Start and MPI_Test of the MPI\n"
"library mpi4py loaded, mpi4py's MPI.Exception (raised with MPI's error code), and how\n"
"long a wait asks MPI here before the plan's wait takes over (waiting.SPIN_S).");

static PyObject *bind(PyObject *unused, PyObject *args)
{
    PyObject *start, *test, *exception;
    double spin;
    if (!PyArg_ParseTuple(args, "OOOd:bind", &start, &test, &exception, &spin))
        return NULL;
    void *s = PyLong_AsVoidPtr(start), *t = PyLong_AsVoidPtr(test);
    if (PyErr_Occurred())
        return NULL;
    if (s == NULL || t == NULL) {
        PyErr_SetString(PyExc_ValueError, "bind needs both functions' addresses");
        return NULL;
    }
    mpi_start = (start_fn)s;
    mpi_test = (test_fn)t;
    spin_s = spin;
    Py_XSETREF(mpi_exception, Py_NewRef(exception));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS, bind_doc},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_persistent",
    "MPI's persistent collectives started and waited for in C (persistent.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__persistent(void)
{
    s_broadcast = PyUnicode_InternFromString("broadcast");
    s_allgather = PyUnicode_InternFromString("allgather");
    if (s_broadcast == NULL || s_allgather == NULL || PyType_Ready(&KeptType) < 0 ||
        PyType_Ready(&PlannedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Kept", (PyObject *)&KeptType) < 0 ||
        PyModule_AddObjectRef(m, "Planned", (PyObject *)&PlannedType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* The context of one collective (agent.Collective), in C.
 *
 * Why C: every collective of mpilab is announced to the rank's agent (heartbeats carry
 * the one in progress, a span records it), and a collective of a few KiB on shared
 * memory takes a fraction of a microsecond, while the Python context manager took about
 * 0.45 µs. Here the same work: the clock read, the numbering, the heartbeat's reference
 * to the collective in progress, the recent list for mismatch reports, the span row.
 *
 * The state it writes is the agent's RankState (a Python object: its `seq`, `current`
 * and `recent`); the span goes to `queue` (the agent's queue's append), or, without a
 * notebook, to the agent's `span` method where an `emit` replaced on the agent captures
 * records, and nowhere otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *agent, *state, *op, *nbytes, *shape, *previous, *queue, *recent_append;
    double start;
    int numbered;
} Collective;

static PyObject *one, *s_seq, *s_current, *s_recent, *s_append, *s_state, *s_address, *s_queue,
    *s_span, *s_emit;

static inline double wall_time(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* enter: the number of this collective (the main thread's), or the last one's */
static PyObject *enter(Collective *self)
{
    self->start = wall_time();
    PyObject *seq = PyObject_GetAttr(self->state, s_seq);
    if (seq == NULL || !self->numbered)
        return seq;
    PyObject *next = PyNumber_Add(seq, one);
    Py_DECREF(seq);
    if (next == NULL || PyObject_SetAttr(self->state, s_seq, next) < 0)
        goto fail;
    PyObject *previous = PyObject_GetAttr(self->state, s_current);
    if (previous == NULL)
        goto fail;
    Py_XSETREF(self->previous, previous);
    if (PyObject_SetAttr(self->state, s_current, (PyObject *)self) < 0)
        goto fail;
    PyObject *item = PyTuple_Pack(3, next, self->op, self->nbytes);
    if (item == NULL)
        goto fail;
    PyObject *r = PyObject_CallOneArg(self->recent_append, item);
    Py_DECREF(item);
    if (r == NULL)
        goto fail;
    Py_DECREF(r);
    return next;
fail:
    Py_XDECREF(next);
    return NULL;
}

/* Without a notebook, spans go only to a capture: an `emit` set on the agent itself
 * (agent.Agent.span). Looked up here, at every span, so a capture set after the context
 * was made still gets it; without one the call to agent.span (~0.1 µs) is spared. */
static int captured(PyObject *agent)
{
    PyObject *dict = PyObject_GenericGetDict(agent, NULL);
    int found = dict == NULL ? -1 : PyDict_Contains(dict, s_emit);
    Py_XDECREF(dict);
    if (found < 0) {  /* no instance dict: agent.span decides */
        PyErr_Clear();
        return 1;
    }
    return found;
}

/* exit: the heartbeat's reference back, the span out. Keeps a pending exception. */
static int leave(Collective *self)
{
    double end = wall_time();
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    int status = 0;
    if (self->numbered) {
        PyObject *previous = self->previous ? self->previous : Py_None;
        status = PyObject_SetAttr(self->state, s_current, previous);
        Py_CLEAR(self->previous);
    }
    PyObject *seq = status < 0 ? NULL : PyObject_GetAttr(self->state, s_seq);
    PyObject *ts = PyFloat_FromDouble(self->start), *te = PyFloat_FromDouble(end);
    PyObject *r = NULL;
    if (seq != NULL && ts != NULL && te != NULL) {
        if (self->queue != Py_None) {
            PyObject *row = PyTuple_Pack(5, self->op, ts, te, self->nbytes, seq);
            if (row != NULL) {
                r = PyObject_CallOneArg(self->queue, row);
                Py_DECREF(row);
            }
        } else if (captured(self->agent)) {
            PyObject *args[] = {self->agent, self->op, ts, te, self->nbytes, seq};
            r = PyObject_VectorcallMethod(s_span, args, 6, NULL);
        } else {  /* no notebook and no capture: the span goes nowhere */
            r = Py_NewRef(Py_None);
        }
    }
    Py_XDECREF(seq);
    Py_XDECREF(ts);
    Py_XDECREF(te);
    if (r == NULL)
        status = -1;
    Py_XDECREF(r);
    if (exc_type != NULL) {  /* the collective's own exception wins */
        if (status < 0)
            PyErr_Clear();
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return -1;
    }
    return status;
}

static PyObject *Collective_enter(Collective *self, PyObject *unused)
{
    return enter(self);
}

static PyObject *Collective_exit(Collective *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (leave(self) < 0)
        return NULL;
    Py_RETURN_FALSE;
}

/* run(fn, *args): fn(*args) inside this collective's context, without a `with`. */
static PyObject *Collective_run(Collective *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "run(fn, *args)");
        return NULL;
    }
    PyObject *seq = enter(self);
    if (seq == NULL)
        return NULL;
    Py_DECREF(seq);
    PyObject *result = PyObject_Vectorcall(args[0], args + 1, nargs - 1, NULL);
    if (leave(self) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static int Collective_init(Collective *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"agent", "op", "nbytes", "shape", "numbered", NULL};
    PyObject *agent, *op, *nbytes, *shape;
    int numbered;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOp", kw, &agent, &op, &nbytes, &shape,
                                     &numbered))
        return -1;
    PyObject *state = PyObject_GetAttr(agent, s_state);
    if (state == NULL)
        return -1;
    PyObject *recent = PyObject_GetAttr(state, s_recent);
    PyObject *recent_append = recent ? PyObject_GetAttr(recent, s_append) : NULL;
    Py_XDECREF(recent);
    PyObject *address = recent_append ? PyObject_GetAttr(agent, s_address) : NULL;
    PyObject *queue = NULL;
    if (address != NULL) {
        if (address == Py_None) {
            queue = Py_NewRef(Py_None);
        } else {
            PyObject *q = PyObject_GetAttr(agent, s_queue);
            queue = q ? PyObject_GetAttr(q, s_append) : NULL;
            Py_XDECREF(q);
        }
        Py_DECREF(address);
    }
    if (queue == NULL) {
        Py_DECREF(state);
        Py_XDECREF(recent_append);
        return -1;
    }
    Py_XSETREF(self->agent, Py_NewRef(agent));
    Py_XSETREF(self->state, state);
    Py_XSETREF(self->op, Py_NewRef(op));
    Py_XSETREF(self->nbytes, Py_NewRef(nbytes));
    Py_XSETREF(self->shape, Py_NewRef(shape));
    Py_XSETREF(self->queue, queue);
    Py_XSETREF(self->recent_append, recent_append);
    self->numbered = numbered;
    self->start = 0.0;
    return 0;
}

static int Collective_traverse(Collective *self, visitproc visit, void *arg)
{
    Py_VISIT(self->agent);
    Py_VISIT(self->state);
    Py_VISIT(self->op);
    Py_VISIT(self->nbytes);
    Py_VISIT(self->shape);
    Py_VISIT(self->previous);
    Py_VISIT(self->queue);
    Py_VISIT(self->recent_append);
    return 0;
}

static int Collective_clear(Collective *self)
{
    Py_CLEAR(self->agent);
    Py_CLEAR(self->state);
    Py_CLEAR(self->op);
    Py_CLEAR(self->nbytes);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->previous);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->recent_append);
    return 0;
}

static void Collective_dealloc(Collective *self)
{
    PyObject_GC_UnTrack(self);
    Collective_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Collective_methods[] = {
    {"__enter__", (PyCFunction)Collective_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Collective_exit, METH_FASTCALL, NULL},
    {"run", (PyCFunction)(void (*)(void))Collective_run, METH_FASTCALL,
     "run(fn, *args): fn(*args) inside this collective's context"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Collective_members[] = {
    {"agent", T_OBJECT, offsetof(Collective, agent), READONLY, "the agent it reports to"},
    {"op", T_OBJECT, offsetof(Collective, op), READONLY, "the collective's name"},
    {"nbytes", T_OBJECT, offsetof(Collective, nbytes), READONLY, "the bytes it moves"},
    {"shape", T_OBJECT, offsetof(Collective, shape), READONLY,
     "what it is on: a text, or a tensor's shape (formatted by a heartbeat)"},
    {"numbered", T_INT, offsetof(Collective, numbered), READONLY,
     "the main thread's (numbered, in heartbeats) or another thread's (a span only)"},
    {"start", T_DOUBLE, offsetof(Collective, start), READONLY, "when it was last entered"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CollectiveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpilab.rank._collective.Collective",
    .tp_doc = PyDoc_STR(
        "Collective(agent, op, nbytes, shape, numbered): the context of one collective:\n"
        "`with` it (or .run(fn, *args)) around the collective. Numbered ones (the main\n"
        "thread's) count in the agent's state and show in its heartbeats; every one\n"
        "leaves a span."),
    .tp_basicsize = sizeof(Collective),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Collective_init,
    .tp_dealloc = (destructor)Collective_dealloc,
    .tp_traverse = (traverseproc)Collective_traverse,
    .tp_clear = (inquiry)Collective_clear,
    .tp_methods = Collective_methods,
    .tp_members = Collective_members,
};

static struct PyModuleDef collective_module = {
    PyModuleDef_HEAD_INIT, "_collective", "The context of one collective (see agent.py).", -1,
    NULL,
};

PyMODINIT_FUNC PyInit__collective(void)
{
    if (PyType_Ready(&CollectiveType) < 0)
        return NULL;
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    if ((one = PyLong_FromLong(1)) == NULL)
        return NULL;
    INTERN(s_seq, "seq");
    INTERN(s_current, "current");
    INTERN(s_recent, "recent");
    INTERN(s_append, "append");
    INTERN(s_state, "state");
    INTERN(s_address, "address");
    INTERN(s_queue, "_queue");
    INTERN(s_span, "span");
    INTERN(s_emit, "emit");
    PyObject *m = PyModule_Create(&collective_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CollectiveType);
    if (PyModule_AddObject(m, "Collective", (PyObject *)&CollectiveType) < 0) {
        Py_DECREF(&CollectiveType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

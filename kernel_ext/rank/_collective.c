/* The context of one collective (agent.Collective), and the public collectives' way in
 * for a tensor with a plan (collectives.TensorPlan), in C.
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
 *
 * `run_planned` is what `mpilab.allreduce(t)`, `mpilab.broadcast(t)` and
 * `mpilab.allgather(t, out=o)` do for a CPU tensor with a plan: check that the plan still
 * holds for the tensor, then run the plan's function inside the plan's kept context. The
 * same steps in Python cost 0.2-0.35 µs more a call (2 ranks, 4 KiB), about as much as the
 * one-piece collective itself. `kept_here` is the rule for a kept context, for both paths
 * (waiting.reuse is the Python one's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <pythread.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *agent, *state, *op, *nbytes, *shape, *previous, *queue, *recent_append;
    double start;
    int numbered;
} Collective;

static PyObject *one, *s_seq, *s_current, *s_recent, *s_append, *s_state, *s_address, *s_queue,
    *s_span, *s_emit, *s_ptr, *s_shape, *s_dtype, *s_data_ptr, *s_is_contiguous,
    *s_agent, *s_main_ident;

/* The agent module (`follow`): its `_agent` and `_main_ident` say whether a kept context
 * applies on this thread (waiting.reuse's rule). */
static PyObject *agent_module;

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

/* -- a tensor's plan ---------------------------------------------------------------------- */
/* 1 where `have` equals `want`, 0 where not, -1 on an error. */
static int same(PyObject *have, PyObject *want)
{
    if (have == NULL || want == NULL)
        return -1;
    return have == want ? 1 : PyObject_RichCompareBool(have, want, Py_EQ);
}

/* Whether plan `plan` still holds for `tensor` (collectives.tensor_plan's check): the
 * tensor still has that memory, shape and dtype, contiguous. Whether it is the object the
 * plan was made for does not matter: the plan's functions are bound to that memory, and a
 * plan goes from `plans` with its tensor (a weak reference's callback), so a plan found
 * by a tensor's id is its own in any case. An object whose accessors fail has no plan
 * (the general path says what is wrong with it). */
static int holds(PyObject *plan, PyObject *tensor)
{
    PyObject *have = PyObject_CallMethodNoArgs(tensor, s_data_ptr);
    PyObject *want = PyObject_GetAttr(plan, s_ptr);
    int ok = same(have, want);
    Py_XDECREF(have);
    Py_XDECREF(want);
    if (ok == 1) {
        have = PyObject_GetAttr(tensor, s_shape);
        want = PyObject_GetAttr(plan, s_shape);
        ok = same(have, want);
        Py_XDECREF(have);
        Py_XDECREF(want);
    }
    if (ok == 1) {
        have = PyObject_GetAttr(tensor, s_dtype);
        want = PyObject_GetAttr(plan, s_dtype);
        ok = have == NULL || want == NULL ? -1 : have == want;
        Py_XDECREF(have);
        Py_XDECREF(want);
    }
    if (ok == 1) {
        have = PyObject_CallMethodNoArgs(tensor, s_is_contiguous);
        ok = have == NULL ? -1 : have == Py_True;
        Py_XDECREF(have);
    }
    if (ok < 0) {
        PyErr_Clear();
        ok = 0;
    }
    return ok;
}

/* The plan in `plans` (id → plan) of `tensor` where it still holds; NULL otherwise, with
 * an exception set only where `plans` is not a dict. A new reference. */
static PyObject *plan_of(PyObject *plans, PyObject *tensor)
{
    if (!PyDict_Check(plans)) {
        PyErr_SetString(PyExc_TypeError, "plans must be a dict");
        return NULL;
    }
    PyObject *key = PyLong_FromVoidPtr(tensor);
    if (key == NULL)
        return NULL;
    PyObject *plan = PyDict_GetItemWithError(plans, key);
    Py_DECREF(key);
    if (plan == NULL)
        return NULL;
    Py_INCREF(plan);
    if (holds(plan, tensor))
        return plan;
    Py_DECREF(plan);
    return NULL;
}

/* planned(plans, tensor): tensor's plan in `plans` (a dict by id) where it still holds for
 * the tensor, else None. */
static PyObject *planned(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "planned(plans, tensor)");
        return NULL;
    }
    PyObject *plan = plan_of(args[0], args[1]);
    if (plan == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return plan;
}

/* Whether a context kept for the main thread applies here: on the main thread, made for
 * the agent now in place (waiting.reuse). -1 on an error. */
static int kept_applies(Collective *context)
{
    if (agent_module == NULL)
        return 0;
    PyObject *agent = PyObject_GetAttr(agent_module, s_agent);
    if (agent == NULL)
        return -1;
    int ok = agent == context->agent;
    Py_DECREF(agent);
    if (!ok)
        return 0;
    PyObject *main = PyObject_GetAttr(agent_module, s_main_ident);
    if (main == NULL)
        return -1;
    PyObject *ident = PyList_Check(main) && PyList_GET_SIZE(main) == 1 ?
        PyList_GET_ITEM(main, 0) : Py_None;
    ok = PyLong_Check(ident) &&
        PyLong_AsUnsignedLong(ident) == PyThread_get_thread_ident();
    Py_DECREF(main);
    if (PyErr_Occurred())
        return -1;
    return ok;
}

/* run_planned(plans, tensor, table, key[, out]): where tensor's plan holds, its `table` (a
 * dict attribute of the plan) has an entry (context, fn[, out_plan]) for `key`, that kept
 * context applies on this thread, and with `out` (an allgather's receive tensor) the plan
 * of `out` holds and is the entry's out_plan: fn() inside the context, and True. False
 * otherwise, having done nothing: the caller takes its general path (which also makes
 * the missing entry). */
static PyObject *run_planned(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "run_planned(plans, tensor, table, key[, out])");
        return NULL;
    }
    PyObject *plan = plan_of(args[0], args[1]);
    if (plan == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    PyObject *table = PyObject_GetAttr(plan, args[2]);
    Py_DECREF(plan);
    if (table == NULL)
        return NULL;
    if (!PyDict_Check(table)) {
        Py_DECREF(table);
        PyErr_SetString(PyExc_TypeError, "a plan's table must be a dict");
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(table, args[3]);
    if (entry == NULL) {
        Py_DECREF(table);
        PyErr_Clear();  /* an unhashable key: the general path says what is wrong */
        Py_RETURN_FALSE;
    }
    Py_INCREF(entry);
    Py_DECREF(table);
    Py_ssize_t items = nargs == 5 ? 3 : 2;
    int ok = PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == items &&
        Py_IS_TYPE(PyTuple_GET_ITEM(entry, 0), &CollectiveType);
    if (ok && nargs == 5) {
        PyObject *out_plan = plan_of(args[0], args[4]);
        ok = out_plan == NULL ? (PyErr_Occurred() ? -1 : 0) :
            out_plan == PyTuple_GET_ITEM(entry, 2);
        Py_XDECREF(out_plan);
    }
    Collective *context = ok == 1 ? (Collective *)PyTuple_GET_ITEM(entry, 0) : NULL;
    if (ok == 1)
        ok = kept_applies(context);
    if (ok < 0) {
        Py_DECREF(entry);
        return NULL;
    }
    if (!ok) {
        Py_DECREF(entry);
        Py_RETURN_FALSE;
    }
    PyObject *seq = enter(context);
    PyObject *result = NULL;
    if (seq != NULL) {
        Py_DECREF(seq);
        result = PyObject_CallNoArgs(PyTuple_GET_ITEM(entry, 1));
        if (leave(context) < 0)
            Py_CLEAR(result);
    }
    Py_DECREF(entry);
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    Py_RETURN_TRUE;
}

/* kept_here(context): whether a context kept for the main thread applies here. */
static PyObject *kept_here(PyObject *unused, PyObject *context)
{
    if (!Py_IS_TYPE(context, &CollectiveType)) {
        PyErr_SetString(PyExc_TypeError, "kept_here takes a Collective");
        return NULL;
    }
    int ok = kept_applies((Collective *)context);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

/* follow(agent_module): the module whose `_agent` and `_main_ident` kept_here reads. */
static PyObject *follow(PyObject *unused, PyObject *module)
{
    Py_XSETREF(agent_module, Py_NewRef(module));
    Py_RETURN_NONE;
}

static PyMethodDef module_functions[] = {
    {"planned", (PyCFunction)(void (*)(void))planned, METH_FASTCALL,
     "planned(plans, tensor): tensor's plan in `plans` (by id) where it still holds, else None"},
    {"run_planned", (PyCFunction)(void (*)(void))run_planned, METH_FASTCALL,
     "run_planned(plans, tensor, table, key[, out]): run tensor's planned collective; "
     "False if none"},
    {"kept_here", (PyCFunction)kept_here, METH_O,
     "kept_here(context): whether a context kept for the main thread applies on this "
     "thread (the main one, with the agent it was made for)"},
    {"follow", (PyCFunction)follow, METH_O,
     "follow(agent_module): where kept_here finds the agent and the main thread"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef collective_module = {
    PyModuleDef_HEAD_INIT, "_collective",
    "The context of one collective (see agent.py), and a planned tensor's collective.", -1,
    module_functions,
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
    INTERN(s_ptr, "ptr");
    INTERN(s_shape, "shape");
    INTERN(s_dtype, "dtype");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_agent, "_agent");
    INTERN(s_main_ident, "_main_ident");
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

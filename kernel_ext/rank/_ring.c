/* The flag protocol of mpilab's shared-memory engine (shm.py), its one-piece allreduce,
 * its broadcast and allgather of any size, the read way of its larger allreduce, and the
 * two passes of that allreduce's other way that C does better than NumPy (a copy that
 * bypasses the caches, a reduction that publishes as it goes), in C.
 *
 * Why C: a collective of a few KiB between two cores of one node takes well under a
 * microsecond of copying and cache-line hand-offs, but several microseconds of Python
 * (every flag read, epoch bump and slot view is a bytecode or a NumPy call). So the ring
 * holds the engine's synchronisation state (epoch, slot parity, the wait a broadcast owes,
 * the collective in progress, broken) and does the waits for every collective of the
 * engine: the larger allreduce through the slots, written in Python with NumPy, calls
 * arrive / barrier / settle here; the others run here whole.
 *
 * Waiting is what shm.py's docstring describes: spin for ~10 µs, then yield the core
 * (releasing the GIL, running Python's signal handlers) for up to 5 ms, then sleep up to
 * 1 ms at a time, calling check_abort between sleeps: Ctrl-C and an abort land as they did
 * in the Python loop. A wait that raises leaves the ring broken (the ranks are out of
 * step); the next collective raises what `refuse` raises.
 *
 * Memory order: a rank's slot writes, then its signature, then its flag (a release store);
 * a waiter reads the flag (an acquire load), then the signature and the slots. That is
 * correct on every architecture, so no MPI call is needed as a fence. Slot writes that
 * bypass the caches (stream_bytes) end with their own fence, which a release store does
 * not give them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>

#define RING 4                     /* signatures kept per rank, by epoch */
#define CACHE_LINE 64
/* A broadcast's root writes its slot around its caches from this size, so the receivers
 * read the lines from memory rather than out of the root core's cache: on this project's
 * 2-vCPU VMs the cache-to-cache reads ran up to ten times slower in some launches than
 * in others, the streamed ones at one steady rate (docs/performance.md). */
#define BROADCAST_STREAM_BYTES (8 << 10)
/* ... up to this size: above it, streamed pieces measured slower than cached ones where
 * the cache-to-cache reads ran well (at 4 MiB), and the message no longer fits the
 * receivers' caches either way. */
#define BROADCAST_ROOT_STREAM_MAX (1 << 20)
/* A broadcast's or an allgather's copies release the GIL from this size on. */
#define RELEASE_BYTES (64 << 10)
/* A collective larger than one piece goes one of two ways, whichever the rank that
 * decides (a broadcast's root, else rank 0) last measured faster at that size (to a
 * power of two): pipelined through the slots, or read straight out of the other ranks'
 * buffers (process_vm_readv: one copy, and no cache hands another a line it has just
 * written). On this project's VMs the hand-offs through the slots ran five to ten times
 * slower for seconds at a time (docs/performance.md). The way not chosen is tried again
 * at most this often, so a change of regime is seen within about a second. */
#define RETRY_OTHER_WAY_NS 1000000000LL
enum { WAY_PIPELINED = 0, WAY_READ = 1 };
/* An allreduce's read way reads the others' parts of a slice in pieces of this, each
 * reduced while it is still in the cache. */
#define READ_PIECE_BYTES (1 << 20)
/* The deciding rank announces its way, and every rank its buffer's address, in the rest
 * of its flag's line: int64 slots FLAG_WAY and FLAG_ADDRESS after the flag and the
 * signatures. */
#define FLAG_WAY (1 + RING)
#define FLAG_ADDRESS (2 + RING)
#define SPIN_NS 10000LL            /* pure polling first */
#define YIELD_NS 5000000LL         /* then yield the core for up to this */
#define MAX_SLEEP_NS 1000000LL     /* then sleep at most this at a time */

/* the collectives' kinds in their signatures (the module's KINDS, for shm.py) */
enum { K_SUM = 1, K_MAX = 2, K_MIN = 3, K_BROADCAST = 4, K_ALLGATHER = 5, K_BARRIER = 6 };
static const char *KIND_NAMES[] = {NULL, "sum", "max", "min", "broadcast", "allgather",
                                   "barrier"};
/* element types of the one-piece allreduce (the module's ELEMENT_TYPES, NumPy's names) */
enum { T_F32 = 0, T_F64, T_F16, T_I8, T_I16, T_I32, T_I64, T_U8, T_U16, T_U32, T_U64, T_COUNT };
static const char *TYPE_NAMES[T_COUNT] = {"float32", "float64", "float16", "int8", "int16",
                                          "int32", "int64", "uint8", "uint16", "uint32",
                                          "uint64"};

/* What a rank announces with an arrival: the collective (an allreduce by its reduction),
 * a broadcast's root and the bytes, in one int64. */
static inline long long signature(int kind, Py_ssize_t nbytes, int root)
{
    return kind | (long long)root << 8 | (long long)nbytes << 24;
}

/* What the rank that decides a large collective's way (a broadcast's root, otherwise
 * rank 0) last measured of each way, by log2 of the bytes, and when. */
typedef struct {
    double rate[64][2];
    long long tried[64][2];
} Ways;
enum { WAYS_BROADCAST = 0, WAYS_ALLGATHER = 1, WAYS_ALLREDUCE = 2, WAYS_COUNT = 3 };

typedef struct {
    PyObject_HEAD
    int n, me;
    int64_t **flags;              /* flags[r]: rank r's flag; its signatures follow it */
    char **slots;                 /* slots[2 r + parity] */
    Py_ssize_t slot_bytes;
    long long epoch, use, owed, owed_sig, sig;
    int broken;
    pid_t *pids;                  /* each rank's pid, NULL where ranks cannot read peers */
    int way;                      /* a large collective's way: -1 measured, else that one */
    int last_way;                 /* the way the last one that could go either way went */
    Ways ways[WAYS_COUNT];        /* what the deciding rank measured, per collective */
    long long since;              /* when every rank had announced the way in progress */
    PyThread_type_lock lock;
    PyObject *check_abort, *wait_release, *refuse, *keep;
} Ring;

static inline long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Wait until *flag >= target; -1 with a Python exception set if interrupted. */
static int wait_flag(Ring *self, int64_t *flag, long long target)
{
    if (load(flag) >= target)
        return 0;
    long long start = now_ns();
    do {
        for (int i = 0; i < 64; i++) {
            if (load(flag) >= target)
                return 0;
            relax();
        }
    } while (now_ns() - start < SPIN_NS);
    while (load(flag) < target) {
        long long waited = now_ns() - start;
        if (PyErr_CheckSignals() < 0)
            return -1;
        if (waited < YIELD_NS) {
            Py_BEGIN_ALLOW_THREADS
            sched_yield();
            Py_END_ALLOW_THREADS
        } else {
            PyObject *r = PyObject_CallNoArgs(self->check_abort);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
            long long ns = waited / 16 < MAX_SLEEP_NS ? waited / 16 : MAX_SLEEP_NS;
            struct timespec t = {0, (long)ns};
            Py_BEGIN_ALLOW_THREADS
            nanosleep(&t, NULL);
            Py_END_ALLOW_THREADS
        }
    }
    return 0;
}

/* A collective that cannot complete (`why`: another rank arrived at this epoch in a
 * different collective, or a rank has gone): the Python `wait_release` waits, as a wait
 * for a flag would, until the notebook's watchdog releases the ranks, and raises; in a
 * batch script, where no watchdog will, it returns at once and `why` is raised. */
static int wait_release(Ring *self, const char *why)
{
    PyObject *r = PyObject_CallNoArgs(self->wait_release);
    Py_XDECREF(r);
    if (r != NULL)
        PyErr_SetString(PyExc_RuntimeError, why);
    return -1;
}

/* A collective's signature in words (node ranks: the engine's ranks are its node's). */
static void describe(long long sig, char *out, size_t len)
{
    int kind = (int)(sig & 0xff), root = (int)((sig >> 8) & 0xffff);
    long long nbytes = sig >> 24;
    if (kind >= K_SUM && kind <= K_MIN)
        snprintf(out, len, "an allreduce (%s) of %lld bytes", KIND_NAMES[kind], nbytes);
    else if (kind == K_BROADCAST)
        snprintf(out, len, "a broadcast of %lld bytes from its node's rank %d", nbytes, root);
    else if (kind == K_ALLGATHER)
        snprintf(out, len, "an allgather of %lld bytes", nbytes);
    else if (kind == K_BARRIER)
        snprintf(out, len, "a barrier");
    else
        snprintf(out, len, "an unknown collective (%lld)", sig);
}

static int __attribute__((noinline)) mismatched(Ring *self, int r, long long sig,
                                                long long theirs)
{
    char mine_text[96], theirs_text[96], why[400];
    describe(sig, mine_text, sizeof mine_text);
    describe(theirs, theirs_text, sizeof theirs_text);
    snprintf(why, sizeof why, "mismatched collectives: this rank is in %s, and its node's "
             "rank %d in %s at the same point: every rank must call the same collectives "
             "in the same order", mine_text, r, theirs_text);
    return wait_release(self, why);
}

static inline int check_sig(Ring *self, int r, long long epoch, long long sig)
{
    long long theirs = self->flags[r][1 + (epoch & (RING - 1))];
    return theirs == sig ? 0 : mismatched(self, r, sig, theirs);
}

static long long arrive(Ring *self)
{
    long long e = ++self->epoch;
    int64_t *mine = self->flags[self->me];
    mine[1 + (e & (RING - 1))] = self->sig;
    __atomic_store_n(mine, e, __ATOMIC_RELEASE);
    return e;
}

static int wait_arrivals(Ring *self, long long epoch)
{
    for (int r = 0; r < self->n; r++) {
        if (r == self->me)
            continue;
        if (wait_flag(self, self->flags[r], epoch) < 0 || check_sig(self, r, epoch, self->sig) < 0)
            return -1;
    }
    return 0;
}

static int barrier(Ring *self)
{
    if (wait_arrivals(self, arrive(self)) < 0)
        return -1;
    self->owed = 0;
    return 0;
}

static int wait_root(Ring *self, int root, long long epoch)
{
    if (wait_flag(self, self->flags[root], epoch) < 0)
        return -1;
    return check_sig(self, root, epoch, self->sig);
}

static int settle(Ring *self)
{
    long long owed = self->owed;
    if (!owed)
        return 0;
    for (int r = 0; r < self->n; r++) {
        if (r == self->me)
            continue;
        if (wait_flag(self, self->flags[r], owed) < 0 || check_sig(self, r, owed, self->owed_sig) < 0)
            return -1;
    }
    self->owed = 0;
    return 0;
}

/* -- the lock: one collective at a time per engine -------------------------------------- */
static int enter(Ring *self)
{
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        for (;;) {
            PyLockStatus got;
            Py_BEGIN_ALLOW_THREADS
            got = PyThread_acquire_lock_timed(self->lock, 1000, 0);
            Py_END_ALLOW_THREADS
            if (got == PY_LOCK_ACQUIRED)
                break;
            if (PyErr_CheckSignals() < 0)
                return -1;
        }
    }
    if (self->broken) {
        PyThread_release_lock(self->lock);
        PyObject *r = PyObject_CallNoArgs(self->refuse);
        Py_XDECREF(r);
        if (r != NULL)
            PyErr_SetString(PyExc_RuntimeError, "the shared-memory ring is broken");
        return -1;
    }
    return 0;
}

/* Leave a collective: status < 0 (an exception set) leaves the ring broken. */
static PyObject *leave(Ring *self, int status)
{
    if (status < 0)
        self->broken = 1;
    PyThread_release_lock(self->lock);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* An address: an int (a caller's checked tensor), or an object with a contiguous buffer
 * of at least `need` bytes, which the collective may write into where `writable`. */
static char *address(PyObject *obj, Py_ssize_t need, int writable)
{
    if (PyLong_Check(obj))
        return (char *)PyLong_AsVoidPtr(obj);
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    char *p = view.buf;
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    if (len < need) {
        PyErr_Format(PyExc_ValueError, "a buffer of %zd bytes where %zd are needed", len, need);
        return NULL;
    }
    return p;
}

static int check_piece(Ring *self, Py_ssize_t nbytes)
{
    if (nbytes < 0 || nbytes > self->slot_bytes) {
        PyErr_Format(PyExc_ValueError, "%zd bytes do not fit in one slot of %zd", nbytes,
                     self->slot_bytes);
        return -1;
    }
    return 0;
}

static void stream_bytes(char *dst, const char *src, Py_ssize_t n);

/* The arguments a broadcast and an allgather share: nbytes (args[1]), and where nargs is
 * 5 the piece (args[3]; the whole message otherwise) and stream_out (args[4]). */
static int piece_args(Ring *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t *nbytes,
                      Py_ssize_t *piece, int *stream_out)
{
    *nbytes = PyLong_AsSsize_t(args[1]);
    *piece = nargs == 5 ? PyLong_AsSsize_t(args[3]) : *nbytes;
    *stream_out = nargs == 5 ? PyObject_IsTrue(args[4]) : 0;
    if (PyErr_Occurred() || *stream_out < 0 || check_piece(self, *piece) < 0)
        return -1;
    if (*nbytes < 0 || (*piece <= 0 && *nbytes > 0)) {
        PyErr_Format(PyExc_ValueError, "%zd bytes in pieces of %zd", *nbytes, *piece);
        return -1;
    }
    return 0;
}

/* -- the broadcast and the allgather ---------------------------------------------------- */
/* Copy n bytes, around the caches where `streamed`; without the GIL from a size at which
 * the copy takes longer than handing the GIL over (the agent's threads run meanwhile). */
static void copy_piece(char *dst, const char *src, Py_ssize_t n, int streamed)
{
    if (n < RELEASE_BYTES) {
        if (streamed)
            stream_bytes(dst, src, n);  /* fenced: visible before the flag */
        else
            memmove(dst, src, n);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    if (streamed)
        stream_bytes(dst, src, n);
    else
        memmove(dst, src, n);
    Py_END_ALLOW_THREADS
}

/* Read n bytes at `remote` in process pid into `dst`, or where `push`, write n bytes at
 * `dst` into `remote` there (one copy, by the kernel): 0, or the errno of why it could
 * not. */
static int move_peer(pid_t pid, char *dst, uintptr_t remote, Py_ssize_t n, int push)
{
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (n > 0) {
        struct iovec local = {dst, (size_t)n}, far = {(void *)remote, (size_t)n};
        ssize_t got = push ? process_vm_writev(pid, &local, 1, &far, 1, 0)
                           : process_vm_readv(pid, &local, 1, &far, 1, 0);
        if (got <= 0) {
            err = got < 0 ? errno : EIO;
            break;
        }
        dst += got, remote += (uintptr_t)got, n -= got;
    }
    Py_END_ALLOW_THREADS
    return err;
}

/* A collective's read of rank r's buffer (a write into it where `push`); -1 with an
 * exception set if it fails. A rank that has gone (ESRCH) is what the notebook's
 * watchdog reports: wait for its release, as a wait for that rank's flag would. */
static int move_rank(Ring *self, int r, char *dst, uintptr_t remote, Py_ssize_t n, int push)
{
    int err = move_peer(self->pids[r], dst, remote, n, push);
    if (err == 0)
        return 0;
    if (err == ESRCH)
        return wait_release(self, "a rank has gone");
    PyErr_Format(PyExc_OSError, "%s rank %d's buffer failed: %s", push ? "writing" : "reading",
                 r, strerror(err));
    return -1;
}

static inline int read_rank(Ring *self, int r, char *dst, uintptr_t remote, Py_ssize_t n)
{
    return move_rank(self, r, dst, remote, n, 0);
}

static inline int log2_bucket(Py_ssize_t n)
{
    return 63 - __builtin_clzll((unsigned long long)n);
}

/* Whether a broadcast or an allgather may go either way: where the ranks can read each
 * other, and in more than one piece. A broadcast needs the second piece: a receiver
 * reads the root's way before it arrives at it, and the root cannot finish (and announce
 * the next broadcast's way) before that arrival, or the read way's barrier. Every rank
 * computes it the same from the same arguments. */
static inline int two_ways(Ring *self, Py_ssize_t nbytes, Py_ssize_t piece)
{
    return self->pids != NULL && piece < nbytes;
}

/* The way for a collective that may go either way: the faster by the last measurement,
 * or the other one where that was last tried RETRY_OTHER_WAY_NS ago (each is tried once
 * first); `way` where that is set. */
static int choose_way(Ring *self, Ways *ways, Py_ssize_t nbytes)
{
    if (self->way >= 0)
        return self->way;
    int b = log2_bucket(nbytes);
    double *rate = ways->rate[b];
    int best = rate[WAY_READ] > rate[WAY_PIPELINED] ? WAY_READ : WAY_PIPELINED;
    int other = 1 - best;
    return now_ns() - ways->tried[b][other] > RETRY_OTHER_WAY_NS ? other : best;
}

/* A measurement of a way: bytes per ns since every rank was there. What a way is known
 * to reach is the best of its recent rates, each fading by e every RETRY_OTHER_WAY_NS:
 * a call slowed by something else (the rate of a way is noisy; noise only slows) does
 * not make the faster way look slower, and a way that turns slow is seen so within
 * about as long as the way not chosen waits for its next try. */
static void record_way(Ways *ways, Py_ssize_t nbytes, int way, Py_ssize_t bytes, long long since)
{
    long long now = now_ns();
    int b = log2_bucket(nbytes);
    double rate = (double)bytes / (double)(now - since + 1), *known = &ways->rate[b][way];
    double kept = *known * exp(-(double)(now - ways->tried[b][way]) / RETRY_OTHER_WAY_NS);
    *known = rate > kept ? rate : kept;
    ways->tried[b][way] = now;
}

/* Where every rank takes part in deciding nothing but rank 0 decides (an allgather, an
 * allreduce): each rank announces its buffer, rank 0 its way, in one barrier; *way is
 * rank 0's. A rank reads rank 0's way before it can arrive at the collective's next
 * barrier, so rank 0 cannot announce another before every rank has read this one. */
static int announce(Ring *self, int kind, Py_ssize_t nbytes, char *buffer, int *way)
{
    int64_t *line = self->flags[self->me];
    line[FLAG_ADDRESS] = (int64_t)(uintptr_t)buffer;
    if (self->me == 0)
        line[FLAG_WAY] = choose_way(self, &self->ways[kind], nbytes);
    if (barrier(self) < 0)
        return -1;
    *way = (int)self->flags[0][FLAG_WAY];
    self->since = now_ns();
    return 0;
}

/* broadcast(buffer, nbytes, root[, piece, stream_out]): the root's bytes into every
 * rank's buffer.
 *
 * Pipelined (always, for one piece): in pieces of `piece` bytes (at most a slot; the
 * whole message, one piece, without it), the receivers' copies around the
 * caches where `stream_out`. Piece k goes through the root's slot of the next parity:
 * the root copies it in and arrives, then waits for the receivers' arrivals at that
 * epoch (they make them as they start on it, so the root copies piece k+1 in while they
 * copy piece k out); a receiver arrives, waits for the root alone, copies out, and owes
 * the rest of the barrier (settled at the next piece or collective: shm.py's docstring).
 *
 * Read: the root announces its buffer with its arrival, each receiver its own with its
 * arrival; each receiver reads all but the last share of the message (1/n of it) out of
 * the root's memory while the root writes that share into every receiver's buffer, so
 * every rank copies (n-1)/n of the message, at once; then a barrier.
 *
 * The root's first arrival carries its way (FLAG_WAY), so every rank goes the same. */
static PyObject *Ring_broadcast(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "broadcast(buffer, nbytes, root[, piece, stream_out])");
        return NULL;
    }
    Py_ssize_t nbytes, piece;
    int stream_out, root = (int)PyLong_AsLong(args[2]);
    if ((root == -1 && PyErr_Occurred()) || piece_args(self, args, nargs, &nbytes, &piece,
                                                       &stream_out) < 0)
        return NULL;
    if (root < 0 || root >= self->n)
        return PyErr_Format(PyExc_ValueError, "root %d is not a rank of %d", root, self->n);
    char *buf = address(args[0], nbytes, 1);
    if (buf == NULL || enter(self) < 0)
        return NULL;
    long long sig = signature(K_BROADCAST, nbytes, root);
    int stream_in = nbytes >= BROADCAST_STREAM_BYTES && nbytes <= BROADCAST_ROOT_STREAM_MAX;
    int i_am_root = self->me == root, way = WAY_PIPELINED, status = 0;
    int either = two_ways(self, nbytes, piece);
    int64_t *root_line = self->flags[root];
    long long since = 0;
    self->sig = sig;
    /* the read way's split: the receivers read [0, cut), the root writes the rest */
    Py_ssize_t done = 0, cut = (nbytes - nbytes / self->n) / CACHE_LINE * CACHE_LINE;
    do {
        Py_ssize_t n = nbytes - done < piece ? nbytes - done : piece;
        char *slot = self->slots[2 * root + (++self->use & 1)];
        if ((status = settle(self)) < 0)
            break;
        if (i_am_root) {
            if (done == 0 && either) {
                way = choose_way(self, &self->ways[WAYS_BROADCAST], nbytes);
                root_line[FLAG_WAY] = way;
                root_line[FLAG_ADDRESS] = (int64_t)(uintptr_t)buf;
            }
            if (way == WAY_PIPELINED)
                copy_piece(slot, buf + done, n, stream_in);
            if ((status = wait_arrivals(self, arrive(self))) < 0)
                break;
            if (done == 0)
                since = now_ns();
            if (way == WAY_READ) {
                for (int r = 0; status == 0 && r < self->n; r++)
                    if (r != root)
                        status = move_rank(self, r, buf + cut,
                                           (uintptr_t)self->flags[r][FLAG_ADDRESS] + cut,
                                           nbytes - cut, 1);
                if (status == 0)
                    status = barrier(self);
                done = nbytes;
                break;
            }
        } else {
            if (done == 0 && either)
                self->flags[self->me][FLAG_ADDRESS] = (int64_t)(uintptr_t)buf;
            long long e = arrive(self);
            if ((status = wait_root(self, root, e)) < 0)
                break;
            if (done == 0 && either)
                way = (int)root_line[FLAG_WAY];
            if (way == WAY_READ) {
                status = read_rank(self, root, buf, (uintptr_t)root_line[FLAG_ADDRESS], cut);
                if (status == 0)  /* and the root's writes into this buffer are done */
                    status = barrier(self);
                done = nbytes;
                break;
            }
            copy_piece(buf + done, slot, n, stream_out);
            self->owed = e;
            self->owed_sig = sig;
        }
        done += n;
    } while (done < nbytes);
    if (status == 0 && either) {
        self->last_way = way;
        if (i_am_root)
            record_way(&self->ways[WAYS_BROADCAST], nbytes, way,
                       way == WAY_READ ? nbytes : nbytes - piece, since);
    }
    return leave(self, status);
}

/* allgather(send, nbytes, recv[, piece, stream_out]): every rank's nbytes of send into
 * recv, in rank order; in pieces of `piece` (one piece, the whole, without it), the
 * copies into recv around the caches where `stream_out`.
 *
 * Pipelined: phase k (between barriers) writes piece k of send into this rank's slot of
 * the next parity while it copies piece k-1 out of the others' slots (the slot reuse rule
 * of shm.py's docstring). Read, where the ranks can read each other and there is more
 * than one piece: every rank copies the others' send buffers straight out of their
 * memory, then waits until all have (a barrier: then every send may change again).
 * Rank 0 decides the way, by its measurements as a broadcast's root does, and announces
 * it in a first barrier in which every rank announces its send buffer. */
static PyObject *Ring_allgather(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "allgather(send, nbytes, recv[, piece, stream_out])");
        return NULL;
    }
    Py_ssize_t nbytes, piece;
    int stream_out;
    if (piece_args(self, args, nargs, &nbytes, &piece, &stream_out) < 0)
        return NULL;
    char *send = address(args[0], nbytes, 0);
    if (send == NULL)
        return NULL;
    char *recv = address(args[2], nbytes * self->n, 1);
    if (recv == NULL || enter(self) < 0)
        return NULL;
    self->sig = signature(K_ALLGATHER, nbytes, 0);
    int me = self->me, way = WAY_PIPELINED, status = settle(self);
    int either = two_ways(self, nbytes, piece);
    char *own = recv + (Py_ssize_t)me * nbytes;
    if (status == 0 && either)
        status = announce(self, WAYS_ALLGATHER, nbytes, send, &way);
    if (status == 0 && way == WAY_READ) {
        for (int r = 0; status == 0 && r < self->n; r++)
            if (r != me)
                status = read_rank(self, r, recv + (Py_ssize_t)r * nbytes,
                                   (uintptr_t)self->flags[r][FLAG_ADDRESS], nbytes);
        if (status == 0 && own != send)
            copy_piece(own, send, nbytes, stream_out);
        if (status == 0)
            status = barrier(self);
    } else if (status == 0) {
        int parity = 0;
        for (Py_ssize_t done = 0; status == 0 && done < nbytes; done += piece) {
            Py_ssize_t n = nbytes - done < piece ? nbytes - done : piece;
            if (done > 0)  /* the others' previous piece, out of the previous parity */
                for (int r = 0; r < self->n; r++)
                    if (r != me)
                        copy_piece(recv + (Py_ssize_t)r * nbytes + done - piece,
                                   self->slots[2 * r + parity], piece, stream_out);
            parity = ++self->use & 1;
            copy_piece(self->slots[2 * me + parity], send + done, n, 0);
            if (own != send)
                copy_piece(own + done, send + done, n, stream_out);
            status = barrier(self);
        }
        if (status == 0) {  /* the others' last piece */
            Py_ssize_t last = nbytes == 0 ? 0 : (nbytes - 1) / piece * piece;
            for (int r = 0; r < self->n; r++)
                if (r != me)
                    copy_piece(recv + (Py_ssize_t)r * nbytes + last,
                               self->slots[2 * r + parity], nbytes - last, stream_out);
        }
    }
    if (status == 0 && either) {
        self->last_way = way;
        if (me == 0)
            record_way(&self->ways[WAYS_ALLGATHER], nbytes, way, nbytes, self->since);
    }
    return leave(self, status);
}

/* out = a (op) b, elementwise; the same order of operands on every rank, so every rank
 * gets identical bits. Integer sums wrap (as NumPy's); a float max or min with a NaN is
 * NaN (as NumPy's maximum and minimum). */
#define REDUCE_LOOP(T, EXPR)                                                   \
    do {                                                                       \
        T *o = (T *)out, *o2 = (T *)copy;                                      \
        const T *x = (const T *)a, *y = (const T *)b;                          \
        if (o2 == NULL)                                                        \
            for (Py_ssize_t i = 0; i < count; i++) { T p = x[i], q = y[i]; o[i] = (EXPR); } \
        else                                                                   \
            for (Py_ssize_t i = 0; i < count; i++) {                           \
                T p = x[i], q = y[i]; T v = (EXPR); o[i] = v; o2[i] = v;       \
            }                                                                  \
    } while (0)
#define FLOAT_OPS(T)                                                           \
    switch (op) {                                                              \
    case K_SUM: REDUCE_LOOP(T, p + q); break;                                  \
    case K_MAX: REDUCE_LOOP(T, (p >= q || p != p) ? p : q); break;             \
    case K_MIN: REDUCE_LOOP(T, (p <= q || p != p) ? p : q); break;             \
    }
#define INT_OPS(T, U)                                                          \
    switch (op) {                                                              \
    case K_SUM: REDUCE_LOOP(T, (T)((U)p + (U)q)); break;                       \
    case K_MAX: REDUCE_LOOP(T, p >= q ? p : q); break;                         \
    case K_MIN: REDUCE_LOOP(T, p <= q ? p : q); break;                         \
    }

/* `copy`, where not NULL, gets the result too, in the same pass (a chunked allreduce's
 * owner publishes its reduced slice as it computes it). */
static void reduce(int type, int op, char *out, char *copy, const char *a, const char *b,
                   Py_ssize_t count)
{
    switch (type) {
    case T_F32: FLOAT_OPS(float); break;
    case T_F64: FLOAT_OPS(double); break;
    case T_F16: FLOAT_OPS(_Float16); break;
    case T_I8: INT_OPS(int8_t, uint8_t); break;
    case T_I16: INT_OPS(int16_t, uint16_t); break;
    case T_I32: INT_OPS(int32_t, uint32_t); break;
    case T_I64: INT_OPS(int64_t, uint64_t); break;
    case T_U8: INT_OPS(uint8_t, uint8_t); break;
    case T_U16: INT_OPS(uint16_t, uint16_t); break;
    case T_U32: INT_OPS(uint32_t, uint32_t); break;
    case T_U64: INT_OPS(uint64_t, uint64_t); break;
    }
}

/* -- the one-piece allreduce ------------------------------------------------------------ */
static const int ITEM_SIZE[T_COUNT] = {4, 8, 2, 1, 2, 4, 8, 1, 2, 4, 8};

/* A reduction's arguments (count, type, op), from args[at]; -1 with an exception set if
 * they name none. */
static int reduction_args(PyObject *const *args, Py_ssize_t at, Py_ssize_t *count, int *type,
                          int *op)
{
    *count = PyLong_AsSsize_t(args[at]);
    *type = (int)PyLong_AsLong(args[at + 1]);
    *op = (int)PyLong_AsLong(args[at + 2]);
    if (PyErr_Occurred())
        return -1;
    if (*type < 0 || *type >= T_COUNT || *op < K_SUM || *op > K_MIN || *count < 0) {
        PyErr_Format(PyExc_ValueError, "no reduction %d of %zd elements of type %d", *op,
                     *count, *type);
        return -1;
    }
    return 0;
}

static PyObject *Ring_allreduce(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "allreduce(buffer, count, type, op)");
        return NULL;
    }
    Py_ssize_t count;
    int type, op;
    if (reduction_args(args, 1, &count, &type, &op) < 0)
        return NULL;
    Py_ssize_t nbytes = count * ITEM_SIZE[type];
    if (check_piece(self, nbytes) < 0)
        return NULL;
    char *buf = address(args[0], nbytes, 1);
    if (buf == NULL || enter(self) < 0)
        return NULL;
    self->sig = signature(op, nbytes, 0);
    int parity = ++self->use & 1;
    int status = settle(self);
    if (status == 0) {
        memcpy(self->slots[2 * self->me + parity], buf, nbytes);
        status = barrier(self);
    }
    if (status == 0 && count && self->n > 1) {
        reduce(type, op, buf, NULL, self->slots[parity], self->slots[2 + parity], count);
        for (int r = 2; r < self->n; r++)
            reduce(type, op, buf, NULL, buf, self->slots[2 * r + parity], count);
    }
    return leave(self, status);
}

/* -- the protocol, for the collectives written in Python ------------------------------- */
/* announce_allreduce(nbytes, buffer): an allreduce's way (0 pipelined, 1 read), which
 * rank 0 decides, announced with every rank's buffer in one barrier. */
static PyObject *Ring_announce_allreduce(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "announce_allreduce(nbytes, buffer)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[0]);
    if (PyErr_Occurred())
        return NULL;
    char *buf = address(args[1], nbytes, 1);
    int way;
    if (buf == NULL || self->pids == NULL) {
        if (buf != NULL)
            PyErr_SetString(PyExc_RuntimeError, "the ranks cannot read each other here");
        return NULL;
    }
    if (announce(self, WAYS_ALLREDUCE, nbytes, buf, &way) < 0)
        return NULL;
    return PyLong_FromLong(way);
}

/* read_allreduce(buffer, count, type, op): the read way of an announced allreduce. Each
 * rank owns an equal slice (edges on cache lines, as shm.py's _slice_edges): it reads
 * the others' parts of it out of their buffers, a slot at a time into its own slots
 * (nobody reads a slot after the announcing barrier), and reduces them into its own in
 * rank order; after a barrier, it reads every other owner's reduced slice into its
 * buffer; after another, every buffer may change again. The owner alone computes its
 * slice, so every rank gets identical bits. */
static PyObject *Ring_read_allreduce(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "read_allreduce(buffer, count, type, op)");
        return NULL;
    }
    Py_ssize_t count;
    int type, op;
    if (reduction_args(args, 1, &count, &type, &op) < 0)
        return NULL;
    if (self->pids == NULL)
        return PyErr_Format(PyExc_RuntimeError, "the ranks cannot read each other here");
    Py_ssize_t item = ITEM_SIZE[type], unit = CACHE_LINE / item;
    char *buf = address(args[0], count * item, 1);
    if (buf == NULL)
        return NULL;
    int n = self->n, me = self->me;
    Py_ssize_t edge[n + 1];
    for (int r = 0; r < n; r++)
        edge[r] = count * r / n / unit * unit;
    edge[n] = count;
    char *scratch = self->slots[2 * me];  /* both slots, adjacent: up to READ_PIECE_BYTES */
    Py_ssize_t step = (2 * self->slot_bytes < READ_PIECE_BYTES ? 2 * self->slot_bytes
                                                              : READ_PIECE_BYTES) / item;
    int status = 0;
    for (Py_ssize_t s = edge[me]; status == 0 && s < edge[me + 1]; s += step) {
        Py_ssize_t c = edge[me + 1] - s < step ? edge[me + 1] - s : step;
        for (int r = 0; status == 0 && r < n; r++) {
            if (r == me)
                continue;
            status = read_rank(self, r, scratch,
                               (uintptr_t)self->flags[r][FLAG_ADDRESS] + s * item, c * item);
            if (status == 0) {
                Py_BEGIN_ALLOW_THREADS
                reduce(type, op, buf + s * item, NULL, buf + s * item, scratch, c);
                Py_END_ALLOW_THREADS
            }
        }
    }
    if (status == 0)
        status = barrier(self);
    for (int r = 0; status == 0 && r < n; r++)
        if (r != me && edge[r + 1] > edge[r])
            status = read_rank(self, r, buf + edge[r] * item,
                               (uintptr_t)self->flags[r][FLAG_ADDRESS] + edge[r] * item,
                               (edge[r + 1] - edge[r]) * item);
    if (status == 0)
        status = barrier(self);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* allreduce_done(nbytes, way): rank 0 records how long the way it announced took. */
static PyObject *Ring_allreduce_done(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "allreduce_done(nbytes, way)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[0]);
    int way = (int)PyLong_AsLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (nbytes <= 0 || (way != WAY_PIPELINED && way != WAY_READ))
        return PyErr_Format(PyExc_ValueError, "no way %d of %zd bytes", way, nbytes);
    self->last_way = way;
    if (self->me == 0)
        record_way(&self->ways[WAYS_ALLREDUCE], nbytes, way, nbytes, self->since);
    Py_RETURN_NONE;
}

/* known(collective, nbytes): what the deciding rank knows of each way at that size, as
 * (pipelined, read) in bytes per ns (GB/s); zeros elsewhere and before a measurement. */
static PyObject *Ring_known(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *names[WAYS_COUNT] = {"broadcast", "allgather", "allreduce"};
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "known(collective, nbytes)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    for (int kind = 0; kind < WAYS_COUNT; kind++)
        if (PyUnicode_CompareWithASCIIString(args[0], names[kind]) == 0) {
            if (nbytes <= 0)
                return PyErr_Format(PyExc_ValueError, "no way of %zd bytes", nbytes);
            double *rate = self->ways[kind].rate[log2_bucket(nbytes)];
            return Py_BuildValue("(dd)", rate[WAY_PIPELINED], rate[WAY_READ]);
        }
    return PyErr_Format(PyExc_ValueError, "%R is not broadcast, allgather or allreduce",
                        args[0]);
}

static PyObject *Ring_arrive(Ring *self, PyObject *unused)
{
    return PyLong_FromLongLong(arrive(self));
}

static PyObject *Ring_barrier(Ring *self, PyObject *unused)
{
    if (barrier(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_wait_arrivals(Ring *self, PyObject *arg)
{
    long long epoch = PyLong_AsLongLong(arg);
    if ((epoch == -1 && PyErr_Occurred()) || wait_arrivals(self, epoch) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_wait_root(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wait_root(root, epoch)");
        return NULL;
    }
    int root = (int)PyLong_AsLong(args[0]);
    long long epoch = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (root < 0 || root >= self->n)
        return PyErr_Format(PyExc_ValueError, "root %d is not a rank of %d", root, self->n);
    if (wait_root(self, root, epoch) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_settle(Ring *self, PyObject *unused)
{
    if (settle(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* `with ring:` holds the engine's lock (what the one-piece collectives take) and refuses
 * a broken ring; leaving with an exception breaks it. */
static PyObject *Ring_enter(Ring *self, PyObject *unused)
{
    if (enter(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_exit(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    int failed = nargs > 0 && args[0] != Py_None;
    if (failed)
        self->broken = 1;
    PyThread_release_lock(self->lock);
    Py_RETURN_FALSE;
}

static PyMethodDef Ring_methods[] = {
    {"broadcast", (PyCFunction)(void (*)(void))Ring_broadcast, METH_FASTCALL,
     "broadcast(buffer, nbytes, root[, piece, stream_out]): root's bytes into every rank's "
     "buffer, in pieces (one without `piece`)"},
    {"allgather", (PyCFunction)(void (*)(void))Ring_allgather, METH_FASTCALL,
     "allgather(send, nbytes, recv[, piece, stream_out]): every rank's send, in rank order, "
     "into recv, in pieces (one without `piece`)"},
    {"allreduce", (PyCFunction)(void (*)(void))Ring_allreduce, METH_FASTCALL,
     "allreduce(buffer, count, type, op): reduce count elements in place (one piece)"},
    {"arrive", (PyCFunction)Ring_arrive, METH_NOARGS,
     "bump this rank's flag to the next epoch (after its slot writes); return the epoch"},
    {"barrier", (PyCFunction)Ring_barrier, METH_NOARGS, "arrive, then wait for every rank"},
    {"wait_arrivals", (PyCFunction)Ring_wait_arrivals, METH_O,
     "wait until every other rank has arrived at epoch, in the same collective"},
    {"wait_root", (PyCFunction)(void (*)(void))Ring_wait_root, METH_FASTCALL,
     "a broadcast's receiver: wait for the root's arrival at epoch"},
    {"settle", (PyCFunction)Ring_settle, METH_NOARGS, "wait what a broadcast left owing"},
    {"announce_allreduce", (PyCFunction)(void (*)(void))Ring_announce_allreduce, METH_FASTCALL,
     "announce_allreduce(nbytes, buffer): the way of this allreduce, rank 0's (a barrier)"},
    {"read_allreduce", (PyCFunction)(void (*)(void))Ring_read_allreduce, METH_FASTCALL,
     "read_allreduce(buffer, count, type, op): an announced allreduce, the read way"},
    {"allreduce_done", (PyCFunction)(void (*)(void))Ring_allreduce_done, METH_FASTCALL,
     "allreduce_done(nbytes, way): rank 0 records the announced way's time"},
    {"known", (PyCFunction)(void (*)(void))Ring_known, METH_FASTCALL,
     "known(collective, nbytes): (pipelined, read) GB/s the deciding rank knows at that size"},
    {"__enter__", (PyCFunction)Ring_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Ring_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Ring_members[] = {
    {"epoch", T_LONGLONG, offsetof(Ring, epoch), 0, "this rank's last arrival"},
    {"use", T_LONGLONG, offsetof(Ring, use), 0, "slot uses so far (their parity alternates)"},
    {"owed", T_LONGLONG, offsetof(Ring, owed), 0, "an epoch arrived at without waiting"},
    {"owed_sig", T_LONGLONG, offsetof(Ring, owed_sig), 0, "the signature it arrived with"},
    {"sig", T_LONGLONG, offsetof(Ring, sig), 0, "the signature of the collective in progress"},
    {"broken", T_INT, offsetof(Ring, broken), 0, "a collective stopped half-way"},
    {"way", T_INT, offsetof(Ring, way), 0,
     "the way of a collective above one piece, as the rank that decides picks it: -1 by "
     "measurement, 0 pipelined through the slots, 1 read out of the other ranks' memory"},
    {"last_way", T_INT, offsetof(Ring, last_way), READONLY,
     "the way the last collective that could go either way went (0 or 1), -1 before one"},
    {NULL, 0, 0, 0, NULL},
};

static int Ring_init(Ring *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"segments", "me", "slot_bytes", "check_abort", "wait_release",
                         "refuse", "keep", "pids", NULL};
    PyObject *segments, *keep, *pids = Py_None;
    Py_ssize_t slot_bytes;
    int me;
    if (self->flags != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a ring is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OinOOOO|O", kw, &segments, &me, &slot_bytes,
                                     &self->check_abort, &self->wait_release, &self->refuse,
                                     &keep, &pids))
        return -1;
    self->way = self->last_way = -1;
    Py_INCREF(self->check_abort);
    Py_INCREF(self->wait_release);
    Py_INCREF(self->refuse);
    Py_INCREF(keep);
    self->keep = keep;
    PyObject *seq = PySequence_Fast(segments, "segments: a list of addresses");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || me < 0 || me >= n) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "me must be one of the segments' ranks");
        return -1;
    }
    self->n = (int)n;
    self->me = me;
    self->slot_bytes = slot_bytes;
    self->flags = PyMem_Calloc(n, sizeof(int64_t *));
    self->slots = PyMem_Calloc(2 * n, sizeof(char *));
    if (self->flags == NULL || self->slots == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        char *base = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, r));
        if (base == NULL && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        self->flags[r] = (int64_t *)base;
        self->slots[2 * r] = base + CACHE_LINE;
        self->slots[2 * r + 1] = base + CACHE_LINE + slot_bytes;
    }
    Py_DECREF(seq);
    if (pids != Py_None) {
        PyObject *ps = PySequence_Fast(pids, "pids: a list of process ids, or None");
        if (ps == NULL)
            return -1;
        if (PySequence_Fast_GET_SIZE(ps) != n) {
            Py_DECREF(ps);
            PyErr_SetString(PyExc_ValueError, "pids: one per segment");
            return -1;
        }
        self->pids = PyMem_Calloc(n, sizeof(pid_t));
        for (Py_ssize_t r = 0; self->pids != NULL && r < n; r++)
            self->pids[r] = (pid_t)PyLong_AsLong(PySequence_Fast_GET_ITEM(ps, r));
        Py_DECREF(ps);
        if (self->pids == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (PyErr_Occurred())
            return -1;
    }
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Ring_dealloc(Ring *self)
{
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    PyMem_Free(self->flags);
    PyMem_Free(self->slots);
    PyMem_Free(self->pids);
    Py_XDECREF(self->check_abort);
    Py_XDECREF(self->wait_release);
    Py_XDECREF(self->refuse);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpilab.rank._ring.Ring",
    .tp_doc = PyDoc_STR(
        "Ring(segments, me, slot_bytes, check_abort, wait_release, refuse, keep, pids=None):\n"
        "the flag protocol over every rank's segment (addresses: a 64-byte line of flag,\n"
        "signatures, a way and a buffer's address, then two slots of slot_bytes), the\n"
        "collectives of one piece, the broadcast and the allgather, and the allreduce's\n"
        "read way. keep: what owns the segments' memory, kept alive with the ring. pids:\n"
        "each rank's process id where every rank can read the others' memory (read_peer);\n"
        "collectives above one piece may then go that way."),
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_members = Ring_members,
};

static PyObject *module_signature(PyObject *m, PyObject *args)
{
    const char *kind;
    Py_ssize_t nbytes;
    int root = 0;
    if (!PyArg_ParseTuple(args, "sn|i", &kind, &nbytes, &root))
        return NULL;
    for (int k = K_SUM; k <= K_BARRIER; k++)
        if (strcmp(kind, KIND_NAMES[k]) == 0)
            return PyLong_FromLongLong(signature(k, nbytes, root));
    return PyErr_Format(PyExc_ValueError, "no collective %s", kind);
}

/* stream_copy(dst, src): copy src's bytes into dst with stores that bypass the caches
 * (x86's non-temporal stores; a plain memcpy elsewhere). For a destination far larger
 * than the caches, which a cached store would first read from memory (for ownership) and
 * then evict anyway: a third less memory traffic. Without the GIL. */
static void stream_bytes(char *dst, const char *src, Py_ssize_t n)
{
#if defined(__SSE2__)
    Py_ssize_t head = (Py_ssize_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence();  /* the streamed stores are visible before any flag that follows */
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *module_stream_copy(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "stream_copy(dst, src)");
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy of %zd bytes into %zd", src.len, dst.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        stream_bytes(dst.buf, src.buf, src.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* reduce_publish(mine, others, published, count, type, op): mine = mine (op) each of
 * `others` in turn, the last pass writing the result into `published` as well. A chunked
 * allreduce's owner reduces its slice and publishes it for the other ranks so, reading its
 * slice once rather than again for a separate copy. Without the GIL (a slice is ~1 MiB). */
static PyObject *module_reduce_publish(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) < 1) {
        PyErr_SetString(PyExc_TypeError,
                        "reduce_publish(mine, others (a non-empty tuple), published, count, "
                        "type, op)");
        return NULL;
    }
    Py_ssize_t count;
    int type, op;
    if (reduction_args(args, 3, &count, &type, &op) < 0)
        return NULL;
    Py_ssize_t nbytes = count * ITEM_SIZE[type], n = PyTuple_GET_SIZE(args[1]);
    char *mine = address(args[0], nbytes, 1);
    char *published = mine == NULL ? NULL : address(args[2], nbytes, 1);
    if (published == NULL)
        return NULL;
    const char *others[n];
    for (Py_ssize_t k = 0; k < n; k++)
        if ((others[k] = address(PyTuple_GET_ITEM(args[1], k), nbytes, 0)) == NULL)
            return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++)
        reduce(type, op, mine, k == n - 1 ? published : NULL, mine, others[k], count);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* read_peer(pid, address, nbytes): nbytes at address in process pid, as bytes. */
static PyObject *module_read_peer(PyObject *m, PyObject *args)
{
    int pid;
    unsigned long long remote;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKn", &pid, &remote, &n))
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "%zd bytes", n);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    int err = out == NULL ? 0 : move_peer((pid_t)pid, PyBytes_AS_STRING(out), (uintptr_t)remote,
                                          n, 0);
    if (err) {
        Py_CLEAR(out);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"read_peer", module_read_peer, METH_VARARGS,
     "read_peer(pid, address, nbytes): the bytes at address in process pid (OSError where "
     "this process may not read it)"},
    {"stream_copy", (PyCFunction)(void (*)(void))module_stream_copy, METH_FASTCALL,
     "stream_copy(dst, src): src's bytes into dst (same length), with stores that bypass "
     "the caches where the CPU has them"},
    {"reduce_publish", (PyCFunction)(void (*)(void))module_reduce_publish, METH_FASTCALL,
     "reduce_publish(mine, others, published, count, type, op): mine (op)= each of others "
     "(a tuple), the result written into published too, in the same pass"},
    {"signature", module_signature, METH_VARARGS,
     "signature(kind, nbytes, root=0): what a rank announces with an arrival (the ring's "
     "`sig`)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT, "_ring",
    "The shared-memory engine's flag protocol and one-piece collectives (see shm.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__ring(void)
{
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&ring_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *kinds = PyDict_New(), *types = PyTuple_New(T_COUNT);
    int failed = kinds == NULL || types == NULL;
    for (int k = K_SUM; !failed && k <= K_BARRIER; k++) {
        PyObject *code = PyLong_FromLong(k);
        failed = code == NULL || PyDict_SetItemString(kinds, KIND_NAMES[k], code) < 0;
        Py_XDECREF(code);
    }
    for (int t = 0; !failed && t < T_COUNT; t++) {
        PyObject *name = PyUnicode_FromString(TYPE_NAMES[t]);
        failed = name == NULL;
        if (!failed)
            PyTuple_SET_ITEM(types, t, name);
    }
    if (failed || PyModule_AddObject(m, "KINDS", kinds) < 0) {
        Py_XDECREF(kinds);
        Py_XDECREF(types);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "ELEMENT_TYPES", types) < 0) {
        Py_DECREF(types);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

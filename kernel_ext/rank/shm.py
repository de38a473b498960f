"""Shared-memory collectives among the ranks of one node (an MPI-3 shared window).

Why: ranks on one node share memory, so an allreduce is bounded by memory bandwidth,
not by a network. MPI's and gloo's intra-node channels copy each message several times
through small bounce buffers; here every rank reads the others' data straight from one
shared window, with NumPy kernels (which release the GIL) and one flag barrier per chunk.

Layout of each rank's segment of the window::

    [flag: int64, then 4 int64 signatures, in one 64-byte cache line][slot 0][slot 1]

Synchronisation: a barrier is "bump my flag to the next epoch (arrive), wait until every
flag has reached it" (monotonic counters, so no reset race). The flag is written with
release and read with acquire semantics, so slot writes are seen before the flag and
slot reads happen after it, on every architecture. A broadcast needs less: the receivers wait
for the root's arrival alone and copy; the root waits only for the receivers' arrivals,
which they make as they start, before they copy. So the root copies the next chunk (or
the next call's data) in while the receivers copy this one out, and a broadcast costs
about one copy, not the root's copy and then the receivers'. A receiver owes the rest of
the barrier (the ring's `owed`: that the other receivers arrived) and settles it at the
start of its next collective (`settle`), so no rank is ever more than one epoch ahead of another.

With each arrival a rank announces which collective it is in (a signature: the kind,
the reduction, a broadcast's root, the bytes; kept by epoch). A rank that finds another
arrived at the same epoch in a different collective does not complete against it (that
would give wrong data and no error): it waits, as MPI's own collectives would, until the
notebook's watchdog names the mismatch from the heartbeats and releases the ranks.

The protocol, the collectives that fit in one piece, and the broadcast and the allgather
of any size are C (``_ring.Ring``, which holds the synchronisation state: epoch, slot
parity, what a broadcast owes, the collective in progress, broken) and the collectives'
signatures. A collective of a few KiB between two cores is well under a microsecond of
copying and cache-line hand-offs; in Python its flag reads, epoch bumps and NumPy calls
would cost ~2 µs more, and a broadcast or an allgather, which does nothing between its
copies but wait, would pay that for every piece. Above one piece these two (and an
allreduce from READ_WAY_MIN_BYTES) go one of two ways, whichever the deciding rank last
measured faster: pipelined through the slots, or read straight out of the other ranks' memory
(process_vm_readv, where `_readable_peers` finds the ranks may): on this project's VMs
the slots' cache-to-cache hand-offs ran five to ten times slower for seconds at a time.
The larger allreduce is driven from here, chunk by chunk, and uses the ring's arrive /
barrier / wait_root / settle between its chunks: one protocol for all. Its copies are
NumPy's, but for those into a destination as large as the cache (`stream_copy`, which
bypasses the caches, as a broadcast's root does into its slots from 8 KiB to 1 MiB) and
its reduction, which publishes as it reduces (`reduce_publish`); all of them release the
GIL.

Waiting spins ~10 µs, then yields the core for up to 5 ms (releasing the GIL, running
Python's signal handlers), then sleeps up to 1 ms at a time, checking for an abort
between sleeps: a KeyboardInterrupt or an abort lands within a millisecond or so. More
ranks than cores must not starve, and a rank that sleeps wakes up to ~1 ms late while
its peer waits for it at the next barrier; DataParallel's ranks reach the end-of-step
allreduce a few ms apart (their steps vary), so the yielding covers that gap.

Slot reuse rule (why two slots are enough): every use of a slot (one chunk of a
collective) takes the next parity, alternating across chunks and across calls. Between
two barriers a rank writes either the parity nobody reads in that phase, or a region of
its own slot that nobody reads in that phase (see `_rsag`). So a slot is never
overwritten while another rank may still read it, without any extra barrier.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import numpy as np

from . import agent as agent_mod
from ._ring import ELEMENT_TYPES, KINDS, Ring, read_peer, reduce_publish, signature, stream_copy
from .waiting import check_abort

CACHE_LINE = 64
# A broadcast is cut into at least 4 chunks of at least this (at most chunk_bytes), so
# the receivers copy one chunk out while the root copies the next one in.
BROADCAST_PIECE_BYTES = 256 << 10
# ... and a broadcast as large as the last-level cache (it streams from memory) into
# pieces of this, which measured faster there; below the cache's size 2 MiB pieces are
# faster (benchmarks/bench_pieces.py).
STREAMING_PIECE_BYTES = 512 << 10
# 2 MiB per slot: large enough that Python's per-chunk overhead (a few µs) is small
# beside the copy, small enough that both slots of every rank stay in the last-level
# cache (much smaller chunks lose bandwidth to that overhead, larger ones to the cache).
DEFAULT_CHUNK_BYTES = 2 << 20
# An allgather moves each rank's part in pieces of this (at most chunk_bytes), pipelined:
# a rank reads the others' piece j-1 while it writes its piece j. Smaller than the
# allreduce's chunk, since an allgather does no arithmetic between its copies
# (benchmarks/bench_pieces.py times the choices; docs/performance.md has the figures).
ALLGATHER_PIECE_BYTES = 512 << 10

# A collective's copies into the caller's buffer go around the caches (`stream_copy`)
# when that buffer is at least this fraction of the last-level cache (a broadcast's or
# an allgather's destination), or the whole cache (an allreduce's, whose lines its own
# copy-in has just read): a cached store would first read each line from memory, to
# evict it again before the call ends. Below these sizes cached stores measured as fast
# or faster (docs/performance.md).
STREAM_FRACTION_OF_CACHE = 4

# An allreduce from this size, where the ranks can read each other, goes the way rank 0
# last measured faster: through the slots, or read out of the other ranks' buffers (the
# module's docstring says why there are two).
READ_WAY_MIN_BYTES = 1 << 20

UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum}

# the element types the ring reduces, by the ring's code; others take the chunked path
DTYPE_CODES = {np.dtype(name): code for code, name in enumerate(ELEMENT_TYPES)}


def _timed(times: dict[str, float], name: str, fn: Callable[..., None]) -> Callable[..., None]:
    """fn, adding the seconds each call takes to times[name]."""
    def timed(*args) -> None:
        start = time.perf_counter()
        fn(*args)
        times[name] = times.get(name, 0.0) + time.perf_counter() - start
    return timed


def last_level_cache_bytes() -> int:
    """The size of this CPU's largest cache, from sysfs (32 MiB where it cannot say)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in os.listdir(base):
            with open(f"{base}/{index}/size") as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return best or 32 << 20


def _reducer(op: str, dtype: np.dtype) -> Callable[[np.ndarray, tuple, np.ndarray], None]:
    """The function that reduces an owner's slice with the others' (`mine` ⊕= each of
    `others`, in rank order) and writes the result into `published` too: in one pass, in
    C, for the ring's element types (reading the slice again for a separate copy costs
    a pass through the cache per chunk); with NumPy's ufunc and a copy for the others."""
    code = DTYPE_CODES.get(np.dtype(dtype))
    if code is not None:
        kind = KINDS[op]
        return lambda mine, others, published: reduce_publish(
            mine, others, published, mine.size, code, kind)
    ufunc = UFUNCS[op]

    def reduce_then_copy(mine: np.ndarray, others: tuple, published: np.ndarray) -> None:
        for src in others:
            ufunc(mine, src, out=mine)
        np.copyto(published, mine)
    return reduce_then_copy


def _readable_peers(node_comm) -> list[int] | None:
    """Every node rank's pid, where each rank can read every other's memory
    (process_vm_readv: the same user, no policy against it, one pid namespace); else None.
    Collective on `node_comm`: each rank reads a random token of every other rank's, so a
    pid that names another process here (another namespace) does not pass."""
    from mpi4py import MPI

    token = np.frombuffer(os.urandom(16), np.uint8).copy()
    peers = node_comm.allgather((os.getpid(), int(token.ctypes.data), token.tobytes()))
    me = node_comm.Get_rank()
    try:
        readable = all(read_peer(pid, address, len(data)) == data
                       for r, (pid, address, data) in enumerate(peers) if r != me)
    except OSError:
        readable = False
    readable = node_comm.allreduce(readable, op=MPI.LAND)
    return [pid for pid, _, _ in peers] if readable else None


class ShmBroken(RuntimeError):
    """An earlier collective on this window stopped half-way; the ranks are out of step."""


def _wait_for_release() -> None:
    """A collective that cannot complete (another rank arrived here in a different
    collective, or a rank has gone): wait, interruptibly, for the release (the watchdog's
    report aborts the waits, Ctrl-C interrupts them); never complete with data that
    belongs to another collective. A batch script has no watchdog to release it: the
    collective raises at once, saying why, and the job ends (rank/batch.py)."""
    if agent_mod.current().address is None:
        return
    while True:
        check_abort()
        time.sleep(0.005)


class ShmEngine:
    """Collectives over one shared-memory window spanning the ranks of `node_comm`.

    Creation is collective on `node_comm`. One collective at a time per engine (a lock
    serialises threads; different threads issuing collectives in different orders on
    different ranks is an error in MPI terms too).
    """

    def __init__(self, node_comm, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 allgather_piece_bytes: int = ALLGATHER_PIECE_BYTES,
                 streaming_piece_bytes: int = STREAMING_PIECE_BYTES):
        """The piece sizes are the defaults everywhere but in
        benchmarks/bench_pieces.py, which times the choices against each other."""
        from mpi4py import MPI

        self.size = node_comm.Get_size()
        self.rank = node_comm.Get_rank()
        self.chunk_bytes = chunk_bytes - chunk_bytes % CACHE_LINE
        segment = CACHE_LINE + 2 * self.chunk_bytes
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment near its own rank
        try:
            self.win = MPI.Win.Allocate_shared(segment, 1, info=info, comm=node_comm)
        finally:
            info.Free()
        self.win.Lock_all()
        segments: list[np.ndarray] = []
        self._slots: list[tuple[np.ndarray, np.ndarray]] = []
        for r in range(self.size):
            buf, _ = self.win.Shared_query(r)
            raw = np.frombuffer(buf, np.uint8, count=segment)
            segments.append(raw)
            body = raw[CACHE_LINE:]
            self._slots.append((body[: self.chunk_bytes], body[self.chunk_bytes :]))
        segments[self.rank][:CACHE_LINE] = 0
        # whether every rank may read the others' memory (collectives above one piece then may)
        self.pids = _readable_peers(node_comm)
        self._ring = Ring([int(raw.ctypes.data) for raw in segments], self.rank,
                          self.chunk_bytes, check_abort, _wait_for_release, self._refuse, segments,
                          self.pids)
        self._typed: dict[np.dtype, list[tuple[np.ndarray, np.ndarray]]] = {}
        # seconds spent in each pass of the chunked allreduce ("copy in", "reduce",
        # "copy out", "barrier"), summed, while a caller sets it to a dict (which holds
        # every allreduce to that way, through the slots): where a large allreduce's time
        # goes (benchmarks/bench_allreduce_passes.py); None, untimed
        self.pass_times: dict[str, float] | None = None
        self._small_views: dict[tuple[np.dtype, int], tuple[list[np.ndarray], ...]] = {}
        self._other_ranks = [r for r in range(self.size) if r != self.rank]
        # Below this, saving a barrier matters more than the (n-1)× redundant arithmetic
        # of every rank reducing everything (2 ranks: one-shot 40 µs against 63 µs for
        # reduce-scatter/all-gather at 128 KiB, even at 512 KiB).
        self.oneshot_bytes = min(self.chunk_bytes, (256 << 10) // (self.size - 1))
        self._allgather_piece = min(self.chunk_bytes, allgather_piece_bytes)
        self._broadcast_piece = min(self.chunk_bytes, BROADCAST_PIECE_BYTES)
        self._streaming_piece = streaming_piece_bytes
        # agreed: every rank of a broadcast must cut it into the same pieces
        self._cache_bytes = node_comm.allreduce(last_level_cache_bytes(), op=MPI.MIN)
        self._stream_bytes = self._cache_bytes // STREAM_FRACTION_OF_CACHE
        # MPI's idiom for shared windows: every flag is 0 before anyone reads one.
        self.win.Sync()
        node_comm.Barrier()
        self.win.Sync()

    def close(self) -> None:
        """Free the window (collective on the node communicator)."""
        self.win.Unlock_all()
        self.win.Free()

    # -- synchronisation ---------------------------------------------------------------
    def _typed_slots(self, dtype: np.dtype) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per rank, both slots viewed as `dtype`: made once (a view costs ~1 µs)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = [
                tuple(s[: len(s) // dtype.itemsize * dtype.itemsize].view(dtype) for s in pair)
                for pair in self._slots
            ]
        return typed

    def _next_parity(self) -> int:
        ring = self._ring
        ring.use += 1
        return ring.use & 1

    def _run(self, fn, *args) -> None:
        """Run one collective under the ring's lock (one at a time per engine); if it
        stops half-way, the ring refuses the next (no silent hang)."""
        with self._ring:
            fn(*args)

    @staticmethod
    def _refuse() -> None:
        raise ShmBroken(
            "an earlier collective on this communicator was interrupted half-way, "
            "so the ranks are out of step: restart them (%mpilab restart)"
        )

    # -- collectives -----------------------------------------------------------------
    def allreduce(self, arr: np.ndarray, op: str, to_root_only: bool = False) -> None:
        """Reduce 1-D contiguous `arr` across the node in place.

        With to_root_only, only node rank 0 is guaranteed the result (the first half of
        the hierarchical allreduce), which saves the other ranks' copy-out.
        """
        code = DTYPE_CODES.get(arr.dtype)
        if arr.nbytes <= self.oneshot_bytes and code is not None:
            self._ring.allreduce(arr, arr.size, code, KINDS[op])
            return
        sig = signature(op, arr.nbytes)
        if (code is not None and self.pids is not None and not to_root_only
                and arr.nbytes >= READ_WAY_MIN_BYTES and self.pass_times is None):
            self._run(self._either_way, arr, op, code, sig)
            return
        self._run(self._rsag, arr, _reducer(op, arr.dtype), to_root_only, sig)

    def _either_way(self, arr: np.ndarray, op: str, code: int, sig: int) -> None:
        """An allreduce of READ_WAY_MIN_BYTES or more where the ranks can read each
        other: rank 0 announces the way it measured faster (the ring's
        `announce_allreduce`), reduce-scatter/all-gather through the slots (`_rsag`) or
        read out of the other ranks' buffers (`read_allreduce`), and records its time."""
        ring = self._ring
        ring.sig = sig
        ring.settle()
        way = ring.announce_allreduce(arr.nbytes, arr)
        if way:
            ring.read_allreduce(arr, arr.size, code, KINDS[op])
        else:
            self._rsag(arr, _reducer(op, arr.dtype), False, sig)
        ring.allreduce_done(arr.nbytes, way)

    def split_allreduce(self, arr: np.ndarray, op: str,
                        across: Callable[[np.ndarray], None]) -> None:
        """Reduce `arr` (at most one chunk) across the node and, slice by slice, across
        the nodes: each rank reduces the slice it owns over the node's slots, hands it
        to `across` (which reduces it in place with the same slice on the other nodes),
        and publishes it; then every rank gathers the others' slices. So each rank
        sends only its share of the message between nodes. Every node must hold as many
        ranks (the same node rank owns the same slice everywhere).

        The single-chunk case of _rsag, with its slot views made once per size: the
        same slot reuse rule holds (see the module's docstring)."""
        if arr.nbytes > self.chunk_bytes:
            raise ValueError(f"split_allreduce takes at most {self.chunk_bytes} bytes, "
                             f"not {arr.nbytes}")
        self._run(self._split, arr, UFUNCS[op], across, signature(op, arr.nbytes))

    def _split(self, arr: np.ndarray, ufunc, across, sig: int) -> None:
        me, ring = self.rank, self._ring
        edges = self._slice_edges(arr.size, arr.dtype.itemsize)
        slots = self._views(arr.dtype, arr.size)[self._next_parity()]
        lo, hi = edges[me], edges[me + 1]
        mine, published = arr[lo:hi], slots[me][lo:hi]
        ring.sig = sig
        ring.settle()
        if lo:
            np.copyto(slots[me][:lo], arr[:lo])
        if hi < arr.size:
            np.copyto(slots[me][hi:], arr[hi:])
        ring.barrier()
        if hi > lo:  # the owner alone computes its slice: identical bits everywhere
            for r in self._other_ranks:
                ufunc(mine, slots[r][lo:hi], out=mine)
            across(mine)
            np.copyto(published, mine)
        ring.barrier()
        for r in self._other_ranks:
            if edges[r + 1] > edges[r]:
                np.copyto(arr[edges[r]:edges[r + 1]], slots[r][edges[r]:edges[r + 1]])

    def _slice_edges(self, count: int, itemsize: int) -> list[int]:
        """Where each rank's slice of `count` elements begins, then `count`: equal
        shares, their edges on cache lines."""
        unit = max(1, CACHE_LINE // itemsize)
        return [count * r // self.size // unit * unit for r in range(self.size)] + [count]

    def small_allreduce(self, address: int, dtype: np.dtype, count: int, op: str,
                        ) -> Callable[[], None] | None:
        """A function that reduces the `count` elements of `dtype` at `address` in place
        (one piece, in C): for a caller that reduces the same buffer again and again
        (mpilab.allreduce's plan of a tensor). None above the one-shot size, or for an
        element type the ring does not reduce."""
        dtype = np.dtype(dtype)
        code = DTYPE_CODES.get(dtype)
        if count * dtype.itemsize > self.oneshot_bytes or code is None:
            return None
        return functools.partial(self._ring.allreduce, address, count, code, KINDS[op])

    def small_broadcast(self, address: int, nbytes: int) -> Callable[[int], None] | None:
        """A function of the root that broadcasts the `nbytes` at `address` (one piece,
        in C); None for larger ones."""
        if nbytes > self._broadcast_piece:
            return None
        return functools.partial(self._ring.broadcast, address, nbytes)

    def small_allgather(self, address: int, nbytes: int) -> Callable[[int], None] | None:
        """A function of the receive buffer's address that gathers every rank's `nbytes`
        at `address` into it, in rank order (one piece, in C); None for larger ones."""
        if nbytes > self._allgather_piece:
            return None
        return functools.partial(self._ring.allgather, address, nbytes)

    def _views(self, dtype: np.dtype, count: int) -> tuple[list[np.ndarray], ...]:
        """Per parity, every rank's slot as `count` elements of `dtype`: made once per
        (dtype, count), since small messages repeat their sizes (a training step's
        buckets, a metric) and a view costs about as much as copying 4 KiB."""
        key = (dtype, count)
        views = self._small_views.get(key)
        if views is None:
            if len(self._small_views) >= 256:
                self._small_views.clear()
            typed = self._typed_slots(dtype)
            views = self._small_views[key] = tuple(
                [pair[p][:count] for pair in typed] for p in (0, 1))
        return views

    def _rsag(self, arr: np.ndarray, reduce_slice: Callable[..., None], to_root_only: bool,
              sig: int) -> None:
        """Reduce-scatter then all-gather, chunk by chunk, one barrier per chunk.

        Chunk j is split into one slice per rank; rank r owns slice r. Phase j (between
        barriers) does: copy_out(j-1), reduce(j), copy_in(j+1), where
          copy_in(k):  write my slices != me of chunk k into my slot (parity k)
          reduce(k):   slice me of my array ⊕= the others' slots, in place (the line is
                       already in cache, so writing it costs no extra memory traffic),
                       the result written into slice me of my slot (parity k) for the
                       others in the same pass (`_reducer`)
          copy_out(k): read every other owner's reduced slice of chunk k into my array
                       (around the caches for an array as large as the last-level
                       cache: STREAM_FRACTION_OF_CACHE)
        In one phase nobody reads what is being written: copy_in writes parity j+1
        slices != owner while others read only the owner's slice of that parity;
        reduce writes the owner's slice of parity j while others read the other slices.
        Each array byte crosses the memory bus once in and once out; the slots stay in
        cache. The loop is plain views and ufuncs, built before the first barrier, so
        Python's per-chunk cost stays a few µs against ~100 µs of copying.
        """
        size, me, dt = self.size, self.rank, arr.dtype
        step = self.chunk_bytes // dt.itemsize
        typed = self._typed_slots(dt)
        # One set of slice edges for every chunk of the call (the last chunk, shorter,
        # is clipped): chunks j-1 and j+1 share a slot, and their slices must line up
        # for copy_in(j+1) and copy_out(j-1) never to touch the same bytes.
        edges0 = self._slice_edges(min(step, arr.size), dt.itemsize)
        phases = []  # per chunk: (copy_in pairs, (my slice, others' slots), my slot's slice,
        #            copy_out pairs)
        for start in range(0, arr.size, step):
            c = arr[start : start + step]
            b = [min(e, c.size) for e in edges0]
            parity = self._next_parity()
            slots = [pair[parity][: c.size] for pair in typed]
            own = slice(b[me], b[me + 1])
            outside = [(slots[me][s], c[s]) for s in (slice(0, b[me]), slice(b[me + 1], None))]
            others = tuple(slots[r][own] for r in range(size) if r != me)
            gather = [] if to_root_only and me != 0 else [
                (c[b[r] : b[r + 1]], slots[r][b[r] : b[r + 1]]) for r in range(size) if r != me]
            phases.append((
                [(d, s) for d, s in outside if d.size],
                (c[own], others) if b[me + 1] > b[me] else None,
                slots[me][own],
                [(d, s) for d, s in gather if d.size],
            ))

        def copy_in(k: int) -> None:
            for dst, src in phases[k][0]:
                np.copyto(dst, src)

        def reduce(k: int) -> None:
            operands, published = phases[k][1], phases[k][2]
            if operands is None:
                return
            # The owner alone computes its slice and everyone copies it, so all ranks
            # get identical bits.
            reduce_slice(operands[0], operands[1], published)

        out = stream_copy if arr.nbytes >= self._cache_bytes else np.copyto

        def copy_out(k: int) -> None:
            for dst, src in phases[k][3]:
                out(dst, src)

        ring = self._ring
        barrier = ring.barrier
        if self.pass_times is not None:
            copy_in, reduce, copy_out, barrier = (
                _timed(self.pass_times, name, fn) for name, fn in (
                    ("copy in", copy_in), ("reduce", reduce), ("copy out", copy_out),
                    ("barrier", barrier)))
        ring.sig = sig
        ring.settle()
        copy_in(0)
        barrier()
        for j in range(len(phases)):
            if j > 0:
                copy_out(j - 1)
            reduce(j)
            if j + 1 < len(phases):
                copy_in(j + 1)
            barrier()
        copy_out(len(phases) - 1)

    def broadcast(self, arr: np.ndarray, root: int = 0) -> None:
        """Broadcast 1-D contiguous `arr` from node rank `root`, in C, pipelined by piece:
        the root copies piece j in while the receivers copy piece j-1 out; the receivers
        wait for the root alone, the root for nobody (see the module's docstring). Up to
        BROADCAST_PIECE_BYTES it is one piece."""
        nbytes = arr.nbytes
        if nbytes <= self._broadcast_piece:
            self._ring.broadcast(arr, nbytes, root)
            return
        piece = min(self.chunk_bytes, max(BROADCAST_PIECE_BYTES, nbytes // 4))
        if nbytes >= self._cache_bytes:
            piece = min(piece, self._streaming_piece)
        piece -= piece % CACHE_LINE
        self._ring.broadcast(arr, nbytes, root, piece, nbytes >= self._stream_bytes)

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Every node rank's 1-D contiguous `send` into `recv`, in node-rank order
        (recv.size = size × send.size, same dtype), in C: pipelined by piece
        (ALLGATHER_PIECE_BYTES), a rank writing its piece j into its slot while it reads
        the others' piece j-1, or, above one piece, read straight out of the others'
        memory where rank 0 measured that faster (the ring's `allgather`)."""
        nbytes = send.nbytes
        if nbytes <= self._allgather_piece:
            if nbytes:
                self._ring.allgather(send, nbytes, recv)
            return
        self._ring.allgather(send, nbytes, recv, self._allgather_piece,
                             recv.nbytes >= self._stream_bytes)

    def sync(self) -> None:
        """A barrier of the node's ranks (one flag each; interruptible like the rest)."""
        self._run(self._sync)

    def _sync(self) -> None:
        ring = self._ring
        ring.sig = signature("barrier", 0)
        ring.settle()
        ring.barrier()

"""Shared-memory collectives among the ranks of one node (an MPI-3 shared window).

Why: ranks on one node share memory, so an allreduce is bounded by memory bandwidth,
not by a network. MPI's and gloo's intra-node channels copy each message several times
through small bounce buffers; here every rank reads the others' data straight from one
shared window, with NumPy kernels (which release the GIL) and one flag barrier per chunk.

Layout of each rank's segment of the window::

    [flag: int64, then 4 int64 signatures, in one 64-byte cache line][slot 0][slot 1]

Synchronisation: a barrier is "bump my flag to the next epoch (arrive), wait until every
flag has reached it" (monotonic counters, so no reset race). `Win.Sync` around it is the
memory barrier MPI's unified model asks for, except on x86-64, whose memory model
already keeps stores in order with stores and loads with loads (all the flag protocol
needs: slot writes before the flag write, the flag read before slot reads); each call
into MPI costs ~0.15 µs of a 2-µs collective. A broadcast needs less: the receivers wait
for the root's arrival alone and copy; the root waits only for the receivers' arrivals,
which they make as they start, before they copy. So the root copies the next chunk (or
the next call's data) in while the receivers copy this one out, and a broadcast costs
about one copy, not the root's copy and then the receivers'. A receiver owes the rest of
the barrier (`_owed`: that the other receivers arrived) and settles it at the start of
its next collective (`_settle`), so no rank is ever more than one epoch ahead of another.

With each arrival a rank announces which collective it is in (a signature: the kind,
the reduction, a broadcast's root, the bytes; kept by epoch). A rank that finds another
arrived at the same epoch in a different collective does not complete against it (that
would give wrong data and no error): it waits, as MPI's own collectives would, until the
notebook's watchdog names the mismatch from the heartbeats and releases the ranks.

Waiting polls in Python with yields and short sleeps, so a KeyboardInterrupt lands
within a millisecond or so.

Slot reuse rule (why two slots are enough): every use of a slot (one chunk of a
collective) takes the next parity, alternating across chunks and across calls. Between
two barriers a rank writes either the parity nobody reads in that phase, or a region of
its own slot that nobody reads in that phase (see `_rsag`). So a slot is never
overwritten while another rank may still read it, without any extra barrier.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable

import numpy as np

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

UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum}

_KIND_CODES = {"sum": 1, "max": 2, "min": 3, "broadcast": 4, "allgather": 5, "barrier": 6}
_RING = 4  # signatures kept per rank, by epoch (ranks are at most one epoch apart)


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


def signature(kind: str, nbytes: int, root: int = 0) -> int:
    """What a rank announces with an arrival: the collective (an allreduce by its
    reduction), a broadcast's root and the bytes, in one int64."""
    return _KIND_CODES[kind] | root << 8 | nbytes << 24

# Win.Sync as a memory barrier where the hardware reorders stores or loads (see above)
FENCES = platform.machine().lower() not in ("x86_64", "amd64")

_HOT_SPINS = 256  # ~10 µs of pure polling: the partner usually arrives within that
# then yield the core (more ranks than cores must not starve) for up to 5 ms before
# sleeping: a rank that sleeps wakes up to ~1 ms late, and its peer waits for it at the
# next barrier. DataParallel's ranks reach the end-of-step allreduce a few ms apart
# (their steps vary), so the yielding covers that gap.
_YIELD_S = 0.005
_MAX_SLEEP_S = 0.001


class ShmBroken(RuntimeError):
    """An earlier collective on this window stopped half-way; the ranks are out of step."""


def _mismatched() -> None:
    """Another rank arrived here in a different collective: wait, interruptibly, for the
    release (the watchdog's mismatch report aborts the waits, Ctrl-C interrupts them);
    never complete with data that belongs to another collective."""
    while True:
        check_abort()
        time.sleep(0.005)


def _wait_flag(flag: memoryview, target: int) -> None:
    """Wait until flag[0] >= target, staying responsive to signals."""
    for _ in range(_HOT_SPINS):
        if flag[0] >= target:
            return
    start = time.perf_counter()
    while flag[0] < target:
        waited = time.perf_counter() - start
        if waited < _YIELD_S:
            os.sched_yield()
        else:
            check_abort()  # a released rank (peer failed) stops waiting, on any thread
            time.sleep(min(_MAX_SLEEP_S, waited / 16))


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
        # flags as int64 memoryviews: reading one costs a third of a NumPy scalar read,
        # and a small allreduce reads them in its spin loop
        self._flags: list[memoryview] = []
        self._sigs: list[memoryview] = []
        self._slots: list[tuple[np.ndarray, np.ndarray]] = []
        for r in range(self.size):
            buf, _ = self.win.Shared_query(r)
            raw = np.frombuffer(buf, np.uint8, count=segment)
            self._flags.append(memoryview(raw[:8]).cast("q"))
            self._sigs.append(memoryview(raw[8 : 8 * (1 + _RING)]).cast("q"))
            body = raw[CACHE_LINE:]
            self._slots.append((body[: self.chunk_bytes], body[self.chunk_bytes :]))
        self._typed: dict[np.dtype, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._small_views: dict[tuple[np.dtype, int], tuple[list[np.ndarray], ...]] = {}
        self._flags[self.rank][0] = 0
        self._flag, self._sig_ring = self._flags[self.rank], self._sigs[self.rank]
        self._other_ranks = [r for r in range(self.size) if r != self.rank]
        self._others = [(self._flags[r], self._sigs[r]) for r in self._other_ranks]
        # Below this, saving a barrier matters more than the (n-1)× redundant arithmetic
        # of every rank reducing everything (2 ranks: one-shot 40 µs against 63 µs for
        # reduce-scatter/all-gather at 128 KiB, even at 512 KiB).
        self.oneshot_bytes = min(self.chunk_bytes, (256 << 10) // (self.size - 1))
        self._allgather_piece = min(self.chunk_bytes, allgather_piece_bytes)
        self._streaming_piece = streaming_piece_bytes
        # agreed: every rank of a broadcast must cut it into the same pieces
        self._cache_bytes = node_comm.allreduce(last_level_cache_bytes(), op=MPI.MIN)
        self._epoch = 0
        self._sig = 0  # the signature of the collective in progress
        self._owed = 0  # an epoch this rank arrived at without waiting for the others
        self._owed_sig = 0  # and the signature it arrived with
        self._use = 0
        self._lock = threading.Lock()
        self._broken = False
        # MPI's idiom for shared windows: every flag is 0 before anyone reads one.
        self.win.Sync()
        node_comm.Barrier()
        self.win.Sync()

    def close(self) -> None:
        """Free the window (collective on the node communicator)."""
        self.win.Unlock_all()
        self.win.Free()

    # -- synchronisation ---------------------------------------------------------------
    def arrive(self) -> int:
        """Bump this rank's flag to the next epoch (after its slot writes), announcing
        the collective in progress (self._sig); returns the epoch."""
        self._epoch += 1
        epoch = self._epoch
        self._sig_ring[epoch & 3] = self._sig
        if FENCES:
            self.win.Sync()  # release: my slot writes are visible before my flag
        self._flag[0] = epoch
        return epoch

    def barrier(self) -> None:
        self._wait_arrivals(self.arrive())
        self._owed = 0  # every flag is past it now
        if FENCES:
            self.win.Sync()  # acquire: read the others' slots only after their flags

    def _wait_arrivals(self, epoch: int) -> None:
        """Wait until every other rank has arrived at `epoch`, checking that it is in the
        same collective (a barrier; a broadcast's root, which waits for the receivers'
        arrivals, not their copies: they arrive before they copy)."""
        sig = self._sig
        for flag, sigs in self._others:
            if flag[0] < epoch:
                _wait_flag(flag, epoch)
            if sigs[epoch & 3] != sig:
                _mismatched()

    def _wait_root(self, root: int, epoch: int) -> None:
        """A broadcast's receiver: wait for the root's arrival alone."""
        flag = self._flags[root]
        if flag[0] < epoch:
            _wait_flag(flag, epoch)
        if self._sigs[root][epoch & 3] != self._sig:
            _mismatched()
        if FENCES:
            self.win.Sync()  # acquire: the root's chunk after its flag

    def _settle(self) -> None:
        """At the start of a collective: the wait a broadcast left owing. Every other
        rank has then arrived where this one did, so it has read what it was to read of
        the slot parity about to be written (the reads of a use end before the next
        arrival), and no rank gets more than one epoch ahead. Nothing owed: nothing to do
        (the hot paths test `_owed` before calling)."""
        owed, sig = self._owed, self._owed_sig
        if not owed:
            return
        for flag, sigs in self._others:
            if flag[0] < owed:
                _wait_flag(flag, owed)
            if sigs[owed & 3] != sig:
                _mismatched()
        self._owed = 0
        if FENCES:
            self.win.Sync()

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
        self._use += 1
        return self._use & 1

    def _run(self, fn, *args) -> None:
        """Run one collective; if it stops half-way, refuse the next (no silent hang)."""
        with self._lock:
            if self._broken:
                self._refuse()
            try:
                fn(*args)
            except BaseException:
                self._broken = True
                raise

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
        if arr.nbytes > self.oneshot_bytes:
            self._run(self._rsag, arr, UFUNCS[op], to_root_only, signature(op, arr.nbytes))
            return
        # _run inlined: a 4 KiB allreduce takes ~4 µs, and every call level is ~0.1 µs
        with self._lock:
            if self._broken:
                self._refuse()
            try:
                self._sig = signature(op, arr.nbytes)
                self._oneshot(arr, UFUNCS[op])
            except BaseException:
                self._broken = True
                raise

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
        me = self.rank
        edges = self._slice_edges(arr.size, arr.dtype.itemsize)
        self._use += 1
        slots = self._views(arr.dtype, arr.size)[self._use & 1]
        lo, hi = edges[me], edges[me + 1]
        mine, published = arr[lo:hi], slots[me][lo:hi]
        self._sig = sig
        if self._owed:
            self._settle()
        if lo:
            np.copyto(slots[me][:lo], arr[:lo])
        if hi < arr.size:
            np.copyto(slots[me][hi:], arr[hi:])
        self.barrier()
        if hi > lo:  # the owner alone computes its slice: identical bits everywhere
            for r in self._other_ranks:
                ufunc(mine, slots[r][lo:hi], out=mine)
            across(mine)
            np.copyto(published, mine)
        self.barrier()
        for r in self._other_ranks:
            if edges[r + 1] > edges[r]:
                np.copyto(arr[edges[r]:edges[r + 1]], slots[r][edges[r]:edges[r + 1]])

    def _slice_edges(self, count: int, itemsize: int) -> list[int]:
        """Where each rank's slice of `count` elements begins, then `count`: equal
        shares, their edges on cache lines."""
        unit = max(1, CACHE_LINE // itemsize)
        return [count * r // self.size // unit * unit for r in range(self.size)] + [count]

    def small_allreduce(self, dtype: np.dtype, count: int, op: str,
                        ) -> Callable[[np.ndarray], None] | None:
        """allreduce(arr, op) for arrays of `count` elements of `dtype`, with what it
        looks up made once: for a caller that reduces the same shape again and again
        (mpilab.allreduce's plan of a tensor). None above the one-shot size."""
        dtype = np.dtype(dtype)
        if count * dtype.itemsize > self.oneshot_bytes:
            return None
        ufunc, me, lock = UFUNCS[op], self.rank, self._lock
        views = self._views(dtype, count)
        rest = tuple(v[2:] for v in views)
        sig = signature(op, count * dtype.itemsize)

        def run(arr: np.ndarray) -> None:
            with lock:
                if self._broken:
                    self._refuse()
                try:
                    self._sig = sig
                    self._use += 1
                    parity = self._use & 1
                    srcs = views[parity]
                    if self._owed:
                        self._settle()
                    np.copyto(srcs[me], arr)
                    self.barrier()
                    # the same order of operands on every rank: identical bits
                    ufunc(srcs[0], srcs[1], out=arr)
                    for src in rest[parity]:
                        ufunc(arr, src, out=arr)
                except BaseException:
                    self._broken = True
                    raise

        return run

    def small_broadcast(self, count: int) -> Callable[[np.ndarray, int], None] | None:
        """broadcast(arr, root) for uint8 arrays of `count` bytes that fit in one piece,
        with what it looks up made once (as small_allreduce). None for larger ones."""
        if count > BROADCAST_PIECE_BYTES:
            return None
        views, lock = self._views(np.dtype(np.uint8), count), self._lock
        me, base = self.rank, signature("broadcast", count)

        def run(arr: np.ndarray, root: int) -> None:
            with lock:
                if self._broken:
                    self._refuse()
                try:
                    self._sig = sig = base | root << 8
                    self._use += 1
                    slot = views[self._use & 1][root]
                    if self._owed:
                        self._settle()
                    if me == root:
                        np.copyto(slot, arr)
                        self._wait_arrivals(self.arrive())
                        return
                    epoch = self.arrive()
                    self._wait_root(root, epoch)
                    np.copyto(arr, slot)
                    self._owed, self._owed_sig = epoch, sig
                except BaseException:
                    self._broken = True
                    raise

        return run

    def small_allgather(self, count: int) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """allgather(send, recv) for uint8 arrays of `count` bytes that fit in one piece,
        with what it looks up made once (as small_allreduce). None for larger ones."""
        if count > self._allgather_piece:
            return None
        views, lock, me = self._views(np.dtype(np.uint8), count), self._lock, self.rank
        parts = [(r, slice(r * count, (r + 1) * count)) for r in self._other_ranks]
        mine = slice(me * count, (me + 1) * count)
        sig = signature("allgather", count)

        def run(send: np.ndarray, recv: np.ndarray) -> None:
            with lock:
                if self._broken:
                    self._refuse()
                try:
                    self._sig = sig
                    self._use += 1
                    slots = views[self._use & 1]
                    if self._owed:
                        self._settle()
                    np.copyto(slots[me], send)
                    np.copyto(recv[mine], send)
                    self.barrier()
                    for r, part in parts:
                        np.copyto(recv[part], slots[r])
                except BaseException:
                    self._broken = True
                    raise

        return run

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

    def _oneshot(self, arr: np.ndarray, ufunc) -> None:
        self._use += 1
        srcs = self._views(arr.dtype, arr.size)[self._use & 1]  # every rank's slot
        if self._owed:
            self._settle()
        np.copyto(srcs[self.rank], arr)
        self.barrier()
        # The same order of operands on every rank, so every rank gets identical bits.
        ufunc(srcs[0], srcs[1], out=arr)
        for s in srcs[2:]:
            ufunc(arr, s, out=arr)

    def _rsag(self, arr: np.ndarray, ufunc, to_root_only: bool, sig: int) -> None:
        """Reduce-scatter then all-gather, chunk by chunk, one barrier per chunk.

        Chunk j is split into one slice per rank; rank r owns slice r. Phase j (between
        barriers) does: copy_out(j-1), reduce(j), copy_in(j+1), where
          copy_in(k):  write my slices != me of chunk k into my slot (parity k)
          reduce(k):   slice me of my array ⊕= the others' slots, in place (the line is
                       already in cache, so writing it costs no extra memory traffic),
                       then copied into slice me of my slot (parity k) for the others
          copy_out(k): read every other owner's reduced slice of chunk k into my array
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
            others = [slots[r][own] for r in range(size) if r != me]
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
            mine, others = operands
            for src in others:
                ufunc(mine, src, out=mine)
            np.copyto(published, mine)

        def copy_out(k: int) -> None:
            for dst, src in phases[k][3]:
                np.copyto(dst, src)

        self._sig = sig
        if self._owed:
            self._settle()
        copy_in(0)
        self.barrier()
        for j in range(len(phases)):
            if j > 0:
                copy_out(j - 1)
            reduce(j)
            if j + 1 < len(phases):
                copy_in(j + 1)
            self.barrier()
        copy_out(len(phases) - 1)

    def broadcast(self, arr: np.ndarray, root: int = 0) -> None:
        """Broadcast 1-D contiguous `arr` from node rank `root`, pipelined by chunk: the
        root copies chunk j in (parity j) while the receivers copy chunk j-1 out; the
        receivers wait for the root alone, the root for nobody (see the module's
        docstring)."""
        self._run(self._broadcast, arr, root)

    def _broadcast(self, arr: np.ndarray, root: int) -> None:
        dt = arr.dtype
        piece = min(self.chunk_bytes, max(BROADCAST_PIECE_BYTES, arr.nbytes // 4))
        if arr.nbytes >= self._cache_bytes:
            piece = min(piece, self._streaming_piece)
        step = piece // CACHE_LINE * CACHE_LINE // dt.itemsize
        count = min(step, arr.size)
        views = self._views(dt, count)
        self._sig = sig = signature("broadcast", arr.nbytes, root)
        for start in range(0, arr.size, step):
            self._use += 1
            chunk = arr[start : start + step] if count < arr.size else arr
            slot = views[self._use & 1][root][: chunk.size]
            if self._owed:
                self._settle()
            if self.rank == root:
                np.copyto(slot, chunk)
                self._wait_arrivals(self.arrive())
            else:
                epoch = self.arrive()
                self._wait_root(root, epoch)
                np.copyto(chunk, slot)
                self._owed, self._owed_sig = epoch, sig

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Every node rank's 1-D contiguous `send` into `recv`, in node-rank order
        (recv.size = size × send.size, same dtype), pipelined by piece
        (ALLGATHER_PIECE_BYTES).

        Phase j: every rank writes piece j of its `send` into its own slot (parity j)
        while it reads piece j-1 of the others' slots (parity j-1), so no slot is written
        while another rank may read it (the rule of `_rsag`).
        """
        self._run(self._allgather, send, recv)

    def _allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        m, me = send.size, self.rank
        if m == 0:
            return
        step = self._allgather_piece // send.dtype.itemsize
        others = self._other_ranks
        self._sig = signature("allgather", send.nbytes)
        if self._owed:
            self._settle()
        if m <= step:  # one piece (small messages): one barrier, views made once
            self._use += 1
            slots = self._views(send.dtype, m)[self._use & 1]
            np.copyto(slots[me], send)
            np.copyto(recv[me * m : (me + 1) * m], send)
            self.barrier()
            for r in others:
                np.copyto(recv[r * m : (r + 1) * m], slots[r])
            return
        typed = self._typed_slots(send.dtype)
        starts = list(range(0, m, step))
        parities = [self._next_parity() for _ in starts]

        def copy_out(k: int) -> None:
            s = starts[k]
            c = min(step, m - s)
            for r in others:
                np.copyto(recv[r * m + s : r * m + s + c], typed[r][parities[k]][:c])

        for j, s in enumerate(starts):
            if j > 0:
                copy_out(j - 1)
            chunk = send[s : s + step]
            np.copyto(typed[me][parities[j]][: chunk.size], chunk)
            np.copyto(recv[me * m + s : me * m + s + chunk.size], chunk)
            self.barrier()
        copy_out(len(starts) - 1)

    def sync(self) -> None:
        """A barrier of the node's ranks (one flag each; interruptible like the rest)."""
        self._run(self._sync)

    def _sync(self) -> None:
        self._sig = signature("barrier", 0)
        if self._owed:
            self._settle()
        self.barrier()

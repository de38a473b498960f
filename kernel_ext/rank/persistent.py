"""Small broadcasts and allgathers over MPI's persistent collectives.

MPICH builds a non-blocking collective's schedule at every call (``MPI_Ibcast``,
``MPI_Iallgather``): several µs, which at a few KiB is as much as the message's trip
between hosts. A persistent collective (MPI 4: ``MPI_Bcast_init``,
``MPI_Allgather_init``) is built once; each call starts it and waits as every mpilab
wait does (driven between hosts, interruptible).

Making one takes the communicator's next collective tag, so every rank must make them in
the same order. One per tensor would break that (a rank may pass a new tensor where
another reuses one), so there is one per (collective, bytes, root), on buffers of its own:
every rank meets a new key at the same call, since the ranks' collectives match. The data
is copied into those buffers and out.

The copies, the start and the wait run in C (`_persistent`): for a tensor with a plan,
`small_broadcast` / `small_allgather` give the plan one C call that keeps its request
while it is alive; other callers go through `broadcast` / `allgather`. The Python around
these calls cost 2-3 µs a call on each rank, and between hosts a rank's peer completes
only once the rank is back asking MPI, so ranks that share a core paid it several times
over: 4 ranks on 2 emulated hosts, at 4 KiB, the public calls went from 0.68-0.76× of
mpi4py (broadcast) and 0.63-0.66× (allgather) to 0.95-1.04× and 0.98-1.04×
(bench_multinode.py, two runs each).

Which sizes go this way (4 ranks on 2 emulated hosts bound to cores, µs a call, median of
7 loops): a broadcast of up to 4 KiB; from 16 KiB, through the nodes' shared memory and
leaders (`across_nodes`) is as fast (16 KiB 49 against 47 this way, 64 KiB 164 against
169; mpi4py's blocking ``Bcast`` 39 and 107), and striped over evenly filled nodes
faster from 8 KiB. An allgather with up to 1 MiB of result: a part of 64 KiB 329 this
way against 358 by ``MPI_Iallgather`` (mpi4py 292), 256 KiB 1,728 against 1,847 (mpi4py
1,666), 1 MiB level (7,195 and 7,176), where the result's copies cost as much as the
schedule saves; over evenly filled nodes, from a part of 8 KiB, striped through the
nodes' shared memory (`across_nodes.takes_allgather`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from . import _persistent, waiting

BROADCAST_MAX_BYTES = 4 << 10
ALLGATHER_MAX_BYTES = 1 << 20  # of the gathered result
# kinds of call kept at once, and the bytes of their buffers; past either all go (at the
# same call on every rank, as their keys arrive in the same order everywhere, with the
# same sizes) and are made again as they are met
_MAX_KEPT = 32
_MAX_KEPT_BYTES = 16 << 20
_bound: bool | None = None  # whether _persistent has MPI's functions (asked once)


def _bind() -> bool:
    """Give `_persistent` MPI_Start and MPI_Test of the MPI library mpi4py loaded; False
    where that is not possible or the MPI is older than version 4."""
    global _bound
    if _bound is None:
        from mpi4py import MPI

        try:
            library = ctypes.CDLL(MPI.__file__)  # already loaded: its MPI library's symbols
            _persistent.bind(ctypes.cast(library.MPI_Start, ctypes.c_void_p).value,
                             ctypes.cast(library.MPI_Test, ctypes.c_void_p).value,
                             MPI.Exception, waiting.SPIN_S)
            _bound = MPI.Get_version() >= (4, 0)
        except (OSError, AttributeError, ValueError):
            _bound = False
    return _bound


class Persistent:
    """The persistent broadcasts and allgathers of one communicator, made as they are
    first needed. `wait` waits for a started request (the communicator's plan's)."""

    def __init__(self, comm, wait: Callable[[object], None]) -> None:
        self._comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._wait = wait
        self._kept: dict[tuple, _persistent.Kept] = {}
        self._kept_bytes = 0
        # False where _persistent cannot call this MPI, or once it has shown it has none
        self._available = _bind()

    def broadcast(self, flat: np.ndarray, root: int) -> bool:
        """`flat` (1-D uint8) from rank `root` to every rank; False (nothing done) where
        it is too large for this way or this MPI lacks persistent collectives."""
        if flat.nbytes > BROADCAST_MAX_BYTES:
            return False
        kept = self._entry(("broadcast", flat.nbytes, root))
        if kept is None:
            return False
        if self._rank == root:
            kept.run(flat, None, self._wait)
        else:
            kept.run(None, flat, self._wait)
        return True

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> bool:
        """Every rank's `send` (1-D uint8) into `recv` in rank order; False as for
        broadcast."""
        if recv.nbytes > ALLGATHER_MAX_BYTES:
            return False
        kept = self._entry(("allgather", send.nbytes))
        if kept is None:
            return False
        kept.run(send, recv, self._wait)
        return True

    def small_broadcast(self, address: int, nbytes: int,
                        fallback: Callable[[int], None]) -> Callable[[int], None] | None:
        """A function of the root that broadcasts the `nbytes` at `address` (a tensor's,
        with a plan) in one C call; `fallback(root)` where this MPI turns out to have no
        persistent collectives. None for larger ones."""
        if nbytes > BROADCAST_MAX_BYTES or not self._available:
            return None
        return _persistent.Planned(self._entry, self._wait, fallback, address, nbytes,
                                   False, self._rank, self._size)

    def small_allgather(self, address: int, nbytes: int,
                        fallback: Callable[[int], None]) -> Callable[[int], None] | None:
        """A function of the receive buffer's address that gathers every rank's `nbytes`
        at `address` into it, as small_broadcast."""
        if nbytes * self._size > ALLGATHER_MAX_BYTES or not self._available:
            return None
        return _persistent.Planned(self._entry, self._wait, fallback, address, nbytes,
                                   True, self._rank, self._size)

    def _entry(self, key: tuple) -> _persistent.Kept | None:
        kept = self._kept.get(key)
        if kept is not None or not self._available:
            return kept
        nbytes = key[1] if key[0] == "broadcast" else key[1] * (1 + self._size)
        if len(self._kept) >= _MAX_KEPT or self._kept_bytes + nbytes > _MAX_KEPT_BYTES:
            self.close()
        try:
            kept = self._make(key)
        except NotImplementedError:  # mpi4py's word for an MPI before version 4
            self._available = False
            return None
        self._kept[key] = kept
        self._kept_bytes += nbytes
        return kept

    def _make(self, key: tuple) -> _persistent.Kept:
        from mpi4py import MPI

        if key[0] == "broadcast":
            _, nbytes, root = key
            sending = receiving = np.empty(nbytes, dtype=np.uint8)
            request = self._comm.Bcast_init(sending, root=root)
        else:
            nbytes = key[1]
            sending = np.empty(nbytes, dtype=np.uint8)
            receiving = np.empty(nbytes * self._size, dtype=np.uint8)
            request = self._comm.Allgather_init(sending, receiving)
        return _persistent.Kept(request, MPI._addressof(request), sending, receiving)

    def close(self) -> None:
        """Free the requests, but one an abort left started: that one goes to
        `waiting.abandon`, with its buffers, till it completes. Every rank closes at the
        same call, so all make the next ones in the same order."""
        for kept in self._kept.values():
            if kept.close():
                waiting.abandon((kept.request,), holder=kept)
        self._kept.clear()
        self._kept_bytes = 0

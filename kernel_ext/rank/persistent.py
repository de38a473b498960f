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
is copied into those buffers and out, and only small messages go this way: from 8 KiB a
broadcast between 2 emulated hosts of 2 ranks is faster through the nodes' shared memory
and leaders (`across_nodes`: 21-23 µs a call against 31-35 this way and 33-36 for
mpi4py's blocking ``Bcast``), and an allgather of 64 KiB a rank went at 0.74-0.79× of
mpi4py this way against 0.82-0.86× by ``MPI_Iallgather`` (its result's copies cost more
than the schedule). The same hosts at 4 KiB, µs a call:
broadcast 11.4-15.5 this way, 16.1-18.3 by ``MPI_Ibcast`` driven, 19.5-31.4 through
shared memory and leaders, mpi4py 12.7-16.9; allgather 44.5-52.0 this way, 50.8-65.4 by
``MPI_Iallgather`` driven, mpi4py 44.2-54.9.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BROADCAST_MAX_BYTES = 4 << 10
ALLGATHER_MAX_BYTES = 64 << 10  # of the gathered result
# kinds of call kept at once; past it all go (at the same call on every rank, as their
# keys arrive in the same order everywhere) and are made again as they are met
_MAX_KEPT = 32
# requests an abort left started, with their buffers: never freed (freeing an active
# persistent collective is erroneous in MPI, and mpi4py frees a request it made when its
# object goes; MPI may still write into the buffers)
_left_started: list = []


class Persistent:
    """The persistent broadcasts and allgathers of one communicator, made as they are
    first needed. `wait` waits for a started request (the communicator's plan's)."""

    def __init__(self, comm, wait: Callable[[object], None]) -> None:
        self._comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._wait = wait
        # key -> (request, send buffer, receive buffer); a broadcast's are one
        self._kept: dict[tuple, tuple] = {}
        self._started = None  # the request started and not yet seen complete
        self._available = True  # False once this MPI has shown it has none

    def broadcast(self, flat: np.ndarray, root: int) -> bool:
        """`flat` (1-D uint8) from rank `root` to every rank; False (nothing done) where
        it is too large for this way or this MPI lacks persistent collectives."""
        if flat.nbytes > BROADCAST_MAX_BYTES:
            return False
        entry = self._entry(("broadcast", flat.nbytes, root))
        if entry is None:
            return False
        request, buffer, _ = entry
        if self._rank == root:
            buffer[:] = flat
        self._run(request)
        if self._rank != root:
            flat[:] = buffer
        return True

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> bool:
        """Every rank's `send` (1-D uint8) into `recv` in rank order; False as for
        broadcast."""
        if recv.nbytes > ALLGATHER_MAX_BYTES:
            return False
        entry = self._entry(("allgather", send.nbytes))
        if entry is None:
            return False
        request, sending, receiving = entry
        sending[:] = send
        self._run(request)
        recv[:] = receiving
        return True

    def _run(self, request) -> None:
        self._started = request
        request.Start()
        self._wait(request)  # an abort raises here and leaves it started
        self._started = None

    def _entry(self, key: tuple) -> tuple | None:
        entry = self._kept.get(key)
        if entry is not None or not self._available:
            return entry
        if len(self._kept) >= _MAX_KEPT:
            self.close()
        try:
            entry = self._make(key)
        except NotImplementedError:  # mpi4py's word for an MPI before version 4
            self._available = False
            return None
        self._kept[key] = entry
        return entry

    def _make(self, key: tuple) -> tuple:
        if key[0] == "broadcast":
            _, nbytes, root = key
            buffer = np.empty(nbytes, dtype=np.uint8)
            return self._comm.Bcast_init(buffer, root=root), buffer, buffer
        nbytes = key[1]
        sending = np.empty(nbytes, dtype=np.uint8)
        receiving = np.empty(nbytes * self._size, dtype=np.uint8)
        return self._comm.Allgather_init(sending, receiving), sending, receiving

    def close(self) -> None:
        """Free the requests, but one an abort left started (`_left_started`). Every
        rank closes at the same call, so all make the next ones in the same order."""
        for entry in self._kept.values():
            request = entry[0]
            if request is self._started:
                _left_started.append(entry)
            else:
                request.Free()
        self._kept.clear()
        self._started = None

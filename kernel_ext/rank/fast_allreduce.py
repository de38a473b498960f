"""The numpy allreduce the MPI path of mpilab's collectives goes through.

One function, so the fastest available implementation is used everywhere
(mpilab.allreduce, DataParallel(backend="mpi"), the benchmarks).
"""

from __future__ import annotations

import numpy as np

from .waiting import wait_interruptibly


def allreduce_inplace(array: np.ndarray, op: str, comm) -> None:
    """Reduce a contiguous array across `comm` in place. op: sum | max | min.

    (mean is sum followed by a division, done by the caller.)
    """
    from mpi4py import MPI

    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
    wait_interruptibly(comm.Iallreduce(MPI.IN_PLACE, array, mpi_op))

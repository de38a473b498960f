"""The piece sizes of the shared-memory engine's large allgather and broadcast, timed
against each other and against mpi4py, on 2 ranks of one node.

    .venv/bin/python benchmarks/bench_pieces.py [--sizes 4M:64M] [--repeats 12] [-n 2]

Why: an allgather moves each rank's part, and a broadcast as large as the last-level
cache moves its message, in pipelined pieces (`shm.ALLGATHER_PIECE_BYTES`,
`shm.STREAMING_PIECE_BYTES`); this is what those choices rest on. One engine per piece
size (2 MiB, 1 MiB, 512 KiB, 256 KiB, 128 KiB), each made with that piece for both
collectives and held to the pipelined way (the ring's `way` 0: pieces through the
slots), one engine held to the other way ("read": each rank reads the others' buffers,
in no pieces; the engines pick between the two by measurement, ahead of the pieces),
and mpi4py's blocking `Allgather` / `Bcast`, take turns at every
repetition (the order rotated), each timing a loop of back-to-back calls moving ~64 MiB
after one untimed call; the slowest rank's time, median of the repetitions. Figures are
bus bandwidth (nccl-tests: allgather's size is the gathered output). The broadcast's
pieces apply from the cache's size (a smaller message moves in pieces of a quarter of
it, 256 KiB to 2 MiB, whatever the engine); below it every engine broadcasts alike.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from options import collective_parser
from ranks import relaunch

PIECES = [2 << 20, 1 << 20, 512 << 10, 256 << 10, 128 << 10]


def main() -> int:
    args = collective_parser(__doc__, "4M:64M", 12).parse_args()
    sizes = args.sizes
    launched = relaunch(args.n)
    if launched is not None:
        return launched

    import numpy as np
    from mpi4py import MPI
    from mpilab.rank.shm import ShmEngine

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    engines = {piece: ShmEngine(comm.Dup(), allgather_piece_bytes=piece,
                                streaming_piece_bytes=piece) for piece in PIECES}
    engines["read"] = ShmEngine(comm.Dup())
    for name, engine in engines.items():
        engine._ring.way = 1 if name == "read" else 0
    names = [*PIECES, "read", "mpi4py"]
    if comm.rank == 0:
        print(f"{n} ranks; load average {os.getloadavg()[0]:.1f}; bus bandwidth GB/s, "
              f"median of {args.repeats}; last-level cache "
              f"{engines[PIECES[0]]._cache_bytes >> 20} MiB")
        print(f"{'':9} {'size':>6} " + " ".join(
            f"{_label(p):>8}" for p in names))
    for op in ("allgather", "broadcast"):
        for size in sizes:
            part = size // n if op == "allgather" else size
            send = np.zeros(part // 4, np.float32)
            send.fill(0)
            recv = np.zeros(part // 4 * n, np.float32)
            recv.fill(0)
            iters = max(3, (64 << 20) // size)
            times: dict = {name: [] for name in names}
            for i in range(args.repeats):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    call = _call(op, name, engines, comm, send, recv)
                    call()
                    comm.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call()
                    took = comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)
                    times[name].append(took)
            if comm.rank == 0:
                moved = size * (n - 1) / n if op == "allgather" else size
                print(f"{op:9} {_label(size):>6} " + " ".join(
                    f"{moved / statistics.median(times[name]) / 1e9:8.2f}" for name in names))
    for engine in engines.values():
        engine.close()
    return 0


def _call(op, name, engines, comm, send, recv):
    if name == "mpi4py":
        return (lambda: comm.Allgather(send, recv)) if op == "allgather" else \
            (lambda: comm.Bcast(send, root=0))
    engine = engines[name]
    return (lambda: engine.allgather(send, recv)) if op == "allgather" else \
        (lambda: engine.broadcast(send, 0))


def _label(value) -> str:
    if isinstance(value, str):
        return value
    return f"{value >> 20}M" if value >= 1 << 20 else f"{value >> 10}K"


if __name__ == "__main__":
    sys.exit(main())

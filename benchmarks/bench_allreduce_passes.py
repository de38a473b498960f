"""Where a large allreduce's time goes: `mpilab.allreduce` of 16-64 MiB on 2 ranks of one
node, its passes timed, against the memory-copy figure.

    .venv/bin/python benchmarks/bench_allreduce_passes.py [--sizes 16M:64M] [--repeats 12]

Why: a user's tensor lives in its own process's memory, so the shared-memory allreduce
stages it (`shm.ShmEngine._rsag`). Each rank makes three passes over its share of
every chunk: **copy in** (the part the other ranks reduce, from the tensor into its
slot of the shared window), **reduce** (its own part with the others' slots, written
to the tensor and published in its slot in the same pass) and **copy out** (the
others' reduced parts into the tensor). On 2 ranks each pass moves half the tensor.
If each pass runs at one core's copy rate (the memory-copy figure,
`mpilab.rank.bench.memcpy_bandwidth`), three passes over half the tensor take as long
as one and a half copies of it: the **staging ceiling** is 2/3 of the figure.

What it does, per size: the public call (`mpilab.allreduce` on a CPU tensor, what a
user calls) timed alone, and the same call with the engine's pass clock on
(`ShmEngine.pass_times`: each pass's seconds summed over the chunks), taking turns at
every repetition; the slowest rank's time, median. GB/s is bus bandwidth (nccl-tests:
2(n-1)/n x size / time); a pass's GB/s is the bytes it moves per rank over its time.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from options import collective_parser
from ranks import relaunch

PASSES = ("copy in", "reduce", "copy out", "barrier")


def main() -> int:
    args = collective_parser(__doc__, "16M:64M", 12).parse_args()
    sizes = args.sizes
    launched = relaunch(args.n)
    if launched is not None:
        return launched

    import mpilab
    import torch
    from mpi4py import MPI
    from mpilab.rank.bench import memcpy_figures
    from mpilab.rank.collectives import private_comm
    from mpilab.rank.fast_allreduce import plan_for

    ctx = mpilab.init()
    comm, n = ctx.comm, ctx.world_size
    route = plan_for(private_comm())
    if route.path != "shm":
        if ctx.rank == 0:
            print(f"the allreduce here is not the shared-memory one ({route.path}): "
                  "run the ranks on one node")
        return 1
    engine = route.node
    load = os.getloadavg()[0]
    # the memory-copy figure alone and on every rank at once, three times each, medians
    alone, together = memcpy_figures(comm, 3)
    figure = statistics.median(alone)
    if ctx.rank == 0:
        print(f"{n} ranks; load average {load:.1f}; memory-copy figure {figure:.2f} GB/s "
              f"(the same copy on every rank at once: {statistics.median(together):.2f} "
              f"GB/s each); staging ceiling (three passes at the figure's rate) "
              f"{figure * _ceiling(n):.2f} GB/s = {_ceiling(n):.0%} of it; "
              f"median of {args.repeats}")
        print(f"{'size':>5} {'allreduce':>16} {'of figure':>9} {'(timed)':>8}  " + "  ".join(
            f"{name:>16}" for name in PASSES))
    for size in sizes:
        tensor = torch.ones(size // 4)
        mpilab.allreduce(tensor)  # its plan, and its pages, made untimed
        plain: list[float] = []
        timed: list[float] = []
        passes: dict[str, list[float]] = {name: [] for name in PASSES}
        for i in range(args.repeats):
            for clocked in ((False, True) if i % 2 == 0 else (True, False)):
                engine.pass_times = {} if clocked else None
                comm.Barrier()
                t0 = time.perf_counter()
                mpilab.allreduce(tensor)
                took = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if clocked:
                    timed.append(took)
                    for name in PASSES:  # the slowest rank's time in each pass
                        passes[name].append(comm.allreduce(
                            engine.pass_times.get(name, 0.0), op=MPI.MAX))
                else:
                    plain.append(took)
        engine.pass_times = None
        if ctx.rank == 0:
            bus = 2 * (n - 1) / n * size
            moved = {"copy in": size * (n - 1) / n, "reduce": size / n,
                     "copy out": size * (n - 1) / n}
            cells = []
            for name in PASSES:
                t = statistics.median(passes[name])
                rate = f" {moved[name] / t / 1e9:5.1f} GB/s" if name in moved and t else ""
                cells.append(f"{t * 1e3:6.2f} ms{rate:>10}" if rate else f"{t * 1e3:6.2f} ms")
            speed = bus / statistics.median(plain) / 1e9
            print(f"{_label(size):>5} {speed:11.2f} GB/s {speed / figure:9.0%} "
                  f"{bus / statistics.median(timed) / 1e9:8.2f}  "
                  + "  ".join(f"{c:>16}" for c in cells))
    return 0


def _ceiling(n: int) -> float:
    """Bus bandwidth over the figure if each rank's three passes (copy in and copy out
    of (n-1)/n of the tensor, reduce of 1/n) ran at the figure's rate."""
    bus = 2 * (n - 1) / n
    return bus / (2 * (n - 1) / n + 1 / n)


def _label(value: int) -> str:
    return f"{value >> 20}M" if value >= 1 << 20 else f"{value >> 10}K"


if __name__ == "__main__":
    sys.exit(main())

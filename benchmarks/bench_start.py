"""Start and stop of ranks: `%mpilab start -n N` / `%mpilab stop` (RankCluster.start and
.stop: torch.distributed ready, the warm-up done; then every process ended and every file
removed) against a bare ipyparallel MPI cluster (`start_and_connect_sync()` until its N
engines registered, `stop_cluster_sync()`).

Alternating repetitions in one run, median. After each stop the benchmark checks that
none of the processes the start created is left (it fails if one is).

    .venv/bin/python benchmarks/bench_start.py [--reps 3] [-n 2]

On this 2-core machine 16 ranks oversubscribe the cores eight times over, so every
per-rank cost (importing torch, the warm-up) is paid eight times in series: read ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import ipyparallel as ipp
import psutil
from mpilab.cluster import ClusterConfig, RankCluster
from options import count


def _left_behind() -> list[str]:
    """Processes descended from this one still running after a stop."""
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{child.pid} {' '.join(child.cmdline()[:3])}")
        except psutil.Error:
            continue
    return left


def run_mpilab(n: int) -> tuple[float, float]:
    cluster = RankCluster(ClusterConfig(n=n))
    began = time.perf_counter()
    cluster.start()
    started = time.perf_counter()
    cluster.stop()
    return started - began, time.perf_counter() - started


def run_bare(n: int) -> tuple[float, float]:
    cluster = ipp.Cluster(engines="mpi", n=n, log_level=40)
    began = time.perf_counter()
    client = cluster.start_and_connect_sync()
    started = time.perf_counter()
    client.close()
    cluster.stop_cluster_sync()
    return started - began, time.perf_counter() - started


def main() -> None:
    # the bare cluster finds mpiexec on PATH, as a user's shell would
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=count, default=3)
    parser.add_argument("-n", type=count, default=2)
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        for name, run in (("mpilab", run_mpilab), ("bare ipyparallel", run_bare)):
            start, stop = run(args.n)
            times.setdefault((name, "start"), []).append(start)
            times.setdefault((name, "stop"), []).append(stop)
            time.sleep(1.0)  # what a stop leaves to the kernel (reaping) settles
            left = _left_behind()
            if left:
                raise SystemExit(f"{name} left processes running after stop: {left}")
    print(f"{args.n} ranks, {args.reps} alternating repetitions, median (all); "
          "nothing left running after any stop")
    for phase in ("start", "stop"):
        med = {name: statistics.median(times[(name, phase)])
               for name in ("mpilab", "bare ipyparallel")}
        for name in med:
            every = ", ".join(f"{x:.2f}" for x in times[(name, phase)])
            print(f"  {phase:<5} {name:<17} {med[name]:6.2f} s   ({every})")
        print(f"  {phase:<5} ratio mpilab / bare = {med['mpilab'] / med['bare ipyparallel']:.2f}x")


if __name__ == "__main__":
    main()

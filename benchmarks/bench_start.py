"""Time to ready ranks: `%mpilab start -n 2` (torch.distributed included) against a
bare `ipyparallel.Cluster(engines="mpi", n=2).start_and_connect_sync()`.

Alternating repetitions in one run, median. Each start is followed by a full stop.

    .venv/bin/python benchmarks/bench_start.py [--reps 3] [-n 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import ipyparallel as ipp
from mpilab.cluster import ClusterConfig, RankCluster


def start_mpilab(n: int) -> float:
    cluster = RankCluster(ClusterConfig(n=n))
    start = time.perf_counter()
    cluster.start()
    elapsed = time.perf_counter() - start
    cluster.stop()
    return elapsed


def start_bare(n: int) -> float:
    cluster = ipp.Cluster(engines="mpi", n=n, log_level=40)
    start = time.perf_counter()
    client = cluster.start_and_connect_sync()
    elapsed = time.perf_counter() - start
    client.close()
    cluster.stop_cluster_sync()
    return elapsed


def main() -> None:
    # the bare cluster finds mpiexec on PATH, as a user's shell would
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("-n", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"mpilab start": [], "bare ipyparallel": []}
    for _ in range(args.reps):
        times["mpilab start"].append(start_mpilab(args.n))
        times["bare ipyparallel"].append(start_bare(args.n))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"start {args.n} ranks until ready, {args.reps} alternating repetitions")
    for name, t in times.items():
        print(f"  {name:<17} median {med[name]:5.2f} s   all {', '.join(f'{x:.2f}' for x in t)}")
    ratio = med["mpilab start"] / med["bare ipyparallel"]
    print(f"  ratio mpilab / bare = {ratio:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()

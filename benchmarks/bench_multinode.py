"""mpilab on several hosts: the collectives' bandwidth and start-to-ready, against the peers.

On the emulated cluster (tests/cluster.py: 2 nodes unless `--nodes` says more, each its
own network, UTS and PID namespace with a real sshd and slurmd; 2 ranks a node unless
`--per-node` says otherwise for the bandwidth run; traffic over veth pairs and a bridge,
not a real NIC):

1. bus bandwidth (nccl-tests' busbw: allreduce 2(n-1)/n x bytes / time, broadcast
   bytes / time, allgather (n-1)/n x gathered bytes / time), float32, 4 KiB to 64 MiB
   (an allgather's part on each rank), of the public calls `mpilab.allreduce(tensor)`,
   `mpilab.broadcast(tensor)` and `mpilab.allgather(tensor, out=...)` (each node's
   shared memory, then MPI between the nodes: docs/cluster.md says which way each size
   goes), mpi4py's blocking `Allreduce` / `Bcast` / `Allgather` and torch gloo's
   `dist.all_reduce` / `broadcast` / `all_gather_into_tensor`, interleaved in one run
   (every repeat runs the three in turn, the order rotating, each with three untimed
   calls before its timed loop of about 20 ms: as many calls as fit, at most 1,000),
   median of the slowest rank's time per repeat;
2. start-to-ready of 2 ranks a node through ssh (`mpiexec -f hostfile`) and through
   Slurm (a batch job), `%mpilab start` (RankCluster.start: ranks bootstrapped,
   torch.distributed ready) against a bare ipyparallel cluster on the same launcher
   (engines registered), alternating, median.

    .venv/bin/python benchmarks/bench_multinode.py [--repeats 15] [--starts 3] [--no-start]
        [--ops allreduce,broadcast,allgather] [--bind-to core|none] [--nodes 2] [--per-node 2]

The bandwidth run binds each rank to a core (`mpiexec -bind-to core`), as Slurm's task
affinity and most MPI launchers do on real hosts. Here each emulated host's launcher
binds its ranks to this machine's cores 0 and 1, so a rank of node1 shares a core with
its peer of every other node; unbound, the kernel moves the busy-polling ranks over 2
cores as it pleases and the small-message figures of every backend swing by ±30%
between runs. With 3 nodes (6 ranks on 2 cores) the figures say how the ways compare
where the node count is not a power of two, not what such hosts would move.

Brings the emulated cluster up and down itself (root, Linux namespaces), each node on
every core of this machine (the tests' cluster gives each node a core of its own).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from options import count

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

MIB = 1 << 20
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
BACKENDS = ("mpilab", "mpi4py", "gloo")


OPS = ("allreduce", "broadcast", "allgather")


def measure_on_ranks(repeats: int, ops: list[str]) -> None:
    """Runs on every rank under mpiexec: prints rank 0's tables."""
    import mpilab

    ctx = mpilab.init()
    comm, n = ctx.comm, ctx.world_size
    nodes = len(set(comm.allgather(ctx.host)))
    for op in ops:
        results: dict[tuple[str, int], list[float]] = {}
        for size in SIZES:
            calls = _calls(op, size // 4, comm, n)
            loops = {}
            for name in BACKENDS:  # warm-up: plans, connections, pages
                for _ in range(3):
                    calls[name]()
                loops[name] = _loops_for(calls[name], comm)
            for r in range(repeats):
                order = BACKENDS[r % 3:] + BACKENDS[:r % 3]
                for name in order:
                    for _ in range(3):  # after another backend's loop: its first calls
                        calls[name]()  # wake what that loop left idle (peers, connections)
                    comm.Barrier()
                    start = time.perf_counter()
                    for _ in range(loops[name]):
                        calls[name]()
                    took = (time.perf_counter() - start) / loops[name]
                    results.setdefault((name, size), []).append(
                        comm.allreduce(took, op=_max()))
        if ctx.rank != 0:
            continue
        factor = {"allreduce": 2 * (n - 1) / n, "broadcast": 1.0, "allgather": n - 1}[op]
        print(f"{op} float32, {n} ranks on {nodes} nodes, bus bandwidth GB/s "
              f"(median of {repeats})")
        print(f"{'size':>8} " + " ".join(f"{b:>8}" for b in BACKENDS) + "   mpilab/best peer")
        for size in SIZES:
            bw = {b: factor * size / statistics.median(results[(b, size)]) / 1e9
                  for b in BACKENDS}
            best = max(bw["mpi4py"], bw["gloo"])
            print(f"{_fmt(size):>8} " + " ".join(f"{bw[b]:8.3f}" for b in BACKENDS)
                  + f"   {bw['mpilab'] / best:5.2f}x", flush=True)


def _calls(op: str, count: int, comm, n: int) -> dict:
    """The three backends' calls of `op` on `count` float32 values a rank (zeros: sums
    repeated hundreds of times stay finite), on `n` ranks."""
    import mpilab
    import numpy as np
    import torch
    import torch.distributed as dist

    tensor = torch.zeros(count)
    array = np.zeros(count, dtype=np.float32)
    if op == "allreduce":
        out = np.empty_like(array)
        return {"mpilab": lambda: mpilab.allreduce(tensor),
                "mpi4py": lambda: comm.Allreduce(array, out),
                "gloo": lambda: dist.all_reduce(tensor)}
    if op == "broadcast":
        return {"mpilab": lambda: mpilab.broadcast(tensor, root=0),
                "mpi4py": lambda: comm.Bcast(array, root=0),
                "gloo": lambda: dist.broadcast(tensor, src=0)}
    gathered = torch.empty((n, count))
    out = np.empty((n, count), dtype=np.float32)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return {"mpilab": lambda: mpilab.allgather(tensor, out=gathered),
            "mpi4py": lambda: comm.Allgather(array, out),
            "gloo": lambda: gather_single(gathered.view(-1), tensor)}


def _loops_for(call, comm, sample_s: float = 0.02) -> int:
    """Calls per timed sample: enough for about `sample_s` (a sample of a few calls of
    50 µs is shorter than a scheduler's time slice, so its median is noise), the same
    on every rank (the slowest rank's estimate)."""
    start = time.perf_counter()
    for _ in range(3):
        call()
    each = comm.allreduce((time.perf_counter() - start) / 3, op=_max())
    return max(1, min(1000, round(sample_s / each)))


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _fmt(n: int) -> str:
    return f"{n // MIB}M" if n >= MIB else f"{n >> 10}K"


def bandwidth(cluster, repeats: int, bind: str, ops: str, per_node: int) -> None:
    hostfile = cluster.hostfile(slots_per_node=per_node)  # every node
    ranks = per_node * len(cluster.names)
    env = {**os.environ, **cluster.env()}
    print(f"ranks bound: mpiexec -bind-to {bind}", flush=True)
    subprocess.run([str(Path(sys.executable).parent / "mpiexec"), "-f", str(hostfile),
                    "-bind-to", bind,
                    "-n", str(ranks), sys.executable, __file__, "--on-ranks",
                    "--repeats", str(repeats), "--ops", ops], env=env, check=True,
                   timeout=3600)


def start_times(cluster, starts: int) -> None:
    import ipyparallel as ipp
    from mpilab.cluster import ClusterConfig, RankCluster
    from mpilab.placement import SlurmSettings, batch_script

    hostfile = str(cluster.hostfile(slots_per_node=2))  # every node
    nodes = len(cluster.names)
    n = 2 * nodes
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    engine = [sys.executable, "-m", "ipyparallel.engine"]

    def mpilab_start(launcher: str) -> float:
        if launcher == "mpi":
            config = ClusterConfig(n=n, hostfile=hostfile)
        else:
            config = ClusterConfig(n=n, launcher="slurm",
                                   slurm=SlurmSettings(nodes=str(nodes), tasks_per_node=2))
        ranks = RankCluster(config)
        began = time.perf_counter()
        ranks.start()
        took = time.perf_counter() - began
        ranks.stop()
        return took

    def bare_start(launcher: str) -> float:
        bare = ipp.Cluster(engines="mpi" if launcher == "mpi" else "slurm", n=n,
                           controller_ip=cluster.head_address, log_level=40, delay=0)
        if launcher == "mpi":
            bare.config.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
            bare.config.MPIEngineSetLauncher.mpi_args = ["-f", hostfile]
            bare.config.MPIEngineSetLauncher.engine_cmd = engine
        else:  # the same job shape: mpiexec inside one batch job of these nodes
            slurm = bare.config.SlurmEngineSetLauncher
            slurm.engine_cmd = engine
            slurm.batch_template = batch_script(
                SlurmSettings(nodes=str(nodes), tasks_per_node=2), mpiexec)
            slurm.batch_file_name = str(Path(bare.profile_dir) / "log" / "bare.sbatch")
        began = time.perf_counter()
        bare.start_cluster_sync()
        client = bare.connect_client_sync()
        client.wait_for_engines(n, timeout=180, interactive=False)
        took = time.perf_counter() - began
        client.close()
        bare.stop_cluster_sync()
        return took

    for launcher, env in (("mpi", cluster.env()), ("slurm", cluster.job_env())):
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            times: dict[str, list[float]] = {"mpilab": [], "bare": []}
            for _ in range(starts):
                times["mpilab"].append(mpilab_start(launcher))
                times["bare"].append(bare_start(launcher))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        med = {k: statistics.median(v) for k, v in times.items()}
        via = "ssh (mpiexec -f)" if launcher == "mpi" else "Slurm (sbatch)"
        print(f"start-to-ready, {n} ranks on {nodes} nodes through {via}, {starts} alternating "
              f"repetitions: mpilab {med['mpilab']:.2f} s (all "
              f"{', '.join(f'{t:.1f}' for t in times['mpilab'])}), bare ipyparallel "
              f"{med['bare']:.2f} s (all {', '.join(f'{t:.1f}' for t in times['bare'])}), "
              f"ratio {med['mpilab'] / med['bare']:.2f}x (target <= 1.3x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=count, default=15)
    parser.add_argument("--starts", type=count, default=3)
    parser.add_argument("--no-start", action="store_true", help="bandwidth only")
    parser.add_argument("--ops", default="allreduce",
                        help="comma-separated, of " + ", ".join(OPS) + " (default: allreduce)")
    parser.add_argument("--bind-to", choices=("core", "none"), default="core",
                        help="how mpiexec binds the bandwidth run's ranks (default: one "
                        "core each, as Slurm and most MPI launchers do)")
    parser.add_argument("--nodes", type=count, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--per-node", type=count, default=2,
                        help="the bandwidth run's ranks on each host (default 2)")
    parser.add_argument("--on-ranks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        parser.error(f"--ops {args.ops!r}: choose from {', '.join(OPS)}")
    if args.on_ranks:
        measure_on_ranks(args.repeats, ops)
        return 0
    from cluster import EmulatedCluster

    if args.nodes < 2:
        parser.error("--nodes: at least 2 (ranks on one host: bench_allreduce.py)")
    cluster = EmulatedCluster(tuple(f"node{i + 1}" for i in range(args.nodes)),
                              every_core=True)
    cluster.up()
    try:
        bandwidth(cluster, args.repeats, args.bind_to, ",".join(ops), args.per_node)
        if not args.no_start:
            start_times(cluster, args.starts)
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""mpilab's collectives, as a user calls them, against mpi4py and torch gloo, on 2 ranks.

    .venv/bin/python benchmarks/bench_allreduce.py [--ops allreduce,broadcast,allgather]
        [--sizes 4K:64M] [--repeats 20] [-n 2] [--json FILE]

Run plainly, it relaunches itself under the venv's mpiexec; under mpiexec it measures.
Rows, all in one run, the backends taking every order in turn at each repetition:

- ``mpilab``: ``mpilab.allreduce / broadcast / allgather`` on a CPU tensor, what a user
  calls (heartbeat state, numbering and spans included);
- ``internal``: the NumPy-level path under it (``allreduce_inplace``, the shared-memory
  engine's broadcast and allgather), to show what the public call adds per call;
- ``mpi4py``: ``comm.Allreduce / Bcast / Allgather`` (blocking) on NumPy arrays;
- ``gloo``: ``torch.distributed`` on CPU tensors.

Every figure is bus bandwidth (nccl-tests) from the median of `repeats` timings of the
slowest rank, each a loop of back-to-back collectives moving ~32 MiB (at most 100 of
them, after a fifth as many untimed ones). A second table gives the fastest repeat:
what each backend does when the node's other tenants leave it alone.

The memory-copy figure (``bench.memcpy_bandwidth``: bytes one core copies per second
between two 256 MiB buffers) is measured in the same run, on rank 0 while the others
wait, and so are the same copy on every rank at once and an in-place pass over 256 MiB
(``bench.pass_bandwidth``: read and write back, the least an allreduce must do with
each rank's buffer) alone and on every rank at once: every rank of an allreduce streams
its buffer at the same time as the others. Targets (issue 24): mpilab ≥ the better of mpi4py and
gloo at every size, at most 5 µs a call above the internal path, and for allreduce at
≥ 16 MiB ≥ 80% of the memory-copy figure ("of memcpy"; "of bound": of the in-place pass
rate each core gets while every rank makes one, the most an allreduce can reach here:
see docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
NAMES = {"mpilab": "mpilab", "mpilab-internal": "internal", "mpi": "mpi4py", "gloo": "gloo"}
OVERHEAD_TARGET_US = 5.0
CEILING_TARGET = 0.80  # allreduce at >= 16 MiB against the memory-copy figure


def _under_mpi() -> bool:
    return any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="allreduce,broadcast,allgather")
    parser.add_argument("--sizes", default="4K:64M")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("-n", type=int, default=2, help="ranks (when launching mpiexec)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if not _under_mpi():
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [str(mpiexec), "-n", str(args.n), sys.executable, __file__, *sys.argv[1:]]
        return subprocess.call(cmd)

    import mpilab
    from mpilab.rank import bench
    from mpilab.rank.waiting import wait_interruptibly

    ctx = mpilab.init()
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    sizes = bench.parse_sizes(args.sizes)
    load_before = os.getloadavg()
    rows = {op: bench.run_bench(op, sizes, list(NAMES), args.repeats) for op in ops}
    load_after = os.getloadavg()
    # The memory-copy figure on rank 0 alone, while the others sleep rather than spin,
    # then the same copy on every rank at once; then the in-place pass (what each rank
    # must at least do with its buffer) the same two ways. Five times each, alternating
    # (the host's memory bandwidth drifts, at times 2x for seconds), the medians kept.
    measured: dict[str, list[float]] = {"copy": [], "copy, all ranks": [], "pass": [],
                                        "pass, all ranks": []}
    for _ in range(5):
        for name, measure in (("copy", bench.memcpy_bandwidth),
                              ("pass", bench.pass_bandwidth)):
            if ctx.rank == 0:
                measured[name].append(measure())
            wait_interruptibly(ctx.comm.Ibarrier())
            ctx.comm.Barrier()
            each = ctx.comm.gather(measure(), root=0)
            wait_interruptibly(ctx.comm.Ibarrier())
            if ctx.rank == 0:
                measured[f"{name}, all ranks"].append(min(each))  # the slowest rank's
    if ctx.rank != 0:
        return 0

    memory = {name: statistics.median(values) for name, values in measured.items()}
    memcpy, concurrent = memory["copy"], memory["pass, all ranks"]
    print(f"{ctx.world_size} ranks; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after (cores: {os.cpu_count()})")
    print(f"memory-copy figure (one core, 2 x {bench.MEMCPY_BYTES // MIB} MiB buffers): "
          f"{memcpy:.2f} GB/s (runs: {_list(measured['copy'])})")
    print(f"  the same copy on every rank at once: {memory['copy, all ranks']:.2f} GB/s each "
          f"(runs: {_list(measured['copy, all ranks'])})")
    print(f"  in-place pass over {bench.MEMCPY_BYTES // MIB} MiB (read and write back), one "
          f"core: {memory['pass']:.2f} GB/s (runs: {_list(measured['pass'])}); every rank at "
          f"once: {concurrent:.2f} GB/s each (runs: {_list(measured['pass, all ranks'])}) = "
          f"{concurrent / memcpy:.0%} of the memory-copy figure: the most a {ctx.world_size}-"
          "rank allreduce of a large buffer can reach here (\"of bound\")")
    met = True
    for op in ops:
        print(f"\n== {op}, float32, bus bandwidth GB/s; +µs/call: mpilab's time per call "
              "minus the internal path's ==")
        table = (op, rows[op], sizes, ctx.world_size, (memcpy, concurrent))
        met &= _table(*table, f"median of {args.repeats}", "time_s")
        _table(*table, "fastest repeat (undisturbed)", "time_min_s")
    print("\nall targets met (median)" if met else "\nsome targets missed (median)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rows": rows, "memory_GBps": measured,
             "load": [load_before, load_after]}, indent=1))
    return 0


def _table(op: str, rows: list[dict], sizes: list[int], n: int,
           copies: tuple[float, float], title: str, key: str) -> bool:
    """Print one table from `key` times; True when every target is met. `copies`: the
    memory-copy figure, and each core's in-place pass rate while every rank makes one."""
    memcpy, concurrent = copies
    from mpilab.rank import bench

    bw = {(r["backend"], r["size_bytes"]): r["busbw_GBps"] * r["time_s"] / r[key]
          for r in rows}
    per_call = {(r["backend"], r["size_bytes"]): r[key] for r in rows}
    print(f"\n{title}")
    print(f"{'size':>8} " + " ".join(f"{name:>9}" for name in NAMES.values())
          + f" {'≥ best peer':>14} {'+µs/call':>9}"
          + (f" {'of memcpy':>10} {'of bound':>8}" if op == "allreduce" else ""))
    met_all = True
    for s in sizes:
        size = bench.effective_size(op, s, n)
        ours, internal, mpi, gloo = (bw[(b, size)] for b in NAMES)
        best = max(mpi, gloo)
        extra_us = (per_call[("mpilab", size)] - per_call[("mpilab-internal", size)]) * 1e6
        beat = ours >= best
        met = beat and extra_us <= OVERHEAD_TARGET_US
        line = (f"{_fmt(size):>8} {ours:9.2f} {internal:9.2f} {mpi:9.2f} {gloo:9.2f} "
                f"{'yes' if beat else 'no':>4} ({ours / best:5.2f}×) {extra_us:+9.1f}")
        if op == "allreduce":
            share = ours / memcpy
            if size >= 16 * MIB:
                met &= share >= CEILING_TARGET
            line += (f" {share:10.0%} {ours / concurrent:8.0%}" if size >= MIB
                     else f" {'-':>10} {'-':>8}")
        met_all &= met
        print(line)
    return met_all


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _fmt(n: int) -> str:
    for unit, scale in (("M", MIB), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


if __name__ == "__main__":
    sys.exit(main())

"""mpilab's collectives, as a user calls them, against mpi4py and torch gloo, on 2 ranks.

    .venv/bin/python benchmarks/bench_allreduce.py [--ops allreduce,broadcast,allgather]
        [--sizes 4K:64M] [--repeats 20] [-n 2] [--json FILE]

Run plainly, it relaunches itself under the venv's mpiexec; under mpiexec it measures.
Rows, all in one run, the backends taking every order in turn at each repetition:

- ``mpilab``: ``mpilab.allreduce / broadcast / allgather`` on a CPU tensor, what a user
  calls (heartbeat state, numbering and spans included);
- ``internal``: what that call runs under its plan check and its heartbeat and span
  (the functions the tensor's plan holds), to show what the public call adds per call;
- ``mpi4py``: ``comm.Allreduce / Bcast / Allgather`` (blocking) on NumPy arrays;
- ``gloo``: ``torch.distributed`` on CPU tensors.

Every figure is bus bandwidth (nccl-tests) from the median of `repeats` timings of the
slowest rank, each a loop of back-to-back collectives moving ~32 MiB (at most 100 of
them, and no more than take ~5 ms at the backend's speed in the first warm-up; after a
fifth as many untimed ones). A second table gives the fastest repeat:
what each backend does when the node's other tenants leave it alone.

The memory-copy figure (``bench.memcpy_bandwidth``: bytes one core copies per second
between two 256 MiB buffers) is measured in the same run, on rank 0 while the others
wait, and so is the same copy on every rank at once. Beside the allreduces, in turn with
them at every size, the ``memory`` bound: every rank reads and writes back its buffer
in place at once, the least an allreduce must do with it, with no communication.
Targets: mpilab ≥ the better of mpi4py and gloo at every size, at most 5 µs a call
above the internal path (judged where a call takes at most 100 µs: above, the difference
of two medians is the host's spread, not the call's own cost), and for allreduce at
≥ 16 MiB ≥ 80% of the memory-copy figure ("of memcpy"; "of bound": of the memory bound
at that size, the most an allreduce can reach here: see docs/performance.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from mpilab.wire import BENCH_COLLECTIVES
from options import collective_parser, names
from ranks import relaunch

MIB = 1 << 20
NAMES = {"mpilab": "mpilab", "mpilab-internal": "internal", "mpi": "mpi4py", "gloo": "gloo"}
OVERHEAD_TARGET_US = 5.0
# ... judged where a call takes at most this long: what the public call adds does not
# depend on the size, and above this the difference between two medians is the host's
# run-to-run spread (a few % of a call of milliseconds), not the call's own cost
OVERHEAD_RESOLVED_S = 100e-6
CEILING_TARGET = 0.80  # allreduce at >= 16 MiB against the memory-copy figure


def main() -> int:
    parser = collective_parser(__doc__, "4K:64M", 20)
    parser.add_argument("--ops", type=names(BENCH_COLLECTIVES),
                        default="allreduce,broadcast,allgather")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    ops, sizes = args.ops, args.sizes
    launched = relaunch(args.n)
    if launched is not None:
        return launched

    import mpilab
    from mpilab.rank import bench

    ctx = mpilab.init()
    load_before = os.getloadavg()
    # allreduce: with the memory bound timed in turn with the collectives (bench.py)
    rows = {op: bench.run_bench(op, sizes, list(NAMES) + (["memory"] if op == "allreduce"
                                                          else []), args.repeats)
            for op in ops}
    load_after = os.getloadavg()
    # the memory-copy figure alone and on every rank at once, five times each, medians
    alone, together = bench.memcpy_figures(ctx.comm, 5)
    measured = {"alone": alone, "all ranks": together}
    if ctx.rank != 0:
        return 0

    memcpy = statistics.median(measured["alone"])
    print(f"{ctx.world_size} ranks; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after (cores: {os.cpu_count()})")
    print(f"memory-copy figure (one core, 2 x {bench.MEMCPY_BYTES // MIB} MiB buffers): "
          f"{memcpy:.2f} GB/s (runs: {_list(measured['alone'])}); the same copy on every "
          f"rank at once: {statistics.median(measured['all ranks']):.2f} GB/s each "
          f"(runs: {_list(measured['all ranks'])})")
    print("allreduce's \"bound\": every rank reading and writing back its buffer in place "
          "at once (no communication), timed in turn with the collectives: the most an "
          "allreduce of that size can reach here")
    missed: list[str] = []
    for op in ops:
        print(f"\n== {op}, float32, bus bandwidth GB/s; +µs/call: mpilab's time per call "
              "minus the internal path's ==")
        table = (op, rows[op], sizes, ctx.world_size, memcpy)
        missed += _table(*table, f"median of {args.repeats}", "time_s")
        _table(*table, "fastest repeat (undisturbed)", "time_min_s")
    print("\nall targets met (median)" if not missed else
          "\ntargets missed (median): " + "; ".join(missed))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rows": rows, "memcpy_GBps": measured,
             "load": [load_before, load_after]}, indent=1))
    return 0


def _table(op: str, rows: list[dict], sizes: list[int], n: int, memcpy: float, title: str,
           key: str) -> list[str]:
    """Print one table from `key` times; the targets it misses, named (size, what)."""
    from mpilab.rank import bench

    bw = {(r["backend"], r["size_bytes"]): r["busbw_GBps"] * r["time_s"] / r[key]
          for r in rows if r.get("time_s") is not None}
    per_call = {(r["backend"], r["size_bytes"]): r[key] for r in rows}
    print(f"\n{title}")
    print(f"{'size':>8} " + " ".join(f"{name:>9}" for name in NAMES.values())
          + f" {'≥ best peer':>14} {'+µs/call':>9}"
          + (f" {'of memcpy':>10} {'of bound':>8}" if op == "allreduce" else ""))
    missed = []
    for s in sizes:
        size = bench.effective_size(op, s, n)
        ours, internal, mpi, gloo = (bw[(b, size)] for b in NAMES)
        best = max(mpi, gloo)
        extra_us = (per_call[("mpilab", size)] - per_call[("mpilab-internal", size)]) * 1e6
        beat = ours >= best
        if not beat:
            missed.append(f"{op} {_fmt(size)} {ours / best:.2f}× the better peer")
        if extra_us > OVERHEAD_TARGET_US \
                and per_call[("mpilab-internal", size)] <= OVERHEAD_RESOLVED_S:
            missed.append(f"{op} {_fmt(size)} own cost {extra_us:+.1f} µs")
        line = (f"{_fmt(size):>8} {ours:9.2f} {internal:9.2f} {mpi:9.2f} {gloo:9.2f} "
                f"{'yes' if beat else 'no':>4} ({ours / best:5.2f}×) {extra_us:+9.1f}")
        if op == "allreduce":
            share = ours / memcpy
            if size >= 16 * MIB and share < CEILING_TARGET:
                missed.append(f"{op} {_fmt(size)} {share:.0%} of the memory-copy figure")
            # the bound only where the buffers leave the last-level cache: below, an
            # in-place pass runs from cache and says nothing about an allreduce
            line += f" {share:10.0%}" if size >= MIB else f" {'-':>10}"
            line += f" {ours / bw[('memory', size)]:8.0%}" if size >= 16 * MIB else \
                f" {'-':>8}"
        print(line)
    return missed


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _fmt(n: int) -> str:
    for unit, scale in (("M", MIB), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


if __name__ == "__main__":
    sys.exit(main())

"""`mpilab bench` on the ranks: what each rank of ``mpiexec -n N python -m
mpilab.rank.bench_cli OP SIZES BACKENDS`` runs (the `mpilab bench` command starts it).

Rank 0 writes the measurements as one line, wire.BENCH_RESULT_PREFIX and JSON, which the
command reads and shows as the table `%mpilab bench` shows; nothing of the notebook side
(the table is a widget module's) is imported on the ranks.
"""

from __future__ import annotations

import json
import sys

from ..wire import BENCH_RESULT_PREFIX


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on this rank; 2 when OP, SIZES or BACKENDS is not understood."""
    from ..wire import parse_backends, parse_sizes
    from .bootstrap import init
    from .engine import bench_here

    op, sizes, backends = sys.argv[1:] if argv is None else argv
    ctx = init()
    try:
        rows, ceiling = bench_here(op, parse_sizes(sizes), parse_backends(backends))
    except ValueError as e:
        if ctx.rank == 0:
            print(f"mpilab: {e}", file=sys.stderr)
        return 2
    if ctx.rank == 0:
        print(BENCH_RESULT_PREFIX + json.dumps({"rows": rows, "ceiling": ceiling}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

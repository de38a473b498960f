"""Latency of a trivial `%%ranks` cell against `%%px` on a bare ipyparallel MPI cluster.

`%%px` on a bare `ipyparallel.Cluster(engines="mpi", n=N)` is what a user would run
instead of mpilab: the peer. (Not `%%px` on mpilab's own engines, whose agent threads and
output relay slow `%%px` as well.) Both clusters run in one notebook kernel, driven over
the Jupyter protocol as a user's cells are: the time from execute_request to the
kernel's reply. The two cells alternate, the order swapped every repetition; median.

    .venv/bin/python benchmarks/bench_dispatch.py [--reps 40] [-n 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from options import count

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel import Kernel  # noqa: E402

TARGET = 1.1

# the bare cluster finds mpiexec on PATH, as a user's shell would (the venv's, as mpilab)
START_BARE = f"""
import os
os.environ["PATH"] = {str(Path(sys.executable).parent)!r} + os.pathsep + os.environ["PATH"]
import ipyparallel as ipp
_bare = ipp.Cluster(engines="mpi", n={{n}}, log_level=40)
_bare_client = _bare.start_and_connect_sync()
_bare_view = _bare_client[:]
_bare_view.block = True
_bare_view.activate()  # %%px runs on the bare cluster
"""
STOP_BARE = """
_bare_client.close()
_bare.stop_cluster_sync()
"""


def timed(kernel: Kernel, code: str) -> float:
    start = time.perf_counter()
    run = kernel.run(code)
    elapsed = time.perf_counter() - start
    if not run.ok:
        raise SystemExit(f"benchmark cell failed: {code!r}\n{run.text}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=count, default=40)
    parser.add_argument("-n", type=count, default=2)
    args = parser.parse_args()
    kernel = Kernel()
    load = []
    try:
        assert kernel.run("%load_ext mpilab").ok
        assert kernel.run(f"%mpilab start -n {args.n}", timeout=300).ok
        bare = kernel.run(START_BARE.format(n=args.n), timeout=300)
        if not bare.ok:
            raise SystemExit(f"the bare ipyparallel cluster did not start:\n{bare.text}")
        cells = {"%%ranks": "%%ranks\nx = 1", "%%px (bare)": "%%px\nx = 1"}
        for code in cells.values():  # warm both paths
            for _ in range(3):
                timed(kernel, code)
        times: dict[str, list[float]] = {name: [] for name in cells}
        load.append(os.getloadavg()[0])
        for rep in range(args.reps):
            order = list(cells) if rep % 2 == 0 else list(reversed(cells))
            for name in order:
                times[name].append(timed(kernel, cells[name]))
        load.append(os.getloadavg()[0])
        kernel.run(STOP_BARE, timeout=120)
        kernel.run("%mpilab stop", timeout=120)
    finally:
        kernel.shutdown()
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    p90 = {name: statistics.quantiles(t, n=10)[-1] * 1e3 for name, t in times.items()}
    print(f"trivial cell on {args.n} ranks, {args.reps} alternating repetitions; "
          f"load average {load[0]:.1f} before, {load[1]:.1f} after ({os.cpu_count()} cores)")
    for name in cells:
        print(f"  {name:<12} median {med[name]:7.1f} ms   p90 {p90[name]:7.1f} ms")
    ratio = med["%%ranks"] / med["%%px (bare)"]
    print(f"  ratio %%ranks / %%px on a bare ipyparallel cluster = {ratio:.2f}x "
          f"(target <= {TARGET}x)")


if __name__ == "__main__":
    main()

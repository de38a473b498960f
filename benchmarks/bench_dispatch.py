"""Latency of a trivial `%%ranks` cell against ipyparallel's own `%%px`, same engines.

Both are driven through a real notebook kernel over the Jupyter protocol, as a user's
cell is: the time from execute_request to the kernel's reply. Alternating, median.

    .venv/bin/python benchmarks/bench_dispatch.py [--reps 40] [-n 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel import Kernel  # noqa: E402

ACTIVATE_PX = """
from mpilab.session import Session
_view = Session.instance().cluster.client[:]
_view.block = True
_view.activate()
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
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("-n", type=int, default=2)
    args = parser.parse_args()
    kernel = Kernel()
    try:
        assert kernel.run("%load_ext mpilab").ok
        assert kernel.run(f"%mpilab start -n {args.n}", timeout=300).ok
        assert kernel.run(ACTIVATE_PX).ok
        cells = {"%%ranks": "%%ranks\nx = 1", "%%px": "%%px\nx = 1"}
        for code in cells.values():  # warm both paths
            timed(kernel, code)
        times: dict[str, list[float]] = {name: [] for name in cells}
        for _ in range(args.reps):
            for name, code in cells.items():
                times[name].append(timed(kernel, code))
        kernel.run("%mpilab stop", timeout=120)
    finally:
        kernel.shutdown()
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    p90 = {name: statistics.quantiles(t, n=10)[-1] * 1e3 for name, t in times.items()}
    print(f"trivial cell on {args.n} ranks, {args.reps} alternating repetitions")
    for name in cells:
        print(f"  {name:<8} median {med[name]:7.1f} ms   p90 {p90[name]:7.1f} ms")
    ratio = med["%%ranks"] / med["%%px"]
    print(f"  ratio %%ranks / %%px = {ratio:.2f}x (target <= 1.2x)")


if __name__ == "__main__":
    main()

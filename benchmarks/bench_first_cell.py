"""The first training cell after `%mpilab start` against the same cell run again.

A user's first hour: start the ranks, run the README's 100-step training cell (with its
progress bar and dashboard), run it again. Whatever the ranks or the notebook load
lazily the first time (torch's optimizer imports, the dashboard's figure) lands in the
first run; mpilab warms it while the ranks start, so the first run should take about
what the second does (target: at most 1.5x). Each repetition is a fresh kernel and a
fresh start; the cell is sent right after start returns, as a notebook run top to bottom
does. Times are from execute request to the kernel's reply, through a real kernel.

    .venv/bin/python benchmarks/bench_first_cell.py [--reps 3] [-n 2] [--cells 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from options import at_least, count

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel import Kernel  # noqa: E402

TARGET = 1.5
# the README's "Thirty seconds" cell
CELL = """%%ranks
import torch
model = mpilab.DataParallel(torch.nn.Linear(64, 10))          # averaged gradients over MPI
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in mpilab.progress(range(100), desc="train"):       # a bar under the cell
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    mpilab.log(loss=loss.item())                              # the dashboard's loss plot
print(f"rank {rank}: final loss {loss.item():.3f}")
"""


def timed(kernel: Kernel, code: str, timeout: float = 300) -> float:
    start = time.perf_counter()
    run = kernel.run(code, timeout=timeout)
    elapsed = time.perf_counter() - start
    if run.error or (code == CELL and "final loss" not in run.text):
        raise SystemExit(f"benchmark cell failed: {code.splitlines()[0]!r}\n{run.text}")
    return elapsed


def one_session(n: int, cells: int) -> list[float]:
    """[start, first cell, second cell, …] in a fresh kernel."""
    kernel = Kernel()
    try:
        kernel.run("%load_ext mpilab")
        times = [timed(kernel, f"%mpilab start -n {n}")]
        times += [timed(kernel, CELL) for _ in range(cells)]
        kernel.run("%mpilab stop", timeout=120)
    finally:
        kernel.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=count, default=3, help="fresh kernels and starts")
    parser.add_argument("-n", type=count, default=2, help="ranks")
    parser.add_argument("--cells", type=at_least(2), default=3,
                        help="runs of the cell per start (the first is held against the second)")
    args = parser.parse_args()
    rows = []
    for rep in range(args.reps):
        rows.append(one_session(args.n, args.cells))
        print(f"  repetition {rep + 1}: start {rows[-1][0]:.2f} s, cells "
              + ", ".join(f"{t:.3f}" for t in rows[-1][1:]) + " s", flush=True)
    columns = list(zip(*rows))
    med = [statistics.median(c) for c in columns]
    print(f"first training cell after start, {args.n} ranks, {args.reps} fresh starts (median)")
    print(f"  start                {med[0]:6.2f} s")
    for i, value in enumerate(med[1:], start=1):
        print(f"  cell run {i}           {value:6.3f} s")
    ratio = med[1] / med[2]
    worst = max(row[1] / row[2] for row in rows)
    print(f"  ratio first / second = {ratio:.2f}x, worst start {worst:.2f}x "
          f"(target <= {TARGET}x): {'met' if ratio <= TARGET else 'missed'}")


if __name__ == "__main__":
    main()

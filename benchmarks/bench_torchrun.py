"""The same torchrun script through `torchrun` and through `%%ranks` + `%run`: samples/s.

The script is tests/torchrun_scripts/train.py, unchanged: argparse, init_process_group
from the environment, DDP over gloo, a DistributedSampler with set_epoch,
destroy_process_group. It times each epoch itself and rank 0 prints `samples/s X`; the
first epoch is a warm-up, the median of the others is the run's figure.

- ``torchrun``: ``torchrun --standalone --nproc-per-node N train.py …``, with
  OMP_NUM_THREADS = cores / N (mpilab's bootstrap gives its ranks as many torch threads);
- ``%%ranks``: a real notebook kernel, ``%mpilab start -n N`` once, then a cell
  ``%%ranks`` / ``%run train.py …`` per run (the dashboard on, as a user gets it).

Runs alternate, the order turning each repeat; the median run of each way is reported,
for two shapes of the model: ``small`` (a narrow MLP: per-step overheads dominate) and
``wide`` (a wide MLP: compute and the gradient allreduce dominate).

    .venv/bin/python benchmarks/bench_torchrun.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from kernel import Kernel  # noqa: E402

SCRIPT = HERE.parent / "tests" / "torchrun_scripts" / "train.py"
BIN = Path(sys.executable).parent
RATE = re.compile(r"samples/s ([\d.]+)")


@dataclass(frozen=True)
class Shape:
    """One model and data size: what the script's arguments say."""

    name: str
    width: int
    batch: int  # per process
    samples: int
    epochs: int

    def args(self) -> list[str]:
        return ["--epochs", str(self.epochs), "--batch-size", str(self.batch),
                "--samples", str(self.samples), "--width", str(self.width), "--report"]


SHAPES = {
    "small": Shape("small", width=256, batch=32, samples=32768, epochs=4),
    "wide": Shape("wide", width=8192, batch=128, samples=32768, epochs=4),
}


def run_figure(rates: list[float]) -> float:
    """A run's samples/s: the median epoch after the first (the warm-up)."""
    if len(rates) < 2:
        raise RuntimeError(f"expected a rate per epoch, got {rates}")
    return statistics.median(rates[1:])


def through_torchrun(shape: Shape, n: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={n}", str(SCRIPT),
           *shape.args()]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    rates = [float(x) for x in RATE.findall(proc.stdout)]
    # a gloo process may abort while it exits, after the script has finished: the
    # figures printed before count, a failure before them does not
    if len(rates) != shape.epochs:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return run_figure(rates)


def through_ranks(kernel: Kernel, shape: Shape) -> float:
    run = kernel.run(f"%%ranks\n%run {SCRIPT} {' '.join(shape.args())}", timeout=900)
    if not run.ok:
        raise RuntimeError(f"%%ranks run failed:\n{run.text[-3000:]}")
    rates = [float(x) for x in re.findall(r"^\[rank 0\] samples/s ([\d.]+)$", run.stdout,
                                          re.M)]
    return run_figure(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="processes / ranks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="small,wide", help="small, wide or both")
    a = parser.parse_args()
    shapes = [SHAPES[s] for s in a.shapes.split(",")]
    print(f"{a.n} processes, {os.cpu_count()} cores, script {SCRIPT.relative_to(HERE.parent)}"
          f", {a.repeats} alternating repeats, median")
    kernel = Kernel()
    results: dict[str, dict[str, list[float]]] = {}
    began = time.strftime("%Y-%m-%d %H:%M")
    try:
        assert kernel.run("%load_ext mpilab").ok
        start = kernel.run(f"%mpilab start -n {a.n}", timeout=300)
        assert start.ok, start.text
        ways = {"torchrun": lambda s: through_torchrun(s, a.n),
                "%%ranks": lambda s: through_ranks(kernel, s)}
        for shape in shapes:
            for way in ways.values():  # one untimed run each: imports, caches
                way(shape)
            got = results[shape.name] = {name: [] for name in ways}
            for i in range(a.repeats):
                order = list(ways) if i % 2 == 0 else list(reversed(ways))
                for name in order:
                    got[name].append(ways[name](shape))
                print(f"  {shape.name} repeat {i + 1}: " + ", ".join(
                    f"{name} {got[name][-1]:,.0f}" for name in ways), flush=True)
        kernel.run("%mpilab stop", timeout=120)
    finally:
        kernel.shutdown()
    print(f"\nrun began {began}")
    print(f"{'shape':6} {'params':>9} {'torchrun':>12} {'%%ranks':>12} {'ratio':>7}   "
          "(samples/s; ratio = %%ranks / torchrun, target >= 1.0)")
    for shape in shapes:
        got = results[shape.name]
        tr, rk = statistics.median(got["torchrun"]), statistics.median(got["%%ranks"])
        params = 35 * shape.width + 2  # Linear(32, w) and Linear(w, 2)
        print(f"{shape.name:6} {params:>9,} {tr:>12,.0f} {rk:>12,.0f} {rk / tr:>6.2f}x   "
              f"(runs: torchrun {min(got['torchrun']):,.0f}-{max(got['torchrun']):,.0f}, "
              f"%%ranks {min(got['%%ranks']):,.0f}-{max(got['%%ranks']):,.0f})")


if __name__ == "__main__":
    main()

"""The same torchrun script through `torchrun` and through `%%ranks` + `%run`: samples/s.

The script is tests/torchrun_scripts/train.py, unchanged: argparse, init_process_group
from the environment, DDP over gloo, a DistributedSampler with set_epoch,
destroy_process_group. It times each epoch itself and rank 0 prints `samples/s X`; the
first epoch is a warm-up, the median of the others is the run's figure. Rank 0 also
reports its CPU time per sample, which preemption by other work on the machine leaves
(mostly) alone: where the samples/s are noisy, it says whether one way does more work.

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

from options import count, names

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from kernel import Kernel  # noqa: E402

SCRIPT = HERE.parent / "tests" / "torchrun_scripts" / "train.py"
BIN = Path(sys.executable).parent
# rank 0's line per epoch (train.py --report)
REPORT = re.compile(r"^(?:\[rank 0\] )?samples/s ([\d.]+) cpu_ms_per_sample ([\d.]+)$", re.M)


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


@dataclass(frozen=True)
class Measure:
    """One run: samples/s of all processes, and rank 0's CPU ms per sample."""

    samples_s: float
    cpu_ms: float


def run_figure(text: str, epochs: int) -> Measure:
    """A run's figures: the median epoch after the first (the warm-up)."""
    found = [(float(a), float(b)) for a, b in REPORT.findall(text)]
    if len(found) != epochs or epochs < 2:
        raise RuntimeError(f"expected {epochs} epoch reports, got {found}")
    return Measure(statistics.median(r for r, _ in found[1:]),
                   statistics.median(c for _, c in found[1:]))


def through_torchrun(shape: Shape, n: int) -> Measure:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={n}", str(SCRIPT),
           *shape.args()]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    # a gloo process may abort while it exits, after the script has finished: the
    # figures printed before count, a failure before them does not
    try:
        return run_figure(proc.stdout, shape.epochs)
    except RuntimeError:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}") \
            from None


def through_ranks(kernel: Kernel, shape: Shape) -> Measure:
    run = kernel.run(f"%%ranks\n%run {SCRIPT} {' '.join(shape.args())}", timeout=900)
    if not run.ok:
        raise RuntimeError(f"%%ranks run failed:\n{run.text[-3000:]}")
    return run_figure(run.stdout, shape.epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=count, default=2, help="processes / ranks")
    parser.add_argument("--repeats", type=count, default=5)
    parser.add_argument("--shapes", type=names(SHAPES), default="small,wide",
                        help="small, wide or both")
    a = parser.parse_args()
    shapes = [SHAPES[s] for s in a.shapes]
    print(f"{a.n} processes, {os.cpu_count()} cores, script {SCRIPT.relative_to(HERE.parent)}"
          f", {a.repeats} alternating repeats, median")
    kernel = Kernel()
    results: dict[str, dict[str, list[Measure]]] = {}
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
                    f"{name} {got[name][-1].samples_s:,.0f} samples/s "
                    f"({got[name][-1].cpu_ms:.4f} cpu ms/sample)" for name in ways), flush=True)
        kernel.run("%mpilab stop", timeout=120)
    finally:
        kernel.shutdown()
    print(f"\nrun began {began}, ended {time.strftime('%H:%M')}; load average at the end "
          f"{' '.join(_loadavg()[:3])} (other work on the machine spreads the figures)")
    print(f"{'shape':6} {'params':>9} {'':13} {'torchrun':>10} {'%%ranks':>10} {'ratio':>7}")
    for shape in shapes:
        got = results[shape.name]
        params = 35 * shape.width + 2  # Linear(32, w) and Linear(w, 2)
        rate = {way: [m.samples_s for m in got[way]] for way in got}
        cpu = {way: [m.cpu_ms for m in got[way]] for way in got}
        tr, rk = statistics.median(rate["torchrun"]), statistics.median(rate["%%ranks"])
        print(f"{shape.name:6} {params:>9,} {'samples/s':13} {tr:>10,.0f} {rk:>10,.0f} "
              f"{rk / tr:>6.2f}x  (target >= 1.0; runs: torchrun "
              f"{min(rate['torchrun']):,.0f}-{max(rate['torchrun']):,.0f}, %%ranks "
              f"{min(rate['%%ranks']):,.0f}-{max(rate['%%ranks']):,.0f}; %%ranks ahead in "
              f"{sum(r > t for r, t in zip(rate['%%ranks'], rate['torchrun']))} of "
              f"{len(rate['torchrun'])} repeats)")
        tc, rc = statistics.median(cpu["torchrun"]), statistics.median(cpu["%%ranks"])
        print(f"{'':6} {'':9} {'cpu ms/sample':13} {tc:>10.4f} {rc:>10.4f} {rc / tc:>6.2f}x  "
              "(rank 0's CPU time per sample: the work each way costs, less the "
              "machine's other load)")


def _loadavg() -> list[str]:
    try:
        return Path("/proc/loadavg").read_text().split()
    except OSError:
        return ["?"] * 3


if __name__ == "__main__":
    main()

"""What watching costs: DataParallel training with the record channel and dashboard on
against off, and the latency from a record on a rank to the dashboard's data.

Two designs, both in one run on one cluster, and a third reading of the second's cells:

- **in one cell** (steady state): one long cell under a live dashboard turns the
  ranks' records on and off every ~1.5 s in ABBA order; each group of four phases gives
  one cost figure, and the median of the groups is reported with a bootstrap interval.
  ABBA cancels drift across a group; this machine's shorter slow spells remain (one
  group's figure varies by ±5% in an A/A run), hence the interval.
- **cell against cell**: whole cells per mode (this includes what each cell pays once:
  showing the dashboard and its final static plot).

- **the send cycle** (within cells): the steps of each mode's cells against the steps
  in the quiet part of the ranks' 0.25-s send cycle, away from the rounds. It sees what
  follows a round (sending, receiving, redrawing), with steps of the same cells as the
  reference, so the machine's slow spells cancel out; not what a cell pays once.

Cell against cell: three modes alternate, in every order in turn, median of several
repetitions: "watched" (records and the dashboard), "records only" (the cell runs with
--no-dashboard: what the record channel alone costs) and "unwatched" (the agent's
records paused, heartbeats stay because the watchdog needs them, and --no-dashboard).

`-n 2` (the default) fills this machine's two cores with ranks, so every millisecond
the notebook spends is taken from a rank. `-n 1 --threads 1` leaves the notebook a core
of its own, as ranks on a GPU node leave cores idle while they wait on their GPUs (the
bootstrap gives a rank cores / local ranks torch threads: one rank alone fills both).

    .venv/bin/python benchmarks/bench_overhead.py [-n 2] [--threads K] [--reps 12]
        [--steps 600] [--phase-cells 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import psutil
from mpilab.rank.agent import SEND_INTERVAL_S
from options import at_least, count

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel import Kernel  # noqa: E402

SETUP = """%%ranks
import time, torch
from mpilab.rank import agent as _agent
torch.manual_seed(0)
model = mpilab.DataParallel(torch.nn.Sequential(
    torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(64, 512)
ends = []  # when each step of the last train() ended (epoch s)
def train(steps, records):
    global ends
    ends = []
    a = _agent.current()
    address = a.address
    if not records:
        a.address = None  # emit() drops records; the heartbeat thread goes on
    try:
        start = time.perf_counter()
        for _ in range(steps):
            loss = model(data).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            mpilab.log(loss=loss.item())
            ends.append(time.time())
        return steps * 64 * world_size / (time.perf_counter() - start)
    finally:
        a.address = address
def train_phases(phases, steps, untimed):
    # records (so the dashboard too) on and off in turn, in ABBA order; each phase
    # first runs untimed steps that absorb the switch (the last round of records of
    # a phase reaches the notebook up to 0.25 s into the next)
    rates = []
    for i in range(phases):
        records = i % 4 in (0, 3)
        train(untimed, records)
        rates.append((records, train(steps, records)))
    return rates
"""

# Records reach the widget when a redraw takes them: stamp each log record with the
# time of the redraw that drew it (read incrementally: the probe must not cost what a
# scan of the whole run would, on the receiver's thread, at every redraw)
LATENCY_PROBE = """
import time
import mpilab.widgets.dashboard as _d
_latencies = []
_refresh = _d.Dashboard.refresh
def _timed_refresh(self, force=False):
    drawn = _refresh(self, force)
    if drawn:
        now = time.time()
        if not hasattr(self, "_probe_position"):
            self._probe_position = {}
        # the log rows the widget has now, taken since the last redraw
        for _, _, rows in self.store.new_rows("log", self._probe_position,
                                              upto=self._runlog.position["log"],
                                              window=self.cell.bounds(self.store)):
            _latencies.extend((now - rows[:, 0]).tolist())
    return drawn
_d.Dashboard.refresh = _timed_refresh
"""


# what each mode turns on: (records from the ranks, dashboard under the cell)
MODES = {"watched": (True, True), "records only": (True, False), "unwatched": (False, False)}


def samples_per_s(kernel: Kernel, steps: int, mode: str) -> tuple[float, float, np.ndarray]:
    """(samples/s, the notebook kernel's CPU share of one core while the cell ran, when
    each step ended)."""
    records, dashboard = MODES[mode]
    flags = "" if dashboard else " --no-dashboard"
    kernel_proc = psutil.Process(kernel.km.provisioner.process.pid)
    cpu_before = sum(kernel_proc.cpu_times()[:2])
    run = kernel.run(f"%%ranks{flags}\nrate = train({steps}, {records})\nprint(round(rate))"
                     "\nimport json\nprint('ends', json.dumps(ends))", timeout=600)
    cpu = sum(kernel_proc.cpu_times()[:2]) - cpu_before
    if not run.ok:
        raise SystemExit(run.text)
    lines = run.stdout.splitlines()
    rates = [float(line.split()[-1]) for line in lines if line.strip() and "ends" not in line]
    ends = [json.loads(line[line.index("ends [") + 5:]) for line in lines if "ends [" in line]
    # the ranks step together; the slower one sets the pace
    return min(rates), cpu / (run.finished - run.started), np.max(ends, axis=0)


def cycle_cost(cells: list[np.ndarray]) -> float:
    """How much longer the steps are, on average, than in the quiet part of the ranks'
    send cycle (the last 40% of each SEND_INTERVAL_S, before the next round): what the
    rounds cost the training, measured against steps of the same cells (the machine's
    slow spells, which make cells differ by several percent, cancel out)."""
    durations, phases = [], []
    for ends in cells:
        ends = ends[UNTIMED_STEPS:]  # the cell's start: the dashboard appears then
        durations.append(np.diff(ends))
        phases.append(((ends[1:] + ends[:-1]) / 2) % SEND_INTERVAL_S / SEND_INTERVAL_S)
    duration, phase = np.concatenate(durations), np.concatenate(phases)
    # the host's own stalls (tens of ms, anywhere in the cycle) would swamp the means;
    # what a round costs a step is a few ms
    kept = duration < 4 * np.median(duration)
    duration, phase = duration[kept], phase[kept]
    return duration.mean() / duration[phase >= 0.6].mean() - 1


PHASES, PHASE_STEPS, UNTIMED_STEPS = 32, 160, 40  # ~1 min a cell


def phase_groups(kernel: Kernel, phase_rates: dict[bool, list[float]]) -> list[float]:
    """One in-one-cell run: the cost of each ABBA group of phases (1 - on / off)."""
    run = kernel.run(f"%%ranks\nimport json\n"
                     f"print(json.dumps(train_phases({PHASES}, {PHASE_STEPS}, {UNTIMED_STEPS})))",
                     timeout=600)
    if not run.ok:
        raise SystemExit(run.text)
    per_rank = [json.loads(line[line.index("[["):]) for line in run.stdout.splitlines()
                if "[[" in line]
    # the ranks step together; the slower one sets the pace
    phases = [(per_rank[0][i][0], min(rank[i][1] for rank in per_rank))
              for i in range(PHASES)]
    for records, rate in phases:
        phase_rates[records].append(rate)
    groups = []
    for g in range(0, PHASES - 3, 4):
        on = [rate for records, rate in phases[g:g + 4] if records]
        off = [rate for records, rate in phases[g:g + 4] if not records]
        groups.append(1 - statistics.mean(on) / statistics.mean(off))
    return groups


def bootstrap_interval(values: list[float], level: float = 0.9) -> tuple[float, float]:
    """Where the median of `values` lies, from 2000 resamples: this machine's noise
    (phases of one cell differ by ±5%) is as large as what is measured."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(2000))
    tail = int((1 - level) / 2 * len(medians))
    return medians[tail], medians[-1 - tail]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=count, default=12)  # a multiple of the 3 modes
    # a cell of ~5 s: training-like; the first UNTIMED_STEPS are left out and the rest
    # must span a few of the ranks' send cycles
    parser.add_argument("--steps", type=at_least(UNTIMED_STEPS + 60), default=600)
    # in-one-cell runs, ~1 min each (0: none)
    parser.add_argument("--phase-cells", type=at_least(0), default=4)
    parser.add_argument("-n", "--ranks", type=count, default=2, help="ranks to start")
    parser.add_argument("--threads", type=count, default=None,
                        help="torch threads per rank (default: the bootstrap's)")
    args = parser.parse_args()
    kernel = Kernel()
    try:
        assert kernel.run("%load_ext mpilab").ok
        assert kernel.run(f"%mpilab start -n {args.ranks}", timeout=300).ok
        assert kernel.run(SETUP).ok
        if args.threads:
            assert kernel.run(f"%%ranks\ntorch.set_num_threads({args.threads})").ok
        assert kernel.run(LATENCY_PROBE).ok
        samples_per_s(kernel, 10, "watched")  # warm-up
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        kernel_cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        step_ends: dict[str, list[np.ndarray]] = {mode: [] for mode in MODES}
        order = list(MODES)
        for rep in range(args.reps):
            # each mode runs in each position in turn: a cell runs slower or faster
            # depending on what ran before it (up to 5% here), which a fixed order
            # would charge to one mode
            for mode in order[rep % len(order):] + order[:rep % len(order)]:
                rate, cpu, ends = samples_per_s(kernel, args.steps, mode)
                rates[mode].append(rate)
                kernel_cpu[mode].append(cpu)
                step_ends[mode].append(ends)
        groups: list[float] = []
        phase_rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.phase_cells):
            for group in phase_groups(kernel, phase_rates):
                groups.append(group)
        latency = kernel.run("import json\nprint(json.dumps(_latencies))")
        latencies = sorted(json.loads(latency.stdout.strip().splitlines()[-1]))
        kernel.run("%mpilab stop", timeout=120)
    finally:
        kernel.shutdown()
    if groups:
        on, off_phases = (statistics.median(phase_rates[k]) for k in (True, False))
        low, high = bootstrap_interval(groups)
        cost = statistics.median(groups)
        print(f"In one cell, records and dashboard on and off in turn ({PHASES} phases of "
              f"{PHASE_STEPS} steps per cell, {args.phase_cells} cells): watching costs "
              f"{100 * cost:+.1f}% (median of {len(groups)} ABBA groups; 90% interval "
              f"{100 * low:+.1f}% to {100 * high:+.1f}%), {100 * (1 - on / off_phases):+.1f}% "
              f"of medians; target <= 2%: {'met' if cost <= 0.02 else 'missed'}"
              f"{'' if high <= 0.02 else ' (the interval reaches past 2%)'}")
    off = statistics.median(rates["unwatched"])
    print(f"DataParallel MLP (1.05M parameters), {args.ranks} ranks, {args.steps} steps, "
          f"{args.reps} alternating repetitions")
    for mode in MODES:
        rate = statistics.median(rates[mode])
        # each run against the unwatched run of its repetition: drift in the machine's
        # speed over the benchmark cancels out
        pairs = [1 - r / u for r, u in zip(rates[mode], rates["unwatched"])]
        cost = "" if mode == "unwatched" else (
            f"  cost {100 * (1 - rate / off):+.1f}% of medians, "
            f"{100 * statistics.median(pairs):+.1f}% median of pairs")
        print(f"  {mode:13} median {rate:9.1f} samples/s, kernel CPU "
              f"{100 * statistics.median(kernel_cpu[mode]):4.1f}% of a core{cost}")
    cpu = {mode: 100 * statistics.median(kernel_cpu[mode]) for mode in MODES}
    print(f"  kernel CPU above unwatched: records {cpu['records only'] - cpu['unwatched']:+.1f}"
          f" points of a core, the dashboard {cpu['watched'] - cpu['records only']:+.1f} more")
    cycle = {mode: cycle_cost(step_ends[mode]) for mode in MODES}
    print("  steps against the quiet part of the send cycle: " + ", ".join(
        f"{mode} {100 * cost:+.2f}%" for mode, cost in cycle.items())
        + f"; so watching costs {100 * (cycle['watched'] - cycle['unwatched']):+.2f}%: the"
        f" records {100 * (cycle['records only'] - cycle['unwatched']):+.2f}%,"
        f" the dashboard {100 * (cycle['watched'] - cycle['records only']):+.2f}% more")
    watched_cost = 1 - statistics.median(rates["watched"]) / off
    print(f"  target: watched costs <= 2%: {'met' if watched_cost <= 0.02 else 'missed'}; "
          f"spread of the unwatched runs "
          f"{100 * (max(rates['unwatched']) / min(rates['unwatched']) - 1):.1f}%")
    if latencies:
        p50 = statistics.median(latencies) * 1e3
        p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] * 1e3
        print(f"  record -> dashboard data: median {p50:.0f} ms, p95 {p95:.0f} ms "
              f"over {len(latencies)} records (target p95 <= 300 ms)")


if __name__ == "__main__":
    main()

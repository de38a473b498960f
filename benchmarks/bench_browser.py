"""What watching costs with the dashboard drawn in a browser on the same machine.

bench_overhead.py drives the kernel over the Jupyter protocol: nothing draws. Here the
same training runs in JupyterLab, in chromium (headless, no GPU: plotly paints in
software), as a user sees it. Three kinds of cell, each in each position in turn:
"watched" (records on, the live dashboard under the cell), "out of sight" (the same,
but its output is collapsed once the dashboard appears, as a user who looks elsewhere
during a long run) and "unwatched" (records off, --no-dashboard). For each cell: the
ranks' throughput and the CPU of each process group (the browser, the Jupyter server,
the kernel, the ranks) as a share of one core.

    .venv/bin/python benchmarks/bench_browser.py [--reps 3] [--steps 2400]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from bench_overhead import SETUP
from options import count

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from jupyter_lab import (  # noqa: E402
    CHROMIUM,
    cell,
    chromium,
    open_notebook,
    run_cell,
    running_lab,
    wait_cell_done,
)


@dataclass(frozen=True)
class Mode:
    flags: str  # of %%ranks
    records: bool  # the ranks send their records
    collapsed: bool = False  # the dashboard's output is collapsed once it appears


MODES = {"watched": Mode("", records=True),
         "out of sight": Mode("", records=True, collapsed=True),
         "unwatched": Mode(" --no-dashboard", records=False)}
GROUPS = ("browser", "server", "kernel", "ranks", "other")


def group_of(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    if "chrom" in command:
        return "browser"
    if "ipykernel" in command:
        return "kernel"
    if "mpilab.rank" in command or "engine" in command:
        return "ranks"
    if "jupyter-lab" in command or "jupyter lab" in command:
        return "server"
    return "other"  # the controller, mpiexec, Playwright's driver


def cpu_seconds() -> dict[str, float]:
    """CPU time so far of this benchmark's process tree, by group (the living ones)."""
    totals = dict.fromkeys(GROUPS, 0.0)
    for process in psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
            totals[group_of(process)] += times.user + times.system
        except psutil.Error:
            continue  # ended meanwhile
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=count, default=3)  # cells of each mode
    parser.add_argument("--steps", type=count, default=2400)  # ~20 s a cell: a steady state
    args = parser.parse_args()
    if not CHROMIUM.exists():
        raise SystemExit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    # each mode runs in each position in turn: a cell runs faster or slower depending on
    # what ran before it, which a fixed order would charge to one mode
    modes, order = list(MODES), []
    for _ in range(args.reps):
        order += modes
        modes = modes[1:] + modes[:1]
    cells = ["%load_ext mpilab\n%mpilab start -n 2", SETUP]
    for mode in order:
        cells.append(f"%%ranks 0-1{MODES[mode].flags}\n"
                     f"rate = train({args.steps}, {MODES[mode].records})\n"
                     "print('samples/s', round(rate))")
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="mpilab-bench-browser") as base, \
            running_lab(Path(base)) as lab, chromium() as browser:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        open_notebook(page, lab, lab.write_notebook("bench.ipynb", cells))
        for index in range(2):
            run_cell(page, index)
            wait_cell_done(page, index, timeout_s=300)
        for index, mode in enumerate(order, start=2):
            before, started = cpu_seconds(), time.monotonic()
            run_cell(page, index)
            collapsed = MODES[mode].collapsed
            if collapsed:
                cell(page, index).locator(".jp-OutputArea .js-plotly-plot").first.wait_for(
                    timeout=60_000)
                cell(page, index).locator(".jp-Cell-outputCollapser").click()
            wait_cell_done(page, index, timeout_s=600)
            after, seconds = cpu_seconds(), time.monotonic() - started
            if collapsed:
                cell(page, index).locator(".jp-OutputPlaceholder").click()  # to read it
            # the ranks step together; the slower one sets the pace
            per_rank = re.findall(r"samples/s (\d+)", cell(page, index).inner_text())
            rates[mode].append(min(float(rate) for rate in per_rank))
            cpu[mode].append({group: 100 * (after[group] - before[group]) / seconds
                              for group in GROUPS})
            page.wait_for_timeout(1000)  # the final plot drawn before the next cell
        lab.shutdown_kernels()
    print(f"DataParallel MLP, 2 ranks, {args.steps} steps a cell, {args.reps} cells per mode, "
          "in JupyterLab in headless chromium on this machine")
    for mode in MODES:
        shares = "  ".join(f"{group} {statistics.median(c[group] for c in cpu[mode]):5.1f}"
                           for group in GROUPS)
        print(f"  {mode:12} median {statistics.median(rates[mode]):8.0f} samples/s;"
              f" CPU, % of a core: {shares}")
    for mode in ("watched", "out of sight"):
        # a cell against the unwatched one of the same round
        pairs = [1 - w / u for w, u in zip(rates[mode], rates["unwatched"])]
        extra = {group: statistics.median(w[group] - u[group] for w, u in
                                          zip(cpu[mode], cpu["unwatched"])) for group in GROUPS}
        print(f"  {mode}: costs {100 * statistics.median(pairs):+.1f}% (median of "
              f"{len(pairs)} rounds; each: {', '.join(f'{100 * p:+.1f}%' for p in pairs)})")
        print("    CPU above unwatched, % of a core: "
              + ", ".join(f"{group} {extra[group]:+.1f}" for group in GROUPS))


if __name__ == "__main__":
    main()

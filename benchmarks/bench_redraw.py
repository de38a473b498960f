"""What one dashboard redraw costs the notebook kernel, and what the widget update in it
costs against plotly's FigureWidget (the peer), in one real kernel, side by side.

- redraw: `Dashboard.refresh` of a 2-rank run, 30 new steps per rank before each (a
  training loop's 0.25 s between rounds, filed as the ranks send them), snapshot and
  widget update included (it sends the points that changed); early
  in the run (up to ~2,400 steps) and late in a long one (from --long steps on): a
  redraw should cost what arrived since the last one, not the run so far;
- update: the same arrays (10 traces of 600 points, every value new, so LivePlot sends
  them all) into a shown widget, through `LivePlot.show` (one message) and through
  `FigureWidget.plotly_restyle` (plotly's four messages and its Python copy of the
  figure), interleaved, median of each.

    .venv/bin/python benchmarks/bench_redraw.py [--redraws 80] [--updates 200] [--long 20000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from options import at_least, count

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel import Kernel  # noqa: E402

CODE = """
import json, statistics, time
import numpy as np
import plotly.graph_objects as go
from IPython.display import display
from mpilab.metrics_store import MetricsStore
from mpilab.wire import encode
from mpilab.widgets import Dashboard, LivePlot

store = MetricsStore(world_size=2)
dash = Dashboard(store, world_size=2, since=time.time() - 1)
step = 0
def feed(steps):
    # as the ranks send them: each rank's records in messages of blocks of rows
    global step
    sent = {r: [] for r in range(2)}
    for _ in range(steps):
        step += 1
        now = time.time()
        for r in range(2):
            sent[r] += [{"k": "step", "r": r, "t": now, "step": step, "dur": 0.008,
                         "compute": 0.006, "comm": 0.002, "nbytes": 4_000_000,
                         "samples": 64},
                        {"k": "log", "r": r, "t": now, "step": step,
                         "values": {"loss": 1.0 / step}}]
    for r, records in sent.items():
        for message in encode(r, records):
            store.add_raw(message)
feed(30)
display(dash.mimebundle(), raw=True)
def redraws():
    spent = []
    for _ in range(REDRAWS):
        feed(30)
        started = time.perf_counter()
        dash.refresh(force=True)
        spent.append(time.perf_counter() - started)
    return statistics.median(spent[10:]), step
early = redraws()
feed(LONG - step)  # late in a long run
dash.refresh(force=True)
late = redraws()

x = np.arange(600, dtype=float)
live = LivePlot({"data": [{"type": "scatter"} for _ in range(10)], "layout": {}})
peer = go.FigureWidget(go.Figure([go.Scatter() for _ in range(10)]))
display(live)
display(peer)
ours, theirs = [], []
for k in range(UPDATES):
    # new data every time, as in training (an unchanged value would send nothing)
    traces = {i: (x, x * (i + 1) + k) for i in range(10)}
    started = time.perf_counter()
    live.show(traces)
    ours.append(time.perf_counter() - started)
    started = time.perf_counter()
    peer.plotly_restyle({"x": [a for a, _ in traces.values()],
                         "y": [b for _, b in traces.values()]}, trace_indexes=list(traces))
    theirs.append(time.perf_counter() - started)
print(json.dumps({"redraws": [early, late],
                  "ours": statistics.median(ours), "theirs": statistics.median(theirs)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the first 10 redraws of each series are a warm-up, left out
    parser.add_argument("--redraws", type=at_least(11), default=80)
    parser.add_argument("--updates", type=count, default=200)
    parser.add_argument("--long", type=count, default=20_000)  # steps of the long run
    args = parser.parse_args()
    kernel = Kernel()
    try:
        run = kernel.run(CODE.replace("REDRAWS", str(args.redraws))
                         .replace("UPDATES", str(args.updates))
                         .replace("LONG", str(args.long)), timeout=300)
        if not run.ok:
            raise SystemExit(run.text)
        got = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        kernel.shutdown()
    for redraw, steps in got["redraws"]:
        print(f"dashboard redraw (2 ranks, 30 new steps each), the run at step {steps}: "
              f"median {1e3 * redraw:.2f} ms")
    print(f"widget update, 10 traces x 600 points: LivePlot {1e3 * got['ours']:.2f} ms, "
          f"FigureWidget {1e3 * got['theirs']:.2f} ms "
          f"({got['theirs'] / got['ours']:.1f}x; median of {args.updates} each, interleaved)")


if __name__ == "__main__":
    main()

"""The widgets in a real JupyterLab, in a real browser (Debian's chromium, Playwright).

A JupyterLab server is started on 127.0.0.1 with a token in a temporary root; chromium
opens notebooks there and runs their cells with the keyboard, as a user would (jupyter_lab.py).
Screenshots go to build/, and so does what each check of a plot growing saw (NAME.json:
the test's samples and the views' own logs of updates and drawings), for when it fails.
Without /usr/bin/chromium the tests skip locally, never in CI.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from jupyter_lab import (
    BUILD,
    cell,
    is_running,
    open_notebook,
    require_chromium,
    run_cell,
    wait_cell_done,
)

pytestmark = pytest.mark.timeout(300)

require_chromium()


def trace_lengths(page, index: int) -> list[list[int]]:
    """Points per trace of each plotly plot in a cell's output, read from the DOM.

    plotly.js keeps what it drew in `_fullData` (typed arrays decoded, unlike `data`).
    """
    return page.evaluate(
        """i => [...document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                   .querySelectorAll('.js-plotly-plot')]
                 .map(p => (p._fullData || []).map(t => t.x ? t.x.length : 0))""", index)


def trace_x(page, index: int, trace: int) -> list[float]:
    """The x values that a cell's first plot draws for one trace."""
    return page.evaluate(
        """([i, t]) => Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                                 .querySelector('.js-plotly-plot')._fullData[t].x)""",
        [index, trace])


def wait_for_plot(page, index: int, timeout_s: float = 60) -> None:
    cell(page, index).locator(".jp-OutputArea .js-plotly-plot").first.wait_for(
        timeout=timeout_s * 1000)


def watch_growth(page, index: int, while_, timeout_s: float = 60,
                 samples: list | None = None) -> list[int]:
    """Total points in the first plot seen in the cell's output, sampled until `while_()`
    turns false. Only that plot counts: the live view the user watches, not one that a
    later update of the output puts in its place (a cell's final plot). Each sample
    (epoch ms, total or None, while_'s answer) goes to `samples`."""
    seen = []
    samples = [] if samples is None else samples
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        going = while_()
        total = watched_total(page, index)
        samples.append((round(time.time() * 1000), total, going))
        if not going:
            break
        if total is not None and (not seen or total != seen[-1]):
            seen.append(total)
        page.wait_for_timeout(200)
    return seen


def watched_total(page, index: int) -> int | None:
    """Points in the first plot seen in a cell's output (None before there is one). The
    page keeps a hold on every plot seen there (`window.mpilabWatched`), for plot_logs."""
    return page.evaluate(
        """i => {
             const plots = [...document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                              .querySelectorAll('.js-plotly-plot')];
             const watched = (window.mpilabWatched = window.mpilabWatched || {});
             const seen = (watched[i] = watched[i] || new Set());
             plots.forEach(p => seen.add(p));
             const first = seen.values().next().value;
             return first && first._fullData
               ? first._fullData.reduce((n, t) => n + (t.x ? t.x.length : 0), 0) : null;
           }""", index)


def plot_logs(page, index: int) -> list[list[dict]]:
    """What each live plot in a cell's output did and when (`mpilabLog`, live_plot.py):
    those watch_growth saw, then those there now."""
    return page.evaluate(
        """i => {
             const plots = new Set((window.mpilabWatched || {})[i] || []);
             document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
               .querySelectorAll('.js-plotly-plot').forEach(p => plots.add(p));
             return [...plots].map(p => p.mpilabLog || null);
           }""", index)


def keep_evidence(page, name: str, index: int, **timing) -> str:
    """The plot's own log and the test's timing, in build/NAME.json: what a failure of a
    timing-sensitive assertion needs to be understood. Returns a short summary."""
    logs = plot_logs(page, index)
    record = {"cell": index, **timing, "plot_logs": logs}
    (BUILD / f"{name}.json").write_text(json.dumps(record, indent=1))
    draws = [e for log in logs if log for e in log if e["kind"] in ("draw", "restyle")]
    start = timing.get("cell_started_ms", 0)
    return (f"drawings at (ms after the cell started, ms taken, points): "
            f"{[(e['at'] - start, e['ms'], e['points']) for e in draws][:40]}; "
            f"details in {BUILD / name}.json")


def screenshot(page, name: str, index: int, output: int = 0, plot: int | None = None) -> Path:
    """One output of a cell (or the output holding its `plot`-th plot), scrolled into
    view first: JupyterLab scrolls inside its own panel, not the page."""
    path = BUILD / f"{name}.png"
    if plot is not None:
        output = page.evaluate(
            """([i, k]) => {
                 const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
                 const target = cell.querySelectorAll('.js-plotly-plot')[k];
                 return [...cell.querySelectorAll('.jp-OutputArea-output')]
                          .findIndex(o => o.contains(target)); }""", [index, plot])
        assert output >= 0, f"plot {plot} of cell {index} is in no output"
    target = cell(page, index).locator(".jp-OutputArea-output").nth(output)
    target.scroll_into_view_if_needed()
    target.screenshot(path=str(path))
    return path


# -- the widget alone, fed from a synthetic store -------------------------------------------
SYNTHETIC_SETUP = """\
import os, threading, time
from mpilab.metrics_store import MetricsStore
from mpilab.widgets import Dashboard

store = MetricsStore(world_size=2)

def add_step(step):
    now = time.time()
    for r in range(2):
        dur = 0.05 + 0.03 * r  # rank 1 is the straggler
        store.add({"k": "step", "r": r, "t": now, "step": step, "dur": dur,
                   "compute": 0.03 + 0.03 * r, "comm": 0.02, "nbytes": 4_000_000 + step,
                   "samples": 32})
        store.add({"k": "log", "r": r, "t": now, "step": step,
                   "values": {"loss": 2.0 / (1 + step / 20) + 0.01 * r}})

fed = []  # the steps feed() added
def feed(dash, steps, stop=None, start=None):
    # like a --noblock cell: the kernel is idle while a thread adds `steps` and redraws
    # after each, until `stop` is set. It starts once the browser shows the plot: once
    # the file `start` exists (the test saw the plot drawn), or without one once a view
    # is attached (it draws when plotly.js has loaded: seconds later in a slow browser)
    shown = ((lambda: os.path.exists(start)) if start
             else (lambda: dash.widget._view_count >= 1))
    deadline = time.monotonic() + 60
    while not shown() and time.monotonic() < deadline:
        time.sleep(0.05)
    for step in steps:
        if stop is not None and stop.is_set():
            break
        add_step(step)
        fed.append(step)
        dash.refresh()
        time.sleep(0.05)
    dash.refresh(force=True)
"""

FED_STEPS = 120
FEED_START = "feed.start"  # in the lab's root: the test saw the plot drawn
NOBLOCK_CELL = f"""\
dash = Dashboard(store, world_size=2)
feeder = threading.Thread(target=feed, args=(dash, range({FED_STEPS})),
                          kwargs={{"start": {FEED_START!r}}})
feeder.start()
display(dash.mimebundle(), raw=True)
"""

# like a blocking %%ranks cell: the runner's loop displays on the first metric and
# refreshes every tick on the main thread, then puts the final bundle in place
BLOCKING_CELL = """\
feeder.join()
dash2 = Dashboard(store, world_size=2, since=time.time())
handle = None
for tick in range(70):
    add_step(1000 + tick)
    if handle is None and dash2.has_data():
        handle = display(dash2.mimebundle(), raw=True, display_id=True)
    dash2.refresh()
    time.sleep(0.1)
dash2.refresh(force=True)
handle.update(dash2.mimebundle(), raw=True)
"""

STATIC_CELL = """\
from mpilab.widgets import StatusTable, bench_figure, figure_bundle
rows = [{"op": "allreduce", "backend": b, "size_bytes": s, "time_s": s / (bw * 1e9),
         "algbw_GBps": bw * s / (s + 65536), "busbw_GBps": bw * s / (s + 65536)}
        for b, bw in (("mpi", 6.0), ("gloo", 2.0), ("mpilab", 9.0))
        for s in (4 << 10, 64 << 10, 1 << 20, 4 << 20)]
display(figure_bundle(bench_figure(rows, memcpy_gbps=12.0)), raw=True)
# a run whose live view was never shown ends as a static plot (plotly mime renderer)
display(Dashboard(store, world_size=2).mimebundle(final=True), raw=True)
store.add({"k": "hb", "r": 0, "t": time.time(), "pid": 11, "host": "node1",
           "phase": "collective", "op": "allreduce", "seq": 42, "op_age": 0.01,
           "rss": 300 << 20, "step": 120, "dev_mem": 0, "cell": 3})
StatusTable([{"rank": r, "host": "node1", "pid": 11 + r, "device": "cpu",
              "backend": "gloo"} for r in range(2)], store)
"""


def test_dashboard_widget_renders_and_grows(page, lab):
    name = lab.write_notebook("widget.ipynb",
                              [SYNTHETIC_SETUP, NOBLOCK_CELL, BLOCKING_CELL, STATIC_CELL])
    open_notebook(page, lab, name)
    run_cell(page, 0)
    wait_cell_done(page, 0)

    # the kernel is idle while a thread feeds the widget (a --noblock cell), from when
    # the plot is drawn
    started = round(time.time() * 1000)
    run_cell(page, 1)
    wait_for_plot(page, 1)
    plot_seen = round(time.time() * 1000)
    (lab.root / FEED_START).touch()
    samples: list = []
    seen = watch_growth(page, 1, while_=lambda: not seen_final(page, 1, FED_STEPS),
                        samples=samples)
    evidence = keep_evidence(page, "widget_dashboard_fed", 1, cell_started_ms=started,
                             plot_seen_ms=plot_seen, samples=samples)
    assert len(seen) >= 2, f"the plot did not grow while fed: {seen}; {evidence}"
    assert seen == sorted(seen)
    wait_cell_done(page, 1)
    lengths = trace_lengths(page, 1)[0]
    # throughput x2 + total (without the warm-up step), 2 bars (2 ranks), bandwidth x2, loss
    assert lengths == [FED_STEPS - 1] * 3 + [2, 2] + [FED_STEPS] * 3 \
        + [FED_STEPS - 1] * 3 + [FED_STEPS] * 3, lengths
    # each redraw sent only what changed: the views put the pieces together right
    assert trace_x(page, 1, 0) == list(range(1, FED_STEPS))
    assert trace_x(page, 1, 7) == list(range(FED_STEPS))  # the loss
    screenshot(page, "widget_dashboard", 1)

    # a blocking cell that refreshes on the main thread, as the runner does
    started = round(time.time() * 1000)
    run_cell(page, 2)
    wait_for_plot(page, 2)
    plot_seen = round(time.time() * 1000)
    samples: list = []
    seen = watch_growth(page, 2, while_=lambda: is_running(page, 2), samples=samples)
    evidence = keep_evidence(page, "widget_dashboard_blocking", 2, cell_started_ms=started,
                             plot_seen_ms=plot_seen, samples=samples)
    assert len(seen) >= 2 and seen == sorted(seen), \
        f"the plot did not grow while the cell was running: {seen}; {evidence}"
    wait_cell_done(page, 2)
    assert trace_lengths(page, 2)[0][0] == 70 - 1
    ticks = page.evaluate("""() => document.querySelectorAll('.jp-Notebook .jp-Cell')[2]
                               .querySelector('.js-plotly-plot')._fullLayout.xaxis2.ticktext""")
    assert ticks == ["rank 0", "rank 1"]  # the final view names the ranks too
    screenshot(page, "widget_dashboard_blocking", 2)

    # the benchmark plot (plotly mime renderer) and the status table
    run_cell(page, 3)
    wait_cell_done(page, 3)
    wait_for_plot(page, 3)
    page.wait_for_function(
        "() => document.querySelectorAll('.jp-Notebook .jp-Cell')[3]"
        ".querySelectorAll('.js-plotly-plot').length == 2")
    bench, static = trace_lengths(page, 3)
    assert bench == [4] * 6 + [2, 2]  # algbw and busbw of 3 backends, the ceiling twice
    assert static == [FED_STEPS + 69] * 3 + [2, 2] + [FED_STEPS + 70] * 3 \
        + [FED_STEPS + 69] * 3 + [FED_STEPS + 70] * 3, static
    table = cell(page, 3).locator("table.mpilab-status")
    table.wait_for()
    assert table.locator("tbody tr").count() == 2
    assert "allreduce #42" in table.inner_text()
    screenshot(page, "widget_bench", 3, 0)
    screenshot(page, "widget_static_dashboard", 3, 1)
    screenshot(page, "widget_status", 3, 2)


def seen_final(page, index: int, steps: int) -> bool:
    """The cell's first plot draws all `steps`: its throughput (trace 0) has every step but
    the warm-up one."""
    lengths = trace_lengths(page, index)
    return bool(lengths) and lengths[0][0] >= steps - 1


# a thread feeds the plot until told to stop
FEED_UNTIL_STOPPED = """\
import itertools
dash3 = Dashboard(store, world_size=2, since=time.time())
stop = threading.Event()
feeder3 = threading.Thread(target=feed, args=(dash3, itertools.count(5000), stop))
feeder3.start()
display(dash3.mimebundle(), raw=True)
"""
# then a scalar never logged before: the figure gains a trace
STOP_FEEDING = """\
stop.set(); feeder3.join()
store.add({"k": "log", "r": 0, "t": time.time(), "step": 5000 + len(fed), "values": {"lr": 0.1}})
dash3.refresh(force=True)
print('fed', len(fed))
"""


def settled(page, expression: str, quiet_ms: int = 1000, timeout_s: float = 10):
    """The value of a page expression once it has not changed for `quiet_ms` (or after
    `timeout_s`): a loaded machine may take a while to finish what was under way."""
    value, since = page.evaluate(expression), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline and time.monotonic() - since < quiet_ms / 1000:
        page.wait_for_timeout(250)
        now = page.evaluate(expression)
        if now != value:
            value, since = now, time.monotonic()
    return value


def test_view_out_of_sight_draws_nothing_until_back(page, lab):
    """A researcher who collapses the dashboard's output (or scrolls away, or switches
    tabs) during a long run should not pay for drawing it; back, it shows the latest."""
    name = lab.write_notebook("hidden.ipynb", [SYNTHETIC_SETUP, FEED_UNTIL_STOPPED,
                                               STOP_FEEDING])
    open_notebook(page, lab, name)
    run_cell(page, 0)
    wait_cell_done(page, 0)
    run_cell(page, 1)
    wait_cell_done(page, 1)
    wait_for_plot(page, 1)
    # the view may first draw the empty figure (traces without x), if it is attached
    # before the thread's first update reaches it
    page.wait_for_function("() => (document.querySelectorAll('.jp-Notebook .jp-Cell')[1]"
                           ".querySelector('.js-plotly-plot')._fullData || [])[0]?.x?.length"
                           " >= 5")
    # the plot leaves the page with its output: keep a handle on it, and count drawings
    page.evaluate("""() => {
        window.feedPlot = document.querySelectorAll('.jp-Notebook .jp-Cell')[1]
                            .querySelector('.js-plotly-plot');
        window.feedDraws = 0;
        window.feedPlot.on('plotly_afterplot', () => { window.feedDraws += 1; });
    }""")
    drawn = "() => [window.feedDraws, window.feedPlot._fullData[0].x.length]"
    cell(page, 1).locator(".jp-Cell-outputCollapser").click()
    cell(page, 1).locator(".jp-OutputPlaceholder").wait_for()
    hidden = settled(page, drawn)  # a drawing under way when it was hidden ends
    page.wait_for_timeout(1500)  # the thread goes on feeding: ~30 steps, ~6 updates
    assert page.evaluate(drawn) == hidden, "a view out of sight went on drawing"

    run_cell(page, 2)
    wait_cell_done(page, 2)
    fed = int(cell(page, 2).locator(".jp-OutputArea").inner_text().split()[-1])
    page.wait_for_timeout(500)
    assert page.evaluate(drawn) == hidden, "a view out of sight drew the last update"

    cell(page, 1).locator(".jp-OutputPlaceholder").click()
    # back in sight, it draws what it missed: every step but the warm-up one, and the
    # new scalar's trace
    page.wait_for_function("n => window.feedPlot._fullData.length == 16 &&"
                           " window.feedPlot._fullData[0].x.length == n", arg=fed - 1,
                           timeout=10_000)
    assert trace_x(page, 1, 0) == list(range(5001, 5000 + fed))
    assert trace_x(page, 1, 8) == [5000 + fed]
    screenshot(page, "widget_back_in_sight", 1)



# -- the whole path: ranks, a training cell, the benchmark ------------------------------------
TRAIN_CELL = """\
%%ranks
import time, torch
torch.manual_seed(0)
model = mpilab.DataParallel(torch.nn.Sequential(
    torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
for step in range(60):
    x = torch.randn(64, 64, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), 2 * x[:, :1])
    opt.zero_grad(); loss.backward(); opt.step()
    mpilab.log(loss=loss.item())
    time.sleep(0.1 + 0.1 * rank)  # ~10 s, and rank 1 is the straggler
print("trained", step + 1, "steps")
"""


def answer_input(page, index: int, text: str) -> str:
    """Type `text` into the input box under cell `index` once it shows; its prompt."""
    # JupyterLab hides an answered box for a moment before it removes it
    asking = cell(page, index).locator(
        ".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding)")
    asking.wait_for(timeout=60_000)
    prompt = asking.locator(".jp-Stdin-prompt").inner_text().strip()
    box = asking.locator(".jp-Stdin-input").element_handle()
    box.fill(text)
    box.press("Enter")
    page.wait_for_function("box => !box.isConnected || "
                           "box.closest('.jp-OutputArea-stdin-hiding') !== null",
                           arg=box, timeout=30_000)
    return prompt


def test_training_dashboard_and_bench_on_two_ranks(page, lab):
    name = lab.write_notebook("cluster.ipynb", [
        "%load_ext mpilab\n%mpilab start -n 2",
        TRAIN_CELL,
        "%mpilab bench allreduce --sizes 4K:1M",
        "%%ranks 0\nimport ipywidgets\nfrom IPython.display import display\n"
        "slider = ipywidgets.IntSlider(value=3)\ndisplay(slider)",
        "%%ranks 0\nslider.value = 42",
        "%%ranks\nimport pdb\nx = rank * 10\npdb.set_trace()\nprint('after', x)",
        "%%ranks\ndef f(z):\n    return 1 / z\nf(rank - 1)",
        "%debug",
        "%mpilab stop",
    ])
    open_notebook(page, lab, name)
    run_cell(page, 0)
    wait_cell_done(page, 0, timeout_s=120)
    assert "2 ranks" in cell(page, 0).locator(".jp-OutputArea").inner_text()

    started = round(time.time() * 1000)
    run_cell(page, 1)
    wait_for_plot(page, 1, timeout_s=60)
    plot_seen = round(time.time() * 1000)
    assert is_running(page, 1), "the dashboard must appear while the cell runs"
    samples: list = []
    seen = watch_growth(page, 1, while_=lambda: is_running(page, 1), timeout_s=120,
                        samples=samples)
    evidence = keep_evidence(page, "cluster_dashboard", 1, cell_started_ms=started,
                             plot_seen_ms=plot_seen, samples=samples)
    assert len(seen) >= 2 and seen == sorted(seen), \
        f"the dashboard did not grow while the cell was running: {seen}; {evidence}"
    wait_cell_done(page, 1)
    assert "trained 60 steps" in cell(page, 1).locator(".jp-OutputArea").inner_text()
    lengths = trace_lengths(page, 1)[0]
    assert lengths[0] == lengths[1] == 59, lengths  # every step but the warm-up one
    screenshot(page, "cluster_dashboard", 1, plot=0)

    run_cell(page, 2)
    wait_cell_done(page, 2, timeout_s=120)
    wait_for_plot(page, 2)
    bench = trace_lengths(page, 2)[0]
    assert bench[:-2] and all(n == 9 for n in bench[:-2]), bench  # 4K, 8K, ... 1M
    assert bench[-2:] == [2, 2]  # the memcpy ceiling in both plots
    screenshot(page, "cluster_bench", 2, plot=0)

    # a widget made on a rank is live in the notebook (ipyparallel relays its messages):
    # the rank's later change shows
    run_cell(page, 3)
    wait_cell_done(page, 3, timeout_s=60)
    readout = cell(page, 3).locator(".widget-readout")
    readout.wait_for(timeout=30_000)
    assert readout.inner_text().strip() == "3"
    run_cell(page, 4)
    wait_cell_done(page, 4, timeout_s=60)
    page.wait_for_function(
        "i => document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
        ".querySelector('.widget-readout')?.textContent.trim() === '42'", arg=3,
        timeout=30_000)

    # a debugger on the ranks is driven from JupyterLab's input box under the cell: one
    # prompt for the ranks at it, pdb's lines first, each rank's own answer
    run_cell(page, 5)
    prompt = answer_input(page, 5, "p x")
    assert prompt == "[ranks 0-1] (Pdb)", prompt
    answer_input(page, 5, "c")
    wait_cell_done(page, 5, timeout_s=60)
    shown = cell(page, 5).locator(".jp-OutputArea").inner_text()
    assert shown.index("-> pdb.set_trace()") < shown.index("[ranks 0-1] (Pdb)  p x") \
        < shown.index("[rank 1] 10") < shown.index("[rank 1] after 10"), shown
    # %debug after a cell failed on rank 1 opens the debugger there
    run_cell(page, 6)
    page.wait_for_function(  # done, and failed: wait_cell_done would refuse it
        "i => /\\[[0-9]+\\]/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').textContent)", arg=6, timeout=60_000)
    assert "ZeroDivisionError" in cell(page, 6).locator(".jp-OutputArea").inner_text()
    run_cell(page, 7)
    assert answer_input(page, 7, "p z") == "ipdb>"
    answer_input(page, 7, "q")
    wait_cell_done(page, 7, timeout_s=60)
    debugged = cell(page, 7).locator(".jp-OutputArea").inner_text()
    assert debugged.startswith("mpilab: the debugger on rank 1, where the cell failed"), debugged
    assert "----> 2     return 1 / z" in debugged and "\n0\n" in debugged, debugged

    run_cell(page, 8)
    wait_cell_done(page, 8, timeout_s=60)

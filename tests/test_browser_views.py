"""What `%mpilab status` and `%mpilab dashboard` show in a real JupyterLab, in a real
browser (Debian's chromium, Playwright), on real ranks: the status table ticks while it
is on screen and shows a killed rank dead within the watchdog's bound; the dashboard
command finds the latest run with metrics after a cell without any; a cell that only
logs scalars gets one panel, its values against their count.

Then the views at scale, on simulated ranks (records made by the ranks' own encoder, in
one kernel): 64 ranks drawn as a band with smoothed lines, compact and expandable; a
plot in a slow browser saying how many steps it is behind, and nothing once current;
the status of 64 ranks as a summary with the full table a click away; the per-rank
output of 256 ranks with a selector and a filter.

Every wait is on a condition in the page (never a fixed sleep): the machine may be busy.
Screenshots go to build/views_*.png.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from jupyter_lab import (
    BUILD,
    cell,
    fresh_page,
    open_notebook,
    require_chromium,
    run_cell,
    wait_cell_done,
)

# the status table shows a dead rank at its next tick: a local rank's process is checked
# then; a rank the notebook cannot see is "cannot be reached" after the watchdog's 5 s of
# silence. Both within this (a tick is 0.7 s; the browser may be slow to paint)
DEAD_SHOWN_WITHIN_S = 5.0 + 3.0

pytestmark = pytest.mark.timeout(400)

require_chromium()


def shot(page, name: str, index: int, output: int = 0) -> None:
    target = cell(page, index).locator(".jp-OutputArea-output").nth(output)
    target.scroll_into_view_if_needed()
    target.screenshot(path=str(BUILD / f"{name}.png"))


def plot_layout(page, index: int, key: str):
    """A value of the first plot's `_fullLayout` in a cell's output."""
    return page.evaluate(
        """([i, k]) => {
             const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                         .querySelector('.js-plotly-plot');
             return p && p._fullLayout ? k.split('.').reduce((o, f) => o && o[f], p._fullLayout)
                                        : null; }""", [index, key])


def wait_plot_layout(page, index: int, key: str, expected, timeout_s: float = 60) -> None:
    page.wait_for_function(
        """([i, k, want]) => {
             const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                         .querySelector('.js-plotly-plot');
             const got = p && p._fullLayout
               ? k.split('.').reduce((o, f) => o && o[f], p._fullLayout) : undefined;
             return JSON.stringify(got) === JSON.stringify(want); }""",
        arg=[index, key, expected], timeout=timeout_s * 1000)


START = "%load_ext mpilab\n%mpilab start -n 2"
LOG_ONLY = "%%ranks\nfor i in range(40):\n    mpilab.log(loss=25.0 - 0.1 * i + 0.01 * rank)"
PRINT = "%%ranks\nprint('hello from', rank)"
DASHBOARD = "%mpilab dashboard"
STATUS = "%mpilab status"


def test_log_only_plot_and_dashboard_after_a_cell_without_metrics(page, lab):
    name = lab.write_notebook("views_dashboard.ipynb", [START, LOG_ONLY, PRINT, DASHBOARD])
    open_notebook(page, lab, name)
    run_cell(page, 0)
    wait_cell_done(page, 0, timeout_s=180)
    # a cell that only logs: one panel, the values against their count
    run_cell(page, 1)
    wait_cell_done(page, 1)
    wait_plot_layout(page, 1, "xaxis.visible", False)
    assert plot_layout(page, 1, "xaxis3.visible") is not False
    assert "without training steps" in plot_layout(page, 1, "xaxis3.title.text")
    assert plot_layout(page, 1, "xaxis3.range")[1] >= 39  # 40 values, not one step
    shown = page.evaluate("""i => [...document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                               .querySelectorAll('.js-plotly-plot .annotation-text')]
                               .map(e => e.textContent)""", 1)
    assert "Loss and logged scalars" in shown and "Throughput (samples/s)" not in shown, shown
    shot(page, "views_log_only", 1)
    # a cell without metrics, then the dashboard command: the log-only run, named
    run_cell(page, 2)
    wait_cell_done(page, 2)
    run_cell(page, 3)
    wait_cell_done(page, 3)
    cell(page, 3).locator(".js-plotly-plot").first.wait_for(timeout=60_000)
    page.wait_for_function(
        """i => /from In\\[\\d+\\]/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.js-plotly-plot .gtitle')?.textContent || '')""", arg=3,
        timeout=60_000)
    assert "no training metrics" not in cell(page, 3).inner_text()
    shot(page, "views_dashboard_after_print", 3)


def status_text(page, index: int) -> str:
    return cell(page, index).locator("table.mpilab-status").inner_text()


def test_status_ticks_and_shows_a_killed_rank_dead(page, lab):
    name = lab.write_notebook("views_status.ipynb", [START, STATUS])
    open_notebook(page, lab, name)
    run_cell(page, 0)
    wait_cell_done(page, 0, timeout_s=180)
    run_cell(page, 1)
    wait_cell_done(page, 1)
    table = cell(page, 1).locator("table.mpilab-status")
    table.wait_for(timeout=60_000)
    stamp = cell(page, 1).locator(".mpilab-status-time")
    first = stamp.inner_text()
    # it ticks: the time it was read moves on while the kernel is idle
    page.wait_for_function(
        """([i, was]) => {
             const s = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                         .querySelector('.mpilab-status-time');
             return s && s.textContent !== was; }""", arg=[1, first], timeout=15_000)
    rows = table.locator("tbody tr")
    assert rows.count() == 2
    assert all("idle" in rows.nth(r).inner_text() for r in range(2)), status_text(page, 1)
    shot(page, "views_status_live", 1)

    # rank 1 is killed outside any cell: the table says so within the watchdog's bound
    pid = int(re.split(r"\s+", rows.nth(1).inner_text().strip())[2])
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    page.wait_for_function(
        """i => /dead/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelectorAll('table.mpilab-status tbody tr')[1].textContent)""",
        arg=1, timeout=DEAD_SHOWN_WITHIN_S * 1000)
    took = time.monotonic() - killed
    assert took < DEAD_SHOWN_WITHIN_S, took
    shot(page, "views_status_dead", 1)


def per_rank_cell(flag: Path) -> str:
    """Four ranks print; they wait for `flag` (the test saw their output live), then
    rank 2 fails, in a `%%ranks --by-rank` cell."""
    return ("%%ranks --by-rank\n"
            "import os, sys, time\n"
            "print('step 0 on rank', rank, flush=True)\n"
            "deadline, waited = time.monotonic() + 90, 0\n"
            f"while not os.path.exists({str(flag)!r}) and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
            "    waited += 1\n"
            "    sys.stderr.write(f'\\rwaited {waited}'); sys.stderr.flush()\n"
            "print('step 1 on rank', rank, flush=True)\n"
            "if rank == 2:\n"
            "    raise ValueError('boom on rank 2')\n")


def wait_prompt_done(page, index: int, timeout_s: float = 120) -> None:
    """The cell has finished (it may have failed: this cell's error is expected)."""
    page.wait_for_function(
        "i => /\\[[0-9]+\\]/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').textContent)", arg=index,
        timeout=timeout_s * 1000)


def test_per_rank_view_with_four_ranks_live_and_a_failing_rank_marked(page, lab):
    flag = lab.root / "per_rank.go"
    flag.unlink(missing_ok=True)
    name = lab.write_notebook("views_per_rank.ipynb",
                              ["%load_ext mpilab\n%mpilab start -n 4", per_rank_cell(flag)])
    open_notebook(page, lab, name)
    run_cell(page, 0)
    wait_cell_done(page, 0, timeout_s=240)
    run_cell(page, 1)
    tabs = cell(page, 1).locator(".mpilab-rank-tabs")
    tabs.wait_for(timeout=60_000)
    assert tabs.locator("button").all_inner_texts() == \
        ["merged", "rank 0", "rank 1", "rank 2", "rank 3"]
    # live: rank 1's own output while the cell still runs (the ranks wait for the flag)
    tabs.locator("button[data-rank='1']").click()
    page.wait_for_function(
        """i => /step 0 on rank 1/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.mpilab-rank-output')?.textContent || '')""",
        arg=1, timeout=60_000)
    shown = cell(page, 1).locator(".mpilab-rank-output").inner_text()
    assert "rank 0" not in shown and "rank 3" not in shown, shown
    # its line being redrawn in place (`\rwaited N`), as it stands: it moves, never piles up
    waited = re.compile(r"step 0 on rank 1\nwaited (\d+)$")
    page.wait_for_function(
        """i => /waited [0-9]+$/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.mpilab-rank-output')?.textContent || '')""",
        arg=1, timeout=30_000)
    first = waited.search(cell(page, 1).locator(".mpilab-rank-output").inner_text().strip())
    assert first, cell(page, 1).locator(".mpilab-rank-output").inner_text()
    page.wait_for_function(
        """([i, n]) => {
             const m = /waited ([0-9]+)$/.exec(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.mpilab-rank-output')?.textContent || '');
             return m && Number(m[1]) > n; }""",
        arg=[1, int(first.group(1))], timeout=30_000)
    assert waited.search(cell(page, 1).locator(".mpilab-rank-output").inner_text().strip())
    assert "[*]" in cell(page, 1).locator(".jp-InputPrompt").inner_text()
    shot(page, "views_per_rank_live", 1)
    flag.touch()
    wait_prompt_done(page, 1)
    # the failing rank is marked, its error in its own output; the merged view stays
    failed = tabs.locator("button.mpilab-rank-failed")
    failed.wait_for(timeout=30_000)
    assert failed.all_inner_texts() == ["rank 2 \u2717"]
    failed.click()
    page.wait_for_function(
        """i => /boom on rank 2/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.mpilab-rank-output')?.textContent || '')""",
        arg=1, timeout=30_000)
    merged = cell(page, 1).locator(".jp-OutputArea").inner_text()
    assert "step 1 on rank 3" in merged
    shot(page, "views_per_rank_failed", 1)


# -- the views at scale, on simulated ranks ------------------------------------------------
# One notebook, one kernel and one page for these tests: no ranks, the records made by the
# ranks' own encoder (mpilab.rank.agent: `encode`, `Agent.heartbeat`) and filed as the
# record receiver files them (MetricsStore.add_raw, then notify: a round of records).
SIM_SETUP = '''
import os, threading, time
import numpy as np
from IPython.display import display
from mpilab.metrics_store import MetricsStore
from mpilab.rank.agent import Agent
from mpilab.wire import encode
from mpilab.widgets import Dashboard, StatusTable
from mpilab.widgets.rank_output import RankOutputs

SLOW = {5: 0.2, 40: 0.15}  # ranks that compute longer than the others' 0.1 s

def steps(rank, first, count, t0=None):
    """What a DataParallel rank queues for `count` steps: a step record and its loss."""
    t0 = time.time() if t0 is None else t0
    out = []
    rng = np.random.default_rng(rank * 7919 + first)
    for step in range(first, first + count):
        compute = SLOW.get(rank, 0.1)
        out.append({"k": "step", "r": rank, "t": t0, "step": step, "dur": 0.21,
                    "compute": compute, "comm": 0.21 - compute, "nbytes": 4_000_000,
                    "samples": int(rng.integers(26, 39))})
        out.append({"k": "log", "r": rank, "t": t0, "step": step,
                    "values": {"loss": 2.0 / (1 + step / 50) + float(rng.normal(0, 0.1))}})
    return out

def feed(store, ranks, first, count):
    for rank in range(ranks):
        for message in encode(rank, steps(rank, first, count)):
            assert store.add_raw(message)
    store.notify()

def feeding(store, ranks, rounds, per_round, every_s, start=None):
    """A thread that sends `rounds` rounds of `per_round` steps from every rank (once the
    file `start` exists, if given: the test saw the plot drawn)."""
    def run():
        while start and not os.path.exists(start):
            time.sleep(0.05)
        for i in range(rounds):
            feed(store, ranks, i * per_round, per_round)
            time.sleep(every_s)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
'''

SIM_BAND = '''
store64 = MetricsStore(world_size=64)
feed(store64, 64, 0, 300)
dash64 = Dashboard(store64, 64, source="64 simulated ranks")
display(dash64.mimebundle(), raw=True)
'''

SIM_BEHIND = '''
store8 = MetricsStore(world_size=8)
dash8 = Dashboard(store8, 8, source="8 simulated ranks")
feed(store8, 8, 0, 20)
display(dash8.mimebundle(), raw=True)
feeder8 = feeding(store8, 8, rounds=120, per_round=20, every_s=0.05,  # 6 s+, 400 steps/s
                  start="behind.go")
'''

SIM_STATUS = '''
hosts = 8
agents = [Agent(rank=r, world_size=64, address=None) for r in range(64)]
for agent in agents:
    agent.host = f"sim-node-{agent.rank // hosts}"
    agent.pid = 20_000 + agent.rank
    agent.state.phase, agent.state.step = "running", 100
agents[9].state.step = 90  # behind the others
agents[7].device_memory = lambda: 6 << 30  # most device memory
store_hb = MetricsStore(world_size=64)
info = [{"rank": r, "host": f"sim-node-{r // hosts}", "pid": 20_000 + r, "device": "cpu",
         "backend": "gloo", "dead": "exit code 9" if r == 3 else ""} for r in range(64)]

def beating(seconds):
    """Every rank's heartbeat every 0.5 s (rank 20 is silent), as the agents send them."""
    def run():
        for _ in range(int(seconds / 0.5)):
            for agent in agents:
                if agent.rank != 20:
                    for message in encode(agent.rank, [agent.heartbeat()]):
                        store_hb.add_raw(message)
            store_hb.notify()
            time.sleep(0.5)
    threading.Thread(target=run, daemon=True).start()

beating(120)
time.sleep(0.3)
status64 = StatusTable(info, store_hb)
status64.start()
display(status64)
'''

SIM_OUTPUT = '''
outputs = RankOutputs(list(range(256)))
display(outputs.mimebundle(), raw=True)
for r in range(256):
    outputs.feed(r, f"step 0 on rank {r}\\n")
outputs.feed(17, "loss nan at step 3\\n")
outputs.tick(force=True)  # the widget's state: every rank's text
time.sleep(0.3)
outputs.feed(201, "loss nan at step 5\\n")
outputs.tick()  # only what arrived, in an update (the state is rewritten every 5 s)
assert outputs.view.texts["201"] == "step 0 on rank 201\\n"
'''

SIM_OUTPUT_END = '''
for r in (17, 200):
    outputs.feed(r, f"\\nRuntimeError: boom on rank {r}\\n")
outputs.finish([17, 200])
'''

SIM_CELLS = [SIM_SETUP, SIM_BAND, SIM_BEHIND, SIM_STATUS, SIM_OUTPUT, SIM_OUTPUT_END]


@pytest.fixture(scope="module")
def sim_page(browser, lab):
    """The simulated-ranks notebook, open, its setup cell run."""
    with fresh_page(browser, lab, "views_scale") as page:
        name = lab.write_notebook("views_scale.ipynb", SIM_CELLS)
        open_notebook(page, lab, name)
        run_cell(page, 0)
        wait_cell_done(page, 0)
        yield page


def plot_traces(page, index: int) -> list[dict]:
    """The first plot's traces in a cell's output, as plotly holds them."""
    return page.evaluate(
        """i => [...document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                  .querySelector('.js-plotly-plot').data]
                .map(t => ({name: t.name, opacity: t.opacity, fill: t.fill,
                            smooth: t.meta ? t.meta.smooth_of : null,
                            n: t.x ? t.x.length : 0}))""", index)


def test_64_ranks_drawn_as_a_band_smoothed_compact_and_expandable(sim_page):
    page = sim_page
    run_cell(page, 1)
    wait_cell_done(page, 1)
    cell(page, 1).locator(".js-plotly-plot").first.wait_for(timeout=60_000)
    wait_plot_layout(page, 1, "height", 440)  # compact
    traces = plot_traces(page, 1)
    names = [t["name"] for t in traces]
    assert "median rank" in names and "min-max of 64 ranks" in names, names
    assert not any(n.startswith("rank ") for n in names) and len(traces) < 20, names
    band = next(t for t in traces if t["name"] == "min-max of 64 ranks")
    assert band["fill"] == "tonexty" and band["n"] > 250
    # every per-step trace: faint raw points and a smoothed line drawn over them
    smooth = [t for t in traces if t["smooth"] is not None]
    assert {t["name"] for t in smooth} >= {"median rank", "total", "loss"}, smooth
    for trace in smooth:
        raw = traces[trace["smooth"]]
        assert raw["opacity"] < 1 and trace["n"] == raw["n"] > 0, (raw, trace)
    notes = cell(page, 1).locator(".mpilab-plot-notes").inner_text()
    assert notes.startswith("slowest ranks: rank 5 (200 ms), rank 40 (150 ms)"), notes
    shot(page, "views_band_64_compact", 1)
    # expanded with one click, compact again with another
    button = cell(page, 1).locator(".mpilab-plot-expand")
    assert button.inner_text().startswith("expand")
    button.click()
    wait_plot_layout(page, 1, "height", 640)
    shot(page, "views_band_64_expanded", 1)
    button.click()
    wait_plot_layout(page, 1, "height", 440)


def test_a_plot_that_lags_the_data_says_how_many_steps_behind_and_nothing_once_current(
        sim_page, lab):
    page = sim_page
    go = lab.root / "behind.go"
    go.unlink(missing_ok=True)
    run_cell(page, 2)
    wait_cell_done(page, 2)
    cell(page, 2).locator(".js-plotly-plot").first.wait_for(timeout=60_000)
    # a browser 20 times slower (software painting on a busy machine): the drawing falls
    # behind 400 steps a second of data
    cdp = page.context.new_cdp_session(page)
    cdp.send("Emulation.setCPUThrottlingRate", {"rate": 20})
    go.touch()
    try:
        page.wait_for_function(
            """i => /^[0-9]+ steps? behind$/.test(document.querySelectorAll(
                 '.jp-Notebook .jp-Cell')[i].querySelector('.mpilab-plot-behind')
                 ?.textContent || '') && document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.mpilab-plot-behind').style.display !== 'none'""",
            arg=2, timeout=60_000)
        lag = int(cell(page, 2).locator(".mpilab-plot-behind").get_attribute("data-lag"))
        assert lag > 0
        shot(page, "views_behind", 2)
    finally:
        cdp.send("Emulation.setCPUThrottlingRate", {"rate": 1})
    # the feeding ends (120 rounds, 6 s or more): the plot catches up and says nothing
    page.wait_for_function(
        """i => { const b = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                    .querySelector('.mpilab-plot-behind');
                  return b && b.style.display === 'none' && b.dataset.lag === '0'; }""",
        arg=2, timeout=90_000)
    shot(page, "views_behind_current", 2)


def test_status_of_64_ranks_is_a_summary_with_outliers_and_the_full_table_a_click_away(
        sim_page):
    page = sim_page
    run_cell(page, 3)
    wait_cell_done(page, 3)
    summary = cell(page, 3).locator(".mpilab-status-summary")
    summary.wait_for(timeout=60_000)
    text = summary.inner_text()
    assert "64 ranks on 8 hosts" in text and "1 dead" in text, text
    outliers = cell(page, 3).locator(".mpilab-status-outlier").all_inner_texts()
    joined = "\n".join(outliers)
    assert "dead: rank 3 (exit code 9)" in joined, joined
    assert "silent: rank 20" in joined and "slowest: rank 9 (at step 90" in joined, joined
    assert "rank 7 (device memory 6GB" in joined, joined
    assert cell(page, 3).locator("table.mpilab-status").count() == 0  # folded
    # it ticks as the small table does
    stamp = cell(page, 3).locator(".mpilab-status-time").inner_text()
    page.wait_for_function(
        """([i, was]) => document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
             .querySelector('.mpilab-status-time').textContent !== was""",
        arg=[3, stamp], timeout=15_000)
    shot(page, "views_status_64_summary", 3)
    full = cell(page, 3).locator("details.mpilab-status-full")
    full.locator("summary").click()
    rows = full.locator("table.mpilab-status tbody tr")
    rows.first.wait_for(timeout=15_000)
    assert rows.count() == 64
    assert "dead: exit code 9" in rows.nth(3).inner_text()
    # the open table stays open across the kernel's updates
    stamp = cell(page, 3).locator(".mpilab-status-time").inner_text()
    page.wait_for_function(
        """([i, was]) => document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
             .querySelector('.mpilab-status-time').textContent !== was""",
        arg=[3, stamp], timeout=15_000)
    assert full.get_attribute("open") is not None and rows.count() == 64
    shot(page, "views_status_64_full", 3)


def test_per_rank_output_of_256_ranks_has_a_selector_and_a_filter_failing_ranks_marked(
        sim_page):
    page = sim_page
    run_cell(page, 4)
    wait_cell_done(page, 4)
    tabs = cell(page, 4).locator(".mpilab-rank-tabs")
    tabs.wait_for(timeout=60_000)
    # no wall of 256 buttons: a selector of the ranks
    assert tabs.locator("button").all_inner_texts() == ["merged"]
    select = tabs.locator("select.mpilab-rank-select")
    assert select.locator("option").count() == 257
    # the filter keeps the ranks whose output has the text, the update after the
    # widget's state included (rank 201's line came only in an update)
    tabs.locator("input.mpilab-rank-filter").fill("nan")
    page.wait_for_function(
        """i => document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
             .querySelectorAll('select.mpilab-rank-select option').length === 3""",
        arg=4, timeout=15_000)
    assert select.locator("option").all_inner_texts()[1:] == ["rank 17", "rank 201"]
    select.select_option("201")
    output = cell(page, 4).locator(".mpilab-rank-output")
    page.wait_for_function(
        """i => /loss nan at step 5/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.mpilab-rank-output')?.textContent || '')""",
        arg=4, timeout=15_000)
    assert "rank 17" not in output.inner_text()
    # the cell ends with two ranks failed: marked, first in the selector, a button each
    run_cell(page, 5)
    wait_cell_done(page, 5)
    failed = tabs.locator("button.mpilab-rank-failed")
    page.wait_for_function(
        """i => document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
             .querySelectorAll('button.mpilab-rank-failed').length === 2""",
        arg=4, timeout=15_000)
    assert failed.all_inner_texts() == ["rank 17 \u2717", "rank 200 \u2717"]
    tabs.locator("input.mpilab-rank-filter").fill("")
    options = select.locator("option").all_inner_texts()
    assert len(options) == 257 and options[1:3] == ["rank 17 \u2717", "rank 200 \u2717"]
    shot(page, "views_per_rank_256", 4)
    failed.first.click()
    page.wait_for_function(
        """i => /boom on rank 17/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                 .querySelector('.mpilab-rank-output')?.textContent || '')""",
        arg=4, timeout=15_000)

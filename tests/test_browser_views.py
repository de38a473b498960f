"""What `%mpilab status` and `%mpilab dashboard` show in a real JupyterLab, in a real
browser (Debian's chromium, Playwright), on real ranks: the status table ticks while it
is on screen and shows a killed rank dead within the watchdog's bound; the dashboard
command finds the latest run with metrics after a cell without any; a cell that only
logs scalars gets one panel, its values against their count.

Every wait is on a condition in the page (never a fixed sleep): the machine may be busy.
Screenshots go to build/views_*.png.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_lab import (
    CHROMIUM,
    Lab,
    cell,
    chromium,
    open_notebook,
    run_cell,
    running_lab,
    wait_cell_done,
)

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
# the status table shows a dead rank at its next tick: a local rank's process is checked
# then; a rank the notebook cannot see is "cannot be reached" after the watchdog's 5 s of
# silence. Both within this (a tick is 0.7 s; the browser may be slow to paint)
DEAD_SHOWN_WITHIN_S = 5.0 + 3.0

pytestmark = pytest.mark.timeout(400)

if not CHROMIUM.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} is missing; CI installs it with "
                           "`apt-get install -y chromium`")
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium); browser tests skipped "
                "outside CI", allow_module_level=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[Lab]:
    with running_lab(tmp_path_factory.mktemp("lab-views")) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    with chromium() as running:
        yield running


@pytest.fixture
def page(browser, lab, request):
    BUILD.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        yield page
    finally:
        page.screenshot(path=str(BUILD / f"{request.node.name}-last.png"), full_page=True)
        context.close()
        lab.shutdown_kernels()  # the extension stops the kernel's ranks


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
            "import os, time\n"
            "print('step 0 on rank', rank, flush=True)\n"
            "deadline = time.monotonic() + 90\n"
            f"while not os.path.exists({str(flag)!r}) and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
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

"""Unit tests of the widgets: downsampling, throttling, and figures from a synthetic store."""

from __future__ import annotations

import base64
import json
import queue
import textwrap
import time

import numpy as np
import plotly.graph_objects as go
import pytest
from mpilab.metrics_store import MetricsStore
from mpilab.widgets import (
    Dashboard,
    StatusTable,
    bench_figure,
    bench_table,
    downsample,
    figure_bundle,
    status_text,
)
from mpilab.widgets.dashboard import (
    COMPACT_HEIGHT,
    FULL_HEIGHT,
    MIN_REDRAW_INTERVAL_S,
)
from mpilab.widgets.live_plot import REBASE_SHARE, LivePlot
from mpilab.widgets.plotting import EXACT_POINTS, MAX_POINTS, WIDGET_VIEW_MIME, GrowingSeries

T0 = 1_700_000_000.0


def step_record(rank: int, step: int, *, dur=0.1, compute=0.06, comm=0.03, nbytes=4_000_000,
                samples=32, t=None) -> dict:
    return {"k": "step", "r": rank, "t": T0 + step if t is None else t, "step": step,
            "dur": dur, "compute": compute, "comm": comm, "nbytes": nbytes, "samples": samples}


def log_record(rank: int, step: int, **values) -> dict:
    return {"k": "log", "r": rank, "t": T0 + step, "step": step, "values": values}


def hb_record(rank: int, phase="idle", op="", seq=0, op_age=0.0, step=0) -> dict:
    return {"k": "hb", "r": rank, "t": time.time(), "pid": 100 + rank, "host": "node1",
            "phase": phase, "op": op, "seq": seq, "op_age": op_age, "rss": 300 << 20,
            "dev_mem": 0, "step": step, "cell": 1}


def filled_store(steps: int = 50, world_size: int = 2) -> MetricsStore:
    """Rank 1 is a straggler: it computes twice as long, so rank 0 waits in comm."""
    store = MetricsStore(world_size=world_size)
    for step in range(steps):
        for r in range(world_size):
            slow = r == 1
            store.add(step_record(r, step, dur=0.2 if slow else 0.19,
                                  compute=0.16 if slow else 0.08, comm=0.02 if slow else 0.1))
            store.add(log_record(r, step, loss=1.0 / (step + 1) + r * 0.01, acc=step / steps))
    return store


def _len(values) -> int:
    return 0 if values is None else len(values)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- downsampling -------------------------------------------------------------------------
def test_downsample_keeps_short_series_exact():
    x, y = np.arange(100.0), np.random.default_rng(0).random(100)
    dx, dy = downsample(x, y)
    assert np.array_equal(dx, x) and np.array_equal(dy, y)


@pytest.mark.parametrize("n", [MAX_POINTS + 1, 5_000, 20_001, 100_000])
def test_downsample_bounds_points_and_keeps_newest_exact(n):
    x = np.arange(n, dtype=float)
    y = np.sin(x / 50.0)
    dx, dy = downsample(x, y)
    assert len(dx) == len(dy) <= MAX_POINTS
    assert np.array_equal(dx[-EXACT_POINTS:], x[-EXACT_POINTS:])
    assert np.array_equal(dy[-EXACT_POINTS:], y[-EXACT_POINTS:])
    assert np.all(np.diff(dx) > 0)  # still a function of the step
    assert dx[0] >= x[0] and dx[-1] == x[-1]


def test_downsample_averages_buckets():
    n = 10_000
    x, y = np.arange(n, dtype=float), np.arange(n, dtype=float) * 2
    dx, dy = downsample(x, y, max_points=1000, exact=100)
    # a linear series stays on its line after bucket means
    assert np.allclose(dy, 2 * dx)
    assert dy.min() >= 0 and dy.max() == y[-1]


def test_downsample_old_buckets_are_stable_as_points_arrive():
    rng = np.random.default_rng(1)
    y = rng.random(8_001)
    x = np.arange(len(y), dtype=float)
    a = downsample(x[:-1], y[:-1])
    b = downsample(x, y)
    full_buckets = len(a[0]) - EXACT_POINTS - 1  # all but the partial bucket
    assert np.array_equal(a[1][:full_buckets], b[1][:full_buckets])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_growing_series_downsamples_as_if_drawn_from_scratch(seed):
    """Redraws reuse the bucket means of earlier ones; what they show must not depend
    on how the points arrived (in batches, late values for a step, out of order)."""
    rng = np.random.default_rng(seed)
    series = GrowingSeries(max_points=300, exact=50)
    step, points = 0, {}
    while step < 8_000:
        batch = int(rng.integers(1, 300))
        for s in range(step, step + batch):
            points[s] = [float(rng.random())]
        series.extend(np.arange(step, step + batch), [v[0] for v in points.values()][-batch:])
        step += batch
        for _ in range(int(rng.integers(0, 3))):  # another rank's value for a recent step
            s = int(rng.integers(max(0, step - 80), step))
            value = float(rng.random())
            points[s].append(value)
            series.average_in(s, value)
        expected = downsample(np.array(list(points)), [np.mean(v) for v in points.values()],
                              max_points=300, exact=50)
        shown = series.downsampled()
        assert len(shown[0]) == len(expected[0]) <= 300
        assert np.allclose(shown, expected, rtol=1e-12, atol=0)
    # a value for a step that never had one goes in its place, however old
    series.average_in(10.5, 7.0)
    x, _ = series.downsampled()
    assert np.all(np.diff(x) > 0) and series.n == len(points) + 1


def test_growing_series_keeps_a_bounded_history():
    series = GrowingSeries(max_points=100, exact=10, history=1000)
    for start in range(0, 7000, 70):
        series.extend(np.arange(start, start + 70), np.ones(70))
        series.downsampled()
    assert 500 <= series.n <= 1000 and series.x[-1] == 6999
    assert np.array_equal(series.x, np.arange(7000 - series.n, 7000))
    x, y = series.downsampled()
    assert np.allclose(y, 1) and np.allclose(x, downsample(series.x, series.y, 100, 10)[0])


# -- dashboard ---------------------------------------------------------------------------
def test_dashboard_figures_from_synthetic_store():
    store = filled_store(steps=50)
    dash = Dashboard(store, world_size=2)
    assert dash.has_data()
    assert dash.refresh()
    fig = dash.widget.to_figure()  # what the browser draws
    names = [t.name for t in fig.data]
    assert names[:3] == ["rank 0", "rank 1", "total"]
    assert {"compute", "comm wait", "loss", "acc"} <= set(names)
    by_name = {(t.name, t.xaxis): t for t in fig.data}
    # throughput: samples/s per rank, total = sum over ranks
    r0 = by_name[("rank 0", "x")]
    assert list(r0.x) == list(range(1, 50))  # step 0 is warm-up
    assert r0.y[0] == pytest.approx(32 / 0.19)
    total = by_name[("total", "x")]
    assert total.y[0] == pytest.approx(32 / 0.19 + 32 / 0.2)
    # step split: the straggler computes longer, the other rank waits in comm
    compute, wait = by_name[("compute", "x2")], by_name[("comm wait", "x2")]
    assert compute.y[1] > compute.y[0] and wait.y[0] > wait.y[1]
    assert compute.y[0] + wait.y[0] == pytest.approx(0.19)
    # loss is the mean over ranks at each step
    loss = by_name[("loss", "x3")]
    assert loss.y[0] == pytest.approx(1.0 + 0.005)
    # bandwidth: nbytes / comm time, in GB/s
    bw = [t for t in fig.data if t.xaxis == "x4"]
    assert bw[0].y[0] == pytest.approx(4e6 / 0.1 / 1e9)
    # the static figure shows the same data
    static = dash.static_figure()
    assert isinstance(static, go.Figure) and not isinstance(static, go.FigureWidget)
    assert [_len(t.x) for t in static.data] == [_len(t.x) for t in fig.data]


def test_dashboard_total_waits_for_all_ranks_and_since_hides_old_runs():
    store = MetricsStore(world_size=2)
    store.add(step_record(0, 0, t=T0 - 100))  # a previous run
    for step in (1, 2, 3):
        store.add(step_record(0, step))
    for step in (1, 2):
        store.add(step_record(1, step))
    dash = Dashboard(store, world_size=2, since=T0)
    dash.refresh()
    shown = dash.widget.to_figure()
    total = shown.data[2]
    assert list(total.x) == [2.0]  # step 3: rank 1 has not reported yet
    assert list(shown.data[0].x) == [2.0, 3.0]  # step 1 is the run's warm-up


def test_dashboard_drawn_round_by_round_shows_what_one_draw_would():
    """Each redraw derives only the newly arrived records; the result must be the same as
    drawing the whole run at once, whatever order the ranks' records came in (a rank that
    starts late, a rank's loss for a step the other already logged)."""
    store = MetricsStore(world_size=2)
    live = Dashboard(store, world_size=2)
    rng = np.random.default_rng(3)
    lagging: list[dict] = []
    for start in range(0, 3000, 150):
        for step in range(start, start + 150):
            store.add(step_record(0, step, dur=float(rng.uniform(0.1, 0.2))))
            store.add(log_record(0, step, loss=float(rng.random())))
            lagging += [step_record(1, step, dur=float(rng.uniform(0.1, 0.2))),
                        log_record(1, step, loss=float(rng.random()))]
        if start:  # rank 1's records reach the notebook a round late: it starts late
            for record in lagging[:300]:
                store.add(record)
            del lagging[:300]
        live.refresh(force=True)
    for record in lagging:
        store.add(record)
    live.refresh(force=True)
    at_once = Dashboard(store, world_size=2)
    at_once.refresh()
    shown, expected = live.widget.to_figure(), at_once.widget.to_figure()
    assert [t.name for t in shown.data] == [t.name for t in expected.data]
    for got, want in zip(shown.data, expected.data):
        assert np.allclose(got.x, want.x) and np.allclose(got.y, want.y), got.name
    total = expected.data[2]  # of both ranks, from step 1 (step 0 is warm-up) to 2999
    assert len(total.x) <= MAX_POINTS and total.x[0] < 3 and total.x[-1] == 2999


def test_live_plot_sends_what_changed_and_its_state_draws_the_latest_data():
    """A redraw of a growing, downsampled trace sends only its changed end, a fraction of
    the data; the widget's state, which a view opening at any moment draws, always holds
    the latest data; a new figure starts empty."""
    plot = LivePlot({"data": [{"type": "scatter"}, {"type": "bar"}], "layout": {}})
    sent: list[str] = []
    plot.observe(lambda change: sent.append(change["name"]), names=["series", "tail"])
    series, shares = GrowingSeries(), []
    for start in range(0, 20_000, 50):
        steps = np.arange(start, start + 50, dtype=float)
        series.extend(steps, np.sin(steps / 300))
        x, y = series.downsampled()
        bars = (np.array([0.0, 1.0]), np.array([start, start + 1.0]))
        plot.show({0: (x, y), 1: bars})
        drawn = plot.to_figure()
        assert np.array_equal(drawn.data[0].x, x) and np.array_equal(drawn.data[0].y, y)
        assert list(drawn.data[1].y) == list(bars[1])
        if plot.tail:
            shares.append(sum(len(v) for v in plot.tail["x"]) / 8 / (len(x) + 2))
    assert sent.count("tail") > 10 * sent.count("series"), sent.count("series")
    assert max(shares) <= REBASE_SHARE
    plot.show({}, figure={"data": [{"type": "scatter"}], "layout": {}})
    assert plot.to_figure().data[0].x is None


def test_dashboard_has_data_only_for_step_or_log_records():
    store = MetricsStore(world_size=2)
    dash = Dashboard(store, world_size=2, since=T0)
    store.add(hb_record(0))
    store.add({"k": "span", "r": 0, "t": T0 + 1, "name": "allreduce", "cat": "comm",
               "ts": T0, "dur": 0.1})
    assert not dash.has_data()
    assert not dash.refresh()
    assert dash._widget is None  # no widget (and its 4.6 MB of code) for a cell without metrics
    store.add(log_record(1, 0, loss=2.0))
    assert dash.has_data()
    assert dash.refresh() and dash._widget is not None


def test_dashboard_refresh_is_throttled_and_skips_unchanged_store():
    store = filled_store(steps=5)
    dash = Dashboard(store, world_size=2)
    clock = dash.clock = FakeClock()
    assert dash.refresh() and dash.redraws == 1
    assert not dash.refresh()  # nothing new
    store.add(step_record(0, 5))
    assert not dash.refresh()  # new, but too soon
    clock.now += MIN_REDRAW_INTERVAL_S
    assert dash.refresh() and dash.redraws == 2
    clock.now += 10
    assert not dash.refresh()  # old enough, but nothing new
    assert dash.refresh(force=True) and dash.redraws == 3
    # a flood of records between ticks costs one redraw per interval
    for tick in range(40):  # 40 ticks of 0.1 s = 4 s
        for step in range(100):
            store.add(step_record(1, 1000 + tick * 100 + step))
        dash.refresh()
        clock.now += 0.1
    assert dash.redraws - 3 <= 4 * 4 + 1


def test_dashboard_bounds_points_per_trace():
    store = MetricsStore(world_size=1, max_per_rank=30_000)
    for step in range(10_000):
        store.add(step_record(0, step))
        store.add(log_record(0, step, loss=1.0))
    dash = Dashboard(store, world_size=1)
    dash.refresh()
    shown = dash.widget.to_figure()
    assert max(_len(t.x) for t in shown.data) <= MAX_POINTS
    assert shown.data[0].x[-1] == 9_999


def test_dashboard_mimebundle_has_widget_and_static_fallbacks():
    dash = Dashboard(filled_store(steps=10), world_size=2)
    bundle = dash.mimebundle()
    # the widget shown has the data (but warm-up)
    assert len(dash.widget.to_figure().data[0].x) == 9
    assert bundle[WIDGET_VIEW_MIME]["model_id"] == dash.widget.model_id
    assert bundle[WIDGET_VIEW_MIME]["version_major"] == 2
    assert "cdn.plot.ly" in bundle["text/html"] and "Plotly.newPlot" in bundle["text/html"]
    assert bundle["text/plain"].startswith("mpilab dashboard: 2 ranks, step 9")
    assert "loss" in bundle["text/plain"]
    json.dumps(bundle)  # display(bundle, raw=True) sends it as JSON


def test_dashboard_final_bundle_is_a_static_plot_that_keeps_the_data():
    """An ended run's output must not depend on widget state (a saved notebook, nbconvert)."""
    dash = Dashboard(filled_store(steps=10), world_size=2)
    dash.refresh()
    dash.widget._view_count = 1  # what JupyterLab's widget manager reports
    final = dash.mimebundle(final=True)
    assert WIDGET_VIEW_MIME not in final
    assert set(final) == {"application/vnd.plotly.v1+json", "text/html", "text/plain"}
    x = final["application/vnd.plotly.v1+json"]["data"][0]["x"]  # plotly.js typed array
    assert len(np.frombuffer(base64.b64decode(x["bdata"]), dtype=x["dtype"])) == 9
    assert not dash.refresh(force=True)  # an ended dashboard draws no more


def test_an_ended_runs_widget_is_reused_empty_by_the_next_dashboard():
    """Each new widget costs the browser plotly.js (4.6 MB): reuse them."""
    first = Dashboard(filled_store(steps=10, world_size=3), world_size=3)
    first.refresh()  # adds the traces of its logged scalars, loss and acc
    model_id = first.widget.model_id
    first.mimebundle(final=True)

    store = MetricsStore(world_size=3)
    for r in range(3):
        store.add(step_record(r, 1))
        store.add(step_record(r, 2))
    second = Dashboard(store, world_size=3)
    assert second.widget.model_id == model_id
    emptied = second.widget.to_figure()
    assert len(emptied.data) == len(second._figure_json([])["data"])  # no loss, no acc
    assert all(_len(t.x) == 0 for t in emptied.data if t.type == "scatter")
    second.refresh(force=True)
    # its own run only (step 1 is warm-up)
    assert list(second.widget.to_figure().data[0].x) == [2]
    other = Dashboard(store, world_size=3)  # while the second runs: a widget of its own
    assert other.widget.model_id != model_id


def test_dashboard_refresh_from_a_thread():
    """--noblock cells refresh from the relay thread."""
    import threading

    store = filled_store(steps=5)
    dash = Dashboard(store, world_size=2)
    done = []
    thread = threading.Thread(target=lambda: done.append(dash.refresh()))
    thread.start()
    thread.join()
    assert done == [True] and len(dash.widget.to_figure().data[0].x) == 4


def test_dashboard_command_shows_the_latest_run_with_metrics_and_names_its_cell():
    from mpilab.cell_window import CellWindow
    from mpilab.runner import RecentRun
    from mpilab.session import latest_dashboard

    store = filled_store(steps=20)  # records at T0 .. T0+19
    training = RecentRun("In[3]", CellWindow(T0 - 1))
    printing = RecentRun("In[4]", CellWindow(T0 + 100))  # a later cell with no metrics
    dash = latest_dashboard([training, printing], store, 2)
    assert dash is not None and dash.source == "In[3]"
    assert "from In[3]" in dash.mimebundle(final=True)["text/plain"]
    assert "from In[3]" in dash.static_figure().layout.title.text
    later = RecentRun("In[5]", CellWindow(T0 + 10))  # a later run that has metrics wins
    assert latest_dashboard([training, printing, later], store, 2).source == "In[5]"
    assert latest_dashboard([printing], store, 2) is None
    assert latest_dashboard([], store, 2).source is None  # no cells: every record
    assert latest_dashboard([], MetricsStore(world_size=2), 2) is None


def test_log_only_cell_plots_scalars_against_their_count_in_one_panel():
    """A cell that only calls mpilab.log after a training run logs every value at the
    step where that run stopped: the values are plotted against their count, and only
    the panel that has something to show is drawn."""
    store = MetricsStore(world_size=2)
    for i in range(30):
        for r in range(2):
            record = log_record(r, 300, loss=24.0 - i + r)
            record["t"] = T0 + i
            store.add(record)
    dash = Dashboard(store, world_size=2)
    assert dash.refresh()
    fig = dash.widget.to_figure()
    loss = next(t for t in fig.data if t.name == "loss")
    assert list(loss.x) == list(range(1, 31)) and loss.y[0] == pytest.approx(24.5)
    layout = fig.layout
    assert "without training steps" in layout.xaxis3.title.text
    assert list(layout.xaxis3.domain) == [0, 1] and layout.height < 640
    for axis in ("xaxis", "yaxis", "xaxis2", "yaxis2", "xaxis4", "yaxis4", "yaxis5",
                 "yaxis6"):
        assert layout[axis].visible is False, axis
    shown_titles = [a.text for a in layout.annotations if a.visible is not False]
    assert shown_titles == ["Loss and logged scalars"]
    assert [t.name for t in fig.data if t.showlegend is not False] == ["loss"]
    static = dash.static_figure()
    assert static.layout.xaxis.visible is False and static.layout.xaxis3.visible is not False
    # steps the user gave (increasing) stay the x axis
    store = MetricsStore(world_size=1)
    for i in range(5):
        store.add(log_record(0, 10 * i, acc=i / 5))
    given = Dashboard(store, world_size=1).static_figure()
    assert list(next(t for t in given.data if t.name == "acc").x) == [0, 10, 20, 30, 40]
    assert given.layout.xaxis3.title.text != "value # (logged without training steps)"


def test_quantities_never_take_a_ranks_color():
    from mpilab.widgets.plotting import RANK_COLORS

    fig = Dashboard(filled_store(steps=10, world_size=8), world_size=8).static_figure()
    ranks = {t.line.color for t in fig.data if (t.name or "").startswith("rank ")}
    assert ranks == set(RANK_COLORS[:8])
    quantities = [t.marker.color for t in fig.data if t.type == "bar"]
    quantities += [t.line.color for t in fig.data if t.name in ("loss", "acc")]
    assert len(set(quantities)) == 4 and not set(quantities) & set(RANK_COLORS)


def test_a_training_run_draws_every_panel_that_has_data():
    fig = Dashboard(filled_store(steps=20), world_size=2).static_figure()
    assert all(fig.layout[a].visible is not False for a in ("xaxis", "xaxis2", "xaxis3",
                                                              "xaxis4"))
    store = MetricsStore(world_size=1)  # one rank, no loss: nothing communicated or logged
    for step in range(10):
        store.add(step_record(0, step, comm=0.0, nbytes=0))
    dash = Dashboard(store, world_size=1)
    dash.refresh()
    layout = dash.widget.to_figure().layout
    assert layout.xaxis3.visible is False and layout.xaxis4.visible is False
    assert layout.xaxis.domain[1] < layout.xaxis2.domain[0]  # side by side, one row
    store.add(log_record(0, 10, loss=1.0))  # a panel appears once it has data
    dash.refresh(force=True)
    layout = dash.widget.to_figure().layout
    # three panels keep the grid: compact, expandable to the full height
    assert layout.xaxis3.visible is not False and layout.height == COMPACT_HEIGHT
    assert layout.meta["expanded_height"] == FULL_HEIGHT


def test_per_rank_output_collects_each_ranks_text_throttled_and_marks_failures():
    from mpilab.widgets.rank_output import MAX_CHARS, SNAPSHOT_EVERY_S, RankOutputs

    clock = FakeClock()
    outputs = RankOutputs([0, 1, 2, 3])
    outputs.clock = clock
    sent: list[dict] = []
    outputs.view.send = lambda content, buffers=None: sent.append(content)
    outputs.feed(0, "a\n")
    outputs.feed(2, "x\n")
    # the first update: what arrived, and the state every view starts from
    assert outputs.tick() and sent[-1] == {"seq": 0, "append": {"0": "a\n", "2": "x\n"}}
    assert outputs.view.texts == {"0": "a\n", "1": "", "2": "x\n", "3": ""}
    assert outputs.view.seq == 0
    outputs.feed(0, "b\n")
    assert not outputs.tick()  # too soon after the last send
    clock.now += 0.3
    # only what arrived since; the state is rewritten at most every SNAPSHOT_EVERY_S
    assert outputs.tick() and sent[-1] == {"seq": 1, "append": {"0": "b\n"}}
    assert outputs.view.texts["0"] == "a\n" and outputs.view.seq == 0
    assert not outputs.tick(force=True)  # nothing new
    clock.now += SNAPSHOT_EVERY_S
    outputs.feed(3, "c\n")
    assert outputs.tick() and outputs.view.texts["0"] == "a\nb\n" and outputs.view.seq == 2
    outputs.feed(9, "not a rank of this cell")
    outputs.feed(1, "y" * (MAX_CHARS + 10))
    outputs.feed(1, "z\n")
    outputs.finish([2])
    assert outputs.view.failed == [2] and outputs.view.texts["1"].endswith("z\n")
    assert len(outputs.view.texts["1"]) <= MAX_CHARS and outputs.view.seq == 3
    bundle = outputs.mimebundle()
    assert bundle[WIDGET_VIEW_MIME]["model_id"] == outputs.view.model_id
    assert bundle["text/plain"] == "[per-rank output of ranks 0, 1, 2, 3; failed: 2]"


def test_per_rank_output_shows_each_ranks_line_still_being_written():
    """A bar redrawn in place on a rank: its line as it stands goes with the updates
    (only when it changed), into the state, and away when it ends."""
    from mpilab.widgets.rank_output import RankOutputs

    clock = FakeClock()
    outputs = RankOutputs([0, 1])
    outputs.clock = clock
    sent: list[dict] = []
    outputs.view.send = lambda content, buffers=None: sent.append(content)
    outputs.feed(0, "start\n")
    outputs.set_unfinished({0: "train 10%", 1: ""})
    assert outputs.tick() and sent[-1] == {"seq": 0, "append": {"0": "start\n"},
                                           "tails": {"0": "train 10%"}}
    assert outputs.view.tails == {"0": "train 10%"}
    clock.now += 0.3
    outputs.set_unfinished({0: "train 10%"})
    assert not outputs.tick()  # nothing new
    outputs.set_unfinished({0: "train 50%"})
    assert outputs.tick() and sent[-1] == {"seq": 1, "append": {}, "tails": {"0": "train 50%"}}
    outputs.feed(0, "train 100%\n")
    outputs.set_unfinished({})
    outputs.finish([])
    assert sent[-1] == {"seq": 2, "append": {"0": "train 100%\n"}, "tails": {}}
    assert outputs.view.tails == {} and outputs.view.texts["0"] == "start\ntrain 100%\n"


def test_per_rank_output_of_256_ranks_sends_what_arrived_and_summarises_in_one_line():
    from mpilab.widgets.rank_output import RankOutputs

    outputs = RankOutputs(list(range(256)))
    sent: list[dict] = []
    outputs.view.send = lambda content, buffers=None: sent.append(content)
    for r in range(256):
        outputs.feed(r, f"step 0 on rank {r}\n")
    assert outputs.tick()
    outputs.clock = lambda: time.monotonic() + 1.0
    outputs.feed(17, "loss nan\n")
    assert outputs.tick() and sent[-1]["append"] == {"17": "loss nan\n"}
    outputs.finish([17, 200, 201, 202])
    assert outputs.summary() == ("[per-rank output of ranks 0-255; failed: 17, 200, 201, 202]")


# -- status ------------------------------------------------------------------------------
RANK_INFO = [{"rank": r, "host": "node1", "pid": 100 + r, "device": "cpu", "backend": "gloo"}
             for r in range(3)]


def test_status_text_and_table():
    store = MetricsStore(world_size=3)
    store.add(hb_record(0, phase="collective", op="allreduce", seq=7, op_age=0.25))
    store.add(hb_record(1, phase="running", step=12))
    text = status_text(RANK_INFO, store)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["rank", "host", "pid", "device"]
    assert "in allreduce #7 for 0.2 s" in lines[1] or "in allreduce #7 for 0.3 s" in lines[1]
    assert "300MB" in lines[1] and "cpu (gloo)" in lines[1]
    assert "running (step 12)" in lines[2]
    assert "no heartbeat" in lines[3] and "never" in lines[3]
    table = StatusTable(RANK_INFO, store)
    assert table.widget.value.count("<tr") == 4
    assert "allreduce #7" in table.widget.value
    bundle = table.mimebundle()
    assert bundle[WIDGET_VIEW_MIME]["model_id"] == table.widget.model_id
    assert bundle["text/plain"].splitlines()[0] == lines[0]


def test_status_marks_silent_ranks_unreachable_and_dead_ones_dead():
    store = MetricsStore(world_size=3)
    store.add(hb_record(0))
    store.add(hb_record(1))
    store.last_seen[0] -= 30  # as if the last heartbeat was 30 s ago
    store.last_seen[1] -= 2
    lines = status_text(RANK_INFO, store).splitlines()
    assert "cannot be reached: no heartbeat for 30 s" in lines[1]
    assert "idle" in lines[2] and "(late)" in lines[2]
    table = StatusTable(RANK_INFO, store)
    assert "cannot be reached" in table.widget.value and "#fde0dc" in table.widget.value
    info = [dict(RANK_INFO[0], dead="exit code 9")]
    assert "dead: exit code 9" in status_text(info, store).splitlines()[1]


def test_status_table_ticks_while_in_sight_and_reads_the_ranks_anew():
    store = MetricsStore(world_size=3)
    for r in range(3):
        store.add(hb_record(r))
    dead: dict[int, str] = {}
    stopped = []
    table = StatusTable(lambda: [dict(i, dead=dead.get(i["rank"], ""), stopped=bool(stopped))
                                 for i in RANK_INFO], store)
    table.start(interval_s=0.02)
    try:
        _wait(lambda: table.refreshes >= 3)
        dead[2] = "its process has ended"  # shown at the next tick, not after silence
        _wait(lambda: "dead: its process has ended" in table.widget.value)
        # every view out of sight: the table stops rewriting itself
        table.widget._on_view(table.widget, {"view": "a", "visible": False}, [])
        time.sleep(0.1)
        frozen = table.refreshes
        time.sleep(0.2)
        assert table.refreshes == frozen
        table.widget._on_view(table.widget, {"view": "a", "visible": True}, [])
        _wait(lambda: table.refreshes > frozen)
        stopped.append(True)  # the cluster stopped: one last rewrite, then no more
        _wait(lambda: table.stopped)
        assert ">stopped<" in table.widget.value
        last = table.refreshes
        time.sleep(0.2)
        assert table.refreshes == last
    finally:
        table.stop()


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_live_rank_info_sees_a_dead_process_and_a_stopped_cluster():
    import socket
    import subprocess
    import sys

    from mpilab.cluster import local_processes
    from mpilab.session import live_rank_info

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        class Cluster:
            slurm = None
            ranks = [{"rank": 0, "host": socket.gethostname(), "pid": proc.pid,
                      "device": "cpu"},
                     {"rank": 1, "host": "elsewhere", "pid": 1, "device": "cpu"}]
            dead: dict[int, str] = {}
            output = ""

            @staticmethod
            def local_processes() -> dict:  # as RankCluster makes them at start
                return local_processes(Cluster.ranks)

            @staticmethod
            def engine_output(lines: int = 15) -> str:
                return Cluster.output

        info = live_rank_info(Cluster)
        assert [i["dead"] for i in info()] == ["", ""]
        proc.kill()
        proc.wait()
        assert [i["dead"] for i in info()] == ["its process has ended", ""]
        Cluster.dead = {1: "no heartbeat for 6 s"}
        assert info()[1]["dead"] == "no heartbeat for 6 s"
        Cluster.ranks = []  # stopped
        assert all(i["stopped"] and i["dead"].startswith("stopped") for i in info())
        # ranks in a Slurm job that Slurm ended while no cell ran: its output says why
        Cluster.slurm = "job 8"
        Cluster.ranks, Cluster.dead = [{"rank": r, "host": "node1", "pid": 10 + r,
                                        "device": "cpu"} for r in range(2)], {}
        info = live_rank_info(Cluster)
        assert [i["dead"] for i in info()] == ["", ""]
        Cluster.output = ("slurmstepd: error: *** JOB 8 ON node1 CANCELLED AT "
                          "2026-12-04T18:21:49 ***")
        assert [i["dead"] for i in info()] == ["the Slurm job 8 was cancelled at 18:21:49"] * 2
    finally:
        proc.kill()
        proc.wait()


# -- bench -------------------------------------------------------------------------------
def bench_rows() -> list[dict]:
    rows = []
    for backend, peak in (("mpi", 4.0), ("gloo", 1.5)):
        for size in (4 << 10, 64 << 10, 1 << 20):
            algbw = peak * size / (size + 65536)
            rows.append({"op": "allreduce", "backend": backend, "size_bytes": size,
                         "time_s": size / (algbw * 1e9), "algbw_GBps": algbw,
                         "busbw_GBps": algbw * 2 * (2 - 1) / 2})
    return rows


def test_bench_figure():
    fig = bench_figure(bench_rows(), memcpy_gbps=12.5)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["mpi", "mpi", "gloo", "gloo"]
    assert [t.showlegend for t in lines] == [True, False, True, False]
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"
    assert fig.layout.yaxis.type == "log"
    assert list(fig.layout.xaxis.ticktext) == ["4K", "64K", "1M"]
    ceilings = [t for t in fig.data if t.legendgroup == "memcpy"]
    assert [list(t.y) for t in ceilings] == [[12.5, 12.5]] * 2
    assert list(ceilings[0].x) == [4 << 10, 1 << 20]
    assert ceilings[0].name == "memcpy ceiling 12.5 GB/s"
    assert "allreduce" in fig.layout.title.text
    bundle = figure_bundle(fig)
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/html", "text/plain"}
    json.dumps(bundle)
    assert len(bench_figure(bench_rows()).data) == 4  # no ceiling without a measurement


def test_bench_lists_backends_that_could_not_run():
    rows = bench_rows() + [{"op": "allreduce", "backend": "nccl", "size_bytes": None,
                            "time_s": None, "algbw_GBps": None, "busbw_GBps": None,
                            "note": "no GPU on this node"}]
    fig = bench_figure(rows)
    assert "nccl" not in {t.name for t in fig.data}
    assert "nccl: no GPU on this node" in fig.layout.annotations[-1].text
    lines = bench_table(rows).splitlines()
    assert len(lines) == 1 + 6 + 1 and lines[-1] == "not measured: nccl: no GPU on this node"


def test_bench_table():
    lines = bench_table(bench_rows()).splitlines()
    assert lines[0].split()[:3] == ["op", "backend", "size"]
    assert [line.split()[1:3] for line in lines[1:]] == [
        ["mpi", "4K"], ["mpi", "64K"], ["mpi", "1M"],
        ["gloo", "4K"], ["gloo", "64K"], ["gloo", "1M"]]
    assert len({len(line) for line in lines}) == 1  # aligned


# -- in a real kernel ----------------------------------------------------------------------
def test_widget_updates_from_a_thread_reach_the_frontend():
    """A --noblock cell's relay thread redraws while the kernel is idle: the comm
    messages it sends from that thread must reach the frontend."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        code = textwrap.dedent("""
            import threading, time
            from mpilab.metrics_store import MetricsStore
            from mpilab.widgets import Dashboard
            store = MetricsStore(world_size=1)
            dash = Dashboard(store, world_size=1)
            print(dash.widget.model_id)
            def feed():
                time.sleep(0.5)  # the cell has finished: the kernel is idle
                store.add({"k": "step", "r": 0, "t": time.time(), "step": 1, "dur": 0.1,
                           "compute": 0.05, "comm": 0.05, "nbytes": 8, "samples": 4})
                dash.refresh(force=True)
            threading.Thread(target=feed).start()
        """)
        kc.execute(code)
        model_id, updates = None, []  # comm ids of the widget updates seen
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and model_id not in updates:
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            content = msg["content"]
            if msg["msg_type"] == "error":
                pytest.fail("\n".join(content["traceback"]))
            if msg["msg_type"] == "stream" and model_id is None:
                model_id = content["text"].strip()
            if (msg["msg_type"] == "comm_msg"
                    and content["data"].get("state", {}).get("series")):
                updates.append(content["comm_id"])
        assert model_id in updates, "no widget update arrived from the thread"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_executed_notebook_and_its_html_keep_a_static_plot(tmp_path):
    """nbclient has no widget frontend: the runner's final update_display must leave a
    plot that nbconvert's HTML shows (not a widget view that needs a live kernel)."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    code = textwrap.dedent("""
        import time
        from mpilab.metrics_store import MetricsStore
        from mpilab.widgets import Dashboard
        store = MetricsStore(world_size=2)
        dash = Dashboard(store, world_size=2)
        handle = None
        for step in range(20):
            for r in range(2):
                store.add({"k": "step", "r": r, "t": time.time(), "step": step, "dur": 0.1,
                           "compute": 0.08, "comm": 0.03, "nbytes": 1000, "samples": 8})
            if handle is None and dash.has_data():
                handle = display(dash.mimebundle(), raw=True, display_id=True)
            dash.refresh()
        dash.refresh(force=True)
        handle.update(dash.mimebundle(final=True), raw=True)
    """)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code)]
    NotebookClient(nb, timeout=120, kernel_name="python3", store_widget_state=False).execute()
    (output,) = nb.cells[0].outputs
    assert WIDGET_VIEW_MIME not in output["data"]
    assert output["data"]["text/plain"].startswith("mpilab dashboard: 2 ranks, step 19")
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert "cdn.plot.ly" in html and "Plotly.newPlot" in html


def _busy(seconds: float) -> None:
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass


def test_dashboard_spaces_out_expensive_redraws(monkeypatch):
    """Drawing must stay a small share of the kernel's CPU, however dear a redraw gets;
    a redraw that only took long (preempted by the ranks) must not delay the next."""
    store = filled_store(steps=5)
    dash = Dashboard(store, world_size=2)
    clock = dash.clock = FakeClock()
    dash.widget  # noqa: B018 - made up front, as the first display does
    monkeypatch.setattr(dash, "_draw", lambda *args: time.sleep(0.05))
    assert dash.refresh()
    store.add(step_record(0, 5))
    clock.now += MIN_REDRAW_INTERVAL_S
    assert dash.refresh()  # 50 ms of waiting, no CPU: the next round draws as usual
    monkeypatch.setattr(dash, "_draw", lambda *args: _busy(0.05))
    store.add(step_record(0, 6))
    clock.now += MIN_REDRAW_INTERVAL_S
    assert dash.refresh()
    store.add(step_record(0, 7))
    clock.now += MIN_REDRAW_INTERVAL_S
    assert not dash.refresh()  # a redraw of 50 ms of CPU waits at least 10x that
    assert dash._min_interval >= 10 * 0.05
    clock.now += 5
    assert dash.refresh()


def test_a_shown_dashboard_follows_the_store_until_its_run_ends():
    """Shown, the dashboard redraws on the receiver's rounds; ended, it stops listening."""
    store = filled_store(steps=5)
    dash = Dashboard(store, world_size=2)
    clock = dash.clock = FakeClock()
    dash.mimebundle()
    assert dash.refresh in store._listeners
    drawn = dash.redraws
    store.add(step_record(0, 5))
    clock.now += MIN_REDRAW_INTERVAL_S
    store.notify()  # what the receiver does after a round
    assert dash.redraws == drawn + 1
    store.add(hb_record(0))
    clock.now += MIN_REDRAW_INTERVAL_S
    store.notify()  # a round of heartbeats only: nothing to draw
    assert dash.redraws == drawn + 1
    dash.mimebundle(final=True)
    assert store._listeners == []


def test_a_cell_whose_records_came_after_its_last_tick_still_gets_its_dashboard(monkeypatch):
    """A quick training cell: no tick found its records, they arrived while the cell
    ended. Its final plot is shown all the same (in a saved or exported notebook too)."""
    import mpilab.live as live

    shown = []
    monkeypatch.setattr(live, "display", lambda bundle, **kw: shown.append(bundle))
    store = MetricsStore(world_size=2)
    views = live.LiveViews(store, 2, True, {0: "a", 1: "b"})
    views.tick()
    assert shown == []  # nothing logged yet
    for rank, msg in ((0, "a"), (1, "b")):
        store.add({"k": "event", "r": rank, "t": time.time(), "what": "cell-start",
                   "cell": 1, "msg": msg})
    for step in range(3):
        store.add({**log_record(0, step, loss=1.0 / (step + 1)), "t": time.time()})
    for rank, msg in ((0, "a"), (1, "b")):
        store.add({"k": "event", "r": rank, "t": time.time(), "what": "cell-end",
                   "cell": 1, "msg": msg})
    views.finish([0, 1])
    assert len(shown) == 1 and "text/html" in shown[0], shown  # the static plot


# -- views at scale: pure logic ----------------------------------------------------------
def test_ema_is_debiased_and_skips_gaps():
    from mpilab.widgets.plotting import ema

    assert list(ema([5.0, 5.0, 5.0], 0.9)) == pytest.approx([5.0, 5.0, 5.0])  # no pull to 0
    smooth = ema([0.0, 10.0] * 50, 0.85)
    assert np.ptp(smooth[-20:]) < 3 and smooth[-1] == pytest.approx(5.0, abs=1.5)
    gap = ema([1.0, float("nan"), 3.0], 0.5)
    assert gap[1] == gap[0] == 1.0 and 1.0 < gap[2] < 3.0


def test_smoothed_traces_are_drawn_over_faint_raw_ones():
    from mpilab.widgets.plotting import ema

    dash = Dashboard(filled_store(steps=50), world_size=2)
    dash.refresh()
    fig = dash.widget.to_figure()
    smooth = [t for t in fig.data if isinstance(t.meta, dict) and "smooth_of" in t.meta]
    # every rank's throughput and bandwidth, the total, the two scalars
    assert sorted(t.name for t in smooth) == ["acc", "loss", "rank 0", "rank 0", "rank 1",
                                              "rank 1", "total"]
    for trace in smooth:
        raw = fig.data[trace.meta["smooth_of"]]
        assert raw.name == trace.name and raw.opacity < 1 and trace.opacity is None
        assert np.array_equal(raw.x, trace.x) and np.allclose(trace.y, ema(raw.y))
    # the static figure draws the same smoothed lines
    static = dash.static_figure()
    for got, want in zip(static.data, fig.data):
        assert np.allclose(_arr(got.y), _arr(want.y), equal_nan=True), got.name


def _arr(values) -> np.ndarray:
    return np.asarray([] if values is None else values, dtype=float)


def test_step_band_has_median_and_extremes_once_every_rank_reported():
    from mpilab.widgets.plotting import StepBand

    band = StepBand()
    band.add([0, 0], [1, 2], [10.0, 10.0], world=3)
    band.add([1], [1], [20.0], world=3)
    assert band.median.n == 0  # rank 2 has not reported step 1
    band.add([2, 2], [1, 2], [90.0, 30.0], world=3)
    assert list(band.median.x) == [1] and list(band.median.y) == [20.0]
    assert list(band.low.y) == [10.0] and list(band.high.y) == [90.0]
    assert list(band.total.y) == [120.0]  # the ranks' sum: the run's samples/s
    band.add([1, 1], [1, 2], [0.0, 20.0], world=3)  # a second report of step 1 is late
    assert list(band.median.y) == [20.0, 20.0] and list(band.high.y) == [90.0, 30.0]
    band.add([0, 1, 2, 0], [3, 3, 3, 3], [1.0, 2.0, 3.0, 9.0], world=3)  # one step once
    assert list(band.median.x) == [1, 2, 3] and list(band.total.y) == [120.0, 60.0, 6.0]


def test_past_16_ranks_the_dashboard_draws_a_band_and_names_the_slowest_ranks():
    from mpilab.widgets.dashboard import slowest_ranks

    store = MetricsStore(world_size=64)
    for step in range(30):
        for r in range(64):  # ranks 5 and 40 compute longest; the others wait for them
            compute = {5: 0.2, 40: 0.15}.get(r, 0.1)
            store.add(step_record(r, step, dur=0.21, compute=compute, comm=0.21 - compute,
                                  samples=32 + r % 3))
    dash = Dashboard(store, world_size=64)
    dash.refresh()
    fig = dash.widget.to_figure()
    names = [t.name for t in fig.data]
    assert not any(n.startswith("rank ") for n in names) and len(fig.data) < 20
    low, high, median = fig.data[0], fig.data[1], fig.data[2]
    assert high.fill == "tonexty" and median.name == "median rank"
    assert list(low.y[:1]) == [32 / 0.21] and list(high.y[:1]) == [pytest.approx(34 / 0.21)]
    assert median.y[0] == pytest.approx(33 / 0.21)
    assert dash.widget.notes.startswith("slowest ranks: rank 5 (200 ms), rank 40 (150 ms);")
    bars = [t for t in fig.data if t.type == "bar"]
    assert list(bars[0].y) == pytest.approx([0.1, 0.2, 0.15, 0.1])  # median, slowest 3
    assert "rank 5 (200 ms)" in dash.static_figure().layout.title.text
    assert slowest_ranks({0: (0.1, 0.0), 1: (0.3, 0.0), 2: (0.2, 0.0)}, 2) == [(1, 0.3),
                                                                                 (2, 0.2)]
    # 16 ranks keep a line each
    assert [t.name for t in Dashboard(filled_store(5, 16), 16).static_figure().data][:2] == \
        ["rank 0", "rank 1"]


def test_status_past_32_ranks_is_a_summary_with_the_outliers_and_the_full_table_folded():
    from mpilab.widgets.status import status_rows, status_summary, summary_lines

    store = MetricsStore(world_size=64)
    for r in range(64):
        if r == 20:
            continue  # never sent a heartbeat
        record = hb_record(r, phase="running", step=90 if r in (5, 9) else 100)
        record["host"] = f"node{r // 8}"
        if r == 7:
            record["rss"] = 2 << 30
        store.add(record)
    store.last_seen[33] -= 3  # late
    info = [{"rank": r, "host": f"node{r // 8}", "pid": 100 + r, "device": "cpu",
             "dead": "exit code 9" if r == 3 else ""} for r in range(64)]
    summary = status_summary(status_rows(info, store), dict(store.heartbeats),
                             store.heartbeat_ages())
    assert summary.states == {"running": 62, "dead": 1, "no heartbeat": 1}
    assert summary.hosts["node0"] == {"running": 7, "dead": 1}
    outliers = [(kind, r) for kind, r, _ in summary.outliers]
    assert outliers == [("dead", 3), ("silent", 20), ("silent", 33), ("slowest", 5),
                        ("slowest", 9), ("most memory", 7)]
    lines = summary_lines(summary)
    assert lines[0] == "64 ranks on 8 hosts: 62 running, 1 dead, 1 no heartbeat"
    assert "slowest: rank 5 (at step 90, others up to 100), rank 9" in "\n".join(lines)
    table = StatusTable(info, store)
    assert "mpilab-status-summary" in table.widget.value
    assert "<table class='mpilab-status'" not in table.widget.value  # folded
    assert table.widget.table.count("<tr") == 65 and "64 ranks" in table.widget.table_label
    text = status_text(info, store)
    assert text.startswith(lines[0]) and "rank  host" in text
    # 32 ranks: the table as it is
    small = StatusTable([dict(i) for i in info[:32]], store)
    assert small.widget.value.count("<tr") == 33 and small.widget.table == ""

"""The live training dashboard: throughput, step-time split, loss and bandwidth.

A plotly figure fed from the MetricsStore, live in a LivePlot widget. While it is shown
it follows the store: it redraws as each round of records arrives (the ranks send 4
rounds a second, together), at most ~4 times a second and only when the run logged
something new, and each trace is downsampled so a long run stays cheap to draw.
When the run ends its output becomes a static plot and the widget is kept for the next
run's dashboard: each new widget sends plotly.js (4.6 MB) to the browser.
"""

from __future__ import annotations

import collections
import copy
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from mpilab.cell_window import CellWindow
from mpilab.wire import TABLES
from plotly.subplots import make_subplots

from .live_plot import REDRAW_BUDGET, LivePlot
from .plotting import (
    RAW_OPACITY,
    SMOOTH_WEIGHT,
    WIDGET_VIEW_MIME,
    GrowingSeries,
    StepBand,
    figure_bundle,
    figure_html,
    quantity_color,
    rank_color,
    smoothed_traces,
)

# at most ~4 redraws a second whatever the record rate; a little under the ranks' send
# interval (0.25 s), as rounds arrive a few ms early or late
MIN_REDRAW_INTERVAL_S = 0.23  # and at least REDRAW_BUDGET times a redraw's own duration
SPLIT_WINDOW = 20  # the step-time bars average this many recent steps per rank
# A step's time is compute plus the communication it waited for (the rest overlapped
# with backward); the stack is the step time, and a straggler's peers wait longest.
# greys, as no rank is drawn in them (RANK_COLORS): comm wait, the dark part, stands out
SPLIT_PARTS = (("compute", "#c7c7c7"), ("comm wait", "#252525"))
Series = tuple[np.ndarray, np.ndarray]
# the panels, in the order of the 2x2 grid: (x axis, y axis) and the subplot title's index
PANELS = ("throughput", "split", "scalars", "bandwidth")
_PANEL_AXES = {"throughput": ("xaxis", "yaxis"), "split": ("xaxis2", "yaxis2"),
               "scalars": ("xaxis3", "yaxis3"), "bandwidth": ("xaxis4", "yaxis4")}
# px: two rows of panels, or one. A figure is drawn compact (the cell's printed output
# goes on under it, and stays near) and a button expands it
FULL_HEIGHT, ROW_HEIGHT = 640, 380
COMPACT_HEIGHT, COMPACT_ROW_HEIGHT = 440, 300
# past this many ranks the per-rank panels show the ranks as a band (median, min-max),
# the slowest ranks named, instead of a line per rank
BAND_ABOVE_RANKS = 16
SLOWEST_NAMED = 3  # the slowest ranks named (and shown in the step-time bars) in a band
# ... named when they compute at least this much longer than the median rank
STRAGGLER_SHARE = 1.05
_BASE_FIGURES: dict[int, dict] = {}  # world size -> the empty dashboard, as plotly JSON
# world size -> widgets whose run ended (no output shows them any more), for reuse
_SPARE_WIDGETS: dict[int, list[LivePlot]] = defaultdict(list)
_SPARE_LOCK = threading.Lock()


COMM_SCALARS = frozenset({"bytes_sent", "compression_ratio"})  # what strategies log
STEP_COLUMNS = ("step", "dur", "comm", "compute", "nbytes", "samples")
# where they are in the store's rows of steps, and a log row's step and value
_STEP_INDEX = [TABLES["step"].columns.index(column) for column in STEP_COLUMNS]
_LOG_INDEX = [TABLES["log"].columns.index(column) for column in ("step", "value")]


@dataclass
class _NewSteps:
    """A round's step rows of all ranks, worked out at once: per row its step, samples/s
    (`shown` where it counts: a positive duration, not a run's warm-up step), GB/s
    (where `moving`: a step that sent bytes), compute time and duration."""

    steps: np.ndarray
    rates: np.ndarray
    shown: np.ndarray
    gbps: np.ndarray
    moving: np.ndarray
    compute: np.ndarray
    dur: np.ndarray


class _RankSteps:
    """One rank's step records, as the plots use them."""

    def __init__(self):
        self.rows = 0
        self.first: Series | None = None  # its first step (warm-up): shown while alone
        self.throughput = GrowingSeries()  # step -> samples/s
        self.bandwidth = GrowingSeries()  # step -> GB/s
        # the recent steps' compute times and durations
        self.recent_compute: collections.deque = collections.deque(maxlen=SPLIT_WINDOW)
        self.recent_dur: collections.deque = collections.deque(maxlen=SPLIT_WINDOW)

    def add(self, new: _NewSteps, part: slice) -> None:
        """This rank's rows of a round (`part` of them)."""
        steps, shown, moving = new.steps[part], new.shown[part], new.moving[part]
        self.rows += len(steps)
        self.throughput.extend(steps[shown], new.rates[part][shown])
        self.bandwidth.extend(steps[moving], new.gbps[part][moving])
        self.recent_compute.extend(new.compute[part][-SPLIT_WINDOW:].tolist())
        self.recent_dur.extend(new.dur[part][-SPLIT_WINDOW:].tolist())

    def shown_throughput(self) -> Series:
        if self.rows == 1 and self.first is not None:
            return self.first
        return self.throughput.downsampled()

    def split(self) -> tuple[float, float]:
        """Mean compute time and mean wait for communication over the recent steps."""
        n = len(self.recent_dur)
        compute = sum(self.recent_compute) / n
        return compute, max(sum(self.recent_dur) / n - compute, 0.0)


class _RunLog:
    """The plots' data, derived from each of the run's step and log records once, as it
    arrives: a redraw late in a long run costs what arrived since the last one."""

    def __init__(self, cell: CellWindow, band: bool = False):
        self.cell = cell
        # ranks as a band: their throughput and bandwidth as median and min-max per step;
        # the throughput's band also sums the ranks (the total), band or not
        self.band = band
        self.throughput_band = StepBand()
        self.bandwidth_band = StepBand()
        self.position: dict[str, dict] = {"step": {}, "log": {}}  # the store's rows taken
        self.ranks: dict[int, _RankSteps] = {}
        self.scalars: dict[str, GrowingSeries] = {}  # name -> mean over ranks per step
        # the same scalars against how many values of each a rank has logged (mean over
        # ranks per count): a cell that logs without training steps logs every value at
        # one step (the rank's step counter stays where the last training left it)
        self.counted: dict[str, GrowingSeries] = {}
        self._logged: dict[tuple[int, str], tuple[int, float]] = {}  # -> (count, last step)
        self._steps_repeat = False  # a rank logged a scalar twice at a step (or went back)
        self.last_step: int | None = None
        self._lock = threading.Lock()

    @property
    def total(self) -> GrowingSeries:
        """samples/s summed over the ranks, at the steps every rank has reported."""
        return self.throughput_band.total

    def update(self, store) -> int:
        """Take the rows that arrived since the last call; how many were the run's."""
        with self._lock:  # the receiver's thread and a final display may both read
            window = self.cell.bounds(store)
            taken = self._add_steps(store.new_rows("step", self.position["step"],
                                                   window=window))
            return taken + self._add_logs(
                store.new_rows("log", self.position["log"], window=window))

    def _add_steps(self, batches: list[tuple[int, tuple, np.ndarray]]) -> int:
        """The ranks' new steps: the arithmetic over all of their rows at once (1,024
        ranks' rows every redraw), then each rank's series and the steps every rank has
        reported into the bands."""
        if not batches:
            return 0
        # ranks new to the run join the bands together: one rebuild, not one per rank
        joined = [rank for rank, _, _ in batches if rank not in self.ranks]
        for rank in joined:
            self.ranks[rank] = _RankSteps()
        rows = np.concatenate([rows for _, _, rows in batches])[:, _STEP_INDEX]
        steps, dur, comm, compute, nbytes, samples = rows.T
        shown = dur > 0
        rates = np.divide(samples, dur, out=np.zeros(len(dur)), where=shown)
        moving = (comm > 0) & (nbytes > 0)
        gbps = np.divide(nbytes, comm, out=np.zeros(len(dur)), where=moving) / 1e9
        new = _NewSteps(steps, rates, shown, gbps, moving, compute, dur)
        owner = np.empty(len(rows), dtype=np.int64)
        start = 0
        for rank, _, part in batches:
            end = start + len(part)
            owner[start:end] = rank
            one = self.ranks[rank]
            if one.rows == 0:  # a run's first step is warm-up: it would dwarf the rest
                if shown[start]:
                    one.first = (steps[start:start + 1].copy(), rates[start:start + 1].copy())
                shown[start] = False
            one.add(new, slice(start, end))
            start = end
        if joined:
            self._rebuild_bands()
        else:
            self.throughput_band.add(owner[shown], steps[shown], rates[shown], len(self.ranks))
            if self.band:
                self.bandwidth_band.add(owner[moving], steps[moving], gbps[moving],
                                        len(self.ranks))
        self._saw(int(steps.max()))
        return len(rows)

    def snapshot(self) -> _Snapshot:
        """The plots' data, downsampled."""
        with self._lock:
            split = {r: steps.split() for r, steps in self.ranks.items()}
            if self.band:  # no line per rank: their series are not downsampled
                throughput, bandwidth = {}, {}
                bands = {"throughput": self.throughput_band.downsampled(),
                         "bandwidth": self.bandwidth_band.downsampled()}
                if not self.throughput_band.median.n:  # the first steps, before a median
                    bands["throughput"] = (_EMPTY,) * 2 + (_first_steps(self.ranks),)
            else:
                throughput = {r: steps.shown_throughput() for r, steps in self.ranks.items()}
                bandwidth = {r: steps.bandwidth.downsampled() for r, steps in self.ranks.items()}
                bands = {}
            return _Snapshot(
                throughput=throughput,
                total=self.total.downsampled(),
                split=split,
                bandwidth=bandwidth,
                bands=bands,
                slowest=slowest_ranks(split),
                scalars={name: series.downsampled() for name, series in self.by().items()},
                scalars_by="count" if self.by() is self.counted else "step",
                last_step=self.last_step)

    def by(self) -> dict[str, GrowingSeries]:
        """The scalars against their step, or against their count when the run has no
        training steps and its steps do not tell the values apart."""
        return self.counted if self._steps_repeat and not self.ranks else self.scalars

    def _rebuild_bands(self) -> None:
        """The bands (and the total) again from every rank's series: a rank joined, and
        the steps count once every rank of the run has reported them."""
        self.throughput_band = _band_of({r: s.throughput for r, s in self.ranks.items()})
        self.bandwidth_band = (_band_of({r: s.bandwidth for r, s in self.ranks.items()})
                               if self.band else StepBand())

    def _add_logs(self, logs: list[tuple[int, tuple, np.ndarray]]) -> int:
        """A scalar's point at a step (or count) is the mean of the values the ranks
        logged there."""
        by_step: dict[str, list[np.ndarray]] = defaultdict(list)  # (step, value) rows
        by_count: dict[str, list[np.ndarray]] = defaultdict(list)  # (count, value) rows
        counting = not self.ranks  # a run with training steps shows scalars by step
        for rank, (name,), rows in logs:
            step_values = rows[:, _LOG_INDEX]
            by_step[name].append(step_values)
            if not counting:
                continue
            steps, values = step_values.T
            count, last = self._logged.get((rank, name), (0, -np.inf))
            if len(steps) and (steps[0] <= last or np.any(np.diff(steps) <= 0)):
                self._steps_repeat = True
            self._logged[(rank, name)] = (count + len(steps), steps[-1] if len(steps) else last)
            counts = np.arange(count + 1, count + len(steps) + 1, dtype=float)
            by_count[name].append(np.column_stack([counts, values]))
        taken = 0
        for name, parts in by_step.items():
            rows = np.concatenate(parts)
            taken += len(rows)
            _average_into(self.scalars, name, rows)
            self._saw(int(rows[:, 0].max()))
        for name, parts in by_count.items():
            _average_into(self.counted, name, np.concatenate(parts))
        return taken

    def _saw(self, step: int) -> None:
        self.last_step = step if self.last_step is None else max(self.last_step, step)


def _band_of(series: dict[int, GrowingSeries]) -> StepBand:
    """A band of every rank's whole series (rank -> its series)."""
    band = StepBand()
    band.add(np.concatenate([np.full(one.n, rank) for rank, one in series.items()]),
             np.concatenate([one.x for one in series.values()]),
             np.concatenate([one.y for one in series.values()]), len(series))
    return band


_EMPTY: Series = (np.empty(0), np.empty(0))


def _first_steps(ranks: dict[int, _RankSteps]) -> Series:
    """Each rank's first step alone (warm-up, left out of the band), as points."""
    firsts = [steps.first for steps in ranks.values() if steps.first is not None]
    if not firsts:
        return _EMPTY
    x = np.concatenate([f[0] for f in firsts])
    y = np.concatenate([f[1] for f in firsts])
    order = np.argsort(x, kind="stable")
    return x[order], y[order]


def slowest_ranks(split: dict[int, tuple[float, float]],
                  count: int = SLOWEST_NAMED) -> list[tuple[int, float]]:
    """The `count` ranks that compute longest per step (mean of their recent steps), as
    (rank, seconds), slowest first. In synchronous data parallelism every rank's step
    takes as long as the slowest rank's: step times and throughput are the same on all
    ranks, and a straggler shows as the rank that computes longest while its peers wait
    for it in communication."""
    ranks = np.fromiter(split, dtype=np.int64, count=len(split))
    compute = np.fromiter((c for c, _ in split.values()), dtype=float, count=len(split))
    slowest = np.lexsort((ranks, -compute))[:count]  # by compute, then by rank
    return list(zip(ranks[slowest].tolist(), compute[slowest].tolist()))


def _panels_with_data(snap: _Snapshot) -> tuple[str, ...]:
    """The panels that have something to show, in PANELS order."""
    bands = snap.bands
    has = {"throughput": any(len(x) for x, _ in snap.throughput.values())
           or any(len(x) for x, _ in bands.get("throughput", ())),
           "split": bool(snap.split),
           "scalars": any(len(x) for x, _ in snap.scalars.values()),
           "bandwidth": any(len(x) for x, _ in snap.bandwidth.values())
           or any(len(x) for x, _ in bands.get("bandwidth", ()))}
    return tuple(p for p in PANELS if has[p])


def _arrange(figure: dict, panels: tuple[str, ...], world_size: int, comm_axis: bool) -> None:
    """Lay out the 2x2 dashboard (plotly JSON, in place) with only `panels`: the others'
    axes, titles and legend entries go; one or two panels share one shorter row, three
    or four keep the grid (a missing one leaves its place empty)."""
    layout = figure["layout"]
    hidden = [p for p in PANELS if p not in panels]
    titles = layout.get("annotations", [])[:len(PANELS)]  # the subplot titles, in order
    row = len(panels) <= 2
    layout["height"] = COMPACT_ROW_HEIGHT if row else COMPACT_HEIGHT
    layout["meta"] = {"expanded_height": ROW_HEIGHT if row else FULL_HEIGHT}
    if row:
        width = 1.0 if len(panels) == 1 else 0.45
        for i, panel in enumerate(panels):
            x_axis, y_axis = _PANEL_AXES[panel]
            left = i * (1 - width) if len(panels) == 2 else 0.0
            layout[x_axis]["domain"] = [left, left + width]
            layout[y_axis]["domain"] = [0.0, 1.0]
            title = titles[PANELS.index(panel)]
            title["x"], title["y"] = left + width / 2, 1.0
    for panel in hidden:
        for axis in _PANEL_AXES[panel]:
            layout[axis]["visible"] = False
        titles[PANELS.index(panel)]["visible"] = False
    if "scalars" in hidden or not comm_axis:
        layout["yaxis5"]["visible"] = False
    if "throughput" in hidden:
        layout["yaxis6"]["visible"] = False
    if not row and "scalars" in panels:  # the loss panel's title sits where it would be
        layout["xaxis"].pop("title", None)
    hidden_axes = {_PANEL_AXES[p][0].replace("axis", "") for p in hidden}  # "x", "x2"
    for trace in figure["data"]:  # the throughput traces carry the ranks' legend entries
        if trace.get("xaxis", "x") in hidden_axes:
            trace["showlegend"] = False


def _average_into(series_of: dict[str, GrowingSeries], name: str, rows: np.ndarray) -> None:
    """(x, value) rows into the series `name`: the mean of the values at each x."""
    xs, values = rows.T
    xs, index = np.unique(xs, return_inverse=True)
    totals, counts = np.bincount(index, weights=values), np.bincount(index)
    series = series_of.get(name)
    if series is None:
        series = series_of[name] = GrowingSeries()
    last = series.x[-1] if series.n else -np.inf
    late = xs <= last  # a rank's late value for a point already drawn
    for x, total, count in zip(xs[late], totals[late], counts[late]):
        series.average_in(x, total, count)
    new = ~late
    series.extend(xs[new], totals[new] / counts[new], counts[new])


@dataclass
class _Snapshot:
    """What the figure shows, downsampled."""

    throughput: dict[int, Series] = field(default_factory=dict)
    total: Series = (np.empty(0), np.empty(0))
    split: dict[int, tuple[float, float]] = field(default_factory=dict)  # compute, comm wait
    bandwidth: dict[int, Series] = field(default_factory=dict)
    # past BAND_ABOVE_RANKS ranks: panel -> (low, high, median) series over the ranks
    bands: dict[str, tuple[Series, Series, Series]] = field(default_factory=dict)
    slowest: list[tuple[int, float]] = field(default_factory=list)  # (rank, compute s)
    scalars: dict[str, Series] = field(default_factory=dict)
    scalars_by: str = "step"  # or "count": logged without training steps
    last_step: int | None = None


class Dashboard:
    """Live plots of a training run, read from a MetricsStore.

    `since` (epoch seconds) hides the records of earlier runs; a `cell` window shows
    one cell's records (it may have waited behind a --noblock one); `source` names
    that cell ("In[5]") in the title and the summary. Display it with
    `display(dash.mimebundle(), raw=True)` or just `dash` in a cell.
    """

    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, store, world_size: int, since: float = 0.0,
                 cell: CellWindow | None = None, source: str | None = None):
        self.store = store
        self.source = source
        self.world_size = world_size
        self.band = world_size > BAND_ABOVE_RANKS
        # traces per rank-wise panel (throughput, bandwidth): one per rank, or a band's
        # low, high and median
        self._lines = 3 if self.band else world_size
        self.cell = cell or CellWindow(since)
        self.redraws = 0
        self._min_interval = MIN_REDRAW_INTERVAL_S
        self._runlog = _RunLog(self.cell, band=self.band)
        self._drawn_version = -1
        self._drawn_at = -float("inf")
        self._lock = threading.Lock()
        self._has_data = False
        self._checked_version = -1
        self._shown_scalars: list[str] = []  # the logged scalars the widget has traces for
        self._shown_layout: tuple = ()  # (panels, scalars_by) the widget's figure has
        self._panels: tuple[str, ...] = ()  # the panels that had data: they stay
        self._widget: LivePlot | None = None
        self._widget_lock = threading.Lock()
        self._ended = False
        self._following = False

    @property
    def widget(self) -> LivePlot:
        """The live widget, taken on first use: each new one sends plotly.js to the
        frontend, and most cells a dashboard watches never log a metric. A widget an
        ended run gave back is emptied and reused."""
        with self._widget_lock:  # the relay thread and the user may both ask first
            if self._widget is None:
                with _SPARE_LOCK:
                    spare = _SPARE_WIDGETS[self.world_size]
                    widget = spare.pop() if spare else None
                if widget is None:
                    widget = LivePlot(self._figure_json([]))
                else:
                    widget.show({}, figure=self._figure_json([]))
                self._widget = widget
        return self._widget

    # -- what the runner calls ----------------------------------------------------------
    def refresh(self, force: bool = False) -> bool:
        """Redraw if the run logged something new and the last redraw is old enough.

        Cheap when there is nothing to do, so it can be called on every relay tick and
        every round of records; safe from any thread.
        """
        if self._ended:
            return False  # the widget belongs to a later run now
        version = self.store.version
        now = self.clock()
        if not force and (version == self._drawn_version
                          or now - self._drawn_at < self._min_interval):
            return False
        if not self.has_data():
            return False
        if not self._lock.acquire(blocking=False):
            return False  # another thread is drawing this very moment
        try:
            widget = self.widget  # made once (there is data); not a redraw's cost
            started = time.thread_time()
            # heartbeats change the store's version too: they are not worth a redraw
            if not self._runlog.update(self.store) and not force:
                self._drawn_version = version
                return False
            self._drawn_version, self._drawn_at = version, now
            self._draw(widget, self._runlog.snapshot())  # updated just above
            self.redraws += 1
            # a redraw (taking the new rows, then drawing) takes at most 1/REDRAW_BUDGET
            # of a core (the ranks may share the kernel's cores) however dear it gets
            # (many ranks or scalars, a slow host). CPU time: a redraw the ranks
            # preempted cost no more, and spacing the next ones would only delay the data
            cost = time.thread_time() - started
            self._min_interval = max(MIN_REDRAW_INTERVAL_S, REDRAW_BUDGET * cost)
        finally:
            self._lock.release()
        return True

    def follow(self) -> None:
        """Redraw on the record receiver's thread as rounds of records arrive: the data
        is in the widget a few ms after it reaches the notebook, with no polling."""
        with self._widget_lock:
            if self._following or self._ended:
                return
            self._following = True
        self.store.subscribe(self.refresh)

    def unfollow(self) -> None:
        with self._widget_lock:
            following, self._following = self._following, False
        if following:
            self.store.unsubscribe(self.refresh)

    def has_data(self) -> bool:
        """True once the run has sent any step or log record (then the runner displays it)."""
        version = self.store.version
        if not self._has_data and version != self._checked_version:  # called every tick
            self._checked_version = version
            self._has_data = self.store.has_rows(("step", "log"), self.cell.bounds(self.store))
        return self._has_data

    def static_figure(self) -> go.Figure:
        """The same plots as a plain Figure, for frontends without widgets."""
        return self._static(self._snapshot())

    def mimebundle(self, final: bool = False) -> dict:
        """One bundle: the live widget for JupyterLab, a static plot and text for the rest.

        nbconvert and nbclient have no widget frontend; they fall back to the HTML
        (plotly.js from the CDN), so executed notebooks keep their plots. With `final`
        (the run is over) the bundle is a static plot, which JupyterLab draws with
        plotly's renderer (zoom and hover included) and a saved notebook keeps without
        widget state; the widget goes back for the next run's dashboard, and this one
        stops drawing.
        """
        snapshot = self._snapshot()
        if final or self._ended:
            self._end()
            return figure_bundle(self._static(snapshot), text=self._summary(snapshot))
        self.refresh(force=True)  # the view starts with the data there is now
        self.follow()
        return {
            WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0,
                               "model_id": self.widget.model_id},
            "text/html": figure_html(self._static(snapshot)),
            "text/plain": self._summary(snapshot),
        }

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return self.mimebundle()

    def _end(self) -> None:
        self.unfollow()
        with self._lock:  # not while a thread is drawing into the widget
            self._ended = True
        with self._widget_lock:
            widget, self._widget = self._widget, None
        if widget is not None:
            with _SPARE_LOCK:
                _SPARE_WIDGETS[self.world_size].append(widget)

    # -- building ---------------------------------------------------------------------------
    def _figure_json(self, scalars: list[str], panels: tuple[str, ...] = PANELS,
                     scalars_by: str = "step") -> dict:
        """The empty dashboard as plotly JSON, with a trace per logged scalar, showing
        only `panels` (the others have nothing to show), then a smoothed trace over each
        per-step trace (which the views compute: see `_smoothed`). The base is built (and
        validated by plotly, ~0.1 s) once per world size: a cell's first display stays
        quick."""
        base = _BASE_FIGURES.get(self.world_size)
        if base is None:
            base = _BASE_FIGURES[self.world_size] = json.loads(
                pio.to_json(self._build_base_figure(), validate=False))
        figure = copy.deepcopy(base)
        if self.source:
            figure["layout"]["title"]["text"] += f", from {self.source}"
        for i, name in enumerate(scalars):
            # the loss panel is subplot (2, 1): axes x3/y3 (named: the cached base
            # figure has no subplot grid to look rows and columns up in)
            axis = "y5" if name in COMM_SCALARS else "y3"
            figure["data"].append({"type": "scatter", "name": name, "legendgroup": name,
                                   "mode": "lines", "xaxis": "x3", "yaxis": axis,
                                   "line": {"color": quantity_color(i),
                                            **({"dash": "dot"} if axis == "y5" else {})}})
        for index in self._smoothed(len(scalars)):
            raw = figure["data"][index]
            smooth = {**raw, "line": {**raw.get("line", {}), "width": 2},
                      "meta": {"smooth_of": index, "weight": SMOOTH_WEIGHT},
                      "hovertemplate": "%{y:.4g} (smoothed)"}
            smooth.pop("opacity", None)
            raw.update({"opacity": RAW_OPACITY, "showlegend": False,
                        "line": {**raw.get("line", {}), "width": 1}})
            figure["data"].append(smooth)
        _arrange(figure, panels, self.world_size,
                 comm_axis=any(name in COMM_SCALARS for name in scalars))
        if scalars_by == "count":  # logged without training steps
            figure["layout"]["xaxis3"]["title"] = {
                "text": "value # (logged without training steps)"}
        return figure

    def _smoothed(self, scalars: int) -> list[int]:
        """The indexes of the per-step traces that get a smoothed line over them: every
        rank's (or the band's median) throughput and bandwidth, the total, the scalars.
        Not the band's edges: they show the spread as it is."""
        lines, w = self._lines, self.world_size
        first_bandwidth = lines + 1 + len(SPLIT_PARTS)
        first_scalar = first_bandwidth + lines
        if self.band:  # low, high, median: the median
            rank_lines = [2, lines, first_bandwidth + 2]
        else:
            rank_lines = [*range(w + 1), *range(first_bandwidth, first_bandwidth + w)]
        return rank_lines + list(range(first_scalar, first_scalar + scalars))

    def _build_base_figure(self) -> go.Figure:
        split_title = f"Step time (s), mean of last {SPLIT_WINDOW} steps"
        if self.band:
            split_title += ": median and slowest ranks"
        fig = make_subplots(
            rows=2, cols=2, vertical_spacing=0.16, horizontal_spacing=0.1,
            subplot_titles=("Throughput (samples/s)", split_title,
                            "Loss and logged scalars", "Communication bandwidth (GB/s)"),
        )
        for col in (1, 2):  # throughput, then bandwidth: per rank, or the band
            row = col
            for trace in self._rank_lines(legend=col == 1):
                fig.add_trace(trace, row=row, col=col)
            if col == 1:
                # the total on an axis of its own (right): on the ranks' axis it is
                # world_size times higher, and flattens their lines (or band) at the bottom
                fig.add_trace(go.Scatter(name="total", legendgroup="total", mode="lines",
                                         line={"color": "black", "dash": "dot"}, yaxis="y6",
                                         xaxis="x"))
                # numeric x with rank labels: a view created after restyles
                # (update_display) draws bars without their x, i.e. at 0..n-1, which
                # then is still right
                bars = self._bar_labels()
                for part, color in SPLIT_PARTS:
                    fig.add_trace(go.Bar(name=part, x=list(range(len(bars))),
                                         y=[0] * len(bars), marker_color=color,
                                         hovertemplate="%{y:.4f} s"), row=1, col=2)
        # the legend sits above the plots: the widget is drawn 700 px wide in JupyterLab
        # (it is sized before it is attached), and the plots need that width
        fig.update_layout(height=COMPACT_HEIGHT, barmode="stack", template="plotly_white",
                          margin={"t": 100, "b": 40, "l": 50, "r": 20},
                          title={"text": f"mpilab training: {self.world_size} ranks",
                                 "x": 0.01, "y": 0.985},
                          legend={"orientation": "h", "x": 0, "y": 1.09, "yanchor": "bottom"})
        fig.update_xaxes(title_text="step", row=1, col=1)
        fig.update_xaxes(title_text="step", row=2, col=1)
        fig.update_xaxes(title_text="step", row=2, col=2)
        # log, a label per decade: a rank that waits for a straggler "achieves" 100× less
        fig.update_yaxes(type="log", dtick=1, exponentformat="none", row=2, col=2)
        # communication scalars (bytes sent, compression ratio: the training strategies'
        # trade-off) span other magnitudes than a loss: their own log axis, on the right
        fig.update_layout(yaxis5={"overlaying": "y3", "side": "right", "type": "log",
                                  "anchor": "x3", "showgrid": False,
                                  "title": {"text": "bytes / ratio"}},
                          yaxis6={"overlaying": "y", "side": "right", "anchor": "x",
                                  "showgrid": False, "rangemode": "tozero"})
        bars = self._bar_labels()
        fig.update_xaxes(tickvals=list(range(len(bars))), ticktext=bars, row=1, col=2)
        return fig

    def _rank_lines(self, legend: bool) -> list[go.Scatter]:
        """A panel's per-rank traces: a line per rank, or past BAND_ABOVE_RANKS ranks the
        band (low and high edges, filled between) and its median."""
        if not self.band:
            return [go.Scatter(name=f"rank {r}", legendgroup=f"rank {r}", showlegend=legend,
                               mode="lines", line={"color": rank_color(r)})
                    for r in range(self.world_size)]
        color = rank_color(0)
        edge = {"mode": "lines", "line": {"width": 0, "color": color}, "legendgroup": "band",
                "hoverinfo": "skip"}
        return [go.Scatter(name="min of ranks", showlegend=False, **edge),
                go.Scatter(name=f"min-max of {self.world_size} ranks", showlegend=legend,
                           fill="tonexty", fillcolor="rgba(31,119,180,0.2)", **edge),
                go.Scatter(name="median rank", legendgroup="median", showlegend=legend,
                           mode="lines", line={"color": color})]

    def _bar_labels(self) -> list[str]:
        """The step-time bars: a bar per rank, or the median rank's and the slowest
        ranks' (which ranks those are, the line above the plot says)."""
        if not self.band:
            return [f"rank {r}" for r in range(self.world_size)]
        return ["median"] + [f"slowest #{i + 1}" for i in range(SLOWEST_NAMED)]

    def _static(self, snap: _Snapshot) -> go.Figure:
        figure = self._figure_json(list(snap.scalars), _panels_with_data(snap),
                                   snap.scalars_by)
        notes = self._notes(snap)
        if notes:  # the live view shows them above the plot
            figure["layout"]["title"]["text"] += f"<br><sup>{notes}</sup>"
        fig = go.Figure(figure, _validate=False)
        traces = self._traces(snap, list(snap.scalars))
        traces.update(smoothed_traces(figure["data"], traces))
        # our arrays are clean float64: no per-property validation
        fig.plotly_restyle({"x": [x for x, _ in traces.values()],
                            "y": [y for _, y in traces.values()]}, trace_indexes=list(traces))
        return fig

    def _draw(self, widget: LivePlot, snap: _Snapshot) -> None:
        """Every trace's data in one message; the figure too when scalars were added."""
        scalars = list(snap.scalars)  # in order of first appearance: traces only grow
        # a panel appears once it has data, and stays
        self._panels = tuple(p for p in PANELS
                             if p in self._panels or p in _panels_with_data(snap))
        layout = (self._panels, snap.scalars_by)
        added = scalars != self._shown_scalars or layout != self._shown_layout
        self._shown_scalars, self._shown_layout = scalars, layout
        widget.show(self._traces(snap, scalars),
                    figure=self._figure_json(scalars, *layout) if added else None,
                    step=snap.last_step if snap.scalars_by == "step"
                    and snap.last_step is not None else -1,
                    notes=self._notes(snap))

    def _notes(self, snap: _Snapshot) -> str:
        """The line above the plot: past BAND_ABOVE_RANKS ranks, the slowest ranks."""
        if not self.band or not snap.slowest:
            return ""
        median = float(np.median([compute for compute, _ in snap.split.values()]))
        window = f"compute per step, last {SPLIT_WINDOW} steps"
        slow = [(r, c) for r, c in snap.slowest if c > STRAGGLER_SHARE * median]
        if not slow:
            return (f"no straggler: every rank within {STRAGGLER_SHARE - 1:.0%} of the "
                    f"median rank's {median * 1000:.0f} ms ({window})")
        named = ", ".join(f"rank {r} ({compute * 1000:.0f} ms)" for r, compute in slow)
        return f"slowest ranks: {named}; median {median * 1000:.0f} ms ({window})"

    def _traces(self, snap: _Snapshot, scalars: list[str]) -> dict[int, Series]:
        """Trace index -> (x, y) of every raw trace of the figure that
        `_figure_json(scalars)` makes (the smoothed ones follow from them)."""
        w, lines = self.world_size, self._lines
        traces: dict[int, Series] = {}
        if self.band:
            for i, series in enumerate(snap.bands.get("throughput", (_EMPTY,) * 3)):
                traces[i] = series
        else:
            for r in range(w):
                traces[r] = snap.throughput.get(r, _EMPTY)
        traces[lines] = snap.total
        bars = self._split_bars(snap)
        for part in range(len(SPLIT_PARTS)):
            traces[lines + 1 + part] = (np.arange(len(bars), dtype=float),
                                        np.array([bar[part] for bar in bars]))
        first_bandwidth = lines + 1 + len(SPLIT_PARTS)
        if self.band:
            for i, series in enumerate(snap.bands.get("bandwidth", (_EMPTY,) * 3)):
                traces[first_bandwidth + i] = series
        else:
            for r in range(w):
                traces[first_bandwidth + r] = snap.bandwidth.get(r, _EMPTY)
        first_scalar = first_bandwidth + lines
        for i, name in enumerate(scalars):
            traces[first_scalar + i] = snap.scalars.get(name, _EMPTY)
        return traces

    def _split_bars(self, snap: _Snapshot) -> list[tuple[float, float]]:
        """(compute, comm wait) per bar: per rank, or the median's and the slowest's."""
        if not self.band:
            return [snap.split.get(r, (0.0, 0.0)) for r in range(self.world_size)]
        if not snap.split:
            return [(0.0, 0.0)] * (1 + SLOWEST_NAMED)
        median = tuple(np.median(np.array(list(snap.split.values())), axis=0).tolist())
        bars = [median] + [snap.split[r] for r, _ in snap.slowest]
        return bars + [(0.0, 0.0)] * (1 + SLOWEST_NAMED - len(bars))

    def _snapshot(self) -> _Snapshot:
        self._runlog.update(self.store)
        return self._runlog.snapshot()

    def _summary(self, snap: _Snapshot) -> str:
        """One line for terminals: where the run is and how fast it goes."""
        parts = [f"mpilab dashboard: {self.world_size} ranks"]
        if snap.last_step is not None:
            parts.append(f"step {snap.last_step}")
        if len(snap.total[1]):
            parts.append(f"{snap.total[1][-1]:,.0f} samples/s")
        parts += [f"{name} {values[-1]:.4g}" for name, (_, values) in snap.scalars.items()]
        if self.band and snap.slowest:
            parts.append("slowest ranks " + ", ".join(str(r) for r, _ in snap.slowest))
        return ", ".join(parts) + (f" (from {self.source})" if self.source else "")

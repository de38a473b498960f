"""Helpers shared by the widgets: downsampling, human units, display bundles."""

from __future__ import annotations

import json
import math

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs, get_plotlyjs_version

MAX_POINTS = 2000  # per trace: the browser stays fast however long the run
EXACT_POINTS = 100  # the newest points are never averaged, so "now" is exact; few, as
# a redraw sends the points that changed (live_plot.py): these and the newest buckets
HISTORY_POINTS = 1 << 18  # per live series (4 MB); beyond, the oldest half is dropped
RANK_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)
# quantities (logged scalars, the parts of a step) never take a rank's color: a loss line
# beside rank 3's throughput must not read as rank 3's. Black and dark shades that
# category10 (RANK_COLORS) does not use
QUANTITY_COLORS = ("#000000", "#8c6d31", "#393b79", "#637939", "#7b4173", "#5254a3")
# per-step traces are drawn faint, with an exponential moving average over them (the
# debiased EMA TensorBoard draws: no lag towards 0 at the start); the weight is per drawn
# point, so a long run's averaged buckets smooth as much as a short run's steps
SMOOTH_WEIGHT = 0.85
RAW_OPACITY = 0.3  # the raw points behind a smoothed line
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# plotly's own include_plotlyjs="cdn" hashes its 4.6 MB plotly.js for the script tag's
# integrity attribute on every call (17 of a dashboard's 20 ms); a URL skips that
_PLOTLYJS_CDN = f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"
# how plotly's to_html writes that script tag
_PLOTLYJS_TAG = f'<script charset="utf-8" src="{_PLOTLYJS_CDN}"></script>'


def rank_color(rank: int) -> str:
    """The same color for a rank in every plot, so a straggler is followed across them."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def quantity_color(index: int) -> str:
    """The color of the `index`-th quantity (logged scalar) of a plot."""
    return QUANTITY_COLORS[index % len(QUANTITY_COLORS)]


def ema(y, weight: float = SMOOTH_WEIGHT) -> np.ndarray:
    """The debiased exponential moving average of `y` (non-finite values are skipped and
    take the average so far): what a view draws over a trace's faint raw points. The
    live view computes the same in the browser (live_plot.py), so the kernel sends only
    the raw data."""
    y = np.asarray(y, dtype=float)
    out = np.empty(len(y))
    last, n = 0.0, 0
    for i, value in enumerate(y.tolist()):
        if math.isfinite(value):
            last = last * weight + (1 - weight) * value
            n += 1
        out[i] = last / (1 - weight ** n) if n else math.nan
    return out


def smoothed_traces(figure_data: list, traces: dict[int, tuple[np.ndarray, np.ndarray]]
                    ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Trace index -> (x, y) of the figure's smoothed traces (plotly JSON dicts or trace
    objects whose `meta` names the trace they smooth, `smooth_of`), from the raw
    `traces`."""
    out = {}
    for index, trace in enumerate(figure_data):
        meta = trace.get("meta") if isinstance(trace, dict) else trace.meta
        if isinstance(meta, dict) and "smooth_of" in meta:
            x, y = traces.get(meta["smooth_of"], (np.empty(0), np.empty(0)))
            out[index] = (np.asarray(x, dtype=float),
                          ema(y, meta.get("weight", SMOOTH_WEIGHT)))
    return out


class StepBand:
    """The ranks at each step: the median, min, max and sum of one value over the ranks,
    once every rank of the run has reported that step (a rank's first report of a step
    counts). Past a few ranks one line per rank is unreadable (and costs a trace each);
    the band shows the spread and the median, and the ranks at its edge are named
    elsewhere. The sum is the run's total (samples/s of all ranks)."""

    def __init__(self):
        self.median, self.low, self.high = GrowingSeries(), GrowingSeries(), GrowingSeries()
        self.total = GrowingSeries()
        self._pending: dict[float, dict[int, float]] = {}  # step -> rank -> value
        self._done = -math.inf  # the newest complete step: older reports come too late

    def add(self, ranks, steps, values, world: int) -> None:
        """Points (rank, step, value), as three sequences; `world`: how many ranks the
        run has now."""
        done, pending = self._done, self._pending
        complete = []
        for rank, step, value in zip(np.asarray(ranks).tolist(), np.asarray(steps).tolist(),
                                     np.asarray(values).tolist()):
            if step <= done:
                continue
            reported = pending.get(step)
            if reported is None:
                reported = pending[step] = {}
            if rank not in reported:
                reported[rank] = value
                if len(reported) >= world:
                    complete.append(step)
        if not complete:
            return
        complete.sort()
        values = [np.fromiter(pending[s].values(), dtype=float) for s in complete]
        self.median.extend(complete, [float(np.median(v)) for v in values])
        self.low.extend(complete, [float(v.min()) for v in values])
        self.high.extend(complete, [float(v.max()) for v in values])
        self.total.extend(complete, [float(v.sum()) for v in values])
        self._done = complete[-1]
        self._pending = {s: r for s, r in pending.items() if s > self._done}

    def downsampled(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """(low, high, median), each (x, y), downsampled."""
        return self.low.downsampled(), self.high.downsampled(), self.median.downsampled()


def downsample(x, y, max_points: int = MAX_POINTS,
               exact: int = EXACT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` points: the newest `exact` as they are, older ones bucket-averaged.

    Buckets hold a power-of-two number of points counted from the first point, so old
    buckets do not shift as new points arrive and the curve does not flicker between
    refreshes.
    """
    series = GrowingSeries(max_points, exact, history=max(len(x), 1))
    series.extend(x, y)
    return series.downsampled()


class GrowingSeries:
    """An (x, y) series that grows at its end and keeps `downsample(x, y)` up to date
    incrementally: the bucket means already computed are kept (two merged into one when
    the bucket size doubles), so a redraw late in a long run costs the points that
    arrived since the last one, not the whole run.

    A point may also be a mean that takes more values later (`average_in`), and points
    may arrive out of order (`insert`); a change inside the averaged buckets recomputes
    them once. Beyond `history` points the oldest half is dropped.
    """

    def __init__(self, max_points: int = MAX_POINTS, exact: int = EXACT_POINTS,
                 history: int = HISTORY_POINTS):
        self._xyn = np.empty((3, 256))  # x, y and how many values y is the mean of
        self.n = 0
        self._max_points, self._exact, self._history = max_points, exact, history
        self._size = 1  # points per cached bucket
        self._means = np.empty((2, 0))  # (x, y) means of the first buckets of the series

    @property
    def x(self) -> np.ndarray:
        return self._xyn[0, :self.n]

    @property
    def y(self) -> np.ndarray:
        return self._xyn[1, :self.n]

    def extend(self, x, y, counts=1) -> None:
        x = np.asarray(x, dtype=float)
        end = self.n + len(x)
        if end > self._xyn.shape[1]:
            if end > self._history:  # keep the newest half of the history
                drop = min(self.n, end - self._history // 2)
                self._xyn[:, :self.n - drop] = self._xyn[:, drop:self.n]
                self.n -= drop
                end -= drop
                self._means = self._means[:, :0]  # buckets count from the first point
            if end > self._xyn.shape[1]:
                grown = np.empty((3, max(2 * self._xyn.shape[1], end)))
                grown[:, :self.n] = self._xyn[:, :self.n]
                self._xyn = grown
        self._xyn[0, self.n:end] = x
        self._xyn[1, self.n:end] = y
        self._xyn[2, self.n:end] = counts
        self.n = end

    def average_in(self, x: float, total: float, count: int = 1) -> None:
        """More values (`count` of them, summing to `total`) for the point at `x` (x is
        sorted): the point becomes the mean of all its values; a new point if there is
        none at `x`."""
        index = int(np.searchsorted(self.x, x))
        if index < self.n and self._xyn[0, index] == x:
            had = self._xyn[2, index]
            self._xyn[1, index] = (self._xyn[1, index] * had + total) / (had + count)
            self._xyn[2, index] = had + count
        else:  # out of order: rare, so O(n)
            after = self.n - index
            self.extend([x], [total / count], count)
            index = self.n - 1 - after  # the oldest points may have been dropped
            self._xyn[:, index + 1:self.n] = self._xyn[:, index:self.n - 1].copy()
            self._xyn[:, index] = (x, total / count, count)
        self._means = self._means[:, :index // self._size]  # buckets from index on are stale

    def downsampled(self) -> tuple[np.ndarray, np.ndarray]:
        """What `downsample(self.x, self.y)` gives (new arrays; equal up to rounding)."""
        n, max_points = self.n, self._max_points
        if n <= max_points:
            return self.x.copy(), self.y.copy()
        exact = min(self._exact, max_points - 1)
        old = n - exact
        size = _bucket_size(old, max_points - exact)
        if size > self._size:  # the series grew: merge cached buckets in pairs
            merge = size // self._size
            kept = self._means.shape[1] // merge * merge
            self._means = self._means[:, :kept].reshape(2, -1, merge).mean(axis=2)
        elif size < self._size:  # it lost its oldest half
            self._means = self._means[:, :0]
        self._size = size
        full = old // size
        cached = self._means.shape[1]
        if full > cached:
            new = self._xyn[:2, cached * size:full * size].reshape(2, -1, size).mean(axis=2)
            self._means = np.concatenate([self._means, new], axis=1)
        parts = [self._means[:, :full]]
        if full * size < old:  # one partial bucket just before the exact tail
            parts.append(self._xyn[:2, full * size:old].mean(axis=1, keepdims=True))
        parts.append(self._xyn[:2, old:n])
        x, y = np.concatenate(parts, axis=1)
        return x, y


def _bucket_size(old: int, budget: int) -> int:
    """Points per bucket so that `old` points fit in `budget` buckets: a power of two, so
    buckets only ever merge in pairs as the series grows."""
    return 1 << math.ceil(math.log2(old / budget))


def figure_bundle(fig: go.Figure, text: str | None = None) -> dict:
    """A display bundle for a static figure that renders everywhere.

    JupyterLab draws the plotly mime type; nbconvert HTML and other frontends without
    the plotly renderer use the HTML (plotly.js from the CDN, or inside the page with
    `inline_plotlyjs`, as `mpilab run --html` does); terminals get the text.
    """
    return {
        PLOTLY_MIME: json.loads(pio.to_json(fig, validate=False)),
        "text/html": figure_html(fig),
        "text/plain": text if text is not None else _title(fig),
    }


def figure_html(fig: go.Figure) -> str:
    """The figure as an HTML fragment that loads plotly.js from the CDN."""
    return pio.to_html(fig, include_plotlyjs=_PLOTLYJS_CDN, full_html=False, validate=False,
                       config={"displaylogo": False, "responsive": True})


def inline_plotlyjs(html: str) -> str:
    """`html` (a page or fragment holding `figure_html` figures) with plotly.js inside
    instead of fetched from the CDN: the first figure's script tag becomes plotly.js
    itself (4.6 MB, once per page), the others go. A page exported on a cluster node
    without internet then shows its plots; one without figures is returned unchanged.

    A notebook's outputs keep the CDN tag (the file stays small); `mpilab run --html`
    passes its page through this.
    """
    first = html.find(_PLOTLYJS_TAG)
    if first < 0:
        return html
    # a "</script" inside the code would end the tag early; plotly.min.js has none
    code = get_plotlyjs().replace("</script", "<\\/script")
    rest = html[first + len(_PLOTLYJS_TAG):].replace(_PLOTLYJS_TAG, "")
    return f'{html[:first]}<script charset="utf-8">{code}</script>{rest}'


def _title(fig: go.Figure) -> str:
    title = fig.layout.title.text
    return f"<plotly figure: {title}>" if title else "<plotly figure>"

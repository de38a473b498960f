"""A plotly plot in JupyterLab whose traces take new data in one message.

plotly's FigureWidget sends four comm messages per update and keeps a validated copy of
the figure in Python; the dashboard redraws 4 times a second on cores the ranks train
on. This widget draws with the same plotly.js and takes a redraw's arrays as binary
buffers in one state update: about a quarter of FigureWidget's kernel time per update
(benchmarks/bench_redraw.py). plotly.js travels with each widget, as FigureWidget's does,
but runs once per page: running it again took a second widget 2.5 s of the browser's main
thread on the 2-core test machine (against 0.3 s to skip it), and a browser four times
slower showed a new dashboard only 4.5-5.6 s into a 7-s cell.

A redraw sends only what changed: each trace's data is the `series` sent last in full
(the base) up to a point, then a `tail`. A downsampled trace changes only in its newest
points, so a redraw's message is a fraction of the data; the base is sent again once the
tails grow past a quarter of it. Both are plain widget state, so a view that opens at any
moment (a second display, a page reload) draws the same data.

The browser pays for a redraw too, and more than the kernel: plotly lays out and paints
the whole figure again (benchmarks/bench_browser.py measures what that costs). Each view
times its redraws and waits REDRAW_BUDGET times as long before the next, drawing the
latest data then: drawing takes at most about a tenth of the browser's main thread, as
in the kernel. A fast browser still draws every update; a slower one, fewer. But a live
view must move: it never stays still for more than MAX_STILL_S while there is new data,
unless a redraw itself takes longer, and then it waits as long as that redraw took. So
a slow browser (redraws over 0.11 s) spends up to half its main thread drawing and
still shows the run about once a second, where waiting ten times as long had left a plot
still for 3.7 s after a 0.37-s redraw, past the end of the cell it watched. A view out of
sight draws nothing until it is back: a long run in a collapsed output or a background
tab costs the browser no drawing.

What the views add to the data, so that it never travels: a trace whose `meta` names
another (`smooth_of`) is drawn as that trace's moving average (plotting.ema, the same
in Python for `to_figure` and static figures). A line above the plot carries the
kernel's `notes` (the slowest ranks), says "N steps behind" when the drawing has lagged
the newest `step` sent for BEHIND_AFTER_S, and holds the button that switches a compact
figure to its `layout.meta.expanded_height` and back (per view, kept across redraws).
"""

from __future__ import annotations

import json

import anywidget
import numpy as np
import plotly.graph_objects as go
import traitlets
from plotly.offline import get_plotlyjs, get_plotlyjs_version

from .plotting import smoothed_traces

# a redraw (kernel or browser) is followed by at least this many times its own duration
# without one: drawing takes at most 1/REDRAW_BUDGET of a core
REDRAW_BUDGET = 10
# ... but a view with new data to draw waits at most this long after a redraw ends, or as
# long as that redraw took if more (at most half the browser's main thread then)
MAX_STILL_S = 1.0
# a view says how many steps its drawing is behind the data the kernel sent once that has
# lasted this long (and hides it once it has been current as long)
BEHIND_AFTER_S = 0.5
# each view keeps a log of its last this many updates and drawings (`mpilabLog` on the
# plot's element)
LOG_SIZE = 400

# plotly.js runs once per page, the first time a LivePlot's module loads; the next
# modules find its Plotly under this name (with the version: a page may hold widgets of
# two mpilab installs)
_PLOTLY_KEY = f"mpilab plotly.js {get_plotlyjs_version()}"
_PLOTLY_ONCE = (f"if (!globalThis[{json.dumps(_PLOTLY_KEY)}]) {{\n"
                f"(function () {{\n{get_plotlyjs()}\n}}).call(globalThis);\n"
                f"globalThis[{json.dumps(_PLOTLY_KEY)}] = globalThis.Plotly;\n}}\n"
                f"const PLOTLY = globalThis[{json.dumps(_PLOTLY_KEY)}];\n")

# Runs after _PLOTLY_ONCE. Each view draws the figure with the latest series once it is
# attached, then restyles at its own pace; drawings are queued so a restyle never races
# a redraw.
_RENDER_JS = r"""
const CONFIG = { displaylogo: false, responsive: true };
const float64 = (v) => new Float64Array(v.buffer.slice(v.byteOffset, v.byteOffset + v.byteLength));

// the base's first `keep` values, then the tail's
const spliced = (base, keep, tail) => {
  const out = new Float64Array(keep + tail.length);
  out.set(base.subarray(0, keep));
  out.set(tail, keep);
  return out;
};

// the debiased EMA of plotting.ema: what a smoothed trace draws over its raw trace
const ema = (y, w) => {
  const out = new Float64Array(y.length);
  let last = 0, n = 0;
  for (let i = 0; i < y.length; i++) {
    if (Number.isFinite(y[i])) { last = last * w + (1 - w) * y[i]; n++; }
    out[i] = n ? last / (1 - Math.pow(w, n)) : NaN;
  }
  return out;
};

function render({ model, el }) {
  const Plotly = PLOTLY;
  // a line above the plot: the figure's notes (the slowest ranks), how far the drawing
  // is behind the data the kernel sent, and the button that expands a compact figure
  const bar = document.createElement("div");
  bar.className = "mpilab-plot-bar";
  bar.style.cssText = "display:flex;gap:8px;align-items:center;justify-content:flex-end;" +
                      "font:11px monospace;color:#555;min-height:18px";
  const notes = document.createElement("span");
  notes.className = "mpilab-plot-notes";
  notes.style.cssText = "flex:1;white-space:nowrap;overflow:hidden;text-overflow:ellipsis";
  const behind = document.createElement("span");
  behind.className = "mpilab-plot-behind";
  behind.style.cssText = "color:#8a4b00;background:#fff1d6;padding:0 6px;border-radius:3px;" +
                         "display:none";
  const expand = document.createElement("button");
  expand.className = "mpilab-plot-expand";
  expand.style.cssText = "font:11px monospace;padding:0 6px;cursor:pointer;display:none";
  bar.append(notes, behind, expand);
  const div = document.createElement("div");
  div.style.width = "100%";
  el.append(bar, div);
  let expanded = false;
  const heights = () => {
    const layout = model.get("figure").layout || {};
    const meta = layout.meta || {};
    return { compact: layout.height, full: meta.expanded_height };
  };
  const showExpand = () => {
    const h = heights();
    expand.style.display = h.full && h.full !== h.compact ? "" : "none";
    expand.textContent = expanded ? "compact \u25b4" : "expand \u25be";
  };
  expand.onclick = () => {
    expanded = !expanded;
    showExpand();
    const h = heights();
    later(() => Plotly.relayout(div, { height: expanded ? h.full : h.compact }));
  };
  const showNotes = () => { notes.textContent = model.get("notes") || ""; };
  // what this view did, when (epoch ms) and for how long: the last LOG_SIZE entries, for
  // the tests and for anyone asking in the browser's console why a plot looks behind
  const log = (div.mpilabLog = []);
  const note = (kind, start, points) => {
    const now = performance.now();
    log.push({ kind, at: Math.round(performance.timeOrigin + start),
               ms: Math.round(now - start), points });
    if (log.length > LOG_SIZE) log.splice(0, log.length - LOG_SIZE);
  };
  const count = (data) => (data ? data.x.reduce((n, v) => n + v.length, 0) : 0);
  note("render", performance.now(), 0);
  let queue = Promise.resolve();
  const later = (step) => {
    queue = queue.then(step).catch((e) => console.error("mpilab live plot:", e));
  };
  // every trace's data as the views draw it: the base's, then the tail's
  const current = () => {
    const s = model.get("series");
    if (!(s && s.traces && s.traces.length)) return null;
    const x = s.x.map(float64), y = s.y.map(float64);
    const t = model.get("tail") || {};
    (t.traces || []).forEach((trace, i) => {
      const j = s.traces.indexOf(trace);
      x[j] = spliced(x[j], t.keep[i], float64(t.x[i]));
      y[j] = spliced(y[j], t.keep[i], float64(t.y[i]));
    });
    // the smoothed traces, from the raw ones they name (meta.smooth_of)
    const f = model.get("figure");
    const traces = [...s.traces];
    (f.data || []).forEach((trace, j) => {
      const of = trace.meta && trace.meta.smooth_of;
      const i = of === undefined ? -1 : s.traces.indexOf(of);
      if (i < 0) return;
      traces.push(j);
      x.push(x[i]);
      y.push(ema(y[i], trace.meta.weight));
    });
    return { traces, x, y };
  };
  // "N steps behind": the newest step the kernel sent (`step`) against the step of the
  // data drawn last. Said once the drawing has stayed behind for BEHIND_AFTER_MS (a view
  // that keeps up is behind only while a restyle runs), and kept until it has been
  // current for as long, so that a slow view's label does not blink at each restyle.
  let drawnStep = -1, behindSince = null, currentSince = null, behindTimer = null;
  const updateBehind = () => {
    const now = performance.now(), newest = model.get("step");
    const lag = newest >= 0 && drawnStep >= 0 ? newest - drawnStep : 0;
    clearTimeout(behindTimer);
    if (lag > 0) {
      currentSince = null;
      behindSince = behindSince === null ? now : behindSince;
      if (now - behindSince >= BEHIND_AFTER_MS) {
        behind.textContent = `${lag} step${lag === 1 ? "" : "s"} behind`;
        behind.style.display = "";
        behind.dataset.lag = String(lag);
      } else {
        behindTimer = setTimeout(updateBehind, BEHIND_AFTER_MS - (now - behindSince) + 1);
      }
    } else {
      behindSince = null;
      currentSince = currentSince === null ? now : currentSince;
      if (now - currentSince >= BEHIND_AFTER_MS) {
        behind.style.display = "none";
        behind.dataset.lag = "0";
      } else if (behind.style.display !== "none") {
        behindTimer = setTimeout(updateBehind, BEHIND_AFTER_MS - (now - currentSince) + 1);
      }
    }
  };
  const restyle = () => {
    const data = current();
    if (!data) return 0;
    const step = model.get("step");
    return Plotly.restyle(div, { x: data.x, y: data.y }, data.traces).then(() => {
      drawnStep = step;
      updateBehind();
      return count(data);
    });
  };
  // the figure with its data in one drawing (plotly lays out and paints it all each time)
  const draw = () => {
    const f = model.get("figure");
    const traces = (f.data || []).map((trace) => ({ ...trace }));
    const data = current();
    (data ? data.traces : []).forEach((j, i) => {
      if (traces[j]) Object.assign(traces[j], { x: data.x[i], y: data.y[i] });
    });
    const layout = { ...(f.layout || {}) };
    if (expanded && heights().full) layout.height = heights().full;
    showExpand();
    const start = performance.now(), step = model.get("step");
    return Plotly.react(div, traces, layout, CONFIG).then(() => {
      drawn = true;
      drawnStep = step;
      updateBehind();
      note("draw", start, count(data));
    });
  };
  // the first drawing waits until the view has its width (JupyterLab makes it before
  // attaching it), so that it is the only one; restyles and new figures wait for it
  let sized = false, drawn = false;
  // Out of sight (scrolled away, its output collapsed, its browser tab in the
  // background) a view does not draw; back in sight, it draws what it missed: the
  // latest data, or the whole figure when traces were added meanwhile.
  let inSight = true, missed = null;  // null, "data" or "figure"
  const visible = () => inSight && !document.hidden;
  const onFigure = () => {
    if (drawn) later(() => (visible() ? draw() : (missed = "figure")));
  };
  // A restyle is timed to the frame that paints it; the next one starts no sooner than
  // REDRAW_BUDGET times that after it, and no later than MAX_STILL_MS after it ended
  // (or as long as it took, if more), and draws the latest series and tail then.
  let pending = false, readyAt = 0, closed = false;
  const pause = (ms) => new Promise((done) => setTimeout(done, ms));
  const painted = () => new Promise((done) => {
    requestAnimationFrame(() => done());
    setTimeout(done, 100);  // no frames while the page is hidden
  });
  const pacedRestyle = async () => {
    await pause(readyAt - performance.now());
    pending = false;  // an update from now on needs a restyle of its own
    if (closed || !drawn) {
      note(closed ? "skip: closed" : "skip: not drawn yet", performance.now(), 0);
      return;
    }
    if (!visible()) {
      note("skip: out of sight", performance.now(), 0);
      missed = missed || "data";
      return;
    }
    const start = performance.now();
    const points = await restyle();
    await painted();
    note("restyle", start, points);
    const end = performance.now(), took = end - start;
    readyAt = end + Math.max(took, Math.min((REDRAW_BUDGET - 1) * took, MAX_STILL_MS));
  };
  // a new base comes with an empty tail: one restyle for both changes
  const onSeries = () => {
    updateBehind();
    note(pending ? "update (batched)" : "update", performance.now(), 0);
    if (!pending) {
      pending = true;
      later(pacedRestyle);
    }
  };
  const onSight = () => {
    if (!missed || !visible()) return;
    const figure = missed === "figure";
    missed = null;
    if (figure) later(draw);  // with the latest data
    else onSeries();
  };
  const sight = new IntersectionObserver((entries) => {
    inSight = entries[entries.length - 1].isIntersecting;
    note(inSight ? "in sight" : "out of sight", performance.now(), 0);
    onSight();
  });
  sight.observe(el);
  document.addEventListener("visibilitychange", onSight);
  showNotes();
  model.on("change:figure", onFigure);
  model.on("change:series", onSeries);
  model.on("change:tail", onSeries);
  model.on("change:notes", showNotes);
  const resized = new ResizeObserver(() => {
    if (!div.offsetWidth) return;
    note("sized", performance.now(), 0);
    if (sized) {
      later(() => Plotly.Plots.resize(div));
    } else {
      sized = true;
      later(draw);
    }
  });
  resized.observe(el);
  return () => {
    model.off("change:figure", onFigure);
    model.off("change:series", onSeries);
    model.off("change:tail", onSeries);
    model.off("change:notes", showNotes);
    clearTimeout(behindTimer);
    closed = true;
    resized.disconnect();
    sight.disconnect();
    document.removeEventListener("visibilitychange", onSight);
    Plotly.purge(div);
  };
}

export default { render };
"""


# the base is sent again once the tails hold more than this share of the points
REBASE_SHARE = 0.25
Series = tuple[np.ndarray, np.ndarray]


class LivePlot(anywidget.AnyWidget):
    """`figure` is plotly JSON (layout and trace styles), sent when traces are added;
    `series` (the base) and `tail` carry the traces' data."""

    _esm = (f"{_PLOTLY_ONCE}const REDRAW_BUDGET = {REDRAW_BUDGET};\n"
            f"const MAX_STILL_MS = {MAX_STILL_S * 1000:g};\n"
            f"const LOG_SIZE = {LOG_SIZE};\n"
            f"const BEHIND_AFTER_MS = {BEHIND_AFTER_S * 1000:g};\n{_RENDER_JS}")
    figure = traitlets.Dict().tag(sync=True)
    series = traitlets.Dict().tag(sync=True)
    tail = traitlets.Dict().tag(sync=True)
    # the newest step in the data (-1: none, or not counted in steps): a view compares
    # it with the step of what it drew last
    step = traitlets.Int(-1).tag(sync=True)
    notes = traitlets.Unicode("").tag(sync=True)  # a line shown above the plot

    def __init__(self, figure: dict):
        # _view_count: the frontend reports how many views show the plot
        super().__init__(figure=figure, series={}, tail={}, _view_count=0)
        self._data: dict[int, Series] = {}  # every trace's data, as the views draw it
        self._base: dict[int, Series] = {}  # what `series` holds

    def show(self, traces: dict[int, Series], figure: dict | None = None,
             step: int | None = None, notes: str | None = None) -> None:
        """New data for these traces (and a new figure first, whose traces start empty),
        with the newest step they hold and the line above the plot, in one message.

        A trace whose `meta` names another (`smooth_of`) is drawn by the views as that
        trace's moving average: its data never travels."""
        if figure is not None:
            self._data = {}
        self._data.update({index: (_float64(x), _float64(y))
                           for index, (x, y) in traces.items()})
        tail = None if figure is not None else self._tail()
        with self.hold_sync():
            if figure is not None:
                self.figure = figure
            if step is not None:
                self.step = int(step)
            if notes is not None:
                self.notes = notes
            if tail is None:
                self._base = dict(self._data)
                self.series = _state(self._base)
                self.tail = {}
            else:
                self.tail = tail

    def _tail(self) -> dict | None:
        """The tail that turns the base into the data, or None when the base must be
        sent again (a new trace, or tails past REBASE_SHARE of the points)."""
        if not self._data.keys() <= self._base.keys():
            return None
        budget = REBASE_SHARE * sum(len(x) for x, _ in self._data.values())
        changed, keep, size = {}, [], 0
        for index, (x, y) in self._data.items():
            kept = _common_prefix(*self._base[index], x, y)
            if kept < len(self._base[index][0]) or kept < len(x):
                size += len(x) - kept
                if size > budget:  # most of the data changed: stop comparing
                    return None
                changed[index] = (x[kept:], y[kept:])
                keep.append(kept)
        return {**_state(changed), "keep": keep}

    def to_figure(self) -> go.Figure:
        """What the views draw, as a plotly Figure (for tests and inspection)."""
        fig = go.Figure(self.figure)
        data = {index: (np.frombuffer(x, dtype=np.float64), np.frombuffer(y, dtype=np.float64))
                for index, x, y in zip(*(self.series.get(key, []) for key in ("traces", "x", "y")))}
        tail = self.tail
        for index, kept, x, y in zip(*(tail.get(key, []) for key in ("traces", "keep", "x", "y"))):
            base_x, base_y = data[index]
            data[index] = (np.concatenate([base_x[:kept], np.frombuffer(x, dtype=np.float64)]),
                           np.concatenate([base_y[:kept], np.frombuffer(y, dtype=np.float64)]))
        data.update(smoothed_traces(self.figure.get("data", []), data))
        for index, (x, y) in data.items():
            fig.data[index].x, fig.data[index].y = x, y
        return fig


def _float64(values) -> np.ndarray:
    """A copy: the next update is compared with it, whatever the caller does with its own."""
    return np.array(values, dtype=np.float64)


def _state(traces: dict[int, Series]) -> dict:
    """Traces as widget state: their arrays travel as binary buffers."""
    return {"traces": list(traces),
            "x": [memoryview(x) for x, _ in traces.values()],
            "y": [memoryview(y) for _, y in traces.values()]}


def _common_prefix(old_x: np.ndarray, old_y: np.ndarray, x: np.ndarray, y: np.ndarray) -> int:
    """How many leading points two series share."""
    n = min(len(old_x), len(x))
    if not n:
        return 0
    differ = (old_x[:n] != x[:n]) | (old_y[:n] != y[:n])
    first = int(differ.argmax())
    return first if differ[first] else n

"""A plotly plot in JupyterLab whose traces take new data in one message.

plotly's FigureWidget sends four comm messages per update and keeps a validated copy of
the figure in Python; the dashboard redraws 4 times a second on cores the ranks train
on. This widget draws with the same plotly.js (shipped once per widget, as FigureWidget
does) and takes a redraw's arrays as binary buffers in one state update: about a fifth
of FigureWidget's kernel time per update (benchmarks/bench_redraw.py).
"""

from __future__ import annotations

import anywidget
import numpy as np
import plotly.graph_objects as go
import traitlets
from plotly.offline import get_plotlyjs

# Runs after plotly.js (which sets globalThis.Plotly). Each view draws the figure, then
# the latest series; updates are queued so a restyle never races a redraw.
_RENDER_JS = r"""
;
const CONFIG = { displaylogo: false, responsive: true };
const floats = (views) => views.map(
  (v) => new Float64Array(v.buffer.slice(v.byteOffset, v.byteOffset + v.byteLength)));

function render({ model, el }) {
  const Plotly = globalThis.Plotly;
  const div = document.createElement("div");
  div.style.width = "100%";
  el.appendChild(div);
  let queue = Promise.resolve();
  const later = (step) => {
    queue = queue.then(step).catch((e) => console.error("mpilab live plot:", e));
  };
  const restyle = () => {
    const s = model.get("series");
    if (s && s.traces && s.traces.length) {
      return Plotly.restyle(div, { x: floats(s.x), y: floats(s.y) }, s.traces);
    }
  };
  const draw = () => {
    const f = model.get("figure");
    return Plotly.react(div, f.data || [], f.layout || {}, CONFIG).then(restyle);
  };
  const onFigure = () => later(draw);
  const onSeries = () => later(restyle);
  later(draw);
  model.on("change:figure", onFigure);
  model.on("change:series", onSeries);
  // drawn before JupyterLab attaches the output: fit the width once it is known
  const sized = new ResizeObserver(() => {
    if (div.offsetWidth) later(() => Plotly.Plots.resize(div));
  });
  sized.observe(el);
  return () => {
    model.off("change:figure", onFigure);
    model.off("change:series", onSeries);
    sized.disconnect();
    Plotly.purge(div);
  };
}

export default { render };
"""


class LivePlot(anywidget.AnyWidget):
    """`figure` is plotly JSON (layout and trace styles), sent when traces are added;
    `series` carries the data of the traces a redraw changes."""

    _esm = get_plotlyjs() + _RENDER_JS
    figure = traitlets.Dict().tag(sync=True)
    series = traitlets.Dict().tag(sync=True)

    def __init__(self, figure: dict):
        # _view_count: the frontend reports how many views show the plot
        super().__init__(figure=figure, series={}, _view_count=0)

    def show(self, traces: dict[int, tuple[np.ndarray, np.ndarray]],
             figure: dict | None = None) -> None:
        """New data for these traces (and a new figure first, when it gained traces),
        in one message."""
        with self.hold_sync():
            if figure is not None:
                self.figure = figure
            self.series = {"traces": list(traces),
                           "x": [_buffer(x) for x, _ in traces.values()],
                           "y": [_buffer(y) for _, y in traces.values()]}

    def to_figure(self) -> go.Figure:
        """What the views draw, as a plotly Figure (for tests and inspection)."""
        fig = go.Figure(self.figure)
        series = self.series
        for index, x, y in zip(series.get("traces", []), series.get("x", []),
                               series.get("y", [])):
            fig.data[index].x = np.frombuffer(x, dtype=np.float64)
            fig.data[index].y = np.frombuffer(y, dtype=np.float64)
        return fig


def _buffer(values: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(values, dtype=np.float64))

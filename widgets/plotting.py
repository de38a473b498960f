"""Helpers shared by the widgets: downsampling, human units, display bundles."""

from __future__ import annotations

import json
import math

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs_version

MAX_POINTS = 2000  # per trace: the browser stays fast however long the run
EXACT_POINTS = 500  # the newest points are never averaged, so "now" is exact
RANK_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# plotly's own include_plotlyjs="cdn" hashes its 4.6 MB plotly.js for the script tag's
# integrity attribute on every call (17 of a dashboard's 20 ms); a URL skips that
_PLOTLYJS_CDN = f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"


def rank_color(rank: int) -> str:
    """The same color for a rank in every plot, so a straggler is followed across them."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def downsample(x, y, max_points: int = MAX_POINTS,
               exact: int = EXACT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` points: the newest `exact` as they are, older ones bucket-averaged.

    Buckets hold a power-of-two number of points counted from the first point, so old
    buckets do not shift as new points arrive and the curve does not flicker between
    refreshes.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = len(x)
    if n <= max_points:
        return x, y
    exact = min(exact, max_points - 1)
    old, budget = n - exact, max_points - exact
    size = 1 << math.ceil(math.log2(old / budget))
    full = old // size * size
    xs = [x[:full].reshape(-1, size).mean(axis=1)]
    ys = [y[:full].reshape(-1, size).mean(axis=1)]
    if full < old:  # one partial bucket just before the exact tail
        xs.append(x[full:old].mean(keepdims=True))
        ys.append(y[full:old].mean(keepdims=True))
    return np.concatenate([*xs, x[old:]]), np.concatenate([*ys, y[old:]])


def human_bytes(n: float, suffix: str = "") -> str:
    """4096 -> '4K', 1048576 -> '1M', 1536 -> '1.5K' (binary units, as in --sizes)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            text = f"{n:.1f}".rstrip("0").rstrip(".") if unit else f"{int(n)}"
            return f"{text}{unit}{suffix}"
        n /= 1024
    raise AssertionError("unreachable")


def figure_bundle(fig: go.Figure, text: str | None = None) -> dict:
    """A display bundle for a static figure that renders everywhere.

    JupyterLab draws the plotly mime type; nbconvert HTML and other frontends without
    the plotly renderer use the HTML (plotly.js from the CDN); terminals get the text.
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


def _title(fig: go.Figure) -> str:
    title = fig.layout.title.text
    return f"<plotly figure: {title}>" if title else "<plotly figure>"

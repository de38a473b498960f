"""mpilab.widgets: live plotly dashboards of a training run, the cluster and benchmarks.

Importing this package is cheap: plotly and ipywidgets are imported the first time a
name below is used, so `%load_ext mpilab` stays fast.
"""

from __future__ import annotations

from mpilab._lazy import lazy_names

# public name -> module that defines it (relative to this package)
_API = {
    "Dashboard": ".dashboard",
    "LivePlot": ".live_plot",
    "StatusTable": ".status",
    "status_text": ".status",
    "bench_figure": ".bench",
    "bench_table": ".bench",
    "figure_bundle": ".plotting",
    "downsample": ".plotting",
    "human_bytes": ".plotting",
}

__all__ = sorted(_API)


__getattr__, __dir__ = lazy_names(__name__, globals(), _API)


def warm_up(world_size: int | None = None) -> None:
    """Import plotly, anywidget and the dashboard (seconds; this reads plotly.js too):
    `%load_ext` runs this on a thread, so the first dashboard does not stall a training
    cell's output. With `world_size` (`%mpilab start` runs it while the ranks start), also
    build that many ranks' empty dashboard and a static figure's HTML once: 0.1-0.2 s the
    first training cell would otherwise spend before its dashboard appears."""
    from plotly.subplots import make_subplots

    from . import dashboard, plotting

    fig = make_subplots(rows=2, cols=2)
    if world_size:
        dashboard.Dashboard(None, world_size)._figure_json([])  # cached per world size
        fig.update_layout(template="plotly_white")  # the dashboard's template, loaded
        plotting.figure_bundle(fig)

"""mpilab.widgets: live plotly dashboards of a training run, the cluster and benchmarks.

Importing this package is cheap: plotly and anywidget are imported the first time a
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
}

__all__ = sorted(_API)


__getattr__, __dir__ = lazy_names(__name__, globals(), _API)


def warm_up(world_size: int | None = None) -> None:
    """Import plotly, anywidget and the dashboard (seconds; this reads plotly.js too):
    `%load_ext` runs this on a thread, so the first dashboard does not stall a training
    cell's output.

    With `world_size` (`%mpilab start` runs it while the ranks start) it also prepares
    that many ranks' first dashboard, as an ended run leaves one for the next: the empty
    figure (built and validated once per world size) and a spare live widget, whose
    creation sends plotly.js (4.6 MB) to the frontend, which loads it now rather than
    during the first training cell; and a static figure's HTML once. Together 0.2-0.3 s
    of the notebook's time that the first training cell spent and the second did not.
    """
    import numpy as np
    from plotly.subplots import make_subplots

    from . import dashboard, plotting

    fig = make_subplots(rows=2, cols=2)
    if not world_size:
        return
    figure = dashboard.Dashboard(None, world_size)._figure_json([])  # cached per size
    with dashboard._SPARE_LOCK:  # where a Dashboard takes its widget from
        if not dashboard._SPARE_WIDGETS[world_size]:
            dashboard._SPARE_WIDGETS[world_size].append(dashboard.LivePlot(figure))
    fig.update_layout(template="plotly_white")  # the dashboard's template, loaded
    # numpy data, as the dashboard's: its first conversion to typed arrays looks up
    # plotly's dataframe plugins (entry points)
    fig.add_scatter(x=np.arange(4.0), y=np.ones(4), row=1, col=1)
    plotting.figure_bundle(fig)

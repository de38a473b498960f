"""mpilab.widgets: live plotly dashboards of a training run, the cluster and benchmarks.

Importing this package is cheap: plotly and ipywidgets are imported the first time a
name below is used, so `%load_ext mpilab` stays fast.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it (relative to this package)
_API = {
    "Dashboard": ".dashboard",
    "StatusTable": ".status",
    "status_text": ".status",
    "bench_figure": ".bench",
    "bench_table": ".bench",
    "figure_bundle": ".plotting",
    "downsample": ".plotting",
    "human_bytes": ".plotting",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'mpilab.widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__

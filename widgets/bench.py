"""Plot and table of a communication benchmark (`%mpilab bench`, `mpilab bench`).

Rows come from the ranks' benchmark, one per (backend, message size), with the
nccl-tests definitions: algbw = size / time, busbw = algbw × the op's bus factor
(2(n−1)/n for allreduce). The node's memory-copy bandwidth is drawn as the ceiling
that no intra-node backend can beat.
"""

from __future__ import annotations

import plotly.graph_objects as go
from mpilab.wire import size_text
from plotly.subplots import make_subplots

from .plotting import rank_color

MAX_TICKS = 10


def _backends(rows: list[dict]) -> list[str]:
    """Backends in the order they were measured."""
    return list(dict.fromkeys(row["backend"] for row in rows))


def _measured(rows: list[dict]) -> list[dict]:
    """Rows with figures; a backend that cannot run here has one row with a `note` instead."""
    return [row for row in rows if row.get("time_s") is not None]


def _notes(rows: list[dict]) -> list[str]:
    return [f"{row['backend']}: {row['note']}" for row in rows if row.get("time_s") is None]


def bench_figure(rows: list[dict], memcpy_gbps: float | None = None,
                 notes: bool = True) -> go.Figure:
    """algbw and busbw against message size (log x), one line per backend, memcpy as ceiling.

    `notes`: name the backends that could not run under the plot (not where the table,
    which names them too, is shown beside it)."""
    ops = sorted({row["op"] for row in rows})
    notes = _notes(rows) if notes else []
    rows = _measured(rows)
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=("algorithm bandwidth (algbw)", "bus bandwidth (busbw)"))
    for i, backend in enumerate(_backends(rows)):
        mine = sorted((row for row in rows if row["backend"] == backend),
                      key=lambda row: row["size_bytes"])
        sizes = [row["size_bytes"] for row in mine]
        hover = [f"{size_text(row['size_bytes'], 'B')}: {row['time_s'] * 1e6:,.1f} µs"
                 for row in mine]
        for col, key in ((1, "algbw_GBps"), (2, "busbw_GBps")):
            fig.add_trace(go.Scatter(
                x=sizes, y=[row[key] for row in mine], name=backend, legendgroup=backend,
                showlegend=col == 1, mode="lines+markers", line={"color": rank_color(i)},
                text=hover, hovertemplate=f"{backend} %{{text}}<br>%{{y:.2f}} GB/s<extra></extra>",
            ), row=1, col=col)
    ticks = sorted({row["size_bytes"] for row in rows})
    if memcpy_gbps and ticks:
        # a trace, not add_hline: its annotation lands at 10^y on a log axis
        for col in (1, 2):
            fig.add_trace(go.Scatter(
                x=[ticks[0], ticks[-1]], y=[memcpy_gbps] * 2, mode="lines",
                name=f"memcpy ceiling {memcpy_gbps:.1f} GB/s", legendgroup="memcpy",
                showlegend=col == 1, line={"color": "gray", "dash": "dash"},
                hovertemplate="memcpy %{y:.2f} GB/s<extra></extra>",
            ), row=1, col=col)
    ticks = ticks[::max(1, -(-len(ticks) // MAX_TICKS))]
    fig.update_xaxes(type="log", title_text="message size", tickvals=ticks,
                     ticktext=[size_text(t) for t in ticks])
    # log: small messages are latency-bound, 100× below the large ones
    fig.update_yaxes(type="log", dtick=1, exponentformat="none")  # 0.001, not 1m
    fig.update_yaxes(title_text="GB/s", row=1, col=1)
    if notes:
        fig.add_annotation(text="not measured: " + "; ".join(notes), showarrow=False,
                           xref="paper", yref="paper", x=0, y=-0.25, xanchor="left",
                           yanchor="top",
                           font={"color": "gray"})
    fig.update_layout(title={"text": f"{', '.join(ops) or 'collective'} bandwidth", "x": 0.01},
                      height=420, template="plotly_white",
                      margin={"t": 70, "b": 90 if notes else 50, "l": 60, "r": 20})
    return fig


def bench_table(rows: list[dict], memcpy_gbps: float | None = None) -> str:
    """The measurements as an aligned text table, grouped by backend, sizes ascending;
    then one line per backend that could not run, with the reason, and the memory-copy
    ceiling when given."""
    notes = _notes(rows)
    rows = _measured(rows)
    header = ("op", "backend", "size", "time (µs)", "algbw (GB/s)", "busbw (GB/s)")
    order = {b: i for i, b in enumerate(_backends(rows))}
    body = [
        (row["op"], row["backend"], size_text(row["size_bytes"]), f"{row['time_s'] * 1e6:,.1f}",
         f"{row['algbw_GBps']:.3f}", f"{row['busbw_GBps']:.3f}")
        for row in sorted(rows, key=lambda r: (order[r["backend"]], r["op"], r["size_bytes"]))
    ]
    widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(len(header))]
    left = 2  # text columns are left-aligned, numbers right-aligned
    lines = [
        "  ".join(c.ljust(w) if i < left else c.rjust(w)
                  for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        for cells in [header, *body]
    ]
    lines += [f"not measured: {note}" for note in notes]
    if memcpy_gbps:
        lines.append(f"memory-copy ceiling (one core): {memcpy_gbps:.2f} GB/s")
    return "\n".join(lines)

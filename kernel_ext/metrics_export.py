"""The metrics store's exports: steps and logged scalars as JSON or CSV
(`%mpilab metrics --save`), spans as a Chrome trace (`%mpilab trace --save`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .metrics_store import MetricsStore


def save_metrics(store: MetricsStore, path: str | Path) -> Path:
    """Write step and log records as JSON (everything) or CSV (one row a record); their
    times on the notebook's clock."""
    path = Path(path)
    to_notebook = store.clocks.to_notebook
    rows = [
        {"kind": rec["k"], "rank": rec["r"], "time": to_notebook(rec["r"], rec["t"]),
         **{k: v for k, v in rec.items()
            if k not in ("k", "r", "t", "values", "recv", "_n")},
         **rec.get("values", {})}
        for kind in ("step", "log")
        for rec in store.records(kind)
    ]
    if path.suffix == ".json":
        path.write_text(json.dumps({"world_size": store.world_size, "records": rows}, indent=1))
    elif path.suffix == ".csv":
        columns = sorted({key for row in rows for key in row},
                         key=lambda c: (c not in ("kind", "rank", "time"), c))
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    else:
        raise ValueError(f"{path}: metrics are saved as .json or .csv")
    return path


def chrome_trace(store: MetricsStore) -> dict:
    """Spans as a Chrome trace (chrome://tracing, Perfetto): one process per rank, on
    the notebook's clock (ranks on several hosts line up where their clocks differ)."""
    events = []
    for rank in range(store.world_size):
        offset = store.clocks.offset(rank)
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        for span in store.records("span", rank):
            events.append({
                "ph": "X", "name": span["name"], "cat": span["cat"], "pid": rank,
                "tid": 1 if span["cat"] == "comm" else 0,
                "ts": (span["ts"] + offset) * 1e6, "dur": span["dur"] * 1e6,
                "args": {k: span[k] for k in ("nbytes", "seq") if k in span},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_trace(store: MetricsStore, path: str | Path) -> Path:
    """Write chrome_trace(store) as JSON."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(store)))
    return path

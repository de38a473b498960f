"""The cluster status table: one row per rank, from rank info and the latest heartbeats."""

from __future__ import annotations

import html
import threading

import ipywidgets

from .plotting import WIDGET_VIEW_MIME, human_bytes

STALE_AFTER_S = 5.0  # heartbeats come every 0.5 s; 10 missed ones mean trouble
COLUMNS = ("rank", "host", "pid", "device", "state", "RSS", "device mem", "heartbeat")


def status_rows(rank_info: list[dict], store) -> list[dict[str, str]]:
    """The table as strings, one dict per rank, for both the widget and the text form.

    rank_info: the cluster's dicts (rank, host, pid, device, backend; `dead`, a reason,
    once the watchdog declared the rank dead).
    """
    ages = store.heartbeat_ages()
    beats = dict(store.heartbeats)
    rows = []
    for info in sorted(rank_info, key=lambda i: i["rank"]):
        r = info["rank"]
        hb, age = beats.get(r), ages.get(r)
        device = str(info.get("device", "?"))
        if info.get("backend"):
            device += f" ({info['backend']})"
        row = {"rank": str(r), "host": str(info.get("host", "?")), "pid": str(info.get("pid", "?")),
               "device": device, "state": "no heartbeat", "RSS": "-", "device mem": "-",
               "heartbeat": "never"}
        if hb is not None:
            row["host"], row["pid"] = hb["host"], str(hb["pid"])
            row["state"] = _state(hb)
            row["RSS"] = human_bytes(hb["rss"], "B")
            if hb.get("dev_mem"):
                row["device mem"] = human_bytes(hb["dev_mem"], "B")
        if age is not None:
            row["heartbeat"] = f"{age:.1f} s ago"
            if age > STALE_AFTER_S:
                row["state"] = f"dead? (silent {age:.0f} s)"
        if info.get("dead"):  # the watchdog's verdict, with how the rank died
            row["state"] = f"dead: {info['dead']}"
        rows.append(row)
    return rows


def _state(hb: dict) -> str:
    if hb["phase"] == "collective":
        return f"in {hb['op']} #{hb['seq']} for {hb['op_age']:.1f} s"
    if hb["phase"] == "running":
        return f"running (step {hb['step']})" if hb["step"] else "running"
    return hb["phase"]


def status_text(rank_info: list[dict], store) -> str:
    """The status table as aligned plain text, for terminals and frontends without widgets."""
    rows = status_rows(rank_info, store)
    widths = {c: max([len(c)] + [len(row[c]) for row in rows]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip()]
    lines += ["  ".join(row[c].ljust(widths[c]) for c in COLUMNS).rstrip() for row in rows]
    return "\n".join(lines)


class StatusTable:
    """An HTML table of the ranks that `refresh()` rewrites, or a thread does with `start()`."""

    def __init__(self, rank_info: list[dict], store):
        self.rank_info = rank_info
        self.store = store
        self.widget = ipywidgets.HTML()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()

    def refresh(self) -> None:
        rows = status_rows(self.rank_info, self.store)
        head = "".join(f"<th style='text-align:left;padding:2px 10px'>{c}</th>" for c in COLUMNS)
        body = "".join(
            f"<tr style='{_row_style(row)}'>"
            + "".join(f"<td style='padding:2px 10px'>{html.escape(row[c])}</td>" for c in COLUMNS)
            + "</tr>"
            for row in rows
        )
        self.widget.value = (f"<table class='mpilab-status' style='border-collapse:collapse;"
                             f"font-family:monospace'><thead><tr>{head}</tr></thead>"
                             f"<tbody>{body}</tbody></table>")

    def start(self, interval_s: float = 1.0) -> None:
        """Keep the table live (ages tick, states change) while the kernel is idle."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(interval_s,),
                                            name="mpilab-status", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if self.widget.comm is None:  # closed by the user or the kernel
                return
            self.refresh()

    def mimebundle(self) -> dict:
        """The widget, plus the same table as HTML and text for frontends without widgets."""
        return {
            WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0,
                               "model_id": self.widget.model_id},
            "text/html": self.widget.value,
            "text/plain": status_text(self.rank_info, self.store),
        }

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return self.mimebundle()


def _row_style(row: dict[str, str]) -> str:
    if row["state"].startswith(("dead", "no heartbeat")):
        return "background:#fde0dc"
    if row["state"].startswith("in "):
        return "background:#fff4d6"
    return ""

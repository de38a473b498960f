"""The cluster status table: one row per rank, from rank info and the latest heartbeats.

Shown, it is live: a thread rewrites it every TICK_S while a view of it is on screen
(heartbeat ages, states, collectives, memory; a rank that died or cannot be reached at
once), and sleeps while every view is out of sight (scrolled away, a collapsed output, a
background tab): each view tells the kernel when it comes into and goes out of sight.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable

import anywidget
import traitlets

from .plotting import WIDGET_VIEW_MIME, human_bytes

# the watchdog's bound for a rank it cannot see the process of (mpilab.watchdog's
# DEAD_HEARTBEAT_S: heartbeats come every 0.5 s, 10 missed ones mean trouble)
STALE_AFTER_S = 5.0
LATE_AFTER_S = 1.5  # three heartbeats missed: said in the heartbeat column
# not a multiple of the heartbeats' 0.5 s: ages sampled in step with them would read
# the same at every tick and the table would look frozen
TICK_S = 0.7
COLUMNS = ("rank", "host", "pid", "device", "state", "RSS", "device mem", "heartbeat")
RankInfo = list[dict] | Callable[[], list[dict]]

# Each view renders the table's HTML and tells the kernel whether it is in sight (an
# IntersectionObserver, and the page's visibility); a removed view counts as out of sight.
_STATUS_JS = r"""
let nextView = 0;
export default {
  render({ model, el }) {
    const id = `${Date.now()}-${nextView++}`;
    const draw = () => { el.innerHTML = model.get("value"); };
    draw();
    model.on("change:value", draw);
    let onScreen = true, sent = null;
    const tell = () => {
      const visible = onScreen && document.visibilityState !== "hidden";
      if (visible !== sent) { sent = visible; model.send({ view: id, visible }); }
    };
    const observer = new IntersectionObserver((entries) => {
      onScreen = entries.some((e) => e.isIntersecting);
      tell();
    });
    observer.observe(el);
    document.addEventListener("visibilitychange", tell);
    return () => {
      observer.disconnect();
      document.removeEventListener("visibilitychange", tell);
      model.off("change:value", draw);
      model.send({ view: id, visible: false });
    };
  },
};
"""


class StatusView(anywidget.AnyWidget):
    """The table's HTML in the browser; its views report whether they are in sight."""

    _esm = _STATUS_JS
    value = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.views: dict[str, bool] = {}  # view id -> in sight; none reported yet: unknown
        self.seen = threading.Event()  # set while a view may be in sight
        self.seen.set()
        self.on_msg(self._on_view)

    def _on_view(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and "view" in content:
            self.views[str(content["view"])] = bool(content.get("visible"))
            if any(self.views.values()):
                self.seen.set()
            else:
                self.seen.clear()

    @property
    def in_sight(self) -> bool:
        return self.seen.is_set()


def status_rows(rank_info: list[dict], store) -> list[dict[str, str]]:
    """The table as strings, one dict per rank, for both the widget and the text form.

    rank_info: the cluster's dicts (rank, host, pid, device, backend; `dead`, a reason,
    once the rank is known dead: the watchdog's verdict, or its process gone).
    """
    ages = store.heartbeat_ages() if store is not None else {}
    beats = dict(store.heartbeats) if store is not None else {}
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
            if age > LATE_AFTER_S:
                row["heartbeat"] += " (late)"
            if age > STALE_AFTER_S:  # the watchdog's words for a rank it cannot see
                row["state"] = f"cannot be reached: no heartbeat for {age:.0f} s"
        if info.get("dead"):  # how the rank died
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
    """An HTML table of the ranks that `refresh()` rewrites, or a thread does with `start()`.

    rank_info: the ranks' dicts, or a function that returns them as they are now (a
    rank's death, the cluster stopped: then the table stops ticking).
    """

    def __init__(self, rank_info: RankInfo, store):
        self._rank_info = rank_info
        self.store = store
        self.widget = StatusView()
        self.refreshes = 0
        self.stopped = False  # the ranks it shows are gone: it no longer ticks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()

    @property
    def rank_info(self) -> list[dict]:
        info = self._rank_info
        return info() if callable(info) else info

    def refresh(self) -> None:
        info = self.rank_info
        rows = status_rows(info, self.store)
        if info and all(i.get("stopped") for i in info):
            self.stopped = True
        head = "".join(f"<th style='text-align:left;padding:2px 10px'>{c}</th>" for c in COLUMNS)
        body = "".join(
            f"<tr style='{_row_style(row)}'>"
            + "".join(f"<td style='padding:2px 10px'>{html.escape(row[c])}</td>" for c in COLUMNS)
            + "</tr>"
            for row in rows
        )
        when = "stopped" if self.stopped else f"as of {time.strftime('%H:%M:%S')}"
        self.widget.value = (f"<table class='mpilab-status' style='border-collapse:collapse;"
                             f"font-family:monospace'><thead><tr>{head}</tr></thead>"
                             f"<tbody>{body}</tbody></table>"
                             f"<div class='mpilab-status-time' style='font:11px monospace;"
                             f"color:#888;padding:2px 10px'>{when}</div>")
        self.refreshes += 1

    def start(self, interval_s: float = TICK_S) -> None:
        """Keep the table live (ages tick, states change) while the kernel is idle."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(interval_s,),
                                            name="mpilab-status", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.widget.seen.set()  # wake the thread to end

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            # out of sight: sleep until a view is back (or the table is stopped)
            while not self.widget.seen.wait(1.0):
                if self._stop.is_set():
                    return
            if self._stop.is_set() or self.widget.comm is None:  # closed
                return
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a table that cannot be read stays as it was
                return
            if self.stopped:
                return

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
    if row["state"].startswith(("dead", "no heartbeat", "cannot be reached", "stopped")):
        return "background:#fde0dc"
    if row["state"].startswith("in "):
        return "background:#fff4d6"
    return ""

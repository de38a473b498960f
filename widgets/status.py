"""The cluster status table: one row per rank, from rank info and the latest heartbeats.

Past SUMMARY_ABOVE_RANKS ranks a table of every rank is too long to read: the view shows
a summary instead (how many ranks in each state, per host) and the outliers a user looks
for (dead, silent, behind the others, most memory), with the full table one click away.

Shown, it is live: a thread rewrites it every TICK_S while a view of it is on screen
(heartbeat ages, states, collectives, memory; a rank that died or cannot be reached at
once), and sleeps while every view is out of sight (scrolled away, a collapsed output, a
background tab): each view tells the kernel when it comes into and goes out of sight.
"""

from __future__ import annotations

import html
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import anywidget
import traitlets
from mpilab.wire import size_text

from .plotting import WIDGET_VIEW_MIME

# the watchdog's bound for a rank it cannot see the process of (mpilab.watchdog's
# DEAD_HEARTBEAT_S: heartbeats come every 0.5 s, 10 missed ones mean trouble)
STALE_AFTER_S = 5.0
LATE_AFTER_S = 1.5  # three heartbeats missed: said in the heartbeat column
# not a multiple of the heartbeats' 0.5 s: ages sampled in step with them would read
# the same at every tick and the table would look frozen
TICK_S = 0.7
COLUMNS = ("rank", "host", "pid", "device", "state", "RSS", "device mem", "heartbeat")
# past this many ranks the view is a summary with the outliers, and the full table folds
SUMMARY_ABOVE_RANKS = 32
OUTLIERS_NAMED = 3  # per kind (slowest, most memory); every dead or silent rank, up to
MAX_LISTED = 12  # ... this many named, then a count
MEMORY_SHARE = 1.2  # a rank is named for its memory from this many times the median
# a folded full table is rebuilt at most this often (it is the costly part: a row per
# rank); an open one at every tick
FOLDED_TABLE_EVERY_S = 5.0
RankInfo = list[dict] | Callable[[], list[dict]]

# Each view renders the table's HTML and tells the kernel whether it is in sight (an
# IntersectionObserver, and the page's visibility); a removed view counts as out of sight.
_STATUS_JS = r"""
let nextView = 0;
export default {
  render({ model, el }) {
    const id = `${Date.now()}-${nextView++}`;
    // the table (or the summary), then, past SUMMARY_ABOVE_RANKS ranks, the full table
    // folded in a <details> that stays open or closed across the kernel's updates
    const head = document.createElement("div");
    const full = document.createElement("details");
    full.className = "mpilab-status-full";
    const label = document.createElement("summary");
    label.style.cssText = "cursor:pointer;font:12px monospace;color:#333;padding:2px 10px";
    const body = document.createElement("div");
    full.append(label, body);
    el.append(head, full);
    const draw = () => {
      head.innerHTML = model.get("value");
      const table = model.get("table");
      full.style.display = table ? "" : "none";
      label.textContent = model.get("table_label");
      if (full.open) body.innerHTML = table;
    };
    full.addEventListener("toggle", () => {
      if (full.open) body.innerHTML = model.get("table");
      model.send({ view: id, full: full.open });
    });
    draw();
    model.on("change:value", draw);
    model.on("change:table", draw);
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
      model.off("change:table", draw);
      model.send({ view: id, visible: false, full: false });
    };
  },
};
"""


class StatusView(anywidget.AnyWidget):
    """The table's HTML in the browser; its views report whether they are in sight."""

    _esm = _STATUS_JS
    value = traitlets.Unicode("").tag(sync=True)  # the table, or past 32 ranks the summary
    table = traitlets.Unicode("").tag(sync=True)  # the full table, folded ("": none)
    table_label = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.views: dict[str, bool] = {}  # view id -> in sight; none reported yet: unknown
        self.unfolded: dict[str, bool] = {}  # view id -> its full table is open
        self.seen = threading.Event()  # set while a view may be in sight
        self.seen.set()
        self.on_msg(self._on_view)

    def _on_view(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and "full" in content and "view" in content:
            self.unfolded[str(content["view"])] = bool(content["full"])
        if isinstance(content, dict) and "view" in content and "visible" in content:
            self.views[str(content["view"])] = bool(content.get("visible"))
            if any(self.views.values()):
                self.seen.set()
            else:
                self.seen.clear()

    @property
    def in_sight(self) -> bool:
        return self.seen.is_set()

    @property
    def full_open(self) -> bool:
        return any(self.unfolded.values())


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
            row["RSS"] = size_text(hb["rss"], "B")
            if hb.get("dev_mem"):
                row["device mem"] = size_text(hb["dev_mem"], "B")
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


def _summary_of(rows: list[dict[str, str]], store) -> StatusSummary:
    beats = dict(store.heartbeats) if store is not None else {}
    ages = store.heartbeat_ages() if store is not None else {}
    return status_summary(rows, beats, ages)


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
    lines = []
    if len(rows) > SUMMARY_ABOVE_RANKS:  # the summary first, then every rank
        lines += summary_lines(_summary_of(rows, store)) + [""]
    lines += ["  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip()]
    lines += ["  ".join(row[c].ljust(widths[c]) for c in COLUMNS).rstrip() for row in rows]
    return "\n".join(lines)


@dataclass
class StatusSummary:
    """The ranks in numbers, for a view of many ranks: state -> count, host -> state ->
    count, and the outliers as (kind, rank, why) in the order a user looks for them."""

    ranks: int = 0
    states: Counter = field(default_factory=Counter)
    hosts: dict[str, Counter] = field(default_factory=dict)
    outliers: list[tuple[str, int, str]] = field(default_factory=list)


def state_kind(state: str) -> str:
    """A row's state as a category to count (its step, collective and age left out)."""
    for prefix, kind in (("dead", "dead"), ("cannot be reached", "cannot be reached"),
                         ("no heartbeat", "no heartbeat"), ("in ", "in a collective"),
                         ("running", "running")):
        if state.startswith(prefix):
            return kind
    return state


def status_summary(rows: list[dict[str, str]], beats: dict[int, dict],
                   ages: dict[int, float]) -> StatusSummary:
    """Counts per state and per host, and the outliers: every dead rank, every silent one
    (no heartbeat, or late), the slowest (the lowest step counter of the ranks running
    a cell, when below the others'; the longest in one collective), the most memory
    (RSS, then device memory, from MEMORY_SHARE times the median: the rank that leaks
    or holds a larger shard). Only ranks known alive count for the last two: a dead
    rank's last heartbeat is old news."""
    summary = StatusSummary(ranks=len(rows))
    for row in rows:
        kind = state_kind(row["state"])
        summary.states[kind] += 1
        summary.hosts.setdefault(row["host"], Counter())[kind] += 1
    out = summary.outliers
    for row in rows:
        if row["state"].startswith("dead"):
            out.append(("dead", int(row["rank"]), row["state"][len("dead: "):]))
    for row in rows:
        r = int(row["rank"])
        if row["state"].startswith(("cannot be reached", "no heartbeat")):
            out.append(("silent", r, row["state"]))
        elif ages.get(r, 0.0) > LATE_AFTER_S and not row["state"].startswith("dead"):
            out.append(("silent", r, f"last heartbeat {ages[r]:.1f} s ago"))
    # the ranks whose heartbeat tells how they are now (not a dead or silent one's last)
    alive = {int(row["rank"]) for row in rows
             if state_kind(row["state"]) in ("running", "in a collective", "idle")}
    beats = {r: hb for r, hb in beats.items() if r in alive}
    busy = {r: hb for r, hb in beats.items()
            if hb.get("phase") in ("running", "collective") and hb.get("step")}
    if busy:
        newest = max(hb["step"] for hb in busy.values())
        behind = sorted((hb["step"], r) for r, hb in busy.items() if hb["step"] < newest)
        out += [("slowest", r, f"at step {step}, others up to {newest}")
                for step, r in behind[:OUTLIERS_NAMED]]
    waiting = sorted(((hb.get("op_age", 0.0), r) for r, hb in beats.items()
                      if hb.get("phase") == "collective"), reverse=True)
    if waiting and waiting[0][0] > LATE_AFTER_S:
        age, r = waiting[0]
        out.append(("slowest", r, f"in {beats[r]['op']} #{beats[r]['seq']} for {age:.1f} s"))
    for key, what in (("rss", "RSS"), ("dev_mem", "device memory")):
        sizes = sorted(((hb.get(key) or 0, r) for r, hb in beats.items()), reverse=True)
        if not sizes:
            continue
        typical = sizes[len(sizes) // 2][0]  # the median
        out += [("most memory", r, f"{what} {size_text(size, 'B')}, "
                                   f"median {size_text(typical, 'B')}")
                for size, r in sizes[:OUTLIERS_NAMED] if size and size >= MEMORY_SHARE * typical]
    return summary


def _named(items: list[str]) -> str:
    shown = items[:MAX_LISTED]
    more = f", and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return ", ".join(shown) + more


def summary_lines(summary: StatusSummary) -> list[str]:
    """The summary as lines of text: the counts, per host, the outliers by kind."""
    def counts(counter: Counter) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in counter.most_common())

    lines = [f"{summary.ranks} ranks on {len(summary.hosts)} hosts: {counts(summary.states)}"]
    lines += [f"  {host}: {counts(states)}" for host, states in sorted(summary.hosts.items())]
    for kind in ("dead", "silent", "slowest", "most memory"):
        found = [f"rank {r} ({why})" for k, r, why in summary.outliers if k == kind]
        if found:
            lines.append(f"{kind}: {_named(found)}")
    return lines


def _summary_html(summary: StatusSummary) -> str:
    """The summary as the view shows it: the counts, a row per host, the outliers."""
    lines = summary_lines(summary)
    hosts = [line for line in lines[1:] if line.startswith("  ")]
    outliers = [line for line in lines[1:] if not line.startswith("  ")]
    rows = "".join(f"<tr><td style='padding:1px 10px'>{html.escape(h.strip())}</td></tr>"
                   for h in hosts[:MAX_LISTED])
    if len(hosts) > MAX_LISTED:
        rows += (f"<tr><td style='padding:1px 10px;color:#888'>and {len(hosts) - MAX_LISTED}"
                 " more hosts (in the full table)</td></tr>")
    listed = "".join(
        f"<li class='mpilab-status-outlier' style='{_outlier_style(line)}'>"
        f"{html.escape(line)}</li>" for line in outliers)
    return (f"<div class='mpilab-status-summary' style='font:12px monospace;padding:2px 10px'>"
            f"<b>{html.escape(lines[0])}</b>"
            f"<table class='mpilab-status-hosts' style='border-collapse:collapse'>{rows}</table>"
            f"<ul style='margin:2px 0;padding-left:18px'>{listed or '<li>no outliers</li>'}</ul>"
            f"</div>")


def _outlier_style(line: str) -> str:
    if line.startswith(("dead", "silent")):
        return "background:#fde0dc"
    if line.startswith("slowest"):
        return "background:#fff4d6"
    return ""


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
        self._table_at = -float("inf")  # when the folded full table was last rebuilt
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
        when = "stopped" if self.stopped else f"as of {time.strftime('%H:%M:%S')}"
        stamp = (f"<div class='mpilab-status-time' style='font:11px monospace;"
                 f"color:#888;padding:2px 10px'>{when}</div>")
        if len(rows) <= SUMMARY_ABOVE_RANKS:
            self.widget.value = _table_html(rows) + stamp
        else:
            now = time.monotonic()
            with self.widget.hold_sync():
                self.widget.value = _summary_html(_summary_of(rows, self.store)) + stamp
                if (self.widget.full_open or self.stopped
                        or now - self._table_at >= FOLDED_TABLE_EVERY_S):
                    self._table_at = now
                    self.widget.table = _table_html(rows)
                    self.widget.table_label = f"full table ({len(rows)} ranks)"
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
        folded = ""
        if self.widget.table:
            folded = (f"<details><summary>{html.escape(self.widget.table_label)}</summary>"
                      f"{self.widget.table}</details>")
        return {
            WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0,
                               "model_id": self.widget.model_id},
            "text/html": self.widget.value + folded,
            "text/plain": status_text(self.rank_info, self.store),
        }

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return self.mimebundle()


def _table_html(rows: list[dict[str, str]]) -> str:
    """Every rank's row."""
    head = "".join(f"<th style='text-align:left;padding:2px 10px'>{c}</th>" for c in COLUMNS)
    body = "".join(
        f"<tr style='{_row_style(row)}'>"
        + "".join(f"<td style='padding:2px 10px'>{html.escape(row[c])}</td>" for c in COLUMNS)
        + "</tr>"
        for row in rows
    )
    return (f"<table class='mpilab-status' style='border-collapse:collapse;"
            f"font-family:monospace'><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _row_style(row: dict[str, str]) -> str:
    if row["state"].startswith(("dead", "no heartbeat", "cannot be reached", "stopped")):
        return "background:#fde0dc"
    if row["state"].startswith("in "):
        return "background:#fff4d6"
    return ""

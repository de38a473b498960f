"""A cell's output rank by rank, beside the merged view.

The runner's merged output (identical lines once, each line naming its ranks) stays the
cell's output; this bar above it lists the ranks, failing ones marked, and shows one
rank's own output when its button is pressed, live while the cell runs. Past
BUTTONS_UP_TO ranks a button per rank is a wall of buttons: the bar has a selector of
the ranks instead (failing ranks first, marked, and each a button of its own), and a
filter that keeps the ranks whose output holds a text (a `nan`, an error's words). A
saved notebook opened without the widget shows a one-line summary instead
(text/plain), under which the merged output stays readable.

Each tick sends only the output that arrived since the last one (a custom message,
numbered): at 256 ranks the whole text of every rank in each update would grow with the
run. The widget's state holds every rank's text as of a numbered update, rewritten at
most every SNAPSHOT_EVERY_S and at the end; the page keeps each widget's texts from when
its model is made (before a view has loaded) and applies the newer updates, and a page
reloaded starts again from the state. The
browser filters and selects by itself: while the cell runs the kernel does not read
the view's messages.
"""

from __future__ import annotations

import threading
import time
import uuid

import anywidget
import traitlets
from mpilab.wire import format_ranks

from .plotting import WIDGET_VIEW_MIME

MAX_CHARS = 200_000  # per rank: the newest output; the merged view keeps the rest
MIN_SEND_INTERVAL_S = 0.25  # at most 4 updates a second, whatever the output rate
SNAPSHOT_EVERY_S = 5.0  # the state's full texts, for views that open later
BUTTONS_UP_TO = 16  # ranks with a button each; past this, a selector and a filter
MAX_FAILED_BUTTONS = 16  # failing ranks with a button of their own past BUTTONS_UP_TO

_RANK_OUTPUT_JS = r"""
// Every rank's text as this page knows it, per widget (its `key`): the state's, then the
// updates after it. Kept from when the widget's model is made (initialize), before any
// view: an update that arrives while the first view is still loading is not lost.
const KNOWN = new Map();

const known = (model) => {
  const key = model.get("key");
  let k = KNOWN.get(key);
  if (!k) {
    k = { texts: {}, tails: {}, seq: -1, views: new Set() };
    KNOWN.set(key, k);
  }
  return k;
};

export default {
  initialize({ model }) {
    const k = known(model);
    const fromState = () => {
      if (model.get("seq") < k.seq) return;
      k.texts = { ...model.get("texts") };
      k.tails = { ...model.get("tails") };
      k.seq = model.get("seq");
      k.views.forEach((draw) => draw(null));
    };
    // the kernel's numbered updates: the output each rank printed since the last one
    const onUpdate = (msg) => {
      if (!msg || msg.seq === undefined || msg.seq <= k.seq) return;
      k.seq = msg.seq;
      for (const [r, text] of Object.entries(msg.append || {})) {
        const all = (k.texts[r] || "") + text;
        k.texts[r] = all.length > MAX_CHARS ? all.slice(all.length - MAX_CHARS) : all;
      }
      // each rank's line still being written (a bar redrawn in place), as it stands
      const changed = { ...(msg.append || {}) };
      if (msg.tails) {
        for (const r of new Set([...Object.keys(k.tails), ...Object.keys(msg.tails)])) {
          if (k.tails[r] !== msg.tails[r]) changed[r] = "";
        }
        k.tails = msg.tails;
      }
      k.views.forEach((draw) => draw(changed));
    };
    fromState();
    model.on("msg:custom", onUpdate);
    model.on("change:texts", fromState);
    return () => {
      model.off("msg:custom", onUpdate);
      model.off("change:texts", fromState);
      KNOWN.delete(model.get("key"));
    };
  },
  render({ model, el }) {
    let selected = null;  // null: the merged view below is the one to read
    let filter = "";
    const k = known(model);
    const bar = document.createElement("div");
    bar.className = "mpilab-rank-tabs";
    bar.style.cssText = "font:12px monospace;display:flex;flex-wrap:wrap;gap:4px;" +
                        "align-items:center;padding:2px 0";
    const pre = document.createElement("pre");
    pre.className = "mpilab-rank-output";
    pre.style.cssText = "max-height:24em;overflow:auto;margin:4px 0;padding:4px 8px;" +
                        "background:#f7f7f7;border-left:3px solid #999;display:none";
    // past BUTTONS_UP_TO ranks: a selector of the ranks and a filter of their output
    const select = document.createElement("select");
    select.className = "mpilab-rank-select";
    select.style.cssText = "font:12px monospace;max-width:16em";
    select.onchange = () => {
      selected = select.value === "" ? null : Number(select.value);
      draw();
    };
    const find = document.createElement("input");
    find.className = "mpilab-rank-filter";
    find.type = "search";
    find.placeholder = "ranks whose output has…";
    find.style.cssText = "font:12px monospace;width:14em";
    find.oninput = () => { filter = find.value; draw(); };
    const count = document.createElement("span");
    count.className = "mpilab-rank-count";
    count.style.color = "#666";
    el.append(bar, pre);
    const button = (label, key, failed) => {
      const b = document.createElement("button");
      b.textContent = label;
      b.dataset.rank = key === null ? "merged" : String(key);
      const on = selected === key;
      b.style.cssText = "font:12px monospace;padding:1px 8px;cursor:pointer;border-radius:3px;" +
        `border:1px solid ${failed ? "#c62828" : "#aaa"};` +
        `background:${on ? (failed ? "#c62828" : "#555") : (failed ? "#fde0dc" : "#fff")};` +
        `color:${on ? "#fff" : (failed ? "#c62828" : "#222")}`;
      if (failed) b.classList.add("mpilab-rank-failed");
      b.onclick = () => { selected = key; draw(); };
      return b;
    };
    const mark = (r, failed) => (failed.has(r) ? `rank ${r} \u2717` : `rank ${r}`);
    const drawSelector = (ranks, failed) => {
      // the failing ranks first, then the others; only those whose output has `filter`
      const wanted = filter ? ranks.filter((r) => (k.texts[String(r)] || "").includes(filter))
                            : ranks;
      const ordered = [...wanted.filter((r) => failed.has(r)),
                       ...wanted.filter((r) => !failed.has(r))];
      const first = document.createElement("option");
      first.value = "";
      first.textContent = filter ? `${ordered.length} of ${ranks.length} ranks`
                                 : `rank… (${ranks.length})`;
      select.replaceChildren(first, ...ordered.map((r) => {
        const o = document.createElement("option");
        o.value = String(r);
        o.textContent = mark(r, failed);
        if (failed.has(r)) o.style.color = "#c62828";
        return o;
      }));
      select.value = selected === null || !wanted.includes(selected) ? "" : String(selected);
      count.textContent = failed.size ? `${failed.size} failed` : "";
      const shown = [...failed].sort((a, b) => a - b).slice(0, MAX_FAILED_BUTTONS);
      return [select, find, count, ...shown.map((r) => button(mark(r, failed), r, true))];
    };
    const draw = () => {
      const failed = new Set(model.get("failed"));
      const ranks = model.get("ranks");
      const label = document.createElement("span");
      label.textContent = "output:";
      const rest = ranks.length > BUTTONS_UP_TO ? drawSelector(ranks, failed)
        : ranks.map((r) => button(mark(r, failed), r, failed.has(r)));
      bar.replaceChildren(label, button("merged", null, false), ...rest);
      if (selected === null) { pre.style.display = "none"; return; }
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      const tail = k.tails[String(selected)] || "";
      pre.textContent = (k.texts[String(selected)] || "") + tail || "(no output)";
      pre.style.display = "block";
      if (atEnd) pre.scrollTop = pre.scrollHeight;  // follows the output, unless read above
    };
    // new output (`append`: rank -> text; null: the state was read again); the bar
    // changes with it only under a filter (which ranks match)
    const onNew = (append) => {
      if (append === null || filter) draw();
      else if (selected !== null && String(selected) in append) draw();
    };
    draw();
    k.views.add(onNew);
    model.on("change:failed", draw);
    model.on("change:ranks", draw);
    return () => {
      k.views.delete(onNew);
      model.off("change:failed", draw);
      model.off("change:ranks", draw);
    };
  },
};
"""


class RankOutputView(anywidget.AnyWidget):
    """Each rank's output text and which ranks failed, for the per-rank bar."""

    _esm = (f"const BUTTONS_UP_TO = {BUTTONS_UP_TO};\n"
            f"const MAX_FAILED_BUTTONS = {MAX_FAILED_BUTTONS};\n"
            f"const MAX_CHARS = {MAX_CHARS};\n{_RANK_OUTPUT_JS}")
    key = traitlets.Unicode().tag(sync=True)  # the page's name for this widget's texts
    ranks = traitlets.List(traitlets.Int()).tag(sync=True)
    texts = traitlets.Dict().tag(sync=True)  # str(rank) -> that rank's output, as of `seq`
    # str(rank) -> its line still being written, as it stands (as of `seq`)
    tails = traitlets.Dict().tag(sync=True)
    seq = traitlets.Int(-1).tag(sync=True)  # the last update `texts` includes
    failed = traitlets.List(traitlets.Int()).tag(sync=True)


class RankOutputs:
    """Collects a cell's output per rank as it arrives and keeps the view up to date:
    what arrived is sent at most every MIN_SEND_INTERVAL_S (`tick`), and at once at
    `finish`."""

    clock = staticmethod(time.monotonic)

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self._texts = {r: [] for r in self.ranks}
        self._chars = {r: 0 for r in self.ranks}
        self._new: dict[int, list[str]] = {}  # rank -> what arrived since the last send
        self._tails: dict[str, str] = {}  # str(rank) -> its unfinished line, as it stands
        self._tails_sent: dict[str, str] = {}
        self._failed: list[int] = []
        self._sent_at = -float("inf")
        self._snapshot_at = -float("inf")
        self._seq = -1
        self._lock = threading.Lock()
        self.sends = 0
        self.display_id: str | None = None  # the output that shows it (the runner's)
        self.view = RankOutputView(ranks=self.ranks, key=uuid.uuid4().hex)

    def feed(self, rank: int, text: str) -> None:
        if not text or rank not in self._texts:
            return
        with self._lock:
            parts = self._texts[rank]
            parts.append(text)
            self._chars[rank] += len(text)
            while self._chars[rank] > MAX_CHARS and len(parts) > 1:
                self._chars[rank] -= len(parts.pop(0))
            self._new.setdefault(rank, []).append(text)

    def set_unfinished(self, lines: dict[int, str]) -> None:
        """Each rank's line still being written, as it stands (rank -> line; a rank
        left out has none): shown after its output until the line ends."""
        with self._lock:
            self._tails = {str(r): line for r, line in lines.items() if line}

    def tick(self, force: bool = False) -> bool:
        """Send what arrived if the last send is old enough; whether it sent."""
        now = self.clock()
        tails_changed = self._tails != self._tails_sent
        if not (self._new or tails_changed) or (
                not force and now - self._sent_at < MIN_SEND_INTERVAL_S):
            return False
        with self._lock:
            new, self._new = self._new, {}
            tails = self._tails_sent = self._tails
            self._seq += 1
            seq = self._seq
            snapshot = force or now - self._snapshot_at >= SNAPSHOT_EVERY_S
            texts = ({str(r): "".join(parts)[-MAX_CHARS:] for r, parts in self._texts.items()}
                     if snapshot else None)
        self._sent_at = now
        message = {"seq": seq, "append": {str(r): "".join(parts)[-MAX_CHARS:]
                                          for r, parts in new.items()}}
        if tails_changed:
            message["tails"] = tails
        self.view.send(message)
        if texts is not None:
            self._snapshot_at = now
            with self.view.hold_sync():
                self.view.texts = texts
                self.view.tails = tails
                self.view.seq = seq
        self.sends += 1
        return True

    def finish(self, failed: list[int]) -> None:
        self._failed = sorted(set(failed))
        self.tick(force=True)
        if self.view.seq != self._seq:  # nothing new to send: the state, as it is
            with self._lock:
                texts = {str(r): "".join(parts)[-MAX_CHARS:] for r, parts in self._texts.items()}
            with self.view.hold_sync():
                self.view.texts = texts
                self.view.tails = self._tails_sent
                self.view.seq = self._seq
        self.view.failed = self._failed

    def text(self, rank: int) -> str:
        with self._lock:
            return "".join(self._texts.get(rank, []))

    def summary(self) -> str:
        """The view's one line for frontends without widgets (a saved notebook)."""
        failed = f"; failed: {_ranks_text(self._failed)}" if self._failed else ""
        return f"[per-rank output of ranks {_ranks_text(self.ranks)}{failed}]"

    def mimebundle(self) -> dict:
        return {WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0,
                                   "model_id": self.view.model_id},
                "text/plain": self.summary()}


def _ranks_text(ranks: list[int]) -> str:
    """0, 1, 2, 3 (up to 8 ranks), or runs: 0-255 (256 ranks), 0-2, 4-9."""
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    return format_ranks(ranks).replace(",", ", ")

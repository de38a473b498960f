"""A cell's output rank by rank, beside the merged view.

The runner's merged output (identical lines once, each line naming its ranks) stays the
cell's output; this bar above it lists the ranks, failing ones marked, and shows one
rank's own output when its button is pressed, live while the cell runs. A saved notebook
opened without the widget shows a one-line summary instead (text/plain), under which the
merged output stays readable.
"""

from __future__ import annotations

import threading
import time

import anywidget
import traitlets

from .plotting import WIDGET_VIEW_MIME

MAX_CHARS = 200_000  # per rank: the newest output; the merged view keeps the rest
MIN_SEND_INTERVAL_S = 0.25  # at most 4 updates a second, whatever the output rate

_RANK_OUTPUT_JS = r"""
export default {
  render({ model, el }) {
    let selected = null;  // null: the merged view below is the one to read
    const bar = document.createElement("div");
    bar.className = "mpilab-rank-tabs";
    bar.style.cssText = "font:12px monospace;display:flex;flex-wrap:wrap;gap:4px;" +
                        "align-items:center;padding:2px 0";
    const pre = document.createElement("pre");
    pre.className = "mpilab-rank-output";
    pre.style.cssText = "max-height:24em;overflow:auto;margin:4px 0;padding:4px 8px;" +
                        "background:#f7f7f7;border-left:3px solid #999;display:none";
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
    const draw = () => {
      const failed = new Set(model.get("failed"));
      const label = document.createElement("span");
      label.textContent = "output:";
      bar.replaceChildren(label, button("merged", null, false),
        ...model.get("ranks").map((r) =>
          button(failed.has(r) ? `rank ${r} \u2717` : `rank ${r}`, r, failed.has(r))));
      if (selected === null) { pre.style.display = "none"; return; }
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.textContent = model.get("texts")[String(selected)] || "(no output)";
      pre.style.display = "block";
      if (atEnd) pre.scrollTop = pre.scrollHeight;  // follows the output, unless read above
    };
    draw();
    model.on("change:texts", draw);
    model.on("change:failed", draw);
    model.on("change:ranks", draw);
    return () => {
      model.off("change:texts", draw);
      model.off("change:failed", draw);
      model.off("change:ranks", draw);
    };
  },
};
"""


class RankOutputView(anywidget.AnyWidget):
    """Each rank's output text and which ranks failed, for the per-rank bar."""

    _esm = _RANK_OUTPUT_JS
    ranks = traitlets.List(traitlets.Int()).tag(sync=True)
    texts = traitlets.Dict().tag(sync=True)  # str(rank) -> that rank's output
    failed = traitlets.List(traitlets.Int()).tag(sync=True)


class RankOutputs:
    """Collects a cell's output per rank as it arrives and keeps the view up to date,
    at most every MIN_SEND_INTERVAL_S (`tick`), and at once at `finish`."""

    clock = staticmethod(time.monotonic)

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self._texts = {r: [] for r in self.ranks}
        self._chars = {r: 0 for r in self.ranks}
        self._failed: list[int] = []
        self._dirty = False
        self._sent_at = -float("inf")
        self._lock = threading.Lock()
        self.sends = 0
        self.display_id: str | None = None  # the output that shows it (the runner's)
        self.view = RankOutputView(ranks=self.ranks)

    def feed(self, rank: int, text: str) -> None:
        if not text or rank not in self._texts:
            return
        with self._lock:
            parts = self._texts[rank]
            parts.append(text)
            self._chars[rank] += len(text)
            while self._chars[rank] > MAX_CHARS and len(parts) > 1:
                self._chars[rank] -= len(parts.pop(0))
            self._dirty = True

    def tick(self, force: bool = False) -> bool:
        """Send what arrived if the last send is old enough; whether it sent."""
        now = self.clock()
        if not self._dirty or (not force and now - self._sent_at < MIN_SEND_INTERVAL_S):
            return False
        with self._lock:
            texts = {str(r): "".join(parts)[-MAX_CHARS:] for r, parts in self._texts.items()}
            self._dirty = False
        self._sent_at = now
        self.view.texts = texts
        self.sends += 1
        return True

    def finish(self, failed: list[int]) -> None:
        self._failed = sorted(set(failed))
        self._dirty = True
        self.tick(force=True)
        self.view.failed = self._failed

    def text(self, rank: int) -> str:
        with self._lock:
            return "".join(self._texts.get(rank, []))

    def summary(self) -> str:
        """The view's one line for frontends without widgets (a saved notebook)."""
        failed = f"; failed: {', '.join(map(str, self._failed))}" if self._failed else ""
        return f"[per-rank output of ranks {', '.join(map(str, self.ranks))}{failed}]"

    def mimebundle(self) -> dict:
        return {WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0,
                                   "model_id": self.view.model_id},
                "text/plain": self.summary()}

"""What appears under a running `%%ranks` cell besides its text: the training dashboard,
rank 0's progress bar, and the ranks' lines still being written. The runner calls
`tick()` on every relay tick and `finish()` at the end; both are cheap when the cell
logs nothing. Once shown, the dashboard redraws itself as records arrive
(`Dashboard.follow`)."""

from __future__ import annotations

import html
import time
import uuid

from IPython.display import display, update_display

from .cell_window import CellWindow

PROGRESS_MIN_INTERVAL_S = 0.25
CELL_END_WAIT_S = 1.0


class LiveViews:
    def __init__(self, store, world_size: int, dashboard: bool, msg_ids: dict[int, str]):
        """msg_ids: rank -> the cell's execute request there (ipyparallel's msg id)."""
        from mpilab.widgets import Dashboard

        self.store = store
        self.cell = CellWindow(time.time(), msg_ids)
        self.dashboard = Dashboard(store, world_size, cell=self.cell) if dashboard else None
        self._dashboard_id: str | None = None
        self._progress_id: str | None = None
        self._progress_shown: tuple | None = None
        self._progress_at = 0.0
        self._version = -1

    def tick(self) -> None:
        if self.store.version != self._version:
            self._version = self.store.version
            self._progress()
        dash = self.dashboard
        if dash is None:
            return
        if self._dashboard_id is None and dash.has_data():
            # shown, it follows the store: the record receiver's thread redraws it
            self._dashboard_id = uuid.uuid4().hex
            display(dash.mimebundle(), raw=True, display_id=self._dashboard_id)

    def finish(self, ranks: list[int] | None = None) -> None:
        """Final drawing; with `ranks`, first wait (briefly) for their last records."""
        if ranks:
            self._wait_for_cell_end(ranks)
        self._version = -1
        self._progress(final=True)
        dash = self.dashboard
        if dash is None:
            return
        if self._dashboard_id is not None:
            dash.refresh(force=True)
            update_display(dash.mimebundle(final=True), raw=True,
                           display_id=self._dashboard_id)
        elif dash.has_data():  # a cell whose records all came after its last tick
            self._dashboard_id = uuid.uuid4().hex
            display(dash.mimebundle(final=True), raw=True, display_id=self._dashboard_id)

    def _wait_for_cell_end(self, ranks: list[int]) -> None:
        """Records travel apart from the cell's reply: wait for each rank's end marker."""
        deadline = time.monotonic() + CELL_END_WAIT_S
        while time.monotonic() < deadline:
            if self.cell.ended(self.store).issuperset(ranks):
                return
            time.sleep(0.002)

    def _progress(self, final: bool = False) -> None:
        bounds = self.cell.bounds(self.store).get(0)  # rank 0 reports progress
        last = None if bounds is None else self.store.latest_event("progress", 0, *bounds)
        if last is None:
            return
        state = (last.get("n"), last.get("total"), last.get("desc"))
        now = time.monotonic()
        if state == self._progress_shown or (
                not final and now - self._progress_at < PROGRESS_MIN_INTERVAL_S):
            return
        self._progress_shown, self._progress_at = state, now
        bundle = progress_bundle(last)
        if self._progress_id is None:
            self._progress_id = uuid.uuid4().hex
            display(bundle, raw=True, display_id=self._progress_id)
        else:
            update_display(bundle, raw=True, display_id=self._progress_id)


class TextInPlace:
    """Plain text under the cell, redrawn in place at most PROGRESS_MIN_INTERVAL_S apart
    (the ranks' lines in progress). Emptied, it is left empty; text after that starts a
    new one under whatever was written meanwhile, so it follows the output, while one
    that is showing stays where it is (each move would leave an empty output behind)."""

    def __init__(self) -> None:
        self._id: str | None = None
        self._shown = ""
        self._at = 0.0
        self._written = -1  # the cell's output count when it was displayed

    def show(self, text: str, written: int, now: float) -> None:
        """`written`: how much the cell has output so far (any growing count)."""
        showing = self._shown
        if text == showing or (text and showing and now - self._at < PROGRESS_MIN_INTERVAL_S):
            return
        self._shown, self._at = text, now
        bundle = {"text/plain": text} if text else {}
        if self._id is not None and (showing or not text or self._written == written):
            update_display(bundle, raw=True, display_id=self._id)
        else:
            self._id, self._written = uuid.uuid4().hex, written
            display(bundle, raw=True, display_id=self._id)


def progress_bundle(event: dict) -> dict:
    n, total = int(event.get("n", 0)), int(event.get("total", 0))
    elapsed = float(event.get("elapsed", 0.0))
    rate = n / elapsed if elapsed > 0 else 0.0
    desc = str(event.get("desc", ""))
    count = f"{n}/{total}" if total else f"{n}"
    text = f"{desc + ': ' if desc else ''}{count} [{elapsed:.1f} s, {rate:.1f} it/s]"
    bar = (f"<progress value='{n}' max='{total}' style='width:40%'></progress> "
           if total else "")
    return {"text/plain": text,
            "text/html": f"<div class='mpilab-progress'>{bar}{html.escape(text)}</div>"}

"""The metrics store: bounded per-rank buffers of what the ranks reported, which the
widgets, the watchdog and the exporters read.

The receiver files each round of messages here (`add_messages`): heartbeats (the newest
per rank), events (bounded per rank; progress and checkpoint events keep only their
newest), and the per-step kinds as tables of float64 rows (mpilab.row_tables), checked
a round at a time (mpilab.records). The dashboard reads new rows as arrays (`new_rows`).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .cell_window import Bounds, CellMarks
from .metrics_export import chrome_trace, save_metrics, save_trace
from .rank_clocks import RankClocks
from .records import check_blocks, well_formed
from .row_tables import MAX_STORE_ROWS, MIN_TABLE_ROWS, TABLE_BYTES_PER_ROW, RowTable, TableBudget
from .wire import HEARTBEAT, ROWS, TABLES, decode, encode

# Events whose newest alone matters: each replaces the last one of its rank, and they
# outlive clear() (state, not metrics). A progress bar reports 5 times a second; kept,
# its events would push the rare ones (a cell's end) out of the bounded buffers within
# an hour, and readers would scan them. A checkpoint is named when the ranks restart.
LATEST_ONLY_EVENTS = frozenset({"progress", "checkpoint"})
# A cell's start and end events, found by its execute request: what the runner, the
# watchdog and the dashboard ask for every tick of a running cell, at a cost that does
# not grow with the cells run before it. Kept for this many cells a rank, newest last.
CELL_EVENTS = frozenset({"cell-start", "cell-end"})
CELLS_KEPT = 4096


@dataclass
class MetricsStore:
    """Bounded per-rank buffers of what the ranks reported. Thread-safe."""

    world_size: int
    max_per_rank: int = 20_000  # rows per table (a rank's steps, one scalar, ...), events
    # rows of all tables together: each table keeps max_rows / tables, at least
    # MIN_TABLE_ROWS; the tables' arrays take at most TABLE_BYTES_PER_ROW bytes a row
    max_rows: int = MAX_STORE_ROWS
    dropped: int = 0
    received: int = 0  # records filed (a table's row counts as one)
    version: int = 0  # bumps on every filing; readers poll it cheaply
    events: int = 0  # events filed into the buffers (a cell's start and end among them)
    beats: int = 0  # heartbeats filed: a reader of `heartbeats` polls it cheaply
    heartbeats: dict = field(default_factory=dict)  # rank -> newest; its "at" is its "t"
    # on the notebook's clock (`clocks`)
    clocks: RankClocks = field(default_factory=RankClocks)  # each rank's clock's offset
    _latest: dict = field(default_factory=dict)  # (what, rank) -> newest LATEST_ONLY event
    last_seen: dict = field(default_factory=dict)  # rank -> monotonic time of last record
    _buffers: dict = field(default_factory=dict)  # (kind, rank) -> records (events)
    _cells: dict = field(default_factory=dict)  # rank -> {msg id: {what: cell event}}
    _tables: dict = field(default_factory=dict)  # kind -> (rank, labels) -> RowTable
    _budget: TableBudget | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _listeners: list = field(default_factory=list)

    def subscribe(self, listener) -> None:
        """Call `listener()` on the receiver's thread after each round of records: a
        reader that must be quick (the dashboard) acts when data comes, without polling."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

    def unsubscribe(self, listener) -> None:
        with self._lock:
            self._listeners = [other for other in self._listeners if other != listener]

    def notify(self) -> None:
        """A round of records is filed: tell the listeners (the receiver calls this)."""
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - one reader's failure must not stop the channel
                logging.getLogger("mpilab").exception(
                    "metrics listener %r failed; it gets no more rounds", listener)
                self.unsubscribe(listener)

    def add_raw(self, raw: bytes) -> bool:
        """Decode and file one message (a record or a batch of them); anything
        malformed is dropped and counted. True when every record was filed."""
        return self.add_messages([raw]) == 0

    def add_messages(self, raws: list[bytes]) -> int:
        """Decode and file messages (the receiver's round of them) in one go: their
        blocks of rows are checked together, a few array operations per table. Returns
        how many records were dropped."""
        records = []
        for raw in raws:
            records += decode(raw)
        now, monotonic_now = time.time(), time.monotonic()
        with self._lock:  # one acquisition per round, not one per record
            return self._file_all(records, now, monotonic_now)

    def add(self, record: dict) -> bool:
        """File one record made by hand (tests, tools) as a rank would send it: through
        the ranks' encoder (mpilab.wire.encode), then as the receiver files a message."""
        rank = record.get("r") if type(record) is dict else None
        messages = encode(rank, [record]) if type(record) is dict and "k" in record else []
        if not messages:  # not a record the encoder makes a message of
            with self._lock:
                self.dropped += 1
            return False
        return self.add_messages(messages) == 0

    def _file_all(self, records: list, now: float, monotonic_now: float) -> int:
        """File records as they arrived, in order but for the blocks of rows, which go
        first (an event such as a cell's end follows the rows before it); returns how
        many were dropped. The lock is held."""
        world_size = self.world_size
        dropped = 0
        blocks: dict[str, list[dict]] = {}
        others = []
        for record in records:
            if not well_formed(record, world_size):
                dropped += 1
            elif record["k"] == ROWS:
                blocks.setdefault(record["of"], []).append(record)
            else:
                others.append(record)
        last_seen = self.last_seen
        filed = 0
        for kind, of_kind in blocks.items():
            rows, spans = check_blocks(kind, [record["data"] for record in of_kind])
            stamped = np.empty((len(rows), rows.shape[1] + 1))  # the rows, then when filed
            stamped[:, :-1] = rows
            stamped[:, -1] = now
            tables = self._tables.setdefault(kind, {})
            for record, span in zip(of_kind, spans):
                if span is None:
                    dropped += 1
                    continue
                rank = record["r"]
                key = (rank, tuple(record["labels"]))
                table = tables.get(key)
                if table is None:
                    table = self._table(kind, *key)
                table.put(stamped[span])
                self.received += span.stop - span.start  # a row counts as a record
                last_seen[rank] = monotonic_now
                filed += 1
        for record in others:
            rank, kind = record["r"], record["k"]
            record["recv"] = now
            if kind == HEARTBEAT:
                record["at"] = self.clocks.heard(rank, record["t"], now)
                self.heartbeats[rank] = record
                self.beats += 1
            elif record["what"] in LATEST_ONLY_EVENTS:
                self._latest[(record["what"], rank)] = record
            else:
                buf = self._buffers.get((kind, rank))
                if buf is None:
                    buf = self._buffers[(kind, rank)] = _Records(maxlen=self.max_per_rank)
                buf.ordered = buf.ordered and (not buf or record["t"] >= buf[-1]["t"])
                buf.append(record)
                self.events += 1
                if record["what"] in CELL_EVENTS and "msg" in record:
                    self._file_cell_event(rank, record)
            self.received += 1
            last_seen[rank] = monotonic_now
            filed += 1
        self.version += filed
        self.dropped += dropped
        return dropped

    def _file_cell_event(self, rank: int, record: dict) -> None:
        cells = self._cells.get(rank)
        if cells is None:
            cells = self._cells[rank] = {}
        marks = cells.get(record["msg"])
        if marks is None:
            if len(cells) >= CELLS_KEPT:
                del cells[next(iter(cells))]
            marks = cells[record["msg"]] = {}
        marks[record["what"]] = record

    def _table(self, kind: str, rank: int, labels: tuple) -> RowTable:
        tables = self._tables.setdefault(kind, {})
        rows = tables.get((rank, labels))
        if rows is None:
            if self._budget is None:
                self._budget = TableBudget(self.max_per_rank, self.max_rows)
            self._budget.add_table()
            rows = tables[(rank, labels)] = RowTable(len(TABLES[kind].columns), self._budget)
        return rows

    def table_cap(self) -> int:
        """The most bytes the tables' arrays may take: 2 * max(max_rows, tables *
        MIN_TABLE_ROWS) rows of TABLE_BYTES_PER_ROW."""
        with self._lock:
            tables = self._budget.tables if self._budget else 0
        return 2 * max(self.max_rows, tables * MIN_TABLE_ROWS) * TABLE_BYTES_PER_ROW

    def table_bytes(self) -> int:
        """The bytes the tables' arrays take (the bulk of the store: steps, spans and
        logged scalars)."""
        with self._lock:
            return sum(rows.data.nbytes for tables in self._tables.values()
                       for rows in tables.values())

    def new_rows(self, kind: str, position: dict, upto: dict | None = None,
                 window: Bounds | None = None) -> list[tuple[int, tuple, np.ndarray]]:
        """(rank, labels, rows) of a tabular kind filed since `position`, which it moves
        on (to `upto`'s, when given: another reader's position). For readers that take
        each row once, however long the run: a copy of the new rows, columns as in the
        kind's Table, then the time each was filed. With `window`, only its ranks' rows
        stamped within their bounds; the other ranks' rows stay to be taken (a rank's
        window may not be known yet)."""
        keys, parts = [], []
        with self._lock:
            for key, table in self._tables.get(kind, {}).items():
                if window is not None and key[0] not in window:
                    continue
                serial, first = position.get(key, (table.serial, 0))
                if serial != table.serial:
                    first = 0  # the store was cleared since
                end = table.end if upto is None else upto.get(key, (table.serial, 0))[1]
                rows = table.between(first, end)
                position[key] = (table.serial, max(first, end))
                if len(rows):
                    keys.append(key)
                    parts.append(rows)
            if not parts:
                return []
            # one copy of every table's new rows, and one comparison with the windows:
            # 1,024 ranks' tables on every redraw
            joined = np.concatenate(parts)
        counts = [len(rows) for rows in parts]
        if window is not None:
            bounds = np.array([window[key[0]] for key in keys])
            since, until = np.repeat(bounds, counts, axis=0).T
            inside = (joined[:, 0] >= since) & (joined[:, 0] <= until)
            if not inside.all():
                kept = np.add.reduceat(inside, np.cumsum([0, *counts[:-1]]))
                keys = [key for key, n in zip(keys, kept.tolist()) if n]
                counts = [n for n in kept.tolist() if n]
                joined = joined[inside]
        return [(*key, rows) for key, rows in
                zip(keys, np.split(joined, np.cumsum(counts[:-1])))]

    def records(self, kind: str, rank: int | None = None, since: float = 0.0) -> list[dict]:
        """Records of one kind (all ranks unless `rank`) stamped at or after `since`
        (epoch s), oldest first. Tabular kinds are made into records here: for exports
        and tests; the dashboard reads rows (`new_rows`)."""
        ranks = range(self.world_size) if rank is None else [rank]
        with self._lock:
            if kind in TABLES:
                out = [record for r in ranks for record in self._table_records(kind, r, since)]
            else:  # events: the cell's own, read on every relay tick
                out = [rec for r in ranks for rec in _newer_than(self._buffers.get((kind, r)),
                                                                 since)]
        out.sort(key=lambda rec: rec["t"])
        return out

    def _table_records(self, kind: str, rank: int, since: float) -> list[dict]:
        table = TABLES[kind]
        columns = (*table.columns, "recv")
        records: list[dict] = []
        logged: dict[tuple, dict] = {}  # (t, step) -> a log record: its scalars together
        for (r, labels), rows in self._tables.get(kind, {}).items():
            if r != rank:
                continue
            kept = rows.between()
            for row in kept[kept[:, 0] >= since].tolist():
                fields = dict(zip(columns, row))
                for column in table.ints:
                    value = fields.pop(column)
                    if value == value:  # not NaN: present
                        fields[column] = int(value)
                if kind != "log":
                    records.append({"k": kind, "r": rank, **dict(zip(table.labels, labels)),
                                    **fields})
                    continue
                record = logged.get((fields["t"], fields["step"]))
                if record is None:
                    record = logged[(fields["t"], fields["step"])] = {
                        "k": "log", "r": rank, "t": fields["t"], "step": fields["step"],
                        "values": {}, "recv": fields["recv"]}
                    records.append(record)
                record["values"][labels[0]] = fields["value"]
        return records

    def latest_event(self, what: str, rank: int, since: float = 0.0,
                     until: float = math.inf) -> dict | None:
        """The newest event of a LATEST_ONLY_EVENTS kind from `rank`, if stamped between
        `since` and `until`."""
        with self._lock:
            event = self._latest.get((what, rank))
        return event if event is not None and since <= event["t"] <= until else None

    def has_rows(self, kinds: tuple[str, ...], window: Bounds) -> bool:
        """True when a table of these kinds has a row of a rank in `window`, within its
        bounds."""
        with self._lock:
            return any(len(_within(rows.between(), window[rank]))
                       for kind in kinds for (rank, _), rows in self._tables.get(kind, {}).items()
                       if rank in window)

    def cell_marks(self, msg_ids: dict[int, str]) -> dict[int, CellMarks]:
        """The cell each rank ran for the execute request `msg_ids` names, for the ranks
        that have begun it."""
        marks = {}
        no_cell: dict = {}
        with self._lock:
            cells = self._cells
            for rank, msg_id in msg_ids.items():
                mine = cells.get(rank, no_cell).get(msg_id, no_cell)
                start, end = mine.get("cell-start"), mine.get("cell-end")
                if start is not None:
                    marks[rank] = CellMarks(start["t"], math.inf if end is None else end["t"],
                                            int(start.get("cell", 0)))
        return marks

    def heartbeat_ages(self, over: float = -math.inf) -> dict[int, float]:
        """rank -> seconds since its last record, of the ranks silent longer than `over`
        (the watchdog asks 20 times a second for the few silent ones of 1,024)."""
        now = time.monotonic()
        since = now - over
        with self._lock:
            return {r: now - t for r, t in self.last_seen.items() if t < since}

    def clear(self) -> None:
        """Forget the metrics of the previous runs. Heartbeats and events stay: they are
        state (a running cell's window is read from its start and end events)."""
        with self._lock:
            self._buffers = {key: buf for key, buf in self._buffers.items()
                             if key[0] == "event"}
            self._tables.clear()
            self._budget = None
            self.version += 1

    # -- exporters (mpilab.metrics_export) ---------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write step and log records as JSON (everything) or CSV (one row a record)."""
        return save_metrics(self, path)

    def chrome_trace(self) -> dict:
        """Spans as a Chrome trace (chrome://tracing, Perfetto): one process per rank."""
        return chrome_trace(self)

    def save_trace(self, path: str | Path) -> Path:
        return save_trace(self, path)


class _Records(collections.deque):
    """One kind's records from one rank, and whether their times only ever went up."""

    ordered = True


def _newer_than(buf: _Records | None, since: float) -> list[dict]:
    """The records at or after `since`; in time order, scanning back from the newest:
    a reader costs what the current cell sent, not the history."""
    if not buf:
        return []
    if not buf.ordered:
        return [rec for rec in buf if rec["t"] >= since]
    newer = []
    for rec in reversed(buf):
        if rec["t"] < since:
            break
        newer.append(rec)
    newer.reverse()
    return newer


def _within(rows: np.ndarray, bounds: tuple[float, float]) -> np.ndarray:
    """The rows stamped within (from, until)."""
    since, until = bounds
    times = rows[:, 0]
    return rows[(times >= since) & (times <= until)]

"""The notebook's end of the rank→notebook record channel, and the metrics store.

Ranks PUSH msgpack records; one receiver thread here PULLs them, validates each
(the channel carries data, never code: msgpack only, known kinds, typed fields) and
files them into bounded per-rank buffers that the widgets, the watchdog and the
exporters read. The per-step kinds arrive as blocks of float64 rows (agent.TABLES):
a block is checked and filed as a whole, and the dashboard reads new rows as arrays.
"""

from __future__ import annotations

import collections
import csv
import itertools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import zmq

from .rank.agent import MAX_TABLE_ROWS, TABLES, table_rows

# kind -> fields that must be present, with their types
_NUM = (int, float)
RECORD_SCHEMA: dict[str, dict[str, tuple]] = {
    "hb": {"pid": (int,), "host": (str,), "phase": (str,), "op": (str,), "seq": (int,),
           "op_age": _NUM, "rss": (int,), "step": (int,)},
    "step": {"step": (int,), "dur": _NUM, "compute": _NUM, "comm": _NUM,
             "nbytes": (int,), "samples": (int,)},
    "log": {"step": (int,), "values": (dict,)},
    "span": {"name": (str,), "cat": (str,), "ts": _NUM, "dur": _NUM},
    "event": {"what": (str,)},
    "rows": {"of": (str,), "labels": (list,), "data": (bytes,)},  # a block of a table
}
# Events whose newest alone matters: each replaces the last one of its rank, and they
# outlive clear() (state, not metrics). A progress bar reports 5 times a second; kept,
# its events would push the rare ones (a cell's end) out of the bounded buffers within
# an hour, and readers would scan them. A checkpoint is named when the ranks restart.
LATEST_ONLY_EVENTS = frozenset({"progress", "checkpoint"})
# how far the ranks' clocks may lag the notebook's (hosts kept in step by NTP): a cell's
# start is looked for from this long before it was run
CLOCK_SKEW_S = 60.0
MAX_MESSAGE_BYTES = 256 * 1024  # a batch of records from one rank
MAX_BATCH_RECORDS = 1000
# The ranks send at the same moments (agent.SEND_INTERVAL_S); their batches count as
# one round until the socket has been quiet this long, and a round ends after at most:
ROUND_QUIET_S = 0.01
ROUND_MAX_S = 0.05
# The tables' memory cap: MAX_STORE_ROWS rows kept in all, however many ranks (1,024
# ranks' steps, loss and a kind of span: 3,072 tables of 325 rows), at most twice that
# allocated, at most TABLE_BYTES_PER_ROW bytes a row (the widest table: steps' 7 columns
# and the filing time): 128 MB. A table keeps at least MIN_TABLE_ROWS, so past
# MAX_STORE_ROWS / MIN_TABLE_ROWS tables the cap grows with them (MetricsStore.table_cap).
MAX_STORE_ROWS = 1_000_000
MIN_TABLE_ROWS = 250
TABLE_BYTES_PER_ROW = 8 * (1 + max(len(table.columns) for table in TABLES.values()))


def validate(record, world_size: int) -> bool:
    """True for a well-formed record from a rank of this cluster."""
    return _well_formed(record, world_size) and (
        record["k"] != "rows" or block_rows(record) is not None)


def _well_formed(record, world_size: int) -> bool:
    """validate() but for a block's rows, which its filing checks as it reads them."""
    if not isinstance(record, dict):
        return False
    schema = RECORD_SCHEMA.get(record.get("k"))
    rank = record.get("r")
    if schema is None or type(rank) is not int or not 0 <= rank < world_size:
        return False
    if not isinstance(record.get("t"), _NUM):
        return False
    for name, types in schema.items():
        value = record.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            return False
    if record["k"] == "log":
        return all(isinstance(k, str) and isinstance(v, _NUM) for k, v in record["values"].items())
    return True


def block_rows(record: dict) -> np.ndarray | None:
    """The rows of a `rows` record, or None when it is not a block of its table: known
    table, its labels, whole rows, finite times and whole numbers where the table has
    them (NaN where a column is optional)."""
    table = TABLES.get(record["of"])
    labels = record["labels"]
    if table is None or len(labels) != len(table.labels) or not all(
            isinstance(label, str) for label in labels):
        return None
    width = 8 * len(table.columns)
    data = record["data"]
    if not data or len(data) % width or len(data) // width > MAX_TABLE_ROWS:
        return None
    rows = np.frombuffer(data, dtype=np.float64).reshape(-1, len(table.columns))
    if not np.isfinite(rows[:, 0]).all():
        return None
    for name, column in zip(table.columns, rows.T):
        if name in table.ints:
            whole = np.isfinite(column) & (column == np.round(column))
            if name in table.optional:
                whole |= np.isnan(column)
            if not whole.all():
                return None
    return rows


def _table_blocks(record: dict) -> list[tuple[str, tuple, np.ndarray]] | None:
    """(kind, labels, rows) that a well-formed block, or a record of a tabular kind,
    adds to the tables; None when its numbers are not numbers (optional fields)."""
    if record["k"] == "rows":
        rows = block_rows(record)
        return None if rows is None else [(record["of"], tuple(record["labels"]), rows)]
    try:
        return [(kind, labels, np.array([row], dtype=float))
                for kind, labels, row in table_rows(record)]
    except (TypeError, ValueError):
        return None


class _Budget:
    """The rows each table of a store keeps: the store's row budget shared by its
    tables, so its memory stays within a cap however many ranks and tables there are
    (MetricsStore.max_rows)."""

    def __init__(self, max_per_rank: int, max_rows: int):
        self.max_per_rank = max_per_rank
        self.max_rows = max_rows
        self.tables = 0
        self.limit = max_per_rank

    def add_table(self) -> None:
        self.tables += 1
        self.limit = min(self.max_per_rank, max(MIN_TABLE_ROWS, self.max_rows // self.tables))


class _Rows:
    """One table's rows from one rank and labels, with the time they were filed: the
    newest `limit` (the store's budget says how many); a row's number counts from the
    table's first. Its array holds at most 2 * limit rows."""

    serials = itertools.count()

    def __init__(self, width: int, budget: _Budget):
        self.data = np.empty((64, width + 1))  # the columns, then the filing time
        self.n = 0
        self.dropped = 0  # rows before data[0]
        self.budget = budget
        self.serial = next(self.serials)  # readers' positions belong to one table

    @property
    def limit(self) -> int:
        return self.budget.limit

    def append(self, rows: np.ndarray, now: float) -> None:
        limit = self.budget.limit
        if len(rows) > limit:  # more than is kept: the newest `limit` replace all
            self.dropped += self.n + len(rows) - limit
            self.n = 0
            rows = rows[-limit:]
        end = self.n + len(rows)
        if end > 2 * limit:  # amortised: down to the newest `limit` rows
            drop = end - limit
            keep = self.n - drop
            if len(self.data) > 2 * limit:  # the budget shrank since the array grew
                smaller = np.empty((2 * limit, self.data.shape[1]))
                smaller[:keep] = self.data[drop:self.n]
                self.data = smaller
            else:
                self.data[:keep] = self.data[drop:self.n]
            self.n = keep
            self.dropped += drop
            end = limit
        if end > len(self.data):
            grown = np.empty((min(max(2 * len(self.data), end), 2 * limit),
                              self.data.shape[1]))
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        self.data[self.n:end, :-1] = rows
        self.data[self.n:end, -1] = now
        self.n = end

    @property
    def end(self) -> int:
        """The number of the row after the newest."""
        return self.dropped + self.n

    def between(self, first: int = 0, end: int | None = None) -> np.ndarray:
        """The kept rows (the newest `limit`) numbered from `first` to before `end`."""
        first = max(first - self.dropped, self.n - self.limit, 0)
        last = self.n if end is None else max(first, min(self.n, end - self.dropped))
        return self.data[first:last]


Bounds = dict[int, tuple[float, float]]  # rank -> (from, until), epoch s: one run's records


@dataclass(frozen=True)
class CellMarks:
    """One cell on one rank, from its cell-start and cell-end events."""

    start: float
    end: float  # inf while it runs
    number: int  # the rank's count of cells: its heartbeats carry it


@dataclass
class CellWindow:
    """Which records are one cell's. A cell may wait on the ranks behind a --noblock one,
    so per rank they are those between its cell-start and cell-end events there, which
    name the cell's execute request. Without `msg_ids`: every rank's from `since` on."""

    since: float  # epoch s: when the cell was run (it begins on the ranks later)
    msg_ids: dict[int, str] | None = None  # rank -> the cell's execute request there
    _marks: dict[int, CellMarks] = field(default_factory=dict)
    _events_read: int = -1  # the store's count of events when the marks were read

    def bounds(self, store: MetricsStore) -> Bounds:
        """The ranks whose records count now, and from when until when."""
        if self.msg_ids is None:
            return {r: (self.since, math.inf) for r in range(store.world_size)}
        return {r: (m.start, m.end) for r, m in self._read(store).items()}

    def numbers(self, store: MetricsStore) -> dict[int, int]:
        """rank -> the cell's number there (its heartbeats carry it), once begun there;
        none without `msg_ids`, as the numbers come from the ranks' cell-start events."""
        return {r: m.number for r, m in self._read(store).items()}

    def _read(self, store: MetricsStore) -> dict[int, CellMarks]:
        # read again until the cell ends everywhere, when an event came since (the
        # watchdog asks 20 times a second: at 1,024 ranks a read cost ~10 ms)
        events = store.events
        if events != self._events_read and (
                len(self._marks) < len(self.msg_ids or ()) or any(
                    m.end == math.inf for m in self._marks.values())):
            self._events_read = events
            self._marks = store.cell_marks(self.msg_ids or {}, self.since)
        return self._marks

    def started(self, store: MetricsStore) -> float | None:
        """When the first rank began the cell (epoch s), once one has."""
        bounds = self.bounds(store)
        return min(start for start, _ in bounds.values()) if bounds else None

    def ended(self, store: MetricsStore) -> set[int]:
        return {r for r, (_, end) in self.bounds(store).items() if end != math.inf}


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
    heartbeats: dict = field(default_factory=dict)
    _latest: dict = field(default_factory=dict)  # (what, rank) -> newest LATEST_ONLY event
    last_seen: dict = field(default_factory=dict)  # rank -> monotonic time of last record
    _buffers: dict = field(default_factory=dict)  # (kind, rank) -> records (events)
    _tables: dict = field(default_factory=dict)  # kind -> (rank, labels) -> _Rows
    _budget: _Budget | None = None
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
        try:
            if len(raw) > MAX_MESSAGE_BYTES:
                raise ValueError("oversized")
            payload = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                      ext_hook=_refuse_ext)
        except Exception:  # noqa: BLE001 - any undecodable payload is dropped
            payload = None
        if not (isinstance(payload, list) and 0 < len(payload) <= MAX_BATCH_RECORDS
                and all(isinstance(record, dict) for record in payload)):
            payload = [payload]  # anything else is one malformed message
        now, monotonic_now = time.time(), time.monotonic()
        with self._lock:  # one acquisition per batch, not one per record
            filed = [self._file(record, now, monotonic_now) for record in payload]
        return all(filed)

    def add(self, record) -> bool:
        with self._lock:
            return self._file(record, time.time(), time.monotonic())

    def _file(self, record, now: float, monotonic_now: float) -> bool:
        """File one record (the lock is held)."""
        if not _well_formed(record, self.world_size):
            return self._drop()
        rank, kind = record["r"], record["k"]
        if kind == "rows" or kind in TABLES:
            made = _table_blocks(record)
            if made is None:
                return self._drop()
            for of, labels, rows in made:
                self._table(of, rank, labels).append(rows, now)
            # a row counts as a record; a record as one, whatever rows it made
            self.received += len(made[0][2]) if kind == "rows" else 1
        else:
            record["recv"] = now
            if kind == "hb":
                self.heartbeats[rank] = record
            elif kind == "event" and record["what"] in LATEST_ONLY_EVENTS:
                self._latest[(record["what"], rank)] = record
            else:
                buf = self._buffers.get((kind, rank))
                if buf is None:
                    buf = self._buffers[(kind, rank)] = _Records(maxlen=self.max_per_rank)
                buf.ordered = buf.ordered and (not buf or record["t"] >= buf[-1]["t"])
                buf.append(record)
                self.events += 1
            self.received += 1
        self.last_seen[rank] = monotonic_now
        self.version += 1
        return True

    def _drop(self) -> bool:
        self.dropped += 1
        return False

    def _table(self, kind: str, rank: int, labels: tuple) -> _Rows:
        tables = self._tables.setdefault(kind, {})
        rows = tables.get((rank, labels))
        if rows is None:
            if self._budget is None:
                self._budget = _Budget(self.max_per_rank, self.max_rows)
            self._budget.add_table()
            rows = tables[(rank, labels)] = _Rows(len(TABLES[kind].columns), self._budget)
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
        out = []
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
                if window is not None:
                    rows = _within(rows, window[key[0]])
                if len(rows):
                    out.append((*key, rows.copy()))
        return out

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

    def cell_marks(self, msg_ids: dict[int, str], since: float) -> dict[int, CellMarks]:
        """The cell each rank ran for the execute request `msg_ids` names, for the ranks
        that have begun it; `since`: when it was run."""
        marks = {}
        with self._lock:
            for rank, msg_id in msg_ids.items():
                events = _newer_than(self._buffers.get(("event", rank)), since - CLOCK_SKEW_S)
                mine = {e["what"]: e for e in events if e.get("msg") == msg_id}
                start, end = mine.get("cell-start"), mine.get("cell-end")
                if start is not None:
                    marks[rank] = CellMarks(start["t"], math.inf if end is None else end["t"],
                                            int(start.get("cell", 0)))
        return marks

    def heartbeat_ages(self) -> dict[int, float]:
        now = time.monotonic()
        with self._lock:
            return {r: now - t for r, t in self.last_seen.items()}

    def clear(self) -> None:
        """Forget the metrics of the previous runs. Heartbeats and events stay: they are
        state (a running cell's window is read from its start and end events)."""
        with self._lock:
            self._buffers = {key: buf for key, buf in self._buffers.items()
                             if key[0] == "event"}
            self._tables.clear()
            self._budget = None
            self.version += 1

    # -- exporters -------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write step and log records as JSON (everything) or CSV (one row a record)."""
        path = Path(path)
        rows = [
            {"kind": rec["k"], "rank": rec["r"], "time": rec["t"],
             **{k: v for k, v in rec.items()
                if k not in ("k", "r", "t", "values", "recv", "_n")},
             **rec.get("values", {})}
            for kind in ("step", "log")
            for rec in self.records(kind)
        ]
        if path.suffix == ".json":
            path.write_text(json.dumps({"world_size": self.world_size, "records": rows}, indent=1))
        elif path.suffix == ".csv":
            columns = sorted({key for row in rows for key in row},
                             key=lambda c: (c not in ("kind", "rank", "time"), c))
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(rows)
        else:
            raise ValueError(f"{path.name}: metrics are saved as .json or .csv")
        return path

    def chrome_trace(self) -> dict:
        """Spans as a Chrome trace (chrome://tracing, Perfetto): one process per rank."""
        events = []
        for rank in range(self.world_size):
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                           "args": {"name": f"rank {rank}"}})
            for span in self.records("span", rank):
                events.append({
                    "ph": "X", "name": span["name"], "cat": span["cat"], "pid": rank,
                    "tid": 1 if span["cat"] == "comm" else 0,
                    "ts": span["ts"] * 1e6, "dur": span["dur"] * 1e6,
                    "args": {k: span[k] for k in ("nbytes", "seq") if k in span},
                })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace()))
        return path


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


def _refuse_ext(code, data):
    raise ValueError("msgpack extension types are not accepted")


class RecordReceiver:
    """Binds the PULL socket and files every record into a MetricsStore."""

    def __init__(self, store: MetricsStore, ip: str = "127.0.0.1"):
        self.store = store
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        port = self._sock.bind_to_random_port(f"tcp://{ip}")
        self.address = f"tcp://{ip}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpilab-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            round_ends = time.monotonic() + ROUND_MAX_S
            self._drain()
            while time.monotonic() < round_ends and poller.poll(1e3 * ROUND_QUIET_S):
                self._drain()
            self.store.notify()

    def _drain(self) -> None:
        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.store.add_raw(raw)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()

"""The notebook's end of the rank→notebook record channel, and the metrics store.

Ranks PUSH msgpack records; one receiver thread here PULLs them, validates each
(the channel carries data, never code: msgpack only, known kinds, typed fields) and
files them into bounded per-rank buffers that the widgets, the watchdog and the
exporters read.
"""

from __future__ import annotations

import collections
import csv
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import zmq

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
}
MAX_MESSAGE_BYTES = 256 * 1024  # a batch of records from one rank
MAX_BATCH_RECORDS = 1000
# The ranks send at the same moments (agent.SEND_INTERVAL_S); their batches count as
# one round until the socket has been quiet this long, and a round ends after at most:
ROUND_QUIET_S = 0.01
ROUND_MAX_S = 0.05


def validate(record, world_size: int) -> bool:
    """True for a well-formed record from a rank of this cluster."""
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


@dataclass
class MetricsStore:
    """Bounded per-rank buffers of what the ranks reported. Thread-safe."""

    world_size: int
    max_per_rank: int = 20_000
    dropped: int = 0
    received: int = 0
    version: int = 0  # bumps on every accepted record; readers poll it cheaply
    heartbeats: dict = field(default_factory=dict)
    last_seen: dict = field(default_factory=dict)  # rank -> monotonic time of last record
    _buffers: dict = field(default_factory=dict)
    _unordered: set = field(default_factory=set)  # buffers whose times ever went back
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

    def _buffer(self, kind: str, rank: int) -> collections.deque:
        key = (kind, rank)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = collections.deque(maxlen=self.max_per_rank)
        return buf

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
        if not validate(record, self.world_size):
            self.dropped += 1
            return False
        record["recv"] = now
        record["_n"] = self.received + 1  # arrival order: readers resume after it
        rank = record["r"]
        self.last_seen[rank] = monotonic_now
        if record["k"] == "hb":
            self.heartbeats[rank] = record
        else:
            buf = self._buffer(record["k"], rank)
            if buf and record["t"] < buf[-1]["t"]:
                self._unordered.add((record["k"], rank))
            buf.append(record)
        self.received += 1
        self.version += 1
        return True

    def records(self, kind: str, rank: int | None = None, since: float = 0.0,
                after: int = 0, upto: int | None = None) -> list[dict]:
        """Records of one kind (all ranks unless `rank`) stamped at or after `since`
        (epoch s) and, for incremental readers, filed after arrival number `after` and
        up to `upto` (see `sequence`)."""
        with self._lock:
            ranks = range(self.world_size) if rank is None else [rank]
            out = []
            for r in ranks:
                buf = self._buffers.get((kind, r))
                if not buf:
                    continue
                if after:
                    found = _arrived_after(buf, after)
                elif (kind, r) in self._unordered:
                    found = list(buf)
                else:
                    found = _newer_than(buf, since)
                out.extend(rec for rec in found if rec["t"] >= since
                           and (upto is None or rec["_n"] <= upto))
        out.sort(key=lambda rec: rec["t"])
        return out

    @property
    def sequence(self) -> int:
        """The arrival number of the newest record: `records(after=…)` resumes from it."""
        return self.received

    def heartbeat_ages(self) -> dict[int, float]:
        now = time.monotonic()
        with self._lock:
            return {r: now - t for r, t in self.last_seen.items()}

    def clear(self) -> None:
        """Forget the metrics of the previous run (heartbeats stay)."""
        with self._lock:
            self._buffers.clear()
            self._unordered.clear()
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


def _newer_than(buf: collections.deque, since: float) -> list[dict]:
    """The records at or after `since` of a time-ordered buffer, scanning back from the
    newest: a dashboard redraw costs what the current run logged, not the history."""
    if not since:
        return list(buf)
    newer = []
    for rec in reversed(buf):
        if rec["t"] < since:
            break
        newer.append(rec)
    newer.reverse()
    return newer


def _arrived_after(buf: collections.deque, after: int) -> list[dict]:
    """The records filed after arrival number `after`, scanning back from the newest."""
    newer = []
    for rec in reversed(buf):
        if rec["_n"] <= after:
            break
        newer.append(rec)
    newer.reverse()
    return newer


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

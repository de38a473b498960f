"""The rank's side of the record channel: state, heartbeats, metrics and spans.

Runs on every rank. Records are plain dicts packed with msgpack and PUSHed to the
notebook kernel's PULL socket by one background thread, so the training thread
never blocks on the network and never touches a ZMQ socket (they are not
thread-safe). Without a notebook (a batch job), records are simply not sent.

The per-step kinds (steps, spans, logged scalars: several a step) travel as tables:
that thread turns each kind's records into rows of float64 numbers, one binary block
per table, which the notebook files without looking at each record (it shares the
cores the ranks train on). What a record holds and how messages are made is
mpilab.wire's (the schema both sides import).
"""

from __future__ import annotations

import collections
import linecache
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from threading import get_ident

from ..wire import HEARTBEAT, encode  # the channel's schema and its encoder

# the context of one collective: a C type, since it is on the path of every collective,
# and a small one takes a fraction of a microsecond
from ._collective import Collective, follow

HEARTBEAT_INTERVAL_S = 0.5
# Records leave in batches at wall-clock multiples of this, the same moments on every
# rank: the notebook gets all ranks' batches together and draws the dashboard once for
# them, as they arrive. A record reaches the notebook within this; each send wakes this
# process, its ZMQ thread and the notebook kernel, on cores the training shares.
SEND_INTERVAL_S = 0.25
MAX_QUEUED_RECORDS = 50_000
TAKEN_RECORDS = 1000  # queued records the thread encodes at a time


@dataclass
class RankState:
    """What this rank is doing now; read by the heartbeat, written by the hot path."""

    phase: str = "idle"  # idle | running (a heartbeat says collective while in one)
    seq: int = 0  # collectives started so far (the collective sequence number)
    # the main thread's collective in progress (its op, bytes, shape and start), if any:
    # one reference set and cleared per collective, read by the heartbeat
    current: Collective | None = None
    step: int = 0
    cell: int = 0
    request: str = ""  # the running cell's execute request (msg id): the notebook's name for it
    # the last collectives of the main thread: [seq, op, nbytes], for mismatch reports
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    # the newest value of each scalar `mpilab.log` was given (a batch script's progress
    # lines show them)
    logged: dict = field(default_factory=dict)


class Agent:
    """Owns the PUSH socket and the heartbeat thread of one rank."""

    def __init__(self, rank: int, world_size: int, address: str | None):
        self.rank = rank
        self.world_size = world_size
        self.address = address
        self.state = RankState()
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self._queue: collections.deque = collections.deque(maxlen=MAX_QUEUED_RECORDS)
        self._wake = threading.Event()
        self._stop = threading.Event()
        # taking records off the queue, counted: what a cell queued is known to be
        # still queued while the count stands (`cell_queued`)
        self._taking = threading.Lock()
        self._takes = 0
        self._cell_start: dict | None = None  # the running cell's start marker, queued
        self._cell_takes = 0  # the count when it was queued
        self._thread: threading.Thread | None = None
        self.device_memory = lambda: 0

    # -- records -----------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        """Queue one record; cheap, never blocks, drops the oldest when full."""
        if self.address is None:
            return
        fields["k"] = kind
        fields["r"] = self.rank
        fields.setdefault("t", time.time())
        self._queue.append(fields)  # sent within SEND_INTERVAL_S by the agent thread

    def begin_cell(self, **fields) -> None:
        """Queue a cell's start marker (an "event" record); what is queued after it is
        the cell's own. It leaves with the next batch: a cell's records follow it there,
        and the notebook learns that a rank began a cell from ipyparallel's own message."""
        if self.address is None:
            return
        fields.update(k="event", r=self.rank, t=time.time())
        with self._taking:
            self._queue.append(fields)
            self._cell_start, self._cell_takes = fields, self._takes

    def cell_queued(self) -> bool:
        """Whether the running cell queued records of its own since `begin_cell`
        (heartbeats aside), or may have: some of them already left."""
        if self.address is None:
            return False
        with self._taking:
            if self._takes != self._cell_takes:
                return True
            start = self._cell_start
            for item in reversed(self._queue):
                if item is start:
                    return False
                if type(item) is not dict or item["k"] != HEARTBEAT:
                    return True
            return True  # its start marker was dropped from a full queue

    def beat(self) -> None:
        """Queue a heartbeat now (the thread sends one every HEARTBEAT_INTERVAL_S): for a
        change of state the notebook should see at once."""
        if self.address is not None:
            self._queue.append(self.heartbeat())

    def heartbeat(self) -> dict:
        st = self.state
        now = time.time()
        current = st.current  # one read: the main thread sets and clears it meanwhile
        phase = "collective" if current is not None else st.phase
        return {  # the fields of wire.HEARTBEAT_FIELDS and wire.HEARTBEAT_EXTRA
            "k": HEARTBEAT,
            "r": self.rank,
            "t": now,
            "pid": self.pid,
            "host": self.host,
            "phase": phase,
            "op": current.op if current is not None else "",
            "seq": st.seq,
            "op_age": now - current.start if current is not None else 0.0,
            "op_nbytes": current.nbytes if current is not None else 0,
            "op_shape": shape_text(current.shape) if current is not None else "",
            "step": st.step,
            "cell": st.cell,
            "rss": _rss_bytes(),
            "dev_mem": int(self.device_memory()),
            "where": user_frame() if phase != "idle" else "",
            "recent": [list(item) for item in st.recent],
        }

    def collective(self, op: str, nbytes: int = 0, shape: str | tuple = "",
                   numbered: bool | None = None) -> Collective:
        """Mark a collective in progress: heartbeats carry it, a span records it
        (``with agent.collective(...) as seq:``).

        Only the main thread's collectives are numbered (`numbered` None: whether this is
        the main thread): their order is the program's, the same on every rank, so
        numbers can be compared across ranks. A background thread's (DataParallel's
        buckets) only leave spans. `shape`: a text, or a tensor's shape (formatted only
        when a heartbeat is sent).
        """
        if numbered is None:
            numbered = get_ident() == main_ident()
        return Collective(self, op, nbytes, shape, numbered)

    def span(self, name: str, ts: float, end: float, nbytes: int, seq: int) -> None:
        """Queue a collective's span (category "comm") as a row, not a record: a
        collective of a few microseconds must not pay for a dict.

        Without a notebook nothing is sent; an ``emit`` replaced on this agent (a capture
        of the records) still gets the span as a record."""
        if self.address is None:
            capture = self.__dict__.get("emit")
            if capture is not None:
                capture("span", name=name, cat="comm", ts=ts, dur=end - ts, nbytes=nbytes,
                        seq=seq, t=end)
            return
        self._queue.append((name, ts, end, nbytes, seq))

    # -- the thread --------------------------------------------------------------
    def start(self) -> None:
        if self.address is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="mpilab-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def flush(self) -> None:
        """Ask the thread to send what is queued now rather than at the next tick."""
        self._wake.set()

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(self.address)
        next_beat = 0.0
        next_send = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._queue.append(self.heartbeat())
                    # due again at the send tick nearest to one interval from now
                    next_beat = now + HEARTBEAT_INTERVAL_S - SEND_INTERVAL_S / 2
                while self._queue:
                    # one message per batch: each message costs wake-ups and system
                    # calls in this process, the ZMQ thread and the notebook kernel
                    with self._taking:
                        taken = [self._queue.popleft()
                                 for _ in range(min(TAKEN_RECORDS, len(self._queue)))]
                        self._takes += 1
                    try:
                        for message in encode(self.rank, taken):
                            sock.send(message, zmq.NOBLOCK)
                    except zmq.Again:
                        break  # the notebook is not reading: drop rather than block
                # no wake-up per record: the training thread never waits on this one;
                # flush() sends at once, and the ticks stay where they were
                if time.time() >= next_send:
                    next_send = next_send_time(time.time())
                self._wake.wait(max(0.0, next_send - time.time()))
                self._wake.clear()
        finally:
            sock.close()


_main_ident = [threading.main_thread().ident]
os.register_at_fork(after_in_child=lambda: _main_ident.__setitem__(
    0, threading.main_thread().ident))


def main_ident() -> int | None:
    """The main thread's id (threading.main_thread().ident, kept: a collective asks)."""
    return _main_ident[0]


def shape_text(shape: str | tuple) -> str:
    """A heartbeat's op_shape: a text as it is, a tensor's shape as 2x3 ("scalar": ())."""
    if isinstance(shape, str):
        return shape
    return "x".join(str(s) for s in shape) or "scalar"


def next_send_time(now: float) -> float:
    """The first multiple of SEND_INTERVAL_S (epoch seconds) after `now`: hosts whose
    clocks agree (NTP) send together too."""
    return (math.floor(now / SEND_INTERVAL_S) + 1) * SEND_INTERVAL_S


_MPILAB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_PARTS = ("site-packages", "/lib/python3", "<frozen", _MPILAB_DIR)


def user_frame() -> str:
    """The innermost line of user code the main thread is running: for hang reports.

    Blocking MPI and gloo calls release the GIL, so this works while the main thread
    sits in one of them.
    """
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _LIBRARY_PARTS):
            line = linecache.getline(filename, frame.f_lineno).strip()
            label = "cell" if "ipykernel_" in filename or filename.startswith("<") else \
                os.path.basename(filename)
            return f"{label} line {frame.f_lineno}: {line}"[:200]
        frame = frame.f_back
    return ""


_statm: list[int] = [-1, -1]  # [the process that opened it, its /proc/self/statm]
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    """This process's resident memory, for the heartbeat (sent with every cell's end).

    Read from a descriptor kept open (a fork reopens it: it names the process that
    opened it): opening /proc/self/statm for each heartbeat cost 14 µs, and in an
    engine busy with cells its open waited on the other threads' memory maps.
    """
    pid = os.getpid()
    try:
        if _statm[0] != pid:
            _statm[1] = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            _statm[0] = pid
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


_agent: Agent | None = None
follow(sys.modules[__name__])  # a planned collective's context checks _agent, _main_ident


def current() -> Agent:
    """This process's agent; a silent one until the bootstrap installs the real one."""
    global _agent
    if _agent is None:
        _agent = Agent(rank=0, world_size=1, address=None)
    return _agent


def install(agent: Agent) -> Agent:
    global _agent
    if _agent is not None and _agent is not agent:
        _agent.stop()
    _agent = agent
    agent.start()
    return agent


def log(step: int | None = None, **scalars: float) -> None:
    """Send loss and friends to the dashboard: numbers, or one-element tensors such as a
    loss as it is (in a batch job, where nothing is sent, the newest values show in
    rank 0's `mpilab.progress` lines)."""
    agent = current()
    if step is None:
        step = agent.state.step
    values = {}
    for name, value in scalars.items():
        detach = getattr(value, "detach", None)  # a loss tensor, passed as it is
        try:
            values[name] = float(detach() if detach is not None else value)
        except (TypeError, ValueError):
            raise TypeError(f"mpilab.log({name}=…) takes a number (a float, an int or a "
                            f"one-element tensor), got {_described(value)}") from None
    agent.state.logged.update(values)
    agent.emit("log", step=int(step), values=values)


def _described(value: object) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__} of shape {tuple(shape)}"
    return f"{type(value).__name__} {value!r:.40}"

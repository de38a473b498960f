"""The rank's side of the record channel: state, heartbeats, metrics and spans.

Runs on every rank. Records are plain dicts packed with msgpack and PUSHed to the
notebook kernel's PULL socket by one background thread, so the training thread
never blocks on the network and never touches a ZMQ socket (they are not
thread-safe). Without a notebook (a batch job), records are simply not sent.
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
from contextlib import contextmanager
from dataclasses import dataclass, field

HEARTBEAT_INTERVAL_S = 0.5
# Records leave in batches at wall-clock multiples of this, the same moments on every
# rank: the notebook gets all ranks' batches together and draws the dashboard once for
# them, as they arrive. A record reaches the notebook within this; each send wakes this
# process, its ZMQ thread and the notebook kernel, on cores the training shares.
SEND_INTERVAL_S = 0.25
BATCH_RECORDS = 100  # records per message (well under the receiver's size limit)
MAX_QUEUED_RECORDS = 50_000


@dataclass
class RankState:
    """What this rank is doing now; read by the heartbeat, written by the hot path."""

    phase: str = "idle"  # idle | running | collective
    op: str = ""  # the collective in progress, if any
    seq: int = 0  # collectives started so far (the collective sequence number)
    op_started: float = 0.0
    op_nbytes: int = 0
    op_shape: str = ""
    step: int = 0
    cell: int = 0
    # the last collectives of the main thread: [seq, op, nbytes], for mismatch reports
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))


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

    def heartbeat(self) -> dict:
        st = self.state
        now = time.time()
        return {
            "k": "hb",
            "r": self.rank,
            "t": now,
            "pid": self.pid,
            "host": self.host,
            "phase": st.phase,
            "op": st.op,
            "seq": st.seq,
            "op_age": (now - st.op_started) if st.phase == "collective" else 0.0,
            "op_nbytes": st.op_nbytes,
            "op_shape": st.op_shape,
            "step": st.step,
            "cell": st.cell,
            "rss": _rss_bytes(),
            "dev_mem": int(self.device_memory()),
            "where": user_frame() if st.phase != "idle" else "",
            "recent": [list(item) for item in st.recent],
        }

    @contextmanager
    def collective(self, op: str, nbytes: int = 0, shape: str = ""):
        """Mark a collective in progress: heartbeats carry it, a span records it.

        Only the main thread's collectives are numbered: their order is the program's,
        the same on every rank, so numbers can be compared across ranks. A background
        thread's (DataParallel's buckets) only leave spans.
        """
        st = self.state
        start = time.time()
        main = threading.current_thread() is threading.main_thread()
        if main:
            previous = st.phase
            st.seq += 1
            st.op, st.op_nbytes, st.op_shape = op, nbytes, shape
            st.op_started = start
            st.phase = "collective"
            st.recent.append((st.seq, op, nbytes))
        try:
            yield st.seq
        finally:
            end = time.time()
            if main:
                st.phase = previous
                st.op = ""
            self.emit("span", name=op, cat="comm", ts=start, dur=end - start,
                      nbytes=nbytes, seq=st.seq, t=end)

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
        import msgpack
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(self.address)
        pack = msgpack.Packer(use_bin_type=True).pack
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
                    batch = [self._queue.popleft()
                             for _ in range(min(BATCH_RECORDS, len(self._queue)))]
                    try:
                        sock.send(pack(batch), zmq.NOBLOCK)
                    except zmq.Again:
                        break  # the notebook is not reading: drop rather than block
                    except (TypeError, ValueError):
                        continue  # a record msgpack cannot carry: its batch is dropped
                # no wake-up per record: the training thread never waits on this one;
                # flush() sends at once, and the ticks stay where they were
                if time.time() >= next_send:
                    next_send = next_send_time(time.time())
                self._wake.wait(max(0.0, next_send - time.time()))
                self._wake.clear()
        finally:
            sock.close()


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


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


_agent: Agent | None = None


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
    """Send loss and friends to the dashboard (no-op in a batch job)."""
    agent = current()
    if step is None:
        step = agent.state.step
    values = {k: float(v) for k, v in scalars.items()}
    agent.emit("log", step=int(step), values=values)

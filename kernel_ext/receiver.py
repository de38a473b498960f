"""The notebook's end of the record channel: one PULL socket, bound by the kernel, that
every rank's agent PUSHes its messages to, and one thread that files them into the
metrics store a round at a time."""

from __future__ import annotations

import gc
import threading
import time

import zmq

from .metrics_store import MetricsStore
from .wire import MAX_MESSAGE_BYTES

# The ranks send at the same moments (agent.SEND_INTERVAL_S); their batches count as
# one round until the socket has been quiet this long, and a round ends after at most:
ROUND_QUIET_S = 0.01
ROUND_MAX_S = 0.05
# While the receiver is behind (a round ends with records still waiting) the listeners
# hear of rounds at most this often: the dashboard redraws on this thread, and records
# must be filed before a redraw can show them.
BEHIND_NOTIFY_S = 1.0
# messages filed together (MetricsStore.add_messages), their blocks checked at once: at
# most this many, and as many as make DRAIN_BYTES (a round's end waits for no more)
DRAIN_MESSAGES = 512
DRAIN_BYTES = 256 * 1024
# While a receiver is open, CPython's collector starts a young collection after this many
# net allocations instead of its default 700. Filing a thousand ranks' records keeps tens
# of thousands of decoded records in flight a second: at 700 a young collection ran every
# few hundred records and moved those in flight to the old generation, whose growth then
# set off a full collection of the kernel's objects (0.1-0.15 s each) every two seconds,
# a fifth of the kernel's CPU at 1,024 ranks. A threshold set higher already is kept.
GC_YOUNG_THRESHOLD = 10_000
_open_receivers: list[RecordReceiver] = []
_gc_lock = threading.Lock()
_saved_threshold: tuple[int, ...] | None = None  # the collector's, before the first receiver


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
        _tune_gc(self, opening=True)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        notified = 0.0
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            # a round ends when the socket has been quiet ROUND_QUIET_S, or at the
            # latest after ROUND_MAX_S even if records keep coming (a thousand ranks
            # whose sends spread out keep the socket busy): the listeners hear of it
            round_ends = time.monotonic() + ROUND_MAX_S
            emptied = self._drain(round_ends)
            while time.monotonic() < round_ends and poller.poll(1e3 * ROUND_QUIET_S):
                emptied = self._drain(round_ends)
            now = time.monotonic()
            if emptied or now - notified >= BEHIND_NOTIFY_S:
                notified = now
                self.store.notify()

    def _drain(self, until: float) -> bool:
        """File what the socket holds, DRAIN_MESSAGES or DRAIN_BYTES at a time, until it
        is empty (True) or the round's time is up."""
        recv, again = self._sock.recv, zmq.Again
        while True:
            raws = []
            size = 0
            try:
                while len(raws) < DRAIN_MESSAGES and size < DRAIN_BYTES:
                    raw = recv(zmq.NOBLOCK)
                    raws.append(raw)
                    size += len(raw)
            except again:
                emptied = True
            else:
                emptied = False
            if raws:
                self.store.add_messages(raws)
            if emptied or time.monotonic() >= until:
                return emptied

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        _tune_gc(self, opening=False)


def _tune_gc(receiver: RecordReceiver, opening: bool) -> None:
    """Raise the collector's young threshold while any receiver is open (GC_YOUNG_THRESHOLD)
    and give the user's back once the last one closes, unless it was changed meanwhile."""
    global _saved_threshold
    with _gc_lock:
        if opening:
            if not _open_receivers:
                current = gc.get_threshold()
                if current[0] < GC_YOUNG_THRESHOLD:
                    _saved_threshold = current
                    gc.set_threshold(GC_YOUNG_THRESHOLD, *current[1:])
            _open_receivers.append(receiver)
            return
        if receiver not in _open_receivers:
            return  # closed twice
        _open_receivers.remove(receiver)
        if not _open_receivers and _saved_threshold is not None:
            if gc.get_threshold()[0] == GC_YOUNG_THRESHOLD:
                gc.set_threshold(*_saved_threshold)
            _saved_threshold = None

"""The notebook's lifeline to its cluster: how a rank on any host knows its notebook is gone.

The notebook kernel listens on one TCP port (on the address the ranks reach, like the
controller) and sends a byte a second on every connection. Each rank's supervisor and
the controller hold a connection: when the kernel ends, killed or not, its sockets close
and every holder learns it at once; when the kernel's host is unreachable (a cut link,
a frozen machine), the bytes stop and the holders give up after `SILENCE_S`. Either way
the holder ends what it supervises. A process id would do on one host only.

Both ends live here: the kernel imports `Lifeline`, the ranks import `hold`. Nothing is
ever read from a holder, so the port offers nothing to whoever connects.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time

ENV = "MPILAB_LIFELINE"  # "IP:PORT", handed to every rank by the launcher's environment
BEAT_S = 1.0
SILENCE_S = 10.0  # no byte for this long: the notebook is unreachable
CONNECT_S = 15.0  # how long a holder tries to reach the notebook at start
# how a rank's host says it cannot reach the notebook (a start's line quotes it)
UNREACHABLE = "cannot reach the notebook at"


class Lifeline:
    """The kernel's end: a listener on `ip` and a thread that beats every connection."""

    def __init__(self, ip: str):
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((ip, 0))
        self._listener.listen(1024)
        self._listener.setblocking(False)
        self.address = f"{ip}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # close() writes to one end so the beating thread leaves its wait at once
        self._wake, self._woken = socket.socketpair()
        self._selector.register(self._woken, selectors.EVENT_READ)
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="mpilab-lifeline")
        self._thread.start()

    @property
    def holders(self) -> int:
        return len(self._held)

    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._closed.is_set():
            for key, _ in self._selector.select(timeout=max(0.0, next_beat - time.monotonic())):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._woken:
                    continue
                else:  # a holder closed its end (or sent something it should not)
                    self._drop(key.fileobj)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + BEAT_S
                for sock in list(self._held):
                    try:
                        sock.send(b".")
                    except OSError:
                        self._drop(sock)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        self._held.append(sock)
        self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, sock) -> None:
        if sock in self._held:
            self._held.remove(sock)
            self._selector.unregister(sock)
            sock.close()

    def close(self) -> None:
        """Every holder learns at once that the notebook let go of its cluster."""
        self._closed.set()
        try:
            self._wake.send(b".")
        except OSError:
            pass
        self._thread.join(timeout=2 * BEAT_S)
        for sock in [self._listener, self._wake, self._woken, *self._held]:
            try:
                sock.close()
            except OSError:
                pass
        self._held = []
        self._selector.close()


class LifelineLost(Exception):
    """The notebook could not be reached at start."""


def hold(address: str | None = None, connect_s: float = CONNECT_S) -> Holder | None:
    """A rank's end, connected to the address in $MPILAB_LIFELINE (None: no notebook)."""
    address = address or os.environ.get(ENV)
    if not address:
        return None
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + connect_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=2.0)
            return Holder(sock)
        except OSError as e:
            if time.monotonic() > deadline:
                raise LifelineLost(f"{UNREACHABLE} {address}: {e}") from None
            time.sleep(0.25)


class Holder:
    """A held connection; `notebook_gone` answers without blocking for longer than asked."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._sock.setblocking(False)
        self._last = time.monotonic()

    def fileno(self) -> int:
        return self._sock.fileno()

    def notebook_gone(self, wait: float = 0.0, silence_s: float = SILENCE_S) -> str | None:
        """Why the notebook is gone ('closed', 'silent for 10 s'), or None while it lives."""
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        try:
            ready = sel.select(timeout=wait)
        finally:
            sel.close()
        while ready:  # read what is there; an empty read is the notebook's end closing
            try:
                data = self._sock.recv(4096)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                return "the notebook closed its lifeline"
            self._last = time.monotonic()
        silent = time.monotonic() - self._last
        if silent > silence_s:
            return f"no word from the notebook for {silent:.0f} s"
        return None

"""Interruptible waiting, abort and recovery for mpilab's collectives.

A blocking MPI call cannot be interrupted: Python's signal handlers only run between
bytecodes. So every wait in mpilab polls (a non-blocking request, a torch async work,
a shared-memory flag) with short sleeps, which lets two things land within
milliseconds: KeyboardInterrupt on the main thread (the notebook's stop button), and
`abort()`, which makes every wait on every thread of this rank raise
CollectiveAborted (a rank whose peer failed must not wait for it forever).

An abandoned collective leaves the communicator it used out of step across ranks, so
after an abort all ranks call `recover()` together: it runs the hooks that rebuild
mpilab's private communicators and shared-memory state, then clears the abort.
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Callable

# Spin briefly first (small messages finish in microseconds), then back off.
_SPIN_S = 0.0002
_MAX_SLEEP_S = 0.002

_abort = threading.Event()
_abort_reason = ["aborted"]
# each gives its hook, or None once the object of a bound-method hook is gone
_recover_hooks: list[Callable[[], Callable[[], None] | None]] = []


class CollectiveAborted(RuntimeError):
    """This rank stopped waiting in a collective because the cell was being released."""


def abort(reason: str = "the notebook released the ranks") -> None:
    _abort_reason[0] = reason
    _abort.set()


def aborted() -> bool:
    return _abort.is_set()


def check_abort() -> None:
    """Raise CollectiveAborted if this rank has been told to stop waiting."""
    if _abort.is_set():
        raise CollectiveAborted(_abort_reason[0])


def on_recover(hook: Callable[[], None]) -> None:
    """Register a collective reset (all ranks run them, in registration order). A bound
    method is held weakly: the reset of a gradient sync that a rewrap replaced goes
    with it."""
    if any(ref() == hook for ref in _recover_hooks):
        return
    _recover_hooks.append(weakref.WeakMethod(hook) if inspect.ismethod(hook)
                          else lambda: hook)


def recover() -> None:
    """Collectively rebuild mpilab's communication state after an abort (all ranks)."""
    for ref in list(_recover_hooks):
        hook = ref()
        if hook is None:
            _recover_hooks.remove(ref)
        else:
            hook()
    _abort.clear()


def poll(done: Callable[[], bool]) -> None:
    """Wait until done() is true, interruptibly, with a short spin then backoff."""
    if done():
        return
    start = time.perf_counter()
    sleep = 0.0
    while not done():
        if _abort.is_set():
            raise CollectiveAborted(_abort_reason[0])
        if time.perf_counter() - start > _SPIN_S:
            sleep = min(_MAX_SLEEP_S, sleep * 2 or 0.00005)
            time.sleep(sleep)


def wait_interruptibly(request) -> None:
    """Wait for an mpi4py Request, staying responsive to signals and aborts."""
    poll(request.Test)

"""Interruptible waiting, abort and recovery for mpilab's collectives.

A blocking MPI call cannot be interrupted: Python's signal handlers only run between
bytecodes. So every wait in mpilab goes through here and polls (a non-blocking request,
a torch async work, a shared-memory flag, a CUDA event: ``poll``; another thread's
event: ``wait_event``) with short sleeps, which lets two things land within
milliseconds: KeyboardInterrupt on the main thread (the notebook's stop button), and
`abort()`, which makes every wait on every thread of this rank raise
CollectiveAborted (a rank whose peer failed must not wait for it forever).

Two waits run in C by the same rules: the shared-memory engine's (`_ring.c`: spin, then
yield the core with signal handlers run, then sleep, checking for an abort), and the
first 200 µs of a small persistent collective (`_persistent.c`, which then calls the
plan's wait here).

Autograd runs gradient hooks and its end-of-backward callbacks on whichever thread runs
the graph: for CUDA tensors a device thread of its own, while the main thread sits in
C++ ``backward()``, where Python runs no signal handler. Two things keep such waits in
reach of the notebook:

- ``for_main_thread()``: a wait on another thread that the main thread is blocked on is
  numbered and shown in heartbeats as the main thread's own (``collective()``), so the
  watchdog compares it across ranks as it does on CPU.
- ``watch_interrupts()``: a SIGINT that arrives while the main thread is inside
  ``backward()`` aborts the waits at once, from a watcher thread woken by the signal's
  wakeup fd, instead of waiting for a handler that would only run after ``backward()``.

An abandoned collective leaves the communicator it used out of step across ranks, so
after an abort all ranks call `recover()` together: it runs the hooks that rebuild
mpilab's private communicators, torch.distributed's group where it may hold a broken
collective, and shared-memory state, then clears the abort.

An MPI request a wait gives up on may still be moved by MPI later, whenever this rank
next asks MPI anything: a receive would write into its buffer, a send read from it. So
a wait that raises (`wait_interruptibly`, `drive`, `drive_all`) cancels its point-to-point
receives (one cancelled before it matched never writes) and keeps every request that
has not completed, with the buffer it holds, until it is seen complete (`_abandoned`).
Otherwise the buffer could be freed under MPI: a collective's output, for one, goes as
the exception leaves the call, and a late write would land in freed memory. Sends are
not cancelled (MPICH cannot cancel one it has begun) nor are collectives (MPI forbids
it). A persistent collective an abort left started (run in C by `persistent`) is handed
over the same way when its owner lets it go (`abandon`), with the object that holds its
buffers, and freed once it completes (freeing an active one is erroneous in MPI).

The messages such a wait's peers sent may also reach this rank after it stopped
waiting, or before it began: MPI keeps them, unreceived, and once their communicator is
freed a communicator made later can be given its context, where they would be taken for
that one's own messages (seen: a stopped exchange's 16 bytes taken by the next cell's
4-byte allreduce, a truncation error; of the same size, wrong data without an error).
So a communicator is drained (`drain`) before mpilab frees it.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from threading import get_ident
from typing import Any

from . import agent as agent_mod
from ._collective import kept_here

# Spin briefly first (small messages finish in microseconds), then back off; also how
# long a small persistent collective asks MPI in C before the plan's wait (`persistent`).
SPIN_S = 0.0002
_MAX_SLEEP_S = 0.002
# how long `drain` waits for one stale message's data (a large one sent by rendezvous
# moves only once its sender's MPI makes progress)
DRAIN_S = 5.0

_abort = threading.Event()
_abort_reason = ["aborted"]
# each gives its hook, or None once the object of a bound-method hook is gone
_recover_hooks: list[Callable[[], Callable[[], None] | None]] = []

# (request, what holds its buffers) for each request given up on before it completed
# (see the module's docstring)
_abandoned: list[tuple[Any, Any]] = []
_abandoned_lock = threading.Lock()

INTERRUPTED = "the cell was interrupted"  # the reason the engine's SIGINT handler gives


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
    _settle_abandoned()
    _abort.clear()


def abandon(requests: Sequence, receives: Sequence = (), holder: Any = None) -> None:
    """Give up on `requests`: cancel `receives` (point-to-point receives among them) and
    keep those not complete, with `holder` (what holds their buffers, where the request
    does not), until they are. A persistent request stays its owner's, who may start it
    again, until the owner hands it over with its holder; it is freed once complete."""
    from mpi4py import MPI

    for request in receives:
        with suppress(MPI.Exception):
            request.Cancel()
    with _abandoned_lock:
        _abandoned.extend((request, holder) for request in requests
                          if holder is not None or not isinstance(request, MPI.Prequest))
    _settle_abandoned()


def _settle_abandoned() -> None:
    """Let go of the abandoned requests that have completed (cancelled, done, or failed:
    MPI no longer touches their buffers)."""
    from mpi4py import MPI

    with _abandoned_lock:
        left = []
        for request, holder in _abandoned:
            if not _completes(request):
                left.append((request, holder))
            elif isinstance(request, MPI.Prequest):
                with suppress(MPI.Exception):
                    request.Free()
        _abandoned[:] = left


def drain(comm) -> None:
    """Receive and drop the point-to-point messages that reached `comm` and that no one
    will receive, before it is freed (see the module's docstring); one whose data is
    not in after DRAIN_S is abandoned (kept, with its buffer). Called by every rank of a
    communicator as it frees it, after an abort's recovery, when the messages of the
    stopped collectives have long arrived."""
    from mpi4py import MPI

    status = MPI.Status()
    while (message := comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)) is not None:
        request = message.Irecv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])
        deadline = time.monotonic() + DRAIN_S
        while not request.Test():
            if time.monotonic() > deadline:
                abandon((request,))
                break
            os.sched_yield()


def _completes(request) -> bool:
    from mpi4py import MPI

    try:
        return request.Test()
    except MPI.Exception:
        return True


def poll(done: Callable[[], bool]) -> None:
    """Wait until done() is true, interruptibly, with a short spin then backoff."""
    if done():
        return
    start = time.perf_counter()
    sleep = 0.0
    while not done():
        if _abort.is_set():
            raise CollectiveAborted(_abort_reason[0])
        if time.perf_counter() - start > SPIN_S:
            sleep = min(_MAX_SLEEP_S, sleep * 2 or 0.00005)
            time.sleep(sleep)


def wait_interruptibly(request) -> None:
    """Wait for an mpi4py Request, staying responsive to signals and aborts; kept where
    the wait raises (`_abandoned`)."""
    try:
        poll(request.Test)
    except BaseException:
        abandon((request,))
        raise


def drive(request, receive: bool = False) -> None:
    """Wait for an mpi4py Request whose data crosses the network: MPI moves it only
    while it is asked (each Test is a step of the transport's progress), so keep asking,
    yielding the core between asks, as MPI's own blocking wait would, and stay
    interruptible. A backoff that sleeps between asks leaves a megabyte in flight for
    tens of ms. `receive`: it is a point-to-point receive (cancelled where the wait
    raises; kept either way, `_abandoned`)."""
    try:
        while not request.Test():
            check_abort()
            os.sched_yield()
    except BaseException:
        abandon((request,), (request,) if receive else ())
        raise


def drive_all(requests: list, receives: Sequence = (),
              meanwhile: Callable[[], None] | None = None) -> None:
    """drive() for several requests at once; `receives`: the point-to-point receives
    among them. `meanwhile` runs first, while they are in flight (abandoned with them
    where it raises)."""
    from mpi4py import MPI

    try:
        if meanwhile is not None:
            meanwhile()
        while not MPI.Request.Testall(requests):
            check_abort()
            os.sched_yield()
    except BaseException:
        abandon(requests, receives)
        raise


def wait_event(event: threading.Event, check_s: float = 0.01) -> None:
    """Wait for a threading.Event set by another thread: woken at once when it is set
    (no polling delay), and checking for an abort every `check_s`."""
    while not event.wait(check_s):
        check_abort()


def wait_device(device: Any) -> None:
    """Wait, interruptibly, until the work queued on `device`'s current stream has run
    (a CUDA event polled; nothing to wait for on CPU)."""
    if device.type != "cuda":
        return
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    poll(event.query)


# ------------------------------------------------------- waits done for the main thread
_local = threading.local()


@contextmanager
def for_main_thread() -> Iterator[None]:
    """Inside, this thread's collectives count as the main thread's: numbered and in the
    heartbeats. For code the main thread is blocked on while it runs elsewhere:
    DataParallel's end-of-backward callback and gradient hooks, which autograd runs on
    a device thread for CUDA models. (A thread of its own, such as DataParallel's
    communication thread, only leaves spans: its order is not the program's.)"""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    outer = getattr(_local, "for_main", False)
    _local.for_main = True
    try:
        yield
    finally:
        _local.for_main = outer


def run_for_main(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) inside for_main_thread(); on the main thread, a plain call (gradient
    hooks run once per parameter and step: no context manager there)."""
    if threading.current_thread() is threading.main_thread():
        return fn(*args)
    outer = getattr(_local, "for_main", False)
    _local.for_main = True
    try:
        return fn(*args)
    finally:
        _local.for_main = outer


def acting_for_main() -> bool:
    """Is this thread the main one, or inside for_main_thread()?"""
    return (threading.current_thread() is threading.main_thread()
            or getattr(_local, "for_main", False))


def collective(op: str, nbytes: int = 0, shape: str | tuple = "") -> agent_mod.Collective:
    """The agent's ``collective`` (heartbeats carry it, a span records it), numbered on
    the main thread and inside for_main_thread() on any other.

    The main thread is then blocked on this one, so no collective of its own can
    interleave with the numbering. (Called once per collective, a few microseconds on
    shared memory: no call here that is not needed.)
    """
    return agent_mod.Collective(
        agent_mod._agent or agent_mod.current(), op, nbytes, shape,
        get_ident() == agent_mod.main_ident() or getattr(_local, "for_main", False))


def kept_collective(op: str, nbytes: int, shape: str | tuple) -> agent_mod.Collective:
    """A collective's context made once for the main thread, for a caller that makes
    the same collective again and again (a tensor's plan); used through `reuse`."""
    return agent_mod.Collective(agent_mod._agent or agent_mod.current(), op, nbytes, shape,
                                True)


def reuse(kept: agent_mod.Collective) -> agent_mod.Collective:
    """`kept` where it applies: on the main thread, with the agent it was made for (a
    context is entered by one thread at a time, and the main thread's collectives never
    nest). Elsewhere a fresh one, as `collective` makes. A small collective on shared
    memory takes a fraction of a microsecond: making a context for it would cost more.
    (The rule is `_collective.kept_here`'s, which `run_planned` applies too.)"""
    if kept_here(kept):
        return kept
    return collective(kept.op, kept.nbytes, kept.shape)


# ----------------------------------------------------------- SIGINT while in backward
# torch.autograd.backward and torch.autograd.grad enter the C++ engine from this function
_BACKWARD_FRAME = "_engine_run_backward"


def main_thread_in_backward() -> bool:
    """Is the main thread inside an autograd backward pass (torch's engine entry on its
    stack)? There it runs no Python signal handler until the pass ends, unless the
    pass calls back into Python on that same thread (CPU tensors)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == _BACKWARD_FRAME:
            return True
        frame = frame.f_back
    return False


class _InterruptWatch:
    """A pipe registered as Python's signal wakeup fd and a thread that reads it.

    The C-level handler writes each signal's number to the wakeup fd as the signal
    arrives, whatever the main thread is doing; the Python-level handler runs later, on
    the main thread, between bytecodes. A SIGINT read while the main thread is inside
    backward() aborts this rank's waits as the engine's handler would. A wakeup fd set
    before (asyncio's) gets every byte forwarded.
    """

    def __init__(self) -> None:
        self.read_fd = -1
        self.write_fd = -1
        self.previous = -1
        self.interrupts = 0  # SIGINTs seen (tests and gpu_check read it)

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # signal.set_wakeup_fd is for the main thread only
        if self.write_fd >= 0:
            current = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
            if current not in (-1, self.write_fd):  # someone took it since: chain theirs
                self.previous = current
            return True
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            os.close(read_fd)
            os.close(write_fd)
            return False
        self.read_fd, self.write_fd, self.previous = read_fd, write_fd, previous
        threading.Thread(target=self._run, name="mpilab-sigint-watch", daemon=True).start()
        return True

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 512)
            except OSError:
                return
            if not data:
                return
            if self.previous >= 0:
                try:
                    os.write(self.previous, data)
                except OSError:
                    pass  # full or closed: its owner reads its own way
            if signal.SIGINT in data:
                self.interrupts += 1
                if main_thread_in_backward():
                    abort(INTERRUPTED)


_watch = _InterruptWatch()


def watch_interrupts() -> bool:
    """Let a SIGINT abort this rank's waits while the main thread sits in backward()
    (main thread only; idempotent; DataParallel calls it when it wraps a model).
    Returns whether the watch is on."""
    return _watch.install()


def interrupts_seen() -> int:
    """How many SIGINTs the watch has read so far."""
    return _watch.interrupts


# ----------------------------------------------------------- SIGINT as a request ends
def reply_uninterrupted() -> None:
    """Ignore SIGINT from here until this engine has sent its reply to the request it
    runs (a cell, or a function the notebook applies); nothing outside an engine.

    The notebook stops a request by signalling each rank once. A signal that arrives
    after the request's code has ended, while ipykernel builds or sends the reply,
    raises KeyboardInterrupt there, which ipykernel catches and logs, and the reply is
    never sent: the notebook waits for it in vain and counts the rank as one in a call
    no interrupt reaches, and restarts the ranks (their state lost). Seen with
    `%mpilab bench` stopped as a message size ended: 6 in 785 stops on a loaded node.
    The request has nothing left to stop by then. After the reply ipykernel puts back
    the engine's own handler, which ignores SIGINT between requests.
    """
    if threading.current_thread() is threading.main_thread() and engine_kernel():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def engine_kernel() -> Any:
    """The kernel of the engine this rank is, running its requests; None in a script."""
    ipython = sys.modules.get("IPython")
    return getattr(ipython.get_ipython(), "kernel", None) if ipython else None


def as_request(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, as the whole of a request the notebook may stop with SIGINT
    (``view.apply_async(as_request, function, …)``): its reply reaches the notebook
    whenever the signal comes (reply_uninterrupted)."""
    try:
        return function(*args)
    finally:
        reply_uninterrupted()

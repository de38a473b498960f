"""On-rank communication benchmark: `%mpilab bench …` in the notebook, `mpilab bench`.

Why here: the figures must come from the ranks themselves, with every backend measured
in the same run on the same buffers, so that mpilab is compared with its peers (MPI,
gloo, NCCL) and with the node's memory-copy ceiling under identical conditions.

Bandwidths follow nccl-tests (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
algbw = size / time; busbw = algbw × 2(n-1)/n for allreduce, × (n-1)/n for allgather
(size = the gathered output), × 1 for broadcast. GB/s are 1e9 bytes per second.

Backends: ``mpilab`` is what a user calls, ``mpilab.allreduce / broadcast / allgather``
on a CPU tensor; ``mpilab-internal`` what that call runs under its plan check and its
heartbeat and span (the functions the tensor's plan holds: shared memory on one node,
MPI across nodes), to show what the public call adds;
``mpi`` mpi4py's blocking calls; ``gloo`` and ``nccl`` torch.distributed's. ``memory``
(allreduce only) is no collective: every rank reads and writes back its buffer in place
at once, the least an allreduce must do with it, timed in turn with the others: the
most an allreduce can reach on this node at that size, in that run.

The memory-copy figure (the ceiling): ``memcpy_bandwidth()``, the bytes one core copies
per second with ``np.copyto`` between two buffers of MEMCPY_BYTES (far beyond any
last-level cache, so it is the DRAM rate). A byte copied is read once and written once,
so the memory bus carries at least twice the figure.
"""

from __future__ import annotations

import itertools
import signal
import statistics
import time
from collections.abc import Callable

import numpy as np

from ..wire import BENCH_COLLECTIVES, BENCH_STOP_GRACE_S, check_backends, size_text
from .context import context
from .memory import available_memory
from .waiting import engine_kernel, poll, wait_interruptibly

MEMCPY_BYTES = 256 << 20  # the memory-copy figure's buffers (each; two of them)
_WARMUP = 2
# Each timed repetition runs back-to-back collectives moving about this many bytes (at
# most _MAX_ITERS of them), as nccl-tests times a loop of iterations: a single 4 KiB
# collective takes a few µs, less than the skew with which ranks leave the barrier
# before it, and a single 1 MiB one would mostly measure the cache misses left by the
# backend that ran before it.
_TIMED_BYTES = 32 << 20
_MAX_ITERS = 100
# ... and lasts at most about this long once a backend's speed is known (from the first
# warm-up repetition): a backend that takes a millisecond a call (gloo's small messages on a
# loaded node) is as well measured by a few calls a repetition as by a hundred, which
# made it most of the benchmark's time. The fast backends' counts stay the byte rule's.
_REPETITION_S = 5e-3


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests)."""
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "broadcast": 1.0}[op]


def memcpy_bandwidth(size: int = MEMCPY_BYTES, repeats: int = 5) -> float:
    """The memory-copy figure, in GB/s: bytes copied per second by one core between two
    buffers of at least MEMCPY_BYTES (`size` when larger), the median of `repeats`
    copies. One definition for every ceiling mpilab shows (%mpilab bench, mpilab bench,
    the benchmarks, docs/performance.md)."""
    return copy_bandwidth(max(size, MEMCPY_BYTES), repeats)


def memcpy_figures(comm, rounds: int) -> tuple[list[float], list[float]]:
    """The memory-copy figure measured `rounds` times on rank 0 alone, while the other
    ranks wait without spinning, and as many times the same copy on every rank at once
    (the slowest rank's), alternating: the host's memory bandwidth drifts, at times 2x
    for seconds. Collective; both lists on every rank."""

    alone, together = [], []
    for _ in range(rounds):
        if comm.rank == 0:
            alone.append(memcpy_bandwidth())
        wait_interruptibly(comm.Ibarrier())
        comm.Barrier()
        together.append(min(comm.allgather(memcpy_bandwidth())))
        wait_interruptibly(comm.Ibarrier())
    return comm.bcast(alone), together


def copy_bandwidth(size: int, repeats: int = 10) -> float:
    """This core's copy rate in GB/s for `size`-byte buffers: above the last-level cache
    the DRAM rate, below it the cache's (faster)."""
    src = np.ones(max(1, size // 8), np.float64)
    dst = np.zeros_like(src)  # written below, so its pages are faulted in beforehand
    times = []
    for i in range(_WARMUP + repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        if i >= _WARMUP:
            times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


# how many message-sized buffers one rank holds at once: its own (two for an allgather)
# and a backend's scratch copy (gloo's); or the memory-copy figure's two
BUFFERS_PER_RANK = 3


def stop_if_withdrawn() -> None:
    """KeyboardInterrupt where the notebook has taken back the request this rank begins.

    The stop button takes a bench's request off the ranks' queues, and signals the ranks
    only once each has that abort; but a rank whose kernel took the request off its
    queue just before the abort came catches no SIGINT until the request's handler
    begins, and would run the bench alone, its peers gone. ipyparallel's engine keeps
    the ids it was told to abort, the running request's too: that is the stop, seen
    whatever the signal's timing. Outside an engine (a script under mpiexec) nothing is
    withdrawn."""
    kernel = engine_kernel()
    if kernel is None:
        return
    msg_id = kernel.get_parent().get("header", {}).get("msg_id")
    if msg_id in getattr(kernel, "aborted", ()):
        raise KeyboardInterrupt


def check_memory(op: str, sizes: list[int]) -> None:
    """Before any buffer is made: every host has the memory its ranks need for the largest
    message, else ValueError naming the host and a size that fits (a 64G message on a
    24 GiB node would leave it to the kernel's OOM killer, which ends any process).
    Collective: every rank raises the same error."""
    stop_if_withdrawn()
    ctx = context()
    largest = max(effective_size(op, size, ctx.world_size) for size in sizes)
    need = BUFFERS_PER_RANK * largest * ctx.local_size
    available = available_memory()
    from .collectives import allgather_json  # interruptible: it comes before StopTogether

    short = [s for s in allgather_json(
        [ctx.host, available] if available is not None and need > available else None,
        "bench memory check") if s]
    if short:
        host, available = short[0]
        fits = available // (BUFFERS_PER_RANK * ctx.local_size)
        hint = (f"use --sizes up to {size_text(1 << (fits.bit_length() - 1))}"
                if fits >= 4 else "free memory on it first")
        raise ValueError(
            f"{size_text(largest)} messages need about {need / 2**30:.1f} GiB on {host} "
            f"({ctx.local_size} ranks, {BUFFERS_PER_RANK} buffers each), which has "
            f"{available / 2**30:.1f} GiB available: {hint}")


def run_bench(op: str, sizes: list[int], backends: list[str], repeats: int = 20) -> list[dict]:
    """Measure `op` at every size with every backend; collective on all ranks.

    Returns plain rows on rank 0 (an empty list elsewhere):
    {op, backend, size_bytes, time_s (one collective's time: the median over repeats of
    the slowest rank's mean over a repeat's back-to-back collectives), algbw_GBps,
    busbw_GBps, time_min_s (the fastest repeat: what the backend does undisturbed on a
    shared, noisy node)}; a backend that cannot run here gives one row with a `note` and
    None figures.
    """
    if op not in BENCH_COLLECTIVES:
        raise ValueError(f"bench op {op!r} is not one of {', '.join(BENCH_COLLECTIVES)}")
    check_backends(backends)
    check_memory(op, sizes)  # the first collective: a withdrawn request stops there
    from .collectives import private_comm

    ctx = context()
    # mpilab's own communicator, not the user's `comm`: a stop can leave a collective
    # half-made (a rank stopped before the loops, or one that never began the bench), and
    # the notebook's recovery makes mpilab's communicators again; the user's would stay
    # out of step for good
    comm, n = private_comm(), ctx.world_size
    rows: list[dict] = []
    running = []
    for backend in backends:
        note = _unavailable_for(op, backend)
        if note:
            rows.append({"op": op, "backend": backend, "size_bytes": None, "time_s": None,
                         "algbw_GBps": None, "busbw_GBps": None, "note": note})
        else:
            running.append(backend)
    measured: dict[tuple[str, int], dict] = {}
    with StopTogether() as stop:
        for size in sizes:
            buffers = _buffers(op, size, n)
            steps = {b: _step(op, b, buffers, comm, n) for b in running}
            calls = dict.fromkeys(running, max(1, min(_MAX_ITERS, _TIMED_BYTES // size)))
            times: dict[str, list[float]] = {b: [] for b in running}
            first: dict[str, float] = {}  # each backend's time a call in the first warm-up
            # Backends take turns at every repetition, so a burst of load on the node hits
            # them alike instead of spoiling one backend's whole series.
            orders = list(itertools.permutations(running))
            for i in range(_WARMUP + repeats):
                if i == 1:
                    calls = _calls_within(comm, first, calls)
                # every order in turn: a backend that leaves work behind (gloo's threads)
                # slows each other backend equally often (a plain rotation of three puts
                # the same one after gloo in two repeats of three)
                for b in orders[i % len(orders)]:
                    step, count = steps[b], calls[b]
                    stop.agree(comm)  # the stop button ends every rank here, together
                    for _ in range(max(1, count // 5)):  # untimed: what the previous backend
                        step()  # left behind (gloo: ~20 slow small collectives after it)
                    comm.Barrier()  # then a spinning barrier: ranks start within a µs or so
                    t0 = time.perf_counter()
                    for _ in range(count):
                        step()
                    per_call = (time.perf_counter() - t0) / count
                    if i == 0:
                        first[b] = per_call
                    elif i >= _WARMUP:
                        times[b].append(per_call)
            nbytes = effective_size(op, size, n)
            for b in running:
                slowest = _slowest(comm, times[b])
                t = float(np.median(slowest))
                algbw = nbytes / t / 1e9
                measured[(b, size)] = {"op": op, "backend": b, "size_bytes": nbytes, "time_s": t,
                                       "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, n),
                                       "time_min_s": float(slowest.min())}
    rows += [measured[(b, size)] for b in running for size in sizes]
    return rows if ctx.rank == 0 else []


class StopTogether:
    """The stop button during a bench ends every rank at the same point.

    A backend's collectives run back to back, and some cannot be interrupted (mpi4py's
    blocking Allreduce, the peer a user would use): a rank interrupted inside a loop
    leaves the others blocked in it for good. So while measuring, SIGINT only takes note;
    before each loop every rank says whether it was told to stop, and all stop there
    together, once each has finished the same loops. A rank that waits longer than
    BENCH_STOP_GRACE_S for the others (one stopped before the loops, or busy elsewhere)
    stops alone; its part of the agreement is left pending, and the notebook then makes
    mpilab's communicators again on every rank (`Session._back_in_step`).
    """

    def __init__(self) -> None:
        self.asked = False
        self._saved = None

    def __enter__(self) -> StopTogether:
        try:
            self._saved = signal.signal(signal.SIGINT, self._note)
        except ValueError:  # not the main thread: interrupts reach it as they did
            self._saved = None
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            signal.signal(signal.SIGINT, self._saved)

    def _note(self, signum, frame) -> None:
        self.asked = True

    def agree(self, comm) -> None:
        """Every rank gathers here; if any was told to stop, all raise KeyboardInterrupt."""
        from mpi4py import MPI

        flag = np.array([int(self.asked)], np.int32)
        request = comm.Iallreduce(MPI.IN_PLACE, flag, MPI.MAX)
        deadline = None

        def gathered() -> bool:
            nonlocal deadline
            if self.asked:  # told while waiting: the others get BENCH_STOP_GRACE_S to come
                deadline = deadline or time.monotonic() + BENCH_STOP_GRACE_S
                if time.monotonic() > deadline:
                    raise KeyboardInterrupt
            return request.Test()

        poll(gathered)
        if flag[0]:
            raise KeyboardInterrupt


def _calls_within(comm, per_call: dict[str, float], calls: dict[str, int]) -> dict[str, int]:
    """Each backend's calls a repetition: as many as `calls` says, but no more than
    fill _REPETITION_S at the slowest rank's time a call (`per_call`, this rank's); the
    same on every rank (they must make the same collectives)."""
    slowest = _slowest(comm, [per_call[b] for b in calls])
    return {b: max(1, min(count, int(_REPETITION_S / max(t, 1e-9))))
            for (b, count), t in zip(calls.items(), slowest)}


def _slowest(comm, times: list[float]) -> np.ndarray:
    """Each of `times` at the slowest rank (collective: every rank passes as many)."""
    from mpi4py import MPI

    slowest = np.array(times, np.float64)
    comm.Allreduce(MPI.IN_PLACE, slowest, MPI.MAX)
    return slowest


def effective_size(op: str, size: int, n: int) -> int:
    """Allgather's size is the gathered output: each rank sends size // n bytes."""
    if op == "allgather":
        return max(4, size // n // 4 * 4) * n
    return max(4, size // 4 * 4)


def _unavailable(backend: str) -> str | None:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        if not torch.cuda.is_available():
            return "skipped: no CUDA device on this rank"
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return "skipped: the process group is not NCCL"
    if backend == "gloo" and not dist.is_initialized():
        return "skipped: torch.distributed is not initialised"
    return None


def _unavailable_for(op: str, backend: str) -> str | None:
    if backend == "memory" and op != "allreduce":
        return "skipped: the memory bound is an allreduce's (each rank's buffer in place)"
    return _unavailable(backend)


_gloo_group = None


def _gloo():
    """The default group on CPU ranks; on GPU ranks (NCCL default) a gloo group, made once."""
    global _gloo_group
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if _gloo_group is None:
        _gloo_group = dist.new_group(backend="gloo")
    return _gloo_group


def _buffers(op: str, size: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The send and receive buffers (the same array but for an allgather) of every
    backend at this size, float32, every page written.

    One pair for all backends: how a buffer's pages are backed differs between
    allocations and changes a large collective's speed as much as the backend does
    (NumPy asks for transparent huge pages from 4 MiB; the kernel grants them as it
    can: a broadcast of 32 MiB ran 1.5-2x faster on huge pages, mpilab's and MPI's alike),
    so no backend may have luckier pages than another.
    """
    count = effective_size(op, size, n) // 4
    # zeros: an allreduce sums in place, hundreds of times; any other value would double
    # each time and overflow (numpy warns on the ranks' stderr), for no difference in speed.
    # Written, not only allocated: np.zeros maps untouched pages to the kernel's one zero
    # page, which a buffer that is only read (a broadcast's root, an allgather's input)
    # would read from cache, whatever its size.
    send = np.zeros(count // n if op == "allgather" else count, np.float32)
    send.fill(0)
    recv = np.zeros(count, np.float32) if op == "allgather" else send
    recv.fill(0)
    return send, recv


def _step(op: str, backend: str, buffers: tuple[np.ndarray, np.ndarray], comm,
          n: int) -> Callable[[], None]:
    """One collective of `op` by `backend` on `buffers` (_buffers); `comm` (n ranks) is
    the MPI backend's."""
    import torch

    send, recv = buffers

    if backend == "mpi":
        from mpi4py import MPI

        return {
            "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, send, MPI.SUM),
            "broadcast": lambda: comm.Bcast(send, root=0),
            "allgather": lambda: comm.Allgather(send, recv),
        }[op]
    # an allgather's output is [n, part]; the others' one buffer holds any count
    t_send = torch.from_numpy(send)
    t_recv = torch.from_numpy(recv).view(n, -1) if op == "allgather" else t_send
    if backend == "mpilab":  # what a user calls (allgather into a buffer, as the others)
        from . import collectives

        return {
            "allreduce": lambda: collectives.allreduce(t_send),
            "broadcast": lambda: collectives.broadcast(t_send, root=0),
            "allgather": lambda: collectives.allgather(t_send, out=t_recv),
        }[op]
    if backend == "memory":  # no collective: each rank's buffer read and written in place
        return lambda: np.multiply(send, 1.0, out=send)
    if backend == "mpilab-internal":  # what the public call runs, from the tensor's plan
        from . import collectives

        # the tensors go with each function (a default argument): the plan's views do
        # not own their memory, which would be freed with the last tensor
        tensors = (t_send, t_recv)
        plan = collectives.tensor_plan(t_send)
        if op == "allreduce":
            run = plan.reducer("sum")
            return lambda tensors=tensors: run()
        if op == "broadcast":
            run = plan.broadcaster(0)
            return lambda tensors=tensors: run()
        run = plan.gatherer(collectives.tensor_plan(t_recv))
        return lambda tensors=tensors: run()

    import torch.distributed as dist

    device = "cuda" if backend == "nccl" else "cpu"
    group = _gloo() if backend == "gloo" else None
    t_send, t_recv = t_send.to(device), torch.from_numpy(recv).to(device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def run(fn) -> Callable[[], None]:
        return lambda: (fn(), sync())

    return {
        "allreduce": run(lambda: dist.all_reduce(t_send, group=group)),
        "broadcast": run(lambda: dist.broadcast(t_send, src=0, group=group)),
        "allgather": run(lambda: dist.all_gather_single(t_recv, t_send, group=group)),
    }[op]

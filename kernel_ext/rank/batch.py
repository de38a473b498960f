"""What ``mpilab.init()`` does for a batch script (under ``mpiexec``, no notebook).

The notebook's ranks are engines: a cell's exception never reaches ``sys.excepthook``
there, and the watchdog releases the peers. A script has neither, so:

- **a rank that fails ends the job.** When an exception ends the script on one rank,
  that rank would go on into MPI's finalization, which waits for every rank, while the
  others wait for it in their next collective: the job would hang until its time limit,
  the traceback long scrolled by. The rank prints its traceback, one line says that
  every rank is being ended, and ``MPI_Abort`` ends them once Python has printed
  everything (torchrun likewise stops the other workers when one fails, and ``python -m
  mpi4py`` aborts). Ranks that fail alike (Ctrl-C reaches every rank at once) say it
  once: the first to fail, through the store (script_watch.Watch.say).
- **a start that cannot work is one line**, not a traceback through mpilab's code from
  every rank: rank 0 says it (the others wait a moment, so that it is said once), then
  the job ends as above.
- **a collective that can never complete is named** (script_watch.py, on any node): a
  rank that waits in one of mpilab's collectives that a rank which ended its script
  never began (`if rank == 0: mpilab.allreduce(…)`, or data that ran out a step early
  on one rank), or ranks in different collectives at the same point, would wait for
  good, and the ended rank in MPI's finalization; the line names both, and the job
  ends as above. A rank waiting for it in torch's own collectives (gloo) fails as
  under torchrun, whose ended process closes its connections: the ended rank shuts
  them after a second at exit, and the failure is named the same way. Ranks that have
  not reached one of mpilab's collectives within the collective timeout (which
  torch.distributed's own collectives keep in mpilab's ranks) are named too.
- **the torch.distributed groups end before the interpreter does**
  (torch_group.release_at_exit): left to its teardown, a gloo group aborted the process
  about half the time.
- **processes that MPI sees apart are named.** ``srun`` without a PMI plugin MPICH
  speaks, ``torchrun``, or another MPI's ``mpirun`` start several processes that each
  find themselves a world of one and would each train alone; that is refused with the
  command that starts them as one world.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from .context import BootstrapError, RankContext
from .frames import user_frames
from .script_watch import Stuck, Watch
from .torch_group import disconnect_peers, release_at_exit

ABORT_CODE = 1  # the exit status of a Python script that ends with an exception
# How long a rank other than 0 waits before it says why the start failed: every rank
# usually learns the same reason, and rank 0 ends the job as it says it. So long, too,
# does a rank whose reason to end the job another rank says.
OTHERS_WAIT_S = 1.0

# How long a rank that ends the job gives mpiexec to take its last lines first.
OUTPUT_DRAIN_S = 0.3
# How often a rank that ended its script looks whether every rank has.
EXIT_POLL_S = 0.05
# How long it waits for them before it shuts its torch.distributed connections, so that
# a peer waiting for it in a torch collective fails as under torchrun (a rank's exit
# closes them there); ranks that end together never get there.
DISCONNECT_AFTER_S = 1.0

_failed = [False]
_installed: list[bool] = []
_watch: list[Watch] = []  # this rank's, once the store is up


def install(comm: Any, rank: int, world_size: int) -> None:
    """The hook and the exit above, for this rank of `comm` (call once MPI is up and
    before anything else can fail; once per process)."""
    if _installed:
        return
    _installed.append(True)
    previous = sys.excepthook

    def excepthook(kind, value, tb) -> None:
        _failed[0] = True
        if isinstance(value, BootstrapError):
            if world_size == 1 and launcher_rank() != 0:
                return  # processes started apart: the launcher's rank 0 says it
            if rank != 0 and world_size > 1:
                time.sleep(OTHERS_WAIT_S)
            print(f"mpilab.init(): {value}", file=sys.stderr, flush=True)
            return
        # the traceback as the script would print it, without mpilab's frames (as a
        # notebook cell's); on the exception too, which is what Python's own hook prints
        # from (its outermost frame may be one left out: runpy's, under `python -m`)
        tb = user_frames(tb)
        stuck = _watch[0].torch_wait_ended(value) if _watch else None
        if _watch and not _says(_watch[0], failure_reason(kind, value, tb, stuck)):
            time.sleep(OTHERS_WAIT_S)  # another rank says the same, and ends the job
            return
        previous(kind, value.with_traceback(tb), tb)
        if world_size > 1:
            what = (stuck.line if stuck is not None
                    else f"rank {rank} was interrupted" if issubclass(kind, KeyboardInterrupt)
                    else f"rank {rank} ended with {kind.__name__}")
            print(f"mpilab: {what}: ending all {world_size} ranks", file=sys.stderr,
                  flush=True)

    def at_exit() -> None:
        # atexit: after the excepthook chain (torch.distributed's wraps this one and
        # writes what it printed when it returns), before MPI's own finalization
        if world_size < 2:
            return
        if not _failed[0]:
            _leave_together(comm)
            return
        _end_every_rank(comm)

    sys.excepthook = excepthook
    # atexit runs the last registered first: at_exit, then the groups' end, then MPI's
    # own finalization (registered when mpi4py was imported). An abort must come before
    # the groups' end, which would join a gloo thread inside a collective whose peers
    # are gone.
    atexit.register(release_at_exit)
    atexit.register(at_exit)


def failure_reason(kind: type, value: BaseException, tb: Any, stuck: Stuck | None) -> str:
    """What ended a rank's script, in words that are the same on every rank it ends
    alike (Watch.say): Ctrl-C reaches every rank at once, and a bug in the script often
    fails every rank at the same line."""
    if stuck is not None:
        return stuck.reason
    if issubclass(kind, KeyboardInterrupt):
        return "interrupted"
    where = ""
    while tb is not None:
        where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{kind.__qualname__}: {value}{where}"


def _says(watch: Watch, reason: str) -> bool:
    try:
        return watch.say(reason)
    except Exception:  # noqa: BLE001 - the store is gone with rank 0: say it here
        return True


def _end_every_rank(comm: Any) -> None:
    """MPI_Abort, once what this rank wrote has had time to reach mpiexec: the abort
    ends every process of the job at once, hydra's proxies too, and a proxy that had
    not yet passed on this rank's last lines loses them (seen: the whole traceback)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing to lose
            pass
    time.sleep(OUTPUT_DRAIN_S)
    comm.Abort(ABORT_CODE)


def _leave_together(comm: Any) -> None:
    """The script ended on this rank: say so in the store (a rank that waits for this
    one in a collective this rank never began learns it there: script_watch.py), then
    wait for every rank to end theirs, as MPI's finalization would, interruptibly. From
    a second on, with the torch.distributed connections shut (disconnect_peers)."""
    from mpi4py import MPI

    if MPI.Is_finalized():  # the script ended MPI itself: nothing is left to wait in
        return
    for watch in _watch:
        watch.stop()
        watch.record_end()
    ended = comm.Ibarrier()
    disconnect_at = time.monotonic() + DISCONNECT_AFTER_S
    while not ended.Test():
        if disconnect_at is not None and time.monotonic() >= disconnect_at:
            disconnect_at = None
            disconnect_peers()
        time.sleep(EXIT_POLL_S)


def watch(ctx: RankContext, collective_timeout: float) -> None:
    """Start this rank's script watch (script_watch.py): once the bootstrap has made the
    rendezvous store, which it reads and writes. `collective_timeout`: how long a rank
    may wait in one of mpilab's collectives (torch's own wait as long)."""
    if ctx.world_size < 2 or ctx.store is None or _watch:
        return
    from .agent import current

    def end_job(line: str) -> None:
        print(f"mpilab: {line}: ending all {ctx.world_size} ranks", file=sys.stderr,
              flush=True)
        _end_every_rank(ctx.comm)

    _watch.append(Watch(ctx.store, ctx.rank, ctx.world_size, current().state, end_job,
                        collective_timeout))
    _watch[0].start()


def launched_apart(world_size: int, environ: Mapping[str, str] = os.environ) -> str | None:
    """One line when a launcher started several processes that MPI sees as worlds of one
    each; None when MPI's world is the launcher's (or there is no other launcher)."""
    if world_size != 1 or environ.get("PMI_SIZE"):  # the PMI a launcher gave MPICH
        return None
    tasks = _count(environ.get("SLURM_STEP_NUM_TASKS"))
    if tasks > 1:
        return (f"srun started {tasks} tasks, but MPI sees each as a world of one (srun "
                "gave MPICH no PMI): run `srun --mpi=pmi2 …`, or `mpiexec -n "
                f"{tasks} python …` inside the job")
    if environ.get("TORCHELASTIC_RUN_ID") not in (None, "mpilab"):
        workers = _count(environ.get("WORLD_SIZE"))
        if workers > 1:
            return (f"torchrun started {workers} workers, but mpilab's ranks are MPI "
                    f"processes: start the script with `mpiexec -n {workers} python …` "
                    "(it sets torchrun's environment for the script)")
    processes = _count(environ.get("OMPI_COMM_WORLD_SIZE"))
    if processes > 1:
        return (f"Open MPI's mpirun started {processes} processes, but this Python's MPI "
                "is another, so each is a world of one: start the script with "
                f"{os.path.join(sys.prefix, 'bin', 'mpiexec')} -n {processes}")
    return None


def launcher_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank among the launcher's (0 where none says): hydra's, srun's,
    torchrun's or Open MPI's variable, read before MPI is up or where MPI sees apart."""
    for name in ("PMI_RANK", "SLURM_PROCID", "RANK", "OMPI_COMM_WORLD_RANK"):
        if environ.get(name) is not None:
            return _count(environ.get(name))
    return 0


def _count(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0

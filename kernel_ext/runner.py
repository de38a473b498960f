"""Run a cell on the ranks and tell the notebook how it went: results shown as
`Out[rank r]`, failures raised as one `RanksError` with the ranks' own tracebacks.

`CellRunner(cluster).run(code, RunOptions(...))` works from plain Python; the
`%%ranks` magic only parses its arguments and calls it. The running cell itself
(output relay, watchdog, timeouts, interrupts) is `mpilab.cell.RunningCell`.
"""

from __future__ import annotations

import collections
import contextvars
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cell import (
    Ahead,
    CellOutcome,
    RunningCell,
    RunOptions,
    display_bundle,
    is_debugger_quit,
    is_interrupt,
)
from .cell_window import CellWindow
from .cluster import ClusterError, RankCluster, interrupts_held
from .live import LiveViews
from .selection import parse_ranks
from .wire import CELL_LABEL, CELL_LABEL_PREFIX, rank_label

RECENT_RUNS = 64  # cells remembered for `%mpilab dashboard` (the newest with metrics)


class RanksError(Exception):
    """A cell failed on the ranks. Rendered as the ranks' tracebacks, without our frames.
    failed: the ranks whose code raised (`%debug` next runs the debugger on the first),
    of the cluster's `generation` then."""

    def __init__(self, text: str, failed: Sequence[int] = (), generation: int = 0):
        super().__init__(text)
        self.text = text
        self.failed = list(failed)
        self.generation = generation

    def _render_traceback_(self) -> list[str]:
        return [self.text]


def _default_write(stream: str, text: str) -> None:
    target = sys.stderr if stream == "stderr" else sys.stdout
    target.write(text)
    target.flush()


@dataclass
class RecentRun:
    """A cell run on the ranks: which notebook cell, and the window of its records."""

    label: str | None  # "In[n]" as the notebook shows it; None outside IPython
    cell: CellWindow


class CellRunner:
    """Executes cells on a RankCluster and reports what they produced."""

    def __init__(self, cluster: RankCluster, write: Callable[[str, str], None] = _default_write):
        self.cluster = cluster
        self.write = write
        self.background: list[threading.Thread] = []
        self.last_views: LiveViews | None = None
        # newest last: `%mpilab dashboard` shows the newest one that has metrics, as most
        # cells (a print, a push) have none
        self.recent_runs: collections.deque[RecentRun] = collections.deque(maxlen=RECENT_RUNS)
        # --noblock cells sent, their AsyncResults and the cluster generation they run on:
        # later cells queue behind them
        self._noblock: list[tuple[Ahead, object, int]] = []

    def run(self, code: str, options: RunOptions | None = None) -> CellOutcome | None:
        """The cell's outcome (`--noblock`: None at once; its report comes later)."""
        options = options or RunOptions()
        self.cluster.check_usable()
        if "await" in code and has_top_level_await(code):  # the test parses: most lack it
            raise ClusterError(TOP_LEVEL_AWAIT)
        ranks = parse_ranks(options.spec, self.cluster.world_size)
        engines = self.cluster.engines(ranks)
        label = cell_label()
        try:
            # the notebook's In[n] travels with the cell, so that the ranks' tracebacks
            # say "Cell In[n]" with the number the notebook shows (mpilab.rank.engine);
            # Ctrl-C as it is sent stops the cell once every rank has it
            with interrupts_held() as held:
                ar = self.cluster.client[engines].execute(code, silent=False, block=False,
                                                          label=label or CELL_LABEL_PREFIX)
        except Exception as e:  # noqa: BLE001 - e.g. engines gone: one line, not a traceback
            raise ClusterError(f"the ranks cannot take the cell ({e}): `%mpilab restart` "
                               "brings back a full cluster") from None
        ahead = self.running_noblock()
        if options.block:
            outcome = self._follow(ar, ranks, options, label, ahead, held.asked)
            self._report(outcome, options)
            return outcome
        # --noblock: follow on a thread that carries this cell's context, so its output
        # and displays land under this cell even while later cells run.
        context = contextvars.copy_context()

        def follow_in_background():
            outcome = self._follow(ar, ranks, options, label, ahead, held.asked)
            try:
                self._report(outcome, options)
            except RanksError as e:
                self.write("stderr", e.text + "\n")

        thread = threading.Thread(target=context.run, args=(follow_in_background,),
                                  name="mpilab-noblock", daemon=True)
        self._noblock = [*self._noblock,
                         (Ahead(shown_label(label), tuple(ranks)), ar, self.cluster.generation)]
        thread.start()
        self.background.append(thread)
        return None

    def running_noblock(self) -> list[Ahead]:
        """The --noblock cells sent that have not ended on every rank: what a cell, pull or
        push sent now waits behind."""
        generation = self.cluster.generation
        running = [(a, ar, g) for a, ar, g in self._noblock
                   if g == generation and not ar.ready()]
        self._noblock = running
        return [a for a, _, _ in running]

    def _follow(self, ar, ranks: list[int], options: RunOptions, label: str | None,
                ahead: list[Ahead], interrupted: bool = False) -> CellOutcome:
        """The cell from its start on the ranks to its outcome, remembered for
        `%mpilab dashboard`; `interrupted`: Ctrl-C came as it was sent."""
        cell = RunningCell(self.cluster, ar, ranks, options, self.write, ahead)
        self.last_views = cell.views
        self.recent_runs.append(RecentRun(shown_label(label), cell.window))
        cell.watch(interrupted)
        with interrupts_held():  # the cell has ended: its last output and drawing, whole
            outcome = cell.finish()
            if options.block and not ahead:
                self._realign(outcome, ranks != list(range(self.cluster.world_size)))
            return outcome

    def _realign(self, outcome: CellOutcome, some_ranks: bool) -> None:
        """A cell that some ranks ended with an error, or that ran on some ranks only, none
        of them stopped or released: the ranks may have ended it at different collectives
        (one finished a broadcast another never began), and are brought back in step
        (`RankCluster.realign`). Where that fails, a restart."""
        if not (some_ranks or failed_ranks(outcome)) or outcome.interrupted or \
                outcome.timed_out or outcome.released or outcome.dead or outcome.restarted \
                or outcome.unfinished:
            return
        answered, numbers = self.cluster.realign()
        if answered and numbers is None:
            return
        if answered:
            at = ", ".join(f"#{number} on {rank_label(ranks)}"
                           for number, ranks in _by_number(numbers))
            outcome.notes.append(f"the ranks ended the cell at different collectives ({at}): "
                                 "the communicators were made again, so that the next "
                                 "ones pair up" + ("; a collective takes every rank: run "
                                                   "it on all of them (`%%ranks`)"
                                                   if some_ranks else ""))
            return
        self.cluster.restart()
        outcome.restarted = True
        outcome.notes.append("the ranks did not come back in step after the error and were "
                             "restarted: their state was lost")

    def _report(self, outcome: CellOutcome, options: RunOptions) -> None:
        for ranks in _group(outcome.results):
            data = dict(outcome.results[ranks[0]])
            # named even when one rank ran the cell: `%%ranks 1` shows Out[rank 1]
            data["text/plain"] = f"Out[{rank_label(ranks)}]: " + data.get("text/plain", "")
            display_bundle(data)
        if not outcome.ok:
            # ranks this cell restarted kept no error to debug: no generation is theirs
            generation = -1 if outcome.restarted else self.cluster.generation
            raise RanksError(report_text(outcome, options.timeout), failed_ranks(outcome),
                             generation)

    def wait_background(self, timeout: float | None = None) -> None:
        for thread in self.background:
            thread.join(timeout)
        self.background = [t for t in self.background if t.is_alive()]


TOP_LEVEL_AWAIT = (
    "%%ranks cannot run a cell with a top-level await: ipyparallel's engines never answer "
    "one (the cell would hang). Run the coroutine on a thread of its own: "
    "concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, main()).result()")


def has_top_level_await(code: str) -> bool:
    """The cell, as IPython reads it (magics and ! lines made Python), awaits outside any
    function. A cell that does not compile is left to the ranks, which say why."""
    import ast
    import inspect

    from IPython.core.inputtransformer2 import TransformerManager

    try:
        source = TransformerManager().transform_cell(code)
        compiled = compile(source, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                           dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return bool(compiled.co_flags & inspect.CO_COROUTINE)


def _raised(outcome: CellOutcome) -> dict[int, str]:
    """The ranks' errors that mpilab did not cause (by releasing or dropping them)."""
    return {r: e for r, e in outcome.errors.items()
            if r not in outcome.released and r not in outcome.dropped}


def _stopped(traceback: str) -> bool:
    """A rank's error that says it was stopped: interrupted, or its collective aborted."""
    return is_interrupt(traceback) or "CollectiveAborted" in traceback.splitlines()[-1]


def _by_number(numbers: list[int]) -> list[tuple[int, list[int]]]:
    """(collective number, the ranks at it), highest first."""
    ranks: dict[int, list[int]] = {}
    for rank, number in enumerate(numbers):
        ranks.setdefault(number, []).append(rank)
    return sorted(ranks.items(), reverse=True)


def failed_ranks(outcome: CellOutcome) -> list[int]:
    """The ranks whose code raised (being stopped, or quitting a debugger, is not it)."""
    return sorted(r for r, e in _raised(outcome).items()
                  if not _stopped(e) and not is_debugger_quit(e))


def report_text(outcome: CellOutcome, timeout: float | None) -> str:
    """What went wrong, for the notebook: each failure's traceback once with its ranks,
    one line per interrupted rank, then mpilab's notes."""
    multi = len(outcome.ranks) > 1
    lines = []
    if outcome.timed_out:
        lines.append(f"mpilab: the cell did not finish within {timeout:g} s; "
                     "its ranks were interrupted")
    if outcome.not_run:
        lines.append(f"[{rank_label(outcome.not_run)}] did not run the cell: the cell "
                     "before it there failed, and the ranks drop the cells queued behind "
                     "a failed one; run it again")
    # released and dropped ranks ended because mpilab ended them: the notes say why
    errors = _raised(outcome)
    for ranks in _group(errors):
        text = errors[ranks[0]]
        if _stopped(text) or (outcome.interrupted and is_debugger_quit(text)):
            lines.extend(f"[rank {r}] interrupted" for r in ranks)
        elif is_debugger_quit(text):
            lines.append(f"[{rank_label(ranks)}] quit the debugger: the cell stopped there")
        else:
            lines.append(f"[{rank_label(ranks)}] failed:" if multi else "")
            lines.append(text)
    lines.extend(f"mpilab: {note}" if not note.startswith(" ") else note
                 for note in outcome.notes)
    return "\n".join(line for line in lines if line)


def cell_label() -> str | None:
    """The label that names the notebook's running cell (None outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    count = getattr(shell, "execution_count", None)
    # IPython counts the running cell before it runs it: In[n] runs with the count at n+1
    return CELL_LABEL.format(count - 1) if isinstance(count, int) and count > 1 else None


def shown_label(label: str | None) -> str | None:
    """'In[n]' from the execute request's label, as the notebook shows the cell."""
    return label.removeprefix(CELL_LABEL_PREFIX) if label else None


_CELL_COUNT = re.compile(r"Cell In\[\d+\]")


def _group(per_rank: dict[int, object]) -> list[list[int]]:
    """Ranks with identical values: bundles by their text, tracebacks regardless of the
    execution counts (they differ once cells have run on some ranks only)."""
    groups: dict = {}
    for r in sorted(per_rank):
        value = per_rank[r]
        key = value.get("text/plain", repr(value)) if isinstance(value, dict) else value
        groups.setdefault(_CELL_COUNT.sub("Cell", key), []).append(r)
    return list(groups.values())

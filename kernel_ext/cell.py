"""One cell while it runs on its ranks, and what it produced.

`RunningCell` is made once the ranks have the cell's execute request. `watch()` relays
the ranks' output live and ends the cell when it must end (the watchdog's verdict,
`--timeout`, Ctrl-C); `finish()` drains what trails, names dead ranks and returns the
`CellOutcome`. `pump()` is one relay step: new output, displays and dashboard data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ipyparallel.error import TaskAborted

from .cell_window import CellWindow
from .cluster import RankCluster, answered, interrupts_held
from .live import LiveViews, TextInPlace
from .rank_input import CellQuestions
from .relay import (
    DEFAULT_OUTPUT_CAP,
    LinesInProgress,
    OutputRelay,
    StreamCursor,
    discard,
    strip_ansi,
)
from .watchdog import (
    DEFAULT_HANG_TIMEOUT_S,
    Ending,
    Verdict,
    Watchdog,
    describe,
    last_checkpoint,
)
from .wire import INPUT_MARKER, NO_RECORDS, rank_label

TICK_S = 0.05  # relay cadence: output and dashboard data reach the notebook within ~0.05 s
INTERRUPT_GRACE_S = 3.0
# ... for a rank in a call an interrupt cannot reach (a blocking MPI or torch.distributed
# collective called directly, its peer gone): long enough for one that just returned
BLOCKING_GRACE_S = 0.5
ABORT_SETTLE_S = 0.3  # a rank may begin a cell just as it is taken off the queue: watch
OUTPUT_TRAIL_S = 5.0
# when ipyparallel reports an engine gone, how long the watchdog is given to see its
# death (the process gone, mpiexec's report) before it is asked to name it
DEATH_SETTLE_S = 0.5
STREAMS = ("stdout", "stderr")
STOPPED_NOTE = "the ranks were stopped while this cell ran (`%mpilab stop` or restart)"
NOBLOCK_NO_INPUT = ("a --noblock cell takes no input: input() and debuggers on the ranks "
                    "are answered in a cell that waits for them")
# a cell (or pull, push) the ranks have not begun this long after it was sent waits behind
# an earlier one there: the notebook says so until they begin it
WAITING_NOTE_AFTER_S = 1.0


@dataclass(frozen=True)
class Ahead:
    """An earlier --noblock cell still running: later cells queue behind it there."""

    label: str | None  # "In[n]" as the notebook shows it; None outside IPython
    ranks: tuple[int, ...]


def waiting_text(waiting: list[int], ahead: Sequence[Ahead]) -> str:
    """Who holds up `waiting`, ranks that have not begun what was sent them: the earlier
    --noblock cells still running there, by name, else an earlier cell."""
    blocking = [a for a in ahead if set(a.ranks) & set(waiting)]
    named = [a.label for a in blocking if a.label]
    if not blocking:
        earlier = "an earlier cell"
    elif len(named) < len(blocking):
        earlier = "an earlier --noblock cell" if len(blocking) == 1 else \
            "earlier --noblock cells"
    else:
        earlier = f"the --noblock cell{'s' if len(named) > 1 else ''} {', '.join(named)}"
    return f"{rank_label(waiting)} {'is' if len(waiting) == 1 else 'are'} still running {earlier}"


@dataclass
class RunOptions:
    spec: str = "all"
    timeout: float | None = None
    block: bool = True
    dashboard: bool = True
    quiet: bool = False
    output_cap: int = DEFAULT_OUTPUT_CAP
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    # a bar above the merged output that shows one rank's own output at a time, live,
    # failing ranks marked (cells on several ranks; not with `quiet`)
    per_rank: bool = False


@dataclass
class CellOutcome:
    """What a finished cell produced, per rank; plain data for callers and tests."""

    ranks: list[int]
    results: dict[int, dict] = field(default_factory=dict)  # rank -> mime bundle
    # rank -> clean traceback where the cell raised (KeyboardInterrupt included)
    errors: dict[int, str] = field(default_factory=dict)
    # ranks whose part of the cell had not ended when it was given up (the notes say why)
    unfinished: list[int] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C
    timed_out: bool = False  # --timeout passed
    notes: list[str] = field(default_factory=list)  # the watchdog's explanation
    released: list[int] = field(default_factory=list)  # ranks it interrupted
    dropped: list[int] = field(default_factory=list)  # ranks it took the cell from, unbegun
    # ranks that dropped the cell themselves: ipykernel drops what is queued behind a
    # cell that failed (a --noblock one)
    not_run: list[int] = field(default_factory=list)
    dead: dict[int, str] = field(default_factory=dict)  # rank -> how it died
    restarted: bool = False  # the cluster was restarted to end the cell

    @property
    def ok(self) -> bool:
        """Nothing to tell beyond the results: every rank ran the cell to its end."""
        return not (self.errors or self.unfinished or self.notes or self.not_run)


def is_interrupt(traceback: str) -> bool:
    """A rank's traceback that ends in KeyboardInterrupt: it was stopped, not broken."""
    return traceback.rstrip().splitlines()[-1].startswith("KeyboardInterrupt")


def is_debugger_quit(traceback: str) -> bool:
    """A rank's traceback that ends in BdbQuit: the user quit a debugger there (or the
    cell was stopped at its prompt, which quits it)."""
    return traceback.rstrip().splitlines()[-1].startswith(("BdbQuit", "bdb.BdbQuit"))


class RunningCell:
    """A cell from the moment the ranks have it to its outcome."""

    def __init__(self, cluster: RankCluster, ar, ranks: list[int], options: RunOptions,
                 write: Callable[[str, str], None], ahead: Sequence[Ahead] = ()):
        """ar: ipyparallel's AsyncResult of the cell on `ranks` (one engine each, in order);
        ahead: the earlier --noblock cells still running when it was sent."""
        self.cluster = cluster
        self.ar = ar
        self.ranks = ranks
        self.options = options
        self.write = write
        self.outcome = CellOutcome(ranks=ranks)
        # the result's own metadata: the client forgets it once the output is complete
        metadata = ar.metadata if isinstance(ar.metadata, list) else [ar.metadata]
        self._metadata = dict(zip(ranks, metadata))
        self._cursors = {(r, s): StreamCursor() for r in ranks for s in STREAMS}
        self._outputs_shown = {r: 0 for r in ranks}
        # --quiet writes nothing, but the relay still keeps each rank's last lines: a
        # death report shows them
        self.relay = OutputRelay(ranks, discard if options.quiet else write,
                                 cap=options.output_cap)
        self.by_rank = _per_rank_view(ranks, options)
        # each rank's unfinished line (a bar redrawn in place) in a block under the output
        self._in_progress = None if options.quiet else LinesInProgress(len(ranks) == 1)
        self._in_progress_view = TextInPlace()
        self._ahead = ahead
        self._sent = time.monotonic()
        self._all_begun = False
        self._msg_ids = dict(zip(ranks, ar.msg_ids))
        self.views = LiveViews(cluster.store, cluster.world_size, options.dashboard,
                               self._msg_ids)
        self._singles = dict(zip(ranks, ar.split()))
        self.watchdog = Watchdog(cluster, ranks, options.hang_timeout, self.views.cell,
                                 notebook_waits=options.block)
        self._deadline: float | None = None  # monotonic; set once the ranks begin the cell
        self._generation = cluster.generation  # the ranks this cell runs on (RankCluster)
        self.questions = CellQuestions(cluster.input_desk, len(ranks), write,
                                       refuse="" if options.block else NOBLOCK_NO_INPUT)

    @property
    def stopped(self) -> bool:
        """The ranks this cell ran on were stopped (`%mpilab stop` or restart, from another
        cell while this one ran with --noblock): there is nothing left to watch or mend."""
        return self.cluster.generation != self._generation

    @property
    def window(self) -> CellWindow:
        """Which records are this cell's (the dashboard's and the watchdog's view)."""
        return self.views.cell

    # -- pump -----------------------------------------------------------------------------
    def pump(self, final: bool = False) -> None:
        """Relay what arrived since the last pump: stream text, displays, dashboard data.
        `final`: the cell is over, every partial line goes out."""
        now = time.monotonic()
        quiet = self.options.quiet
        unfinished: dict[tuple[int, str], tuple[int, str]] = {}
        for r, md in self._metadata.items():
            for stream in STREAMS:
                text = md[stream] or ""
                cursor = self._cursors[(r, stream)]
                new = cursor.read(text, final)
                if new:
                    clean = strip_ansi(new)
                    self.relay.feed(r, stream, clean, now)
                    if self.by_rank is not None:
                        self.by_rank.feed(r, clean)
                line = cursor.unfinished(text)
                if line:
                    unfinished[(r, stream)] = (cursor.lines, strip_ansi(line))
            outputs = md["outputs"]
            while self._outputs_shown[r] < len(outputs):
                output = outputs[self._outputs_shown[r]]
                marker = output.get("data", {}).get(INPUT_MARKER)
                if marker is not None:  # the rank asks for input (mpilab.rank.stdin)
                    self.questions.add(r, marker)
                elif not quiet:
                    self.relay.flush(now, final=True)  # text printed before it goes first
                    _publish(output, r, len(self.ranks) > 1)
                self._outputs_shown[r] += 1
        self.relay.flush(now, final=final)
        if self._in_progress is not None:
            written = self.relay.emitted_chars + sum(self._outputs_shown.values())
            block = self._in_progress.text(unfinished, now)
            waiting = "" if final else self._waiting_line(now)
            if waiting:
                block = f"{waiting}\n{block}" if block else waiting
            self._in_progress_view.show(block, written, now)
        self.views.tick()
        if self.by_rank is not None:
            tails: dict[int, list[str]] = {}
            for (r, _), (_, line) in unfinished.items():
                tails.setdefault(r, []).append(line)
            self.by_rank.set_unfinished({r: "\n".join(lines) for r, lines in tails.items()})
            self.by_rank.tick()

    def _waiting_line(self, now: float) -> str:
        """While some ranks have not begun the cell WAITING_NOTE_AFTER_S after it was sent,
        who they are still running; "" once every rank has begun (or ended) it."""
        if self._all_begun or now - self._sent < WAITING_NOTE_AFTER_S:
            return ""
        begun = self._begun()
        waiting = [r for r in self.ranks if r not in begun and not self._singles[r].ready()]
        if not waiting:
            self._all_begun = True
            return ""
        return (f"{waiting_text(waiting, self._ahead)}: this cell waits its turn there "
                "(the stop button takes it off their queue)")

    # -- watch ----------------------------------------------------------------------------
    def watch(self, interrupted: bool = False) -> None:
        """Pump until every rank has finished the cell, or end it first: on the
        watchdog's verdict, once --timeout has passed, or on Ctrl-C (`interrupted`: it
        came as the cell was sent)."""
        try:
            if interrupted:
                raise KeyboardInterrupt
            while not self.ar.wait(TICK_S):
                if self.stopped:
                    self.outcome.notes.append(STOPPED_NOTE)
                    return
                self.pump()
                self._ask_the_user()
                verdict = self.watchdog.check(time.time(), _finished(self._singles))
                if verdict is not None:
                    self._contain(verdict)
                    return
                if self._past_deadline():
                    self.outcome.timed_out = True
                    self._release(self.ranks)
                    return
        except KeyboardInterrupt:
            self.outcome.interrupted = True
            self._release(self.ranks)

    def _ask_the_user(self) -> None:
        """Put the ranks' questions to the user once every rank still running has asked,
        or no more come for a moment (`CellQuestions.due`), after the lines they
        printed before asking. While ranks wait for the user, and for a hang timeout
        after the last answer (a debugger's next step), the ranks waiting for them wait
        for the user: the watchdog calls no hang."""
        questions = self.questions
        if not questions.waiting:
            return
        self.watchdog.hold_hangs(float("inf"))
        running = [r for r in self.ranks if not self._singles[r].ready()]
        if questions.due(running):
            self.relay.flush(time.monotonic(), final=True)
            try:
                questions.ask()
            finally:
                self.watchdog.hold_hangs(questions.answered_at + self.options.hang_timeout)

    def _past_deadline(self) -> bool:
        """--timeout counts from when the ranks begin the cell: it may have waited behind
        a --noblock one."""
        timeout = self.options.timeout
        if timeout is None:
            return False
        if self._deadline is None:
            started = self.window.started(self.cluster.store)
            if started is None:
                return False
            self._deadline = time.monotonic() + timeout - (time.time() - started)
        return time.monotonic() > self._deadline

    def _contain(self, verdict: Verdict) -> None:
        """Act on the watchdog's verdict: release waiting ranks, or report dead ones."""
        outcome = self.outcome
        outcome.notes.extend(verdict.lines)
        if verdict.dead:
            outcome.dead = verdict.dead
            self.cluster.mark_dead(verdict.dead, self._generation)
            outcome.notes.append(
                f"the cluster is down: `%mpilab restart` brings back {self.cluster.world_size}"
                " ranks (their state was lost)")
            return
        outcome.released = verdict.release
        self._release(verdict.release, blocking=verdict.blocking)

    def _release(self, ranks: list[int], blocking: Sequence[int] = ()) -> None:
        """Interrupt `ranks` (SIGINT: KeyboardInterrupt and an abort of every wait), then
        bring mpilab's communicators back in step on all ranks; restart when a rank sits
        in a call that cannot be interrupted. A rank that has not begun the cell (it still
        runs an earlier --noblock one) is not interrupted: the cell leaves its queue.
        `blocking`: ranks the watchdog saw in a call an interrupt cannot reach; once only
        they are left, the restart comes after BLOCKING_GRACE_S."""
        with interrupts_held():  # a second Ctrl-C: the first is served to the end
            outcome, singles, store = self.outcome, self._singles, self.cluster.store
            begun = self._begun()
            queued = [r for r in ranks if r not in begun and not singles[r].ready()]
            aborted = None  # the queued ranks' answers to the abort, while some are owed
            if queued:
                try:
                    aborted = self.cluster.client.abort(
                        [self._msg_ids[r] for r in queued], targets=self.cluster.engines(queued),
                        block=False)
                except Exception:  # noqa: BLE001 - a dead engine is reported by the watchdog
                    pass
            interrupted: list[int] = []
            settled = time.monotonic() + (ABORT_SETTLE_S if queued else 0.0)
            deadline = time.monotonic() + INTERRUPT_GRACE_S
            blocked_deadline = time.monotonic() + BLOCKING_GRACE_S
            while True:
                # a rank that began the cell as it was taken off the queue is interrupted too:
                # until it has answered the abort (relayed by its nanny, so it may come late),
                # and for ABORT_SETTLE_S after, in which the echo of its beginning can arrive
                if aborted is not None and aborted.done():
                    aborted, settled = None, max(settled, time.monotonic() + ABORT_SETTLE_S)
                begun = self._begun()
                fresh = [r for r in ranks
                         if r not in interrupted and (r not in queued or r in begun)]
                if fresh:
                    self._interrupt(fresh)
                    interrupted += fresh
                pending = [r for r in interrupted if not singles[r].ready()]
                done = not pending
                now = time.monotonic()
                if (done and now >= settled and aborted is None) or now > deadline or \
                        (pending and now > blocked_deadline and set(pending) <= set(blocking)):
                    break
                time.sleep(TICK_S)
            outcome.dropped = dropped = [r for r in queued if r not in interrupted]
            if dropped and any(set(a.ranks) & set(dropped) for a in self._ahead):
                outcome.notes.append(
                    f"{waiting_text(dropped, self._ahead)}, not interrupted; this cell "
                    "had not begun there and was taken off their queue")
            elif dropped:  # stopped as it was sent: nothing ran there before it
                outcome.notes.append(
                    f"{rank_label(dropped)} had not begun this cell: it was taken off "
                    f"{'its' if len(dropped) == 1 else 'their'} queue")
            if not interrupted or self.stopped or (done and self.cluster.recover()):
                return
            stuck = [r for r in interrupted if not singles[r].ready()]
            heartbeats = store.heartbeats if store else {}
            for r in stuck:
                outcome.notes.append(
                    f"{describe(r, heartbeats.get(r))}: it did not answer the interrupt "
                    "(a blocking MPI or torch.distributed call, which mpilab cannot interrupt)")
            outcome.notes.append(
                f"restarted the ranks: their state was lost; {last_checkpoint(store)}")
            outcome.restarted = True
            self.cluster.restart()
            self._generation = self.cluster.generation  # this cell's own restart: it ends now

    def _begun(self) -> set[int]:
        """The ranks that began the cell: an engine echoes a cell's code as it begins it
        (ipyparallel keeps that in the request's metadata), at once, where the rank's
        start marker waits for its next batch of records."""
        return {r for r, md in self._metadata.items() if md.get("execute_input") is not None}

    def _interrupt(self, ranks: list[int]) -> None:
        """SIGINT to `ranks`, through their nannies; back once it has reached them, so
        the recovery sent after it is not what it interrupts."""
        try:
            answered(self.cluster.client.send_signal(
                "SIGINT", targets=self.cluster.engines(ranks), block=False))
        except Exception:  # noqa: BLE001 - a dead engine cannot be signalled; reported later
            pass

    # -- finish ---------------------------------------------------------------------------
    def finish(self) -> CellOutcome:
        """The last output, the dashboard's final drawing, and the cell's outcome."""
        ar, outcome, stopped = self.ar, self.outcome, self.stopped
        if ar.ready() and not stopped:
            # output travels on iopub and can trail the execute reply
            ar.wait_for_output(OUTPUT_TRAIL_S)
        self.pump(final=True)
        self.questions.close("the cell ended before the notebook asked")
        engines_died = not stopped and _engines_died(self._singles)
        self.views.finish(self._records_owed() if ar.ready() and not outcome.dead
                          and not engines_died and not stopped else None)
        note = self.relay.cap_note()
        if note and not self.options.quiet:
            self.write("stderr", note + "\n")
        if engines_died and not outcome.dead and not outcome.restarted:
            self._name_the_dead()
        if stopped:
            if STOPPED_NOTE not in outcome.notes:
                outcome.notes.append(STOPPED_NOTE)
        elif outcome.dead:
            self._add_last_lines_of_the_dead()
        else:
            self._collect()
        _finish_per_rank(self.by_rank, outcome)
        return outcome

    def _records_owed(self) -> list[int]:
        """The ranks whose last records of the cell the final drawing waits for: all but
        those whose reply says the cell queued none (wire.NO_RECORDS)."""
        return [r for r, single in self._singles.items() if not _no_records(single)]

    def _name_the_dead(self) -> None:
        """ipyparallel noticed an engine gone before the watchdog did: the watchdog names
        the dead and how they died."""
        time.sleep(DEATH_SETTLE_S)
        verdict = self.watchdog.check(time.time(), {})
        if verdict is not None and verdict.dead:
            self._contain(verdict)

    def _add_last_lines_of_the_dead(self) -> None:
        for r in sorted(self.outcome.dead):
            tail = self.relay.last_lines.get(r, [])[-5:]
            if tail:
                self.outcome.notes.append(f"last lines from rank {r}:")
                self.outcome.notes.extend(f"  {line}" for line in tail)

    def _collect(self) -> None:
        outcome = self.outcome
        for r, single in self._singles.items():
            if not single.ready():
                outcome.unfinished.append(r)
                continue
            result = single.get(return_exceptions=True)
            if isinstance(result, list):  # a one-engine view still answers with a list
                result = result[0]
            if isinstance(result, TaskAborted):
                if r not in outcome.dropped:
                    outcome.not_run.append(r)
            elif isinstance(result, BaseException):
                outcome.errors[r] = _error_text(result)
            elif result.metadata.get("execute_result"):
                outcome.results[r] = result.metadata["execute_result"].get("data", {})


def _no_records(single) -> bool:
    """The rank's reply to the cell carries wire.NO_RECORDS in its payload. ipyparallel
    keeps a successful reply's content on the ExecuteReply it returns; a failed cell's
    reply is an error (and its rank sent its records at once)."""
    try:
        reply = single.get(0)
        if isinstance(reply, list):  # a one-engine view still answers with a list
            reply = reply[0]
        payload = reply._content["payload"]
    except Exception:  # noqa: BLE001 - a failed cell, or an ipyparallel that keeps no content
        return False
    return any(item.get("source") == NO_RECORDS for item in payload)


def _engines_died(singles: dict) -> bool:
    for single in singles.values():
        if single.ready() and not single.successful():
            error = single.get(return_exceptions=True)
            error = error[0] if isinstance(error, list) else error
            if getattr(error, "ename", type(error).__name__) == "EngineError":
                return True
    return False


def _finished(singles: dict) -> dict[int, Ending]:
    """How each rank whose part of the cell has ended ended it."""
    done: dict[int, Ending] = {}
    for r, single in singles.items():
        if single.ready():
            done[r] = "ok" if single.successful() else "error"
    return done


def _error_text(error) -> str:
    """The clean traceback the rank produced (see mpilab.rank.engine)."""
    if error is None:
        return "failed"
    tb = getattr(error, "traceback", None)
    if tb:
        return strip_ansi(tb).rstrip()
    return f"{getattr(error, 'ename', 'Error')}: {getattr(error, 'evalue', error)}"


def display_bundle(data: dict, metadata: dict | None = None) -> None:
    from IPython.display import publish_display_data

    publish_display_data(data, metadata=metadata or {})


def _publish(output: dict, rank: int, label: bool) -> None:
    """Re-display a rank's display_data (plots, tables, widgets: ipyparallel relays a
    rank's widget messages to the notebook, so they stay live) in the notebook."""
    data = dict(output.get("data", {}))
    if label and "text/plain" in data:
        data["text/plain"] = f"[rank {rank}] " + data["text/plain"]
    display_bundle(data, output.get("metadata"))


def _per_rank_view(ranks: list[int], options: RunOptions):
    """The per-rank output bar, shown above the cell's merged output; None when not
    asked for (or one rank, or --quiet)."""
    if not options.per_rank or len(ranks) < 2 or options.quiet:
        return None
    import uuid

    from IPython.display import display
    from mpilab.widgets.rank_output import RankOutputs

    by_rank = RankOutputs(ranks)
    by_rank.display_id = uuid.uuid4().hex
    display(by_rank.mimebundle(), raw=True, display_id=by_rank.display_id)
    return by_rank


def _finish_per_rank(by_rank, outcome: CellOutcome) -> None:
    """The failing ranks marked, each one's error at the end of its own output."""
    if by_rank is None:
        return
    from IPython.display import update_display

    failed = {r: e for r, e in outcome.errors.items() if not is_interrupt(e)}
    failed.update({r: f"died: {cause}" for r, cause in outcome.dead.items()})
    for r, error in failed.items():
        by_rank.feed(r, f"\n{error}\n")
    by_rank.finish(sorted(failed))
    update_display(by_rank.mimebundle(), raw=True, display_id=by_rank.display_id)

"""Run a cell on the ranks: live output relay, results, errors, timeouts, interrupts.

`CellRunner(cluster).run(code, RunOptions(...))` works from plain Python; the
`%%ranks` magic only parses its arguments and calls it.
"""

from __future__ import annotations

import collections
import contextvars
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ipyparallel.error import TaskAborted

from .channel import CellWindow
from .cluster import ClusterError, RankCluster
from .live import LiveViews
from .watchdog import DEFAULT_HANG_TIMEOUT_S, Verdict, Watchdog, describe, last_checkpoint

TICK_S = 0.05  # relay cadence: output and dashboard data reach the notebook within ~0.05 s
HOLD_S = 0.3  # how long a line waits for identical lines from the other ranks
INTERRUPT_GRACE_S = 3.0
ABORT_SETTLE_S = 0.3  # a rank may begin a cell just as it is taken off the queue: watch
OUTPUT_TRAIL_S = 5.0
DEFAULT_OUTPUT_CAP = 4_000_000  # characters per cell, all ranks together
RECENT_RUNS = 64  # cells remembered for `%mpilab dashboard` (the newest with metrics)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class RanksError(Exception):
    """A cell failed on the ranks. Rendered as the ranks' tracebacks, without our frames."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def _render_traceback_(self) -> list[str]:
        return [self.text]


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """`all`, `0`, `0,2`, `1-3` (and mixtures) → sorted ranks; one-line errors."""
    spec = (spec or "all").strip()
    if spec == "all":
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"rank selection {spec!r} is malformed: use all, 0, 0,2 or 1-3")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"rank range {part!r} is backwards: write {hi}-{lo}")
        ranks.update(range(lo, hi + 1))
    bad = sorted(r for r in ranks if r >= world_size)
    if bad:
        raise ValueError(
            f"rank {bad[0]} does not exist: the cluster has ranks 0-{world_size - 1}"
            if world_size > 1 else f"rank {bad[0]} does not exist: the cluster has rank 0 only"
        )
    return sorted(ranks)


def format_ranks(ranks) -> str:
    """[0,1,2,5] → '0-2,5'."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def rank_label(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


@dataclass
class _Pending:
    text: str
    arrived: float


def _discard(stream: str, text: str) -> None:
    """A relay's writer for --quiet cells."""


class OutputRelay:
    """Turns per-rank output streams into prefixed lines, identical lines shown once.

    A line waits up to HOLD_S for the same line from the other selected ranks, so a
    loop that prints on every rank shows one line per step naming the ranks.
    """

    def __init__(self, ranks: list[int], write: Callable[[str, str], None],
                 cap: int = DEFAULT_OUTPUT_CAP, hold: float = HOLD_S):
        self.ranks = ranks
        self.write = write  # write(stream_name, text)
        self.cap = cap
        self.hold = hold
        self.emitted_chars = 0
        self.dropped_chars = 0
        self._partial: dict[tuple[int, str], str] = {}
        self._queues: dict[tuple[int, str], list[_Pending]] = {}
        self.last_lines: dict[int, list[str]] = {r: [] for r in ranks}

    def feed(self, rank: int, stream: str, text: str, now: float) -> None:
        if not text:
            return
        key = (rank, stream)
        buf = self._partial.get(key, "") + text
        *lines, rest = buf.split("\n")
        self._partial[key] = rest
        queue = self._queues.setdefault(key, [])
        for line in lines:
            queue.append(_Pending(line, now))
            tail = self.last_lines[rank]
            tail.append(line)
            del tail[:-20]

    def flush(self, now: float, final: bool = False) -> None:
        if final:
            for key, rest in self._partial.items():
                if rest:
                    self._queues.setdefault(key, []).append(_Pending(rest, now))
                    self.last_lines[key[0]].append(rest)
            self._partial.clear()
        for stream in ("stdout", "stderr"):
            self._flush_stream(stream, now, final)

    def _flush_stream(self, stream: str, now: float, final: bool) -> None:
        out: list[str] = []
        while True:
            heads: dict[str, list[int]] = {}
            oldest: dict[str, float] = {}
            for r in self.ranks:
                q = self._queues.get((r, stream))
                if q:
                    heads.setdefault(q[0].text, []).append(r)
                    oldest[q[0].text] = min(oldest.get(q[0].text, now), q[0].arrived)
            ready = [
                (text, ranks) for text, ranks in heads.items()
                if final or len(ranks) == len(self.ranks) or now - oldest[text] >= self.hold
            ]
            if not ready:
                break
            for text, ranks in ready:
                for r in ranks:
                    self._queues[(r, stream)].pop(0)
                prefix = "" if len(self.ranks) == 1 else f"[{rank_label(ranks)}] "
                out.append(f"{prefix}{text}\n")
        if out:
            self._emit(stream, "".join(out))

    def _emit(self, stream: str, text: str) -> None:
        room = self.cap - self.emitted_chars
        if room <= 0:
            self.dropped_chars += len(text)
            return
        if len(text) > room:
            self.dropped_chars += len(text) - room
            text = text[:room]
        self.emitted_chars += len(text)
        self.write(stream, text)

    def cap_note(self) -> str | None:
        if not self.dropped_chars:
            return None
        return (f"mpilab: output cut at {self.cap:,} characters for this cell; "
                f"{self.dropped_chars:,} more characters were dropped")


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
    errors: dict[int, str] = field(default_factory=dict)  # rank -> clean traceback
    interrupted: bool = False
    timed_out: bool = False
    notes: list[str] = field(default_factory=list)  # the watchdog's explanation
    released: list[int] = field(default_factory=list)  # ranks it interrupted
    dropped: list[int] = field(default_factory=list)  # ranks it took the cell from, unbegun
    # ranks that dropped the cell themselves: ipykernel drops what is queued behind a
    # cell that failed (a --noblock one)
    not_run: list[int] = field(default_factory=list)
    dead: dict[int, str] = field(default_factory=dict)
    restarted: bool = False


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
    """Executes cells on a RankCluster and relays what the ranks produce."""

    def __init__(self, cluster: RankCluster, write: Callable[[str, str], None] = _default_write):
        self.cluster = cluster
        self.write = write
        self.background: list[threading.Thread] = []
        self.last_views: LiveViews | None = None
        # newest last: `%mpilab dashboard` shows the newest one that has metrics, as most
        # cells (a print, a push) have none
        self.recent_runs: collections.deque[RecentRun] = collections.deque(maxlen=RECENT_RUNS)

    def run(self, code: str, options: RunOptions | None = None) -> CellOutcome | None:
        options = options or RunOptions()
        self.cluster.check_usable()
        ranks = parse_ranks(options.spec, self.cluster.world_size)
        engines = self.cluster.engines(ranks)
        label = cell_label()
        try:
            # the notebook's In[n] travels with the cell, so that the ranks' tracebacks
            # say "Cell In[n]" with the number the notebook shows (mpilab.rank.engine)
            ar = self.cluster.client[engines].execute(code, silent=False, block=False,
                                                      label=label)
        except Exception as e:  # noqa: BLE001 - e.g. engines gone: one line, not a traceback
            raise ClusterError(f"the ranks cannot take the cell ({e}): `%mpilab restart` "
                               "brings back a full cluster") from None
        outcome = CellOutcome(ranks=ranks)
        if options.block:
            self._relay(ar, ranks, options, outcome, label)
            self._report(outcome, options)
            return outcome
        # --noblock: relay on a thread that carries this cell's context, so its output
        # and displays land under this cell even while later cells run.
        context = contextvars.copy_context()

        def relay_in_background():
            self._relay(ar, ranks, options, outcome, label)
            try:
                self._report(outcome, options)
            except RanksError as e:
                self.write("stderr", e.text + "\n")

        thread = threading.Thread(target=context.run, args=(relay_in_background,),
                                  name="mpilab-noblock", daemon=True)
        thread.start()
        self.background.append(thread)
        return None

    def _relay(self, ar, ranks: list[int], options: RunOptions, outcome: CellOutcome,
               label: str | None = None) -> None:
        # the result's own metadata: the client forgets it once the output is complete
        metadata = ar.metadata if isinstance(ar.metadata, list) else [ar.metadata]
        md_of_rank = dict(zip(ranks, metadata))
        offsets = {(r, s): 0 for r in ranks for s in ("stdout", "stderr")}
        shown_outputs = {r: 0 for r in ranks}
        # --quiet writes nothing, but the relay still keeps each rank's last lines: a
        # death report shows them
        relay = OutputRelay(ranks, _discard if options.quiet else self.write,
                            cap=options.output_cap)
        by_rank = _per_rank_view(ranks, options)
        views = LiveViews(self.cluster.store, self.cluster.world_size, options.dashboard,
                          dict(zip(ranks, ar.msg_ids)))
        self.last_views = views
        self.recent_runs.append(RecentRun(
            label.removeprefix(CELL_LABEL.split(":")[0] + ":") if label else None, views.cell))
        deadline = None  # --timeout counts from when the ranks begin the cell

        def pump(final: bool = False) -> None:
            now = time.monotonic()
            for r, md in md_of_rank.items():
                for stream in ("stdout", "stderr"):
                    text = md[stream] or ""
                    start = offsets[(r, stream)]
                    if len(text) > start:
                        offsets[(r, stream)] = len(text)
                        clean = _ANSI.sub("", text[start:])
                        relay.feed(r, stream, clean, now)
                        if by_rank is not None:
                            by_rank.feed(r, clean)
                outputs = md["outputs"]
                while shown_outputs[r] < len(outputs):
                    if not options.quiet:
                        relay.flush(now, final=True)
                        _publish(outputs[shown_outputs[r]], r, len(ranks) > 1)
                    shown_outputs[r] += 1
            relay.flush(now, final=final)
            views.tick()
            if by_rank is not None:
                by_rank.tick()

        singles = dict(zip(ranks, ar.split()))
        watchdog = Watchdog(self.cluster, ranks, options.hang_timeout, views.cell)
        try:
            while not ar.wait(TICK_S):
                pump()
                verdict = watchdog.check(time.time(), _finished(singles))
                if verdict is not None:
                    self._contain(ar, verdict, relay, outcome, views.cell)
                    break
                if options.timeout is not None and deadline is None:
                    started = views.cell.started(self.cluster.store)
                    if started is not None:  # it may have waited behind a --noblock cell
                        deadline = time.monotonic() + options.timeout - (time.time() - started)
                if deadline is not None and time.monotonic() > deadline:
                    outcome.timed_out = True
                    self._release(ar, ranks, outcome, views.cell)
                    break
        except KeyboardInterrupt:
            outcome.interrupted = True
            self._release(ar, ranks, outcome, views.cell)
        if ar.ready():
            # output travels on iopub and can trail the execute reply
            ar.wait_for_output(OUTPUT_TRAIL_S)
        pump(final=True)
        engines_died = _engines_died(singles)
        views.finish(ranks if ar.ready() and not outcome.dead and not engines_died else None)
        note = relay.cap_note()
        if note and not options.quiet:
            self.write("stderr", note + "\n")
        if not outcome.dead and not outcome.restarted and engines_died:
            # ipyparallel noticed first; the watchdog names the dead and how they died
            time.sleep(0.5)
            verdict = watchdog.check(time.time(), {})
            if verdict is not None and verdict.dead:
                self._contain(ar, verdict, relay, outcome, views.cell)
        if outcome.dead:
            for r in sorted(outcome.dead):
                tail = relay.last_lines.get(r, [])[-5:]
                if tail:
                    outcome.notes.append(f"last lines from rank {r}:")
                    outcome.notes.extend(f"  {line}" for line in tail)
            _finish_per_rank(by_rank, outcome)
            return
        self._collect(ar, ranks, outcome)
        _finish_per_rank(by_rank, outcome)

    def _contain(self, ar, verdict: Verdict, relay: OutputRelay, outcome: CellOutcome,
                 cell: CellWindow) -> None:
        """Act on the watchdog's verdict: release waiting ranks, or report dead ones."""
        outcome.notes.extend(verdict.lines)
        if verdict.dead:
            outcome.dead = verdict.dead
            self.cluster.mark_dead(verdict.dead)
            outcome.notes.append(
                f"the cluster is down: `%mpilab restart` brings back {self.cluster.world_size}"
                " ranks (their state was lost)")
            return
        outcome.released = verdict.release
        self._release(ar, verdict.release, outcome, cell)

    def _release(self, ar, ranks: list[int], outcome: CellOutcome, cell: CellWindow) -> None:
        """Interrupt `ranks` (SIGINT: KeyboardInterrupt and an abort of every wait), then
        bring mpilab's communicators back in step on all ranks; restart when a rank sits
        in a call that cannot be interrupted. A rank that has not begun the cell (it still
        runs an earlier --noblock one) is not interrupted: the cell leaves its queue."""
        singles = dict(zip(outcome.ranks, ar.split()))
        msg_ids = dict(zip(outcome.ranks, ar.msg_ids))
        waiting = [r for r in ranks
                   if r not in cell.bounds(self.cluster.store) and not singles[r].ready()]
        if waiting:
            try:
                self.cluster.client.abort([msg_ids[r] for r in waiting],
                                          targets=self.cluster.engines(waiting), block=False)
            except Exception:  # noqa: BLE001 - a dead engine is reported by the watchdog
                pass
        interrupted: list[int] = []
        settled = time.monotonic() + (ABORT_SETTLE_S if waiting else 0.0)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while True:
            # a rank that began the cell as it was taken off the queue is interrupted too
            begun = cell.bounds(self.cluster.store)
            fresh = [r for r in ranks
                     if r not in interrupted and (r not in waiting or r in begun)]
            if fresh:
                self._interrupt(fresh)
                interrupted += fresh
            done = all(singles[r].ready() for r in interrupted)
            if (done and time.monotonic() >= settled) or time.monotonic() > deadline:
                break
            time.sleep(TICK_S)
        outcome.dropped = [r for r in waiting if r not in interrupted]
        if outcome.dropped:
            outcome.notes.append(
                f"{rank_label(outcome.dropped)} had not begun the cell: an earlier --noblock "
                "cell still runs there and goes on; this one was taken off their queue")
        if not interrupted or (done and self.cluster.recover()):
            return
        stuck = [r for r in interrupted if not singles[r].ready()]
        heartbeats = self.cluster.store.heartbeats if self.cluster.store else {}
        for r in stuck:
            outcome.notes.append(
                f"{describe(r, heartbeats.get(r))}: it did not answer the interrupt "
                "(a blocking MPI or torch.distributed call, which mpilab cannot interrupt)")
        checkpoint = last_checkpoint(self.cluster.store)
        outcome.notes.append(f"restarted the ranks: their state was lost; {checkpoint}")
        outcome.restarted = True
        self.cluster.restart()

    def _interrupt(self, ranks: list[int]) -> None:
        try:
            self.cluster.client.send_signal("SIGINT", targets=self.cluster.engines(ranks),
                                            block=False)
        except Exception:  # noqa: BLE001 - a dead engine cannot be signalled; reported later
            pass

    def _collect(self, ar, ranks: list[int], outcome: CellOutcome) -> None:
        for r, single in zip(ranks, ar.split()):
            if not single.ready():
                outcome.errors.setdefault(r, "still running")
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

    def _report(self, outcome: CellOutcome, options: RunOptions) -> None:
        multi = len(outcome.ranks) > 1
        for ranks in _group(outcome.results):
            data = dict(outcome.results[ranks[0]])
            # named even when one rank ran the cell: `%%ranks 1` shows Out[rank 1]
            data["text/plain"] = f"Out[{rank_label(ranks)}]: " + data.get("text/plain", "")
            _display_bundle(data)
        if not outcome.errors and not outcome.notes and not outcome.not_run:
            return
        lines = []
        if outcome.timed_out:
            lines.append(f"mpilab: the cell did not finish within {options.timeout:g} s; "
                         "its ranks were interrupted")
        if outcome.not_run:
            lines.append(f"[{rank_label(outcome.not_run)}] did not run the cell: the cell "
                         "before it there failed, and the ranks drop the cells queued behind "
                         "a failed one; run it again")
        errors = {r: e for r, e in outcome.errors.items()
                  if r not in outcome.released and r not in outcome.dropped}
        for ranks in _group(errors):
            text = errors[ranks[0]]
            if text == "still running":
                continue  # explained by the notes
            if _is_interrupt(text) or "CollectiveAborted" in text.splitlines()[-1]:
                lines.extend(f"[rank {r}] interrupted" for r in ranks)
            else:
                lines.append(f"[{rank_label(ranks)}] failed:" if multi else "")
                lines.append(text)
        lines.extend(f"mpilab: {note}" if not note.startswith(" ") else note
                     for note in outcome.notes)
        raise RanksError("\n".join(line for line in lines if line))

    def wait_background(self, timeout: float | None = None) -> None:
        for thread in self.background:
            thread.join(timeout)
        self.background = [t for t in self.background if t.is_alive()]


CELL_LABEL = "mpilab:In[{}]"  # the execute request's label: the notebook's count


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


def _engines_died(singles: dict) -> bool:
    for single in singles.values():
        if single.ready() and not single.successful():
            error = single.get(return_exceptions=True)
            error = error[0] if isinstance(error, list) else error
            if getattr(error, "ename", type(error).__name__) == "EngineError":
                return True
    return False


def _finished(singles: dict) -> dict[int, str]:
    """rank -> 'ok' | 'error' for the ranks whose part of the cell has ended."""
    done = {}
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
        return _ANSI.sub("", tb).rstrip()
    return f"{getattr(error, 'ename', 'Error')}: {getattr(error, 'evalue', error)}"


def _is_interrupt(text: str) -> bool:
    return text.rstrip().splitlines()[-1].startswith("KeyboardInterrupt")


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


def _display_bundle(data: dict, metadata: dict | None = None) -> None:
    from IPython.display import publish_display_data

    publish_display_data(data, metadata=metadata or {})


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

    failed = {r: e for r, e in outcome.errors.items()
              if e != "still running" and not _is_interrupt(e)}
    failed.update({r: f"died: {cause}" for r, cause in outcome.dead.items()})
    for r, error in failed.items():
        by_rank.feed(r, f"\n{error}\n")
    by_rank.finish(sorted(failed))
    update_display(by_rank.mimebundle(), raw=True, display_id=by_rank.display_id)


def _publish(output: dict, rank: int, label: bool) -> None:
    """Re-display a rank's display_data (plots, tables) in the notebook."""
    data = dict(output.get("data", {}))
    if label and "text/plain" in data:
        data["text/plain"] = f"[rank {rank}] " + data["text/plain"]
    _display_bundle(data, output.get("metadata"))

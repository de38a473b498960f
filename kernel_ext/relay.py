"""The ranks' output streams as the notebook shows them: one line per rank and stream,
identical lines from several ranks shown once naming the ranks, capped per cell."""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from .wire import rank_label

HOLD_S = 0.3  # how long a line waits for identical lines from the other ranks
DEFAULT_OUTPUT_CAP = 4_000_000  # characters per cell, all ranks together
IN_PROGRESS_AFTER_S = 0.5  # an unfinished line this old is shown as it stands
IN_PROGRESS_SHOWN = 8  # lines in progress shown; past this, how many more there are
IN_PROGRESS_WIDTH = 240  # characters of each

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes (the ranks' tracebacks carry them)."""
    return _ANSI.sub("", text)


def discard(stream: str, text: str) -> None:
    """A relay's writer for --quiet cells."""


_DIRTY = re.compile(r"\r[^\n]")  # a carriage return that a later character overwrites


def overwritten(line: str) -> str:
    """A line as the notebook shows it: a carriage return with more of the line after it
    starts the line again (a progress bar redrawn in place shows its last state), one at
    its end is dropped. The rule ipyparallel applies to what it keeps of a stream, so a
    line reads the same however much of it ipyparallel had rewritten."""
    cut = line.rfind("\r", 0, len(line) - 1)
    return line[cut + 1:].rstrip("\r")


class StreamCursor:
    """Reads one rank's stream as ipyparallel accumulates it (`metadata["stdout"]`),
    complete lines as they arrive and the unfinished one at the end, each line once and
    as a notebook would show it (`overwritten`): the relay prefixes and merges lines of
    several ranks, where a carriage return would overwrite another rank's line.

    The accumulated text is not append-only: when a chunk holding a carriage return
    arrives, ipyparallel deletes, in every line, what a carriage return followed by more
    text overwrites. The line still being written may shrink, and so may a line already
    read (one whose carriage return ended an earlier chunk). So the cursor reads complete
    lines only, and checks, in O(1), whether a line it read has been rewritten since; if
    so it finds its place again by counting line breaks, which no rewrite removes.
    """

    def __init__(self) -> None:
        self.done = 0  # offset just past the last line break read
        self.lines = 0  # line breaks read
        self.mark: int | None = None  # offset of the first overwriting \r read, unrewritten

    def read(self, text: str, final: bool = False) -> str:
        """What is new in `text` (the stream's accumulated text now): complete lines, and
        with `final` the unfinished last one."""
        mark = self.mark
        if mark is not None and not (text[mark:mark + 1] == "\r"
                                     and text[mark + 1:mark + 2] not in ("", "\n")):
            # rewritten: every overwriting \r is gone, and nothing was added or removed
            # between line breaks but what they overwrote
            at = -1
            for _ in range(self.lines):
                at = text.index("\n", at + 1)
            self.done, self.mark = at + 1, None
        end = len(text) if final else text.rfind("\n", self.done) + 1
        if end <= self.done:
            return ""
        new = text[self.done:end]
        if self.mark is None:
            dirty = _DIRTY.search(new)
            if dirty is not None:
                self.mark = self.done + dirty.start()
        self.lines += new.count("\n")
        self.done = end
        return "\n".join(overwritten(line) for line in new.split("\n")) if "\r" in new else new

    def unfinished(self, text: str) -> str:
        """The line still being written, as it stands: `text` as `read` last had it."""
        return overwritten(text[self.done:]) if len(text) > self.done else ""


class LinesInProgress:
    """Each rank's unfinished line as it stands, for a block under the cell's output that
    the notebook redraws in place. The merged output shows a line once it ends; a bar
    redrawn with carriage returns (tqdm's text bar) ends when its loop does, so this is
    where it is followed. A line is shown once it has been unfinished for `after`
    seconds, so a line printed in pieces does not flash by; the time counts from the
    first rank's start of that line of the stream, so the ranks' bars, begun a few ms
    apart, appear together rather than one a redraw after the other."""

    def __init__(self, single: bool, after: float = IN_PROGRESS_AFTER_S):
        self.single = single  # one rank: no rank prefix, as in the merged output
        self.after = after
        self._since: dict[tuple[int, str], tuple[int, float]] = {}

    def text(self, lines: dict[tuple[int, str], tuple[int, str]], now: float) -> str:
        """The block for `lines`: (rank, stream) -> (the line's number in its stream,
        the line as it stands); identical lines once, naming their ranks."""
        since: dict[tuple[int, str], tuple[int, float]] = {}
        first: dict[tuple[str, int], float] = {}  # (stream, line number) -> earliest start
        for key, (number, _) in lines.items():
            seen = self._since.get(key)
            began = seen[1] if seen is not None and seen[0] == number else now
            since[key] = (number, began)
            first[key[1], number] = min(began, first.get((key[1], number), began))
        self._since = since
        ranks_of: dict[str, set[int]] = {}
        for key, (number, line) in lines.items():
            if now - first[key[1], number] >= self.after and line.strip():
                ranks_of.setdefault(line[:IN_PROGRESS_WIDTH], set()).add(key[0])
        rows = sorted((sorted(ranks), line) for line, ranks in ranks_of.items())
        shown = [line if self.single else f"[{rank_label(ranks)}] {line}"
                 for ranks, line in rows[:IN_PROGRESS_SHOWN]]
        if len(rows) > IN_PROGRESS_SHOWN:
            shown.append(f"… and {len(rows) - IN_PROGRESS_SHOWN} more lines in progress")
        return "\n".join(shown)


@dataclass
class _Pending:
    text: str
    arrived: float
    piece: int  # lines that came from a rank in one piece share it


class OutputRelay:
    """Turns per-rank output streams into prefixed lines, identical lines shown once.

    A line waits up to HOLD_S for the same line from the other selected ranks, so a
    loop that prints on every rank shows one line per step naming the ranks. A line
    shown for one rank alone takes with it the lines that came with it in one piece
    (the rows of a printed tensor, a model's repr), up to one that another rank has too,
    so ranks' multi-line values are not interleaved row by row.
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
        self._queues: dict[tuple[int, str], deque[_Pending]] = {}
        # stream -> how many ranks' queues hold each text, to tell a line shared
        self._waiting: dict[str, Counter[str]] = {}
        self._pieces = 0
        self.last_lines: dict[int, list[str]] = {r: [] for r in ranks}

    def feed(self, rank: int, stream: str, text: str, now: float) -> None:
        if not text:
            return
        key = (rank, stream)
        buf = self._partial.get(key, "") + text
        *lines, rest = buf.split("\n")
        self._partial[key] = rest
        self._queue(key, lines, now)

    def _queue(self, key: tuple[int, str], lines: list[str], now: float) -> None:
        if not lines:
            return
        self._pieces += 1
        queue = self._queues.setdefault(key, deque())
        waiting = self._waiting.setdefault(key[1], Counter())
        tail = self.last_lines[key[0]]
        for line in lines:
            queue.append(_Pending(line, now, self._pieces))
            waiting[line] += 1
        tail.extend(lines)
        del tail[:-20]

    def flush(self, now: float, final: bool = False) -> None:
        if final:
            for key, rest in self._partial.items():
                if rest:
                    self._queue(key, [rest], now)
            self._partial.clear()
        for stream in ("stdout", "stderr"):
            self._flush_stream(stream, now, final)

    def _flush_stream(self, stream: str, now: float, final: bool) -> None:
        out: list[str] = []
        waiting = self._waiting.get(stream, Counter())
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
                    piece = self._take((r, stream), waiting).piece
                prefix = "" if len(self.ranks) == 1 else f"[{rank_label(ranks)}] "
                out.append(f"{prefix}{text}\n")
                if len(ranks) == 1 and len(self.ranks) > 1:
                    q = self._queues[(ranks[0], stream)]
                    while q and q[0].piece == piece and waiting[q[0].text] == 1:
                        out.append(f"{prefix}{self._take((ranks[0], stream), waiting).text}\n")
        if out:
            self._emit(stream, "".join(out))

    def _take(self, key: tuple[int, str], waiting: Counter[str]) -> _Pending:
        pending = self._queues[key].popleft()
        waiting[pending.text] -= 1
        if not waiting[pending.text]:
            del waiting[pending.text]
        return pending

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

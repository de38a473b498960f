"""Failure containment and hang diagnosis while a cell runs on the ranks.

Reads the ranks' heartbeats (phase, collective op and sequence number, where the main
thread is) from the metrics store and the per-rank completion of the cell, and decides
when waiting ranks must be released: a peer failed, a collective hangs past the hang
timeout, ranks disagree about the collective they are in, or a rank died.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from .cell_window import CellWindow
from .cluster import engine_alive
from .placement import slurm_job_ended
from .wire import exit_reports, mismatch_line, rank_label

DEFAULT_HANG_TIMEOUT_S = 30.0
# a rank neither in a collective nor at a line that calls one when its peer failed: time
# to reach one (or to finish the cell) before it is released
PEER_FAILED_GRACE_S = 5.0
DEAD_HEARTBEAT_S = 5.0  # remote ranks: silence this long means dead
# a cut link or a lost host silences its ranks within a heartbeat or two of each other
# (they beat every half second, out of step): once one of them is past DEAD_HEARTBEAT_S,
# those silent this close to it are named in the same verdict
SILENT_TOGETHER_S = 1.0
# local ranks: how often their processes are looked at (psutil reads /proc several times
# a rank, too dear for every relay tick)
PROCESS_CHECK_S = 0.25
MPIEXEC_REPORT_WAIT_S = 2.0
UNKNOWN_CAUSE = "its process is gone"
SILENT_PREFIX = "no heartbeat"
# a cell on some ranks whose collective waits for ranks that run no cell: how long it
# waits before it is released, and how long after the collective began those ranks must
# still have said they were idle (a --noblock cell sent to them just before this one has
# begun there by then)
IDLE_PEERS_WAIT_S = 1.0

Ending = Literal["ok", "error"]  # how a rank's part of the cell ended


@dataclass
class Verdict:
    """Why the watchdog ends the cell, and which ranks to release."""

    kind: Literal["peer-failed", "hang", "mismatch", "dead"]
    lines: list[str]
    release: list[int] = field(default_factory=list)
    dead: dict[int, str] = field(default_factory=dict)  # rank -> how it died
    # released ranks at a line that calls MPI or torch.distributed directly: an interrupt
    # cannot reach them inside such a call (a DataParallel's backward it can)
    blocking: list[int] = field(default_factory=list)


def describe(rank: int, hb: dict | None) -> str:
    """'rank 0 was waiting in allreduce #57 for 8.2 s' from a heartbeat."""
    if hb is None:
        return f"rank {rank} had sent no heartbeat"
    if hb.get("phase") == "collective":
        shape = f" ({hb['op_shape']})" if hb.get("op_shape") else ""
        return (f"rank {rank} was waiting in {hb['op']} #{hb['seq']}{shape} "
                f"for {_age(hb):.1f} s")
    where = hb.get("where")
    if where:
        return f"rank {rank} was at {where}"
    return f"rank {rank} was {hb.get('phase', 'running')}"


def _age(hb: dict) -> float:
    """How long the rank has been in its current collective, as of now: its age when the
    rank sent the heartbeat, and the time since, on the notebook's clock (the store's
    "at": a rank on another host may keep another time)."""
    now = time.time()
    return hb.get("op_age", 0.0) + max(0.0, now - hb.get("at", now))


class CollectiveLedger:
    """What each rank said it did at each collective number during one cell, read from
    its heartbeats: the first report of a number is kept, and a report that differs is
    a mismatch (ranks that called different collectives, or sizes, at the same number).
    Only the heartbeats that changed since the last read are read (the store replaces a
    rank's heartbeat with each new one): at 1,024 ranks a heartbeat carries the last 16
    collectives, and comparing all of them on every check took most of its time. A
    check reads at most READS_PER_CHECK of them, taking up where the last one stopped:
    a round of 1,024 ranks' heartbeats is read over a few checks (a tick each), and no
    check holds the notebook's tick for all of them."""

    MAX_NUMBERS = 8192  # numbers remembered; past that the oldest half is forgotten
    READS_PER_CHECK = 256

    def __init__(self) -> None:
        self.behind = False  # heartbeats that changed were left for the next check
        self._cursor = 0  # where in the heartbeats the next check starts reading
        self._read: dict[int, dict] = {}  # rank -> the heartbeat read last
        self._done: dict[int, int] = {}  # rank -> the highest finished number read
        self._first: dict[int, tuple[tuple[str, int], int]] = {}  # seq -> (what, rank)
        self._clashes: dict[int, dict[int, tuple[str, int]]] = {}  # seq -> rank -> what

    def _note(self, seq: int, what: tuple[str, int], rank: int) -> None:
        known = self._first.get(seq)
        if known is None:
            self._first[seq] = (what, rank)
        elif known[0] != what:
            self._clashes.setdefault(seq, {known[1]: known[0]})[rank] = what

    def mismatch(self, heartbeats: dict[int, dict],
                 counts: Callable[[dict], bool] | None = None) -> str | None:
        """The first mismatched collective seen so far, as one line (None: none).
        `counts(hb)`: whether a heartbeat is one to compare (its rank's, of this cell);
        asked of the heartbeats that changed since the last read only."""
        first, clashes, done, read = self._first, self._clashes, self._done, self._read
        items = list(heartbeats.items())
        start = self._cursor % len(items) if items else 0
        reads, self.behind = 0, False
        for index, (rank, hb) in enumerate(items[start:] + items[:start]):
            if read.get(rank) is hb or (counts is not None and not counts(hb)):
                continue
            if reads == self.READS_PER_CHECK:
                self._cursor, self.behind = start + index, True
                break
            reads += 1
            read[rank] = hb
            upto = done.get(rank, -1)
            recent = hb.get("recent", ())  # finished ones, oldest first
            new = len(recent)
            while new and recent[new - 1][0] > upto:  # the ones not read before
                new -= 1
            for seq, op, nbytes in recent[new:]:
                self._note(int(seq), (op, int(nbytes)), rank)
            if new < len(recent):
                done[rank] = recent[-1][0]
            if hb.get("phase") == "collective":  # the one it is in
                self._note(hb["seq"], (hb["op"], hb.get("op_nbytes", 0)), rank)
        if len(first) > self.MAX_NUMBERS:
            for seq in sorted(first)[:len(first) // 2]:
                del first[seq]
        if not clashes:
            return None
        seq = min(clashes)
        members = dict(clashes[seq])
        for rank, hb in heartbeats.items():  # every rank that reported this number
            if counts is not None and not counts(hb):
                continue
            what = _history(hb).get(seq)
            if what is not None:
                members.setdefault(rank, what)
        return mismatch_line(seq, members)


def _history(hb: dict) -> dict[int, tuple[str, int]]:
    """seq -> (op, nbytes) of a rank's recent collectives and the one it is in."""
    history = {int(seq): (op, int(nbytes)) for seq, op, nbytes in hb.get("recent", [])}
    if hb.get("phase") == "collective":
        history[hb["seq"]] = (hb["op"], hb.get("op_nbytes", 0))
    return history


# a cell line that calls MPI or torch.distributed directly: comm.Allreduce(…),
# dist.all_reduce(…), node_comm.Barrier(), or a backward() whose DDP hooks allreduce;
# mpilab's own collectives report themselves
_COLLECTIVE_CALL = re.compile(r"\b(?:\w+_)?(?:comm|dist)\.\w+\(")
_DIRECT_CALL = re.compile(rf"{_COLLECTIVE_CALL.pattern}|\.backward\(")


def reported_causes(launcher_output: str) -> dict[tuple[str, int | None], str]:
    """(host, pid) -> 'killed by signal 9 (SIGKILL)' / 'exited with code 3', as each
    rank's supervisor reported it (mpilab.wire's exit report; the first report of a
    process counts)."""
    causes: dict[tuple[str, int | None], str] = {}
    for report in exit_reports(launcher_output):
        causes.setdefault((report.host, report.pid), report.cause)
    return causes


class Watchdog:
    """One per running cell; `check()` is called on every relay tick."""

    def __init__(self, cluster, ranks: list[int], hang_timeout: float, cell: CellWindow,
                 notebook_waits: bool = False):
        """notebook_waits: the notebook waits on this cell (not --noblock), so no other
        cell starts meanwhile and ranks idle outside it stay idle."""
        self.cluster = cluster
        self.notebook_waits = notebook_waits
        self.ranks = ranks
        self._ranks = set(ranks)  # membership tests: 1,024 ranks, 20 checks a second
        self.hang_timeout = hang_timeout
        self.cell = cell
        self._numbers: dict[int, int] = {}  # rank -> this cell's number there, once begun
        self.first_failure: float | None = None
        self._on_line: dict[int, tuple[str, float]] = {}  # rank -> (direct call, seen since)
        self._next_process_check = 0.0
        self._info = {i["rank"]: i for i in cluster.ranks}
        # the collectives compared at the last check: (heartbeats, events) filed by then,
        # and what the comparison found; compared again only once either count moves
        self._compared: tuple[int, int] | None = None
        self._mismatch: str | None = None
        self._ledger = CollectiveLedger()
        self._procs = {rank: proc for rank, proc in cluster.local_processes().items()
                       if rank in self._ranks}
        self._remote = [r for r in ranks if r not in self._procs and r in self._info]
        self._outside = [r for r in range(cluster.world_size) if r not in self._ranks]
        # no hang is called before this time (epoch s): ranks of this cell wait for the
        # user's answer to a rank's input() or debugger prompt, or have just had it
        self._hangs_held_until = 0.0
        self._job_ended: str | None = None  # why Slurm ended the ranks' job, once seen

    def hold_hangs(self, until: float) -> None:
        """Call no hang before `until` (epoch s; inf: until told otherwise): the ranks wait
        for the user, and a collective's wait so far counts the user's time."""
        self._hangs_held_until = until

    def _compares(self, hb: dict) -> bool:
        """A heartbeat whose collectives are compared: a rank of this cell's, sent
        while this cell runs."""
        return hb["r"] in self._ranks and self._this_cell(hb)

    def _this_cell(self, hb: dict | None) -> bool:
        """A heartbeat sent while this cell runs: not a stale one from the cell before,
        nor one of a --noblock cell this one waits behind."""
        return hb is not None and hb.get("cell") == self._numbers.get(hb["r"])

    def dead_ranks(self, now: float) -> dict[int, str]:
        dead = {}
        if now >= self._next_process_check:
            self._next_process_check = now + PROCESS_CHECK_S
            for rank, proc in self._procs.items():
                if not engine_alive(proc):
                    dead[rank] = self._cause(rank)
            if self._remote:  # their supervisors' reports reach the launcher's output
                output = self.cluster.engine_output(lines=200)
                reported, ended = reported_causes(output), self._ended_by_slurm(output)
                for rank in self._remote:
                    info = self._info[rank]
                    cause = ended or reported.get((info["host"], info["pid"]))
                    if cause is not None:
                        dead[rank] = cause
        store = self.cluster.store
        ages = store.heartbeat_ages(DEAD_HEARTBEAT_S - SILENT_TOGETHER_S) if store else {}
        silent = {r: age for r, age in ages.items()
                  if r in self._ranks and r not in self._procs and r not in dead}
        if silent and max(silent.values()) > DEAD_HEARTBEAT_S:
            dead.update((r, f"{SILENT_PREFIX} for {age:.0f} s") for r, age in silent.items())
        return dead

    def _ended_by_slurm(self, output: str) -> str | None:
        """Why Slurm ended the ranks' job, as the launcher's output says (kept: the
        verdict names the ranks it took in one line)."""
        self._job_ended = slurm_job_ended(output) or self._job_ended
        return self._job_ended

    def _death_lines(self, dead: dict[int, str]) -> list[str]:
        """A line a rank, or one for all the ranks a Slurm job's end took with it."""
        ended = [r for r, cause in sorted(dead.items()) if cause == self._job_ended]
        return ([f"{rank_label(ended)} ended: {self._job_ended}"] if ended else []) + \
            [self._death_line(r, cause) for r, cause in sorted(dead.items()) if r not in ended]

    def _death_line(self, rank: int, cause: str) -> str:
        info = self._info.get(rank, {})
        who = f"rank {rank} (pid {info.get('pid', '?')} on {info.get('host', '?')})"
        if cause.startswith(SILENT_PREFIX):  # gone or cut off: the notebook cannot tell
            return f"{who} cannot be reached: {cause}"
        return f"{who} died: {cause}"

    def _cause(self, rank: int) -> str:
        """mpiexec reports how a rank ended a moment after it ends: wait for that."""
        info = self._info[rank]
        deadline = time.monotonic() + MPIEXEC_REPORT_WAIT_S
        while True:
            output = self.cluster.engine_output(lines=200)
            cause = self._ended_by_slurm(output) or \
                reported_causes(output).get((info["host"], info["pid"]), UNKNOWN_CAUSE)
            if cause != UNKNOWN_CAUSE or time.monotonic() > deadline:
                return cause
            time.sleep(0.1)

    def check(self, now: float, finished: dict[int, Ending]) -> Verdict | None:
        """finished: how each rank whose part of the cell has ended ended it."""
        dead = self.dead_ranks(now)
        if dead:
            known = [r for r, cause in dead.items() if cause != UNKNOWN_CAUSE]
            if known:  # the others were ended by mpiexec's clean-up
                for r, cause in dead.items():
                    if cause == UNKNOWN_CAUSE:
                        dead[r] = f"ended by mpiexec after rank {known[0]} died"
            return Verdict("dead", self._death_lines(dead), dead=dead)
        running = [r for r in self.ranks if r not in finished]
        if not running:
            return None
        store = self.cluster.store
        heartbeats = dict(store.heartbeats) if store else {}
        self._numbers = self.cell.numbers(store) if store else {}
        waiting = {r: heartbeats.get(r) for r in running}
        seen = (store.beats, store.events) if store else None
        if seen is None or seen != self._compared or self._ledger.behind:
            self._compared = seen
            self._mismatch = self._ledger.mismatch(heartbeats, self._compares)
        mismatch = self._mismatch
        if mismatch:
            return Verdict("mismatch", [mismatch], release=running)
        failed = [r for r, how in finished.items() if how == "error"]
        if failed:
            if self.first_failure is None:
                self.first_failure = now
            waits_for_peer = all(self._waits_for_peer(hb, self.first_failure)
                                 for hb in waiting.values())
            if waits_for_peer or now - self.first_failure > PEER_FAILED_GRACE_S:
                who = ", ".join(str(r) for r in failed)
                lines = [f"{describe(r, hb)} when rank {who} failed"
                         for r, hb in waiting.items()]
                return Verdict("peer-failed", lines, release=running,
                               blocking=self._blocking(waiting))
            return None
        if now < self._hangs_held_until:
            return None
        # a heartbeat of an earlier cell (this one's first has not come yet) may still
        # show the collective a released rank was in
        stuck = {r: hb for r, hb in waiting.items()
                 if hb is not None and hb.get("phase") == "collective"
                 and _age(hb) > self.hang_timeout and self._this_cell(hb)}
        idle = self._idle_elsewhere(heartbeats)
        if not stuck and idle and self.notebook_waits:
            stuck = self._waiting_for_the_idle(waiting, heartbeats)
        if stuck:
            progress = ", ".join(
                f"rank {r} at collective #{hb['seq'] if hb else '?'}"
                + (" (cell finished)" if r in finished else "")
                for r, hb in sorted(heartbeats.items()) if r in self._ranks)
            lines = [f"hang: {describe(r, hb)}" for r, hb in sorted(stuck.items())]
            lines.append(f"progress: {progress}")
            if idle:
                lines.append(_not_in_this_cell(idle))
            return Verdict("hang", lines, release=running)
        return self._direct_hang(now, finished, waiting, idle)

    def _idle_elsewhere(self, heartbeats: dict[int, dict]) -> list[int]:
        """The ranks outside this cell (`%%ranks 0` runs it on rank 0 only), when every
        one of them is idle: none of them will join a collective of all the ranks. Empty
        when the cell runs everywhere, or when one outside runs a cell of its own (a
        --noblock one may be the other half of this cell's collectives)."""
        outside = self._outside
        if outside and all(heartbeats.get(r, {}).get("phase") == "idle" for r in outside):
            return outside
        return []

    def _waiting_for_the_idle(self, waiting: dict[int, dict | None],
                              heartbeats: dict[int, dict]) -> dict[int, dict]:
        """This cell's ranks in one of mpilab's collectives (every one is over all the
        ranks) while the ranks outside the cell sit idle, told by heartbeats received
        well after the collective began. The notebook waits on this cell, so nothing
        will start a cell there: the collective can never complete, and waiting out the
        hang timeout only keeps the user waiting."""
        idle_told = min(heartbeats[r]["recv"] for r in self._outside)
        return {r: hb for r, hb in waiting.items()
                if hb is not None and hb.get("phase") == "collective" and self._this_cell(hb)
                and _age(hb) > IDLE_PEERS_WAIT_S
                and idle_told - (hb["recv"] - hb.get("op_age", 0.0)) > IDLE_PEERS_WAIT_S / 2}

    def _waits_for_peer(self, hb: dict | None, failed_at: float) -> bool:
        """In one of mpilab's collectives, or at a line that calls one directly: a call
        the failed peer will never join. Told by a heartbeat that reached the notebook
        since the watchdog saw the failure (`failed_at`): one from before may show a
        collective or a line the rank has left (the init_process_group it waited in,
        while it now runs its backward); the next one comes within a heartbeat interval."""
        if hb is None or hb.get("recv", 0.0) < failed_at:
            return False
        return hb.get("phase") == "collective" or self._at_direct_call(hb)

    def _at_direct_call(self, hb: dict | None) -> bool:
        """This cell's heartbeat puts the rank at a line that calls MPI or
        torch.distributed directly (mpilab cannot see inside such a call)."""
        return (hb is not None and hb.get("phase") == "running" and self._this_cell(hb)
                and bool(_DIRECT_CALL.search(hb.get("where", ""))))

    def _blocking(self, waiting: dict[int, dict | None]) -> list[int]:
        """The ranks of `waiting` at a direct call of MPI or torch.distributed (not a
        backward(): DataParallel's answers the interrupt)."""
        return [r for r, hb in waiting.items()
                if self._at_direct_call(hb) and _COLLECTIVE_CALL.search(hb["where"])]

    def _direct_hang(self, now: float, finished: dict[int, Ending],
                     waiting: dict[int, dict | None], idle: list[int]) -> Verdict | None:
        """Ranks that sit on one line calling MPI or torch.distributed directly for
        hang_timeout while the others have finished the cell, or are `idle` outside it:
        a collective that those ranks never joined. mpilab cannot see inside such a call;
        a line that stays put while every peer is gone is the sign."""
        done = sorted(r for r, how in finished.items() if how == "ok")
        on_line = {}
        for r, hb in waiting.items():
            if not (self._at_direct_call(hb)
                    and (done or (idle and _COLLECTIVE_CALL.search(hb["where"])))):
                self._on_line.clear()
                return None
            where = hb["where"]
            line, since = self._on_line.get(r, (where, now))
            on_line[r] = (where, since if line == where else now)
        self._on_line = on_line
        if any(now - since <= self.hang_timeout for _, since in on_line.values()):
            return None
        why = f", and {rank_label(done)} finished the cell without joining it" if done else ""
        lines = [f"hang: rank {r} has been at {where} for {now - since:.1f} s{why}"
                 for r, (where, since) in sorted(on_line.items())]
        if idle:
            lines.append(_not_in_this_cell(idle))
        return Verdict("hang", lines, release=list(waiting), blocking=self._blocking(waiting))


def _not_in_this_cell(idle: list[int]) -> str:
    ranks = rank_label(idle)
    return (f"{ranks} {'is' if len(idle) == 1 else 'are'} not running this cell, and a "
            "collective waits for every rank: run it on all of them (`%%ranks`)")


def last_checkpoint(store) -> str:
    """The newest checkpoint the ranks reported saving, for the restart message."""
    if store is None:
        return "no checkpoint was saved"
    last = store.latest_event("checkpoint", rank=0)  # rank 0 writes them
    if last is None:
        return "no checkpoint was saved"
    when = time.strftime("%H:%M:%S", time.localtime(store.clocks.to_notebook(0, last["t"])))
    return f"the last checkpoint saved was {last.get('path', '?')} at {when}"

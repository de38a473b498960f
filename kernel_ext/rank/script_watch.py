"""A batch script's watchdog: whether a collective a rank waits in can still complete.

In a notebook the watchdog reads every rank's heartbeat and releases the ranks when one
waits in a collective that cannot complete. A script under ``mpiexec`` has no notebook,
and MPI shows nothing of a peer that waits on another node, or has ended. So the ranks
of a script write what a peer would need to know to the rendezvous store (the
torch.distributed TCPStore that ``mpilab.init()`` made, served by a thread of rank 0's
process: it answers while rank 0 computes):

- a rank that ends its script, how many collectives it began (`Watch.record_end`, from
  batch.py's exit);
- a rank that has waited in a collective for `CHECK_S`, that it is in it, and which
  collective it is, at that collective's number (the first rank's is kept:
  ``compare_set``).

A thread looks at the main thread's collective in progress every `CHECK_S`; one waited
in that long is checked against those records. A rank that ended before beginning it,
or a rank in another collective at the same number, means it never completes: every
rank would wait for good (and under torchrun until torch's timeout). A collective
waited in past the collective timeout (`mpilab.init(collective_timeout=…)`, 30 minutes
by default: what torch.distributed's own collectives wait in mpilab's ranks) names the
ranks that never arrived. The first rank to find one of these says so in one line, and
the job ends as it does when a rank fails.

It sees what mpilab numbers: its collectives and DataParallel's (the collectives'
numbers are the program's order, the same on every rank). A rank waiting in
torch.distributed's own collectives (gloo) learns of a peer that ended its script from
gloo, as under torchrun: the ended rank's exit shuts its connections
(torch_group.disconnect_peers), and the waiting rank's error is named from the records
here (`ended_in_torch`). A peer in MPI's own collectives shows nothing.

Cost: nothing on a collective's path; three store requests when a wait reaches a
second, one a second after that, two at exit; the store keeps a short key for each rank
that waited a second in a collective, and one for the collective.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..wire import collective_words, mismatch_line, rank_label

CHECK_S = 1.0  # how often the thread looks, and how long a wait is before it is checked
STOP_WAIT_S = 2.0  # the longest a rank's exit waits for a store request in flight
SAID_WAIT_S = 1.0  # the longest a rank waits for the reason the first rank is saying
_PREFIX = "mpilab-script/"
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo's words


@dataclass(frozen=True)
class Stuck:
    """A collective that cannot complete, and the line that says why."""

    line: str
    reason: str  # in words every rank that finds it uses alike: it is said once (`say`)


def ended_before(rank: int, seq: int, what: str,
                 ended: list[tuple[int, int]]) -> Stuck | None:
    """This rank waits in collective number `seq` (`what`, in words); `ended` holds
    (rank, collectives it began) of the ranks that ended their script. One that began
    fewer never joins this one."""
    for peer, began in ended:
        if began < seq:
            return Stuck(f"rank {peer} ended the script, but rank {rank} waits for it in "
                         f"{what} that rank {peer} never began",
                         f"rank {peer} ended before #{seq}")
    return None


def peer_gone(error: str) -> bool:
    """Whether `error` is gloo's, saying that a peer's connection closed."""
    return any(words in error for words in _PEER_GONE)


def ended_in_torch(rank: int, error: str, ended: list[tuple[int, int]]) -> Stuck | None:
    """This rank's torch.distributed call failed with `error`; `ended` as above. Gloo
    says a peer's connection closed when its process exits, or when its script ended
    and its exit shut the connections (torch_group.disconnect_peers): a rank that ended
    its script is the peer the collective waited for."""
    if not ended or not peer_gone(error):
        return None
    peer = ended[0][0]
    return Stuck(f"rank {peer} ended the script, but rank {rank} waited for it in a "
                 f"torch.distributed collective that rank {peer} never began",
                 f"rank {peer} ended before a torch.distributed collective")


def other_collective(rank: int, what: tuple[str, int], seq: int,
                     first: str) -> Stuck | None:
    """`what`: this rank's (op, bytes) at collective number `seq`; `first`: "rank op
    bytes" of the first rank that waited there. Another collective there is a mismatch:
    ranks in different collectives wait for each other for good."""
    peer, op, nbytes = first.split()
    theirs = (op, int(nbytes))
    if theirs == what:
        return None
    return Stuck(mismatch_line(seq, {int(peer): theirs, rank: what})
                 + ": every rank must call the same collectives in the same order",
                 f"mismatch at #{seq}")


def not_reached(missing: list[int], world_size: int, what: str,
                timeout_s: float) -> Stuck:
    """The collective `what` (in words) waited in for `timeout_s`; `missing`: the ranks
    that have not said they are in it."""
    why = ("the collective timeout: mpilab.init(collective_timeout=…) or "
           "$MPILAB_COLLECTIVE_TIMEOUT sets it")
    if not missing:
        return Stuck(f"{what} has not completed within {timeout_s:g} s, with every rank "
                     f"in it ({why})", timeout_reason(what))
    waited = world_size - len(missing)
    return Stuck(f"{rank_label(missing)} did not reach {what} within {timeout_s:g} s, "
                 f"while {waited} other rank{'s' if waited != 1 else ''} waited in it "
                 f"({why})", timeout_reason(what))


def timeout_reason(what: str) -> str:
    """The reason (Stuck.reason) of a collective `what` (in words) past the timeout."""
    return f"timeout in {what}"


class Watch:
    """The records in the store, and the thread that checks this rank's long waits."""

    def __init__(self, store: Any, rank: int, world_size: int, state: Any,
                 end_job: Callable[[str], None], timeout_s: float) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(_PREFIX, store)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s  # the collective timeout
        self.state = state  # the agent's RankState: `seq` and `current` of the main thread
        self.end_job = end_job  # says the line (with what comes after it) and ends the job
        self._ended: list[tuple[int, int]] = []  # the records read so far, in slot order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpilab-script-watch",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread before the interpreter does: a daemon thread inside a store
        request (C++) when the interpreter ends would end the process with
        std::terminate, as gloo's threads did (torch_group.release_at_exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT_S)

    def record_end(self) -> None:
        """This rank ended its script: a slot of its own (an atomic count), then its
        rank and how many collectives it began."""
        try:
            slot = self.store.add("ended", 1)
            self.store.set(f"ended/{slot}", f"{self.rank} {self.state.seq}")
        except Exception:  # noqa: BLE001 - the store is gone with rank 0: nothing waits on it
            pass

    def torch_wait_ended(self, error: BaseException) -> Stuck | None:
        """Whether `error`, which ends this rank's script, is a torch.distributed
        collective that a rank which ended its script never began (ended_in_torch)."""
        if not peer_gone(str(error)):
            return None
        self.stop()  # the thread reads the same records
        try:
            ended = self._read_ended()
        except Exception:  # noqa: BLE001 - rank 0 and its store are gone
            return None
        return ended_in_torch(self.rank, str(error), ended)

    def say(self, reason: str) -> bool:
        """Whether this rank says why the job ends. The first rank to find a reason says
        it; a later one says its own only if it is another `reason` (in words every rank
        that finds it uses alike): every rank interrupted at once, or waiting for the
        same rank that ended, or failing alike at the same line, is said once."""
        if self.store.add("said", 1) == 1:
            self.store.set("said/reason", reason)
            return True
        self.store.wait(["said/reason"], timedelta(seconds=SAID_WAIT_S))
        return self.store.get("said/reason").decode() != reason

    def _read_ended(self) -> list[tuple[int, int]]:
        count = self.store.add("ended", 0)
        while len(self._ended) < count:
            key = f"ended/{len(self._ended) + 1}"
            if not self.store.check([key]):
                break  # its rank took the slot and has not written it yet
            peer, began = self.store.get(key).decode().split()
            self._ended.append((int(peer), int(began)))
        return self._ended

    def announce(self, what: tuple[str, int], seq: int) -> Stuck | None:
        """Record that this rank is in collective number `seq`, and its (op, bytes);
        another collective recorded there first is a mismatch."""
        op, nbytes = what
        self.store.set(f"in/{seq}/{self.rank}", "")
        first = self.store.compare_set(f"at/{seq}", "", f"{self.rank} {op} {nbytes}")
        return other_collective(self.rank, what, seq, first.decode())

    def missing(self, seq: int) -> list[int]:
        """The ranks that have not recorded that they are in collective number `seq`
        (a request a rank: asked once, by the rank that names them)."""
        return [rank for rank in range(self.world_size)
                if not self.store.check([f"in/{seq}/{rank}"])]

    def _run(self) -> None:
        announced = 0  # the last collective number recorded: each is recorded once
        while not self._stop.wait(CHECK_S):
            current, seq = self.state.current, self.state.seq
            if current is None:
                continue
            start = current.start
            if time.time() - start < CHECK_S:
                continue
            what = (current.op, int(current.nbytes or 0))
            try:
                stuck = None
                if seq != announced:
                    announced = seq
                    stuck = self.announce(what, seq)
                words = collective_words(what[0], seq, what[1])
                stuck = stuck or ended_before(self.rank, seq, words, self._read_ended())
                timed_out = time.time() - start >= self.timeout_s
                still_in = (self.state.current is current and self.state.seq == seq
                            and current.start == start)  # one that completed was not stuck
                if (stuck is None and not timed_out) or not still_in:
                    continue
                if not self.say(timeout_reason(words) if stuck is None else stuck.reason):
                    return  # another rank says it and ends the job
                if stuck is None:
                    stuck = not_reached(self.missing(seq), self.world_size, words,
                                        self.timeout_s)
            except Exception:  # noqa: BLE001 - rank 0 and its store are gone: the job ends
                return
            self.end_job(stuck.line)
            return

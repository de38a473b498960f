"""The ranks' input(), getpass() and debugger prompts, put to the user in the notebook.

A rank asks on its own socket and leaves a marker among its outputs
(`mpilab.rank.stdin`); the running cell reads the markers in the order of the rank's
output, gathers for a moment the ranks that ask, asks once for each prompt they share
(`[ranks 0-3] (Pdb) `), and sends each asking rank the answer. A cell that cannot ask
(one run with --noblock, a frontend without input) answers "no input", which the rank's
input() raises as EOFError, as a script's does at the end of its standard input.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from .wire import MAX_INPUT_BYTES, input_answer, rank_label, read_input

# the ranks' questions are put to the user once every rank still running has asked, or
# none has come for this long (a thousand ranks' markers arrive over more than a moment)
GATHER_S = 0.3
HELD_QUESTIONS = 4096  # questions kept until their markers come; past it the oldest go
QUESTION_WAIT_S = 2.0  # for a question whose marker has come (it was sent before it)


@dataclass
class Question:
    rank: int
    id: int
    prompt: str
    password: bool
    route: bytes  # the asking rank's socket, as the notebook's socket names it


class InputDesk:
    """The notebook's socket for the ranks' questions, bound where the ranks reach it
    (beside the record receiver)."""

    def __init__(self, ip: str = "127.0.0.1"):
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_INPUT_BYTES)
        port = self._sock.bind_to_random_port(f"tcp://{ip}")
        self.address = f"tcp://{ip}:{port}"
        self._arrived: dict[tuple[bytes, int], dict] = {}
        self._lock = threading.Lock()  # a --noblock cell follows on a thread of its own

    def question(self, rank: int, route: bytes, qid: int) -> Question | None:
        """Rank `rank`'s question `qid`, whose marker has come: it was sent first, on
        this socket (None if it does not come within QUESTION_WAIT_S)."""
        deadline = time.monotonic() + QUESTION_WAIT_S
        with self._lock:
            while True:
                while self._sock.poll(0):
                    self._take()
                message = self._arrived.pop((route, qid), None)
                if message is not None:
                    return Question(rank, qid, str(message.get("prompt", "")),
                                    bool(message.get("password")), route)
                if time.monotonic() > deadline:
                    return None
                self._sock.poll(50)

    def _take(self) -> None:
        try:
            route, raw = self._sock.recv_multipart(zmq.NOBLOCK)
            message = read_input(raw)
            self._arrived[(route, message["id"])] = message
            if len(self._arrived) > HELD_QUESTIONS:  # never claimed by a marker
                del self._arrived[next(iter(self._arrived))]
        except (ValueError, zmq.Again):  # not a rank's question: dropped
            pass

    def answer(self, question: Question, text: str | None, refused: str = "") -> None:
        with self._lock:
            try:
                self._sock.send_multipart([question.route, input_answer(question.id, text,
                                                                          refused)],
                                          zmq.NOBLOCK)
            except zmq.ZMQError:  # the rank is gone: nobody to answer
                pass

    def close(self) -> None:
        self._sock.close()


class CellQuestions:
    """The questions of one cell's ranks, put to the user as they come."""

    def __init__(self, desk: InputDesk | None, cell_ranks: int,
                 write: Callable[[str, str], None], refuse: str = ""):
        """refuse: why this cell cannot ask the user ("" when it can)."""
        self.desk = desk
        self.cell_ranks = cell_ranks
        self.write = write
        self.refuse = refuse
        self._waiting: list[Question] = []
        self._latest = 0.0  # when the newest waiting question came
        self.answered_at = 0.0  # when the user last answered (time.time())

    def add(self, rank: int, marker: dict) -> None:
        """A rank's marker, read among its outputs."""
        route = marker.get("route")
        if self.desk is None or not isinstance(marker.get("id"), int) or \
                not isinstance(route, str):
            return
        question = self.desk.question(rank, route.encode(), marker["id"])
        if question is None:
            return
        if self.refuse:
            self._refuse([question], self.refuse)
            return
        self._latest = time.monotonic()
        self._waiting.append(question)

    @property
    def waiting(self) -> bool:
        """Ranks wait for the user: their questions are gathered, not yet answered."""
        return bool(self._waiting)

    def due(self, running: list[int]) -> bool:
        """Questions are waiting, and every rank still running the cell has asked, or none
        has come for GATHER_S."""
        if not self._waiting:
            return False
        asking = {q.rank for q in self._waiting}
        return (all(r in asking for r in running)
                or time.monotonic() - self._latest >= GATHER_S)

    def ask(self) -> None:
        """Put each prompt to the user once and answer the ranks that asked it.
        KeyboardInterrupt (the stop button while the notebook asks) goes to the caller,
        which stops the cell; the rank then stops waiting too."""
        waiting, self._waiting = self._waiting, []
        groups: dict[tuple[str, bool], list[Question]] = {}
        for q in waiting:
            groups.setdefault((q.prompt, q.password), []).append(q)
        for (prompt, password), questions in groups.items():
            ranks = sorted(q.rank for q in questions)
            shown = f"[{rank_label(ranks)}] {prompt}" if self.cell_ranks > 1 else prompt
            # the stop button raises KeyboardInterrupt here, to the caller: the cell's
            # interrupt stops the asking ranks' wait too, so they get no answer
            try:
                text = _ask_user(shown, password)
            except Exception as e:  # noqa: BLE001 - a frontend that takes no input
                why = "this notebook's frontend takes no input"
                self.write("stderr", f"mpilab: {rank_label(ranks)} asked for input "
                                     f"({prompt.strip()!r}), but {why}: their input() "
                                     "raised EOFError\n")
                self._refuse(questions, f"{why} ({type(e).__name__})")
                continue
            self.answered_at = time.time()
            for q in questions:
                self.desk.answer(q, text)

    def close(self, why: str) -> None:
        """The cell is over here: a question still waiting gets no answer but `why`."""
        self._refuse(self._waiting, why)
        self._waiting = []

    def _refuse(self, questions: list[Question], why: str) -> None:
        for q in questions:
            self.desk.answer(q, None, why)


def _ask_user(prompt: str, password: bool) -> str:
    """The kernel's own input request (JupyterLab shows an input box under the cell)."""
    if password:
        import getpass

        return getpass.getpass(prompt)
    return input(prompt)

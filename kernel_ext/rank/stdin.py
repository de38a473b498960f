"""input() and getpass() on a rank, answered in the notebook.

An engine's own input() raises StdinNotImplementedError: ipyparallel's client takes no
input requests. A rank asks the notebook instead, so that `input()`, `pdb.set_trace()`,
`breakpoint()` and `%debug` work in a `%%ranks` cell as they do in a notebook cell. The
question goes on a socket of its own (connected to the notebook, as the record channel
is); a marker among the cell's outputs (`wire.INPUT_MARKER`) says where it falls among
the lines the rank printed, so the notebook shows those lines (pdb's, before its prompt)
first. The notebook asks once for ranks waiting at the same prompt and gives each of them
the answer.
"""

from __future__ import annotations

import itertools
import sys
import threading

from ..wire import INPUT_MARKER, MAX_INPUT_BYTES, input_question, input_route, read_input

POLL_MS = 100  # between looks at the socket: a Ctrl-C (SIGINT) is handled between them
INPUT_PHASE = "waiting for input"  # the rank's phase in its heartbeat meanwhile


class NotebookInput:
    """The engine's raw_input and getpass (ipykernel makes them the cell's `input` and
    `getpass.getpass`): each asks the notebook and waits for the user's answer."""

    def __init__(self, address: str, agent, kernel):
        self.address = address
        self.agent = agent
        # the engine's own, for a cell not sent by mpilab (`%%px`: nobody would answer)
        self._engine_input, self._engine_getpass = kernel.raw_input, kernel.getpass
        self.answered = True  # the running cell is mpilab's (set as each cell begins)
        self._sock = None
        self._route = input_route(agent.rank)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one question at a time: the socket is not thread-safe
        self._stopped = ""  # the cell (request id) whose question the user stopped

    def raw_input(self, prompt: object = "") -> str:
        if not self.answered:
            return self._engine_input(prompt)
        return self.ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream=None, **kwargs) -> str:
        if not self.answered:
            return self._engine_getpass(prompt, stream, **kwargs)
        return self.ask(str(prompt), password=True)

    def ask(self, prompt: str, password: bool) -> str:
        """The user's answer, typed in the notebook; EOFError when there is none (the
        notebook cannot ask, or the cell was stopped while it asked: pdb then quits
        instead of asking again)."""
        from IPython.display import publish_display_data

        state = self.agent.state
        if self._stopped and self._stopped == state.request:
            raise EOFError("the cell was stopped while this rank waited for input")
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        with self._lock:
            sock = self._socket()
            qid = next(self._ids)
            # the notebook takes messages up to MAX_INPUT_BYTES (JSON: 6 bytes a character
            # at most)
            sock.send(input_question(qid, prompt[-(MAX_INPUT_BYTES // 8):], password))
            publish_display_data({INPUT_MARKER: {"id": qid, "route": self._route}})
            phase, state.phase = state.phase, INPUT_PHASE
            self.agent.beat()
            try:
                return self._wait(sock, qid)
            except KeyboardInterrupt:
                self._stopped = state.request
                raise
            finally:
                state.phase = phase
                self.agent.beat()

    def _wait(self, sock, qid: int) -> str:
        while True:
            if not sock.poll(POLL_MS):
                continue
            try:
                answer = read_input(sock.recv())
            except ValueError:
                continue
            if answer["id"] != qid:  # the answer to a question stopped before it came
                continue
            if isinstance(answer.get("text"), str):
                return answer["text"]
            raise EOFError(answer.get("refused") or "the notebook gave no answer")

    def _socket(self):
        if self._sock is None:
            import zmq

            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self._route.encode())
            sock.connect(self.address)
            self._sock = sock
        return self._sock


def install(kernel, address: str | None, agent) -> NotebookInput | None:
    """Make the engine's input requests ask the notebook at `address` (none: a rank
    without a notebook keeps the engine's own)."""
    if address is None:
        return None
    asker = NotebookInput(address, agent, kernel)
    # ipykernel's debugger made breakpoint() a no-op without a client (none reaches a
    # rank); Python's own hook runs pdb, or what PYTHONBREAKPOINT names
    sys.breakpointhook = sys.__breakpointhook__
    # ipykernel points builtins.input and getpass.getpass at these for each request
    kernel.raw_input = asker.raw_input
    kernel.getpass = asker.getpass
    return asker

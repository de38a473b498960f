"""A real IPython kernel driven over the Jupyter protocol, for notebook-side tests.

Each message is timestamped on arrival so tests can check that output streams live.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager, start_new_kernel


@dataclass
class CellRun:
    outputs: list[dict] = field(default_factory=list)  # iopub messages (type, content, t)
    reply: dict = field(default_factory=dict)
    started: float = 0.0
    finished: float = 0.0
    msg_id: str = ""
    prompts: list[str] = field(default_factory=list)  # the input requests' prompts, in turn

    @property
    def stdout(self) -> str:
        return "".join(o["content"]["text"] for o in self.outputs
                       if o["type"] == "stream" and o["content"]["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(o["content"]["text"] for o in self.outputs
                       if o["type"] == "stream" and o["content"]["name"] == "stderr")

    @property
    def error(self) -> dict | None:
        return next((o["content"] for o in self.outputs if o["type"] == "error"), None)

    @property
    def error_text(self) -> str:
        err = self.error
        return "\n".join(err["traceback"]) if err else ""

    @property
    def ok(self) -> bool:
        return self.reply.get("status") == "ok"

    def displays(self) -> list[dict]:
        return [o["content"] for o in self.outputs
                if o["type"] in ("display_data", "execute_result", "update_display_data")]

    @property
    def text(self) -> str:
        """Everything a user reads once the cell is done: streams, plain-text displays as
        last updated (one emptied shows nothing), errors."""
        latest = {}  # display id -> its last data
        for o in self.outputs:
            display_id = o["content"].get("transient", {}).get("display_id")
            if display_id and "data" in o["content"]:
                latest[display_id] = o["content"]["data"]
        parts = []
        for o in self.outputs:
            c = o["content"]
            if o["type"] == "stream":
                parts.append(c["text"])
            elif o["type"] in ("display_data", "execute_result"):
                data = latest.get(c.get("transient", {}).get("display_id"), c["data"])
                if data:
                    parts.append(data.get("text/plain", "") + "\n")
            elif o["type"] == "error":
                parts.append("\n".join(c["traceback"]) + "\n")
        return "".join(parts)


class Kernel:
    def __init__(self, cwd: str | None = None, env: dict[str, str] | None = None,
                 wrap: list[str] | None = None):
        """env: variables added to this process's environment for the kernel.
        wrap: a command line the kernel's own runs inside (`nsenter … --`: a kernel on
        an emulated host, reached through Unix sockets in a shared folder)."""
        kwargs = {"cwd": cwd} if cwd else {}
        if env:
            kwargs["env"] = {**os.environ, **env}
        # a wrapped kernel's spec and sockets, removed when this object goes
        self._folder = None if wrap is None else tempfile.TemporaryDirectory(
            prefix="mpilab-kernel-")
        if wrap is None:
            self.km, self.kc = start_new_kernel(kernel_name="python3", **kwargs)
        else:
            self.km, self.kc = _start_wrapped(wrap, kwargs, Path(self._folder.name))
        self._backlog: list[dict] = []
        self._poller = zmq.Poller()
        for channel in (self.kc.iopub_channel, self.kc.stdin_channel):
            self._poller.register(channel.socket, zmq.POLLIN)

    def run(self, code: str, timeout: float = 120, interrupt_after: float | None = None,
            answers: list[str] | None = None, answer_after: float = 0.0) -> CellRun:
        """answers: the lines to type, in turn, when the cell asks for input, each
        `answer_after` seconds after the request (each prompt is kept in run.prompts);
        none left, the input request stays unanswered."""
        run = CellRun(started=time.time())
        answers = list(answers or [])
        answer_at = None
        msg_id = self.kc.execute(code)
        run.msg_id = msg_id
        deadline = time.monotonic() + timeout
        interrupt_at = None if interrupt_after is None else time.monotonic() + interrupt_after
        idle = False
        while not idle:
            if interrupt_at is not None and time.monotonic() >= interrupt_at:
                self.km.interrupt_kernel()
                interrupt_at = None
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish in {timeout} s:\n{code}\n{run.text}")
            if answer_at is not None and time.monotonic() >= answer_at:
                self.kc.input(answers.pop(0))
                answer_at = None
            # one wait on both channels: a cell's time is its own, not a polling period's
            wait_s = 0.1 if answer_at is None else max(0.0, answer_at - time.monotonic())
            ready = dict(self._poller.poll(int(wait_s * 1000)))
            if self.kc.stdin_channel.socket in ready:
                request = self.kc.get_stdin_msg(timeout=0)
                run.prompts.append(request["content"]["prompt"])
                if answers:
                    answer_at = time.monotonic() + answer_after
            if self.kc.iopub_channel.socket not in ready:
                continue
            msg = self.kc.get_iopub_msg(timeout=0)
            if msg["parent_header"].get("msg_id") != msg_id:
                self._backlog.append(msg)  # another cell's (a --noblock one): keep it
                continue
            kind = msg["msg_type"]
            if kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
            elif kind in ("stream", "display_data", "execute_result", "error",
                          "update_display_data", "clear_output"):
                run.outputs.append({"type": kind, "content": msg["content"], "t": time.time()})
        while True:  # this cell's reply (an earlier cell's, left unread, is skipped)
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        run.reply = reply["content"]
        run.finished = time.time()
        return run

    def collect_iopub(self, seconds: float,
                      until: Callable[[list[dict]], bool] | None = None) -> list[dict]:
        """Messages for any cell that `run` passed over, then those arriving during the
        next `seconds`, or until those so far satisfy `until` (what a test waits for has
        come; a test that asserts something never comes waits all of `seconds`)."""
        raw, self._backlog = self._backlog, []
        messages = [_brief(msg) for msg in raw]
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and until(messages)):
            try:
                messages.append(_brief(self.kc.get_iopub_msg(timeout=0.1)))
            except queue.Empty:
                continue
        return messages

    @property
    def pid(self) -> int:
        """The process the kernel was started as (for a wrapped kernel, the wrapper)."""
        return self.km.provisioner.process.pid

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)

    def release(self) -> None:
        """After the kernel was killed: close the channels and remove its connection
        files (a shutdown would wait for a kernel that cannot answer)."""
        self.kc.stop_channels()
        self.km.cleanup_resources()


def stream_text(messages: list[dict], parent: str) -> str:
    """What cell `parent` printed, in order, among messages `collect_iopub` returned."""
    return "".join(m["content"].get("text", "") for m in messages
                   if m["parent"] == parent and m["type"] == "stream")


def _brief(msg: dict) -> dict:
    """An iopub message as the tests read it: its type, content and parent cell."""
    return {"type": msg["msg_type"], "content": msg["content"],
            "parent": msg["parent_header"].get("msg_id")}


def _start_wrapped(wrap: list[str], kwargs: dict, folder: Path):
    """A kernel whose command line runs inside `wrap`, from a kernel spec of its own in
    `folder`. Its channels are Unix sockets in `folder` (a kernel in another network
    namespace cannot be reached on this one's loopback, and jupyter_client binds TCP to
    this host's own addresses only); interrupts go as messages (a signal to the wrapper
    would not reach the kernel)."""
    (folder / "wrapped").mkdir()
    (folder / "wrapped" / "kernel.json").write_text(json.dumps({
        "argv": [*wrap, sys.executable, "-m", "ipykernel_launcher", "-f",
                 "{connection_file}"],
        "display_name": "wrapped", "language": "python", "interrupt_mode": "message"}))
    km = KernelManager(kernel_name="wrapped", transport="ipc", ip=str(folder / "channel"),
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(folder)]))
    km.start_kernel(**kwargs)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
    except RuntimeError:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise
    return km, kc

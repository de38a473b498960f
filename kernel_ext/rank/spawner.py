"""One process per host that forks that host's engines with torch already imported.

Why: every engine imports torch, torch.distributed and, for its warm-up, torch._dynamo:
about two seconds of CPU each. On a host with more ranks than cores those imports run
in series (16 ranks on 2 cores: most of the start). There the host's first supervisor
starts a spawner that does the imports once; each supervisor (one per rank, started by
mpiexec) hands it what its engine must inherit and gets back the pid of a forked engine,
then its exit status. (With a core for each rank, engines that import side by side are
ready sooner than forks of a spawner that imports alone: there each engine starts as a
fresh interpreter.)

What an engine inherits from its supervisor, sent over a Unix socket: argv, the
environment, the working directory, the CPUs it may run on (a launcher that binds ranks
to cores binds their supervisors; a fork would otherwise run on the spawner's, the first
supervisor's, so every rank of the host on one core), and open files passed as
descriptors (stdin, stdout and stderr, so the engine writes where the launcher reads,
and MPI's PMI socket at the number PMI_FD names; MPI itself is initialised only in the
engine). The forked engine
gets fresh random seeds (Python's and NumPy's global streams would otherwise repeat the
spawner's on every rank) and dies with the spawner.

The spawner listens on an abstract Unix socket (no file; scoped to the host's network
namespace) named for the user, the launcher's proxy on this host and the notebook's
lifeline, so only the ranks of one start on one host share it. It ends when none of its
engines lives and no supervisor is connected: a supervisor that goes closes its
connection and the spawner kills that supervisor's engine. Where the spawner cannot start
or does not answer, the supervisor starts its engine as a fresh interpreter instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

from . import engine

ENV = "MPILAB_SPAWNER"  # "1": a spawner wherever a host runs several ranks; "0": never
CONNECT_S = 5.0  # trying to reach (or start) the spawner
ANSWER_S = 120.0  # for the spawner's imports and the fork (16 ranks on 2 cores: ~10 s)
IDLE_S = 30.0  # a spawner nobody asked (its supervisors gone before they could) ends
_HEADER = struct.Struct("!I")
# what the engines import before their first cell (and the warm-up's optimizer import)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.optim", "numpy",
           "ipyparallel.engine.app", "mpilab.rank.engine", "mpilab.rank.bootstrap",
           "mpilab.rank.warmup", "mpilab.rank.torchrun")


def wanted(environ=os.environ, cores: int | None = None) -> bool:
    """Use a spawner where this host runs more ranks of a launch than it has cores for
    them (MPICH's hydra says how many: MPI_LOCALNRANKS): there every engine's imports
    would run in series with the others'. With a core for each rank, engines importing
    side by side are ready sooner (2 ranks on 2 cores: 3.9 s against 4.7 s through a
    spawner). MPILAB_SPAWNER=1: wherever a host runs several ranks; 0: never."""
    choice = environ.get(ENV, "").strip()
    if choice == "0":
        return False
    try:
        several = int(environ.get("MPI_LOCALNRANKS", "1")) > 1
    except ValueError:
        return False
    return several and (choice == "1" or engine.host_oversubscribed(environ, cores))


def socket_name(environ=os.environ) -> bytes:
    """The abstract socket name the ranks of one launch on one host share."""
    key = f"{os.getuid()}:{os.getppid()}:{environ.get('MPILAB_LIFELINE', '')}"
    return b"\0mpilab-spawner-" + hashlib.sha1(key.encode()).hexdigest()[:16].encode()


# -- messages: a length, then JSON ---------------------------------------------------------
def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:  # the descriptors travel with the header; the rest may take several sends
        socket.send_fds(sock, [_HEADER.pack(len(data))], fds)
    else:
        sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at end of stream."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 16)
    while data and len(data) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(data))
        if not more:
            return None, fds
        data += more
    if not data:
        return None, fds
    (length,) = _HEADER.unpack(data)
    body = bytearray()
    while len(body) < length:
        more = sock.recv(min(length - len(body), 1 << 20))
        if not more:
            return None, fds
        body += more
    return json.loads(body), fds


# -- the supervisor's side -----------------------------------------------------------------
class SpawnedEngine:
    """An engine the spawner forked for this supervisor: its pid, and its exit status
    (a wait status, as os.waitpid gives) when the spawner reports it."""

    def __init__(self, sock: socket.socket, pid: int):
        self._sock = sock
        self.pid = pid

    def poll(self) -> int | None:
        """The engine's wait status once it ended, else None. A spawner that went away
        took the engine with it (it dies with its parent, by SIGKILL)."""
        if not select.select([self._sock], [], [], 0)[0]:
            return None
        self._sock.settimeout(ANSWER_S)
        try:
            message, _ = _receive(self._sock)
        except OSError:
            message = None
        if message is None or "status" not in message:
            return signal.SIGKILL
        return int(message["status"])


def spawn(argv: list[str]) -> SpawnedEngine | None:
    """Ask this host's spawner (starting it if nobody has) for an engine run with `argv`;
    None where that fails or the spawner refuses, and the caller starts the engine
    itself."""
    name = socket_name()
    deadline = time.monotonic() + CONNECT_S
    while time.monotonic() < deadline:
        sock = _unix_socket(name, "connect")
        if sock is None:
            if not _start_spawner(name):
                time.sleep(0.05)  # another supervisor is starting it
            continue
        answer = _request(sock, argv)
        if answer is not None and "pid" in answer:
            return SpawnedEngine(sock, int(answer["pid"]))
        sock.close()
        if answer is not None:  # refused (it cannot fork engines): no use asking again
            return None
    return None


def _unix_socket(name: bytes, how: str) -> socket.socket | None:
    """A Unix socket that did `how` (connect, bind) at `name`; None where it failed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        getattr(sock, how)(name)
    except OSError:
        sock.close()
        return None
    return sock


def _start_spawner(name: bytes) -> bool:
    """Bind the name (only one supervisor of the host can) and start the spawner on
    it, in a session of its own (the launcher's signals to this rank are not its)."""
    listener = _unix_socket(name, "bind")
    if listener is None:
        return False
    listener.listen(1024)
    try:
        with open(os.devnull, "r+b") as null:
            subprocess.Popen(
                [sys.executable, "-m", "mpilab.rank.spawner", str(listener.fileno())],
                stdin=null, stdout=null, stderr=null, pass_fds=(listener.fileno(),),
                start_new_session=True)
    except OSError:
        return False
    finally:
        listener.close()
    return True


def _request(sock: socket.socket, argv: list[str]) -> dict | None:
    """Send the engine's inheritance; the spawner's answer, None where none came."""
    fds = [0, 1, 2]
    pmi = os.environ.get("PMI_FD", "")
    if pmi.isdigit():
        fds.append(int(pmi))
    sock.settimeout(ANSWER_S)
    try:
        _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                     "cpus": sorted(os.sched_getaffinity(0)), "fds": fds}, fds)
        answer, _ = _receive(sock)
    except OSError:
        return None
    finally:
        sock.settimeout(None)
    return answer


# -- the spawner ---------------------------------------------------------------------------
class Spawner:
    def __init__(self, listener: socket.socket, refusal: str | None = None):
        """refusal: why this spawner answers every request without an engine."""
        self.listener = listener
        self.refusal = refusal
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.engine_of: dict[socket.socket, int] = {}  # a supervisor's connection: its engine
        self.served = 0
        self.started = time.monotonic()

    def run(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=0.1):
                if key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    conn.settimeout(ANSWER_S)  # a request half sent does not hold us
                    self.selector.register(conn, selectors.EVENT_READ)
                else:
                    self._serve(key.fileobj)
            self._reap()
            if not self.engine_of and not self._waiting() and (
                    self.served or time.monotonic() - self.started > IDLE_S):
                return

    def _waiting(self) -> bool:
        """Connections that have not asked for an engine yet, or pending ones."""
        if len(self.selector.get_map()) > 1:
            return True
        return bool(self.selector.select(timeout=0))

    def _serve(self, conn: socket.socket) -> None:
        try:
            request, fds = _receive(conn)
        except OSError:
            request, fds = None, []
        try:
            if request is None or conn in self.engine_of:  # gone, or a second request
                self._drop(conn)
                return
            self.served += 1
            if self.refusal is not None:
                answer = {"error": self.refusal}
            elif not _may_run_on(request["cpus"]):
                answer = {"error": f"the spawner may not run on CPUs {request['cpus']}"}
            else:
                answer = {"pid": self._fork(request, fds)}
                self.engine_of[conn] = answer["pid"]
        finally:
            for fd in fds:
                os.close(fd)
        try:
            _send(conn, answer)
        except OSError:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        """A supervisor went: its engine (and what the engine started) goes too."""
        self.selector.unregister(conn)
        pid = self.engine_of.pop(conn, None)
        conn.close()
        if pid is not None:
            engine.kill(pid)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            for conn, forked in list(self.engine_of.items()):
                if forked == pid:
                    del self.engine_of[conn]
                    try:
                        _send(conn, {"status": status})
                    except OSError:
                        pass

    def _fork(self, request: dict, fds: list[int]) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            self._become_engine(request, fds)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - the engine's own stderr says why
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(code)

    def _become_engine(self, request: dict, fds: list[int]) -> None:
        """In the forked child (which never returns from _fork)."""
        # nothing of the spawner's stays open in the engine: its sockets, the listener
        # among them, are all registered with the selector
        for key in list(self.selector.get_map().values()):
            os.close(key.fileobj.detach())
        self.selector.close()
        # the supervisor's descriptors at the numbers the supervisor had them
        import fcntl

        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
        for fd in fds:
            os.close(fd)
        for source, target in zip(moved, request["fds"]):
            os.dup2(source, target)
            os.close(source)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.sched_setaffinity(0, request["cpus"])
        _reseed()
        engine.name_process(b"mpilab-engine")
        engine.run(request["argv"])


def _may_run_on(cpus: list[int]) -> bool:
    """Whether this process (and so a fork of it) may be bound to `cpus`: a cgroup can
    confine the spawner to other CPUs than a rank's; that rank then starts its own
    engine."""
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return False
    os.sched_setaffinity(0, own)
    return True


def _reseed() -> None:
    """The global random streams of Python and NumPy, from the OS, as a fresh process
    seeds them (torch's default generator starts from a fixed seed in every process)."""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main(argv: list[str]) -> int:
    listener = socket.socket(fileno=int(argv[0]))
    # torch.cuda.is_available() then asks NVML and leaves CUDA uninitialised: a process
    # forked after CUDA's initialisation cannot use CUDA
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import importlib

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the engine imports it again and reports it
            pass
    torch = sys.modules.get("torch")
    refusal = None
    if torch is not None and torch.cuda.is_initialized():
        refusal = "an import initialised CUDA, which a forked engine could not use"
    Spawner(listener, refusal).run()  # refusing, its supervisors start their engines
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

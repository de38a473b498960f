"""A rank's supervisor, the launcher's entry point: `python -m mpilab.rank.supervisor --mpi …`.

mpiexec (or srun) starts this on the rank's host as a small supervisor that runs the
real engine as its child and waits for it, ending it when the notebook is gone: it holds
the notebook's lifeline (mpilab.lifeline), which works across hosts. When the engine
dies the supervisor prints how (signal or exit code), with its host and pid, to the
launcher's output, which is where the notebook reads "rank 1 (pid N on node2) died:
killed by signal 9" from; mpiexec's own report names whichever process it noticed
first. Before the engine starts, the supervisor closes the listening sockets it
inherited from the launcher and keeps MPI's network transport on the interface the
ranks share. Where the host runs several ranks, the engine is forked by the host's
spawner (mpilab.rank.spawner: torch imported once per host), else it is this process's
child, a fresh interpreter that imports torch on a thread while ipyparallel registers it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from mpilab import lifeline
from mpilab.rank import engine as engine_mod
from mpilab.rank import spawner
from mpilab.wire import exit_report

WATCH_INTERVAL_S = 0.25
ENGINE_END_WAIT_S = 5.0  # for a killed engine to be reaped
_CHILD_FLAG = "--mpilab-engine-child"


def report(pid: int | None, cause: str) -> str:
    """The line the notebook's watchdog reads from the launcher's output."""
    return exit_report(pid, cause).line()


def close_inherited_listeners() -> None:
    """Close listening sockets inherited from the launcher (mpiexec's PMI port listens
    on every interface): a rank must not keep them open for the whole session."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # not a socket
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        if listening:
            sock.close()
        else:
            sock.detach()


def mpi_net_devices(notebook_address: str | None) -> str | None:
    """UCX_NET_DEVICES for the engine: MPI's TCP transport listens only on the interface
    the ranks share (loopback when they share this host with the notebook); RDMA
    devices stay usable. None: leave MPI's choice (no notebook, or the user chose)."""
    if "UCX_NET_DEVICES" in os.environ or not notebook_address:
        return None
    from mpilab.endpoint import interface_of, route_source

    ip = notebook_address.rsplit(":", 1)[0]
    if ip.startswith("127."):
        return "lo"
    source = route_source(ip)
    interface = interface_of(source) if source else None
    if interface is None:
        return None
    return ",".join([interface, *_rdma_ports()])


def _rdma_ports() -> list[str]:
    """UCX's names of this host's RDMA ports (mlx5_0:1 …), from sysfs."""
    root = "/sys/class/infiniband"
    ports = []
    for device in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for port in sorted(os.listdir(f"{root}/{device}/ports")):
            ports.append(f"{device}:{port}")
    return ports


class ChildEngine:
    """The engine as this supervisor's own child: a fresh interpreter (where no spawner
    serves this host, mpilab.rank.spawner)."""

    def __init__(self, argv: list[str], held: lifeline.Holder | None):
        self.pid = os.fork()
        if self.pid == 0:
            if held is not None:
                os.close(held.fileno())
            os.execv(sys.executable, [sys.executable, "-m", "mpilab.rank.supervisor",
                                      _CHILD_FLAG, *argv])

    def poll(self) -> int | None:
        """The engine's wait status once it ended, else None."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return 1 << 8  # reaped elsewhere: say it exited with code 1
        return status if pid else None


def _wait(engine: ChildEngine | spawner.SpawnedEngine, timeout: float) -> int | None:
    """The engine's wait status once it ended, waiting up to `timeout` s for it."""
    deadline = time.monotonic() + timeout
    while (status := engine.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return status


def describe(status: int) -> tuple[str, int]:
    """A wait status as the exit report's cause and this supervisor's exit code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else "?"
        return f"killed by signal {sig} ({name})", 128 + sig
    code = os.WEXITSTATUS(status)
    return f"exited with code {code}", code


def supervise(argv: list[str]) -> int:
    try:
        held = lifeline.hold()
    except lifeline.LifelineLost as e:
        print(report(None, f"did not start: {e}"), file=sys.stderr, flush=True)
        return 1
    close_inherited_listeners()
    devices = mpi_net_devices(os.environ.get(lifeline.ENV))
    if devices:
        os.environ["UCX_NET_DEVICES"] = devices
    engine = (spawner.spawn(argv) if spawner.wanted() else None) or ChildEngine(argv, held)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: os.kill(engine.pid, signum))
    while (status := engine.poll()) is None:
        gone = held.notebook_gone(wait=WATCH_INTERVAL_S) if held else None
        if gone:  # the notebook is gone: so are its ranks
            engine_mod.kill(engine.pid)
            _wait(engine, ENGINE_END_WAIT_S)
            print(report(engine.pid, f"ended: {gone}"), file=sys.stderr, flush=True)
            return 1
        if held is None:
            time.sleep(WATCH_INTERVAL_S)
    cause, code = describe(status)
    print(report(engine.pid, cause), file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == [_CHILD_FLAG]:
        engine_mod.run(sys.argv[2:])
    else:
        sys.exit(supervise(sys.argv[1:]))

"""Entry point of a rank's engine process: `python -m mpilab.rank.engine_main --mpi …`.

mpiexec starts this as a small supervisor that runs the real engine as its child and
waits for it, ending it if the notebook kernel that started the cluster is gone. When
the engine dies the supervisor prints how (signal or exit code) to the launcher's
output, which is where the notebook reads "rank 1 (pid N) died: killed by signal 9"
from; mpiexec's own report names whichever process it noticed first. The engine child
imports torch on a thread while ipyparallel registers it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

REPORT_PREFIX = "mpilab-engine-exit"
WATCH_INTERVAL_S = 0.25
KERNEL_PID_ENV = "MPILAB_KERNEL_PID"  # the notebook kernel whose death ends its cluster


def watched_kernel_pid() -> int:
    """The pid of the notebook kernel that started this cluster (0: none to watch)."""
    return int(os.environ.get(KERNEL_PID_ENV, "0"))
_CHILD_FLAG = "--mpilab-engine-child"


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie (a killed kernel stays one until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): existence is all we can tell


def _die_with_parent() -> None:
    """The engine must not outlive its supervisor (mpiexec's cleanup kills the latter)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_engine(argv: list[str]) -> None:
    _die_with_parent()
    from mpilab.rank.engine import preload

    preload()
    from ipyparallel.engine.app import main

    sys.argv = [sys.argv[0], *argv]
    main()


def supervise(argv: list[str]) -> int:
    child = os.fork()
    if child == 0:
        os.execv(sys.executable, [sys.executable, "-m", "mpilab.rank.engine_main",
                                  _CHILD_FLAG, *argv])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    kernel = watched_kernel_pid()
    while True:
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            return 1
        if pid:
            break
        if kernel and not pid_alive(kernel):  # the notebook is gone: so are its ranks
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            return 1
        time.sleep(WATCH_INTERVAL_S)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else "?"
        cause, code = f"killed by signal {sig} ({name})", 128 + sig
    else:
        code = os.WEXITSTATUS(status)
        cause = f"exited with code {code}"
    print(f"{REPORT_PREFIX} pid={child} {cause}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == [_CHILD_FLAG]:
        run_engine(sys.argv[2:])
    else:
        sys.exit(supervise(sys.argv[1:]))

"""Entry point of a rank's engine process: `python -m mpilab.rank.engine_main --mpi …`.

mpiexec starts this as a small supervisor that runs the real engine as its child and
waits for it. When the engine dies the supervisor prints how (signal or exit code) to
the launcher's output, which is where the notebook reads "rank 1 (pid N) died: killed
by signal 9" from; mpiexec's own report names whichever process it noticed first.
The engine child imports torch on a thread while ipyparallel registers it.
"""

from __future__ import annotations

import os
import signal
import sys

REPORT_PREFIX = "mpilab-engine-exit"
_CHILD_FLAG = "--mpilab-engine-child"


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
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
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

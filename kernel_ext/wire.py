"""What crosses between the notebook and the ranks outside the record channel, defined
once for both sides: the environment a launcher hands the ranks, and the line a rank's
supervisor writes to the launcher's output when its engine ends.

Light to import: the ranks' supervisor imports it before anything else.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

# torch.distributed's own collective timeout, as `%mpilab start --collective-timeout` set it
COLLECTIVE_TIMEOUT_ENV = "MPILAB_COLLECTIVE_TIMEOUT"
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0

REPORT_PREFIX = "mpilab-engine-exit"
_REPORT = re.compile(re.escape(REPORT_PREFIX) + r" host=(?P<host>\S+) pid=(?P<pid>\d+|-) "
                     r"(?P<cause>.+)")


@dataclass(frozen=True)
class ExitReport:
    """How a rank's engine ended, as its supervisor saw it (host and pid name the rank
    on any host: a pid alone means nothing on another)."""

    host: str
    pid: int | None  # None: the engine never started
    cause: str  # 'killed by signal 9 (SIGKILL)', 'exited with code 3', 'did not start: …'

    def line(self) -> str:
        pid = "-" if self.pid is None else str(self.pid)
        return f"{REPORT_PREFIX} host={self.host} pid={pid} {self.cause}"


def exit_report(pid: int | None, cause: str) -> ExitReport:
    """This host's report for an engine with this pid."""
    return ExitReport(socket.gethostname(), pid, cause)


def exit_reports(output: str) -> list[ExitReport]:
    """Every report in a launcher's output, in order."""
    return [ExitReport(m["host"], None if m["pid"] == "-" else int(m["pid"]),
                       m["cause"].strip())
            for m in _REPORT.finditer(output)]

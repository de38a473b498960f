"""What the benchmarks that time collectives share: they start themselves again on N
ranks under the environment's mpiexec when run as a plain script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def relaunch(n: int) -> int | None:
    """None in a rank (MPICH's or Open MPI's variables are set); elsewhere this script
    run again with the same arguments by `mpiexec -n n` from beside this Python, and
    its exit status."""
    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK")):
        return None
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return subprocess.call([str(mpiexec), "-n", str(n), sys.executable, *sys.argv])

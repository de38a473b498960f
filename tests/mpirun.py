"""Run a Python snippet on N real MPI ranks (mpiexec from the venv) for rank-side tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
MPIEXEC = str(VENV_BIN / "mpiexec")
# `init` for a snippet that needs only MPI (mpilab's numpy collectives): the rank's
# rank, world size and world communicator, as mpilab.init() gives them, without torch
# (whose import and process group cost each rank about 2 s of CPU)
MPI_ONLY = ("__import__('types').SimpleNamespace(comm=MPI.COMM_WORLD, "
            "rank=MPI.COMM_WORLD.Get_rank(), world_size=MPI.COMM_WORLD.Get_size())")


def run_ranks(code: str, n: int = 2, timeout: float = 180, env: dict | None = None,
              check: bool = True, init: str = "mpilab.init()") -> list:
    """Run `code` under `mpiexec -n n`; each rank may call `report(obj)` once.

    Returns the reported objects ordered by rank. The snippet starts with
    `import mpilab; from mpi4py import MPI; ctx = <init>` already done. Each rank
    reports into its own file: mpiexec interleaves lines that ranks print at the same
    moment.
    """
    results_dir = tempfile.mkdtemp(prefix="mpilab-ranks-")
    prelude = textwrap.dedent(
        f"""
        import json, sys
        import mpilab
        from mpi4py import MPI
        ctx = {init}
        def report(obj):
            with open({results_dir!r} + f"/{{ctx.rank}}.json", "w") as f:
                json.dump(obj, f)
        """
    )
    full = prelude + textwrap.dedent(code)
    proc = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, "-c", full],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"mpiexec exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-4000:]}"
        )
    results = {}
    for path in Path(results_dir).glob("*.json"):
        results[int(path.stem)] = json.loads(path.read_text())
        path.unlink()
    os.rmdir(results_dir)
    if not check:
        return [results.get(r) for r in range(n)], proc
    return [results.get(r) for r in range(n)]

"""Run a Python snippet on N real MPI ranks (mpiexec from the venv) for rank-side tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
MPIEXEC = str(VENV_BIN / "mpiexec")
RESULT_MARK = "@@mpilab-result@@ "


def run_ranks(code: str, n: int = 2, timeout: float = 180, env: dict | None = None,
              check: bool = True) -> list:
    """Run `code` under `mpiexec -n n`; each rank may call `report(obj)` once.

    Returns the reported objects ordered by rank. The snippet starts with
    `import mpilab; ctx = mpilab.init()` already done.
    """
    prelude = textwrap.dedent(
        f"""
        import json, sys
        import mpilab
        ctx = mpilab.init()
        def report(obj):
            print({RESULT_MARK!r} + json.dumps([ctx.rank, obj]), flush=True)
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
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            rank, obj = json.loads(line[len(RESULT_MARK):])
            results[rank] = obj
    if not check:
        return [results.get(r) for r in range(n)], proc
    return [results.get(r) for r in range(n)]

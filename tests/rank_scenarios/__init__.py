"""Rank-side scenarios: modules the tests run on real MPI ranks.

Each module has ``main(ctx, report, **args)``: it runs on every rank under ``mpiexec`` after
``mpilab.init()``, and calls ``report(obj)`` at most once per rank (see tests/mpirun.py).
``run_scenario(name)`` runs one and returns what the ranks reported, by rank.
"""

from __future__ import annotations

import json
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def run_scenario(name: str, n: int = 2, timeout: float = 240, args: dict | None = None,
                 **kwargs):
    """Run rank_scenarios.<name>.main on `n` ranks (tests/mpirun.py's run_ranks, which
    takes `kwargs`); `args`: plain data passed to main as keyword arguments."""
    from mpirun import run_ranks

    code = (f"import json, sys\nsys.path.insert(0, {str(TESTS)!r})\n"
            f"from rank_scenarios.{name} import main\n"
            f"main(ctx, report, **json.loads({json.dumps(args or {})!r}))\n")
    return run_ranks(code, n=n, timeout=timeout, **kwargs)

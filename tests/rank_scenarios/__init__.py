"""Rank-side scenarios: modules the tests run on real MPI ranks.

Each module has ``main(ctx, report)``: it runs on every rank under ``mpiexec`` after
``mpilab.init()``, and calls ``report(obj)`` at most once per rank (see tests/mpirun.py).
``run_scenario(name)`` runs one and returns what the ranks reported, by rank.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def run_scenario(name: str, n: int = 2, timeout: float = 240, **kwargs):
    """Run rank_scenarios.<name>.main on `n` ranks (tests/mpirun.py's run_ranks)."""
    from mpirun import run_ranks

    code = (f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
            f"from rank_scenarios.{name} import main\nmain(ctx, report)\n")
    return run_ranks(code, n=n, timeout=timeout, **kwargs)

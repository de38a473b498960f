"""`mpiexec -n 8 python -m mpilab.launch train.py --epochs 2`: a torchrun script, as it is,
as a batch job on mpilab's ranks.

What ``torchrun --nproc-per-node 8 train.py`` does for a script, with MPI starting the
processes: every rank runs ``mpilab.init()`` first (torchrun's environment: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…, and the group that the script's
``dist.init_process_group()`` then reuses), then the script as ``python train.py --epochs
2`` would run it: its own ``sys.argv``, ``__name__ == "__main__"``, its folder first on
``sys.path``. A batch job's failure handling (batch.py) applies: a rank that raises ends
the job after its traceback, and a collective that can never complete is named.

The notebook's way to the same script is ``%%ranks`` and ``%run train.py --epochs 2``.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = ("usage: mpiexec -n N python -m mpilab.launch SCRIPT [ARGUMENTS …] (mpiexec's -n "
         "sets how many ranks run it, as torchrun's --nproc-per-node did)")


def main(argv: list[str]) -> int:
    """Run `argv` (the script, then its arguments) on this rank; the exit status of a
    usage error (the script's own status comes from its sys.exit)."""
    script = argv[0] if argv else ""
    if script in ("", "-h", "--help"):
        return _say(USAGE, 0 if script else 2)
    if script.startswith("-"):
        return _say(f"mpilab.launch: {script} is an option, not a script: {USAGE}", 2)
    if not os.path.isfile(script):
        return _say(f"mpilab.launch: there is no script {script!r} in {os.getcwd()}", 2)
    from .rank.bootstrap import init

    init()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


def _say(line: str, status: int) -> int:
    """`line` once for the job, from the launcher's first process (MPI is not up yet)."""
    from .rank.batch import launcher_rank

    if launcher_rank() == 0:
        print(line, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Entry point of a rank's engine process: `python -m mpilab.rank.engine_main --mpi …`.

Starts importing torch on a thread before ipyparallel's engine begins its own imports
and registration, so the two overlap; then runs ipyparallel's engine unchanged.
"""

from __future__ import annotations

if __name__ == "__main__":
    from mpilab.rank.engine import preload

    preload()
    from ipyparallel.engine.app import main

    main()

"""The ipyparallel controller as mpilab starts it: `python -m mpilab.controller_main`.

The same controller, plus a thread that holds the notebook's lifeline (mpilab.lifeline)
and ends the controller and its schedulers when the notebook kernel that started the
cluster is gone (killed rather than shut down), so no controller outlives its notebook.
"""

from __future__ import annotations

import os
import sys
import threading

from mpilab import lifeline


def _watch(held: lifeline.Holder) -> None:
    import psutil

    while not held.notebook_gone(wait=1.0):
        pass
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(1)


if __name__ == "__main__":
    try:
        held = lifeline.hold()
    except lifeline.LifelineLost as e:
        print(f"mpilab controller: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if held is not None:
        threading.Thread(target=_watch, args=(held,), daemon=True).start()
    from ipyparallel.controller.app import main

    main()

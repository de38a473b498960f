"""The ipyparallel controller as mpilab starts it: `python -m mpilab.controller_main`.

The same controller, plus a thread that holds the notebook's lifeline (mpilab.lifeline)
and ends the controller and its schedulers when the notebook kernel that started the
cluster is gone (killed rather than shut down), so no controller outlives its notebook.

The controller forks its schedulers, queues and heart monitor (multiprocessing) as it
starts, from its main thread. A fork keeps only the forking thread, so they do not watch
the lifeline; each dies with the controller instead, as an engine dies with its
supervisor (`end_forked_children_with_me`).
Without that, a start that failed at once (sbatch refusing the job) could end the
controller while it was still forking, before the notebook had seen its children, and
a scheduler outlived it for good.
"""

from __future__ import annotations

import os
import sys
import threading

from mpilab import lifeline
from mpilab.rank.engine import die_with_parent


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


_forker = [0]  # the pid of the process that forks, as the child sees it after the fork


def end_forked_children_with_me() -> None:
    """Every process forked from now on (and forked by those) dies when the process that
    forked it ends: the engines' parent-death signal (`engine.die_with_parent`), asked
    for in the child as it starts; a child whose forker ended before that exits."""
    os.register_at_fork(before=_note_forker, after_in_child=_die_with_forker)


def _note_forker() -> None:
    _forker[0] = os.getpid()


def _die_with_forker() -> None:
    die_with_parent()
    if os.getppid() != _forker[0]:  # ended before the signal was asked for
        os._exit(1)


if __name__ == "__main__":
    try:
        held = lifeline.hold()
    except lifeline.LifelineLost as e:
        print(f"mpilab controller: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if held is not None:
        threading.Thread(target=_watch, args=(held,), daemon=True).start()
    end_forked_children_with_me()
    from ipyparallel.controller.app import main

    main()

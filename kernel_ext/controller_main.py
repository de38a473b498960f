"""The ipyparallel controller as mpilab starts it: `python -m mpilab.controller_main`.

The same controller, plus a thread that ends it and its schedulers when the notebook
kernel that started the cluster is gone (killed rather than shut down), so no
controller outlives its notebook.
"""

from __future__ import annotations

import os
import threading
import time

from mpilab.rank.engine_main import WATCH_INTERVAL_S, pid_alive, watched_kernel_pid


def _watch_kernel(kernel: int) -> None:
    import psutil

    while pid_alive(kernel):
        time.sleep(WATCH_INTERVAL_S)
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(1)


if __name__ == "__main__":
    kernel_pid = watched_kernel_pid()
    if kernel_pid:
        threading.Thread(target=_watch_kernel, args=(kernel_pid,), daemon=True).start()
    from ipyparallel.controller.app import main

    main()

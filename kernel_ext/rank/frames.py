"""Which frames a rank's traceback shows: the user's code and the libraries it called,
not mpilab's own, the engine's glue (ipyparallel, IPython, …) or torch's private modules.
One rule for a notebook cell's traceback (engine.py) and a batch script's (batch.py)."""

from __future__ import annotations

import os

_MPILAB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HIDDEN_PACKAGES = ("mpilab", "ipyparallel", "IPython", "ipykernel", "zmq", "tornado")


def hidden_frame(filename: str) -> bool:
    """Whether a traceback leaves out a frame of this file."""
    if filename.startswith(_MPILAB_DIR) or filename == "<frozen runpy>":
        return True  # runpy: how `python -m mpilab.launch` runs a script
    parts = filename.replace("\\", "/").split("/")
    return any(p in _HIDDEN_PACKAGES for p in parts) or "site-packages/torch/_" in filename


def user_frames(tb):
    """`tb` without the frames a traceback leaves out (relinked; kept as it is when that
    would leave none)."""
    kept, each = [], tb
    while each is not None:
        if not hidden_frame(each.tb_frame.f_code.co_filename):
            kept.append(each)
        each = each.tb_next
    if not kept:
        return tb
    for earlier, later in zip(kept, kept[1:]):
        earlier.tb_next = later
    kept[-1].tb_next = None
    return kept[0]

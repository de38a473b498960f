"""mpilab: MPI ranks from a notebook, for data-parallel deep learning.

In the notebook: ``%load_ext mpilab`` then ``%mpilab start -n 4``. On the ranks (and in
batch scripts) the names below are the training API. Importing this package is cheap:
each name is resolved from its module the first time it is used, and nothing from the
notebook side is imported on the ranks.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_RANK_API = {
    "init": ".rank.bootstrap",
    "context": ".rank.bootstrap",
    "RankContext": ".rank.bootstrap",
    "log": ".rank.agent",
    "progress": ".rank.progress",
    "allreduce": ".rank.collectives",
    "broadcast": ".rank.collectives",
    "allgather": ".rank.collectives",
    "barrier": ".rank.collectives",
    "DataParallel": ".rank.data_parallel",
    "shard": ".rank.sharding",
    "save_checkpoint": ".rank.checkpoint",
    "load_checkpoint": ".rank.checkpoint",
    "LocalSGD": ".rank.strategies",
    "EASGD": ".rank.strategies",
    "PowerSGD": ".rank.compression",
    "TopK": ".rank.compression",
    "traffic": ".rank.compression",
    "ScaledLR": ".rank.large_batch",
    "LARS": ".rank.large_batch",
}

__all__ = sorted(_RANK_API) + ["load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str):
    module = _RANK_API.get(name)
    if module is None:
        raise AttributeError(f"module 'mpilab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


def load_ipython_extension(ipython) -> None:
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magics import unload

    unload(ipython)

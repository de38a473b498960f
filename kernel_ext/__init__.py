"""mpilab: MPI ranks from a notebook, for data-parallel deep learning.

In the notebook: ``%load_ext mpilab`` then ``%mpilab start -n 4``. On the ranks (and in
batch scripts) the names below are the training API. Importing this package is cheap:
each name is resolved from its module the first time it is used, and nothing from the
notebook side is imported on the ranks.
"""

from __future__ import annotations

from ._lazy import lazy_names

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
    "traffic": ".rank.accounting",
    "ScaledLR": ".rank.large_batch",
    "LARS": ".rank.large_batch",
}

__all__ = sorted(_RANK_API) + ["load_ipython_extension", "unload_ipython_extension"]


__getattr__, __dir__ = lazy_names(__name__, globals(), _RANK_API)


def load_ipython_extension(ipython) -> None:
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magics import unload

    unload(ipython)

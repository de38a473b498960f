"""mpilab.shard: this rank's DataLoader, every sample seen exactly once per epoch.

All ranks draw the same permutation (seed + epoch) and walk it in *global* batches of
``world_size * batch_size`` samples; each global batch is split into one contiguous
piece per rank. So every rank runs the same number of steps (a rank with one batch more
than the others would leave them waiting in the gradient allreduce forever) and no
sample is duplicated or dropped.

The uneven end, with ``drop_last=False``: the last global batch holds R < world_size *
batch_size samples and is split as evenly as possible (sizes differ by at most one). If
R < world_size some rank would get an empty batch, so those R samples join the previous
global batch instead (a few ranks then take batch_size + 1 there). With
``drop_last=True`` every batch on every rank has exactly batch_size samples and the
incomplete last global batch is skipped (a different one each epoch when shuffled).

DataParallel averages gradients over ranks, so with uneven batches the samples of a
smaller batch weigh slightly more in that one step; that is the price of no duplicates.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from .context import context


@dataclass(frozen=True)
class ShardPlan:
    """Which samples a rank takes: a pure function of sizes, seed and epoch."""

    n_samples: int
    world_size: int
    rank: int
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if not self.drop_last and 0 < self.n_samples < self.world_size:
            raise ValueError(
                f"a dataset of {self.n_samples} samples cannot be sharded over "
                f"{self.world_size} ranks without duplicating samples: use a bigger dataset "
                "or fewer ranks")

    def global_batches(self) -> list[tuple[int, int]]:
        """(start, stop) of each global batch in the epoch's permutation."""
        span = self.world_size * self.batch_size
        full, rest = divmod(self.n_samples, span)
        bounds = [(i * span, (i + 1) * span) for i in range(full)]
        if rest and not self.drop_last:
            if rest >= self.world_size or not bounds:
                bounds.append((full * span, self.n_samples))
            else:  # too few to give every rank one: join the previous global batch
                bounds[-1] = (bounds[-1][0], self.n_samples)
        return bounds

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of dataset indices for `epoch`."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n_samples, generator=g).tolist()
        else:
            order = list(range(self.n_samples))
        out = []
        for start, stop in self.global_batches():
            base, extra = divmod(stop - start, self.world_size)
            lo = start + self.rank * base + min(self.rank, extra)
            hi = lo + base + (1 if self.rank < extra else 0)
            out.append(order[lo:hi])
        return out


class ShardSampler(Sampler[list[int]]):
    """A batch sampler over a ShardPlan; set_epoch reshuffles reproducibly."""

    def __init__(self, plan: ShardPlan):
        self.plan = plan
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.plan.batches(self.epoch))

    def __len__(self) -> int:
        return len(self.plan.global_batches())


class ShardLoader(DataLoader):
    """A DataLoader over this rank's shard; call ``set_epoch(e)`` before each epoch."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def shard(dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0,
          drop_last: bool = False, **loader_kwargs: Any) -> ShardLoader:
    """This rank's DataLoader over `dataset` (extra keyword arguments go to DataLoader)."""
    ctx = context()
    try:
        n_samples = len(dataset)
    except TypeError:
        raise TypeError(f"mpilab.shard takes a dataset with a length and indexing (a torch "
                        f"Dataset, a list), got {type(dataset).__name__}") from None
    plan = ShardPlan(n_samples, ctx.world_size, ctx.rank, batch_size, shuffle, seed,
                     drop_last)
    return ShardLoader(dataset, batch_sampler=ShardSampler(plan), **loader_kwargs)

"""mpilab.shard: every sample exactly once per epoch, equal step counts on every rank."""

from __future__ import annotations

import itertools

import pytest
from mpilab.rank import bootstrap
from mpilab.rank.sharding import ShardPlan, shard
from mpirun import run_ranks


def _epoch(n: int, world: int, b: int, drop_last: bool, epoch: int = 0,
           shuffle: bool = True) -> list[list[list[int]]]:
    return [ShardPlan(n, world, r, b, shuffle=shuffle, seed=7, drop_last=drop_last).batches(epoch)
            for r in range(world)]


@pytest.mark.parametrize("n,world,b", list(itertools.product([1, 5, 8, 23, 24, 25, 97],
                                                              [1, 2, 3, 4], [1, 3, 4])))
def test_plan_covers_every_sample_once(n: int, world: int, b: int) -> None:
    if n < world:
        with pytest.raises(ValueError, match="without duplicating"):
            ShardPlan(n, world, 0, b)
        return
    ranks = _epoch(n, world, b, drop_last=False)
    seen = [i for batches in ranks for batch in batches for i in batch]
    assert sorted(seen) == list(range(n))
    assert len({len(batches) for batches in ranks}) == 1, "ranks must run the same steps"
    assert all(batch for batches in ranks for batch in batches), "no empty batch"
    assert all(len(batch) <= b + 1 for batches in ranks for batch in batches)


@pytest.mark.parametrize("n,world,b", [(23, 2, 4), (24, 3, 4), (7, 2, 4), (100, 4, 3)])
def test_drop_last_gives_full_batches(n: int, world: int, b: int) -> None:
    ranks = _epoch(n, world, b, drop_last=True)
    seen = [i for batches in ranks for batch in batches for i in batch]
    assert len(seen) == len(set(seen)) == (n // (world * b)) * world * b
    assert all(len(batch) == b for batches in ranks for batch in batches)


def test_epochs_reshuffle_reproducibly() -> None:
    assert _epoch(50, 2, 4, False, epoch=1) == _epoch(50, 2, 4, False, epoch=1)
    assert _epoch(50, 2, 4, False, epoch=1) != _epoch(50, 2, 4, False, epoch=2)
    flat = [i for batch in _epoch(12, 2, 3, False, shuffle=False)[0] for i in batch]
    assert flat == [0, 1, 2, 6, 7, 8]


def test_outside_a_cluster_says_so() -> None:
    assert not bootstrap.is_initialized()
    with pytest.raises(bootstrap.BootstrapError, match="not initialised"):
        shard(list(range(10)), batch_size=2)


_REAL = """
import torch
from torch.utils.data import TensorDataset

out = {}
for n in (20, 23):
    loader = mpilab.shard(TensorDataset(torch.arange(n)), batch_size=4, seed=3)
    epochs = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        epochs.append([batch[0].tolist() for batch in loader])
    out[n] = {"epochs": epochs, "len": len(loader)}
try:
    mpilab.shard(5, batch_size=2)
except TypeError as e:
    out["not a dataset"] = str(e)
everyone = ctx.comm.gather(out, root=0)
if ctx.rank == 0:
    report(everyone)
"""


def test_shard_on_two_real_ranks() -> None:
    by_rank = run_ranks(_REAL, n=2)[0]
    for n in ("20", "23"):
        for epoch in (0, 1):
            seen = [i for r in by_rank for batch in r[n]["epochs"][epoch] for i in batch]
            assert sorted(seen) == list(range(int(n)))
        assert by_rank[0][n]["len"] == by_rank[1][n]["len"] == len(by_rank[0][n]["epochs"][0])
        assert by_rank[0][n]["epochs"][0] != by_rank[0][n]["epochs"][1]
    assert by_rank[0]["not a dataset"] == ("mpilab.shard takes a dataset with a length and "
                                           "indexing (a torch Dataset, a list), got int")

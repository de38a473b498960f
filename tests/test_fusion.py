"""grouped_allreduce: bucketing logic, and real reductions on 2 and 3 MPI ranks
(tests/rank_scenarios/fusion.py)."""

from __future__ import annotations

import pytest
import torch
from mpilab.rank.fusion import _buckets, _plan, grouped_allreduce
from rank_scenarios import run_scenario


def test_buckets_pack_in_order_up_to_the_threshold_per_dtype():
    ts = [torch.zeros(100), torch.zeros(100), torch.zeros(50, dtype=torch.float64),
          torch.zeros(200), torch.zeros(1000), torch.zeros(10, dtype=torch.bfloat16)]
    plans = [_plan(t, "mpi") for t in ts]
    got = [(wire, members) for _, _, wire, members in _buckets(ts, plans, limit=1000)]
    # float32 400+400 bytes fit, +800 does not; the 4000-byte tensor goes alone;
    # bfloat16 travels as float32 with the other float32 tensors; full buckets go first,
    # then the open ones in order of their first tensor.
    assert got == [
        (torch.float32, [0, 1]),
        (torch.float32, [3]),
        (torch.float32, [4]),
        (torch.float32, [5]),
        (torch.float64, [2]),
    ]


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="op 'prod'"):
        grouped_allreduce([torch.zeros(2)], op="prod")
    with pytest.raises(ValueError, match="backend 'nccl2'"):
        grouped_allreduce([torch.zeros(2)], backend="nccl2")
    with pytest.raises(TypeError, match="torch.bool"):
        grouped_allreduce([torch.zeros(2, dtype=torch.bool)])


@pytest.mark.parametrize("n", [2, 3])
def test_grouped_allreduce_every_dtype_and_op(n):
    assert run_scenario("fusion", n=n) == [[]] * n

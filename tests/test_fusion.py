"""grouped_allreduce: bucketing logic, and real reductions on 2 and 3 MPI ranks."""

from __future__ import annotations

import pytest
import torch
from mpilab.rank.fusion import _buckets, _plan, grouped_allreduce
from mpirun import run_ranks


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


CHECK = """
import torch
from mpilab.rank.fusion import grouped_allreduce

n, r = ctx.world_size, ctx.rank
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
SHAPES = [(1,), (3,), (17, 5), (1000,), (64, 1025), (300_001,)]

def value(rank, numel):
    i = torch.arange(numel, dtype=torch.int64)
    return (i * 7 + rank * 13) % 17 - 8

def expected(numel, op):
    parts = torch.stack([value(q, numel) for q in range(n)])
    return {"sum": parts.sum(0), "max": parts.max(0).values, "min": parts.min(0).values,
            "mean": parts.sum(0).double() / n}[op]

failures = []
for backend in ("mpi", "torch"):
    for op in ("sum", "mean", "max", "min"):
        tensors, wants = [], []
        for dt in DTYPES:
            for shape in SHAPES:
                numel = torch.Size(shape).numel()
                tensors.append(value(r, numel).to(dt).reshape(shape))
                want = expected(numel, op)
                if op == "mean" and not dt.is_floating_point:
                    want = torch.div(expected(numel, "sum"), n, rounding_mode="floor")
                wants.append(want.reshape(shape))
        # a parameter (requires_grad) and a non-contiguous tensor are reduced in place too
        tensors.append(torch.nn.Parameter(value(r, 9).float()))
        wants.append(expected(9, op))
        base = value(r, 200).float().reshape(10, 20)
        tensors.append(base.t())
        wants.append(expected(200, op).reshape(10, 20).t())
        out = grouped_allreduce(tensors, op=op, backend=backend, threshold=1 << 20)
        assert out is not tensors and all(a is b for a, b in zip(out, tensors))
        for t, want in zip(tensors, wants):
            tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(t.dtype, 1e-6)
            ok = torch.allclose(t.double(), want.double(), rtol=tol, atol=tol)
            if op != "mean":
                ok = torch.equal(t.double(), want.double())
            if not ok:
                failures.append(f"{backend} {op} {t.dtype} {tuple(t.shape)}")
        if not base.t().data_ptr() == tensors[-1].data_ptr():
            failures.append("non-contiguous tensor replaced")
for q in range(n):
    if q == r:
        report(failures)
    ctx.comm.Barrier()
"""


@pytest.mark.parametrize("n", [2, 3])
def test_grouped_allreduce_every_dtype_and_op(n):
    assert run_ranks(CHECK, n=n, timeout=240) == [[]] * n

"""mpilab.allreduce / broadcast / allgather / barrier on a real 2-rank cluster."""

from __future__ import annotations

import pytest
from mpilab.rank import bootstrap, collectives
from mpirun import run_ranks

_RUN = """
import importlib.util
import torch
from mpilab.rank import agent

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64}
out = {"allreduce": {}, "errors": {}}
seq0 = agent.current().state.seq
calls = 0
for backend in ("mpi", "torch", "auto"):
    for name, dtype in DTYPES.items():
        for op in ("sum", "mean", "max", "min"):
            # rank r holds r + 1 + (position / 4): half-precision exact values
            x = (torch.arange(6, dtype=torch.float64).reshape(2, 3) / 4 + ctx.rank + 1)
            x = x.to(dtype) if dtype.is_floating_point else (x * 4).to(dtype)
            got = mpilab.allreduce(x, op=op, backend=backend)
            calls += 1
            out["allreduce"][f"{backend}/{name}/{op}"] = [got is x, str(got.dtype),
                                                          got.double().flatten().tolist()]
    # non-contiguous input is reduced in place too
    t = (torch.arange(6.0).reshape(2, 3) + ctx.rank).t()
    mpilab.allreduce(t, backend=backend)
    out[f"{backend}/transposed"] = t.flatten().tolist()
    b = torch.full((3,), float(ctx.rank), dtype=torch.bfloat16)
    out[f"{backend}/broadcast"] = mpilab.broadcast(b, root=1, backend=backend).tolist()
    g = mpilab.allgather(torch.tensor([ctx.rank, 10 * ctx.rank]), backend=backend)
    out[f"{backend}/allgather"] = [list(g.shape), g.tolist()]
    mpilab.barrier(backend="mpi" if backend == "auto" else backend)
    calls += 4
param = torch.nn.Parameter(torch.ones(3) * (ctx.rank + 1))  # requires_grad: in place too
mpilab.allreduce(param, op="mean")
mpilab.broadcast(param, root=1)
out["param"] = param.tolist()
calls += 2
out["seq_counted"] = agent.current().state.seq - seq0 == calls

def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"

out["errors"]["op"] = error_of(lambda: mpilab.allreduce(torch.ones(2), op="avg"))
out["errors"]["backend"] = error_of(lambda: mpilab.allreduce(torch.ones(2), backend="nccl"))
odd = mpilab.allreduce(torch.tensor([ctx.rank, -ctx.rank], dtype=torch.int64), op="mean")
out["int_mean_floor"] = odd.tolist()
out["errors"]["root"] = error_of(lambda: mpilab.broadcast(torch.ones(2), root=5))
if importlib.util.find_spec("mpilab.rank.fusion") is not None:
    pair = [torch.ones(3) * (ctx.rank + 1), torch.ones(2, 2, dtype=torch.float64)]
    mpilab.allreduce(pair, op="sum")
    out["fused"] = [p.flatten().tolist() for p in pair]
everyone = ctx.comm.gather(out, root=0)
if ctx.rank == 0:
    report(everyone)
"""


def _expected(op: str, integer: bool) -> list[float]:
    base = [i / 4 for i in range(6)]
    ranks = [[v + r + 1 for v in base] for r in range(2)]
    if integer:
        ranks = [[v * 4 for v in values] for values in ranks]
    pick = {"sum": lambda a, b: a + b, "mean": lambda a, b: (a + b) / 2, "max": max,
            "min": min}[op]  # the integer means here are exact
    return [pick(a, b) for a, b in zip(*ranks, strict=True)]


@pytest.fixture(scope="module")
def results() -> list:
    return run_ranks(_RUN, n=2)[0]


def test_allreduce_every_dtype_op_and_backend(results: list) -> None:
    checked = 0
    for got in results:
        for key, (in_place, dtype, values) in got["allreduce"].items():
            backend, name, op = key.split("/")
            assert in_place, key
            assert dtype == f"torch.{name}", key
            assert values == _expected(op, name == "int64"), key
            checked += 1
    assert checked == 2 * 3 * 5 * 4
    assert results[0]["int_mean_floor"] == [0, -1]  # integer means round down


@pytest.mark.parametrize("backend", ["mpi", "torch", "auto"])
def test_broadcast_allgather_and_layouts(results: list, backend: str) -> None:
    for rank, got in enumerate(results):
        assert got[f"{backend}/transposed"] == [0 + 1, 6 + 1, 2 + 1, 8 + 1, 4 + 1, 10 + 1]
        assert got[f"{backend}/broadcast"] == [1.0, 1.0, 1.0], rank
        assert got[f"{backend}/allgather"] == [[2, 2], [[0, 0], [1, 10]]]


def test_parameters_reduce_in_place(results: list) -> None:
    assert results[0]["param"] == results[1]["param"] == [1.5, 1.5, 1.5]


def test_every_call_is_seen_by_the_agent(results: list) -> None:
    assert all(got["seq_counted"] for got in results)


def test_bad_input_is_named(results: list) -> None:
    errors = results[0]["errors"]
    assert "'avg'" in errors["op"] and "sum, mean, max, min" in errors["op"]
    assert "'nccl'" in errors["backend"] and "auto, mpi, torch" in errors["backend"]
    assert "root 5" in errors["root"]


def test_a_list_goes_through_tensor_fusion(results: list) -> None:
    if "fused" not in results[0]:
        pytest.skip("mpilab.rank.fusion is not there yet")
    for got in results:
        assert got["fused"] == [[3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]]


def test_outside_a_cluster_says_so() -> None:
    import torch

    assert not bootstrap.is_initialized()
    with pytest.raises(bootstrap.BootstrapError, match="not initialised"):
        collectives.allreduce(torch.ones(2))
    with pytest.raises(bootstrap.BootstrapError, match="not initialised"):
        collectives.barrier()

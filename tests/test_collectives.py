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


# ------------------------------------------------ the per-tensor plans of CPU tensors
_PLANS = """
import gc, threading, time
import numpy as np
import torch
from mpilab.rank import agent as agent_mod, collectives, waiting
from mpilab.rank.fast_allreduce import plan_for

out = {}
r, n = ctx.rank, ctx.world_size
out["path"] = plan_for(collectives.private_comm()).path
# spans and heartbeats as the notebook gets them: an agent with an address, not started
probe = agent_mod.Agent(r, n, "tcp://127.0.0.1:9")
agent_mod._agent = probe

# one tensor reduced again and again: values change, the plan is kept
t = torch.zeros(5)
sums = []
for i in range(4):
    t.fill_(r + i)
    sums.append(mpilab.allreduce(t).tolist())
out["loop"] = sums
out["planned"] = collectives.tensor_plan(t) is collectives.tensor_plan(t)
# the tensor changes under its plan: new storage, new shape, new dtype
t.data = torch.full((3,), float(r + 1))
out["new_storage"] = mpilab.allreduce(t, op="mean").tolist()
t.resize_(2, 2).fill_(r)
out["resized"] = mpilab.allreduce(t, op="max").tolist()
t.data = torch.full((2,), r + 1, dtype=torch.int64)
out["new_dtype"] = mpilab.allreduce(t, op="mean").tolist()
view = torch.arange(10.0)[2:6] + r  # a view with an offset into its storage
out["view"] = mpilab.allreduce(view).tolist()
# gone with its tensor
before = len(collectives._plans)
mpilab.allreduce(torch.ones(7))
gc.collect()
out["dropped"] = len(collectives._plans) == before

# broadcast and allgather: small, several chunks (odd sizes), every kind of dtype
def pattern(count, dtype, rank):
    values = (torch.arange(count, dtype=torch.int64) * 7 + rank * 13) % 120
    return values.to(dtype)

bad = []
for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64):
    for count in (1, 3, 1000, (5 << 20) // 4 + 3):
        for root in range(n):
            x = pattern(count, dtype, r)
            mpilab.broadcast(x, root=root)
            if not torch.equal(x, pattern(count, dtype, root)):
                bad.append(f"broadcast {dtype} {count} root {root}")
        g = mpilab.allgather(pattern(count, dtype, r))
        want = torch.stack([pattern(count, dtype, q) for q in range(n)])
        if g.shape != want.shape or g.dtype != dtype or not torch.equal(g, want):
            bad.append(f"allgather {dtype} {count}")
out["bad"] = bad
out["scalar"] = mpilab.allgather(torch.tensor(float(r))).tolist()
# into a buffer: reused, returned; a transposed one is filled too; a wrong one is named
buf = torch.zeros(n, 3)
firsts = [mpilab.allgather(torch.full((3,), float(r + i)), out=buf) is buf for i in range(2)]
out["out"] = [firsts, buf[:, 0].tolist()]
side = torch.zeros(3, n).t()
mpilab.allgather(torch.full((3,), float(r)), out=side)
out["out_strided"] = side[:, 0].tolist()
try:
    mpilab.allgather(torch.ones(3), out=torch.zeros(n, 4))
except ValueError as e:
    out["out_error"] = str(e)

# what the notebook receives: numbered spans with bytes, and a heartbeat's shape text
probe._queue.clear()
seq0 = probe.state.seq
m = torch.ones(2, 3)
mpilab.allreduce(m)
mpilab.broadcast(m)
mpilab.allgather(m)
spans = [(rec["labels"], list(np.frombuffer(rec["data"]).reshape(-1, 5)[:, 3:]))
         for rec in agent_mod.tabulate(r, list(probe._queue)) if rec.get("of") == "span"]
out["spans"] = [[labels, [[int(v) for v in row] for row in rows]] for labels, rows in spans]
out["seq"] = probe.state.seq - seq0
seen = []
def sample(stop):
    while not stop.is_set():
        hb = probe.heartbeat()
        if hb["phase"] == "collective":
            seen.append([hb["op"], hb["op_shape"], hb["op_nbytes"]])
            return
stop = threading.Event()
sampler = threading.Thread(target=sample, args=(stop,))
sampler.start()
if r == 1:
    time.sleep(0.3)  # rank 0 waits in its allreduce meanwhile
mpilab.allreduce(torch.ones(4, 1, 2))
stop.set(); sampler.join()
out["heartbeat"] = seen

# a released wait in a planned broadcast (a receiver's: a root waits for nobody); recovery
# gives the tensor a new plan
x = torch.zeros(1000)
mpilab.broadcast(x)
ctx.comm.Barrier()
outcome = None
if r == 1:
    threading.Timer(0.3, waiting.abort, ("peer failed",)).start()
    try:
        mpilab.broadcast(x)
    except waiting.CollectiveAborted as e:
        outcome = str(e)
else:
    time.sleep(0.6)
    waiting.abort("peer failed")
waiting.recover()
x.fill_(r + 5)
out["aborted"] = outcome
out["after_recovery"] = mpilab.broadcast(x, root=1).tolist()[:2]
report(out)
"""


@pytest.fixture(scope="module")
def plans() -> list:
    return run_ranks(_PLANS, n=2)


def test_a_tensor_reduced_again_keeps_its_plan_and_follows_its_changes(plans: list) -> None:
    for rank, got in enumerate(plans):
        assert got["path"] == "shm"
        assert got["loop"] == [[2 * i + 1.0] * 5 for i in range(4)], rank
        assert got["planned"]
        assert got["new_storage"] == [1.5, 1.5, 1.5]
        assert got["resized"] == [[1.0, 1.0], [1.0, 1.0]]
        assert got["new_dtype"] == [1, 1]  # (1 + 2) // 2
        assert got["view"] == [5.0, 7.0, 9.0, 11.0]
        assert got["dropped"]


def test_broadcast_and_allgather_over_shared_memory_every_size_and_dtype(plans: list) -> None:
    for got in plans:
        assert got["bad"] == []
        assert got["scalar"] == [0.0, 1.0]
        assert got["out"] == [[True, True], [1.0, 2.0]]
        assert got["out_strided"] == [0.0, 1.0]
        assert got["out_error"].startswith("allgather's out is [2, 4] torch.float32")
        assert "\n" not in got["out_error"]


def test_collectives_leave_numbered_spans_and_heartbeats_format_shapes(plans: list) -> None:
    for got in plans:
        assert got["seq"] == 3
        assert [labels for labels, _ in got["spans"]] == [
            ["allreduce", "comm"], ["broadcast", "comm"], ["allgather", "comm"]]
        rows = [rows for _, rows in got["spans"]]
        first = rows[0][0][1]
        assert rows == [[[24, first]], [[24, first + 1]], [[24, first + 2]]]
    assert plans[0]["heartbeat"] == [["allreduce", "4x1x2", 32]]


def test_a_released_planned_wait_and_recovery(plans: list) -> None:
    assert plans[1]["aborted"] == "peer failed"
    assert plans[0]["after_recovery"] == plans[1]["after_recovery"] == [6.0, 6.0]


def test_span_rows_and_shape_text_match_the_records_they_replace() -> None:
    import torch
    from mpilab.rank import agent as agent_mod

    record = {"k": "span", "r": 0, "t": 2.5, "name": "allreduce", "cat": "comm", "ts": 2.0,
              "dur": 0.5, "nbytes": 64, "seq": 7}
    assert agent_mod.tabulate(0, [("allreduce", 2.0, 2.5, 64, 7)]) == \
        agent_mod.tabulate(0, [record])
    assert agent_mod.shape_text(torch.Size([2, 3])) == "2x3"
    assert agent_mod.shape_text(()) == "scalar"
    assert agent_mod.shape_text("buckets=2") == "buckets=2"


_MISMATCH = """
import threading, time
import torch
from mpilab.rank import waiting

def released(fn):
    # a mismatch must wait (as MPI's collectives would) until the watchdog releases it
    timer = threading.Timer(0.5, waiting.abort, ("released",))
    timer.start()
    start = time.perf_counter()
    try:
        fn()
        outcome = "completed"
    except waiting.CollectiveAborted as e:
        outcome = str(e)
    ctx.comm.Barrier()
    waiting.recover()
    return [outcome, time.perf_counter() - start >= 0.4]

r = ctx.rank
x = torch.ones(3)
out = {
    "ops": released(lambda: mpilab.allreduce(x) if r == 0 else mpilab.broadcast(x)),
    "sizes": released(lambda: mpilab.allreduce(torch.ones(3 + r))),
    "reductions": released(lambda: mpilab.allreduce(x, op="max" if r else "sum")),
    "roots": released(lambda: mpilab.broadcast(torch.ones(4), root=r)),
    "gather_barrier": released(lambda: mpilab.allgather(x) if r else mpilab.barrier()),
}
out["after"] = mpilab.allreduce(torch.ones(2)).tolist()
report(out)
"""


def test_ranks_in_different_collectives_wait_to_be_released() -> None:
    for got in run_ranks(_MISMATCH, n=2):
        after = got.pop("after")
        assert after == [2.0, 2.0]
        for case, outcome in got.items():
            assert outcome == ["released", True], case

"""mpilab.allreduce / broadcast / allgather / barrier on a real 2-rank cluster (the rank side:
tests/rank_scenarios/collectives.py and tensor_plans.py)."""

from __future__ import annotations

import re
import time

import pytest
from mpilab.rank import bootstrap, collectives
from mpirun import run_ranks
from rank_scenarios import run_scenario


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
    return run_scenario("collectives")[0]


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
    assert errors["bool"] == ("TypeError: mpilab.allreduce does not reduce torch.bool tensors: "
                              "t.to(torch.uint8) reduced with op='max' is any, with op='min' "
                              "all")
    assert errors["root_text"] == "TypeError: mpilab.broadcast's root is a rank number, got str '0'"
    assert all(got["numpy_root"] == [1.0, 1.0] for got in results)
    # what is not a tensor is named, with how to make one
    assert errors["list"] == ("TypeError: mpilab.allreduce's tensor must be a tensor or a "
                              "list of tensors, got a list holding an int: make each a "
                              "tensor (torch.as_tensor)")
    assert errors["array"] == ("TypeError: mpilab.broadcast's tensor must be a tensor, got "
                               "a numpy array: torch.from_numpy(a) shares the array's memory, "
                               "so the result lands in the array")
    assert errors["out"].startswith("TypeError: mpilab.allgather's out must be a tensor, "
                                    "got a list")


def test_a_list_goes_through_tensor_fusion(results: list) -> None:
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
@pytest.fixture(scope="module")
def plans() -> list:
    return run_scenario("tensor_plans")


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
        assert got["read_peers"]  # large broadcasts may read the root's memory here
        assert got["scalar"] == [0.0, 1.0]
        assert got["out"] == [[True, True], [1.0, 2.0]]
        assert got["out_strided"] == [0.0, 1.0]
        # one buffer filled again and again, also after its storage changed under it
        assert got["gathers"] == [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0], [10.0, 11.0],
                                  "allgather's out is [2, 4] torch.float32 on cpu, but the "
                                  "result is [2, 3] torch.float32 on cpu"]
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
    # a tensor's collectives again, by its plan: numbered and in spans just the same
    for got in plans:
        assert got["planned_seq"] == 6
        assert got["planned_spans"] == ["allreduce", "broadcast", "allgather"] * 2
        assert got["planned_numbers"] == [1, 2, 3, 4, 5, 6]
        # the one C call: taken for a planned op on the main thread (the sum ran again: 2 + 2),
        # not for an op or root without an entry, another thread, or a resized tensor
        assert got["taken"] == [True, False, False, False, False, [[4.0, 4.0], [4.0, 4.0]]]
    # a planned collective on another thread leaves a span and takes no number
    assert all(got["off_main"] == [0, [["allreduce", "comm"], ["broadcast", "comm"]]]
               for got in plans), [got["off_main"] for got in plans]


def test_a_released_planned_wait_and_recovery(plans: list) -> None:
    assert plans[1]["aborted"] == "peer failed"
    assert plans[0]["after_recovery"] == plans[1]["after_recovery"] == [6.0, 6.0]


def test_span_rows_and_shape_text_match_the_records_they_replace() -> None:
    import torch
    from mpilab import wire
    from mpilab.rank import agent as agent_mod

    record = {"k": "span", "r": 0, "t": 2.5, "name": "allreduce", "cat": "comm", "ts": 2.0,
              "dur": 0.5, "nbytes": 64, "seq": 7}
    assert wire.tabulate(0, [("allreduce", 2.0, 2.5, 64, 7)]) == \
        wire.tabulate(0, [record])
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


# The ranks as the notebook's are: with a notebook to report to (nothing listens here),
# whose watchdog releases a mismatch (the timer above stands in for it).
AS_IN_THE_NOTEBOOK = {"MPILAB_AGENT": "tcp://127.0.0.1:9"}


def test_ranks_in_different_collectives_wait_to_be_released() -> None:
    for got in run_ranks(_MISMATCH, n=2, env=AS_IN_THE_NOTEBOOK):
        after = got.pop("after")
        assert after == [2.0, 2.0]
        for case, outcome in got.items():
            assert outcome == ["released", True], case


def test_ranks_in_different_collectives_in_a_batch_script_end_the_job_saying_so() -> None:
    """A batch script has no watchdog to release ranks in different collectives: the
    collective raises at once, saying which two, and the job ends (it hung for good)."""
    started = time.monotonic()
    results, job = run_ranks("""
import torch
x = torch.ones(8)
if ctx.rank == 0:
    mpilab.allreduce(x)
else:
    mpilab.broadcast(x, root=0)
report("completed")
""", n=2, timeout=120, check=False)
    assert job.returncode == 1 and results == [None, None], job.stderr[-3000:]
    assert time.monotonic() - started < 60
    said = re.findall(r"RuntimeError: (mismatched collectives: .*)", job.stderr)
    assert said and said[0] in (
        "mismatched collectives: this rank is in an allreduce (sum) of 32 bytes, and its "
        "node's rank 1 in a broadcast of 32 bytes from its node's rank 0 at the same point: "
        "every rank must call the same collectives in the same order",
        "mismatched collectives: this rank is in a broadcast of 32 bytes from its node's "
        "rank 0, and its node's rank 0 in an allreduce (sum) of 32 bytes at the same point: "
        "every rank must call the same collectives in the same order"), job.stderr
    assert "ending all 2 ranks" in job.stderr
    assert "collectives.py" not in job.stderr  # the script's frames, not mpilab's

"""DataParallel on a real 2-rank cluster: equivalence with one big-batch process, errors."""

from __future__ import annotations

import pytest
from mpirun import run_ranks
from rank_scenarios import run_scenario

# mpiexec can interleave long lines from two ranks: rank 0 reports everyone's results.
_GATHER = """
def report_all(obj):
    everyone = ctx.comm.gather(obj, root=0)
    if ctx.rank == 0:
        report(everyone)
"""


def run_gathered(code: str, n: int = 2, timeout: float = 240) -> list:
    """Each rank calls report_all(obj) once; returns the objects by rank."""
    return run_ranks(_GATHER + code, n=n, timeout=timeout)[0]


@pytest.fixture(scope="module")
def trained() -> list:
    return run_scenario("data_parallel")[0]


@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("variant", ["plain", "buckets", "no_sync"])
def test_matches_one_process_with_the_global_batch(trained: list, backend: str,
                                                   variant: str) -> None:
    for rank_out in trained:
        assert rank_out[f"{backend}-{variant}"]["err"] < 1e-5
    if backend == "mpi":
        assert trained[0]["mpi-plain"]["buckets"] == 1
        assert trained[0][f"mpi-{variant}"]["buckets"] >= (1 if variant == "plain" else 3)


@pytest.mark.parametrize("variant", ["buckets", "no_sync"])
def test_without_a_comm_thread(trained: list, variant: str) -> None:
    for rank_out in trained:
        assert rank_out[f"mpi-inline-{variant}"]["err"] < 1e-5
        assert rank_out[f"mpi-inline-{variant}"]["steps"] == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_stays_close(trained: list, backend: str, compression: str) -> None:
    # fp16 keeps 11 bits of mantissa; bf16 only 8, so it gets a looser bound
    bound = 1e-2 if compression == "fp16" else 5e-2
    for rank_out in trained:
        assert rank_out[f"{backend}-{compression}"]["rel_update_err"] < bound
    assert trained[0][f"{backend}-{compression}"]["err"] == trained[1][
        f"{backend}-{compression}"]["err"], "ranks diverged"


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_one_step_record_per_optimizer_step(trained: list, backend: str) -> None:
    for variant in ("plain", "buckets", "no_sync", "fp16"):
        got = trained[0][f"{backend}-{variant}"]
        assert got["steps"] == [1, 2, 3, 4]
        assert got["samples"] == [8, 8, 8, 8]  # both micro-batches counted with no_sync
        assert got["nbytes_ok"] and got["times_ok"]
        assert got["agent_step"] == 4


@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_half_precision_logs_its_bytes_and_ratio(trained: list, backend: str,
                                                  compression: str) -> None:
    """The dashboard's bytes sent and compression ratio, as for the other methods."""
    got = trained[0][f"{backend}-{compression}"]
    assert [v["bytes_sent"] for v in got["logged"]] == got["nbytes"]
    assert all(v["compression_ratio"] == 2.0 for v in got["logged"])  # float32 sent as 16 bits


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_wrapped_model_looks_like_the_plain_one(trained: list, backend: str) -> None:
    got = trained[1][f"{backend}-plain"]
    assert got["keys_plain"] and got["forward_same"]


def test_wrapping_again(trained: list) -> None:
    assert trained[0]["rewrap_err"] < 1e-5
    assert "already wrapped by DataParallel" in trained[0]["wrap_twice"]
    assert trained[0]["not_a_model"] == \
        "TypeError: DataParallel wraps a torch.nn.Module, got str 'resnet'"


def test_bfloat16_model_over_mpi(trained: list) -> None:
    assert trained[0]["bf16_params"] == trained[1]["bf16_params"]


def test_unused_parameters_do_not_hang(trained: list) -> None:
    assert trained[0]["unused_grad_zero"]


_ERRORS = """
import torch
from torch import nn

def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None

shape = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 if ctx.rank == 0 else 5))
count = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 + ctx.rank)])
report_all({
    "shape": error_of(lambda: mpilab.DataParallel(shape)),
    "count": error_of(lambda: mpilab.DataParallel(count, backend="torch")),
    "backend": error_of(lambda: mpilab.DataParallel(nn.Linear(2, 2), backend="nccl2")),
    "compression": error_of(lambda: mpilab.DataParallel(nn.Linear(2, 2), compression="int8")),
})
"""


def test_bad_input_is_named() -> None:
    for got in run_gathered(_ERRORS):
        assert "'1.weight'" in got["shape"] and "rank 1" in got["shape"]
        assert "[3, 4]" in got["shape"] and "[5, 4]" in got["shape"]
        assert "rank 0 has 4 parameters but rank 1 has 6" in got["count"]
        assert "'2.weight'" in got["count"]
        assert "nccl2" in got["backend"] and "mpi, torch" in got["backend"]
        assert "'int8'" in got["compression"]


def test_outside_a_cluster_says_so() -> None:
    from mpilab.rank import bootstrap
    from mpilab.rank.data_parallel import DataParallel
    from torch import nn

    assert not bootstrap.is_initialized()
    with pytest.raises(bootstrap.BootstrapError, match="not initialised"):
        DataParallel(nn.Linear(2, 2))


_RECOVER = """
import threading
import torch
from torch import nn
from mpilab.rank import waiting

torch.manual_seed(0)
model = nn.Linear(32, 16)  # a matrix PowerSGD compresses
dp = mpilab.DataParallel(model, compression=COMPRESSION)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(8, 32) * (ctx.rank + 1)

def step():
    opt.zero_grad()
    dp(x).sum().backward()
    opt.step()

step()
outcome = "released"
if ctx.rank == 0:  # waits in the gradient allreduce for a peer that never comes
    threading.Timer(0.5, waiting.abort, args=("peer failed",)).start()
    try:
        step()
    except Exception as e:  # noqa: BLE001 - autograd may wrap what a callback raised
        outcome = f"aborted: {e}"
else:  # fails before its backward; the watchdog releases every rank
    waiting.abort("released")
ctx.comm.Barrier()
waiting.recover()
step()
step()
from mpilab.rank.collectives import private_comm
from mpilab.rank.fast_allreduce import plan_for
report_all({"outcome": outcome, "params": [p.tolist() for p in model.parameters()],
            "path": plan_for(private_comm("data_parallel")).path})
"""


@pytest.mark.parametrize("path", ["shm", "mpi"])
def test_recovers_after_an_abort_mid_step(path: str) -> None:
    env = {"MPILAB_ALLREDUCE": "mpi" if path == "mpi" else "auto"}
    got = run_ranks(_GATHER + _RECOVER.replace("COMPRESSION", "None"), n=2, env=env,
                    timeout=120)[0]
    assert got[0]["outcome"] == "aborted: peer failed"
    assert got[0]["params"] == got[1]["params"]
    assert got[0]["path"] == path  # the path this case is about, not a silent fallback


@pytest.mark.parametrize("compression", ["powersgd", "topk"])
def test_compressed_training_recovers_after_an_abort_mid_step(compression: str) -> None:
    """Rank 0 counted the aborted step and rank 1 did not: without a reset, PowerSGD
    would send dense gradients on one rank and compressed ones on the other."""
    code = _RECOVER.replace("COMPRESSION", repr(compression))
    got = run_ranks(_GATHER + code, n=2, timeout=120)[0]
    assert "peer failed" in got[0]["outcome"]
    assert got[0]["params"] == got[1]["params"]


_AT_THE_END = """
import torch
from torch import nn
from mpilab.rank import agent, data_parallel as dpm

records = []
agent.current().emit = lambda kind, **f: records.append((kind, f))
here = []
real = dpm._CommThread.reduce_here_if_idle
def spy(self, bucket):
    done = real(self, bucket)
    here.append(done)
    return done
dpm._CommThread.reduce_here_if_idle = spy

out = {}
for name, bucket_mb in (("one bucket", 25.0), ("several", 0.05)):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Linear(128, 4))
    dp = mpilab.DataParallel(model, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(ctx.rank))
    here.clear()
    records.clear()
    seq0 = agent.current().state.seq
    for _ in range(3):
        opt.zero_grad()
        dp(x).pow(2).mean().backward()
        opt.step()
    spans = [f for kind, f in records if kind == "span" and f["name"] == "dp_allreduce"]
    out[name] = {"buckets": len(dp._sync.buckets), "here": list(here),
                 "numbered": agent.current().state.seq - seq0, "spans": len(spans),
                 "params": [p.detach().flatten()[:3].tolist() for p in model.parameters()]}
report_all(out)
"""


def test_buckets_that_fill_at_the_end_of_backward_are_reduced_there() -> None:
    results = run_gathered(_AT_THE_END)
    for got in results:
        one, several = got["one bucket"], got["several"]
        assert one["buckets"] == 1 and one["here"] == [True] * 3  # no thread hand-off
        # the last bucket, once a step: here unless the thread still reduces the others
        assert several["buckets"] > 2 and len(several["here"]) == 3
        for case in (one, several):  # one number per step, a span per bucket and wait
            assert case["numbered"] == 3
            assert case["spans"] == 3 * (case["buckets"] + 1)
    for name in ("one bucket", "several"):
        assert results[0][name]["params"] == results[1][name]["params"]

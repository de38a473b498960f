"""The GPU path's logic, proved on CPU: device and backend choice, the thread of
autograd's end-of-backward callback, the recovery of torch.distributed's group,
GPU placement, and the prepared GPU check itself.

On a CUDA model autograd runs gradient hooks and its final callbacks on a device thread
while the main thread sits in C++ ``backward()``. On CPU it runs them on the main
thread, so the rank tests here move autograd onto another thread the same way (the main
thread waits in C++ on a torch future, where no Python signal handler runs: the
rank-side scenarios tests/rank_scenarios/off_main.py and renew_group.py) and check
that DataParallel's waits there are numbered, shown in heartbeats, and released by
SIGINT as the notebook sends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from mpilab.rank import bootstrap, collectives, data_parallel, torch_group, waiting
from mpilab.rank.agent import Agent
from rank_scenarios import run_scenario

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ backend choice
def _on(device: str) -> types.SimpleNamespace:
    """Something with a tensor's .device (a CUDA tensor cannot be made on this machine)."""
    return types.SimpleNamespace(device=torch.device(device))


NCCL = {"cuda": "nccl"}
GLOO = {"cpu": "gloo", "cuda": "gloo"}


def test_auto_sends_gpu_tensors_over_nccl_and_cpu_tensors_over_mpi(monkeypatch):
    assert torch_group.auto_transport("cuda", NCCL) == "torch"
    assert torch_group.auto_transport("cuda", {"cpu": "gloo", "cuda": "nccl"}) == "torch"
    assert torch_group.auto_transport("cpu", {"cpu": "gloo", "cuda": "nccl"}) == "mpi"
    # ranks sharing GPUs over gloo: GPU tensors staged through MPI, mpilab's fast path
    assert torch_group.auto_transport("cuda", GLOO) == "mpi"
    assert torch_group.auto_transport("cuda", {}) == "mpi"  # no group at all

    monkeypatch.setattr(torch_group, "group_backends", lambda: NCCL)
    assert torch_group.resolve_transport("auto", _on("cuda:1")) == "torch"
    assert torch_group.resolve_transport("auto", _on("cpu")) == "mpi"
    assert torch_group.resolve_transport("mpi", _on("cuda:0")) == "mpi"  # staged, as asked
    assert torch_group.resolve_transport("auto", None) == "mpi"  # a barrier
    monkeypatch.setattr(torch_group, "group_backends", lambda: GLOO)
    assert torch_group.resolve_transport("auto", _on("cuda:0")) == "mpi"
    with pytest.raises(ValueError, match="'nccl' is not one of auto, mpi, torch"):
        torch_group.resolve_transport("nccl", _on("cpu"))


def test_group_backends_read_as_torch_maps_them():
    assert torch_group.device_backends("nccl") == NCCL
    assert torch_group.device_backends("gloo") == GLOO
    assert torch_group.device_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo",
                                                                 "cuda": "nccl"}


def test_fusion_plans_by_the_same_rule():
    from mpilab.rank.fusion import _plan

    cpu = torch.zeros(3, dtype=torch.bfloat16)
    assert _plan(cpu, "auto", NCCL) == ("mpi", torch.device("cpu"), torch.float32)
    assert _plan(cpu, "torch", {}) == ("torch", torch.device("cpu"), torch.bfloat16)


def test_data_parallel_picks_ddp_over_nccl_for_gpu_models_only():
    choose = data_parallel.choose_path
    assert choose("auto", {"cuda"}, NCCL) == "torch"
    assert choose("auto", {"cpu"}, {"cpu": "gloo"}) == "mpi"
    assert choose("auto", {"cuda"}, GLOO) == "mpi"  # GPUs shared over gloo
    assert choose("auto", {"cuda", "cpu"}, NCCL) == "mpi"  # DDP takes one device
    assert choose("auto", set(), NCCL) == "mpi"  # no parameters
    assert choose("mpi", {"cuda"}, NCCL) == "mpi"  # staged through pinned memory
    assert choose("torch", {"cpu"}, {"cpu": "gloo"}) == "torch"


def test_auto_is_the_default_everywhere():
    import inspect

    from mpilab.rank import compression

    def default(fn, name="backend"):
        return inspect.signature(fn).parameters[name].default

    assert data_parallel.DataParallelConfig().backend == "auto"
    assert default(data_parallel.DataParallel.__init__) == "auto"
    for fn in (collectives.allreduce, collectives.broadcast, collectives.allgather,
               collectives.barrier, compression.make_compressor,
               compression.PowerSGDCompressor.__init__, compression.TopKCompressor.__init__):
        assert default(fn) == "auto", fn.__qualname__
    with pytest.raises(ValueError, match="'nccl2' is not one of auto, mpi, torch"):
        data_parallel.DataParallelConfig(backend="nccl2")


# ------------------------------------------------------------- recovery's decision
def test_nccl_groups_are_always_made_again_gloo_ones_when_abandoned():
    assert torch_group.needs_new_group(NCCL, abandoned_anywhere=False)
    assert torch_group.needs_new_group({"cpu": "gloo", "cuda": "nccl"}, False)
    assert not torch_group.needs_new_group(GLOO, abandoned_anywhere=False)
    assert torch_group.needs_new_group(GLOO, abandoned_anywhere=True)
    assert not torch_group.needs_new_group({}, abandoned_anywhere=True)  # no group


# ------------------------------------------------------------------------ placement
def test_one_rank_per_gpu_by_node_local_rank():
    assert [bootstrap.gpu_for_rank(r, [0, 1, 2, 3]) for r in range(4)] == [0, 1, 2, 3]
    assert bootstrap.gpu_for_rank(1, [2, 5]) == 5  # --gpus 2,5
    assert bootstrap.gpu_for_rank(3, [0]) == 0  # Slurm bound this task to one GPU
    assert bootstrap.gpu_for_rank(0, []) is None  # CPU


def test_more_ranks_than_gpus_is_one_line_under_nccl():
    uuids = [f"GPU-{g}" for g in (0, 1, 2, 3, 0, 1, 2, 3)]  # 8 ranks wrapped onto 4
    line = bootstrap.placement_error(uuids, "nccl", host="node7")
    assert line is not None and "\n" not in line
    assert "8 ranks on node7 but 4 GPUs" in line
    assert "ranks 0 and 4 would share one" in line
    assert "NCCL cannot put two ranks on one GPU" in line
    assert "at most 4 ranks per node" in line and "--backend gloo" in line
    mixed = bootstrap.placement_error(["GPU-0", "GPU-0"], "cpu:gloo,cuda:nccl")
    assert mixed is not None and "2 ranks on this node but 1 GPU for them" in mixed


def test_placement_that_works_says_nothing():
    shared = [f"GPU-{g}" for g in (0, 1, 0, 1)]
    assert bootstrap.placement_error(shared, "gloo") is None  # sharing asked for
    # Slurm's per-task binding: every rank's GPU is its index 0, yet all differ
    assert bootstrap.placement_error(["GPU-a", "GPU-b", "GPU-c"], "nccl") is None
    assert bootstrap.placement_error([None, None], "gloo") is None  # CPU ranks
    assert bootstrap.placement_error(["GPU-0"], "nccl") is None


# ------------------------------------------------- waits on another thread, in-process
@pytest.fixture
def fresh_agent(monkeypatch):
    from mpilab.rank import agent as agent_mod

    agent = Agent(rank=0, world_size=2, address=None)
    monkeypatch.setattr(agent_mod, "_agent", agent)
    return agent


def test_a_wait_for_the_main_thread_is_numbered_on_any_thread(fresh_agent):
    seen: dict = {}

    def device_thread():
        with waiting.collective("span-only"):  # a thread of its own: not numbered
            seen["own"] = fresh_agent.state.seq
        with waiting.for_main_thread(), waiting.collective("dp_allreduce", 64, "buckets=1"):
            hb = fresh_agent.heartbeat()
            seen["for_main"] = (hb["phase"], hb["op"], hb["seq"], hb["op_nbytes"])
            seen["acting"] = waiting.acting_for_main()
        seen["after"] = (fresh_agent.state.phase, waiting.acting_for_main())

    thread = threading.Thread(target=device_thread)
    thread.start()
    thread.join()
    assert seen["own"] == 0
    assert seen["for_main"] == ("collective", "dp_allreduce", 1, 64) and seen["acting"]
    assert seen["after"] == ("idle", False)
    assert list(fresh_agent.state.recent) == [(1, "dp_allreduce", 64)]
    with waiting.collective("allreduce"):  # the main thread: the agent's own numbering
        assert fresh_agent.state.seq == 2


def test_a_batch_process_spans_reach_a_capture_set_after_the_context(fresh_agent):
    """Without a notebook a collective's span goes only to a capture (an `emit` set on
    the agent), also one set after a kept context (a tensor's plan) was made."""
    kept = waiting.kept_collective("allreduce", 4096, (1024,))
    assert kept.run(lambda x: x + 1, 1) == 2  # no capture: numbered, the span dropped
    assert fresh_agent.state.seq == 1
    records = []
    fresh_agent.emit = lambda kind, **f: records.append((kind, f))
    kept.run(int)
    assert [(kind, f["name"], f["nbytes"], f["seq"]) for kind, f in records] == \
        [("span", "allreduce", 4096, 2)]
    del fresh_agent.emit
    kept.run(int)
    assert len(records) == 1 and fresh_agent.state.seq == 3


def _engine_run_backward(wait_for):
    """Named as torch's engine entry: the main thread sits in C++ below it."""
    wait_for()


def test_the_main_thread_in_backward_is_recognised():
    seen = []
    ready = threading.Event()
    fut: torch.futures.Future = torch.futures.Future()

    def look():
        ready.wait()
        time.sleep(0.05)
        seen.append(waiting.main_thread_in_backward())
        fut.set_result(None)

    assert not waiting.main_thread_in_backward()
    threading.Thread(target=look).start()
    ready.set()
    _engine_run_backward(fut.wait)
    assert seen == [True]


def test_sigint_releases_a_wait_while_the_main_thread_is_in_backward(monkeypatch):
    """The C-level handler writes to the wakeup fd at once; the Python handler only
    runs once the main thread leaves C++ — after the wait was released."""
    monkeypatch.setattr(waiting, "_recover_hooks", [])
    watch = waiting._InterruptWatch()
    monkeypatch.setattr(waiting, "_watch", watch)
    previous_fd = signal.set_wakeup_fd(-1)
    handled: list[tuple[float, bool]] = []
    old_handler = signal.signal(
        signal.SIGINT, lambda *_: handled.append((time.monotonic(), waiting.aborted())))
    outcome: dict = {}
    fut: torch.futures.Future = torch.futures.Future()

    def device_thread():
        try:
            waiting.poll(lambda: False)  # a peer that never comes
        except waiting.CollectiveAborted as e:
            outcome["released"] = (time.monotonic(), str(e))
        fut.set_result(None)

    try:
        assert waiting.watch_interrupts() and waiting.watch_interrupts()  # idempotent
        threading.Thread(target=device_thread).start()
        threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT)).start()
        sent = time.monotonic() + 0.2
        _engine_run_backward(lambda: fut.wait())  # C++: no Python handler runs here
        time.sleep(0.05)  # the pending Python handler runs now
    finally:
        signal.signal(signal.SIGINT, old_handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(watch.write_fd)  # the watch thread reads EOF and ends
        waiting.recover()
    released_at, reason = outcome["released"]
    assert reason == waiting.INTERRUPTED and watch.interrupts == 1
    assert released_at - sent < 0.5
    assert handled and handled[0][0] >= released_at and handled[0][1], handled


# --------------------------------------------------------- real ranks, autograd moved
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_waits_of_autograd_on_another_thread_are_numbered_and_released(backend, tmp_path):
    got = run_scenario("off_main", timeout=180,
                       args={"backend": backend,
                             "signal_file": str(tmp_path / "signal-sent")})[0]
    r0 = got[0]
    assert r0["backend"] == backend
    assert r0["threads"] == ["autograd-device"]  # the waits ran on the moved thread
    op = "dp_allreduce" if backend == "mpi" else "ddp_allreduce"
    # numbered as the main thread's, once per step, shown with the main thread's line
    # (here the stand-in's wait: it is the innermost frame outside torch and mpilab)
    assert r0["seq_per_step"] == got[1]["seq_per_step"] >= 1
    assert r0["beats"] and all(b[0] == op and b[1] > 0 for b in r0["beats"]), r0["beats"]
    assert all(b[2].startswith("off_main.py line ") for b in r0["beats"]), r0["beats"]
    # the SIGINT released the wait while the main thread sat in C++ backward; the
    # Python handler (the engine's) ran only afterwards
    assert r0["outcome"] in ("CollectiveAborted", "KeyboardInterrupt")
    assert r0["release_s"] < 1.0, r0["release_s"]
    assert r0["handled"] == {"aborted_before": True}
    assert r0["watch_interrupts"] == 1
    # recovery: training goes on with the ranks in step
    assert r0["same_params"] and got[1]["same_params"]
    if backend == "torch":  # rank 0 gave up a gloo work: a new group, DDP made again
        assert r0["generation"] == got[1]["generation"] == 1
        assert r0["new_group"] and got[1]["new_group"]
    else:
        assert r0["generation"] == 0 and not r0["new_group"]


# ------------------------------------------------------------ the recovery sequence
def test_recovery_aborts_and_remakes_the_torch_group_on_every_rank():
    got = run_scenario("renew_group", timeout=180)[0]
    for out in got:
        assert out["kept_when_clean"]
        assert out["renewed"] and out["generation"] == 1
        assert out["sum_after"] == 3.0
        assert out["timeout_after"] == out["timeout_before"]  # the collective timeout kept
        assert out["adopted"] and out["kept_by_destroy"]
        assert out["nccl_rule_renewed"] and out["generation_nccl"] == 2
        assert "cannot abort its gloo group" in out["cannot"]
        assert "the ranks must be restarted" in out["cannot"]
    assert got[0]["abandoned"] == "peer failed"


# ---------------------------------------------------------------- the GPU check
def test_gpu_check_runs_here_and_says_what_it_skipped():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for check in ("bootstrap", "nccl allreduce", "DataParallel", "compression",
                  "rank failure", "checkpoint"):
        assert check in out, out
    assert "skipped" in out and "no GPU" in out
    assert took < 120, took

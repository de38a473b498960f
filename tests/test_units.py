"""Pure logic: rank selection, output relay, configs, device choice, auto mode, tracebacks."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time

import pytest
import torch
from mpilab.cell_window import CellWindow
from mpilab.cluster import ClusterConfig, ClusterError, check_one_world, find_mpiexec
from mpilab.metrics_store import MetricsStore
from mpilab.rank.agent import SEND_INTERVAL_S, log, next_send_time
from mpilab.rank.bootstrap import BootstrapError, choose_backend, parse_gpus
from mpilab.rank.progress import progress
from mpilab.relay import (
    IN_PROGRESS_SHOWN,
    LinesInProgress,
    OutputRelay,
    StreamCursor,
    overwritten,
)
from mpilab.selection import parse_ranks
from mpilab.session import _run_on_ranks
from mpilab.watchdog import Watchdog
from mpilab.wire import format_ranks


@pytest.mark.parametrize("spec, ranks", [
    ("all", [0, 1, 2, 3]), (None, [0, 1, 2, 3]), ("0", [0]), ("0,2", [0, 2]),
    ("1-3", [1, 2, 3]), ("0, 2-3", [0, 2, 3]), ("3,1", [1, 3]),
])
def test_parse_ranks(spec, ranks):
    assert parse_ranks(spec, 4) == ranks


@pytest.mark.parametrize("spec, message", [
    ("4", "rank 4 does not exist: the cluster has ranks 0-3"),
    ("0-5", "ranks 4-5 do not exist: the cluster has ranks 0-3"),
    # said at once, without making the range (it took the kernel's memory)
    ("1,0-99999999999", "ranks 4-99999999999 do not exist: the cluster has ranks 0-3"),
    ("x", "malformed"), ("1-", "malformed"), ("-1", "malformed"), ("3-1", "backwards"),
])
def test_parse_ranks_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_ranks(spec, 4)


def test_format_ranks():
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


class Sink:
    def __init__(self):
        self.out: list[tuple[str, str]] = []

    def __call__(self, stream, text):
        self.out.append((stream, text))

    @property
    def text(self):
        return "".join(t for _, t in self.out)


def test_relay_groups_identical_lines_and_keeps_order():
    sink = Sink()
    relay = OutputRelay([0, 1], sink, hold=0.3)
    relay.feed(0, "stdout", "a\nb\n", 0.0)
    relay.feed(1, "stdout", "a\n", 0.0)
    relay.flush(0.1)
    assert sink.text == "[ranks 0-1] a\n"  # b waits for rank 1
    relay.feed(1, "stdout", "c\n", 0.2)
    relay.flush(0.5)
    assert sink.text == "[ranks 0-1] a\n[rank 0] b\n[rank 1] c\n"


def test_relay_keeps_a_ranks_multi_line_value_together():
    """The rows of a value printed on each rank (a tensor) arrive in one piece: each
    rank's rows stay together, where they were interleaved row by row; a line every rank
    has is still shown once; lines that came in separate pieces keep their time order."""
    sink = Sink()
    relay = OutputRelay([0, 1], sink, hold=0.3)
    relay.feed(0, "stdout", "t([[1,\n   2]])\nnext\n", 0.0)
    relay.feed(1, "stdout", "t([[3,\n   4]])\nnext\n", 0.0)
    relay.flush(0.5)
    assert sink.text == ("[rank 0] t([[1,\n[rank 0]    2]])\n[rank 1] t([[3,\n[rank 1]    4]])\n"
                         "[ranks 0-1] next\n")
    sink.out.clear()
    for t, step in ((0.6, 0), (0.7, 1)):
        relay.feed(0, "stdout", f"step {step} loss a\n", t)
        relay.feed(1, "stdout", f"step {step} loss b\n", t)
    relay.flush(1.5)
    assert sink.text == ("[rank 0] step 0 loss a\n[rank 1] step 0 loss b\n"
                         "[rank 0] step 1 loss a\n[rank 1] step 1 loss b\n")


def test_relay_partial_lines_and_final_flush():
    sink = Sink()
    relay = OutputRelay([0, 1], sink)
    relay.feed(0, "stdout", "par", 0.0)
    relay.feed(0, "stdout", "tial\nrest", 0.0)
    relay.feed(1, "stderr", "oops\n", 0.0)
    relay.flush(1.0, final=True)
    assert ("stdout", "[rank 0] partial\n[rank 0] rest\n") in sink.out
    assert ("stderr", "[rank 1] oops\n") in sink.out


def test_relay_single_rank_has_no_prefix():
    sink = Sink()
    relay = OutputRelay([3], sink)
    relay.feed(3, "stdout", "x\n", 0.0)
    relay.flush(0.0)
    assert sink.text == "x\n"


def test_relay_cap_cuts_and_says_how_much():
    sink = Sink()
    relay = OutputRelay([0], sink, cap=10)
    relay.feed(0, "stdout", "0123456789abcdef\n" * 3, 0.0)
    relay.flush(0.0, final=True)
    assert len(sink.text) == 10
    assert "41 more characters were dropped" in relay.cap_note()


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "-n must be a positive"), ({"launcher": "pbs"}, "--launcher 'pbs'"),
    ({"backend": "mpi"}, "--backend 'mpi'"), ({"hostfile": "/no/such"}, "no such file"),
    ({"timeout": 0}, "--timeout must be positive"),
    ({"launcher": "ssh"}, "use --launcher mpi --hostfile FILE"),
    ({"launcher": "slurm", "hostfile": "hosts"}, "--hostfile goes with --launcher mpi"),
])
def test_cluster_config_validation(kwargs, message):
    with pytest.raises(ClusterError, match=message):
        ClusterConfig(**kwargs).validate()


def test_engines_must_be_one_mpi_job():
    one_job = [{"rank": r, "world_size": 3} for r in (2, 0, 1)]
    check_one_world(one_job, 3)
    # started one by one (ssh, a misconfigured srun): each is rank 0 of a world of one
    apart = [{"rank": 0, "world_size": 1} for _ in range(3)]
    with pytest.raises(ClusterError, match=r"not one MPI job of 3 ranks \(they are ranks "
                                           r"\[0, 0, 0\] of worlds of \[1\]\)"):
        check_one_world(apart, 3)


def test_find_mpiexec_order(tmp_path, monkeypatch):
    exe = tmp_path / "my-mpiexec"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert find_mpiexec(str(exe)) == str(exe)
    monkeypatch.setenv("MPILAB_MPIEXEC", str(exe))
    assert find_mpiexec() == str(exe)
    monkeypatch.setenv("MPILAB_MPIEXEC", str(tmp_path / "missing"))
    with pytest.raises(ClusterError, match=r"\$MPILAB_MPIEXEC .*not an executable"):
        find_mpiexec()
    monkeypatch.delenv("MPILAB_MPIEXEC")
    assert find_mpiexec().endswith("/mpiexec")


def test_parse_gpus_and_backend():
    assert parse_gpus("auto", 4) == [0, 1, 2, 3]
    assert parse_gpus("none", 4) == []
    assert parse_gpus("1,3", 4) == [1, 3]
    assert parse_gpus("auto", 0) == []
    with pytest.raises(BootstrapError, match="names GPU 5 but this node has 4"):
        parse_gpus("5", 4)
    with pytest.raises(BootstrapError, match="is not auto, none or a list"):
        parse_gpus("first", 4)
    with pytest.raises(BootstrapError, match="is not auto, none or a list"):
        parse_gpus("first", 0)  # a typo is one even where there are no GPUs
    with pytest.raises(BootstrapError, match="names GPU 0 but this node has none"):
        parse_gpus("0", 0)  # asked for by number: not silently the CPU
    assert choose_backend("auto", "cuda") == "nccl"
    assert choose_backend("auto", "cpu") == "gloo"
    with pytest.raises(BootstrapError, match="nccl needs GPUs"):
        choose_backend("nccl", "cpu")


def test_auto_mode_transformer_leaves_control_cells_alone():
    assert _run_on_ranks(["x = 1\n"]) == ["%%ranks\n", "x = 1\n"]
    for control in ("%mpilab auto off\n", "%%ranks 0\n", "%load_ext mpilab\n"):
        assert _run_on_ranks([control]) == [control]
    assert _run_on_ranks(["\n"]) == ["\n"]


def test_ranks_send_records_at_the_same_wall_clock_ticks():
    """Every rank's batch of a round leaves at the same moment (one redraw for all)."""
    assert SEND_INTERVAL_S == 0.25  # 4 rounds a second: the dashboard's latency target
    assert next_send_time(1000.1) == 1000.25
    assert next_send_time(1000.25) == 1000.5  # strictly after now
    ticks = {next_send_time(1000.0 + offset) for offset in (0.001, 0.1, 0.249)}
    assert ticks == {1000.25}


def test_recovery_hooks_of_replaced_objects_drop_out(monkeypatch):
    """A rewrapped model's old gradient sync must not be reset (or kept alive) forever."""
    import gc

    from mpilab.rank import waiting

    monkeypatch.setattr(waiting, "_recover_hooks", [])  # only this test's hooks run
    calls = []

    class Sync:
        def reset(self):
            calls.append(self)

    kept, replaced = Sync(), Sync()
    for sync in (kept, replaced, kept):  # the same hook twice is registered once
        waiting.on_recover(sync.reset)
    del replaced
    gc.collect()
    waiting.abort("test")
    waiting.recover()
    assert calls == [kept] and not waiting.aborted()
    assert len(waiting._recover_hooks) == 1


def test_a_wait_given_up_cancels_its_receive_and_keeps_its_send_till_done(monkeypatch):
    """A stop or an abort while a rank drives its messages: MPI may still move them
    whenever the rank next asks it anything. The receive is cancelled, so a message
    that comes later never lands in the buffer; the send, which MPI cannot cancel once
    begun, keeps its buffer alive until it completes (freed, it would be read or
    written after the memory went back), and is let go at the recovery after it does.
    Real MPI on one process (a dup of MPI.COMM_SELF)."""
    import gc
    import weakref

    import numpy as np
    from mpi4py import MPI
    from mpilab.rank import waiting

    monkeypatch.setattr(waiting, "_recover_hooks", [])
    monkeypatch.setattr(waiting, "_abandoned", [])
    comm = MPI.COMM_SELF.Dup()
    try:
        received = np.zeros(1 << 20, np.uint8)
        outgoing = np.ones(4 << 20, np.uint8)  # past MPICH's eager size: pending till matched
        sent = weakref.ref(outgoing)
        receive = comm.Irecv(received, 0, 1)
        waiting.abort("test")
        with pytest.raises(waiting.CollectiveAborted, match="test"):
            waiting.drive_all([receive, comm.Isend(outgoing, 0, 2)], [receive])
        del outgoing
        gc.collect()
        assert sent() is not None and len(waiting._abandoned) == 1
        late = comm.Isend(np.full(1 << 20, 7, np.uint8), 0, 1)  # what the receive awaited
        assert not late.Test() and not received.any()
        comm.Recv(np.empty(4 << 20, np.uint8), 0, 2)  # the send's peer arrives
        late.Cancel()
        late.Wait()
        waiting.recover()
        gc.collect()
        assert sent() is None and waiting._abandoned == [] and not received.any()
    finally:
        waiting.recover()
        comm.Free()


class _QuietCluster:
    """What Watchdog reads of a cluster: heartbeats in a store, no local processes."""

    def __init__(self):
        self.store = MetricsStore(world_size=2)
        self.ranks = []

    @property
    def world_size(self) -> int:
        return self.store.world_size

    def local_processes(self) -> dict:
        return {}

    def start_cell(self, number: int, t: float = 0.0) -> CellWindow:
        """Both ranks begin their cell `number`: the window the runner gives the watchdog."""
        msg_ids = {r: f"request-{number}-{r}" for r in range(2)}
        for r, msg_id in msg_ids.items():
            self.store.add({"k": "event", "r": r, "t": t, "what": "cell-start",
                            "cell": number, "msg": msg_id})
        return CellWindow(since=t, msg_ids=msg_ids)

    def beat(self, rank: int, t: float, phase: str, where: str = "", cell: int = 1,
             op: str = "", op_age: float = 0.0) -> None:
        self.store.add({"k": "hb", "r": rank, "t": t, "pid": 1, "host": "h", "phase": phase,
                        "op": op, "seq": 7, "op_age": op_age, "rss": 0, "step": 0,
                        "cell": cell, "where": where})


def test_a_collective_of_an_earlier_cell_is_no_hang_of_this_one(monkeypatch):
    cluster = _QuietCluster()
    now = 1000.0
    monkeypatch.setattr("time.time", lambda: now)
    # released from allreduce #7 after 3.1 s in cell 1; cell 2 starts before its first beat
    cluster.beat(0, now - 0.1, "collective", cell=1, op="allreduce", op_age=3.1)
    cluster.beat(1, now - 0.1, "idle", cell=1)
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=3.0, cell=cluster.start_cell(2, now))
    assert watchdog.check(now, {}) is None
    cluster.beat(0, now, "collective", cell=2, op="allreduce", op_age=3.2)  # this cell's
    assert watchdog.check(now, {}).lines[0] == "hang: rank 0 was waiting in allreduce #7 " \
        "for 3.2 s"


def test_a_ranks_clock_is_read_from_its_quickest_heartbeat_and_followed_when_stepped():
    """Arrival minus making is the clocks' offset plus the way: the smallest is the
    offset. A clock stepped (NTP) is followed within two windows."""
    from mpilab.rank_clocks import WINDOW_S, RankClocks

    clocks, now = RankClocks(), 1000.0
    for delay in (0.2, 0.004, 0.05, 0.001, 0.3):  # rank 1's clock is 90 s behind
        now += 0.5
        made = clocks.heard(1, now - 90 - delay, now)
    assert made == pytest.approx(now - 0.3 + 0.001)  # the last, on the notebook's clock
    assert clocks.offset(1) == pytest.approx(90.001)
    assert clocks.to_notebook(1, now - 90.001) == pytest.approx(now)
    assert clocks.offset(0) == 0.0  # no heartbeat yet: its times as they are
    for _ in range(int(2 * WINDOW_S / 0.5) + 2):  # stepped forward to 2 s behind
        now += 0.5
        clocks.heard(1, now - 2.002, now)
    assert clocks.offset(1) == pytest.approx(2.002)


def test_a_rank_whose_clock_is_behind_is_no_hang_until_it_has_waited(monkeypatch):
    """A rank on a host whose clock is 90 s behind the notebook's: its heartbeat's age in
    a collective is what it waited, not what the clocks differ by."""
    cluster = _QuietCluster()
    now = 1000.0
    monkeypatch.setattr("time.time", lambda: now)
    cell = cluster.start_cell(1, now - 90)
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=3.0, cell=cell)
    cluster.beat(0, now - 90, "collective", op="allreduce", op_age=1.0)
    cluster.beat(1, now, "running")
    assert watchdog.check(now, {}) is None
    now += 2.5
    assert watchdog.check(now, {}).lines[0] == "hang: rank 0 was waiting in allreduce #7 " \
        "for 3.5 s"


def test_a_cells_start_and_a_trace_are_read_on_the_notebooks_clock(monkeypatch, tmp_path):
    """A cell's --timeout counts from its first rank's start, and a trace puts every
    rank's spans on one clock, where rank 1's host keeps a clock 90 s behind."""
    cluster = _QuietCluster()
    now = 1000.0
    monkeypatch.setattr("time.time", lambda: now)
    cluster.beat(0, now, "running")
    cluster.beat(1, now - 90, "running")
    store = cluster.store
    msg_ids = {0: "request-0", 1: "request-1"}
    for r, began in ((0, now - 2), (1, now - 92.5)):  # rank 1 began half a second sooner
        store.add({"k": "event", "r": r, "t": began, "what": "cell-start", "cell": 1,
                   "msg": msg_ids[r]})
    assert CellWindow(since=now - 3, msg_ids=msg_ids).started(store) == pytest.approx(now - 2.5)
    for r, ended in ((0, now - 1), (1, now - 91)):  # one allreduce, ended together
        store.add({"k": "span", "r": r, "t": ended, "name": "allreduce", "cat": "comm",
                   "ts": ended - 0.5, "dur": 0.5})
    spans = [e for e in store.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in spans] == pytest.approx([(now - 1.5) * 1e6] * 2)
    assert store.add({"k": "step", "r": 1, "t": now - 91, "step": 1, "dur": 0.1,
                      "compute": 0.08, "comm": 0.02, "nbytes": 64, "samples": 8})
    saved = json.loads(store.save(tmp_path / "m.json").read_text())["records"]
    assert saved[0]["time"] == pytest.approx(now - 1)


def test_a_noblock_cell_ahead_in_the_queue_is_not_watched_as_this_one(monkeypatch):
    """Run right after a --noblock cell, before that cell's first heartbeat: the heartbeats
    that come next are the --noblock cell's, not this one's, until the ranks begin it."""
    cluster = _QuietCluster()
    now = 1000.0
    monkeypatch.setattr("time.time", lambda: now)
    cluster.beat(0, now - 1, "idle", cell=1)
    cluster.beat(1, now - 1, "idle", cell=1)
    cluster.start_cell(2, now - 0.2)  # the --noblock cell
    queued = CellWindow(since=now, msg_ids={0: "queued-0", 1: "queued-1"})
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=3.0, cell=queued)
    cluster.beat(0, now, "collective", cell=2, op="allreduce", op_age=40.0)
    cluster.beat(1, now, "collective", cell=2, op="broadcast", op_age=40.0)
    assert watchdog.check(now, {}) is None


def test_ranks_silenced_together_are_named_together():
    """A cut link silences every rank behind it within a heartbeat or two of each other
    (they beat out of step): the verdict names all of them, not the first one past 5 s."""
    cluster = _QuietCluster()
    cluster.store = MetricsStore(world_size=3)
    watchdog = Watchdog(cluster, [0, 1, 2], hang_timeout=3.0, cell=cluster.start_cell(1))
    now = time.monotonic()
    cluster.store.last_seen.update({0: now - 0.2, 1: now - 4.6, 2: now - 3.0})
    assert watchdog.check(time.time(), {}) is None  # nobody silent for 5 s yet
    cluster.store.last_seen.update({1: now - 5.1, 2: now - 4.3})
    verdict = watchdog.check(time.time() + 1, {})
    assert verdict.kind == "dead" and sorted(verdict.dead) == [1, 2], verdict
    assert verdict.lines == ["rank 1 (pid ? on ?) cannot be reached: no heartbeat for 5 s",
                             "rank 2 (pid ? on ?) cannot be reached: no heartbeat for 4 s"]


def test_direct_call_hang_needs_a_finished_peer_and_a_line_that_stays():
    cluster = _QuietCluster()
    cell = cluster.start_cell(1)
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=3.0, cell=cell)
    allreduce = "cell line 5: comm.Allreduce(MPI.IN_PLACE, x)"
    cluster.beat(0, 0.0, "running", allreduce)
    cluster.beat(1, 0.0, "running", "cell line 2: y = model(x)")
    assert watchdog.check(10.0, {}) is None  # nobody finished: it may be waiting for them
    cluster.beat(1, 10.0, "idle")
    assert watchdog.check(10.0, {1: "ok"}) is None  # the clock starts now
    cluster.beat(0, 12.0, "running", "cell line 4: z = compute(x)")  # it moved on
    assert watchdog.check(12.0, {1: "ok"}) is None
    cluster.beat(0, 13.0, "running", allreduce)
    assert watchdog.check(13.0, {1: "ok"}) is None  # on it again: the clock starts again
    assert watchdog.check(15.9, {1: "ok"}) is None
    verdict = watchdog.check(16.1, {1: "ok"})
    assert verdict.kind == "hang" and verdict.release == [0]
    assert verdict.lines == [f"hang: rank 0 has been at {allreduce} for 3.1 s, and rank 1 "
                             "finished the cell without joining it"]
    # a long computation on one rank is no hang, however long
    cluster.beat(0, 20.0, "running", "cell line 3: evaluate(model)")
    assert Watchdog(cluster, [0, 1], 3.0, cell).check(100.0, {1: "ok"}) is None



def test_a_peer_at_a_direct_collective_is_released_when_a_rank_fails():
    """A rank that raised leaves its peers waiting: one in a collective called directly
    (dist.all_reduce, comm.Allreduce, DDP's backward) is released at once; one still
    computing gets PEER_FAILED_GRACE_S to reach a collective or finish the cell."""
    from mpilab.watchdog import PEER_FAILED_GRACE_S

    cluster = _QuietCluster()
    cell = cluster.start_cell(1)
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=30.0, cell=cell)
    cluster.beat(0, 10.0, "running", "cell line 2: y = model(x)")
    assert watchdog.check(10.0, {1: "error"}) is None
    verdict = watchdog.check(10.0 + PEER_FAILED_GRACE_S + 0.1, {1: "error"})
    assert verdict.kind == "peer-failed" and verdict.release == [0]
    assert verdict.lines == ["rank 0 was at cell line 2: y = model(x) when rank 1 failed"]
    assert verdict.blocking == []  # computing: the interrupt reaches it

    watchdog = Watchdog(cluster, [0, 1], hang_timeout=30.0, cell=cell)
    cluster.beat(0, 20.0, "running", "cell line 4: dist.all_reduce(t)")
    verdict = watchdog.check(20.0, {1: "error"})
    assert verdict.kind == "peer-failed" and verdict.release == [0]
    assert verdict.lines == ["rank 0 was at cell line 4: dist.all_reduce(t) when rank 1 failed"]
    assert verdict.blocking == [0]  # no interrupt reaches a blocking gloo or MPI call
    # the same line in a heartbeat of the cell before says nothing of this one
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=30.0, cell=cluster.start_cell(2, 30.0))
    assert watchdog.check(30.0, {1: "error"}) is None


def test_a_direct_call_line_counts_on_a_heartbeat_sent_since_the_failure(monkeypatch):
    """A heartbeat that reached the notebook before a peer's failure may name a line the
    rank has since left (the init_process_group it waited in, while it now runs its
    backward): the rank is released on its next heartbeat, at the line it is at."""
    cluster = _QuietCluster()
    cell = cluster.start_cell(1)
    clock = [100.0]
    monkeypatch.setattr("time.time", lambda: clock[0])
    cluster.beat(0, 100.0, "running", "train.py line 51: dist.init_process_group(backend)")
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=30.0, cell=cell)
    clock[0] = 100.4
    assert watchdog.check(100.4, {1: "error"}) is None  # rank 1 failed; rank 0 moved on
    clock[0] = 100.6
    cluster.beat(0, 100.6, "running", "train.py line 79: loss.backward()")
    verdict = watchdog.check(100.6, {1: "error"})
    assert verdict.kind == "peer-failed" and verdict.release == [0]
    assert verdict.lines == ["rank 0 was at train.py line 79: loss.backward() when rank 1 failed"]
    assert verdict.blocking == []  # DDP's backward answers the interrupt
    # so with a collective of mpilab's: the one a heartbeat before the failure showed
    # may have ended since
    clock[0] = 101.0
    cluster.beat(0, 101.0, "collective", "train.py line 80: allreduce(grads)", op="allreduce")
    watchdog = Watchdog(cluster, [0, 1], hang_timeout=30.0, cell=cell)
    clock[0] = 101.2
    assert watchdog.check(101.2, {1: "error"}) is None
    clock[0] = 101.5
    cluster.beat(0, 101.5, "collective", "train.py line 80: allreduce(grads)", op="allreduce")
    assert watchdog.check(101.5, {1: "error"}).kind == "peer-failed"


# -- placement: Slurm settings, allocations, the launcher's telling line ---------------------
def test_slurm_settings_make_the_batch_script():
    from mpilab.placement import SlurmSettings, batch_script

    settings = SlurmSettings(partition="gpu", time="1:00:00", account="proj", nodes="2",
                             tasks_per_node=4, gpus_per_node="a100:4",
                             sbatch_options=["--qos=high", "--constraint={fast}"])
    script = batch_script(settings, "/opt/venv/bin/mpiexec")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --account=proj",
                 "#SBATCH --nodes=2", "#SBATCH --tasks-per-node=4",
                 "#SBATCH --gpus-per-node=a100:4", "#SBATCH --qos=high",
                 "#SBATCH --constraint={{fast}}", "#SBATCH --ntasks={n}",
                 "/opt/venv/bin/mpiexec -launcher slurm -launcher-exec srun -rmk slurm "
                 "-n {n} {program_and_args}", 'exit "$status"'):
        assert line in script.splitlines(), (line, script)
    # where mpiexec fails, the script asks the nodes (braces kept from ipyparallel)
    probed = batch_script(settings, "/opt/venv/bin/mpiexec", probe="srun echo {x}")
    assert '[ "$status" -eq 0 ] || srun echo {{x}}' in probed.splitlines()
    assert "srun echo" not in script
    assert settings.given() == ["--partition", "--time", "--account", "--nodes",
                                "--tasks-per-node", "--gpus-per-node", "--sbatch-option"]


def test_slurm_settings_need_the_slurm_launcher():
    from mpilab.cluster import ClusterConfig, ClusterError
    from mpilab.placement import SlurmSettings

    with pytest.raises(ClusterError, match="--partition is a Slurm setting: add --launcher slurm"):
        ClusterConfig(slurm=SlurmSettings(partition="gpu")).validate()
    with pytest.raises(ClusterError, match="give it as sbatch spells it"):
        ClusterConfig(launcher="slurm", slurm=SlurmSettings(sbatch_options=["qos=high"])).validate()
    for nodes in ("2", "2-4", "16"):
        ClusterConfig(launcher="slurm", slurm=SlurmSettings(nodes=nodes)).validate()
    for nodes in ("x", "0", "2-", "-2"):
        with pytest.raises(ClusterError, match=rf"^--nodes '{nodes}': give a number of nodes, "
                           r"or a range as sbatch takes it \(2, 2-4\)$"):
            ClusterConfig(launcher="slurm", slurm=SlurmSettings(nodes=nodes)).validate()


def test_a_slurm_command_that_fails_is_one_line_naming_it_once(tmp_path, monkeypatch):
    """Without a configured Slurm, sinfo says so in its own words; the line says what
    --launcher slurm needs."""
    from mpilab.placement import ClusterError, slurm_query

    fake = tmp_path / "sinfo"
    fake.write_text("#!/bin/sh\necho 'sinfo: fatal: Could not establish a configuration "
                    "source' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(ClusterError) as failed:
        slurm_query("sinfo", "-h")
    assert str(failed.value) == (
        "sinfo: fatal: Could not establish a configuration source (--launcher slurm needs "
        "this host's Slurm commands to reach slurmctld: check slurm.conf, or start "
        "without it)")


def test_hostfile_lines_mpiexec_would_reject_are_named(tmp_path):
    from mpilab.placement import hostfile_hosts

    good = tmp_path / "hosts"
    good.write_text("# the nodes\n  node1:2\nnode2\n\nnode3:4:1 ifhn=eth0\n")
    assert hostfile_hosts(str(good)) == ["node1", "node2", "node3"]
    for line, fault in [("node1:2  # two", "mpiexec takes comments only on lines of their own"),
                        ("node1:abc", "give `host` or `host:slots`, slots a positive number"),
                        ("node1:0", "give `host` or `host:slots`, slots a positive number"),
                        (":2", "give `host` or `host:slots`, slots a positive number"),
                        ("node1 slots=2", "that is Open MPI's form; mpiexec (MPICH's hydra) "
                                          "takes node1:2"),
                        ("node1:2 cpus=4", "mpiexec takes no 'cpus' there (only "
                                           "`ifhn=ADDRESS` after `host:slots`)")]:
        bad = tmp_path / "bad"
        bad.write_text(f"node0\n{line}\n")
        with pytest.raises(ClusterError) as told:
            hostfile_hosts(str(bad))
        assert str(told.value) == f"--hostfile {bad}, line 2 ({line!r}): {fault}"


def test_hosts_that_take_ranks_fill_each_host_s_slots_in_turn(tmp_path):
    from mpilab.placement import hostfile_hosts

    hosts = tmp_path / "hosts"
    hosts.write_text("node1:2\nnode2\nnode3:4\n")
    assert hostfile_hosts(str(hosts), 1) == hostfile_hosts(str(hosts), 2) == ["node1"]
    assert hostfile_hosts(str(hosts), 3) == ["node1", "node2"]
    assert hostfile_hosts(str(hosts), 4) == hostfile_hosts(str(hosts), 99) == \
        ["node1", "node2", "node3"]


def test_a_hostfile_naming_this_host_localhost_beside_other_hosts_is_one_line(tmp_path):
    """mpiexec tells the other hosts' proxies to call back to the name the hostfile gives
    this host: `localhost` sends them to themselves (hydra: `unable to connect from
    "node2" to "localhost" (Connection refused)`). On its own, localhost is fine."""
    import socket

    from mpilab.placement import place

    for own in ("localhost", "127.0.0.1"):
        hosts = tmp_path / "hosts"
        hosts.write_text(f"{own}:2\n192.0.2.77:2\n")
        with pytest.raises(ClusterError) as told:
            place("mpi", str(hosts), None, None)
        assert str(told.value) == (
            f"--hostfile {hosts}: {own!r} means each host itself, and mpiexec tells "
            f"192.0.2.77 to reach this host by that name: write this host as the others "
            f"reach it ({socket.gethostname()}, or its address on their network)")
    alone = tmp_path / "alone"
    alone.write_text("localhost:2\n")
    assert place("mpi", str(alone), None, None).listen_ip == "127.0.0.1"


def test_what_a_host_lacks_is_asked_by_one_script_and_told_in_one_line(tmp_path):
    """The probe runs in a real shell here (on the hosts it runs over ssh or srun); the
    answer and slurmstepd's own line name the host, the path and what to do."""
    import socket
    import sys

    from mpilab.host_check import (
        FOLDER,
        MODULE,
        Needed,
        lacking_line,
        probe_script,
        read_answers,
    )

    program = tmp_path / "bin" / "hydra_pmi_proxy"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    no_mpilab = tmp_path / "bin" / "python3"  # runs, imports nothing
    no_mpilab.write_text("#!/bin/sh\nexit 1\n")
    no_mpilab.chmod(0o755)
    have = [Needed(str(tmp_path), FOLDER), Needed(str(program)), Needed(sys.executable, MODULE)]
    lack = [Needed(str(tmp_path / "gone"), FOLDER), Needed(str(tmp_path / "bin" / "python")),
            Needed(str(no_mpilab), MODULE)]
    paths = [have[0], lack[0], have[1], lack[1], have[2], lack[2]]
    said = subprocess.run(["sh", "-c", probe_script(paths)], capture_output=True, text=True,
                          check=True).stdout
    host = socket.gethostname()
    assert read_answers(said, paths) == {host: lack}
    silent = subprocess.run(["sh", "-c", probe_script(have)], capture_output=True, text=True,
                            check=True).stdout
    assert silent == "" and read_answers(silent, have) == {} and lacking_line({}) is None

    # a program first, then mpilab: without the environment the folder does not matter
    assert lacking_line({"node2": lack}) == (
        f"node2 has no {lack[1].path}: the ranks run this kernel's Python environment "
        f"({sys.prefix}) at the same path on every host; install it there, or keep it on a "
        "file system every host shares")
    assert lacking_line({"node2": lack[::2]}) == (
        f"on node2, {no_mpilab} cannot import mpilab: install mpilab in that environment "
        "there, or keep the environment (and an editable install's source) on a file system "
        "every host shares")
    assert lacking_line({"node2": [lack[0]], "node3": [lack[0]]}) == (
        f"node2 and node3 have no folder {lack[0].path}, this notebook's folder, where "
        "mpiexec starts the ranks: `%cd` to a folder every host shares (a home or project "
        "file system), then start again")
    # srun could not start the proxy on a node: slurmstepd's line says which and where
    output = ("srun: error: node2: task 1: Exited with exit code 2\n"
              "slurmstepd-node2: error: execve(): /opt/venv/bin/hydra_pmi_proxy: No such "
              "file or directory\n")
    proxy = Needed("/opt/venv/bin/hydra_pmi_proxy")
    assert read_answers(output, [Needed("/work", FOLDER), proxy]) == {"node2": [proxy]}


def test_allocation_tasks_from_slurm_variables(monkeypatch):
    from mpilab.placement import allocation_tasks

    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3),1")
    assert allocation_tasks() == 7
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert allocation_tasks() == 4


def test_inside_a_step_the_allocations_layout_is_asked_of_slurm(monkeypatch):
    """A kernel that srun runs (`srun --pty jupyter lab`) sees its step's one task on one
    node in SLURM_NTASKS and SLURM_TASKS_PER_NODE: the allocation's tasks come from
    squeue, and mpiexec gets them laid out as Slurm lays out a job's tasks (round robin
    up to each node's CPUs, then beyond)."""
    from mpilab import placement

    asked = []
    monkeypatch.setattr(placement, "slurm_query",
                        lambda *cmd: asked.append(cmd) or "4                   1   \n")
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1",
                        "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "node[1-2]",
                        "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}.items():
        monkeypatch.setenv(name, value)
    assert placement.allocation_tasks() == 4
    assert asked[0] == ("squeue", "-h", "-j", "7", "-O", "NumTasks,cpus-per-task")
    assert placement.step_layout() == {
        "SLURM_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_NTASKS": "4",
        "SLURM_NPROCS": "4", "SLURM_TASKS_PER_NODE": "2(x2)"}
    monkeypatch.delenv("SLURM_STEP_ID")  # salloc's shell: its variables are the job's
    assert placement.allocation_tasks() == 1 and placement.step_layout() == {}
    assert len(asked) == 2
    spread = placement.spread
    assert spread(4, [32, 32]) == [2, 2]  # whole nodes: round robin, not all on the first
    assert spread(3, [2, 2]) == [2, 1] and spread(5, [2, 2]) == [3, 2]
    assert spread(7, [1, 4, 1]) == [1, 4, 2]
    assert placement.per_node_counts([2, 2, 2, 1]) == "2(x3),1"
    assert placement.per_node_counts([3]) == "3"


def test_a_batch_jobs_hosts_place_the_ranks_as_mpiexec_would(monkeypatch, tmp_path):
    """Without --hostfile, mpiexec (Hydra) places ranks on a PBS, LSF or SGE job's hosts
    by itself: a PBS job's node file is the hostfile mpilab goes by too; an LSF or SGE
    job on other hosts is one line; a job on this host alone keeps the ranks here."""
    import socket

    from mpilab import placement

    for name in ("SLURM_JOB_ID", "PBS_NODEFILE", "LSF_BINDIR", "LSB_MCPU_HOSTS",
                 "SGE_ROOT", "ARC", "PE_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    assert placement.batch_nodefile("mpi", None) is None
    assert placement.batch_nodefile("mpi", "hosts.txt") == "hosts.txt"
    nodes = tmp_path / "7.head"
    nodes.write_text("node1\nnode1\nnode2\nnode2\n")
    monkeypatch.setenv("PBS_NODEFILE", str(nodes))
    assert placement.batch_nodefile("mpi", None) == str(nodes)
    assert placement.hostfile_hosts(str(nodes), 4) == ["node1", "node1", "node2", "node2"]
    assert placement.batch_nodefile("slurm", None) is None  # a Slurm job of its own
    monkeypatch.setenv("PBS_NODEFILE", str(tmp_path / "gone"))
    with pytest.raises(placement.ClusterError,
                       match=r"cannot read the batch job's host list .*gone: No such file"):
        placement.batch_nodefile("mpi", None)
    monkeypatch.setenv("PBS_NODEFILE", str(nodes))
    monkeypatch.setenv("PBS_JOBID", "7.head")
    from mpilab.cli import _batch_job_found  # mpilab doctor's row

    assert _batch_job_found() == ("PBS job 7.head (node1, node2): `%mpilab start -n N` "
                                  "places the ranks by its node file")
    monkeypatch.delenv("PBS_NODEFILE")
    assert _batch_job_found() is None
    monkeypatch.setenv("LSF_BINDIR", "/opt/lsf/bin")
    monkeypatch.setenv("LSB_MCPU_HOSTS", f"{socket.gethostname()} 4")
    assert placement.batch_nodefile("mpi", None) is None  # this host alone
    monkeypatch.setenv("LSB_MCPU_HOSTS", "gpu01 4 gpu02 4")
    with pytest.raises(placement.ClusterError) as told:
        placement.batch_nodefile("mpi", None)
    assert str(told.value) == (
        "this kernel runs in an LSF job on gpu01, gpu02: give its hosts as --hostfile (a "
        "`host:slots` line each); mpilab places ranks on other hosts by a hostfile, and "
        "mpiexec alone would take them from LSB_MCPU_HOSTS")
    monkeypatch.delenv("LSF_BINDIR")
    pe = tmp_path / "pe_hostfile"
    pe.write_text("gpu01 4 all.q@gpu01 UNDEFINED\ngpu02 4 all.q@gpu02 UNDEFINED\n")
    for name, value in {"SGE_ROOT": "/opt/sge", "ARC": "lx-amd64",
                        "PE_HOSTFILE": str(pe)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(placement.ClusterError, match="in an SGE job on gpu01, gpu02: .* "
                                                     "from PE_HOSTFILE"):
        placement.batch_nodefile("mpi", None)


def test_ranks_go_into_the_allocation_the_kernel_runs_in(monkeypatch):
    """In a Slurm allocation (salloc's shell, JupyterLab inside a job) the ranks go into
    it with --launcher slurm, and under mpiexec without a hostfile, as mpiexec would;
    an allocation of this host alone is reached on the loopback."""
    import socket

    from mpilab import placement

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not placement.into_allocation("slurm", None)
    assert not placement.into_allocation("mpi", None)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert placement.into_allocation("slurm", None)
    assert placement.into_allocation("mpi", None)
    assert placement.into_allocation("slurm", "hosts.txt")
    assert not placement.into_allocation("mpi", "hosts.txt")  # the hostfile says where
    monkeypatch.setenv("SLURM_JOB_NODELIST", "here")
    monkeypatch.setattr(placement, "allocation_hosts", lambda: [socket.gethostname()])
    here = placement.place("mpi", None, None, placement.SlurmSettings())
    assert (here.listen_ip, here.remote) == ("127.0.0.1", False)


def refused_start(config) -> str:
    """The one line a start refuses `config` with, before anything runs."""
    from mpilab.cluster import ClusterError, RankCluster

    ranks = RankCluster(config)
    with pytest.raises(ClusterError) as told:
        ranks.start()
    assert not ranks.running
    return str(told.value)


def test_job_settings_inside_an_allocation_are_one_line_not_ignored(monkeypatch):
    from mpilab.cluster import ClusterConfig
    from mpilab.placement import SlurmSettings

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert refused_start(ClusterConfig(n=2, launcher="slurm", slurm=SlurmSettings(
        partition="gpu", nodes="2"))) == (
        "--partition asks for a new Slurm job, but this kernel runs in Slurm allocation 42, "
        "where the ranks go: start without it, or `%env SLURM_JOB_ID=` first to submit a "
        "job of their own")


def test_a_ucx_tls_without_shared_memory_on_one_host_is_one_line(monkeypatch):
    """Ranks on this host alone keep MPI's TCP on the loopback, where UCX's TCP does not
    run (mpiexec then fails with UCX's `no active messages transport`): UCX_TLS=tcp is
    one line before anything starts; one that leaves shared memory, or ranks on other
    hosts, pass."""
    from mpilab.cluster import ClusterConfig, ClusterError
    from mpilab.placement import check_transports

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    assert refused_start(ClusterConfig(n=2)) == (
        "UCX_TLS=tcp,self leaves MPI no way between ranks on this host: they talk through "
        "shared memory, and UCX's TCP transport does not run over the loopback they keep "
        "it on: add sm (UCX_TLS=sm,tcp,self), or unset UCX_TLS")
    check_transports("10.1.2.3", 2)  # across hosts: TCP on their network
    check_transports("127.0.0.1", 1)
    for usable in ("sm,tcp,self", "posix,tcp", "^ib", "all"):
        monkeypatch.setenv("UCX_TLS", usable)
        check_transports("127.0.0.1", 4)
    monkeypatch.setenv("UCX_TLS", "^sm")
    with pytest.raises(ClusterError, match="take sm out of its exclusions"):
        check_transports("127.0.0.1", 4)


def test_a_starts_proxies_step_is_named_its_own_and_overlaps(monkeypatch):
    """In an allocation every mpiexec's proxies' step would be `hydra_pmi_proxy`, and
    would wait while another step holds the nodes: a start names its own and lets it
    overlap (srun's --job-name and --overlap, through Hydra's extra launcher
    arguments), after the user's own extra arguments."""
    from mpilab.placement import proxy_step_env, proxy_step_name

    name = proxy_step_name("1764892800-ab12")
    assert name == "mpilab-1764892800-ab12"
    monkeypatch.delenv("HYDRA_LAUNCHER_EXTRA_ARGS", raising=False)
    assert proxy_step_env(name) == {
        "HYDRA_LAUNCHER_EXTRA_ARGS": "--overlap --job-name=mpilab-1764892800-ab12"}
    monkeypatch.setenv("HYDRA_LAUNCHER_EXTRA_ARGS", "--cpu-bind=none ")
    assert proxy_step_env(name) == {"HYDRA_LAUNCHER_EXTRA_ARGS":
                                    "--cpu-bind=none --overlap --job-name=mpilab-1764892800-ab12"}


def test_many_hosts_are_named_in_ranges():
    """The start line names a few hosts each; a thousand ranks on 128 hosts read as
    Slurm writes them, not as a 1,000-character list."""
    from mpilab.cluster import StartReport
    from mpilab.selection import host_list

    assert host_list(["node2", "node1", "node1"]) == "node1, node2"
    assert host_list([f"gpu{i:03d}" for i in range(1, 129)]) == "128 hosts: gpu[001-128]"
    assert host_list([f"node{i}" for i in (7, 8, 9, 10, 12)]) == "5 hosts: node[7-10,12]"
    assert host_list(["login", "cpu12", "cpu13", "gpu001", "gpu003"]) == \
        "5 hosts: cpu[12-13], gpu[001,003], login"
    assert host_list([f"r{i}n{j}" for i in range(8) for j in range(2)]) == (
        "16 hosts: r0n[0-1], r1n[0-1], r2n[0-1], r3n[0-1], r4n[0-1], r5n[0-1], … (2 more)")
    ranks = [{"host": f"gpu{r // 8 + 1:03d}", "device": f"cuda:{r % 8}", "backend": "nccl"}
             for r in range(1024)]
    line = StartReport(ranks=ranks, seconds=42.0, job="Slurm job 5").line()
    assert line.startswith("mpilab: 1024 ranks on 128 hosts: gpu[001-128] in Slurm job 5 · "
                           "devices "), line
    # hosts whose clocks are off: one line, however many
    off = {f"gpu{i:03d}": 6.0 + i for i in range(1, 41)}
    notes = StartReport(ranks=ranks, seconds=42.0, clocks_off=off).notes()
    assert notes == ["mpilab: the clocks of 40 hosts: gpu[001-040] are 7–46 s off this "
                     "host's (no NTP there?): mpilab reads the ranks' times on this clock, "
                     "but the times your code reads there differ"]
    notes = StartReport(ranks=ranks, seconds=42.0, clocks_off={"gpu007": -12.4}).notes()
    assert notes[0].startswith("mpilab: gpu007's clock is 12 s ahead of this host's (")
    assert StartReport(ranks=ranks, seconds=42.0).notes() == []
    # CPU ranks that outnumber a host's cores: one line for the hosts that run too many
    cpu = [{"host": f"cpu{r // 6 + 1:02d}", "device": "cpu", "backend": "gloo",
            "cpus": [0, 1, 2, 3]} for r in range(60)] + [
        {"host": "cpu11", "device": "cpu", "backend": "gloo", "cpus": [0, 1, 2, 3]}]
    assert StartReport(ranks=cpu, seconds=9.0).notes() == [
        "mpilab: 10 hosts: cpu[01-10] each run 6 ranks on 4 cores: the ranks take turns on "
        "the cores, so ranks past 4 a host add no speed (fine for trying code, not for "
        "timing it)"]
    one = [{"host": "laptop", "device": "cpu", "backend": "gloo", "cpus": [0, 1]}] * 3
    assert StartReport(ranks=one, seconds=9.0).notes()[0].startswith(
        "mpilab: laptop runs 3 ranks on 2 cores: ")
    assert StartReport(ranks=one[:2], seconds=9.0).notes() == []
    # ranks that did not say their CPUs (a summary without them) are not judged
    assert StartReport(ranks=[{k: v for k, v in r.items() if k != "cpus"} for r in one],
                       seconds=9.0).notes() == []
    # ranks bound a core each (Slurm's task binding): the host's cores are theirs together
    bound = [{"host": "n1", "device": "cpu", "backend": "gloo", "cpus": [c]} for c in range(4)]
    assert StartReport(ranks=bound, seconds=9.0).notes() == []
    assert "n1 runs 5 ranks on 4 cores" in StartReport(ranks=bound + bound[:1],
                                                        seconds=9.0).notes()[0]
    # a GPU a rank is what a GPU host is sized by; its cores are not counted
    assert StartReport(ranks=[{**r, "cpus": [0]} for r in ranks[:8]], seconds=9.0).notes() == []


def test_a_bootstrap_out_of_time_names_the_ranks_that_did_not_finish():
    from mpilab.cluster import bootstrap_timeout_line

    assert bootstrap_timeout_line(2, [], 120) == \
        "the ranks did not finish their bootstrap within 120 s"
    line = bootstrap_timeout_line(4, [{"rank": 2, "host": "node3"},
                                      {"rank": 3, "host": "node3"}, RuntimeError()], 120)
    assert line == ("ranks 0-1 did not finish their bootstrap within 120 s (ranks 2-3 on "
                    "node3 did)")
    assert bootstrap_timeout_line(2, [{"rank": 1, "host": "b"}], 60).startswith(
        "rank 0 did not finish its bootstrap within 60 s (rank 1 on b did")


def test_the_launchers_telling_line_is_picked():
    from mpilab.cluster import telling_line

    output = ("[mpiexec@vm] HYDU_sock_write: write error\n"
              "ssh: connect to host 10.0.0.9 port 22: No route to host\n"
              "[mpiexec@vm] main: process manager error waiting for completion\n")
    assert telling_line(output) == "ssh: connect to host 10.0.0.9 port 22: No route to host"
    assert telling_line("sbatch: error: invalid partition specified: nosuch\n") == \
        "sbatch: error: invalid partition specified: nosuch"
    assert telling_line("mpilab-engine-exit host=n1 pid=- did not start: cannot reach the "
                        "notebook at 10.0.0.1:4000: timed out\n") == \
        "cannot reach the notebook at 10.0.0.1:4000: timed out"
    assert telling_line("all fine\n") is None


def test_lifeline_tells_its_holders_when_the_notebook_goes():
    from mpilab import lifeline

    line = lifeline.Lifeline("127.0.0.1")
    held = lifeline.hold(line.address)
    assert held.notebook_gone(wait=1.5) is None  # a beat arrives
    deadline = time.monotonic() + 2
    while line.holders < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert line.holders == 1
    line.close()
    assert held.notebook_gone(wait=1.0) == "the notebook closed its lifeline"


def test_lifeline_silence_means_gone_and_no_notebook_means_lost():
    import socket

    from mpilab import lifeline

    quiet = socket.socket()
    quiet.bind(("127.0.0.1", 0))
    quiet.listen(1)  # accepts, never beats: a notebook behind a cut link
    held = lifeline.hold(f"127.0.0.1:{quiet.getsockname()[1]}")
    assert held.notebook_gone(wait=0.2, silence_s=0.1).startswith("no word from the notebook")
    quiet.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(lifeline.LifelineLost, match="cannot reach the notebook"):
        lifeline.hold(f"127.0.0.1:{port}", connect_s=0.3)


def test_collective_ledger_names_the_first_mismatch_and_keeps_it():
    from mpilab.watchdog import CollectiveLedger

    def beat(recent, **now):
        return {"recent": [[seq, op, size] for seq, op, size in recent], **now}

    ledger = CollectiveLedger()
    agree = {r: beat([(1, "allreduce", 64), (2, "allreduce", 64)]) for r in range(3)}
    assert ledger.mismatch(agree) is None
    # rank 2 moves on to #3 as a broadcast while ranks 0 and 1 sit in allreduce #3
    later = dict(agree)
    later[0] = beat([(2, "allreduce", 64)], phase="collective", seq=3, op="allreduce",
                    op_nbytes=64)
    later[1] = beat([(2, "allreduce", 64)], phase="collective", seq=3, op="allreduce",
                    op_nbytes=64)
    later[2] = beat([(2, "allreduce", 64), (3, "broadcast", 8)])
    assert ledger.mismatch(later) == (
        "mismatched collectives: rank 0 in allreduce #3 (64 bytes), "
        "rank 1 in allreduce #3 (64 bytes), rank 2 in broadcast #3 (8 bytes)")
    # a mismatch stays found after the ranks' windows moved past it
    moved = {r: beat([(9, "allreduce", 64)]) for r in range(3)}
    assert "rank 2 in broadcast #3" in ledger.mismatch(moved)


def test_collective_ledger_reads_many_heartbeats_over_several_checks(monkeypatch):
    """A check reads at most READS_PER_CHECK changed heartbeats and the next one takes up
    where it stopped: a mismatch in the last of 10 ranks is found by the fourth check,
    with 3 read a check, and a check with nothing new reads nothing."""
    from mpilab.watchdog import CollectiveLedger

    monkeypatch.setattr(CollectiveLedger, "READS_PER_CHECK", 3)
    ledger = CollectiveLedger()
    beats = {r: {"recent": [[1, "allreduce", 64]]} for r in range(10)}
    beats[9] = {"recent": [[1, "broadcast", 8]]}
    for _ in range(3):
        assert ledger.mismatch(beats) is None and ledger.behind
    found = ledger.mismatch(beats)  # ranks 9, then nothing left
    assert found.startswith("mismatched collectives: rank 0 in allreduce #1 (64 bytes)")
    assert found.endswith("rank 9 in broadcast #1 (8 bytes)") and not ledger.behind
    assert ledger.mismatch(beats) == found and not ledger.behind


def _smaps_field(address: int, field: str) -> str:
    """`field` of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == f"{field}:":
                return line.split()[1]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_kept_buffers_ask_for_huge_pages_from_4_mib():
    """DataParallel's buckets and fusion's buffers: zeros of the dtype asked, from
    HUGE_MIN_BYTES on in a mapping aligned to a huge page that the kernel may back with
    them (where it has transparent huge pages at all); the tensor keeps its mapping."""
    import gc

    import torch
    from mpilab.rank.host_memory import HUGE_MIN_BYTES, HUGE_PAGE_BYTES, kept_zeros

    cpu = torch.device("cpu")
    big = kept_zeros(HUGE_MIN_BYTES // 2 + 3, torch.bfloat16, cpu)
    assert big.dtype is torch.bfloat16 and big.shape == (HUGE_MIN_BYTES // 2 + 3,)
    assert not big.any() and big.data_ptr() % HUGE_PAGE_BYTES == 0
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" not in f.read():
            assert _smaps_field(big.data_ptr(), "THPeligible") == "1"
    view = kept_zeros(HUGE_MIN_BYTES, torch.float32, cpu)[-10:]
    gc.collect()
    view += 1
    assert view.sum().item() == 10
    small = kept_zeros(1000, torch.int64, cpu)
    assert small.dtype is torch.int64 and small.shape == (1000,) and not small.any()


@pytest.mark.parametrize("call, line", [
    (lambda: log(loss="abc"), "mpilab.log(loss=…) takes a number (a float, an int or a "
                              "one-element tensor), got str 'abc'"),
    (lambda: log(acc=torch.ones(3)), "mpilab.log(acc=…) takes a number (a float, an int "
                                     "or a one-element tensor), got Tensor of shape (3,)"),
    (lambda: progress(5), "mpilab.progress takes an iterable (range(n), a DataLoader), got "
                          "int: range(5)?"),
])
def test_rank_helpers_given_the_wrong_kind_of_value_say_what_they_take(call, line):
    """Said at the call, in one line, not as float()'s or a generator's error at the
    loop's first step."""
    with pytest.raises(TypeError) as info:
        call()
    assert str(info.value) == line


def test_rank_helpers_take_what_a_training_loop_passes():
    log(loss=torch.tensor(0.5, requires_grad=True), step_time=0.1, epoch=2)
    assert list(progress(range(3))) == [0, 1, 2]
    assert list(progress("ab")) == ["a", "b"]


def test_a_batch_scripts_progress_line_reads_at_any_pace(capsys):
    """Without a notebook (here: no agent address) rank 0's loop ends with a line on
    stderr: steps, share, time, pace (per second, or seconds each for a slow loop) and
    the newest logged values; a loop left with `break` says where it stopped."""
    from mpilab.rank.progress import progress_line

    assert progress_line("train", 40, 100, 12.0, {"loss": 0.31234}) == \
        "train: 40/100 (40%) · 12.0 s · 3.33/s · loss 0.3123"
    assert progress_line("epoch", 3, 10, 65.2, {}) == "epoch: 3/10 (30%) · 65.2 s · 21.7 s each"
    assert progress_line("", 2000, 0, 0.5, {"acc": 0.9}) == \
        "progress: 2000 · 0.5 s · 4000/s · acc 0.9"
    for step in progress(range(10), desc="early"):
        if step == 3:
            break
    assert capsys.readouterr().err.startswith("early: 3/10 (30%) · ")


def _ipyparallel_accumulates(text: str, chunk: str) -> str:
    """What ipyparallel's client keeps of a rank's stream as a chunk arrives: the text so
    far plus the chunk, and when the chunk holds a carriage return, every line cut to
    what follows its last carriage return that more text follows (Client._handle_iopub)."""
    text += chunk
    return re.sub(r".*\r(?=[^\n])", "", text) if "\r" in chunk else text


def test_stream_cursor_reads_a_progress_line_as_the_notebook_shows_it():
    cursor, text, read = StreamCursor(), "", []
    for chunk in ["epoch 1\n", "0\r", "1\r", "2\r", "\n", "a\r", "b\n", "c\rd\n", "tail\r"]:
        text = _ipyparallel_accumulates(text, chunk)
        read.append(cursor.read(text))
    read.append(cursor.read(text, final=True))
    assert "".join(read) == "epoch 1\n2\nb\nd\ntail"


def test_stream_cursor_gives_every_line_once_however_the_stream_is_cut():
    """Random text of letters, carriage returns and line breaks, cut into random chunks
    and read at random moments: what the cursor gives is the whole stream, each line as
    a notebook shows it, whatever ipyparallel rewrote in between."""
    rng = random.Random(7)
    for _ in range(400):
        stream = "".join(rng.choice("ab\r\r\n") for _ in range(rng.randrange(0, 60)))
        cursor, text, read, at = StreamCursor(), "", [], 0
        while at < len(stream):
            step = rng.randrange(1, 6)
            text = _ipyparallel_accumulates(text, stream[at:at + step])
            at += step
            if rng.random() < 0.6:
                read.append(cursor.read(text))
                so_far = stream[:at]
                assert cursor.lines == so_far.count("\n"), repr(stream)
                assert cursor.unfinished(text) == overwritten(so_far.rsplit("\n", 1)[-1]), \
                    repr(stream)
        read.append(cursor.read(text, final=True))
        assert "".join(read) == "\n".join(overwritten(line) for line in stream.split("\n")), \
            repr(stream)


def test_lines_in_progress_show_once_they_stay_unfinished():
    """A rank's unfinished line shows once it has stayed unfinished for `after` seconds
    (a line printed in pieces does not flash by), as it stands, identical ones once;
    a line that ended leaves the block, and the next line waits its own time."""
    block = LinesInProgress(single=False, after=0.5)
    bar = {(0, "stderr"): (3, "train 10%"), (1, "stderr"): (3, "train 10%")}
    assert block.text(bar, now=0.0) == ""
    assert block.text(bar, now=0.6) == "[ranks 0-1] train 10%"
    bar[(1, "stderr")] = (3, "train 20%")  # the same line, redrawn: no new wait
    assert block.text(bar, now=0.7) == "[rank 0] train 10%\n[rank 1] train 20%"
    bar[(1, "stderr")] = (4, "eval 0%")  # rank 1 began a new line
    assert block.text(bar, now=0.8) == "[rank 0] train 10%"
    assert block.text(bar, now=1.4) == "[rank 0] train 10%\n[rank 1] eval 0%"
    assert block.text({}, now=1.5) == ""
    # the ranks' bars begun a few ms apart appear together, at the first one's time
    apart = LinesInProgress(single=False, after=0.5)
    assert apart.text({(1, "stderr"): (2, "train 0%")}, now=2.0) == ""
    bars = {(1, "stderr"): (2, "train 5%"), (0, "stderr"): (2, "train 0%")}
    assert apart.text(bars, now=2.01) == ""
    assert apart.text(bars, now=2.5) == "[rank 0] train 0%\n[rank 1] train 5%"
    one = LinesInProgress(single=True, after=0.0)
    assert one.text({(0, "stdout"): (0, "step 3")}, now=0.0) == "step 3"
    many = {(r, "stderr"): (0, f"rank {r} at {r}%") for r in range(IN_PROGRESS_SHOWN + 5)}
    shown = LinesInProgress(single=False, after=0.0).text(many, now=0.0).splitlines()
    assert len(shown) == IN_PROGRESS_SHOWN + 1 and shown[0] == "[rank 0] rank 0 at 0%"
    assert shown[-1] == "… and 5 more lines in progress"


def test_text_in_place_is_redrawn_and_follows_the_output(monkeypatch):
    """The block is one output redrawn in place while it shows; emptied and shown again
    after more output, it is a new one under that output; redraws are rate-limited,
    emptying is not."""
    from mpilab import live

    sent = []
    monkeypatch.setattr(live, "display", lambda data, raw, display_id:
                        sent.append(("new", display_id, data.get("text/plain"))))
    monkeypatch.setattr(live, "update_display", lambda data, raw, display_id:
                        sent.append(("update", display_id, data.get("text/plain"))))
    view = live.TextInPlace()
    view.show("", written=0, now=0.0)
    assert sent == []
    view.show("a 1", written=0, now=0.0)
    view.show("a 2", written=5, now=0.1)  # too soon
    view.show("a 3", written=5, now=0.3)  # output went under it: it stays
    view.show("", written=9, now=0.31)
    view.show("b 1", written=9, now=0.4)  # output came after it: a new one
    view.show("", written=9, now=0.5)
    view.show("c 1", written=9, now=0.6)  # nothing since: the same one
    first, second = sent[0][1], sent[3][1]
    assert sent == [("new", first, "a 1"), ("update", first, "a 3"), ("update", first, None),
                    ("new", second, "b 1"), ("update", second, None),
                    ("update", second, "c 1")]
    assert first != second


def test_a_collective_on_some_ranks_while_the_others_sit_idle_is_named_a_hang(monkeypatch):
    """`%%ranks 1` calling dist.all_reduce: rank 0 runs no cell and never joins. After
    the hang timeout at that line the verdict says why; not while rank 0 runs a cell of
    its own (a --noblock one may be the other half)."""
    cluster = _QuietCluster()
    cell = cluster.start_cell(1)
    call = "cell line 2: dist.all_reduce(t)"
    cluster.beat(0, 0.0, "running", "cell line 1: other_half()", cell=5)
    cluster.beat(1, 0.0, "running", call)
    watchdog = Watchdog(cluster, [1], hang_timeout=3.0, cell=cell)
    assert watchdog.check(0.0, {}) is None
    assert watchdog.check(10.0, {}) is None  # rank 0 is busy: it may join
    cluster.beat(0, 10.0, "idle", cell=5)
    assert watchdog.check(10.0, {}) is None  # the clock starts now
    verdict = watchdog.check(13.1, {})
    assert verdict.kind == "hang" and verdict.release == [1] and verdict.blocking == [1]
    assert verdict.lines == [
        f"hang: rank 1 has been at {call} for 3.1 s",
        "rank 0 is not running this cell, and a collective waits for every rank: run it "
        "on all of them (`%%ranks`)"]
    # a backward() alone on rank 1 (no DataParallel: nothing to join) is no hang
    cluster.beat(1, 20.0, "running", "cell line 3: loss.backward()")
    assert Watchdog(cluster, [1], 3.0, cell).check(100.0, {}) is None
    # in one of mpilab's collectives, the hang timeout's verdict says the same
    monkeypatch.setattr("time.time", lambda: 100.0)
    cluster.beat(1, 100.0, "collective", cell=1, op="allreduce", op_age=3.2)
    lines = Watchdog(cluster, [1], 3.0, cell).check(100.0, {}).lines
    assert lines[0] == "hang: rank 1 was waiting in allreduce #7 for 3.2 s"
    assert lines[-1].startswith("rank 0 is not running this cell")


def test_a_collective_waiting_for_ranks_that_run_no_cell_is_released_at_once(monkeypatch):
    """`%%ranks 1` calling mpilab.allreduce while rank 0 sits idle: the notebook waits on
    this cell, so rank 0 never joins; the verdict comes once rank 0 has said it is idle
    well after the collective began, not after the 30-s hang timeout. A --noblock cell's
    collective waits the hang timeout (a later cell may be its other half)."""
    clock = [100.0]
    monkeypatch.setattr("time.time", lambda: clock[0])
    cluster = _QuietCluster()
    cell = cluster.start_cell(1)

    def at(t: float) -> None:
        clock[0] = t
        cluster.beat(0, t, "idle", cell=5)
        cluster.beat(1, t, "collective", cell=1, op="allreduce", op_age=t - 100.0)

    waits = Watchdog(cluster, [1], hang_timeout=30.0, cell=cell, notebook_waits=True)
    noblock = Watchdog(cluster, [1], hang_timeout=30.0, cell=cell)
    at(100.5)
    assert waits.check(100.5, {}) is None  # too soon: rank 0 may be about to begin a cell
    at(101.2)
    assert noblock.check(101.2, {}) is None
    verdict = waits.check(101.2, {})
    assert verdict.kind == "hang" and verdict.release == [1]
    assert verdict.lines == [
        "hang: rank 1 was waiting in allreduce #7 for 1.2 s",
        "progress: rank 1 at collective #7",
        "rank 0 is not running this cell, and a collective waits for every rank: run it "
        "on all of them (`%%ranks`)"]
    # rank 0 last told of being idle before the collective began: no verdict yet
    cluster = _QuietCluster()
    clock[0] = 99.0
    cluster.beat(0, 99.0, "idle", cell=5)
    clock[0] = 102.0
    cluster.beat(1, 102.0, "collective", cell=1, op="allreduce", op_age=2.0)
    assert Watchdog(cluster, [1], 30.0, cluster.start_cell(1), notebook_waits=True) \
        .check(102.0, {}) is None


@pytest.mark.parametrize("output, said", [
    ("slurmstepd-node1: error: *** JOB 5 ON node1 CANCELLED AT 2026-12-04T18:21:49 DUE TO "
     "TIME LIMIT ***", "the Slurm job 5 reached its time limit at 18:21:49 (`%mpilab start "
     "--time` sets it)"),
    ("slurmstepd: error: *** STEP 5.0 ON node1 CANCELLED AT 2026-12-04T18:21:49 DUE TO "
     "PREEMPTION ***", "the Slurm job 5 was preempted at 18:21:49"),
    ("*** JOB 77 ON gpu01 CANCELLED AT 2026-12-04T18:21:49 DUE TO NODE FAILURE, SEE "
     "SLURMCTLD LOG FOR DETAILS ***", "the Slurm job 77 lost a node at 18:21:49"),
    ("*** JOB 12 CANCELLED AT 2026-12-04T01:02:03 DUE TO TIME LIMIT ***",  # older Slurm
     "the Slurm job 12 reached its time limit at 01:02:03 (`%mpilab start --time` sets it)"),
    ("slurmstepd: error: *** JOB 9 ON node2 CANCELLED AT 2026-12-04T18:21:49 ***",
     "the Slurm job 9 was cancelled at 18:21:49"),
    ("2026-12-04 18:20:38.391 [IPEngine.3] Starting nanny", None),
])
def test_why_slurm_ended_a_job_is_read_from_its_output(output, said, monkeypatch):
    from mpilab.placement import slurm_job_ended

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm_job_ended(output) == said


def test_the_allocation_the_kernel_runs_in_is_named_as_one_when_it_ends(monkeypatch):
    """Ranks started inside salloc's allocation end with it: its time limit is salloc's
    (a start's --time is refused there), and another job is still a job."""
    from mpilab.placement import slurm_job_ended

    monkeypatch.setenv("SLURM_JOB_ID", "5")
    step = "slurmstepd: error: *** STEP 5.0 ON node1 CANCELLED AT 2026-12-04T18:21:49 DUE TO "
    assert slurm_job_ended(step + "TIME LIMIT ***") == (
        "the Slurm allocation 5 reached its time limit at 18:21:49 (salloc's --time sets it)")
    assert slurm_job_ended(step + "PREEMPTION ***") == \
        "the Slurm allocation 5 was preempted at 18:21:49"
    assert slurm_job_ended("*** JOB 6 ON node1 CANCELLED AT 2026-12-04T18:21:49 ***") == \
        "the Slurm job 6 was cancelled at 18:21:49"


class _SlurmJobCluster(_QuietCluster):
    """Four ranks on two hosts in a Slurm job whose output says how it ended."""

    def __init__(self, output: str):
        super().__init__()
        self.store = MetricsStore(world_size=4)
        self.ranks = [{"rank": r, "host": f"node{1 + r // 2}", "pid": 100 + r}
                      for r in range(4)]
        self.output = output

    def engine_output(self, lines: int = 15) -> str:
        return self.output


def test_ranks_a_slurm_job_took_with_it_are_named_together_with_the_reason():
    """The time limit ends every rank at once: one line that says so, at once, not four
    ranks that stopped sending heartbeats."""
    quiet = _SlurmJobCluster("[IPEngine.0] Handling execute_request: 1")
    assert Watchdog(quiet, [0, 1, 2, 3], 30.0, CellWindow(since=0.0)).check(1.0, {}) is None
    ended = _SlurmJobCluster(
        "slurmstepd-node1: error: *** JOB 5 ON node1 CANCELLED AT 2026-12-04T18:21:49 DUE "
        "TO TIME LIMIT ***\n[IPEngine.1] CRITICAL | received signal 15, stopping")
    verdict = Watchdog(ended, [0, 1, 2, 3], 30.0, CellWindow(since=0.0)).check(1.0, {})
    assert verdict.kind == "dead" and sorted(verdict.dead) == [0, 1, 2, 3]
    assert verdict.lines == ["ranks 0-3 ended: the Slurm job 5 reached its time limit at "
                             "18:21:49 (`%mpilab start --time` sets it)"]


@pytest.mark.parametrize("code, awaits", [
    ("import asyncio\nawait asyncio.sleep(0)", True),
    ("%time x = 1\nawait f()", True),  # read as IPython reads it
    ("async def f():\n    await g()", False),  # inside a function: runs as any cell
    ("print('await')", False),
    ("!echo await", False),
    ("await", False),  # does not compile: the ranks say why
])
def test_a_cell_with_a_top_level_await_is_told_apart(code, awaits):
    from mpilab.runner import has_top_level_await

    assert has_top_level_await(code) is awaits


def test_sizes_are_written_as_bench_takes_them_and_memory_is_known():
    from mpilab.rank.memory import available_memory
    from mpilab.wire import parse_sizes, size_text

    assert [size_text(n) for n in (512, 4096, 1536, 3 << 19, 64 << 20, 1 << 31, 3 << 30)] == \
        ["512", "4K", "1.5K", "1.5M", "64M", "2G", "3G"]
    assert size_text(4096, "B") == "4KB"
    # just under a unit (3 ranks' allgather of 1 MiB gathers 1048572 bytes) is that unit
    assert [size_text(n) for n in (4092, 1048572, 1023)] == ["4K", "1M", "1023"]
    for n in (512, 4096, 64 << 20, 1 << 31):  # what it writes, --sizes reads back
        assert parse_sizes(size_text(n)) == [n]
    assert 0 < available_memory() < 1 << 50  # Linux says, within any cgroup limit


def test_a_pending_job_that_no_wait_starts_is_told_from_one_that_waits():
    from mpilab.placement import never_starts

    assert never_starts("PENDING (PartitionTimeLimit)") == (
        "a longer --time than the partition allows: ask for less")
    assert never_starts("PENDING (PartitionNodeLimit)").startswith("more nodes than the")
    for waits in ("PENDING (Resources)", "PENDING (Priority)", "RUNNING (None)", "UNKNOWN", None):
        assert never_starts(waits) is None
    from mpilab.placement import pending_reason

    assert pending_reason("PENDING (Resources)") == "Resources"
    assert pending_reason("RUNNING (None)") is pending_reason("UNKNOWN") is None


def test_a_controller_ip_the_ranks_hosts_do_not_reach_is_named_in_the_start_line(monkeypatch):
    from mpilab.cluster import ClusterConfig, RankCluster

    cluster = RankCluster(config=ClusterConfig(n=2, controller_ip="192.0.2.2"))
    monkeypatch.setattr(cluster, "engine_output", lambda lines=15: (
        "mpilab-engine-exit host=node1 pid=- did not start: cannot reach the notebook at "
        "192.0.2.2:4000: [Errno 101] Network is unreachable\n"))
    assert cluster._start_failure(RuntimeError("mpiexec exited")) == (
        "the ranks did not start (mpiexec exited): cannot reach the notebook at "
        "192.0.2.2:4000: [Errno 101] Network is unreachable (the ranks' hosts do not reach "
        "--controller-ip 192.0.2.2: give an address on the network they share, or leave it "
        "out to listen where the route towards them leaves this host)")


@pytest.mark.parametrize("environ, says, launcher_rank", [
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1"},
     "srun started 4 tasks, but MPI sees each as a world of one (srun gave MPICH no PMI): "
     "run `srun --mpi=pmi2 …`, or `mpiexec -n 4 python …` inside the job", 1),
    ({"SLURM_STEP_NUM_TASKS": "4", "PMI_SIZE": "1"}, None, 0),  # srun's PMI: one task asked
    ({"SLURM_STEP_NUM_TASKS": "1"}, None, 0),
    ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "RANK": "1"},
     "torchrun started 2 workers, but mpilab's ranks are MPI processes: start the script "
     "with `mpiexec -n 2 python …` (it sets torchrun's environment for the script)", 1),
    ({"TORCHELASTIC_RUN_ID": "mpilab", "WORLD_SIZE": "2"}, None, 0),  # mpilab's own ranks
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"},
     "Open MPI's mpirun started 3 processes, but this Python's MPI is another, so each is "
     "a world of one: start the script with ", 2),
    ({"SLURM_STEP_NUM_TASKS": "x", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "RANK": "1"},
     None, 0),  # the first variable set is the launcher's
    ({"PMI_RANK": "3", "SLURM_PROCID": "0"}, None, 3),  # hydra's, under srun's step
    ({}, None, 0),
])
def test_processes_a_launcher_started_apart_are_named_with_the_command(environ, says,
                                                                       launcher_rank):
    """`srun -n 4 python train.py` where srun gives MPICH no PMI, `torchrun`, or another
    MPI's mpirun: each process is a world of one and would train alone."""
    from mpilab.rank import batch

    line = batch.launched_apart(1, environ)
    if says is None:
        assert line is None
    else:  # the Open MPI line ends with this environment's mpiexec
        assert line is not None and line.startswith(says), line
    assert batch.launched_apart(2, environ) is None  # MPI's world is the launcher's
    assert batch.launcher_rank(environ) == launcher_rank


def test_a_scripts_ranks_learn_from_the_store_what_can_never_complete():
    """The records a batch script's ranks leave in the rendezvous store (a real torch
    store, in one process): a rank that ended before a collective's number cannot join
    it; another collective recorded first at the same number is a mismatch; the same
    one, or a rank that ended after beginning it, is no reason."""
    import torch.distributed as dist
    from mpilab.rank.agent import RankState
    from mpilab.rank.script_watch import Watch, ended_before, not_reached
    from mpilab.wire import collective_words

    store = dist.HashStore()
    states = [RankState(seq=5), RankState(seq=3), RankState(seq=5)]
    watches = [Watch(store, rank, 3, state, end_job=print, timeout_s=1800)
               for rank, state in enumerate(states)]
    assert watches[0].announce(("dp_allreduce", 388), 5) is None  # the first at number 5
    assert watches[2].announce(("dp_allreduce", 388), 5) is None
    watches[1].record_end()  # rank 1 ended its script after 3 collectives
    assert watches[0]._read_ended() == [(1, 3)]
    assert watches[2].announce(("broadcast", 32), 6) is None
    stuck = watches[0].announce(("allreduce", 32), 6)
    assert stuck is not None and stuck.line == (
        "mismatched collectives: rank 0 in allreduce #6 (32 bytes), rank 2 in broadcast #6 "
        "(32 bytes): every rank must call the same collectives in the same order")
    assert watches[1].announce(("broadcast", 64), 6).line.startswith(
        "mismatched collectives: rank 1 in broadcast #6 (64 bytes), rank 2 in broadcast #6 "
        "(32 bytes)")  # the same op of another size is another collective
    what = collective_words("dp_allreduce", 5, 4096)
    assert ended_before(0, 5, what, watches[0]._read_ended()).line == (
        "rank 1 ended the script, but rank 0 waits for it in dp_allreduce #5 (4,096 bytes) "
        "that rank 1 never began")
    assert ended_before(0, 3, "allreduce #3 (4 bytes)", [(1, 3)]) is None  # it began #3
    # past the collective timeout: the ranks that never said they are in it
    assert watches[0].missing(5) == [1]
    assert not_reached([1], 3, what, 1800).line == (
        "rank 1 did not reach dp_allreduce #5 (4,096 bytes) within 1800 s, while 2 other "
        "ranks waited in it (the collective timeout: mpilab.init(collective_timeout=…) or "
        "$MPILAB_COLLECTIVE_TIMEOUT sets it)")
    assert not_reached([], 3, what, 2.5).line.startswith(
        "dp_allreduce #5 (4,096 bytes) has not completed within 2.5 s, with every rank in it")


def test_a_torch_collective_that_fails_as_a_peer_ended_its_script_is_named():
    """gloo's error when a peer's connections closed, with a rank recorded as having
    ended its script, names that rank; another error, or no ended rank (a peer that
    crashed), is no such collective."""
    import torch.distributed as dist
    from mpilab.rank.agent import RankState
    from mpilab.rank.script_watch import Watch, ended_in_torch

    gloo = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
            "by peer [10.0.0.2]:14530. This is typically caused by a remote worker crashing.")
    assert ended_in_torch(0, gloo, [(2, 7)]).line == (
        "rank 2 ended the script, but rank 0 waited for it in a torch.distributed "
        "collective that rank 2 never began")
    assert ended_in_torch(0, gloo, []) is None
    assert ended_in_torch(0, "mat1 and mat2 shapes cannot be multiplied", [(2, 7)]) is None
    store = dist.HashStore()
    watches = [Watch(store, rank, 2, RankState(seq=4), end_job=print, timeout_s=1800)
               for rank in range(2)]
    watches[1].record_end()
    assert watches[0].torch_wait_ended(RuntimeError(gloo)).line.startswith(
        "rank 1 ended the script, but rank 0 waited")
    stuck = watches[0].torch_wait_ended(RuntimeError(gloo))
    assert watches[0].say(stuck.reason)  # the first to find it says it
    # another rank waiting for rank 1 finds it alike: said once
    assert not watches[1].say(ended_in_torch(1, gloo, [(1, 4)]).reason)


def test_a_reason_to_end_a_batch_job_is_said_once_by_the_ranks_it_ends_alike():
    """Ctrl-C reaches every rank of a script at once, and a bug often fails every rank
    at the same line: the first rank says it, the others only a reason of their own."""
    import torch.distributed as dist
    from mpilab.rank.agent import RankState
    from mpilab.rank.batch import failure_reason
    from mpilab.rank.script_watch import Watch

    def raised(error: BaseException):
        try:
            raise error
        except BaseException as e:  # noqa: BLE001 - the test raises it to get a traceback
            return type(e), e, e.__traceback__

    interrupted = failure_reason(*raised(KeyboardInterrupt()), None)
    assert interrupted == "interrupted"
    kind, value, tb = raised(ValueError("shapes (2,3) and (4,) do not match"))
    assert failure_reason(kind, value, tb, None) == (
        f"ValueError: shapes (2,3) and (4,) do not match at {__file__}:"
        f"{tb.tb_lineno}")
    store = dist.HashStore()
    watches = [Watch(store, rank, 3, RankState(), end_job=print, timeout_s=1800)
               for rank in range(3)]
    assert watches[2].say(interrupted)
    assert not watches[0].say(interrupted)
    assert watches[1].say(failure_reason(kind, value, tb, None))  # another reason: said


def test_a_scripts_exit_shuts_the_groups_connections_and_no_others(monkeypatch):
    """The connections opened while the group was made, other than the store's, are
    the group's; shutting them ends a peer's read at once (as the process's exit would),
    and leaves the store's connection and sockets opened before alone."""
    import socket

    from mpilab.rank import torch_group

    monkeypatch.setattr(torch_group, "_connections", [])
    listener = socket.create_server(("127.0.0.1", 0))
    store_listener = socket.create_server(("127.0.0.1", 0))
    store_port = store_listener.getsockname()[1]
    earlier = socket.create_connection(listener.getsockname())
    earlier_peer, _ = listener.accept()
    before = torch_group.open_sockets()
    group = socket.create_connection(listener.getsockname())  # a pair of the group
    group_peer, _ = listener.accept()
    store = socket.create_connection(("127.0.0.1", store_port))
    store_peer, _ = store_listener.accept()
    torch_group.note_connections(before, store_port)
    # the accepted ends are this process's too, as a peer's ends are on rank 0's store
    noted = {fd for fd, _ in torch_group._connections}
    assert noted == {group.fileno(), group_peer.fileno()}
    torch_group.disconnect_peers()
    group_peer.settimeout(5)
    assert group_peer.recv(1) == b""  # the peer's wait ends: its connection closed
    for alive, other in ((earlier, earlier_peer), (store, store_peer)):
        alive.sendall(b"x")
        other.settimeout(5)
        assert other.recv(1) == b"x"
    assert torch_group._connections == []
    for sock in (listener, store_listener, earlier, earlier_peer, group, group_peer, store,
                 store_peer):
        sock.close()


@pytest.mark.parametrize("slurm_conf, says", [
    ("ClusterName=c\nMpiDefault=pmi2\n",
     "srun's MPI plugin pmi2: a job script's `srun python train.py` is one world"),
    ("mpidefault = PMIx\n", "srun's MPI plugin pmix: in a job script, `srun --mpi=pmi2 "
                            "python train.py` or `mpiexec -n N python train.py`"),
    ("ClusterName=c\n#MpiDefault=pmi2\n", "srun's MPI plugin none: in a job script, "
     "`srun --mpi=pmi2 python train.py` or `mpiexec -n N python train.py`"),
])
def test_doctor_says_how_a_job_script_starts_one_world(slurm_conf, says):
    from mpilab.cli import srun_plugin_advice  # mpilab doctor's "job scripts" row

    assert srun_plugin_advice(slurm_conf) == says


class _CommBeforeMPI4:
    """A communicator of an MPI without persistent collectives, as mpi4py shows one."""

    made = 0

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Bcast_init(self, *args, **kwargs):
        self.made += 1
        raise NotImplementedError("MPI_Bcast_init")

    Allgather_init = Bcast_init


def test_persistent_collectives_run_from_c_on_mpis_own_request():
    """The C half (`_persistent`) starts and waits on the request inside mpi4py's own
    object through the MPI library mpi4py loaded: on one process (MPI.COMM_SELF) the
    data goes through its buffers, a tensor's planned call keeps its request, and a
    closed request is freed in MPI and never run again."""
    import numpy as np
    import torch
    from mpi4py import MPI
    from mpilab.rank.persistent import Persistent

    waits = []
    ways = Persistent(MPI.COMM_SELF, wait=waits.append)
    data = np.arange(16, dtype=np.uint8)
    assert ways.broadcast(data, 0)
    got = np.zeros(64, np.uint8)
    assert ways.allgather(np.arange(64, dtype=np.uint8), got)
    assert np.array_equal(got, np.arange(64, dtype=np.uint8))
    tensor, out = torch.arange(8, dtype=torch.float32), torch.zeros(1, 8)
    gather = ways.small_allgather(tensor.data_ptr(), 32, fallback=None)
    for _ in range(3):
        out.zero_()
        gather(out.data_ptr())
        assert torch.equal(out[0], tensor)
    assert sorted(ways._kept) == [("allgather", 32), ("allgather", 64), ("broadcast", 16, 0)]
    kept = list(ways._kept.values())
    requests = [k.request for k in kept]
    ways.close()
    assert not any(k.alive for k in kept) and all(r == MPI.REQUEST_NULL for r in requests)
    with pytest.raises(RuntimeError, match="closed persistent request"):
        kept[0].run(None, None, waits.append)
    gather(out.data_ptr())  # made again at the next call
    assert torch.equal(out[0], tensor) and len(ways._kept) == 1
    ways.close()
    assert waits == []  # each completed within the spin


def test_persistent_collectives_step_aside_for_large_messages_and_older_mpi():
    """A broadcast or allgather that the persistent way does not take returns False with
    nothing done, so the caller's own way runs: above its sizes, and on an MPI before
    version 4 (asked once, not at every call)."""
    import numpy as np
    from mpilab.rank.persistent import ALLGATHER_MAX_BYTES, BROADCAST_MAX_BYTES, Persistent

    comm = _CommBeforeMPI4()
    ways = Persistent(comm, wait=lambda request: None)
    assert not ways.broadcast(np.zeros(BROADCAST_MAX_BYTES + 1, np.uint8), 0)
    assert not ways.allgather(np.zeros(ALLGATHER_MAX_BYTES // 2 + 1, np.uint8),
                              np.zeros(ALLGATHER_MAX_BYTES + 2, np.uint8))
    assert comm.made == 0
    for _ in range(3):
        assert not ways.broadcast(np.zeros(16, np.uint8), 0)
        assert not ways.allgather(np.zeros(16, np.uint8), np.zeros(32, np.uint8))
    assert comm.made == 1

"""Engines forked by their host's spawner (torch imported once per host, where a host
runs more ranks than it has cores): each rank is a process of its own with its own
random streams, a rank whose supervisor goes takes its engine along, and the spawner
ends with the last of them. MPILAB_SPAWNER=1 asks for it on this 2-core machine's 2
ranks; MPILAB_SPAWNER=0 starts each engine as a fresh interpreter even where the ranks
outnumber the cores."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import psutil
import pytest
from conftest import cluster_pids
from kernel import Kernel

WHO = """%%ranks
import json, os, random, psutil
import numpy as np
parent = psutil.Process(os.getppid())
print(json.dumps({"rank": rank, "parent": parent.pid, "command": parent.cmdline()[1:3],
                  "name": psutil.Process().name(), "draws": [random.random(),
                  float(np.random.random())]}))
"""


def who(kernel) -> list[dict]:
    run = kernel.run(WHO)
    assert run.ok, run.text
    return [json.loads(line.split("] ", 1)[1]) for line in run.stdout.splitlines()
            if line.startswith("[rank")]


@pytest.fixture(scope="module")
def spawned():
    """A kernel whose 2 ranks are forks of one spawner."""
    kernel = Kernel(env={"MPILAB_SPAWNER": "1"})
    try:
        assert kernel.run("%load_ext mpilab").ok
        started = kernel.run("%mpilab start -n 2", timeout=180)
        assert started.ok, started.text
        yield kernel
        kernel.run("%mpilab stop", timeout=120)
    finally:
        kernel.shutdown()


def test_ranks_of_a_host_are_forks_of_one_spawner_with_their_own_random_streams(spawned):
    found = who(spawned)
    assert sorted(r["rank"] for r in found) == [0, 1], found
    assert len({r["parent"] for r in found}) == 1, found
    assert all(r["command"] == ["-m", "mpilab.rank.spawner"] for r in found), found
    assert all(r["name"] == "mpilab-engine" for r in found), found
    assert found[0]["draws"][0] != found[1]["draws"][0], found  # Python's stream
    assert found[0]["draws"][1] != found[1]["draws"][1], found  # NumPy's global one


def test_a_supervisor_killed_takes_its_engine_and_the_spawner_along(spawned):
    engines = cluster_pids(spawned)["engines"]
    spawner = psutil.Process(engines[0]).parent()
    supervisors = [p for p in psutil.Process(spawned.pid).children(recursive=True)
                   if p.cmdline()[1:3] == ["-m", "mpilab.rank.supervisor"]]
    assert len(supervisors) == 2, supervisors
    watched = [psutil.Process(pid) for pid in engines] + [spawner]
    try:
        os.kill(supervisors[1].pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(watched, timeout=15)
        assert not alive, [p.cmdline()[:3] for p in alive]
    finally:
        assert spawned.run("%mpilab stop", timeout=120).ok


def test_a_forked_engine_runs_on_the_cores_its_rank_was_bound_to(tmp_path):
    """A launcher that binds ranks to cores (`mpiexec -bind-to core`, Slurm's
    --cpu-bind) binds their supervisors; each engine forked by the spawner (which is the
    first supervisor's child, bound to its core) runs where its own rank was bound."""
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f'#!/bin/sh\nexec {Path(sys.executable).parent / "mpiexec"} '
                       '-bind-to core "$@"\n')
    mpiexec.chmod(0o755)
    kernel = Kernel(env={"MPILAB_SPAWNER": "1"})
    try:
        assert kernel.run("%load_ext mpilab").ok
        started = kernel.run(f"%mpilab start -n 2 --mpiexec {mpiexec}", timeout=180)
        assert started.ok, started.text
        run = kernel.run("%%ranks\nimport json, os, psutil\nprint(json.dumps({'rank': rank, "
                         "'cpus': sorted(os.sched_getaffinity(0)), "
                         "'parent': psutil.Process(os.getppid()).cmdline()[1:3]}))")
        assert run.ok, run.text
        found = [json.loads(line.split("] ", 1)[1]) for line in run.stdout.splitlines()
                 if line.startswith("[rank")]
        assert all(r["parent"] == ["-m", "mpilab.rank.spawner"] for r in found), found
        assert sorted(r["cpus"] for r in found) == [[0], [1]], found
        assert kernel.run("%mpilab stop", timeout=120).ok
    finally:
        kernel.shutdown()


def test_turned_off_each_engine_is_its_supervisors_child_where_ranks_outnumber_cores():
    kernel = Kernel(env={"MPILAB_SPAWNER": "0"})
    try:
        assert kernel.run("%load_ext mpilab").ok
        started = kernel.run("%mpilab start -n 3", timeout=180)  # 3 ranks, 2 cores
        assert started.ok, started.text
        # and the start says what that costs
        assert " runs 3 ranks on 2 cores: the ranks take turns on the cores, so ranks past 2 " \
            "a host add no speed (fine for trying code, not for timing it)" in started.stdout, \
            started.text
        found = who(kernel)
        assert len({r["parent"] for r in found}) == 3, found
        assert all(r["command"] == ["-m", "mpilab.rank.supervisor"] for r in found), found
        assert kernel.run("%mpilab stop", timeout=120).ok
    finally:
        kernel.shutdown()


def test_a_spawner_serves_hosts_whose_ranks_outnumber_their_cores():
    from mpilab.rank.spawner import wanted

    assert wanted({"MPI_LOCALNRANKS": "16"}, cores=2)
    assert not wanted({"MPI_LOCALNRANKS": "2"}, cores=2)  # a core each: side by side
    assert wanted({"MPI_LOCALNRANKS": "2", "MPILAB_SPAWNER": "1"}, cores=2)
    assert not wanted({"MPI_LOCALNRANKS": "1", "MPILAB_SPAWNER": "1"}, cores=2)
    assert not wanted({"MPI_LOCALNRANKS": "16", "MPILAB_SPAWNER": "0"}, cores=2)
    assert not wanted({}, cores=1)  # not started by MPICH's hydra: nothing says how many
    assert not wanted({"MPI_LOCALNRANKS": "many"}, cores=1)


def test_a_request_crosses_whole_with_its_descriptors(tmp_path):
    import socket

    from mpilab.rank.spawner import _receive, _send

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    marker = tmp_path / "passed"
    marker.write_text("through the socket")
    env = {f"VAR{i}": "x" * 100 for i in range(2000)}  # ~200 KB: several reads
    got = []
    with open(marker) as f, left, right:
        reader = threading.Thread(target=lambda: got.append(_receive(right)))
        reader.start()
        _send(left, {"env": env, "fds": [7]}, [f.fileno()])
        reader.join(10)
        message, fds = got[0]
        assert message == {"env": env, "fds": [7]}
        assert len(fds) == 1
        with open(fds[0]) as passed:
            assert passed.read() == "through the socket"


def test_a_spawner_nobody_asks_ends_by_itself(monkeypatch):
    """Its supervisors gone before they asked (mpiexec ended during the imports): the
    spawner does not outlive them."""
    import socket

    from mpilab.rank import spawner

    monkeypatch.setattr(spawner, "IDLE_S", 0.3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0mpilab-test-idle-{os.getpid()}".encode())
    listener.listen()
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.connect(listener.getsockname())
    left.close()  # a supervisor that connected and went without asking
    serving = threading.Thread(target=spawner.Spawner(listener).run)
    serving.start()
    serving.join(10)
    assert not serving.is_alive()
    listener.close()


def test_a_spawner_that_cannot_fork_engines_refuses_and_the_rank_starts_its_own(monkeypatch):
    """Where an import initialised CUDA (a fork could not use it) the spawner answers
    every request with a refusal: each supervisor then starts its engine itself at once,
    instead of asking again, and the spawner ends once they have gone."""
    import socket
    import time

    from mpilab.rank import spawner

    name = f"\0mpilab-test-refuse-{os.getpid()}".encode()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen()
    monkeypatch.setattr(spawner, "socket_name", lambda: name)
    serving = threading.Thread(target=spawner.Spawner(listener, "CUDA is initialised").run)
    serving.start()
    asked = time.monotonic()
    assert spawner.spawn(["--never-run"]) is None
    assert time.monotonic() - asked < 2  # no asking again until CONNECT_S runs out
    serving.join(10)
    assert not serving.is_alive()
    listener.close()


def test_a_rank_bound_to_cpus_the_spawner_may_not_use_starts_its_own(monkeypatch):
    """A cgroup can confine the spawner to other CPUs than a rank was bound to: that
    rank's request is refused (its supervisor starts the engine itself) rather than
    answered with an engine on the wrong CPUs."""
    import socket

    from mpilab.rank import spawner

    name = f"\0mpilab-test-cpus-{os.getpid()}".encode()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen()
    monkeypatch.setattr(spawner, "socket_name", lambda: name)
    serving = threading.Thread(target=spawner.Spawner(listener).run)
    serving.start()
    # the supervisor was bound to a CPU this machine does not have
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4095})
    assert spawner.spawn(["--never-run"]) is None
    serving.join(10)
    assert not serving.is_alive()
    listener.close()

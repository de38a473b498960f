"""Ranks on several hosts: mpiexec over ssh and Slurm, on the emulated cluster.

The hosts are network, UTS and PID namespaces on this machine (tests/cluster.py) running
a real sshd and a real slurmd; the notebook kernel runs on the head side (in one test
on node1, beside ranks of its own). These tests
prove real daemons and real TCP between namespaces; not real NICs, not InfiniBand.
One cluster of ranks is shared by the tests of each launcher where state allows.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from kernel import Kernel
from listeners import is_hydra, listeners_of, listeners_of_pids

REPO = Path(__file__).resolve().parents[1]
NODES = ("node1", "node2")

pytestmark = pytest.mark.timeout(600)

CHECK_CELL = """\
%%ranks
import socket, torch
t = torch.full((3,), float(rank))
dist.all_reduce(t)
x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(rank))
mpilab.allreduce(x)
from mpilab.rank.collectives import private_comm
from mpilab.rank.fast_allreduce import plan_for
import hashlib
digest = hashlib.sha1(x.numpy().tobytes()).hexdigest()
print(socket.gethostname(), t.tolist(), comm.allreduce(rank),
      plan_for(private_comm()).path, len(set(comm.allgather(digest))))
"""

DIGITS_SETUP = """\
%%ranks
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset
digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    digits.images / 16.0, digits.target, test_size=0.25, random_state=0,
    stratify=digits.target)
def as_dataset(images, labels):
    return TensorDataset(torch.tensor(images, dtype=torch.float32).unsqueeze(1),
                         torch.tensor(labels))
train_set, test_set = as_dataset(x_train, y_train), as_dataset(x_test, y_test)
def train_and_score(backend, epochs=10):
    # notebooks/02_data_parallel's model and global batch (64) as on one node
    torch.manual_seed(0)
    model = mpilab.DataParallel(nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10)), backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = mpilab.shard(train_set, batch_size=64 // world_size, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    counts = torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        for x, y in mpilab.shard(test_set, batch_size=128, shuffle=False):
            counts += torch.tensor([int((model(x).argmax(1) == y).sum()), len(y)])
    mpilab.allreduce(counts)
    return counts[0].item() / counts[1].item()
"""


RANK_PROCESSES = ("mpilab.rank", "ipyparallel", "hydra_pmi_proxy", "mpiexec")


def node_processes(cluster, node: str) -> dict[int, str]:
    """What the ranks left on a node: engines, their supervisors, hydra's proxies (the
    node's own init, sshd and slurmd are not counted)."""
    users = set(cluster.user_pids_on(node))
    return {pid: cmd for pid, cmd in cluster.processes_on(node).items()
            if pid in users and any(what in cmd for what in RANK_PROCESSES)}


def wait_nothing_left(cluster, timeout: float) -> dict[str, dict[int, str]]:
    deadline = time.monotonic() + timeout
    while True:
        left = {n: p for n in NODES if (p := node_processes(cluster, n))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def stopped(kernel: Kernel, code: str, after_s: float, timeout: float = 120):
    """Run `code` and press the stop button `after_s` into it: the run, and how long the
    cell took."""
    started = time.monotonic()
    run = kernel.run(code, timeout=timeout, interrupt_after=after_s)
    return run, time.monotonic() - started


@contextlib.contextmanager
def hidden_on(cluster, node: str, path) -> Iterator[None]:
    """`path` an empty folder on `node` alone (a tmpfs over it among that node's mounts):
    a host that lacks what the notebook's host has there."""
    cluster.run_on(node, ["mount", "-t", "tmpfs", "none", str(path)], check=True)
    try:
        yield
    finally:
        cluster.run_on(node, ["umount", str(path)], check=True)


def start_in(kernel: Kernel, folder, options: str, timeout: float = 200):
    """`%mpilab start options` with the notebook in `folder`; back where it was after."""
    return kernel.run(
        f"import os\n_back = os.getcwd()\nos.chdir({str(folder)!r})\n"
        f"try:\n    get_ipython().run_line_magic('mpilab', {('start ' + options)!r})\n"
        "finally:\n    os.chdir(_back)", timeout=timeout)


LACKING = ("environment", "mpilab", "folder")  # what a host may lack that the ranks need


def node2_lacking(lacks: str, project: Path) -> tuple[Path, str]:
    """What to hide on node2 so that it lacks `lacks` (the notebook working in `project`),
    and the pattern of what the user is then told, the host's name as {host}."""
    prefix = re.escape(sys.prefix)
    if lacks == "environment":
        return Path(sys.prefix), (
            rf"{{host}} has no {prefix}/bin/hydra_pmi_proxy: the ranks run this kernel's "
            rf"Python environment \({prefix}\) at the same path on every host; install it "
            "there, or keep it on a file system every host shares")
    if lacks == "mpilab":  # the package's own folder: an editable install's source, or not
        package = Path(importlib.util.find_spec("mpilab").origin).parent
        return package, (rf"on {{host}}, {prefix}/bin/python3? cannot import mpilab: install "
                         "mpilab in that environment there")
    return project.parent, (rf"{{host}} has no folder {re.escape(str(project))}, this "
                            "notebook's folder, where mpiexec starts the ranks: `%cd` to a "
                            "folder every host shares")


def told_what_node2_lacks(run, pattern: str, host: str) -> bool:
    """The start failed with one line that names the host and what it lacks."""
    error = run.text.split("UsageError: ")[-1].strip()
    return (len(error.splitlines()) == 1 and "Traceback" not in run.text and re.match(
        r"the ranks did not start \(.*?\): " + pattern.replace("{host}", re.escape(host)),
        error) is not None)


def rank_lines(run) -> list[str]:
    return [line for line in run.stdout.splitlines() if line.startswith("[rank")]


@contextlib.contextmanager
def allocation(cluster, one_task: bool = False) -> Iterator[tuple[str, dict[str, str]]]:
    """salloc's allocation of 2 nodes, 2 tasks each (or of one task with node1's 2 CPUs,
    as JupyterHub's batchspawner asks for), as `salloc --no-shell` makes it: its job id
    and the variables a shell inside it has (the kernel's environment)."""
    shape = ["-N", "1", "-n", "1", "-c", "2", "-w", "node1"] if one_task else \
        ["-N", "2", "-n", "4", "--ntasks-per-node", "2"]
    out = cluster.slurm_cmd("salloc", "--no-shell", *shape, "-t", "10").stderr
    job = next(w for w in out.split() if w.isdigit())
    held = {"SLURM_JOB_NODELIST": "node1", "SLURM_NODELIST": "node1", "SLURM_NNODES": "1",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1", "SLURM_NPROCS": "1",
            "SLURM_TASKS_PER_NODE": "1", "SLURM_CPUS_PER_TASK": "2",
            "SLURM_JOB_CPUS_PER_NODE": "2"} if one_task else \
        {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NODELIST": "node[1-2]",
         "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4",
         "SLURM_NPROCS": "4", "SLURM_TASKS_PER_NODE": "2(x2)",
         "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}
    try:
        yield job, {**cluster.env(), "SLURM_JOB_ID": job, "SLURM_JOBID": job, **held}
    finally:
        cluster.slurm_cmd("scancel", job, check=False)


def steps_named(cluster, job: str) -> dict[str, str]:
    """The steps of `job`: id to name."""
    out = cluster.slurm_cmd("squeue", "-h", "--steps", "-j", job, "-o", "%i %j").stdout
    return dict(row.split(maxsplit=1) for row in out.splitlines() if row.strip())


def named_step(cluster, job: str, name: str, nodes: int = 1,
               overlap: bool = True) -> tuple[subprocess.Popen, str]:
    """A step in `job` named `name` on `nodes` nodes, run by an srun of its own session
    (as an srun left by an mpiexec that died is; without `overlap` it holds the nodes'
    CPUs, as a user's own srun does): the srun, and the step's id."""
    before = steps_named(cluster, job)
    srun = subprocess.Popen(["srun", f"--jobid={job}", "-N", str(nodes), "-n", str(nodes),
                             *(["--overlap"] if overlap else []), f"--job-name={name}",
                             "sleep", "300"],
                            env=cluster.slurm_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not (new := steps_named(cluster, job).keys() - before.keys()):
        assert time.monotonic() < deadline, "srun's step did not appear"
        time.sleep(0.2)
    return srun, new.pop()


def mpilab_steps(cluster, job: str) -> dict[str, str]:
    """The steps of `job` that mpilab's starts named: id to name."""
    return {i: n for i, n in steps_named(cluster, job).items() if n.startswith("mpilab-")}


# -- mpiexec over ssh --------------------------------------------------------------------
@pytest.fixture(scope="module")
def ssh_kernel(emulated_cluster):
    kernel = Kernel(env=emulated_cluster.env())
    assert kernel.run("%load_ext mpilab").ok
    yield kernel
    kernel.run("%mpilab stop", timeout=120)
    kernel.shutdown()
    assert not wait_nothing_left(emulated_cluster, 15)


@pytest.fixture(scope="module")
def hostfile(emulated_cluster) -> Path:
    return emulated_cluster.hostfile(slots_per_node=2, nodes=NODES)


START_LINES: dict[str, str] = {}  # launcher -> the latest start line


@pytest.fixture
def ssh_ranks(ssh_kernel, hostfile):
    """4 ranks, 2 on each of node1 and node2, started once and reused while they live."""
    status = ssh_kernel.run("from mpilab.session import Session\n"
                            "print(Session.instance().cluster.running and "
                            "not Session.instance().cluster.dead)")
    if status.stdout.strip() != "True":
        ssh_kernel.run("%mpilab stop", timeout=120)
        run = ssh_kernel.run(f"%mpilab start -n 4 --hostfile {hostfile}", timeout=240)
        assert run.ok, run.text
        START_LINES["ssh"] = run.stdout
    return ssh_kernel


def test_ssh_start_names_both_hosts_and_every_rank_answers(ssh_ranks):
    assert "4 ranks on node1, node2" in START_LINES["ssh"]
    status = ssh_ranks.run("%mpilab status")
    assert status.ok, status.text
    for node in NODES:
        assert status.text.count(node) >= 2, status.text
    run = ssh_ranks.run(CHECK_CELL, timeout=120)
    assert run.ok, run.text
    # [ranks 0-1] node1 [6.0, 6.0, 6.0] 6 hierarchical 1
    assert "[ranks 0-1] node1 [6.0, 6.0, 6.0] 6 hierarchical 1" in run.stdout, run.text
    assert "[ranks 2-3] node2 [6.0, 6.0, 6.0] 6 hierarchical 1" in run.stdout, run.text


def test_ssh_broadcast_and_allgather_between_hosts_are_right_and_not_slow(ssh_ranks):
    """mpilab.broadcast from every root (on either host) and mpilab.allgather deliver
    every rank's data; a megabyte between the hosts takes a few times mpi4py's blocking
    call at most (a wait that slept between MPI's progress steps took 30 times as long)."""
    code = ("%%ranks\nimport time, numpy as np, torch\nok = True\n"
            "for root in range(4):\n"
            "    for n in (3, 1 << 18, 1 << 20):\n"
            "        t = torch.full((n,), float(rank))\n"
            "        mpilab.broadcast(t, root=root)\n"
            "        ok = ok and bool((t == root).all())\n"
            "        g = mpilab.allgather(torch.full((n,), float(rank + root)))\n"
            "        ok = ok and all(bool((g[r] == r + root).all()) for r in range(4))\n"
            "x = (torch.arange(15.).reshape(3, 5) + 100 * rank).t()  # not contiguous\n"
            "mpilab.broadcast(x, root=2)\n"
            "ok = ok and torch.equal(x, (torch.arange(15.).reshape(3, 5) + 200).t())\n"
            "t, a = torch.zeros(1 << 18), np.zeros(1 << 18, dtype=np.float32)\n"
            "def took(call):\n"
            "    comm.Barrier()\n"
            "    began = time.perf_counter()\n"
            "    for _ in range(10):\n"
            "        call()\n"
            "    return comm.allreduce(time.perf_counter() - began, op=MPI.MAX)\n"
            "from mpi4py import MPI\n"
            "ours = min(took(lambda: mpilab.broadcast(t, root=1)) for _ in range(3))\n"
            "theirs = min(took(lambda: comm.Bcast(a, root=1)) for _ in range(3))\n"
            "print(ok, ours < 4 * theirs + 0.01, f'{ours:.4f} {theirs:.4f}')")
    run = ssh_ranks.run(code, timeout=180)
    assert run.ok, run.text
    assert all(line.split()[2:4] == ["True", "True"] for line in rank_lines(run)), run.text


def test_ssh_a_broadcast_that_a_failed_rank_never_began_is_not_taken_by_its_next_one(
        ssh_ranks):
    """Rank 3, on node2, raises before a small broadcast that the others finish without
    it (a leaf of the broadcast's tree: no rank waits for it). The cell names the error
    and says the ranks ended at different collectives; the next broadcasts deliver their
    own data on every rank (left out of step, rank 3 took the missed one's, and each
    later one a call late). The same for a cell run on the root alone."""
    run = ssh_ranks.run("%%ranks\nimport torch\nif rank == 3:\n"
                        "    raise ValueError('not this time')\n"
                        "mpilab.broadcast(torch.full((4,), 10.0), root=0)")
    assert not run.ok and "ValueError: not this time" in run.text, run.text
    assert re.search(r"the ranks ended the cell at different collectives \(#\d+ on "
                     r"ranks 0-2, #\d+ on rank 3\): the communicators were made again",
                     run.text), run.text
    for value in (100.0, 101.0):
        after = ssh_ranks.run(f"%%ranks\nx = torch.full((4,), {value} if rank == 0 else 0.)\n"
                              "mpilab.broadcast(x, root=0)\nprint(x.tolist())")
        assert after.ok and f"[ranks 0-3] {[value] * 4}" in after.stdout, after.text
    # the same from a cell run on rank 0 alone: the root finishes, no one else began
    alone = ssh_ranks.run("%%ranks 0\nmpilab.broadcast(torch.full((4,), 10.0), root=0)")
    assert re.search(r"the ranks ended the cell at different collectives \(#\d+ on "
                     r"rank 0, #\d+ on ranks 1-3\): .*; a collective takes every rank: "
                     r"run it on all of them \(`%%ranks`\)", alone.text), alone.text
    after = ssh_ranks.run("%%ranks\nx = torch.full((4,), 7.0 if rank == 0 else 0.)\n"
                          "mpilab.broadcast(x, root=0)\nprint(x.tolist())")
    assert after.ok and f"[ranks 0-3] {[7.0] * 4}" in after.stdout, after.text


def test_ssh_a_rank_on_node2_asks_the_notebook_for_input(ssh_ranks):
    # its question crosses to the notebook as its records do: rank 2's socket connects to it
    run = ssh_ranks.run("%%ranks\nimport socket\nif rank == 2:\n"
                        "    print(socket.gethostname(), input('which host? '))",
                        answers=["the second"], timeout=120)
    assert run.ok, run.text
    assert run.prompts == ["[rank 2] which host? "]
    assert "[rank 2] node2 the second" in run.stdout, run.text


def test_ssh_ranks_listen_on_the_cluster_network_only(ssh_ranks, emulated_cluster):
    run = ssh_ranks.run(CHECK_CELL, timeout=120)
    assert run.ok, run.text
    head = emulated_cluster.head_address
    outside = [x for x in listeners_of(ssh_ranks.pid) if x.ip not in (head, "127.0.0.1")]
    assert all(is_hydra(x) for x in outside), outside
    for node in NODES:
        assert_listens_on_its_network_only(emulated_cluster, node)


def assert_listens_on_its_network_only(cluster, node: str) -> None:
    """What the ranks run on `node` listens on that host's address on the cluster
    network or its loopback, but hydra's control port (it binds every interface); the
    ranks themselves do listen (the check sees them)."""
    address = cluster.node(node).address
    found = listeners_of_pids(node_processes(cluster, node))
    assert any("mpilab.rank" in x.command for x in found), found
    bad = [x for x in found if x.ip not in (address, "127.0.0.1") and not is_hydra(x)]
    assert not bad, f"on {node}: {bad}"


def test_ssh_data_parallel_on_digits_both_backends(ssh_ranks):
    assert ssh_ranks.run(DIGITS_SETUP, timeout=120).ok
    run = ssh_ranks.run("%%ranks\nfor b in ('mpi', 'torch'):\n"
                        "    acc = train_and_score(b)\n"
                        "    print(b, acc >= 0.95, f'{acc:.3f}')", timeout=400)
    assert run.ok, run.text
    assert "[ranks 0-3] mpi True" in run.stdout and "[ranks 0-3] torch True" in run.stdout, \
        run.text


def test_ssh_a_torchrun_script_runs_across_the_hosts_as_torchrun_would_start_it(
        ssh_ranks, emulated_cluster):
    """torchrun's variables as on two nodes (a node's index, its local ranks) and the
    store at rank 0's address on the hosts' network; a DDP script run with `%run` uses
    them and trains over both hosts."""
    run = ssh_ranks.run(
        "%%ranks\nimport json, os, socket\n"
        "keys = ['RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'GROUP_WORLD_SIZE',"
        " 'WORLD_SIZE', 'MASTER_ADDR']\n"
        "print(json.dumps([socket.gethostname()] + [os.environ[k] for k in keys]))")
    assert run.ok, run.text
    rows = {int(rank): json.loads(line)
            for rank, line in re.findall(r"^\[rank (\d)\] (.*)$", run.stdout, re.M)}
    node1 = emulated_cluster.addresses["node1"]  # rank 0's host, on the hosts' network
    assert rows == {0: ["node1", "0", "0", "2", "0", "2", "4", node1],
                    1: ["node1", "1", "1", "2", "0", "2", "4", node1],
                    2: ["node2", "2", "0", "2", "1", "2", "4", node1],
                    3: ["node2", "3", "1", "2", "1", "2", "4", node1]}, run.text
    script = REPO / "tests" / "torchrun_scripts" / "train.py"
    run = ssh_ranks.run(f"%%ranks\n%run {script} --epochs 2 --samples 256", timeout=200)
    assert run.ok, run.text
    epochs = re.findall(r"\[rank 0\] epoch (\d): loss [\d.]+, every sample once: True",
                        run.stdout)
    assert epochs == ["0", "1"], run.text


def test_ssh_rank_failure_on_node2_releases_node1(ssh_ranks):
    code = ("%%ranks\nimport torch\nkept = 41 + 1\n"
            "if rank == 3:\n    raise ValueError('bad batch on node2')\n"
            "mpilab.allreduce(torch.ones(4))")
    started = time.monotonic()
    run = ssh_ranks.run(code, timeout=120)
    assert time.monotonic() - started < 10, run.text
    assert "ValueError: bad batch on node2" in run.text
    assert "when rank 3 failed" in run.text, run.text
    after = ssh_ranks.run("%%ranks\nprint(kept)")
    assert after.ok and "[ranks 0-3] 42" in after.stdout, after.text


def test_ssh_the_stop_button_interrupts_the_ranks_on_both_hosts(ssh_ranks):
    """The stop button reaches every rank through its nanny, on either host: node2's ranks
    asleep, node1's waiting in a collective for them. Every rank is interrupted within
    seconds and keeps its state."""
    code = ("%%ranks\nimport time, torch\nkept = 40 + 3\n"
            "if rank >= 2:\n    time.sleep(60)\nmpilab.allreduce(torch.ones(4))\nprint('never')")
    run, took = stopped(ssh_ranks, code, after_s=2.0)
    assert not run.ok and took < 10, (took, run.text)
    for r in range(4):
        assert f"[rank {r}] interrupted" in run.error_text, run.text
    assert "never" not in run.text and "restarted" not in run.text, run.text
    after = ssh_ranks.run("%%ranks\nx = torch.ones(1)\nmpilab.allreduce(x)\n"
                          "print(kept, int(x))")
    assert after.ok and "[ranks 0-3] 43 4" in after.stdout, after.text
    # a small allgather or broadcast goes by a persistent MPI request, which the stop
    # leaves started on node1 and never complete: the next ones are right all the same
    code = ("%%ranks\nimport time, torch\nif rank >= 2:\n    time.sleep(60)\n"
            "mpilab.allgather(torch.ones(4))\nprint('never')")
    run, took = stopped(ssh_ranks, code, after_s=2.0)
    assert not run.ok and took < 10 and "never" not in run.text, (took, run.text)
    after = ssh_ranks.run("%%ranks\nx = torch.full((4,), float(rank))\n"
                          "mpilab.broadcast(x, root=2)\n"
                          "g = mpilab.allgather(torch.ones(4) * rank)\n"
                          "print(kept, x.tolist(), g[:, 0].tolist())")
    assert after.ok and "[ranks 0-3] 43 [2.0, 2.0, 2.0, 2.0] [0.0, 1.0, 2.0, 3.0]" in \
        after.stdout, after.text


def test_ssh_the_stop_button_with_a_rank_in_a_blocking_call_on_node2_restarts_all(ssh_ranks):
    """Rank 3, on node2, in a blocking MPI receive no interrupt reaches: the stop button
    names it and restarts every rank on both hosts, in one report, within seconds."""
    code = ("%%ranks\nfrom mpi4py import MPI\nimport numpy as np\nif rank == 3:\n"
            "    MPI.COMM_WORLD.Recv(np.zeros(1), source=0, tag=5)  # nothing is sent")
    run, took = stopped(ssh_ranks, code, after_s=1.5, timeout=180)
    assert not run.ok and took < 40, (took, run.text)
    assert "Traceback" not in run.text, run.text
    assert "rank 3 was at cell line 4: MPI.COMM_WORLD.Recv" in run.text and \
        "restarted the ranks: their state was lost" in run.text, run.text
    again = ssh_ranks.run("%%ranks\nimport socket, torch\nx = torch.ones(1)\n"
                          "mpilab.allreduce(x)\nprint(socket.gethostname(), int(x))")
    assert again.ok, again.text
    assert "[ranks 0-1] node1 4" in again.stdout and "[ranks 2-3] node2 4" in again.stdout, \
        again.text


def test_ssh_killed_rank_on_node2_is_named_then_restart(ssh_ranks, emulated_cluster):
    pids = ssh_ranks.run("%%ranks\nimport os\nprint(os.getpid())")
    assert pids.ok
    code = "%%ranks\nimport os, signal, time\nif rank == 2:\n    os.kill(os.getpid(), " \
           "signal.SIGKILL)\ntime.sleep(30)"
    started = time.monotonic()
    run = ssh_ranks.run(code, timeout=120)
    took = time.monotonic() - started
    assert "rank 2 (pid" in run.text and "on node2) died: killed by signal 9" in run.text, \
        run.text
    assert took < 5, f"{took:.1f} s"
    restarted = ssh_ranks.run("%mpilab restart", timeout=240)
    assert restarted.ok and "4 ranks on node1, node2" in restarted.stdout, restarted.text
    again = ssh_ranks.run("%%ranks\nprint(rank)")
    assert again.ok and len(rank_lines(again)) == 4, again.text


def test_ssh_node2_cut_off_is_named_and_stop_leaves_nothing(ssh_ranks, emulated_cluster):
    try:
        # the ranks are busy in collectives when the link goes (a restart before this
        # test leaves a namespace without torch)
        ssh_ranks.run("%%ranks --noblock\nimport time, torch\nfor i in range(600):\n"
                      "    time.sleep(0.1)\n    mpilab.allreduce(torch.ones(2))")
        time.sleep(2)
        emulated_cluster.link_down("node2")
        started = time.monotonic()
        run = ssh_ranks.run("%%ranks\nprint('next')", timeout=120)
        text = run.text + "".join(
            str(m["content"]) for m in ssh_ranks.collect_iopub(0))
        assert "rank 2" in text and "rank 3" in text and "node2" in text, text
        assert "cannot be reached" in text or "no heartbeat" in text, text
        assert time.monotonic() - started < 60
        stopped = ssh_ranks.run("%mpilab stop", timeout=120)
        assert stopped.ok, stopped.text
        # node2 cannot hear the stop; its supervisors give up on the silent notebook
        left = wait_nothing_left(emulated_cluster, 30)
        assert not left, left
    finally:
        emulated_cluster.link_up("node2")


def test_batch_job_under_mpiexec_with_a_hostfile(emulated_cluster, hostfile, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import socket, torch, mpilab\n"
        "ctx = mpilab.init()\n"
        "model = mpilab.DataParallel(torch.nn.Linear(8, 1))\n"
        "model(torch.ones(4, 8)).sum().backward()\n"
        "x = mpilab.allreduce(torch.ones(3))\n"
        # one write per line: print's pieces may reach mpiexec apart when unbuffered
        "print(f'{ctx.rank} {socket.gethostname()} {x.tolist()}', flush=True)\n")
    mpiexec = str(REPO / ".venv/bin/mpiexec")
    done = subprocess.run([mpiexec, "-f", str(hostfile), "-n", "4", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, **emulated_cluster.env()})
    assert done.returncode == 0, done.stderr[-2000:]
    # the ranks' lines may interleave in mpiexec's output: read each rank's report
    found = sorted(re.findall(r"(\d) (node\d) \[4\.0, 4\.0, 4\.0\]", done.stdout))
    assert found == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")], \
        done.stdout


def test_batch_job_whose_rank_on_node2_raises_ends_on_both_hosts(emulated_cluster, hostfile,
                                                                  tmp_path):
    """A rank of a batch job raises on node2 while the ranks on both hosts wait for it in
    an allreduce: the job ends within seconds with its traceback and one line, and
    nothing is left on either host (it hung until killed)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import socket, torch, mpilab\n"
        "ctx = mpilab.init()\n"
        "x = mpilab.allreduce(torch.ones(3))\n"
        "if ctx.rank == 3:\n"
        "    raise ValueError(f'bad batch on {socket.gethostname()}')\n"
        "mpilab.allreduce(x)\n")
    mpiexec = str(REPO / ".venv/bin/mpiexec")
    started = time.monotonic()
    done = subprocess.run([mpiexec, "-f", str(hostfile), "-n", "4", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **emulated_cluster.env()})
    assert done.returncode == 1, done.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "ValueError: bad batch on node2" in done.stderr, done.stderr[-3000:]
    assert "mpilab: rank 3 ended with ValueError: ending all 4 ranks" in done.stderr
    assert not wait_nothing_left(emulated_cluster, timeout=10)


def test_batch_job_whose_collective_can_never_complete_across_hosts_is_named(
        emulated_cluster, hostfile, tmp_path):
    """Three ways a batch job's collective never completes across node1 and node2: the
    ranks on node2 ran out of data a step early (their script ended while node1's ranks
    wait for them in DataParallel's allreduce, or in torch's own DDP), and ranks in
    different collectives at the same point. MPI shows nothing between hosts, and each
    job waited for good (torch's DDP for the 30-minute collective timeout); each now
    ends within seconds with one line naming the ranks, and leaves nothing on either
    host."""
    uneven = tmp_path / "uneven.py"
    uneven.write_text(
        "import torch, mpilab\n"
        "ctx = mpilab.init()\n"
        "model = mpilab.DataParallel(torch.nn.Linear(8, 1))\n"
        "for step in range(3 if ctx.rank < 2 else 2):  # node2's shard is a batch short\n"
        "    model(torch.ones(4, 8)).sum().backward()\n")
    uneven_ddp = tmp_path / "uneven_ddp.py"
    uneven_ddp.write_text(uneven.read_text().replace(
        "mpilab.DataParallel(", "torch.nn.parallel.DistributedDataParallel("))
    mismatched = tmp_path / "mismatched.py"
    mismatched.write_text(
        "import torch, mpilab\n"
        "ctx = mpilab.init()\n"
        "x = mpilab.allreduce(torch.ones(8))\n"
        "if ctx.rank < 2:\n"
        "    mpilab.allreduce(x)\n"
        "else:\n"
        "    mpilab.broadcast(x)\n")
    mpiexec = str(REPO / ".venv/bin/mpiexec")
    said = {}
    for script in (uneven, uneven_ddp, mismatched):
        started = time.monotonic()
        done = subprocess.run([mpiexec, "-f", str(hostfile), "-n", "4", sys.executable,
                               str(script)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **emulated_cluster.env()})
        assert done.returncode == 1, done.stderr[-3000:]
        assert time.monotonic() - started < 60
        # torch's excepthook starts each line of a failed rank with "[rankN]: "
        said[script.stem] = [re.sub(r"^\[rank\d\]: ", "", line)
                             for line in done.stderr.splitlines() if "mpilab:" in line]
        assert not wait_nothing_left(emulated_cluster, timeout=10)
    assert len(said["uneven"]) == 1 and re.fullmatch(
        r"mpilab: rank ([23]) ended the script, but rank [01] waits for it in dp_allreduce "
        r"#(\d+) \([\d,]+ bytes\) that rank \1 never began: ending all 4 ranks",
        said["uneven"][0]), said
    assert len(said["uneven_ddp"]) == 1 and re.fullmatch(
        r"mpilab: rank ([23]) ended the script, but rank [01] waited for it in a "
        r"torch.distributed collective that rank \1 never began: ending all 4 ranks",
        said["uneven_ddp"][0]), said
    assert len(said["mismatched"]) == 1 and re.fullmatch(
        r"mpilab: mismatched collectives: rank [01] in allreduce #(\d+) \(32 bytes\), rank "
        r"[23] in broadcast #\1 \(32 bytes\): every rank must call the same collectives in "
        r"the same order: ending all 4 ranks", said["mismatched"][0]), said


def test_ssh_kernel_killed_ends_every_rank_on_every_node(emulated_cluster, hostfile,
                                                        ssh_kernel):
    assert ssh_kernel.run("%mpilab stop", timeout=120).ok  # its ranks would count as left
    kernel = Kernel(env=emulated_cluster.env())
    try:
        run = kernel.run(f"%load_ext mpilab\n%mpilab start -n 4 --hostfile {hostfile}",
                         timeout=240)
        assert run.ok, run.text
        assert node_processes(emulated_cluster, "node2")
        os.kill(kernel.pid, signal.SIGKILL)
        left = wait_nothing_left(emulated_cluster, 10)
        assert not left, left
    finally:
        kernel.release()


@pytest.mark.parametrize("launcher", ["ssh", "allocation", "step", "pbs"])
def test_a_notebook_on_one_of_the_ranks_hosts(emulated_cluster, hostfile, ssh_kernel,
                                              launcher, tmp_path):
    """JupyterLab on the first node of an allocation (or of a hostfile), ranks on that
    node and the next: the kernel runs on node1 (its namespaces), with 2 ranks beside it
    and 2 on node2. In the allocation a plain `%mpilab start -n 4` goes into it, as
    `mpiexec -n 4` in its shell would; so does `--launcher slurm` from a kernel that srun
    runs in a step of the allocation (`srun --pty jupyter lab`), whose step holds node1's
    CPUs and whose Slurm variables say one task on one node; and in a PBS job (its
    variables and node file, as `qsub -I` gives them; no PBS server here), where
    mpiexec places the ranks by the node file by itself. The ranks answer across the
    hosts, what runs listens on each host's address on the cluster network or its
    loopback, and a killed kernel ends every rank on both."""
    assert ssh_kernel.run("%mpilab stop", timeout=120).ok  # its ranks would count as left
    with contextlib.ExitStack() as stack:
        wrap = emulated_cluster.nsenter_argv("node1", [], cwd=REPO)
        held = ""  # the start line's " in <job>"
        if launcher == "ssh":
            env, start = emulated_cluster.env(), f"--hostfile {hostfile}"
        elif launcher == "pbs":
            nodefile = tmp_path / "7.head"
            nodefile.write_text("node1\nnode1\nnode2\nnode2\n")
            env, start = {**emulated_cluster.env(), "PBS_NODEFILE": str(nodefile),
                          "PBS_JOBID": "7.head", "PBS_ENVIRONMENT": "PBS_INTERACTIVE"}, ""
            held = " in PBS job 7.head"
        else:
            job, env = stack.enter_context(allocation(emulated_cluster))
            start, held = "", f" in Slurm allocation {job}"
            if launcher == "step":
                wrap = ["srun", f"--jobid={job}", "-N", "1", "-n", "1", "-w", "node1",
                        f"--chdir={REPO}"]
                start = "--launcher slurm"
        notebook_on_node1_runs_ranks_there_and_on_node2(emulated_cluster, env, start, wrap,
                                                        held)


def test_a_notebook_server_in_a_one_task_job_step_starts_ranks_on_its_node(
        emulated_cluster, ssh_kernel):
    """JupyterHub's batchspawner: a job of one task with a few CPUs, whose script starts
    the user's server with srun, so the kernel runs in a step that holds the job's CPUs.
    `%mpilab start -n 3` puts the ranks on that node (they overlap the server's step),
    and the stop leaves the job to its server."""
    assert ssh_kernel.run("%mpilab stop", timeout=120).ok  # its ranks would count as left
    with allocation(emulated_cluster, one_task=True) as (job, env):
        env["UCX_TLS"] = "sm,tcp,self"  # every rank on node1, in one PID namespace
        kernel = Kernel(env=env, wrap=["srun", f"--jobid={job}", "-N", "1", "-n", "1",
                                       f"--chdir={REPO}"])
        try:
            run = kernel.run("%load_ext mpilab\n%mpilab start -n 3", timeout=240)
            assert run.ok, run.text
            assert f"3 ranks on node1 in Slurm allocation {job} · " in run.stdout, run.text
            run = kernel.run("%%ranks\nimport socket\n"
                             "print(socket.gethostname(), comm.allreduce(rank))", timeout=120)
            assert run.ok and "[ranks 0-2] node1 3" in run.stdout, run.text
            assert kernel.run("%mpilab stop", timeout=120).ok
            assert not mpilab_steps(emulated_cluster, job)
            assert [j["id"] for j in emulated_cluster.squeue()] == [job]
        finally:
            kernel.run("%mpilab stop", timeout=120)
            kernel.shutdown()
        assert not wait_nothing_left(emulated_cluster, 15)


def notebook_on_node1_runs_ranks_there_and_on_node2(cluster, env: dict[str, str],
                                                    start: str, wrap: list[str],
                                                    held: str) -> None:
    node1 = cluster.node("node1").address
    kernel = Kernel(env=env, wrap=wrap)
    killed = False
    try:
        run = kernel.run(f"%load_ext mpilab\n%mpilab start -n 4 {start}", timeout=240)
        assert run.ok, run.text
        assert f"4 ranks on node1, node2{held} · " in run.stdout, run.text
        run = kernel.run(CHECK_CELL, timeout=120)
        assert run.ok, run.text
        assert "[ranks 0-1] node1 [6.0, 6.0, 6.0] 6 hierarchical 1" in run.stdout, run.text
        assert "[ranks 2-3] node2 [6.0, 6.0, 6.0] 6 hierarchical 1" in run.stdout, run.text
        process = kernel_process(kernel)
        notebook_side = [x for x in listeners_of(process.pid) if not is_hydra(x)]
        assert notebook_side and all(x.ip in (node1, "127.0.0.1") for x in notebook_side), \
            notebook_side
        for node in NODES:
            assert_listens_on_its_network_only(cluster, node)
        process.kill()
        killed = True
        left = wait_nothing_left(cluster, 10)
        assert not left, left
    finally:
        if killed:
            kernel.release()
        else:
            kernel.run("%mpilab stop", timeout=120)
            kernel.shutdown()
        assert not wait_nothing_left(cluster, 15)


def kernel_process(kernel: Kernel) -> psutil.Process:
    """A wrapped kernel's own process (under nsenter, or under slurmstepd on its node
    where srun runs it): the one whose command line names its connection file."""
    connection = kernel.km.connection_file
    found = [p for p in psutil.process_iter(["cmdline"])
             if (p.info["cmdline"] or [])[1:4] == ["-m", "ipykernel_launcher", "-f"]
             and connection in p.info["cmdline"]]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("line, message", [
    ("{subnet}.99:2", "did not start"),  # no host has this address
])
def test_ssh_bad_hostfile_is_one_line_and_leaves_nothing(ssh_kernel, emulated_cluster,
                                                          tmp_path, line, message):
    ssh_kernel.run("%mpilab stop", timeout=120)
    bad = tmp_path / "hosts"
    bad.write_text(line.format(subnet=emulated_cluster.head_address.rsplit(".", 1)[0]) + "\n")
    started = time.monotonic()
    run = ssh_kernel.run(f"%mpilab start -n 2 --hostfile {bad} --timeout 60", timeout=200)
    assert not run.ok
    assert message in run.text
    assert "Traceback" not in run.text
    assert time.monotonic() - started < 60
    assert not wait_nothing_left(emulated_cluster, 10)


def test_ssh_refused_is_ssh_s_line(ssh_kernel, emulated_cluster, hostfile, tmp_path):
    """A key the hosts do not accept: ssh's own words, and nothing left anywhere."""
    ssh_kernel.run("%mpilab stop", timeout=120)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "key")],
                   check=True)
    config = (emulated_cluster.ssh_dir / "config").read_text()
    config = "\n".join(f"  IdentityFile {tmp_path / 'key'}" if "IdentityFile" in line else line
                       for line in config.splitlines())
    (tmp_path / "config").write_text(config + "\n")
    wrapper = tmp_path / "bin" / "ssh"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {tmp_path / 'config'} \"$@\"\n")
    wrapper.chmod(0o755)
    run = ssh_kernel.run(
        f"import os\n_path = os.environ['PATH']\nos.environ['PATH'] = '{wrapper.parent}:' + _path\n"
        f"try:\n    get_ipython().run_line_magic('mpilab', 'start -n 4 --hostfile {hostfile}')\n"
        "finally:\n    os.environ['PATH'] = _path", timeout=200)
    assert "UsageError: " in run.text, run.text
    assert "Permission denied (publickey" in run.text, run.text
    assert "Traceback" not in run.text.split("UsageError")[-1]
    assert not wait_nothing_left(emulated_cluster, 10)


@pytest.mark.parametrize("lacks", LACKING)
def test_ssh_a_host_without_the_environment_mpilab_or_the_folder_is_named(
        ssh_kernel, emulated_cluster, hostfile, tmp_path, lacks):
    """node2 lacks this venv, mpilab in it, or the notebook's folder: hydra's own lines
    name neither the host nor the path (or the other ranks wait in MPI's start until the
    timeout); the start says both and what to do, at once, leaving nothing."""
    ssh_kernel.run("%mpilab stop", timeout=120)
    project = tmp_path / "project"
    project.mkdir()
    hidden, told = node2_lacking(lacks, project)
    with hidden_on(emulated_cluster, "node2", hidden):
        started = time.monotonic()
        run = start_in(ssh_kernel, project, f"-n 4 --hostfile {hostfile} --timeout 60")
        took = time.monotonic() - started
    assert told_what_node2_lacks(run, told, emulated_cluster.addresses["node2"]), run.text
    assert took < 30, took
    assert not wait_nothing_left(emulated_cluster, 10)


def test_ssh_ranks_placed_round_robin_over_the_hosts(ssh_kernel, emulated_cluster):
    """One slot a host, so mpiexec deals the ranks out in turn (0 and 2 on node1, 1 and 3
    on node2), as Slurm's cyclic distribution does: every collective and DataParallel
    stay right where a host's ranks are not consecutive."""
    ssh_kernel.run("%mpilab stop", timeout=120)
    dealt = emulated_cluster.hostfile(slots_per_node=1, nodes=NODES)
    try:
        run = ssh_kernel.run(f"%mpilab start -n 4 --hostfile {dealt}", timeout=240)
        assert run.ok, run.text
        run = ssh_kernel.run(CHECK_CELL, timeout=120)
        assert "[ranks 0,2] node1 [6.0, 6.0, 6.0] 6 hierarchical 1" in run.stdout, run.text
        assert "[ranks 1,3] node2 [6.0, 6.0, 6.0] 6 hierarchical 1" in run.stdout, run.text
        run = ssh_kernel.run(
            "%%ranks\nimport torch\nok = True\n"
            "for root in range(4):\n"
            "    for n in (3, 1 << 20, 1 << 21):\n"
            "        t = torch.full((n,), float(rank))\n"
            "        mpilab.broadcast(t, root=root)\n"
            "        ok = ok and bool((t == root).all())\n"
            "        g = mpilab.allgather(torch.full((n,), float(rank + root)))\n"
            "        ok = ok and all(bool((g[r] == r + root).all()) for r in range(4))\n"
            "torch.manual_seed(rank)\n"
            "model = mpilab.DataParallel(torch.nn.Linear(8, 2))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n"
            "    opt.zero_grad()\n"
            "    model(torch.randn(4, 8)).sum().backward()\n"
            "    opt.step()\n"
            "w = model.module.weight.detach().clone()\n"
            "same = all(torch.equal(w, x) for x in mpilab.allgather(w))\n"
            "print(ok, same)", timeout=180)
        assert run.ok, run.text
        assert "[ranks 0-3] True True" in run.stdout, run.text
    finally:
        ssh_kernel.run("%mpilab stop", timeout=120)
    assert not wait_nothing_left(emulated_cluster, 10)


# -- Slurm ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm_kernel(emulated_cluster, ssh_kernel):
    """A kernel that submits batch jobs: the nodes' own mpiexec starts the ranks inside.
    The ssh tests' ranks are stopped first: these tests count what is left on the nodes."""
    assert ssh_kernel.run("%mpilab stop", timeout=120).ok
    kernel = Kernel(env=emulated_cluster.job_env())
    assert kernel.run("%load_ext mpilab").ok
    yield kernel
    kernel.run("%mpilab stop", timeout=120)
    kernel.shutdown()
    assert not emulated_cluster.squeue()


WORLD = """
import mpilab
ctx = mpilab.init()
print(f"rank {ctx.rank} of {ctx.world_size} on {ctx.host}", flush=True)
"""


def test_a_batch_script_under_srun_is_one_world_with_pmi2_and_one_line_without(
        emulated_cluster, tmp_path):
    """`srun -n 2 python train.py` in a job script: with a PMI plugin MPICH speaks
    (`--mpi=pmi2`) the tasks are one world across the nodes; without one (Slurm's
    default here) each task found itself a world of one and trained alone, silently.
    That is one line now, said once, naming the commands that work."""
    script = tmp_path / "world.py"
    script.write_text(WORLD)
    env = {**os.environ, **emulated_cluster.env()}

    def srun(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run(["srun", *options, "-N", "2", "-n", "2", sys.executable,
                               str(script)], env=env, capture_output=True, text=True,
                              timeout=120)

    apart = srun()
    assert apart.returncode != 0, apart.stdout
    said = [line for line in apart.stderr.splitlines() if "mpilab" in line]
    assert said == ["mpilab.init(): srun started 2 tasks, but MPI sees each as a world of "
                    "one (srun gave MPICH no PMI): run `srun --mpi=pmi2 …`, or `mpiexec -n "
                    "2 python …` inside the job"], apart.stderr
    assert "Traceback" not in apart.stderr and "of 1" not in apart.stdout
    together = srun("--mpi=pmi2")
    assert together.returncode == 0, together.stderr[-3000:]
    assert sorted(together.stdout.split("\n"))[1:] == ["rank 0 of 2 on node1",
                                                      "rank 1 of 2 on node2"]


SLURM_START = ("%mpilab start -n 4 --launcher slurm --partition debug --time 10 --nodes 2 "
               "--tasks-per-node 2 --account research --sbatch-option=--comment=mpilab-test")


def test_slurm_batch_job_runs_the_ranks_and_stop_cancels_it(slurm_kernel, emulated_cluster):
    run = slurm_kernel.run(SLURM_START, timeout=240)
    assert run.ok, run.text
    assert "4 ranks on node1, node2" in run.stdout
    jobs = emulated_cluster.squeue()
    assert len(jobs) == 1 and jobs[0]["state"] == "RUNNING", jobs
    assert f"4 ranks on node1, node2 in Slurm job {jobs[0]['id']} · " in run.stdout, run.text
    shown = emulated_cluster.slurm_cmd("scontrol", "show", "job", jobs[0]["id"]).stdout
    assert "Partition=debug" in shown and "TimeLimit=00:10:00" in shown, shown
    assert "Comment=mpilab-test" in shown and "Account=research" in shown, shown
    check = slurm_kernel.run(CHECK_CELL, timeout=120)
    assert check.ok, check.text
    assert "[ranks 0-1] node1 [6.0, 6.0, 6.0] 6 hierarchical 1" in check.stdout, check.text
    assert "[ranks 2-3] node2 [6.0, 6.0, 6.0] 6 hierarchical 1" in check.stdout, check.text
    for node in NODES:  # inside the job as over ssh: the cluster network or loopback
        assert_listens_on_its_network_only(emulated_cluster, node)
    assert slurm_kernel.run(DIGITS_SETUP, timeout=120).ok
    trained = slurm_kernel.run("%%ranks\nacc = train_and_score('mpi')\n"
                               "print(acc >= 0.95, f'{acc:.3f}')", timeout=300)
    assert trained.ok and "[ranks 0-3] True" in trained.stdout, trained.text
    # the stop button reaches the ranks inside the job on both nodes; they keep their state
    run = slurm_kernel.run("%%ranks\nimport time\nkept = 7\ntime.sleep(60)", timeout=60,
                           interrupt_after=2.0)
    assert not run.ok and run.finished - run.started < 10, run.text
    assert all(f"[rank {r}] interrupted" in run.error_text for r in range(4)), run.text
    kept = slurm_kernel.run("%%ranks\nprint(kept)")
    assert kept.ok and "[ranks 0-3] 7" in kept.stdout, kept.text
    # with a rank in a call no interrupt reaches, the ranks are restarted in a new job
    before = jobs[0]["id"]
    run = slurm_kernel.run("%%ranks\nfrom mpi4py import MPI\nimport numpy as np\n"
                           "if rank == 3:\n    MPI.COMM_WORLD.Recv(np.zeros(1), source=0, tag=5)",
                           timeout=240, interrupt_after=1.5)
    assert not run.ok and "restarted the ranks: their state was lost" in run.text, run.text
    jobs = emulated_cluster.squeue()
    assert len(jobs) == 1 and jobs[0]["id"] != before, jobs
    again = slurm_kernel.run("%%ranks\nimport socket\nprint(socket.gethostname())")
    assert "[ranks 0-1] node1" in again.stdout and "[ranks 2-3] node2" in again.stdout, \
        again.text
    stopped = slurm_kernel.run("%mpilab stop", timeout=120)
    assert stopped.ok, stopped.text
    assert emulated_cluster.squeue() == []
    assert not wait_nothing_left(emulated_cluster, 10)


def test_slurm_time_limit_reached_in_a_cell_is_named_as_such(slurm_kernel, emulated_cluster):
    """The job reaches its time limit while a cell runs: the notebook says so within
    seconds of Slurm's cancel, in one line (not four ranks that cannot be reached), and
    nothing is left on the nodes. Slurm's shortest limit is a minute; the test moves the
    running job's end (an administrator's `scontrol update EndTime`) a few seconds ahead,
    so that the limit is reached without waiting the rest of the minute: slurmctld ends
    it as at any limit, at its next check of the limits (every 30 s)."""
    run = slurm_kernel.run("%mpilab start -n 4 --launcher slurm --partition debug --time 1 "
                           "--nodes 2 --tasks-per-node 2", timeout=240)
    assert run.ok, run.text
    job = emulated_cluster.squeue()[0]["id"]
    shown = emulated_cluster.slurm_cmd("scontrol", "show", "job", job).stdout
    assert "TimeLimit=00:01:00" in shown, shown
    soon = (datetime.datetime.now() + datetime.timedelta(seconds=3)).isoformat("T", "seconds")
    emulated_cluster.slurm_cmd("scontrol", "update", f"JobId={job}", f"EndTime={soon}")
    run = slurm_kernel.run("%%ranks\nimport time\nfor _ in range(300):\n    time.sleep(1)",
                           timeout=400)
    assert not run.ok
    said = re.search(r"ranks 0-3 ended: the Slurm job \d+ reached its time limit at "
                     r"(\d\d:\d\d:\d\d) \(`%mpilab start --time` sets it\)", run.text)
    assert said and "no heartbeat" not in run.text, run.text
    cancelled = datetime.datetime.combine(datetime.date.today(),
                                          datetime.time.fromisoformat(said[1]))
    assert run.finished - cancelled.timestamp() < 4.0, run.text
    after = slurm_kernel.run("%%ranks\nprint(rank)")
    assert "ranks 0-3 died (the Slurm job" in after.text, after.text
    assert slurm_kernel.run("%mpilab stop", timeout=120).ok
    assert emulated_cluster.squeue() == []
    assert not wait_nothing_left(emulated_cluster, 10)


def test_slurm_job_cancelled_while_idle_is_named_by_status_and_the_next_cell(
        slurm_kernel, emulated_cluster):
    """`scancel` from outside while no cell runs: `%mpilab status` names the job's end,
    and so does the next cell, at once."""
    run = slurm_kernel.run(SLURM_START, timeout=240)
    assert run.ok, run.text
    job = emulated_cluster.squeue()[0]["id"]
    emulated_cluster.slurm_cmd("scancel", job)
    deadline = time.monotonic() + 30
    while emulated_cluster.squeue() and time.monotonic() < deadline:
        time.sleep(0.5)
    cancelled = f"the Slurm job {job} was cancelled at "
    status = slurm_kernel.run("%mpilab status")
    assert status.text.count(f"dead: {cancelled}") == 4, status.text
    started = time.monotonic()
    run = slurm_kernel.run("%%ranks\nprint(rank)", timeout=120)
    assert not run.ok and f"ranks 0-3 ended: {cancelled}" in run.text, run.text
    assert time.monotonic() - started < 5, run.text
    assert slurm_kernel.run("%mpilab stop", timeout=120).ok
    assert not wait_nothing_left(emulated_cluster, 10)


def test_slurm_bad_partition_is_sbatch_s_line(slurm_kernel, emulated_cluster):
    run = slurm_kernel.run("%mpilab start -n 2 --launcher slurm --partition nosuch", timeout=120)
    assert not run.ok
    assert "nosuch" in run.text and "Traceback" not in run.text, run.text
    assert emulated_cluster.squeue() == []


@pytest.mark.parametrize("option, said", [
    ("--time abc", "sbatch: error: Invalid --time specification"),
    ("--sbatch-option=--mem=999999G", "sbatch: error: Memory specification can not be "
                                      "satisfied"),
])
def test_slurm_an_option_sbatch_refuses_is_sbatch_s_line_once(slurm_kernel, emulated_cluster,
                                                              option, said):
    """sbatch's own error, in the start's one line; not also printed above it (it wrote
    to the kernel's stderr), and not Python's words for a failed command."""
    run = slurm_kernel.run(f"%mpilab start -n 2 --launcher slurm {option}", timeout=120)
    assert not run.ok
    assert re.fullmatch(r"UsageError: the ranks did not start \(sbatch exited with code \d+\): "
                        + re.escape(said), run.text.strip()), run.text
    assert emulated_cluster.squeue() == []


def test_slurm_a_job_that_will_never_start_is_one_line_within_seconds(slurm_kernel,
                                                                      emulated_cluster):
    """sbatch takes a job that asks for more nodes than the partition has (as it does
    where the site does not enforce the partition's limits at submission); it would pend
    for good. The start says so within seconds, not after its --timeout, and cancels it."""
    more = len(emulated_cluster.names) + 1
    started = time.monotonic()
    try:
        run = slurm_kernel.run(f"%mpilab start -n {more} --launcher slurm --nodes {more}",
                               timeout=120)
        took = time.monotonic() - started
        assert not run.ok and took < 20, (took, run.text)
        assert re.fullmatch(r"UsageError: the Slurm job \d+ will not start: it asks for more "
                            r"nodes than the partition allows \(or its nodes are down\): ask "
                            r"for fewer with --nodes, or another --partition \(squeue: PENDING "
                            r"\(PartitionNodeLimit\)\)", run.text.strip()), run.text
        assert emulated_cluster.squeue() == []
    finally:
        slurm_kernel.run("%mpilab stop", timeout=120)


@contextlib.contextmanager
def every_node_held(cluster) -> Iterator[str]:
    """Another user's job on every node of the partition, while the block runs: its id.
    Gone from the queue when the block ends (a cancelled job stays COMPLETING for a while,
    seconds on a busy host), so what the queue holds after it is the notebook's."""
    out = cluster.slurm_cmd("salloc", "--no-shell", "-N", str(len(cluster.names)),
                            "--exclusive", "-t", "10").stderr
    job = next(w for w in out.split() if w.isdigit())
    try:
        yield job
    finally:
        cluster.slurm_cmd("scancel", job, check=False)
        deadline = time.monotonic() + 30
        while any(j["id"] == job for j in cluster.squeue()) and time.monotonic() < deadline:
            time.sleep(0.2)


def test_slurm_a_start_whose_job_waits_in_the_queue_says_so_while_it_waits(slurm_kernel,
                                                                            emulated_cluster):
    """Another job holds every node: the start's job waits in the queue, and the cell says
    so, in place, while it does (a real queue can hold it for minutes); once it runs the
    note is gone and the start line stands alone."""
    try:
        with every_node_held(emulated_cluster) as job:
            threading.Timer(6.0, emulated_cluster.slurm_cmd, ("scancel", job),
                            {"check": False}).start()
            # a rank on each node (each has one core here): no note of ranks sharing one
            run = slurm_kernel.run("%mpilab start -n 2 --nodes 2 --launcher slurm --timeout 60",
                                   timeout=120)
        assert run.ok and re.fullmatch(r"mpilab: 2 ranks on node1, node2 in Slurm job \d+ · .*",
                                       run.text.strip()), run.text
    finally:
        slurm_kernel.run("%mpilab stop", timeout=120)
    notes = [o["content"]["data"].get("text/plain", "") for o in run.outputs
             if o["type"] in ("display_data", "update_display_data")]
    assert any(re.fullmatch(r"mpilab: the Slurm job \d+ waits in the queue \(Resources\): "
                            r"\d+ s of the start's 60 s \(--timeout\)", note)
               for note in notes), notes
    assert notes[-1] == "", notes  # emptied once the job runs
    with every_node_held(emulated_cluster):  # and held past the start's --timeout
        run = slurm_kernel.run("%mpilab start -n 2 --launcher slurm --timeout 5", timeout=120)
    assert re.fullmatch(r"UsageError: the ranks did not start \(0 of 2 engines registered in "
                        r"5 s; the Slurm job \d+ is still in the queue, PENDING \(Resources\): a "
                        r"longer --timeout waits for it\)", run.text.strip()), run.text
    assert emulated_cluster.squeue() == []


def test_slurm_controller_down_is_one_line(slurm_kernel, emulated_cluster, tmp_path):
    """slurmctld not answering (its port closed, as when it is down): Slurm's own words."""
    conf = emulated_cluster.slurm_conf.read_text().splitlines()
    dead = tmp_path / "slurm.conf"
    dead.write_text("\n".join("SlurmctldPort=1" if line.startswith("SlurmctldPort=") else line
                              for line in conf) + "\n")
    run = slurm_kernel.run(
        f"import os\n_conf = os.environ['SLURM_CONF']\nos.environ['SLURM_CONF'] = '{dead}'\n"
        "try:\n    get_ipython().run_line_magic('mpilab', 'start -n 2 --launcher slurm')\n"
        "finally:\n    os.environ['SLURM_CONF'] = _conf", timeout=120)
    assert "UsageError: " in run.text, run.text
    error = run.text.split("UsageError: ")[-1].strip()
    assert "Unable to contact slurm controller" in error and len(error.splitlines()) == 1, error
    assert emulated_cluster.squeue() == []


@pytest.mark.parametrize("lacks", LACKING)
def test_slurm_a_node_without_the_environment_mpilab_or_the_folder_is_named(
        slurm_kernel, emulated_cluster, tmp_path, lacks):
    """As over ssh, in a batch job: the job's nodes say what they lack (slurmstepd's line,
    one srun task each once mpiexec failed, or asked while the job still runs); told
    within seconds, not at the timeout."""
    project = tmp_path / "project"
    project.mkdir()
    hidden, told = node2_lacking(lacks, project)
    with hidden_on(emulated_cluster, "node2", hidden):
        started = time.monotonic()
        run = start_in(slurm_kernel, project, "-n 4 --launcher slurm --nodes 2 "
                       "--tasks-per-node 2 --time 10 --timeout 60")
        took = time.monotonic() - started
    assert told_what_node2_lacks(run, told, "node2"), run.text
    assert took < 30, took
    assert emulated_cluster.squeue() == []
    assert not wait_nothing_left(emulated_cluster, 10)


def test_slurm_kernel_killed_ends_the_job(emulated_cluster, slurm_kernel):
    kernel = Kernel(env=emulated_cluster.job_env())
    try:
        run = kernel.run("%load_ext mpilab\n%mpilab start -n 4 --launcher slurm --nodes 2",
                         timeout=240)
        assert run.ok, run.text
        os.kill(kernel.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (emulated_cluster.squeue()
                                               or wait_nothing_left(emulated_cluster, 0)):
            time.sleep(0.2)
        assert not wait_nothing_left(emulated_cluster, 0)
        assert emulated_cluster.squeue() == []
    finally:
        kernel.release()


def test_slurm_inside_an_allocation(emulated_cluster, slurm_kernel, hostfile, tmp_path):
    """salloc's allocation (its variables in the kernel): the ranks go into it. A node
    without the notebook's folder is named (asked with srun in the allocation); a
    hostfile srun cannot place (addresses, not the nodes' Slurm names) is said at once,
    where mpiexec waits for proxies that never come."""
    with allocation(emulated_cluster) as (job, env):
        doctor = subprocess.run([str(Path(sys.executable).parent / "mpilab"), "doctor"],
                                env={**os.environ, **env}, capture_output=True, text=True,
                                timeout=120)
        assert (f"Slurm          allocation {job} (node1, node2; 4 tasks): `%mpilab start "
                "-n N` puts the ranks there") in doctor.stdout, doctor.stdout
        # this cluster's slurm.conf has MpiDefault=none, as many sites' do
        assert ("job scripts    srun's MPI plugin none: in a job script, `srun --mpi=pmi2 "
                "python train.py` or `mpiexec -n N python train.py`") in doctor.stdout
        kernel = Kernel(env=env)
        try:
            too_many = kernel.run("%load_ext mpilab\n%mpilab start -n 6 --launcher slurm")
            assert not too_many.ok
            assert f"allocation {job} holds 4 tasks, fewer than -n 6" in too_many.text
            began = time.monotonic()
            placed = kernel.run(f"%mpilab start -n 4 --hostfile {hostfile} --timeout 60")
            error = placed.text.split("UsageError: ")[-1].strip()
            assert not placed.ok and len(error.splitlines()) == 1, placed.text
            assert error.startswith("the ranks did not start (srun could not start mpiexec's "
                                    f"proxies): srun: error: Unable to create step for job "
                                    f"{job}: "), error
            assert "must be the allocation's nodes by their Slurm names" in error, error
            assert time.monotonic() - began < 20
            assert not wait_nothing_left(emulated_cluster, 10)
            project = tmp_path / "project"
            project.mkdir()
            hidden, told = node2_lacking("folder", project)
            with hidden_on(emulated_cluster, "node2", hidden):
                lacking = start_in(kernel, project, "-n 4 --launcher slurm --timeout 60")
            assert told_what_node2_lacks(lacking, told, "node2"), lacking.text
            assert not wait_nothing_left(emulated_cluster, 10)
            # the user's own srun, holding both nodes' CPUs: the ranks' step overlaps it
            users, users_step = named_step(emulated_cluster, job, "hydra_pmi_proxy",
                                           nodes=2, overlap=False)
            run = kernel.run("%mpilab start -n 4 --launcher slurm", timeout=240)
            assert run.ok, run.text
            assert f"4 ranks on node1, node2 in Slurm allocation {job} · " in run.stdout
            assert [j["id"] for j in emulated_cluster.squeue()] == [job]
            check = kernel.run(CHECK_CELL, timeout=120)
            assert check.ok and "hierarchical 1" in check.stdout, check.text
            ours = mpilab_steps(emulated_cluster, job)
            assert len(ours) == 1, steps_named(emulated_cluster, job)  # the start's proxies
            name = next(iter(ours.values()))
            # an srun of this start's that the start never saw (an mpiexec gone within
            # its first second leaves one)
            orphan, orphan_step = named_step(emulated_cluster, job, name)
            # a second notebook in the same allocation starts ranks of its own, and keeps
            # them through the first one's stop
            second = Kernel(env=env)
            try:
                started = second.run("%load_ext mpilab\n%mpilab start -n 2", timeout=240)
                assert started.ok and f"in Slurm allocation {job} · " in started.stdout, \
                    started.text
                theirs = mpilab_steps(emulated_cluster, job).keys() - ours.keys() - {orphan_step}
                assert len(theirs) == 1, steps_named(emulated_cluster, job)
                assert kernel.run("%mpilab stop", timeout=120).ok
                assert orphan.wait(timeout=30) != 0
                steps = steps_named(emulated_cluster, job)
                assert orphan_step not in steps and name not in steps.values(), steps
                assert users_step in steps and theirs <= steps.keys(), steps
                still = second.run("%%ranks\nprint('rank', rank, 'of', world_size)",
                                   timeout=120)
                assert still.ok and "rank 1 of 2" in still.stdout, still.text
                assert [j["id"] for j in emulated_cluster.squeue()] == [job]  # the user's
                users.terminate()
                users.wait(timeout=30)
                # the allocation ends under the second notebook's ranks: named as such
                emulated_cluster.slurm_cmd("scancel", job)
                deadline = time.monotonic() + 30
                while emulated_cluster.squeue() and time.monotonic() < deadline:
                    time.sleep(0.5)
                status = second.run("%mpilab status")
                assert status.text.count(
                    f"dead: the Slurm allocation {job} was cancelled at ") == 2, status.text
                assert second.run("%mpilab stop", timeout=120).ok
            finally:
                second.run("%mpilab stop", timeout=120)
                second.shutdown()
            assert not wait_nothing_left(emulated_cluster, 10)
        finally:
            kernel.run("%mpilab stop", timeout=120)
            kernel.shutdown()


def test_listen_address_is_chosen_or_one_line(tmp_path):
    """Pure logic: loopback where the ranks run here, else a one-line choice."""
    from mpilab.placement import ClusterError, place

    assert place("mpi", None, None, _settings()).listen_ip == "127.0.0.1"
    local = tmp_path / "local"
    local.write_text("localhost:2\n")
    assert place("mpi", str(local), None, _settings()).listen_ip == "127.0.0.1"
    unknown = tmp_path / "unknown"
    unknown.write_text("no-such-host.invalid:2\n")
    for given, said in ((None, "give --controller-ip, one of"),
                        ("127.0.0.1", "cannot reach this host's loopback; give one of")):
        with pytest.raises(ClusterError, match=said) as told:
            place("mpi", str(unknown), given, _settings())
        offered = str(told.value).rpartition("one of ")[2].split(", ")
        assert offered and "127.0.0.1" not in offered, told.value  # the ranks cannot reach it


def _settings():
    from mpilab.placement import SlurmSettings

    return SlurmSettings()


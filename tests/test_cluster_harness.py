"""The emulated multi-host cluster itself (tests/cluster.py), with no mpilab code: real
sshd, mpiexec across nodes, Slurm (sbatch, salloc + srun from the head side, scancel), and
a teardown that leaves nothing, from a new process and after a crashed owner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cluster import EmulatedCluster, Layout, _start_time, emulated_cluster, leftovers

assert emulated_cluster  # the session fixture, until tests/conftest.py imports it

VENV_BIN = Path(sys.executable).parent
PYTHON = str(VENV_BIN / "python")
MPIEXEC = str(VENV_BIN / "mpiexec")
TESTS = Path(__file__).resolve().parent

# Rank 0 prints what every rank reports, on one line (lines that ranks print at the same
# moment can interleave).
ALLREDUCE = textwrap.dedent("""
    import json, os, socket
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.rank + 1)
    rows = comm.gather({"rank": comm.rank, "size": comm.size, "host": socket.gethostname(),
                        "pid": os.getpid(), "sum": total})
    if comm.rank == 0:
        print("RANKS " + json.dumps(rows), flush=True)
""")


def rank_reports(stdout: str) -> list[dict]:
    """The ranks' reports, by rank."""
    lines = [line for line in stdout.splitlines() if line.startswith("RANKS ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len("RANKS "):])


def check_allreduce(stdout: str, n: int, hosts: list[str]) -> list[dict]:
    rows = rank_reports(stdout)
    assert [r["rank"] for r in rows] == list(range(n)), stdout
    assert all(r["sum"] == n * (n + 1) // 2 and r["size"] == n for r in rows), stdout
    assert sorted({r["host"] for r in rows}) == hosts, stdout
    return rows


def head_env(cluster: EmulatedCluster) -> dict[str, str]:
    return {**os.environ, **cluster.env()}


# ---------------------------------------------------------------------------------------
# (a) hosts: names, namespaces, ssh with the key only, no route out


def test_ssh_with_the_test_key_reaches_each_node_by_name(emulated_cluster):
    c = emulated_cluster
    env = head_env(c)
    for node in ("node1", "node2"):
        out = subprocess.run(["ssh", node, "hostname; getent hosts node1 node2 head"],
                             capture_output=True, text=True, timeout=30, env=env)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.split("\n")
        assert lines[0] == node
        assert f"{c.addresses['node1']} " in out.stdout.replace("\t", " ")
        assert f"{c.addresses['node2']} " in out.stdout.replace("\t", " ")
        assert f"{c.head_address} " in out.stdout.replace("\t", " ")


def test_sshd_takes_no_password_and_no_unknown_key(emulated_cluster, tmp_path):
    c = emulated_cluster
    other_key = tmp_path / "id_other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)],
                   check=True)
    base = ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5"]
    out = subprocess.run([*base, "-i", str(other_key), "-o", "IdentitiesOnly=yes",
                          f"root@{c.addresses['node1']}", "true"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 255
    assert "Permission denied (publickey)" in out.stderr, out.stderr


def test_each_node_has_its_own_pid_uts_and_network_namespace(emulated_cluster):
    c = emulated_cluster
    seen = {}
    for node in ("node1", "node2"):
        out = c.run_on(node, "hostname; readlink /proc/self/ns/pid /proc/self/ns/uts "
                             "/proc/self/ns/net; cat /proc/1/cmdline | tr '\\0' ' '", check=True)
        name, pidns, utsns, netns, init = out.stdout.strip().split("\n")
        assert name == node
        assert "_node-init" in init  # pid 1 is the node's own init, not this machine's
        seen[node] = (pidns, utsns, netns)
    mine = tuple(os.readlink(f"/proc/self/ns/{k}") for k in ("pid", "uts", "net"))
    assert len({seen["node1"][i] for i in range(3)} | {seen["node2"][i] for i in range(3)}
               | set(mine)) == 9
    # what runs on one node is not there on the other, nor shares pids with this machine's
    p1, p2 = set(c.pids_on("node1")), set(c.pids_on("node2"))
    assert p1 and p2 and not p1 & p2
    assert os.getpid() not in p1 | p2
    procs = c.processes_on("node1")
    assert any("sshd" in cmd for cmd in procs.values()), procs
    assert any("slurmd" in cmd for cmd in procs.values()), procs


def test_each_node_runs_on_cores_of_its_own(emulated_cluster):
    """As hosts have: what a node runs (a login over ssh, a Slurm job) is on its share of
    this machine's cores, and no two nodes share one while there are cores enough, so
    two ranks on a node of one core see one core, not every core of the machine."""
    env = head_env(emulated_cluster)
    machine = os.sched_getaffinity(0)
    seen = {}
    for node in ("node1", "node2"):
        out = subprocess.run(["ssh", node, "python3 -c 'import os; "
                              "print(*sorted(os.sched_getaffinity(0)))'"],
                             capture_output=True, text=True, timeout=30, env=env)
        assert out.returncode == 0, out.stderr
        seen[node] = {int(c) for c in out.stdout.split()}
    job = emulated_cluster.slurm_cmd(
        "srun", "-w", "node2", "-n", "1", "python3", "-c",
        "import os; print(*sorted(os.sched_getaffinity(0)))").stdout
    assert {int(c) for c in job.split()} == seen["node2"], job
    assert seen["node1"] and seen["node2"] and seen["node1"] | seen["node2"] <= machine
    if len(machine) >= 2:
        assert not seen["node1"] & seen["node2"], seen


def test_the_nodes_have_no_route_out_of_the_test_network(emulated_cluster):
    c = emulated_cluster
    probe = textwrap.dedent("""
        import socket, time
        for addr in ("192.0.2.1", "192.0.2.2", "1.1.1.1"):
            t = time.monotonic()
            s = socket.socket()
            s.settimeout(5)
            try:
                s.connect((addr, 80))
                print(addr, "CONNECTED")
            except OSError as e:
                print(addr, e.errno, round(time.monotonic() - t, 2))
    """)
    out = c.run_on("node1", [PYTHON, "-c", probe], check=True)
    for line in out.stdout.splitlines():
        addr, errno, seconds = line.split()
        assert errno == "101", out.stdout          # ENETUNREACH: no route at all
        assert float(seconds) < 1, out.stdout
    routes = c.run_on("node1", ["ip", "route"], check=True).stdout
    assert "default" not in routes and routes.count("\n") == 1, routes


# ---------------------------------------------------------------------------------------
# (b) mpiexec -f HOSTFILE from the head side, launching by ssh


@pytest.mark.parametrize("by", ["address", "name"])
def test_mpiexec_hostfile_runs_ranks_on_both_nodes(emulated_cluster, by):
    c = emulated_cluster
    hostfile = c.hostfile(2, nodes=["node1", "node2"], by=by)
    out = subprocess.run([MPIEXEC, "-f", str(hostfile), "-n", "4", PYTHON, "-c", ALLREDUCE],
                         capture_output=True, text=True, timeout=120, env=head_env(c))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = check_allreduce(out.stdout, 4, ["node1", "node2"])
    assert [r["host"] for r in rows] == ["node1", "node1", "node2", "node2"]
    assert c.leftover_processes(["node1", "node2"]) == {}


def test_mpiexec_with_the_explicit_hydra_settings(emulated_cluster):
    c = emulated_cluster
    env = {**os.environ, **c.hydra_env()}
    env["PATH"] = os.environ["PATH"]  # the launcher is HYDRA_LAUNCHER_EXEC's wrapper alone
    out = subprocess.run([MPIEXEC, "-f", str(c.hostfile(1, nodes=["node2", "node3"])),
                          "-n", "2", PYTHON, "-c", ALLREDUCE],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    check_allreduce(out.stdout, 2, ["node2", "node3"])


# ---------------------------------------------------------------------------------------
# (c) Slurm


def wait_queue_empty(c: EmulatedCluster, timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while (queue := c.squeue()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return queue


def test_sinfo_shows_the_nodes_idle(emulated_cluster):
    c = emulated_cluster
    assert c.sinfo() == {n: "idle" for n in c.names}
    assert c.squeue() == []


def test_sbatch_job_runs_mpiexec_across_two_nodes(emulated_cluster, tmp_path):
    c = emulated_cluster
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\necho batch-host $(hostname)\n"
                      f"{MPIEXEC} -n 4 {PYTHON} -c '{ALLREDUCE}'\n")
    out_file = tmp_path / "job.out"
    run = subprocess.run(["sbatch", "--wait", "-N2", "-n4", "-o", str(out_file),
                          "-J", "harness-mpi", str(script)],
                         capture_output=True, text=True, timeout=120, env=head_env(c))
    text = out_file.read_text() if out_file.exists() else ""
    assert run.returncode == 0, run.stdout + run.stderr + text
    assert "batch-host node1" in text, text
    check_allreduce(text, 4, ["node1", "node2"])
    assert wait_queue_empty(c) == []


def test_salloc_then_srun_from_the_head_side_then_scancel(emulated_cluster):
    c = emulated_cluster
    env = head_env(c)
    alloc = subprocess.run(["salloc", "-N2", "--no-shell", "-J", "harness-alloc"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert alloc.returncode == 0, alloc.stderr
    job = re.search(r"Granted job allocation (\d+)", alloc.stderr).group(1)
    try:
        assert [(j["id"], j["state"]) for j in c.squeue()] == [(job, "RUNNING")]
        step = subprocess.run(["srun", "--jobid", job, "-N2", "-n2", "sh", "-c",
                               "echo $SLURM_PROCID $(hostname) $$"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert step.returncode == 0, step.stdout + step.stderr
        lines = sorted(step.stdout.split("\n")[:-1])
        assert [line.split()[:2] for line in lines] == [["0", "node1"], ["1", "node2"]], lines
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30)
    assert wait_queue_empty(c) == []
    assert c.sinfo() == {n: "idle" for n in c.names}


# ---------------------------------------------------------------------------------------
# the harness's failure tools: kill what runs on a node, cut its link, restart it


def ssh_ok(c: EmulatedCluster, node: str) -> bool:
    out = subprocess.run(["ssh", "-o", "ConnectTimeout=2", node, "hostname"],
                         capture_output=True, text=True, timeout=30, env=head_env(c))
    return out.returncode == 0 and out.stdout.strip() == node


def test_kill_all_on_ends_what_runs_and_keeps_the_daemons(emulated_cluster):
    c = emulated_cluster
    subprocess.run(["ssh", "node2", "nohup sleep 300 >/dev/null 2>&1 &"], check=True,
                   timeout=30, env=head_env(c))
    # ssh returns once the remote shell has put it in the background: it may not yet be
    # `sleep` (nohup execs it), and the session's sshd may be on its way out
    deadline = time.monotonic() + 10
    while True:
        left = c.leftover_processes(["node2"], timeout=0)
        if any(cmd == "sleep 300" for cmd in left.get("node2", {}).values()) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert any(cmd == "sleep 300" for cmd in left.get("node2", {}).values()), left
    daemons = dict(c.node("node2").daemons)
    killed = c.kill_all_on("node2")
    assert killed and c.leftover_processes(["node2"], timeout=0) == {}
    assert all(p.alive() for p in daemons.values())
    assert ssh_ok(c, "node2")


def test_link_down_cuts_a_node_off_until_link_up(emulated_cluster):
    c = emulated_cluster
    probe = f"import socket; socket.create_connection(('{c.addresses['node3']}', 22), 1)"
    try:
        c.link_down("node3")
        assert not ssh_ok(c, "node3")
        assert c.run_on("node1", [PYTHON, "-c", probe]).returncode != 0
    finally:
        c.link_up("node3")
    assert c.run_on("node1", [PYTHON, "-c", probe]).returncode == 0
    assert ssh_ok(c, "node3")


def test_a_node_killed_whole_comes_back_with_restart_node(emulated_cluster):
    c = emulated_cluster
    before = c.node("node3").init.pid
    c.kill_all_on("node3", daemons=True)
    assert c.pids_on("node3") == []
    assert not ssh_ok(c, "node3")
    c.restart_node("node3")
    assert c.node("node3").init.pid != before
    assert ssh_ok(c, "node3")
    deadline = time.monotonic() + 30
    while c.sinfo().get("node3") != "idle" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.sinfo() == {n: "idle" for n in c.names}
    step = subprocess.run(["srun", "-w", "node3", "hostname"], capture_output=True, text=True,
                          timeout=60, env=head_env(c))
    assert step.stdout.strip() == "node3", step.stderr


# ---------------------------------------------------------------------------------------
# teardown, on a second instance beside the session's cluster


def test_down_from_a_new_process_and_after_a_crashed_owner_leaves_nothing():
    layout = Layout("t")
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    assert leftovers(layout) == []
    # an owner that dies holding the cluster (as a killed test session does)
    holder = subprocess.Popen(
        [PYTHON, "-c", "import time; from cluster import EmulatedCluster as C; "
         "c = C(('node1', 'node2'), instance='t').up(); print('up', flush=True); "
         "time.sleep(600)"], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "up"
    state = json.loads((layout.run_dir / "state.json").read_text())
    pids = [(p["pid"], p["start"]) for p in state["head"].values()]
    pids += [(n[k]["pid"], n[k]["start"]) for n in state["nodes"] for k in ("init", "holder")]
    pids += [(d["pid"], d["start"]) for n in state["nodes"] for d in n["daemons"].values()]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert all(_start_time(p) == s for p, s in pids), "the daemons outlive their owner"
    # a new owner clears the leftovers and starts clean
    again = subprocess.run(
        [PYTHON, "-c", "from cluster import EmulatedCluster as C; "
         "c = C(('node1',), instance='t').up(); print(c.run_on('node1', 'hostname').stdout); "
         "c.down()"], capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0 and again.stdout.strip() == "node1", again.stderr
    assert all(_start_time(p) != s for p, s in pids)
    assert leftovers(layout) == []
    # by hand: up, then down from another process
    up = subprocess.run([PYTHON, "-m", "tests.cluster", "--instance", "t", "up"],
                        capture_output=True, text=True, timeout=120, cwd=TESTS.parent)
    assert up.returncode == 0, up.stderr
    state = json.loads((layout.run_dir / "state.json").read_text())
    pids = [(p["pid"], p["start"]) for p in state["head"].values()]
    pids += [(n["init"]["pid"], n["init"]["start"]) for n in state["nodes"]]
    down = subprocess.run([PYTHON, "-m", "tests.cluster", "--instance", "t", "down"],
                          capture_output=True, text=True, timeout=120, cwd=TESTS.parent)
    assert down.returncode == 0, down.stderr
    assert all(_start_time(p) != s for p, s in pids)
    assert leftovers(layout) == []
    assert not layout.lock_file.exists()

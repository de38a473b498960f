"""An emulated multi-host cluster on this one machine, for the multi-host tests and by hand.

Each node is a network namespace (`mpilab-nodeK`, a veth pair to the bridge `mpilab-br0`
on the notebook's side) holding one long-lived init process in its own UTS namespace (its
hostname), PID namespace (its pids mean nothing elsewhere, as on real hosts) and mount
namespace (its own /run, and /etc/hosts and /etc/resolv.conf from /etc/netns/NETNS/, which
`ip netns exec` binds), and runs on its share of this machine's cores (its CPU affinity;
one core each for 2 nodes on 2 cores). Everything else, the run directory included, is the
one shared file system, as a cluster's shared home is. The init runs a real sshd (key
login only, per-run keys) and a real slurmd; the head side runs munged and slurmctld, the
latter in a UTS namespace of its own named `head` in this machine's network namespace,
listening on the bridge address only.

Names: the nodes resolve each other, `head`, and this machine's own hostname (to the bridge
address, as a real compute node resolves its login node). This machine's /etc/hosts is not
touched: on the head side ssh finds the nodes by name through the harness's ssh config
(`HostName`). Hostfiles hold the nodes' addresses by default; `hostfile(by="name")` works
for mpiexec too (it hands the names to ssh), but code on the head side that resolves a
node's name itself fails there.

Traffic stays in the test subnet: the nodes have a route to that subnet and no other
(no default route, no NAT, and forwarding stays as it is, off), and the head side's
daemons listen on the bridge address.

Everything is started by pid and recorded in RUN_DIR/state.json as it is started, so that
`down()`, from this process or from a new one (`python -m tests.cluster down`), ends
exactly what was started: each node's init (its PID namespace and every process in it die
with it), whatever else still runs in a node's network namespace, munged and slurmctld
(by recorded pid and start time), then the links, the namespaces, /etc/netns/NETNS and the
run directory. A run that finds a crashed run's leftovers clears them the same way, also by
the names this harness gives its namespaces and links (the `mpilab-` prefix).

Command line: `python -m tests.cluster up [--nodes N] | down | status`.
In tests: the session fixture `emulated_cluster` (see the bottom of this file).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BASE_DIR = os.environ.get("MPILAB_TESTCLUSTER_DIR", "/tmp/mpilab-testcluster")
SUBNET = os.environ.get("MPILAB_TESTCLUSTER_SUBNET", "10.213.0")  # a /24: SUBNET.0/24
INSTANCES = "abcdefghijklmnopqrstuvwxyz0123456789"
HEAD_NAME = "head"
SSH_PORT = 22
SLURMCTLD_PORT = 16817
SLURMD_PORT = 16818
PARTITION = "debug"
UP_TIMEOUT = 60.0

TOOLS = ("ip", "unshare", "nsenter", "hostname", "mount",
         "/usr/sbin/sshd", "ssh", "ssh-keygen",
         "munged", "slurmctld", "slurmd", "sinfo", "squeue", "scontrol")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be brought up, or is held by someone else."""


@dataclass(frozen=True)
class Layout:
    """Where one cluster lives: its names' prefix, subnet and run directory.

    The default instance ("") is the one the tests' fixture and the command line use:
    `mpilab-br0`, `mpilab-node1`, SUBNET, BASE_DIR. Another instance (one letter or digit,
    `x`) lives beside it: `mpilab-x-br0`, `mpilab-x-node1`, 10.213.N, BASE_DIR-x.
    """
    instance: str = ""

    def __post_init__(self):
        if self.instance and (len(self.instance) != 1 or self.instance not in INSTANCES):
            raise ClusterError(f"an instance is one of a-z or 0-9, got {self.instance!r}")

    @property
    def prefix(self) -> str:
        return "mpilab-" + (f"{self.instance}-" if self.instance else "")

    @property
    def bridge(self) -> str:
        return self.prefix + "br0"

    @property
    def subnet(self) -> str:
        if not self.instance:
            return SUBNET
        return f"10.213.{1 + INSTANCES.index(self.instance)}"

    @property
    def run_dir(self) -> Path:
        return Path(BASE_DIR + (f"-{self.instance}" if self.instance else ""))

    @property
    def lock_file(self) -> Path:
        return Path(str(self.run_dir) + ".lock")

    def ours(self, name: str) -> bool:
        """Whether a link or network namespace name is one this instance creates."""
        return re.fullmatch(re.escape(self.prefix) + r"(br0|node\d+)", name) is not None


# ---------------------------------------------------------------------------------------
# small process helpers


def _sh(*argv: str, check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; a failure raises with that output."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks after boot), None if it is gone or
    a zombie.

    Recorded with every pid so that a pid reused by someone else's process is never
    signalled.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _alive(pid: int, start: int | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start is None or now == start)


def _kill(pid: int, start: int | None, sig: int = signal.SIGKILL) -> None:
    if _alive(pid, start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _pidns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _ns_pid(pid: int) -> int | None:
    """`pid`'s number inside its innermost PID namespace (NSpid's last field)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        return None
    return None


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _wait_gone(pids: Sequence[tuple[int, int | None]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in pids):
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------
# records


@dataclass
class Proc:
    """A process the harness started: its pid on this machine and its start time."""
    pid: int
    start: int | None

    @classmethod
    def of(cls, pid: int) -> Proc:
        return cls(pid, _start_time(pid))

    def alive(self) -> bool:
        return _alive(self.pid, self.start)


@dataclass
class Node:
    """One emulated host."""
    name: str             # its hostname, and its NodeName in Slurm
    address: str          # on the test subnet
    netns: str            # the network namespace's name (`ip netns`)
    link: str             # the veth end on the head side, a port of the bridge
    init: Proc | None = None     # pid 1 of the node's PID namespace
    holder: Proc | None = None   # `unshare`, the init's parent in this machine's namespace
    daemons: dict[str, Proc] = field(default_factory=dict)  # sshd, slurmd


@dataclass
class State:
    """What a run has started, written to RUN_DIR/state.json as it goes (for `down`)."""
    owner: int                       # pid of the process that brought the cluster up
    owner_start: int | None
    manual: bool                     # brought up by `python -m tests.cluster up`
    instance: str
    subnet: str
    nodes: list[Node] = field(default_factory=list)
    head: dict[str, Proc] = field(default_factory=dict)   # munged, slurmctld
    links: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    etc_netns: list[str] = field(default_factory=list)
    made_etc_netns: bool = False     # /etc/netns did not exist before this run
    slurm: bool = True
    ssh: bool = True
    every_core: bool = False
    ready: bool = False

    def save(self) -> None:
        run_dir = Layout(self.instance).run_dir
        tmp = run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(_to_json(self), indent=1))
        tmp.replace(run_dir / "state.json")

    @classmethod
    def load(cls, layout: Layout) -> State | None:
        try:
            raw = json.loads((layout.run_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        nodes = []
        for n in raw.pop("nodes"):
            init, holder = n.pop("init"), n.pop("holder")
            daemons = {k: Proc(**v) for k, v in n.pop("daemons").items()}
            nodes.append(Node(**n, init=Proc(**init) if init else None,
                              holder=Proc(**holder) if holder else None, daemons=daemons))
        head = {k: Proc(**v) for k, v in raw.pop("head").items()}
        return cls(**raw, nodes=nodes, head=head)


def _to_json(obj):
    if isinstance(obj, (State, Node, Proc)):
        return {k: _to_json(v) for k, v in vars(obj).items()}
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_json(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------
# the cluster


class EmulatedCluster:
    """Emulated hosts on this machine, each with a real sshd and slurmd (see module doc).

    `with EmulatedCluster(("node1", "node2")) as c:` brings it up and always takes it
    down; `up()`/`down()` do the same by hand. One cluster at a time per machine: `up()`
    waits for a lock that the owner holds until `down()`.
    """

    def __init__(self, nodes: Sequence[str] = ("node1", "node2"), *, slurm: bool = True,
                 ssh: bool = True, cpus_per_node: int | None = None,
                 lock_timeout: float = 900.0, instance: str = "", every_core: bool = False):
        self.layout = lay = Layout(instance)
        for name in nodes:
            if not (name.startswith("node") and name[4:].isdigit() and 0 < int(name[4:]) < 100):
                raise ClusterError(f"node names are node1..node99, got {name!r}")
        self.nodes: list[Node] = [
            Node(name=n, address=f"{lay.subnet}.{10 + int(n[4:])}", netns=lay.prefix + n,
                 link=lay.prefix + n) for n in nodes]
        self.slurm = slurm
        self.ssh = ssh
        # Slurm's CPUs per node: this machine's cores unless told, though a node runs on
        # its share of them (`_cores_of`); Slurm takes the configured count
        # (SlurmdParameters=config_overrides), so tests can place 2 ranks on each node.
        self.cpus_per_node = cpus_per_node or os.cpu_count() or 1
        # True: every node runs on every core of this machine, as benchmarks/
        # bench_multinode.py's figures were measured (its ranks bound to cores 0 and 1)
        self.every_core = every_core
        self.lock_timeout = lock_timeout
        self.head_address = f"{lay.subnet}.1"
        self.head_interface = lay.bridge
        self.head_name = HEAD_NAME
        self.run_dir = run = lay.run_dir
        self.ssh_dir = run / "ssh"
        self.ssh_wrapper = run / "bin" / "ssh"
        self.slurm_conf = run / "slurm" / "slurm.conf"
        self.munge_socket = run / "munge" / "munge.socket.2"
        self.log_dir = run / "log"
        self._lock_fd: int | None = None
        self._state: State | None = None
        self._children: list[subprocess.Popen] = []  # reaped in down()

    @classmethod
    def attach(cls, instance: str = "") -> EmulatedCluster:
        """The cluster that runs now (brought up by `python -m tests.cluster up`, or by
        another process), for use from this process; it stays up when this one ends."""
        layout = Layout(instance)
        state = State.load(layout)
        if state is None or not state.ready or not cls._is_live(state):
            raise ClusterError(f"no test cluster is up ({layout.run_dir}): "
                               "python -m tests.cluster up")
        c = cls([n.name for n in state.nodes], slurm=state.slurm, ssh=state.ssh,
                every_core=state.every_core, instance=instance)
        c.nodes = state.nodes
        c._state = state
        return c

    # -- public surface ------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def addresses(self) -> dict[str, str]:
        return {n.name: n.address for n in self.nodes}

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ClusterError(f"no node {name!r} in this cluster (it has {', '.join(self.names)})")

    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def env(self) -> dict[str, str]:
        """Environment for a notebook kernel on the head side to use the nodes, by ssh
        (mpiexec -f HOSTFILE) and by Slurm (sbatch, salloc, srun); safe to pass into jobs.

        PATH: the harness's `ssh` wrapper first (test key, per-run known hosts, the nodes'
        names), so mpiexec's ssh launcher and a plain `ssh node1` use it. UCX_TLS: UCX's
        shared-memory transport fails between nodes that share a kernel but not a PID
        namespace. SLURM_CONF: this run's slurm.conf.

        Not HYDRA_LAUNCHER_EXEC or HYDRA_IFACE (see `hydra_env`): sbatch passes the
        submitter's environment into the job, and there mpiexec launches with srun; with
        HYDRA_LAUNCHER_EXEC it runs the ssh wrapper as srun and hangs, with HYDRA_IFACE it
        fails (the bridge is not on the nodes). mpiexec on the head side does not need
        HYDRA_IFACE here: it advertises this machine's hostname, which the nodes resolve to
        the bridge address.
        """
        env = self.job_env()
        if self.ssh:
            env["PATH"] = f"{self.ssh_wrapper.parent}:{os.environ.get('PATH', '')}"
        return env

    def hydra_env(self) -> dict[str, str]:
        """The explicit form, for an mpiexec on the head side that launches by ssh only:
        `env()` plus HYDRA_LAUNCHER_EXEC (the ssh wrapper) and HYDRA_IFACE (the bridge).
        Never for a process that submits Slurm jobs (see `env`)."""
        env = self.env()
        if self.ssh:
            env["HYDRA_LAUNCHER_EXEC"] = str(self.ssh_wrapper)
        env["HYDRA_IFACE"] = self.head_interface
        return env

    def job_env(self) -> dict[str, str]:
        """What a process on the nodes (a Slurm job, a rank) needs from the emulation."""
        env = {"UCX_TLS": "tcp,self"}
        if self.slurm:
            env["SLURM_CONF"] = str(self.slurm_conf)
        return env

    def hostfile(self, slots_per_node: int = 1, nodes: Sequence[str] | None = None,
                 by: str = "address", path: str | os.PathLike | None = None) -> Path:
        """Write an mpiexec hostfile (`HOST:SLOTS` lines) and return its path.

        Both forms work for mpiexec, from the head side and from the nodes; with
        `by="name"` the head side reaches the nodes through the ssh config's HostName,
        as this machine does not resolve their names itself.
        """
        if by not in ("address", "name"):
            raise ClusterError(f"hostfile(by=...) is 'address' or 'name', got {by!r}")
        chosen = [self.node(n) for n in (nodes or self.names)]
        lines = [f"{n.address if by == 'address' else n.name}:{slots_per_node}\n"
                 for n in chosen]
        name = f"hostfile-{'-'.join(n.name for n in chosen)}-{slots_per_node}-{by}"
        out = Path(path) if path else self.run_dir / name
        out.write_text("".join(lines))
        return out

    def run_on(self, node: str, argv: Sequence[str] | str, *, timeout: float = 60,
               check: bool = False, env: dict[str, str] | None = None,
               cwd: str | os.PathLike | None = None, input: str | None = None,
               ) -> subprocess.CompletedProcess:
        """Run a command on `node` (inside its network, UTS, PID and mount namespaces).

        A string is run by `sh -c`. Output is captured as text. The environment is this
        process's plus `env`; the working directory is `cwd` or this process's.
        """
        cmd = self.nsenter_argv(node, argv, cwd=cwd)
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=full_env, input=input)
        if check and proc.returncode != 0:
            raise ClusterError(f"on {node}: {argv!r} failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def nsenter_argv(self, node: str, argv: Sequence[str] | str, *,
                     cwd: str | os.PathLike | None = None) -> list[str]:
        """The command line that runs `argv` on `node` (for a Popen of one's own)."""
        n = self.node(node)
        if n.init is None or not n.init.alive():
            raise ClusterError(f"{node} is not running (python -m tests.cluster status)")
        if isinstance(argv, str):
            argv = ["sh", "-c", argv]
        return ["nsenter", "-t", str(n.init.pid), "-n", "-u", "-p", "-m",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def ssh_argv(self, node: str, command: str) -> list[str]:
        """`ssh node command` as mpiexec does it, from the head side."""
        return [str(self.ssh_wrapper), node, command]

    def pids_on(self, node: str) -> list[int]:
        """Pids (in this machine's namespace) of every process on `node`, its init included."""
        n = self.node(node)
        ns = _pidns(n.init.pid) if n.init and n.init.alive() else None
        if ns is None:
            return []
        return sorted(p for p in _all_pids() if _pidns(p) == ns)

    def processes_on(self, node: str) -> dict[int, str]:
        """`pids_on(node)` with each process's command line, for assertions and messages."""
        out = {}
        for pid in self.pids_on(node):
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            out[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        return out

    def user_pids_on(self, node: str) -> list[int]:
        """Pids on `node` other than its init, sshd's listener and slurmd: what jobs left."""
        n = self.node(node)
        keep = {n.init.pid} if n.init else set()
        keep |= {d.pid for d in n.daemons.values()}
        return [p for p in self.pids_on(node) if p not in keep]

    def leftover_processes(self, nodes: Sequence[str] | None = None, timeout: float = 10,
                           ) -> dict[str, dict[int, str]]:
        """Wait up to `timeout` s for `nodes` (all by default) to hold nothing but their
        init and daemons; return what is still there, {node: {pid: command line}}, empty
        when all is gone. An ssh session's sshd lingers a moment after its command exits."""
        nodes = list(nodes or self.names)
        deadline = time.monotonic() + timeout
        while True:
            left = {n: procs for n in nodes
                    if (procs := {p: cmd for p, cmd in self.processes_on(n).items()
                                  if p in set(self.user_pids_on(n))})}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def kill_all_on(self, node: str, *, daemons: bool = False) -> list[int]:
        """SIGKILL the processes on `node`: what jobs and logins left, or (daemons=True)
        the whole node, its init, sshd and slurmd included (a crashed host; `down()` then
        still clears its links and namespace). Returns the pids signalled."""
        n = self.node(node)
        if daemons:
            pids = self.pids_on(node)
            if n.init:
                _kill(n.init.pid, n.init.start)  # the PID namespace's other processes go too
        else:
            pids = self.user_pids_on(node)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p in pids for p in _all_pids()):
            time.sleep(0.02)
        return pids

    def link_down(self, node: str) -> None:
        """Cut `node` off the network (its veth end at the bridge goes down)."""
        _sh("ip", "link", "set", self.node(node).link, "down")

    def link_up(self, node: str, timeout: float = 10) -> None:
        """Put `node` back on the network and return once traffic passes: both veth ends
        up, the bridge port forwarding, and the node's sshd reachable from the head side
        (the link's carrier comes back a moment after `ip link set up` returns)."""
        n = self.node(node)
        _sh("ip", "link", "set", n.link, "up")

        def passes() -> bool:
            head_end = _sh("ip", "-o", "link", "show", "dev", n.link, check=False).stdout
            node_end = _sh("ip", "-n", n.netns, "-o", "link", "show", "dev", "eth0",
                           check=False).stdout
            port = _sh("bridge", "-d", "link", "show", "dev", n.link, check=False).stdout
            if not ("state UP" in head_end and "state UP" in node_end
                    and "forwarding" in port):
                return False
            try:
                socket.create_connection((n.address, 22), 0.5).close()
            except OSError:
                return False
            return True

        _wait_for(passes, timeout, f"{node}'s link to come back up")

    def slurm_env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def slurm_cmd(self, *argv: str, timeout: float = 30, check: bool = True
                  ) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sinfo, sbatch, ...) on the head side."""
        return _sh(*argv, check=check, timeout=timeout, env=self.slurm_env())

    def squeue(self) -> list[dict[str, str]]:
        """The queue: one dict per job (id, name, state, nodes)."""
        out = self.slurm_cmd("squeue", "-h", "-o", "%i|%j|%T|%N").stdout
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        return [dict(zip(("id", "name", "state", "nodes"), r)) for r in rows]

    def sinfo(self) -> dict[str, str]:
        """Each node's Slurm state (idle, alloc, down*, ...)."""
        out = self.slurm_cmd("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def status(self) -> dict:
        """What runs now: per node its address, init and daemons alive; Slurm's view."""
        state = State.load(self.layout)
        if state is None:
            return {"up": False}
        info: dict = {"up": state.ready, "run_dir": str(self.run_dir), "owner": state.owner,
                      "manual": state.manual, "head": {
                          "address": f"{state.subnet}.1", "interface": self.head_interface,
                          **{k: {"pid": p.pid, "alive": p.alive()} for k, p in state.head.items()}},
                      "nodes": {}}
        for n in state.nodes:
            info["nodes"][n.name] = {
                "address": n.address, "netns": n.netns,
                "init": {"pid": n.init.pid, "alive": n.init.alive()} if n.init else None,
                **{k: {"pid": p.pid, "alive": p.alive()} for k, p in n.daemons.items()}}
        if state.slurm and "slurmctld" in state.head and state.head["slurmctld"].alive():
            with contextlib.suppress(Exception):
                info["slurm"] = self.sinfo()
        return info

    # -- up ------------------------------------------------------------------------------

    def up(self) -> EmulatedCluster:
        """Bring the cluster up, clearing a crashed run's leftovers first; on any failure
        everything started so far is taken down and the error says what failed."""
        t0 = time.monotonic()
        self._preflight()
        self._acquire_lock()
        try:
            previous = State.load(self.layout)
            if previous is not None and previous.manual and self._is_live(previous):
                raise ClusterError(
                    f"a test cluster brought up by hand is running ({self.run_dir}): "
                    "take it down first with `python -m tests.cluster down`, or run the "
                    "tests on it with MPILAB_TESTCLUSTER_REUSE=1")
            _teardown(self.layout, previous)
            self._state = State(owner=os.getpid(), owner_start=_start_time(os.getpid()),
                                manual=False, instance=self.layout.instance,
                                subnet=self.layout.subnet, slurm=self.slurm, ssh=self.ssh,
                                every_core=self.every_core)
            self._make_run_dir()
            self._state.save()
            self._network()
            if self.ssh:
                self._ssh_files()
            if self.slurm:
                self._start_munge()
                self._write_slurm_conf()
                self._start_slurmctld()
            self._start_nodes(self.nodes)
            self._wait_ready(t0 + UP_TIMEOUT, self.nodes)
            self._state.nodes = self.nodes
            self._state.ready = True
            self._state.save()
        except BaseException:
            with contextlib.suppress(Exception):
                self.down()
            raise
        self.up_seconds = time.monotonic() - t0
        return self

    def _preflight(self) -> None:
        if os.geteuid() != 0:
            raise ClusterError("the emulated cluster needs root (Linux namespaces, veth links)")
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise ClusterError(f"missing {', '.join(missing)}: install iproute2 util-linux "
                               "openssh-server slurm-wlm munge (as .ci/run does)")

    def _acquire_lock(self) -> None:
        """Hold the instance's lock file (flock) until `down()`, waiting up to lock_timeout.

        The holder unlinks the file when it lets go, so none is left behind; a waiter that
        got the lock of a file unlinked meanwhile tries again with the new one.
        """
        path = self.layout.lock_file
        deadline = time.monotonic() + self.lock_timeout
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                os.close(fd)
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"the test cluster is in use by pid {holder} "
                        f"(lock {path}); waited {self.lock_timeout:.0f} s") from None
                time.sleep(0.5)
                continue
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.layout.lock_file)
            os.close(self._lock_fd)   # closing drops the flock
            self._lock_fd = None

    @staticmethod
    def _is_live(state: State) -> bool:
        return any(p.alive() for p in state.head.values()) or any(
            n.init is not None and n.init.alive() for n in state.nodes)

    def _make_run_dir(self) -> None:
        self.run_dir.mkdir(mode=0o700, exist_ok=False)
        for sub in ("ssh", "bin", "log", "munge", "slurm", "nodes"):
            (self.run_dir / sub).mkdir(mode=0o700)

    def _check_subnet_free(self) -> None:
        routes = _sh("ip", "-4", "route", "show", "table", "all").stdout
        addrs = _sh("ip", "-4", "-o", "addr", "show").stdout
        subnet = self.layout.subnet
        clash = [line for line in (routes + addrs).splitlines() if subnet + "." in line]
        if clash:
            raise ClusterError(f"the test subnet {subnet}.0/24 is in use here ({clash[0].strip()});"
                               " set MPILAB_TESTCLUSTER_SUBNET to a free one, e.g. 10.214.0")

    def _network(self) -> None:
        st = self._state
        self._check_subnet_free()
        bridge = self.head_interface
        _sh("ip", "link", "add", bridge, "type", "bridge")
        st.links.append(bridge)
        st.save()
        _set_sysctl(f"net/ipv6/conf/{bridge}/disable_ipv6", "1")
        _sh("ip", "addr", "add", f"{self.head_address}/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        hosts = self._hosts_file()
        for n in self.nodes:
            _sh("ip", "netns", "add", n.netns)
            st.netns.append(n.netns)
            st.save()
            _sh("ip", "link", "add", n.link, "type", "veth", "peer", "name", "eth0",
                "netns", n.netns)
            st.links.append(n.link)
            st.save()
            _set_sysctl(f"net/ipv6/conf/{n.link}/disable_ipv6", "1")
            _sh("ip", "link", "set", n.link, "master", bridge, "up")
            _sh("ip", "-n", n.netns, "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", n.netns, "sh", "-c",
                "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6")
            _sh("ip", "-n", n.netns, "addr", "add", f"{n.address}/24", "dev", "eth0")
            _sh("ip", "-n", n.netns, "link", "set", "eth0", "up")
            etc = Path("/etc/netns") / n.netns
            if not etc.parent.exists():
                st.made_etc_netns = True
            st.etc_netns.append(str(etc))
            st.save()
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            # No name server on the test network: the hosts file is the names' source,
            # and a query for anything else fails at once on the node's own loopback.
            (etc / "resolv.conf").write_text(
                "# emulated test network: names come from /etc/hosts\n"
                "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1\tlocalhost",
                 f"{self.head_address}\t{HEAD_NAME} {socket.gethostname()}"]
        lines += [f"{n.address}\t{n.name}" for n in self.nodes]
        return "\n".join(lines) + "\n"

    def _ssh_files(self) -> None:
        d = self.ssh_dir
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mpilab-testcluster",
            "-f", str(d / "id_ed25519"))
        (d / "authorized_keys").write_text((d / "id_ed25519.pub").read_text())
        known = []
        for n in self.nodes:
            nd = self.run_dir / "nodes" / n.name
            nd.mkdir(mode=0o700, exist_ok=True)
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", n.name,
                "-f", str(nd / "ssh_host_ed25519_key"))
            pub = (nd / "ssh_host_ed25519_key.pub").read_text().split()
            known.append(f"{n.name},{n.address} {pub[0]} {pub[1]}\n")
            (nd / "sshd_config").write_text(_sshd_config(n, nd, d))
        (d / "known_hosts").write_text("".join(known))
        (d / "config").write_text(self._ssh_config())
        self.ssh_wrapper.write_text(
            "#!/bin/sh\n# ssh to the emulated nodes with the test key and host keys\n"
            f'exec /usr/bin/ssh -F {d / "config"} "$@"\n')
        self.ssh_wrapper.chmod(0o755)
        # the run directory is root's alone; the wrapper lives in it
        (self.run_dir / "bin").chmod(0o755)

    def _ssh_config(self) -> str:
        d = self.ssh_dir
        hosts = " ".join(self.names + [n.address for n in self.nodes])
        out = [f"Host {hosts}",
               "  User root",
               f"  IdentityFile {d / 'id_ed25519'}",
               "  IdentitiesOnly yes",
               f"  UserKnownHostsFile {d / 'known_hosts'}",
               "  GlobalKnownHostsFile /dev/null",
               "  StrictHostKeyChecking yes",
               "  CheckHostIP no",
               "  BatchMode yes",
               "  LogLevel ERROR",
               "  ConnectTimeout 5",
               # a node cut off (link_down) is noticed by the ssh sessions within ~6 s
               "  ServerAliveInterval 2",
               "  ServerAliveCountMax 3",
               ""]
        for n in self.nodes:
            out += [f"Host {n.name}", f"  HostName {n.address}", ""]
        return "\n".join(out)

    def _start_munge(self) -> None:
        d = self.run_dir / "munge"
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        log = open(self.log_dir / "munged.out", "wb")
        # --force: munged refuses root and a socket under world-writable /tmp otherwise
        proc = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
             f"--log-file={self.log_dir / 'munged.log'}", f"--seed-file={d / 'munged.seed'}",
             "--num-threads=4"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        self._children.append(proc)
        self._state.head["munged"] = Proc.of(proc.pid)
        self._state.save()
        _wait_for(lambda: self.munge_socket.exists() or proc.poll() is not None, 10,
                  "munged to create its socket")
        if proc.poll() is not None:
            raise ClusterError("munged exited: " + _tail(self.log_dir / "munged.out")
                               + _tail(self.log_dir / "munged.log"))

    def _write_slurm_conf(self) -> None:
        s = self.run_dir / "slurm"
        (s / "ctld").mkdir(mode=0o700, exist_ok=True)
        conf = f"""\
# slurm.conf of the emulated test cluster (tests/cluster.py); one per run
ClusterName=mpilabtest
SlurmctldHost={HEAD_NAME}({self.head_address})
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
# slurmctld binds the bridge address only. Not NoInAddrAny: with it srun on the head side
# binds its I/O and response ports to what this machine's hostname resolves to (127.0.0.1
# here), which the nodes cannot reach; slurmd has only its node's address to bind anyway.
CommunicationParameters=NoCtldInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={s / 'ctld'}
SlurmdSpoolDir={s / 'spool-%n'}
SlurmctldPidFile={s / 'slurmctld.pid'}
SlurmdPidFile={s / 'slurmd-%n.pid'}
SlurmctldLogFile={self.log_dir / 'slurmctld.log'}
SlurmdLogFile={self.log_dir / 'slurmd-%n.log'}
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=/dev/null
# no cgroups, no accounting: processes are tracked by /proc (inside the node's PID namespace)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# a batch job is scheduled as it is submitted, not up to 3 s later (Slurm's default
# batch_sched_delay, which spares a busy controller the work of scheduling each job)
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
SwitchType=switch/none
# the nodes report this machine's cores; the configured CPUs count
SlurmdParameters=config_overrides
ReturnToService=2
# short timeouts, so that failures show within seconds
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=5
TCPTimeout=2
KillWait=2
MinJobAge=2
InactiveLimit=0
Waittime=0
UnkillableStepTimeout=10
"""
        for n in self.nodes:
            conf += (f"NodeName={n.name} NodeAddr={n.address} NodeHostname={n.name} "
                     f"CPUs={self.cpus_per_node} Sockets=1 CoresPerSocket={self.cpus_per_node}"
                     " ThreadsPerCore=1 State=UNKNOWN\n")
        conf += f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        self.slurm_conf.write_text(conf)
        # Slurm reads cgroup.conf beside slurm.conf. Naming the plugin skips slurmd's probe of
        # /sys/fs/cgroup, which is empty in a network namespace's fresh /sys; no cgroup-based
        # plugin is configured, so nothing is constrained.
        (s / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        for n in self.nodes:
            (s / f"spool-{n.name}").mkdir(mode=0o700, exist_ok=True)

    def _start_slurmctld(self) -> None:
        log = open(self.log_dir / "slurmctld.out", "wb")
        hosts = self.run_dir / "slurm" / "hosts"
        hosts.write_text(self._hosts_file())
        # Its own UTS namespace: slurmctld runs only on a host named as SlurmctldHost says.
        # Its own mount namespace, with the cluster's hosts file: it resolves its own name
        # to bind the bridge address only (NoCtldInAddrAny).
        proc = subprocess.Popen(
            ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
             f'hostname {HEAD_NAME} && mount --bind "$1" /etc/hosts '
             '&& exec slurmctld -D -i -f "$0"', str(self.slurm_conf), str(hosts)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=self.slurm_env())
        log.close()
        self._children.append(proc)
        self._state.head["slurmctld"] = Proc.of(proc.pid)
        self._state.save()

    def _cores_of(self, node: Node) -> list[int]:
        """The cores of this machine that `node` runs on: an even share, no core shared
        with another node while there are enough (2 cores, 2 nodes: one each), as each
        host of a cluster has cores of its own. Were the nodes all on every core, 2 ranks
        on each of 2 nodes would each see 2 cores for 2 ranks and start as if they had
        them (torch imported and a warm-up run by each), while 4 ranks shared 2 cores."""
        cores = sorted(os.sched_getaffinity(0))
        if self.every_core:
            return cores
        index = self.nodes.index(node)
        share = max(1, len(cores) // len(self.nodes))
        if share * len(self.nodes) > len(cores):  # more nodes than cores: one each, in turn
            return [cores[index % len(cores)]]
        return cores[index * share:(index + 1) * share]

    def _start_nodes(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            nd = self.run_dir / "nodes" / n.name
            nd.mkdir(mode=0o700, exist_ok=True)
            daemons = []
            if self.ssh:
                daemons.append(["sshd", ["/usr/sbin/sshd", "-D", "-e", "-f",
                                         str(nd / "sshd_config")]])
            if self.slurm:
                daemons.append(["slurmd", ["slurmd", "-D", "-N", n.name,
                                           "-f", str(self.slurm_conf)]])
            spec = {"hostname": n.name, "daemons": daemons, "log_dir": str(self.log_dir),
                    "ready": str(nd / "ready.json"), "env": {"SLURM_CONF": str(self.slurm_conf)},
                    "cpus": self._cores_of(n)}
            (nd / "spec.json").write_text(json.dumps(spec))
            log = open(self.log_dir / f"init-{n.name}.log", "wb")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", n.netns,
                 "unshare", "--uts", "--pid", "--mount-proc", "--fork", "--kill-child",
                 sys.executable, str(Path(__file__).resolve()), "_node-init",
                 str(nd / "spec.json")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
            log.close()
            self._children.append(holder)
            n.holder = Proc.of(holder.pid)
            self._state.nodes = self.nodes
            self._state.save()
        for n in nodes:
            _wait_for(lambda n=n: bool(_children(n.holder.pid)) or not n.holder.alive(), 10,
                      f"{n.name}'s init to start")
            kids = _children(n.holder.pid)
            if not kids:
                raise ClusterError(f"{n.name}'s init did not start: "
                                   + _tail(self.log_dir / f"init-{n.name}.log"))
            n.init = Proc.of(kids[0])
            self._state.save()

    def _wait_ready(self, deadline: float, nodes: Sequence[Node], restarted: bool = False,
                    ) -> None:
        """Wait for the nodes' daemons: sshd accepting, slurmd registered (the node idle,
        or for a restarted node, any state in which it responds)."""
        for n in nodes:
            ready = self.run_dir / "nodes" / n.name / "ready.json"
            _wait_for(lambda ready=ready, n=n: ready.exists() or not n.init.alive(),
                      deadline - time.monotonic(), f"{n.name}'s daemons to start")
            if not n.init.alive():
                raise ClusterError(f"{n.name}'s init exited: "
                                   + _tail(self.log_dir / f"init-{n.name}.log"))
            ns_pids = json.loads(ready.read_text())
            by_ns_pid = {_ns_pid(p): p for p in _children(n.init.pid)}
            n.daemons = {name: Proc.of(by_ns_pid[p]) for name, p in ns_pids.items()
                         if p in by_ns_pid}
            self._state.save()
        if self.ssh:
            for n in nodes:
                _wait_for(lambda n=n: _port_open(n.address, SSH_PORT) or not n.init.alive(),
                          deadline - time.monotonic(), f"sshd on {n.name}",
                          lambda n=n: _tail(self.log_dir / f"sshd-{n.name}.log"))
        if self.slurm:
            def idle() -> bool:
                if not self._state.head["slurmctld"].alive():
                    raise ClusterError("slurmctld exited: "
                                       + _tail(self.log_dir / "slurmctld.out")
                                       + _tail(self.log_dir / "slurmctld.log"))
                for n in nodes:
                    if "slurmd" in n.daemons and not n.daemons["slurmd"].alive():
                        raise ClusterError(f"slurmd on {n.name} exited: "
                                           + _tail(self.log_dir / f"slurmd-{n.name}.log"))
                try:
                    states = self.sinfo()
                except ClusterError:
                    return False
                if restarted:
                    return all(not states.get(n.name, "*").endswith("*")
                               and states[n.name] not in ("down", "drain", "fail")
                               for n in nodes)
                return all(states.get(n.name) == "idle" for n in nodes)
            _wait_for(idle, deadline - time.monotonic(), "the Slurm nodes to be idle",
                      lambda: _tail(self.log_dir / "slurmctld.log") + "".join(
                          _tail(self.log_dir / f"slurmd-{n.name}.log") for n in nodes))

    def restart_node(self, node: str, timeout: float = UP_TIMEOUT) -> None:
        """Start `node` afresh (a new init, sshd and slurmd in its network namespace), as a
        host that reboots; what ran on it is killed first. Its link state is kept."""
        n = self.node(node)
        if self._state is None:
            raise ClusterError("restart_node() needs the cluster up in this process")
        old = [p for p in (n.init, n.holder) if p is not None]
        for p in old:
            _kill(p.pid, p.start)
        _wait_gone([(p.pid, p.start) for p in old], 10)
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / "nodes" / n.name / "ready.json").unlink()
        n.init = n.holder = None
        n.daemons = {}
        self._start_nodes([n])
        self._wait_ready(time.monotonic() + timeout, [n], restarted=True)
        self._state.save()

    # -- down ----------------------------------------------------------------------------

    def down(self) -> None:
        """Take everything down (see the module doc); safe to call twice."""
        try:
            state = State.load(self.layout)
            if state is None and self._state is not None:
                state = self._state
            _teardown(self.layout, state, self.nodes)
        finally:
            for child in self._children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=1)
            self._children = []
            self._state = None
            for n in self.nodes:
                n.init = n.holder = None
                n.daemons = {}
            self._release_lock()


def _sshd_config(n: Node, nd: Path, ssh_dir: Path) -> str:
    return f"""\
# sshd of emulated node {n.name} (tests/cluster.py): key login only, this run's keys
ListenAddress {n.address}
Port {SSH_PORT}
HostKey {nd / 'ssh_host_ed25519_key'}
PidFile none
AuthorizedKeysFile {ssh_dir / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
UseDNS no
X11Forwarding no
PrintMotd no
PrintLastLog no
MaxStartups 100:30:200
MaxSessions 100
ClientAliveInterval 2
ClientAliveCountMax 3
LogLevel INFO
"""


def _set_sysctl(key: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys", key).write_text(value)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- {path.name} ---\n" + "\n".join(text)


def _wait_for(cond, timeout: float, what: str, detail=None) -> None:
    deadline = time.monotonic() + max(timeout, 0)
    while not cond():
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out waiting for {what}" + (detail() if detail else ""))
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------
# teardown: from a state file, and by the harness's names


def _netns_pids(netns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _our_netns(layout: Layout) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if layout.ours(n)]


def _our_links(layout: Layout) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [n for n in names if layout.ours(n)]


def leftovers(layout: Layout = Layout()) -> list[str]:
    """What of `layout`'s cluster exists now (empty after a clean `down`)."""
    found = [f"netns {n}" for n in _our_netns(layout)]
    found += [f"link {n}" for n in _our_links(layout)]
    etc = Path("/etc/netns")
    if etc.is_dir():
        found += [f"{p}" for p in etc.iterdir() if layout.ours(p.name)]
    if layout.run_dir.exists():
        found.append(str(layout.run_dir))
    return found


def _teardown(layout: Layout, state: State | None, nodes: Sequence[Node] = ()) -> None:
    """End and remove everything `state` records, then whatever else carries our names."""
    victims: list[tuple[int, int | None]] = []
    node_records = list(state.nodes) if state else []
    node_records += [n for n in nodes if n.init is not None]
    for n in node_records:
        for p in (n.init, n.holder):
            if p is not None:
                _kill(p.pid, p.start)     # init first: its whole PID namespace dies with it
                victims.append((p.pid, p.start))
    # whatever still runs in our network namespaces (a test's own `ip netns exec`, or a
    # crashed run's nodes when its state file is gone) is ours by construction
    netns = set(_our_netns(layout)) | set(state.netns if state else [])
    for ns in netns:
        for pid in _netns_pids(ns):
            start = _start_time(pid)
            _kill(pid, start)
            victims.append((pid, start))
    if state:
        for p in state.head.values():
            _kill(p.pid, p.start, signal.SIGTERM)
            victims.append((p.pid, p.start))
    _wait_gone(victims, 5)
    for pid, start in victims:
        _kill(pid, start)
    _wait_gone(victims, 5)
    for link in set(_our_links(layout)) | set(state.links if state else []):
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    for ns in netns:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    etc = Path("/etc/netns")
    stale = set(state.etc_netns if state else [])
    if etc.is_dir():
        stale |= {str(p) for p in etc.iterdir() if layout.ours(p.name)}
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(OSError):
        if (state is None or state.made_etc_netns) and etc.is_dir() and not any(etc.iterdir()):
            etc.rmdir()
    shutil.rmtree(layout.run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# the init of a node (pid 1 of its PID namespace), run as `cluster.py _node-init SPEC`


def _node_init(spec_path: str) -> None:
    """Name the host, give it a private /run, start its daemons, reap orphans forever.

    Killing this process ends the node: the kernel kills the rest of its PID namespace.
    """
    spec = json.loads(Path(spec_path).read_text())
    socket.sethostname(spec["hostname"])
    os.sched_setaffinity(0, spec["cpus"])  # the daemons, and all they start, inherit it
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=16m", "tmpfs", "/run"],
                   check=True)
    os.makedirs("/run/sshd", mode=0o755)
    env = {**os.environ, **spec["env"]}
    pids = {}
    for name, argv in spec["daemons"]:
        log = open(Path(spec["log_dir"]) / f"{name}-{spec['hostname']}.log", "ab")
        pids[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, env=env).pid
        log.close()
    tmp = spec["ready"] + ".tmp"
    Path(tmp).write_text(json.dumps(pids))
    os.replace(tmp, spec["ready"])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(1)


# ---------------------------------------------------------------------------------------
# command line


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster",
                                     description="The emulated multi-host test cluster.")
    parser.add_argument("--instance", default="",
                        help="a second cluster beside the default one: one of a-z, 0-9")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring it up (and leave it up)")
    p_up.add_argument("--nodes", type=int, default=2, help="how many nodes (default 2)")
    p_up.add_argument("--cpus", type=int, default=None, help="Slurm CPUs per node")
    p_up.add_argument("--no-slurm", action="store_true")
    p_up.add_argument("--no-ssh", action="store_true")
    p_down = sub.add_parser("down", help="take it down, and any leftovers of a crashed run")
    p_down.add_argument("--force", action="store_true",
                        help="even while a test session holds it")
    sub.add_parser("status", help="what runs now")
    p_init = sub.add_parser("_node-init")
    p_init.add_argument("spec")
    args = parser.parse_args(argv)

    if args.cmd == "_node-init":
        _node_init(args.spec)
        return 0
    if args.cmd == "up":
        c = EmulatedCluster([f"node{i}" for i in range(1, args.nodes + 1)],
                            slurm=not args.no_slurm, ssh=not args.no_ssh,
                            cpus_per_node=args.cpus, lock_timeout=0, instance=args.instance)
        try:
            c.up()
        except ClusterError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        c._state.manual = True
        c._state.save()
        c._release_lock()
        print(f"up in {c.up_seconds:.1f} s: " + ", ".join(
            f"{n.name}={n.address}" for n in c.nodes)
            + f"; head={c.head_address} ({c.head_interface})")
        print("environment for the head side:")
        for k, v in c.env().items():
            if k == "PATH":
                v = f"{c.ssh_wrapper.parent}:$PATH"
            print(f"  export {k}={v}")
        print(f"then: ssh node1 hostname; sinfo; {c.run_dir / 'log'} has the daemons' logs")
        return 0
    if args.cmd == "down":
        c = EmulatedCluster((), lock_timeout=0, instance=args.instance)
        try:
            c._acquire_lock()
        except ClusterError as e:
            if not args.force:
                print(f"error: {e}; it is taken down when that session ends "
                      "(--force to take it down now)", file=sys.stderr)
                return 1
        c.down()
        left = leftovers(c.layout)
        if left:
            print(f"error: still there after down: {', '.join(left)}", file=sys.stderr)
            return 1
        print("down: no test namespaces, links, daemons or run directory left")
        return 0
    info = EmulatedCluster((), instance=args.instance).status()
    print(json.dumps(info, indent=1))
    return 0


# ---------------------------------------------------------------------------------------
# the pytest fixture (tests/conftest.py imports it)

try:
    import pytest
except ImportError:  # the command line runs without pytest
    pytest = None

_session_cluster: EmulatedCluster | None = None

if pytest is not None:
    @pytest.fixture(scope="session")
    def emulated_cluster() -> Iterator[EmulatedCluster]:
        """node1..node3 with sshd and slurmd, up once per test session, always taken down.

        Tests needing two nodes use node1 and node2 (`hostfile(nodes=...)`, `sbatch -N2`).
        Registered more than once (a test module and conftest), the first instance serves.
        MPILAB_TESTCLUSTER_REUSE=1 uses the cluster brought up by hand instead (for quick
        reruns while working; it stays up). The lock wait (another session holds the
        cluster) stays under pytest-timeout's 300 s, so that its own message is the one shown.
        """
        global _session_cluster
        if _session_cluster is not None:
            yield _session_cluster
            return
        if os.environ.get("MPILAB_TESTCLUSTER_REUSE") == "1":
            # a cluster brought up by hand (`python -m tests.cluster up --nodes 3`), kept up
            yield EmulatedCluster.attach()
            return
        cluster = EmulatedCluster(("node1", "node2", "node3"), lock_timeout=240)
        _session_cluster = cluster
        try:
            cluster.up()
            yield cluster
        finally:
            _session_cluster = None
            cluster.down()


if __name__ == "__main__":
    sys.exit(_cli())

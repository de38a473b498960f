"""Start, stop, restart and inspect the rank cluster (ipyparallel engines under mpiexec
or Slurm, on this host or on others).

Usable from plain Python: ``RankCluster(ClusterConfig(n=2)).start()``. The magics only
parse arguments and call this. Where the ranks run (which hosts, through which launcher)
and the address they reach the notebook at are worked out in `placement.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import host_check, lifeline, placement
from .metrics_store import MetricsStore
from .placement import ClusterError
from .rank_input import InputDesk
from .receiver import RecordReceiver
from .selection import host_list
from .wire import (
    COLLECTIVE_TIMEOUT_ENV,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    exit_reports,
    gpu_spec,
    rank_label,
)

LAUNCHERS = ("mpi", "slurm")


@dataclass
class ClusterConfig:
    n: int = 2
    gpus: str = "auto"
    backend: str = "auto"
    launcher: str = "mpi"
    hostfile: str | None = None
    controller_ip: str | None = None  # None: chosen from where the ranks run
    mpiexec: str | None = None
    timeout: float = 120.0
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S  # torch.distributed's own
    slurm: placement.SlurmSettings = field(default_factory=placement.SlurmSettings)

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ClusterError(f"-n must be a positive number of ranks, got {self.n!r}")
        if self.launcher == "ssh":
            raise ClusterError(
                "--launcher ssh would start each engine on its own, not as one MPI job: "
                "use --launcher mpi --hostfile FILE (mpiexec reaches the hosts over ssh)")
        if self.launcher not in LAUNCHERS:
            raise ClusterError(f"--launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        if self.hostfile and self.launcher != "mpi":
            raise ClusterError("--hostfile goes with --launcher mpi; under slurm, the "
                               "allocation places the ranks")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ClusterError(f"--backend {self.backend!r} is not auto, nccl or gloo")
        if self.hostfile and not Path(self.hostfile).is_file():
            raise ClusterError(f"--hostfile {self.hostfile}: no such file")
        if self.timeout <= 0:
            raise ClusterError(f"--timeout must be positive, got {self.timeout}")
        if self.collective_timeout <= 0:
            raise ClusterError("--collective-timeout must be positive, got "
                               f"{self.collective_timeout}")
        if self.launcher != "slurm" and self.slurm.given():
            raise ClusterError(f"{self.slurm.given()[0]} is a Slurm setting: add "
                               "--launcher slurm")
        self.slurm.validate()
        if self.controller_ip is not None:
            placement.check_local_ip(self.controller_ip)
        try:
            gpu_spec(self.gpus)
        except ValueError as e:
            raise ClusterError(str(e)) from None


# The controller finishes an engine's registration at its first heartbeat ping after the
# engine registered, and pings every 3 s by default: an engine a moment late (its rank
# imports torch while it registers) waited up to 3 s more. Pings every half second; an
# engine is still given up after 30 s of silence, as by default.
HEARTBEAT_ARGS = ("--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=60")


def find_mpiexec(explicit: str | None = None) -> str:
    """--mpiexec, then $MPILAB_MPIEXEC, then beside this Python, then PATH."""
    candidates = [
        ("--mpiexec", explicit),
        ("$MPILAB_MPIEXEC", os.environ.get("MPILAB_MPIEXEC")),
        ("the Python environment", str(Path(sys.executable).parent / "mpiexec")),
    ]
    for origin, path in candidates:
        if not path:
            continue
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
        if origin != "the Python environment":
            raise ClusterError(f"{origin} {path}: not an executable mpiexec")
    found = shutil.which("mpiexec")
    if found:
        return found
    raise ClusterError(
        "mpiexec not found: install MPI into this environment with `pip install mpich mpi4py`, "
        "or point --mpiexec / $MPILAB_MPIEXEC at your system's mpiexec"
    )


# what one rank takes on its host before any cell runs: its engine ~60 MB, its supervisor
# and ipyparallel's nanny ~35 MB (private memory, measured with torch imported)
RANK_BYTES = 100 << 20


def check_memory_here(n: int, elsewhere: str = "") -> None:
    """Ranks that cannot fit in this host's memory are refused before a process is made
    (-n 1000 for -n 100 would end in the kernel's OOM killer, which picks any process).
    `elsewhere`: how to place them on other hosts instead, for the message."""
    from .rank.memory import available_memory

    available = available_memory()
    if available is not None and n * RANK_BYTES > available:
        raise ClusterError(
            f"-n {n}: {n} ranks on this host take about {n * RANK_BYTES / 2**30:.1f} GiB "
            f"before any cell runs, and it has {available / 2**30:.1f} GiB available: start "
            f"at most {available // RANK_BYTES} here{elsewhere}")


# a host whose clock is this far from the notebook's is named when the ranks start: mpilab
# reads the ranks' times on the notebook's clock (mpilab.rank_clocks), the user's code
# there does not
CLOCK_NOTE_S = 5.0
# a start that takes this long says how far it got, in place under the cell, while it
# goes on (a few ranks start in a few seconds; tens of ranks, or a thousand, take longer);
# one whose Slurm job waits in the queue says so sooner (a job usually leaves the queue
# in a second or two, and a queue can hold it for minutes)
START_NOTE_AFTER_S = 10.0
QUEUE_NOTE_AFTER_S = 3.0


@dataclass
class StartReport:
    ranks: list[dict]
    seconds: float
    job: str | None = None  # "Slurm job 5", "Slurm allocation 42", "PBS job 7.head"
    clocks_off: dict[str, float] = field(default_factory=dict)  # host -> s behind ours

    def line(self) -> str:
        hosts = {r["host"] for r in self.ranks}
        devices = sorted({r["device"] for r in self.ranks})
        backend = self.ranks[0]["backend"] if self.ranks else "?"
        held = f" in {self.job}" if self.job else ""
        return (
            f"mpilab: {len(self.ranks)} ranks on {host_list(hosts)}{held} · "
            f"devices {', '.join(devices)} · backend {backend} · ready in {self.seconds:.1f} s"
        )

    def notes(self) -> list[str]:
        """Lines under the start line: hosts whose CPU ranks outnumber their cores, and
        hosts whose clocks are CLOCK_NOTE_S or more off from this one's (a thousand
        ranks' hosts read as one range in each)."""
        return [note for note in (self._crowded_note(), self._clock_note()) if note]

    def _crowded_note(self) -> str:
        """CPU ranks take turns on a host with fewer cores than ranks: each step waits for
        the slowest, so more ranks there train slower, not faster. A host's cores are
        those its ranks may run on, together (each rank bound to its own, or all to all)."""
        ranks: dict[str, int] = {}
        cpus: dict[str, set[int]] = {}
        for r in self.ranks:
            if r["device"] == "cpu":
                ranks[r["host"]] = ranks.get(r["host"], 0) + 1
                cpus.setdefault(r["host"], set()).update(r.get("cpus", ()))
        crowded = {host: (n, len(cpus[host])) for host, n in ranks.items()
                   if cpus[host] and n > len(cpus[host])}
        if not crowded:
            return ""
        shapes = sorted(set(crowded.values()))
        counts = (f"{shapes[0][0]} ranks on {shapes[0][1]} core{'s' * (shapes[0][1] > 1)}"
                  if len(shapes) == 1 else "more ranks than cores")
        runs = "runs" if len(crowded) == 1 else "each run"
        fits = min(c for _, c in crowded.values())
        return (f"mpilab: {host_list(crowded)} {runs} {counts}: the ranks take turns on the "
                f"cores, so ranks past {fits} a host add no speed (fine for trying code, not "
                "for timing it)")

    def _clock_note(self) -> str:
        off = self.clocks_off
        if not off:
            return ""
        if len(off) == 1:
            (host, by), = off.items()
            whose = (f"{host}'s clock is {abs(by):.0f} s "
                     f"{'behind' if by > 0 else 'ahead of'} this host's")
        else:
            spread = sorted(abs(by) for by in off.values())
            whose = (f"the clocks of {host_list(off)} are {spread[0]:.0f}–{spread[-1]:.0f} s "
                     "off this host's")
        return (f"mpilab: {whose} (no NTP there?): mpilab reads the ranks' times on this "
                "clock, but the times your code reads there differ")


@dataclass
class RankCluster:
    """The running cluster: controller, engines (one per rank), client, record channel."""

    config: ClusterConfig = field(default_factory=ClusterConfig)
    ranks: list[dict] = field(default_factory=list)
    engine_of_rank: dict[int, int] = field(default_factory=dict)
    store: MetricsStore | None = None
    dead: dict[int, str] = field(default_factory=dict)  # rank -> how it died
    # which ranks these are: each start and stop makes it new, so that a cell still
    # followed in the background (--noblock) acts on the ranks it ran on, never on the
    # ones started after them
    generation: int = 0
    _ipp_cluster: object = None
    _client: object = None
    _receiver: RecordReceiver | None = None
    input_desk: InputDesk | None = None  # where the ranks' input() asks the notebook
    _lifeline: lifeline.Lifeline | None = None
    _local: dict | None = None  # local_processes(), made once per start
    # what the start launched on this host (psutil handles): mpiexec's children are kept
    # as they appear, so that a stop after mpiexec died first still ends them (an srun
    # left alone keeps its step, and a proxy on another node, alive)
    _launched: list = field(default_factory=list)
    # in an allocation (where mpiexec launches with srun): its job id and the name of
    # the step of this start's mpiexec proxies; a stop cancels what still runs under it
    # (an srun orphaned by an mpiexec that died within the first second is never seen
    # among mpiexec's children, and its step keeps the allocation's tasks busy)
    _allocation: tuple[str, str] | None = None
    # the hostfile the ranks go by: --hostfile's, or the PBS job's node file
    _hostfile: str | None = None
    # the paths every rank's host needs, asked of the hosts where a start fails
    _needed: list[host_check.Needed] = field(default_factory=list)
    # told, about once a second, how far a slow start got (START_NOTE_AFTER_S), or why
    # it waits (QUEUE_NOTE_AFTER_S); the caller clears it when the start ends
    waiting: Callable[[str], None] | None = None
    _queued: tuple[str, str] | None = None  # (job, squeue's reason) while it pends
    _began = 0.0  # when the start began (time.monotonic)

    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def client(self):
        if self._client is None:
            raise ClusterError("no ranks are running: start them with `%mpilab start -n N`")
        return self._client

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def slurm(self) -> str | None:
        """The Slurm job or allocation the ranks run in ('job 5', 'allocation 42'); None
        outside Slurm. Slurm's end of it ends them: its output says why."""
        jobs = _slurm_jobs(self._ipp_cluster)
        return f"job {jobs[0]}" if jobs else \
            f"allocation {self._allocation[0]}" if self._allocation else None

    def _held_by(self) -> str | None:
        """The batch job the ranks run in, for the start line."""
        if self.slurm:
            return f"Slurm {self.slurm}"
        if self._hostfile and self._hostfile != self.config.hostfile:  # a PBS job's nodes
            return placement.pbs_job()
        return None

    def start(self) -> StartReport:
        if self.running:
            raise ClusterError(
                "ranks are already running: `%mpilab stop` or `%mpilab restart` first"
            )
        cfg = self.config
        cfg.validate()
        self.generation += 1
        self._began = time.monotonic()
        into_allocation = placement.into_allocation(cfg.launcher, cfg.hostfile)
        mpiexec = find_mpiexec(cfg.mpiexec)  # a Slurm job's script runs it on the nodes too
        self._needed = host_check.needed(mpiexec)
        if into_allocation:
            job = os.environ["SLURM_JOB_ID"]
            if cfg.slurm.given():  # they ask for a job of their own: said, not ignored
                raise ClusterError(
                    f"{cfg.slurm.given()[0]} asks for a new Slurm job, but this kernel runs "
                    f"in Slurm allocation {job}, where the ranks go: start without it, or "
                    "`%env SLURM_JOB_ID=` first to submit a job of their own")
            # with --launcher slurm the allocation's tasks are the ranks' places; under
            # plain mpiexec, as in the allocation's shell, ranks beyond them share its
            # nodes (a job of one task and many cores, as JupyterLab in a job often is)
            held = placement.allocation_tasks() if cfg.launcher == "slurm" else None
            if held is not None and held < cfg.n:
                raise ClusterError(
                    f"the Slurm allocation {job} holds {held} tasks, "
                    f"fewer than -n {cfg.n}: ask salloc for more, or start fewer ranks")
        self._hostfile = placement.batch_nodefile(cfg.launcher, cfg.hostfile)
        where = placement.place(cfg.launcher, self._hostfile, cfg.controller_ip, cfg.slurm)
        placement.check_transports(where.listen_ip, cfg.n)
        if not where.remote and not placement.in_allocation():  # every rank on this host
            check_memory_here(cfg.n, ", or place them on several hosts (--hostfile, "
                                     "--launcher slurm)")
        started = time.perf_counter()
        saved = self.store.latest_event("checkpoint", rank=0) if self.store else None
        self.store = MetricsStore(world_size=cfg.n)
        if saved is not None:  # a later restart still names it: the file outlives the ranks
            self.store.add(saved)
        self._receiver = RecordReceiver(self.store, ip=where.listen_ip)
        self.input_desk = InputDesk(ip=where.listen_ip)
        self._lifeline = lifeline.Lifeline(where.listen_ip)
        try:
            self._start_engines(mpiexec, where, into_allocation)
            self._bootstrap()
        except BaseException:
            self.stop()
            raise
        return StartReport(ranks=self.ranks, seconds=time.perf_counter() - started,
                           job=self._held_by(), clocks_off=self._clocks_off())

    def _clocks_off(self) -> dict[str, float]:
        """host -> how far its clock is behind this one's (s; negative: ahead), for the
        hosts CLOCK_NOTE_S or more off, from the ranks' heartbeats so far: a rank's first
        leaves as its agent starts, before its bootstrap ends."""
        offsets = {r["host"]: self.store.clocks.offset(r["rank"]) for r in self.ranks}
        return {host: off for host, off in offsets.items() if abs(off) >= CLOCK_NOTE_S}

    def _start_engines(self, mpiexec: str, where: placement.Placement,
                       into_allocation: bool) -> None:
        import ipyparallel as ipp

        cfg = self.config
        batch = cfg.launcher == "slurm" and not into_allocation
        cluster = ipp.Cluster(
            engines="slurm" if batch else "mpi",
            n=cfg.n,
            controller_ip=where.listen_ip,
            delay=0,  # engines wait for the controller's connection info anyway
            engine_timeout=int(cfg.timeout),
            log=_quiet_log(),
            shutdown_atexit=False,  # our Session.shutdown ends everything, by pid, fast
            # no cluster file: ipyparallel's JupyterLab panel lists clusters from those,
            # and its STOP button would end the ranks behind mpilab's back
            cluster_file="",
            controller_args=list(HEARTBEAT_ARGS),
        )
        # the controller and every engine hold this kernel's lifeline and end themselves
        # when it is gone (killed, crashed, unreachable), on whichever host they run
        os.environ[lifeline.ENV] = self._lifeline.address
        os.environ[COLLECTIVE_TIMEOUT_ENV] = str(cfg.collective_timeout)
        cluster.config.LocalControllerLauncher.controller_cmd = [
            sys.executable, "-m", "mpilab.controller_main"]
        # each engine runs under its supervisor (mpilab.rank.supervisor), and starts
        # importing torch while it registers
        engine_cmd = [sys.executable, "-m", "mpilab.rank.supervisor"]
        for launcher in ("MPIEngineSetLauncher", "SlurmEngineSetLauncher"):
            cluster.config[launcher].engine_cmd = engine_cmd
        if batch:
            slurm = cluster.config.SlurmEngineSetLauncher
            slurm.batch_template = placement.batch_script(
                cfg.slurm, mpiexec, host_check.srun_probe(self._needed))
            # the script beside the cluster's other files, not in the notebook's folder
            # (the job itself starts in the notebook's folder, as the ranks' cwd)
            scripts = Path(cluster.profile_dir) / "log"
            scripts.mkdir(parents=True, exist_ok=True)
            slurm.batch_file_name = str(scripts / f"mpilab-{cluster.cluster_id}.sbatch")
            # sbatch's error goes into the start's line, not past it onto the cell's
            # stderr: submitted with its stderr on its stdout, and the job's number
            # read from its own sentence (a warning line may hold other numbers)
            slurm.submit_command = ["sh", "-c", 'exec sbatch "$@" 2>&1', "sbatch"]
            slurm.job_id_regexp = r"Submitted batch job (\d+)"
            slurm.job_id_regexp_group = 1
        else:
            cluster.config.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
            if placement.in_allocation():
                # mpiexec launches with srun there, hostfile or not: its proxies' step
                # takes a name of this start's, which the stop cancels
                name = placement.proxy_step_name(cluster.cluster_id)
                cluster.config.MPIEngineSetLauncher.environment = {
                    **placement.proxy_step_env(name), **placement.step_layout()}
                self._allocation = (os.environ["SLURM_JOB_ID"], name)
            if into_allocation:
                cluster.config.MPIEngineSetLauncher.mpi_args = list(placement.SLURM_MPIEXEC_ARGS)
            elif self._hostfile:
                cluster.config.MPIEngineSetLauncher.mpi_args = ["-f", self._hostfile]
        self._ipp_cluster = cluster
        try:
            cluster.start_cluster_sync()
            client = cluster.connect_client_sync()
            _bind_parallel_magics(client)
        except Exception as e:  # noqa: BLE001 - every start failure becomes one line + log
            raise ClusterError(self._start_failure(e)) from None
        self._client = client
        self._wait_for_engines(client, cfg.n, cfg.timeout)

    def _wait_for_engines(self, client, n: int, timeout: float) -> None:
        """Until n engines registered; a launcher that ended first (ssh refused, a job
        that failed or was cancelled) is told at once, with what it said."""
        deadline = time.monotonic() + timeout
        next_look = 0.0
        self._queued = None
        while len(client.ids) < n:
            now = time.monotonic()
            if now > deadline:
                raise ClusterError(self._start_failure(TimeoutError(
                    f"{len(client.ids)} of {n} engines registered in {timeout:.0f} s"
                    + self._job_state_note())))
            if now >= next_look:
                next_look = now + 1.0
                self._hold_launched(self._ipp_cluster)
                ended = self._launcher_ended()
                if ended:
                    raise ClusterError(self._start_failure(RuntimeError(ended)))
                waited = now - self._began
                if self._queued and waited >= QUEUE_NOTE_AFTER_S:
                    job, reason = self._queued
                    self._tell(f"the Slurm job {job} waits in the queue ({reason}): "
                               f"{waited:.0f} s of the start's {timeout:.0f} s (--timeout)")
                elif waited >= START_NOTE_AFTER_S:
                    self._tell(f"{len(client.ids)} of {n} ranks started, {waited:.0f} s")
            time.sleep(0.1)

    def _tell(self, note: str) -> None:
        """How far the start got, to whoever watches it (`waiting`)."""
        if self.waiting is not None:
            self.waiting(f"mpilab: {note}")

    def _hold_launched(self, cluster) -> None:
        """Add what runs below `cluster`'s launchers now to what the start launched."""
        if cluster is not None:
            held = set(self._launched)
            self._launched += [p for p in _launched_processes(cluster) if p not in held]

    def _launcher_ended(self) -> str | None:
        """Why the engines' launcher is gone before they all registered (None: it runs).
        A Slurm job that no wait will start raises ClusterError; one that waits in the
        queue is kept in `_queued` for the start's note."""
        for engine_set in getattr(self._ipp_cluster, "engines", {}).values():
            job = getattr(engine_set, "job_id", None)
            if job:
                state = placement.slurm_job_state(job, with_reason=True)
                ended = state.partition(" ")[0] if state else None
                if ended is None or ended in placement.SLURM_END_STATES:
                    return f"the Slurm job {job} ended ({ended or 'gone'})"
                instead = placement.never_starts(state)
                if instead:  # nothing the ranks said: Slurm's reason is the whole story
                    raise ClusterError(f"the Slurm job {job} will not start: it asks for "
                                       f"{instead} (squeue: {state})")
                reason = placement.pending_reason(state)
                self._queued = (job, reason) if reason is not None else None
                continue
            process = getattr(engine_set, "process", None)
            if process is not None and not process.is_running():
                return "mpiexec exited"
            if process is not None:
                try:
                    if process.status() == "zombie":
                        return "mpiexec exited"
                except Exception:  # noqa: BLE001 - gone between the two looks
                    return "mpiexec exited"
        # a proxy srun could not start (in a Slurm job or allocation), or an engine whose
        # Python lacks mpilab, leaves the other ranks waiting for it in MPI's start
        output = self.engine_output(lines=None)
        failed = _SRUN_TASK_FAILED.search(output)
        if failed:
            return f"srun's task on {failed['node']} exited with code {failed['code']}"
        if _SRUN_NO_STEP.search(output):  # mpiexec then waits for proxies that never come
            return "srun could not start mpiexec's proxies"
        if _NO_MPILAB.search(output):
            return "an engine's Python could not import mpilab"
        return None

    def _job_state_note(self) -> str:
        for engine_set in getattr(self._ipp_cluster, "engines", {}).values():
            job = getattr(engine_set, "job_id", None)
            if job:
                state = placement.slurm_job_state(job, with_reason=True)
                if placement.pending_reason(state) is not None:
                    return (f"; the Slurm job {job} is still in the queue, {state}: a longer "
                            "--timeout waits for it")
                return f"; the Slurm job {job} is {state or 'gone'}"
        return ""

    def _start_failure(self, error: Exception) -> str:
        """One line: what happened and the launcher's own word for why (ssh's, sbatch's,
        srun's, an engine's), then where the launcher's whole output is."""
        output = self.engine_output(lines=None)
        what = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, subprocess.CalledProcessError) and "sbatch" in error.cmd:
            what = f"sbatch exited with code {error.returncode}"
            output = (error.output or b"").decode(errors="replace") + output
        msg = f"the ranks did not start ({what})"
        cause = self._what_hosts_lack(output) or telling_line(output)
        if cause:
            msg += f": {cause}"
            given = self.config.controller_ip
            if given and cause.startswith(lifeline.UNREACHABLE):
                msg += (f" (the ranks' hosts do not reach --controller-ip {given}: give an "
                        "address on the network they share, or leave it out to listen where "
                        "the route towards them leaves this host)")
        elif output:
            msg += "; the engines said:\n" + "\n".join(output.splitlines()[-5:])
        if self.config.hostfile and placement.in_allocation() and _SRUN_NO_STEP.search(output):
            msg += (f" (in Slurm allocation {os.environ['SLURM_JOB_ID']} mpiexec starts the "
                    "ranks with srun on the hostfile's hosts, which must be the allocation's "
                    "nodes by their Slurm names; or start without --hostfile)")
        log = self.engine_log_path()
        if log and output:
            msg += f" (the launcher's whole output: {log})"
        return msg

    def _what_hosts_lack(self, output: str) -> str | None:
        """Which host lacks the environment, mpilab in it, or the folder the ranks need,
        where one does: as a batch job's nodes (or slurmstepd) said in its output, else
        as the hosts answer when asked now."""
        return host_check.lacking_line(host_check.read_answers(output, self._needed)
                                       or self._ask_the_hosts(output))

    def _ask_the_hosts(self, output: str) -> dict[str, list[host_check.Needed]]:
        """The nodes of the allocation this kernel is in, or of the batch job while it
        runs, asked with srun; else each host of the hostfile that was to take ranks,
        over ssh (unless ssh already said why it failed)."""
        cfg = self.config
        if placement.into_allocation(cfg.launcher, cfg.hostfile):
            return host_check.ask_with_srun(self._needed)
        jobs = _slurm_jobs(self._ipp_cluster)
        if jobs:
            nodes = placement.slurm_job_nodes(jobs[0])
            asked = host_check.ask_with_srun(self._needed, jobs[0], nodes) if nodes else {}
            # a job that ended before it could be asked ran its script's probe: mpiexec's
            # srun says a task failed before the probe's answers reach the job's output
            return asked or host_check.read_answers(self.engine_output(lines=None),
                                                    self._needed)
        if self._hostfile and not said_by_a_tool(output):
            hosts = [host for host in placement.hostfile_hosts(self._hostfile, cfg.n)
                     if not placement.is_this_host(host)]
            return host_check.ask_over_ssh(hosts, self._needed)
        return {}

    def engine_log_path(self) -> str | None:
        for engine_set in getattr(self._ipp_cluster, "engines", {}).values():
            path = getattr(engine_set, "output_file", None)
            if path and os.path.exists(path):
                return str(path)
        return None

    def engine_output(self, lines: int | None = 15) -> str:
        """The last lines the engine launcher (mpiexec and the engines) wrote (None:
        all of them)."""
        cluster = self._ipp_cluster
        if cluster is None:
            return ""
        out = []
        for engine_set in getattr(cluster, "engines", {}).values():
            # read the file afresh: the launcher's get_output() caches its first read
            path = getattr(engine_set, "output_file", None)
            try:
                with open(path) as f:
                    out.append(f.read())
                continue
            except (OSError, TypeError):
                pass
            try:
                out.append(engine_set.get_output(remove=False) or "")
            except Exception:  # noqa: BLE001 - output is best-effort diagnostics
                continue
        text = "".join(out).strip()
        return text if lines is None else "\n".join(text.splitlines()[-lines:])

    def _bootstrap(self) -> None:
        from .rank.engine import bootstrap

        cfg = self.config
        view = self._client[:]
        ar = view.apply_async(bootstrap, cfg.gpus, cfg.backend, self._receiver.address,
                              cfg.timeout, self.input_desk.address)
        deadline = time.monotonic() + cfg.timeout
        while not ar.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                results = self._client.results
                raise ClusterError(bootstrap_timeout_line(
                    cfg.n, [results[m] for m in ar.msg_ids if m in results], cfg.timeout))
            waited = time.monotonic() - self._began
            if waited >= START_NOTE_AFTER_S:
                self._tell(f"{cfg.n} ranks started, {ar.progress} through their bootstrap "
                           f"(MPI, devices, torch.distributed), {waited:.0f} s")
        try:
            summaries = ar.get()
        except Exception as e:  # noqa: BLE001 - the ranks' own error, shortened
            raise ClusterError(f"rank bootstrap failed: {_remote_message(e)}") from None
        check_one_world(summaries, cfg.n)
        self.ranks = sorted(summaries, key=lambda s: s["rank"])
        self._local = None
        self.engine_of_rank = {s["rank"]: eid for s, eid in zip(summaries, ar.engine_id)}

    def stop(self, fast: bool = False) -> None:
        """Stop engines, controller and receiver, on every host; leaves nothing behind.

        Closing the lifeline ends every rank at once, on whichever host: each supervisor
        kills its engine within a quarter of a second (a rank keeps no state worth a
        graceful exit). Then mpiexec and the controller are ended by pid, ipyparallel's
        files removed, and a Slurm job cancelled and waited for.
        fast: the kernel is exiting and may be killed within seconds: wait for nothing.
        """
        self.generation += 1
        client, cluster, receiver = self._client, self._ipp_cluster, self._receiver
        held, desk = self._lifeline, self.input_desk
        self._client = self._ipp_cluster = self._receiver = self._lifeline = None
        self.input_desk = None
        self.ranks, self.engine_of_rank, self.dead, self._local = [], {}, {}, None
        self._hold_launched(cluster)
        launched, self._launched = self._launched, []
        jobs = _slurm_jobs(cluster) if cluster is not None else []
        if held is not None:
            held.close()
        if not fast:
            _wait_for_exit(launched, timeout=ENGINE_EXIT_WAIT_S)
        _end_survivors(launched, graceful=not fast)
        allocation, self._allocation = self._allocation, None
        if allocation is not None and not fast:  # a kernel that exits asks Slurm nothing
            placement.cancel_steps(*allocation, wait=placement.SLURM_CANCEL_WAIT_S)
        if cluster is not None:
            _remove_cluster_files(cluster)
        for job in jobs:
            placement.cancel_job(job, wait=0 if fast else placement.SLURM_CANCEL_WAIT_S)
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken client is fine
                pass
        if receiver is not None:
            receiver.close()
        if desk is not None:
            desk.close()

    def restart(self) -> StartReport:
        self.stop()
        return self.start()

    def mark_dead(self, dead: dict[int, str], generation: int) -> None:
        """Remember dead ranks of `generation`: status shows them, cells refuse to run until
        restart. The ranks of an earlier generation were stopped on purpose."""
        if generation == self.generation:
            self.dead.update(dead)

    def check_usable(self) -> None:
        if not self.running:
            raise ClusterError("no ranks are running: start them with `%mpilab start -n N`")
        if self.dead:
            raise ClusterError(f"{rank_label(sorted(self.dead))} died "
                               f"({next(iter(self.dead.values()))}): "
                               "`%mpilab restart` brings back a full cluster")

    def recover(self, timeout: float = 15.0) -> bool:
        """After released ranks: every rank rebuilds mpilab's communicators together."""
        from .rank.waiting import recover

        return self._on_every_rank(recover, timeout) is not None

    def realign(self, timeout: float = 15.0) -> tuple[bool, list[int] | None]:
        """After a cell that failed on some ranks, or ran on some only: whether every rank
        answered, and their collective numbers where they differed (mpilab's
        communicators then made again on every rank: `mpilab.rank.bootstrap.realign`)."""
        from .rank.bootstrap import realign

        answers = self._on_every_rank(realign, timeout)
        return answers is not None, answers[0] if answers else None

    def _on_every_rank(self, fn, timeout: float) -> list | None:
        """`fn()` run on every rank together (a collective of theirs): the answers in rank
        order, or None where one did not answer in `timeout` or raised (the caller then
        restarts the ranks)."""
        try:
            ar = self.client[self.engines()].apply_async(fn)
            return ar.get() if ar.wait(timeout) and ar.successful() else None
        except Exception:  # noqa: BLE001 - one that cannot answer means restart
            return None

    @property
    def receiver_address(self) -> str | None:
        return self._receiver.address if self._receiver else None

    def connection_files(self) -> list[str]:
        """The controller's connection files (they hold the cluster's signing key)."""
        cluster = self._ipp_cluster
        if cluster is None:
            return []
        security = Path(cluster.profile_dir) / "security"
        return sorted(str(p) for p in security.glob(f"ipcontroller-{cluster.cluster_id}-*.json"))

    def engines(self, ranks: list[int] | None = None) -> list[int]:
        """ipyparallel engine ids of `ranks` (all ranks by default), in rank order."""
        ranks = range(self.world_size) if ranks is None else ranks
        return [self.engine_of_rank[r] for r in ranks]

    def engine_pids(self) -> list[int]:
        return [r["pid"] for r in self.ranks]

    def local_processes(self) -> dict:
        """rank -> psutil handle of its engine, for the ranks on this host; made once per
        start (every cell's watchdog checks them, and making one reads /proc: ~0.4 ms a
        rank). A handle remembers its process's start time, so a pid reused later never
        passes for a rank. A rank of this host without one had ended when they were
        made."""
        if self._local is None:
            self._local = local_processes(self.ranks)
        return self._local

    def launcher_pids(self) -> list[int]:
        """Process ids of what ipyparallel launched: controller and mpiexec."""
        cluster = self._ipp_cluster
        if cluster is None:
            return []
        launchers = [cluster.controller, *getattr(cluster, "engines", {}).values()]
        return [p for p in (getattr(x, "pid", None) for x in launchers if x) if p]


def local_processes(ranks: list[dict]) -> dict:
    """rank -> psutil handle of its engine, for those of `ranks` (RankCluster.ranks)
    whose host is this one and whose process runs now."""
    import psutil

    here, handles = socket.gethostname(), {}
    for info in ranks:
        if info["host"] == here:
            try:
                handles[info["rank"]] = psutil.Process(info["pid"])
            except psutil.Error:
                pass
    return handles


# how long the notebook waits for the engines' answers to a control request (an abort, a
# signal): a live engine, or its nanny, answers in milliseconds
CONTROL_ANSWER_S = 2.0


def answered(sent, timeout: float = CONTROL_ANSWER_S) -> None:
    """Wait, at most `timeout`, for the engines' answers to a control request sent with
    block=False (`sent`: ipyparallel's future of them). An abort is in force on an engine
    once it answers; a signal has reached the rank once its nanny answers, so a request
    sent after that cannot be the one it interrupts. A dead engine never answers: the
    wait ends at the timeout and the caller goes on."""
    try:
        sent.result(timeout)
    except Exception:  # noqa: BLE001 - a timeout, or an engine gone: the caller goes on
        pass


@dataclass
class HeldInterrupt:
    """Whether Ctrl-C came while `interrupts_held` held it."""

    asked: bool = False


@contextlib.contextmanager
def interrupts_held() -> Iterator[HeldInterrupt]:
    """Ctrl-C while a request is being sent to the ranks is noted, not raised, until the
    request has reached every rank: ipyparallel sends one message per engine, and a
    KeyboardInterrupt between two of them would leave the request (a collective) on
    some ranks only, waiting for the others for good, with no AsyncResult to take it
    back by. The caller looks at `asked` once it holds the AsyncResult and stops the
    request on every rank. Outside the main thread (a --noblock cell's) signals never
    arrive, and nothing is held."""
    held = HeldInterrupt()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def note(signum, frame) -> None:
        held.asked = True

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)


def engine_alive(proc) -> bool:
    """Whether a local_processes() handle's process still runs (a zombie does not)."""
    import psutil

    try:
        return proc is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _launched_processes(cluster) -> list:
    """The controller, mpiexec and everything below them, as psutil handles.

    psutil.Process remembers each process's start time, so a later kill can never hit
    a recycled pid.
    """
    import psutil

    procs = []
    for launcher in [cluster.controller, *getattr(cluster, "engines", {}).values()]:
        pid = getattr(launcher, "pid", None) if launcher else None
        if not pid:
            continue
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    return procs


ENGINE_EXIT_WAIT_S = 3.0
_EXIT_POLL_S = 0.02


def _wait_for_exit(procs: list, timeout: float) -> None:
    """Wait until the engines and mpiexec (not the controller) have exited here."""
    engines = [p for p in procs if "controller_main" not in " ".join(_cmdline(p))]
    _wait_gone(engines, timeout)


def _wait_gone(procs: list, timeout: float) -> list:
    """The processes of `procs` still running after up to `timeout` s, checked every
    20 ms. A zombie counts as gone; this process's own children are reaped.
    psutil.wait_procs notices a process that is not our child by polling with a
    growing sleep, one process after another: seconds for a tree that ended at once."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while True:
        alive = [p for p in alive if not _gone(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(_EXIT_POLL_S)


def _gone(proc) -> bool:
    import psutil

    try:
        proc.wait(timeout=0)  # reaps our own child; for another's, raises while it exists
        return True
    except psutil.TimeoutExpired:
        return not engine_alive(proc)
    except (psutil.Error, ChildProcessError):
        return True


def _slurm_jobs(cluster) -> list[str]:
    return [job for engine_set in getattr(cluster, "engines", {}).values()
            if (job := getattr(engine_set, "job_id", None))]


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - a process that is gone has no command line
        return []


def _remove_cluster_files(cluster) -> None:
    """The cluster and connection files ipyparallel's own stop would have removed."""
    security = Path(cluster.profile_dir) / "security"
    for path in security.glob(f"*{cluster.cluster_id}*.json"):
        path.unlink(missing_ok=True)


SURVIVOR_TERM_WAIT_S = 2.0


def _end_survivors(procs: list, graceful: bool) -> None:
    """End, by pid, what is still running of `procs`, and wait for it to go. graceful:
    SIGTERM first, for up to 2 s: an srun passes it to its tasks on the other nodes and
    so ends its step there (killed, it would leave them running)."""
    import psutil

    alive = [p for p in procs if not _gone(p)]
    if graceful and alive:
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        alive = _wait_gone(alive, timeout=SURVIVOR_TERM_WAIT_S)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _wait_gone(alive, timeout=5)


def _quiet_log() -> logging.Logger:
    """ipyparallel's chatter (engine logs on stop) stays out of the notebook."""
    log = logging.getLogger("mpilab.ipyparallel")
    if not log.handlers:
        log.addHandler(logging.NullHandler())
        log.propagate = False
        log.setLevel(logging.ERROR)
    return log


# the lines of a launcher's output that say why, most telling first: the tools' own
# words, then a supervisor's report that its engine could not start, then any error
_TOOLS_SAID = (re.compile(r"^(ssh|sbatch|srun|salloc|scontrol)(: |\S*: )"),
               re.compile(r"(Permission denied|Could not resolve|No route to host|Connection "
                          r"refused|Connection timed out|Host key verification failed)"))
_SRUN_TASK_FAILED = re.compile(r"^srun: error: (?P<node>\S+): tasks? [\d,-]+: Exited with exit "
                               r"code (?P<code>\d+)", re.M)
_SRUN_NO_STEP = re.compile(r"^srun: error: Unable to create step for job ", re.M)
_NO_MPILAB = re.compile(r"No module named '?mpilab\b")
_ANY_ERROR = re.compile(r"\b(error|Error|ERROR)\b")
_NOT_STARTED = "did not start: "


def _bind_parallel_magics(client) -> None:
    """ipyparallel binds its magics (%px, %%px, %autopx) to the first client made in a
    kernel only: after a restart they would run on the stopped ranks' closed client
    ('Client cannot be used after its sockets have been closed'). They go to this one."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None and "px" in shell.magics_manager.magics["line"]:
        client.activate()


def said_by_a_tool(output: str) -> str | None:
    """The line of a launcher's output in which ssh or Slurm says why it failed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pattern in _TOOLS_SAID:
        for line in lines:
            if pattern.search(line):
                return line
    return None


def telling_line(output: str) -> str | None:
    """The line of a launcher's output that says why it failed (None: nothing does)."""
    said = said_by_a_tool(output)
    if said:
        return said
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for report in exit_reports(output):
        if report.cause.startswith(_NOT_STARTED):
            return report.cause[len(_NOT_STARTED):]
    return next((line for line in lines if _ANY_ERROR.search(line)), None)


def bootstrap_timeout_line(n: int, finished: list, timeout: float) -> str:
    """The line for a bootstrap that ran out of time: which ranks did not finish, told
    from the ones that did (a rank's number is known from its finished bootstrap only),
    and the hosts those are on."""
    summaries = [s for s in finished if isinstance(s, dict) and "rank" in s]
    waited = f"within {timeout:.0f} s"
    if not summaries:
        return f"the ranks did not finish their bootstrap {waited}"
    done = sorted(s["rank"] for s in summaries)
    missing = sorted(set(range(n)) - set(done))
    hosts = host_list({s.get("host", "?") for s in summaries})
    return (f"{rank_label(missing)} did not finish {'its' if len(missing) == 1 else 'their'} "
            f"bootstrap {waited} ({rank_label(done)} on {hosts} did)")


def check_one_world(summaries: list[dict], n: int) -> None:
    """The engines must be the ranks 0..n-1 of one MPI job: a launcher that starts them
    one by one (each its own world of one) would make n ranks 0."""
    ranks = sorted(s["rank"] for s in summaries)
    sizes = sorted({s["world_size"] for s in summaries})
    if ranks != list(range(n)) or sizes != [n]:
        raise ClusterError(
            f"the {len(summaries)} engines are not one MPI job of {n} ranks (they are ranks "
            f"{ranks} of worlds of {sizes}): the launcher must start them together, as "
            "`--launcher mpi` does with mpiexec")


def _remote_message(error: Exception) -> str:
    """One line from an ipyparallel RemoteError/CompositeError."""
    inner = getattr(error, "elist", None)
    if inner:
        ename, evalue = inner[0][0], inner[0][1]
        return f"{ename}: {evalue}"
    ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return str(error).splitlines()[0]

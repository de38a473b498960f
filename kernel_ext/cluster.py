"""Start, stop, restart and inspect the rank cluster (ipyparallel engines under mpiexec).

Usable from plain Python: ``RankCluster(ClusterConfig(n=2)).start()``. The magics only
parse arguments and call this.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .channel import MetricsStore, RecordReceiver
from .rank.bootstrap import BootstrapError, gpu_spec
from .rank.engine_main import KERNEL_PID_ENV

LAUNCHERS = ("mpi", "slurm")


class ClusterError(Exception):
    """A problem the user can fix; the message is one line saying what to do."""


@dataclass
class ClusterConfig:
    n: int = 2
    gpus: str = "auto"
    backend: str = "auto"
    launcher: str = "mpi"
    hostfile: str | None = None
    controller_ip: str = "127.0.0.1"
    mpiexec: str | None = None
    timeout: float = 120.0

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
        _check_controller_ip(self.controller_ip)
        try:
            gpu_spec(self.gpus)
        except BootstrapError as e:
            raise ClusterError(str(e)) from None


def _check_controller_ip(ip: str) -> None:
    """The controller and the record channel listen there: an address of this host."""
    import psutil

    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise ClusterError(f"--controller-ip {ip}: not an IP address; give this host's "
                           "address on the network the ranks' hosts share") from None
    local = {a.address.split("%")[0] for addresses in psutil.net_if_addrs().values()
             for a in addresses}
    if ip not in local:
        ours = ", ".join(sorted(a for a in local if "." in a))
        raise ClusterError(f"--controller-ip {ip}: not an address of this host (it has "
                           f"{ours}); give one that the ranks' hosts reach")


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


@dataclass
class StartReport:
    ranks: list[dict]
    seconds: float

    def line(self) -> str:
        hosts = sorted({r["host"] for r in self.ranks})
        devices = sorted({r["device"] for r in self.ranks})
        backend = self.ranks[0]["backend"] if self.ranks else "?"
        return (
            f"mpilab: {len(self.ranks)} ranks on {', '.join(hosts)} · "
            f"devices {', '.join(devices)} · backend {backend} · ready in {self.seconds:.1f} s"
        )


@dataclass
class RankCluster:
    """The running cluster: controller, engines (one per rank), client, record channel."""

    config: ClusterConfig = field(default_factory=ClusterConfig)
    ranks: list[dict] = field(default_factory=list)
    engine_of_rank: dict[int, int] = field(default_factory=dict)
    store: MetricsStore | None = None
    dead: dict[int, str] = field(default_factory=dict)  # rank -> how it died
    _ipp_cluster: object = None
    _client: object = None
    _receiver: RecordReceiver | None = None

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

    def start(self) -> StartReport:
        if self.running:
            raise ClusterError(
                "ranks are already running: `%mpilab stop` or `%mpilab restart` first"
            )
        self.config.validate()
        mpiexec = find_mpiexec(self.config.mpiexec) if self.config.launcher == "mpi" else None
        started = time.perf_counter()
        saved = self.store.latest_event("checkpoint", rank=0) if self.store else None
        self.store = MetricsStore(world_size=self.config.n)
        if saved is not None:  # a later restart still names it: the file outlives the ranks
            self.store.add(saved)
        self._receiver = RecordReceiver(self.store, ip=self.config.controller_ip)
        try:
            self._start_engines(mpiexec)
            self._bootstrap()
        except BaseException:
            self.stop()
            raise
        return StartReport(ranks=self.ranks, seconds=time.perf_counter() - started)

    def _start_engines(self, mpiexec: str | None) -> None:
        import ipyparallel as ipp

        cfg = self.config
        cluster = ipp.Cluster(
            engines=cfg.launcher,
            n=cfg.n,
            controller_ip=cfg.controller_ip,
            delay=0,  # engines wait for the controller's connection info anyway
            engine_timeout=int(cfg.timeout),
            log=_quiet_log(),
            shutdown_atexit=False,  # our Session.shutdown ends everything, by pid, fast
        )
        # the controller and every engine end themselves if this kernel dies without
        # stopping them (killed, crashed): they watch its pid
        os.environ[KERNEL_PID_ENV] = str(os.getpid())
        cluster.config.LocalControllerLauncher.controller_cmd = [
            sys.executable, "-m", "mpilab.controller_main"]
        # engines start importing torch while they register (mpilab.rank.engine_main)
        engine_cmd = [sys.executable, "-m", "mpilab.rank.engine_main"]
        for launcher in ("MPIEngineSetLauncher", "SlurmEngineSetLauncher"):
            cluster.config[launcher].engine_cmd = engine_cmd
        if cfg.launcher == "mpi":
            cluster.config.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
            if cfg.hostfile:
                cluster.config.MPIEngineSetLauncher.mpi_args = ["-f", cfg.hostfile]
        self._ipp_cluster = cluster
        try:
            cluster.start_cluster_sync()
            client = cluster.connect_client_sync()
            client.wait_for_engines(cfg.n, timeout=cfg.timeout, interactive=False)
        except Exception as e:  # noqa: BLE001 - every start failure becomes one line + log
            raise ClusterError(self._start_failure(e)) from None
        self._client = client

    def _start_failure(self, error: Exception) -> str:
        tail = self.engine_output(lines=15)
        what = str(error).splitlines()[0] if str(error) else type(error).__name__
        msg = f"the ranks did not start ({what})"
        if tail:
            msg += "; the engines said:\n" + tail
        return msg

    def engine_output(self, lines: int = 15) -> str:
        """The last lines the engine launcher (mpiexec and the engines) wrote."""
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
        text = "".join(out).strip().splitlines()
        return "\n".join(text[-lines:])

    def _bootstrap(self) -> None:
        from .rank.engine import bootstrap

        cfg = self.config
        view = self._client[:]
        ar = view.apply_async(bootstrap, cfg.gpus, cfg.backend, self._receiver.address,
                              cfg.timeout)
        if not ar.wait(cfg.timeout):
            raise ClusterError(
                f"the ranks did not finish their bootstrap within {cfg.timeout:.0f} s"
            )
        try:
            summaries = ar.get()
        except Exception as e:  # noqa: BLE001 - the ranks' own error, shortened
            raise ClusterError(f"rank bootstrap failed: {_remote_message(e)}") from None
        check_one_world(summaries, cfg.n)
        self.ranks = sorted(summaries, key=lambda s: s["rank"])
        self.engine_of_rank = {s["rank"]: eid for s, eid in zip(summaries, ar.engine_id)}

    def stop(self, fast: bool = False) -> None:
        """Stop engines, controller and receiver; leaves no process behind.

        fast: the kernel is exiting and may be killed within seconds, so end what was
        launched at once, by pid, and tidy ipyparallel's files ourselves.
        """
        client, cluster, receiver = self._client, self._ipp_cluster, self._receiver
        self._client = self._ipp_cluster = self._receiver = None
        self.ranks, self.engine_of_rank, self.dead = [], {}, {}
        launched = _launched_processes(cluster) if cluster is not None else []
        if fast:
            _kill_survivors(launched, grace=0)
            if cluster is not None:
                _remove_cluster_files(cluster)
        else:
            if client is not None:
                try:
                    # engines that exit on their own let mpiexec end cleanly and at once
                    client.shutdown(targets="all", block=False)
                except Exception:  # noqa: BLE001 - dead engines cannot be asked; killed below
                    pass
                _wait_for_exit(launched, timeout=5)
            if cluster is not None:
                try:
                    cluster.stop_cluster_sync()
                except Exception:  # noqa: BLE001 - then kill what we started, by pid
                    pass
                _kill_survivors(launched)
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken client is fine
                pass
        if receiver is not None:
            receiver.close()

    def restart(self) -> StartReport:
        self.stop()
        return self.start()

    def mark_dead(self, dead: dict[int, str]) -> None:
        """Remember dead ranks: status shows them, cells refuse to run until restart."""
        self.dead.update(dead)

    def check_usable(self) -> None:
        if not self.running:
            raise ClusterError("no ranks are running: start them with `%mpilab start -n N`")
        if self.dead:
            ranks = ", ".join(str(r) for r in sorted(self.dead))
            raise ClusterError(f"rank {ranks} died ({next(iter(self.dead.values()))}): "
                               "`%mpilab restart` brings back a full cluster")

    def recover(self, timeout: float = 15.0) -> bool:
        """After released ranks: every rank rebuilds mpilab's communicators together."""
        from .rank.waiting import recover

        try:
            ar = self.client[self.engines()].apply_async(recover)
            return bool(ar.wait(timeout)) and ar.successful()
        except Exception:  # noqa: BLE001 - a failed recovery means restart
            return False

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

    def launcher_pids(self) -> list[int]:
        """Process ids of what ipyparallel launched: controller and mpiexec."""
        cluster = self._ipp_cluster
        if cluster is None:
            return []
        launchers = [cluster.controller, *getattr(cluster, "engines", {}).values()]
        return [p for p in (getattr(x, "pid", None) for x in launchers if x) if p]


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


def _wait_for_exit(procs: list, timeout: float) -> None:
    """Wait until the engine processes (not the controller) have exited."""
    import psutil

    engines = [p for p in procs if "ipyparallel.controller" not in " ".join(_cmdline(p))]
    psutil.wait_procs([p for p in engines if p.is_running()], timeout=timeout)


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


def _kill_survivors(procs: list, grace: float = 3.0) -> None:
    """Kill, by pid, what ipyparallel's stop left running (after `grace` seconds)."""
    import psutil

    alive = [p for p in procs if p.is_running()]
    if alive and grace > 0:
        _, alive = psutil.wait_procs(alive, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _quiet_log() -> logging.Logger:
    """ipyparallel's chatter (engine logs on stop) stays out of the notebook."""
    log = logging.getLogger("mpilab.ipyparallel")
    if not log.handlers:
        log.addHandler(logging.NullHandler())
        log.propagate = False
        log.setLevel(logging.ERROR)
    return log


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

"""`%mpilab` and `%%ranks`: argument parsing only; the work is in cluster/runner."""

from __future__ import annotations

import atexit
import threading

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .cluster import ClusterConfig, ClusterError
from .placement import SlurmSettings
from .runner import RunOptions, parse_ranks
from .session import Session

SUBCOMMANDS = ("start", "stop", "restart", "status", "push", "pull", "auto", "bench",
               "dashboard", "metrics", "trace")


def _parse(func, line: str):
    """parse_argstring with a one-line UsageError for bad numbers and unknown options."""
    try:
        return parse_argstring(func, line)
    except UsageError:
        raise
    except SystemExit:
        raise UsageError(f"could not parse {line!r}; see `%mpilab?`") from None


@magics_class
class MpilabMagics(Magics):
    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    # -- %mpilab ------------------------------------------------------------------------
    @line_magic
    def mpilab(self, line: str = ""):
        """%mpilab start|stop|restart|status|push|pull|auto|bench|dashboard|metrics|trace …"""
        words = line.strip().split(None, 1)
        if not words or words[0] not in SUBCOMMANDS:
            got = f" {words[0]!r}" if words else ""
            raise UsageError(f"%mpilab needs a subcommand{got}: one of {', '.join(SUBCOMMANDS)}")
        sub, rest = words[0], (words[1] if len(words) > 1 else "")
        try:
            return getattr(self, f"_{sub}")(rest)
        except (ClusterError, ValueError) as e:
            raise UsageError(str(e)) from None

    @magic_arguments(name="%mpilab start")
    @argument("-n", type=int, default=2, help="number of ranks")
    @argument("--gpus", default="auto", help="auto | none | a list like 0,1")
    @argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    @argument("--launcher", default="mpi",
              help="mpi (mpiexec) | slurm (a batch job, or the salloc allocation you are in)")
    @argument("--hostfile", default=None, help="hosts for mpiexec (it reaches them over ssh)")
    @argument("--controller-ip", default=None,
              help="this host's address the ranks reach (default: loopback for ranks on this "
                   "host, else the route towards their first host)")
    @argument("--partition", default=None, help="Slurm partition")
    @argument("--time", default=None, help="Slurm time limit, e.g. 1:00:00")
    @argument("--account", default=None, help="Slurm account")
    @argument("--nodes", default=None, help="Slurm nodes (a count or min-max)")
    @argument("--tasks-per-node", type=int, default=None, help="Slurm tasks (ranks) per node")
    @argument("--gpus-per-node", default=None, help="Slurm GPUs per node (a count or type:count)")
    @argument("--sbatch-option", action="append", default=[],
              help="any other sbatch option, as sbatch spells it (repeat for more): "
                   "--sbatch-option=--qos=high")
    @argument("--mpiexec", default=None, help="path to mpiexec")
    @argument("--timeout", type=float, default=120.0, help="seconds to wait for the ranks")
    @argument("--hang-timeout", type=float, default=None,
              help="default seconds a collective may wait before ranks are released")
    def _start_args(self, line):
        """%mpilab start [-n N] [--gpus …] [--backend …] [--launcher …] …"""

    def _start(self, rest: str):
        args = _parse(self._start_args, rest)
        slurm = SlurmSettings(partition=args.partition, time=args.time, account=args.account,
                              nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                              gpus_per_node=args.gpus_per_node,
                              sbatch_options=args.sbatch_option)
        config = ClusterConfig(n=args.n, gpus=args.gpus, backend=args.backend,
                               launcher=args.launcher, hostfile=args.hostfile,
                               controller_ip=args.controller_ip, mpiexec=args.mpiexec,
                               timeout=args.timeout, slurm=slurm)
        if args.hang_timeout is not None:
            if args.hang_timeout <= 0:
                raise UsageError("--hang-timeout must be a positive number of seconds")
            self.session.hang_timeout = args.hang_timeout
        print(self.session.start(config).line())

    def _stop(self, rest: str):
        self._no_args("stop", rest)
        print(self.session.stop())

    def _restart(self, rest: str):
        self._no_args("restart", rest)
        print(self.session.restart().line())

    def _status(self, rest: str):
        self._no_args("status", rest)
        return self.session.show_status()

    @magic_arguments(name="%mpilab push")
    @argument("names", help="NAME[,NAME…] of notebook variables to send to every rank")
    def _push_args(self, line):
        """%mpilab push NAME[,NAME…]"""

    def _push(self, rest: str):
        args = _parse(self._push_args, rest)
        names = [n.strip() for n in args.names.split(",") if n.strip()]
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"push: no variable named {missing[0]!r} in the notebook")
        self.session.push({n: self.shell.user_ns[n] for n in names})

    @magic_arguments(name="%mpilab pull")
    @argument("name", help="variable on the ranks to copy into the notebook")
    @argument("--rank", type=int, default=None, help="take it from this rank only")
    def _pull_args(self, line):
        """%mpilab pull NAME [--rank R]"""

    def _pull(self, rest: str):
        args = _parse(self._pull_args, rest)
        value = self.session.pull(args.name, args.rank)
        self.shell.user_ns[args.name] = value
        return value

    def _auto(self, rest: str):
        mode = rest.strip()
        if mode not in ("on", "off"):
            raise UsageError("%mpilab auto takes on or off")
        self.session.set_auto(self.shell, mode == "on")
        print(f"mpilab: every cell runs on the ranks ({'on' if mode == 'on' else 'off'})"
              if mode == "on" else "mpilab: cells run in the notebook again")

    @magic_arguments(name="%mpilab bench")
    @argument("op", choices=["allreduce", "broadcast", "allgather"])
    @argument("--sizes", default="4K:64M", help="message sizes, powers of two: 4K:64M")
    @argument("--backends", default="mpi,gloo,nccl,mpilab",
              help="any of mpi, gloo, nccl, mpilab (nccl needs GPUs)")
    def _bench_args(self, line):
        """%mpilab bench allreduce|broadcast|allgather [--sizes 4K:64M] [--backends …]"""

    def _bench(self, rest: str):
        args = _parse(self._bench_args, rest)
        self.session.show_bench(args.op, args.sizes, args.backends)

    def _dashboard(self, rest: str):
        self._no_args("dashboard", rest)
        self.session.show_dashboard()

    @magic_arguments(name="%mpilab metrics")
    @argument("--save", help="FILE.json or FILE.csv: the steps and logged scalars of every "
              "run since the ranks started")
    @argument("--clear", action="store_true",
              help="then forget them (and the spans): the next save holds only later runs")
    def _metrics_args(self, line):
        """%mpilab metrics [--save FILE.json|FILE.csv] [--clear]"""

    def _metrics(self, rest: str):
        args = _parse(self._metrics_args, rest)
        if args.save is None and not args.clear:
            raise UsageError("%mpilab metrics: give --save FILE.json|FILE.csv, --clear, or both")
        if args.save is not None:
            print(f"mpilab: metrics saved to {self.session.save_metrics(args.save)}")
        if args.clear:
            self.session.clear_metrics()
            print("mpilab: metrics cleared")

    @magic_arguments(name="%mpilab trace")
    @argument("--save", required=True, help="FILE.json (Chrome trace; Perfetto opens it)")
    def _trace_args(self, line):
        """%mpilab trace --save FILE.json"""

    def _trace(self, rest: str):
        args = _parse(self._trace_args, rest)
        print(f"mpilab: trace saved to {self.session.save_trace(args.save)}")

    def _no_args(self, sub: str, rest: str) -> None:
        if rest.strip():
            raise UsageError(f"%mpilab {sub} takes no arguments, got {rest.strip()!r}")

    # -- %%ranks -----------------------------------------------------------------------
    @magic_arguments()
    @argument("spec", nargs="?", default="all", help="all | 0 | 0,2 | 1-3")
    @argument("--timeout", type=float, default=None, help="stop the cell after S seconds")
    @argument("--noblock", action="store_true", help="return at once; output still lands here")
    @argument("--no-dashboard", action="store_true")
    @argument("--quiet", action="store_true", help="do not relay the ranks' output")
    @argument("--hang-timeout", type=float, default=None,
              help="seconds a collective may wait before the ranks are released")
    @cell_magic
    def ranks(self, line: str, cell: str):
        """Run this cell on the ranks: %%ranks [all|0|0,2|1-3] [--timeout S] [--noblock] …"""
        args = _parse(self.ranks, line)
        try:
            self.session.cluster.check_usable()
            parse_ranks(args.spec, self.session.cluster.world_size)
        except (ClusterError, ValueError) as e:
            raise UsageError(str(e)) from None
        for name in ("timeout", "hang_timeout"):
            value = getattr(args, name)
            if value is not None and value <= 0:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be a positive number of seconds")
        options = RunOptions(spec=args.spec, timeout=args.timeout, block=not args.noblock,
                             dashboard=not args.no_dashboard, quiet=args.quiet,
                             hang_timeout=args.hang_timeout or self.session.hang_timeout)
        self.session.run_cell(cell, options)


def load(ipython) -> None:
    session = Session.instance()
    ipython.register_magics(MpilabMagics(ipython, session))
    atexit.register(session.shutdown)
    # plotly's widget module takes seconds to import: do it now, off the main thread,
    # so the first dashboard does not stall a training cell's output
    from mpilab.widgets import warm_up

    threading.Thread(target=warm_up, name="mpilab-warm", daemon=True).start()


def unload(ipython) -> None:
    session = Session.instance()
    session.set_auto(ipython, False)
    session.shutdown()


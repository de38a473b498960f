"""`%mpilab` and `%%ranks`: argument parsing only; the work is in cluster/runner."""

from __future__ import annotations

import atexit
import difflib
import os
import sys
import textwrap
import threading

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .cell import RunOptions
from .cluster import ClusterConfig, ClusterError, StartReport
from .placement import SlurmSettings
from .selection import parse_ranks
from .session import Session
from .wire import BENCH_COLLECTIVES, DEFAULT_COLLECTIVE_TIMEOUT_S, SIZES_HELP

# each subcommand, what it does in one line (`%mpilab?` and `%mpilab help` list them)
SUMMARIES = {
    "start": "start N ranks and wait until every one is ready (MPI, device, torch.distributed)",
    "stop": "stop every rank (and the Slurm job): nothing is left running",
    "restart": "stop, then start again with the same settings (the ranks' variables are lost)",
    "status": "a live table of the ranks: host, pid, device, state, memory, heartbeat age",
    "push": "send notebook variables to every rank",
    "pull": "copy a variable from the ranks into the notebook",
    "auto": "on: every following cell runs on the ranks, as if it began with %%ranks",
    "bench": "bandwidth of a collective on the running ranks: a table and a plot",
    "dashboard": "the latest run's training dashboard",
    "metrics": "save (or forget) the steps and logged scalars of the runs so far",
    "trace": "save the ranks' timing spans as a Chrome trace (Perfetto opens it)",
    "help": "this help, or one subcommand's: %mpilab help start",
}
SUBCOMMANDS = tuple(SUMMARIES)
HELP_FLAGS = ("-h", "--help")


def _parse(func, line: str):
    """parse_argstring with a one-line UsageError for bad numbers and unknown options."""
    try:
        return parse_argstring(func, line)
    except UsageError:
        raise
    except SystemExit:
        raise UsageError(f"could not parse {line!r}; see `%mpilab help`") from None


def _with_sbatch_hint(message: str, line: str) -> str:
    """A start with --launcher slurm that names an option of sbatch's that mpilab does not
    (--mem, --exclusive): the message says how to pass it."""
    unknown = message.partition("unrecognized arguments: ")[2].split()
    words = line.replace("=", " ").split()
    slurm = any(a == "--launcher" and b == "slurm" for a, b in zip(words, words[1:]))
    if not unknown or not unknown[0].startswith("--") or not slurm:
        return message
    option = unknown[0]
    if len(unknown) > 1 and not unknown[1].startswith("-"):
        option += f"={unknown[1]}"
    return (f"{message}: pass sbatch's other options as sbatch spells them, "
            f"--sbatch-option={option}")


def _asks_help(line: str) -> bool:
    """`-h` or `--help` anywhere among the words (no option takes such a value)."""
    return any(word in HELP_FLAGS for word in line.split())


def help_text(func) -> str:
    """A magic's argparse help as plain text: IPython's formatter writes the usage as a
    reST literal block (`::` and an indent), which a terminal shows as is."""
    text = func.parser.format_help()
    usage, _, rest = text.removeprefix("::\n\n").partition("\n\n")
    return textwrap.dedent(usage) + "\n\n" + rest.rstrip() + "\n"


def _print_start(report: StartReport) -> None:
    """A start's line, then its notes (a host whose clock is off)."""
    print(report.line())
    for note in report.notes():
        print(note)


def _unknown_subcommand(word: str | None) -> str:
    """The line for `%mpilab` without a subcommand it knows, naming the nearest one."""
    known = f"one of {', '.join(SUBCOMMANDS)} (`%mpilab help` describes them)"
    if word is None:
        return f"%mpilab needs a subcommand: {known}"
    near = difflib.get_close_matches(word, SUBCOMMANDS, n=1)
    guess = f" (did you mean {near[0]}?)" if near else ""
    return f"%mpilab has no subcommand {word!r}{guess}: {known}"


@magics_class
class MpilabMagics(Magics):
    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    # -- %mpilab ------------------------------------------------------------------------
    @line_magic
    def mpilab(self, line: str = ""):
        # the docstring is `overview()`, set below the class: `%mpilab?` shows it
        words = line.strip().split(None, 1)
        if words and words[0] in HELP_FLAGS:
            words = ["help"]
        if not words or words[0] not in SUBCOMMANDS:
            raise UsageError(_unknown_subcommand(words[0] if words else None))
        sub, rest = words[0], (words[1] if len(words) > 1 else "")
        if sub != "help" and _asks_help(rest):
            print(help_text(self._args_of(sub)), end="")
            return None
        try:
            return getattr(self, f"_{sub}")(rest)
        except (ClusterError, ValueError) as e:
            raise UsageError(str(e)) from None
        except KeyboardInterrupt:
            if sub in ("start", "restart"):  # the cluster stopped what it had started
                raise UsageError(f"%mpilab {sub} interrupted: no ranks are running (nothing "
                                 "was left behind)") from None
            raise

    @classmethod
    def _args_of(cls, sub: str):
        """The argument-parsing function of a subcommand (its `.parser` is argparse's)."""
        return getattr(cls, f"_{sub}_args")

    @magic_arguments(name="mpilab help")
    @argument("subcommand", nargs="?", default=None, help=", ".join(SUBCOMMANDS[:-1]))
    def _help_args(self, line):
        """Every subcommand with its options, or one subcommand's help."""

    def _help(self, rest: str):
        args = _parse(self._help_args, rest)
        sub = args.subcommand
        if sub is None:
            print(overview(), end="")
        elif sub in SUBCOMMANDS:
            print(help_text(self._args_of(sub)), end="")
        else:
            raise UsageError(f"%mpilab help: no subcommand {sub!r}; one of "
                             f"{', '.join(SUBCOMMANDS)}")

    @magic_arguments(name="mpilab start")
    @argument("-n", type=int, default=2, metavar="N", help="number of ranks (default 2)")
    @argument("--gpus", default="auto", metavar="GPUS",
              help="auto (one per rank where there are GPUs) | none | a list like 0,1")
    @argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
              metavar="BACKEND",
              help="torch.distributed's backend: auto (nccl on GPUs, gloo on CPU) | nccl | gloo")
    @argument("--launcher", default="mpi", metavar="LAUNCHER",
              help="mpi (mpiexec: in the Slurm allocation you are in, its nodes) | slurm "
                   "(a batch job, or the allocation you are in)")
    @argument("--hostfile", default=None, metavar="FILE", type=os.path.expanduser,
              help="hosts for mpiexec (it reaches them over ssh)")
    @argument("--controller-ip", default=None, metavar="IP",
              help="this host's address the ranks reach (default: loopback for ranks on this "
                   "host, else the route towards their first host)")
    @argument("--partition", default=None, metavar="NAME", help="Slurm partition")
    @argument("--time", default=None, metavar="LIMIT", help="Slurm time limit, e.g. 1:00:00")
    @argument("--account", default=None, metavar="NAME", help="Slurm account")
    @argument("--nodes", default=None, metavar="N",
              help="Slurm nodes (a count or min-max)")
    @argument("--tasks-per-node", "--ntasks-per-node", type=int, default=None, metavar="N",
              help="Slurm tasks (ranks) per node")
    @argument("--gpus-per-node", default=None, metavar="N",
              help="Slurm GPUs per node (a count or type:count)")
    @argument("--sbatch-option", action="append", default=[], metavar="OPTION",
              help="any other sbatch option, as sbatch spells it (repeat for more): "
                   "--sbatch-option=--qos=high")
    @argument("--mpiexec", default=None, metavar="PATH", type=os.path.expanduser,
              help="the mpiexec to use (default: the one beside this Python, else PATH's)")
    @argument("--timeout", type=float, default=120.0, metavar="S",
              help="seconds to wait for the ranks to be ready (default 120)")
    @argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
              metavar="S", help="seconds torch.distributed's own collectives may wait before "
              "torch gives up on them (default 1800; the watchdog releases hung ranks first)")
    @argument("--hang-timeout", type=float, default=None, metavar="S",
              help="seconds a collective may wait before the ranks are released (default "
                   "30); %%%%ranks --hang-timeout sets it for one cell")
    def _start_args(self, line):
        """Start N ranks (ipyparallel engines under mpiexec, or a Slurm job) and wait until
        every one finished its bootstrap: MPI, node-local rank, device, torch.distributed."""

    def _start(self, rest: str):
        try:
            args = _parse(self._start_args, rest)
        except UsageError as e:
            raise UsageError(_with_sbatch_hint(str(e), rest)) from None
        slurm = SlurmSettings(partition=args.partition, time=args.time, account=args.account,
                              nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                              gpus_per_node=args.gpus_per_node,
                              sbatch_options=args.sbatch_option)
        config = ClusterConfig(n=args.n, gpus=args.gpus, backend=args.backend,
                               launcher=args.launcher, hostfile=args.hostfile,
                               controller_ip=args.controller_ip, mpiexec=args.mpiexec,
                               timeout=args.timeout,
                               collective_timeout=args.collective_timeout, slurm=slurm)
        if args.hang_timeout is not None:
            if args.hang_timeout <= 0:
                raise UsageError("--hang-timeout must be a positive number of seconds")
            self.session.hang_timeout = args.hang_timeout
        _print_start(self.session.start(config))

    @magic_arguments(name="mpilab stop")
    def _stop_args(self, line):
        """Stop every rank, the controller and (with --launcher slurm) the job."""

    def _stop(self, rest: str):
        self._no_args("stop", rest)
        print(self.session.stop())

    @magic_arguments(name="mpilab restart")
    def _restart_args(self, line):
        """Stop the ranks and start them again with the last start's settings: a full
        cluster after a rank died (the ranks' variables are lost)."""

    def _restart(self, rest: str):
        self._no_args("restart", rest)
        _print_start(self.session.restart())

    @magic_arguments(name="mpilab status")
    def _status_args(self, line):
        """A live table of the ranks: rank, host, pid, device, state (idle, running, in
        allreduce #k), memory and heartbeat age."""

    def _status(self, rest: str):
        self._no_args("status", rest)
        return self.session.show_status()

    @magic_arguments(name="mpilab push")
    @argument("names", metavar="NAME[,NAME…]",
              help="notebook variables to send to every rank")
    def _push_args(self, line):
        """Send notebook variables to every rank (pickled, as ipyparallel's push)."""

    def _push(self, rest: str):
        args = _parse(self._push_args, rest)
        names = [n.strip() for n in args.names.split(",") if n.strip()]
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"push: no variable named {missing[0]!r} in the notebook")
        self.session.push({n: self.shell.user_ns[n] for n in names})

    @magic_arguments(name="mpilab pull")
    @argument("name", metavar="NAME", help="variable on the ranks to copy into the notebook")
    @argument("--rank", type=int, default=None, metavar="R",
              help="take it from this rank only (default: a list, one value per rank)")
    def _pull_args(self, line):
        """Copy a variable from the ranks into the notebook's namespace."""

    def _pull(self, rest: str):
        args = _parse(self._pull_args, rest)
        value = self.session.pull(args.name, args.rank)
        self.shell.user_ns[args.name] = value
        return value

    @magic_arguments(name="mpilab auto")
    @argument("mode", metavar="on|off", help="on: every following cell runs on the ranks; "
              "off: cells run in the notebook again")
    def _auto_args(self, line):
        """Run every following cell on the ranks, as if it began with %%ranks (mpilab's
        own magics still run in the notebook)."""

    def _auto(self, rest: str):
        mode = rest.strip()
        if mode not in ("on", "off"):
            raise UsageError("%mpilab auto takes on or off")
        self.session.set_auto(self.shell, mode == "on")
        print(f"mpilab: every cell runs on the ranks ({'on' if mode == 'on' else 'off'})"
              if mode == "on" else "mpilab: cells run in the notebook again")

    @magic_arguments(name="mpilab bench")
    @argument("op", choices=BENCH_COLLECTIVES,
              help="the collective to measure: allreduce, broadcast or allgather")
    @argument("--sizes", default="4K:64M", metavar="SIZES",
              help=f"{SIZES_HELP} (default 4K:64M)")
    @argument("--backends", default="mpi,gloo,nccl,mpilab", metavar="LIST",
              help="any of mpi, gloo, nccl, mpilab (default: all; nccl needs GPUs)")
    def _bench_args(self, line):
        """Measure a collective on the running ranks, backend against backend, at each
        message size: a table (time, algbw, busbw) and a plot with the node's memory-copy
        bandwidth as the ceiling."""

    def _bench(self, rest: str):
        args = _parse(self._bench_args, rest)
        self.session.show_bench(args.op, args.sizes, args.backends)

    @magic_arguments(name="mpilab dashboard")
    def _dashboard_args(self, line):
        """Show the latest run's training dashboard again (it follows the run while it
        logs)."""

    def _dashboard(self, rest: str):
        self._no_args("dashboard", rest)
        self.session.show_dashboard()

    @magic_arguments(name="mpilab metrics")
    @argument("--save", metavar="FILE", type=os.path.expanduser,
              help="FILE.json or FILE.csv: the steps and logged "
              "scalars of every run since the ranks started")
    @argument("--clear", action="store_true",
              help="then forget them (and the spans): the next save holds only later runs")
    def _metrics_args(self, line):
        """Save the steps and logged scalars of the runs so far (the newest 20,000 rows of
        each rank), or forget them."""

    def _metrics(self, rest: str):
        args = _parse(self._metrics_args, rest)
        if args.save is None and not args.clear:
            raise UsageError("%mpilab metrics: give --save FILE.json|FILE.csv, --clear, or both")
        if args.save is not None:
            print(f"mpilab: metrics saved to {self.session.save_metrics(args.save)}")
        if args.clear:
            self.session.clear_metrics()
            print("mpilab: metrics cleared")

    @magic_arguments(name="mpilab trace")
    @argument("--save", required=True, metavar="FILE", type=os.path.expanduser,
              help="FILE.json: where to write it (Chrome trace format; Perfetto opens it)")
    def _trace_args(self, line):
        """Save the ranks' timing spans (forward, backward, each collective) as a Chrome
        trace."""

    def _trace(self, rest: str):
        args = _parse(self._trace_args, rest)
        print(f"mpilab: trace saved to {self.session.save_trace(args.save)}")

    def _no_args(self, sub: str, rest: str) -> None:
        if rest.strip():
            raise UsageError(f"%mpilab {sub} takes no arguments, got {rest.strip()!r}")

    # -- %%ranks -----------------------------------------------------------------------
    @magic_arguments(name="%ranks")
    @argument("spec", nargs="?", default="all", metavar="RANKS",
              help="which ranks run the cell: all (default) | 0 | 0,2 | 1-3")
    @argument("--timeout", type=float, default=None, metavar="S",
              help="interrupt the ranks if the cell has not finished S seconds after they "
                   "began it")
    @argument("--noblock", action="store_true",
              help="return at once; the output still lands under this cell")
    @argument("--no-dashboard", action="store_true",
              help="no live training dashboard under this cell (the records are still kept)")
    @argument("--quiet", action="store_true", help="do not relay the ranks' output")
    @argument("--by-rank", action="store_true",
              help="also a view of each rank's own output (a button per rank, failing ranks "
                   "marked), beside the merged one")
    @argument("--hang-timeout", type=float, default=None, metavar="S",
              help="seconds a collective may wait before the ranks are released (default: "
                   "%%mpilab start's, 30)")
    @cell_magic
    def ranks(self, line: str, cell: str):
        """Run this cell on the ranks. Output streams live, one line per rank (identical
        lines once, naming the ranks); the dashboard appears once the cell logs a step."""
        if _asks_help(line):
            print(help_text(self.ranks), end="")
            return
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
                             per_rank=args.by_rank,
                             hang_timeout=args.hang_timeout or self.session.hang_timeout)
        try:
            self.session.run_cell(cell, options)
        except ClusterError as e:  # a cell the ranks cannot take, said before it is sent
            raise UsageError(str(e)) from None


def overview() -> str:
    """`%mpilab?` and `%mpilab help`: every subcommand in a line, then each with its options."""
    width = max(map(len, SUBCOMMANDS))
    lines = ["%mpilab SUBCOMMAND [options]: MPI ranks for this notebook.", ""]
    lines += [f"  {sub:<{width}}  {SUMMARIES[sub]}" for sub in SUBCOMMANDS]
    lines += ["", "`%mpilab SUBCOMMAND -h` shows one of them; `%%ranks?` the cell magic "
              "that runs a cell on the ranks.", ""]
    for sub in SUBCOMMANDS:
        if sub != "help":
            lines += [help_text(MpilabMagics._args_of(sub)).rstrip(), ""]
    return "\n".join(lines) + "\n"


MpilabMagics.mpilab.__doc__ = overview()


def _debug_magic(session: Session, ipython_debug):
    """`%debug` that, right after a cell failed on the ranks, debugs that failure on its
    rank rather than mpilab's frames in the notebook; IPython's otherwise."""

    def debug(line: str = ""):
        if not line.strip():
            try:
                if session.post_mortem(getattr(sys, "last_value", None)):
                    return None
            except ClusterError as e:
                raise UsageError(str(e)) from None
        return ipython_debug(line)

    debug.__doc__ = ipython_debug.__doc__
    return debug


def load(ipython) -> None:
    session = Session.instance()
    ipython.register_magics(MpilabMagics(ipython, session))
    ipython_debug = ipython.find_line_magic("debug")
    if ipython_debug is not None and not getattr(ipython_debug, "_mpilab", False):
        debug = _debug_magic(session, ipython_debug)
        debug._mpilab = ipython_debug  # the original, given back on unload
        ipython.register_magic_function(debug, "line", "debug")
    atexit.register(session.shutdown)
    # plotly's widget module takes seconds to import: do it now, off the main thread,
    # so the first dashboard does not stall a training cell's output
    from mpilab.widgets import warm_up

    threading.Thread(target=warm_up, name="mpilab-warm", daemon=True).start()


def unload(ipython) -> None:
    session = Session.instance()
    debug = ipython.find_line_magic("debug")
    if getattr(debug, "_mpilab", None) is not None:
        ipython.register_magic_function(debug._mpilab, "line", "debug")
    session.set_auto(ipython, False)
    session.shutdown()


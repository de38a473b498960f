"""Engine-side glue for the notebook: bootstrap an ipyparallel engine as a rank.

Runs inside each engine's IPython kernel: performs `mpilab.init()`, injects the
rank's names into the user namespace, and installs the traceback filter that hides
mpilab's and ipyparallel's frames from the user.
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import sys
import threading
import traceback
import warnings

from ..wire import CELL_LABEL, CELL_LABEL_PREFIX, NO_RECORDS
from .frames import hidden_frame


def run(argv: list[str]) -> None:
    """Run the ipyparallel engine with `argv`, in a process that dies with its parent
    (its supervisor, or its host's spawner), importing torch while it registers."""
    die_with_parent()
    preload()
    from ipyparallel.engine.app import main

    sys.argv = [sys.argv[0], *argv]
    main()


def die_with_parent() -> None:
    """This process is killed when the thread that forked it ends (Linux's parent-death
    signal; elsewhere nothing happens)."""
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def name_process(name: bytes) -> None:
    """The name `top` and `ps -o comm` show (a forked engine keeps its spawner's
    command line)."""
    import ctypes

    _prctl(15, ctypes.c_char_p(name))  # PR_SET_NAME


def _prctl(option: int, value) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def kill(pid: int) -> None:
    """Kill an engine and everything it started (ipyparallel's nanny runs in a session
    of its own, and would hold mpiexec's output pipe open after the engine is gone)."""
    import psutil

    try:
        helpers = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        helpers = []
    for target in (pid, *helpers):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def preload() -> None:
    """Import torch and warm up a first training step in the background while the
    engine registers (start-up overlap; mpilab.rank.warmup), where this host has a core
    for each of its ranks. Where its ranks outnumber its cores, the warm-up's CPU time
    (about 1.3 s a rank) would be spent in series with every rank's start, so the
    bootstrap starts it once the rank is ready (`bootstrap`)."""
    global _warming_since_start
    from . import warmup

    if not host_oversubscribed():
        _warming_since_start = True
        warmup.start_background()
    else:  # the bootstrap needs torch.distributed: imported while the engine registers
        threading.Thread(target=_import_torch_distributed, name="mpilab-import",
                         daemon=True).start()


def _import_torch_distributed() -> None:
    try:
        import torch.distributed  # noqa: F401
    except BaseException:  # noqa: BLE001 - the bootstrap's own import reports it
        pass


_warming_since_start = False


def host_oversubscribed(environ=os.environ, cores: int | None = None) -> bool:
    """Whether this host runs more ranks than it has cores for this process (MPICH's
    hydra tells each rank how many ranks its host runs: MPI_LOCALNRANKS)."""
    try:
        local = int(environ.get("MPI_LOCALNRANKS", "1"))
    except ValueError:
        return False
    return local > (len(os.sched_getaffinity(0)) if cores is None else cores)


def bootstrap(gpus: str, backend: str, agent_address: str | None, timeout: float,
              input_address: str | None = None) -> dict:
    """Make this engine a rank; returns the rank's summary for the notebook.
    input_address: where the notebook answers the rank's input() (mpilab.rank.stdin)."""
    import mpilab
    from IPython import get_ipython

    from . import agent as agent_mod
    from . import stdin, waiting, warmup
    from .bootstrap import init
    from .torchrun import install_shell

    ctx = init(gpus=gpus, backend=backend, agent_address=agent_address, timeout=timeout)
    # the warm-up preload() began is done before the first cell; on an oversubscribed
    # host it runs from here on, in the background (a first training cell sent at once
    # waits for its imports)
    warmup.finish(ctx.device)
    if not _warming_since_start:
        warmup.start_background()
    import torch.distributed as dist

    shell = get_ipython()
    shell.user_ns.update(
        rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank,
        device=ctx.device, comm=ctx.comm, dist=dist, mpilab=mpilab,
    )
    shell.set_custom_exc((BaseException,), _clean_traceback)
    shell.showsyntaxerror = _syntax_error_shower(shell)
    _end_cells_as_scripts_end(shell)
    warnings.formatwarning = _cell_warnings(shell, warnings.formatwarning)
    install_shell(shell)  # `%run script.py` fails the cell when the script fails
    agent = agent_mod.current()
    state = agent.state
    asker = stdin.install(shell.kernel, input_address, agent)

    mpilab_cell = False  # the running cell is one of mpilab's (its request's label says)

    def pre_run(info=None):
        nonlocal mpilab_cell
        state.cell += 1
        state.phase = "running"
        # ipykernel installs its own SIGINT handler for each cell; ours also aborts the
        # waits of every thread (a DataParallel comm thread must stop waiting too)
        signal.signal(signal.SIGINT, _interrupt)
        # a cell may have waited here behind a --noblock one: its records start now
        parent = shell.kernel.get_parent()
        state.request = parent.get("header", {}).get("msg_id", "")
        # the notebook's In[n] for this cell (its request's label): tracebacks name it
        request_label = parent.get("metadata", {}).get("label") or ""
        mpilab_cell = request_label.startswith(CELL_LABEL_PREFIX)
        # input() asks the notebook in mpilab's cells only (`%%px` cannot answer it)
        if asker is not None:
            asker.answered = mpilab_cell
        label = _CELL_LABEL.fullmatch(request_label)
        if label:  # IPython counted this cell before running it
            _notebook_count[shell.execution_count - 1] = int(label.group(1))
        agent.begin_cell(what="cell-start", cell=state.cell, msg=state.request)

    def post_run(result=None):
        waiting.reply_uninterrupted()  # the cell's code has ended: its reply must go
        state.phase = "idle"
        if result is not None and _succeeded_exit(result.error_in_exec):
            result.error_in_exec = None  # sys.exit(0) ended the cell as it ends a script
        agent.beat()
        queued = agent.cell_queued()
        agent.emit("event", what="cell-end", cell=state.cell, msg=state.request)
        if queued or not mpilab_cell or (result is not None and not result.success):
            # the notebook waits for this marker, so a cell's last records make its
            # plots, and `%mpilab status` right after shows the rank idle
            agent.flush()
        else:  # nothing to wait for: the markers go with the next batch (wire.NO_RECORDS)
            shell.payload_manager.write_payload({"source": NO_RECORDS})

    for event, hook in (("pre_run_cell", pre_run), ("post_run_cell", post_run)):
        shell.events.register(event, hook)
    return ctx.summary()


# the functions that report a cell's error: an interrupt that lands in one of them has no
# code of the user's left to stop, and raised there it would replace the cell's error with
# one in IPython's formatting (which also drops the clean traceback for good)
_REPORTING = frozenset({"_clean_traceback", "_format_exception_for_storage"})


def _interrupt(signum, frame):
    from .waiting import abort

    abort("the cell was interrupted")  # other threads' waits end either way
    if not _reporting_error(frame):
        raise KeyboardInterrupt


def _reporting_error(frame) -> bool:
    """The main thread, interrupted at `frame`, is reporting the cell's error."""
    while frame is not None:
        if frame.f_code.co_name in _REPORTING:
            return True
        frame = frame.f_back
    return False


_CELL_LABEL = re.compile(re.escape(CELL_LABEL).replace(r"\{\}", r"(\d+)"))
_notebook_count: dict[int, int] = {}  # this engine's execution count -> the notebook's


def _frame_label(shell, filename: str) -> str:
    count = getattr(shell.compile, "_filename_map", {}).get(filename)
    if count is not None:
        return f"Cell In[{_notebook_count.get(count, count)}]"
    return f'File "{filename}"'


_CAUSE = "The above exception was the direct cause of the following exception:"
_CONTEXT = "During handling of the above exception, another exception occurred:"


def format_clean_traceback(shell, etype, value, tb) -> list[str]:
    """The rank's own traceback: user frames (and library frames it called), no glue;
    the exceptions it was raised from or while handling, and an exception group's
    members, as Python chains them."""
    return ["\n".join(_exception_lines(shell, etype, value, tb, set()))]


def _user_frames(tb) -> list[traceback.FrameSummary]:
    """The frames shown: none of mpilab's or the engine's, nor a generated one (a
    dataclass's `__init__`, file "<string>") that called straight into them."""
    frames = traceback.extract_tb(tb)
    hidden = [hidden_frame(f.filename) for f in frames]
    return [f for i, f in enumerate(frames) if not hidden[i] and not (
        f.filename == "<string>" and i + 1 < len(frames) and hidden[i + 1])]


def _exception_lines(shell, etype, value, tb, seen: set[int]) -> list[str]:
    seen.add(id(value))
    frames = _user_frames(tb)
    lines: list[str] = []
    earlier = value.__cause__  # `from e`; else what it was raised while handling
    if earlier is None and not value.__suppress_context__:
        earlier = value.__context__
    # one raised and handled inside mpilab's or the engine's glue alone is theirs
    if earlier is not None and id(earlier) not in seen and (
            earlier.__traceback__ is None or _user_frames(earlier.__traceback__)):
        lines += _exception_lines(shell, type(earlier), earlier, earlier.__traceback__, seen)
        lines += ["", _CAUSE if value.__cause__ is not None else _CONTEXT, ""]
    if frames:
        lines.append("Traceback (most recent call last):")
    for f in frames:
        lines.append(f"  {_frame_label(shell, f.filename)}, line {f.lineno}, in {f.name}")
        source = (f.line or linecache.getline(f.filename, f.lineno)).strip()
        if source:
            lines.append(f"    {source}")
    cell_file = getattr(value, "filename", None) if isinstance(value, SyntaxError) else None
    for line in traceback.format_exception_only(etype, value):
        if cell_file:  # a syntax error names the file it is in, as the frames do
            line = line.replace(f'File "{cell_file}"', _frame_label(shell, cell_file))
        lines.append(line.rstrip("\n"))
    members = getattr(value, "exceptions", None)
    if isinstance(members, tuple) and all(isinstance(m, BaseException) for m in members):
        for i, member in enumerate(members, 1):  # an exception group's
            lines.append(f"  -- {i} of {len(members)} --")
            lines += [f"    {line}" if line else line for line in _exception_lines(
                shell, type(member), member, member.__traceback__, seen)]
    return lines


def _syntax_error_shower(shell):
    """IPython shows a cell's syntax error (raised before the cell runs, so not through
    the custom handler) with the engine's temporary file name, which differs on every
    rank: the same typo then showed once per rank instead of once, naming the ranks."""

    def showsyntaxerror(filename=None, running_compiled_code=False):
        etype, value, tb = shell._get_exc_info()
        if filename and issubclass(etype, SyntaxError):
            value.filename = filename
        stb = format_clean_traceback(shell, etype, value, tb if running_compiled_code else None)
        shell._showtraceback(etype, value, stb)

    return showsyntaxerror


def _succeeded_exit(error: BaseException | None) -> bool:
    return isinstance(error, SystemExit) and error.code in (None, 0)


def _end_cells_as_scripts_end(shell) -> None:
    """`sys.exit()` in a cell (a script pasted in, `sys.exit(main())` at its end) ends the
    cell as it ends a script: with status 0 or none, a success that shows nothing; else a
    failure shown as the rank's traceback, which names the line. IPython showed
    "An exception has occurred, use %tb to see the full traceback" (a `%tb` in the
    notebook shows only that) and warned "To exit: use 'exit', 'quit', or Ctrl-D", advice
    for a terminal. `exit()` ends the cell as `sys.exit()` does and says the ranks stay up
    (ipykernel's would ask the engine to stop: one rank gone ends every rank's MPI job)."""
    show = shell.showtraceback

    def showtraceback(*args, **kwargs):
        exc_tuple = args[0] if args else kwargs.get("exc_tuple")
        etype, value, tb = exc_tuple or sys.exc_info()
        if not isinstance(value, SystemExit):
            return show(*args, **kwargs)
        if not _succeeded_exit(value):
            shell._showtraceback(etype, value, format_clean_traceback(shell, etype, value, tb))
        return None

    shell.showtraceback = showtraceback
    warnings.filterwarnings("ignore", message="To exit: use 'exit', 'quit', or Ctrl-D")
    from IPython.core.autocall import IPyAutocall

    class EndsTheCell(IPyAutocall):
        rewrite = False  # a bare `exit` is called without IPython echoing `------> exit()`

        def __init__(self, ip, name: str):
            super().__init__(ip)
            self.name = name

        def __call__(self, code=None):
            print(f"{self.name}() ends the cell, not the ranks: they stay up for the next "
                  "one (`%mpilab stop` ends them)", file=sys.stderr)
            raise SystemExit(code)

    shell.user_ns.update(exit=EndsTheCell(shell, "exit"), quit=EndsTheCell(shell, "quit"))


def _cell_warnings(shell, format_warning):
    """A warning raised by a cell's own line names the cell as its tracebacks do
    (`Cell In[6], line 2: UserWarning: …`), not by the engine's temporary file, whose
    name differs on every rank: the same warning showed once per rank instead of once,
    naming the ranks."""

    def formatwarning(message, category, filename, lineno, line=None):
        text = format_warning(message, category, filename, lineno, line)
        label = _frame_label(shell, filename)
        where = f"{filename}:{lineno}:"
        if label.startswith("Cell") and text.startswith(where):
            text = f"{label}, line {lineno}:{text[len(where):]}"
        return text

    return formatwarning


def _clean_traceback(shell, etype, value, tb, tb_offset=None):
    # IPython keeps these for `%debug` only on its own traceback path, not a custom one
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    sys.last_exc = value
    stb = format_clean_traceback(shell, etype, value, tb)
    shell._showtraceback(etype, value, stb)
    return stb


def bench_here(op: str, sizes: list[int], backends: list[str]) -> tuple[list[dict], float]:
    """One rank's part of `%mpilab bench` / `mpilab bench`: rows and, on rank 0, the
    node's single-core memory-copy bandwidth (the plot's ceiling), measured the same run."""
    from .bench import memcpy_bandwidth, run_bench
    from .bootstrap import context

    rows = run_bench(op, sizes, backends)
    ceiling = memcpy_bandwidth(max(64 << 20, max(sizes))) if context().rank == 0 else 0.0
    return rows, ceiling

"""The `mpilab` command: lab, run, bench, doctor, install-kernel."""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .wire import BENCH_COLLECTIVES, BENCH_RESULT_PREFIX, SIZES_HELP

KERNEL_NAME = "mpilab"
KERNEL_DISPLAY_NAME = "Python (mpilab)"
DEFAULT_NOTEBOOK_DIR = "~/mpilab-notebooks"


def _fail(message: str) -> int:
    print(f"mpilab: {message}", file=sys.stderr)
    return 2


def examples_dir() -> Path | None:
    """The example notebooks: `mpilab.examples` in an installed wheel (package data), the
    checkout's notebooks/ in an editable install; None when neither is there."""
    spec = importlib.util.find_spec("mpilab.examples")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if any(Path(location).glob("*.ipynb")):
                return Path(location)
    checkout = Path(__file__).resolve().parent.parent / "notebooks"
    return checkout if any(checkout.glob("*.ipynb")) else None


def kernel_spec() -> dict:
    """A kernel that loads the extension at start: notebooks begin with `%mpilab start`,
    and the user's own IPython configuration stays in effect."""
    return {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 f"--ext={KERNEL_NAME}"],
        "display_name": KERNEL_DISPLAY_NAME,
        "language": "python",
        "metadata": {"debugger": True},
    }


def install_kernel(user: bool | None = None, prefix: str | None = None) -> tuple[Path, bool]:
    """Install the "Python (mpilab)" kernelspec; returns (its folder, whether it changed).

    Default place: this environment's share/jupyter/kernels inside a virtual environment
    (the kernel goes away with it), else the user's kernels folder. Installed already
    means installed there: a kernel of the same name elsewhere (this environment's, when
    the user's folder is asked for) does not count.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if user is None and prefix is None:
        if sys.prefix != sys.base_prefix:
            prefix = sys.prefix
        else:
            user = True
    spec, manager = kernel_spec(), KernelSpecManager()
    kernels = Path(manager.user_kernel_dir) if user else \
        Path(prefix).expanduser().resolve() / "share" / "jupyter" / "kernels"
    try:
        current = json.loads((kernels / KERNEL_NAME / "kernel.json").read_text())
        if _same_command(current["argv"], spec["argv"]) \
                and current["display_name"] == spec["display_name"]:
            return kernels / KERNEL_NAME, False
    except (OSError, ValueError, KeyError, TypeError):  # not there, or not one of ours
        pass
    with tempfile.TemporaryDirectory() as staging:
        (Path(staging) / "kernel.json").write_text(json.dumps(spec, indent=1))
        where = manager.install_kernel_spec(
            staging, KERNEL_NAME, user=bool(user), prefix=None if user else str(prefix))
    return Path(where), True


def _same_command(a: list[str], b: list[str]) -> bool:
    """The same kernel command, whichever name of this Python started it (bin/python and
    bin/python3 of one virtual environment are one interpreter)."""
    if not a or not b or a[1:] != b[1:]:
        return False
    return a[0] == b[0] or (Path(a[0]).parent == Path(b[0]).parent
                            and os.path.realpath(a[0]) == os.path.realpath(b[0]))


def prepare_notebooks(directory: Path) -> list[Path]:
    """Copy the example notebooks that are not there yet into `directory`/examples and
    return those copied: the user runs and edits copies, never the package's (or the
    checkout's) own files, and a copy they changed is never overwritten."""
    source = examples_dir()
    if source is None:
        return []
    target = directory / "examples"
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for notebook in sorted(source.glob("*.ipynb")):
        destination = target / notebook.name
        if not destination.exists():
            shutil.copyfile(notebook, destination)
            copied.append(destination)
    return copied


def lab_command(args) -> tuple[list[str], Path] | int:
    """(JupyterLab's command line, its root folder), or an exit status after a message."""
    if args.notebook:
        notebook = Path(args.notebook).expanduser().resolve()
        if not notebook.exists():
            hint = (" (options for jupyter lab take their value after '=', as in --port=9999)"
                    if args.lab_args else "")
            return _fail(f"{notebook}: no such notebook{hint}")
        root, opened = notebook.parent, notebook.name
    else:
        root = Path(args.dir or os.environ.get("MPILAB_NOTEBOOKS", DEFAULT_NOTEBOOK_DIR))
        root = root.expanduser().resolve()
        copied = prepare_notebooks(root)
        if copied:
            print(f"mpilab: copied {len(copied)} example notebooks into {root / 'examples'}")
        quickstart = root / "examples" / "01_quickstart.ipynb"
        if not quickstart.exists():
            return _fail(f"no example notebooks to open in {root}: this mpilab has none "
                         "(pass a notebook: mpilab lab NOTEBOOK)")
        opened = "examples/01_quickstart.ipynb"
    where, changed = install_kernel()
    if changed:
        print(f"mpilab: installed the kernel {KERNEL_DISPLAY_NAME!r} in {where}")
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}",
           f"--LabApp.default_url=/lab/tree/{opened}", *args.lab_args]
    if os.geteuid() == 0:  # containers and CI machines run as root; JupyterLab refuses
        cmd.append("--allow-root")
    return cmd, root


def cmd_lab(args) -> int:
    """JupyterLab on copies of the examples (or a notebook given), the quickstart open,
    with the "Python (mpilab)" kernel installed."""
    prepared = lab_command(args)
    if isinstance(prepared, int):
        return prepared
    cmd, _ = prepared
    # become JupyterLab: signals (Ctrl-C, a terminate) then reach the server itself
    os.execv(sys.executable, cmd)


def cmd_install_kernel(args) -> int:
    """Install the kernelspec for a JupyterLab or Notebook the user runs themselves."""
    where, changed = install_kernel(user=True if args.user else None, prefix=args.prefix)
    state = "installed" if changed else "already installed"
    print(f"mpilab: kernel {KERNEL_DISPLAY_NAME!r} {state} in {where}")
    return 0


def cmd_run(args) -> int:
    """Execute a notebook headless (nbclient), ranks included; save it and its HTML."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from traitlets.config import Config

    source = Path(args.notebook)
    if not source.exists():
        return _fail(f"{source}: no such notebook")
    try:
        nb = nbformat.read(source, as_version=4)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets one line
        return _fail(f"{source}: not a readable notebook ({e})")
    # A notebook for the "Python (mpilab)" kernel runs in what that kernelspec starts:
    # this Python's kernel with the extension loaded (installed or not); any other in
    # this Python's kernel, as before (such notebooks load the extension themselves).
    wants_mpilab = nb.metadata.get("kernelspec", {}).get("name") == KERNEL_NAME
    # no widget state in the saved notebook: each live dashboard would add megabytes,
    # and its static plot (the cell's final output) is what a reader of the file needs
    running: list[int] = []  # the index of the cell that runs now

    def started(cell, cell_index: int) -> None:
        running[:] = [cell_index]

    # the kernel on sockets in a folder of this run's own (ipc), not on TCP ports of the
    # loopback: no other user may connect to it, and it prints no warning that its TCP
    # is not encrypted. An absolute path: the kernel runs in the notebook's folder
    sockets = tempfile.mkdtemp(prefix="mpilab-run-")
    config = Config({"KernelManager": {"transport": "ipc", "ip": f"{sockets}/kernel"}})
    client = NotebookClient(nb, timeout=args.cell_timeout, kernel_name="python3",
                            extra_arguments=[f"--ext={KERNEL_NAME}"] if wants_mpilab else [],
                            store_widget_state=False, on_cell_start=started, config=config,
                            resources={"metadata": {"path": str(source.parent.resolve())}})
    # the kernel's own stderr (ipykernel's and tornado's log, among it a traceback its
    # shutdown sometimes races into) goes to a file, not onto this command's: the cells'
    # output comes over the kernel's channels into the notebook, C-level output included.
    # Where the kernel died, what it wrote last is said after the line that names the cell.
    kernel_log = open(Path(sockets) / "kernel.log", "w+b")
    status, died = 0, False
    try:
        client.execute(stderr=kernel_log)
    except CellExecutionError as e:
        status = 1
        error = _error_line(e.ename, e.evalue)
        if e.ename == "UsageError" and not wants_mpilab and \
                re.search(r"magic function `%%?(mpilab|ranks)` not found", e.evalue or ""):
            error = (error.rstrip(".") + ": the notebook's kernel does not load mpilab; put "
                     "`%load_ext mpilab` first, or use the Python (mpilab) kernel")
        print(f"mpilab: {source.name}: a cell failed{_cell_named(nb, running)}: {error}",
              file=sys.stderr)
    except (CellTimeoutError, DeadKernelError) as e:  # the ranks go with the kernel
        status = 1
        what = (f"ran past --cell-timeout ({args.cell_timeout} s)"
                if isinstance(e, CellTimeoutError) else "ended with its kernel's death")
        print(f"mpilab: {source.name}: a cell {what}{_cell_named(nb, running)}; the cells "
              "before it ran", file=sys.stderr)
        died = isinstance(e, DeadKernelError)
    except RuntimeError as e:  # jupyter_client's "Kernel died before replying to kernel_info"
        if "died" not in str(e):
            raise
        status, died = 1, True
        atexit.unregister(client._cleanup_kernel)  # nbclient's, for the kernel it lost
        print(f"mpilab: {source.name}: its kernel died as it started; no cell ran",
              file=sys.stderr)
    finally:
        if died:
            kernel_log.seek(0)
            sys.stderr.write(kernel_log.read().decode(errors="replace"))
        kernel_log.close()
        shutil.rmtree(sockets, ignore_errors=True)
    out = Path(args.output) if args.output else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)
    if args.html:
        from mpilab.widgets.plotting import inline_plotlyjs
        from nbconvert import HTMLExporter

        html, _ = HTMLExporter().from_notebook_node(nb)
        Path(args.html).parent.mkdir(parents=True, exist_ok=True)
        # plotly.js inside the page: a cluster node without internet shows the plots
        Path(args.html).write_text(inline_plotlyjs(html))
    if status == 0:
        print(f"mpilab: ran {source}" + (f" → {out}" if out else "")
              + (f", {args.html}" if args.html else ""))
    return status


def _cell_named(nb, running: list[int]) -> str:
    """' (cell 2: its first line)' for the cell that ran last, '' before any."""
    if not running:
        return ""
    line = next(iter(nb.cells[running[0]].source.strip().splitlines()), "")
    return f" (cell {running[0] + 1}: {line[:60]})"


def _error_line(ename: str, evalue: str) -> str:
    """A failed cell's error in one line: the last line of what the ranks raised (a
    %%ranks cell's error holds their tracebacks), or the kernel's own error."""
    from .runner import RanksError

    lines = [line.strip() for line in (evalue or "").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if ename == RanksError.__name__:
        return last
    return f"{ename}: {last}" if last else ename


def _slurm_found() -> str:
    """Where the ranks go as far as Slurm is concerned: into the allocation this runs
    in, into a job --launcher slurm submits, or nowhere (no Slurm here)."""
    from . import placement
    from .selection import host_list

    if placement.in_allocation():
        job = os.environ["SLURM_JOB_ID"]
        try:
            nodes = host_list(placement.allocation_hosts())
            tasks = placement.allocation_tasks()
        except placement.ClusterError as e:
            return f"allocation {job}, but {e}"
        held = f"; {tasks} tasks" if tasks else ""
        return f"allocation {job} ({nodes}{held}): `%mpilab start -n N` puts the ranks there"
    if shutil.which("sbatch"):
        return "sbatch found: `%mpilab start --launcher slurm` submits a job"
    return "none (ranks run here, or on hosts of a --hostfile over ssh)"


def srun_plugin_advice(slurm_conf: str) -> str:
    """How a job script of one's own starts the ranks, from slurm.conf's text: srun's
    default MPI plugin (MpiDefault; Slurm's own default is none) decides whether a plain
    `srun python train.py` gives MPICH its peers (pmi2) or leaves every task a world of
    one."""
    found = re.search(r"^\s*MpiDefault\s*=\s*(\S+)", slurm_conf, re.M | re.I)
    default = found.group(1).lower() if found else "none"
    if default == "pmi2":
        return "srun's MPI plugin pmi2: a job script's `srun python train.py` is one world"
    return (f"srun's MPI plugin {default}: in a job script, `srun --mpi=pmi2 python "
            "train.py` or `mpiexec -n N python train.py`")


def _job_scripts_found() -> str | None:
    """mpilab doctor's row on job scripts (None: no srun, or no slurm.conf to read here)."""
    if not shutil.which("srun"):
        return None
    try:
        with open(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf") as f:
            return srun_plugin_advice(f.read())
    except OSError:
        return None


def _batch_job_found() -> str | None:
    """The PBS, LSF or SGE job this runs in and where a plain start puts the ranks
    there (None: no such job)."""
    from . import placement
    from .selection import host_list

    try:
        nodefile = placement.batch_nodefile("mpi", None)
        if nodefile is None:
            return None
        hosts = host_list(placement.hostfile_hosts(nodefile))
    except placement.ClusterError as e:
        return str(e)
    return (f"{placement.pbs_job()} ({hosts}): `%mpilab start -n N` places the ranks by "
            "its node file")


def cmd_doctor(args) -> int:
    """What mpilab found on this machine and what is missing, with the fix."""
    from .cluster import ClusterError, find_mpiexec

    problems: list[tuple[str, str]] = []

    def row(name: str, value: str) -> None:
        print(f"  {name:<14} {value}")

    print("mpilab doctor")
    row("python", f"{sys.version.split()[0]} ({sys.executable})")
    try:
        row("mpiexec", find_mpiexec())
    except ClusterError as e:
        row("mpiexec", "missing")
        problems.append(("mpiexec", str(e)))
    try:
        import mpi4py
        from mpi4py import MPI

        row("mpi4py", mpi4py.__version__)
        row("MPI library", MPI.Get_library_version().splitlines()[0].strip())
    except Exception as e:  # noqa: BLE001 - any import failure is reported
        row("mpi4py", f"missing ({e})")
        problems.append(("mpi4py", "pip install mpich mpi4py"))
    try:
        import torch
        import torch.distributed as dist

        backends = [b for b, ok in (("gloo", dist.is_gloo_available()),
                                    ("nccl", dist.is_nccl_available()),
                                    ("mpi", dist.is_mpi_available())) if ok]
        row("torch", f"{torch.__version__} (backends: {', '.join(backends) or 'none'})")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        row("GPUs", ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or
            "none (ranks use the CPU and gloo)")
    except Exception as e:  # noqa: BLE001
        row("torch", f"missing ({e})")
        problems.append(("torch", "pip install torch"))
    for module, fix in (("ipyparallel", "pip install ipyparallel"),
                        ("jupyterlab", "pip install jupyterlab"),
                        ("plotly", "pip install plotly")):
        try:
            mod = __import__(module)
            row(module, getattr(mod, "__version__", "installed"))
        except ImportError:
            row(module, "missing")
            problems.append((module, fix))
    row("Slurm", _slurm_found())
    scripts = _job_scripts_found()
    if scripts:
        row("job scripts", scripts)
    batch = _batch_job_found()
    if batch:
        row("batch job", batch)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    row("chromium", browser or "missing (only the browser tests need it)")
    if problems:
        print("missing:")
        for name, fix in problems:
            print(f"  {name}: {fix}")
        return 1
    print("everything mpilab needs is here")
    return 0


def cmd_bench(args) -> int:
    """Run a collective benchmark on N fresh ranks under mpiexec and print the table."""
    from .cluster import ClusterError, check_memory_here, find_mpiexec

    try:
        mpiexec = find_mpiexec(args.mpiexec)
    except ClusterError as e:
        return _fail(str(e))
    from .wire import parse_backends, parse_sizes

    if args.n < 1:
        return _fail(f"-n must be a positive number of ranks, got {args.n}")
    try:
        check_memory_here(args.n)
    except ClusterError as e:
        return _fail(str(e))
    try:
        parse_sizes(args.sizes)
        parse_backends(args.backends)
    except ValueError as e:
        return _fail(str(e))
    proc = subprocess.Popen([mpiexec, "-n", str(args.n), sys.executable, "-m",
                             "mpilab.rank.bench_cli", args.op, args.sizes, args.backends],
                            stdout=subprocess.PIPE, text=True)
    result = None
    for line in proc.stdout:  # the ranks' own lines pass through as they come
        if line.startswith(BENCH_RESULT_PREFIX):
            result = json.loads(line[len(BENCH_RESULT_PREFIX):])
        else:
            print(line, end="", flush=True)
    code = proc.wait()
    if result is not None:
        from .widgets import bench_table

        print(bench_table(result["rows"], result["ceiling"]))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpilab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    lab = sub.add_parser(
        "lab", help="JupyterLab with the examples and the \"Python (mpilab)\" kernel",
        description="Copies the example notebooks that are missing into DIR/examples (your "
        "copies: edit them freely), installs the \"Python (mpilab)\" kernel, which loads "
        "the extension, and opens the quickstart in JupyterLab. Other options (e.g. "
        "--ServerApp.port=9999) go to jupyter lab.")
    lab.add_argument("notebook", nargs="?",
                     help="open this notebook instead (JupyterLab's root is its folder)")
    lab.add_argument("--dir", help="JupyterLab's root folder, where the examples are copied "
                     f"(default: $MPILAB_NOTEBOOKS, else {DEFAULT_NOTEBOOK_DIR})")
    lab.set_defaults(func=cmd_lab)

    run = sub.add_parser(
        "run", help="execute a notebook headless, with its ranks",
        description="Runs every cell as JupyterLab would (a notebook for the \"Python "
        "(mpilab)\" kernel gets the extension loaded; others load it themselves), in the "
        "notebook's folder, and saves the executed notebook and an HTML page that shows its "
        "plots without a network (plotly.js inside). Its output is one line: what ran, or "
        "which cell failed and why (after a kernel's death, what the kernel wrote last).")
    run.add_argument("notebook")
    run.add_argument("-o", "--output", help="write the executed notebook here")
    run.add_argument("--html", help="also write it as a self-contained HTML page here")
    run.add_argument("--cell-timeout", type=int, default=900,
                     help="seconds a cell may run (default 900)")
    run.set_defaults(func=cmd_run)

    kernel = sub.add_parser(
        "install-kernel", help="install the \"Python (mpilab)\" kernel for your own Jupyter",
        description="A kernelspec whose kernels load the mpilab extension at start. Default "
        "place: this virtual environment, else your user's kernels.")
    kernel.add_argument("--user", action="store_true", help="in your user's kernels folder")
    kernel.add_argument("--prefix", help="under PREFIX/share/jupyter/kernels")
    kernel.set_defaults(func=cmd_install_kernel)

    bench = sub.add_parser("bench", help="measure a collective across ranks")
    bench.add_argument("op", choices=BENCH_COLLECTIVES)
    bench.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    bench.add_argument("--sizes", default="4K:64M",
                       help=f"{SIZES_HELP} (default 4K:64M)")
    bench.add_argument("--backends", default="mpi,gloo,mpilab",
                       help="any of mpi, gloo, nccl, mpilab (default mpi,gloo,mpilab)")
    bench.add_argument("--mpiexec", default=None, help="the mpiexec to use")
    bench.set_defaults(func=cmd_bench)

    doctor = sub.add_parser("doctor", help="check MPI, torch and devices")
    doctor.set_defaults(func=cmd_doctor)

    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.lab_args = extra
    try:
        return args.func(args)
    except OSError as e:  # a folder or file given (or defaulted) that cannot be written
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}")


if __name__ == "__main__":
    sys.exit(main())

"""The `mpilab` command: lab, run, bench, doctor."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _fail(message: str) -> int:
    print(f"mpilab: {message}", file=sys.stderr)
    return 2


def kernel_ipython_dir() -> Path:
    """An IPython dir whose kernels load the mpilab extension at start."""
    base = Path(os.environ.get("MPILAB_HOME", Path.home() / ".mpilab")) / "ipython"
    config = base / "profile_default" / "ipython_kernel_config.py"
    config.parent.mkdir(parents=True, exist_ok=True)
    text = 'c.InteractiveShellApp.extensions = ["mpilab"]\n'
    if not config.exists() or config.read_text() != text:
        config.write_text(text)
    return base


def cmd_lab(args) -> int:
    """JupyterLab with the extension loaded in every kernel and the quickstart open."""
    notebook = Path(args.notebook) if args.notebook else PACKAGE_NOTEBOOKS / "01_quickstart.ipynb"
    if not notebook.exists():
        hint = (" (options for jupyter lab take their value after '=', as in --port=9999)"
                if args.lab_args else "")
        return _fail(f"{notebook}: no such notebook{hint}")
    env = {**os.environ, "IPYTHONDIR": str(kernel_ipython_dir())}
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebook.parent}",
           f"--LabApp.default_url=/lab/tree/{notebook.name}", *args.lab_args]
    if os.geteuid() == 0:  # containers and CI machines run as root; JupyterLab refuses
        cmd.append("--allow-root")
    # become JupyterLab: signals (Ctrl-C, a terminate) then reach the server itself
    os.execve(sys.executable, cmd, env)


def cmd_run(args) -> int:
    """Execute a notebook headless (nbclient), ranks included; save it and its HTML."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    source = Path(args.notebook)
    if not source.exists():
        return _fail(f"{source}: no such notebook")
    try:
        nb = nbformat.read(source, as_version=4)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets one line
        return _fail(f"{source}: not a readable notebook ({e})")
    # no widget state in the saved notebook: each live dashboard would add megabytes,
    # and its static plot (the cell's final output) is what a reader of the file needs
    client = NotebookClient(nb, timeout=args.cell_timeout, kernel_name="python3",
                            store_widget_state=False,
                            resources={"metadata": {"path": str(source.parent.resolve())}})
    status = 0
    try:
        client.execute()
    except CellExecutionError as e:
        status = 1
        first = str(e).strip().splitlines()
        print(f"mpilab: {source.name}: a cell failed: {first[-1] if first else e}",
              file=sys.stderr)
    out = Path(args.output) if args.output else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)
    if args.html:
        from nbconvert import HTMLExporter

        html, _ = HTMLExporter().from_notebook_node(nb)
        Path(args.html).parent.mkdir(parents=True, exist_ok=True)
        Path(args.html).write_text(html)
    if status == 0:
        print(f"mpilab: ran {source}" + (f" → {out}" if out else "")
              + (f", {args.html}" if args.html else ""))
    return status


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
    from .cluster import ClusterError, find_mpiexec

    try:
        mpiexec = find_mpiexec(args.mpiexec)
    except ClusterError as e:
        return _fail(str(e))
    from .rank.bench import parse_backends, parse_sizes

    if args.n < 1:
        return _fail(f"-n must be a positive number of ranks, got {args.n}")
    try:
        parse_sizes(args.sizes)
        parse_backends(args.backends)
    except ValueError as e:
        return _fail(str(e))
    code = ("import sys; from mpilab.cli import bench_on_ranks; "
            f"sys.exit(bench_on_ranks({args.op!r}, {args.sizes!r}, {args.backends!r}))")
    return subprocess.call([mpiexec, "-n", str(args.n), sys.executable, "-c", code])


def bench_on_ranks(op: str, sizes: str, backends: str) -> int:
    """Runs on every rank under mpiexec; rank 0 prints the table `%mpilab bench` shows."""
    import mpilab
    from mpilab.rank.bench import parse_backends, parse_sizes
    from mpilab.rank.engine import bench_here

    ctx = mpilab.init()
    try:
        rows, ceiling = bench_here(op, parse_sizes(sizes), parse_backends(backends))
    except ValueError as e:
        if ctx.rank == 0:
            print(f"mpilab: {e}", file=sys.stderr)
        return 2
    if ctx.rank == 0:
        from mpilab.widgets import bench_table

        print(bench_table(rows, ceiling))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpilab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    lab = sub.add_parser("lab", help="JupyterLab with mpilab loaded and the examples open")
    lab.add_argument("notebook", nargs="?", help="default: the quickstart; other options "
                     "(e.g. --ServerApp.port=9999) go to jupyter lab")
    lab.set_defaults(func=cmd_lab)

    run = sub.add_parser("run", help="execute a notebook headless, with its ranks")
    run.add_argument("notebook")
    run.add_argument("-o", "--output", help="write the executed notebook here")
    run.add_argument("--html", help="also write it as HTML here")
    run.add_argument("--cell-timeout", type=int, default=900)
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="measure a collective across ranks")
    bench.add_argument("op", choices=["allreduce", "broadcast", "allgather"])
    bench.add_argument("-n", type=int, default=2)
    bench.add_argument("--sizes", default="4K:64M")
    bench.add_argument("--backends", default="mpi,gloo,mpilab")
    bench.add_argument("--mpiexec", default=None)
    bench.set_defaults(func=cmd_bench)

    doctor = sub.add_parser("doctor", help="check MPI, torch and devices")
    doctor.set_defaults(func=cmd_doctor)

    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.lab_args = extra
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

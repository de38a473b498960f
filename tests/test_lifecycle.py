"""Clusters beyond the shared one: hostfile, unload, kernel shutdown, batch jobs, CLI."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import cluster_pids
from kernel import Kernel
from mpirun import run_ranks

ROOT = Path(__file__).resolve().parent.parent
MPILAB = str(Path(sys.executable).parent / "mpilab")


def _assert_gone(pids: dict) -> None:
    for pid in pids["engines"] + pids["launchers"]:
        if psutil.pid_exists(pid):
            proc = psutil.Process(pid)
            assert proc.status() == "zombie", f"process {pid} survived: {proc.cmdline()}"


def test_hostfile_ranks_then_unload_and_kernel_shutdown_leave_nothing(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n")
    kernel = Kernel()
    try:
        assert kernel.run("%load_ext mpilab").ok
        run = kernel.run(f"%mpilab start -n 2 --hostfile {hostfile}", timeout=180)
        assert run.ok, run.text
        run = kernel.run("%%ranks\nprint(comm.allreduce(rank + 1))")
        assert "[ranks 0-1] 3" in run.stdout
        pids = cluster_pids(kernel)
        assert kernel.run("%unload_ext mpilab", timeout=60).ok
        _assert_gone(pids)
        # loaded again, started again on this host's network address (as for ranks on
        # other hosts: the controller and the record channel listen there), with three
        # ranks (on a 2-core host: more ranks than cores, so each rank warms up after
        # its start), then the kernel itself goes away
        assert kernel.run("%load_ext mpilab").ok
        ip = _network_address()
        assert kernel.run(f"%mpilab start -n 3 --controller-ip {ip}", timeout=180).ok
        run = kernel.run("%%ranks\nfrom mpilab.rank import engine, warmup\n"
                         "done = warmup.wait(120) is not None\ncomm.Barrier()\n"
                         "print(engine._warming_since_start, done)",
                         timeout=180)
        oversubscribed = len(os.sched_getaffinity(0)) < 3
        assert f"[ranks 0-2] {not oversubscribed} True" in run.stdout, run.text
        run = kernel.run("%%ranks\nfor step in range(3):\n    mpilab.log(step=step, loss=1.0)")
        assert run.ok, run.text
        address = kernel.run("from mpilab.session import Session\n"
                             "print(Session.instance().cluster.receiver_address)").stdout
        assert address.startswith(f"tcp://{ip}:"), address
        assert "loss 1" in kernel.run("%mpilab dashboard").text  # the records arrived
        pids = cluster_pids(kernel)
    finally:
        kernel.shutdown()
    psutil.wait_procs([psutil.Process(p) for p in pids["engines"] if psutil.pid_exists(p)],
                      timeout=20)
    _assert_gone(pids)


def _network_address() -> str:
    """This host's first IPv4 address that is not loopback."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    raise AssertionError("this machine has no network address to test --controller-ip on")


def test_batch_job_runs_notebook_cell_code_unchanged():
    cell = (
        "import torch\n"
        "t = torch.ones(3) * (ctx.rank + 1)\n"
        "import torch.distributed as dist\n"
        "dist.all_reduce(t)\n"
        "report({'sum': t.tolist(), 'mpi': ctx.comm.allreduce(1), 'device': str(ctx.device),"
        " 'world': ctx.world_size, 'local': ctx.local_rank,"
        " 'same': mpilab.init() is ctx, 'threads': torch.get_num_threads()})\n"
    )
    results = run_ranks(cell, n=2)
    for rank, res in enumerate(results):
        assert res["sum"] == [3.0, 3.0, 3.0]
        assert res["mpi"] == 2 and res["world"] == 2 and res["local"] == rank
        assert res["device"] == "cpu" and res["same"]
        assert res["threads"] >= 1


def test_a_batch_jobs_progress_is_a_line_from_rank_0_with_the_logged_values():
    """The README's training cell as a batch job: there is no notebook to draw the bar
    or the loss plot, so rank 0 writes the loop's progress with the newest logged values
    to stderr, a line at the end (and every few seconds of a longer loop), once."""
    cell = (
        "import torch\n"
        "model = mpilab.DataParallel(torch.nn.Linear(64, 10))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in mpilab.progress(range(20), desc='train'):\n"
        "    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))\n"
        "    loss = torch.nn.functional.cross_entropy(model(x), y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    mpilab.log(loss=loss)\n"
        "report(round(loss.item(), 4))\n"
    )
    results, job = run_ranks(cell, n=2, check=False)
    assert job.returncode == 0, job.stderr[-3000:]
    lines = [line for line in job.stderr.splitlines() if line.startswith("train:")]
    assert len(lines) == 1, job.stderr
    found = re.fullmatch(r"train: 20/20 \(100%\) · [\d.]+ s · [\d.]+(/s| s each) · loss "
                         r"([\d.e-]+)", lines[0])
    assert found and abs(float(found.group(2)) - results[0]) < 1e-3, (lines, results)


def test_doctor_reports_what_it_found():
    proc = subprocess.run([MPILAB, "doctor"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpiexec" in proc.stdout and "MPICH" in proc.stdout and "torch" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["run", "nope.ipynb"], "nope.ipynb: no such notebook"),
    (["bench", "allreduce", "-n", "0"], "-n must be a positive number of ranks, got 0"),
    (["bench", "allreduce", "--backends", "foo"], "bench backend 'foo' is not one of"),
    (["bench", "allreduce", "-n", "100000"], "100000 ranks on this host take about"),
    (["lab", "--port", "9999"], "9999: no such notebook (options for jupyter lab take their "
                                "value after '=', as in --port=9999)"),
    (["lab", "--dir", "/proc/mpilab-nowhere"], "/proc/mpilab-nowhere: No such file or directory"),
    (["install-kernel", "--prefix", "/proc/mpilab-nowhere"], "No such file or directory"),
])
def test_cli_bad_input_is_one_line(args, message):
    proc = subprocess.run([MPILAB, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    said = proc.stderr.strip()
    assert said.startswith("mpilab: ") and message in said, said  # a path may lead the line
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout


def test_install_kernel_installs_where_asked_once(tmp_path):
    """--prefix and --user each get their own kernel, though this environment has one of
    the same name (which `mpilab lab` installed): that one is not where they asked."""
    env = {**os.environ, "JUPYTER_DATA_DIR": str(tmp_path / "user")}

    def install(*args: str) -> str:
        proc = subprocess.run([MPILAB, "install-kernel", *args], capture_output=True,
                              text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    prefix = tmp_path / "prefix"
    kernels = prefix / "share" / "jupyter" / "kernels" / "mpilab"
    assert install("--prefix", str(prefix)) == \
        f"mpilab: kernel 'Python (mpilab)' installed in {kernels}"
    assert install("--prefix", str(prefix)) == \
        f"mpilab: kernel 'Python (mpilab)' already installed in {kernels}"
    spec = json.loads((kernels / "kernel.json").read_text())
    assert Path(spec["argv"][0]).parent == Path(sys.executable).parent  # this environment
    assert "--ext=mpilab" in spec["argv"]
    user = tmp_path / "user" / "kernels" / "mpilab"
    assert install("--user") == f"mpilab: kernel 'Python (mpilab)' installed in {user}"
    assert (user / "kernel.json").exists()


def test_run_stops_at_a_cell_past_its_timeout_and_keeps_what_ran(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("print('first cell ran')"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(120)"),
        nbformat.v4.new_code_cell("print('never')"),
    ])
    nbformat.write(nb, tmp_path / "slow.ipynb")
    out = tmp_path / "out.ipynb"
    proc = subprocess.run([MPILAB, "run", str(tmp_path / "slow.ipynb"), "-o", str(out),
                           "--cell-timeout", "3"], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("mpilab: ")]
    assert said == ["mpilab: slow.ipynb: a cell ran past --cell-timeout (3 s) (cell 2: import "
                    "time); the cells before it ran"], proc.stderr
    kept = nbformat.read(out, as_version=4)
    assert kept.cells[0].outputs[0]["text"] == "first cell ran\n"
    assert not kept.cells[2].get("outputs")


def test_run_names_the_failed_cell_and_its_error_in_one_line(tmp_path):
    """nbclient's own message ended in its separator line (`------------------`) when
    the error had no traceback, as a magic's usage error has; a notebook whose kernel
    does not load mpilab is told how to."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('first')"),
                                         nbformat.v4.new_code_cell("%mpilab start -n 2")])
    nbformat.write(nb, tmp_path / "plain.ipynb")
    proc = subprocess.run([MPILAB, "run", str(tmp_path / "plain.ipynb")], capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 1
    said = [line for line in proc.stderr.splitlines() if line.startswith("mpilab: ")]
    assert said == ["mpilab: plain.ipynb: a cell failed (cell 2: %mpilab start -n 2): "
                    "UsageError: Line magic function `%mpilab` not found: the notebook's "
                    "kernel does not load mpilab; put `%load_ext mpilab` first, or use the "
                    "Python (mpilab) kernel"], proc.stderr
    assert proc.stderr.strip() == said[0], proc.stderr  # nothing more (TCP warnings and such)
    nb.cells[1].source = "raise KeyError('no such column')"
    nbformat.write(nb, tmp_path / "plain.ipynb")
    proc = subprocess.run([MPILAB, "run", str(tmp_path / "plain.ipynb")], capture_output=True,
                          text=True, timeout=90)
    said = [line for line in proc.stderr.splitlines() if line.startswith("mpilab: ")]
    assert said == ["mpilab: plain.ipynb: a cell failed (cell 2: raise KeyError('no such "
                    "column')): KeyError: 'no such column'"], proc.stderr


# what the kernel writes on its own stderr (its log; here as it exits, where ipykernel's
# shutdown at times races into a traceback of its own), not into a cell's output: fd 2,
# or where ipykernel takes fd 2 for the cells' output (not under pytest), its copy of it
KERNEL_OWN_LINE = ("import atexit, os, sys\n"
                   "_log = getattr(sys.stderr, '_original_stdstream_copy', 2)\n"
                   "atexit.register(os.write, _log, b'the kernel log line\\n')\nprint('ran')")


def test_run_says_the_kernels_own_log_only_where_the_kernel_died(tmp_path):
    """`mpilab run`'s output is its own lines: the kernel's log goes to a file; a kernel
    that died has what it wrote last said after the line that names the cell."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(KERNEL_OWN_LINE)])
    nbformat.write(nb, tmp_path / "quiet.ipynb")
    proc = subprocess.run([MPILAB, "run", str(tmp_path / "quiet.ipynb")], capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    nb.cells.append(nbformat.v4.new_code_cell(
        "os.write(_log, b'its last words\\n')\nos._exit(3)"))
    nbformat.write(nb, tmp_path / "dies.ipynb")
    proc = subprocess.run([MPILAB, "run", str(tmp_path / "dies.ipynb")], capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "mpilab: dies.ipynb: a cell ended with its kernel's death (cell 2: os.write(_log, "
        "b'its last words\\n')); the cells before it ran", "its last words"], proc.stderr
    # a kernel that dies as it starts (a broken environment): one line, then its own words,
    # not nbclient's traceback
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\nif 'ipykernel_launcher' in sys.orig_argv:\n"
        "    sys.stderr.write('the kernel cannot start here\\n')\n    sys.stderr.flush()\n"
        "    import os\n    os._exit(3)\n")
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([MPILAB, "run", str(tmp_path / "quiet.ipynb")], capture_output=True,
                          text=True, timeout=90, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "mpilab: quiet.ipynb: its kernel died as it started; no cell ran",
        "the kernel cannot start here"], proc.stderr


def test_mpilab_lab_serves_the_examples(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MPILAB_HOME": str(tmp_path), "MPILAB_NOTEBOOKS": str(tmp_path / "nb")}
    proc = subprocess.Popen([MPILAB, "lab", f"--ServerApp.port={port}",
                             "--ServerApp.ip=127.0.0.1", "--no-browser",
                             "--IdentityProvider.token=t0ken"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}/api/contents/examples?token=t0ken"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    listing = json.load(response)
                break
            except OSError:
                assert time.monotonic() < deadline, "mpilab lab did not answer"
                time.sleep(0.5)
        names = {item["name"] for item in listing["content"]}
        assert "01_quickstart.ipynb" in names  # copies of the examples (test_first_hour)
        # mpilab lab became the server (no wrapper in between), so stopping it stops it
        assert "jupyterlab" in " ".join(psutil.Process(proc.pid).cmdline())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "JupyterLab outlived mpilab lab"


def test_killed_kernel_leaves_no_ranks_behind():
    """A kernel that dies without stopping its cluster (SIGKILL): controller and engines
    notice and end themselves."""
    kernel = Kernel()
    try:
        assert kernel.run("%load_ext mpilab").ok
        assert kernel.run("%mpilab start -n 2", timeout=180).ok
        kernel_proc = psutil.Process(kernel.km.provisioner.process.pid)
        tree = kernel_proc.children(recursive=True)
        assert len(tree) >= 5  # controller (+ schedulers), mpiexec, supervisors, engines
        kernel_proc.kill()
        _, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        kernel.release()


FORKS = """
import multiprocessing, time
from mpilab.controller_main import end_forked_children_with_me

end_forked_children_with_me()

def grandchild():
    time.sleep(120)

def child():
    p = multiprocessing.Process(target=grandchild)
    p.start()
    print("grandchild", p.pid, flush=True)
    time.sleep(120)

if __name__ == "__main__":
    multiprocessing.set_start_method("fork")
    p = multiprocessing.Process(target=child)
    p.start()
    print("child", p.pid, flush=True)
    time.sleep(120)
"""


def test_what_the_controller_forks_ends_with_the_controller():
    """ipyparallel's controller forks its schedulers and queues as it starts; a start that
    failed at once could end the controller before the notebook had seen them, and they
    ran on for good (found after the Slurm tests). Each ends with its own parent, and
    while that lives it lives."""
    proc = subprocess.Popen([sys.executable, "-c", FORKS], stdout=subprocess.PIPE, text=True)
    try:
        pids = dict(proc.stdout.readline().split() for _ in range(2))
        forked = [psutil.Process(int(pids[name])) for name in ("child", "grandchild")]
        time.sleep(2.0)  # their parent alive: the signal is not sent
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in forked)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in forked):
        assert time.monotonic() < deadline, "a forked process outlived its parent"
        time.sleep(0.1)

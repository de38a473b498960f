"""A notebook never hangs: failing peers, hangs, interrupts, dead ranks, floods, soak.

Own kernel and cluster (these tests kill ranks and restart the cluster).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest
from conftest import cluster_pids
from kernel import Kernel, stream_text
from mpirun import run_ranks

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def nb():
    kernel = Kernel()
    assert kernel.run("%load_ext mpilab").ok
    assert kernel.run("%mpilab start -n 2", timeout=180).ok
    assert kernel.run("%%ranks\nimport torch, numpy as np, os, time").ok
    yield kernel
    kernel.run("%mpilab stop", timeout=60)
    kernel.shutdown()


def timed(kernel: Kernel, code: str, timeout: float = 120, **kw):
    start = time.monotonic()
    run = kernel.run(code, timeout=timeout, **kw)
    return run, time.monotonic() - start


def assert_usable_with_state(nb: Kernel, name: str, value: str) -> None:
    run = nb.run(f"%%ranks\nx = torch.ones(2)\nmpilab.allreduce(x)\nprint(x.tolist(), {name})")
    assert run.ok, run.text
    assert f"[ranks 0-1] [2.0, 2.0] {value}" in run.stdout


def test_peer_failure_in_mpilab_allreduce_releases_waiter_and_keeps_state(nb):
    assert nb.run("%%ranks\nkept = 'kept-' + str(rank)").ok
    run, took = timed(nb, "%%ranks\nx = torch.ones(4)\nif rank == 1:\n"
                          "    raise RuntimeError('rank one broke')\nmpilab.allreduce(x)")
    assert not run.ok
    assert took < 10
    err = run.error_text
    assert err.count("RuntimeError: rank one broke") == 1
    assert re.search(r"rank 0 was waiting in allreduce #\d+ .*for [\d.]+ s when rank 1 failed",
                     err), err
    assert "Traceback" in err and "kernel_ext" not in err
    run = nb.run("%%ranks\nx = torch.ones(2)\nmpilab.allreduce(x)\nprint(x.tolist(), kept)")
    assert run.ok, run.text
    assert "[rank 0] [2.0, 2.0] kept-0" in run.stdout


def test_peer_failure_in_data_parallel(nb):
    code = (
        "%%ranks\n"
        "model = mpilab.DataParallel(torch.nn.Linear(64, 64), backend='mpi')\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(20):\n"
        "    if rank == 1 and step == 5:\n"
        "        raise ValueError('bad batch on rank 1')\n"
        "    loss = model(torch.randn(8, 64)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
    )
    run, took = timed(nb, code)
    assert not run.ok and took < 10
    assert run.error_text.count("ValueError: bad batch on rank 1") == 1
    assert "rank 0 was waiting in" in run.error_text
    assert nb.run("%%ranks\nx = torch.ones(2)\nmpilab.allreduce(x)\nassert x[0] == 2").ok


def test_hang_diagnosed_after_hang_timeout_and_released(nb):
    run, took = timed(nb, "%%ranks --hang-timeout 3\nx = torch.ones(3)\n"
                          "if rank == 0:\n    mpilab.allreduce(x)\nprint('done', rank)")
    assert not run.ok and took < 15
    err = run.error_text
    assert re.search(r"hang: rank 0 was waiting in allreduce #\d+", err), err
    assert "progress: rank 0 at collective #" in err and "rank 1 at collective #" in err
    assert "[rank 1] done 1" in run.stdout
    assert nb.run("%%ranks\nx = torch.ones(2)\nmpilab.allreduce(x)\nassert x[0] == 2").ok


def test_mismatched_collectives_reported_at_once(nb):
    run, took = timed(nb, "%%ranks\nx = torch.ones(3)\nif rank == 0:\n    mpilab.allreduce(x)\n"
                          "else:\n    mpilab.broadcast(x)")
    assert not run.ok and took < 10  # long before the 30 s hang timeout
    assert re.search(r"mismatched collectives: rank 0 in allreduce #(\d+) .*rank 1 in "
                     r"broadcast #\1", run.error_text), run.error_text
    assert nb.run("%%ranks\nx = torch.ones(2)\nmpilab.allreduce(x)\nassert x[0] == 2").ok


def test_interrupt_inside_collective_reaches_every_rank_within_3s(nb):
    assert nb.run("%%ranks\nmarker = 41 + 1").ok
    run = nb.run("%%ranks\nx = torch.ones(3)\nif rank == 0:\n    mpilab.allreduce(x)\n"
                 "else:\n    time.sleep(60)", interrupt_after=2, timeout=30)
    assert not run.ok
    assert run.finished - run.started < 2 + 3 + 1.5
    assert "[rank 0] interrupted" in run.error_text and "[rank 1] interrupted" in run.error_text
    run = nb.run("%%ranks\nx = torch.ones(2)\nmpilab.allreduce(x)\nprint(x.tolist(), marker)")
    assert "[ranks 0-1] [2.0, 2.0] 42" in run.stdout, run.text


def test_output_flood_is_capped_and_does_not_block(nb):
    run, took = timed(nb, "%%ranks 0\nimport sys\nline = 'x' * 99 + '\\n'\n"
                          "for _ in range(100_000):\n    sys.stdout.write(line)\nprint('end')",
                      timeout=120)
    assert run.ok, run.error_text
    assert "output cut at" in run.stderr and "more characters were dropped" in run.stderr
    assert len(run.stdout) <= 4_100_000
    assert nb.run("%%ranks\nprint('after flood')").ok


def test_soak_300_cells_memory_bounded(nb):
    kernel_proc = psutil.Process(nb.km.provisioner.process.pid)
    engines = [psutil.Process(p) for p in cluster_pids(nb)["engines"]]
    for _ in range(20):
        assert nb.run("%%ranks\ny = rank + 1").ok
    before = [kernel_proc.memory_info().rss] + [e.memory_info().rss for e in engines]
    for i in range(300):
        run = nb.run(f"%%ranks\ny = rank + {i}\nprint(y)")
        assert run.ok, run.text
    after = [kernel_proc.memory_info().rss] + [e.memory_info().rss for e in engines]
    growth_mb = [(a - b) / 2**20 for a, b in zip(after, before)]
    # bound: 64 MiB per process over 300 cells (each cell keeps ~a few KiB of history)
    assert all(g < 64 for g in growth_mb), growth_mb


def test_the_ranks_recover_as_often_as_their_cells_are_stopped(nb):
    """A stopped cell whose ranks were in a collective makes mpilab's communicators
    again on every rank (the recovery); the replaced ones were never freed, and after
    some 220 stops MPI had none left ("Too many communicators"): the ranks were
    restarted, their state lost. 2,000 recoveries, the stop button's own, with a
    DataParallel model whose communication thread recovers too; then it trains and the
    collectives work, with the state kept. And one replaced with a collective left half
    done on it (freed plainly, its plan's free waited in MPI for good: a hang)."""
    many = ("from mpilab.rank import waiting\n"
            "model = mpilab.DataParallel(torch.nn.Linear(4, 1))\n"
            "model(torch.ones(2, 4)).sum().backward()\n"
            "for _ in range(2000):\n"
            "    waiting.recover()\n"
            "model(torch.ones(2, 4)).sum().backward()\n")
    # a communicator replaced with a collective that a stopped rank left half done, as
    # recovery finds them, is freed by the next recovery without waiting in it
    half_done = ("from mpi4py import MPI\n"
                 "from mpilab.rank import collectives, waiting\n"
                 "if rank == 0:  # rank 1 never joins it\n"
                 "    pending = collectives.private_comm().Iallreduce(\n"
                 "        MPI.IN_PLACE, np.ones(4), MPI.SUM)\n"
                 "waiting.recover()\n"
                 "waiting.recover()\n")
    for cell in (many, half_done):
        run = nb.run("%%ranks\n" + cell + "print('after', mpilab.allreduce(torch.ones(1)).item())",
                     timeout=300)
        assert run.ok and "[ranks 0-1] after 2.0" in run.stdout, run.text


def test_blocking_torch_collective_restarts_with_plain_message(nb, tmp_path):
    run, took = timed(nb, "%%ranks\nt = torch.ones(3)\nif rank == 1:\n"
                          "    raise RuntimeError('gone')\ndist.all_reduce(t)", timeout=180)
    assert not run.ok and took < 60
    err = run.error_text
    assert "RuntimeError: gone" in err
    assert "rank 0 was at cell line 4: dist.all_reduce(t)" in err
    assert "restarted the ranks: their state was lost; no checkpoint was saved" in err
    run = nb.run("%%ranks\nimport torch\nx = torch.ones(2)\nmpilab.allreduce(x)\nx.tolist()")
    assert run.ok and "[2.0, 2.0]" in run.text

    # once one is saved, every later restart names it: the state to go back to
    path = (tmp_path / "ckpt.pt").resolve()
    assert nb.run(f"%%ranks\nmpilab.save_checkpoint({str(path)!r}, torch.nn.Linear(2, 2))").ok
    for _ in range(2):
        run, _ = timed(nb, "%%ranks\nimport torch\nt = torch.ones(3)\nif rank == 1:\n"
                           "    raise RuntimeError('gone again')\ndist.all_reduce(t)",
                       timeout=180)
        assert not run.ok
        assert f"their state was lost; the last checkpoint saved was {path} at " \
            in run.error_text


def test_direct_mpi_collective_hang_diagnosed_and_restarted(nb):
    """comm.Allreduce on one rank only: mpilab cannot see into the call, but the rank
    sits on that line while its peer has finished the cell."""
    run, took = timed(nb, "%%ranks --hang-timeout 3\nimport numpy as np\nfrom mpi4py import MPI"
                          "\nx = np.ones(3)\nif rank == 0:\n"
                          "    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)\nprint('done', rank)",
                      timeout=180)
    assert not run.ok and took < 60
    err = run.error_text
    assert re.search(r"hang: rank 0 has been at cell line 5: comm\.Allreduce\(MPI\.IN_PLACE, "
                     r"x, op=MPI\.SUM\) for \d+\.\d s, and rank 1 finished the cell without "
                     r"joining it", err), err
    assert "restarted the ranks: their state was lost" in err
    assert "[rank 1] done 1" in run.stdout
    # the restart lost the module's imports: back for the tests after this one
    assert nb.run("%%ranks\nimport torch, numpy as np, os, time\nx = torch.ones(2)\n"
                  "mpilab.allreduce(x)\nassert x[0] == 2").ok


def test_a_collective_run_on_some_ranks_only_is_diagnosed_not_left_hanging(nb):
    """`%%ranks 0` with a collective: rank 1 runs no cell and never joins. mpilab's own
    collective is released after the hang timeout; a torch.distributed call (which
    mpilab cannot see into or interrupt) is diagnosed too and the ranks restarted. It
    waited for ever."""
    run, took = timed(nb, "%%ranks 0 --hang-timeout 3\nx = torch.ones(3)\nmpilab.allreduce(x)")
    assert not run.ok and took < 15, took
    err = run.error_text
    assert re.search(r"hang: rank 0 was waiting in allreduce #\d+", err), err
    assert ("rank 1 is not running this cell, and a collective waits for every rank: run it "
            "on all of them (`%%ranks`)") in err, err
    assert nb.run("%%ranks\nx = torch.ones(2)\nmpilab.allreduce(x)\nassert x[0] == 2").ok
    # at the default hang timeout (30 s): the notebook waits on this cell, so nothing will
    # start a cell on rank 1; the verdict comes at once, and the ranks keep their state
    run, took = timed(nb, "%%ranks 0\nx = torch.ones(3)\nmpilab.allreduce(x)\nprint('never')")
    assert not run.ok and took < 8, took
    assert "rank 1 is not running this cell" in run.error_text, run.error_text
    assert "never" not in run.stdout and "restarted" not in run.text, run.text
    # a --noblock cell's collective may have its other half in a later cell
    half = nb.run("%%ranks 0 --noblock\nx = torch.ones(3)\nmpilab.allreduce(x)\n"
                  "print('half', x.tolist())")
    assert half.ok, half.text
    time.sleep(2)  # past the wait for ranks that run no cell
    other = nb.run("%%ranks 1\nx = torch.ones(3)\nmpilab.allreduce(x)\n"
                   "print('other', x.tolist())")
    assert other.ok and "other [2.0, 2.0, 2.0]" in other.stdout, other.text
    late = stream_text(nb.collect_iopub(1.0), half.msg_id)
    assert "half [2.0, 2.0, 2.0]" in late, late
    run, took = timed(nb, "%%ranks 1 --hang-timeout 3\nt = torch.ones(3)\ndist.all_reduce(t)",
                      timeout=180)
    assert not run.ok and took < 60, took
    err = run.error_text
    assert re.search(r"hang: rank 1 has been at cell line 2: dist\.all_reduce\(t\) for "
                     r"\d+\.\d s\n", err + "\n"), err
    assert "rank 0 is not running this cell" in err and "restarted the ranks" in err, err
    assert nb.run("%%ranks\nimport torch, numpy as np, os, time\nx = torch.ones(2)\n"
                  "mpilab.allreduce(x)\nassert x[0] == 2").ok


def test_dead_rank_reported_with_signal_and_last_lines_then_restart(nb):
    pid1 = cluster_pids(nb)["engines"][1]
    run, took = timed(nb, "%%ranks\nimport os, time\nprint('last words', rank, flush=True)\n"
                          "time.sleep(1)\nif rank == 1:\n    os.kill(os.getpid(), 9)\n"
                          "time.sleep(60)")
    assert not run.ok and took < 10
    err = run.error_text
    assert re.search(rf"rank 1 \(pid {pid1} on \S+\) died: killed by signal 9", err), err
    assert "last lines from rank 1:" in err and "last words 1" in err
    status = nb.run("%mpilab status")
    assert "dead" in status.text
    blocked = nb.run("%%ranks\n1")
    assert not blocked.ok and "`%mpilab restart`" in blocked.text
    assert len(blocked.text.strip().splitlines()) == 1
    # pull and push say the same (ipyparallel's own line advised client.wait_for_engines)
    for line in ("%mpilab pull x", "x = 1\n%mpilab push x"):
        blocked = nb.run(line)
        assert not blocked.ok and "rank 1 died" in blocked.text and \
            "`%mpilab restart`" in blocked.text, blocked.text
        assert len(blocked.text.strip().splitlines()) == 1, blocked.text
    restart = nb.run("%mpilab restart", timeout=180)
    assert restart.ok and "2 ranks" in restart.text
    assert nb.run("%%ranks\nimport os\nassert rank in (0, 1)").ok


def test_rank_exit_code_reported(nb):
    # --quiet relays no output, yet the report still shows the dead rank's last lines
    run, _ = timed(nb, "%%ranks --quiet\nimport os, time\nprint('quiet words', rank, flush=True)"
                       "\ntime.sleep(0.5)\nif rank == 0:\n    os._exit(3)\ntime.sleep(60)")
    assert not run.ok
    assert re.search(r"rank 0 \(pid \d+ on \S+\) died: exited with code 3", run.error_text), \
        run.error_text
    assert "quiet words" not in run.stdout
    assert "last lines from rank 0:" in run.error_text and "quiet words 0" in run.error_text
    assert nb.run("%mpilab restart", timeout=180).ok


def test_a_batch_script_whose_rank_raises_ends_every_rank_at_once():
    """`mpiexec -n 3 python train.py` with `mpilab.init()`: rank 1 raises (with a gloo
    collective of its own in flight) while ranks 0 and 2 wait for it, in mpilab's
    allreduce and in torch's. The job ends at once with the traceback and one line saying
    why every rank ended; it hung until killed (rank 1 waited in MPI's finalization for
    ranks that waited for it)."""
    started = time.monotonic()
    results, job = run_ranks("""
import time, torch
import torch.distributed as dist
if ctx.rank == 1:
    pending = dist.all_reduce(torch.ones(8), async_op=True)
    raise RuntimeError("rank 1 cannot go on")
t = torch.ones(8)
if ctx.rank == 0:
    mpilab.allreduce(t)
else:
    dist.all_reduce(t)
report("got through")
""", n=3, timeout=120, check=False)
    took = time.monotonic() - started
    assert job.returncode == 1, (job.returncode, job.stderr[-3000:])
    assert results == [None, None, None]
    assert "RuntimeError: rank 1 cannot go on" in job.stderr
    assert "mpilab: rank 1 ended with RuntimeError: ending all 3 ranks" in job.stderr
    assert took < 60, took  # mostly three torch imports on two cores


def test_a_batch_script_rank_that_ends_while_another_waits_for_it_is_named():
    """`if rank == 0: mpilab.allreduce(loss)` at the end of a script: rank 1 ended, rank 0
    waited in the allreduce and rank 1 in MPI's finalization, for good. The job ends
    within seconds, naming both; a rank that only works longer at the end is waited for."""
    results, job = run_ranks("""
import time, torch
loss = torch.ones(1)
mpilab.allreduce(loss)
if ctx.rank == 0:
    time.sleep(2)  # more work on rank 0 alone: rank 1 waits for it
    mpilab.allreduce(loss)  # a collective rank 1 never calls
report("ended")
""", n=2, timeout=120, check=False)
    assert job.returncode == 1, (job.returncode, job.stderr[-3000:])
    assert results[1] == "ended" and results[0] is None
    assert ("mpilab: rank 1 ended the script, but rank 0 waits for it in allreduce #2 "
            "(4 bytes) that rank 1 never began: ending all 2 ranks") in job.stderr, job.stderr


def test_a_batch_script_rank_that_never_reaches_a_collective_is_named_at_the_timeout():
    """A rank stuck before a collective (a deadlock in its own code, a file system that
    hangs) while the others wait in it: they waited for good. Past the collective
    timeout, which torch.distributed's collectives keep too, the job ends naming it."""
    results, job = run_ranks("""
import time, torch
x = mpilab.allreduce(torch.ones(1))
if ctx.rank == 2:
    time.sleep(60)
mpilab.allreduce(x)
report("done")
""", n=3, timeout=120, check=False, init="mpilab.init(collective_timeout=3)")
    assert job.returncode == 1, (job.returncode, job.stderr[-3000:])
    assert results == [None, None, None]
    said = [line for line in job.stderr.splitlines() if line.startswith("mpilab:")]
    assert said == ["mpilab: rank 2 did not reach allreduce #2 (4 bytes) within 3 s, while 2 "
                    "other ranks waited in it (the collective timeout: "
                    "mpilab.init(collective_timeout=…) or $MPILAB_COLLECTIVE_TIMEOUT sets "
                    "it): ending all 3 ranks"], job.stderr


def test_a_batch_script_whose_ranks_wait_seconds_for_a_slow_one_runs_to_its_end():
    """What the script's watch must not take for a hang: ranks that wait seconds in an
    allreduce and in DataParallel's step for a rank that comes late, and one that ends
    first and waits for the others at exit (past the moment its exit shuts its
    torch.distributed connections, which the others used last just before). The job
    ends with status 0 and no line."""
    results, job = run_ranks("""
import time, torch
import torch.distributed as dist
model = mpilab.DataParallel(torch.nn.Linear(4, 1))
for step in range(2):
    if ctx.rank == 2:
        time.sleep(2.5)  # a slow rank: the others wait for it in the step's allreduce
    model(torch.ones(2, 4)).sum().backward()
x = mpilab.allreduce(torch.ones(1))
dist.all_reduce(torch.ones(1 << 16))
if ctx.rank != 0:
    time.sleep(2.5)  # rank 0 ends first and waits for the others at exit
report(x.item())
""", n=3, timeout=120, check=False, init="mpilab.init(collective_timeout=60)")
    assert job.returncode == 0, job.stderr[-3000:]
    assert results == [3.0, 3.0, 3.0]
    assert "mpilab:" not in job.stderr, job.stderr


def test_a_batch_script_whose_torch_collective_a_rank_never_began_is_named():
    """torch's own DDP, with rank 1's data a batch short: under torchrun the ended
    process's connections close and gloo fails the others' wait at once; a rank of
    mpilab's stays alive at exit until every rank has ended, and shuts its connections
    instead. Within seconds, one traceback and one line naming both ranks, status 1."""
    started = time.monotonic()
    _, job = run_ranks("""
import torch
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
for step in range(2 if ctx.rank == 1 else 3):
    model(torch.ones(2, 4)).sum().backward()
""", n=3, timeout=120, check=False)
    assert job.returncode == 1, job.stderr[-3000:]
    assert time.monotonic() - started < 40
    # torch's excepthook starts each line of a failed rank with "[rankN]: "
    said = [re.sub(r"^\[rank\d\]: ", "", line) for line in job.stderr.splitlines()
            if "mpilab:" in line]
    assert len(said) == 1 and re.fullmatch(
        r"mpilab: rank 1 ended the script, but rank [02] waited for it in a "
        r"torch.distributed collective that rank 1 never began: ending all 3 ranks",
        said[0]), job.stderr[-3000:]
    assert job.stderr.count("Traceback") == 1, job.stderr[-3000:]


def test_ctrl_c_on_a_batch_job_is_one_traceback_and_one_line(tmp_path):
    """Ctrl-C in the terminal reaches every process of `mpiexec -n 3 python train.py` at
    once; each rank raised KeyboardInterrupt and printed its traceback and line. One
    rank says it now, the job ends with status 1, and no process is left."""
    import os
    import signal
    import subprocess
    import sys

    from mpirun import MPIEXEC

    script = tmp_path / "train.py"
    script.write_text(
        "import time, torch, mpilab\n"
        "ctx = mpilab.init()\n"
        "mpilab.allreduce(torch.ones(1))\n"
        "print('training', flush=True)\n"
        "while True:\n"
        "    mpilab.allreduce(torch.ones(1000))\n"
        "    time.sleep(0.01)\n")
    job = subprocess.Popen([MPIEXEC, "-n", "3", sys.executable, str(script)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # a terminal's foreground group
    try:
        seen = ""
        while seen.count("training") < 3:  # the ranks' lines may come interleaved
            line = job.stdout.readline()
            assert line, seen
            seen += line
        os.killpg(job.pid, signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 1, stderr[-3000:]
    said = [re.sub(r"^\[rank\d\]: ", "", line) for line in stderr.splitlines()
            if "mpilab:" in line]
    assert len(said) == 1 and re.fullmatch(
        r"mpilab: rank [0-2] was interrupted: ending all 3 ranks", said[0]), stderr
    assert stderr.count("Traceback") == 1 and "KeyboardInterrupt" in stderr, stderr
    left = [p for p in psutil.process_iter()
            if p.pid != os.getpid() and _group_of(p.pid) == job.pid]
    assert not left, left


def _group_of(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_a_batch_script_that_ends_mpi_itself_ends_quietly():
    """`MPI.Finalize()` at the end of a script, as some MPI programs do: the ranks end
    with status 0 and nothing on stderr (mpilab's exit does no MPI call after it)."""
    results, job = run_ranks("""
import torch
from mpi4py import MPI
x = torch.ones(4)
mpilab.allreduce(x)
report(x.tolist())
MPI.Finalize()
""", n=2, timeout=120, check=False)
    assert job.returncode == 0 and job.stderr == "", job.stderr
    assert results == [[2.0] * 4] * 2


def test_a_batch_script_whose_start_cannot_work_says_so_in_one_line():
    """Bad input to mpilab.init() in a script: one line, said once, no traceback through
    mpilab's code from every rank, and the job ends with status 1."""
    _, job = run_ranks("", n=2, timeout=120, check=False, init="mpilab.init(gpus='7')")
    assert job.returncode == 1, (job.returncode, job.stderr[-3000:])
    said = [line for line in job.stderr.splitlines() if "mpilab" in line]
    assert said == ["mpilab.init(): --gpus names GPU 7 but this node has none: use --gpus "
                    "auto or none"], job.stderr
    assert "Traceback" not in job.stderr


def test_security_loopback_private_files_and_no_kill_by_name(nb):
    run = nb.run("from mpilab.session import Session\n_c = Session.instance().cluster\n"
                 "import json, os, stat\n"
                 "files = [f for f in _c.connection_files()]\n"
                 "print(json.dumps({'receiver': _c.receiver_address, 'files': files,"
                 " 'modes': [oct(os.stat(f).st_mode & 0o777) for f in files],"
                 " 'interfaces': [json.load(open(f)).get('interface') for f in files],"
                 " 'launchers': _c.launcher_pids()}))")
    assert run.ok, run.text
    info = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    assert info["receiver"].startswith("tcp://127.0.0.1:")
    assert info["files"] and all(m == "0o600" for m in info["modes"]), info
    assert all(iface == "tcp://127.0.0.1" for iface in info["interfaces"]), info
    controller = psutil.Process(info["launchers"][0])
    listening = [c.laddr.ip for p in [controller, *controller.children(recursive=True)]
                 for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) == {"127.0.0.1"}, listening
    sources = list((ROOT / "kernel_ext").rglob("*.py")) + list((ROOT / "widgets").rglob("*.py"))
    for src in sources:
        text = src.read_text()
        assert "pkill" not in text and "killall" not in text, src

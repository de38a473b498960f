"""Code written for torchrun runs unchanged on mpilab's ranks.

Real kernels and ranks throughout: the tutorial-shaped scripts in tests/torchrun_scripts
are pasted into `%%ranks` cells or run there with `%run`, as a researcher would. The
shared `ranks` cluster serves them; the two failure tests at the end restart its ranks
(a blocking torch.distributed call cannot be released otherwise) and leave it usable.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from listeners import is_hydra, listeners_of
from mpilab.rank import torchrun
from mpirun import MPIEXEC, run_ranks

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "torchrun_scripts"
TRAIN = SCRIPTS / "train.py"
REUSED = "mpilab: init_process_group: the ranks' gloo group is reused"


def tutorial(name: str, keep_main: bool = False) -> str:
    """A tutorial script's text as a user pastes it; without its __main__ block (which
    starts processes with mp.spawn) unless keep_main."""
    text = (SCRIPTS / name).read_text()
    return text if keep_main else text.split('if __name__ == "__main__":')[0]


def json_lines(stdout: str) -> dict[int, dict]:
    """rank -> object from lines '[rank r] {json}' (or '[ranks a-b] {json}')."""
    found = {}
    for m in re.finditer(r"^\[ranks? (\d+)(?:-(\d+))?\] (\{.*\})$", stdout, re.M):
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        for r in range(lo, hi + 1):
            found[r] = json.loads(m.group(3))
    return found


def assert_group_works(ranks) -> None:
    """torch.distributed, mpilab's collectives and DataParallel over torch all work."""
    run = ranks.run("%%ranks\nimport torch\nt = torch.ones(2)\ndist.all_reduce(t)\n"
                    "x = torch.ones(2)\nmpilab.allreduce(x)\n"
                    "m = mpilab.DataParallel(torch.nn.Linear(4, 2), backend='torch')\n"
                    "m(torch.randn(3, 4)).sum().backward()\n"
                    "print(t.tolist(), x.tolist(), dist.is_initialized(), dist.get_backend())")
    assert run.ok, run.text
    assert "[ranks 0-1] [2.0, 2.0] [2.0, 2.0] True gloo" in run.stdout, run.text


# -- pure logic ----------------------------------------------------------------------------


def test_plan_reuses_what_serves_and_replaces_what_differs():
    assert torchrun.plan(None, "gloo", "cpu") == torchrun.Plan("reuse")
    assert torchrun.plan("gloo", "gloo", "cpu") == torchrun.Plan("reuse")
    assert torchrun.plan("GLOO", "gloo", "cpu") == torchrun.Plan("reuse")
    # the cuda half does not matter on CPU ranks
    assert torchrun.plan("cpu:gloo,cuda:nccl", "gloo", "cpu") == torchrun.Plan("reuse")
    # gloo asked on GPU ranks whose group is NCCL: another group is made, as asked (a
    # GPU build of torch has both)
    def gpu_build(name):
        return name in ("gloo", "nccl")

    assert torchrun.plan("gloo", "nccl", "cuda", gpu_build) == torchrun.Plan("replace")
    assert torchrun.plan("cpu:gloo,cuda:nccl", "nccl", "cuda", gpu_build) \
        == torchrun.Plan("replace")
    assert torchrun.plan("nccl", "nccl", "cuda", gpu_build) == torchrun.Plan("reuse")
    assert torchrun.plan("nccl", "gloo", "cuda", gpu_build) == torchrun.Plan("replace")
    # what cannot be honoured says why (this torch is a CPU build)
    nccl = torchrun.plan("nccl", "gloo", "cpu")
    assert nccl.action == "reuse" and nccl.why_not == (
        "NCCL needs a GPU on every rank, and these ranks run on CPU")
    assert torchrun.plan("mpi", "gloo", "cpu").why_not == "this torch has no mpi backend"
    assert torchrun.plan("nccl", "gloo", "cuda", lambda name: name == "gloo").why_not \
        == "this torch has no nccl backend"


def test_spawn_message_names_the_call_to_make_instead():
    def demo_basic(rank, world_size):
        pass

    line = torchrun.spawn_message(demo_basic, (2,), 2, 2)
    assert "\n" not in line
    assert "mp.spawn would start 2 more processes on each of the 2 ranks" in line
    assert "call demo_basic(rank, 2) instead, on every rank" in line


# -- on the shared cluster ---------------------------------------------------------------------


def test_ranks_carry_torchrun_environment(ranks):
    run = ranks.run(
        "%%ranks\nimport json, os\n"
        "keys = ['RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK',\n"
        "        'GROUP_WORLD_SIZE', 'ROLE_RANK', 'MASTER_ADDR', 'MASTER_PORT']\n"
        "env = {k: os.environ[k] for k in keys}\n"
        "env['store'] = list(mpilab.context().store_address)\n"
        "env['local_rank_as_torchrun_code_reads_it'] = int(os.environ['LOCAL_RANK'])\n"
        "print(json.dumps(env))")
    assert run.ok, run.text
    env = json_lines(run.stdout)
    assert set(env) == {0, 1}, run.text
    for r in (0, 1):
        e = env[r]
        assert (e["RANK"], e["LOCAL_RANK"], e["ROLE_RANK"]) == (str(r),) * 3
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) == ("0", "1")  # one host
        assert e["local_rank_as_torchrun_code_reads_it"] == r
        # MASTER_ADDR/PORT name the store of the group mpilab set up: on loopback here
        assert [e["MASTER_ADDR"], int(e["MASTER_PORT"])] == e["store"]
        assert e["MASTER_ADDR"] == "127.0.0.1"


def test_ddp_tutorial_runs_unchanged_and_again(ranks):
    """The tutorial's setup() (MASTER_PORT=12355, init_process_group("gloo", rank=…,
    world_size=…)), a DDP step and cleanup() (destroy_process_group), twice."""
    cell = "%%ranks\n" + tutorial("ddp_basic.py") + "\ndemo_basic(rank, world_size)\n"
    for _ in range(2):
        run = ranks.run(cell)
        assert run.ok, run.text
        assert "initialize the default process group twice" not in run.text
        assert run.text.count(REUSED) == 1, run.text  # once per cell, for both ranks
        assert f"[ranks 0-1] {REUSED} (ranks 0-1; mpilab set it up)" in run.stderr
        for r in (0, 1):
            assert f"rank {r}: one DDP step done, weights equal to rank 0's: True" in run.stdout
            assert f"Finished running basic DDP example on rank {r}." in run.stdout
    # the user's MASTER_PORT opened nothing: every rank still listens on loopback only,
    # and nobody on 12355
    found = [x for x in listeners_of(ranks.km.provisioner.process.pid)  # the engines'
             if "mpilab.rank." in x.command and not is_hydra(x)]
    assert found and all(x.ip == "127.0.0.1" for x in found), found
    assert all(x.port != 12355 for x in found), found
    # destroy_process_group() left the next cell a working group, mpilab's included
    assert_group_works(ranks)


def test_mp_spawn_gets_one_line_saying_what_to_do(ranks):
    # the whole tutorial pasted, __main__ block included (a cell's __name__ is __main__)
    run = ranks.run("%%ranks\n" + tutorial("ddp_basic.py", keep_main=True))
    assert not run.ok
    err = run.error_text
    assert err.count("mp.spawn would start 2 more processes on each of the 2 ranks") == 1, err
    assert "[ranks 0-1] failed:" in err
    assert "call demo_basic(rank, 2) instead, on every rank" in err
    # nothing was started
    assert "Running basic DDP example" not in run.stdout


def test_checkpoint_tutorial_saves_on_rank0_and_loads_with_map_location(ranks, tmp_path):
    run = ranks.run("%%ranks\n" + tutorial("ddp_checkpoint.py")
                    + f"\ndemo_checkpoint(rank, world_size, {str(tmp_path)!r})\n")
    assert run.ok, run.text
    for r in (0, 1):
        assert f"rank {r}: loaded rank 0's checkpoint: True" in run.stdout, run.text
        assert f"Finished running DDP checkpoint example on rank {r}." in run.stdout
    assert not (tmp_path / "model.checkpoint").exists()  # rank 0 removed it


def test_run_script_with_argparse_sampler_and_set_epoch(ranks):
    run = ranks.run(f"%%ranks\n%run {TRAIN} --epochs 2 --samples 256\n"
                    "import sys\nprint('after:', __name__, sys.argv[0].endswith('train.py'),"
                    " callable(make_dataset))")
    assert run.ok, run.text
    epochs = re.findall(r"\[rank 0\] epoch (\d): loss [\d.]+, every sample once: True, "
                        r"first samples (\[[\d, ]+\])", run.stdout)
    assert [e for e, _ in epochs] == ["0", "1"], run.text
    assert epochs[0][1] != epochs[1][1]  # set_epoch: another order in epoch 1
    # %run restores the notebook's names and argv, and leaves the script's globals
    after = re.findall(r"^\[ranks? ([\d-]+)\] after: (.*)$", run.stdout, re.M)
    assert after and {line for _, line in after} == {"__main__ False True"}, run.text
    assert run.text.count(REUSED) == 1
    assert_group_works(ranks)


def test_run_script_bad_arguments_fail_the_cell_with_argparse_message(ranks):
    run = ranks.run(f"%%ranks\n%run {TRAIN} --epochs 1 --bogus")
    assert not run.ok
    assert "[ranks 0-1] train.py: error: unrecognized arguments: --bogus" in run.stderr
    assert run.error_text.count("train.py exited with status 2") == 1, run.error_text
    assert "To exit: use" not in run.text


def test_a_script_exiting_with_a_message_fails_the_cell_with_it(ranks, tmp_path):
    script = tmp_path / "prepare.py"
    script.write_text("import sys\nsys.exit('no data in /data/train')\n")
    run = ranks.run(f"%%ranks\n%run {script}")
    assert not run.ok
    assert run.error_text.count("prepare.py exited with status 1: no data in /data/train") \
        == 1, run.error_text


def test_init_process_group_variants(ranks):
    run = ranks.run(
        "%%ranks\nimport torch\nimport torch.distributed as dist\n"
        "dist.init_process_group(backend='nccl')\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:23456', rank=rank,"
        " world_size=world_size)\n"
        "sub = dist.new_group([0, 1])\n"
        "dist.destroy_process_group()\n"
        "try:\n    dist.get_backend(sub)\nexcept ValueError as e:\n"
        "    print('subgroup gone:', type(e).__name__)\n"
        "try:\n    dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "except ValueError as e:\n    print('mismatch:', e)\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())")
    assert run.ok, run.text
    assert ("[ranks 0-1] mpilab: init_process_group('nccl'): NCCL needs a GPU on every rank, "
            "and these ranks run on CPU; the ranks' gloo group serves instead") in run.stderr
    assert run.text.count(REUSED) == 1, run.text
    assert "[ranks 0-1] subgroup gone: ValueError" in run.stdout, run.text
    assert re.search(r"\[rank 0\] mismatch: init_process_group\(rank=0, world_size=1\) does "
                     r"not match these ranks \(this is rank 0 of 2\)", run.stdout), run.text
    assert "[ranks 0-1] sum 2.0" in run.stdout


# -- batch mode: mpilab.init() in a script under mpiexec ------------------------------------------


def test_batch_script_gets_the_same_environment_and_group_handling():
    results = run_ranks("""
import os, torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
dist.init_process_group("gloo")
u = torch.ones(1)
dist.all_reduce(u)
report({"env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                            "MASTER_ADDR", "MASTER_PORT")},
        "store": list(ctx.store_address), "sums": [t.item(), u.item()]})
""")
    for r, got in enumerate(results):
        assert got["env"]["RANK"] == got["env"]["LOCAL_RANK"] == str(r)
        assert got["env"]["WORLD_SIZE"] == "2"
        assert [got["env"]["MASTER_ADDR"], int(got["env"]["MASTER_PORT"])] == got["store"]
        assert got["sums"] == [2.0, 2.0]


def test_group_destroyed_past_mpilab_is_made_again_over_its_store():
    """A default group destroyed by torch's own function (not the one the ranks are
    given): the next init_process_group makes the ranks' group again over mpilab's store,
    and the address the script names opens no listener."""
    results = run_ranks("""
import inspect, os, psutil, torch
import torch.distributed as dist
inspect.unwrap(dist.destroy_process_group)()
gone = not dist.is_initialized()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", rank=ctx.rank,
                        world_size=ctx.world_size)
t = torch.ones(1)
dist.all_reduce(t)
x = torch.ones(1)
mpilab.allreduce(x, backend="torch")
ports = [c.laddr.port for c in psutil.Process().net_connections("inet")
         if c.status == psutil.CONN_LISTEN]
dist.destroy_process_group()
report({"gone": gone, "sums": [t.item(), x.item()], "listens_29531": 29531 in ports,
        "after_destroy": dist.is_initialized()})
""")
    for got in results:
        assert got == {"gone": True, "sums": [2.0, 2.0], "listens_29531": False,
                       "after_destroy": True}, got


def test_another_backend_stands_in_and_destroy_brings_mpilabs_back():
    """The path a GPU cluster takes when a script asks gloo where mpilab chose NCCL: on
    this CPU machine the plan is told that gloo differs, so the stand-in group, its
    collectives and its retirement run for real."""
    results = run_ranks("""
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from mpilab.rank import torchrun
mine = c10d._get_default_group()
torchrun.plan = lambda requested, current, device: torchrun.Plan("replace")
dist.init_process_group("gloo")
stand_in = c10d._get_default_group()
t = torch.ones(1)
dist.all_reduce(t)
x = torch.ones(1)
mpilab.allreduce(x, backend="torch")
dist.destroy_process_group()
back = c10d._get_default_group()
u = torch.ones(1)
dist.all_reduce(u)
report({"replaced": stand_in is not mine, "restored": back is mine,
        "stand_in_gone": stand_in not in c10d._world.pg_map,
        "sums": [t.item(), x.item(), u.item()]})
""")
    for got in results:
        assert got == {"replaced": True, "restored": True, "stand_in_gone": True,
                       "sums": [2.0, 2.0, 2.0]}, got


END_AFTER_GLOO = """
import atexit, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out = sys.argv[1]


def after_mpilab():  # registered before mpilab.init, so it runs after mpilab's exit
    with open(os.path.join(out, str(ctx.rank)), "w") as f:
        f.write(str(dist.is_initialized()))


atexit.register(after_mpilab)
import mpilab  # noqa: E402

ctx = mpilab.init()
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(64, 8))  # holds the group to the end, in the globals
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    optimizer.zero_grad()
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
t = torch.ones(1 << 16)
for _ in range(20):
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_a_torchrun_script_runs_unchanged_as_a_batch_job_with_mpilab_launch(tmp_path):
    """`torchrun --nproc-per-node 2 train.py --epochs 2` as `mpiexec -n 2 python -m
    mpilab.launch train.py --epochs 2`, from another folder: the script's own argv and
    env:// rendezvous, every sample once an epoch, mpilab's note said once for the job.
    A rank that fails ends the job with the script's frames only; a torchrun option in
    the script's place is one line."""
    def launch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpilab.launch",
                               *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=180)

    ran = launch(str(TRAIN), "--epochs", "2")
    assert ran.returncode == 0, ran.stderr[-3000:]
    for epoch in (0, 1):
        assert f"epoch {epoch}: loss " in ran.stdout and ran.stdout.count(
            "every sample once: True") == 2, ran.stdout
    assert ran.stderr.count(REUSED) == 1, ran.stderr
    failed = launch(str(TRAIN), "--fail-rank", "1")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "RuntimeError: rank 1 failed in backward" in failed.stderr
    assert "mpilab: rank 1 ended with RuntimeError: ending all 2 ranks" in failed.stderr
    assert 'train.py", line' in failed.stderr, failed.stderr
    assert "runpy" not in failed.stderr and "kernel_ext" not in failed.stderr, failed.stderr
    wrong = launch("--nproc-per-node", "2", str(TRAIN))
    assert wrong.returncode == 2 and wrong.stderr.splitlines() == [
        "mpilab.launch: --nproc-per-node is an option, not a script: usage: mpiexec -n N "
        "python -m mpilab.launch SCRIPT [ARGUMENTS …] (mpiexec's -n sets how many ranks run "
        "it, as torchrun's --nproc-per-node did)"], wrong.stderr


def test_a_batch_job_ends_cleanly_right_after_gloo_collectives(tmp_path):
    """A script that trains with DDP over gloo and ends, as torchrun scripts do, exits
    0 on every rank. Ending the interpreter while a gloo worker still held a finished
    collective's tensors aborted about half such jobs ("terminate called without an
    active exception"; mpiexec reported the job failed), torch's own scripts too, and
    mpilab kept its group through the script's destroy_process_group; mpilab now ends
    the group at exit, before MPI is finalized. Four jobs: one in two failed before."""
    script = tmp_path / "train_and_end.py"
    script.write_text(END_AFTER_GLOO)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    for attempt in range(4):
        out = tmp_path / f"job{attempt}"
        out.mkdir()
        job = subprocess.run([mpiexec, "-n", "3", sys.executable, str(script), str(out)],
                             capture_output=True, text=True, timeout=180)
        assert job.returncode == 0 and "terminate called" not in job.stderr, (
            f"job {attempt}: rc {job.returncode}\n{job.stdout[-2000:]}\n{job.stderr[-3000:]}")
        # mpilab's group was destroyed at exit, on every rank
        assert {p.name: p.read_text() for p in out.iterdir()} == {
            "0": "False", "1": "False", "2": "False"}


# -- the example notebook ---------------------------------------------------------------------


def test_torchrun_notebook_runs(tmp_path):
    out, html = tmp_path / "05.ipynb", tmp_path / "05.html"
    mpilab = str(Path(sys.executable).parent / "mpilab")
    proc = subprocess.run([mpilab, "run", str(ROOT / "notebooks" / "05_torchrun.ipynb"),
                           "-o", str(out), "--html", str(html)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    text = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert REUSED in text
    # the script ran twice through %run, then the same model under mpilab.DataParallel
    finals = re.findall(r"\[rank 0\] epoch 2: loss [\d.]+, train accuracy ([\d.]+)", text)
    assert len(finals) == 2, text[-3000:]
    assert all(float(a) > 0.9 for a in finals), finals
    assert "mpilab dashboard: 2 ranks" in text


# -- failures (these restart the shared cluster's ranks; keep them last) ------------------------


def test_rank_raising_in_ddp_backward_of_a_script_restarts_with_the_promised_message(ranks):
    start = time.monotonic()
    run = ranks.run(f"%%ranks\n%run {TRAIN} --epochs 1 --fail-rank 1", timeout=180)
    took = time.monotonic() - start
    assert not run.ok
    assert took < 60, took  # the bound of README's direct torch collective row
    err = run.error_text
    assert err.count("RuntimeError: rank 1 failed in backward") == 1, err
    assert 'train.py", line' in err and "kernel_ext" not in err
    assert re.search(r"rank 0 was at train\.py line \d+: loss\.backward\(\) when rank 1 "
                     r"failed", err), err
    assert "restarted the ranks: their state was lost" in err
    assert_group_works(ranks)


def test_script_hang_in_a_direct_collective_is_diagnosed(ranks):
    run = ranks.run(f"%%ranks --hang-timeout 3\n%run {TRAIN} --epochs 1 --samples 128 "
                    "--hang-rank 0", timeout=180)
    assert not run.ok
    err = run.error_text
    assert re.search(r"hang: rank 0 has been at train\.py line \d+: dist\.all_reduce\(total\) "
                     r"for \d+\.\d s, and rank 1 finished the cell without joining it", err), err
    assert "restarted the ranks: their state was lost" in err
    assert_group_works(ranks)


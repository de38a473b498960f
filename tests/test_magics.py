"""The %mpilab / %%ranks surface on a real 2-rank cluster (one cluster for the module)."""

from __future__ import annotations

import csv
import json
import os
import re
import stat
import threading
import time

import psutil
import pytest
from conftest import cluster_pids
from kernel import stream_text

# -- bad input before any cluster -----------------------------------------------------------
# These run first (the `ranks` fixture starts the cluster later in this module).

@pytest.mark.parametrize("code, message", [
    ("%%ranks\nprint(1)", "no ranks are running: start them with `%mpilab start -n N`"),
    ("%mpilab start -n 0", "-n must be a positive number of ranks, got 0"),
    ("%mpilab start --launcher ssh", "not as one MPI job: use --launcher mpi --hostfile FILE"),
    ("%mpilab start -n x", "argument -n: invalid int value: 'x'"),
    ("%mpilab start --bogus", "unrecognized arguments: --bogus"),
    ("%mpilab start -n 2 --launcher slurm --mem 64G", "unrecognized arguments: --mem 64G: pass "
     "sbatch's other options as sbatch spells them, --sbatch-option=--mem=64G"),
    ("%mpilab start --launcher=slurm --exclusive",
     "unrecognized arguments: --exclusive: pass sbatch's other options as sbatch spells them, "
     "--sbatch-option=--exclusive"),
    ("%mpilab frobnicate", "%mpilab has no subcommand 'frobnicate': one of start, stop"),
    ("%mpilab strat -n 2", "%mpilab has no subcommand 'strat' (did you mean start?)"),
    ("%mpilab", "%mpilab needs a subcommand: one of start, stop"),
    ("%mpilab start --gpus banana", "--gpus 'banana' is not auto, none or a list like 0,1"),
    ("%mpilab start --controller-ip 10.9.9.9", "--controller-ip 10.9.9.9: not an address of"),
    ("%mpilab start --controller-ip nonsense", "--controller-ip nonsense: not an IP address"),
    ("%mpilab start --mpiexec /nonexistent/mpiexec",
     "--mpiexec /nonexistent/mpiexec: not an executable mpiexec"),
    ("%mpilab pull x", "no ranks are running"),
    ("%mpilab bench allreduce --sizes 4K", "no ranks are running"),
    ("%mpilab start --launcher slurm --nodes x", "--nodes 'x': give a number of nodes"),
    ("%mpilab restart", "nothing to restart"),
    ("%mpilab start --collective-timeout 0", "--collective-timeout must be positive, got 0.0"),
    ("%mpilab start --partition gpu", "--partition is a Slurm setting: add --launcher slurm"),
    ("%mpilab start --hostfile /nonexistent/hosts", "--hostfile /nonexistent/hosts: no such file"),
    ("%mpilab start --hostfile ~/no-such-hosts",  # as a shell would, ~ is the home folder
     f"--hostfile {os.path.expanduser('~/no-such-hosts')}: no such file"),
    # before any process is made: the OOM killer would pick the processes to end
    ("%mpilab start -n 100000", "-n 100000: 100000 ranks on this host take about 9765.6 GiB "
                                "before any cell runs, and it has "),
])
def test_bad_input_before_start_is_one_line(fresh_kernel, code, message):
    run = fresh_kernel.run(code)
    assert not run.ok
    assert message in run.text
    _assert_one_line_error(run)


def _assert_one_line_error(run):
    text = run.text.strip()
    assert "Traceback" not in text and "kernel_ext" not in text, text
    assert len(text.splitlines()) == 1, text


def test_engines_that_fail_to_start_show_their_output_and_leave_nothing(fresh_kernel, tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'engine: cannot attach to the fabric' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run = fresh_kernel.run(f"%mpilab start -n 2 --mpiexec {fake} --timeout 20", timeout=60)
    assert not run.ok
    assert "the ranks did not start" in run.text
    assert "cannot attach to the fabric" in run.text
    assert "Traceback" not in run.text
    kernel_pid = fresh_kernel.km.provisioner.process.pid
    left = [p for p in psutil.Process(kernel_pid).children(recursive=True)]
    assert left == [] or all(p.pid in before for p in left), left


def test_a_start_stopped_with_the_stop_button_says_so_in_one_line_and_leaves_nothing(
        fresh_kernel):
    try:
        run = fresh_kernel.run("%mpilab start -n 2", timeout=120, interrupt_after=1.0)
        assert not run.ok
        assert run.text.strip() == ("UsageError: %mpilab start interrupted: no ranks are "
                                    "running (nothing was left behind)"), run.text
        kernel = psutil.Process(fresh_kernel.km.provisioner.process.pid)
        deadline = time.monotonic() + 10
        while kernel.children(recursive=True) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert kernel.children(recursive=True) == []
        again = fresh_kernel.run("%mpilab start -n 2", timeout=120)
        assert again.ok, again.text
    finally:
        fresh_kernel.run("%mpilab stop", timeout=120)  # the kernel is shared: no ranks


def test_ranks_that_fail_their_bootstrap_say_why_in_one_line_and_leave_nothing(fresh_kernel):
    """Real ranks asked for what they lack (nccl without GPUs) fail their bootstrap
    together, at once, rather than hang in the rendezvous."""
    kernel_pid = fresh_kernel.km.provisioner.process.pid
    before = {p.pid for p in psutil.Process(kernel_pid).children(recursive=True)}
    run = fresh_kernel.run("%mpilab start -n 2 --gpus none --backend nccl", timeout=120)
    assert not run.ok
    assert "backend nccl needs GPUs; use --backend gloo on CPU ranks" in run.text
    _assert_one_line_error(run)
    left = psutil.Process(kernel_pid).children(recursive=True)
    assert all(p.pid in before for p in left), left


# -- the running cluster -------------------------------------------------------------------

def test_allreduce_through_dist_and_comm(ranks):
    run = ranks.run(
        "%%ranks\nimport torch\nt = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\n"
        "print('dist', t.tolist())\nprint('comm', comm.allreduce(rank + 1))"
    )
    assert run.ok, run.text
    assert "[ranks 0-1] dist [3.0, 3.0, 3.0]" in run.stdout
    assert "[ranks 0-1] comm 3" in run.stdout


def test_names_are_injected(ranks):
    run = ranks.run("%%ranks\n(rank, world_size, local_rank, str(device), "
                    "comm.Get_size(), dist.get_world_size(), mpilab.__name__)")
    assert run.ok, run.text
    assert "Out[rank 0]: (0, 2, 0, 'cpu', 2, 2, 'mpilab')" in run.text
    assert "Out[rank 1]: (1, 2, 1, 'cpu', 2, 2, 'mpilab')" in run.text


def test_output_streams_live(ranks):
    run = ranks.run("%%ranks\nimport time\nfor i in range(3):\n"
                    "    print('tick', i, flush=True)\n    time.sleep(1)")
    assert run.ok, run.text
    arrivals = [o["t"] for o in run.outputs if o["type"] == "stream" and "tick" in
                o["content"]["text"]]
    assert len(arrivals) >= 3, run.outputs
    # the first tick arrives while the cell still has ~2 s to run
    assert run.finished - arrivals[0] > 1.5
    assert "[ranks 0-1] tick 0" in run.stdout and "[ranks 0-1] tick 2" in run.stdout


def test_identical_output_shown_once_different_output_per_rank(ranks):
    run = ranks.run("%%ranks\nprint('same')\nprint('mine', rank)")
    assert run.ok
    assert run.stdout.count("same") == 1
    assert "[ranks 0-1] same" in run.stdout
    assert "[rank 0] mine 0" in run.stdout and "[rank 1] mine 1" in run.stdout


def test_a_line_redrawn_in_place_shows_its_last_state_on_each_rank(ranks):
    """A progress bar written with carriage returns (tqdm's text bar, on stderr): each
    rank's line as the notebook would show it alone, its last state, however its
    redraws were cut into chunks; before, ipyparallel's rewriting of the stream it keeps
    left fragments of the first and the last redraws, spliced."""
    run = ranks.run("%%ranks\nimport sys, time\nfor i in range(6):\n"
                    "    sys.stderr.write(f'\\rtrain {i}/5 ' + '#' * i); sys.stderr.flush()\n"
                    "    time.sleep(0.12)\nsys.stderr.write('\\n')\nprint('after', rank)")
    assert run.ok, run.text
    assert "\r" not in run.stderr, repr(run.stderr)
    lines = run.stderr.splitlines()
    assert lines and all(line.endswith("] train 5/5 #####") for line in lines), lines
    assert lines in (["[ranks 0-1] train 5/5 #####"],
                     ["[rank 0] train 5/5 #####", "[rank 1] train 5/5 #####"],
                     ["[rank 1] train 5/5 #####", "[rank 0] train 5/5 #####"]), lines
    assert "[rank 0] after 0" in run.stdout and "[rank 1] after 1" in run.stdout


def test_a_text_progress_bar_on_the_ranks_is_followed_live_under_the_cell(ranks):
    """tqdm's text bar (`from tqdm import tqdm`) redraws one line with carriage returns
    and ends it when its loop ends, so the merged output showed nothing until then.
    While it runs each rank's bar is redrawn in one block under the output, which is
    emptied when the bars end and their last state is in the output."""
    run = ranks.run("%%ranks\nfrom tqdm import tqdm\nimport time\n"
                    "for i in tqdm(range(20), desc='train'):\n    time.sleep(0.1)")
    assert run.ok, run.text
    blocks = [(d["transient"]["display_id"], d["data"].get("text/plain", ""))
              for d in run.displays() if (d.get("transient") or {}).get("display_id")]
    moving = [text for _, text in blocks if "train:" in text]
    assert len(set(moving)) >= 2, blocks  # redrawn while it ran
    assert len({block for block, _ in blocks}) == 1, blocks  # in one place
    assert all("/20 [" in text and "20/20" not in text for text in moving), moving
    assert all(("[rank 0]" in text and "[rank 1]" in text) or "[ranks 0-1]" in text
               for text in moving), moving
    assert blocks[-1][1] == "", blocks  # emptied at the end
    lines = run.stderr.splitlines()
    assert len(lines) in (1, 2) and all("train: 100%" in line and "20/20" in line
                                        for line in lines), lines


def test_a_warning_from_a_cell_line_names_the_cell_once_for_all_ranks(ranks):
    """Warnings name the cell as tracebacks do; by the engine's temporary file, whose
    name holds its pid, the same warning was shown once per rank."""
    run = ranks.run("%%ranks\nimport warnings\nwarnings.warn('careful')")
    assert run.ok, run.text
    assert re.fullmatch(r"\[ranks 0-1\] Cell In\[\d+\], line 2: UserWarning: careful\n"
                        r"\[ranks 0-1\]   warnings.warn\('careful'\)\n", run.stderr), run.stderr


def test_a_tensor_printed_on_each_rank_keeps_its_rows_together(ranks):
    run = ranks.run("%%ranks\nimport torch\nprint(torch.full((3, 2), float(rank)))\n"
                    "print('next')")
    assert run.ok, run.text
    rows = ["tensor([[{0}., {0}.],", "        [{0}., {0}.],", "        [{0}., {0}.]])"]
    assert run.stdout == "".join(f"[rank {r}] {row.format(r)}\n" for r in (0, 1)
                                 for row in rows) + "[ranks 0-1] next\n", run.stdout


def test_rank_selection(ranks):
    run = ranks.run("%%ranks 1\nprint('hi from', rank)")
    assert run.stdout == "hi from 1\n"
    run = ranks.run("%%ranks 0,1\nprint('x')")
    assert "[ranks 0-1] x" in run.stdout
    run = ranks.run("%%ranks 1-1\nrank")
    assert run.text.strip() == "Out[rank 1]: 1"  # labelled as all-rank values are


@pytest.mark.parametrize("spec, message", [
    ("5", "rank 5 does not exist: the cluster has ranks 0-1"),
    ("a-b", "rank selection 'a-b' is malformed"),
    ("1-0", "rank range '1-0' is backwards"),
])
def test_bad_rank_spec(ranks, spec, message):
    run = ranks.run(f"%%ranks {spec}\nprint(1)")
    assert not run.ok and message in run.text
    _assert_one_line_error(run)


def test_start_while_running(ranks):
    run = ranks.run("%mpilab start -n 2")
    assert not run.ok and "ranks are already running" in run.text
    _assert_one_line_error(run)


def test_error_traceback_once_naming_ranks_without_glue_frames(ranks):
    run = ranks.run("%%ranks\ndef inner():\n    raise ValueError('bad value ' + str(rank > 0))\n"
                    "if rank == 1:\n    inner()\nprint('ok', rank)")
    assert not run.ok
    err = run.error_text
    assert "[rank 1] failed:" in err
    assert err.count("ValueError: bad value True") == 1
    assert "in inner" in err
    for glue in ("ipyparallel", "mpilab", "site-packages", "kernel_ext"):
        assert glue not in err, err
    assert "[rank 0] ok 0" in run.stdout


def test_an_error_mpilab_raises_shows_the_users_line_and_none_of_mpilabs(ranks):
    """mpilab.shard checks its dataset in a dataclass: the generated `__init__` (file
    "<string>") that calls mpilab's check is mpilab's too."""
    run = ranks.run("%%ranks\nimport torch\n"
                    "ds = torch.utils.data.TensorDataset(torch.arange(1.0))\n"
                    "loader = mpilab.shard(ds, batch_size=4)")
    err = run.error_text
    assert "line 3, in <module>" in err and "cannot be sharded over 2 ranks" in err, err
    assert "<string>" not in err and "__init__" not in err, err


def test_a_restart_after_a_refused_start_starts_the_last_settings_again(ranks):
    """A start whose settings were refused is not what `%mpilab restart` starts again."""
    assert ranks.run("%mpilab stop", timeout=120).ok
    refused = ranks.run("%mpilab start -n 2 --launcher slurm --nodes x")
    assert "--nodes 'x': give a number of nodes" in refused.text, refused.text
    run = ranks.run("%mpilab restart", timeout=180)
    assert run.ok and "mpilab: 2 ranks on" in run.stdout, run.text
    # ipyparallel's %%px, bound to the first client only, follows the new ranks too
    px = ranks.run("%%px\nprint(rank)")
    assert px.ok and "[stdout:0] 0" in px.text, px.text


def test_same_error_on_all_ranks_shown_once(ranks):
    run = ranks.run("%%ranks\n1/0")
    assert not run.ok
    assert "[ranks 0-1] failed:" in run.error_text
    assert run.error_text.count("ZeroDivisionError") == 1


def test_an_error_raised_from_another_shows_both_as_python_chains_them(ranks):
    """`raise X from e`, an error while handling another, an exception group: what the
    cause says (here: which file is missing) was dropped, only the last error shown."""
    run = ranks.run("%%ranks\ndef load(path):\n    return open(path).read()\ntry:\n"
                    "    load('/nonexistent/config.yaml')\nexcept OSError as e:\n"
                    "    raise RuntimeError('no config') from e")
    err = run.error_text
    assert not run.ok and not any(glue in err for glue in ("ipyparallel", "mpilab")), err
    cause = err.index("FileNotFoundError: [Errno 2] No such file or directory: "
                      "'/nonexistent/config.yaml'")
    assert err.index("in load") < cause < err.index(
        "The above exception was the direct cause of the following exception:") < \
        err.index("RuntimeError: no config"), err
    run = ranks.run("%%ranks\ntry:\n    1/0\nexcept ZeroDivisionError:\n    undefined_name")
    assert run.error_text.index("ZeroDivisionError") < run.error_text.index(
        "During handling of the above exception") < run.error_text.index("NameError"), \
        run.error_text
    run = ranks.run("%%ranks\nraise ExceptionGroup('two', [ValueError('a'), KeyError('b')])")
    assert "ExceptionGroup: two (2 sub-exceptions)\n  -- 1 of 2 --\n    ValueError: a\n" \
           "  -- 2 of 2 --\n    KeyError: 'b'" in run.error_text, run.error_text
    for glue in ("ipyparallel", "mpilab", "kernel_ext"):
        assert glue not in run.error_text


def test_sys_exit_in_a_cell_ends_it_as_it_ends_a_script(ranks):
    """A script pasted into a cell ends with `sys.exit(main())`: status 0 is a success,
    another status the rank's traceback naming the line, without IPython's advice for a
    terminal; `exit()` ends the cell, and the ranks stay up."""
    run = ranks.run("%%ranks\nimport sys\ndef main():\n    print('trained', rank)\n"
                    "    return 0\nif __name__ == '__main__':\n    sys.exit(main())\n"
                    "print('not here')")
    assert run.ok and run.text == "[rank 0] trained 0\n[rank 1] trained 1\n", run.text
    run = ranks.run("%%ranks 1\nimport sys\nsys.exit(3)")
    assert not run.ok
    assert re.search(r"Cell In\[\d+\], line 2, in <module>\n    sys.exit\(3\)\n"
                     r"SystemExit: 3$", run.error_text), run.error_text
    assert "%tb" not in run.text and "To exit" not in run.text, run.text
    run = ranks.run("%%ranks\nexit()\nprint('not here')")
    assert run.ok and run.text == ("[ranks 0-1] exit() ends the cell, not the ranks: they "
                                   "stay up for the next one (`%mpilab stop` ends them)\n")
    after = ranks.run("%%ranks\nprint('up', rank)")
    assert after.ok and "[rank 1] up 1" in after.stdout, after.text


def test_syntax_error_shown_once_as_the_cell(ranks):
    run = ranks.run("%%ranks\ndef f(:\n    pass")
    assert not run.ok
    err = run.error_text
    assert "[ranks 0-1] failed:" in err, err
    assert err.count("SyntaxError") == 1, err
    assert "Cell In[" in err and "ipykernel_" not in err, err
    assert "def f(:" in err


def test_timeout_stops_waiting_and_cluster_stays_usable(ranks):
    start = time.monotonic()
    run = ranks.run("%%ranks --timeout 1\nimport time\ntime.sleep(60)", timeout=30)
    assert time.monotonic() - start < 10
    assert not run.ok
    assert "did not finish within 1 s" in run.error_text
    assert ranks.run("%%ranks\nprint('alive', rank)").ok


def test_interrupt_reaches_every_rank(ranks):
    run = ranks.run("%%ranks\nimport time\nstate = 'before'\ntime.sleep(60)", timeout=30,
                    interrupt_after=2)
    assert not run.ok
    assert "[rank 0] interrupted" in run.error_text
    assert "[rank 1] interrupted" in run.error_text
    after = ranks.run("%%ranks\nstate")
    assert after.ok and "'before'" in after.text


# -- input() and debuggers on the ranks ------------------------------------------------------
def test_input_on_the_ranks_is_asked_once_in_the_notebook_and_each_rank_gets_the_answer(ranks):
    run = ranks.run("%%ranks\nname = input('name? ')\nprint('got', name, rank)",
                    answers=["bob"])
    assert run.ok, run.text
    assert run.prompts == ["[ranks 0-1] name? "]
    assert "[rank 0] got bob 0" in run.stdout and "[rank 1] got bob 1" in run.stdout
    one = ranks.run("%%ranks\nif rank == 1:\n    print('asked', input('only you? '))",
                    answers=["yes"])
    assert one.ok and one.prompts == ["[rank 1] only you? "], one.text
    assert "[rank 1] asked yes" in one.stdout
    secret = ranks.run("%%ranks\nimport getpass\nprint(len(getpass.getpass()))",
                       answers=["hunter2"])
    assert secret.ok and secret.prompts == ["[ranks 0-1] Password: "], secret.text
    assert "[ranks 0-1] 7" in secret.stdout and "hunter2" not in secret.text


def test_pdb_and_breakpoint_on_the_ranks_are_driven_from_the_notebook(ranks):
    run = ranks.run("%%ranks\nimport pdb\nx = rank * 10\npdb.set_trace()\nprint('after', x)",
                    answers=["p x", "c"])
    assert run.ok, run.text
    assert run.prompts == ["[ranks 0-1] (Pdb) "] * 2
    out = run.stdout
    # pdb's lines before its prompt come first; each rank answers for itself
    assert out.index("-> pdb.set_trace()") < out.index("[rank 0] 0") < out.index("[rank 0] after 0")
    assert "[rank 1] 10" in out and "[rank 1] after 10" in out
    # breakpoint() is pdb's on the ranks (ipykernel's hook made it a no-op there)
    stop = ranks.run("%%ranks\nbreakpoint()\nprint('went on')", answers=["c"])
    assert stop.ok and stop.prompts == ["[ranks 0-1] (Pdb) "], stop.text
    quit_ = ranks.run("%%ranks\nbreakpoint()\nprint('never')", answers=["q"])
    assert not quit_.ok and "never" not in quit_.text
    assert "[ranks 0-1] quit the debugger: the cell stopped there" in quit_.error_text
    assert "Traceback" not in quit_.text


def test_debug_after_a_failed_cell_debugs_the_rank_it_failed_on(ranks):
    failed = ranks.run("%%ranks\ndef f(z):\n    return 1 / z\nf(rank - 1)")
    assert not failed.ok and "[rank 1] failed:" in failed.error_text
    run = ranks.run("%debug", answers=["p z", "q"])
    assert run.ok, run.text
    assert run.text.startswith("mpilab: the debugger on rank 1, where the cell failed\n")
    assert "----> 2     return 1 / z" in run.text and "\n0\n" in run.text
    assert run.prompts == ["ipdb> "] * 2  # one rank: its prompt as it is
    # an error of the notebook's own: IPython's %debug, as without mpilab
    assert not ranks.run("1 / 0").ok
    local = ranks.run("%debug", answers=["q"])
    assert local.ok and local.prompts == ["ipdb> "] and "mpilab" not in local.text


def test_a_rank_at_a_prompt_is_not_a_hang_and_the_stop_button_ends_it(ranks):
    # rank 1 waits in a collective far past --hang-timeout while rank 0 waits for the user
    code = ("%%ranks --hang-timeout 1\nimport torch\nif rank == 0:\n    input('go? ')\n"
            "t = torch.ones(2)\nmpilab.allreduce(t)\nprint(t.tolist())")
    run = ranks.run(code, answers=["go"], answer_after=3.0)
    assert run.ok, run.text
    assert "[ranks 0-1] [2.0, 2.0]" in run.stdout
    # once the user has answered, a collective that stays unjoined is a hang again, a
    # hang timeout after the answer (not at once: its wait so far counts the user's time)
    never = ("%%ranks --hang-timeout 2\nimport torch\nif rank == 0:\n    input('go? ')\n"
             "else:\n    mpilab.allreduce(torch.ones(2))")
    hung = ranks.run(never, answers=["go"], answer_after=3.0, timeout=60)
    assert not hung.ok and "hang: rank 1 was waiting in allreduce" in hung.error_text, \
        hung.text
    waited = float(re.search(r"allreduce #\d+ \(2\) for ([\d.]+) s", hung.error_text)[1])
    assert waited >= 3.0 + 2.0, hung.error_text
    stopped = ranks.run("%%ranks\nimport pdb\npdb.set_trace()\nprint('never')",
                        interrupt_after=2.0)
    assert not stopped.ok and stopped.prompts == ["[ranks 0-1] (Pdb) "], stopped.text
    assert "[rank 0] interrupted" in stopped.error_text
    assert "[rank 1] interrupted" in stopped.error_text and "never" not in stopped.text
    assert ranks.run("%%ranks\nprint('next')").ok


def test_a_cell_that_cannot_ask_says_so_and_its_input_ends_as_at_end_of_file(ranks):
    run = ranks.run("%%ranks --noblock\ninput('later? ')")
    assert run.ok and not run.prompts
    said = ("EOFError: a --noblock cell takes no input: input() and debuggers on the ranks "
            "are answered in a cell that waits for them")
    messages = ranks.collect_iopub(5.0, until=lambda ms: said in stream_text(ms, run.msg_id))
    assert said in stream_text(messages, run.msg_id), messages
    # ipyparallel's own %%px cannot answer: the engine's error, at once, as without mpilab
    px = ranks.run("%%px\ninput('px? ')", timeout=30)
    assert not px.ok and not px.prompts and "StdinNotImplementedError" in px.text


def test_the_stop_button_while_a_cell_reports_its_error_keeps_that_error_clean(ranks):
    # the interrupt lands while the ranks format the error (its message is slow to make)
    code = ("%%ranks\nimport time\nclass SlowToSay(Exception):\n    said = False\n"
            "    def __str__(self):\n        if not SlowToSay.said:\n"
            "            SlowToSay.said = True\n            time.sleep(1.5)\n"
            "        return 'said slowly'\nraise SlowToSay()")
    run = ranks.run(code, interrupt_after=0.7, timeout=60)
    assert not run.ok
    assert "[ranks 0-1] failed:" in run.error_text and \
        run.error_text.count("SlowToSay: said slowly") == 1, run.text
    assert "Custom TB Handler failed" not in run.text and "site-packages" not in run.text
    # the ranks' clean tracebacks are still theirs
    later = ranks.run("%%ranks\nraise ValueError('plain')")
    assert "Traceback (most recent call last):\n  Cell In[" in later.error_text, later.text
    assert "site-packages" not in later.text


def test_noblock_returns_at_once_and_output_lands_under_its_cell(ranks):
    cell = ranks.run("%%ranks --noblock\nimport time\ntime.sleep(1.5)\nprint('late', rank)")
    assert cell.ok
    assert cell.finished - cell.started < 1.5
    other = ranks.run("import time\ntime.sleep(3)\nprint('notebook')")
    assert other.ok and "late" not in other.text
    late = stream_text(ranks.collect_iopub(1.0), cell.msg_id)
    assert "[rank 0] late 0" in late and "[rank 1] late 1" in late, late
    assert ranks.run("%%ranks\nprint('next')").ok


def test_ranks_started_after_a_stop_are_not_touched_by_a_noblock_cell_of_the_old_ones(ranks):
    """A --noblock cell still followed when its ranks are stopped and new ones started: it
    says once that its ranks were stopped, and leaves the new ranks alone (its follower
    took their engines' absence for deaths and marked the new ranks dead)."""
    cell = ranks.run("%%ranks --noblock\nimport time\ntime.sleep(30)")
    assert cell.ok
    assert ranks.run("%mpilab stop", timeout=120).ok
    started = ranks.run("%mpilab start -n 2", timeout=180)
    assert started.ok, started.text
    said = stream_text(ranks.collect_iopub(2.0), cell.msg_id)
    assert said == ("mpilab: the ranks were stopped while this cell ran (`%mpilab stop` or "
                    "restart)\n"), said
    after = ranks.run("%%ranks\nprint('new', rank)")
    assert after.ok, after.text
    assert "[rank 0] new 0" in after.stdout and "[rank 1] new 1" in after.stdout


def test_push_pull_round_trip(ranks):
    run = ranks.run("import torch\nw = torch.arange(6.).reshape(2, 3)\n"
                    "conf = {'lr': 0.1, 'n': [1, 2]}\n%mpilab push w,conf")
    assert run.ok, run.text
    run = ranks.run("%%ranks\nw2 = w * (rank + 1)\nconf2 = dict(conf, rank=rank)\n"
                    "print(w.sum().item())")
    assert "[ranks 0-1] 15.0" in run.stdout
    run = ranks.run("%mpilab pull w2 --rank 1\n%mpilab pull conf2\n"
                    "print(w2.tolist(), conf2)")
    assert run.ok, run.text
    assert "[[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]" in run.stdout
    expected = "[{'lr': 0.1, 'n': [1, 2], 'rank': 0}, {'lr': 0.1, 'n': [1, 2], 'rank': 1}]"
    assert expected in run.stdout


def test_pull_of_a_name_set_on_some_ranks_says_where_it_is(ranks):
    assert ranks.run("%%ranks 1\nonly_on_1 = 42").ok
    run = ranks.run("%mpilab pull only_on_1")
    assert "pull: 'only_on_1' is not defined on rank 0; it is on rank 1: add --rank 1" \
        in run.text, run.text
    _assert_one_line_error(run)
    run = ranks.run("%%ranks\nimport threading\nlock = threading.Lock()")
    assert run.ok, run.text
    run = ranks.run("%mpilab pull lock --rank 0")
    assert "pull: 'lock' could not be fetched from rank 0: TypeError" in run.text, run.text
    _assert_one_line_error(run)
    # the other way: what cannot be pickled is named, with what to do instead
    run = ranks.run("import threading\nnotebook_lock = threading.Lock()\n"
                    "%mpilab push notebook_lock")
    assert not run.ok
    assert ("push: 'notebook_lock' cannot be sent to the ranks (TypeError: cannot pickle "
            "'_thread.lock' object): make it on the ranks in a %%ranks cell, or push what it "
            "is made of") in run.text, run.text
    _assert_one_line_error(run)
    # an object of a class defined in the notebook pickles here (by the class's name),
    # and the ranks, which lack the class, cannot unpickle it: said, and what to do
    run = ranks.run("class Settings:\n    lr = 0.1\nsettings = Settings()\n"
                    "%mpilab push settings")
    assert not run.ok
    assert ("push: settings could not be unpickled on ranks 0-1: AttributeError: Can't get "
            "attribute 'Settings' on <module '__main__'") in run.text, run.text
    assert run.text.strip().endswith("its class is defined in the notebook only: run that "
                                     "class's cell with %%ranks too, or push plain data"), run.text
    _assert_one_line_error(run)
    assert ranks.run("%%ranks\nclass Settings:\n    lr = 0.1").ok
    assert ranks.run("%mpilab push settings").ok
    assert "[ranks 0-1] 0.1" in ranks.run("%%ranks\nprint(settings.lr)").stdout


@pytest.mark.parametrize("code, message", [
    ("%mpilab push nope", "push: no variable named 'nope' in the notebook"),
    ("%mpilab pull nope", "pull: 'nope' is not defined on ranks 0-1"),
    ("%mpilab pull w2 --rank 7", "rank 7 does not exist"),
    ("%mpilab auto maybe", "%mpilab auto takes on or off"),
    ("%%ranks --timeout -1\n1", "--timeout must be a positive number of seconds"),
    ("%mpilab bench allreduce --sizes 4X", "'4X' is not a size like 4K"),
    ("%mpilab bench reduce", "argument op: invalid choice: 'reduce'"),
    ("%mpilab bench allreduce --sizes 4K --backends carrier-pigeon",
     "bench backend 'carrier-pigeon' is not one of"),
    ("%mpilab metrics --save run.txt", "metrics are saved as .json or .csv"),
    ("%mpilab metrics --save /tmp", "UsageError: /tmp: metrics are saved as .json or .csv"),
    ("%mpilab metrics", "give --save FILE.json|FILE.csv, --clear, or both"),
    ("%mpilab trace --save trace.csv", "a trace is saved as .json"),
    ("%mpilab metrics --save /nonexistent/run.json",
     "/nonexistent/run.json: cannot write it (No such file or directory)"),
    ("%mpilab trace --save /nonexistent/trace.json",
     "/nonexistent/trace.json: cannot write it (No such file or directory)"),
    ("%%ranks\nimport asyncio\nawait asyncio.sleep(0)",
     "%%ranks cannot run a cell with a top-level await: ipyparallel's engines never answer"),
])
def test_bad_input_with_cluster(ranks, code, message):
    run = ranks.run(code)
    assert not run.ok and message in run.text, run.text
    _assert_one_line_error(run)


def test_auto_mode(ranks):
    assert ranks.run("%mpilab auto on").ok
    run = ranks.run("print('auto', rank)")
    assert "[rank 0] auto 0" in run.stdout and "[rank 1] auto 1" in run.stdout
    assert ranks.run("%mpilab auto off").ok
    run = ranks.run("print('local')")
    assert run.stdout == "local\n"


def test_dashboard_before_any_metrics_is_one_line(ranks):
    run = ranks.run("%mpilab dashboard")
    assert not run.ok and "no training metrics yet" in run.text
    _assert_one_line_error(run)


TRAIN_CELL = """%%ranks
import torch, time
model = mpilab.DataParallel(torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in mpilab.progress(range(12), desc="train"):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    mpilab.log(loss=loss.item())
    time.sleep(0.05)
print("trained")
"""


def test_training_cell_records_metrics_and_shows_dashboard_and_progress(ranks, tmp_path):
    run = ranks.run(TRAIN_CELL)
    assert run.ok, run.text
    kinds = [(o["type"], sorted(o["content"].get("data", {}))) for o in run.outputs
             if o["type"] != "stream"]
    widget = "application/vnd.jupyter.widget-view+json"
    assert any(t == "display_data" and widget in mimes for t, mimes in kinds), kinds
    final = [o for o in run.outputs if o["type"] == "update_display_data"
             and "mpilab dashboard" in o["content"]["data"].get("text/plain", "")]
    assert final and "step 12" in final[-1]["content"]["data"]["text/plain"]
    bars = [o["content"]["data"]["text/plain"] for o in run.outputs
            if o["type"] in ("display_data", "update_display_data")
            and o["content"]["data"].get("text/plain", "").startswith("train:")]
    assert bars and bars[-1].startswith("train: 12/12")

    csv_path, json_path, trace_path = (tmp_path / n for n in ("run.csv", "run.json", "t.json"))
    assert ranks.run(f"%mpilab metrics --save {csv_path}").ok
    assert ranks.run(f"%mpilab metrics --save {json_path}").ok
    assert ranks.run(f"%mpilab trace --save {trace_path}").ok
    records = json.loads(json_path.read_text())["records"]
    steps = [r for r in records if r["kind"] == "step"]
    assert {r["rank"] for r in steps} == {0, 1}
    assert max(r["step"] for r in steps) == 12
    assert all(r["nbytes"] > 0 and r["samples"] == 16 and r["dur"] > 0 for r in steps)
    assert any("loss" in r for r in records if r["kind"] == "log")
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == len(records) and {"kind", "rank", "step", "loss"} <= set(rows[0])
    trace = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert all(e["dur"] >= 0 and e["cat"] in ("comm", "compute") for e in spans)

    dash = ranks.run("%mpilab dashboard")
    assert dash.ok and "mpilab dashboard: 2 ranks, step 12" in dash.text

    # saved, then forgotten: the next save holds only later runs
    cleared = ranks.run(f"%mpilab metrics --save {json_path} --clear")
    assert cleared.ok and "metrics cleared" in cleared.stdout
    assert json.loads(json_path.read_text())["records"] == records
    assert ranks.run(f"%mpilab metrics --save {json_path}").ok
    assert json.loads(json_path.read_text())["records"] == []
    assert "no training metrics yet" in ranks.run("%mpilab dashboard").text


def test_noblock_training_keeps_its_dashboard_updating(ranks):
    cell = ranks.run(TRAIN_CELL.replace("%%ranks", "%%ranks --noblock", 1))
    assert cell.ok and cell.finished - cell.started < 1.5
    def seen(messages):
        """Whether the dashboard was shown, its final view (step 12) sent, and the
        cell's last line printed."""
        views = [(m["type"], m["content"]["data"].get("text/plain", "")) for m in messages
                 if m["parent"] == cell.msg_id and "data" in m["content"]]
        return (any(k == "display_data" and "mpilab dashboard" in t for k, t in views),
                any(k == "update_display_data" and "step 12" in t for k, t in views),
                "trained" in stream_text(messages, cell.msg_id))

    messages = ranks.collect_iopub(8.0, until=lambda ms: all(seen(ms)))
    shown, final, trained = seen(messages)
    assert shown and final, [m["type"] for m in messages]
    assert trained, messages


def test_cell_queued_behind_noblock_shows_and_times_only_its_own_run(ranks):
    """A cell run while a --noblock cell trains waits behind it on the ranks: its
    dashboard, progress bar and --timeout begin when the ranks begin it."""
    first = ranks.run(TRAIN_CELL.replace("%%ranks", "%%ranks --noblock", 1)
                      .replace("range(12)", "range(60)").replace('"train"', '"first"'))
    assert first.ok
    # 60 steps of 0.05 s ahead of it: counted from when it was run, 3 s would time out
    second = ranks.run(TRAIN_CELL.replace("%%ranks", "%%ranks --timeout 3", 1)
                       .replace("loss=", "acc=").replace('"train"', '"second"'))
    assert second.ok, second.text
    texts = [o["content"]["data"].get("text/plain", "") for o in second.outputs
             if o["type"] in ("display_data", "update_display_data")]
    bars = [t for t in texts if t.startswith(("first:", "second:"))]
    assert bars and all(t.startswith("second:") for t in bars), bars
    final = [t for t in texts if t.startswith("mpilab dashboard")][-1]
    assert "step 12" in final and "acc" in final and "loss" not in final, final
    # the first cell's own dashboard ends with its own run
    messages = [m for m in ranks.collect_iopub(1.0) if m["parent"] == first.msg_id]
    ends = [m["content"]["data"]["text/plain"] for m in messages
            if m["type"] == "update_display_data"
            and "mpilab dashboard" in m["content"]["data"].get("text/plain", "")]
    assert ends and "step 60" in ends[-1] and "acc" not in ends[-1], ends


def test_stopping_a_queued_cell_drops_it_and_the_noblock_cell_goes_on(ranks):
    first = ranks.run("%%ranks --noblock\nimport time\ntime.sleep(3)\nprint('first done')")
    assert first.ok
    second = ranks.run("%%ranks\nprint('second ran')", interrupt_after=1.0)
    assert not second.ok
    count = first.reply["execution_count"]
    assert f"ranks 0-1 are still running the --noblock cell In[{count}], not interrupted; " \
        "this cell had not begun there and was taken off their queue" in second.text, \
        second.text
    assert "Traceback" not in second.text and "restarted" not in second.text
    messages = [m for m in ranks.collect_iopub(4.0)
                  if m["parent"] in (first.msg_id, second.msg_id)]
    texts = [m["content"].get("text", "") for m in messages if m["type"] == "stream"]
    assert any("[ranks 0-1] first done" in t for t in texts), messages  # not interrupted
    assert not any("second ran" in t for t in texts + [second.text])
    assert ranks.run("%%ranks\nprint('next', rank)").ok


def test_a_cell_waiting_behind_a_noblock_cell_says_so_until_the_ranks_begin_it(ranks):
    first = ranks.run("%%ranks --noblock\nimport time\ntime.sleep(3)\nprint('first done')")
    second = ranks.run("%%ranks\nprint('second ran')")
    assert second.ok and "[ranks 0-1] second ran" in second.stdout, second.text
    count = first.reply["execution_count"]
    shown = [o for o in second.outputs if o["type"] in ("display_data", "update_display_data")]
    assert shown and shown[0]["content"]["data"]["text/plain"] == (
        f"ranks 0-1 are still running the --noblock cell In[{count}]: this cell waits its "
        "turn there (the stop button takes it off their queue)"), shown
    assert 0.8 < shown[0]["t"] - second.started < 2.0
    # emptied once the ranks begin it (JupyterLab draws nothing for it)
    ids = {o["content"]["transient"]["display_id"] for o in shown}
    assert len(ids) == 1 and shown[-1]["content"]["data"] == {}, shown


def test_pull_push_behind_a_noblock_cell_say_so_and_ctrl_c_takes_them_back(ranks):
    noblock = "%%ranks --noblock\nimport time\nx = 0\ntime.sleep(3)\nx = 7"
    first = ranks.run(noblock)
    pull = ranks.run("%mpilab pull x")
    count = first.reply["execution_count"]
    assert pull.ok and pull.stderr == (
        f"mpilab: ranks 0-1 are still running the --noblock cell In[{count}]: pull waits its "
        "turn there (interrupt the kernel to stop waiting)\n"), pull.text
    assert pull.displays()[-1]["data"]["text/plain"] == "[7, 7]"
    first = ranks.run(noblock + "\nprint('first done')")
    assert ranks.run("late = 5").ok
    push = ranks.run("%mpilab push late", interrupt_after=1.5)
    assert not push.ok
    assert push.text.strip().splitlines()[-1] == \
        "UsageError: push interrupted: no rank got the values", push.text
    assert "Traceback" not in push.text and "kernel_ext" not in push.text
    def done(messages):
        return "[ranks 0-1] first done" in stream_text(messages, first.msg_id)

    messages = ranks.collect_iopub(3.0, until=done)
    assert done(messages), messages  # the --noblock cell went on, not interrupted
    # taken off the queue: the ranks never got it
    pulled = ranks.run("%mpilab pull late")
    assert not pulled.ok and "'late' is not defined on ranks 0-1" in pulled.text


def test_cell_queued_behind_a_failing_noblock_cell_says_it_did_not_run(ranks):
    first = ranks.run("%%ranks --noblock\nimport time\ntime.sleep(1)\nraise ValueError('boom')")
    assert first.ok
    second = ranks.run("%%ranks\nprint('second ran')")
    assert not second.ok and "second ran" not in second.text
    assert "[ranks 0-1] did not run the cell: the cell before it there failed" in \
        second.text, second.text
    _assert_one_line_error(second)
    said = stream_text(ranks.collect_iopub(1.0), first.msg_id)
    assert "ValueError: boom" in said, said
    assert ranks.run("%%ranks\nprint('next', rank)").ok


def test_status_lists_every_rank(ranks):
    # right after a cell (its last heartbeat said "running"), the ranks show idle
    assert ranks.run("%%ranks\nimport time\ntime.sleep(0.7)").ok
    run = ranks.run("%mpilab status")
    assert run.ok, run.text
    lines = run.text.strip().splitlines()
    assert lines[0].split()[:4] == ["rank", "host", "pid", "device"]
    assert [ln.split()[0] for ln in lines[1:]] == ["0", "1"]
    assert all("idle" in ln for ln in lines[1:])


OWED_SPY = """
import mpilab.cell as _cell_module
_owed = []
_records_owed = _cell_module.RunningCell._records_owed
_cell_module.RunningCell._records_owed = lambda cell: _owed.append(_records_owed(cell)) or _owed[-1]
"""


def test_a_cell_that_records_nothing_leaves_nothing_to_wait_for_and_a_log_is_drawn(ranks):
    """A rank whose cell queued no records says so in its reply and sends its cell's
    markers with its next batch: a trivial cell wakes no record thread on the ranks and no
    receiver in the notebook (most of what it cost above `%%px`). A cell that logs sends
    its records at once, and its final drawing has its last value."""
    assert ranks.run(OWED_SPY).ok
    try:
        assert ranks.run("%%ranks\nx = 1").ok
        assert ranks.run("%%ranks\nraise ValueError('no')").error
        run = ranks.run("%%ranks\nfor i in range(3):\n    mpilab.log(loss=7.0 + i)")
        assert run.ok, run.text
        owed = ranks.run("print(_owed[-3:])").stdout.strip()
        assert owed == "[[], [0, 1], [0, 1]]", owed
        drawn = [o["content"]["data"]["text/plain"] for o in run.outputs
                 if o["type"] in ("display_data", "update_display_data")
                 and "mpilab dashboard" in o["content"]["data"].get("text/plain", "")]
        assert drawn and "loss 9" in drawn[-1], drawn
    finally:
        assert ranks.run("_cell_module.RunningCell._records_owed = _records_owed").ok


def test_bench_shows_table_and_plot(ranks):
    run = ranks.run("%mpilab bench allreduce --sizes 4K:16K --backends mpi,mpilab", timeout=120)
    assert run.ok, run.text
    for backend in ("mpi", "mpilab"):
        assert re.search(rf"allreduce\s+{backend}\s+4K", run.stdout), run.stdout
    assert "memory-copy ceiling" in run.stdout
    plots = [o for o in run.outputs if o["type"] == "display_data"
             and "application/vnd.plotly.v1+json" in o["content"]["data"]]
    assert plots


def test_a_bench_too_large_for_the_node_is_one_line_before_any_buffer(ranks):
    """64G messages on a 24 GiB node: the kernel's OOM killer would pick processes."""
    run = ranks.run("%mpilab bench allreduce --sizes 4K,64G")
    assert not run.ok and run.finished - run.started < 5
    assert re.fullmatch(r"UsageError: bench: 64G messages need about 384\.0 GiB on \S+ "
                        r"\(2 ranks, 3 buffers each\), which has [\d.]+ GiB available: "
                        r"use --sizes up to \d+[KMG]\n", run.text), run.text
    assert ranks.run("%%ranks\nprint('next', rank)").ok


# the ranks' collectives, mpilab's and mpi4py's, are in step: each sums the two ranks'
IN_STEP = ("%%ranks\nimport torch\n"
           "print('next', rank, int(mpilab.allreduce(torch.ones(1))), comm.allreduce(1))")


def test_stopping_a_bench_is_one_line_and_the_ranks_go_on(ranks):
    run = ranks.run("%mpilab bench allreduce --sizes 4K:64M --backends mpilab,mpi",
                    timeout=120, interrupt_after=2.0)
    assert not run.ok and run.finished - run.started < 10
    assert run.text.strip().splitlines()[-1] == "UsageError: bench interrupted", run.text
    assert "Traceback" not in run.text and "KeyboardInterrupt" not in run.text
    after = ranks.run(IN_STEP, timeout=30)
    assert after.ok and "[rank 0] next 0 2 2" in after.stdout, after.text


# a request of the bench's kind whose code has ended when the stop button's signal comes
SIGNALLED_AS_IT_ENDS = """
from mpilab.session import Session
def ended_then_signalled():
    import os, signal, time
    from mpilab.rank.waiting import as_request
    pid = as_request(os.getpid)
    os.kill(pid, signal.SIGINT)  # as ipykernel makes the reply
    time.sleep(0.5)
    return pid
_c = Session.instance().cluster
print(sorted(_c.client[_c.engines([0, 1])].apply_sync(ended_then_signalled))
      == sorted(_c.engine_pids()))
"""


def test_a_stop_that_comes_as_a_bench_request_ends_still_gets_its_reply(ranks):
    """The stop button signals each rank once. One that had just ended the bench's
    request raised KeyboardInterrupt while ipykernel made the reply, which ipykernel
    catches and sends no reply: the notebook waited for it in vain and restarted the
    ranks (6 of 785 stops on a loaded node). The request's reply comes, and the next
    cell is interrupted as ever."""
    run = ranks.run(SIGNALLED_AS_IT_ENDS, timeout=60)
    assert run.ok and run.stdout.strip() == "True", run.text
    stopped = ranks.run("%%ranks\nimport time\ntime.sleep(60)", timeout=60,
                        interrupt_after=1.5)
    assert not stopped.ok and stopped.finished - stopped.started < 10, stopped.text
    after = ranks.run(IN_STEP, timeout=30)
    assert after.ok and "[rank 0] next 0 2 2" in after.stdout, after.text


# rank 1's bench waits in a blocking MPI receive that nothing sends: a call no interrupt
# reaches (a C call holding the rank, as a peer's blocking collective would)
STUCK_IN_THE_BENCH = """%%ranks 1
from mpi4py import MPI
from mpilab.rank import bench
def _stuck(*args):
    MPI.COMM_WORLD.Recv(bytearray(1), source=0, tag=7)
bench._buffers = _stuck
"""


def test_stopping_a_bench_with_a_rank_no_interrupt_reaches_restarts_the_ranks(ranks):
    """Rank 0 stops at the bench's meeting point, rank 1 cannot: the notebook names it
    and restarts the ranks at once (not after a recovery that cannot succeed), and
    leaves no process of theirs behind."""
    assert ranks.run(STUCK_IN_THE_BENCH).ok
    engines = [psutil.Process(p) for p in cluster_pids(ranks)["engines"]]
    run = ranks.run("%mpilab bench allreduce --sizes 4K --backends mpilab", timeout=120,
                    interrupt_after=2.0)
    assert not run.ok and run.finished - run.started < 16, run.text  # not 15 s on a recovery
    assert run.text.strip().splitlines()[-1] == (
        "UsageError: bench interrupted; rank 1 did not stop (in a call no interrupt "
        "reaches), so the ranks were restarted: their state was lost"), run.text
    assert "Traceback" not in run.text and "KeyboardInterrupt" not in run.text
    gone, alive = psutil.wait_procs(engines, timeout=10)
    assert not alive, alive
    after = ranks.run(IN_STEP, timeout=30)
    assert after.ok and "[rank 0] next 0 2 2" in after.stdout and \
        "[rank 1] next 1 2 2" in after.stdout, after.text


# rank 1's kernel stalls between taking the next request off its queue and catching
# SIGINT for it (where a stop's signal is ignored), once, past the stop's grace
STALL_BEFORE_THE_NEXT_REQUEST = """%%ranks 1
import time
_kernel = get_ipython().kernel
_should_handle = _kernel.should_handle
def _stalled(stream, msg, idents):
    handle = _should_handle(stream, msg, idents)
    if handle and msg["header"]["msg_type"] == "apply_request":
        del _kernel.should_handle
        time.sleep(3)
    return handle
_kernel.should_handle = _stalled
"""


def test_a_rank_that_begins_a_stopped_bench_after_its_signal_stops_too(ranks):
    """The stop button's signal reached rank 1 before its kernel could catch it, with
    the request already off its queue: rank 1 must not run the bench alone (its peer
    gone, it would wait in the bench's first collective for good, and the ranks be
    restarted). It sees that the request was withdrawn and stops as it begins."""
    assert ranks.run(STALL_BEFORE_THE_NEXT_REQUEST).ok
    run = ranks.run("%mpilab bench allreduce --sizes 4K --backends mpilab", timeout=120,
                    interrupt_after=1.0)
    assert not run.ok and run.finished - run.started < 15, run.text
    assert run.text.strip().splitlines()[-1] == "UsageError: bench interrupted", run.text
    after = ranks.run(IN_STEP, timeout=30)
    assert after.ok and "[rank 0] next 0 2 2" in after.stdout and \
        "[rank 1] next 1 2 2" in after.stdout, after.text


def test_a_second_ctrl_c_while_the_ranks_are_released_changes_nothing(ranks):
    """The stop button pressed again while the first stop is still being served (rank 0
    sits in a blocking MPI receive, so the notebook waits out the interrupt grace and
    then restarts the ranks): one report, no traceback, and the ranks come back."""
    code = ("%%ranks\nfrom mpi4py import MPI\nimport numpy as np\nif rank == 0:\n"
            "    MPI.COMM_WORLD.Recv(np.zeros(1), source=1, tag=5)  # nothing is sent")
    again = threading.Timer(2.5, ranks.km.interrupt_kernel)
    again.start()
    try:
        run = ranks.run(code, timeout=120, interrupt_after=1.5)
    finally:
        again.cancel()
    assert not run.ok and run.finished - run.started < 20, run.text
    assert "Traceback" not in run.text and "KeyboardInterrupt" not in run.text, run.text
    assert "rank 0 was at cell line 4: MPI.COMM_WORLD.Recv" in run.text and \
        "restarted the ranks: their state was lost" in run.text, run.text
    after = ranks.run(IN_STEP, timeout=30)
    assert after.ok and "[rank 0] next 0 2 2" in after.stdout and \
        "[rank 1] next 1 2 2" in after.stdout, after.text


CTRL_C_BETWEEN_SENDS = """
import os, signal, ipyparallel
_sends = {{"apply": ipyparallel.Client.send_apply_request,
          "execute": ipyparallel.Client.send_execute_request}}
def _ctrl_c_after_the_first(kind, name):
    def send(self, *args, **kwargs):
        future = _sends[kind](self, *args, **kwargs)
        what = args[1]  # the cell's code, or the function pickled (and its arguments)
        if name in (what if isinstance(what, str) else str(b"".join(
                what.buffers + [b for arg in args[2] for b in arg.buffers]))):
            setattr(ipyparallel.Client, "send_" + kind + "_request", _sends[kind])
            os.kill(os.getpid(), signal.SIGINT)  # the stop button: rank 0 has it, rank 1 not
        return future
    return send
ipyparallel.Client.send_{kind}_request = _ctrl_c_after_the_first({kind!r}, {name!r})
"""
UNDO_CTRL_C = """
ipyparallel.Client.send_apply_request = _sends["apply"]
ipyparallel.Client.send_execute_request = _sends["execute"]
"""


@pytest.mark.parametrize("kind,name,code,said", [
    ("apply", "run_bench", "%mpilab bench allreduce --sizes 4K:64M --backends mpilab,mpi",
     "UsageError: bench interrupted"),
    ("execute", "allreduce", "%%ranks\nimport time, torch\ntime.sleep(5)\n"
     "mpilab.allreduce(torch.ones(4))",
     "queue|interrupted"),  # each rank interrupted, or the cell taken off its queue
])
def test_ctrl_c_while_a_request_is_sent_stops_it_on_every_rank(ranks, kind, name, code, said):
    """ipyparallel sends a request one rank at a time: the stop button pressed between two
    sends must not leave a collective running on the ranks that got it, waiting for good
    for those that did not (with nothing left in the notebook to stop it). Whether rank 1
    drops the request or begins it first is a race, run by run: either way the stop is
    one line, and the ranks' collectives stay in step after it."""
    assert ranks.run(CTRL_C_BETWEEN_SENDS.format(kind=kind, name=name)).ok
    try:
        run = ranks.run(code, timeout=60)
        assert not run.ok and run.finished - run.started < 15, run.text
        assert re.search(said, run.text) and "Traceback" not in run.text, run.text
        assert "earlier cell" not in run.text, run.text  # nothing left from the last one
        assert "restarted" not in run.text, run.text  # no rank is beyond an interrupt here
    finally:
        assert ranks.run(UNDO_CTRL_C).ok
    after = ranks.run(IN_STEP, timeout=30)
    assert after.ok and "[rank 0] next 0 2 2" in after.stdout and \
        "[rank 1] next 1 2 2" in after.stdout, after.text


def test_stop_leaves_no_process(ranks):
    pids = cluster_pids(ranks)
    assert len(pids["engines"]) == 2 and pids["launchers"]
    run = ranks.run("%mpilab stop", timeout=60)
    assert run.ok and "stopped 2 ranks" in run.stdout
    for pid in pids["engines"] + pids["launchers"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    kernel = psutil.Process(ranks.km.provisioner.process.pid)
    assert kernel.children(recursive=True) == []

"""What a new user meets in the first hour: help for every magic, the kernel and the
examples `mpilab lab` sets up, exports that work offline, the package's dependencies."""

from __future__ import annotations

import re

import pytest
from mpilab.magics import SUBCOMMANDS

# every option of every subcommand, as `%mpilab?` must list them
OPTIONS = {
    "start": ["-n", "--gpus", "--backend", "--launcher", "--hostfile", "--controller-ip",
              "--partition", "--time", "--account", "--nodes", "--tasks-per-node",
              "--gpus-per-node", "--sbatch-option", "--mpiexec", "--timeout", "--hang-timeout"],
    "pull": ["--rank"],
    "bench": ["--sizes", "--backends"],
    "metrics": ["--save", "--clear"],
    "trace": ["--save"],
}


def _page_text(kernel, code: str) -> str:
    """What `x?` shows: IPython sends it as a pager payload in the execute reply (taken
    here by its parent's id: the shell channel may still hold an earlier reply)."""
    msg_id = kernel.kc.execute(code)
    while True:
        reply = kernel.kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert reply["content"]["status"] == "ok", reply["content"]
    pages = [p["data"]["text/plain"] for p in reply["content"].get("payload", [])
             if p.get("source") == "page"]
    return re.sub(r"\x1b\[[0-9;]*m", "", "".join(pages))


# -- help ----------------------------------------------------------------------------------
def test_mpilab_question_mark_lists_every_subcommand_with_its_options(fresh_kernel):
    text = _page_text(fresh_kernel, "%mpilab?")
    for sub in SUBCOMMANDS:
        assert re.search(rf"^  {sub}\s+\S", text, re.M), f"{sub} not listed:\n{text}"
        if sub != "help":
            assert f"%mpilab {sub}" in text, sub
    for sub, options in OPTIONS.items():
        block = text[text.index(f"\n%mpilab {sub} "):]
        for option in options:
            assert re.search(rf"^\s+{re.escape(option)}\b.*\S", block, re.M), (sub, option)


@pytest.mark.parametrize("sub", [s for s in SUBCOMMANDS if s != "help"])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_each_subcommand_prints_its_help(fresh_kernel, sub, flag):
    args = {"push": "x ", "pull": "x ", "bench": "allreduce ", "auto": "on "}.get(sub, "")
    run = fresh_kernel.run(f"%mpilab {sub} {args}{flag}")
    assert run.ok, run.text
    assert run.stdout.startswith(f"%mpilab {sub}"), run.stdout
    for option in OPTIONS.get(sub, []):
        assert option in run.stdout, (sub, option)
    assert "\n\n" in run.stdout and len(run.stdout.splitlines()) >= 3  # usage, description


def test_mpilab_help_and_help_of_one_subcommand(fresh_kernel):
    everything = fresh_kernel.run("%mpilab help")
    assert everything.ok and all(f"%mpilab {s}" in everything.stdout
                                 for s in SUBCOMMANDS if s != "help")
    one = fresh_kernel.run("%mpilab help start")
    assert one.ok and one.stdout.startswith("%mpilab start [-n N]")
    assert "--sbatch-option" in one.stdout
    assert fresh_kernel.run("%mpilab -h").stdout == everything.stdout
    bad = fresh_kernel.run("%mpilab help frobnicate")
    assert not bad.ok and "no subcommand 'frobnicate'" in bad.text


def test_ranks_help_names_the_cell_magic_and_describes_every_option(fresh_kernel):
    text = _page_text(fresh_kernel, "%%ranks?")
    assert "%%ranks [--timeout S]" in text, text
    for option in ("--timeout", "--noblock", "--no-dashboard", "--quiet", "--hang-timeout"):
        assert re.search(rf"^\s+{option}\b( S)?\s+\S", text, re.M), (option, text)
    # -h prints the same help instead of running the cell (no ranks are needed for it)
    run = fresh_kernel.run("%%ranks -h\nprint('the cell ran')")
    assert run.ok and run.stdout.startswith("%%ranks [") and "the cell ran" not in run.stdout

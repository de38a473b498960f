"""What a host lacks that its ranks need: the notebook's folder and this Python environment.

mpiexec starts every rank in the notebook's folder, with the proxy beside mpiexec and
this kernel's Python (which must import mpilab), at the same paths on every host. A host
without one of them makes hydra fail with lines that name neither the host nor the path
(`launch_procs returned error`, `assert (!closed) failed`, a shell's `No such file or
directory` with no host), or leaves the other ranks waiting for it in MPI's start.
Only once a start has failed, each host that was to take ranks is asked which of those
paths it lacks: over ssh as mpiexec reached it, or, in a Slurm job or allocation, by one
srun task per node (a batch job's script runs it where mpiexec failed). One probe script
serves every way, and its answer becomes one line that names the host, the path and what
to do.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ASK_TIMEOUT_S = 10.0
MARK = "mpilab-host-lacks:"  # the probe's answer: "mpilab-host-lacks: node2 0 2"


PROGRAM, MODULE, FOLDER = "program", "module", "folder"  # most telling first


@dataclass(frozen=True)
class Needed:
    """A path every rank's host must have: a program to run, a Python that imports
    mpilab, or a folder to start in."""

    path: str
    kind: str = PROGRAM

    def test(self) -> str:
        """The shell test that holds where the host has it."""
        if self.kind == MODULE:
            return f"{shlex.quote(self.path)} -c 'import mpilab.rank.supervisor' >/dev/null 2>&1"
        return f"test -{'d' if self.kind == FOLDER else 'x'} {shlex.quote(self.path)}"


def needed(mpiexec: str, folder: str | None = None) -> list[Needed]:
    """What the ranks of `mpiexec` need on each host: the folder, its proxy, this Python
    and mpilab in it."""
    paths = [Needed(folder or os.getcwd(), FOLDER)]
    proxy = Path(mpiexec).with_name("hydra_pmi_proxy")
    if proxy.exists():
        paths.append(Needed(str(proxy)))
    paths += [Needed(sys.executable), Needed(sys.executable, MODULE)]
    return paths


def probe_script(paths: list[Needed]) -> str:
    """A shell script that prints MARK, the host's name and the index of each path it
    lacks, on one line, or nothing where it lacks none."""
    tests = "; ".join(f'{p.test()} || lacks="$lacks {i}"' for i, p in enumerate(paths))
    return (f"lacks=; {tests}; if [ -n \"$lacks\" ]; then "
            f"echo \"{MARK} $(hostname)$lacks\"; fi; true")


def srun_probe(paths: list[Needed], job: str | None = None,
               nodes: str = '"$SLURM_JOB_NUM_NODES"') -> str:
    """The shell command by which a Slurm job asks each of its `nodes`, one srun task
    each, beside whatever step still holds them: from inside the job (its script, or a
    shell in its allocation), or from outside it, naming the job."""
    into = f"--jobid={job} " if job else ""
    return (f"srun {into}-N {nodes} -n {nodes} --ntasks-per-node=1 --overlap "
            f"--kill-on-bad-exit=0 sh -c {shlex.quote(probe_script(paths))}")


_ANSWER = re.compile(rf"^{re.escape(MARK)} (\S+)((?: \d+)+)\s*$", re.M)
# slurmstepd's line where a node cannot run the proxy srun starts there
_EXECVE = re.compile(r"slurmstepd-(\S+): error: execve\(\): (/\S+): No such file or directory")


def read_answers(output: str, paths: list[Needed]) -> dict[str, list[Needed]]:
    """host -> what it lacks, from the probe's lines and slurmstepd's own in `output`."""
    missing: dict[str, list[Needed]] = {}
    for host, indices in _ANSWER.findall(output):
        missing.setdefault(host, []).extend(
            paths[int(i)] for i in indices.split() if int(i) < len(paths))
    for host, path in _EXECVE.findall(output):
        found = next((p for p in paths if p.path == path and p.kind == PROGRAM),
                     Needed(path))
        missing.setdefault(host, []).append(found)
    return missing


def ssh_command() -> list[str]:
    """The ssh mpiexec (hydra) runs: HYDRA_LAUNCHER_EXEC's where set, else `ssh`."""
    return [os.environ.get("HYDRA_LAUNCHER_EXEC") or "ssh", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=5"]


def ask_over_ssh(hosts: list[str], paths: list[Needed],
                 timeout: float = ASK_TIMEOUT_S) -> dict[str, list[Needed]]:
    """host (as the hostfile names it) -> the paths it lacks, every host asked at once. A
    host ssh cannot reach is left out: ssh's own line about it is in mpiexec's output."""
    script = probe_script(paths)

    def ask(host: str) -> list[Needed]:
        try:
            done = subprocess.run([*ssh_command(), host, script], capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return []
        if done.returncode != 0:
            return []
        return [p for found in read_answers(done.stdout, paths).values() for p in found]

    unique = list(dict.fromkeys(hosts))
    if not unique:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(unique))) as pool:
        answers = dict(zip(unique, pool.map(ask, unique), strict=True))
    return {host: found for host, found in answers.items() if found}


def ask_with_srun(paths: list[Needed], job: str | None = None, nodes: int | None = None,
                  timeout: float = ASK_TIMEOUT_S) -> dict[str, list[Needed]]:
    """node -> the paths it lacks, asked with srun: in the allocation this kernel is in,
    or in the running job `job` of `nodes` nodes."""
    command = srun_probe(paths, job, str(nodes)) if job else srun_probe(paths)
    try:  # srun in the shell's place: a timeout ends srun itself
        done = subprocess.run(["sh", "-c", "exec " + command], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return read_answers(done.stdout, paths)


def lacking_line(missing: dict[str, list[Needed]]) -> str | None:
    """One line naming the hosts and what they lack, and what to do (None: nothing)."""
    by_path: dict[Needed, list[str]] = {}
    for host, paths in missing.items():
        for path in paths:
            hosts = by_path.setdefault(path, [])
            if host not in hosts:
                hosts.append(host)
    if not by_path:
        return None
    # a program first, then mpilab: without the environment the folder does not matter
    first = min(by_path, key=lambda p: (PROGRAM, MODULE, FOLDER).index(p.kind))
    hosts = by_path[first]
    who = hosts[0] if len(hosts) == 1 else ", ".join(hosts[:-1]) + " and " + hosts[-1]
    has = "has" if len(hosts) == 1 else "have"
    if first.kind == MODULE:
        return (f"on {who}, {first.path} cannot import mpilab: install mpilab in that "
                "environment there, or keep the environment (and an editable install's "
                "source) on a file system every host shares")
    if first.kind == FOLDER:
        return (f"{who} {has} no folder {first.path}, this notebook's folder, where mpiexec "
                "starts the ranks: `%cd` to a folder every host shares (a home or project "
                "file system), then start again")
    return (f"{who} {has} no {first.path}: the ranks run this kernel's Python environment "
            f"({sys.prefix}) at the same path on every host; install it there, or keep it "
            "on a file system every host shares")

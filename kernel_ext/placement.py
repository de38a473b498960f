"""Where the ranks run and where they reach the notebook.

Past one host mpilab rides on MPI's and Slurm's own launchers; what it decides itself is
small and lives here: the address the controller, the record channel and the lifeline
listen on (one the ranks' hosts reach, on that interface only), how a Slurm job is
asked for, watched and cancelled, and whether an existing allocation can hold the ranks.
Each problem is one line that says what to do.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from .endpoint import route_source
from .selection import host_list

LOOPBACK = "127.0.0.1"
SLURM_QUERY_S = 15.0


class ClusterError(Exception):
    """A problem the user can fix; the message is one line saying what to do."""


OPTION_NAMES = {"sbatch_options": "--sbatch-option"}


_NODE_COUNT = re.compile(r"[1-9]\d*(?:-[1-9]\d*)?")


@dataclass
class SlurmSettings:
    """What a user tells sbatch (the magic's option names are the fields' with dashes)."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    nodes: str | None = None
    tasks_per_node: int | None = None
    gpus_per_node: str | None = None
    sbatch_options: list[str] = field(default_factory=list)  # any other, as sbatch spells it

    def given(self) -> list[str]:
        """The options set, as the user typed them (for 'needs --launcher slurm')."""
        return [OPTION_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
                for f in fields(self) if getattr(self, f.name)]

    def validate(self) -> None:
        if self.nodes is not None and not _NODE_COUNT.fullmatch(self.nodes):
            raise ClusterError(f"--nodes {self.nodes!r}: give a number of nodes, or a range "
                               "as sbatch takes it (2, 2-4)")
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise ClusterError(f"--tasks-per-node must be positive, got {self.tasks_per_node}")
        for option in self.sbatch_options:
            if not option.startswith("-"):
                raise ClusterError(f"--sbatch-option {option!r}: give it as sbatch spells it, "
                                   "for example --sbatch-option=--qos=high")

    def directives(self) -> list[str]:
        """The #SBATCH lines these settings make."""
        lines = []
        for name in ("partition", "time", "account", "nodes", "tasks_per_node",
                     "gpus_per_node"):
            value = getattr(self, name)
            if value:
                lines.append(f"#SBATCH --{name.replace('_', '-')}={value}")
        lines += [f"#SBATCH {option}" for option in self.sbatch_options]
        return lines


def batch_script(settings: SlurmSettings, mpiexec: str, probe: str | None = None) -> str:
    """ipyparallel's Slurm batch template: one job whose ranks mpiexec starts together
    (through srun on the job's nodes), so they are one MPI world. Where mpiexec fails,
    the script runs the shell command `probe` (host_check's: each node says what it lacks
    of the ranks' paths, into the job's output). Braces are escaped from ipyparallel's
    formatting."""
    def escaped(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    return "\n".join([
        "#!/bin/sh",
        "#SBATCH --job-name=mpilab-{cluster_id}",
        "#SBATCH --ntasks={n}",
        "#SBATCH --output={output_file}",
        "#SBATCH --export=ALL",
        *(escaped(line) for line in settings.directives()),
        f"{shlex.quote(mpiexec)} {' '.join(SLURM_MPIEXEC_ARGS)} -n {{n}} {{program_and_args}}",
        "status=$?",
        *([] if probe is None else [f'[ "$status" -eq 0 ] || {escaped(probe)}']),
        'exit "$status"',
        "",
    ])


# inside a Slurm job, mpiexec starts its proxies on the job's nodes with srun, whatever
# launcher the environment names for interactive use (ssh)
SLURM_MPIEXEC_ARGS = ("-launcher", "slurm", "-launcher-exec", "srun", "-rmk", "slurm")


# what slurmstepd writes into a job's output when Slurm ends it: "*** JOB 5 ON node1
# CANCELLED AT 2026-12-04T18:21:49 DUE TO TIME LIMIT ***" (a step's: "STEP 5.0"; older
# versions leave out "ON node1"; no reason: cancelled by a user, scancel)
_CANCELLED_LINE = re.compile(r"\*\*\* (?:JOB|STEP) (?P<job>\d+)(?:\.\S+)?(?: ON \S+)? "
                             r"CANCELLED AT \S*?T?(?P<at>\d\d:\d\d:\d\d)\S*"
                             r"(?: DUE TO (?P<why>[A-Z ]+))?")
# the reason's words -> (what befell the job, what the user can do about it)
_SLURM_WHY = {"TIME LIMIT": ("reached its time limit", "`%mpilab start --time` sets it"),
              "PREEMPTION": ("was preempted", ""), "NODE FAILURE": ("lost a node", ""),
              "JOB REQUEUE": ("was requeued", "")}


def slurm_job_ended(output: str) -> str | None:
    """Why Slurm ended the job whose output this is ('the Slurm job 5 reached its time
    limit at 18:21:49 (…)'), or None where it says nothing of the kind. The allocation
    this kernel runs in is named as one: its time limit is salloc's, not a start's."""
    found = _CANCELLED_LINE.search(output)
    if found is None:
        return None
    why = (found["why"] or "").strip()
    what, hint = _SLURM_WHY.get(why, (f"was cancelled ({why.lower()})" if why
                                      else "was cancelled", ""))
    job = found["job"]
    held = in_allocation() and os.environ.get("SLURM_JOB_ID") == job
    if held and why == "TIME LIMIT":
        hint = "salloc's --time sets it"
    return f"the Slurm {'allocation' if held else 'job'} {job} {what} at {found['at']}" + \
        (f" ({hint})" if hint else "")


# squeue's states of a job that has ended
SLURM_END_STATES = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
SLURM_CANCEL_WAIT_S = 15.0
# the reasons squeue gives for a pending job that no wait will start, as the job was
# asked (sbatch takes such a job when the site does not set EnforcePartLimits), with
# what to ask instead
SLURM_NEVER_STARTS = {
    "PartitionNodeLimit": "more nodes than the partition allows (or its nodes are down): "
                          "ask for fewer with --nodes, or another --partition",
    "PartitionTimeLimit": "a longer --time than the partition allows: ask for less",
    "BadConstraints": "no node has what the job asks for (features, memory, GPUs): ask "
                      "for less, or another --partition",
    "InvalidAccount": "an account you may not use: check --account",
    "InvalidQOS": "a QOS you may not use: check the --qos you pass",
    "QOSMaxNodePerJobLimit": "more nodes than your QOS allows a job: ask for fewer",
    "QOSMaxWallDurationPerJobLimit": "a longer --time than your QOS allows: ask for less",
    "AssocMaxNodesPerJobLimit": "more nodes than your account allows a job: ask for fewer",
    "AssocMaxWallDurationPerJobLimit": "a longer --time than your account allows: ask "
                                       "for less",
    "AssocMaxCpuPerJobLimit": "more CPUs than your account allows a job: ask for fewer",
}


def _squeue(job: str, fmt: str, steps: bool = False) -> str | None:
    """squeue's `fmt` for `job` (for its steps, with `steps`); None once the job is gone,
    'UNKNOWN' where squeue fails."""
    try:
        done = subprocess.run(["squeue", "-h", *(["--steps"] if steps else []), "-j",
                               str(job), "-o", fmt],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    out = done.stdout.strip()
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        return "UNKNOWN"
    return out or None


def slurm_job_state(job: str, with_reason: bool = False) -> str | None:
    """squeue's state of a job ('RUNNING', 'PENDING (Resources)'); None once it is gone."""
    return _squeue(job, "%T (%r)" if with_reason else "%T")


def pending_reason(state: str | None) -> str | None:
    """Why a pending job waits, from its squeue state with the reason (slurm_job_state
    with_reason: 'PENDING (Resources)' -> 'Resources'); None for a job not pending."""
    if not state or not state.startswith("PENDING ("):
        return None
    return state.removeprefix("PENDING (").removesuffix(")")


def never_starts(state: str | None) -> str | None:
    """What to ask instead, for a job whose squeue state ('PENDING (PartitionNodeLimit)')
    no wait will change; None for any other."""
    return SLURM_NEVER_STARTS.get(pending_reason(state) or "")


def slurm_job_nodes(job: str) -> int | None:
    """How many nodes the job holds while it runs (None: it does not run)."""
    state, _, nodes = (_squeue(job, "%T %D") or "").partition(" ")
    return int(nodes) if state == "RUNNING" and nodes.isdigit() else None


def proxy_step_name(cluster_id: str) -> str:
    """The name srun gives the step of one start's mpiexec proxies. Unnamed, a step is
    named after its program, `hydra_pmi_proxy`, alike for every mpiexec in the
    allocation: the name tells a start's step from another notebook's."""
    return f"mpilab-{cluster_id}"


def proxy_step_env(name: str) -> dict[str, str]:
    """mpiexec's environment in an allocation: the srun it starts its proxies with names
    their step `name` and lets it overlap the allocation's other steps (Hydra adds
    HYDRA_LAUNCHER_EXTRA_ARGS to srun's arguments; the user's own stay, before these).
    Without --overlap the step waits, silently, for as long as another step holds the
    nodes' CPUs: another notebook's ranks, the user's own srun, or the `srun --pty` step
    that JupyterLab itself runs in."""
    given = os.environ.get("HYDRA_LAUNCHER_EXTRA_ARGS", "").strip()
    return {"HYDRA_LAUNCHER_EXTRA_ARGS": f"{given} --overlap --job-name={name}".strip()}


def steps_named(job: str, name: str) -> set[str]:
    """The steps of `job` named `name`, as JOB.STEP (none where squeue cannot say)."""
    out = _squeue(job, "%i %j", steps=True)
    rows = [] if out in (None, "UNKNOWN") else out.splitlines()
    return {step for step, _, named in (row.strip().partition(" ") for row in rows)
            if named.strip() == name}


def cancel_job(job: str, wait: float) -> None:
    """scancel the job and wait (up to `wait` s) until squeue no longer lists it."""
    _scancel([job], wait, lambda: slurm_job_state(job) is not None)


def cancel_steps(job: str, name: str, wait: float) -> None:
    """scancel the steps of `job` named `name` and wait (up to `wait` s) until squeue no
    longer lists them: their tasks free the allocation's cores for the next start."""
    if steps := steps_named(job, name):
        _scancel(sorted(steps), wait, lambda: bool(steps_named(job, name) & steps))


def _scancel(ids: list[str], wait: float, listed: Callable[[], bool]) -> None:
    try:
        subprocess.run(["scancel", *map(str, ids)], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and listed():
        time.sleep(0.2)


def in_allocation() -> bool:
    """This kernel runs in a Slurm allocation (salloc's shell, a batch job's: JupyterLab
    started inside a job, as Open OnDemand does)."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def into_allocation(launcher: str, hostfile: str | None) -> bool:
    """The ranks go into the allocation this kernel runs in: with `--launcher slurm`,
    and under mpiexec without a hostfile too, as `mpiexec -n N` in that allocation's
    shell would (MPICH's mpiexec finds the allocation and starts the ranks on its nodes
    with srun); so the notebook listens where those nodes reach it."""
    return in_allocation() and (launcher == "slurm" or not hostfile)


def allocation_hosts() -> list[str]:
    """The node names of the allocation this kernel runs in."""
    return slurm_query("scontrol", "show", "hostnames",
                       os.environ.get("SLURM_JOB_NODELIST", "")).split()


def allocation_tasks() -> int | None:
    """How many tasks the current allocation holds: SLURM_NTASKS, else per node x nodes;
    inside one of its steps (a kernel, or JupyterLab, that srun runs) those variables
    are the step's own, and squeue says the allocation's."""
    if in_step():
        return _job_tasks()[0]
    if os.environ.get("SLURM_NTASKS"):
        return int(os.environ["SLURM_NTASKS"])
    per_node = os.environ.get("SLURM_TASKS_PER_NODE") or os.environ.get("SLURM_JOB_CPUS_PER_NODE")
    return sum(_per_node(per_node)) if per_node else None


def in_step() -> bool:
    """This kernel runs inside a step of its allocation (`srun --pty jupyter lab`, or a
    shell that `srun --pty bash` opened): Slurm's task variables are the step's."""
    return in_allocation() and bool(os.environ.get("SLURM_STEP_ID"))


def step_layout() -> dict[str, str]:
    """mpiexec's Slurm variables inside a step: the allocation's nodes and tasks, in
    place of the step's one task on one node, by which mpiexec would crowd the ranks
    onto the last node. Tasks per node as Slurm lays out a job's tasks by default:
    round robin over the nodes up to each one's CPUs (for its CPUs per task). Empty
    outside a step, or where Slurm does not say (a job that srun itself made, whose
    step's variables are the job's)."""
    if not in_step():
        return {}
    cpus = _per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
    if not cpus or not os.environ.get("SLURM_JOB_NODELIST"):
        return {}
    tasks, per_task = _job_tasks()
    if tasks is None:
        return {}
    layout = spread(tasks, [c // per_task for c in cpus])
    return {"SLURM_NODELIST": os.environ["SLURM_JOB_NODELIST"], "SLURM_NNODES": str(len(cpus)),
            "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks),
            "SLURM_TASKS_PER_NODE": per_node_counts(layout)}


def spread(tasks: int, room: list[int]) -> list[int]:
    """`tasks` dealt over nodes in turn, each up to its `room`, then in turn beyond it."""
    counts = [0] * len(room)
    node = 0
    for _ in range(tasks):
        if sum(counts) < sum(room):
            while counts[node] >= room[node]:
                node = (node + 1) % len(room)
        counts[node] += 1
        node = (node + 1) % len(room)
    return counts


def per_node_counts(counts: list[int]) -> str:
    """Counts a node as Slurm writes them: [2, 2, 2, 1] -> '2(x3),1'."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return ",".join(f"{c}(x{n})" if n > 1 else str(c) for c, n in runs)


def _per_node(counts: str) -> list[int]:
    """Slurm's counts a node, one a node: '2(x3),1' -> [2, 2, 2, 1]."""
    out = []
    for part in filter(None, counts.split(",")):
        count, _, times = part.partition("(x")
        if not count.isdigit():
            return []
        out += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return out


def _job_tasks() -> tuple[int | None, int]:
    """The allocation's task count and CPUs per task, as squeue says them."""
    said = slurm_query("squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-O",
                       "NumTasks,cpus-per-task").split()
    if len(said) != 2 or not all(x.isdigit() for x in said):
        return None, 1
    return int(said[0]), max(1, int(said[1]))


def check_local_ip(ip: str) -> None:
    """An address given for the controller must be one of this host's."""
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise ClusterError(f"--controller-ip {ip}: not an IP address; give this host's "
                           "address on the network the ranks' hosts share") from None
    if ip not in local_addresses():
        raise ClusterError(f"--controller-ip {ip}: not an address of this host (it has "
                           f"{_choices()}); give one that the ranks' hosts reach")


def local_addresses() -> set[str]:
    import psutil

    return {a.address.split("%")[0] for addresses in psutil.net_if_addrs().values()
            for a in addresses}


def _choices(remote: bool = False) -> str:
    """This host's IPv4 addresses; `remote`: those another host may reach (no loopback)."""
    return ", ".join(sorted(a for a in local_addresses() if "." in a and not (
        remote and ipaddress.ip_address(a).is_loopback)))


def batch_nodefile(launcher: str, hostfile: str | None) -> str | None:
    """The hostfile the ranks go by: --hostfile's, else, in a PBS job, its node file.
    mpiexec (Hydra) places ranks on a batch job's hosts by itself where no hostfile is
    given, so mpilab places them by the same file and listens where those hosts reach
    it. An LSF or SGE job's host list is in another format: one that names other hosts
    than this one is one line, asking for them as --hostfile."""
    if hostfile or launcher != "mpi" or in_allocation():
        return hostfile
    env = os.environ
    listed = None  # Hydra's order: LSF, then SGE, then PBS
    if env.get("LSF_BINDIR") and env.get("LSB_MCPU_HOSTS"):
        listed = ("LSF", "LSB_MCPU_HOSTS", env["LSB_MCPU_HOSTS"].split()[::2])
    elif env.get("SGE_ROOT") and env.get("ARC") and env.get("PE_HOSTFILE"):
        listed = ("SGE", "PE_HOSTFILE",
                  [row.split()[0] for row in _read_hosts(env["PE_HOSTFILE"]) if row.split()])
    elif env.get("PBS_NODEFILE"):
        _read_hosts(env["PBS_NODEFILE"])
        return env["PBS_NODEFILE"]
    if listed is not None:
        system, variable, hosts = listed
        others = [host for host in dict.fromkeys(hosts) if not is_this_host(host)]
        if others:
            raise ClusterError(
                f"this kernel runs in an {system} job on {host_list(hosts)}: give its hosts "
                "as --hostfile (a `host:slots` line each); mpilab places ranks on other "
                f"hosts by a hostfile, and mpiexec alone would take them from {variable}")
    return None


def pbs_job() -> str:
    """The PBS job whose node file batch_nodefile gave, as messages name it."""
    return f"PBS job {os.environ.get('PBS_JOBID', '')}".strip()


def _read_hosts(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError as e:
        raise ClusterError(f"cannot read the batch job's host list {path}: "
                           f"{e.strerror or e}") from None


def hostfile_hosts(path: str, n: int | None = None) -> list[str]:
    """The host names of an mpiexec (MPICH hydra) hostfile: a host a line, `host` or
    `host:slots`, maybe followed by hydra's `key=value` options; comments on lines of
    their own. What hydra would reject is told here, naming the line: hydra's own
    message names neither the line nor the fault, and `host:0` makes it wait forever.

    With `n`, the hosts that take some of n ranks: hydra fills each host's slots in the
    file's order (and goes round again where the file holds fewer than n)."""
    hosts = []
    slots_of = []
    for number, text in enumerate(Path(path).read_text().splitlines(), 1):
        line = text.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--hostfile {path}, line {number} ({line!r})"
        if "#" in line:
            raise ClusterError(f"{where}: mpiexec takes comments only on lines of their own")
        first, *options = line.split()
        host, colon, rest = first.partition(":")
        slots = rest.split(":")[0]
        if not host or (colon and not (slots.isdigit() and int(slots) > 0)):
            raise ClusterError(f"{where}: give `host` or `host:slots`, slots a positive number")
        for option in options:  # hydra takes one: ifhn=, the interface to reach it by
            key = option.partition("=")[0]
            if key in ("slots", "max_slots", "max-slots"):
                raise ClusterError(f"{where}: that is Open MPI's form; mpiexec (MPICH's "
                                   f"hydra) takes {host}:{option.partition('=')[2] or 'N'}")
            if key != "ifhn":
                raise ClusterError(f"{where}: mpiexec takes no {key!r} there (only "
                                   "`ifhn=ADDRESS` after `host:slots`)")
        hosts.append(host)
        slots_of.append(int(slots) if slots else 1)
    if not hosts:
        raise ClusterError(f"--hostfile {path}: names no host (one per line, `host:slots`)")
    if n is None:
        return hosts
    taking, placed = [], 0
    for host, slots in zip(hosts, slots_of, strict=True):
        if placed >= n:
            break
        taking.append(host)
        placed += slots
    return taking


def is_this_host(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return resolve(host) in local_addresses()
    except OSError:
        return False


def _loopback_name(host: str) -> bool:
    if host == "localhost" or host.startswith("localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str:
    return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]


def slurm_query(*command: str) -> str:
    """A Slurm command's output; its own error as one line when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SLURM_QUERY_S)
    except FileNotFoundError:
        raise ClusterError(f"{command[0]} not found: {_needs_slurm()} Slurm's commands on "
                           "this host's PATH") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(command)} did not answer in {SLURM_QUERY_S:.0f} s: "
                           "is slurmctld running?") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        last = said[-1] if said else "failed"
        if not last.startswith(f"{command[0]}:"):  # Slurm's commands name themselves
            last = f"{command[0]}: {last}"
        advice = "" if in_allocation() else ", or start without it"
        raise ClusterError(f"{last} ({_needs_slurm()} this host's Slurm commands to reach "
                           f"slurmctld: check slurm.conf{advice})")
    return done.stdout


def _needs_slurm() -> str:
    """Who needs Slurm's commands here: the ranks going into this kernel's allocation
    (whatever the launcher), else --launcher slurm."""
    return ("the ranks going into this kernel's Slurm allocation (SLURM_JOB_ID is set) need"
            if in_allocation() else "--launcher slurm needs")


def first_slurm_node_address(settings: SlurmSettings) -> str | None:
    """The address of the first node the ranks may land on: the allocation's, else the
    partition's (sinfo's NodeAddr, which is what slurmd is reached at)."""
    if in_allocation() and os.environ.get("SLURM_JOB_NODELIST"):
        first = allocation_hosts()[0]
        rows = slurm_query("sinfo", "-h", "-N", "-n", first, "-o", "%N %o").split()
    else:
        partition = ["-p", settings.partition] if settings.partition else []
        rows = slurm_query("sinfo", "-h", "-N", *partition, "-o", "%N %o").split()
        if not rows:
            where = f"partition {settings.partition}" if settings.partition else "the cluster"
            raise ClusterError(f"sinfo lists no node in {where}: check --partition")
    return rows[1] if len(rows) > 1 else None


@dataclass
class Placement:
    """Where the ranks will run, as far as the notebook can tell before starting them."""

    listen_ip: str  # controller, record channel and lifeline bind here
    remote: bool  # some rank may run on another host
    first_host: str | None = None  # a host the ranks run on (for messages)


def place(launcher: str, hostfile: str | None, controller_ip: str | None,
          slurm: SlurmSettings) -> Placement:
    """Choose the address the ranks reach the notebook at: the given one, else loopback
    when they run here, else the route towards the first rank's host."""
    inside = into_allocation(launcher, hostfile)
    if launcher == "slurm" or inside:
        if inside and os.environ.get("SLURM_JOB_NODELIST") and \
                all(is_this_host(host) for host in allocation_hosts()):
            return _given_or_loopback(controller_ip)  # an allocation of this host alone
        address = first = first_slurm_node_address(slurm)
    elif hostfile:
        hosts = hostfile_hosts(hostfile)
        remote_hosts = [h for h in hosts if not is_this_host(h)]
        if not remote_hosts:
            return _given_or_loopback(controller_ip)
        own = next((h for h in hosts if _loopback_name(h)), None)
        if own is not None:  # hydra tells the other hosts' proxies to call it back there
            raise ClusterError(
                f"--hostfile {hostfile}: {own!r} means each host itself, and mpiexec tells "
                f"{remote_hosts[0]} to reach this host by that name: write this host as the "
                f"others reach it ({socket.gethostname()}, or its address on their network)")
        first = remote_hosts[0]
        try:
            address = resolve(first)
        except OSError:
            address = None
    else:
        return _given_or_loopback(controller_ip)
    if controller_ip is not None:
        if ipaddress.ip_address(controller_ip).is_loopback:
            raise ClusterError(f"--controller-ip {controller_ip}: the ranks on {first} cannot "
                               f"reach this host's loopback; give one of {_choices(remote=True)}")
        return Placement(controller_ip, remote=True, first_host=first)
    source = route_source(address) if address else None
    if source is None or ipaddress.ip_address(source).is_loopback:
        why = "does not resolve here" if address is None else f"({address}) has no route here"
        raise ClusterError(f"cannot tell which address of this host {first} reaches: it "
                           f"{why}; give --controller-ip, one of {_choices(remote=True)}")
    return Placement(source, remote=True, first_host=first)


# UCX's shared-memory transports, and its names for all of them
_UCX_SHARED_MEMORY = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "all"}


def check_transports(listen_ip: str, n: int) -> None:
    """Ranks that all run on this host keep MPI's TCP transport on the loopback (each
    rank's UCX_NET_DEVICES), over which UCX's TCP transport does not run: they talk
    through shared memory, which a UCX_TLS of the user's must then leave them."""
    tls = os.environ.get("UCX_TLS", "").strip()
    if not tls or n < 2 or not ipaddress.ip_address(listen_ip).is_loopback:
        return
    names = {name.strip().lower() for name in tls.lstrip("^").split(",")}
    excluding = tls.startswith("^")  # every transport but these
    if (not names & {"sm", "shm", "all"}) if excluding else names & _UCX_SHARED_MEMORY:
        return
    fix = "take sm out of its exclusions" if excluding else f"add sm (UCX_TLS=sm,{tls})"
    raise ClusterError(f"UCX_TLS={tls} leaves MPI no way between ranks on this host: they "
                       "talk through shared memory, and UCX's TCP transport does not run "
                       f"over the loopback they keep it on: {fix}, or unset UCX_TLS")


def _given_or_loopback(controller_ip: str | None) -> Placement:
    return Placement(controller_ip or LOOPBACK, remote=False)

"""Code written for torchrun runs unchanged on mpilab's ranks.

torchrun gives each process an environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
…) and leaves the process group to the script: ``init_process_group`` at the top,
``destroy_process_group`` at the end. On mpilab's ranks the group already exists (the
bootstrap made it, and mpilab's collectives, DataParallel and the watchdog rely on it),
so this module

- sets torchrun's environment from the bootstrap, MASTER_ADDR/MASTER_PORT naming the
  store of mpilab's group, so ``env://`` and ``int(os.environ["LOCAL_RANK"])`` work;
- makes ``init_process_group`` reuse mpilab's group when it serves the same ranks (one
  note line per cell), or stand up the backend the user asked for over mpilab's store
  (no new listener: a user's MASTER_PORT would make rank 0 listen on every interface);
- makes ``destroy_process_group`` release what the user made (their subgroups, a group
  of another backend) and keep mpilab's group, so the next cell finds a working one;
- stops ``torch.multiprocessing.spawn`` with one line: each rank already is a process;
- makes ``%run script.py`` on an engine raise the script's error, so a failing script
  fails the cell (and the watchdog releases its peers) instead of printing a traceback
  and reporting success.

Imported by the bootstrap once torch is loaded; importing it imports nothing heavy.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

NOTE_PREFIX = "mpilab: "


@dataclass(frozen=True)
class TorchrunEnv:
    """The variables torchrun sets for each worker (torch.distributed.run's docs)."""

    RANK: int
    WORLD_SIZE: int
    LOCAL_RANK: int
    LOCAL_WORLD_SIZE: int
    GROUP_RANK: int  # this node's index among the job's nodes
    GROUP_WORLD_SIZE: int  # the number of nodes
    ROLE_RANK: int
    ROLE_WORLD_SIZE: int
    MASTER_ADDR: str | None  # None: the default group is not mpilab's; leave them be
    MASTER_PORT: int | None
    ROLE_NAME: str = "default"
    TORCHELASTIC_RESTART_COUNT: int = 0
    TORCHELASTIC_MAX_RESTARTS: int = 0
    TORCHELASTIC_RUN_ID: str = "mpilab"

    def environ(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items() if v is not None}


def torchrun_env(ctx, group_rank: int, group_world_size: int) -> TorchrunEnv:
    """torchrun's environment for the rank `ctx` describes (a RankContext)."""
    address = ctx.store_address
    return TorchrunEnv(
        RANK=ctx.rank, WORLD_SIZE=ctx.world_size,
        LOCAL_RANK=ctx.local_rank, LOCAL_WORLD_SIZE=ctx.local_size,
        GROUP_RANK=group_rank, GROUP_WORLD_SIZE=group_world_size,
        ROLE_RANK=ctx.rank, ROLE_WORLD_SIZE=ctx.world_size,
        MASTER_ADDR=address[0] if address else None,
        MASTER_PORT=int(address[1]) if address else None,
    )


def node_index(comm, node_comm) -> tuple[int, int]:
    """(this node's index, number of nodes), nodes numbered by their lowest rank; a
    collective of every rank (the bootstrap's MPI communicators)."""
    leader = node_comm.bcast(comm.Get_rank(), root=0)
    leaders = sorted(set(comm.allgather(leader)))
    return leaders.index(leader), len(leaders)


def install(ctx) -> None:
    """Give this rank torchrun's world (the bootstrap calls this on every rank)."""
    group_rank, groups = node_index(ctx.comm, ctx.node_comm)
    os.environ.update(torchrun_env(ctx, group_rank, groups).environ())
    import torch.distributed as dist

    if ctx.store is not None and dist.is_initialized():
        global _groups
        _groups = SharedGroups(ctx)
        _groups.patch()
    _guard_spawn(ctx)


def uninstall() -> None:
    """torch's own init_process_group / destroy_process_group again, and no reference
    kept to any group (at exit, so that destroying the groups frees them)."""
    global _groups
    groups, _groups = _groups, None
    if groups is not None:
        groups.unpatch()


# -- notes ----------------------------------------------------------------------------

_noted: set[tuple[int, str]] = set()


def note(text: str) -> None:
    """One line on stderr, at most once per cell for the same text (identical lines of
    several ranks are shown once by the notebook, naming the ranks; in a batch script,
    where nothing merges them, rank 0 says it: every rank's note is the same)."""
    from . import agent as agent_mod

    agent = agent_mod.current()
    if agent.address is None and agent.rank != 0:
        return
    cell = agent.state.cell
    if (cell, text) in _noted:
        return
    if len(_noted) > 64:
        _noted.clear()
    _noted.add((cell, text))
    print(NOTE_PREFIX + text, file=sys.stderr, flush=True)


# -- init_process_group / destroy_process_group ----------------------------------------


def device_backends(backend: str) -> dict[str, str]:
    """'gloo' → {'cpu': 'gloo', 'cuda': 'gloo'}; 'cpu:gloo,cuda:nccl' as written."""
    from torch.distributed import distributed_c10d as c10d

    return c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map()


def backend_available(name: str) -> bool:
    """Whether this torch has the backend `name` (gloo, nccl, mpi, or a registered one)."""
    import torch.distributed as dist

    check = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available,
             "mpi": dist.is_mpi_available}.get(name)
    return bool(check()) if check else _registered(name)


def _registered(name: str) -> bool:
    import torch.distributed as dist

    check = getattr(dist, "is_backend_available", None)
    return bool(check(name)) if check else False


@dataclass
class Plan:
    """What init_process_group(backend) does while a default group exists."""

    action: str  # reuse | replace
    why_not: str | None = None  # reuse although another backend was asked for: why


def plan(requested: str | None, current: str, device_type: str,
         available: Callable[[str], bool] = backend_available) -> Plan:
    """Reuse the current group when it already does what `requested` asks on the devices
    these ranks have (cpu, and cuda on GPU ranks); else replace it, where possible."""
    if not requested:
        return Plan("reuse")
    relevant = {"cpu", device_type}
    wanted = {d: b for d, b in device_backends(requested).items() if d in relevant}
    if not wanted:
        devices = "on CPU" if device_type == "cpu" else f"on {device_type}"
        if "nccl" in device_backends(requested).values():
            return Plan("reuse", f"NCCL needs a GPU on every rank, and these ranks run {devices}")
        return Plan("reuse", f"{requested} serves none of these ranks' devices ({devices})")
    missing = sorted(b for b in set(wanted.values()) if not available(b))
    if missing:
        return Plan("reuse", f"this torch has no {missing[0]} backend")
    have = device_backends(current)
    if all(have.get(d) == b for d, b in wanted.items()):
        return Plan("reuse")
    return Plan("replace")


class RanksMismatch(ValueError):
    """init_process_group was asked for a world other than the ranks'."""


class SharedGroups:
    """mpilab's default group, shared with code that manages its own process group.

    mpilab's group is never destroyed by the user's calls: mpilab's collectives,
    DataParallel(backend="torch") and `%mpilab bench` use it between the user's cells.
    A group of another backend that the user asks for is made over mpilab's store
    (`new_group`: no new listener) and stands in as the default until the user
    destroys it.
    """

    def __init__(self, ctx):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.ctx = ctx
        self.dist = dist
        self.c10d = c10d
        self.real_init = c10d.init_process_group
        self.real_destroy = c10d.destroy_process_group
        self.signature = inspect.signature(self.real_init)
        self.mpilab_pg = c10d._get_default_group()
        self.stand_in = None  # the user's group of another backend, while it is the default
        self.generation = 0  # groups made over mpilab's store after its own was lost
        self.before_user = set(c10d._world.pg_map)  # groups that are not the user's to destroy

    def patch(self) -> None:
        import torch.distributed as dist

        # torch's own names and docs (help(dist.init_process_group) reads as usual)
        init = functools.wraps(self.real_init)(
            lambda *args, **kwargs: self.init_process_group(*args, **kwargs))
        destroy = functools.wraps(self.real_destroy)(
            lambda group=None: self.destroy_process_group(group))
        for module in (dist, self.c10d):
            module.init_process_group = init
            module.destroy_process_group = destroy

    def unpatch(self) -> None:
        import torch.distributed as dist

        for module in (dist, self.c10d):
            module.init_process_group = self.real_init
            module.destroy_process_group = self.real_destroy

    # the replacements -----------------------------------------------------------------
    def init_process_group(self, *args: Any, **kwargs: Any) -> None:
        """torch.distributed.init_process_group on mpilab's ranks (see the class)."""
        call = self.signature.bind(*args, **kwargs).arguments
        requested = call.get("backend")
        requested = str(requested) if requested else None
        self._check_world(call.get("rank", -1), call.get("world_size", -1))
        if not self.dist.is_initialized():
            self._renew(requested, call.get("timeout"))
            return
        current = str(self.dist.get_backend())
        if self.stand_in is not None and plan(requested, current, self._device).action \
                != "reuse":
            self._retire_stand_in()
            current = str(self.dist.get_backend())
        decided = plan(requested, current, self._device)
        if decided.action == "replace" and not hasattr(self.c10d, "_update_default_pg"):
            decided = Plan("reuse", f"torch {_torch_version()} cannot put another group in "
                                    "the default group's place")
        if decided.action == "replace":
            self._stand_in(requested, current, call)
            return
        self.before_user = set(self.c10d._world.pg_map)
        if decided.why_not:
            note(f"init_process_group({requested!r}): {decided.why_not}; the ranks' "
                 f"{current} group serves instead")
        else:
            note(f"init_process_group: the ranks' {current} group is reused (ranks "
                 f"0-{self.ctx.world_size - 1}; mpilab set it up)")

    def destroy_process_group(self, group: Any = None) -> None:
        """torch.distributed.destroy_process_group on mpilab's ranks (see the class)."""
        c10d = self.c10d
        if not self.dist.is_initialized():
            return self.real_destroy(group)
        if not (group is None or group is self.mpilab_pg or group is self.stand_in
                or group == c10d.GroupMember.WORLD):
            return self.real_destroy(group)
        self._retire_stand_in()
        for pg in list(c10d._world.pg_map):
            if pg not in self.before_user and pg is not self.mpilab_pg:
                self.real_destroy(pg)
        self.before_user = set(c10d._world.pg_map)
        return None

    # helpers ----------------------------------------------------------------------------
    @property
    def _device(self) -> str:
        return self.ctx.device.type

    def _check_world(self, rank: Any, world_size: Any) -> None:
        ctx = self.ctx
        rank = -1 if rank is None else int(rank)
        world_size = -1 if world_size is None else int(world_size)
        if (rank < 0 or rank == ctx.rank) and (world_size < 0 or world_size == ctx.world_size):
            return
        more = (f", or start {world_size} ranks with `%mpilab start -n {world_size}`"
                if world_size > 0 and world_size != ctx.world_size else "")
        raise RanksMismatch(
            f"init_process_group(rank={rank}, world_size={world_size}) does not match these "
            f"ranks (this is rank {ctx.rank} of {ctx.world_size}): pass the ranks' own "
            f"rank and world_size (or leave them to RANK and WORLD_SIZE){more}")

    def _stand_in(self, requested: str, current: str, call: dict) -> None:
        """The user's backend over all ranks, made over mpilab's store, as the default."""
        c10d = self.c10d
        kwargs = {k: call[k] for k in ("timeout", "pg_options") if call.get(k) is not None}
        pg = c10d.new_group(backend=requested, **kwargs)
        self.stand_in = pg
        c10d._update_default_pg(pg)
        self.before_user = set(c10d._world.pg_map)
        note(f"init_process_group({requested!r}): a {requested} group of the ranks replaces "
             f"their {current} group, as asked; destroy_process_group() brings the {current} "
             "one back")

    def _retire_stand_in(self) -> None:
        """mpilab's group is the default again; the user's stand-in is destroyed."""
        pg, self.stand_in = self.stand_in, None
        if pg is None:
            return
        self.c10d._update_default_pg(self.mpilab_pg)
        if pg in self.c10d._world.pg_map:
            self.real_destroy(pg)

    def _renew(self, requested: str | None, timeout: Any) -> None:
        """No default group (it was destroyed past this module): a new one of the ranks,
        over mpilab's store under a fresh prefix, whatever MASTER_ADDR/PORT say."""
        import torch.distributed as dist

        ctx = self.ctx
        self.generation += 1
        store = dist.PrefixStore(f"mpilab-torchrun/{self.generation}/", ctx.store)
        usable = requested and plan(requested, ctx.backend, self._device).why_not is None
        backend = requested if usable else ctx.backend
        kwargs = {"timeout": timeout} if timeout is not None else {}
        self.real_init(backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                       **kwargs)
        self.mpilab_pg = self.c10d._get_default_group()
        self.stand_in = None
        self.before_user = set(self.c10d._world.pg_map)
        note(f"init_process_group: a new {backend} group of the ranks, over mpilab's store")


def _torch_version() -> str:
    import torch

    return torch.__version__


_groups: SharedGroups | None = None


def shared_groups() -> SharedGroups | None:
    """The installed SharedGroups (None: the default group is not mpilab's)."""
    return _groups


# -- torch.multiprocessing.spawn ---------------------------------------------------------


class SpawnOnRanks(RuntimeError):
    """mp.spawn was called on a rank: it would start processes on every rank."""


def spawn_message(fn: Any, args: tuple, nprocs: int, world_size: int) -> str:
    """One line: what mp.spawn would do here, and the call that does the job instead."""
    name = getattr(fn, "__name__", "fn")
    shown = ", ".join(repr(a) for a in args)
    call = f"{name}(rank{', ' + shown if shown else ''})"
    if len(call) > 80:
        call = f"{name}(rank, *args)"
    return (f"mp.spawn would start {nprocs} more processes on each of the {world_size} "
            f"ranks, and every rank already is one process of the job: call {call} "
            "instead, on every rank (`rank` is this rank's number)")


def _guard_spawn(ctx) -> None:
    """torch.multiprocessing.spawn / start_processes raise SpawnOnRanks on the ranks."""
    import torch.multiprocessing as mp

    spawn_module = sys.modules.get("torch.multiprocessing.spawn")
    real = mp.start_processes
    signature = inspect.signature(real)

    def refuse(*args: Any, **kwargs: Any):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        raise SpawnOnRanks(spawn_message(a["fn"], tuple(a.get("args") or ()),
                                         a.get("nprocs", 1), ctx.world_size))

    for module in (mp, spawn_module):
        if module is not None:
            module.spawn = refuse
            module.start_processes = refuse


# -- %run on an engine ---------------------------------------------------------------------


def install_shell(shell) -> None:
    """`%run script.py` in a cell raises what the script raises (IPython prints it and
    reports success), so a failing script fails the cell on its rank, and the notebook
    releases the peers that wait for it."""
    run = shell.magics_manager.magics["line"].get("run")
    magics = getattr(run, "__self__", None)  # IPython's ExecutionMagics
    if magics is None or not hasattr(magics, "default_runner"):
        return

    def run_script(filename, *where, exit_ignore: bool = False):
        try:
            shell.safe_execfile(filename, *where, exit_ignore=exit_ignore,
                                raise_exceptions=True)
        except SystemExit as status:  # sys.exit(0) never gets here (IPython ignores it)
            if not exit_ignore:
                raise ScriptExit(filename, status.code) from None

    magics.default_runner = run_script


class ScriptExit(RuntimeError):
    """A script run with %run called sys.exit with a non-zero status (a SystemExit out of
    a cell would make IPython add "To exit: use 'exit', 'quit', or Ctrl-D")."""

    def __init__(self, filename: str, code: Any):
        name = os.path.basename(str(filename))
        # sys.exit("message") exits with status 1 after printing the message
        how = f"with status {code}" if isinstance(code, int) else f"with status 1: {code}"
        super().__init__(f"{name} exited {how}")
        self.code = code

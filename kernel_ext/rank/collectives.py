"""Instrumented, interruptible collectives on tensors: allreduce, broadcast, allgather, barrier.

Every call is announced to the rank agent (``waiting.collective``) so heartbeats show which
collective a rank is in and the dashboard gets a comm span; every wait polls a
non-blocking request so the notebook's stop button lands within milliseconds.

Two transports (``torch_group`` says which one a tensor takes): MPI (mpi4py on NumPy
views of CPU tensors; GPU tensors are staged through pinned host memory) and
torch.distributed (gloo on CPU, NCCL on GPU). How a tensor is reduced on either is
``reduction``'s. mpilab's own MPI traffic runs on private duplicates of COMM_WORLD, so a
user's messages on ``comm`` can never match mpilab's.

A CPU tensor reduced again and again has a plan (``TensorPlan``): what a call would
otherwise redo each time is looked up once.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import across_nodes, reduction, torch_group, waiting
from . import agent as agent_mod
from ._collective import planned, run_planned
from .context import context, is_initialized
from .fast_allreduce import free, plan_for, reducer
from .fusion import grouped_allreduce
from .reduction import WIRE_OP
from .waiting import wait_interruptibly

_HOST_TRANSPORTS = ("auto", "mpi")  # what a CPU tensor resolves to over MPI

# mpilab's own communicators (dups of COMM_WORLD): one for the collectives here, one for
# DataParallel's communication thread (two threads must not share a communicator).
_comms: dict[str, Any] = {}
# the ones the last recovery replaced: freed by the next (see _renew_comms)
_retired: list[Any] = []
# the ones a recovery replaced where a broadcast may have been left half done: never
# freed (see _broadcast_left_behind)
_quarantined: list[Any] = []
# the number of the first collective on the current ones (the recovery that made them
# aligns every rank's numbers to the highest)
_first_number = [1]


def _make_comms(interruptible: bool = True) -> None:
    """Create both communicators and their allreduce plans, on every rank together.

    The bootstrap calls this eagerly (through prepare_communicators), so no rank ever
    blocks in creating them later while a failed peer never arrives.
    """
    world = context().comm
    for name in ("collectives", "data_parallel"):
        if interruptible:
            comm, request = world.Idup()
            wait_interruptibly(request)
        else:
            comm = world.Dup()
        plan_for(comm)
        _comms[name] = comm


def _renew_comms() -> None:
    """Recovery (all ranks present, abort still set): the old ones are out of step, and
    so are the tensors' plans made over them.

    The ones the previous recovery replaced are freed now (fast_allreduce.free, on every
    rank in the same order, as recovery runs): each recovery makes about nine
    communicators, and MPICH gives a process 2,048, so a notebook whose cells were
    stopped some 220 times in collectives could recover no more. Not the ones replaced
    now: a hook that runs after this one (DataParallel's communication thread) may
    still hold them. Nor ones where a broadcast may have been left half done
    (`_broadcast_left_behind`): those are kept for good."""
    _plans.clear()
    while _retired:
        free(_retired.pop(0))
    (_quarantined if _broadcast_left_behind() else _retired).extend(_comms.values())
    _make_comms(interruptible=False)


def _broadcast_left_behind() -> bool:
    """Whether a broadcast may have completed on some ranks and not begun on others,
    judged alike on every rank from all ranks' collective numbers and last collectives
    (the agent's `seq` and `recent`; a recovery hook, before they are aligned).

    A broadcast's root, and the ranks above a leaf in its tree, finish without the leaf.
    If the leaf never began it, their messages wait in MPI's queues on the leaf, and no
    request of anyone's holds the communicator, so once freed its context can go to a
    communicator made later, whose broadcasts would take them for their own: the leaf
    gets the stopped broadcast's data, and from then on each broadcast's data one call
    late, without an error (seen with two ranks and MPI_Bcast_init). MPI offers no way
    to receive a collective's stray messages. Every other collective of mpilab's needs
    every rank's part before any rank finishes it, so a rank that began it holds the
    communicator until it completes, which it never does; point-to-point messages are
    drained before a free (`waiting.drain`)."""
    state = agent_mod.current().state
    everyone = context().comm.allgather((state.seq, [item[:2] for item in state.recent]))
    low = max(_first_number[0], min(seq for seq, _ in everyone))
    _first_number[0] = max(seq for seq, _ in everyone) + 1
    for seq, recent in everyone:
        ops = dict(recent)
        if any(ops.get(number, "broadcast") == "broadcast" for number in range(low, seq + 1)):
            return True  # a broadcast among them, or one beyond the ones kept
    return False


def _renew_torch_group() -> None:
    """Recovery hook (every rank, after _renew_comms): torch_group decides over the
    renewed communicator whether the torch.distributed group must be made again."""
    torch_group.recover_group(_comms["collectives"])


def private_comm(name: str = "collectives") -> Any:
    """One of mpilab's communicators: "collectives" or "data_parallel"."""
    if not _comms:
        _make_comms()
        waiting.on_recover(_renew_comms)
        waiting.on_recover(_renew_torch_group)
    return _comms[name]


def prepare_communicators(ctx: Any = None) -> None:
    """A start-up hook of the bootstrap: make mpilab's communicators and their
    shared-memory plans now, on every rank together.

    Made lazily, a rank whose peer failed before its first collective would block in
    their creation (a blocking, uninterruptible MPI call) instead of in a wait mpilab
    can release.
    """
    private_comm()


def tensor_bytes(tensors: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """The bytes of a tensor, or of a list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


def check_tensor_argument(what: str, value: Any, many: bool = False) -> None:
    """A clear TypeError for what is not a tensor (or, where `many`, a list or tuple of
    tensors), saying how to make one: the call would fail deeper down, naming a method
    the value lacks. `what`: the argument, as "mpilab.broadcast's tensor"."""
    if isinstance(value, torch.Tensor):
        return
    if many and isinstance(value, (list, tuple)):
        wrong = next((v for v in value if not isinstance(v, torch.Tensor)), None)
        if wrong is None:
            return
        raise TypeError(f"{what} must be a tensor or a list of tensors, got a "
                        f"{type(value).__name__} holding {_kind(wrong)}: make each a tensor "
                        "(torch.as_tensor)")
    taken = "a tensor or a list of tensors" if many else "a tensor"
    how = ("torch.from_numpy(a) shares the array's memory, so the result lands in the array"
           if isinstance(value, np.ndarray) else "torch.as_tensor makes one")
    raise TypeError(f"{what} must be {taken}, got {_kind(value)}: {how}")


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return "a numpy array"
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _host_buffer(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `dtype` with `tensor`'s values (`tensor` itself if it can).

    A GPU tensor is staged through pinned memory: the copy is queued without blocking and
    waited for interruptibly (a peer's failure must not leave this rank in a copy).
    """
    if tensor.device.type == "cpu":
        if tensor.dtype == dtype and tensor.is_contiguous():
            return tensor
        return tensor.detach().to(dtype=dtype).contiguous()
    host = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    waiting.wait_device(tensor.device)
    return host


def _copy_back(tensor: torch.Tensor, buf: torch.Tensor) -> None:
    """`buf`'s values into `tensor` (a pinned stage goes back without blocking: the
    caching host allocator keeps it until the copy has run)."""
    if buf is not tensor:
        tensor.copy_(buf, non_blocking=tensor.device.type != "cpu")


def _as_bytes(buf: torch.Tensor) -> Any:
    """A zero-copy uint8 NumPy view (works for every dtype, bfloat16 included)."""
    return buf.detach().view(-1).view(torch.uint8).numpy()


# ------------------------------------------------------------ per-tensor plans (CPU, MPI)
class TensorPlan:
    """How one CPU tensor travels on mpilab's MPI path: made at its first collective and
    kept while the tensor lives with the same storage, shape and dtype, contiguous (checked
    at every call, in C: ``_collective.planned``).

    Why: a collective on a small tensor takes well under a microsecond on shared memory
    (the engine's one-piece collectives, in C, bound here to the tensor's address), and
    what a call would otherwise redo each time (a NumPy view, the byte count, the
    shape's text, the choice of path) costs several times that. A tensor reduced again
    and again (a metric every step, a buffer) pays for them once. Its reductions (by op),
    broadcasts (by root) and gathers into a tensor with a plan (by its id) are kept as
    (kept context, function) pairs (a gather's with the receiving tensor's plan), which
    ``_collective.run_planned`` runs in one call from the public functions.

    The NumPy views do not own the tensor's memory (an owning view would keep the
    tensor alive from this cache); they are used only once the checks have shown that
    the tensor, alive as the caller's argument, still has that memory.
    """

    __slots__ = ("ref", "ptr", "shape", "dtype", "nbytes", "size", "raw", "array",
                 "mean", "reduce", "broadcast", "gather", "gathered_shape",
                 "engine", "reductions", "broadcasts", "gathers", "contexts")

    def reducer(self, op: str) -> Callable[[], None]:
        """The function that reduces the tensor in place for `op` (sum, mean, max, min;
        a mean sums, then divides): the shared-memory engine's one-piece allreduce of
        this buffer where it fits, else the path's general function. Made once per op."""
        entry = self.reductions.get(op)
        if entry is None:
            wire_op, engine = WIRE_OP[op], self.engine
            run = engine.small_allreduce(self.ptr, self.array.dtype, self.array.size,
                                         wire_op) if engine is not None else None
            if run is None:
                run = functools.partial(self.reduce, self.array, wire_op)
            if op == "mean":
                run = functools.partial(_then, run, functools.partial(self.mean, self.array))
            entry = self.reductions[op] = (self.contexts["allreduce"], run)
        return entry[1]

    def broadcaster(self, root: int) -> Callable[[], None]:
        """The function that broadcasts the tensor from `root` (a rank). Made once per root."""
        entry = self.broadcasts.get(root)
        if entry is None:
            entry = self.broadcasts[root] = (self.contexts["broadcast"],
                                             functools.partial(self.broadcast, root))
        return entry[1]

    def gatherer(self, target: TensorPlan) -> Callable[[], None]:
        """The function that gathers every rank's tensor into `target`'s tensor (of shape
        gathered_shape and this dtype, with a plan). Made once per receiving plan."""
        key = id(target.ref())
        entry = self.gathers.get(key)
        if entry is None or entry[2] is not target:
            if len(self.gathers) >= _MAX_GATHER_TARGETS:
                self.gathers.clear()
            entry = self.gathers[key] = (self.contexts["allgather"],
                                         functools.partial(self.gather, target.ptr), target)
        return entry[1]


def _then(first: Callable[[], None], second: Callable[[], None]) -> None:
    first()
    second()


_plans: dict[int, TensorPlan] = {}
_MAX_GATHER_TARGETS = 16  # receiving buffers a plan keeps a gather for at once
_MAX_PLANS = 4096  # tensors whose plans are kept at once (a plan goes with its tensor)


def tensor_plan(tensor: Any) -> TensorPlan | None:
    """The plan of a CPU tensor for mpilab's MPI path, made at the first call; None for
    anything the general path takes (a list, a GPU, empty or non-contiguous tensor, a
    process without mpilab)."""
    plan = planned(_plans, tensor)
    if plan is not None:
        return plan
    if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu"
            or tensor.layout != torch.strided or not tensor.is_contiguous()
            or tensor.numel() == 0 or tensor.is_neg() or tensor.is_conj()
            or not is_initialized()):
        return None
    return _make_plan(tensor)


def _make_plan(tensor: torch.Tensor) -> TensorPlan:
    comm = private_comm()
    plan = TensorPlan()
    key = id(tensor)
    plan.ref = weakref.ref(tensor, functools.partial(_drop_plan, key))
    plan.ptr, plan.shape = tensor.data_ptr(), tensor.shape
    plan.dtype = tensor.dtype
    plan.size = comm.Get_size()
    plan.nbytes = tensor.numel() * tensor.element_size()
    plan.raw = _byte_view(plan.ptr, plan.nbytes)
    # reduced in place through a NumPy view where the dtype travels as it is; the
    # others (16-bit floats) take the general path, which widens them
    numpy_dtype = reduction.NUMPY_DTYPES.get(tensor.dtype) \
        if reduction.host_dtype(tensor.dtype) is tensor.dtype else None
    plan.array = None if numpy_dtype is None else plan.raw.view(numpy_dtype)
    plan.mean = None if numpy_dtype is None else \
        reduction.array_mean(plan.size, tensor.is_floating_point(), numpy_dtype)
    plan.gathered_shape = (plan.size, *plan.shape)
    route = plan_for(comm)
    plan.reduce = reducer(comm)
    plan.engine = route.node if route.path == "shm" else None
    plan.reductions, plan.broadcasts, plan.gathers = {}, {}, {}
    # the main thread's heartbeat and span context of each collective (waiting.reuse)
    plan.contexts = {kind: waiting.kept_collective(kind, plan.nbytes, plan.shape)
                     for kind in ("allreduce", "broadcast", "allgather")}
    # broadcast: a function of the root; gather: of the receive buffer's address
    gathered = plan.nbytes * plan.size
    if route.path == "shm":
        # the engine's one-piece collectives of this buffer where it fits in one piece.
        # The engine's ranks announce which collective they are in with every arrival:
        # ranks in different collectives at the same number wait, as MPI's would, until
        # the watchdog names the mismatch (they never complete against each other)
        engine = route.node
        plan.broadcast = engine.small_broadcast(plan.ptr, plan.nbytes) or \
            functools.partial(engine.broadcast, plan.raw)
        plan.gather = engine.small_allgather(plan.ptr, plan.nbytes) or \
            functools.partial(_gather_into, engine.allgather, plan.raw, gathered)
    else:
        # small ones by MPI's persistent collectives, in one C call (`persistent`), but an
        # allgather that goes through the nodes' shared memory (`across_nodes`)
        broadcast = functools.partial(_mpi_broadcast, comm, plan.raw)
        gather = functools.partial(_gather_into, functools.partial(_mpi_allgather, comm),
                                   plan.raw, gathered)
        plan.broadcast = route.persistent.small_broadcast(plan.ptr, plan.nbytes, broadcast) \
            or broadcast
        plan.gather = gather if across_nodes.takes_allgather(route, plan.nbytes) else \
            route.persistent.small_allgather(plan.ptr, plan.nbytes, gather) or gather
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan
    return plan


def _drop_plan(key: int, ref: weakref.ref) -> None:
    """A tensor with a plan is gone: its plan goes too (unless the id has a newer one)."""
    plan = _plans.get(key)
    if plan is not None and plan.ref is ref:
        del _plans[key]


@functools.lru_cache(maxsize=64)
def _byte_view(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 NumPy array over `nbytes` of memory at `ptr`, not owning it; kept for the
    next call with the same memory (with a view made afresh at every call, gathering
    8 KiB parts between two emulated hosts took 8-10 µs longer a call, one-off)."""
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), np.uint8)


def _gather_into(gather: Callable[[np.ndarray, np.ndarray], None], send: np.ndarray,
                 nbytes: int, address: int) -> None:
    gather(send, _byte_view(address, nbytes))


def _mpi_broadcast(comm: Any, raw: np.ndarray, root: int) -> None:
    """A small message by MPI's persistent broadcast (`persistent`); a larger one, over
    several nodes with shared memory within them, through it and between the nodes by
    point-to-point messages (`across_nodes`); else MPI's broadcast over every rank."""
    route = plan_for(comm)
    if route.persistent.broadcast(raw, root):
        return
    if route.places is not None:
        across_nodes.broadcast(route, raw, root)
    else:
        route.wait(comm.Ibcast(raw, root=root))


def _mpi_allgather(comm: Any, send: np.ndarray, recv: np.ndarray) -> None:
    """Through the nodes' shared memory where every node's ranks are consecutive and
    each rank's part is large enough (`across_nodes.takes_allgather`); else MPI's
    allgather over every rank (the plan's, persistent where small)."""
    route = plan_for(comm)
    if across_nodes.takes_allgather(route, send.nbytes):
        across_nodes.allgather(route, send, recv)
    else:
        route.allgather(send, recv)


def allreduce(tensor: torch.Tensor | Sequence[torch.Tensor], op: str = "sum",
              backend: str = "auto") -> Any:
    """Reduce `tensor` across ranks in place and return it; a list goes through tensor fusion.

    op: sum | mean | max | min (the mean of integer tensors rounds down).
    """
    if backend in _HOST_TRANSPORTS and run_planned(_plans, tensor, "reductions", op):
        return tensor  # a CPU tensor over mpilab's MPI path, by its plan, in one C call
    plan = tensor_plan(tensor)
    if plan is not None and plan.array is not None and backend in _HOST_TRANSPORTS \
            and op in WIRE_OP:
        # its plan's first call for `op`, or not on the main thread: no per-call views or
        # strings either
        waiting.reuse(plan.contexts["allreduce"]).run(plan.reducer(op))
        return tensor
    context()
    reduction.check_reduce_op(op)
    check_tensor_argument("mpilab.allreduce's tensor", tensor, many=True)
    if isinstance(tensor, (list, tuple)):
        nbytes = tensor_bytes(tensor)
        with waiting.collective("allreduce", nbytes, f"{len(tensor)} tensors"):
            return grouped_allreduce(list(tensor), op=op, backend=backend, comm=private_comm())
    chosen = torch_group.resolve_transport(backend, tensor)
    with waiting.collective("allreduce", tensor_bytes(tensor), tensor.shape):
        if chosen == "mpi":
            _mpi_allreduce(tensor, op)
        else:
            _torch_allreduce(tensor, op)
    return tensor


def _unreduced_hint(dtype: torch.dtype) -> str:
    """What to do with a tensor of a dtype the reductions do not take."""
    if dtype == torch.bool:
        return "t.to(torch.uint8) reduced with op='max' is any, with op='min' all"
    if dtype.is_complex:
        return "torch.view_as_real(t) is a float view of the same memory: reduce that"
    return "make it a float or integer tensor"


def _mpi_allreduce(tensor: torch.Tensor, op: str) -> None:
    if tensor.dtype not in reduction.HOST_DTYPES:
        raise TypeError(f"mpilab.allreduce does not reduce {tensor.dtype} tensors: "
                        + _unreduced_hint(tensor.dtype))
    buf = _host_buffer(tensor, reduction.host_dtype(tensor.dtype))
    reduction.allreduce_host(buf, op, private_comm())
    with torch.no_grad():
        _copy_back(tensor, buf)


def _torch_allreduce(tensor: torch.Tensor, op: str) -> None:
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    reduction.allreduce_torch(buf, op)
    if buf is not tensor:
        with torch.no_grad():
            tensor.copy_(buf)


def broadcast(tensor: torch.Tensor, root: int = 0, backend: str = "auto") -> torch.Tensor:
    """Copy rank `root`'s `tensor` into `tensor` on every rank; returns it."""
    if backend in _HOST_TRANSPORTS and run_planned(_plans, tensor, "broadcasts", root):
        return tensor  # as allreduce does
    plan = tensor_plan(tensor)
    if plan is not None and backend in _HOST_TRANSPORTS and type(root) is int \
            and 0 <= root < plan.size:
        waiting.reuse(plan.contexts["broadcast"]).run(plan.broadcaster(root))
        return tensor
    ctx = context()
    check_tensor_argument("mpilab.broadcast's tensor", tensor)
    try:
        root = operator.index(root)
    except TypeError:
        raise TypeError(f"mpilab.broadcast's root is a rank number, got "
                        f"{type(root).__name__} {root!r}") from None
    if not 0 <= root < ctx.world_size:
        raise ValueError(f"root {root} is not a rank of this {ctx.world_size}-rank cluster")
    chosen = torch_group.resolve_transport(backend, tensor)
    with waiting.collective("broadcast", tensor_bytes(tensor), tensor.shape), \
            torch.no_grad():
        if chosen == "mpi":
            buf = _host_buffer(tensor, tensor.dtype)
            _mpi_broadcast(private_comm(), _as_bytes(buf), root)
            _copy_back(tensor, buf)
        else:
            import torch.distributed as dist

            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            torch_group.wait_work(dist.broadcast(buf, src=root, async_op=True))
            if buf is not tensor:
                tensor.copy_(buf)
    return tensor


def allgather_json(obj: Any, what: str) -> list:
    """Every rank's `obj` (plain data), in rank order, through interruptible collectives
    (no pickle): a rank the stop button ends leaves no other rank blocked in C, as a
    blocking mpi4py call would. `what` names it in the ranks' heartbeats."""
    from mpi4py import MPI

    data = json.dumps(obj).encode()
    sizes = allgather(torch.tensor([len(data)], dtype=torch.int64)).view(-1).tolist()
    displs = [0, *itertools.accumulate(sizes)][:-1]
    recv = bytearray(sum(sizes))
    with waiting.collective("allgather", len(recv), what):  # the same bytes on every rank
        comm = private_comm()
        plan_for(comm).wait(comm.Iallgatherv([data, MPI.BYTE], [recv, sizes, displs, MPI.BYTE]))
    return [json.loads(recv[d:d + n]) for d, n in zip(displs, sizes, strict=True)]


def allgather(tensor: torch.Tensor, backend: str = "auto",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's `tensor` stacked: a tensor of shape [world_size, *tensor.shape].

    A new one, or `out` (that shape, dtype and device) filled and returned: a buffer
    reused across calls costs no allocation, which for tensors of tens of MiB means
    thousands of page faults per call.
    """
    if out is not None and backend in _HOST_TRANSPORTS \
            and run_planned(_plans, tensor, "gathers", id(out), out):
        return out  # as allreduce does
    plan = tensor_plan(tensor)
    if plan is not None and backend in _HOST_TRANSPORTS:
        if out is None:
            out = torch.empty(plan.gathered_shape, dtype=plan.dtype)
            run = functools.partial(plan.gather, out.data_ptr())
        else:
            target = tensor_plan(out)
            if (target is None or target.shape != plan.gathered_shape
                    or target.dtype is not plan.dtype):
                return _allgather(tensor, backend, out)
            run = plan.gatherer(target)
        waiting.reuse(plan.contexts["allgather"]).run(run)
        return out
    return _allgather(tensor, backend, out)


def _allgather(tensor: torch.Tensor, backend: str, out: torch.Tensor | None) -> torch.Tensor:
    ctx = context()
    check_tensor_argument("mpilab.allgather's tensor", tensor)
    if out is not None:
        check_tensor_argument("mpilab.allgather's out", out)
    chosen = torch_group.resolve_transport(backend, tensor)
    shape = (ctx.world_size, *tensor.shape)
    if out is not None and (tuple(out.shape) != shape or out.dtype != tensor.dtype
                            or out.device != tensor.device):
        raise ValueError(
            f"allgather's out is {list(out.shape)} {out.dtype} on {out.device}, but the "
            f"result is {list(shape)} {tensor.dtype} on {tensor.device}: pass a tensor "
            "of that shape, dtype and device, or no out")
    result = out if out is not None and out.is_contiguous() else \
        torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    with waiting.collective("allgather", tensor_bytes(tensor), tensor.shape), \
            torch.no_grad():
        if chosen == "mpi":
            send = _host_buffer(tensor, tensor.dtype)
            recv = result if result.device.type == "cpu" else \
                torch.empty(shape, dtype=result.dtype, pin_memory=True)
            _mpi_allgather(private_comm(), _as_bytes(send), _as_bytes(recv))
            _copy_back(result, recv)
        else:
            import torch.distributed as dist

            torch_group.wait_work(dist.all_gather(list(result.unbind(0)),
                                                  tensor.contiguous(), async_op=True))
        if out is not None and result is not out:
            out.copy_(result)
    return out if out is not None else result


def barrier(backend: str = "auto") -> None:
    """Wait until every rank gets here (MPI unless backend="torch")."""
    context()
    chosen = torch_group.resolve_transport(backend, None)
    with waiting.collective("barrier"):
        if chosen == "mpi":
            route = plan_for(private_comm())
            if route.path == "shm":
                route.node.sync()  # MPI's Ibarrier, polled, takes ~50 µs on one node
            else:
                route.wait(private_comm().Ibarrier())
        else:
            import torch.distributed as dist

            torch_group.wait_work(dist.barrier(async_op=True))

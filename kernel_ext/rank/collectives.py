"""Instrumented, interruptible collectives on tensors: allreduce, broadcast, allgather, barrier.

Every call is announced to the rank agent (``waiting.collective``) so heartbeats show which
collective a rank is in and the dashboard gets a comm span; every wait polls a
non-blocking request so the notebook's stop button lands within milliseconds.

Two transports: MPI (mpi4py on NumPy views of CPU tensors; GPU tensors are staged
through pinned host memory) and torch.distributed (gloo on CPU, NCCL on GPU).
``backend="auto"`` picks torch.distributed for a GPU tensor when the ranks' group runs a
GPU backend on it (NCCL), and MPI otherwise: for CPU tensors (mpilab's shared-memory
path beats gloo), and for GPU tensors of ranks that share GPUs over gloo. mpilab's own
MPI traffic runs on a private duplicate of COMM_WORLD, so a user's messages on ``comm``
can never match mpilab's.

After an abort (``waiting.recover``), the torch.distributed group is aborted and made
again on every rank when it may hold a broken collective: always for NCCL (a user's
direct call may have left one queued on the GPU), and for gloo when a wait on it was
abandoned. A group torch cannot abort makes the recovery fail, and the notebook then
restarts the ranks.

GPU placement (one rank per GPU, by node-local rank) is checked here too, as plain
functions the bootstrap calls: ``gpu_for_rank`` and ``placement_error``.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from . import bootstrap, waiting
from .fast_allreduce import allreduce_inplace, plan_for, reducer
from .waiting import wait_interruptibly

OPS = ("sum", "mean", "max", "min")
BACKENDS = ("auto", "mpi", "torch")
# MPI has no bfloat16 and half-precision sums lose accuracy: reduce these in float32.
_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_MPI_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
               torch.int64, torch.int8, torch.uint8}
# reduced as they are, through a NumPy view of the tensor (the others are widened first)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64,
                 torch.int32: np.int32, torch.int64: np.int64, torch.int8: np.int8,
                 torch.uint8: np.uint8}
_HOST_BACKENDS = ("auto", "mpi")  # what a CPU tensor resolves to over MPI
_REDUCE = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}  # op -> MPI's op

# mpilab's own communicators (dups of COMM_WORLD): one for the collectives here, one for
# DataParallel's communication thread (two threads must not share a communicator).
_comms: dict[str, Any] = {}


def _make_comms(interruptible: bool = True) -> None:
    """Create both communicators and their allreduce plans, on every rank together.

    The bootstrap calls this eagerly (through private_comm), so no rank ever blocks in
    creating them later while a failed peer never arrives.
    """
    from .fast_allreduce import plan_for

    world = bootstrap.context().comm
    for name in ("collectives", "data_parallel"):
        if interruptible:
            comm, request = world.Idup()
            wait_interruptibly(request)
        else:
            comm = world.Dup()
        plan_for(comm)
        _comms[name] = comm


def _renew_comms() -> None:
    """Recovery (all ranks present, abort still set): the old ones are out of step."""
    _make_comms(interruptible=False)


def private_comm(name: str = "collectives") -> Any:
    """One of mpilab's communicators: "collectives" or "data_parallel"."""
    if not _comms:
        _make_comms()
        waiting.on_recover(_renew_comms)
        waiting.on_recover(_renew_torch_group)
    return _comms[name]


# ------------------------------------------------------------------ choosing a backend
@functools.lru_cache(maxsize=16)
def device_backends(backend: str) -> dict[str, str]:
    """The backend serving each device type in a group of `backend`: 'nccl' →
    {'cuda': 'nccl'}, 'gloo' → {'cpu': 'gloo', 'cuda': 'gloo'}, 'cpu:gloo,cuda:nccl' as
    written."""
    from torch.distributed import distributed_c10d as c10d

    return dict(c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map())


def group_backends() -> dict[str, str]:
    """What the ranks' default torch.distributed group runs on each device type ({}
    without one)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    return device_backends(str(dist.get_backend()))


def auto_backend(device_type: str, backends: dict[str, str]) -> str:
    """"torch" where the group runs a device backend on `device_type` (NCCL on CUDA):
    the GPU's own interconnect, no host staging. "mpi" otherwise: CPU tensors (mpilab's
    shared-memory allreduce), and GPU tensors of a gloo group (GPUs shared by ranks),
    staged through pinned memory."""
    if device_type == "cpu":
        return "mpi"
    chosen = backends.get(device_type)
    return "torch" if chosen is not None and chosen != "gloo" else "mpi"


def resolve_backend(backend: str, tensor: torch.Tensor | None) -> str:
    """auto → see auto_backend (a barrier, with no tensor, goes over MPI)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if tensor is None or tensor.device.type == "cpu":
        return "mpi"
    return auto_backend(tensor.device.type, group_backends())


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}")


def _divide(buf: torch.Tensor, world_size: int) -> None:
    """The mean from the sum; integer means round down (as tensor fusion does)."""
    if buf.is_floating_point():
        buf.div_(world_size)
    else:
        buf.div_(world_size, rounding_mode="floor")


def tensor_bytes(tensors: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """The bytes of a tensor, or of a list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


# A wait on a torch.distributed work was given up since the last recovery: its group
# may hold a collective the peers never joined.
_abandoned = [False]
_generation = [0]  # groups that recovery made; DataParallel rebuilds DDP when it moves


def abandoned_torch_work() -> None:
    """Note that this rank gave up waiting on a torch.distributed work (see recovery)."""
    _abandoned[0] = True


def torch_group_generation() -> int:
    """How many times recovery made the torch.distributed group again (DDP holds the
    group it was made with, so a wrapper made before must be made again)."""
    return _generation[0]


def wait_work(work: Any) -> None:
    """Wait for a torch.distributed Work handle, staying responsive to signals and aborts."""
    try:
        waiting.poll(work.is_completed)
    except BaseException:
        abandoned_torch_work()
        raise
    work.wait()  # raises the collective's error, if any


def wait_device(device: torch.device) -> None:
    """Wait, interruptibly, until the work queued on `device`'s current stream has run
    (a CUDA event polled; nothing to wait for on CPU)."""
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    waiting.poll(event.query)


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
    wait_device(tensor.device)
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
    at every call, about a microsecond).

    Why: a collective on a small tensor takes a few microseconds on shared memory, and
    what a call would otherwise redo each time (a NumPy view, the byte count, the
    shape's text, the choice of path) costs several times that. A tensor reduced again
    and again (a metric every step, a buffer) pays for them once.

    The NumPy views do not own the tensor's memory (an owning view would keep the
    tensor alive from this cache); they are used only once the checks have shown that
    the tensor, alive as the caller's argument, still has that memory.
    """

    __slots__ = ("ref", "ptr", "shape", "dtype", "comm", "nbytes", "size", "raw", "array",
                 "world", "floating", "reduce", "broadcast", "gather", "gathered_shape",
                 "gathered_bytes", "engine", "small")

    def reducer(self, op: str) -> Callable[[np.ndarray], None]:
        """The function that reduces `array` for `op` (sum, mean, max, min; a mean sums):
        a one-shot of shared memory made for this tensor's size where there is one, else
        the path's general function. Made once per op."""
        run = self.small.get(op)
        if run is None:
            mpi_op, engine = _REDUCE[op], self.engine
            run = engine.small_allreduce(self.array.dtype, self.array.size, mpi_op) \
                if engine is not None else None
            if run is None:
                run = functools.partial(_call_with_op, self.reduce, mpi_op)
            self.small[op] = run
        return run


def _call_with_op(reduce: Callable[[np.ndarray, str], None], op: str,
                  array: np.ndarray) -> None:
    reduce(array, op)


_plans: dict[int, TensorPlan] = {}
_MAX_PLANS = 4096  # tensors whose plans are kept at once (a plan goes with its tensor)


def tensor_plan(tensor: Any) -> TensorPlan | None:
    """The plan of a CPU tensor for mpilab's MPI path, made at the first call; None for
    anything the general path takes (a list, a GPU, empty or non-contiguous tensor, a
    process without mpilab)."""
    plan = _plans.get(id(tensor))
    if (plan is not None and plan.ref() is tensor and plan.comm is _comms.get("collectives")
            and tensor.data_ptr() == plan.ptr and tensor.shape == plan.shape
            and tensor.dtype is plan.dtype and tensor.is_contiguous()):
        return plan
    if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu"
            or tensor.layout != torch.strided or not tensor.is_contiguous()
            or tensor.numel() == 0 or tensor.is_neg() or tensor.is_conj()
            or not bootstrap.is_initialized()):
        return None
    return _make_plan(tensor)


def _make_plan(tensor: torch.Tensor) -> TensorPlan:
    comm = private_comm()
    plan = TensorPlan()
    key = id(tensor)
    plan.ref = weakref.ref(tensor, functools.partial(_drop_plan, key))
    plan.ptr, plan.shape = tensor.data_ptr(), tensor.shape
    plan.dtype, plan.comm = tensor.dtype, comm
    plan.size = comm.Get_size()
    plan.nbytes = tensor.numel() * tensor.element_size()
    plan.raw = _byte_view(plan.ptr, plan.nbytes)
    numpy_dtype = _NUMPY_DTYPES.get(tensor.dtype)
    plan.array = None if numpy_dtype is None else plan.raw.view(numpy_dtype)
    plan.world = None if numpy_dtype is None else numpy_dtype(plan.size)
    plan.floating = tensor.is_floating_point()
    plan.gathered_shape = (plan.size, *plan.shape)
    plan.gathered_bytes = ctypes.c_char * (plan.nbytes * plan.size)
    route = plan_for(comm)
    plan.reduce = reducer(comm)
    plan.engine = route.node if route.path == "shm" else None
    plan.small = {}
    if route.path == "shm":
        # one-shots made for this size where it fits in one piece or chunk. The engine's
        # ranks announce which collective they are in with every arrival: ranks in
        # different collectives at the same number wait, as MPI's would, until the
        # watchdog names the mismatch (they never complete against each other)
        engine = route.node
        plan.broadcast = engine.small_broadcast(plan.nbytes) or engine.broadcast
        plan.gather = engine.small_allgather(plan.nbytes) or engine.allgather
    else:
        plan.broadcast = functools.partial(_mpi_broadcast, comm)
        plan.gather = functools.partial(_mpi_allgather, comm)
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan
    return plan


def _drop_plan(key: int, ref: weakref.ref) -> None:
    """A tensor with a plan is gone: its plan goes too (unless the id has a newer one)."""
    plan = _plans.get(key)
    if plan is not None and plan.ref is ref:
        del _plans[key]


def _byte_view(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 NumPy array over `nbytes` of memory at `ptr`, not owning it."""
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), np.uint8)


def _mpi_broadcast(comm: Any, raw: np.ndarray, root: int) -> None:
    wait_interruptibly(comm.Ibcast(raw, root=root))


def _mpi_allgather(comm: Any, send: np.ndarray, recv: np.ndarray) -> None:
    wait_interruptibly(comm.Iallgather(send, recv))


def allreduce(tensor: torch.Tensor | Sequence[torch.Tensor], op: str = "sum",
              backend: str = "auto") -> Any:
    """Reduce `tensor` across ranks in place and return it; a list goes through tensor fusion.

    op: sum | mean | max | min (the mean of integer tensors rounds down).
    """
    plan = tensor_plan(tensor)
    if plan is not None and plan.array is not None and backend in _HOST_BACKENDS \
            and op in _REDUCE:
        # a CPU tensor over mpilab's MPI path: its plan, no per-call views or strings
        run = plan.small.get(op) or plan.reducer(op)
        with waiting.collective("allreduce", plan.nbytes, plan.shape):
            run(plan.array)
            if op == "mean":  # torch's division of the old path, bit for bit
                (np.divide if plan.floating else np.floor_divide)(
                    plan.array, plan.world, out=plan.array)
        return tensor
    bootstrap.context()
    _check_op(op)
    if isinstance(tensor, (list, tuple)):
        from .fusion import grouped_allreduce

        nbytes = tensor_bytes(tensor)
        with waiting.collective("allreduce", nbytes, f"{len(tensor)} tensors"):
            return grouped_allreduce(list(tensor), op=op, backend=backend, comm=private_comm())
    chosen = resolve_backend(backend, tensor)
    with waiting.collective("allreduce", tensor_bytes(tensor), tensor.shape):
        if chosen == "mpi":
            _mpi_allreduce(tensor, op)
        else:
            _torch_allreduce(tensor, op)
    return tensor


def _mpi_allreduce(tensor: torch.Tensor, op: str) -> None:
    if tensor.dtype not in _MPI_DTYPES:
        raise TypeError(f"allreduce over MPI does not support {tensor.dtype}")
    buf = _host_buffer(tensor, _WIDEN.get(tensor.dtype, tensor.dtype))
    with torch.no_grad():
        array = buf.detach().view(-1).numpy()  # parameters too: no autograd on the wire
        allreduce_inplace(array, "sum" if op == "mean" else op, private_comm())
        if op == "mean":
            _divide(buf, bootstrap.context().world_size)
        _copy_back(tensor, buf)


def _torch_allreduce(tensor: torch.Tensor, op: str) -> None:
    import torch.distributed as dist

    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
                 "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    with torch.no_grad():
        wait_work(dist.all_reduce(buf, op=reduce_op, async_op=True))
        if op == "mean":
            _divide(buf, dist.get_world_size())
        if buf is not tensor:
            tensor.copy_(buf)


def broadcast(tensor: torch.Tensor, root: int = 0, backend: str = "auto") -> torch.Tensor:
    """Copy rank `root`'s `tensor` into `tensor` on every rank; returns it."""
    plan = tensor_plan(tensor)
    if plan is not None and backend in _HOST_BACKENDS and 0 <= root < plan.size:
        with waiting.collective("broadcast", plan.nbytes, plan.shape):
            plan.broadcast(plan.raw, root)
        return tensor
    ctx = bootstrap.context()
    if not 0 <= root < ctx.world_size:
        raise ValueError(f"root {root} is not a rank of this {ctx.world_size}-rank cluster")
    chosen = resolve_backend(backend, tensor)
    with waiting.collective("broadcast", tensor_bytes(tensor), tensor.shape), \
            torch.no_grad():
        if chosen == "mpi":
            buf = _host_buffer(tensor, tensor.dtype)
            wait_interruptibly(private_comm().Ibcast(_as_bytes(buf), root=root))
            _copy_back(tensor, buf)
        else:
            import torch.distributed as dist

            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            wait_work(dist.broadcast(buf, src=root, async_op=True))
            if buf is not tensor:
                tensor.copy_(buf)
    return tensor


def allgather(tensor: torch.Tensor, backend: str = "auto",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's `tensor` stacked: a tensor of shape [world_size, *tensor.shape].

    A new one, or `out` (that shape, dtype and device) filled and returned: a buffer
    reused across calls costs no allocation, which for tensors of tens of MiB means
    thousands of page faults per call.
    """
    plan = tensor_plan(tensor)
    if plan is not None and backend in _HOST_BACKENDS:
        if out is None:
            out = torch.empty(plan.gathered_shape, dtype=plan.dtype)
            recv = np.frombuffer(plan.gathered_bytes.from_address(out.data_ptr()), np.uint8)
        else:
            target = tensor_plan(out)
            if (target is None or target.shape != plan.gathered_shape
                    or target.dtype is not plan.dtype):
                return _allgather(tensor, backend, out)
            recv = target.raw
        with waiting.collective("allgather", plan.nbytes, plan.shape):
            plan.gather(plan.raw, recv)
        return out
    return _allgather(tensor, backend, out)


def _allgather(tensor: torch.Tensor, backend: str, out: torch.Tensor | None) -> torch.Tensor:
    ctx = bootstrap.context()
    chosen = resolve_backend(backend, tensor)
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
            wait_interruptibly(private_comm().Iallgather(_as_bytes(send), _as_bytes(recv)))
            _copy_back(result, recv)
        else:
            import torch.distributed as dist

            wait_work(dist.all_gather(list(result.unbind(0)), tensor.contiguous(),
                                      async_op=True))
        if out is not None and result is not out:
            out.copy_(result)
    return out if out is not None else result


def barrier(backend: str = "auto") -> None:
    """Wait until every rank gets here (MPI unless backend="torch")."""
    bootstrap.context()
    chosen = resolve_backend(backend, None)
    with waiting.collective("barrier"):
        if chosen == "mpi":
            route = plan_for(private_comm())
            if route.path == "shm":
                route.node.sync()  # MPI's Ibarrier, polled, takes ~50 µs on one node
            else:
                wait_interruptibly(private_comm().Ibarrier())
        else:
            import torch.distributed as dist

            wait_work(dist.barrier(async_op=True))


# ------------------------------------------------------- torch.distributed after an abort
class RecoveryError(RuntimeError):
    """The ranks' torch.distributed group cannot be made usable again: restart them."""


def needs_new_group(backends: dict[str, str], abandoned_anywhere: bool) -> bool:
    """Must recovery make the torch.distributed group again?

    NCCL (any device backend but gloo): always. Its collectives run on the GPU behind
    the host's back, so a rank whose host code was released may still have one queued
    that its peers never join (a direct ``dist.all_reduce`` returns at once), and
    nothing tells which. gloo: only when some rank abandoned a wait on it; a direct
    gloo call blocks its rank, which the notebook restarts instead.
    """
    if not backends:
        return False
    return abandoned_anywhere or any(b != "gloo" for b in backends.values())


def group_timeout(pg: Any = None) -> timedelta | None:
    """The collective timeout `pg` (default: the default group) was made with."""
    from torch.distributed import distributed_c10d as c10d

    pg = pg if pg is not None else c10d._get_default_group()
    for device_type in getattr(pg, "_device_types", ()):
        backend = pg._get_backend(torch.device(device_type))
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def _renew_torch_group() -> None:
    """Recovery hook (every rank, after _renew_comms): decide together, then renew."""
    from mpi4py import MPI

    backends = group_backends()
    anywhere = private_comm().allreduce(int(_abandoned[0]), op=MPI.MAX)
    if needs_new_group(backends, bool(anywhere)):
        renew_torch_group()
    _abandoned[0] = False


def renew_torch_group() -> None:
    """Abort every torch.distributed group of this rank and make the ranks' group
    again, over mpilab's store under a new prefix, with the same collective timeout
    (collective: every rank calls it, as recovery does).

    Aborting is what releases a collective stuck on the GPU (ncclCommAbort); the new
    communicator shares nothing with the old one. Groups the user made with
    ``new_group`` go too and must be made again.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    ctx = bootstrap.context()
    backend = str(dist.get_backend())
    if ctx.store is None:
        raise RecoveryError(
            f"torch.distributed's {backend} group was not made by mpilab, so it cannot be "
            "made again here: the ranks must be restarted")
    timeout = group_timeout()
    try:
        c10d._abort_process_group()
    except Exception as e:  # noqa: BLE001 - a group torch cannot abort: restart
        raise RecoveryError(
            f"torch {torch.__version__} cannot abort its {backend} group ({e}): the ranks "
            "must be restarted") from e
    _generation[0] += 1
    store = dist.PrefixStore(f"mpilab-recovered/{_generation[0]}/", ctx.store)
    # torch's own init: torchrun.py's stand-in would treat this as the user's call
    init = inspect.unwrap(c10d.init_process_group)
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if ctx.device.type == "cuda":
        kwargs["device_id"] = ctx.device  # the communicator now, while every rank is here
    init(ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, **kwargs)
    _adopt(c10d._get_default_group())


def _adopt(pg: Any) -> None:
    """torchrun.py's shared group is the new one (the user's destroy_process_group
    must keep it, as it kept the bootstrap's)."""
    from torch.distributed import distributed_c10d as c10d

    from . import torchrun

    groups = torchrun.shared_groups()
    if groups is not None:
        groups.mpilab_pg = pg
        groups.stand_in = None
        groups.before_user = set(c10d._world.pg_map)


# ------------------------------------------------------------------------ GPU placement
def gpu_for_rank(local_rank: int, gpus: Sequence[int]) -> int | None:
    """The GPU (an index among the visible ones, CUDA_VISIBLE_DEVICES applied) of the
    node-local rank `local_rank`: one rank per GPU, in order. Where Slurm binds each task
    to its own GPU, every rank sees one and takes it. Ranks past the GPUs wrap around
    and share; placement_error says when that cannot work. None: no GPU (CPU)."""
    if not gpus:
        return None
    return gpus[local_rank % len(gpus)]


def placement_error(gpu_ids: Sequence[str | None], backend: str,
                    host: str = "this node") -> str | None:
    """One line when ranks of one node would share a GPU under NCCL (it refuses two
    ranks on one GPU); None when the placement works.

    gpu_ids: for each node-local rank, the identity (UUID) of the GPU it took, or None
    on CPU. Identities, not indices: with Slurm's per-task binding every rank's GPU is
    its index 0. backend: the torch.distributed backend of the ranks' group; sharing
    GPUs works over gloo (mpilab's collectives then stage GPU tensors through MPI).
    """
    cuda_backend = device_backends(backend).get("cuda") if backend else None
    if cuda_backend in (None, "gloo"):
        return None
    users: dict[str, list[int]] = {}
    for local_rank, gpu in enumerate(gpu_ids):
        if gpu is not None:
            users.setdefault(gpu, []).append(local_rank)
    shared = next((ranks for ranks in users.values() if len(ranks) > 1), None)
    if shared is None:
        return None
    ranks, gpus = sum(len(r) for r in users.values()), len(users)
    return (f"{ranks} ranks on {host} but {gpus} GPU{'s' if gpus != 1 else ''} for them "
            f"(node-local ranks {shared[0]} and {shared[1]} would share one), and "
            f"{cuda_backend.upper()} cannot put two ranks on one GPU: start at most {gpus} "
            f"rank{'s' if gpus != 1 else ''} per node, or share the GPUs over gloo and "
            "MPI with --backend gloo")

"""mpilab.DataParallel: synchronous data-parallel training over MPI or torch.distributed.

``backend="auto"`` (the default) takes torch's DDP over NCCL for a model on a GPU whose
ranks' group runs NCCL, and mpilab's own path over MPI otherwise (CPU models; GPUs shared
by ranks over gloo). Why DDP rather than mpilab's buckets over NCCL on GPUs: DDP's
reducer runs its gradient hooks in C++, while mpilab's per-parameter hooks are Python on
autograd's device thread, the thread that launches the backward kernels; NCCL needs no
host staging, so the rest of mpilab's path (pinned buffers, the communication thread)
has nothing to add there. ``make gpu-check`` measures the result against torchrun + DDP.

``backend="mpi"`` is mpilab's own gradient synchronisation, in the manner of Theano-MPI
and Horovod: parameters are grouped into buckets in reverse order (the order backward
produces their gradients); a post-accumulate-grad hook copies each gradient, divided
by the number of ranks, into its bucket's flat buffer and points ``param.grad`` at that
slot, so later accumulation happens in place. A full bucket is handed at once to one
background communication thread that allreduces it (``reduction.allreduce_host`` on
the bucket's host buffer), so communication overlaps the rest of backward. A callback
queued on the autograd engine waits for every bucket at the end of backward, so
gradients are averaged before any optimizer step. A model on a GPU is staged through
pinned host memory (the copies are queued without blocking and waited for by polling
CUDA events).

Buckets are started strictly in index order and travel on one thread and one private
communicator, so every rank issues the same collectives in the same order.

``backend="torch"`` is torch's DistributedDataParallel with one comm hook of mpilab's
(``_TimedHook``) around a way of reducing a bucket: torch's own hooks for plain, fp16
and bf16 gradients (``_WholeBuckets``), mpilab's compressors for PowerSGD and top-k
(``compression.CompressedBuckets``). Each says what a bucket sends; the hook counts and
times it, and makes the end of backward wait (by polling) until the gradients are
averaged: on NCCL, DDP would otherwise leave that wait to the next host
sync, a blocking call no signal gets into. After recovery makes the torch.distributed
group again, the next forward makes the DDP wrapper again on it.

Autograd runs the hooks and the end-of-backward callbacks on a device thread for GPU
models while the main thread sits in ``backward()``: every wait there runs inside
``waiting.for_main_thread()`` (numbered, in the heartbeats, released by an abort), and
wrapping installs ``waiting.watch_interrupts()`` so the stop button reaches it. Both
backends emit one ``step`` record per synchronised step.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import agent as agent_mod
from . import collectives, ownership, reduction, torch_group, waiting
from .accounting import StepClock, TrafficMeter
from .compression import CompressedBuckets, CompressedGradSync, Method
from .compression import resolve as resolve_compression
from .context import context
from .host_memory import kept_zeros

PATHS = ("auto", "mpi", "torch")  # DataParallel's backend argument: how gradients travel
_WIRE_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DataParallelConfig:
    """How gradients travel; validated before anything collective happens."""

    backend: str = "auto"
    bucket_mb: float = 25.0
    compression: str | Method | None = None

    def __post_init__(self) -> None:
        if self.backend not in PATHS:
            raise ValueError(f"DataParallel backend {self.backend!r} is not one of "
                             f"{', '.join(PATHS)}")
        resolve_compression(self.compression)  # powersgd, topk: see compression.py
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")


def choose_path(requested: str, device_types: set[str],
                   backends: dict[str, str]) -> str:
    """DataParallel's path, "mpi" or "torch", for a model on `device_types` whose ranks'
    group runs `backends` (torch_group.group_backends). auto: DDP where the model sits
    on one kind of GPU that the group serves with its own backend (NCCL); mpilab's MPI
    path otherwise (see the module's docstring for why)."""
    if requested != "auto":
        return requested
    if len(device_types) == 1:
        (device_type,) = device_types
        if torch_group.auto_transport(device_type, backends) == "torch":
            return "torch"
    return "mpi"


# --------------------------------------------------------------------------- MPI backend
@dataclass(eq=False)
class _Bucket:
    """A group of parameters whose gradients travel together in one allreduce."""

    index: int
    params: list[nn.Parameter]
    slots: list[torch.Tensor]  # views of `flat`, one per parameter, shaped like it
    flat: torch.Tensor  # the gradients, in the parameters' dtype and device
    wire: torch.Tensor  # what is reduced: `flat`, or its half-precision copy
    host: torch.Tensor  # `wire` itself on CPU; a pinned host copy of it on GPU
    world_size: int
    ready: list[bool] = field(default_factory=list)
    n_ready: int = 0
    copied: Any = None  # CUDA event: the device-to-host copy is done
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    comm_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.wire.numel() * self.wire.element_size()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.done.clear()
        self.error = None


class _CommThread:
    """The one thread (and private communicator) that reduces DataParallel buckets.

    Shared by every DataParallel of the process: one FIFO keeps all ranks' collectives
    in the same order, and one communicator serves however often a cell rewraps.
    The thread calls MPI while the training thread may too (on other communicators),
    which needs MPI_THREAD_MULTIPLE: mpi4py asks for it by default and MPICH grants it
    (``MPI.Query_thread() == MPI.THREAD_MULTIPLE`` under mpiexec and in ipyparallel's
    MPI engines). Where an MPI grants less, buckets are reduced on the training thread
    as they fill: correct, without the overlap.
    """

    def __init__(self, comm: Any, threaded: bool):
        self.comm = comm
        self.queue: queue.SimpleQueue[_Bucket] = queue.SimpleQueue()
        self.threaded = threaded
        self.busy = False
        # buckets handed to the thread and not yet reduced (any thread may hand them)
        self._outstanding = 0
        self._count_lock = threading.Lock()
        if threaded:
            threading.Thread(target=self._run, name="mpilab-dp-comm", daemon=True).start()

    def submit(self, bucket: _Bucket) -> None:
        if self.threaded:
            with self._count_lock:
                self._outstanding += 1
            self.queue.put(bucket)
        else:
            self._process(bucket)

    def reduce_here_if_idle(self, bucket: _Bucket) -> bool:
        """Reduce `bucket` on the calling thread if the communication thread has nothing
        to do; False (nothing done) otherwise.

        For the buckets that fill at the end of backward: nothing is left to overlap
        them with, and handing one to the thread only adds two thread switches and a
        wake-up on a core the training uses (a 97k-parameter CNN has one bucket, and it
        is such a one). The lock keeps the thread from being handed a bucket meanwhile:
        one communicator, one collective at a time. Only a span records it, as on the
        thread: whether a rank reduces here depends on timing, so it takes no number.
        """
        if not self.threaded:
            return False
        with self._count_lock:
            if self._outstanding:
                return False
            self._process(bucket, numbered=False)
        return True

    def _run(self) -> None:
        while True:
            bucket = self.queue.get()
            self.busy = True
            self._process(bucket)
            with self._count_lock:
                self._outstanding -= 1
            self.busy = False

    def recover(self) -> None:
        """After an abort (every rank, together): drop queued buckets, take a new comm.

        The abort is still set while recovery hooks run, so the bucket in flight fails
        fast; each gradient sync's own reset (registered after this) then starts its
        next backward from a clean state.
        """
        while True:
            try:
                bucket = self.queue.get_nowait()
            except queue.Empty:
                break
            bucket.error = waiting.CollectiveAborted("dropped by recovery")
            bucket.done.set()
            with self._count_lock:
                self._outstanding -= 1
        while self.busy:  # its bucket fails fast: the abort is still set (no poll here)
            time.sleep(0.001)
        self.comm = collectives.private_comm("data_parallel")  # renewed by recovery

    def _process(self, bucket: _Bucket, numbered: bool | None = None) -> None:
        start = time.perf_counter()
        try:
            if bucket.copied is not None:  # the device-to-host copy, polled
                waiting.poll(bucket.copied.query)
            # numbered when reduced inline for the thread in backward (an MPI without
            # threads: every bucket, on every rank); spans only on the communication
            # thread, whose order is not the program's, and with numbered=False
            with (waiting.collective("dp_allreduce", bucket.nbytes, bucket.host.shape)
                  if numbered is None else agent_mod.current().collective(
                      "dp_allreduce", bucket.nbytes, bucket.host.shape, numbered)):
                self._reduce(bucket)
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            bucket.error = e
        bucket.comm_s = time.perf_counter() - start
        bucket.done.set()

    def _reduce(self, bucket: _Bucket) -> None:
        reduction.allreduce_host(bucket.host, "sum", self.comm)  # already divided


_comm_thread: _CommThread | None = None


def _shared_comm_thread() -> _CommThread:
    """Created at the first wrap, on mpilab's DataParallel communicator."""
    global _comm_thread
    if _comm_thread is None:
        from mpi4py import MPI

        threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        _comm_thread = _CommThread(collectives.private_comm("data_parallel"), threaded)
        waiting.on_recover(_comm_thread.recover)
    return _comm_thread


class _MPIGradSync:
    """Bucketed, overlapped gradient averaging over MPI for one model."""

    def __init__(self, model: nn.Module, cfg: DataParallelConfig, world_size: int,
                 clock: StepClock):
        params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = world_size
        self.clock = clock
        self.comm_thread = _shared_comm_thread()
        self.enabled = True
        self.buckets = _make_buckets(params, cfg, world_size)
        self.where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        # the gradient hooks' handles: DataParallel's claim on the model holds them
        self.hooks = []
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self.where[p] = (bucket, i)
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.reset()
        waiting.on_recover(self.reset)  # after the comm thread's recovery: it drains first

    def reset(self) -> None:
        """No bucket filled or in flight: the state between two steps."""
        for bucket in self.buckets:
            bucket.reset()
        self.next_bucket = 0
        self.pending = False

    def _on_grad(self, p: nn.Parameter) -> None:
        if self.enabled:  # on autograd's device thread, for a GPU model
            waiting.run_for_main(self._grad_ready, p)

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.pending:
            self.pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket, i = self.where[p]
        if bucket.ready[i]:
            return  # AccumulateGrad runs once per backward; never divide a gradient twice
        slot = bucket.slots[i]
        with torch.no_grad():  # average as we pack: one pass over the gradient, not two
            if p.grad.data_ptr() != slot.data_ptr():
                torch.div(p.grad, self.world_size, out=slot)
                p.grad = slot
            else:
                slot.div_(self.world_size)
        bucket.ready[i] = True
        bucket.n_ready += 1
        self._launch_ready()

    def _launch_ready(self, at_end: bool = False) -> None:
        """Start full buckets in index order, so every rank reduces them in one order.

        The last bucket waits for the end of backward (`at_end`, the step's numbered
        wait, which heartbeats show): it fills as backward ends, so nothing is left to
        overlap it with, and it is reduced on this thread where the communication thread
        is idle (_CommThread.reduce_here_if_idle)."""
        last = len(self.buckets) - 1
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if bucket.n_ready < len(bucket.params) or (self.next_bucket == last
                                                        and not at_end):
                return
            self._launch(bucket, at_end)
            self.next_bucket += 1

    def _launch(self, bucket: _Bucket, at_end: bool = False) -> None:
        with torch.no_grad():  # already divided by world_size: no fp16 overflow
            if bucket.wire is not bucket.flat:
                bucket.wire.copy_(bucket.flat)
            if bucket.host is not bucket.wire:
                bucket.host.copy_(bucket.wire, non_blocking=True)
                bucket.copied = torch.cuda.Event()
                bucket.copied.record()
        self.clock.nbytes += bucket.nbytes
        if not (at_end and self.comm_thread.reduce_here_if_idle(bucket)):
            self.comm_thread.submit(bucket)

    def _finish(self) -> None:
        """End of backward (on whichever thread autograd ends it): reduce what no hook
        reported (unused parameters), then wait."""
        waiting.run_for_main(self._finish_step)

    def _finish_step(self) -> None:
        self.pending = False
        for bucket in self.buckets[self.next_bucket:]:
            with torch.no_grad():
                for i, p in enumerate(bucket.params):
                    if not bucket.ready[i]:
                        bucket.slots[i].zero_()
                        p.grad = bucket.slots[i]
                        bucket.ready[i] = True
                        bucket.n_ready += 1
        wait_start = time.perf_counter()
        # The training thread's wait is what the heartbeats and the watchdog see (the
        # comm thread's buckets only leave spans): one numbered collective per step,
        # whichever thread autograd runs this on.
        nbytes = sum(b.nbytes for b in self.buckets)
        with waiting.collective("dp_allreduce", nbytes, f"buckets={len(self.buckets)}"):
            self._launch_ready(at_end=True)  # the rest: nothing left to overlap them with
            self.next_bucket = 0
            for bucket in self.buckets:
                waiting.wait_event(bucket.done)
        exposed = time.perf_counter() - wait_start
        errors = [b.error for b in self.buckets if b.error is not None]
        for bucket in self.buckets:
            self.clock.comm_s += bucket.comm_s
            with torch.no_grad():
                if bucket.host is not bucket.wire:
                    bucket.wire.copy_(bucket.host, non_blocking=True)
                if bucket.wire is not bucket.flat:
                    bucket.flat.copy_(bucket.wire)
            bucket.reset()
        if errors:
            if isinstance(errors[0], waiting.CollectiveAborted):
                raise waiting.CollectiveAborted(str(errors[0])) from errors[0]
            raise RuntimeError(f"gradient allreduce failed: {errors[0]}") from errors[0]
        self.clock.synced(exposed)


def _make_buckets(params: list[nn.Parameter], cfg: DataParallelConfig,
                  world_size: int) -> list[_Bucket]:
    """Reverse parameter order, at most bucket_mb each, one dtype and device per bucket."""
    limit = int(cfg.bucket_mb * 2**20)
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        current = groups[-1] if groups else None
        fits = (current is not None and size + p.numel() * p.element_size() <= limit
                and current[0].dtype == p.dtype and current[0].device == p.device)
        if not fits:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    buckets = []
    for index, group in enumerate(groups):
        dtype, device = group[0].dtype, group[0].device
        numel = sum(p.numel() for p in group)
        flat = kept_zeros(numel, dtype, device)
        slots, offset = [], 0
        for p in group:
            slots.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        wire_dtype = _WIRE_DTYPE.get(cfg.compression, dtype) if dtype.is_floating_point else dtype
        wire = flat if wire_dtype == dtype else kept_zeros(numel, wire_dtype, device)
        host = wire if device.type == "cpu" else torch.zeros_like(wire, device="cpu").pin_memory()
        buckets.append(_Bucket(index, group, slots, flat, wire, host, world_size))
    return buckets


# ------------------------------------------------------------------------- torch backend
class _BucketTimer:
    """How long one DDP bucket took from its launch to its result: wall-clock on CPU;
    on a GPU, CUDA events on the streams (the host only queues NCCL's work there)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stopped = False
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin_s = time.perf_counter()
            self.end_s = self.begin_s

    def stop(self) -> None:
        """In the bucket future's callback: on a GPU, its current stream waits for the
        bucket's collective, so the event records when that has run."""
        if self.cuda:
            self.end.record()
        else:
            self.end_s = time.perf_counter()
        self.stopped = True

    def seconds(self) -> float:
        """After the step's end-of-backward wait. The end event sits on the stream of the
        future's callback, which the wait did not cover: polled (it is due by now)."""
        if not self.stopped:
            return 0.0
        if self.cuda:
            waiting.poll(self.end.query)
            return self.begin.elapsed_time(self.end) / 1000.0
        return self.end_s - self.begin_s


# How DDP reduces one bucket: a future of the averaged bucket and the bytes it sends.
BucketReduce = Callable[[Any], tuple[torch.futures.Future, int]]


@dataclass(frozen=True)
class _WholeBuckets:
    """torch's own comm hook, which sends each bucket whole: in the gradients' dtype
    (``allreduce_hook``), or cast to `wire_dtype` (``fp16_compress_hook``,
    ``bf16_compress_hook``)."""

    hook: Callable[[Any, Any], torch.futures.Future]
    wire_dtype: torch.dtype | None = None

    def __call__(self, bucket: Any) -> tuple[torch.futures.Future, int]:
        buffer = bucket.buffer()
        itemsize = self.wire_dtype.itemsize if self.wire_dtype else buffer.element_size()
        return self.hook(None, bucket), buffer.numel() * itemsize


class _TimedHook:
    """DataParallel's one DDP comm hook around a way of reducing a bucket
    (`reduce_bucket`: _WholeBuckets or compression.CompressedBuckets): counts the
    bytes each bucket sends, times it, waits for the step's buckets interruptibly at the
    end of backward, and closes each step."""

    def __init__(self, reduce_bucket: BucketReduce, clock: StepClock,
                 device: torch.device):
        self.reduce_bucket = reduce_bucket
        self.clock = clock
        self.device = device
        self.pending = False
        self.futures: list[torch.futures.Future] = []
        self.timers: list[_BucketTimer] = []

    def hook(self, state, bucket):  # unannotated: DDP checks annotations against its own
        """The comm hook DDP calls for every bucket (on autograd's thread; mpilab's
        compressors wait in collectives there)."""
        return waiting.run_for_main(self._launch, state, bucket)

    def _launch(self, state, bucket) -> torch.futures.Future:
        if not self.pending:
            self.pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        timer = _BucketTimer(bucket.buffer().device)
        self.timers.append(timer)
        reduced, nbytes = self.reduce_bucket(bucket)
        self.clock.nbytes += nbytes

        def done(fut: torch.futures.Future) -> Any:
            timer.stop()
            return fut.value()

        future = reduced.then(done)
        self.futures.append(future)
        return future

    def _backward_done(self) -> None:
        """Queued before DDP's own finalize (which would block in C++ on gloo, and on NCCL
        leave the wait to the next host sync): wait here, polled, for every bucket's
        result and, on a GPU, for the device work that produces it; then let DDP finish
        and close the step after it."""
        futures, self.futures = self.futures, []
        timers, self.timers = self.timers, []
        self.pending = False  # every bucket of this step has been launched
        start = time.perf_counter()
        with waiting.for_main_thread(), \
                waiting.collective("ddp_allreduce", self.clock.nbytes):
            try:
                waiting.poll(lambda: all(f.done() for f in futures))
                for future in futures:
                    future.wait()  # raises the bucket's error; on a GPU, streams only
                waiting.wait_device(self.device)
            except BaseException:
                torch_group.abandoned_torch_work()
                raise
        exposed = time.perf_counter() - start
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._synced(timers, exposed))

    def _synced(self, timers: list[_BucketTimer], exposed_s: float) -> None:
        """After DDP's finalize: the step is done."""
        self.clock.comm_s += sum(timer.seconds() for timer in timers)
        self.clock.synced(exposed_s)


def _blocks_in_forward(ddp: nn.Module, device: torch.device) -> bool:
    """Will DDP's next forward run a collective that blocks the host, which no signal
    gets into? Until its buckets are rebuilt (the second forward), it agrees on their
    order across ranks and reads the result back; on CPU (gloo) every forward that
    broadcasts buffers blocks too. (On a GPU the buffers' broadcast is only queued.)"""
    if torch.is_grad_enabled() and not getattr(ddp, "_has_rebuilt_buckets", False):
        return True
    return device.type != "cuda" and ddp.will_sync_module_buffers()


def _model_device(model: nn.Module, default: torch.device) -> torch.device:
    """The device of the model's parameters (the rank's device for a model without)."""
    return next((p.device for p in model.parameters()), default)


def _wrap_ddp(model: nn.Module, cfg: DataParallelConfig, device: torch.device,
              clock: StepClock) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_mb,
    )
    method = resolve_compression(cfg.compression)
    if isinstance(method, Method):
        reduce_bucket: BucketReduce = CompressedBuckets(method)
    else:
        reduce_bucket = {
            None: _WholeBuckets(default_hooks.allreduce_hook),
            "fp16": _WholeBuckets(default_hooks.fp16_compress_hook, torch.float16),
            "bf16": _WholeBuckets(default_hooks.bf16_compress_hook, torch.bfloat16),
        }[method]
    ddp.register_comm_hook(None, _TimedHook(reduce_bucket, clock, device).hook)
    return ddp


# ------------------------------------------------------------------------------- common
def check_same_parameters(model: nn.Module, wrapper: str = "DataParallel") -> None:
    """Every rank must hold the same parameters: name the first difference and the ranks."""
    mine = [[name, list(p.shape), str(p.dtype)] for name, p in model.named_parameters()]
    everyone = collectives.allgather_json(mine, "parameter list")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for (n0, s0, d0), (n1, s1, d1) in zip(reference, theirs, strict=False):
            if (n0, s0, d0) != (n1, s1, d1):
                raise ValueError(
                    f"{wrapper}: parameter {n0!r} is {list(s0)} {d0} on rank 0 but rank "
                    f"{rank} has {n1!r} {list(s1)} {d1}; every rank must build the same model")
        longer = reference if len(reference) > len(theirs) else theirs
        first_extra = longer[min(len(reference), len(theirs))][0]
        raise ValueError(
            f"{wrapper}: rank 0 has {len(reference)} parameters but rank {rank} has "
            f"{len(theirs)} (first extra: {first_extra!r}); every rank must build the same model")


class ModelWrapper(nn.Module):
    """A training wrapper that behaves like the model it wraps (`self.module`): forward
    (timed for the step records), ``state_dict`` and attribute access. DataParallel and
    the averaging strategies share it."""

    module: nn.Module
    _clock: StepClock

    @staticmethod
    def check_model(wrapper: str, model: Any) -> None:
        """What a wrapper takes: a plain torch module (not one already wrapped)."""
        if isinstance(model, ModelWrapper):
            raise ValueError(f"{wrapper}: the model is already wrapped by "
                             f"{type(model).__name__}; wrap the plain model (its .module)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"{wrapper} wraps a torch.nn.Module, got "
                            f"{type(model).__name__} {model!r:.60}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._clock.forward(args, kwargs)
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules:
                return getattr(modules["module"], name)
            raise


class DataParallel(ModelWrapper):
    """Wrap `model` for synchronous data-parallel training across the ranks.

    Forward, ``state_dict`` and attribute access behave like the plain model's; gradients
    are averaged over ranks by the end of ``backward()``; ``no_sync()`` skips that for
    gradient accumulation. Any torch optimizer works on ``model.parameters()``. Move the
    model to its device before wrapping it; wrapping the same model again (rerunning a
    cell) replaces the earlier wrap. `backend`: "auto" (DDP over NCCL for a GPU model,
    mpilab's MPI path otherwise), "mpi" or "torch"; ``.backend`` says which one runs.
    `compression`: None, "fp16" or "bf16" (half-precision gradients on the wire),
    "powersgd" or "topk" (error feedback; settings through ``mpilab.PowerSGD(rank=…)`` or
    ``mpilab.TopK(ratio=…)``; see compression.py).
    """

    def __init__(self, model: nn.Module, backend: str = "auto", bucket_mb: float = 25.0,
                 compression: str | Method | None = None):
        super().__init__()
        ctx = context()
        self.config = DataParallelConfig(backend, bucket_mb, compression)
        self.check_model("DataParallel", model)
        self.module = model
        self._clock = StepClock()
        if compression is not None:
            self._clock.meter = TrafficMeter(collectives.tensor_bytes(
                [p for p in model.parameters() if p.requires_grad]))
        check_same_parameters(model)
        self.backend = choose_path(self.config.backend,
                                      {p.device.type for p in model.parameters()},
                                      torch_group.group_backends())
        waiting.watch_interrupts()  # the stop button reaches a wait on autograd's thread
        self._device = _model_device(model, ctx.device)
        self._ddp: nn.Module | None = None
        self._sync = None
        if self.backend == "torch":
            self._ddp = _wrap_ddp(model, self.config, self._device, self._clock)
            self._ddp_generation = torch_group.torch_group_generation()
        else:
            with torch.no_grad():
                for tensor in (*model.parameters(), *model.buffers()):
                    collectives.broadcast(tensor.data, root=0, backend="mpi")
            method = resolve_compression(compression)
            if isinstance(method, Method):
                self._sync = CompressedGradSync(model, method, self._clock)
            else:
                self._sync = _MPIGradSync(model, self.config, ctx.world_size, self._clock)
        # a wrap before this one (a rerun cell) lets go: its gradient hooks go, and a
        # strategy stops at its next step
        ownership.claim(model, self, self._sync.hooks if self._sync is not None else ())

    def _current_ddp(self) -> nn.Module:
        """The DDP wrapper, made again if recovery has made a new torch.distributed
        group since (DDP keeps the group it was made with, now aborted). Every rank
        recovered together, so every rank makes it again at the same forward."""
        if self._ddp_generation != torch_group.torch_group_generation():
            check_same_parameters(self.module)  # interruptible: a peer that failed since
            self._ddp = None  # the old reducer's gradient hooks go with it
            self._ddp = _wrap_ddp(self.module, self.config, self._device, self._clock)
            self._ddp_generation = torch_group.torch_group_generation()
        return self._ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._ddp is None:
            return super().forward(*args, **kwargs)
        ddp = self._current_ddp()
        if _blocks_in_forward(ddp, self._device):
            # every rank here first, waited for interruptibly: a peer that failed before
            # its forward must not leave this one in DDP's blocking collective
            collectives.barrier(backend="mpi")
        self._clock.forward(args, kwargs)
        return ddp(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients; the next one outside syncs."""
        if self._ddp is not None:
            with self._current_ddp().no_sync():
                yield
            return
        self._sync.enabled = False
        try:
            yield
        finally:
            self._sync.enabled = True

"""Gradient compression with error feedback (PowerSGD, top-k) and the traffic report.

Why: on slow links the gradient allreduce dominates a step. Two families from the
literature cut its bytes by one to three orders of magnitude at little cost in accuracy,
because what a step does not send is remembered and added to the next step's gradient
(error feedback: Seide et al. 2014; Karimireddy et al. 2019):

- PowerSGD (Vogels, Karimireddy & Jaggi 2019): each matrix-shaped gradient M (n×m) is
  sent as a rank-r product P·Qᵀ found by one power-iteration step warm-started from the
  previous step's Q. P = M·Q and Q = Mᵀ·P̂ are linear in M, so allreducing them gives an
  approximation of the mean gradient. Vectors, and matrices too small to gain, travel
  uncompressed.
- top-k sparsification (Aji & Heafield 2017; Stich et al. 2018; Lin et al. 2018, DGC):
  each rank sends only its k largest-magnitude entries (values and int32 indices); every
  rank gathers all of them and forms the same sparse mean.

``backend="mpi"``: ``CompressedGradSync`` does this at the end of backward, on the thread
autograd ends it on (for a GPU model, a device thread while the training thread waits in
``backward()``: inside ``waiting.for_main_thread()``), with mpilab's instrumented
collectives; GPU gradients are staged through pinned memory. ``backend="torch"`` (and
"auto" for a GPU model on NCCL): ``ddp_hook`` gives DDP torch's own powerSGD_hook, or
mpilab's top-k hook. Both report, every step, the bytes this rank sent and the running
compression ratio against uncompressed DataParallel (``TrafficMeter``: a "log" record
with values ``bytes_sent`` and ``compression_ratio``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import agent as agent_mod
from . import collectives, waiting

_NAMES = ("fp16", "bf16", "powersgd", "topk")


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD settings: approximation `rank`; the first `dense_steps` steps send plain
    gradients (torch's ``start_powerSGD_iter``; at least 2, which torch's error feedback
    needs); matrices that would shrink less than `min_compression_rate` go uncompressed."""

    rank: int = 2
    dense_steps: int = 2
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.dense_steps, int) or self.dense_steps < 2:
            raise ValueError("PowerSGD dense_steps must be an integer ≥ 2 (error feedback "
                             f"starts from a plain step), got {self.dense_steps!r}")
        if not self.min_compression_rate > 0:
            raise ValueError("PowerSGD min_compression_rate must be positive, got "
                             f"{self.min_compression_rate!r}")


@dataclass(frozen=True)
class TopK:
    """Top-k settings: each rank sends the `ratio` largest-magnitude gradient entries."""

    ratio: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 1):
            raise ValueError(f"TopK ratio must be in (0, 1], got {self.ratio!r}")


Method = PowerSGD | TopK


def resolve(compression: Any) -> str | Method | None:
    """DataParallel's `compression` argument, checked: None, "fp16", "bf16", or a Method."""
    if compression is None or isinstance(compression, (PowerSGD, TopK)):
        return compression
    if compression == "powersgd":
        return PowerSGD()
    if compression == "topk":
        return TopK()
    if compression in ("fp16", "bf16"):
        return compression
    raise ValueError(f"DataParallel compression {compression!r} is not None, "
                     f"{', '.join(repr(n) for n in _NAMES)}, mpilab.PowerSGD(rank=…) or "
                     "mpilab.TopK(ratio=…)")


@dataclass
class TrafficMeter:
    """Bytes sent per step and the running compression ratio, as "log" records.

    The ratio compares with uncompressed DataParallel over the same steps: every
    gradient allreduced, in its own dtype, every step (`dense_bytes` per step). Until
    something has been sent there is no ratio: the records carry ``bytes_sent`` only.
    """

    dense_bytes: int
    steps: int = 0
    sent: int = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes * self.steps / self.sent if self.sent else 0.0

    def report(self, step: int, nbytes: int) -> None:
        self.steps += 1
        self.sent += nbytes
        values = {"bytes_sent": float(nbytes)}
        if self.sent:
            values["compression_ratio"] = self.ratio
        agent_mod.current().emit("log", step=int(step), values=values)


@dataclass
class Traffic:
    """What this rank's training steps sent inside a ``traffic()`` block."""

    nbytes: int = 0
    steps: int = 0


_counting: list[Traffic] = []  # the open traffic() blocks


def count_step(nbytes: int) -> None:
    """A training step sent `nbytes`: every strategy's step clock reports here."""
    for counted in _counting:
        counted.nbytes += nbytes
        counted.steps += 1


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Count the bytes this rank's training steps send inside the block, whatever the
    strategy (DataParallel, compressed or not, LocalSGD, EASGD): the same figure as
    their "step" records' ``nbytes``. For comparing strategies side by side in one
    notebook."""
    counted = Traffic()
    _counting.append(counted)
    try:
        yield counted
    finally:
        _counting.remove(counted)


# ------------------------------------------------------------------------- compressors
class PowerSGDCompressor:
    """Rank-r PowerSGD with error feedback over mpilab's collectives (Vogels et al. 2019)."""

    def __init__(self, cfg: PowerSGD, backend: str = "auto"):
        self.cfg = cfg
        self.backend = backend
        self.reset()

    def reset(self) -> None:
        """Start over from the dense warm-up: after an aborted step the ranks' step
        counts (dense or compressed next) and warm starts may differ."""
        self.steps = 0
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}

    def _compressible(self, g: torch.Tensor) -> bool:
        if g.dim() < 2:
            return False
        n, m = g.shape[0], g.numel() // g.shape[0]
        r = min(n, m, self.cfg.rank)
        return (n + m) * r * self.cfg.min_compression_rate < n * m

    def _q(self, i: int, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        """Last step's Q (warm start); the first is random from a seed every rank shares."""
        q = self.qs.get(i)
        if q is None or q.shape != (m, r):
            gen = torch.Generator().manual_seed(1000 + i)
            q = torch.randn(m, r, generator=gen, dtype=like.dtype).to(like.device)
        return q

    def reduce(self, grads: Sequence[torch.Tensor]) -> int:
        """Average `grads` over the ranks in place (approximately); returns bytes sent."""
        self.steps += 1
        if self.steps <= self.cfg.dense_steps:
            collectives.allreduce(list(grads), op="mean", backend=self.backend)
            return collectives.tensor_bytes(grads)
        plain, mats, ps = [], [], []
        for i, g in enumerate(grads):
            if not self._compressible(g):
                plain.append(g)
                continue
            m = g.view(g.shape[0], -1)
            if i in self.errors:
                m.add_(self.errors[i])  # error feedback: what earlier steps did not send
            r = min(m.shape[0], m.shape[1], self.cfg.rank)
            mats.append((i, m))
            ps.append(m @ self._q(i, m.shape[1], r, m))
        collectives.allreduce(plain + ps, op="mean", backend=self.backend)
        qs = []
        for (_, m), p in zip(mats, ps):
            p.copy_(torch.linalg.qr(p).Q)  # same P̂ on every rank: same input, same QR
            qs.append(m.T @ p)
        if qs:
            collectives.allreduce(qs, op="mean", backend=self.backend)
        for (i, m), p, q in zip(mats, ps, qs):
            approx = p @ q.T
            self.errors[i] = m - approx  # m holds gradient + old error
            m.copy_(approx)
            self.qs[i] = q
        return collectives.tensor_bytes([*plain, *ps, *qs])


class TopKCompressor:
    """Top-k sparsification with error feedback over the flattened gradients."""

    def __init__(self, cfg: TopK, backend: str = "auto"):
        self.cfg = cfg
        self.backend = backend
        self.reset()

    def reset(self) -> None:
        """Drop the error feedback (recovery starts every compressor afresh)."""
        self.error: torch.Tensor | None = None

    def reduce(self, grads: Sequence[torch.Tensor]) -> int:
        """Average `grads` over the ranks in place (sparsely); returns bytes sent."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.error is not None and self.error.shape == flat.shape:
            flat.add_(self.error)
        k = max(1, math.ceil(self.cfg.ratio * flat.numel()))
        index = flat.abs().topk(k, sorted=False).indices
        values = flat[index]
        flat[index] = 0
        self.error = flat  # what was not sent waits for the next step
        index32 = index.to(torch.int32)
        all_values = collectives.allgather(values, backend=self.backend)
        all_index = collectives.allgather(index32, backend=self.backend)
        world = all_values.shape[0]
        dense = torch.zeros_like(flat)
        dense.index_add_(0, all_index.view(-1).long(), all_values.view(-1)).div_(world)
        offset = 0
        for g in grads:
            g.copy_(dense[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return collectives.tensor_bytes([values, index32])


def make_compressor(method: Method, backend: str = "auto") -> PowerSGDCompressor | TopKCompressor:
    """The compressor of `method`; `backend` as in mpilab.allreduce (auto: NCCL for GPU
    gradients where the ranks' group runs it, MPI otherwise)."""
    if isinstance(method, PowerSGD):
        return PowerSGDCompressor(method, backend)
    return TopKCompressor(method, backend)


# ------------------------------------------------------------------- DataParallel paths
def replace_grad_hooks(model: nn.Module, handles: Sequence = ()) -> None:
    """Keep `handles` as the model's gradient hooks, removing an earlier wrap's: a cell
    that wraps the same model again would otherwise reduce every gradient twice."""
    for handle in model.__dict__.pop("_mpilab_grad_hooks", []):
        handle.remove()
    if handles:
        model.__dict__["_mpilab_grad_hooks"] = list(handles)


class CompressedGradSync:
    """DataParallel's MPI path when gradients are compressed.

    The compressors need every gradient of the step (top-k ranks them all, PowerSGD
    batches its P and Q allreduces), so nothing is overlapped with backward: a callback
    queued on the autograd engine compresses, reduces and decompresses at its end, on the
    training thread. `clock` is DataParallel's step clock (``nbytes``, ``comm_s``,
    ``step``, ``synced``). ``enabled`` is DataParallel's no_sync switch.
    """

    def __init__(self, model: nn.Module, method: Method, clock: Any):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.compressor = make_compressor(method, "mpi")
        self.clock = clock
        self.enabled = True
        self.pending = False
        replace_grad_hooks(model, [p.register_post_accumulate_grad_hook(self._on_grad)
                                   for p in self.params])
        waiting.on_recover(self.reset)

    def reset(self) -> None:
        """No step in flight, compression from its warm-up: the state every rank can
        agree on after an abort without talking."""
        self.pending = False
        self.compressor.reset()

    def _on_grad(self, p: nn.Parameter) -> None:
        if self.enabled and not self.pending:
            self.pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        waiting.run_for_main(self._finish_step)  # autograd's device thread, for a GPU model

    def _finish_step(self) -> None:
        self.pending = False
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:  # unused this step: every rank must still send it
                    p.grad = torch.zeros_like(p)
            start = time.perf_counter()
            nbytes = self.compressor.reduce([p.grad for p in self.params])
        elapsed = time.perf_counter() - start
        self.clock.comm_s += elapsed
        self.clock.nbytes += nbytes
        self.clock.synced(elapsed)


class _CountingHook:
    """A DDP comm hook that counts the bytes `inner` sends into the step clock."""

    def __init__(self, inner: Callable, state: Any, bytes_of: Callable[[Any], int],
                 clock: Any):
        self.inner = inner
        self.state = state
        self.bytes_of = bytes_of
        self.clock = clock

    def __call__(self, state, bucket):  # unannotated: DDP checks annotations against its own
        self.clock.nbytes += self.bytes_of(bucket)  # before inner: torch's state.iter moves
        return self.inner(self.state, bucket)


def _powersgd_bytes(state: Any) -> Callable[[Any], int]:
    """What torch's powerSGD_hook sends for a bucket. Its rule, from the PowerSGD paper:
    an (n, m) gradient of rank-r approximation travels as its factors P (n, r) and Q
    (m, r) when they are `min_compression_rate` times smaller than it; else whole."""

    def bytes_of(bucket) -> int:
        buffer = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:
            return collectives.tensor_bytes(buffer)
        numel = 0
        for g in bucket.gradients():
            n = g.shape[0]  # torch views each gradient as (shape[0], -1)
            m = g.numel() // n
            r = min(n, m, state.matrix_approximation_rank)
            dense, factors = n * m, (n + m) * r
            numel += factors if factors * state.min_compression_rate < dense else dense
        return numel * buffer.element_size()

    return bytes_of


class _TopKDDP:
    """mpilab's top-k for DDP: one compressor (and error) per DDP bucket."""

    def __init__(self, cfg: TopK):
        self.cfg = cfg
        self.compressors: dict[int, TopKCompressor] = {}

    def __call__(self, state, bucket):
        return waiting.run_for_main(self._reduce, bucket)  # autograd's thread, on a GPU

    def _reduce(self, bucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        compressor = self.compressors.get(bucket.index())
        if compressor is None:
            compressor = self.compressors[bucket.index()] = TopKCompressor(self.cfg, "torch")
        compressor.reduce([buffer])
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future

    def bytes_of(self, bucket) -> int:
        k = max(1, math.ceil(self.cfg.ratio * bucket.buffer().numel()))
        return k * (bucket.buffer().element_size() + 4)


def ddp_hook(method: Method, clock: Any) -> Callable:
    """The DDP comm hook for `method` (backend "torch"); it counts its own bytes."""
    if isinstance(method, PowerSGD):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=method.rank,
            start_powerSGD_iter=method.dense_steps,
            min_compression_rate=method.min_compression_rate,
            use_error_feedback=True, warm_start=True, random_seed=0)
        return _CountingHook(psgd.powerSGD_hook, state, _powersgd_bytes(state), clock)
    topk = _TopKDDP(method)
    return _CountingHook(topk, None, topk.bytes_of, clock)

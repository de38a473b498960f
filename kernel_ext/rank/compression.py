"""Gradient compression with error feedback: PowerSGD and top-k.

Why: on slow links the gradient allreduce dominates a step. Two families from the
literature cut its bytes by one to three orders of magnitude at little cost in accuracy,
because what a step does not send is remembered and added to the next step's gradient
(error feedback: Seide et al. 2014; Karimireddy et al. 2019):

- PowerSGD (Vogels, Karimireddy & Jaggi 2019): each matrix-shaped gradient M (n×m) is
  sent as a rank-r product P·Qᵀ found by one power-iteration step warm-started from the
  previous step's Q. P = M·Q and Q = Mᵀ·P̂ are linear in M, so allreducing them gives an
  approximation of the mean gradient. Vectors, and matrices too small to gain, travel
  uncompressed (``PowerSGD.factor_rank`` says which).
- top-k sparsification (Aji & Heafield 2017; Stich et al. 2018; Lin et al. 2018, DGC):
  each rank sends only its k largest-magnitude entries (values and int32 indices); every
  rank gathers all of them and forms the same sparse mean.

One compressor per method (``make_compressor``) serves both of DataParallel's paths:
``CompressedGradSync`` reduces every gradient at the end of backward over MPI
(``backend="mpi"``), and ``CompressedBuckets`` reduces each of DDP's buckets over
torch.distributed (``backend="torch"``, and "auto" for a GPU model on NCCL). Both say
what they sent, which DataParallel reports (``accounting``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import collectives, reduction, waiting

_NAMES = ("fp16", "bf16", "powersgd", "topk")


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD settings: approximation `rank`; the first `dense_steps` steps send plain
    gradients (at least 2: DDP settles its buckets after the first step, and each
    bucket's error feedback starts from a plain step); matrices that would shrink less
    than `min_compression_rate` go uncompressed."""

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

    def factor_rank(self, shape: Sequence[int]) -> int | None:
        """The rank r at which a gradient of `shape`, viewed as n = shape[0] rows of m,
        travels as its factors P (n×r) and Q (m×r); None when it travels whole: a
        vector, or a matrix the factors would shrink less than min_compression_rate."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = math.prod(shape) // n if n else 0
        r = min(n, m, self.rank)
        return r if (n + m) * r * self.min_compression_rate < n * m else None


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
            r = self.cfg.factor_rank(g.shape)
            if r is None:
                plain.append(g)
                continue
            m = g.view(g.shape[0], -1)
            error = self.errors.get(i)
            if error is not None and error.shape == m.shape:
                m.add_(error)  # error feedback: what earlier steps did not send
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
        dense.index_add_(0, all_index.view(-1).long(), all_values.view(-1))
        reduction.divide_for_mean(dense, world)
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
        # the gradient hooks' handles: DataParallel's claim on the model holds them
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                      for p in self.params]
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


class CompressedBuckets:
    """DDP's path when gradients are compressed: each of DDP's buckets reduced by a
    compressor of its own (its error feedback and warm start are the bucket's), over
    torch.distributed. Called by DataParallel's bucket hook on autograd's thread; it
    returns a completed future and the bytes the bucket sent."""

    def __init__(self, method: Method):
        self.method = method
        self.compressors: dict[int, PowerSGDCompressor | TopKCompressor] = {}
        waiting.on_recover(self.reset)

    def reset(self) -> None:
        """Every bucket's compression from its warm-up (see CompressedGradSync.reset)."""
        self.compressors.clear()

    def __call__(self, bucket: Any) -> tuple[torch.futures.Future, int]:
        buffer = bucket.buffer()
        compressor = self.compressors.get(bucket.index())
        if compressor is None:
            compressor = self.compressors[bucket.index()] = make_compressor(self.method,
                                                                           "torch")
        nbytes = compressor.reduce(_bucket_gradients(bucket, buffer)
                                   if isinstance(self.method, PowerSGD) else [buffer])
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future, nbytes


def _bucket_gradients(bucket: Any, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of the bucket's flat buffer shaped like its parameters, in its order (what
    PowerSGD factors; reducing them in place reduces the buffer)."""
    views, offset = [], 0
    for p in bucket.parameters():
        views.append(buffer[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views

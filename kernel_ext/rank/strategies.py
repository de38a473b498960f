"""Model-averaging strategies: LocalSGD and synchronous EASGD, wrapped around a model.

Why: DataParallel allreduces every gradient at every step. Averaging the parameters
only every K steps (model averaging: Zhang et al. 2016; local SGD: Stich 2019, Lin et
al. 2020) sends K times fewer bytes; elastic averaging (EASGD: Zhang, Choromanska &
LeCun 2015, the rule Theano-MPI runs) lets the ranks explore around a shared centre.

The training loop stays the one written for DataParallel, with no extra call: a
strategy notices optimizer steps by itself (one global torch optimizer step hook,
filtered to optimizers holding the wrapped model's parameters) and communicates right
after every K-th step, so after K·m steps every rank holds the averaged parameters.
Every step emits a "step" record (bytes and comm time, for the dashboard's throughput
and bandwidth) and a "log" record with ``bytes_sent`` and ``compression_ratio``.
"""

from __future__ import annotations

import copy
import time
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import collectives, ownership, torch_group
from .accounting import StepClock, TrafficMeter
from .context import context
from .data_parallel import ModelWrapper, check_same_parameters

_live: weakref.WeakSet[_Averaging] = weakref.WeakSet()
_hook: Any = None


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for strategy in list(_live):
        if strategy._holds(optimizer):
            strategy._after_step()


class _Averaging(ModelWrapper):
    """What LocalSGD and EASGD share: wrapping, step detection, reporting.

    Like DataParallel: move the model to its device before wrapping it (rank 0's weights
    are broadcast then), and wrapping the same model again replaces the earlier wrap.
    Every rank must take the same number of optimizer steps.
    """

    def __init__(self, model: nn.Module, period: int, backend: str):
        super().__init__()
        global _hook
        name = type(self).__name__
        self.check_model(name, model)
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"{name}: period must be a positive whole number of steps, "
                             f"got {period!r}")
        try:
            torch_group.check_transport(backend)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        ctx = context()
        self.module = model
        self.period = period
        self.backend = backend
        self.world_size = ctx.world_size
        self.steps = 0
        check_same_parameters(model, name)
        with torch.no_grad():  # every rank starts from rank 0's weights
            for tensor in (*model.parameters(), *model.buffers()):
                collectives.broadcast(tensor.data, root=0, backend=backend)
        params = [p for p in model.parameters() if p.requires_grad]
        # what is averaged: trained parameters and float buffers (BatchNorm statistics)
        self._state = [t.detach() for t in params] + \
            [b.detach() for b in model.buffers() if b.is_floating_point()]
        self._param_ids = {id(p) for p in params}
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._clock = StepClock(meter=TrafficMeter(collectives.tensor_bytes(params)))
        # Rewrapping (a rerun cell) replaces the earlier wrap, DataParallel's hooks too.
        # The model keeps its strategy alive: `LocalSGD(net)` works without keeping the
        # wrapper.
        earlier = ownership.owner_of(model)
        if isinstance(earlier, _Averaging):
            _live.discard(earlier)
        ownership.claim(model, self, keep_alive=True)
        _live.add(self)
        if _hook is None:
            _hook = register_optimizer_step_post_hook(_after_optimizer_step)

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Does `optimizer` train this model? Cached per optimizer and its group count."""
        groups = len(optimizer.param_groups)
        known = self._optimizers.get(optimizer)
        if known is None or known[0] != groups:
            mine = any(id(p) in self._param_ids
                       for g in optimizer.param_groups for p in g["params"])
            known = self._optimizers[optimizer] = (groups, mine)
        return known[1]

    def _due(self, step: int) -> bool:
        return step % self.period == 0

    def _communicate(self) -> int:
        """Exchange with the other ranks; returns the bytes this rank sent."""
        raise NotImplementedError

    def _after_step(self) -> None:
        if ownership.owner_of(self.module) is not self:  # rewrapped since
            _live.discard(self)
            return
        self.steps += 1
        nbytes, comm_s = 0, 0.0
        if self._due(self.steps):
            start = time.perf_counter()
            with torch.no_grad():
                nbytes = self._communicate()
            comm_s = time.perf_counter() - start
        self._clock.comm_s += comm_s
        self._clock.nbytes += nbytes
        self._clock.synced(comm_s)

    def _average(self, tensors: list[torch.Tensor]) -> int:
        collectives.allreduce(tensors, op="mean", backend=self.backend)
        return collectives.tensor_bytes(tensors)



class LocalSGD(_Averaging):
    """Local SGD / model averaging: each rank steps alone; every `period` optimizer steps
    the parameters (and float buffers) are averaged over the ranks.

    `warmup` steps at the start average after every step (post-local SGD, Lin et al.
    2020: early training is the sensitive part). With period 1 and plain SGD this is
    exactly DataParallel: the mean of the ranks' steps from equal weights is one step
    with the mean gradient. Any torch optimizer works; its own state (momentum) stays
    per rank.
    """

    def __init__(self, model: nn.Module, period: int = 1, warmup: int = 0,
                 backend: str = "auto"):
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"LocalSGD: warmup must be a whole number of steps ≥ 0, "
                             f"got {warmup!r}")
        super().__init__(model, period, backend)
        self.warmup = warmup

    def _due(self, step: int) -> bool:
        return step <= self.warmup or step % self.period == 0

    def _communicate(self) -> int:
        return self._average(self._state)


class EASGD(_Averaging):
    """Synchronous elastic averaging SGD (Zhang, Choromanska & LeCun 2015, Algorithm 1).

    Every rank keeps the same centre variable x̃. Every `period` optimizer steps, with
    the ranks' parameters x_i and p ranks:

        x_i ← x_i − α (x_i − x̃)        (each rank is pulled toward the centre)
        x̃  ← x̃ + α Σ_i (x_i − x̃)      (the centre moves toward the ranks; β = pα)

    The sum comes from one allreduce of the parameters, so the centre stays identical on
    every rank. It needs 0 < pα ≤ 1 (the paper's stability condition on β). Evaluate the
    centre: ``center_module()``.
    """

    def __init__(self, model: nn.Module, alpha: float, period: int = 1,
                 backend: str = "auto"):
        world = context().world_size
        if not (isinstance(alpha, (int, float)) and 0 < alpha * world <= 1):
            raise ValueError(f"EASGD: alpha must satisfy 0 < alpha × ranks ≤ 1 (the centre's "
                             f"moving rate β = pα), got alpha={alpha!r} with {world} ranks")
        super().__init__(model, period, backend)
        self.alpha = float(alpha)
        self.center = [t.clone() for t in self._state]

    def _communicate(self) -> int:
        mean = [t.clone() for t in self._state]
        nbytes = self._average(mean)
        beta = self.alpha * self.world_size
        for x, c, m in zip(self._state, self.center, mean):
            x.sub_(self.alpha * (x - c))  # the old centre: both moves use step-t values
            c.add_(beta * (m - c))
        return nbytes

    def center_module(self) -> nn.Module:
        """A copy of the model holding the centre variable (what EASGD evaluates)."""
        clone = copy.deepcopy(self.module, memo={id(self): None})  # owned by nobody
        params = [p for p in clone.parameters() if p.requires_grad]
        state = params + [b for b in clone.buffers() if b.is_floating_point()]
        with torch.no_grad():
            for t, c in zip(state, self.center):
                t.copy_(c)
        return clone

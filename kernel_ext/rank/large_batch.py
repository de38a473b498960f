"""Large mini-batch helpers, as optimizer wrappers: scaled learning rate with warm-up, LARS.

Why: N ranks with batch B train with batch N·B. Goyal et al. 2017 ("ImageNet in 1 hour")
keep accuracy by scaling the learning rate with the batch (linear scaling rule) after a
gradual warm-up from the small-batch rate; You, Gitman & Ginsburg 2017 (LARS) go further
by giving every layer a rate proportional to ‖w‖/‖∇w‖, so no layer's update outgrows its
weights. Both wrap any torch optimizer and keep its interface: ``step``, ``zero_grad``,
``param_groups``, ``state_dict``; the strategies' step hooks still see the inner step.
"""

from __future__ import annotations

from typing import Any

import torch

from .context import context


class _Wrapper:
    """Delegates everything it does not define to the wrapped optimizer."""

    def __init__(self, optimizer: Any):
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"{type(self).__name__} wraps a torch optimizer, not "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)


class ScaledLR(_Wrapper):
    """Linear scaling rule with gradual warm-up (Goyal et al. 2017).

    Each group's rate goes from its base rate to base × `scale` (default: the number of
    ranks, i.e. the global batch over one rank's) linearly over `warmup_steps` steps,
    then stays there.
    """

    def __init__(self, optimizer: Any, scale: float | None = None, warmup_steps: int = 0):
        super().__init__(optimizer)
        if scale is None:
            scale = context().world_size
        if not scale > 0:
            raise ValueError(f"ScaledLR: scale must be positive, got {scale!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"ScaledLR: warmup_steps must be a whole number ≥ 0, "
                             f"got {warmup_steps!r}")
        self.scale = float(scale)
        self.warmup_steps = warmup_steps
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.steps = 0
        self._apply()

    def factor(self, step: int) -> float:
        """The rate multiplier at `step`: 1 → scale over the warm-up."""
        if step >= self.warmup_steps:
            return self.scale
        return 1.0 + (self.scale - 1.0) * step / self.warmup_steps

    def _apply(self) -> None:
        f = self.factor(self.steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * f

    def step(self, closure: Any = None) -> Any:
        loss = self.optimizer.step(closure)
        self.steps += 1
        self._apply()
        return loss

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps,
                "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.base_lrs = state["steps"], list(state["base_lrs"])
        self._apply()


class LARS(_Wrapper):
    """Layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017), in NVIDIA's LARC form.

    Before the wrapped step, each parameter's gradient (plus its group's weight decay,
    which the wrapper applies itself) is scaled by
    ``trust_coefficient · ‖w‖ / (‖∇w‖ + weight_decay · ‖w‖ + eps)``; with `clip`, that
    local rate never exceeds the group's rate (LARC's clipping mode). Parameters with a
    zero norm or zero gradient keep their gradient.
    """

    def __init__(self, optimizer: Any, trust_coefficient: float = 0.001, clip: bool = False,
                 eps: float = 1e-8):
        super().__init__(optimizer)
        if not trust_coefficient > 0:
            raise ValueError(f"LARS: trust_coefficient must be positive, "
                             f"got {trust_coefficient!r}")
        self.trust_coefficient = float(trust_coefficient)
        self.clip = clip
        self.eps = float(eps)

    @torch.no_grad()
    def _scale_gradients(self) -> list[float]:
        decays = []
        for group in self.optimizer.param_groups:
            decay = group.get("weight_decay", 0.0)
            decays.append(decay)
            for p in group["params"]:
                if p.grad is None:
                    continue
                w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(p.grad)
                if w_norm == 0 or g_norm == 0:
                    continue
                local = self.trust_coefficient * w_norm / (g_norm + decay * w_norm + self.eps)
                if self.clip:
                    local = torch.clamp(local / group["lr"], max=1.0)
                if decay:
                    p.grad.add_(p, alpha=decay)
                p.grad.mul_(local)
            if "weight_decay" in group:
                group["weight_decay"] = 0.0  # applied above, inside the scaled gradient
        return decays

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # gradients first: the scaling needs them
            with torch.enable_grad():
                loss = closure()
        decays = self._scale_gradients()
        try:
            self.optimizer.step()
            return loss
        finally:
            for group, decay in zip(self.optimizer.param_groups, decays):
                if "weight_decay" in group:
                    group["weight_decay"] = decay

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

"""Which training wrapper owns a model: one claim per model, kept on the model itself.

Rerunning a notebook cell wraps the same model again (``DataParallel(net)``, then
``LocalSGD(net)``, then ``DataParallel(net)`` …). Each wrap claims the model: the claim
releases the previous owner's gradient hooks (a model synchronised twice would reduce
every gradient twice) and lets a replaced strategy notice that it no longer owns the
model. A copy of a model (``copy.deepcopy``, pickling) is owned by nobody.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

_KEY = "_mpilab_claim"  # a plain __dict__ entry: not a submodule, not a parameter


def _unclaimed() -> None:
    return None


class Claim:
    """A wrapper's hold on a model: its owner and the gradient hooks it registered."""

    __slots__ = ("_owner", "hooks")

    def __init__(self, owner: Any, keep_alive: bool, hooks: Iterable[Any]):
        # kept alive: a strategy works without the user keeping its wrapper
        self._owner = owner if keep_alive else weakref.ref(owner)
        self.hooks = list(hooks)

    @property
    def owner(self) -> Any:
        return self._owner() if isinstance(self._owner, weakref.ref) else self._owner

    def release(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def __reduce__(self) -> tuple:
        return _unclaimed, ()  # a copy of the model belongs to nobody


def claim(model: nn.Module, owner: Any, hooks: Iterable[Any] = (),
          keep_alive: bool = False) -> Claim:
    """Make `owner` the wrapper of `model`, releasing the previous one's hooks. `hooks`:
    the handles of the gradient hooks `owner` registered on the model's parameters.
    `keep_alive`: the model keeps `owner` alive (else it is held weakly)."""
    release(model)
    held = Claim(owner, keep_alive, hooks)
    model.__dict__[_KEY] = held
    return held


def release(model: nn.Module) -> None:
    """The model's owner, if any, lets it go: its gradient hooks are removed."""
    held = model.__dict__.pop(_KEY, None)
    if held is not None:
        held.release()


def owner_of(model: nn.Module) -> Any:
    """The wrapper that last claimed `model` and is still alive, or None."""
    held = model.__dict__.get(_KEY)
    return held.owner if held is not None else None

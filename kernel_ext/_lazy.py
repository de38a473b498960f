"""Lazy public names for a package: each is imported from its module on first use, so
importing the package stays cheap (on the ranks, and at `%load_ext`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(package: str, namespace: dict, api: dict[str, str]) -> tuple[Callable, Callable]:
    """A module's `__getattr__` and `__dir__` serving `api` (name -> relative module)."""

    def __getattr__(name: str):
        module = api.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(api) | {n for n in namespace if not n.startswith("_")})

    return __getattr__, __dir__

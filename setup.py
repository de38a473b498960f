"""The compiled parts, both on the path of every small collective (each file says why it
is C): the shared-memory engine's flag protocol and collectives of one piece
(kernel_ext/rank/_ring.c) and a collective's context (kernel_ext/rank/_collective.c).
Everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"mpilab.rank.{name}", [f"kernel_ext/rank/{name}.c"],
                             extra_compile_args=["-O3"])
                   for name in ("_ring", "_collective")])

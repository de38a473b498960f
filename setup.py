"""The compiled parts, on the path of every collective (each file says why it is C): the
shared-memory engine's flag protocol, its collectives of one piece and two passes of its
larger ones (kernel_ext/rank/_ring.c), and a collective's context
(kernel_ext/rank/_collective.c). Everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"mpilab.rank.{name}", [f"kernel_ext/rank/{name}.c"],
                             extra_compile_args=["-O3"])
                   for name in ("_ring", "_collective")])

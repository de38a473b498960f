"""The compiled parts, on the path of every collective (each file says why it is C): the
shared-memory engine's flag protocol, its collectives of one piece and two passes of its
larger ones (kernel_ext/rank/_ring.c), a collective's context
(kernel_ext/rank/_collective.c), and MPI's persistent collectives started and waited for
(kernel_ext/rank/_persistent.c). Everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"mpilab.rank.{name}", [f"kernel_ext/rank/{name}.c"],
                             extra_compile_args=["-O3"])
                   for name in ("_ring", "_collective", "_persistent")])

"""The one compiled part: the shared-memory engine's flag protocol and its collectives of
one piece (kernel_ext/rank/_ring.c; kernel_ext/rank/shm.py says why it is C). Everything
else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mpilab.rank._ring", ["kernel_ext/rank/_ring.c"],
                             extra_compile_args=["-O2"])])

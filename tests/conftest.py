"""Shared fixtures: one real notebook kernel with a real 2-rank cluster for many tests."""

from __future__ import annotations

import json

import pytest
from cluster import emulated_cluster  # noqa: F401 - the session's emulated hosts
from kernel import Kernel

PIDS_CODE = """
import json
from mpilab.session import Session
_c = Session.instance().cluster
print(json.dumps({"engines": _c.engine_pids(), "launchers": _c.launcher_pids()}))
"""


def cluster_pids(kernel: Kernel) -> dict:
    """Pids of the engines and of what ipyparallel launched, read inside the kernel."""
    run = kernel.run(PIDS_CODE)
    assert run.ok, run.text
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def fresh_kernel():
    """A kernel with the extension loaded and no cluster; for bad-input tests."""
    kernel = Kernel()
    assert kernel.run("%load_ext mpilab").ok
    yield kernel
    kernel.run("%mpilab stop")
    kernel.shutdown()


@pytest.fixture(scope="session")
def lab():
    """The shared 2-rank cluster (started once, stopped at the end of the session), in a
    kernel of its own: tests of a kernel without ranks (fresh_kernel) pass in any order."""
    kernel = Kernel()
    assert kernel.run("%load_ext mpilab").ok
    run = kernel.run("%mpilab start -n 2", timeout=180)
    assert run.ok, run.text
    yield kernel
    kernel.run("%mpilab stop")
    kernel.shutdown()

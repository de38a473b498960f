"""Shared fixtures: one real notebook kernel with a real 2-rank cluster for many tests."""

from __future__ import annotations

import json

import pytest
from browser_fixtures import browser, lab, page  # noqa: F401 - the browser tests'
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


def _extension_kernel():
    """A kernel with the extension loaded; whatever it started is stopped at the end."""
    kernel = Kernel()
    assert kernel.run("%load_ext mpilab").ok
    yield kernel
    kernel.run("%mpilab stop")
    kernel.shutdown()


@pytest.fixture(scope="session")
def fresh_kernel():
    """A kernel with the extension loaded and no cluster; for bad-input tests."""
    yield from _extension_kernel()


@pytest.fixture(scope="session")
def _ranks_kernel():
    yield from _extension_kernel()


READY_CODE = """
from mpilab.session import Session as _S
print(_S.instance().cluster.running and not _S.instance().cluster.dead)
"""


@pytest.fixture
def ranks(_ranks_kernel):
    """A kernel with the shared 2-rank cluster, of its own (tests of a kernel without ranks,
    fresh_kernel, pass in any order). Started by the first test that asks, and again for
    a test that finds it stopped or with a dead rank (a test before it may have ended it):
    each test gets running ranks whatever ran before."""
    ready = _ranks_kernel.run(READY_CODE)
    if ready.stdout.strip() != "True":
        _ranks_kernel.run("%mpilab stop", timeout=120)
        run = _ranks_kernel.run("%mpilab start -n 2", timeout=180)
        assert run.ok, run.text
    return _ranks_kernel


# `make test` runs the suite in two processes (pytest-xdist's `-n 2`): on this project's
# 2-core machine the suite keeps the cores busy only about 60% of its time, since much of
# it waits on ranks, daemons and a browser. Each process takes whole groups: a test file,
# or the files that share what only one process may hold at a time (the emulated hosts;
# JupyterLab and its browser). The longest groups go first, so that none starts last.
_GROUPS = {"test_multihost.py": "hosts", "test_cluster_harness.py": "hosts",
           "test_browser.py": "browser", "test_browser_views.py": "browser",
           "test_browser_export.py": "browser"}
_FIRST = ("hosts", "browser", "test_magics.py", "test_failures.py")


def _group(nodeid: str) -> str:
    name = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return _GROUPS.get(name, name)


def pytest_collection_modifyitems(config, items):
    first = {group: k for k, group in enumerate(_FIRST)}
    items.sort(key=lambda item: first.get(_group(item.nodeid), len(first)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to each process, in the order of the collection (xdist's own
    `xdist_group` mark does not reach its scheduler with this pytest)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False
    return ByGroup(config, log)

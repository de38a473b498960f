"""The browser tests' fixtures (conftest.py brings them in): one JupyterLab and one
chromium for the session's browser tests (each notebook has a name of its own), each test
a fresh page (jupyter_lab.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jupyter_lab import Lab, chromium, fresh_page, running_lab


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Iterator[Lab]:
    with running_lab(tmp_path_factory.mktemp("lab")) as running:
        yield running


@pytest.fixture(scope="session")
def browser():
    with chromium() as running:
        yield running


@pytest.fixture
def page(browser, lab, request):
    with fresh_page(browser, lab, request.node.name) as page:
        yield page

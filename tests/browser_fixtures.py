"""The browser tests' fixtures (conftest.py brings them in): each test module gets its
own JupyterLab and chromium, each test a fresh page (jupyter_lab.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jupyter_lab import Lab, chromium, fresh_page, running_lab


@pytest.fixture(scope="module")
def lab(tmp_path_factory, request) -> Iterator[Lab]:
    with running_lab(tmp_path_factory.mktemp(request.module.__name__)) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    with chromium() as running:
        yield running


@pytest.fixture
def page(browser, lab, request):
    with fresh_page(browser, lab, request.node.name) as page:
        yield page

"""A JupyterLab server and a chromium to drive it, as a user would: for the browser tests
and for benchmarks/bench_browser.py.

The server runs on 127.0.0.1 with a token and a quiet settings dir in a root of its own;
Playwright drives Debian's chromium (never `playwright install`: downloads are blocked).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import nbformat

CHROMIUM = Path("/usr/bin/chromium")
BUILD = Path(__file__).resolve().parents[1] / "build"  # screenshots, what a check saw
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
JUPYTER = Path(sys.executable).parent / "jupyter"


class Lab:
    """A running JupyterLab: where it is and how to reach it."""

    def __init__(self, root: Path, port: int, token: str):
        self.root, self.port, self.token = root, port, token

    def url(self, notebook: str) -> str:
        """The notebook in a workspace of its own: no tabs of earlier tests come back."""
        workspace = Path(notebook).stem
        return (f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/{notebook}"
                f"?token={self.token}")

    def shutdown_kernels(self) -> None:
        """Through the REST API, as JupyterLab's own "Shut Down All Kernels" does; the
        mpilab extension stops a kernel's ranks when the kernel shuts down."""
        api = f"http://127.0.0.1:{self.port}/api/kernels"
        headers = {"Authorization": f"token {self.token}"}
        with urllib.request.urlopen(urllib.request.Request(api, headers=headers)) as r:
            kernels = json.load(r)
        for kernel in kernels:
            request = urllib.request.Request(f"{api}/{kernel['id']}", method="DELETE",
                                             headers=headers)
            urllib.request.urlopen(request).close()

    def write_notebook(self, name: str, cells: list[str]) -> str:
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
        nbformat.write(nb, self.root / name)
        return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_lab(base: Path) -> Iterator[Lab]:
    """JupyterLab on 127.0.0.1, a free port and a token, under `base`; ended by pid."""
    root = base / "root"
    root.mkdir()
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
           "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
           "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
           "PATH": f"{JUPYTER.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # no toasts over the notebook (news, updates): a quiet user settings dir
    settings = base / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}))
    # every cell rendered, not only those in view: a test clicks cells as they come
    notebook_settings = base / "settings" / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True)
    (notebook_settings / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"}))
    log = (base / "lab.log").open("wb")
    proc = subprocess.Popen(
        [str(JUPYTER), "lab", "--no-browser", "--ServerApp.open_browser=False",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not start:\n{(base / 'lab.log').read_text()}")
            time.sleep(0.3)
        yield Lab(root, port, token)
    finally:
        proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextmanager
def chromium() -> Iterator:
    """Headless chromium under Playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def require_chromium() -> None:
    """The browser tests' guard, called at import: without Debian's chromium they skip
    locally and fail in CI (which installs it), saying what to install."""
    if CHROMIUM.exists():
        return
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} is missing; CI installs it with "
                           "`apt-get install -y chromium`")
    import pytest

    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium); browser tests skipped "
                "outside CI", allow_module_level=True)


@contextmanager
def fresh_page(browser, lab: Lab, name: str) -> Iterator:
    """A page in a browser context of its own. On the way out, whatever happened: the
    page's last state to build/NAME-last.png (in CI, the only clue to a failure), the
    context closed and the lab's kernels shut down (the mpilab extension stops their
    ranks), so the next test starts on a quiet machine. Each step runs even where the one
    before it failed (a crashed page cannot be drawn)."""
    BUILD.mkdir(exist_ok=True)
    with ExitStack() as on_exit:  # last in, first out
        on_exit.callback(lab.shutdown_kernels)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        on_exit.callback(context.close)
        page = context.new_page()
        on_exit.callback(page.screenshot, path=str(BUILD / f"{name}-last.png"),
                         full_page=True)
        yield page


# -- driving a notebook --------------------------------------------------------------------
def open_notebook(page, lab: Lab, name: str) -> None:
    page.goto(lab.url(name))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    # the kernel is started and connected (before that the indicator says idle too)
    page.get_by_text(re.compile(r"\(ipykernel\) \| Idle")).wait_for(timeout=90_000)


def cell(page, index: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def run_cell(page, index: int) -> None:
    """Select the cell (command mode) and run it with Shift+Enter, as a user does."""
    prompt = cell(page, index).locator(".jp-InputPrompt")
    prompt.scroll_into_view_if_needed(timeout=30_000)
    prompt.click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        "i => /\\[[*0-9]+\\]/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').textContent)", arg=index, timeout=30_000)


def is_running(page, index: int) -> bool:
    return "[*]" in cell(page, index).locator(".jp-InputPrompt").inner_text()


def wait_cell_done(page, index: int, timeout_s: float = 120) -> None:
    page.wait_for_function(
        "i => /\\[[0-9]+\\]/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').textContent)", arg=index,
        timeout=timeout_s * 1000)
    errors = cell(page, index).locator(".jp-OutputArea-output[data-mime-type="
                                       "'application/vnd.jupyter.stderr']")
    tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]
    assert not tracebacks, f"cell {index} failed:\n" + "\n".join(tracebacks)

"""An HTML export (`mpilab run … --html`) shows its plots in a browser without a network,
as on a cluster node with no internet: plotly.js travels inside the page.

Real parts: a notebook run headless by the `mpilab` command on two real ranks (its
training dashboard becomes a static plot at the end of the cell), then Debian's
chromium under Playwright, offline, every request that is not the file refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_lab import require_chromium
from mpilab.widgets.plotting import _PLOTLYJS_TAG

MPILAB = str(Path(sys.executable).parent / "mpilab")

pytestmark = pytest.mark.timeout(300)

require_chromium()

CELLS = [
    "%mpilab start -n 2",
    "%%ranks\nimport torch\nw = torch.zeros(8, requires_grad=True)\n"
    "opt = torch.optim.SGD([w], lr=0.1)\n"
    "for step in range(40):\n"
    "    loss = ((w - 1) ** 2).sum()\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
    "    mpilab.log(loss=loss.item())",
    "%mpilab stop",
]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """The HTML page `mpilab run --html` writes for a notebook with a training dashboard."""
    folder = tmp_path_factory.mktemp("export")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "mpilab", "display_name": "Python (mpilab)",
                                 "language": "python"}
    nbformat.write(nb, folder / "train.ipynb")
    html = folder / "train.html"
    proc = subprocess.run([MPILAB, "run", str(folder / "train.ipynb"), "--html", str(html)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return html


def _open_offline(browser, page_file: Path) -> tuple[dict, list[str]]:
    """Open the page with the network off; (what its plots drew, the URLs it asked for
    that were not the file itself)."""
    context = browser.new_context(offline=True)
    asked: list[str] = []

    def refuse(route):
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            asked.append(route.request.url)
            route.abort()

    context.route("**/*", refuse)
    page = context.new_page()
    try:
        page.goto(page_file.as_uri(), wait_until="load")
        try:
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=15_000)
        except Exception:  # noqa: BLE001 - no plot: what it drew says so below
            pass
        drawn = page.evaluate(
            """() => ({
                plotly: typeof window.Plotly,
                plots: [...document.querySelectorAll('.js-plotly-plot')].map(p =>
                    (p._fullData || []).filter(t => t.y && t.y.length).map(t => t.name)),
                svgs: document.querySelectorAll('.js-plotly-plot .main-svg').length,
            })""")
    finally:
        context.close()
    return drawn, asked


def test_html_export_shows_the_dashboard_without_a_network(export, browser, tmp_path):
    text = export.read_text()
    assert _PLOTLYJS_TAG not in text and "plotly.js v" in text  # plotly.js inside, once
    assert text.count("plotly.js v") == 1
    drawn, asked = _open_offline(browser, export)
    # the same page as it was before plotly.js went inside it (the figure's own CDN tag):
    # offline it draws nothing; the test can tell a blank gap from a plot
    cdn = tmp_path / "cdn.html"
    start = text.index('<script charset="utf-8">/**\n* plotly.js v')
    end = text.index("</script>", start) + len("</script>")
    cdn.write_text(text[:start] + _PLOTLYJS_TAG + text[end:])
    blank, _ = _open_offline(browser, cdn)
    assert drawn["plotly"] == "object", drawn
    assert len(drawn["plots"]) == 1 and "loss" in drawn["plots"][0], drawn
    assert drawn["svgs"] > 0
    assert not any("plot.ly" in url for url in asked), asked
    assert blank["plotly"] == "undefined" and blank["svgs"] == 0, blank

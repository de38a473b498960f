"""notebooks/04_strategies.ipynb runs headless on 2 ranks and shows its figure and table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

MPILAB = str(Path(sys.executable).parent / "mpilab")
NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "04_strategies.ipynb"
STRATEGIES = ["DataParallel", "DataParallel fp16", "PowerSGD rank 2", "top-k 1%",
              "LocalSGD K=4", "LocalSGD K=16", "EASGD K=4"]
PLOTLY = "application/vnd.plotly.v1+json"


@pytest.fixture(scope="module")
def nb(tmp_path_factory) -> nbformat.NotebookNode:
    out = tmp_path_factory.mktemp("nb") / "04_strategies.ipynb"
    # the timeout only catches a hang; how long the notebook takes is not a pass/fail test
    proc = subprocess.run([MPILAB, "run", str(NOTEBOOK), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return nbformat.read(out, as_version=4)


def _outputs(nb: nbformat.NotebookNode, mime: str) -> list:
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if mime in o.get("data", {})]


def test_notebook_runs_without_errors(nb):
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o["output_type"] == "error"]
    assert not errors


def test_figure_shows_accuracy_against_bytes_and_time(nb):
    figure = _outputs(nb, PLOTLY)[-1]  # the comparison, after the cells' dashboards
    traces = figure["data"]
    by_bytes = {t["name"]: t for t in traces if t.get("xaxis", "x") == "x"}
    by_time = [t for t in traces if t.get("xaxis") == "x2"]
    assert list(by_bytes) == STRATEGIES and len(by_time) == len(STRATEGIES)
    assert figure["layout"]["xaxis"]["type"] == "log"
    mb = {name: t["x"][-1] for name, t in by_bytes.items()}
    accuracy = {name: t["y"][-1] for name, t in by_bytes.items()}
    # the trade-off the figure is about: fewer bytes with every strategy, similar accuracy
    assert mb["DataParallel fp16"] == pytest.approx(mb["DataParallel"] / 2, rel=1e-6)
    assert mb["LocalSGD K=16"] < mb["LocalSGD K=4"] < mb["DataParallel"]
    assert mb["PowerSGD rank 2"] < mb["DataParallel"] / 4
    assert mb["top-k 1%"] < mb["DataParallel"] / 10
    assert accuracy["DataParallel"] >= 0.9
    assert all(a >= 0.8 for a in accuracy.values()), accuracy


def test_table_lists_every_strategy(nb):
    table = next(h for h in _outputs(nb, "text/html") if "id='strategies'" in h)
    assert table.count("<tr>") == len(STRATEGIES) + 1
    for name in STRATEGIES:
        assert f"<td>{name}</td>" in table

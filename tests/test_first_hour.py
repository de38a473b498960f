"""What a new user meets in the first hour: help for every magic, the kernel and the
examples `mpilab lab` sets up, exports that work offline, the package's dependencies, the
benchmark commands the README gives."""

from __future__ import annotations

import ast
import http.client
import importlib
import importlib.metadata
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from jupyter_lab import free_port
from kernel import Kernel
from mpilab.magics import SUBCOMMANDS
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
MPILAB = str(Path(sys.executable).parent / "mpilab")
# every option of every subcommand, as `%mpilab?` must list them
OPTIONS = {
    "start": ["-n", "--gpus", "--backend", "--launcher", "--hostfile", "--controller-ip",
              "--partition", "--time", "--account", "--nodes", "--tasks-per-node",
              "--gpus-per-node", "--sbatch-option", "--mpiexec", "--timeout", "--hang-timeout"],
    "pull": ["--rank"],
    "bench": ["--sizes", "--backends"],
    "metrics": ["--save", "--clear"],
    "trace": ["--save"],
}


def _page_text(kernel, code: str) -> str:
    """What `x?` shows: IPython sends it as a pager payload in the execute reply (taken
    here by its parent's id: the shell channel may still hold an earlier reply)."""
    msg_id = kernel.kc.execute(code)
    while True:
        reply = kernel.kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert reply["content"]["status"] == "ok", reply["content"]
    pages = [p["data"]["text/plain"] for p in reply["content"].get("payload", [])
             if p.get("source") == "page"]
    return re.sub(r"\x1b\[[0-9;]*m", "", "".join(pages))


# -- help ----------------------------------------------------------------------------------
def test_mpilab_question_mark_lists_every_subcommand_with_its_options(fresh_kernel):
    text = _page_text(fresh_kernel, "%mpilab?")
    for sub in SUBCOMMANDS:
        assert re.search(rf"^  {sub}\s+\S", text, re.M), f"{sub} not listed:\n{text}"
        if sub != "help":
            assert f"%mpilab {sub}" in text, sub
    for sub, options in OPTIONS.items():
        block = text[text.index(f"\n%mpilab {sub} "):]
        for option in options:
            assert re.search(rf"^\s+{re.escape(option)}\b.*\S", block, re.M), (sub, option)


@pytest.mark.parametrize("sub", [s for s in SUBCOMMANDS if s != "help"])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_each_subcommand_prints_its_help(fresh_kernel, sub, flag):
    args = {"push": "x ", "pull": "x ", "bench": "allreduce ", "auto": "on "}.get(sub, "")
    run = fresh_kernel.run(f"%mpilab {sub} {args}{flag}")
    assert run.ok, run.text
    assert run.stdout.startswith(f"%mpilab {sub}"), run.stdout
    for option in OPTIONS.get(sub, []):
        assert option in run.stdout, (sub, option)
    assert "\n\n" in run.stdout and len(run.stdout.splitlines()) >= 3  # usage, description


def test_mpilab_help_and_help_of_one_subcommand(fresh_kernel):
    everything = fresh_kernel.run("%mpilab help")
    assert everything.ok and all(f"%mpilab {s}" in everything.stdout
                                 for s in SUBCOMMANDS if s != "help")
    one = fresh_kernel.run("%mpilab help start")
    assert one.ok and one.stdout.startswith("%mpilab start [-n N]")
    assert "--sbatch-option" in one.stdout
    assert fresh_kernel.run("%mpilab -h").stdout == everything.stdout
    bad = fresh_kernel.run("%mpilab help frobnicate")
    assert not bad.ok and "no subcommand 'frobnicate'" in bad.text


def test_ranks_help_names_the_cell_magic_and_describes_every_option(fresh_kernel):
    text = _page_text(fresh_kernel, "%%ranks?")
    assert "%%ranks [--timeout S]" in text, text
    for option in ("--timeout", "--noblock", "--no-dashboard", "--quiet", "--hang-timeout"):
        assert re.search(rf"^\s+{option}\b( S)?\s+\S", text, re.M), (option, text)
    # -h prints the same help instead of running the cell (no ranks are needed for it)
    run = fresh_kernel.run("%%ranks -h\nprint('the cell ran')")
    assert run.ok and run.stdout.startswith("%%ranks [") and "the cell ran" not in run.stdout


# -- the package's dependencies -------------------------------------------------------------
# declared, needed at run time, never imported by mpilab's code
RUN_TIME_ONLY = {
    "ipykernel": "the notebook's kernel and every engine run on it",
    "jupyterlab": "`mpilab lab` runs it",
    "mpich": "brings mpiexec and the MPI library mpi4py loads",
}
# the private names mpilab relies on, where they are looked up; each package that has
# some needs an upper bound in pyproject.toml, no further than the release after the
# tested one (the next minor release for torch, the next major one for IPython)
PRIVATE = {
    "torch": [("torch.distributed.distributed_c10d", "_world.pg_map"),
              ("torch.distributed.distributed_c10d", "_get_default_group"),
              ("torch.distributed.distributed_c10d", "_update_default_pg"),
              ("torch.distributed.distributed_c10d", "_abort_process_group")],
    "ipython": [("IPython.core.interactiveshell", "InteractiveShell._showtraceback"),
                ("IPython.core.interactiveshell", "InteractiveShell._get_exc_info"),
                ("IPython.core.compilerop", "CachingCompiler()._filename_map")],
}
# how the code reaches them: every private name these patterns find must be in PRIVATE
PRIVATE_USES = {"torch": r"c10d\._(\w+)", "ipython": r"(?:shell|compile)\._(\w+)"}


def _declared() -> dict[str, Requirement]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in requirements}


def _imported_distributions() -> set[str]:
    modules = set()
    for path in [*(ROOT / "kernel_ext").rglob("*.py"), *(ROOT / "widgets").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    owners = importlib.metadata.packages_distributions()
    third_party = modules - set(sys.stdlib_module_names) - {"mpilab"}
    missing = sorted(m for m in third_party if m not in owners)
    assert not missing, f"imported but installed by no distribution: {missing}"
    return {canonicalize_name(owners[m][0]) for m in third_party}


def test_every_import_is_declared_and_every_dependency_used():
    declared, imported = _declared(), _imported_distributions()
    assert not imported - set(declared), f"imported, not declared: {imported - set(declared)}"
    unused = set(declared) - imported - set(RUN_TIME_ONLY)
    assert not unused, f"declared, never imported nor needed at run time: {unused}"
    assert "scikit-learn" not in declared  # the examples' extra


@pytest.mark.parametrize("package", sorted(PRIVATE))
def test_private_apis_exist_and_the_upper_bound_covers_only_tested_releases(package):
    requirement = _declared()[package]
    installed = Version(importlib.metadata.version(package))
    assert installed in requirement.specifier, (requirement, installed)
    uppers = [Version(s.version) for s in requirement.specifier if s.operator == "<"]
    assert uppers, f"{requirement}: private APIs need an upper bound"
    release = installed.release
    next_release = (Version(f"{release[0]}.{release[1] + 1}") if package == "torch"
                    else Version(f"{release[0] + 1}"))
    assert min(uppers) <= next_release, (requirement, installed)
    for module, name in PRIVATE[package]:
        owner, _, attributes = name.partition(".")
        value = importlib.import_module(module)
        value = getattr(value, owner.removesuffix("()"))
        if owner.endswith("()"):
            value = value()
        for attribute in attributes.split(".") if attributes else []:
            value = getattr(value, attribute)
    known = {part.removesuffix("()") for _, name in PRIVATE[package]
             for part in name.split(".") if part.startswith("_")}
    code = "\n".join(p.read_text() for p in (ROOT / "kernel_ext").rglob("*.py"))
    used = {f"_{m}" for m in re.findall(PRIVATE_USES[package], code)}
    assert used <= known, f"private {package} names used but not checked here: {used - known}"


# -- mpilab lab and its kernel -------------------------------------------------------------
def test_lab_opens_copies_of_the_examples_in_the_mpilab_kernel(tmp_path):
    """`mpilab lab --dir D`: the examples copied into D/examples (a changed copy kept),
    JupyterLab rooted at D opening the quickstart, the "Python (mpilab)" kernelspec
    installed, the user's IPYTHONDIR left alone; that kernel loads the extension."""
    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    mine = work / "examples" / "01_quickstart.ipynb"
    mine.write_text("{}")  # the user's changed copy: never overwritten
    port, token = free_port(), secrets.token_hex(8)
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    env.pop("IPYTHONDIR", None)
    log = (tmp_path / "lab.log").open("wb")
    proc = subprocess.Popen(
        [MPILAB, "lab", "--dir", str(work), "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        api = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{api}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "lab.log").read_text()
                time.sleep(0.3)

        def get(path: str):
            request = urllib.request.Request(f"{api}{path}",
                                             headers={"Authorization": f"token {token}"})
            with urllib.request.urlopen(request) as response:
                return json.load(response)

        listed = sorted(item["name"] for item in get("/api/contents/examples")["content"])
        shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
        assert listed == shipped
        assert mine.read_text() == "{}"
        spec = get("/api/kernelspecs")["kernelspecs"]["mpilab"]["spec"]
        assert spec["display_name"] == "Python (mpilab)" and "--ext=mpilab" in spec["argv"]
        server_env = (Path("/proc") / str(proc.pid) / "environ").read_bytes().split(b"\0")
        assert not any(v.startswith(b"IPYTHONDIR=") for v in server_env)
        # the server's front page sends the browser to the quickstart
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/", headers={"Authorization": f"token {token}"})
        response = connection.getresponse()
        assert response.status in (301, 302)
        location = response.getheader("Location").rstrip("?")
        assert location.endswith("/lab/tree/examples/01_quickstart.ipynb"), location
        connection.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    km, kc = start_new_kernel(kernel_name="mpilab")
    try:
        msg_id = kc.execute("print('mpilab' in get_ipython().extension_manager.loaded)\n"
                            "from IPython.paths import get_ipython_dir\nprint(get_ipython_dir())")
        out = ""
        while True:
            msg = kc.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out += msg["content"]["text"]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    loaded, ipython_dir = out.split()
    assert loaded == "True"
    assert ".mpilab" not in ipython_dir


# -- the wheel, installed ------------------------------------------------------------------
WHEEL_NOTEBOOK = [
    "%mpilab start -n 2",
    "%%ranks\nimport mpilab as m, torch\nt = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\n"
    "print('from', m.__file__.split('site-packages')[0], t.tolist())",
    "%mpilab stop",
]


@pytest.mark.timeout(600)
def test_wheel_in_a_fresh_venv_runs_two_ranks_and_has_the_examples(tmp_path):
    """Not from a checkout: the wheel built from the repo, installed (not editable) into a
    new virtual environment with its declared dependencies, offline (the wheels of this
    environment's versions, packed from it: build/wheelhouse, reused by later runs)."""
    from wheelhouse import wheelhouse

    started = time.monotonic()
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(ROOT), "-w", str(dist)],
                   check=True, capture_output=True)
    wheel = next(dist.glob("mpilab-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(n).name for n in archive.namelist() if n.startswith("mpilab/examples/")}
    assert shipped == {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    houses = ROOT / "build" / "wheelhouse"
    wheelhouse([str(r) for r in _declared().values()], houses)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(houses),
         "--no-compile", "-c", str(ROOT / "constraints-dev.txt"), str(wheel)],
        capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    installed = time.monotonic()
    # the fresh environment alone: its own bin first, nothing of the checkout's
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "IPYTHONDIR")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *(
        p for p in os.environ.get("PATH", "").split(os.pathsep)
        if not p.startswith(str(ROOT)))])
    where = subprocess.run(
        [str(python), "-c", "import mpilab, mpilab.cli as c, pathlib, sys\n"
         "print(mpilab.__file__)\nprint(c.examples_dir())\n"
         "print(len(c.prepare_notebooks(pathlib.Path(sys.argv[1]))))", str(tmp_path / "lab")],
        capture_output=True, text=True, env=env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    package, examples, copied = where.stdout.split()
    site = str(venv / "lib")
    assert package.startswith(site) and examples.startswith(site), where.stdout
    assert int(copied) == len(shipped) and (tmp_path / "lab" / "examples").is_dir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in WHEEL_NOTEBOOK])
    nb.metadata["kernelspec"] = {"name": "mpilab", "display_name": "Python (mpilab)",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / "two_ranks.ipynb")
    run = subprocess.run([str(venv / "bin" / "mpilab"), "run", str(tmp_path / "two_ranks.ipynb"),
                          "-o", str(tmp_path / "out.ipynb")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in out.cells for o in c.outputs)
    assert "mpilab: 2 ranks on" in text and "stopped 2 ranks" in text, text
    assert f"[ranks 0-1] from {venv}/lib/python" in text and "[3.0, 3.0]" in text, text
    print(f"wheel test: install {installed - started:.0f} s, "
          f"run {time.monotonic() - installed:.0f} s")


@pytest.mark.parametrize("script, args, line", [
    ("bench_allreduce.py", ["--sizes", "1M,x"], "--sizes: 'x' is not a size like 4K"),
    ("bench_allreduce.py", ["--ops", "allreduse"], "--ops: 'allreduse': choose from allreduce"),
    ("bench_pieces.py", ["--repeats", "0"], "--repeats: got 0, needs at least 1"),
    ("bench_allreduce_passes.py", ["-n", "two"], "-n: 'two' is not a whole number"),
    ("bench_start.py", ["--reps", "0"], "--reps: got 0, needs at least 1"),
    ("bench_torchrun.py", ["--shapes", "small,huge"], "--shapes: 'small,huge': choose from"),
])
def test_a_benchmark_given_a_bad_option_says_so_in_one_line(script, args, line):
    """The README's figures come with their commands; a mistyped one is refused before any
    rank starts, in one line, with nothing left running."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"{script}: error: argument {line}"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr


# -- with the cluster -----------------------------------------------------------------------
def test_bench_shows_its_progress_and_names_a_skipped_backend_once(ranks):
    run = ranks.run("%mpilab bench allreduce --sizes 4K:8K --backends mpi,nccl", timeout=300)
    assert run.ok, run.text
    progress = [o["content"]["data"]["text/plain"] for o in run.outputs
                if o["type"] in ("display_data", "update_display_data")
                and "message sizes" in o["content"]["data"].get("text/plain", "")]
    assert progress[0].startswith("mpilab bench allreduce: 0/2 message sizes"), progress
    assert "1/2 message sizes, 4KB done" in progress[1] and "2/2" in progress[-1], progress
    assert run.stdout.count("nccl") == 1, run.stdout  # the table's "not measured" line
    assert "not measured: nccl: skipped" in run.stdout
    figure = next(o["content"]["data"]["application/vnd.plotly.v1+json"] for o in run.outputs
                  if "application/vnd.plotly.v1+json" in o["content"].get("data", {}))
    assert "nccl" not in json.dumps(figure["layout"])
    assert {t["name"] for t in figure["data"]} >= {"mpi"}


def test_rank_tracebacks_name_the_notebooks_cell_number(ranks):
    """The ranks' own execution counts differ from the notebook's (cells run in the
    notebook only, cells on some ranks): a traceback names the notebook's In[n]."""
    for _ in range(3):
        assert ranks.run("x = 1").ok
    # IPython counts a cell before running it: this prints the number of the next cell
    n = int(ranks.run("print(get_ipython().execution_count)").stdout)
    run = ranks.run("%%ranks\ndef f():\n    raise ValueError('boom')\nf()")
    assert f"Cell In[{n}], line 3, in <module>" in run.error_text, run.error_text
    assert f"Cell In[{n}], line 2, in f" in run.error_text, run.error_text
    run = ranks.run("%%ranks 1\nprint(1 +)")
    assert f"Cell In[{n + 1}], line 1" in run.error_text, run.error_text


def test_ipyparallels_jupyterlab_panel_does_not_list_mpilabs_cluster(ranks):
    """ipyparallel's panel lists the clusters whose files it finds in the IPython
    profiles, with a STOP button that would end the ranks behind mpilab's back."""
    import ipyparallel as ipp

    run = ranks.run("from mpilab.session import Session\n"
                    "print(Session.instance().cluster._ipp_cluster.cluster_id)")
    cluster_id = run.stdout.strip()
    assert cluster_id, run.text
    listed = {c.cluster_id for c in ipp.ClusterManager().load_clusters().values()}
    assert cluster_id not in listed


def test_a_slow_start_says_how_far_it_got_while_it_goes_on():
    """Tens of ranks take longer than START_NOTE_AFTER_S to start: the cell says, in place,
    how many have started and how many are through their bootstrap, and the line is gone
    once they are ready. Set low here, in a kernel of its own, so that 2 ranks show it."""
    kernel = Kernel()
    try:
        assert kernel.run("%load_ext mpilab\nimport mpilab.cluster\n"
                          "mpilab.cluster.START_NOTE_AFTER_S = 0").ok
        run = kernel.run("%mpilab start -n 2", timeout=180)
    finally:
        kernel.run("%mpilab stop", timeout=120)
        kernel.shutdown()
    assert run.ok and re.fullmatch(r"mpilab: 2 ranks on \S+ · .* · ready in [\d.]+ s",
                                   run.text.strip()), run.text
    notes = [o["content"]["data"].get("text/plain", "") for o in run.outputs
             if o["type"] in ("display_data", "update_display_data")]
    assert re.fullmatch(r"mpilab: [01] of 2 ranks started, \d+ s", notes[0]), notes
    assert all(re.fullmatch(r"mpilab: ([012] of 2 ranks started|2 ranks started, [01] through "
                            r"their bootstrap \(MPI, devices, torch\.distributed\)), \d+ s", note)
               for note in notes[1:-1]), notes
    assert notes[-1] == "", notes

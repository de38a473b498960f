"""Checkpoints on real ranks: bit-for-bit round trip, atomic writes, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpilab.rank import bootstrap
from mpilab.rank.checkpoint import save_checkpoint
from mpirun import run_ranks

_SETUP = """
import os, signal, torch
from torch import nn
from mpilab.rank.checkpoint import CheckpointError
d = os.environ["CKPT_DIR"]

def trained(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    return model, opt
"""

# One rank saves checkpoint A, then dies (SIGKILL) in the middle of writing B.
_KILLED_WRITER = _SETUP + """
model, opt = trained(1)
mpilab.save_checkpoint(f"{d}/ck.pt", model, opt, epoch=1)
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{d}/expected.pt")
model, opt = trained(2)

def dies_mid_write(obj, f):
    f.write(b"half a checkpoint" * 1000)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = dies_mid_write
mpilab.save_checkpoint(f"{d}/ck.pt", model, opt, epoch=2)
"""

_CHECK = _SETUP + """
def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b

def state(model, opt):
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}

def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"

out = {}
# the killed writer left the previous checkpoint intact
model, opt = trained(5)
out["after_kill_extra"] = mpilab.load_checkpoint(f"{d}/ck.pt", model, opt)
out["after_kill_same"] = same(state(model, opt), torch.load(f"{d}/expected.pt"))

# round trip on 2 ranks: rank 1's model differs, the load must overwrite it
model, opt = trained(3)
mpilab.save_checkpoint(f"{d}/rt.pt", model, opt, epoch=7, note="best", lr=[0.1, 0.01])
saved = torch.load(f"{d}/rt.pt")  # reference: exactly what rank 0 wrote
model, opt = trained(10 + ctx.rank)
extra = mpilab.load_checkpoint(f"{d}/rt.pt", model, opt)
out["extra"] = extra
out["roundtrip_same"] = same(state(model, opt), {"model": saved["model"],
                                                 "optimizer": saved["optimizer"]})
out["leftovers"] = sorted(p for p in os.listdir(d) if ".tmp-" in p and "rt.pt" in p)

open(f"{d}/a_file", "w").close()
out["unwritable"] = error_of(lambda: mpilab.save_checkpoint(f"{d}/a_file/ck.pt", model, opt))
out["missing"] = error_of(lambda: mpilab.load_checkpoint(f"{d}/nope.pt", model, opt))
out["not a model"] = error_of(lambda: mpilab.save_checkpoint(f"{d}/x.pt", "model", opt))
out["not an optimizer"] = error_of(lambda: mpilab.load_checkpoint(f"{d}/rt.pt", model, 0.1))

# mpilab's wrappers are saved and loaded as what they wrap
model, opt = trained(3)
wrapped, scaled = mpilab.DataParallel(model), mpilab.ScaledLR(opt, scale=2, warmup_steps=1)
mpilab.save_checkpoint(f"{d}/wrapped.pt", wrapped, scaled)
mpilab.load_checkpoint(f"{d}/wrapped.pt", wrapped, scaled)
out["wrappers"] = same(wrapped.state_dict(), torch.load(f"{d}/wrapped.pt")["model"])
everyone = ctx.comm.gather(out, root=0)
if ctx.rank == 0:
    report(everyone)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list:
    d = tmp_path_factory.mktemp("ckpt")
    env = {"CKPT_DIR": str(d)}
    _, proc = run_ranks(_KILLED_WRITER, n=1, env=env, check=False)
    assert proc.returncode != 0, "the writer was meant to die mid-write"
    assert any(".tmp-" in p.name for p in Path(d).iterdir()), "it died before writing"
    return run_ranks(_CHECK, n=2, env=env)[0]


def test_killed_writer_leaves_the_previous_checkpoint(results: list) -> None:
    for got in results:
        assert got["after_kill_extra"] == {"epoch": 1}
        assert got["after_kill_same"]


def test_round_trip_is_bit_for_bit_on_every_rank(results: list) -> None:
    for got in results:
        assert got["roundtrip_same"]
        assert got["extra"] == {"epoch": 7, "note": "best", "lr": [0.1, 0.01]}
        assert got["leftovers"] == []


def test_errors_name_the_path_on_every_rank(results: list) -> None:
    for got in results:
        assert got["unwritable"].startswith("CheckpointError: cannot write checkpoint")
        assert "a_file/ck.pt" in got["unwritable"]
        assert got["missing"].startswith("CheckpointError: cannot read checkpoint")
        assert "nope.pt" in got["missing"]


def test_a_wrong_argument_is_refused_on_every_rank_and_the_ranks_stay_in_step(results):
    """Checked on every rank before rank 0 writes alone: a rank that raised early would
    leave the others in the save's broadcast, paired with the next collective."""
    for got in results:
        assert got["not a model"] == ("TypeError: mpilab.save_checkpoint's model is a "
                                      "torch.nn.Module, got str")
        assert got["not an optimizer"] == ("TypeError: mpilab.load_checkpoint's optimizer is "
                                           "a torch optimizer or None, got float")
        assert got["wrappers"]


def test_outside_a_cluster_says_so(tmp_path: Path) -> None:
    from torch import nn

    assert not bootstrap.is_initialized()
    with pytest.raises(bootstrap.BootstrapError, match="not initialised"):
        save_checkpoint(tmp_path / "ck.pt", nn.Linear(2, 2), None)

"""Nothing listens beyond where the ranks are: on one host, every socket that the kernel,
the controller, the engines and their children listen on is on the loopback."""

from __future__ import annotations

import ipaddress

from listeners import is_hydra, listeners_of


def test_one_host_cluster_listens_on_loopback_only(ranks):
    run = ranks.run("%%ranks\nimport torch\nt = torch.ones(4)\ndist.all_reduce(t)\n"
                    "mpilab.allreduce(t)\nprint(t.tolist())")
    assert run.ok, run.text
    found = listeners_of(ranks.km.provisioner.process.pid)
    commands = " ".join(sorted({x.command for x in found}))
    # the pieces are all there: the kernel, the controller and both engines listen
    assert "ipykernel" in commands and "controller_main" in commands, commands
    # of a rank's processes (supervisor, the host's spawner, engine) engines alone listen
    engines = {x.pid for x in found if "mpilab.rank." in x.command and not is_hydra(x)}
    assert len(engines) == 2, found
    outside = [x for x in found if not ipaddress.ip_address(x.ip).is_loopback]
    hydra = [x for x in outside if is_hydra(x)]
    others = [x for x in outside if not is_hydra(x)]
    assert not others, f"listening beyond the loopback: {others}"
    # hydra's control port is the one exception (README, Security): mpiexec and its
    # proxy hold it; no engine keeps a copy
    assert len({x.port for x in hydra}) <= 1, hydra

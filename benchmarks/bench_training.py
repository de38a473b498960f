"""Training throughput: mpilab.DataParallel (mpi, torch) against torchrun + plain DDP.

One run trains the same model with the same global batch, on synthetic data, as:

- ``mpilab-mpi``:   ``mpiexec -n N``, ``mpilab.DataParallel(backend="mpi")``
- ``mpilab-torch``: ``mpiexec -n N``, ``mpilab.DataParallel(backend="torch")``
- ``torchrun-ddp``: ``torchrun --nproc-per-node N``, a plain DistributedDataParallel script
- ``single``:       one process, one core's worth of threads, the per-rank batch
  (the baseline of the scaling efficiency: samples/s of N ranks / (N x single))
- ``independent``:  N such processes at once, each on its own, no communication: what N
  busy cores of this machine give (shared caches, memory bandwidth, the host), so the
  most N ranks can reach; its samples/s is the sum of theirs

for two models: ``mlp`` (a wide MLP of ~6.3M parameters and a small batch: communication
heavy) and ``cnn`` (a small CNN on 32x32 images: compute heavy). Every process gets
cores / N torch threads, as mpilab's bootstrap gives its ranks.

    python benchmarks/bench_training.py                       # both models, ~2 minutes
    python benchmarks/bench_training.py --model mlp --steps 50

Figures on a shared machine are noisy: run it alone, compare within one run only, and
use ``--repeats 3`` or more (interleaved runs, the median kept) where other work
shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MARK = "@@bench@@ "
BIN = Path(sys.executable).parent
WAYS = ("mpilab-mpi", "mpilab-torch", "torchrun-ddp", "single", "independent")


@dataclass
class BenchConfig:
    """One measurement: which model, how big, how long."""

    model: str = "mlp"
    ranks: int = 2
    batch: int = 16  # per rank
    steps: int = 30
    warmup: int = 5
    width: int = 2048
    bucket_mb: float = 25.0


def build(cfg: BenchConfig):
    """The model and one synthetic batch (inputs, labels) of the per-rank size."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if cfg.model == "mlp":
        model = nn.Sequential(nn.Linear(1024, cfg.width), nn.ReLU(),
                              nn.Linear(cfg.width, cfg.width), nn.ReLU(),
                              nn.Linear(cfg.width, 10))
        x = torch.randn(cfg.batch, 1024)
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))
        x = torch.randn(cfg.batch, 3, 32, 32)
    return model, x, torch.randint(0, 10, (cfg.batch,))


def train(model, x, y, cfg: BenchConfig, barrier, group: FileGroup | None = None,
          step_times: list[float] | None = None) -> float:
    """Seconds for cfg.steps SGD steps after cfg.warmup (slowest rank's view).

    With a `group` (independent processes): the steps are timed from when every process
    of the group has warmed up, and a process done with them goes on training until
    every other one is done too, so each is timed while all cores are busy; each timed
    step's seconds go to `step_times`."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(cfg.warmup):
        step()
    if group is not None:
        group.meet("warm")
    barrier()
    start = time.perf_counter()
    for _ in range(cfg.steps):
        before = time.perf_counter()
        step()
        if step_times is not None:
            step_times.append(time.perf_counter() - before)
    if group is not None:
        elapsed = time.perf_counter() - start
        group.arrive("done")
        while not group.all_arrived("done"):
            step()
        return elapsed
    barrier()
    return time.perf_counter() - start


class FileGroup:
    """Processes with nothing between them (no MPI) meeting through files in one folder:
    `dir,count` from $MPILAB_BENCH_GROUP."""

    def __init__(self, spec: str):
        folder, count = spec.rsplit(",", 1)
        self.folder, self.count = Path(folder), int(count)

    def arrive(self, name: str) -> None:
        (self.folder / f"{name}.{os.getpid()}").touch()

    def all_arrived(self, name: str) -> bool:
        return len(list(self.folder.glob(f"{name}.*"))) >= self.count

    def meet(self, name: str) -> None:
        self.arrive(name)
        while not self.all_arrived(name):
            time.sleep(0.001)


def worker(way: str, cfg: BenchConfig) -> None:
    """Runs inside each launched process; rank 0 prints the result line."""
    import torch

    step_times: list[float] = []
    if way.startswith("mpilab"):
        import mpilab

        ctx = mpilab.init()
        rank, world = ctx.rank, ctx.world_size
        model, x, y = build(cfg)
        model = mpilab.DataParallel(model, backend=way.split("-")[1], bucket_mb=cfg.bucket_mb)
        elapsed = train(model, x, y, cfg, ctx.comm.Barrier)
    elif way == "torchrun-ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        model, x, y = build(cfg)
        model = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb)
        elapsed = train(model, x, y, cfg, dist.barrier)
        dist.destroy_process_group()
    else:  # single, independent: one process on its own
        rank, world = 0, 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.ranks))
        model, x, y = build(cfg)
        spec = os.environ.get("MPILAB_BENCH_GROUP")
        elapsed = train(model, x, y, cfg, lambda: None, FileGroup(spec) if spec else None,
                        step_times)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(MARK + json.dumps({"way": way, "samples_s": cfg.steps * cfg.batch * world / elapsed,
                                 "step_ms": 1000 * elapsed / cfg.steps, "params": params,
                                 "steps_s": step_times}),
              flush=True)


def launch(way: str, cfg: BenchConfig) -> dict:
    """Start `way` as its own processes and return rank 0's result."""
    args = [sys.executable, __file__, "--worker", way, "--config", json.dumps(asdict(cfg))]
    env = dict(os.environ)
    if way.startswith("mpilab"):
        cmd = [str(BIN / "mpiexec"), "-n", str(cfg.ranks), *args]
    elif way == "torchrun-ddp":
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={cfg.ranks}", *args[1:]]
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.ranks))
    elif way == "independent":
        return _independent(args, cfg, env)
    else:
        cmd = args
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return _result(way, proc.returncode, proc.stdout, proc.stderr)


def _result(way: str, returncode: int, stdout: str, stderr: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{way} failed ({returncode}):\n{stderr[-3000:]}")


def _independent(args: list[str], cfg: BenchConfig, env: dict) -> dict:
    """cfg.ranks single processes started together, each timing its own steps while all
    are busy (FileGroup); their samples/s added up."""
    with tempfile.TemporaryDirectory(prefix="mpilab-bench-") as folder:
        env = {**env, "MPILAB_BENCH_GROUP": f"{folder},{cfg.ranks}"}
        procs = [subprocess.Popen([*args[:3], "single", *args[4:]], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(cfg.ranks)]
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            results.append(_result("independent", proc.returncode, stdout, stderr))
    total = sum(r["samples_s"] for r in results)
    # the same steps as if each had waited for the slowest, step by step: what their own
    # ups and downs would cost synchronous training, with no communication at all
    paired = sum(max(steps) for steps in zip(*(r["steps_s"] for r in results)))
    return {"way": "independent", "samples_s": total,
            "step_ms": max(r["step_ms"] for r in results), "params": results[0]["params"],
            "paired_samples_s": cfg.steps * cfg.batch * cfg.ranks / paired}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "both"], default="both")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--mlp-batch", type=int, default=16, help="per rank")
    parser.add_argument("--cnn-batch", type=int, default=32, help="per rank")
    parser.add_argument("--width", type=int, default=2048, help="MLP hidden width")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every way this often, interleaved, and keep the median")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        worker(a.worker, BenchConfig(**json.loads(a.config)))
        return
    models = ["mlp", "cnn"] if a.model == "both" else [a.model]
    print(f"{a.ranks} ranks, {os.cpu_count()} cores, {a.steps} timed steps after {a.warmup}, "
          f"median of {a.repeats}")
    print(f"{'model':6} {'way':14} {'params':>10} {'samples/s':>11} {'ms/step':>9}")
    for name in models:
        batch = a.mlp_batch if name == "mlp" else a.cnn_batch
        cfg = BenchConfig(name, a.ranks, batch, a.steps, a.warmup, a.width, a.bucket_mb)
        # rotate the order each round, so a burst of outside load hits every way alike
        rounds = [WAYS[i % len(WAYS):] + WAYS[:i % len(WAYS)] for i in range(a.repeats)]
        runs = [{way: launch(way, cfg) for way in order} for order in rounds]
        got = {way: _median_run([r[way] for r in runs]) for way in WAYS}
        for way, r in got.items():
            print(f"{name:6} {way:14} {r['params']:>10,} {r['samples_s']:>11.1f} "
                  f"{r['step_ms']:>9.1f}")
        mpi, tch, ddp, one, apart = (got[w]["samples_s"] for w in WAYS)
        print(f"{name:6} mpilab-mpi / torchrun-ddp = {mpi / ddp:.2f}x   "
              f"mpilab-torch / torchrun-ddp = {tch / ddp:.2f}x   "
              f"scaling efficiency (mpilab-mpi, {a.ranks} ranks vs 1 process) = "
              f"{100 * mpi / (a.ranks * one):.0f}%   "
              f"({a.ranks} independent processes: {100 * apart / (a.ranks * one):.0f}%, "
              f"their steps paired as if synchronised: "
              f"{100 * got['independent']['paired_samples_s'] / (a.ranks * one):.0f}%; "
              f"mpilab-mpi of the independent: {100 * mpi / apart:.0f}%)")
        per_round = [r["mpilab-mpi"]["samples_s"] / r["torchrun-ddp"]["samples_s"]
                     for r in runs]
        print(f"{name:6} mpilab-mpi / torchrun-ddp in each round: "
              + ", ".join(f"{x:.2f}x" for x in per_round))


def _median_run(runs: list[dict]) -> dict:
    """The run with the median samples/s (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["samples_s"])
    return ordered[(len(ordered) - 1) // 2]


if __name__ == "__main__":
    main()

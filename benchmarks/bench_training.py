"""Training throughput: mpilab.DataParallel (mpi, torch) against torchrun + plain DDP.

One run trains the same model with the same global batch, on synthetic data, as:

- ``mpilab-mpi``:   ``mpiexec -n N``, ``mpilab.DataParallel(backend="mpi")``
- ``mpilab-torch``: ``mpiexec -n N``, ``mpilab.DataParallel(backend="torch")``
- ``torchrun-ddp``: ``torchrun --nproc-per-node N``, a plain DistributedDataParallel script
- ``single``:       one process, one core's worth of threads, the per-rank batch
  (the baseline of the scaling efficiency: samples/s of N ranks / (N x single))

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
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MARK = "@@bench@@ "
BIN = Path(sys.executable).parent
WAYS = ("mpilab-mpi", "mpilab-torch", "torchrun-ddp", "single")


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


def train(model, x, y, cfg: BenchConfig, barrier) -> float:
    """Seconds for cfg.steps SGD steps after cfg.warmup (slowest rank's view)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = 0.0
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            barrier()
            start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    barrier()
    return time.perf_counter() - start


def worker(way: str, cfg: BenchConfig) -> None:
    """Runs inside each launched process; rank 0 prints the result line."""
    import torch

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
    else:
        rank, world = 0, 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.ranks))
        model, x, y = build(cfg)
        elapsed = train(model, x, y, cfg, lambda: None)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(MARK + json.dumps({"way": way, "samples_s": cfg.steps * cfg.batch * world / elapsed,
                                 "step_ms": 1000 * elapsed / cfg.steps, "params": params}),
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
    else:
        cmd = args
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{way} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


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
        mpi, tch, ddp, one = (got[w]["samples_s"] for w in WAYS)
        print(f"{name:6} mpilab-mpi / torchrun-ddp = {mpi / ddp:.2f}x   "
              f"mpilab-torch / torchrun-ddp = {tch / ddp:.2f}x   "
              f"scaling efficiency (mpilab-mpi, {a.ranks} ranks vs 1 process) = "
              f"{100 * mpi / (a.ranks * one):.0f}%")


def _median_run(runs: list[dict]) -> dict:
    """The run with the median samples/s (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["samples_s"])
    return ordered[(len(ordered) - 1) // 2]


if __name__ == "__main__":
    main()

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

All five are started together, warmed up, and then take turns: a round gives every way
one block (one untimed step, then ``--steps`` timed ones) while the others wait, blocked
on a socket (no CPU); the order turns each round. Blocks of the ways compared sit seconds
apart, so a change in the machine's speed over a run (this one's cores drift by 10-30%
from minute to minute) hits them alike, and no figure includes a process's start.

    python benchmarks/bench_training.py                       # both models, ~2 minutes
    python benchmarks/bench_training.py --model mlp --steps 50
    python benchmarks/bench_training.py --one-job --repeats 9  # the step alone

``--one-job`` times the step alone instead: the plain model, mpilab.DataParallel and DDP
in turn in the same ranks of one ``mpiexec`` job, so that what differs between them is
the wrapper, not the processes or the minute.

Figures on a shared machine are noisy: run it alone, compare within one run only, and
use ``--repeats 5`` or more (rounds; the median block of each way kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from options import at_least, count

BIN = Path(sys.executable).parent
ONE_JOB = "@@one-job@@ "
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


class Turns:
    """A launched process's line to the benchmark: it waits here, blocked on a socket, while
    other ways take their turn, and reports each block it trains."""

    def __init__(self, way: str, index: int):
        host, port = os.environ["MPILAB_BENCH_TURNS"].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.lines = self.sock.makefile("r")
        self.sock.sendall((json.dumps({"way": way, "index": index}) + "\n").encode())

    def wait(self) -> bool:
        """Blocks until this process's next turn: True to train a block, False to stop."""
        return self.lines.readline().strip() == "go"

    def report(self, result: dict) -> None:
        self.sock.sendall((json.dumps(result) + "\n").encode())


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


def stepper(model, x, y) -> Callable[[], None]:
    """One SGD step of `model` on the batch (x, y), as a function."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def wrap(kind: str, model, cfg: BenchConfig):
    """`model` as a way trains it: "plain", "mpilab-mpi" / "mpilab-torch"
    (mpilab.DataParallel over that backend) or "ddp" (DistributedDataParallel on torch's
    default group)."""
    if kind.startswith("mpilab-"):
        import mpilab

        return mpilab.DataParallel(model, backend=kind.split("-")[1], bucket_mb=cfg.bucket_mb)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb)
    return model


def threads(cfg: BenchConfig) -> int:
    """Torch threads for each process of every way: cores / ranks, as mpilab's bootstrap
    gives its ranks."""
    return max(1, (os.cpu_count() or 1) // cfg.ranks)


def turned(names: tuple[str, ...] | list[str], i: int) -> list[str]:
    """`names` in the order of round `i`: turned by one each round, so each takes every
    place (a burst of outside load then hits them alike)."""
    return [*names[i % len(names):], *names[:i % len(names)]]


def train(model, x, y, cfg: BenchConfig, barrier, turns: Callable[[], Turns],
          group: FileGroup | None = None) -> None:
    """cfg.warmup steps, then (connected through `turns()`) one block of cfg.steps timed
    steps at each turn; the block's seconds (between two barriers: the slowest rank's) and
    each step's are reported.

    With a `group` (independent processes): a block's steps are timed from when every
    process of the group is ready, and a process done with them goes on training until
    every other one is done too, so each is timed while all cores are busy."""
    step = stepper(model, x, y)
    for _ in range(cfg.warmup):
        step()
    line = turns()
    block = 0
    while line.wait():
        block += 1
        step()  # untimed: caches and pages back after the other ways' turns
        if group is not None:
            group.meet(f"ready{block}")
        barrier()
        step_times = []
        start = time.perf_counter()
        for _ in range(cfg.steps):
            before = time.perf_counter()
            step()
            step_times.append(time.perf_counter() - before)
        if group is not None:
            elapsed = time.perf_counter() - start
            group.arrive(f"done{block}")
            while not group.all_arrived(f"done{block}"):
                step()
        else:
            barrier()
            elapsed = time.perf_counter() - start
        line.report({"elapsed": elapsed, "steps_s": step_times})


def worker(way: str, cfg: BenchConfig) -> None:
    """Runs inside each launched process."""
    import torch

    barrier, group = (lambda: None), None
    if way.startswith("mpilab"):
        import mpilab

        ctx = mpilab.init()  # its bootstrap sets the threads
        rank, barrier = ctx.rank, ctx.comm.Barrier
        kind = way
    elif way == "torchrun-ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, barrier = dist.get_rank(), dist.barrier
        torch.set_num_threads(threads(cfg))
        kind = "ddp"
    else:  # single, independent: one process on its own
        rank = int(os.environ.get("MPILAB_BENCH_INDEX", "0"))
        torch.set_num_threads(threads(cfg))
        spec = os.environ.get("MPILAB_BENCH_GROUP")
        group = FileGroup(spec) if spec else None
        kind = "plain"
    model, x, y = build(cfg)
    train(wrap(kind, model, cfg), x, y, cfg, barrier, lambda: Turns(way, rank), group)
    if way == "torchrun-ddp":
        torch.distributed.destroy_process_group()


def one_job(cfg: BenchConfig, rounds: int) -> None:
    """Runs in each rank of one ``mpiexec`` job: the plain model, mpilab.DataParallel and
    DDP (on the torch group mpilab.init sets up), each its own copy, a block of cfg.steps
    steps each in turn; rank 0 prints every block's seconds a step. The same processes,
    threads and seconds for all three: what remains is what each wrapper costs a step,
    the wait for the slower rank included."""
    import mpilab
    import torch.distributed as dist

    ctx = mpilab.init()
    if not dist.is_initialized():
        raise SystemExit("bench_training: mpilab.init() set up no torch.distributed group")
    names = ("plain", "mpilab-mpi", "ddp")
    steps = {}
    for name in names:
        model, x, y = build(cfg)
        steps[name] = stepper(wrap(name, model, cfg), x, y)
        for _ in range(cfg.warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in turned(names, r):
            steps[name]()  # untimed: caches back after the other blocks
            ctx.comm.Barrier()
            start = time.perf_counter()
            for _ in range(cfg.steps):
                steps[name]()
            ctx.comm.Barrier()
            times[name].append((time.perf_counter() - start) / cfg.steps)
    if ctx.rank == 0:
        print(ONE_JOB + json.dumps(times), flush=True)


def run_one_job(cfg: BenchConfig, rounds: int) -> dict[str, list[float]]:
    """`one_job` under ``mpiexec -n cfg.ranks``: {wrapper: seconds a step, each block}."""
    cmd = [str(BIN / "mpiexec"), "-n", str(cfg.ranks), sys.executable, __file__,
           "--worker", "one-job", "--config", json.dumps(asdict(cfg)),
           "--repeats", str(rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(ONE_JOB):
            return json.loads(line[len(ONE_JOB):])
    raise RuntimeError(f"the one-job run failed ({proc.returncode}):\n"
                       f"{(proc.stdout + proc.stderr)[-3000:]}")


@dataclass
class Way:
    """One way's launched processes and, once they have connected, their sockets."""

    name: str
    procs: list[subprocess.Popen]
    logs: list[Path]
    expected: int
    lines: dict[int, tuple[socket.socket, object]] = field(default_factory=dict)

    def failure(self) -> str | None:
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() not in (None, 0):
                return f"{self.name} failed ({proc.returncode}):\n{log.read_text()[-3000:]}"
        return None


def launch(name: str, cfg: BenchConfig, folder: Path, env: dict) -> Way:
    """Start `name`'s processes; each connects back to the benchmark when warmed up."""
    args = [sys.executable, __file__, "--worker", name, "--config", json.dumps(asdict(cfg))]
    env = dict(env)
    if name.startswith("mpilab"):
        cmds = [[str(BIN / "mpiexec"), "-n", str(cfg.ranks), *args]]
    elif name == "torchrun-ddp":
        cmds = [[str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={cfg.ranks}",
                 *args[1:]]]
        env["OMP_NUM_THREADS"] = str(threads(cfg))
    elif name == "independent":
        env["MPILAB_BENCH_GROUP"] = f"{folder / name},{cfg.ranks}"
        (folder / name).mkdir()
        cmds = [args] * cfg.ranks
    else:
        cmds = [args]
    procs, logs = [], []
    for i, cmd in enumerate(cmds):
        logs.append(folder / f"{name}.{i}.log")
        with logs[-1].open("w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env={**env, "MPILAB_BENCH_INDEX": str(i)}))
    expected = 1 if name == "single" else cfg.ranks
    return Way(name, procs, logs, expected)


def connect(server: socket.socket, ways: dict[str, Way], timeout: float = 600) -> None:
    """Accept every launched process's connection (it connects once warmed up)."""
    server.settimeout(1.0)
    deadline = time.monotonic() + timeout
    while any(len(w.lines) < w.expected for w in ways.values()):
        for w in ways.values():
            if (why := w.failure()) is not None:
                raise RuntimeError(why)
        if time.monotonic() > deadline:
            raise RuntimeError("the launched processes did not all connect in time")
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        lines = conn.makefile("r")
        hello = json.loads(lines.readline())
        ways[hello["way"]].lines[hello["index"]] = (conn, lines)


def turn(way: Way, cfg: BenchConfig) -> dict:
    """One block of `way`: samples/s (an independent group's summed), ms a step, and
    for the independent group the throughput of its steps paired as if synchronised."""
    for conn, _ in way.lines.values():
        conn.sendall(b"go\n")
    got = {i: json.loads(lines.readline() or "null") for i, (_, lines) in way.lines.items()}
    if None in got.values():
        raise RuntimeError(way.failure() or f"{way.name} closed its connection")
    if way.name != "independent":
        elapsed = got[0]["elapsed"]  # rank 0's
        world = 1 if way.name == "single" else cfg.ranks
        return {"samples_s": cfg.steps * cfg.batch * world / elapsed,
                "step_ms": 1000 * elapsed / cfg.steps}
    # the same steps as if each had waited for the slowest, step by step: what their own
    # ups and downs would cost synchronous training, with no communication at all
    paired = sum(max(steps) for steps in zip(*(r["steps_s"] for r in got.values())))
    return {"samples_s": sum(cfg.steps * cfg.batch / r["elapsed"] for r in got.values()),
            "step_ms": 1000 * max(r["elapsed"] for r in got.values()) / cfg.steps,
            "paired_samples_s": cfg.steps * cfg.batch * cfg.ranks / paired}


def run_rounds(cfg: BenchConfig, repeats: int) -> list[dict[str, dict]]:
    """Every way started and warmed up at once, then `repeats` rounds of one block each,
    the order turned every round; one {way: block result} a round."""
    with tempfile.TemporaryDirectory(prefix="mpilab-bench-") as tmp, \
            socket.create_server(("127.0.0.1", 0)) as server:
        env = {**os.environ, "MPILAB_BENCH_TURNS": f"127.0.0.1:{server.getsockname()[1]}"}
        ways: dict[str, Way] = {}
        try:
            for name in WAYS:
                ways[name] = launch(name, cfg, Path(tmp), env)
            connect(server, ways)
            return [{name: turn(ways[name], cfg) for name in turned(WAYS, i)}
                    for i in range(repeats)]
        finally:
            for w in ways.values():
                for conn, _ in w.lines.values():
                    with contextlib.suppress(OSError):
                        conn.sendall(b"stop\n")
                        conn.close()
            server.close()  # a process not yet taken in finds the door shut, and ends
            for w in ways.values():
                for proc in w.procs:
                    _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """Wait for a launched process to end; stop it if it does not (SIGTERM first, which
    mpiexec and torchrun pass on to their ranks)."""
    for stop in (None, proc.terminate, proc.kill):
        if stop is not None:
            stop()
        try:
            proc.wait(timeout=60 if stop is None else 10)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "both"], default="both")
    parser.add_argument("--ranks", type=count, default=2)
    parser.add_argument("--steps", type=count, default=30, help="timed steps a block")
    parser.add_argument("--warmup", type=at_least(0), default=5)
    parser.add_argument("--mlp-batch", type=count, default=16, help="per rank")
    parser.add_argument("--cnn-batch", type=count, default=32, help="per rank")
    parser.add_argument("--width", type=count, default=2048, help="MLP hidden width")
    parser.add_argument("--bucket-mb", type=at_least(0.001, float), default=25.0)
    parser.add_argument("--repeats", type=count, default=1,
                        help="rounds: one block of every way each, the median block kept")
    parser.add_argument("--one-job", action="store_true",
                        help="instead: the plain model, mpilab.DataParallel and DDP in turn "
                             "in the same ranks of one mpiexec job")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker == "one-job":
        one_job(BenchConfig(**json.loads(a.config)), a.repeats)
        return
    if a.worker:
        worker(a.worker, BenchConfig(**json.loads(a.config)))
        return
    models = ["mlp", "cnn"] if a.model == "both" else [a.model]
    if a.one_job:
        print(f"{a.ranks} ranks in one mpiexec job, {os.cpu_count()} cores, blocks of "
              f"{a.steps} steps in turn, median of {a.repeats} rounds")
        for name in models:
            batch = a.mlp_batch if name == "mlp" else a.cnn_batch
            cfg = BenchConfig(name, a.ranks, batch, a.steps, a.warmup, a.width, a.bucket_mb)
            times = run_one_job(cfg, a.repeats)
            plain = statistics.median(times["plain"])
            print(f"{name:6} plain {1000 * plain:.1f} ms a step; "
                  + "; ".join(f"{w} {100 * (statistics.median(times[w]) / plain - 1):+.1f}%"
                              for w in ("mpilab-mpi", "ddp"))
                  + "; mpilab-mpi / ddp, seconds a step in each round: "
                  + ", ".join(f"{m / d:.2f}" for m, d in zip(times["mpilab-mpi"], times["ddp"])))
        return
    print(f"{a.ranks} ranks, {os.cpu_count()} cores, blocks of {a.steps} timed steps "
          f"after {a.warmup}, median of {a.repeats} rounds")
    print(f"{'model':6} {'way':14} {'samples/s':>11} {'ms/step':>9}")
    for name in models:
        batch = a.mlp_batch if name == "mlp" else a.cnn_batch
        cfg = BenchConfig(name, a.ranks, batch, a.steps, a.warmup, a.width, a.bucket_mb)
        runs = run_rounds(cfg, a.repeats)
        got = {way: _median_run([r[way] for r in runs]) for way in WAYS}
        for way, r in got.items():
            print(f"{name:6} {way:14} {r['samples_s']:>11.1f} {r['step_ms']:>9.1f}")
        mpi, tch, ddp, one, apart = (got[w]["samples_s"] for w in WAYS)
        print(f"{name:6} mpilab-mpi / torchrun-ddp = {mpi / ddp:.2f}x   "
              f"mpilab-torch / torchrun-ddp = {tch / ddp:.2f}x   "
              f"scaling efficiency (mpilab-mpi, {a.ranks} ranks vs 1 process) = "
              f"{100 * mpi / (a.ranks * one):.0f}%   "
              f"({a.ranks} independent processes: {100 * apart / (a.ranks * one):.0f}%, "
              f"their steps paired as if synchronised: "
              f"{100 * got['independent']['paired_samples_s'] / (a.ranks * one):.0f}%; "
              f"mpilab-mpi of the independent: {100 * mpi / apart:.0f}%)")
        lead = [r["mpilab-mpi"]["samples_s"] / r["torchrun-ddp"]["samples_s"] for r in runs]
        scaling = [r["mpilab-mpi"]["samples_s"] / (a.ranks * r["single"]["samples_s"])
                   for r in runs]
        print(f"{name:6} in each round: mpilab-mpi / torchrun-ddp "
              + ", ".join(f"{x:.2f}x" for x in lead)
              + "; scaling " + ", ".join(f"{100 * x:.0f}%" for x in scaling))


def _median_run(runs: list[dict]) -> dict:
    """The block with the median samples/s (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["samples_s"])
    return ordered[(len(ordered) - 1) // 2]


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:  # a way failed: its own output says why
        sys.exit(f"bench_training: {e}")

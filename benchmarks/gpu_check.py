"""The one prepared check of mpilab's GPU path: what ran, what was skipped and why.

    .venv/bin/python benchmarks/gpu_check.py          # make gpu-check; under 8 minutes

On a node with GPUs it runs, each part as real ranks (``mpiexec``, ``torchrun``, and a
notebook kernel with ``%mpilab start``), one rank per GPU (at most --max-ranks):

- bootstrap on GPUs: one rank per GPU by node-local rank, NCCL, distinct GPUs;
- NCCL allreduce across ranks: mpilab's collectives with ``backend="auto"`` (NCCL) and
  ``"mpi"`` (staged through pinned memory), every dtype and op, exact values; bus
  bandwidth of both beside ``dist.all_reduce`` itself;
- GPUs shared by two ranks over gloo (``--backend gloo``): GPU tensors over mpilab's
  staged MPI path, ``DataParallel`` on it, and the one line NCCL would have given;
- DataParallel ``auto`` against torchrun + DDP(NCCL) on the same model: the same
  result as one process on the global batch, and samples/s side by side;
- fp16 and PowerSGD compression on CUDA (``auto``, and ``mpi`` staged);
- a rank failing inside an NCCL collective: the cell ends within seconds, the NCCL
  group is made again and training goes on with the ranks' state; a direct
  ``dist.all_reduce`` stuck on the GPU restarts the ranks with the plain message;
- a checkpoint saved from CUDA and loaded (on the ranks' GPUs and on CPU).

With one GPU, NCCL cannot run across ranks (it refuses two ranks on one GPU): those
rows say so and the rest runs. Without a GPU every row is skipped with its reason and
the script exits 0. It exits 1 on any wrong result. Figures: samples/s and GB/s of this
run only, each beside its peer measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
BUDGET_S = 420.0  # the parts, launches included; with the clean-up, under 8 minutes
NOT_RUN = "skipped"

ROWS = (
    "bootstrap on GPUs",
    "nccl allreduce across ranks",
    "allreduce bus bandwidth",
    "GPUs shared by ranks (gloo + staged MPI)",
    "DataParallel auto vs torchrun + DDP(NCCL)",
    "compression on CUDA (fp16, PowerSGD)",
    "rank failure inside an NCCL collective",
    "checkpoint saved from CUDA, loaded",
)


@dataclass
class Row:
    """One line of the table: a check, what came of it, and the figures or the reason."""

    check: str
    status: str  # ok | FAIL | skipped
    detail: str


@dataclass(frozen=True)
class SpeedConfig:
    """The model both DataParallel and torchrun + DDP train (wide MLP, synthetic data)."""

    width: int = 4096
    depth: int = 8
    batch: int = 256  # per rank
    steps: int = 20
    warmup: int = 5
    windows: int = 3  # timed windows; the median is kept


# ============================================================================ the ranks
class Rows:
    """Rank 0 writes each row as soon as every rank has its result (one JSON line)."""

    def __init__(self, ctx, path: str):
        self.ctx = ctx
        self.path = path

    def figure(self, name: str, value: float) -> None:
        """A measured figure the driver puts beside its peer's."""
        if self.ctx.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"figure": name, "value": value}) + "\n")

    def add(self, check: str, status: str, detail: str) -> None:
        everyone = self.ctx.comm.allgather((status, detail))
        failed = [(r, d) for r, (s, d) in enumerate(everyone) if s == "FAIL"]
        if failed:
            status, detail = "FAIL", f"rank {failed[0][0]}: {failed[0][1]}"
        if self.ctx.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(asdict(Row(check, status, detail))) + "\n")

    def run(self, check: str, fn) -> None:
        try:
            status, detail = fn()
        except Exception as e:  # noqa: BLE001 - the row says what broke
            status, detail = "FAIL", f"{type(e).__name__}: {e}"[:400]
        self.add(check, status, detail)


def _mlp(width: int, depth: int, out: int = 16):
    from torch import nn

    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, out))


def _gpu_identity(torch, device) -> str | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", "") or f"{props.name}-{props.pci_bus_id}")


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_speed(torch, step, device, barrier, cfg: SpeedConfig, world: int) -> float:
    """Median samples/s over cfg.windows timed windows of cfg.steps steps."""
    for _ in range(cfg.warmup):
        step()
    rates = []
    for _ in range(cfg.windows):
        _sync(torch, device)
        barrier()
        start = time.perf_counter()
        for _ in range(cfg.steps):
            step()
        _sync(torch, device)
        barrier()
        rates.append(cfg.steps * cfg.batch * world / (time.perf_counter() - start))
    return statistics.median(rates)


def part_ranks(out: str, cfg: SpeedConfig, gloo_shared: bool) -> None:
    """Every check that runs on plain ranks under mpiexec (gloo_shared: two ranks on
    one GPU, sharing it over gloo and mpilab's staged MPI path)."""
    import mpilab
    import torch

    started = time.perf_counter()
    ctx = mpilab.init(gpus="0", backend="gloo") if gloo_shared else mpilab.init()
    ready_s = time.perf_counter() - started
    rows = Rows(ctx, out)
    if gloo_shared:
        rows.run(ROWS[3], lambda: _check_shared(torch, ctx))
        return
    rows.run(ROWS[0], lambda: _check_bootstrap(torch, ctx, ready_s))
    rows.run(ROWS[1], lambda: _check_allreduce(torch, ctx))
    rows.run(ROWS[2], lambda: _check_bandwidth(torch, ctx))
    rows.run(ROWS[4], lambda: _check_data_parallel(torch, ctx, cfg, rows))
    rows.run(ROWS[5], lambda: _check_compression(torch, ctx))
    rows.run(ROWS[7], lambda: _check_checkpoint(torch, ctx, os.path.dirname(out)))


def _check_bootstrap(torch, ctx, ready_s: float) -> tuple[str, str]:
    from mpilab.rank import bootstrap

    dev = ctx.device
    if dev.type != "cuda":
        return "FAIL", f"rank {ctx.rank} is on {dev}, not a GPU"
    visible = list(range(torch.cuda.device_count()))
    want = bootstrap.gpu_for_rank(ctx.local_rank, visible)
    everyone = ctx.comm.allgather((ctx.host, ctx.local_rank, dev.index,
                                   _gpu_identity(torch, dev)))
    on_node = [u for h, _, _, u in sorted(everyone, key=lambda e: (e[0], e[1]))
               if h == ctx.host]
    problems = []
    if dev.index != want:
        problems.append(f"node-local rank {ctx.local_rank} took GPU {dev.index}, not {want}")
    if ctx.backend != "nccl":
        problems.append(f"backend {ctx.backend}, not nccl")
    line = bootstrap.placement_error(on_node, ctx.backend, ctx.host)
    if line:
        problems.append(line)
    if problems:
        return "FAIL", "; ".join(problems)
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "ok", (f"{ctx.world_size} ranks, one GPU each ({len(set(on_node))} on "
                  f"{ctx.host}), nccl, ready in {ready_s:.1f} s"
                  + (f"; CUDA_VISIBLE_DEVICES={cvd}" if cvd else ""))


def _expected(torch, world: int, numel: int, op: str):
    parts = torch.stack([(torch.arange(numel) * 7 + r * 13) % 17 - 8 for r in range(world)])
    return {"sum": parts.sum(0), "max": parts.max(0).values, "min": parts.min(0).values,
            "mean": parts.sum(0).double() / world}[op]


def _collective_failures(torch, ctx, backend: str) -> list[str]:
    """mpilab's collectives on this rank's device: exact values, every dtype and op."""
    import mpilab

    dev, world, rank = ctx.device, ctx.world_size, ctx.rank
    failures = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        for op in ("sum", "mean", "max", "min"):
            numel = 1000
            x = ((torch.arange(numel) * 7 + rank * 13) % 17 - 8).to(dtype).to(dev)
            mpilab.allreduce(x, op=op, backend=backend)
            want = _expected(torch, world, numel, op)
            if op == "mean" and not dtype.is_floating_point:
                want = torch.div(_expected(torch, world, numel, "sum"), world,
                                 rounding_mode="floor")
            tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
            if x.device != dev or not torch.allclose(x.double().cpu(), want.double(),
                                                     rtol=tol, atol=tol):
                failures.append(f"{backend} {op} {dtype}")
    pair = [torch.ones(3, device=dev) * (rank + 1), torch.ones(2, 2, device=dev)]
    mpilab.allreduce(pair, backend=backend)  # a list: tensor fusion
    if pair[0].tolist() != [world * (world + 1) / 2] * 3 or pair[1].sum().item() != 4 * world:
        failures.append(f"{backend} fused list")
    b = torch.full((4,), float(rank), device=dev)
    if mpilab.broadcast(b, root=world - 1, backend=backend).tolist() != [world - 1.0] * 4:
        failures.append(f"{backend} broadcast")
    g = mpilab.allgather(torch.tensor([rank], device=dev), backend=backend)
    if g.view(-1).tolist() != list(range(world)):
        failures.append(f"{backend} allgather")
    return failures


def _check_allreduce(torch, ctx) -> tuple[str, str]:
    from mpilab.rank import torch_group

    probe = torch.zeros(1, device=ctx.device)
    chosen = torch_group.resolve_transport("auto", probe)
    failures = []
    if chosen != "torch":
        failures.append(f"auto chose {chosen} for a GPU tensor, not NCCL")
    failures += _collective_failures(torch, ctx, "auto")
    failures += _collective_failures(torch, ctx, "mpi")
    if failures:
        return "FAIL", "wrong: " + ", ".join(failures[:8])
    if ctx.world_size == 1:
        return NOT_RUN, ("one GPU: NCCL across ranks cannot run (it refuses two ranks on "
                         "one GPU); on one rank auto and mpi give the right values")
    return "ok", (f"{ctx.world_size} ranks; auto (NCCL) and mpi (staged): 4 dtypes x 4 ops, "
                  "fused list, broadcast, allgather exact")


def _busbw(torch, ctx, run, nbytes: int, iters: int) -> float:
    """GB/s of allreduce `run` of nbytes (nccl-tests' bus bandwidth)."""
    world = ctx.world_size
    run()
    _sync(torch, ctx.device)
    ctx.comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(torch, ctx.device)
    elapsed = (time.perf_counter() - start) / iters
    return 2 * (world - 1) / world * nbytes / elapsed / 1e9


def _check_bandwidth(torch, ctx) -> tuple[str, str]:
    import mpilab
    import torch.distributed as dist

    if ctx.world_size == 1:
        return NOT_RUN, "one GPU: no traffic between ranks to measure"
    parts = []
    for mib in (4, 64):
        x = torch.zeros(mib << 18, device=ctx.device)  # float32: MiB * 2^18 elements
        nbytes = x.numel() * 4
        raw = _busbw(torch, ctx, lambda x=x: dist.all_reduce(x), nbytes, 20)
        auto = _busbw(torch, ctx, lambda x=x: mpilab.allreduce(x), nbytes, 20)
        staged = _busbw(torch, ctx, lambda x=x: mpilab.allreduce(x, backend="mpi"),
                        nbytes, 3)
        parts.append(f"{mib} MiB: mpilab auto {auto:.1f}, dist.all_reduce {raw:.1f}, "
                     f"staged mpi {staged:.1f} GB/s")
    return "ok", "; ".join(parts)


def _check_data_parallel(torch, ctx, cfg: SpeedConfig, rows: Rows) -> tuple[str, str]:
    """auto: the same result as one process on the global batch; then its speed."""
    import mpilab

    dev, world, rank = ctx.device, ctx.world_size, ctx.rank
    errors = {}
    for backend in ("auto", "mpi"):
        torch.manual_seed(0)
        model = _mlp(128, 3).to(dev)
        ref = copy.deepcopy(model)
        dp = mpilab.DataParallel(model, backend=backend)
        if backend == "auto" and dev.type == "cuda" and dp.backend != "torch":
            return "FAIL", f"DataParallel auto took {dp.backend!r} on NCCL, not DDP"
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(world * 8, 128, generator=gen).to(dev)
            y = torch.randn(world * 8, 16, generator=gen).to(dev)
            mine = slice(rank * 8, (rank + 1) * 8)
            opt.zero_grad()
            torch.nn.functional.mse_loss(dp(x[mine]), y[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
        errors[backend] = max(((p - r).abs().max() / r.abs().max()).item()
                              for p, r in zip(model.parameters(), ref.parameters()))
    if max(errors.values()) > 1e-4:
        return "FAIL", ("not the one-process result: relative error "
                        + ", ".join(f"{b} {e:.1e}" for b, e in errors.items()))
    torch.manual_seed(0)
    model = _mlp(cfg.width, cfg.depth).to(dev)
    dp = mpilab.DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(cfg.batch, cfg.width, device=dev)
    y = torch.randn(cfg.batch, 16, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(dp(x), y).backward()
        opt.step()

    rate = _train_speed(torch, step, dev, ctx.comm.Barrier, cfg, world)
    params = sum(p.numel() for p in model.parameters())
    rows.figure("dataparallel_samples_s", rate)
    way = "DDP over NCCL" if dp.backend == "torch" else "mpilab's MPI path"
    return "ok", (f"auto = {way}; the same result as one process on the global batch "
                  f"(auto {errors['auto']:.1e}, mpi staged {errors['mpi']:.1e}); "
                  f"{params / 1e6:.1f}M-parameter MLP: {rate:,.0f} samples/s")


def _check_compression(torch, ctx) -> tuple[str, str]:
    import mpilab
    from mpilab.rank import agent

    dev = ctx.device
    results = []
    for backend in ("auto", "mpi"):
        for compression in ("fp16", "powersgd"):
            records: list[tuple[str, dict]] = []
            emit = agent.current().emit
            agent.current().emit = lambda kind, _into=records, **f: _into.append((kind, f))
            try:
                torch.manual_seed(0)
                model = _mlp(256, 2).to(dev)
                dp = mpilab.DataParallel(model, backend=backend, compression=compression)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                gen = torch.Generator().manual_seed(10 + ctx.rank)
                x = torch.randn(32, 256, generator=gen).to(dev)
                y = torch.randn(32, 16, generator=gen).to(dev)
                losses = []
                for _ in range(8):
                    opt.zero_grad()
                    loss = torch.nn.functional.mse_loss(dp(x), y)
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
            finally:
                agent.current().emit = emit
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            spread = mpilab.allreduce(flat.clone(), op="max") - \
                mpilab.allreduce(flat.clone(), op="min")
            ratios = [f["values"].get("compression_ratio") for k, f in records if k == "log"]
            ratio = ratios[-1] if ratios and ratios[-1] else 0.0
            name = f"{backend}/{compression}"
            if spread.abs().max().item() > 1e-5:
                return "FAIL", f"{name}: the ranks' parameters differ"
            if not losses[-1] < losses[0]:
                return "FAIL", f"{name}: loss did not go down ({losses[0]:.3f} -> {losses[-1]:.3f})"
            if not ratio > 1:
                return "FAIL", f"{name}: no compression ratio logged ({ratios[-3:]})"
            results.append(f"{name} ({dp.backend}) x{ratio:.1f}")
    return "ok", "ranks agree, loss falls; ratio " + ", ".join(results)


def _check_checkpoint(torch, ctx, directory: str) -> tuple[str, str]:
    import mpilab

    dev = ctx.device
    torch.manual_seed(0)
    model = _mlp(64, 2).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, device=dev)).sum().backward()
    opt.step()
    path = Path(directory) / "gpu-check.pt"
    mpilab.save_checkpoint(path, model, opt, step=1)
    torch.manual_seed(1)
    fresh = _mlp(64, 2).to(dev)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    extra = mpilab.load_checkpoint(path, fresh, fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  fresh.state_dict().values()))
    state_devices = {str(t.device) for s in fresh_opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0}
    on_cpu = torch.load(path, map_location="cpu", weights_only=True)
    cpu_ok = all(t.device.type == "cpu" for t in on_cpu["model"].values())
    problems = []
    if not same:
        problems.append("loaded weights differ")
    if state_devices != {str(dev)}:
        problems.append(f"optimizer state on {sorted(state_devices)}, not {dev}")
    if extra != {"step": 1}:
        problems.append(f"extra came back as {extra!r}")
    if not cpu_ok:
        problems.append("map_location='cpu' left tensors on the GPU")
    if problems:
        return "FAIL", "; ".join(problems)
    return "ok", (f"saved from {dev} by rank 0, loaded on every rank's GPU (Adam state on "
                  "its device) and on CPU")


def _check_shared(torch, ctx) -> tuple[str, str]:
    """Two ranks on one GPU over gloo: GPU tensors go over mpilab's staged MPI path."""
    import mpilab
    from mpilab.rank import bootstrap, torch_group

    dev = ctx.device
    if dev.type != "cuda":
        return "FAIL", f"rank {ctx.rank} is on {dev}, not a GPU"
    ids = ctx.comm.allgather(_gpu_identity(torch, dev))
    problems = []
    if bootstrap.placement_error(ids, ctx.backend) is not None:
        problems.append("placement refused sharing over gloo")
    nccl_line = bootstrap.placement_error(ids, "nccl", ctx.host)
    if nccl_line is None:
        problems.append("two ranks on one GPU under NCCL were not refused")
    chosen = torch_group.resolve_transport("auto", torch.zeros(1, device=dev))
    if chosen != "mpi":
        problems.append(f"auto chose {chosen} for a GPU tensor of a gloo group")
    problems += _collective_failures(torch, ctx, "auto")
    torch.manual_seed(0)
    model = _mlp(64, 2).to(dev)
    ref = copy.deepcopy(model)
    dp = mpilab.DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 64, generator=gen).to(dev)
        y = torch.randn(16, 16, generator=gen).to(dev)
        mine = slice(ctx.rank * 8, ctx.rank * 8 + 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(dp(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    err = max(((p - r).abs().max() / r.abs().max()).item()
              for p, r in zip(model.parameters(), ref.parameters()))
    if dp.backend != "mpi":
        problems.append(f"DataParallel auto took {dp.backend} on a gloo group")
    if err > 1e-4:
        problems.append(f"DataParallel staged: relative error {err:.1e}")
    if problems:
        return "FAIL", "; ".join(problems[:6])
    return "ok", (f"2 ranks on {dev} over gloo: auto = staged MPI, collectives exact, "
                  f"DataParallel = one process ({err:.1e}); under NCCL: \"{nccl_line}\"")


def part_torchrun(out: str, cfg: SpeedConfig) -> None:
    """torchrun + plain DDP on NCCL: the peer of DataParallel auto, same model."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    local = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(_mlp(cfg.width, cfg.depth).to(dev),
                                    device_ids=[dev] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(cfg.batch, cfg.width, device=dev)
    y = torch.randn(cfg.batch, 16, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    rate = _train_speed(torch, step, dev, dist.barrier, cfg, world)
    if dist.get_rank() == 0:
        with open(out, "a") as f:
            f.write(json.dumps({"figure": "torchrun_samples_s", "value": rate}) + "\n")
    dist.destroy_process_group()


# ======================================================================= the notebook
class _Kernel:
    """A real IPython kernel (jupyter_client), as a notebook runs cells."""

    def __init__(self):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def run(self, code: str, timeout: float) -> tuple[bool, str, float]:
        start = time.monotonic()
        msg_id = self.kc.execute(code)
        texts: list[str] = []
        while True:
            left = start + timeout - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no end of the cell within {timeout:.0f} s: {code[:60]!r}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                texts.append(content["text"])
            elif kind == "error":
                texts.append("\n".join(content["traceback"]) + "\n")
            elif kind in ("display_data", "execute_result"):
                texts.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        took = time.monotonic() - start
        while True:  # the execute reply says whether the cell failed
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                ok = reply["content"]["status"] == "ok"
                break
        return ok, re.sub(r"\x1b\[[0-9;]*m", "", "".join(texts)), took

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run("%mpilab stop", timeout=30)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


_TRAIN_CELL = """%%ranks
model = mpilab.DataParallel(torch.nn.Linear(256, 256).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(STEPS):
    if rank == 1 and step == FAIL_AT:
        raise ValueError('bad batch on rank 1')
    loss = model(torch.randn(64, 256, device=device)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
print('trained', mpilab.rank.torch_group.torch_group_generation())
"""


def check_failure(ranks: int, timeout: float) -> Row:
    """A rank fails while its peer waits in DataParallel's NCCL allreduce; then one
    fails while its peer sits in a direct dist.all_reduce stuck on the GPU."""
    name = ROWS[6]
    deadline = time.monotonic() + timeout
    kernel = _Kernel()
    try:
        def run(code: str, limit: float) -> tuple[bool, str, float]:
            return kernel.run(code, min(limit, max(5.0, deadline - time.monotonic())))

        ok, text, took = run("%load_ext mpilab", 30)
        ok, text, start_s = run(f"%mpilab start -n {ranks}", 180)
        if not ok or "backend nccl" not in text:
            return Row(name, "FAIL", f"start: {text.strip()[-300:]}")
        run("%%ranks\nimport torch\nkept = rank * 10", 60)
        ok, text, took = run(_TRAIN_CELL.replace("STEPS", "20").replace("FAIL_AT", "3"), 120)
        problems = []
        if ok or took > 20:
            problems.append(f"the failing cell {'succeeded' if ok else 'ended'} after "
                            f"{took:.1f} s")
        if text.count("ValueError: bad batch on rank 1") != 1:
            problems.append("the failure was not shown once")
        if "rank 0 was waiting in" not in text:
            problems.append(f"no 'rank 0 was waiting in' line: {text.strip()[-300:]}")
        if "restarted the ranks" in text:
            problems.append("the ranks were restarted, not recovered")
        released_s = took
        ok, text, took = run("%%ranks\nx = torch.ones(2, device=device)\n"
                             "mpilab.allreduce(x)\nprint(x.tolist(), kept, "
                             "mpilab.rank.torch_group.torch_group_generation())", 60)
        # each rank kept its `kept`, and its NCCL group was made again (generation ≥ 1)
        for r in range(2):
            if not ok or not re.search(rf"\[rank {r}\] \[2\.0, 2\.0\] {10 * r} [1-9]", text):
                problems.append(f"after the failure: {text.strip()[-200:]}")
                break
        ok, text, took = run(_TRAIN_CELL.replace("STEPS", "5").replace("FAIL_AT", "-1"), 120)
        if not ok or "trained" not in text:
            problems.append(f"training after recovery: {text.strip()[-200:]}")
        # a direct NCCL call stuck on the GPU: no wait of mpilab's to release it
        ok, text, direct_s = run(
            "%%ranks\nimport torch.distributed as dist\ny = torch.ones(4, device=device)\n"
            "if rank == 1:\n    raise RuntimeError('rank one broke')\n"
            "dist.all_reduce(y)\nprint(y.sum().item())", 180)
        if "restarted the ranks: their state was lost" not in text:
            problems.append(f"direct dist.all_reduce: {text.strip()[-300:]}")
        if problems:
            return Row(name, "FAIL", "; ".join(problems))
        return Row(name, "ok", (
            f"{ranks} ranks: DataParallel's NCCL wait released in {released_s:.1f} s, "
            f"state kept, NCCL group made again, training goes on; a direct "
            f"dist.all_reduce restarted the ranks with the plain message ({direct_s:.0f} s; "
            f"start {start_s:.0f} s)"))
    except Exception as e:  # noqa: BLE001 - the row says what broke
        return Row(name, "FAIL", f"{type(e).__name__}: {e}"[:400])
    finally:
        kernel.close()


# ========================================================================== the driver
@dataclass
class Plan:
    """What this node can run."""

    gpus: int
    ranks: int
    reasons: dict[str, str] = field(default_factory=dict)  # row → why it is skipped


def _launch(cmd: list[str], out: str, timeout: float) -> tuple[list[dict], str]:
    """Run a part; its rows (JSON lines in `out`) and the tail of what it printed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        tail = (proc.stdout + proc.stderr)[-1500:]
        if proc.returncode != 0:
            tail = f"exit {proc.returncode}: {tail}"
    except subprocess.TimeoutExpired as e:
        tail = f"timed out after {timeout:.0f} s: {str(e.stderr or '')[-800:]}"
    rows = []
    if os.path.exists(out):
        with open(out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rows, tail


def _figure(records: list[dict], name: str) -> float | None:
    return next((r["value"] for r in records if r.get("figure") == name), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=8,
                        help="ranks at most (one per GPU; default 8)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    a = parser.parse_args()
    cfg = SpeedConfig(**json.loads(a.config)) if a.config else SpeedConfig()
    if a.part == "ranks":
        part_ranks(a.out, cfg, gloo_shared=False)
        return 0
    if a.part == "shared":
        part_ranks(a.out, cfg, gloo_shared=True)
        return 0
    if a.part == "torchrun":
        part_torchrun(a.out, cfg)
        return 0

    started = time.monotonic()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"mpilab GPU check: torch {torch.__version__}, CUDA "
          f"{torch.version.cuda or 'none'}, {gpus} GPU(s) visible"
          + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""), flush=True)
    rows: dict[str, Row] = {}
    if gpus == 0:
        print("no GPU here (torch.cuda.is_available() is False): every check is skipped; "
              "tests/test_gpu_logic.py proves this path's logic on CPU", flush=True)
        rows = {name: Row(name, NOT_RUN, "no GPU on this machine") for name in ROWS}
        return _report(rows, started)
    ranks = min(gpus, a.max_ranks)
    work = tempfile.mkdtemp(prefix="mpilab-gpu-check-")
    me = [sys.executable, os.path.abspath(__file__), "--config", json.dumps(asdict(cfg))]

    def left() -> float:
        return BUDGET_S - (time.monotonic() - started)

    # 1. torchrun + DDP(NCCL): the peer, measured first in the same run
    out = os.path.join(work, "torchrun.jsonl")
    got, tail = _launch([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={ranks}",
                         *me[1:], "--part", "torchrun", "--out", out],
                        out, max(30.0, min(150.0, left() - 240)))
    peer = _figure(got, "torchrun_samples_s")
    peer_note = "" if peer else f"torchrun + DDP did not run: {tail[-300:]}"
    # 2. the ranks: bootstrap, collectives, bandwidth, DataParallel, compression, checkpoint
    out = os.path.join(work, "ranks.jsonl")
    got, tail = _launch([str(BIN / "mpiexec"), "-n", str(ranks), *me, "--part", "ranks",
                         "--out", out], out, max(60.0, min(240.0, left() - 150)))
    for r in got:
        if "check" in r:
            rows[r["check"]] = Row(**r)
    rate = _figure(got, "dataparallel_samples_s")
    for name in (ROWS[0], ROWS[1], ROWS[2], ROWS[4], ROWS[5], ROWS[7]):
        if name not in rows:
            rows[name] = Row(name, "FAIL", f"did not report: {tail[-400:]}")
    dp = rows[ROWS[4]]
    if dp.status == "ok":
        if peer and rate:
            dp.detail += f"; torchrun + DDP(NCCL) {peer:,.0f} samples/s: {rate / peer:.2f}x"
            if ranks == 1:
                dp.detail += " (one rank: the hooks' cost, no communication)"
        else:
            dp.detail += f"; {peer_note or 'no samples/s from the ranks'}"
    # 3. two ranks sharing GPU 0 over gloo and mpilab's staged MPI path
    out = os.path.join(work, "shared.jsonl")
    got, tail = _launch([str(BIN / "mpiexec"), "-n", "2", *me, "--part", "shared",
                         "--out", out], out, max(30.0, min(120.0, left() - 100)))
    rows[ROWS[3]] = Row(**got[0]) if got else Row(ROWS[3], "FAIL",
                                                  f"did not report: {tail[-400:]}")
    # 4. a rank failing inside an NCCL collective, in a notebook kernel
    if ranks < 2:
        rows[ROWS[6]] = Row(ROWS[6], NOT_RUN, "one GPU: NCCL across ranks cannot run (it "
                            "refuses two ranks on one GPU)")
    elif left() < 90:
        rows[ROWS[6]] = Row(ROWS[6], "FAIL", f"no time left ({left():.0f} s of the budget)")
    else:
        rows[ROWS[6]] = check_failure(2, left() - 10)
    return _report(rows, started)


def _report(rows: dict[str, Row], started: float) -> int:
    width = max(len(name) for name in ROWS)
    print(f"\n{'check':<{width}}  {'result':<7}  what ran, or why not")
    print(f"{'-' * width}  {'-' * 7}  {'-' * 40}")
    for name in ROWS:
        row = rows[name]
        print(f"{name:<{width}}  {row.status:<7}  {row.detail}")
    failed = [name for name in ROWS if rows[name].status == "FAIL"]
    print(f"\n{len(failed)} wrong, {sum(r.status == 'ok' for r in rows.values())} ok, "
          f"{sum(r.status == NOT_RUN for r in rows.values())} skipped, in "
          f"{time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

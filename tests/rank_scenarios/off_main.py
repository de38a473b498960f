"""Autograd's waits on another thread, as CUDA's device thread runs them: DataParallel's
end-of-backward wait is numbered as the main thread's and shown in heartbeats, SIGINT
releases it while the main thread sits in C++ backward(), and training goes on after
recovery (with a new torch.distributed group where a gloo wait was given up)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import mpilab
import torch
import torch.distributed as dist
from mpilab.rank import agent, torch_group, waiting
from torch import nn

from .common import end_without_finalizing, report_all


def main(ctx: Any, report: Any, backend: str, signal_file: str) -> None:

    real = torch.autograd.graph._engine_run_backward

    def _engine_run_backward(*args, **kwargs):
        # autograd on another thread, as CUDA's device thread; the main thread waits in
        # C++ (a torch future), where no Python signal handler runs
        fut = torch.futures.Future()
        def device_thread():
            try:
                fut.set_result(real(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                fut.set_exception(e)
        threading.Thread(target=device_thread, name="autograd-device").start()
        return fut.wait()

    torch.autograd._engine_run_backward = _engine_run_backward

    handled = {}
    def engine_handler(signum, frame):  # what mpilab.rank.engine installs for a cell
        handled.setdefault("aborted_before", waiting.aborted())
        waiting.abort(waiting.INTERRUPTED)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, engine_handler)
    pids = ctx.comm.allgather(os.getpid())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    dp = mpilab.DataParallel(model, backend=backend, bucket_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(ctx.rank))

    beats = []
    def sample(stop):
        while not stop.is_set():
            hb = agent.current().heartbeat()
            if hb["phase"] == "collective" and hb["op"] in ("dp_allreduce", "ddp_allreduce"):
                beats.append([hb["op"], hb["seq"], hb["where"]])
            time.sleep(0.001)

    def step(delay=0.0):
        opt.zero_grad()
        loss = dp(x).pow(2).mean()
        time.sleep(delay)  # a slower peer: rank 0 waits for it at the end of backward
        loss.backward()
        opt.step()

    threads = set()
    real_collective = waiting.collective
    def spy(op, *a, **k):
        if waiting.acting_for_main() and threading.current_thread() is not threading.main_thread():
            threads.add(threading.current_thread().name)
        return real_collective(op, *a, **k)
    waiting.collective = spy

    seq0 = agent.current().state.seq
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop,))
    sampler.start()
    for _ in range(3):
        step(0.05 if ctx.rank == 1 else 0.0)
    stop.set()
    sampler.join()
    seq_per_step = (agent.current().state.seq - seq0) / 3

    outcome, release_s = "not released", None
    if ctx.rank == 0:  # waits at the end of backward for a peer that never comes
        try:
            try:
                step()
            finally:
                time.sleep(0.05)  # the pending Python handler runs here at the latest
        except BaseException as e:  # noqa: BLE001 - CollectiveAborted or KeyboardInterrupt
            outcome = type(e).__name__
            release_s = time.time() - float(open(signal_file).read())
    else:  # gets through DDP's forward, then fails; the notebook sends SIGINT to rank 0
        dp(x)
        time.sleep(0.5)
        with open(signal_file, "w") as f:
            f.write(repr(time.time()))
        os.kill(pids[0], signal.SIGINT)
    ctx.comm.Barrier()
    old_group = dist.group.WORLD
    waiting.recover()
    step()
    step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = ctx.comm.allgather(flat.tolist())
    report_all(ctx, report, {
        "seq_per_step": seq_per_step, "beats": beats[:3], "threads": sorted(threads),
        "outcome": outcome, "release_s": release_s, "handled": handled,
        "watch_interrupts": waiting.interrupts_seen(), "backend": dp.backend,
        "same_params": everyone[0] == everyone[1],
        "generation": torch_group.torch_group_generation(),
        "new_group": dist.group.WORLD is not old_group,
    })
    end_without_finalizing(ctx)

"""Warm a rank up before its first cell: what torch loads lazily the first time a
training loop runs, loaded while the ranks start instead.

Why: a first training cell pays for what torch sets up lazily (the README's 100-step
cell on 2 CPU ranks: 3.1 s the first time, 0.24 s after). Creating the first optimizer
imports `torch._dynamo` (about 800 modules, sympy among them: seconds on a busy core),
and the first forward, backward and optimizer step of a process set up autograd's
engine and the kernels' dispatch. A tiny local step here pays for all of that once.

The warm-up is local to the rank: no collective, no record to the notebook (it must not
appear on the dashboard or move the collective counters the watchdog reads), so it
cannot fail because of another rank. A notebook rank runs it on a thread
(`start_background`, as its engine process starts) while the engine registers with the
controller, and its bootstrap ends with `finish(device)`: the CPU part is then done, and
the GPU part runs on the bound device. Batch jobs (`mpilab.init()` in a script) skip it:
there the first step's cost is paid once whatever happens.
"""

from __future__ import annotations

import threading
import time

_thread: threading.Thread | None = None
_seconds: float | None = None  # how long the warm-up took, once done
_error: BaseException | None = None


def warm_up(device=None) -> float:
    """Import and exercise what a first training step needs; returns the seconds it took.

    Imports `torch.distributed` first (the bootstrap needs it next), then the optimizer's
    lazy imports, then a few forward, backward and optimizer steps of a tiny linear model
    on the CPU and, given a CUDA `device`, on it too (its BLAS handles and allocator).
    """
    started = time.perf_counter()
    import torch
    import torch.distributed  # noqa: F401 - the bootstrap's next import

    _exercise(torch.device("cpu"))
    if device is not None and torch.device(device).type == "cuda":
        _exercise(torch.device(device))
    return time.perf_counter() - started


def _exercise(where) -> None:
    """Steps of SGD and Adam (the usual first choices) on `where`. The data comes from a
    generator of its own and the weights are zeros: the global random stream, which the
    user may have seeded, is not consumed."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator(device=where).manual_seed(0)
    weight = torch.zeros(4, 8, device=where, requires_grad=True)
    bias = torch.zeros(4, device=where, requires_grad=True)
    for optimizer_class in (torch.optim.SGD, torch.optim.Adam):
        # the first optimizer imports torch._dynamo (its compile guards): the big one
        optimizer = optimizer_class([weight, bias], lr=0.1)
        x = torch.randn(4, 8, device=where, generator=generator)
        y = torch.randint(0, 4, (4,), device=where, generator=generator)
        loss = F.cross_entropy(F.linear(x, weight, bias), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if where.type == "cuda":
        torch.cuda.synchronize(where)


def _run() -> None:
    global _seconds, _error
    try:
        _seconds = warm_up()
    except BaseException as e:  # noqa: BLE001 - a failed warm-up only costs the first cell time
        _error = e


def start_background() -> threading.Thread:
    """Warm up on a daemon thread (once per process); returns that thread."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_run, name="mpilab-warmup", daemon=True)
        _thread.start()
    return _thread


def finish(device=None, timeout: float = 120.0) -> float | None:
    """The end of a notebook rank's bootstrap: wait for the background warm-up (started
    with the engine), then warm `device` when it is a GPU (known only now). Returns the
    background part's seconds (None: it did not run or failed). Never raises: a warm-up
    that fails costs the first cell time, nothing else."""
    seconds = wait(timeout)
    try:
        import torch

        if device is not None and torch.device(device).type == "cuda":
            _exercise(torch.device(device))
    except Exception:  # noqa: BLE001 - see above
        pass
    return seconds


def wait(timeout: float | None = None) -> float | None:
    """Until the background warm-up is done (or `timeout`); its seconds, None if it is not
    done or never started. A warm-up that failed is not an error for the rank."""
    if _thread is not None:
        _thread.join(timeout)
    return _seconds

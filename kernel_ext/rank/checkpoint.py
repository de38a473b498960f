"""Checkpoints: written once by rank 0, atomically; read once and broadcast to every rank.

Saving writes a temporary file next to the target, fsyncs it, renames it over the
target and fsyncs the directory: a crash at any moment leaves either the previous
checkpoint or the new one, never a torn file. Rank 0 tells every rank how the write
went, so a path that cannot be written raises the same clear error everywhere instead
of leaving the other ranks waiting.

Loading reads the file on rank 0 only and broadcasts its bytes, so ranks on nodes
without a shared filesystem load it too. Files are read with ``weights_only=True``:
``extra`` may hold tensors, numbers, strings, lists and dicts.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from . import agent as agent_mod
from . import collectives
from .context import context

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and cause."""


def _check_arguments(name: str, model: Any, optimizer: Any) -> None:
    """On every rank, before any rank acts alone: a wrong argument raises everywhere.
    Anything with a state (state_dict and load_state_dict) will do: a torch module or
    optimizer, or mpilab's wrappers of them."""
    for role, value, what in (("model", model, "a torch.nn.Module"),
                              ("optimizer", optimizer, "a torch optimizer or None")):
        if role == "optimizer" and value is None:
            continue
        if not all(callable(getattr(value, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(f"mpilab.{name}'s {role} is {what}, got {type(value).__name__}")


def _share_text(text: str | None) -> str | None:
    """Rank 0's `text` (or None) on every rank, through interruptible broadcasts."""
    data = (text or "").encode()
    length = collectives.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, "mpi")
    if int(length) == 0:
        return None
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(int(length), dtype=torch.uint8)
    return bytes(collectives.broadcast(buf, 0, "mpi").numpy()).decode()


def _write_atomically(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> Path:
    """Save model, optimizer and `extra` to `path` (rank 0 writes; every rank returns)."""
    ctx = context()
    _check_arguments("save_checkpoint", model, optimizer)
    target = Path(path).expanduser()
    error = None
    if ctx.rank == 0:
        try:  # whatever fails here fails on every rank, below: the ranks stay in step
            payload = {
                "format": FORMAT,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "extra": extra,
            }
            _write_atomically(target, payload)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = f"cannot write checkpoint {str(target)!r}: {e}"
        else:  # the notebook names it if the ranks must be restarted
            agent_mod.current().emit("event", what="checkpoint", path=str(target.resolve()))
    error = _share_text(error)
    if error:
        raise CheckpointError(error)
    return target


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore model (and optimizer) from `path` on every rank; returns the saved `extra`."""
    ctx = context()
    _check_arguments("load_checkpoint", model, optimizer)
    source = Path(path).expanduser()
    data, error = b"", None
    if ctx.rank == 0:
        try:
            data = source.read_bytes()
        except OSError as e:
            error = f"cannot read checkpoint {str(source)!r}: {e}"
    error = _share_text(error)
    if error:
        raise CheckpointError(error)
    size = collectives.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, "mpi")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(int(size), dtype=torch.uint8)
    collectives.broadcast(buf, 0, "mpi")
    try:
        state = torch.load(io.BytesIO(buf.numpy().tobytes()), map_location=ctx.device,
                           weights_only=True)
    except Exception as e:  # noqa: BLE001 - the same bytes fail the same way on every rank
        raise CheckpointError(f"{str(source)!r} is not a readable mpilab checkpoint: {e}") \
            from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{str(source)!r} is not an mpilab checkpoint")
    model.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointError(f"{str(source)!r} was saved without an optimizer state")
        optimizer.load_state_dict(state["optimizer"])
    return state["extra"]

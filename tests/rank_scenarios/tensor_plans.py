"""The per-tensor plans of CPU tensors on the ranks: a tensor reduced again and again
keeps its plan and follows its changes; broadcast and allgather over shared memory at
every size and dtype; allgather into a buffer; the spans and heartbeats the notebook
gets; a released wait in a planned broadcast, and recovery."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import mpilab
import numpy as np
import torch
from mpilab import wire
from mpilab.rank import agent as agent_mod
from mpilab.rank import collectives, waiting
from mpilab.rank._collective import run_planned
from mpilab.rank.fast_allreduce import plan_for


def main(ctx: Any, report: Any) -> None:
    out: dict[str, Any] = {}
    r, n = ctx.rank, ctx.world_size
    out["path"] = plan_for(collectives.private_comm()).path
    # spans and heartbeats as the notebook gets them: an agent with an address, not started
    probe = agent_mod.Agent(r, n, "tcp://127.0.0.1:9")
    agent_mod._agent = probe

    # one tensor reduced again and again: values change, the plan is kept
    t = torch.zeros(5)
    sums = []
    for i in range(4):
        t.fill_(r + i)
        sums.append(mpilab.allreduce(t).tolist())
    out["loop"] = sums
    out["planned"] = collectives.tensor_plan(t) is collectives.tensor_plan(t)
    # the tensor changes under its plan: new storage, new shape, new dtype
    t.data = torch.full((3,), float(r + 1))
    out["new_storage"] = mpilab.allreduce(t, op="mean").tolist()
    t.resize_(2, 2).fill_(r)
    out["resized"] = mpilab.allreduce(t, op="max").tolist()
    t.data = torch.full((2,), r + 1, dtype=torch.int64)
    out["new_dtype"] = mpilab.allreduce(t, op="mean").tolist()
    view = torch.arange(10.0)[2:6] + r  # a view with an offset into its storage
    out["view"] = mpilab.allreduce(view).tolist()
    # gone with its tensor
    before = len(collectives._plans)
    mpilab.allreduce(torch.ones(7))
    gc.collect()
    out["dropped"] = len(collectives._plans) == before

    # broadcast and allgather: small; one piece whose root writes around its caches (from
    # 8 KiB; odd tails); several chunks (odd sizes); every kind of dtype
    def pattern(count, dtype, rank):
        values = (torch.arange(count, dtype=torch.int64) * 7 + rank * 13) % 120
        return values.to(dtype)

    bad = []
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64):
        for count in (1, 3, 1000, 4099, 60001, (5 << 20) // 4 + 3):
            for root in range(n):
                x = pattern(count, dtype, r)
                mpilab.broadcast(x, root=root)
                if not torch.equal(x, pattern(count, dtype, root)):
                    bad.append(f"broadcast {dtype} {count} root {root}")
            g = mpilab.allgather(pattern(count, dtype, r))
            want = torch.stack([pattern(count, dtype, q) for q in range(n)])
            if g.shape != want.shape or g.dtype != dtype or not torch.equal(g, want):
                bad.append(f"allgather {dtype} {count}")
    # a broadcast as large as the last-level cache streams in smaller pieces
    engine = plan_for(collectives.private_comm()).node
    if engine is not None:
        count = engine._cache_bytes // 4 + 5
        for root in range(n):
            x = pattern(count, torch.float32, r)
            mpilab.broadcast(x, root=root)
            if not torch.equal(x, pattern(count, torch.float32, root)):
                bad.append(f"broadcast float32 {count} root {root}")
    # above one piece a broadcast and an allgather go through the slots or read the other
    # ranks' memory, as the deciding rank measures faster: each way forced, and the
    # measured choice over a run of calls (odd sizes, every root)
    out["read_peers"] = engine is not None and engine.pids is not None
    if engine is not None:
        for way in (0, 1, -1):
            engine._ring.way = way
            for count, dtype in ((((5 << 20) + 6) // 2, torch.bfloat16),
                                 ((3 << 20) // 4 + 1, torch.float32),
                                 ((600 << 10) + 3, torch.int8)):
                for root in [q for q in range(n) for _ in range(3)]:
                    x = pattern(count, dtype, r)
                    mpilab.broadcast(x, root=root)
                    if not torch.equal(x, pattern(count, dtype, root)):
                        bad.append(f"broadcast way {way} {dtype} {count} root {root}")
                want = torch.stack([pattern(count, dtype, q) for q in range(n)])
                for _ in range(3):
                    if not torch.equal(mpilab.allgather(pattern(count, dtype, r)), want):
                        bad.append(f"allgather way {way} {dtype} {count}")
    out["bad"] = bad
    out["scalar"] = mpilab.allgather(torch.tensor(float(r))).tolist()
    # into a buffer: reused, returned; a transposed one is filled too; a wrong one is named
    buf = torch.zeros(n, 3)
    firsts = [mpilab.allgather(torch.full((3,), float(r + i)), out=buf) is buf for i in range(2)]
    out["out"] = [firsts, buf[:, 0].tolist()]
    side = torch.zeros(3, n).t()
    mpilab.allgather(torch.full((3,), float(r)), out=side)
    out["out_strided"] = side[:, 0].tolist()
    try:
        mpilab.allgather(torch.ones(3), out=torch.zeros(n, 4))
    except ValueError as e:
        out["out_error"] = str(e)

    # what the notebook receives: numbered spans with bytes, and a heartbeat's shape text
    probe._queue.clear()
    seq0 = probe.state.seq
    m = torch.ones(2, 3)
    mpilab.allreduce(m)
    mpilab.broadcast(m)
    mpilab.allgather(m)
    spans = [(rec["labels"], list(np.frombuffer(rec["data"]).reshape(-1, 5)[:, 3:]))
             for rec in wire.tabulate(r, list(probe._queue)) if rec.get("of") == "span"]
    out["spans"] = [[labels, [[int(v) for v in row] for row in rows]] for labels, rows in spans]
    out["seq"] = probe.state.seq - seq0
    # the same tensors again, each now by its plan in one call (_collective.run_planned):
    # the same numbered spans
    gathered = torch.empty(n, 2, 3)
    mpilab.allgather(m, out=gathered)
    probe._queue.clear()
    seq0 = probe.state.seq
    for _ in range(2):
        mpilab.allreduce(m)
        mpilab.broadcast(m)
        mpilab.allgather(m, out=gathered)
    numbered = sorted((int(row[4]) - seq0, rec["labels"][0])
                      for rec in wire.tabulate(r, list(probe._queue)) if rec.get("of") == "span"
                      for row in np.frombuffer(rec["data"]).reshape(-1, 5))
    out["planned_spans"] = [label for _, label in numbered]
    out["planned_numbers"] = [number for number, _ in numbered]
    out["planned_seq"] = probe.state.seq - seq0
    # which calls take that one C call: a planned op on the main thread does (and runs
    # the allreduce, on every rank alike); an op, a root or a thread it has no entry or
    # kept context for, or a tensor changed under its plan, does nothing and says so
    plans = collectives._plans
    q = torch.ones(4)
    mpilab.allreduce(q)
    taken = [run_planned(plans, q, "reductions", "sum"),
             run_planned(plans, q, "reductions", "max"),
             run_planned(plans, q, "broadcasts", n)]
    elsewhere = []
    worker = threading.Thread(target=lambda: elsewhere.append(
        run_planned(plans, q, "reductions", "sum")))
    worker.start()
    worker.join()
    q.resize_(2, 2)
    out["taken"] = [*taken, *elsewhere, run_planned(plans, q, "reductions", "sum"),
                    q.tolist()]
    # one tensor gathered again and again into one buffer; then the buffer gets new
    # storage under the same object, then a new shape
    src, into = torch.zeros(3), torch.zeros(n, 3)
    gathers = []
    for i in range(3):
        src.fill_(r + i)
        gathers.append(mpilab.allgather(src, out=into)[:, 0].tolist())
    into.data = torch.zeros(n, 3)
    src.fill_(r + 10)
    gathers.append(mpilab.allgather(src, out=into)[:, 0].tolist())
    into.data = torch.zeros(n, 4)
    try:
        mpilab.allgather(src, out=into)
    except ValueError as e:
        gathers.append(str(e).split(":")[0])
    out["gathers"] = gathers
    # the same tensors' collectives from another thread: spans, not numbers (the plan's
    # kept contexts are the main thread's)
    probe._queue.clear()
    seq0 = probe.state.seq
    worker = threading.Thread(target=lambda: (mpilab.allreduce(m), mpilab.broadcast(m)))
    worker.start()
    worker.join()
    out["off_main"] = [probe.state.seq - seq0,
                       [rec["labels"] for rec in wire.tabulate(r, list(probe._queue))
                        if rec.get("of") == "span"]]
    seen = []
    def sample(stop):
        while not stop.is_set():
            hb = probe.heartbeat()
            if hb["phase"] == "collective":
                seen.append([hb["op"], hb["op_shape"], hb["op_nbytes"]])
                return
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop,))
    sampler.start()
    if r == 1:
        time.sleep(0.3)  # rank 0 waits in its allreduce meanwhile
    mpilab.allreduce(torch.ones(4, 1, 2))
    stop.set()
    sampler.join()
    out["heartbeat"] = seen

    # a released wait in a planned broadcast (a receiver's: a root waits for nobody); recovery
    # gives the tensor a new plan
    x = torch.zeros(1000)
    mpilab.broadcast(x)
    ctx.comm.Barrier()
    outcome = None
    if r == 1:
        threading.Timer(0.3, waiting.abort, ("peer failed",)).start()
        try:
            mpilab.broadcast(x)
        except waiting.CollectiveAborted as e:
            outcome = str(e)
    else:
        time.sleep(0.6)
        waiting.abort("peer failed")
    waiting.recover()
    x.fill_(r + 5)
    out["aborted"] = outcome
    out["after_recovery"] = mpilab.broadcast(x, root=1).tolist()[:2]
    report(out)

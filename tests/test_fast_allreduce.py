"""allreduce_inplace on real MPI ranks: every path, dtype and op against a plain reduction.

Each rank builds its data from a formula, so it can compute the expected result alone
(no gather of 64 MiB). Values are small integers, exact in every dtype, so any summation
order gives the same bits and the comparison is exact. Checks are batched into a few
mpiexec runs because each start costs seconds.
"""

from __future__ import annotations

import pytest
from mpilab.rank import across_nodes
from mpirun import MPI_ONLY, run_ranks

# Ranks report one after another: lines printed at the same moment by two ranks can
# reach mpiexec's stdout interleaved.
IN_TURN = """
def report_in_turn(obj):
    for q in range(ctx.world_size):
        if q == ctx.rank:
            report(obj)
        ctx.comm.Barrier()
"""

CHECK_ALL = """
import hashlib
import numpy as np
from mpilab.rank import fast_allreduce as fa

comm, n, r = ctx.comm, ctx.world_size, ctx.rank

def data(rank, count, dt):
    i = np.arange(count, dtype=np.int64)
    return ((i * 7 + rank * 13) % 17 - 8).astype(dt)

def expected(count, dt, op):
    parts = [data(q, count, np.int64) for q in range(n)]
    red = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op].reduce(parts)
    return red.astype(dt)

failures = []
def check(count, dt, op):
    x = data(r, count, dt)
    fa.allreduce_inplace(x, op, comm)
    if not np.array_equal(x, expected(count, dt, op)):
        failures.append(f"{np.dtype(dt).name} count={count} op={op}")

MiB = 1 << 20
for dt in (np.float32, np.float64, np.float16, np.int64):
    item = np.dtype(dt).itemsize
    # 1 element, tiny, odd, one-shot, one chunk, several chunks with a short last one
    counts = [1, 2, 3, 5, 1000, 4099, 64 * 1024 // item + 1, 3 * MiB // item + 7]
    for count in counts:
        for op in ("sum", "max", "min"):
            check(count, dt, op)
# every other element type the one-piece allreduce (C) reduces: integer sums wrap, as
# NumPy's do, and unsigned max/min compare the wrapped values
def expected_wrapped(count, dt, op):
    parts = [data(q, count, dt) for q in range(n)]  # reduced in dt: NumPy's sum widens
    return {"sum": np.add, "max": np.maximum, "min": np.minimum}[op].reduce(parts, dtype=dt)

for dt in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.uint64):
    for count in (1, 3, 1000, 4099, 3 * MiB // np.dtype(dt).itemsize + 7):
        for op in ("sum", "max", "min"):
            x = data(r, count, dt)
            fa.allreduce_inplace(x, op, comm)
            if not np.array_equal(x, expected_wrapped(count, dt, op)):
                failures.append(f"{np.dtype(dt).name} count={count} op={op}")
# a max or min with a NaN is NaN, as NumPy's maximum and minimum, on every path (one
# piece, chunked), whichever rank holds it
for count in (4099, 3 * MiB // 4 + 7):
    for op in ("max", "min"):
        x = data(r, count, np.float32)
        x[count // 2 + r] = np.nan  # each rank its own NaN; the others' values there are not
        fa.allreduce_inplace(x, op, comm)
        holes = np.flatnonzero(np.isnan(x))
        if list(holes) != [count // 2 + q for q in range(n)]:
            failures.append(f"float32 count={count} op={op}: NaN at {list(holes[:8])}")
# the engine's pass clock (benchmarks/bench_allreduce_passes.py) times a chunked
# allreduce's passes and leaves its result as it is
engine = fa.plan_for(comm).node
engine.pass_times = {}
check(3 * MiB // 4 + 7, np.float32, "sum")
passes = {name: seconds > 0 for name, seconds in engine.pass_times.items()}
engine.pass_times = None
# 64 MiB (+1 element, so not divisible by 2 or 3)
check(16 * MiB + 1, np.float32, "sum")
check(8 * MiB + 1, np.float64, "max")

# From 1 MiB an allreduce goes through the slots or reads the other ranks' buffers,
# whichever rank 0 measured faster: each way forced (pieces of a slice, a short last
# one), NaN kept, every rank the same bits.
engine = fa.plan_for(comm).node
read_peers = engine.pids is not None
way_digests = []
for way in (0, 1):
    engine._ring.way = way
    for dt, ops in ((np.float32, ("sum", "max", "min")), (np.float64, ("sum",)),
                    (np.float16, ("max",)), (np.int8, ("min",))):
        for op in ops:
            check(7 * MiB // 2 // np.dtype(dt).itemsize + 7, dt, op)
    for op in ("max", "min"):
        x = data(r, 3 * MiB // 4 + 7, np.float32)
        x[5 + 7 * r] = np.nan
        fa.allreduce_inplace(x, op, comm)
        if list(np.flatnonzero(np.isnan(x))) != [5 + 7 * q for q in range(n)]:
            failures.append(f"way {way} {op}: NaN at {list(np.flatnonzero(np.isnan(x))[:8])}")
    x = np.random.default_rng(r).standard_normal(600_001).astype(np.float32)
    fa.allreduce_inplace(x, "sum", comm)
    way_digests.append(len(set(comm.allgather(hashlib.sha1(x.tobytes()).hexdigest()))))
    # the engine's broadcast and allgather go these two ways too (the read way of a
    # broadcast: the root writes a share into every receiver as they read the rest)
    for root in range(n):
        x = data(r, 3 * MiB // 4 + 37, np.float32)
        engine.broadcast(x, root)
        if not np.array_equal(x, data(root, x.size, np.float32)):
            failures.append(f"way {way} broadcast from {root}")
    part = data(r, 3 * MiB // 8 + 5, np.float32)
    gathered = np.zeros(part.size * n, np.float32)
    engine.allgather(part, gathered)
    if not np.array_equal(gathered, np.concatenate([data(q, part.size, np.float32)
                                                    for q in range(n)])):
        failures.append(f"way {way} allgather")
engine._ring.way = -1

# The way measured: at a size no call above used (its own power of two), each way is
# tried once (read, then pipelined); then the deciding rank (a broadcast's root) takes
# the faster one it knows, and the other again once a second has passed since its try.
import time
ring = engine._ring
x = np.zeros(5 * MiB // 4, np.float32)
measured_ways, start = [], time.monotonic()
for _ in range(2):
    engine.broadcast(x, 0)
    measured_ways.append(ring.last_way)
known = ring.known("broadcast", x.nbytes)
engine.broadcast(x, 0)
measured_ways.append(ring.last_way)
quick = time.monotonic() - start < 0.9  # the third call came within a second of both tries
time.sleep(1.1)
comm.Barrier()
known_late = ring.known("broadcast", x.nbytes)
engine.broadcast(x, 0)
measured_ways.append(ring.last_way)

# Every rank holds identical bits even when summation order would matter.
rng = np.random.default_rng(r)
x = rng.standard_normal(300_001).astype(np.float32)
fa.allreduce_inplace(x, "sum", comm)
digests = comm.allgather(hashlib.sha1(x.tobytes()).hexdigest())

errors = []
frozen = np.zeros(4, np.float32)
frozen.flags.writeable = False
for bad, exc in ((np.zeros((4, 4), np.float32)[:, 1], ValueError),
                 (np.zeros(4, np.complex64), TypeError), (frozen, ValueError)):
    try:
        fa.allreduce_inplace(bad, "sum", comm)
    except exc as e:
        errors.append(str(e))
try:
    fa.allreduce_inplace(np.zeros(4), "prod", comm)
except ValueError as e:
    errors.append(str(e))
empty = np.zeros(0, np.float32)
fa.allreduce_inplace(empty, "sum", comm)

# A second communicator has its own plan; freeing it frees the plan's window too.
dup = comm.Dup()
y = np.full(10, r + 1.0)
fa.allreduce_inplace(y, "sum", dup)
dup.Free()
fa.allreduce_inplace(x, "sum", comm)
freed_ok = y[0] == n * (n + 1) / 2

report_in_turn({"failures": failures, "path": fa.plan_for(comm).path,
        "identical": len(set(digests)) == 1, "errors": errors, "freed_ok": bool(freed_ok),
        "passes": passes, "read_peers": read_peers, "way_digests": way_digests,
        "rank": r, "measured_ways": measured_ways, "known": known, "known_late": known_late,
        "quick": quick})
"""


@pytest.mark.parametrize("n", [2, 3])
def test_shared_memory_path_every_dtype_op_and_size(n):
    results = run_ranks(IN_TURN + CHECK_ALL, n=n, timeout=240, init=MPI_ONLY)
    for res in results:
        assert res["failures"] == []
        assert res["path"] == "shm"  # one node: the shared-memory engine, not MPI
        assert res["identical"]
        assert len(res["errors"]) == 4
        assert res["freed_ok"]
        assert res["passes"] == {"copy in": True, "reduce": True, "copy out": True,
                                 "barrier": True}
        assert res["read_peers"]  # the read way is there to take, and was taken above
        assert res["way_digests"] == [1, 1]
        # every rank went the way the root chose; the root knows both ways' rates
        assert res["measured_ways"] == results[0]["measured_ways"]
        assert res["measured_ways"][:2] == [1, 0]  # each way tried once: read first
    root = results[0]
    assert root["rank"] == 0 and min(root["known"]) > 0
    faster = 1 if root["known"][1] > root["known"][0] else 0
    if root["quick"]:  # (else the other way was due for its try)
        assert root["measured_ways"][2] == faster, root
    faster_late = 1 if root["known_late"][1] > root["known_late"][0] else 0
    assert root["measured_ways"][3] == 1 - faster_late, root  # a second on: the other


SMALL = """
import numpy as np
from mpilab.rank import fast_allreduce as fa

comm, n, r = ctx.comm, ctx.world_size, ctx.rank
failures = []
for dt in (np.float32, np.float64, np.float16, np.int64):
    for count in (1, 7, 4099, 300_001):
        for op in ("sum", "max", "min"):
            i = np.arange(count)
            x = ((i * 5 + r * 3) % 11 - 5).astype(dt)
            want = {"sum": lambda: sum((i * 5 + q * 3) % 11 - 5 for q in range(n)),
                    "max": lambda: np.max([(i * 5 + q * 3) % 11 - 5 for q in range(n)], 0),
                    "min": lambda: np.min([(i * 5 + q * 3) % 11 - 5 for q in range(n)], 0),
                    }[op]().astype(dt)
            fa.allreduce_inplace(x, op, comm)
            if not np.array_equal(x, want):
                failures.append(f"{np.dtype(dt).name} count={count} op={op}")
report_in_turn({"failures": failures, "path": fa.plan_for(comm).path})
"""


@pytest.mark.parametrize("n", [2, 3])
def test_forced_mpi_path(n):
    # 3 ranks: the pairwise exchange folds the third into the first, and the largest
    # messages go round a ring of uneven segments
    results = run_ranks(IN_TURN + SMALL, n=n, env={"MPILAB_ALLREDUCE": "mpi"}, init=MPI_ONLY)
    assert all(res == {"failures": [], "path": "mpi"} for res in results)


def test_hierarchical_path_with_emulated_nodes():
    # 3 ranks as nodes {0, 1} and {2}: a shared-memory node and a lone rank, two leaders.
    results = run_ranks(IN_TURN + SMALL, n=3, env={"MPILAB_EMULATE_NODE_SIZE": "2"}, init=MPI_ONLY)
    assert all(res == {"failures": [], "path": "hierarchical"} for res in results)


# counts, in `rings[0]`, the allreduces that go round a ring on this rank
COUNTING_RINGS = """
from mpilab.rank import fast_allreduce as fa

rings = [0]
round_the_ring = fa._ring_allreduce
def counting(*args):
    rings[0] += 1
    round_the_ring(*args)
fa._ring_allreduce = counting
"""


LEADERS = COUNTING_RINGS + """
import hashlib
import numpy as np

comm, n, r = ctx.comm, ctx.world_size, ctx.rank
plan = fa.plan_for(comm)
failures, digests = [], []
# spread over full nodes: below SPLIT_MIN_BYTES whole buffers cross, from it each
# rank's slice (odd counts: slices of unequal length), chunk by chunk (the last one
# short). Leaders: pairwise up to EXCHANGE_MAX_BYTES, then Iallreduce. Peers or
# leaders not a power of two: the ones past it folded in first, and round a ring
# instead of Iallreduce.
for count in (1, 3, 1000, fa.SPLIT_MIN_BYTES // 4 - 1, fa.SPLIT_MIN_BYTES // 4 + 3,
              fa.EXCHANGE_MAX_BYTES // 4, fa.EXCHANGE_MAX_BYTES // 4 + 1,
              (3 << 20) // 4 + 7):
    for op in ("sum", "max", "min"):
        x = ((np.arange(count) * 7 + r * 13) % 17 - 8).astype(np.float32)
        parts = [((np.arange(count) * 7 + q * 13) % 17 - 8) for q in range(n)]
        want = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op].reduce(parts)
        fa.allreduce_inplace(x, op, comm)
        if not np.array_equal(x, want.astype(np.float32)):
            failures.append(f"count={count} op={op}")
    noisy = np.random.default_rng(r).standard_normal(count).astype(np.float32)
    fa.allreduce_inplace(noisy, "sum", comm)
    digests.append(hashlib.sha1(noisy.tobytes()).hexdigest())
out = {"path": plan.path, "leads": plan.leaders is not None,
       "spread": plan.peers is not None, "ring": rings[0] > 0, "failures": failures}
out["identical"] = all(len(set(d)) == 1 for d in zip(*comm.allgather(digests)))
report_in_turn(out)
"""


@pytest.mark.parametrize(("n", "spread", "ring"),
                         [(4, True, False), (6, True, True), (8, True, False),
                          (7, False, False), (5, False, True)])
def test_between_nodes_by_node_count_and_fill(n, spread, ring):
    # nodes of 2 emulated ranks. 4 ranks: 2 full nodes, so every rank reduces with its
    # peer on the other node; 6 ranks: 3 full nodes, so every rank with its 2 peers (the
    # third folded into the first; slices past EXCHANGE_MAX_BYTES round a ring); 8
    # ranks: 4 full nodes (slices past EXCHANGE_MAX_BYTES go through the peers'
    # Iallreduce); 7 ranks: 4 leaders (one node holds 1 rank), so the leaders exchange
    # up to EXCHANGE_MAX_BYTES; 5 ranks: 3 leaders, the third folded into the first
    # (past EXCHANGE_MAX_BYTES: a ring)
    results = run_ranks(IN_TURN + LEADERS, n=n, env={"MPILAB_EMULATE_NODE_SIZE": "2"},
                        init=MPI_ONLY)
    assert sum(res["leads"] for res in results) == (n + 1) // 2
    assert all(res["spread"] is spread for res in results)
    # the ring runs where the peers or leaders are not a power of two (on the leaders only
    # where they reduce for their node)
    assert [res["ring"] for res in results] == \
        [ring and (spread or res["leads"]) for res in results], results
    assert all(res["path"] == "hierarchical" and res["failures"] == [] and res["identical"]
               for res in results)


ACROSS = """
import torch
from mpilab.rank import across_nodes, persistent
from mpilab.rank.collectives import private_comm
from mpilab.rank.fast_allreduce import plan_for

r, n = ctx.rank, ctx.world_size
route = plan_for(private_comm())
places = route.places
failures = []
striped = {"broadcast": 0, "allgather": 0}  # calls that went the striped way
for kind in striped:
    def counting(*args, kind=kind, way=getattr(across_nodes, f"_striped_{kind}")):
        striped[kind] += 1
        return way(*args)
    setattr(across_nodes, f"_striped_{kind}", counting)
# small ones go by MPI's persistent collectives; a larger broadcast between the nodes (by
# stripes where the nodes are evenly filled, else by the leaders); a larger allgather
# striped from a part of STRIPED_ALLGATHER_MIN_BYTES where the nodes are evenly filled,
# else through MPI's allgather, and from a part of ALLGATHER_MIN_BYTES through the
# nodes and leaders. Sizes that are no multiple of the stripes' alignment
for count in (1, 1000, across_nodes.STRIPED_ALLGATHER_MIN_BYTES // 4 + 1000,
              persistent.ALLGATHER_MAX_BYTES // 4 + 3,
              across_nodes.ALLGATHER_MIN_BYTES // 4 + 5):
    want = torch.arange(count, dtype=torch.float32)
    for root in range(n):
        t = want + 10 * r
        mpilab.broadcast(t, root=root)
        if not torch.equal(t, want + 10 * root):
            failures.append(f"broadcast count={count} root={root}")
    got = mpilab.allgather(want + r)
    if not all(torch.equal(got[q], want + q) for q in range(n)):
        failures.append(f"allgather count={count}")
report_in_turn({"failures": failures, "leaders": sorted(set(places.leader_of)),
                "spans": places.spans, "striped": striped,
                "persistent": sorted(route.persistent._kept)})
"""


@pytest.mark.parametrize("n", [3, 4, 5, 6, 8])
def test_broadcast_and_allgather_through_the_nodes_and_their_leaders(n):
    # nodes of 2 emulated ranks (the last one holding 1 where n is odd). 4, 6 and 8
    # ranks: evenly filled nodes, 2, 3 and 4 of them, so every node rank carries its
    # stripe down a binomial tree of its peers (a broadcast) or its part round their ring
    # (an allgather); 3 and 5: the leaders pass a broadcast down a binomial tree (3
    # leaders: not a power of two) and a large allgather's blocks round a ring
    results = run_ranks(IN_TURN + ACROSS, n=n, env={"MPILAB_EMULATE_NODE_SIZE": "2"})
    spans = [[first, min(2, n - first)] for first in range(0, n, 2)]
    even = n % 2 == 0
    part = across_nodes.STRIPED_ALLGATHER_MIN_BYTES + 4000
    kept = sorted([["allgather", 4], ["allgather", 4000]]
                  + ([] if even else [["allgather", part]])
                  + [["broadcast", size, root] for size in (4, 4000) for root in range(n)])
    # striped where even: the three larger sizes' broadcasts from every root and gathers
    striped = {"broadcast": 3 * n, "allgather": 3} if even else \
        {"broadcast": 0, "allgather": 0}
    assert all(res == {"failures": [], "leaders": list(range(len(spans))), "spans": spans,
                       "striped": striped, "persistent": kept} for res in results), results


KEPT = """
import torch
from mpilab.rank import persistent
from mpilab.rank.collectives import private_comm
from mpilab.rank.fast_allreduce import plan_for

r, n = ctx.rank, ctx.world_size
made = plan_for(private_comm()).persistent._make
count = [0]
def counting(key):
    count[0] += 1
    return made(key)
plan_for(private_comm()).persistent._make = counting
t, src, out = torch.zeros(8), torch.zeros(8), torch.empty(n, 8)
failures = []
def check(turn):
    for root in range(n):
        t.fill_(r + turn)
        mpilab.broadcast(t, root=root)
        if not torch.equal(t, torch.full((8,), float(root + turn))):
            failures.append(f"broadcast turn={turn} root={root}: {t.tolist()}")
    src.fill_(r * 10 + turn)
    mpilab.allgather(src, out=out)
    if not all(torch.equal(out[q], torch.full((8,), float(q * 10 + turn))) for q in range(n)):
        failures.append(f"allgather turn={turn}: {out.tolist()}")
check(0)
check(1)  # the same tensors: their requests kept, none made
made_at_first = count[0]
# more kinds of call than are kept at once: every request is closed, then made again
for k in range(persistent._MAX_KEPT + 1):
    mpilab.broadcast(torch.full((k + 16,), float(r)), root=0)
check(2)
report_in_turn({"failures": failures, "made": [made_at_first, count[0]]})
"""


def test_a_tensors_small_collectives_keep_their_request_until_every_request_is_closed():
    # 3 ranks on 2 emulated nodes: every root of a 32-byte broadcast and an allgather
    # into the same `out` make n + 1 requests once; the same tensors again make none;
    # 33 new kinds close every request, and the same tensors then make theirs again
    results = run_ranks(IN_TURN + KEPT, n=3, env={"MPILAB_EMULATE_NODE_SIZE": "2"})
    assert all(res == {"failures": [], "made": [4, 4 + 33 + 4]} for res in results), results


INTERRUPT = """
import os, signal, threading, time
import numpy as np
from mpilab.rank import fast_allreduce as fa
from mpilab.rank.shm import ShmBroken

comm = ctx.comm
x = np.ones(1000, np.float32)
fa.allreduce_inplace(x, "sum", comm)  # the plan exists on both ranks
outcome = []
if ctx.rank == 0:
    # rank 1 never joins: the wait must still give way to Ctrl-C
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        fa.allreduce_inplace(x, "sum", comm)
    except KeyboardInterrupt:
        outcome.append("interrupted")
    try:
        fa.allreduce_inplace(x, "sum", comm)
    except ShmBroken as e:
        outcome.append(str(e))
report_in_turn(outcome)
"""


def test_interrupt_lands_and_later_calls_say_why():
    results = run_ranks(IN_TURN + INTERRUPT, n=2)
    assert results[0][0] == "interrupted"
    assert "restart" in results[0][1]
    assert results[1] == []


STOPPED_ON_RANK_0 = """
import threading, time
import torch
from mpilab.rank import waiting

failures = []

def stopped_on_rank_0(collective):
    # rank 0 begins `collective` and is stopped 0.3 s into it; rank 1 has not begun it
    if ctx.rank == 0:
        threading.Timer(0.3, waiting.abort, ("stopped",)).start()
        try:
            collective()
            failures.append("not stopped")
        except waiting.CollectiveAborted:
            pass
"""

STOPPED_TWICE = STOPPED_ON_RANK_0 + """
mpilab.allreduce(torch.ones(4))  # the communicators and their plans exist on both ranks
for stop in range(2):
    # rank 1 never joins: rank 0's half of the exchange reaches it, unreceived
    stopped_on_rank_0(lambda: mpilab.allreduce(torch.ones(4)))
    time.sleep(0.6)
    waiting.abort("stopped")
    waiting.recover()  # the second frees the communicators the first replaced
    x = torch.ones(1)
    try:
        mpilab.allreduce(x)
    except Exception as e:
        failures.append(f"after stop {stop}: {e}")
    else:
        if x.item() != 2:
            failures.append(f"after stop {stop}: {x.item()}")
# a broadcast that its root finished and rank 1 never began: its message waits on rank 1
for stop in range(2):
    if ctx.rank == 0:
        mpilab.broadcast(torch.full((4,), 10.0 + stop), root=0)
    time.sleep(0.3)
    waiting.abort("stopped")
    waiting.recover()
    x = torch.full((4,), 100.0 + stop) if ctx.rank == 0 else torch.zeros(4)
    mpilab.broadcast(x, root=0)
    if x.tolist() != [100.0 + stop] * 4:
        failures.append(f"broadcast after stop {stop}: {x.tolist()}")
report_in_turn({"failures": failures, "abandoned": len(waiting._abandoned)})
"""


def test_a_collective_stopped_again_and_again_leaves_nothing_for_the_next_ones():
    # 2 emulated nodes of 1 rank: the allreduce exchanges point-to-point messages. Rank
    # 0's messages to rank 1, who never came, stay unreceived; the recovery after the
    # next frees their communicator, whose context MPI gives to one made then: they
    # would be taken for the next allreduce's own (unless drained first). A broadcast's
    # stray messages cannot be drained: its communicator is never freed
    results = run_ranks(IN_TURN + STOPPED_TWICE, n=2, env={"MPILAB_EMULATE_NODE_SIZE": "1"})
    assert results == [{"failures": [], "abandoned": 0}] * 2, results


STOPPED_RING = STOPPED_ON_RANK_0 + COUNTING_RINGS + """
count = fa.EXCHANGE_MAX_BYTES // 4 + 1000  # past the exchange: round the ring of 3
mpilab.allreduce(torch.ones(count))  # the communicators and their plans exist
for stop in range(2):
    # the others never join: rank 0's first segment reaches rank 1, unreceived
    stopped_on_rank_0(lambda: mpilab.allreduce(torch.ones(count)))
    time.sleep(0.6)
    waiting.abort("stopped")
    waiting.recover()
    x = torch.arange(count, dtype=torch.float32) * (ctx.rank + 1)
    try:
        mpilab.allreduce(x)
    except Exception as e:
        failures.append(f"after stop {stop}: {e}")
    else:
        if not torch.equal(x, torch.arange(count, dtype=torch.float32) * 6):
            failures.append(f"after stop {stop}: {x[:4].tolist()}")
report_in_turn({"failures": failures, "abandoned": len(waiting._abandoned),
                "rings": rings[0]})
"""


def test_a_ring_stopped_half_way_leaves_nothing_for_the_next_allreduce():
    # 3 emulated nodes of 1 rank: an allreduce past EXCHANGE_MAX_BYTES goes round a
    # ring (3 is not a power of two). Rank 0 is stopped in its first step, the others
    # never began: after the recovery the next allreduce gets every rank's part. Rank
    # 0's segment to rank 1 is too large to leave at once (MPI sends it when rank 1
    # receives it), so that send stays kept with its buffer until the next recovery
    # drains its communicator on rank 1: the last stop's, never more (the first stop's
    # is gone after the second recovery)
    results = run_ranks(IN_TURN + STOPPED_RING, n=3, env={"MPILAB_EMULATE_NODE_SIZE": "1"})
    assert [res["failures"] for res in results] == [[]] * 3, results
    # the first, the 2 stopped (rank 0 only) and the 2 after them
    assert [res["rings"] for res in results] == [5, 3, 3], results
    assert results[0]["abandoned"] <= 1, results
    assert results[1]["abandoned"] == results[2]["abandoned"] == 0, results


LEFT_STARTED = STOPPED_ON_RANK_0 + """
from mpi4py import MPI

mpilab.allgather(torch.ones(4))  # the communicators, their plans and requests exist
handed = []  # (request, holder) that the persistent collectives gave up on
give_up = waiting.abandon
def recording(requests, receives=(), holder=None):
    handed.extend((r, holder) for r in requests if holder is not None)
    give_up(requests, receives, holder)
waiting.abandon = recording
# rank 0 starts its persistent allgather and stops waiting; rank 1 begins its half only
# then, and completes it
stopped_on_rank_0(lambda: mpilab.allgather(torch.ones(4)))
if ctx.rank == 1:
    time.sleep(0.6)
    if mpilab.allgather(torch.ones(4)).flatten().tolist() != [1.0] * 8:
        failures.append("rank 1's half")
for _ in range(2):  # the second frees the communicators the first replaced
    time.sleep(0.3)
    waiting.abort("stopped")
    waiting.recover()
kinds = sorted(type(r).__name__ for r, _ in handed)
freed = all(r == MPI.REQUEST_NULL and not kept.alive for r, kept in handed)
got = mpilab.allgather(torch.full((4,), float(ctx.rank))).flatten().tolist()
if got != [0.0] * 4 + [1.0] * 4:
    failures.append(f"after: {got}")
report_in_turn({"failures": failures, "handed": kinds, "freed": freed,
                "abandoned": len(waiting._abandoned)})
"""


def test_a_persistent_collective_left_started_is_kept_till_it_completes_then_freed():
    # A persistent request that an abort left started may not be freed (MPI), and MPI
    # may still write into its buffers: its owner hands it over with them when it closes,
    # and it is freed once it has completed (rank 1 ran its half), not kept for good. Two
    # emulated nodes of one rank: a small allgather goes by MPI's persistent one
    results = run_ranks(IN_TURN + LEFT_STARTED, n=2, env={"MPILAB_EMULATE_NODE_SIZE": "1"})
    assert results[0] == {"failures": [], "handed": ["Prequest"], "freed": True,
                          "abandoned": 0}, results
    assert results[1] == {"failures": [], "handed": [], "freed": True, "abandoned": 0}, results


def test_parse_sizes():
    from mpilab.wire import parse_sizes

    assert parse_sizes("4K:64M") == [4096 << k for k in range(15)]
    assert parse_sizes("1M") == [1 << 20]
    assert parse_sizes("3:16") == [3, 6, 12]
    assert parse_sizes("1M, 16M,4K:16K,8K") == [4096, 8192, 16384, 1 << 20, 16 << 20]
    for bad, why in (("4K:1K", "larger than its end"), ("4Q:1M", "'4Q' is not a size"),
                     ("1K:2K:4K", "START:END"), ("0:4K", "'0' is not a size"),
                     ("1M,", "'' is not a size")):
        with pytest.raises(ValueError, match=why) as info:
            parse_sizes(bad)
        assert "\n" not in str(info.value)


BENCH = """
from mpilab.rank import bench

rows = {op: bench.run_bench(op, [4096, 65536], ["mpilab", "mpilab-internal", "mpi", "gloo",
                                                 "nccl", "memory"], repeats=2)
        for op in ("allreduce", "broadcast", "allgather")}
report_in_turn({"rows": rows, "memcpy": bench.memcpy_bandwidth(1 << 20, repeats=2)})
"""


def test_run_bench_rows_follow_nccl_tests():
    results = run_ranks(IN_TURN + BENCH, n=2)
    assert all(res["rows"] == {"allreduce": [], "broadcast": [], "allgather": []}
               for res in results[1:])  # rows come back on rank 0 only
    assert results[0]["memcpy"] > 0
    factor = {"allreduce": 1.0, "broadcast": 1.0, "allgather": 0.5}  # 2(n-1)/n, 1, (n-1)/n
    for op, rows in results[0]["rows"].items():
        measured = [r for r in rows if r["time_s"] is not None]
        # the memory bound (no collective) is an allreduce's only
        backends = ("mpilab", "mpilab-internal", "mpi", "gloo") + (
            ("memory",) if op == "allreduce" else ())
        assert [(r["backend"], r["size_bytes"]) for r in measured] == [
            (b, s) for b in backends for s in (4096, 65536)]
        if op != "allreduce":
            (memory,) = [r for r in rows if r["backend"] == "memory"]
            assert memory["note"].startswith("skipped")
        for r in measured:
            assert r["op"] == op and r["time_s"] > 0
            assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor[op])
        (nccl,) = [r for r in rows if r["backend"] == "nccl"]
        assert nccl["note"].startswith("skipped") and nccl["time_s"] is None


def test_run_bench_on_three_ranks_at_a_size_three_does_not_divide():
    """`%mpilab bench` on 3 ranks: 4 KiB is 1,024 floats, which no 3 ranks share evenly
    (mpilab's buffers, as tensors, were once shaped [3, -1] for every op, and failed)."""
    code = ("from mpilab.rank import bench\n"
            "report_in_turn({op: bench.run_bench(op, [4096], ['mpilab', 'mpilab-internal', "
            "'mpi', 'gloo'], repeats=1) for op in ('allreduce', 'broadcast', 'allgather')})\n")
    rows = run_ranks(IN_TURN + code, n=3)[0]
    for op, size in (("allreduce", 4096), ("broadcast", 4096), ("allgather", 4092)):
        assert [(r["backend"], r["size_bytes"]) for r in rows[op] if r["time_s"]] == [
            (b, size) for b in ("mpilab", "mpilab-internal", "mpi", "gloo")], rows[op]

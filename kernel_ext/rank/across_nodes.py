"""Broadcast and allgather over several nodes: through each node's shared memory, and
over MPI between one leader per node.

MPI's own non-blocking collectives over every rank send a node's ranks' messages over
the network one by one and need every rank to drive them; here only the leaders talk
between nodes, by point-to-point messages (MPICH's non-blocking collectives build a
schedule per call, which costs more than a few KiB's trip between hosts), and the other
ranks of a node wait on shared memory, where the node's copies run at memory speed. The
allreduce's hierarchical path (`fast_allreduce`) is the same idea; both use the
communicator's `Plan` (its node engine, its leaders' communicator and `Places`).
"""

from __future__ import annotations

import numpy as np

from .fast_allreduce import Plan
from .waiting import drive, drive_all

_TAG = 0x6D62  # the leaders' communicator carries the allreduce's exchange too (its own tag)
# An allgather goes this way from this size of each rank's part: below it, its three
# steps one after another cost more than MPI's allgather over every rank (2 emulated
# hosts of 2 ranks, µs a call, this way against MPI's driven: 4 KiB 62-91 against 50-79,
# 1 MiB 4,500-6,000 against 4,300-4,600, 2 MiB level; 4 MiB 12,900-13,500 against
# 14,400-20,300, 16 MiB 45,000-53,000 against 73,000-75,000). The broadcast goes this
# way above `persistent.BROADCAST_MAX_BYTES`.
ALLGATHER_MIN_BYTES = 4 << 20


def broadcast(plan: Plan, flat: np.ndarray, root: int) -> None:
    """`flat` (1-D, contiguous, the same size on every rank) from rank `root` to every
    rank: within the root's node first where the root does not lead it, then between the
    leaders, then within each other node."""
    places = plan.places
    root_leader, root_node_rank = places.leader_of[root], places.node_rank_of[root]
    in_root_node = places.leader_of[places.rank] == root_leader
    from_root_first = in_root_node and root_node_rank != 0
    if from_root_first and plan.node is not None:
        plan.node.broadcast(flat, root=root_node_rank)
    if plan.leaders is not None:
        _leaders_broadcast(plan.leaders, flat, root_leader)
    if plan.node is not None and not from_root_first:
        plan.node.broadcast(flat, root=0)


def _leaders_broadcast(comm, flat: np.ndarray, root: int) -> None:
    """A binomial tree from `root` over the leaders: each receives from its parent, then
    sends to its children."""
    size = comm.Get_size()
    me = (comm.Get_rank() - root) % size
    mask = 1
    while mask < size:
        if me & mask:
            drive(comm.Irecv(flat, (me - mask + root) % size, _TAG))
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:
        if me + mask < size:
            sends.append(comm.Isend(flat, (me + mask + root) % size, _TAG))
        mask >>= 1
    if sends:
        drive_all(sends)


def allgather(plan: Plan, send: np.ndarray, recv: np.ndarray) -> None:
    """Every rank's `send` (1-D, contiguous, uint8) into `recv` (1-D, size × as many
    bytes), in rank order, where every node's ranks are consecutive
    (`plan.places.spans`): each node gathers its block into the result, the leaders pass
    the blocks round a ring, and each leader broadcasts the other nodes' blocks (before
    and after its own) within its node."""
    part = send.nbytes
    spans = plan.places.spans
    mine = plan.places.leader_of[plan.places.rank]
    first, count = spans[mine]
    if plan.node is not None:
        plan.node.allgather(send, recv[first * part:(first + count) * part])
    else:
        recv[first * part:(first + count) * part] = send
    if plan.leaders is not None:
        _leaders_ring(plan.leaders, recv, [(f * part, (f + n) * part) for f, n in spans])
    if plan.node is not None:
        for others in (recv[:first * part], recv[(first + count) * part:]):
            if others.nbytes:
                plan.node.broadcast(others, root=0)


def _leaders_ring(comm, recv: np.ndarray, blocks: list[tuple[int, int]]) -> None:
    """Each leader's block of `recv` (its (start, end) in `blocks`, by leader) to every
    leader: at step k each sends the block it got at step k-1 to the next leader and
    receives one from the one before."""
    size, me = comm.Get_size(), comm.Get_rank()
    right, left = (me + 1) % size, (me - 1) % size
    for step in range(size - 1):
        out_start, out_end = blocks[(me - step) % size]
        in_start, in_end = blocks[(me - step - 1) % size]
        drive_all([comm.Irecv(recv[in_start:in_end], left, _TAG),
                   comm.Isend(recv[out_start:out_end], right, _TAG)])

"""Broadcast and allgather over several nodes: through each node's shared memory, and
over MPI between the nodes by point-to-point messages.

MPI's own non-blocking collectives over every rank send a node's ranks' messages over
the network one by one and need every rank to drive them (and MPICH builds their
schedule at every call, which costs more than a few KiB's trip between hosts); here the
nodes' copies run through shared memory at memory speed, and between the nodes:

- **striped**, where every node holds as many ranks (the plan's `peers`, over which the
  allreduce's `_spread` runs too): node rank j carries the j-th share of the message to
  node rank j of every other node, so every rank's link carries a share and no one rank
  sends it all. A broadcast: the root's node gets the whole message, each of its ranks
  sends its stripe down a binomial tree of its peers, and the other nodes gather the
  stripes. An allgather: each rank's part goes round a ring of its peers, then every
  node gathers each node's block. 2 emulated hosts of 2 ranks, µs a call (a one-off
  script, median of 7 loops, against the way before): broadcast 8 KiB 15-17 against
  23-24 through the leaders (mpi4py 26), 1 MiB 670 against 770 (930), 8 MiB 4,400
  against 8,000 (7,000); allgather, a part of 8 KiB 70-75 against 78-80 by MPI's
  persistent allgather (mpi4py 67-69), 32 KiB 90-132 against 128-162 (110-141), 256 KiB
  390-970 against 880-1,640 (830-1,560).
- through **one leader per node** elsewhere: a binomial tree of the leaders for a
  broadcast; for an allgather of a large part (ALLGATHER_MIN_BYTES) with every node's
  ranks consecutive, the node blocks round a ring of the leaders.

The allreduce's hierarchical path (`fast_allreduce`) is the same idea; all use the
communicator's `Plan` (its node engine, its leaders' and peers' communicators, `Places`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .fast_allreduce import Plan
from .waiting import drive, drive_all

_TAG = 0x6D62  # the leaders' and peers' communicators carry the allreduce too (own tags)
# Through the leaders, an allgather goes this way from this size of each rank's part:
# below it, its three steps one after another cost more than MPI's allgather over every
# rank (2 emulated hosts of 2 ranks, µs a call, this way against MPI's driven: 4 KiB
# 62-91 against 50-79, 1 MiB 4,500-6,000 against 4,300-4,600, 2 MiB level; 4 MiB
# 12,900-13,500 against 14,400-20,300, 16 MiB 45,000-53,000 against 73,000-75,000).
ALLGATHER_MIN_BYTES = 4 << 20
# Striped, from this size of each rank's part (below it MPI's persistent allgather; the
# figures in the module's docstring). A broadcast is striped at every size that comes
# here (above `persistent.BROADCAST_MAX_BYTES`).
STRIPED_ALLGATHER_MIN_BYTES = 8 << 10
_ALIGN = 64  # a broadcast's stripes start on cache lines


def takes_allgather(plan: Plan, part: int) -> bool:
    """Whether an allgather of `part` bytes a rank goes this way on `plan` (the same
    answer on every rank): where every node's ranks are consecutive and the part is
    large enough for the way the plan allows."""
    places = plan.places
    if places is None or places.spans is None:
        return False
    return part >= (STRIPED_ALLGATHER_MIN_BYTES if plan.peers is not None
                    else ALLGATHER_MIN_BYTES)


def broadcast(plan: Plan, flat: np.ndarray, root: int) -> None:
    """`flat` (1-D, contiguous, the same size on every rank) from rank `root` to every
    rank: striped over evenly filled nodes; else within the root's node first where the
    root does not lead it, then between the leaders, then within each other node."""
    places = plan.places
    if plan.peers is not None:
        raw = flat.view(np.uint8)
        stripe = raw.nbytes // len(places.members[0]) // _ALIGN * _ALIGN
        if stripe:
            _striped_broadcast(plan, raw, root, stripe)
            return
    root_leader, root_node_rank = places.leader_of[root], places.node_rank_of[root]
    in_root_node = places.leader_of[places.rank] == root_leader
    from_root_first = in_root_node and root_node_rank != 0
    if from_root_first and plan.node is not None:
        plan.node.broadcast(flat, root=root_node_rank)
    if plan.leaders is not None:
        _tree_broadcast(plan.leaders, flat, root_leader)
    if plan.node is not None and not from_root_first:
        plan.node.broadcast(flat, root=0)


def _striped_broadcast(plan: Plan, raw: np.ndarray, root: int, stripe: int) -> None:
    """Node rank j's stripe is bytes [j × stripe, (j + 1) × stripe), the last node
    rank's up to the end: the root's node broadcasts the whole within itself, each of
    its ranks sends its stripe down a tree of its peers, and each other node gathers the
    stripes (the last node rank broadcasts the bytes past k × stripe)."""
    places = plan.places
    me, root_node = places.rank, places.leader_of[root]
    j, k = places.node_rank_of[me], len(places.members[root_node])
    start = j * stripe
    end = raw.nbytes if j == k - 1 else start + stripe
    in_root_node = places.leader_of[me] == root_node
    if in_root_node:
        plan.node.broadcast(raw, root=places.node_rank_of[root])
    source = places.peer_rank_of[places.members[root_node][j]]
    _tree_broadcast(plan.peers, raw[start:end], source)
    if not in_root_node:
        plan.node.allgather(raw[start:start + stripe], raw[:k * stripe])
        if raw.nbytes > k * stripe:
            plan.node.broadcast(raw[k * stripe:], root=k - 1)


def _tree_broadcast(comm, flat: np.ndarray, root: int) -> None:
    """A binomial tree from `root` over `comm` (the leaders or one node rank's peers):
    each receives from its parent, then sends to its children."""
    size = comm.Get_size()
    me = (comm.Get_rank() - root) % size
    mask = 1
    while mask < size:
        if me & mask:
            drive(comm.Irecv(flat, (me - mask + root) % size, _TAG), receive=True)
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
    bytes), in rank order, where `takes_allgather`: striped over evenly filled nodes;
    else each node gathers its block into the result, the leaders pass the blocks round
    a ring, and each leader broadcasts the other nodes' blocks (before and after its
    own) within its node."""
    if plan.peers is not None:
        _striped_allgather(plan, send, recv)
        return
    part, spans = send.nbytes, plan.places.spans
    mine = plan.places.leader_of[plan.places.rank]
    first, count = spans[mine]
    if plan.node is not None:
        plan.node.allgather(send, recv[first * part:(first + count) * part])
    else:
        recv[first * part:(first + count) * part] = send
    if plan.leaders is not None:
        _ring(plan.leaders, recv, [(f * part, (f + n) * part) for f, n in spans])
    if plan.node is not None:
        for others in (recv[:first * part], recv[(first + count) * part:]):
            if others.nbytes:
                plan.node.broadcast(others, root=0)


def _striped_allgather(plan: Plan, send: np.ndarray, recv: np.ndarray) -> None:
    """Each rank's part round a ring of its peers (node rank j of every node, in node
    order, as the spans are), its own node's block gathered while the ring's first
    messages are in flight, then within every node each other node's block gathered
    from its ranks' parts."""
    part = send.nbytes
    places = plan.places
    j, spans = places.node_rank_of[places.rank], places.spans
    first, count = spans[places.leader_of[places.rank]]
    _ring(plan.peers, recv, [((f + j) * part, (f + j + 1) * part) for f, _ in spans], send,
          lambda: plan.node.allgather(send, recv[first * part:(first + count) * part]))
    for f, n in spans:
        if f != first:
            block = recv[f * part:(f + n) * part]
            plan.node.allgather(block[j * part:(j + 1) * part], block)


def _ring(comm, recv: np.ndarray, blocks: list[tuple[int, int]],
          own: np.ndarray | None = None, meanwhile: Callable[[], None] | None = None) -> None:
    """Each rank's block of `recv` (its (start, end) in `blocks`, by rank of `comm`: the
    leaders or one node rank's peers) to every rank: at step k each sends the block it
    got at step k-1 to the next rank and receives one from the one before. `own`: this
    rank's block where it is not in `recv` yet (the first step sends it from there);
    `meanwhile` runs while the first step's messages are in flight."""
    size, me = comm.Get_size(), comm.Get_rank()
    right, left = (me + 1) % size, (me - 1) % size
    for step in range(size - 1):
        out_start, out_end = blocks[(me - step) % size]
        in_start, in_end = blocks[(me - step - 1) % size]
        out = own if step == 0 and own is not None else recv[out_start:out_end]
        receive = comm.Irecv(recv[in_start:in_end], left, _TAG)
        drive_all([receive, comm.Isend(out, right, _TAG)], [receive],
                  meanwhile if step == 0 else None)

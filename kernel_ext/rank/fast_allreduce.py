"""The numpy allreduce the MPI path of mpilab's collectives goes through.

One function, so the fastest available implementation is used everywhere
(mpilab.allreduce, DataParallel(backend="mpi"), the benchmarks). It picks, once per
communicator:

- ``mpi``: MPI's own Iallreduce, where no two ranks share a node or shared memory is
  unavailable. Not for tiny messages on one node: MPI's blocking Allreduce takes ~5 µs
  at 4 KiB there, but it cannot be interrupted, and the interruptible Iallreduce takes
  ~55 µs (MPICH's schedule-based non-blocking path), against ~4 µs for the shm path
  (2 ranks on one 2-core host);
- ``shm``: every rank of the communicator is on one node: the shared-memory engine
  (`mpilab.rank.shm`) reduces in place at close to memory bandwidth;
- ``hierarchical``: several nodes, some with several ranks: reduce within each node
  through shared memory, allreduce among one leader per node over MPI, broadcast back
  within the node. Between the leaders, messages up to EXCHANGE_MAX_BYTES go by pairwise
  exchange (recursive doubling over point-to-point sends; a leader count that is not a
  power of two folds the leaders past the largest power of two in first): MPICH's
  non-blocking Iallreduce builds a schedule per call, which at 4 KiB cost more than the
  message's whole trip between two emulated hosts. Larger messages go by MPI's
  Iallreduce, or round a ring where the leader count is not a power of two
  (RING_MAX_RANKS says why). Where every node holds as many ranks, no rank leads: each
  rank reduces a slice of the message within its node and the same slice with its
  peers on the other nodes (`_spread`), so every rank's link carries a share and
  nobody waits for a broadcast.

Rules for callers:
- The first call on a communicator sets up its plan *collectively* (a node split, a
  shared window, a leaders' communicator) and caches it on the communicator as an MPI
  attribute, so every rank of `comm` must make the same calls in the same order, as with
  any MPI collective. A thread that communicates concurrently with another thread must
  use its own communicator (``comm.Dup()``), made on all ranks in the same order.
- Arrays: C-contiguous (empty ones return at once); dtypes float16/32/64 and
  (u)int8-64; every rank passes the same size and dtype. bfloat16
  has no NumPy dtype: callers convert bfloat16 tensors to float32 before calling (a raw
  uint16 view would be summed as integers, which is wrong).
- Not re-entrant per communicator: one collective at a time (a lock keeps two threads
  from corrupting the shared state; their order would still have to match across ranks).
  If a collective is interrupted half-way (Ctrl-C), later calls on that communicator
  raise `ShmBroken` saying the ranks must be restarted, instead of hanging.
- Every rank gets bit-identical results (reductions use the same operand order on all
  ranks), so data-parallel replicas never drift apart.
- ``MPILAB_ALLREDUCE=mpi`` forces MPI's own path (for comparisons and debugging);
  ``MPILAB_EMULATE_NODE_SIZE=k`` splits each node into groups of k consecutive ranks, so
  the hierarchical path can be exercised on one machine.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .persistent import Persistent
from .shm import UFUNCS, ShmEngine
from .waiting import drain, drive, drive_all, wait_interruptibly

_KINDS = "fiu"
_OPS = frozenset(("sum", "max", "min"))
# Up to this size the leaders exchange whole buffers pairwise; above it, a
# reduce-scatter (MPI's Iallreduce, or the ring) halves what each leader adds up.
EXCHANGE_MAX_BYTES = 64 << 10
_EXCHANGE_TAG = 0x6D6C
# Above the exchange's sizes, a rank count that is not a power of two goes round a ring
# (`_ring_allreduce`) up to this many ranks: MPICH's Iallreduce folds the ranks past the
# largest power of two into others, which then carry their messages too (3 emulated
# hosts: 16-64 MiB 1.2-1.5x faster round the ring with 2 ranks a host, 1.3-2.1x with
# one; 4 hosts: level). A ring takes 2 (n - 1) trips, so many ranks stay with MPI's
# (where that starts to pay is not measured).
RING_MAX_RANKS = 16
# From this size, evenly filled nodes split the exchange: each rank sends only the
# slice of the node's sum it owns, and shared memory gathers the slices (a second node
# barrier). 2 emulated hosts of 2 ranks: whole 67 / split 81 µs at 32 KiB, 119 / 92 µs
# at 64 KiB.
SPLIT_MIN_BYTES = 48 << 10


@dataclass
class Places:
    """Where each rank of a communicator over several nodes sits, for the broadcast and
    the allgather that go through each node's shared memory and between the nodes
    (`across_nodes`)."""

    rank: int  # this rank's
    leader_of: list[int]  # by rank: the rank of its node's leader among the leaders
    node_rank_of: list[int]  # by rank: its rank within its node
    # by leader: (first rank, rank count) of its node, where every node holds consecutive
    # ranks (an allgather's node block is then one slice of the result); else None
    spans: list[tuple[int, int]] | None
    members: list[list[int]]  # by leader: its node's ranks, in node-rank order
    # by rank: its rank among the ranks of its node rank (in the plan's `peers`, where
    # the plan has them)
    peer_rank_of: list[int]


@dataclass
class Plan:
    """How allreduce_inplace runs on one communicator (created once per communicator),
    and what mpilab's other collectives on it need: how to wait for an MPI request, where
    each rank sits across nodes (`across_nodes`), and its small broadcasts and
    allgathers (`persistent`)."""

    comm: object  # the communicator itself
    shm: bool  # every rank agreed that shared memory works
    node: ShmEngine | None  # this node's engine; None when the rank is alone on its node
    node_comm: object
    leaders: object | None  # node leaders' communicator; None on non-leaders/single-node
    multi_node: bool
    # the communicator MPI reduces over: on the mpi path a duplicate of the plan's own
    # (its point-to-point messages never meet a caller's), on the hierarchical one the
    # leaders' (None on a rank that takes part through shared memory only)
    between: object | None
    # where every node holds as many ranks: the ranks with this rank's node rank, one
    # per node (the broadcast and allgather stripe over them, `across_nodes`; `_spread`
    # reduces over them)
    peers: object | None = None
    places: Places | None = None  # on the hierarchical path

    def __post_init__(self) -> None:
        # what allreduce_inplace does on this communicator: mpi | shm | hierarchical
        self.path = "mpi" if not self.shm else "hierarchical" if self.multi_node else "shm"
        self._scratch = np.empty(0, dtype=np.uint8)
        self.persistent = Persistent(self.comm, self.wait)

    def scratch(self, like: np.ndarray) -> np.ndarray:
        """A reused receive buffer of like's size and dtype."""
        if self._scratch.nbytes < like.nbytes:
            self._scratch = np.empty(like.nbytes, dtype=np.uint8)
        return self._scratch[:like.nbytes].view(like.dtype)

    def wait(self, request) -> None:
        """Wait for an MPI request on this plan's communicator: driven where the ranks
        span nodes (the transport moves data only while asked), else polled."""
        if self.multi_node:
            drive(request)
        else:
            wait_interruptibly(request)

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """MPI's allgather over every rank of the communicator: persistent where small
        (`persistent`), else non-blocking, waited for as `wait` does."""
        if not self.persistent.allgather(send, recv):
            self.wait(self.comm.Iallgather(send, recv))

    def close(self) -> None:
        self.persistent.close()
        if self.node is not None:
            self.node.close()
        between = self.between if self.between is not self.leaders else None
        for c in (between, self.peers, self.leaders, self.node_comm):
            if c is not None:
                drain(c)
                c.Free()


_keyval: int | None = None
# The last (communicator object, plan): Get_attr costs ~3 µs, this check 0.05 µs.
_last: tuple[object, Plan] | None = None
_keyval_lock = threading.Lock()


def plan_for(comm) -> Plan:
    """The cached plan of `comm`; the first call is collective on `comm`."""
    global _keyval, _last
    last = _last  # one read: another thread may replace it meanwhile
    if last is not None and last[0] is comm:
        return last[1]
    from mpi4py import MPI

    with _keyval_lock:  # not held while planning: that is collective, and a thread
        if _keyval is None:  # waiting on other ranks must not block another comm's plan
            _keyval = MPI.Comm.Create_keyval(delete_fn=_forget)
    plan = comm.Get_attr(_keyval)
    if plan is None:
        plan = _make_plan(comm)
        comm.Set_attr(_keyval, plan)
    _last = (comm, plan)
    return plan


def free(comm) -> None:
    """Free `comm` and its plan (collective: every rank frees the same ones in order).

    The plan goes first, by deleting the attribute: MPICH deletes a communicator's
    attributes, and so runs `_forget`, only once no operation on it is pending, and one
    that a stopped rank left half done never completes. The plan's shared-memory window
    would then be freed (a synchronizing call) on some ranks only, later, inside another
    MPI call, which waits there for good: seen as a recovery that hung, 2 in 300 stops
    of a bench; reproduced with two ranks and a pending Iallreduce."""
    if _keyval is not None:
        comm.Delete_attr(_keyval)
    drain(comm)
    comm.Free()


def _forget(_comm, _keyval, plan: Plan) -> None:
    """MPI deletes the attribute when the communicator is freed: free the plan too."""
    global _last
    if _last is not None and _last[1] is plan:
        _last = None
    plan.close()


def _make_plan(comm) -> Plan:
    from mpi4py import MPI

    choice = os.environ.get("MPILAB_ALLREDUCE", "auto").strip().lower()
    if choice not in ("auto", "mpi"):
        raise ValueError(f"MPILAB_ALLREDUCE={choice!r} is not auto or mpi")
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    emulate = int(os.environ.get("MPILAB_EMULATE_NODE_SIZE", "0") or 0)
    if emulate > 0:
        split = node_comm.Split(node_comm.Get_rank() // emulate, node_comm.Get_rank())
        node_comm.Free()
        node_comm = split
    node_rank = node_comm.Get_rank()
    nodes = comm.allreduce(1 if node_rank == 0 else 0)
    # Shared memory only helps where some node holds ≥ 2 ranks; all ranks must agree.
    shared = comm.allreduce(node_comm.Get_size(), op=MPI.MAX) > 1 and choice != "mpi"
    node = None
    if shared:
        ok = 1
        if node_comm.Get_size() > 1:
            try:
                node = ShmEngine(node_comm)
            except MPI.Exception:
                ok = 0
        if not comm.allreduce(ok, op=MPI.MIN):
            if node is not None:
                node.close()
            node, shared = None, False
    leaders = None
    if nodes > 1:
        leaders = comm.Split(0 if node_rank == 0 else MPI.UNDEFINED, comm.Get_rank())
        if leaders == MPI.COMM_NULL:
            leaders = None
    peers = None
    if shared and nodes > 1 and \
            len(set(comm.allgather(node_comm.Get_size()))) == 1:  # every node as full
        peers = comm.Split(node_rank, comm.Get_rank())
    between = leaders if shared else comm.Dup()
    places = _places(comm, node_comm, leaders) if shared and nodes > 1 else None
    return Plan(comm, shared, node, node_comm, leaders, nodes > 1, between, peers, places)


def _places(comm, node_comm, leaders) -> Places:
    """Every rank's node leader and node rank, each node's ranks, each rank's place
    among its peers, and the nodes' spans of ranks where each node's are consecutive
    (collective on `comm`)."""
    leader = node_comm.bcast(leaders.Get_rank() if leaders is not None else -1, root=0)
    every = comm.allgather((leader, node_comm.Get_rank()))
    members: list[list[int]] = [[] for _ in range(1 + max(lead for lead, _ in every))]
    peer_rank_of, seen = [], {}
    for rank, (lead, node_rank) in enumerate(every):  # node ranks follow ranks (the split's key)
        members[lead].append(rank)
        peer_rank_of.append(seen.get(node_rank, 0))  # as comm.Split(node_rank, rank) ranks
        seen[node_rank] = peer_rank_of[-1] + 1
    consecutive = all(ranks == list(range(ranks[0], ranks[0] + len(ranks)))
                      for ranks in members)
    return Places(comm.Get_rank(), [lead for lead, _ in every],
                  [node_rank for _, node_rank in every],
                  [(ranks[0], len(ranks)) for ranks in members] if consecutive else None,
                  members, peer_rank_of)


def _mpi_allreduce(array: np.ndarray, op: str, comm, plan: Plan) -> None:
    """MPI's Iallreduce over `comm` (the plan's, or a part of it), waited for as the
    plan waits."""
    from mpi4py import MPI

    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
    plan.wait(comm.Iallreduce(MPI.IN_PLACE, array, mpi_op))


def _between(flat: np.ndarray, op: str, plan: Plan) -> None:
    """The MPI step: over plan.between, by pairwise exchange up to EXCHANGE_MAX_BYTES,
    else as `_large` says."""
    if flat.nbytes <= EXCHANGE_MAX_BYTES:
        _exchange_allreduce(flat, op, plan.between, plan)
    else:
        _large(flat, op, plan.between, plan)


def _large(flat: np.ndarray, op: str, comm, plan: Plan) -> None:
    """A message above the exchange's sizes over `comm`: round a ring where the rank
    count is not a power of two (up to RING_MAX_RANKS), else MPI's Iallreduce."""
    size = comm.Get_size()
    power_of_two = size & (size - 1) == 0
    if not power_of_two and size <= RING_MAX_RANKS:
        _ring_allreduce(flat, op, comm, plan)
    else:
        _mpi_allreduce(flat, op, comm, plan)


def _exchange_allreduce(flat: np.ndarray, op: str, comm, plan: Plan) -> None:
    """Allreduce over `comm` by recursive doubling among the first 2**k ranks (the
    largest power of two of them): at step j each swaps its whole buffer with rank
    ^ 2**j and combines. A rank past them (3 ranks: rank 2) first hands its buffer to
    rank - 2**k, which combines it in, and gets the result back at the end: two steps
    more, as MPICH's own recursive doubling does. Both partners of a swap combine the
    same two operands (IEEE addition, max and min are commutative) and a rank past them
    gets a copy, so every rank ends with the same bits."""
    me, size = comm.Get_rank(), comm.Get_size()
    power = 1 << (size.bit_length() - 1)
    incoming = plan.scratch(flat)
    if me >= power:  # hand the buffer in, get the result back
        partner = me - power
        _swap(comm, flat, partner, incoming, partner)
        flat[...] = incoming
        return
    combine = UFUNCS[op]
    folded = me + power < size  # a rank past the power hands its buffer to this one
    if folded:
        receive = comm.Irecv(incoming, me + power, _EXCHANGE_TAG)
        drive(receive, receive=True)
        combine(flat, incoming, out=flat)
    mask = 1
    while mask < power:
        peer = me ^ mask
        _swap(comm, flat, peer, incoming, peer)
        combine(flat, incoming, out=flat)
        mask <<= 1
    if folded:
        drive(comm.Isend(flat, me + power, _EXCHANGE_TAG))


def _swap(comm, out: np.ndarray, to: int, into: np.ndarray, source: int) -> None:
    """Send `out` to rank `to` while `into` is received from rank `source`: one step of
    the exchange or the ring, driven until both are done."""
    receive = comm.Irecv(into, source, _EXCHANGE_TAG)
    drive_all([receive, comm.Isend(out, to, _EXCHANGE_TAG)], [receive])


def _ring_allreduce(flat: np.ndarray, op: str, comm, plan: Plan) -> None:
    """Allreduce over `comm` round a ring: its ranks reduce one segment of `flat` each,
    passing partial sums to the next rank (size - 1 steps), then pass the sums round
    (size - 1 steps more). Each rank sends and receives 2 (size - 1) / size of the
    buffer, whatever the rank count, and each segment's sum is computed by one rank
    and copied to the others, so every rank ends with the same bits."""
    me, size = comm.Get_rank(), comm.Get_size()
    edges = [flat.size * k // size for k in range(size + 1)]
    segment = [flat[edges[k]:edges[k + 1]] for k in range(size)]
    right, left = (me + 1) % size, (me - 1) % size
    incoming = plan.scratch(max(segment, key=len))
    combine = UFUNCS[op]
    for step in range(size - 1):
        out, into = segment[(me - step) % size], segment[(me - step - 1) % size]
        held = incoming[:into.size]
        _swap(comm, out, right, held, left)
        combine(into, held, out=into)
    for step in range(size - 1):
        out, into = segment[(me + 1 - step) % size], segment[(me - step) % size]
        _swap(comm, out, right, into, left)


def allreduce_inplace(array: np.ndarray, op: str, comm) -> None:
    """Reduce a contiguous array across `comm` in place. op: sum | max | min.

    (mean is sum followed by a division, done by the caller.)
    """
    if op not in _OPS:
        raise ValueError(f"allreduce op {op!r} is not sum, max or min")
    if array.dtype.kind not in _KINDS:
        raise TypeError(
            f"allreduce of dtype {array.dtype} is not supported: use a float or int array "
            "(convert bfloat16 to float32 first)"
        )
    if not array.flags.c_contiguous:
        raise ValueError("allreduce_inplace needs a C-contiguous array; pass a copy")
    if not array.flags.writeable:
        raise ValueError("allreduce_inplace reduces in place, and this array is read-only; "
                         "pass a writable copy")
    if array.size == 0:
        return
    flat = array if array.ndim == 1 else array.reshape(-1)
    plan = plan_for(comm)
    path = plan.path
    if path == "shm":
        plan.node.allreduce(flat, op)
    elif path == "mpi":
        _between(flat, op, plan)
    else:
        _hierarchical(flat, op, plan)


def reducer(comm) -> Callable[[np.ndarray, str], None]:
    """allreduce_inplace on `comm` without its checks, as a function of (array, op):
    for a caller that checked its array once (1-D, C-contiguous, not empty, of a kind
    allreduce_inplace takes; op sum | max | min) and reduces it again and again
    (mpilab.allreduce's plan of a tensor). The first call on `comm` is collective, as
    with plan_for."""
    plan = plan_for(comm)
    if plan.path == "shm":
        return plan.node.allreduce
    if plan.path == "mpi":
        return lambda flat, op: _between(flat, op, plan)
    return lambda flat, op: _hierarchical(flat, op, plan)


def _hierarchical(flat: np.ndarray, op: str, plan: Plan) -> None:
    """Within each node through shared memory, among the node leaders over MPI, and
    back within each node; on evenly filled nodes, spread over every rank (_spread)."""
    if plan.peers is not None:  # every node holds as many ranks
        _spread(flat, op, plan)
        return
    if plan.node is not None:
        plan.node.allreduce(flat, op, to_root_only=True)
    if plan.leaders is not None:
        _between(flat, op, plan)
    if plan.node is not None:
        plan.node.broadcast(flat, root=0)


def _spread(flat: np.ndarray, op: str, plan: Plan) -> None:
    """Every rank carries a share between the nodes, none waits for a leader. Below
    SPLIT_MIN_BYTES each node's ranks all get the node's sum and exchange it with their
    peers on the other nodes; from it, chunk by chunk, each rank reduces the slice of
    the chunk it owns within its node, reduces that slice with its peers, and the
    node's ranks gather the slices (so each rank sends only its slice between nodes,
    and no rank broadcasts to the others afterwards)."""
    if flat.nbytes < SPLIT_MIN_BYTES:
        plan.node.allreduce(flat, op)
        _among_peers(flat, op, plan)
        return
    across = functools.partial(_among_peers, op=op, plan=plan)
    step = plan.node.chunk_bytes // flat.itemsize
    for start in range(0, flat.size, step):
        plan.node.split_allreduce(flat[start:start + step], op, across)


def _among_peers(part: np.ndarray, op: str, plan: Plan) -> None:
    """Allreduce `part` with this rank's peers (one per node): pairwise exchange where
    that sends each byte once (2 nodes) or the part is small, else as `_large` says."""
    if plan.peers.Get_size() == 2 or part.nbytes <= EXCHANGE_MAX_BYTES:
        _exchange_allreduce(part, op, plan.peers, plan)
    else:
        _large(part, op, plan.peers, plan)

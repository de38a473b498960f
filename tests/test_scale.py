"""The metrics store's memory cap at a thousand ranks: a long run of 1,024 ranks' steps,
loss and collective spans, sent as the ranks send them (the agent's encoder, filed from
the wire bytes), stays within the stated cap, and every rank's buffers stay bounded."""

from __future__ import annotations

import msgpack
import numpy as np
from mpilab.metrics_store import MetricsStore
from mpilab.row_tables import MAX_STORE_ROWS, MIN_TABLE_ROWS, TABLE_BYTES_PER_ROW
from mpilab.wire import encode

RANKS = 1024
T0 = 1_700_000_000.0


def rank_records(rank: int, first_step: int, steps: int) -> list:
    """What a training rank queues in `steps` steps: a step record, its loss and two
    bucket allreduces (the agent's span rows) each."""
    out: list = []
    for step in range(first_step, first_step + steps):
        t = T0 + 0.1 * step
        out.append({"k": "step", "r": rank, "t": t, "step": step, "dur": 0.1,
                    "compute": 0.07, "comm": 0.03, "nbytes": 100_000_000, "samples": 32})
        out.append({"k": "log", "r": rank, "t": t, "step": step, "values": {"loss": 1.0}})
        out.append(("allreduce", t - 0.02, t - 0.01, 50_000_000, 2 * step))
        out.append(("allreduce", t - 0.01, t, 50_000_000, 2 * step + 1))
    return out


def rank_messages(rank: int, first_step: int, steps: int) -> list[bytes]:
    """encode(rank, rank_records(...)), made from arrays: the same bytes (checked below)
    at a fraction of the cost, for a million steps."""
    step = np.arange(first_step, first_step + steps, dtype=float)
    t = T0 + 0.1 * step
    one = np.ones(steps)
    step_rows = np.column_stack([t, step, 0.1 * one, 0.07 * one, 0.03 * one,
                                 100_000_000 * one, 32 * one])
    log_rows = np.column_stack([t, step, one])
    spans = np.empty((2 * steps, 5))
    spans[0::2] = np.column_stack([t - 0.01, t - 0.02, t - 0.01 - (t - 0.02),
                                   50_000_000 * one, 2 * step])
    spans[1::2] = np.column_stack([t, t - 0.01, t - (t - 0.01), 50_000_000 * one,
                                   2 * step + 1])
    blocks = [{"k": "rows", "r": rank, "t": float(rows[-1, 0]), "of": of, "labels": labels,
               "data": rows.tobytes()}
              for of, labels, rows in (("step", [], step_rows), ("log", ["loss"], log_rows),
                                       ("span", ["allreduce", "comm"], spans))]
    return [msgpack.packb(blocks, use_bin_type=True)]


def test_the_array_made_messages_are_the_agents():
    for rank, first in ((0, 0), (1023, 1400)):
        assert rank_messages(rank, first, 100) == encode(rank, rank_records(rank, first, 100))


def test_a_thousand_ranks_long_run_stays_within_the_stated_cap():
    store = MetricsStore(world_size=RANKS)
    # each rank's records in messages, as its agent sends them, in rounds of 1,024 ranks
    per_tick = 100  # steps a message: a block per table per rank
    # 1,500 steps per rank: past the per-table limit (325) several times over
    ticks = 1500 // per_tick
    for tick in range(ticks):
        for rank in range(RANKS):
            for message in rank_messages(rank, tick * per_tick, per_tick):
                assert store.add_raw(message)
    assert store.dropped == 0
    tables = 3 * RANKS  # steps, loss, allreduce spans
    limit = MAX_STORE_ROWS // tables
    assert limit >= MIN_TABLE_ROWS
    # the stated cap: 2 * 1M rows of at most 64 bytes (steps: 7 columns and the filing
    # time), and what it is at 1,024 ranks
    assert store.table_cap() == 2 * MAX_STORE_ROWS * TABLE_BYTES_PER_ROW == 128_000_000
    assert store.table_bytes() <= store.table_cap()
    for rank in (0, 511, RANKS - 1):  # each rank keeps its newest `limit` steps
        steps = [rec["step"] for rec in store.records("step", rank=rank)]
        assert steps == list(range(1500 - limit, 1500))
        spans = store.records("span", rank=rank)
        assert len(spans) == limit and spans[-1]["seq"] == 2 * 1499 + 1
    for tables_of_kind in store._tables.values():
        for rows in tables_of_kind.values():
            assert len(rows.data) <= 2 * limit  # every rank's buffer, allocated


def _send(store: MetricsStore, record: dict) -> None:
    """One message of one record, filed as the receiver files a round."""
    assert store.add_messages([msgpack.packb(record, use_bin_type=True)]) == 0


def test_the_cap_holds_as_ranks_join_and_the_budget_shrinks():
    """Tables made early grow under a larger share; when more ranks' tables come the
    share shrinks and their arrays shrink at their next rows."""
    store = MetricsStore(world_size=64, max_rows=20_000)
    rows = np.zeros((50, 7))
    rows[:, 0] = T0
    for step in range(2000):  # rank 0 alone: its share is max_per_rank, capped by max_rows
        rows[:, 1] = np.arange(50 * step, 50 * step + 50)
        _send(store, {"k": "rows", "r": 0, "t": T0, "of": "step", "labels": [],
                      "data": rows.tobytes()})
    assert len(store.records("step", rank=0)) == 20_000
    for rank in range(1, 64):  # 64 tables: 312 rows each now (MIN_TABLE_ROWS is 250)
        for _ in range(10):
            _send(store, {"k": "rows", "r": rank, "t": T0, "of": "step", "labels": [],
                          "data": rows.tobytes()})
    _send(store, {"k": "rows", "r": 0, "t": T0, "of": "step", "labels": [],
                  "data": rows.tobytes()})
    assert store.table_bytes() <= store.table_cap() == 2 * 20_000 * TABLE_BYTES_PER_ROW
    assert len(store.records("step", rank=0)) == 20_000 // 64
    # a block larger than what is kept: its newest rows, numbered as sent
    big = np.zeros((1000, 7))
    big[:, 0] = T0
    big[:, 1] = np.arange(1000)
    _send(store, {"k": "rows", "r": 5, "t": T0, "of": "step", "labels": [],
                  "data": big.tobytes()})
    kept = [rec["step"] for rec in store.records("step", rank=5)]
    assert kept == list(range(1000 - 312, 1000))
    assert store._tables["step"][(5, ())].end == 10 * 50 + 1000

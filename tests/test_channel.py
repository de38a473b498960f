"""Unit tests of the record channel: the schema both sides share (mpilab.wire), the
notebook's checks, the store, the exporters, and the receiver's PULL socket under
garbage. Records reach the store as the ranks send them: through the ranks' encoder."""

from __future__ import annotations

import csv
import json
import pickle
import time

import msgpack
import numpy as np
import pytest
import zmq
from mpilab import receiver as receiver_module
from mpilab.cell_window import CellWindow
from mpilab.metrics_store import MetricsStore
from mpilab.rank.agent import Agent
from mpilab.receiver import BEHIND_NOTIFY_S, DRAIN_MESSAGES, RecordReceiver
from mpilab.records import validate
from mpilab.wire import (
    BATCH_RECORDS,
    HEARTBEAT_EXTRA,
    HEARTBEAT_FIELDS,
    MAX_MESSAGE_BYTES,
    encode,
    fields_fit,
    tabulate,
)

T0 = 1_700_000_000.0

GOOD = {
    "hb": {"k": "hb", "r": 0, "t": T0, "pid": 1, "host": "h", "phase": "idle", "op": "",
           "seq": 0, "op_age": 0.0, "rss": 1 << 20, "step": 0, "dev_mem": 0, "cell": 0},
    "step": {"k": "step", "r": 1, "t": T0, "step": 3, "dur": 0.1, "compute": 0.07,
             "comm": 0.02, "nbytes": 4096, "samples": 32},
    "log": {"k": "log", "r": 0, "t": T0, "step": 3, "values": {"loss": 0.5, "acc": 1}},
    "span": {"k": "span", "r": 1, "t": T0, "name": "allreduce", "cat": "comm", "ts": T0 - 0.01,
             "dur": 0.01, "nbytes": 4096, "seq": 9},
    "event": {"k": "event", "r": 0, "t": T0, "what": "cell started"},
}


def with_(record: dict, **changes) -> dict:
    out = {**record, **changes}
    return {k: v for k, v in out.items() if v is not ...}


# -- the schema and the checks ----------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(GOOD))
def test_what_the_encoder_makes_of_good_records_arrives_valid(kind):
    assert fields_fit(GOOD[kind])
    (message,) = encode(GOOD[kind]["r"], [dict(GOOD[kind])])
    received = msgpack.unpackb(message)
    assert received and all(validate(record, world_size=2) for record in received)
    # the tabular kinds travel only as blocks of rows (the log's two scalars: two blocks)
    travels = {"hb": ["hb"], "event": ["event"], "log": ["rows", "rows"]}
    assert [r["k"] for r in received] == travels.get(kind, ["rows"])
    assert validate(GOOD[kind], world_size=2) == (kind in ("hb", "event"))


def test_a_heartbeat_has_the_fields_of_the_schema():
    beat = Agent(rank=1, world_size=2, address=None).heartbeat()
    assert set(beat) == {"k", "r", "t", *HEARTBEAT_FIELDS, *HEARTBEAT_EXTRA}
    assert validate(beat, world_size=2)
    for name, types in {**HEARTBEAT_FIELDS, **HEARTBEAT_EXTRA}.items():
        assert isinstance(beat[name], types), name


def test_a_cell_queued_records_unless_only_its_start_and_heartbeats_are_still_queued():
    """What `cell_queued` says decides whether the notebook waits for a cell's records."""
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    agent = Agent(rank=0, world_size=2, address=f"tcp://127.0.0.1:{port}")
    try:
        agent.begin_cell(what="cell-start", cell=1, msg="m1")
        agent.beat()
        assert not agent.cell_queued()  # the thread is not running: nothing left
        agent.span("allreduce", T0, T0 + 0.001, 4096, 1)  # a collective's row
        assert agent.cell_queued()
        agent.begin_cell(what="cell-start", cell=2, msg="m2")
        agent.emit("log", step=0, values={"loss": 1.0})
        assert agent.cell_queued()
        agent.begin_cell(what="cell-start", cell=3, msg="m3")
        agent.start()
        agent.flush()
        assert pull.poll(5000)  # the start marker left: what else did may not be in
        assert agent.cell_queued()
        agent.stop()
        agent.begin_cell(what="cell-start", cell=4, msg="m4")
        for _ in range(agent._queue.maxlen):  # a full queue drops its oldest
            agent.beat()
        assert agent.cell_queued()
    finally:
        agent.stop()
        pull.close(linger=0)


@pytest.mark.parametrize("record", [
    None, [], "step", 42,
    with_(GOOD["step"], k="exec"),  # unknown kind
    with_(GOOD["step"], k=...),
    with_(GOOD["step"], r=2),  # out of range for 2 ranks
    with_(GOOD["step"], r=-1),
    with_(GOOD["step"], r=True),  # a bool is not a rank
    with_(GOOD["step"], r="0"),
    with_(GOOD["step"], t="now"),
    with_(GOOD["step"], t=...),
    with_(GOOD["step"], dur=...),  # a missing field
    with_(GOOD["step"], step="3"),
    with_(GOOD["step"], step=3.5),
    with_(GOOD["step"], nbytes=True),
    with_(GOOD["hb"], host=None),
    with_(GOOD["log"], values=[0.5]),
    with_(GOOD["log"], values={"loss": "0.5"}),
    with_(GOOD["log"], values={"loss": None}),
    with_(GOOD["span"], ts=[1]),
    with_(GOOD["event"], what=b"bytes"),
])
def test_malformed_records_are_dropped_and_counted(record):
    """By the ranks' encoder (a record of a tabular kind without its fields) or by the
    notebook's checks (a record as it arrives)."""
    assert not validate(record, world_size=2)
    store = MetricsStore(world_size=2)
    assert not store.add(record)
    assert store.dropped == 1 and store.received == 0 and store.version == 0


@pytest.mark.parametrize("record", [
    {"k": ["hb"], "r": 0, "t": T0},  # a kind that cannot be looked up
    {"k": "rows", "r": 0, "t": T0, "of": ["step"], "labels": [], "data": b"\0" * 56},
    {"k": "rows", "r": 0, "t": T0, "of": {"step": 1}, "labels": [], "data": b"\0" * 56},
])
def test_unhashable_kinds_are_dropped_not_raised(record):
    store = MetricsStore(world_size=2)
    assert not validate(record, world_size=2)
    assert not store.add_raw(msgpack.packb([record]))
    assert store.dropped == 1


# -- the store ------------------------------------------------------------------------------
def test_store_files_records_by_kind_and_rank():
    store = MetricsStore(world_size=2)
    for kind in ("step", "log", "span", "event", "hb"):
        assert store.add(dict(GOOD[kind]))
    # the log record's two scalars are two rows: a row counts as a record
    assert store.received == 6 and store.dropped == 0 and store.version == 6
    assert store.records("step") == [store.records("step", rank=1)[0]]
    assert store.records("step", rank=0) == []
    assert store.records("hb") == []  # heartbeats keep only the latest
    assert store.heartbeats[0]["pid"] == 1
    assert set(store.heartbeat_ages()) == {0, 1}
    assert all(age >= 0 for age in store.heartbeat_ages().values())
    assert "recv" in store.records("log")[0]


def test_store_records_are_time_ordered_and_filtered_by_since():
    store = MetricsStore(world_size=2)
    for i, r in enumerate([1, 0, 1, 0]):
        store.add(with_(GOOD["step"], r=r, step=i, t=T0 + 10 - i))
    assert [rec["t"] for rec in store.records("step")] == [T0 + 7, T0 + 8, T0 + 9, T0 + 10]
    assert [rec["step"] for rec in store.records("step", since=T0 + 9)] == [1, 0]
    assert [rec["step"] for rec in store.records("step", rank=0)] == [3, 1]
    for i, r in enumerate([1, 0, 1, 0]):
        store.add(with_(GOOD["event"], r=r, what=str(i), t=T0 + 10 - i))
    assert [rec["what"] for rec in store.records("event", since=T0 + 8)] == ["2", "1", "0"]


def test_store_buffers_are_bounded_per_rank():
    store = MetricsStore(world_size=2, max_per_rank=100)
    for i in range(1000):
        store.add(with_(GOOD["step"], r=0, step=i, t=T0 + i))
    store.add(with_(GOOD["step"], r=1, step=0))
    steps = [rec["step"] for rec in store.records("step", rank=0)]
    assert steps == list(range(900, 1000))  # the newest are kept
    assert len(store.records("step", rank=1)) == 1
    assert store.received == 1001 and store.version == 1001


def test_latest_only_events_keep_their_newest_and_never_push_rare_ones_out():
    """A progress bar reports 5 times a second: in a long run it must not evict a cell's
    end marker (the cell waits for it), nor make readers scan its past."""
    store = MetricsStore(world_size=2, max_per_rank=10)
    store.add({"k": "event", "r": 0, "t": T0, "what": "cell-end", "cell": 3})
    for n in range(100):
        store.add({"k": "event", "r": 0, "t": T0 + 1 + n, "what": "progress", "n": n})
    assert [e["what"] for e in store.records("event")] == ["cell-end"]
    assert store.latest_event("progress", rank=0)["n"] == 99
    assert store.latest_event("progress", rank=0, since=T0 + 101) is None  # an older cell's
    assert store.latest_event("progress", rank=1) is None
    store.add({"k": "event", "r": 0, "t": T0 + 200, "what": "checkpoint", "path": "/b.pt"})
    store.clear()  # metrics go; the newest checkpoint stays (a restart names it)
    assert store.latest_event("checkpoint", rank=0)["path"] == "/b.pt"


def test_a_cells_window_is_its_time_on_each_rank_from_its_start_and_end_events():
    """A cell queued behind a --noblock one starts on the ranks later than it was run,
    and not on every rank at once: its records are, per rank, those between its own
    start and end events there; a rank that has not begun it keeps its rows for later."""
    store = MetricsStore(world_size=3)
    cell = CellWindow(since=T0, msg_ids={0: "b0", 1: "b1"})  # ranks 0 and 1 only

    def mark(rank, what, t, msg):
        store.add({"k": "event", "r": rank, "t": t, "what": what, "cell": 1, "msg": msg})

    for rank in range(3):
        mark(rank, "cell-start", T0 - 5, f"a{rank}")  # the --noblock cell before it
        for step in range(4):
            store.add(with_(GOOD["step"], r=rank, step=step, t=T0 - 4 + step))
    assert cell.bounds(store) == {} and cell.started(store) is None
    position: dict = {}
    assert store.new_rows("step", position, window=cell.bounds(store)) == []
    assert not store.has_rows(("step",), cell.bounds(store))
    mark(0, "cell-end", T0 + 0.5, "a0")
    mark(0, "cell-start", T0 + 1, "b0")
    store.add(with_(GOOD["step"], r=0, step=0, t=T0 + 2))
    assert cell.bounds(store) == {0: (T0 + 1, float("inf"))} and cell.started(store) == T0 + 1
    assert store.has_rows(("step",), cell.bounds(store))
    (rank, _, rows), = store.new_rows("step", position, window=cell.bounds(store))
    assert (rank, rows[:, 1].tolist()) == (0, [0])  # not the earlier cell's steps
    # rank 1 ends the earlier cell and begins this one; its rows were kept until now
    mark(1, "cell-end", T0 + 1.5, "a1")
    mark(1, "cell-start", T0 + 1.6, "b1")
    store.add(with_(GOOD["step"], r=1, step=0, t=T0 + 1.7))
    mark(0, "cell-end", T0 + 3, "b0")
    store.add(with_(GOOD["step"], r=0, step=9, t=T0 + 4))  # a later cell's
    assert cell.ended(store) == {0}
    got = {rank: rows[:, 1].tolist()
           for rank, _, rows in store.new_rows("step", position, window=cell.bounds(store))}
    assert got == {1: [0]}
    assert 2 not in cell.bounds(store)  # a rank the cell does not run on shows nothing


def test_store_add_raw_drops_and_counts_garbage():
    store = MetricsStore(world_size=2)
    garbage = [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all \xff\xfe",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"k": "step"}),
        msgpack.packb({1: 2}),  # non-string keys
        msgpack.packb(msgpack.ExtType(42, b"code")),
        msgpack.packb({**GOOD["step"], "dur": msgpack.ExtType(1, b"x")}),
        pickle.dumps(GOOD["step"]),
        msgpack.packb({**GOOD["event"], "pad": "x" * MAX_MESSAGE_BYTES}),
        msgpack.packb(GOOD["step"]),  # a step outside a block of rows: never sent so
    ]
    for raw in garbage:
        assert not store.add_raw(raw)
    assert store.dropped == len(garbage) and store.received == 0 and store.version == 0
    (message,) = encode(1, [GOOD["step"]])
    assert store.add_raw(message)
    assert store.received == 1


def test_store_clear_forgets_metrics_but_keeps_heartbeats_and_cell_marks():
    store = MetricsStore(world_size=2)
    store.add(dict(GOOD["hb"]))
    store.add(dict(GOOD["step"]))
    store.add({"k": "event", "r": 1, "t": T0, "what": "cell-start", "msg": "m"})
    version = store.version
    store.clear()
    assert store.records("step") == [] and 0 in store.heartbeats
    assert store.version > version  # so widgets redraw
    # `%mpilab metrics --clear` while a --noblock cell runs: its window stays
    assert CellWindow(T0, {1: "m"}).bounds(store) == {1: (T0, float("inf"))}


def test_cell_marks_found_by_request_among_many_cells():
    """A cell's window is found by its execute request however many cells ran before it
    (cells of a few ms each fill the event buffers); the marks of the oldest cells go
    beyond metrics_store.CELLS_KEPT a rank."""
    from mpilab.metrics_store import CELLS_KEPT

    store = MetricsStore(world_size=2)
    cells = CELLS_KEPT + 10
    for c in range(cells):
        for what, dt in (("cell-start", 0.0), ("cell-end", 0.001)):
            store.add({"k": "event", "r": 0, "t": T0 + c * 0.002 + dt, "what": what,
                       "msg": f"m{c}", "cell": c})
    newest = store.cell_marks({0: f"m{cells - 1}", 1: f"m{cells - 1}"})
    assert list(newest) == [0]  # rank 1 never began it
    assert (newest[0].start, newest[0].end, newest[0].number) == (
        T0 + (cells - 1) * 0.002, T0 + (cells - 1) * 0.002 + 0.001, cells - 1)
    assert store.cell_marks({0: "m0"}) == {}  # beyond CELLS_KEPT
    assert store.cell_marks({0: "m10"})[0].number == 10
    # a cell that has begun but not ended runs on
    store.add({"k": "event", "r": 1, "t": T0, "what": "cell-start", "msg": "late", "cell": 3})
    assert store.cell_marks({1: "late"})[1].end == float("inf")


# -- exporters ----------------------------------------------------------------------------
def metrics_store() -> MetricsStore:
    store = MetricsStore(world_size=2)
    for step in range(3):
        for r in range(2):
            store.add(with_(GOOD["step"], r=r, step=step, t=T0 + step))
            store.add(with_(GOOD["log"], r=r, step=step, t=T0 + step + 0.5,
                            values={"loss": 1.0 / (step + 1)}))
    store.add(dict(GOOD["span"]))
    store.add(with_(GOOD["span"], r=0, name="forward", cat="compute", seq=...))
    return store


def test_save_json(tmp_path):
    path = metrics_store().save(tmp_path / "run.json")
    data = json.loads(path.read_text())
    assert data["world_size"] == 2
    kinds = [row["kind"] for row in data["records"]]
    assert kinds.count("step") == 6 and kinds.count("log") == 6
    log = next(row for row in data["records"] if row["kind"] == "log")
    assert log["loss"] == 1.0 and "values" not in log and "recv" not in log
    step = next(row for row in data["records"] if row["kind"] == "step")
    assert {"rank", "time", "step", "dur", "compute", "comm", "nbytes", "samples"} <= set(step)


def test_save_csv(tmp_path):
    path = metrics_store().save(tmp_path / "run.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12
    assert list(rows[0])[:3] == ["kind", "rank", "time"]
    assert {row["kind"] for row in rows} == {"step", "log"}
    assert [row["loss"] for row in rows if row["kind"] == "log"][:2] == ["1.0", "1.0"]


def test_save_refuses_other_formats(tmp_path):
    with pytest.raises(ValueError, match=r"\.json or \.csv"):
        metrics_store().save(tmp_path / "run.parquet")


def test_chrome_trace(tmp_path):
    store = metrics_store()
    trace = json.loads(store.save_trace(tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    names = [e for e in events if e["ph"] == "M"]
    assert [e["args"]["name"] for e in names] == ["rank 0", "rank 1"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    comm = spans["allreduce"]
    assert comm["pid"] == 1 and comm["tid"] == 1 and comm["cat"] == "comm"
    assert comm["ts"] == pytest.approx((T0 - 0.01) * 1e6)
    assert comm["dur"] == pytest.approx(0.01 * 1e6)
    assert comm["args"] == {"nbytes": 4096, "seq": 9}
    assert spans["forward"]["tid"] == 0 and spans["forward"]["args"] == {"nbytes": 4096}


# -- the receiver ---------------------------------------------------------------------------
def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_receiver_drops_garbage_and_files_good_records():
    store = MetricsStore(world_size=2)
    receiver = RecordReceiver(store)
    assert receiver.address.startswith("tcp://127.0.0.1:")
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(receiver.address)
    try:
        garbage = [
            b"\x00\x01garbage\xff",  # not msgpack
            msgpack.packb(["step", 0, 1.0]),  # msgpack, wrong shape
            msgpack.packb({**GOOD["step"], "dur": "slow"}),  # wrong field type
            msgpack.packb({**GOOD["step"], "r": 7}),  # no such rank
            msgpack.packb({**GOOD["step"], "k": "exec", "code": "import os"}),  # unknown kind
            pickle.dumps(GOOD["step"]),  # the channel never unpickles
        ]
        good = [GOOD["step"], GOOD["log"], GOOD["hb"]]
        filed = 4  # the log record's two scalars are two rows
        for raw in garbage[:3]:
            push.send(raw)
        for record in good:
            for message in encode(record["r"], [record]):
                push.send(message)
        for raw in garbage[3:]:
            push.send(raw)
        wait_for(lambda: store.received + store.dropped == len(garbage) + filed)
        assert store.dropped == len(garbage)
        assert store.received == filed
        assert [rec["step"] for rec in store.records("step")] == [3]
        assert store.records("log")[0]["values"] == {"loss": 0.5, "acc": 1}
        assert store.heartbeats[0]["host"] == "h"
        # an oversized message is cut by the socket itself; the receiver keeps going
        push.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
        push.close()
        push = ctx.socket(zmq.PUSH)
        push.connect(receiver.address)
        push.send(msgpack.packb(GOOD["event"]))
        wait_for(lambda: store.records("event"))
    finally:
        push.close(linger=0)
        receiver.close()


def test_store_files_a_batch_and_drops_only_its_bad_records():
    store = MetricsStore(world_size=2)
    batch = tabulate(1, [with_(GOOD["step"], step=i) for i in range(3)] +
                     [with_(GOOD["event"], what=str(i)) for i in range(2)])
    assert store.add_raw(msgpack.packb(batch))
    assert len(store.records("step")) == 3 and len(store.records("event")) == 2
    assert not store.add_raw(msgpack.packb([*batch, {"k": "event", "r": 7, "t": T0,
                                                     "what": "x"}]))
    assert store.dropped == 1  # only the malformed record; the good ones are filed
    assert len(store.records("step")) == 6 and len(store.records("event")) == 4
    # more than a batch holds: one malformed message, none of its records filed
    assert not store.add_raw(msgpack.packb([GOOD["event"]] * 1001))
    assert store.dropped == 2 and len(store.records("event")) == 4


def test_a_round_of_messages_drops_only_its_bad_blocks():
    """The receiver files a round of messages at once, their blocks checked together:
    a block with a row that does not fit is dropped alone."""
    store = MetricsStore(world_size=2)
    good = [encode(r, [with_(GOOD["step"], r=r, step=s) for s in range(3)])[0]
            for r in range(2)]
    half_step = block(data=np.array([[T0, 3.5, 0.1, 0.07, 0.02, 4096, 32]]).tobytes())
    spans = tabulate(0, [with_(GOOD["span"], r=0, seq=...), with_(GOOD["span"], r=0)])
    assert store.add_messages([good[0], msgpack.packb([half_step]), good[1],
                               msgpack.packb(spans)]) == 1
    assert store.dropped == 1
    assert [(r["r"], r["step"]) for r in store.records("step")] == [
        (rank, step) for rank in range(2) for step in range(3)]
    assert len(store.records("span", rank=0)) == 2  # a missing seq is NaN, not a bad row


def run_records(rank: int, steps: int) -> list[dict]:
    """What a rank's DataParallel step and `mpilab.log` make, with an event between."""
    out = []
    for step in range(steps):
        t = T0 + step
        out += [with_(GOOD["span"], r=rank, t=t, ts=t - 0.01, seq=step),
                with_(GOOD["step"], r=rank, t=t, step=step),
                with_(GOOD["log"], r=rank, t=t, step=step, values={"loss": 1 / (step + 1),
                                                                   "acc": step / 10})]
        if step == 1:
            out.append(with_(GOOD["event"], r=rank, t=t))
    return out


def test_blocks_of_rows_file_as_the_records_they_came_from():
    """The agent sends the per-step kinds as blocks of rows; the store gives back the
    records that went in, and readers of rows take each row once."""
    sent, one_by_one = MetricsStore(world_size=2), MetricsStore(world_size=2)
    for rank in range(2):
        records = run_records(rank, 5)
        for record in records:
            assert one_by_one.add(dict(record))
        blocks = tabulate(rank, [dict(record) for record in records])
        assert [b["k"] for b in blocks] == ["rows"] * 4 + ["event"]  # step, span, 2 scalars
        for message in encode(rank, [dict(record) for record in records]):
            assert sent.add_raw(message)
    for kind in ("step", "span", "log", "event"):
        got, want = sent.records(kind), one_by_one.records(kind)
        assert [without_recv(r) for r in got] == [without_recv(r) for r in want], kind
    assert sent.records("step", rank=1)[0]["nbytes"] == 4096  # ints stay ints
    assert sent.received == 2 * (5 * 4 + 1)  # a row counts as a record
    position: dict = {}
    first = sent.new_rows("step", position)
    assert sorted(rank for rank, _, _ in first) == [0, 1]
    assert all(rows[:, 1].tolist() == [0, 1, 2, 3, 4] for _, _, rows in first)
    assert sent.new_rows("step", position) == []
    sent.add(with_(GOOD["step"], r=0, step=5))
    (rank, labels, rows), = sent.new_rows("step", position)
    assert (rank, labels, rows[:, 1].tolist()) == (0, (), [5])


def without_recv(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "recv"}


def block(**changes) -> dict:
    good = {"k": "rows", "r": 0, "t": T0, "of": "step", "labels": [],
            "data": np.array([[T0, 3, 0.1, 0.07, 0.02, 4096, 32]]).tobytes()}
    return {**good, **changes}


@pytest.mark.parametrize("bad", [
    block(of="exec"),
    block(labels=["extra"]),
    block(of="log", labels=[7], data=np.array([[T0, 1, 0.5]]).tobytes()),
    block(data=b""),
    block(data=np.array([T0, 3, 0.1]).tobytes()),  # not whole rows
    block(data=np.array([[np.nan, 3, 0.1, 0.07, 0.02, 4096, 32]]).tobytes()),  # no time
    block(data=np.array([[T0, 3.5, 0.1, 0.07, 0.02, 4096, 32]]).tobytes()),  # a half step
    block(data=np.array([[T0, np.inf, 0.1, 0.07, 0.02, 4096, 32]]).tobytes()),
    block(data=np.zeros((1001, 7)).tobytes()),  # more rows than a block holds
    block(data="text"),
])
def test_malformed_blocks_are_dropped_and_counted(bad):
    store = MetricsStore(world_size=2)
    assert store.add(block())
    assert not validate(bad, world_size=2)
    assert not store.add_raw(msgpack.packb([bad]))
    assert store.dropped == 1 and store.received == 1


def test_a_record_whose_optional_field_is_no_number_is_dropped():
    store = MetricsStore(world_size=2)
    assert fields_fit(with_(GOOD["span"], seq="x"))  # the schema has no seq
    assert not store.add(with_(GOOD["span"], seq="x"))
    assert store.dropped == 1 and store.records("span") == []


def test_a_span_without_its_optional_fields_keeps_without_them():
    store = MetricsStore(world_size=2)
    assert store.add_raw(msgpack.packb(tabulate(0, [with_(GOOD["span"], r=0, nbytes=...,
                                                          seq=...)])))
    (span,) = store.records("span")
    assert "nbytes" not in span and "seq" not in span and span["name"] == "allreduce"


def test_row_readers_keep_their_place_in_bounded_tables():
    store = MetricsStore(world_size=1, max_per_rank=100)
    position: dict = {}
    taken = []
    for start in range(0, 1000, 30):
        for step in range(start, start + 30):
            store.add(with_(GOOD["step"], r=0, step=step, t=T0 + step))
        for _, _, rows in store.new_rows("step", position):
            taken += rows[:, 1].astype(int).tolist()
    assert taken == list(range(1020))  # each row once, though only 100 are kept
    assert [r["step"] for r in store.records("step")] == list(range(920, 1020))


def test_messages_stay_under_the_receivers_limits():
    records = [with_(GOOD["log"], r=0, step=i, values={f"s{j}": 1.0 for j in range(40)})
               for i in range(1000)]
    assert len(tabulate(0, records)) == 40
    messages = encode(0, records)
    for message in messages:
        assert len(message) <= MAX_MESSAGE_BYTES and len(msgpack.unpackb(message)) <= BATCH_RECORDS
    assert sum(len(msgpack.unpackb(message)) for message in messages) == 40
    assert encode(0, []) == []  # nothing to send is no message (an empty one is malformed)


def test_listeners_hear_of_each_round_and_a_failing_one_is_dropped():
    store = MetricsStore(world_size=2)
    heard = []

    def broken():
        raise RuntimeError("a reader's bug")

    store.subscribe(broken)
    store.subscribe(lambda: heard.append(store.received))
    store.add(GOOD["step"])
    store.notify()
    store.notify()
    assert heard == [1, 1]  # the broken listener did not stop the next one, twice
    assert broken not in store._listeners  # and is not called again
    store.unsubscribe(store._listeners[0])
    store.notify()
    assert heard == [1, 1]


def test_receiver_tells_listeners_once_per_round_of_batches():
    """The ranks send at the same moments: their batches make one round, one redraw."""
    store = MetricsStore(world_size=2)
    rounds = []
    store.subscribe(lambda: rounds.append(store.received))
    receiver = RecordReceiver(store)
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(receiver.address)
        batches = [encode(rank, [with_(GOOD["step"], r=rank, step=s) for s in range(5)])[0]
                   for rank in range(2)]
        for batch in batches:
            push.send(batch)
        wait_for(lambda: rounds)
        time.sleep(0.2)
        assert rounds == [10]
    finally:
        push.close(linger=0)
        receiver.close()


def test_receiver_files_more_messages_than_it_drains_at_once():
    """The receiver files what the socket holds DRAIN_MESSAGES at a time: all of it,
    in order per rank."""
    store = MetricsStore(world_size=2)
    receiver = RecordReceiver(store)
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(receiver.address)
        sent = 3 * DRAIN_MESSAGES + 7
        for n in range(sent):
            (message,) = encode(n % 2, [with_(GOOD["event"], r=n % 2, t=T0 + n, what=str(n))])
            push.send(message)
        wait_for(lambda: store.received == sent)
        assert [e["what"] for e in store.records("event", rank=1)] == [
            str(n) for n in range(1, sent, 2)]
        assert store.dropped == 0 and store.beats == 0
        (beat,) = encode(0, [GOOD["hb"]])
        push.send(beat)
        wait_for(lambda: store.beats == 1)
    finally:
        push.close(linger=0)
        receiver.close()


def test_a_round_ends_while_records_keep_coming(monkeypatch):
    """A thousand ranks whose sends spread out keep the socket busy: a round still ends
    after ROUND_MAX_S, and while the receiver is behind its listeners (the dashboard,
    which redraws on its thread) hear of rounds every BEHIND_NOTIFY_S, not only once the
    socket is empty; once it has caught up, at once."""
    behind_notify_s = BEHIND_NOTIFY_S / 4  # a shorter test
    monkeypatch.setattr(receiver_module, "BEHIND_NOTIFY_S", behind_notify_s)
    store = MetricsStore(world_size=2)
    rounds = []
    store.subscribe(lambda: rounds.append(time.monotonic()))
    receiver = RecordReceiver(store)
    push = zmq.Context.instance().socket(zmq.PUSH)
    # messages of 100 events: sent faster than they are filed
    (message,) = encode(0, [with_(GOOD["event"], what=str(n)) for n in range(BATCH_RECORDS)])
    try:
        push.connect(receiver.address)
        started = time.monotonic()
        sent = 0
        while time.monotonic() < started + 2.5 * behind_notify_s:
            push.send(message)
            sent += BATCH_RECORDS
        busy = store.received
        assert len(rounds) >= 2, f"{len(rounds)} rounds while {busy:,} events were filed"
        wait_for(lambda: store.received == sent, timeout=60)  # caught up
        time.sleep(0.2)
        caught_up = len(rounds)
        (beat,) = encode(0, [GOOD["hb"]])
        push.send(beat)
        wait_for(lambda: len(rounds) > caught_up, timeout=behind_notify_s / 2)
    finally:
        push.close(linger=0)
        receiver.close()


def test_receivers_raise_the_young_gc_threshold_while_open_and_give_it_back():
    """Filing a thousand ranks' records with CPython's default young threshold set off
    full collections every two seconds; the user's setting returns when the last
    receiver closes."""
    import gc

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        first, second = RecordReceiver(MetricsStore(world_size=1)), \
            RecordReceiver(MetricsStore(world_size=1))
        assert gc.get_threshold() == (receiver_module.GC_YOUNG_THRESHOLD, 10, 10)
        first.close()
        assert gc.get_threshold()[0] == receiver_module.GC_YOUNG_THRESHOLD  # one still open
        second.close()
        second.close()
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(50_000, 5, 5)  # a user's own, higher: kept
        third = RecordReceiver(MetricsStore(world_size=1))
        assert gc.get_threshold() == (50_000, 5, 5)
        third.close()
        assert gc.get_threshold() == (50_000, 5, 5)
    finally:
        gc.set_threshold(*saved)

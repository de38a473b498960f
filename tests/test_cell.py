"""Pure logic of a running cell (mpilab.cell) and of its report (mpilab.runner): the
ranks' results stand in as fakes of ipyparallel's AsyncResult, the cluster as what the
cell asks of it; the metrics store, the output relay and the watchdog are the real ones.
The real ranks' side of the same behaviour is pinned by test_failures and test_magics."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from ipyparallel.error import TaskAborted
from mpilab import cell as cell_module
from mpilab.cell import Ahead, CellOutcome, RunningCell, RunOptions, waiting_text
from mpilab.metrics_store import MetricsStore
from mpilab.runner import report_text

BOOM = "Traceback (most recent call last):\n  Cell In[3], line 1\nValueError: boom"
STOPPED = "Traceback (most recent call last):\n  Cell In[3], line 1\nKeyboardInterrupt"


class RankError(Exception):
    """What ipyparallel hands back for a rank whose cell raised."""

    def __init__(self, traceback: str, ename: str = "ValueError"):
        super().__init__(ename)
        self.traceback = traceback
        self.ename = ename


class FakeSingle:
    """One rank's part of the cell."""

    def __init__(self):
        self.done = False
        self.value = None

    def end(self, value) -> None:
        self.done, self.value = True, value

    def ready(self) -> bool:
        return self.done

    def successful(self) -> bool:
        return not isinstance(self.value, BaseException)

    def get(self, return_exceptions: bool = False):
        return [self.value]  # a one-engine view answers with a list


class FakeCellResult:
    """ipyparallel's AsyncResult of a cell on several ranks; `on_wait` plays the ranks."""

    def __init__(self, ranks: list[int]):
        self.msg_ids = [f"msg-{r}" for r in ranks]
        self.metadata = [{"stdout": "", "stderr": "", "outputs": []} for _ in ranks]
        self.singles = [FakeSingle() for _ in ranks]
        self.on_wait = lambda: None

    def split(self) -> list[FakeSingle]:
        return self.singles

    def ready(self) -> bool:
        return all(s.done for s in self.singles)

    def wait(self, timeout: float) -> bool:
        self.on_wait()
        if not self.ready():
            time.sleep(timeout)
        return self.ready()

    def wait_for_output(self, timeout: float) -> None:
        pass


def answered_at_once() -> Future:
    """The engines' (or their nannies') answers to a control request, all in."""
    answers: Future = Future()
    answers.set_result([])
    return answers


class FakeCluster:
    """What a running cell asks of a RankCluster; `on_signal(rank)` plays a rank's
    answer to SIGINT."""

    def __init__(self, world_size: int = 2):
        self.world_size = world_size
        self.store = MetricsStore(world_size=world_size)
        self.ranks: list[dict] = []
        self.client = self
        self.signalled: list[int] = []
        self.aborted: list[str] = []
        self.restarts = 0
        self.generation = 1  # which ranks these are (RankCluster.generation)
        self.input_desk = None  # where the ranks' input() would ask (none here)
        self.on_signal = lambda rank: None
        self.abort_answer: Future | None = None

    def engines(self, ranks):
        return list(ranks)

    def local_processes(self) -> dict:
        return {}  # no local processes for the watchdog to look at

    def send_signal(self, signal: str, targets, block: bool) -> Future:
        for rank in targets:
            self.signalled.append(rank)
            self.on_signal(rank)
        return answered_at_once()

    def abort(self, msg_ids, targets, block: bool) -> Future:
        """The engines' answers to the abort come as `abort_answer` completes (at once
        unless a test sets one)."""
        self.aborted.extend(msg_ids)
        return self.abort_answer or answered_at_once()

    def recover(self) -> bool:
        return True

    def restart(self) -> None:
        self.restarts += 1
        self.generation += 2  # a stop and a start

    def mark_dead(self, dead, generation: int) -> None:
        pass

    def begin(self, ar: FakeCellResult, t: float) -> None:
        """Every rank begins the cell at epoch time t: its engine echoes the code (into
        the request's metadata) and the rank records a cell-start event."""
        for r, msg_id in enumerate(ar.msg_ids):
            ar.metadata[r]["execute_input"] = "cell"
            self.store.add({"k": "event", "r": r, "t": t, "what": "cell-start", "cell": 3,
                            "msg": msg_id})


class Sink:
    def __init__(self):
        self.out: list[tuple[str, str]] = []

    def __call__(self, stream: str, text: str) -> None:
        self.out.append((stream, text))

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.out)


def running(cluster: FakeCluster, ar: FakeCellResult, sink: Sink, ahead=(),
            **options) -> RunningCell:
    options.setdefault("dashboard", False)
    return RunningCell(cluster, ar, [0, 1], RunOptions(**options), sink, ahead)


@pytest.fixture
def shown(monkeypatch) -> list[dict]:
    """The display bundles a cell re-displays in the notebook."""
    bundles: list[dict] = []
    monkeypatch.setattr(cell_module, "display_bundle",
                        lambda data, metadata=None: bundles.append(data))
    return bundles


def test_pump_relays_only_what_is_new_and_text_before_a_display(shown):
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink)
    for md in ar.metadata:
        md["stdout"] = "step 1\n"
    cell.pump()
    assert sink.text == "[ranks 0-1] step 1\n"
    for md in ar.metadata:
        md["stdout"] += "\x1b[31mstep 2\x1b[0m\n"
    ar.metadata[1]["outputs"].append({"data": {"text/plain": "<Figure>"}})
    cell.pump()
    # the display goes out after the text printed before it, named by its rank
    assert sink.text == "[ranks 0-1] step 1\n[ranks 0-1] step 2\n"
    assert shown == [{"text/plain": "[rank 1] <Figure>"}]
    cell.pump(final=True)
    assert sink.text.count("step 2") == 1 and len(shown) == 1


def test_finish_sorts_results_failures_and_unfinished_ranks(shown):
    cluster, ar, sink = FakeCluster(3), FakeCellResult([0, 1, 2]), Sink()
    cell = RunningCell(cluster, ar, [0, 1, 2], RunOptions(dashboard=False), sink)
    ar.singles[0].end(SimpleNamespace(
        metadata={"execute_result": {"data": {"text/plain": "42"}}}))
    ar.singles[1].end(RankError("\x1b[31m" + BOOM + "\x1b[0m\n"))
    outcome = cell.finish()  # rank 2 never ended
    assert outcome.results == {0: {"text/plain": "42"}}
    assert outcome.errors == {1: BOOM}
    assert outcome.unfinished == [2]
    assert not outcome.ok


def test_a_rank_that_dropped_the_cell_did_not_run_it(shown):
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink)
    ar.singles[0].end(SimpleNamespace(metadata={}))
    ar.singles[1].end(TaskAborted())
    outcome = cell.finish()
    assert outcome.not_run == [1] and not outcome.errors and not outcome.unfinished
    assert report_text(outcome, None) == (
        "[rank 1] did not run the cell: the cell before it there failed, and the ranks "
        "drop the cells queued behind a failed one; run it again")


def test_timeout_counts_from_when_the_ranks_began_and_interrupts_them(shown):
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink, timeout=5.0)
    cluster.on_signal = lambda r: ar.singles[r].end(RankError(STOPPED, "KeyboardInterrupt"))
    ticks = []
    ar.on_wait = lambda: ticks.append(time.monotonic())
    cluster.begin(ar, time.time() - 4.9)  # they began 4.9 s ago: 0.1 s left
    cell.watch()
    assert 1 <= len(ticks) <= 10 and ticks[-1] - ticks[0] < 1.0
    outcome = cell.finish()
    assert outcome.timed_out and cluster.signalled == [0, 1] and cluster.restarts == 0
    assert report_text(outcome, 5.0) == (
        "mpilab: the cell did not finish within 5 s; its ranks were interrupted\n"
        "[rank 0] interrupted\n[rank 1] interrupted")


def test_timeout_waits_while_the_cell_is_queued_behind_another(shown):
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink, timeout=0.01)
    waits = []

    def tick():
        waits.append(1)
        if len(waits) == 5:  # the ranks never begin it: the test ends it
            for single in ar.singles:
                single.end(SimpleNamespace(metadata={}))

    ar.on_wait = tick
    cell.watch()
    assert not cell.outcome.timed_out and not cluster.signalled


def ctrl_c():
    """The stop button, pressed as the notebook waits on the cell's ranks."""
    raise KeyboardInterrupt


@pytest.mark.parametrize("ahead,said", [
    ([Ahead("In[4]", (0, 1))],
     "ranks 0-1 are still running the --noblock cell In[4], not interrupted; this cell had "
     "not begun there and was taken off their queue"),
    ([], "ranks 0-1 had not begun this cell: it was taken off their queue"),  # just sent
])
def test_ctrl_c_on_a_cell_no_rank_has_begun_takes_it_off_the_queues_and_interrupts_nobody(
        shown, ahead, said):
    """Behind a --noblock cell, or pressed as it was sent: the note names what runs there
    only when something does."""
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink, ahead=ahead)
    ar.on_wait = ctrl_c
    cell.watch()
    for single in ar.singles:  # the engines answer the abort
        single.end(TaskAborted())
    outcome = cell.finish()
    assert outcome.interrupted and not cluster.signalled
    assert cluster.aborted == ["msg-0", "msg-1"] and outcome.dropped == [0, 1]
    assert not outcome.not_run  # taken off the queue by mpilab, not dropped by the ranks
    assert report_text(outcome, None) == f"mpilab: {said}"


def test_a_rank_that_begins_the_cell_before_it_answers_the_abort_is_interrupted(
        shown, monkeypatch):
    """Ctrl-C as rank 1 has not begun the cell yet: it is taken off rank 1's queue, but
    its nanny relays the abort, so rank 1 may still begin the cell late, after
    ABORT_SETTLE_S. Until rank 1 has answered the abort the cell watches for that, and
    interrupts it: left running, it would wait alone in the cell's collectives."""
    monkeypatch.setattr(cell_module, "ABORT_SETTLE_S", 0.05)
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cluster.abort_answer = Future()
    cluster.on_signal = lambda r: ar.singles[r].end(RankError(STOPPED, "KeyboardInterrupt"))
    cell = running(cluster, ar, sink)
    ar.metadata[0]["execute_input"] = "cell"  # rank 0 began the cell, rank 1 not yet

    def rank_1_begins_late():
        time.sleep(0.4)
        ar.metadata[1]["execute_input"] = "cell"
        time.sleep(0.1)
        cluster.abort_answer.set_result([])  # too late to drop the cell there

    ar.on_wait = ctrl_c
    late = threading.Thread(target=rank_1_begins_late)
    late.start()
    cell.watch()
    late.join()
    outcome = cell.finish()
    assert cluster.aborted == ["msg-1"] and cluster.signalled == [0, 1]
    assert outcome.interrupted and outcome.dropped == [] and cluster.restarts == 0


def test_a_cell_the_ranks_have_not_begun_says_what_it_waits_behind(shown, monkeypatch):
    """In the block under the output, once it has waited WAITING_NOTE_AFTER_S; the block
    is emptied when the ranks begin it."""
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink, ahead=[Ahead("In[4]", (0, 1))])
    blocks: list[str] = []
    cell._in_progress_view.show = lambda text, written, now: blocks.append(text)
    cell.pump()
    assert blocks == [""]  # a cell may begin any moment: nothing said at once
    monkeypatch.setattr(cell_module, "WAITING_NOTE_AFTER_S", 0.0)
    cell.pump()
    assert blocks[-1] == ("ranks 0-1 are still running the --noblock cell In[4]: this cell "
                          "waits its turn there (the stop button takes it off their queue)")
    cluster.begin(ar, time.time())
    cell.pump()
    assert blocks[-1] == ""


def test_what_a_cell_or_request_waits_behind_is_named():
    """Only the --noblock cells on the waiting ranks are named; one run outside IPython
    has no name, and without a known one it is an earlier cell."""
    ahead = [Ahead("In[3]", (0, 1)), Ahead("In[5]", (2,)), Ahead(None, (3,))]
    assert waiting_text([1], ahead) == "rank 1 is still running the --noblock cell In[3]"
    assert waiting_text([0, 1, 2], ahead) == \
        "ranks 0-2 are still running the --noblock cells In[3], In[5]"
    assert waiting_text([3], ahead) == "rank 3 is still running an earlier --noblock cell"
    assert waiting_text([2, 3], ahead) == \
        "ranks 2-3 are still running earlier --noblock cells"
    assert waiting_text([4], ahead) == "rank 4 is still running an earlier cell"


def test_a_rank_deaf_to_the_interrupt_restarts_the_cluster_and_is_unfinished(
        shown, monkeypatch):
    monkeypatch.setattr(cell_module, "INTERRUPT_GRACE_S", 0.2)
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink)
    cluster.begin(ar, time.time())
    # rank 1 answers, rank 0 sits in a call that cannot be interrupted
    cluster.on_signal = lambda r: r == 1 and ar.singles[1].end(
        RankError(STOPPED, "KeyboardInterrupt"))
    ar.on_wait = ctrl_c
    cell.watch()
    outcome = cell.finish()
    assert outcome.interrupted and outcome.restarted and cluster.restarts == 1
    assert outcome.unfinished == [0] and list(outcome.errors) == [1]
    assert report_text(outcome, None).splitlines() == [
        "[rank 1] interrupted",
        "mpilab: rank 0 had sent no heartbeat: it did not answer the interrupt (a blocking "
        "MPI or torch.distributed call, which mpilab cannot interrupt)",
        "mpilab: restarted the ranks: their state was lost; no checkpoint was saved",
    ]


@pytest.mark.parametrize("line, blocking", [("cell line 4: dist.all_reduce(t)", True),
                                            ("cell line 4: loss.backward()", False)])
def test_a_peer_in_a_blocking_direct_collective_is_restarted_without_the_whole_grace(
        shown, monkeypatch, line, blocking):
    """Rank 1 raised while rank 0 sat in dist.all_reduce: no interrupt reaches that
    call, so the restart comes after BLOCKING_GRACE_S, not INTERRUPT_GRACE_S. A
    backward() may be a DataParallel's, which the interrupt does reach: it gets the
    whole grace."""
    monkeypatch.setattr(cell_module, "INTERRUPT_GRACE_S", 1.5)
    monkeypatch.setattr(cell_module, "BLOCKING_GRACE_S", 0.1)
    cluster, ar, sink = FakeCluster(), FakeCellResult([0, 1]), Sink()
    cell = running(cluster, ar, sink)
    now = time.time()
    cluster.begin(ar, now)
    ar.singles[1].end(RankError(BOOM))
    # rank 0's heartbeat thread beats on while its main thread sits in the call: the one
    # that arrives after the failure tells the watchdog where rank 0 is
    beat = threading.Timer(0.2, cluster.store.add, [{
        "k": "hb", "r": 0, "t": now, "pid": 1, "host": "h", "phase": "running", "op": "",
        "seq": 0, "op_age": 0.0, "rss": 0, "step": 0, "cell": 3, "where": line}])
    beat.start()
    started = time.monotonic()
    cell.watch()
    beat.join()
    took = time.monotonic() - started
    outcome = cell.finish()
    assert outcome.restarted and cluster.restarts == 1 and cluster.signalled == [0]
    assert (took < 1.0) if blocking else (took >= 1.5), took
    assert f"mpilab: rank 0 was at {line} when rank 1 failed" in report_text(outcome, None)


def test_report_groups_identical_failures_and_leaves_released_ranks_to_the_notes():
    outcome = CellOutcome(
        ranks=[0, 1, 2, 3],
        errors={0: BOOM, 1: BOOM.replace("In[3]", "In[5]"), 2: STOPPED, 3: BOOM},
        released=[3], notes=["rank 3 was waiting in allreduce #4 for 0.2 s when rank 0, "
                             "1 failed"])
    assert report_text(outcome, None).splitlines() == [
        "[ranks 0-1] failed:", *BOOM.splitlines(), "[rank 2] interrupted",
        "mpilab: rank 3 was waiting in allreduce #4 for 0.2 s when rank 0, 1 failed"]


def test_outcome_is_ok_with_results_only():
    assert CellOutcome(ranks=[0], results={0: {"text/plain": "1"}}).ok
    assert not CellOutcome(ranks=[0], unfinished=[0]).ok
    assert not CellOutcome(ranks=[0], notes=["x"]).ok
    assert not CellOutcome(ranks=[0], not_run=[0]).ok

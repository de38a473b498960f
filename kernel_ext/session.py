"""The notebook kernel's mpilab state: one cluster, its runner, auto mode.

The magics call this; plain Python can too (``Session.instance().start(ClusterConfig())``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .cell import ABORT_SETTLE_S, WAITING_NOTE_AFTER_S, RunOptions, waiting_text
from .cluster import (
    ClusterConfig,
    ClusterError,
    RankCluster,
    StartReport,
    answered,
    engine_alive,
    interrupts_held,
)
from .live import TextInPlace
from .placement import slurm_job_ended
from .runner import CellRunner, RanksError
from .selection import parse_ranks
from .watchdog import DEFAULT_HANG_TIMEOUT_S
from .wire import BENCH_STOP_GRACE_S, parse_backends, parse_sizes, rank_label, size_text

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

# A stopped bench's ranks answer within BENCH_STOP_GRACE_S and this (the signal's way to
# them, the traceback made and the reply's way back, on busy cores); a rank that has not
# by then is in a call no interrupt reaches
STOP_REPLY_MARGIN_S = 1.0

_PASSTHROUGH = ("%mpilab", "%load_ext", "%unload_ext", "%reload_ext", "%%ranks")
WARM_WIDGETS_WAIT_S = 10.0  # at most this long after the ranks are ready


class Session:
    _instance: Session | None = None

    def __init__(self):
        self.cluster = RankCluster()
        self.runner = CellRunner(self.cluster)
        self._auto_transformer = None
        self._started_once = False
        self.hang_timeout = DEFAULT_HANG_TIMEOUT_S
        self._status = None  # the status table that ticks (the latest shown)

    @classmethod
    def instance(cls) -> Session:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, config: ClusterConfig) -> StartReport:
        if self.cluster.running:
            raise ClusterError(
                "ranks are already running: `%mpilab stop` or `%mpilab restart` first"
            )
        config.validate()  # settings refused are not kept: a restart uses the last good ones
        self.cluster.config = config
        warm = _warm_widgets(config.n)  # while the ranks start (they take seconds)
        with self._waiting_shown():
            report = self.cluster.start()
        self._started_once = True
        warm.join(WARM_WIDGETS_WAIT_S)
        if self.cluster.world_size != config.n:  # a Slurm job may size it otherwise
            _warm_widgets(self.cluster.world_size).join(WARM_WIDGETS_WAIT_S)
        return report

    def stop(self) -> str:
        if not self.cluster.running:
            return "mpilab: no ranks were running"
        n = self.cluster.world_size
        self.runner.wait_background(timeout=0)
        self.cluster.stop()
        return f"mpilab: stopped {n} ranks"

    def restart(self) -> StartReport:
        if not self._started_once:
            raise ClusterError("nothing to restart: start ranks with `%mpilab start -n N`")
        with self._waiting_shown():
            return self.cluster.restart()

    @contextlib.contextmanager
    def _waiting_shown(self) -> Iterator[None]:
        """How far a slow start got, or why it waits (its Slurm job in the queue), in
        place under the cell while it goes on; emptied when it ends."""
        line = TextInPlace()
        self.cluster.waiting = lambda text: line.show(text, 0, time.monotonic())
        try:
            yield
        finally:
            self.cluster.waiting = None
            line.show("", 0, time.monotonic())

    def shutdown(self) -> None:
        """Kernel exit or extension unload: never leave ranks behind."""
        if self.cluster.running:
            self.cluster.stop(fast=True)

    # -- cells and data ------------------------------------------------------------------
    def run_cell(self, code: str, options: RunOptions):
        return self.runner.run(code, options)

    def post_mortem(self, error: BaseException | None) -> bool:
        """`%debug` after a cell failed on the ranks: the debugger on the first rank whose
        code raised, there (its prompts are asked in the notebook). False when `error`,
        the notebook's last, is not such a failure: `%debug` is then IPython's own."""
        if not isinstance(error, RanksError) or not error.failed:
            return False
        if error.generation != self.cluster.generation or not self.cluster.running:
            raise ClusterError("the ranks that failed have been stopped or restarted since: "
                               "their error is gone; run the cell again, then `%debug`")
        rank = error.failed[0]
        others = f" (it failed on {rank_label(error.failed)}: `%%ranks N` with `%debug` " \
                 "in the cell debugs rank N)" if len(error.failed) > 1 else ""
        print(f"mpilab: the debugger on rank {rank}, where the cell failed{others}")
        self.run_cell("%debug", RunOptions(spec=str(rank), dashboard=False))
        return True

    def push(self, values: dict) -> None:
        self.cluster.check_usable()
        ranks = list(range(self.cluster.world_size))
        engines = self.cluster.engines(ranks)
        try:
            view = self.cluster.client[engines]
            self._answer(lambda: view.push(values, block=False), ranks, "push",
                         got="got the values")
        except ClusterError:
            raise
        except Exception as e:  # noqa: BLE001 - what could not be sent, as one line
            raise ClusterError(_push_failure(values, dict(zip(engines, ranks)), e)) from None

    def pull(self, name: str, rank: int | None = None):
        """One rank's value (`--rank R`), else a list ordered by rank."""
        self.cluster.check_usable()
        client = self.cluster.client
        ranks = list(range(self.cluster.world_size)) if rank is None else \
            parse_ranks(str(rank), self.cluster.world_size)
        engines = self.cluster.engines(ranks)
        try:
            values = self._answer(lambda: client[engines].pull(name, block=False), ranks,
                                  "pull")
        except ClusterError:
            raise
        except Exception as e:  # noqa: BLE001 - the ranks' errors, as one line
            raise ClusterError(_pull_failure(name, dict(zip(engines, ranks)), e)) from None
        return values[0] if rank is not None else values

    def set_auto(self, shell, on: bool) -> None:
        transformers = shell.input_transformers_cleanup
        if self._auto_transformer in transformers:
            transformers.remove(self._auto_transformer)
        self._auto_transformer = None
        if on:
            self._auto_transformer = _run_on_ranks
            transformers.append(_run_on_ranks)

    # -- metrics -------------------------------------------------------------------------
    def _store(self):
        if self.cluster.store is None:
            raise ClusterError("no metrics yet: start ranks with `%mpilab start -n N`")
        return self.cluster.store

    def save_metrics(self, path: str) -> Path:
        return _written(self._store().save, path)

    def clear_metrics(self) -> None:
        self._store().clear()

    def save_trace(self, path: str) -> Path:
        if not path.endswith(".json"):
            raise ClusterError(f"{path}: a trace is saved as .json (Chrome trace format)")
        return _written(self._store().save_trace, path)

    def bench(self, op: str, sizes: str, backends: str,
              progress: Callable[[int, int, int], None] | None = None
              ) -> tuple[list[dict], float]:
        """Measure a collective on the running ranks: (rows, memcpy ceiling GB/s).

        One message size at a time (the ranks measure every backend at a size before the
        next one anyway), so `progress(done, total, size)` can tell after each; then the
        node's single-core memory-copy bandwidth on rank 0, for the plot's ceiling.
        """
        from .rank.bench import check_memory, memcpy_bandwidth, run_bench

        self.cluster.check_usable()
        sizes_list, backend_list = bench_arguments(sizes, backends)
        rows: list[dict] = []
        notes: list[dict] = []  # a backend that cannot run says so once, not at each size
        try:
            self._on_ranks(check_memory, op, sizes_list)  # before the first size is measured
            for done, size in enumerate(sizes_list):
                measured = self._on_ranks(run_bench, op, [size], backend_list)[0]
                rows += [row for row in measured if row.get("time_s") is not None]
                if done == 0:
                    notes = [row for row in measured if row.get("time_s") is None]
                if progress is not None:
                    progress(done + 1, len(sizes_list), size)
            ceiling = self._on_ranks(memcpy_bandwidth, max(64 << 20, max(sizes_list)),
                                     ranks=[0])[0]
        except KeyboardInterrupt:  # between sizes: no rank runs a part of the bench then
            raise ClusterError("bench interrupted") from None
        return notes + rows, ceiling

    def _on_ranks(self, function, *args, ranks: list[int] | None = None) -> list:
        """`function(*args)` on the ranks (all, or `ranks`), their results in rank order;
        the stop button interrupts them, their errors become one line."""
        from .rank.waiting import as_request

        ranks = list(range(self.cluster.world_size)) if ranks is None else ranks
        view = self.cluster.client[self.cluster.engines(ranks)]
        try:
            return self._answer(lambda: view.apply_async(as_request, function, *args),
                                ranks, "bench", interrupt=True)
        except ClusterError:
            raise
        except Exception as e:  # noqa: BLE001 - the ranks' ValueError, as one line
            from .cluster import _remote_message

            said = _remote_message(e)  # a ValueError is the bench's own message to the user
            raise ClusterError(f"bench: {said.removeprefix('ValueError: ')}") from None

    def _answer(self, send: Callable[[], AsyncResult], ranks: list[int], what: str,
                interrupt: bool = False, got: str | None = None):
        """The ranks' answers to a request `send()` sends them (it returns ipyparallel's
        AsyncResult on `ranks`, one engine each; Ctrl-C waits until every rank has it).
        A request waits on a rank behind a --noblock cell running there: after
        WAITING_NOTE_AFTER_S it says which. Ctrl-C takes it off the queues of the ranks
        that have not begun it and (`interrupt`) interrupts it where it runs, a running
        --noblock cell never; then one line, which names the ranks that finished it
        (`got`: what they have, when that matters)."""
        ar = None
        try:
            with interrupts_held() as held:
                ar = send()
            if held.asked:
                raise KeyboardInterrupt
            if not ar.wait(WAITING_NOTE_AFTER_S):
                ahead = self.runner.running_noblock()
                busy = {r for a in ahead for r in a.ranks}
                waiting = [r for r, single in zip(ranks, ar.split())
                           if r in busy and not single.ready()]
                if waiting:
                    self.runner.write("stderr", f"mpilab: {waiting_text(waiting, ahead)}: "
                                      f"{what} waits its turn there (interrupt the kernel "
                                      "to stop waiting)\n")
            return ar.get()
        except KeyboardInterrupt:
            done, restarted = [], ""
            if ar is not None:
                done, restarted = self._withdraw(ar, ranks, interrupt)
            told = ""
            if got is not None:
                told = (f": {rank_label(done)} {got}, the others not" if done else
                        f": no rank {got}")
            raise ClusterError(f"{what} interrupted{told}{restarted}") from None

    def _withdraw(self, ar, ranks: list[int], interrupt: bool) -> tuple[list[int], str]:
        """Ctrl-C on a request: off the queues, interrupted where it runs (`interrupt`: the
        bench, whose ranks stop together within BENCH_STOP_GRACE_S), the ranks'
        collectives back in step; the ranks that finished it, and what was done to the
        ranks beyond that (a restart: `_back_in_step`)."""
        client = self.cluster.client
        busy = {r for a in self.runner.running_noblock() for r in a.ranks}
        running = [r for r in ranks if r not in busy]
        interrupting = interrupt and bool(running)
        with interrupts_held():  # a second Ctrl-C: this one is served to the end, recovery too
            try:
                aborted = client.abort(ar.msg_ids, targets=self.cluster.engines(ranks),
                                       block=False)
                if interrupting:
                    # A rank's nanny signals it at once, where the abort goes on to the
                    # rank's own control thread: a rank that began the request between
                    # the two would run it uninterrupted (an idle engine ignores SIGINT),
                    # alone in its collectives. So the signal goes once every rank has the
                    # abort: from then on a rank either drops the request or is running it.
                    answered(aborted)
                    answered(client.send_signal(
                        "SIGINT", targets=self.cluster.engines(running), block=False))
            except Exception:  # noqa: BLE001 - a dead engine is told by the next command
                pass
            ar.wait(BENCH_STOP_GRACE_S + STOP_REPLY_MARGIN_S if interrupting else ABORT_SETTLE_S)
            singles = dict(zip(ranks, ar.split()))
            done = [r for r, single in singles.items()
                    if single.ready() and single.successful()]
            if not interrupting or busy or len(done) == len(ranks):
                return done, ""
            return done, self._back_in_step([r for r, single in singles.items()
                                             if not single.ready()])

    def _back_in_step(self, stuck: list[int]) -> str:
        """After ranks were interrupted in a request: mpilab's communicators made again on
        every rank together, as after an interrupted cell. A rank stopped inside a
        collective leaves its peers' part of it pending, and one that dropped the request
        never made its part: the next collective would pair with that one. A rank that
        cannot take part (`stuck`: still running the request past its grace, in a call
        no interrupt reaches), or a recovery that fails, means a restart."""
        if not stuck and self.cluster.recover():
            return ""
        self.cluster.restart()
        why = (f"{rank_label(stuck)} did not stop (in a call no interrupt reaches), so the "
               "ranks were restarted" if stuck else
               "the ranks did not come back in step and were restarted")
        return f"; {why}: their state was lost"

    def show_bench(self, op: str, sizes: str, backends: str) -> None:
        """`%mpilab bench`: a progress line while it measures (~15 s for the full range
        on two ranks of a 2-core node), then the table and the bandwidth plot with the
        ceiling. A backend that cannot run is named once, in the table (not in the plot
        too)."""
        import uuid

        from IPython.display import display, update_display
        from mpilab.widgets import bench_figure, bench_table, figure_bundle

        self.cluster.check_usable()  # before the progress line: no ranks, one line only
        started, shown = time.monotonic(), uuid.uuid4().hex
        total = len(bench_arguments(sizes, backends)[0])

        def progress_bundle(done: int, size: int | None) -> dict:
            at = f", {size_text(size, 'B')} done" if size else ""
            text = (f"mpilab bench {op}: {done}/{total} message sizes{at} "
                    f"[{time.monotonic() - started:.0f} s]")
            bar = f"<progress value='{done}' max='{total}' style='width:30%'></progress> "
            return {"text/plain": text,
                    "text/html": f"<div class='mpilab-progress'>{bar}{text}</div>"}

        display(progress_bundle(0, None), raw=True, display_id=shown)
        try:
            rows, ceiling = self.bench(op, sizes, backends, progress=lambda done, _, size:
                                       update_display(progress_bundle(done, size), raw=True,
                                                      display_id=shown))
        except BaseException:
            update_display({}, raw=True, display_id=shown)  # the error line says it all
            raise
        print(bench_table(rows, ceiling))
        display(figure_bundle(bench_figure(rows, ceiling, notes=False)), raw=True)

    def show_dashboard(self) -> None:
        """The dashboard of the latest run that has metrics (most cells, a print or a
        push, have none), naming its cell. It follows the run's records until they stop
        for a minute (a later run has its own under its cell)."""
        import threading

        from IPython.display import display

        store = self._store()
        dash = latest_dashboard(list(self.runner.recent_runs), store, self.cluster.world_size)
        if dash is None:
            raise ClusterError("no training metrics yet: run a cell that uses "
                               "mpilab.DataParallel or mpilab.log(...)")
        display(dash.mimebundle(), raw=True)  # from now on it follows the store

        def stop_when_idle():
            drawn, idle_since = dash.redraws, time.monotonic()
            while time.monotonic() - idle_since < 60 and self.cluster.running:
                time.sleep(1)
                if dash.redraws != drawn:
                    drawn, idle_since = dash.redraws, time.monotonic()
            dash.unfollow()

        threading.Thread(target=stop_when_idle, daemon=True, name="mpilab-dashboard").start()

    def show_status(self):
        """A live table of the ranks (a text table where there is no widget frontend).
        It ticks while it is in sight, and stops when the ranks it shows are stopped;
        a table shown again replaces the previous one's ticking."""
        from IPython.display import display
        from mpilab.widgets.status import StatusTable

        if not self.cluster.ranks:
            raise ClusterError("no ranks are running: start them with `%mpilab start -n N`")
        if self._status is not None:
            self._status.stop()
        table = self._status = StatusTable(live_rank_info(self.cluster), self.cluster.store)
        table.start()
        display(table)


def live_rank_info(cluster) -> Callable[[], list[dict]]:
    """A function that returns the cluster's ranks as they are now, for the status table:
    a rank the watchdog declared dead, or whose process on this host has ended, is
    `dead` with how (at once, not after its heartbeats' silence); once the cluster is
    stopped or restarted, every rank is `dead` and `stopped`."""
    import socket

    ranks = cluster.ranks  # a restart makes a new list
    shown = [dict(info) for info in ranks]
    here = socket.gethostname()
    procs = cluster.local_processes()  # a rank of this host without one had ended
    in_job = cluster.slurm is not None
    job_ended = ""  # why Slurm ended the ranks' job, once its output says

    def rank_info() -> list[dict]:
        nonlocal job_ended
        if cluster.ranks is not ranks:
            return [dict(info, dead="stopped (`%mpilab start` or `restart` brings ranks back)",
                         stopped=True) for info in shown]
        if in_job and not job_ended:
            job_ended = slurm_job_ended(cluster.engine_output(lines=200)) or ""
        now = []
        for info in shown:
            dead = cluster.dead.get(info["rank"], "") or job_ended
            if not dead and info.get("host") == here \
                    and not engine_alive(procs.get(info["rank"])):
                dead = "its process has ended"
            now.append(dict(info, dead=dead))
        return now

    return rank_info


def latest_dashboard(runs: list, store, world_size: int):
    """A Dashboard of the newest of `runs` (RecentRun, oldest first) that sent step or
    log records, titled with its cell; or of every record when no run is known (ranks
    driven from plain Python); None when there are no metrics at all."""
    from mpilab.widgets import Dashboard

    for run in reversed(runs):
        dash = Dashboard(store, world_size, cell=run.cell, source=run.label)
        if dash.has_data():
            return dash
    if not runs:
        dash = Dashboard(store, world_size)
        if dash.has_data():
            return dash
    return None


def _warm_widgets(world_size: int):
    """Build the first dashboard's figure for `world_size` ranks on a thread (returned):
    the first training cell's dashboard then appears as fast as the second's."""
    import threading

    def warm() -> None:
        from mpilab.widgets import warm_up

        try:
            warm_up(world_size)
        except Exception:  # noqa: BLE001 - only a head start: the dashboard says what fails
            pass

    thread = threading.Thread(target=warm, daemon=True, name="mpilab-warm-dashboard")
    thread.start()
    return thread


def bench_arguments(sizes: str, backends: str) -> tuple[list[int], list[str]]:
    """--sizes and --backends as lists, checked before anything is shown or measured (the
    ranks check them too); a mistake is one line."""
    try:
        return parse_sizes(sizes), parse_backends(backends)
    except ValueError as e:
        raise ClusterError(str(e)) from None


def _push_failure(values: dict, rank_of_engine: dict[int, int], error: Exception) -> str:
    """Which value could not be sent, and why: it cannot be pickled here, or the ranks
    cannot unpickle it (an object of a class defined in the notebook: pickle names the
    class, which the ranks do not have)."""
    from ipyparallel.serialize import serialize_object

    for name, value in values.items():
        try:
            serialize_object(value)
        except Exception as e:  # noqa: BLE001 - the first value that cannot be sent
            return (f"push: {name!r} cannot be sent to the ranks ({type(e).__name__}: {e}): "
                    "make it on the ranks in a %%ranks cell, or push what it is made of")
    failures = _ranks_errors(rank_of_engine, error)
    names = ", ".join(values)
    if failures:
        failed = sorted(failures)
        ename, evalue = failures[failed[0]]
        hint = ("; its class is defined in the notebook only: run that class's cell with "
                "%%ranks too, or push plain data") if "__main__" in evalue else ""
        return f"push: {names} could not be unpickled on {rank_label(failed)}: " \
               f"{ename}: {evalue}{hint}"
    said = str(error).strip().splitlines()
    return f"push: {names}: {said[0] if said else type(error).__name__}"


def _ranks_errors(rank_of_engine: dict[int, int], error: Exception) -> dict[int, tuple]:
    """rank -> (error name, its message) of the ranks' own errors in an ipyparallel
    CompositeError (none for what failed outside the ranks, an engine gone)."""
    return {rank_of_engine[engine]: (ename, evalue)
            for ename, evalue, _, info in getattr(error, "elist", [])
            if (engine := (info or {}).get("engine_id")) in rank_of_engine}


def _pull_failure(name: str, rank_of_engine: dict[int, int], error: Exception) -> str:
    """What went wrong on which ranks: a name defined by a cell run on some ranks only
    is missing on the others, which the user fixes with --rank."""
    failures = _ranks_errors(rank_of_engine, error)
    if not failures:  # not the ranks' own errors (an engine gone): what ipyparallel said
        said = str(error).strip().splitlines()
        return f"pull: {name!r}: {said[0] if said else type(error).__name__}"
    failed = sorted(failures)
    if any(ename != "NameError" for ename, _ in failures.values()):
        ename, evalue = failures[failed[0]]
        return f"pull: {name!r} could not be fetched from {rank_label(failed)}: {ename}: {evalue}"
    have = sorted(set(rank_of_engine.values()) - set(failed))
    hint = f"; it is on {rank_label(have)}: add --rank {have[0]}" if have else ""
    return f"pull: {name!r} is not defined on {rank_label(failed)}{hint}"


def _run_on_ranks(lines: list[str]) -> list[str]:
    """Auto mode: prefix every cell with %%ranks, except mpilab's own control lines."""
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    if not first or first.startswith(_PASSTHROUGH):
        return lines
    return ["%%ranks\n", *lines]


def _written(save, path: str) -> Path:
    """save(path), with a file that cannot be written told in one line."""
    try:
        return save(path)
    except OSError as e:
        raise ClusterError(f"{path}: cannot write it ({e.strerror or e})") from None

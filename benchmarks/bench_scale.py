"""The notebook side under a thousand ranks: simulated ranks through the real channel.

A few sender processes (--senders, 4 by default) each speak for many ranks: one PUSH
socket per rank, the ranks' own encoder (`mpilab.wire.encode`, `Agent.heartbeat`),
sent at the agent's moments (`next_send_time`, every SEND_INTERVAL_S; a heartbeat every
HEARTBEAT_INTERVAL_S). Each simulated rank trains at --step-rate steps a second: per step a
step record, a logged loss and two bucket allreduce spans, as DataParallel and
`mpilab.log` make them; a cell-start event first, rank 0's progress events, and the
heartbeats of a rank in that cell.

A real IPython kernel is the notebook: the real RecordReceiver, MetricsStore and the
runner's LiveViews (the training dashboard, displayed, following the store on the
receiver's thread), and, on the kernel's main thread every runner tick (TICK_S), the real
OutputRelay and Watchdog.check, as mpilab.cell.RunningCell calls them. What is not real there:
the output lines (every rank prints one line a second, the same text, made in the kernel
and fed to the relay: ipyparallel's iopub, which carries them from real ranks, is not in
this benchmark), and the cluster the watchdog reads (a stand-in with the ranks' hosts and
pids, on hosts other than this one, and no launcher output: the cost measured is the
watchdog's own, over 1,024 heartbeats and cell windows).

Per size, over the steady part of the run (after --warmup s):
- kernel CPU: the kernel process's CPU time (every thread: receiver, ZMQ, main) / wall,
  and its parts: the receiver thread filing records (its CPU less the dashboard's
  redraws, which run on it), the redraws, the main thread (relay, watchdog, ticks), and
  the other threads (ZMQ's I/O); CPU time, so a busy machine inflates them less than wall
  times;
- latency: a logged loss's time on the rank to its filing in the store, and to the
  dashboard redraw that took it (median, p95; both include the rank's wait for its next
  send moment, up to 0.25 s, and how late the simulated ranks' messages left, which the
  senders report: on a busy machine they are late too);
- watchdog: wall time of one Watchdog.check on the kernel's main thread (median, p95,
  max; it includes waits for the GIL, which the receiver thread holds while it files
  records and redraws) and its thread's CPU time (median, p95);
- store: the bytes of the store's tables (MetricsStore.table_bytes) and its cap
  (table_cap), and the kernel's RSS;
- redraw: the receiver thread's CPU time per dashboard redraw (median, p95), redraws/s;
  and the longest runner tick's LiveViews.tick (the dashboard's first display).

    .venv/bin/python benchmarks/bench_scale.py [--sizes 64,256,1024] [--duration 30]
        [--warmup 8] [--step-rate 10] [--senders 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from options import at_least, count, counts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SETUP = """
import json, statistics, sys, time
import numpy as np
from mpilab.metrics_store import MetricsStore
from mpilab.receiver import RecordReceiver
from mpilab.live import LiveViews
from mpilab.cell import TICK_S
from mpilab.relay import OutputRelay
from mpilab.watchdog import Watchdog
import mpilab.widgets.dashboard as _d

N = WORLD
store = MetricsStore(world_size=N)
receiver = RecordReceiver(store)
msg_ids = {r: f"sim-{r}" for r in range(N)}

class SimCluster:
    '''A stand-in for RankCluster: what Watchdog reads of it. Ranks on other hosts
    (the watchdog then reads heartbeat ages and the launcher's output, as for remote
    ranks); no launcher output.'''
    world_size = N
    def __init__(self, store):
        self.store = store
        self.ranks = [{"rank": r, "host": f"sim-node-{r // 8}", "pid": 10_000 + r}
                      for r in range(N)]
    def engine_output(self, lines=200):
        return ""
    def local_processes(self):
        return {}

# redraw cost and record -> dashboard latency, read as bench_overhead.py does: the log
# rows the widget has taken at each redraw, incrementally
_latency, _redraw, _redraw_at = [], [], []
_measuring = [False]
_refresh = _d.Dashboard.refresh
def _timed_refresh(self, force=False):
    started = time.thread_time()
    drawn = _refresh(self, force)
    if drawn and _measuring[0]:
        now = time.time()
        _redraw.append(time.thread_time() - started)
        _redraw_at.append(now)
        if not hasattr(self, "_probe_position"):
            self._probe_position = {}
        for _, _, rows in self.store.new_rows("log", self._probe_position,
                                              upto=self._runlog.position["log"],
                                              window=self.cell.bounds(self.store)):
            _latency.extend((now - rows[:, 0]).tolist())
    elif drawn and hasattr(self, "_runlog"):
        self._probe_position = {k: v for k, v in self._runlog.position["log"].items()}
    return drawn
_d.Dashboard.refresh = _timed_refresh
print(receiver.address)
"""

CELL = """
views = LiveViews(store, N, True, msg_ids)
cluster = SimCluster(store)
watchdog = Watchdog(cluster, list(range(N)), 30.0, views.cell)
relay = OutputRelay(list(range(N)), lambda stream, text: sys.stdout.write(text))
checks, check_cpu, verdicts, ticks = [], [], [], []
started = time.monotonic()
steady = started + WARMUP
cpu0 = wall0 = None
import psutil, threading
_me = psutil.Process()
_receiver_tid = receiver._thread.native_id
_main_tid = threading.main_thread().native_id
def thread_cpu():  # CPU s of the receiver thread, the main thread, and all threads
    got = {t.id: t.user_time + t.system_time for t in _me.threads()}
    total = sum(got.values())
    return got.get(_receiver_tid, 0.0), got.get(_main_tid, 0.0), total
line_due, line = started + 1.0, 0
while time.monotonic() < started + DURATION:
    now = time.monotonic()
    if cpu0 is None and now >= steady:
        cpu0, wall0, steady_epoch = time.process_time(), now, time.time()
        threads0 = thread_cpu()
        _measuring[0] = True
    if now >= line_due:  # every rank prints a line a second
        line += 1
        line_due += 1.0
        for r in range(N):
            relay.feed(r, "stdout", f"epoch 0 step {10 * line}: training\\n", now)
    relay.flush(now)
    t0 = time.perf_counter()
    views.tick()
    ticks.append(time.perf_counter() - t0)
    t0, c0 = time.perf_counter(), time.thread_time()
    verdict = watchdog.check(time.time(), {})
    spent, spent_cpu = time.perf_counter() - t0, time.thread_time() - c0
    if cpu0 is not None:
        checks.append(spent)
        check_cpu.append(spent_cpu)
    if verdict is not None:
        verdicts.append(verdict.lines[:2])
    time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
steady_wall = time.monotonic() - wall0
cpu = (time.process_time() - cpu0) / steady_wall
threads = [(b - a) / steady_wall for a, b in zip(threads0, thread_cpu())]
_measuring[0] = False
# record -> store: a logged loss's time on the rank to its filing (the store's last column)
filed = np.concatenate([rows for _, _, rows in store.new_rows("log", {})])
filed = filed[filed[:, -1] >= steady_epoch]
to_store = filed[:, -1] - filed[:, 0]
def pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")
span = (_redraw_at[-1] - _redraw_at[0]) if len(_redraw_at) > 1 else float("nan")
print(json.dumps({
    "cpu": cpu, "receiver_cpu": threads[0], "main_cpu": threads[1],
    "other_cpu": threads[2] - threads[0] - threads[1],
    "drawing_cpu": sum(_redraw) / steady_wall,
    "latency": [pct(_latency, 50), pct(_latency, 95), len(_latency)],
    "to_store": [pct(to_store, 50), pct(to_store, 95), len(to_store)],
    "check": [pct(checks, 50), pct(checks, 95), max(checks), len(checks)],
    "check_cpu": [pct(check_cpu, 50), pct(check_cpu, 95)],
    "redraw": [pct(_redraw, 50), pct(_redraw, 95), (len(_redraw_at) - 1) / span],
    "table_bytes": store.table_bytes(), "table_cap": store.table_cap(),
    "rss": psutil.Process().memory_info().rss, "received": store.received,
    "dropped": store.dropped, "verdicts": verdicts[:3], "first_display": max(ticks),
    "shown": views.dashboard._widget is not None, "redraws": views.dashboard.redraws,
    "ranks_seen": len(store.heartbeats)}))
"""


# -- the simulated ranks ------------------------------------------------------------------
def sender(address: str, world: int, index: int, senders: int, duration: float,
           step_rate: float) -> None:
    """Speak for ranks index, index + senders, ... until `duration` s have passed."""
    import zmq
    from mpilab.rank.agent import HEARTBEAT_INTERVAL_S, SEND_INTERVAL_S, Agent, next_send_time
    from mpilab.wire import encode

    ranks = list(range(index, world, senders))
    ctx = zmq.Context.instance()
    socks, agents = {}, {}
    for r in ranks:
        sock = ctx.socket(zmq.PUSH)  # as Agent._run sets its socket up
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(address)
        socks[r] = sock
        agent = agents[r] = Agent(r, world, None)  # its heartbeat(); it sends nothing itself
        agent.state.phase, agent.state.cell, agent.state.request = "running", 1, f"sim-{r}"
    start = time.time()
    queued = {r: [{"k": "event", "r": r, "t": start, "what": "cell-start", "cell": 1,
                   "msg": f"sim-{r}"}] for r in ranks}
    step, next_step_t = 0, start
    next_beat = 0.0
    dropped = 0
    late = []  # per send moment: how long after it this sender's last message left
    moment = None
    while time.time() < start + duration:
        now = time.time()
        while next_step_t <= now:  # the steps every rank ended since the last send
            step += 1
            t = next_step_t
            for r in ranks:
                # a numbered collective on the main thread each step (the loss's average):
                # heartbeats carry the last 16, which the watchdog compares across ranks
                agents[r].state.seq = step
                agents[r].state.recent.append((step, "allreduce", 8))
                queued[r] += [
                    {"k": "step", "r": r, "t": t, "step": step, "dur": 1 / step_rate,
                     "compute": 0.7 / step_rate, "comm": 0.3 / step_rate,
                     "nbytes": 100_000_000, "samples": 32},
                    {"k": "log", "r": r, "t": t, "step": step,
                     "values": {"loss": 1.0 / step}},
                    ("allreduce", t - 0.2 / step_rate, t - 0.1 / step_rate, 50_000_000,
                     2 * step - 1),
                    ("allreduce", t - 0.1 / step_rate, t, 50_000_000, 2 * step)]
            next_step_t += 1 / step_rate
        beat = time.monotonic() >= next_beat
        if beat:
            next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S - SEND_INTERVAL_S / 2
        for r in ranks:
            agents[r].state.step = step
            records, queued[r] = queued[r], []
            if beat:
                records.append(agents[r].heartbeat())
            if r == 0:
                records.append({"k": "event", "r": 0, "t": now, "what": "progress",
                                "n": step, "total": 0, "desc": "train",
                                "elapsed": now - start})
            for message in encode(r, records):
                try:
                    socks[r].send(message, zmq.NOBLOCK)
                except zmq.Again:
                    dropped += 1
        if moment is not None:
            late.append(time.time() - moment)
        moment = next_send_time(time.time())
        time.sleep(max(0.0, moment - time.time()))
    end = time.time()
    for r in ranks:
        agents[r].state.phase = "idle"
        for message in encode(r, [{"k": "event", "r": r, "t": end, "what": "cell-end",
                                   "cell": 1, "msg": f"sim-{r}"}, agents[r].heartbeat()]):
            socks[r].send(message)
    for sock in socks.values():
        sock.close()
    late.sort()
    print(json.dumps({"sender": index, "ranks": len(ranks), "dropped": dropped,
                      "late": [late[len(late) // 2], late[int(0.95 * len(late))]]}))


# -- the measurement ----------------------------------------------------------------------
def measure(world: int, args) -> dict:
    from kernel import Kernel

    kernel = Kernel()
    procs = []
    try:
        run = kernel.run(SETUP.replace("WORLD", str(world)), timeout=120)
        if not run.ok:
            raise SystemExit(run.text)
        address = run.stdout.strip().splitlines()[-1]
        load_before = os.getloadavg()[0]
        sender_cpu0 = 0.0
        for index in range(args.senders):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--sender", address, "--world", str(world),
                 "--index", str(index), "--senders", str(args.senders),
                 "--duration", str(args.duration + 3), "--step-rate", str(args.step_rate)],
                stdout=subprocess.PIPE, text=True))
        psprocs = [psutil.Process(p.pid) for p in procs]
        run = kernel.run(CELL.replace("WARMUP", str(args.warmup))
                         .replace("DURATION", str(args.duration)), timeout=args.duration + 300)
        sender_cpu = sum(sum(p.cpu_times()[:2]) for p in psprocs if p.is_running()) - sender_cpu0
        if not run.ok:
            raise SystemExit(run.text)
        got = json.loads(run.stdout.strip().splitlines()[-1])
        got["lines"] = sum(1 for line in run.stdout.splitlines() if line.startswith("["))
        got["load"] = [load_before, os.getloadavg()[0]]
        got["sender_cpu"] = sender_cpu / args.duration
        for p in procs:
            p.wait(timeout=60)
        got["senders"] = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in procs]
        return got
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        kernel.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=counts, default="64,256,1024")
    parser.add_argument("--duration", type=at_least(1.0, float), default=30.0)
    parser.add_argument("--warmup", type=at_least(0.0, float), default=8.0)
    parser.add_argument("--step-rate", type=at_least(0.1, float), default=10.0)
    parser.add_argument("--senders", type=count, default=4)
    parser.add_argument("--json", help="also write the results here")
    # one sender process (the benchmark starts them)
    parser.add_argument("--sender")
    parser.add_argument("--world", type=int)
    parser.add_argument("--index", type=int)
    args = parser.parse_args()
    if args.sender:
        sender(args.sender, args.world, args.index, args.senders, args.duration,
               args.step_rate)
        return
    results = {}
    print(f"{args.senders} sender processes, {args.step_rate:g} steps/s per rank "
          f"(a step: a step record, a loss, 2 allreduce spans), {args.duration:g} s runs, "
          f"measured after {args.warmup:g} s; {os.cpu_count()} cores")
    header = ("ranks | kernel CPU (cores): all = filing + drawing + main + ZMQ | "
              "record->store, ->dashboard median / p95 (s) | "
              "watchdog check median / p95 / max (ms), CPU median / p95 (ms) | "
              "store tables (MB) / cap (MB) | kernel RSS (MB) | "
              "redraw CPU median / p95 (ms), redraws/s | load avg")
    print(header)
    print("|".join(["---"] * header.count("|")) + "|---")
    for world in args.sizes:
        got = results[world] = measure(world, args)
        lat, chk, red = got["latency"], got["check"], got["redraw"]
        filing = got["receiver_cpu"] - got["drawing_cpu"]
        print(f"{world} | {got['cpu']:.2f} = {filing:.2f} + {got['drawing_cpu']:.2f} + "
              f"{got['main_cpu']:.2f} + {got['other_cpu']:.2f} | {got['to_store'][0]:.3f} / "
              f"{got['to_store'][1]:.3f}, {lat[0]:.3f} / {lat[1]:.3f} | "
              f"{1e3 * chk[0]:.2f} / {1e3 * chk[1]:.2f} / {1e3 * chk[2]:.1f}, "
              f"{1e3 * got['check_cpu'][0]:.2f} / {1e3 * got['check_cpu'][1]:.2f} | "
              f"{got['table_bytes'] / 1e6:.1f} / {got['table_cap'] / 1e6:.0f} | "
              f"{got['rss'] / 1e6:.0f} | {1e3 * red[0]:.1f} / {1e3 * red[1]:.1f}, "
              f"{red[2]:.1f} | {got['load'][0]:.1f}-{got['load'][1]:.1f}", flush=True)
        print(f"   ({got['received']:,} records filed, {got['dropped']} dropped, "
              f"{got['ranks_seen']} ranks seen, {lat[2]:,} latency samples, "
              f"{chk[3]} checks, {got['lines']} output lines, {got['redraws']} dashboard "
              f"redraws in all, longest LiveViews.tick {got['first_display']:.1f} s, senders "
              f"{got['sender_cpu']:.2f} cores, sends late median / p95 "
              f"{max(s['late'][0] for s in got['senders']):.3f} / "
              f"{max(s['late'][1] for s in got['senders']):.3f} s (the slowest sender's), "
              f"sends dropped "
              f"{sum(s['dropped'] for s in got['senders'])}, verdicts {got['verdicts']})",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

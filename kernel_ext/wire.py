"""What crosses between the notebook and the ranks, defined once for both sides.

- The record channel: the kinds of record a rank's agent sends, their fields, the
  tables the per-step kinds travel as, the limits of a message, and the one encoder
  (rank side) and decoder (notebook side) of its messages.
- A cell's execute request label, and a rank's input() question, its marker among the
  rank's outputs, and the notebook's answer.
- The environment a launcher hands the ranks.
- The lines the ranks write for the notebook side to read: a rank's supervisor's when its
  engine ends, rank 0's measurements under `mpilab bench`; and how either side names
  ranks, a collective and a mismatch of them.

Light to import: the ranks' supervisor imports it before anything else and every rank's
agent imports it; msgpack is imported only where a message is made or read.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import socket
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

# -- the record channel: kinds and fields ------------------------------------------------
# Every record is a msgpack map with its kind "k", the sending rank "r" and the time it
# was made "t" (epoch s), then its kind's fields.
HEARTBEAT = "hb"  # the rank's state, every HEARTBEAT_INTERVAL_S and on a change
EVENT = "event"  # something that happened once ("what": cell-start, cell-end, progress, …)
ROWS = "rows"  # a block of one table's rows: how the tabular kinds (TABLES) travel

NUMBER = (int, float)

# The heartbeat's fields that the notebook checks (a heartbeat without them is dropped) …
HEARTBEAT_FIELDS: dict[str, tuple[type, ...]] = {
    "pid": (int,), "host": (str,), "phase": (str,), "op": (str,), "seq": (int,),
    "op_age": NUMBER, "rss": (int,), "step": (int,)}
# … and those it reads when present (Agent.heartbeat sends all of them)
HEARTBEAT_EXTRA: dict[str, tuple[type, ...]] = {
    "op_nbytes": (int,), "op_shape": (str,), "cell": (int,), "dev_mem": (int,),
    "where": (str,), "recent": (list,)}  # recent: [[seq, op, nbytes], …], newest last


@dataclass(frozen=True)
class Table:
    """How records of one kind travel as rows: one table per rank and `labels` (the
    record's text fields), one float64 column per numeric field, time first."""

    labels: tuple[str, ...]
    columns: tuple[str, ...]
    ints: frozenset[str] = frozenset()  # whole numbers (they are ints in the records)
    optional: frozenset[str] = frozenset()  # may be missing: NaN in the table


TABLES: dict[str, Table] = {
    "step": Table((), ("t", "step", "dur", "compute", "comm", "nbytes", "samples"),
                  ints=frozenset({"step", "nbytes", "samples"})),
    "span": Table(("name", "cat"), ("t", "ts", "dur", "nbytes", "seq"),
                  ints=frozenset({"nbytes", "seq"}), optional=frozenset({"nbytes", "seq"})),
    # one row per logged scalar: `log(loss=…, acc=…)` is two rows at the same time
    "log": Table(("name",), ("t", "step", "value"), ints=frozenset({"step"})),
}

# kind -> the fields a record of it must have, with their types: records as a rank makes
# them. Those of a tabular kind are checked by the encoder and travel as ROWS blocks.
RECORD_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    HEARTBEAT: HEARTBEAT_FIELDS,
    "step": {"step": (int,), "dur": NUMBER, "compute": NUMBER, "comm": NUMBER,
             "nbytes": (int,), "samples": (int,)},
    "log": {"step": (int,), "values": (dict,)},
    "span": {"name": (str,), "cat": (str,), "ts": NUMBER, "dur": NUMBER},
    EVENT: {"what": (str,)},
    ROWS: {"of": (str,), "labels": (list,), "data": (bytes,)},
}
# the kinds a message carries: the tabular ones only inside ROWS blocks
SENT_KINDS = frozenset({HEARTBEAT, EVENT, ROWS})

# -- the record channel: messages ----------------------------------------------------------
MAX_MESSAGE_BYTES = 256 * 1024  # the notebook's limit on one message (a batch of records)
MAX_BATCH_RECORDS = 1000  # and on the records in one message
BATCH_RECORDS = 100  # records per message the encoder makes (well under the limit)
BATCH_BYTES = 128 * 1024  # and bytes of rows
MAX_TABLE_ROWS = 1000  # rows per block: a block of 8 columns is 64 KB


def fields_fit(record: dict) -> bool:
    """True when a record has its kind's fields with their types (whatever its rank):
    a bool is no number, a logged scalar is a number under a text name."""
    kind = record.get("k")
    fields = RECORD_FIELDS.get(kind) if type(kind) is str else None
    if fields is None or not isinstance(record.get("t"), NUMBER):
        return False
    for name, types in fields.items():
        value = record.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            return False
    if record["k"] == "log":
        return all(isinstance(k, str) and isinstance(v, NUMBER) and not isinstance(v, bool)
                   for k, v in record["values"].items())
    return True


def table_rows(record: dict) -> list[tuple[str, tuple, tuple]]:
    """(kind, labels, row) of each row a record of a tabular kind makes."""
    kind = record["k"]
    if kind == "log":
        t, step = record["t"], record["step"]
        return [("log", (name,), (t, step, value)) for name, value in record["values"].items()]
    table = TABLES[kind]
    return [(kind, tuple(record[label] for label in table.labels),
             tuple(record.get(column, math.nan) if column in table.optional else record[column]
                   for column in table.columns))]


def tabulate(rank: int, records: list[dict | tuple]) -> list[dict]:
    """The records with those of tabular kinds turned into blocks of rows (a ROWS record
    per table and at most MAX_TABLE_ROWS rows), then the others as they are: an event such
    as a cell's end comes after the steps before it, in whatever message. A record of a
    tabular kind without its fields (fields_fit) is dropped here.

    A tuple is a collective's span as ``Agent.span`` queues it: (name, ts, end, nbytes,
    seq), a row of the span table of category "comm"."""
    blocks: list[dict] = []
    others: list[dict] = []
    tables: dict[tuple, list[tuple]] = {}
    for record in records:
        if type(record) is tuple:
            name, ts, end, nbytes, seq = record
            tables.setdefault(("span", (name, "comm")), []).append(
                (end, ts, end - ts, nbytes, seq))
            continue
        if record["k"] not in TABLES:
            others.append(record)
            continue
        if not fields_fit(record):
            continue  # not what its kind says: dropped
        for kind, labels, row in table_rows(record):
            tables.setdefault((kind, labels), []).append(row)
    for (kind, labels), rows in tables.items():
        for start in range(0, len(rows), MAX_TABLE_ROWS):
            block = rows[start:start + MAX_TABLE_ROWS]
            try:
                data = array("d", itertools.chain.from_iterable(block)).tobytes()
            except TypeError:
                continue  # a value that is not a number: the block is dropped
            blocks.append({"k": ROWS, "r": rank, "t": block[-1][0], "of": kind,
                           "labels": list(labels), "data": data})
    return blocks + others


def batches(records: list[dict]) -> list[list[dict]]:
    """Records in messages of at most BATCH_RECORDS records and BATCH_BYTES of rows."""
    out: list[list[dict]] = []
    size = 0
    for record in records:
        nbytes = len(record.get("data", b""))
        if not out or len(out[-1]) == BATCH_RECORDS or size + nbytes > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(record)
        size += nbytes
    return out


def encode(rank: int, records: list[dict | tuple]) -> list[bytes]:
    """A rank's records as the messages it sends: blocks of rows, then the rest. The only
    encoder of the channel: the agent's thread, and whatever stands in for a rank (the
    store's `add`, the benchmarks' simulated ranks), make their messages here."""
    import msgpack

    pack = msgpack.Packer(use_bin_type=True).pack
    messages = []
    for part in batches(tabulate(rank, records)):
        try:
            messages.append(pack(part))
        except (TypeError, ValueError):
            continue  # a record msgpack cannot carry: its message is dropped
    return messages


def _refuse_ext(code, data):
    raise ValueError("msgpack extension types are not accepted")


def decode(raw: bytes) -> list:
    """The records of one message, to be checked one by one (the channel carries data,
    never code: msgpack only, no extension types). A message of one record is a batch of
    one; a message that cannot be read (too long, not msgpack, a batch of more than
    MAX_BATCH_RECORDS or of things other than maps) is one malformed record, None."""
    import msgpack

    try:
        if len(raw) > MAX_MESSAGE_BYTES:
            raise ValueError("oversized")
        payload = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except Exception:  # noqa: BLE001 - any undecodable payload is one malformed record
        return [None]
    if type(payload) is dict:
        return [payload]
    if type(payload) is list and 0 < len(payload) <= MAX_BATCH_RECORDS and all(
            type(record) is dict for record in payload):
        return payload
    return [None]


# -- a cell's execute request: its label ---------------------------------------------------
# mpilab's cells carry this label (in the request's metadata): the ranks read the
# notebook's In[n] from it, for their tracebacks, and know the cell is mpilab's (whose
# input() the notebook answers); a cell sent from plain Python carries the bare prefix
CELL_LABEL_PREFIX = "mpilab:"
CELL_LABEL = CELL_LABEL_PREFIX + "In[{}]"  # the notebook's count

# -- a cell's end: whether the notebook waits for the rank's records -------------------------
# A rank whose cell queued no records of its own (beyond its start and end markers and
# heartbeats) and succeeded puts {"source": NO_RECORDS} in the payload of the cell's
# execute reply and leaves those markers for the next batch: the cell's final drawing has
# nothing of the rank's to wait for. Any other cell sends its records at once and the
# notebook waits for its end marker. Waking the record thread and the notebook's receiver
# twice per cell was most of what a trivial `%%ranks` cell cost above `%%px`; a message
# of its own (ipyparallel's publish_data) cost as much again.
NO_RECORDS = "mpilab.no-records"


# -- input() on a rank: the question, its marker among the rank's outputs, the answer ------
# The question travels on its own socket (a rank's DEALER to the notebook's ROUTER, where
# the notebook listens for records); the marker, a display among the cell's outputs,
# says where it falls among what the rank printed (pdb's lines come before its prompt).
# {"id": question id, "route": the asking socket's name}: the notebook answers only the
# socket a marker names, which came over ipyparallel's signed channel; the name is the
# rank's and random, so another process on the network cannot take its answers
INPUT_MARKER = "application/vnd.mpilab.input+json"
MAX_INPUT_BYTES = 1 << 20  # a question's or an answer's (a prompt, a line the user typed)


def input_route(rank: int) -> str:
    """A name for rank `rank`'s socket on the notebook's input socket (its identity):
    the rank's number and a random part no other process can guess."""
    import secrets

    return f"rank-{rank}-{secrets.token_hex(16)}"


def input_question(qid: int, prompt: str, password: bool) -> bytes:
    """A rank's question: what its input() (or getpass()) was called with."""
    return json.dumps({"id": qid, "prompt": prompt, "password": password}).encode()


def input_answer(qid: int, text: str | None, refused: str = "") -> bytes:
    """The notebook's answer: the line the user typed, or why there is none (`refused`:
    the rank's input() raises EOFError, as at the end of a script's standard input)."""
    return json.dumps({"id": qid, "text": text, "refused": refused}).encode()


def read_input(raw: bytes) -> dict:
    """A question or an answer as a dict; ValueError when it is neither."""
    message = json.loads(raw)
    if not isinstance(message, dict) or not isinstance(message.get("id"), int):
        raise ValueError("not a question or an answer")
    return message


# -- ranks and collectives in words: the notebook's messages and the ranks' own lines ------
def format_ranks(ranks: Iterable[int]) -> str:
    """[0,1,2,5] → '0-2,5'."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def rank_label(ranks: Iterable[int]) -> str:
    """'rank 3' or 'ranks 0-2,5': how every message names ranks."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"



def collective_words(op: str, seq: int, nbytes: int) -> str:
    """'allreduce #12 (4,096 bytes)': a collective by its name and number (its place in
    the program's order, the same on every rank)."""
    return f"{op} #{seq} ({nbytes:,} bytes)"


def mismatch_line(seq: int, members: dict[int, tuple[str, int]]) -> str:
    """Ranks in different collectives at number `seq` (rank -> (op, bytes)), one line."""
    return "mismatched collectives: " + ", ".join(
        f"rank {rank} in {collective_words(op, seq, nbytes)}"
        for rank, (op, nbytes) in sorted(members.items()))


# -- the ranks' environment -----------------------------------------------------------------
# torch.distributed's own collective timeout, as `%mpilab start --collective-timeout` set it
COLLECTIVE_TIMEOUT_ENV = "MPILAB_COLLECTIVE_TIMEOUT"
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0

# -- `mpilab bench`: rank 0's measurements, one line that the command reads ----------------
BENCH_RESULT_PREFIX = "mpilab-bench-result "  # then {"rows": [...], "ceiling": GB/s} as JSON
BENCH_COLLECTIVES = ("allreduce", "broadcast", "allgather")
BENCH_BACKENDS = ("mpilab", "mpilab-internal", "mpi", "gloo", "nccl", "memory")
# After the stop button, how long a rank waits for the others at the bench's next meeting
# point before it stops alone; the notebook waits that long (and a little) for every rank
# to stop before it counts one that has not as being in a call no interrupt reaches
BENCH_STOP_GRACE_S = 2.0
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


SIZES_HELP = ("message sizes: every power of two from:to, or sizes and ranges separated "
              "by commas")  # what parse_sizes reads, for the options that take it


def size_text(n: float, suffix: str = "") -> str:
    """4096 -> '4K', 1048576 -> '1M', 1536 -> '1.5K' (binary units, as --sizes takes
    them); a size just under a unit, as 3 ranks' allgather of 1 MiB gathers (1048572),
    is '1M'. Both sides write sizes with it: the ranks' bench lines, the notebook's tables."""
    for unit in ("", "K", "M", "G", "T"):
        if round(abs(n), 1) < 1024 or unit == "T":
            text = f"{n:.1f}".rstrip("0").rstrip(".") if unit else f"{int(n)}"
            return f"{text}{unit}{suffix}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_sizes(spec: str) -> list[int]:
    """'4K:64M' → [4096, 8192, …, 64 MiB] (doubling); '1M' → [1048576]; a comma list of
    either ('4K,1M:4M') → the sizes of each, in order, each once. K/M/G are binary."""

    def one(text: str) -> int:
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
        if not m or int(m.group(1)) == 0:
            raise ValueError(f"--sizes {spec!r}: {text.strip()!r} is not a size like 4K, 16M, 1G")
        return int(m.group(1)) * _UNITS[m.group(2)]

    sizes: list[int] = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) > 2:
            raise ValueError(f"--sizes {spec!r}: use START:END like 4K:64M, one size, "
                             "or several separated by commas")
        start, end = one(parts[0]), one(parts[-1])
        if start > end:
            raise ValueError(f"--sizes {spec!r}: the start of {item.strip()!r} is larger "
                             "than its end")
        size = start
        while size <= end:
            sizes.append(size)
            size *= 2
    return sorted(set(sizes))


def parse_backends(spec: str) -> list[str]:
    """'mpi, gloo' → ['mpi', 'gloo'], each checked (check_backends)."""
    return check_backends([b.strip() for b in spec.split(",") if b.strip()])


def check_backends(backends: list[str]) -> list[str]:
    """The bench's backends as given; ValueError naming the first one it does not know."""
    unknown = [b for b in backends if b not in BENCH_BACKENDS]
    if unknown:
        raise ValueError(f"bench backend {unknown[0]!r} is not one of "
                         f"{', '.join(BENCH_BACKENDS)}")
    return backends


# -- the ranks' GPUs ---------------------------------------------------------------------------
def gpu_spec(gpus: str | None) -> list[int] | None:
    """`--gpus` as the ranks read it: `auto` → None (whatever the node has), `none` → [],
    `0,2` → [0, 2]. The notebook checks it before the ranks start, so a typo is one
    line rather than a failed start. Raises ValueError saying what is wrong."""
    spec = (gpus or "auto").strip().lower()
    if spec == "auto":
        return None
    if spec == "none":
        return []
    try:
        chosen = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        chosen = []
    if not chosen or any(g < 0 for g in chosen):
        raise ValueError(f"--gpus {gpus!r} is not auto, none or a list like 0,1")
    return chosen


# -- the supervisor's report ------------------------------------------------------------------
REPORT_PREFIX = "mpilab-engine-exit"
_REPORT = re.compile(re.escape(REPORT_PREFIX) + r" host=(?P<host>\S+) pid=(?P<pid>\d+|-) "
                     r"(?P<cause>.+)")


@dataclass(frozen=True)
class ExitReport:
    """How a rank's engine ended, as its supervisor saw it (host and pid name the rank
    on any host: a pid alone means nothing on another)."""

    host: str
    pid: int | None  # None: the engine never started
    cause: str  # 'killed by signal 9 (SIGKILL)', 'exited with code 3', 'did not start: …'

    def line(self) -> str:
        pid = "-" if self.pid is None else str(self.pid)
        return f"{REPORT_PREFIX} host={self.host} pid={pid} {self.cause}"


def exit_report(pid: int | None, cause: str) -> ExitReport:
    """This host's report for an engine with this pid."""
    return ExitReport(socket.gethostname(), pid, cause)


def exit_reports(output: str) -> list[ExitReport]:
    """Every report in a launcher's output, in order."""
    return [ExitReport(m["host"], None if m["pid"] == "-" else int(m["pid"]),
                       m["cause"].strip())
            for m in _REPORT.finditer(output)]

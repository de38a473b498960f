"""The notebook's end of the record channel, by the names its users import.

What lives where: mpilab.wire (the schema and the encoding both sides use),
mpilab.records (the checks of what arrives), mpilab.row_tables (the store's bounded
tables), mpilab.cell_window (a cell's records), mpilab.metrics_store (the store),
mpilab.metrics_export (its exports) and mpilab.receiver (the PULL socket's thread).
"""

from __future__ import annotations

from .cell_window import Bounds, CellMarks, CellWindow
from .metrics_store import CLOCK_SKEW_S, LATEST_ONLY_EVENTS, MetricsStore
from .receiver import ROUND_MAX_S, ROUND_QUIET_S, RecordReceiver
from .records import block_rows, validate
from .row_tables import MAX_STORE_ROWS, MIN_TABLE_ROWS, TABLE_BYTES_PER_ROW
from .wire import MAX_BATCH_RECORDS, MAX_MESSAGE_BYTES

__all__ = [
    "CLOCK_SKEW_S", "LATEST_ONLY_EVENTS", "MAX_BATCH_RECORDS", "MAX_MESSAGE_BYTES",
    "MAX_STORE_ROWS", "MIN_TABLE_ROWS", "ROUND_MAX_S", "ROUND_QUIET_S",
    "TABLE_BYTES_PER_ROW", "Bounds", "CellMarks", "CellWindow", "MetricsStore",
    "RecordReceiver", "block_rows", "validate",
]

"""The metrics store's tables: one table of float64 rows per rank, kind and labels,
bounded by one row budget that all tables share, so the store's memory stays within a
stated cap however many ranks report (MAX_STORE_ROWS rows, TABLE_BYTES_PER_ROW bytes a
row, arrays at most twice what is kept)."""

from __future__ import annotations

import itertools

import numpy as np

from .wire import TABLES

# The tables' memory cap: MAX_STORE_ROWS rows kept in all, however many ranks (1,024
# ranks' steps, loss and a kind of span: 3,072 tables of 325 rows), at most twice that
# allocated, at most TABLE_BYTES_PER_ROW bytes a row (the widest table: steps' 7 columns
# and the filing time): 128 MB. A table keeps at least MIN_TABLE_ROWS, so past
# MAX_STORE_ROWS / MIN_TABLE_ROWS tables the cap grows with them (MetricsStore.table_cap).
MAX_STORE_ROWS = 1_000_000
MIN_TABLE_ROWS = 250
TABLE_BYTES_PER_ROW = 8 * (1 + max(len(table.columns) for table in TABLES.values()))


class TableBudget:
    """The rows each table of a store keeps: the store's row budget shared by its
    tables, so its memory stays within a cap however many ranks and tables there are
    (MetricsStore.max_rows)."""

    def __init__(self, max_per_rank: int, max_rows: int):
        self.max_per_rank = max_per_rank
        self.max_rows = max_rows
        self.tables = 0
        self.limit = max_per_rank

    def add_table(self) -> None:
        self.tables += 1
        self.limit = min(self.max_per_rank, max(MIN_TABLE_ROWS, self.max_rows // self.tables))


class RowTable:
    """One table's rows from one rank and labels, with the time they were filed: the
    newest `limit` (the store's budget says how many); a row's number counts from the
    table's first. Its array holds at most 2 * limit rows."""

    serials = itertools.count()

    def __init__(self, width: int, budget: TableBudget):
        self.data = np.empty((64, width + 1))  # the columns, then the filing time
        self.n = 0
        self.dropped = 0  # rows before data[0]
        self.budget = budget
        self.serial = next(self.serials)  # readers' positions belong to one table

    @property
    def limit(self) -> int:
        return self.budget.limit

    def put(self, rows: np.ndarray) -> None:
        """Add rows that end with their filing time (the store makes a round's at once)."""
        limit = self.budget.limit
        if len(rows) > limit:  # more than is kept: the newest `limit` replace all
            self.dropped += self.n + len(rows) - limit
            self.n = 0
            rows = rows[-limit:]
        end = self.n + len(rows)
        if end > 2 * limit:  # amortised: down to the newest `limit` rows
            drop = end - limit
            keep = self.n - drop
            if len(self.data) > 2 * limit:  # the budget shrank since the array grew
                smaller = np.empty((2 * limit, self.data.shape[1]))
                smaller[:keep] = self.data[drop:self.n]
                self.data = smaller
            else:
                self.data[:keep] = self.data[drop:self.n]
            self.n = keep
            self.dropped += drop
            end = limit
        if end > len(self.data):
            grown = np.empty((min(max(2 * len(self.data), end), 2 * limit),
                              self.data.shape[1]))
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        self.data[self.n:end] = rows
        self.n = end

    @property
    def end(self) -> int:
        """The number of the row after the newest."""
        return self.dropped + self.n

    def between(self, first: int = 0, end: int | None = None) -> np.ndarray:
        """The kept rows (the newest `limit`) numbered from `first` to before `end`."""
        first = max(first - self.dropped, self.n - self.limit, 0)
        last = self.n if end is None else max(first, min(self.n, end - self.dropped))
        return self.data[first:last]

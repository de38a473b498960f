"""The notebook's checks of what arrives on the record channel (mpilab.wire's schema).

The channel carries data, never code: a record is filed only when it is of a kind a
message carries (wire.SENT_KINDS), from a rank of this cluster, with its kind's fields
and types; a block of rows only when it is whole rows of a known table, with finite
times and whole numbers where the table has them (NaN where a column is optional).
Blocks are checked many at once (`check_blocks`): a round of 1,024 ranks' messages is a
few array operations per table, not a few per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .wire import MAX_TABLE_ROWS, NUMBER, ROWS, SENT_KINDS, TABLES, fields_fit


@dataclass(frozen=True)
class TableCheck:
    """A table's layout as its blocks are checked: row width in bytes, the columns
    that must hold whole numbers (time first: it must be finite), and which of those may
    be NaN instead."""

    kind: str
    labels: int
    columns: int
    row_bytes: int
    checked: np.ndarray  # column indexes: time, then the whole-number columns
    optional: np.ndarray  # positions within `checked` that may be NaN


def _check(kind: str) -> TableCheck:
    table = TABLES[kind]
    ints = [i for i, name in enumerate(table.columns) if name in table.ints]
    return TableCheck(kind, len(table.labels), len(table.columns), 8 * len(table.columns),
                      np.array([0, *ints]),
                      np.array([1 + n for n, i in enumerate(ints)
                                if table.columns[i] in table.optional], dtype=int))


CHECKS = {kind: _check(kind) for kind in TABLES}


def well_formed(record, world_size: int) -> bool:
    """A record of a kind that messages carry, from a rank of this cluster, with its
    kind's fields; a block's rows are checked apart (check_blocks)."""
    if type(record) is not dict:
        return False
    kind, rank = record.get("k"), record.get("r")
    if type(kind) is not str or type(rank) is not int or not 0 <= rank < world_size:
        return False
    if kind == ROWS:  # most records: checked here without the general loop of fields_fit
        of, labels, data = record.get("of"), record.get("labels"), record.get("data")
        check = CHECKS.get(of) if type(of) is str else None
        return (check is not None and type(record.get("t")) in NUMBER
                and type(labels) is list and len(labels) == check.labels
                and all(type(label) is str for label in labels)
                and type(data) is bytes and _whole_rows(data, check))
    return kind in SENT_KINDS and fields_fit(record)


def _whole_rows(data: bytes, check: TableCheck) -> bool:
    return 0 < len(data) <= MAX_TABLE_ROWS * check.row_bytes and not len(data) % check.row_bytes


def rows_fit(rows: np.ndarray, check: TableCheck) -> np.ndarray:
    """Per row: finite time and whole numbers where the table has them."""
    values = rows[:, check.checked]  # a copy
    values[:, 0] *= 0.0  # a finite time is 0 now; inf and NaN are NaN
    if len(check.optional):
        optional = values[:, check.optional]
        optional[np.isnan(optional)] = 0.0
        values[:, check.optional] = optional
    # x - floor(x) is 0 for a whole number, NaN for inf and NaN
    with np.errstate(invalid="ignore"):
        return ~(values - np.floor(values)).any(axis=1)


def check_blocks(kind: str, blocks: list[bytes]) -> tuple[np.ndarray, list[slice | None]]:
    """The rows of blocks of one table (each whole rows: well_formed) read as one array,
    and each block's rows in it: a slice, or None for a block with a row that does not
    fit (rows_fit)."""
    check = CHECKS[kind]
    joined = b"".join(blocks) if len(blocks) > 1 else blocks[0]
    rows = np.frombuffer(joined, dtype=np.float64).reshape(-1, check.columns)
    fit = rows_fit(rows, check)
    spans: list[slice | None] = []
    n = 0
    for data in blocks:
        end = n + len(data) // check.row_bytes
        spans.append(slice(n, end))
        n = end
    if not fit.all():
        bad = np.add.reduceat(~fit, [span.start for span in spans]) > 0
        spans = [None if is_bad else span for span, is_bad in zip(spans, bad.tolist())]
    return rows, spans


def block_rows(record: dict) -> np.ndarray | None:
    """The rows of a well-formed ROWS record, or None when they do not fit its table."""
    rows, (span,) = check_blocks(record["of"], [record["data"]])
    return None if span is None else rows


def validate(record, world_size: int) -> bool:
    """True for a well-formed record, as it arrives, from a rank of this cluster."""
    return well_formed(record, world_size) and (
        record["k"] != ROWS or block_rows(record) is not None)

"""Which ranks a cell runs on, read from `%%ranks SPEC` and written back in messages:
`all`, `0`, `0,2`, `1-3` in; `0-2,5` and "ranks 0-2,5" out."""

from __future__ import annotations

import re
from collections.abc import Iterable


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """`all`, `0`, `0,2`, `1-3` (and mixtures) → sorted ranks; one-line errors."""
    spec = (spec or "all").strip()
    if spec == "all":
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"rank selection {spec!r} is malformed: use all, 0, 0,2 or 1-3")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"rank range {part!r} is backwards: write {hi}-{lo}")
        if hi >= world_size:  # checked before the range is made: `0-99999999999` is one line
            first = max(lo, world_size)
            missing = f"rank {hi} does" if first == hi else f"ranks {first}-{hi} do"
            has = f"ranks 0-{world_size - 1}" if world_size > 1 else "rank 0 only"
            raise ValueError(f"{missing} not exist: the cluster has {has}")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks)


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

"""Which ranks a cell runs on, read from `%%ranks SPEC`: `all`, `0`, `0,2`, `1-3`; and
the hosts they run on, as messages name them. (Ranks as messages name them, "ranks
0-2,5", are mpilab.wire's: the ranks' own lines name them so too.)"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .wire import format_ranks


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


HOSTS_LISTED = 4  # up to this many hosts a message names each; beyond, in ranges
_GROUPS_SHOWN = 6
_NUMBERED = re.compile(r"(.*?)(\d+)")


def host_list(hosts: Iterable[str]) -> str:
    """'node1, node2', or for many hosts their count and names in Slurm's ranges:
    '128 hosts: gpu[001-128]' (a name's number keeps its zero padding; names apart from
    a numbered run stay whole; past six runs the rest is counted)."""
    hosts = sorted(set(hosts))
    if len(hosts) <= HOSTS_LISTED:
        return ", ".join(hosts)
    numbered = [(m.group(1), m.group(2)) for host in hosts
                if (m := _NUMBERED.fullmatch(host))]
    whole = [host for host in hosts if not _NUMBERED.fullmatch(host)]
    # zero-padded numbers run at their width (gpu001-gpu128 is one run), and a number as
    # wide joins them; others run unpadded whatever their width (node7-node11)
    padded = {(prefix, len(digits)) for prefix, digits in numbered if digits[0] == "0"}
    runs: dict[tuple[str, int], list[int]] = {}  # (prefix, padded width or 0) -> numbers
    for prefix, digits in numbered:
        width = len(digits) if (prefix, len(digits)) in padded else 0
        runs.setdefault((prefix, width), []).append(int(digits))
    groups = sorted([f"{prefix}[{_padded_ranges(numbers, digits)}]" if len(numbers) > 1
                     else f"{prefix}{numbers[0]:0{digits}d}"
                     for (prefix, digits), numbers in runs.items()] + whole)
    shown = ", ".join(groups[:_GROUPS_SHOWN])
    if len(groups) > _GROUPS_SHOWN:
        shown += f", … ({len(groups) - _GROUPS_SHOWN} more)"
    return f"{len(hosts)} hosts: {shown}"


def _padded_ranges(numbers: list[int], digits: int) -> str:
    """format_ranks of the numbers, each zero-padded to `digits`."""
    return re.sub(r"\d+", lambda m: f"{int(m.group()):0{digits}d}",
                  format_ranks(numbers))

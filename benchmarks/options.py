"""The benchmarks' command-line options, checked by argparse before anything starts: a
mistyped command is one line (`bench_start.py: error: argument --reps: got 0, needs at
least 1`), not a traceback once a cluster is up."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from mpilab.wire import SIZES_HELP, parse_sizes


def at_least(minimum: float, kind: type = int) -> Callable[[str], float]:
    """An option's type: a number of `kind` no smaller than `minimum` (ranks,
    repetitions, steps: at least 1)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= minimum:  # NaN too
            raise argparse.ArgumentTypeError(f"got {text}, needs at least {minimum}")
        return value

    return parse


count = at_least(1)


def counts(text: str) -> list[int]:
    """An option's type: whole numbers of at least 1 separated by commas ('64,256')."""
    return [count(part.strip()) for part in text.split(",")]


def names(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An option's type: some of `known`, separated by commas ('small,wide')."""
    known = list(known)

    def parse(text: str) -> list[str]:
        picked = [part.strip() for part in text.split(",") if part.strip()]
        wrong = [p for p in picked if p not in known]
        if wrong or not picked:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose from {', '.join(known)}, separated by commas")
        return picked

    return parse


def sizes(text: str) -> list[int]:
    """An option's type: message sizes as `%mpilab bench --sizes` takes them, in bytes."""
    try:
        return parse_sizes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"--sizes {text!r}: ")) from None


def collective_parser(doc: str, default_sizes: str, repeats: int) -> argparse.ArgumentParser:
    """A parser with the options every benchmark of collectives takes: --sizes (a list of
    byte counts once parsed), --repeats, -n."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sizes", type=sizes, default=default_sizes,
                        help=f"{SIZES_HELP} (default {default_sizes})")
    parser.add_argument("--repeats", type=count, default=repeats,
                        help=f"timed repetitions, the median reported (default {repeats})")
    parser.add_argument("-n", type=count, default=2, help="ranks (when launching mpiexec)")
    return parser

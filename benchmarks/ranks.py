"""What the benchmarks that time collectives share: their options (--sizes, --repeats,
-n), checked before any rank starts, and starting themselves again on N ranks under the
environment's mpiexec when run as a plain script."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def relaunch(n: int) -> int | None:
    """None in a rank (MPICH's or Open MPI's variables are set); elsewhere this script
    run again with the same arguments by `mpiexec -n n` from beside this Python, and
    its exit status."""
    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK")):
        return None
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return subprocess.call([str(mpiexec), "-n", str(n), sys.executable, *sys.argv])


def collective_parser(doc: str, sizes: str, repeats: int) -> argparse.ArgumentParser:
    """A parser with the options every collective benchmark takes; add its own, then
    `parse_checked`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sizes", default=sizes,
                        help=f"every power of two from:to, or sizes and ranges separated "
                             f"by commas (default {sizes})")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed repetitions, the median reported (default {repeats})")
    parser.add_argument("-n", type=int, default=2, help="ranks (when launching mpiexec)")
    return parser


def parse_checked(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, read once before any rank starts (a bad one is one line from the
    parser, not a traceback on every rank); `sizes` as byte counts."""
    from mpilab.wire import parse_sizes

    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1 timed repetition is needed")
    if args.n < 1:
        parser.error(f"-n {args.n}: at least 1 rank is needed")
    try:
        args.sizes = parse_sizes(args.sizes)
    except ValueError as err:
        parser.error(str(err))
    return args

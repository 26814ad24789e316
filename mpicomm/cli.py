"""The ``mpicomm`` command: ``mpicomm demo`` (and, as they land, training and SLURM sub-commands).

Launch under MPI as ``mpiexec -n 4 mpicomm demo``. The entry point aborts the whole job when any
rank raises, so a failure never leaves other ranks blocked in a collective.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpicomm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="one neighbour exchange per codec on a ring of all ranks")
    demo.add_argument("--numel", type=int, default=100_000, help="elements per rank (default 100000)")
    demo.add_argument("--theta", type=float, default=0.1, help="Moniqua bound theta (default 0.1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the sub-command on every rank."""
    args = _parser().parse_args(argv)
    from mpi4py import MPI

    from .comm import abort_on_exception

    with abort_on_exception(MPI.COMM_WORLD):
        if args.command == "demo":
            from .demo import run_demo

            if args.numel <= 0:
                raise SystemExit(f"mpicomm demo: --numel must be a positive integer, got {args.numel}")
            run_demo(MPI.COMM_WORLD, numel=args.numel, theta=args.theta)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every app's ``main`` does: parse, set up on every rank, train, report, exit with a clear status.

Exit status: 0 on success; 2 for a usage or configuration error (the same one-line message on every
rank, nothing trained); 1 (whole job aborted) for an unexpected exception on any rank. A run stopped by
SIGUSR1/SIGTERM commits a checkpoint first; then, inside a SLURM job started with ``--requeue``
semantics wanted (``MPICOMM_REQUEUE=1``, set by the templates), rank 0 asks ``scontrol requeue`` for
this job and every rank exits 0, and the requeued job resumes from ``--resume latest``. Outside SLURM
it exits 128 + the signal number, the shell convention for "ended by a signal".
"""

from __future__ import annotations

import os
import subprocess
import sys

from ..comm import abort_on_exception
from .arguments import parse_app_args, setup_run
from .loop import run_training

__all__ = ["run_app"]


def _requeue(rank: int) -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("MPICOMM_REQUEUE") != "1":
        return False
    if rank == 0:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        print(f"requeue of job {job}: {'ok' if done.returncode == 0 else done.stderr.strip()}", flush=True)
    return True


def run_app(name: str, parser, build_task, argv=None, headline: tuple[str, str] = ("", "")) -> int:
    """Run one training app; ``build_task(args, rank, size)`` returns its Task (model included)."""
    args = parse_app_args(parser, argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    try:
        task, algo, cfg = setup_run(args, world, lambda: build_task(args, rank, size))
    except (ValueError, TypeError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    with abort_on_exception(world):
        summary = run_training(task, algo, cfg, run_info={"app": name, "argv": sys.argv[1:] if argv is None
                                                           else list(argv)})
    if rank == 0:
        key, label = headline
        mb = summary["bytes_sent"] / 1e6
        if key and key in summary:
            print(f"{label}: {100 * summary[key]:.2f} %  |  steps {summary['step']}/{summary['total_steps']}"
                  f"  |  bytes sent by rank 0: {mb:.2f} MB  |  wall {summary['wall_s']:.1f} s", flush=True)
    if summary["stopped_by_signal"]:
        return 0 if _requeue(rank) else 128 + summary["stopped_by_signal"]
    return 0


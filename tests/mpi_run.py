"""Run pytest (with pytest-mpi's --with-mpi) on every MPI rank and agree on one exit code.

Rank 0 prints its session as usual; the other ranks write theirs to a temporary file that is shown
only when that rank failed, so the log stays readable and no failure is hidden. With
``MPICOMM_TEST_RANK_LOGS=DIR`` that file is ``DIR/rank-N.log`` and is kept: a rank killed in C code (an
abort) cannot show it, and ``scripts/test.sh`` prints the end of each when a tier fails. The process exits
with the worst exit code of all ranks.

Before any test, every rank checks that ``MPI.COMM_WORLD`` has as many ranks as were started: as many
as the launcher says it started (MPICH's ``PMI_SIZE``, Open MPI's ``OMPI_COMM_WORLD_SIZE``, or srun's
``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS``) and, if given, as ``--expect-ranks N`` (or the environment
variable ``MPICOMM_EXPECT_RANKS``). An ``mpiexec`` of another MPI library than mpi4py's starts N
independent 1-rank worlds, in which every test that needs peers would skip or return early and the tier
would pass having tested nothing; this refuses such a run with exit code 3 instead.

usage: mpiexec -n N python tests/mpi_run.py [--expect-ranks N] [pytest args...]
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

LAUNCHER_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")  # set for every rank by MPICH's hydra, Open MPI's mpirun
SRUN_SIZES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")  # what srun started (only inside an srun step)
MISMATCH_EXIT = 3
EXIT_S = 120.0  # after the tests: how long finalizing and exiting may take before the stacks and a forced exit


def launcher_size(environ) -> tuple[str, int] | None:
    """(variable, ranks) the launcher says it started, from ``environ``; None if no launcher says."""
    names = LAUNCHER_SIZES + (SRUN_SIZES if "SLURM_STEP_ID" in environ else ())
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return name, int(value)
    return None


def expected_ranks(argv: list[str], environ) -> tuple[int | None, list[str]]:
    """The ``--expect-ranks N`` (or ``MPICOMM_EXPECT_RANKS``) count, and ``argv`` without that option."""
    rest, expect = [], environ.get("MPICOMM_EXPECT_RANKS", "").strip() or None
    args = iter(argv)
    for arg in args:
        if arg == "--expect-ranks":
            expect = next(args, "")
        elif arg.startswith("--expect-ranks="):
            expect = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if expect is None:
        return None, rest
    if not expect.isdigit() or int(expect) < 1:
        raise SystemExit(f"tests/mpi_run.py: --expect-ranks / MPICOMM_EXPECT_RANKS must be a positive integer, "
                         f"got {expect!r}")
    return int(expect), rest


def size_problem(size: int, expect: int | None, environ) -> str:
    """Why a world of ``size`` ranks is not the one started ('' if it is)."""
    problems = []
    said = launcher_size(environ)
    if said is not None and said[1] != size:
        problems.append(f"the launcher started {said[1]} ({said[0]}={said[1]})")
    if expect is not None and expect != size:
        problems.append(f"{expect} were expected (--expect-ranks / MPICOMM_EXPECT_RANKS)")
    if not problems:
        return ""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return (f"tests/mpi_run.py: MPI.COMM_WORLD has {size} rank(s), but {' and '.join(problems)}: the mpiexec "
            f"that started this job does not belong to mpi4py's MPI library (use {here}), or the count is wrong")


def main() -> int:
    """Check the world size, run pytest on this rank, then combine the exit codes of all ranks."""
    expect, pytest_args = expected_ranks(sys.argv[1:], os.environ)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    problem = size_problem(comm.Get_size(), expect, os.environ)
    if problem:  # the same on every rank of this world: no rank waits for another
        print(problem, file=sys.stderr, flush=True)
        return MISMATCH_EXIT
    args = ["--with-mpi", *pytest_args]
    if rank == 0:
        code = int(pytest.main(args))
        log_text = ""
    else:
        # MPICOMM_TEST_RANK_LOGS, a folder: each rank's pytest output is kept there (a rank that dies in C code,
        # say by SIGABRT, cannot print it; scripts/test.sh shows its tail when the tier fails)
        logs = os.environ.get("MPICOMM_TEST_RANK_LOGS")
        log_file = (open(os.path.join(logs, f"rank-{rank}.log"), "w+") if logs
                    else tempfile.TemporaryFile(mode="w+"))
        with log_file as log:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.environ["MPICOMM_TEST_CONSOLE_FD"] = str(saved[1])  # for a line that must reach the console
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                code = int(pytest.main(args))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
            log.seek(0)
            log_text = log.read()
    codes = comm.allgather(code)
    for r in range(1, comm.Get_size()):
        comm.Barrier()
        if r == rank and code != 0:
            print(f"\n===== rank {rank} failed (pytest exit {code}); its session: =====\n{log_text}", flush=True)
    if rank == 0:
        print(f"pytest exit codes by rank: {codes}", flush=True)
    worst = max(codes)
    leave_within(EXIT_S, worst)
    return worst


def leave_within(seconds: float, code: int) -> None:
    """Finalize MPI now, and exit with ``code`` if this process has not ended ``seconds`` later.

    A run that hung after its last test (in MPI's finalize or the interpreter's shutdown) otherwise held its tier
    until the tier's backstop limit, an hour, with nothing said. Here the stacks of every thread are printed,
    then the process exits with the tests' code. MPI is finalized through ctypes, which releases the GIL, so the
    exit timer can run while a finalize hangs (mpi4py's own ``Finalize`` holds the GIL).
    """
    import faulthandler
    import threading

    from mpicomm.comm.faults import finalize_releasing_gil
    from mpicomm.comm.progress import stop_progress

    sys.stdout.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback_later(seconds, exit=False)

    def give_up() -> None:
        print(f"tests/mpi_run.py: this rank had not exited {seconds:.0f} s after its tests ended (the stacks "
              f"above); exiting with the tests' code {code}", file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(seconds + 5, give_up)
    timer.daemon = True
    timer.start()
    stop_progress()
    finalize_releasing_gil()


if __name__ == "__main__":
    sys.exit(main())

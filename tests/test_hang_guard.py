"""The hang guard ends a job whose ranks wait in different collectives: one line and an exit, never a hang.

``tests/hang_job.py`` builds that deadlock on purpose (2 ranks, real MPI). With a hang timeout, a rank
names the collective, what the run was doing and the step, and ``MPI_Abort`` ends the job with exit 4.
Without one, a SIGTERM (what ``scancel`` and SLURM's preemption send) still ends it, within the signal
grace period, with exit 143: the Python handler cannot run while the main thread is inside MPI, so the
guard's thread learns of the signal through the wakeup descriptor.
"""

import os
import signal
import subprocess
import sys
import time

from mpicomm.comm.guard import EXIT_HUNG

from .app_runs import REPO, mpiexec

JOB = [sys.executable, os.path.join(REPO, "tests", "hang_job.py")]


def _start(env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([mpiexec(), "-n", "2", *JOB], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **env), cwd=REPO)
    assert proc.stdout.readline().strip() == "waiting", proc.communicate(timeout=60)
    return proc


def test_a_rank_waiting_past_the_hang_timeout_ends_the_job_with_one_line():
    """Exit 4 within a minute, and a line naming the collective, the activity and the step."""
    proc = _start({"MPICOMM_HANG_TIMEOUT": "2"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_HUNG, err[-2000:]
    lines = [line for line in err.splitlines() if "another rank is not taking part" in line]
    assert lines and "(evaluation) at step 7" in lines[0], err[-2000:]
    assert "the step's agreement" in lines[0] or "the evaluation's allgather" in lines[0], lines[0]


def test_sigterm_ends_ranks_blocked_in_a_collective_with_exit_143():
    """No hang timeout: SIGTERM to the launcher still ends the job, within seconds, with 128 + SIGTERM."""
    proc = _start({"MPICOMM_HANG_TIMEOUT": "0", "MPICOMM_SIGNAL_GRACE": "1"})
    time.sleep(1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert time.monotonic() - sent < 30, "the guard took too long"  # a hang bound, not a timing claim
    assert "SIGTERM arrived while this rank was waiting in" in err, err[-2000:]

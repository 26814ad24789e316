"""The free-running pace (``mpicomm.training.pace``): a rank never waits for a slower one before the run's end.

Rank 0 steps while every other rank is held (it takes no step and joins no round until rank 0 releases it),
so whether rank 0 waits for them depends on the pace's rule alone, not on how the OS schedules the ranks:
it must take all but one of the run's steps without waiting. Then every rank steps to the end, and a rank
may wait only in the run's last two rounds (once its own steps use up what the run still owes).
"""

import time

import pytest

from mpicomm.comm import Communicator
from mpicomm.training.pace import SharedSteps

from .algo_common import topologies_for
from .conftest import run_all

pytestmark = pytest.mark.mpi

TOTAL = 5  # the run's steps: size x TOTAL steps of all ranks together
RELEASE_TAG = 71
HANG_S = 30.0  # only to end the test if rank 0 hangs waiting for the held ranks (a broken pace)


def _step(pace: SharedSteps) -> bool:
    """One step as the training loop takes it: count it, poll, and post the next round unless the one that
    completed reached the run's last step; True once the run has ended."""
    pace.took_step()
    reached = pace.poll()
    if reached is None:
        return False
    if reached.step >= TOTAL:
        return True
    pace.post(0)
    return False


def test_a_rank_runs_ahead_of_held_ranks_without_waiting(comm):
    size = comm.Get_size()
    if size < 2:
        pytest.skip("needs a rank to hold")

    def body():
        pace = SharedSteps(Communicator(comm, topologies_for(size)[0]), 0, TOTAL)
        ahead_waits, ended = None, False
        if comm.Get_rank() == 0:
            for _ in range(size * TOTAL - 1):  # the whole run but one step, alone
                if _step(pace):  # only with a pace that waits (the held ranks join after HANG_S)
                    ended = True
                    break
            ahead_waits = list(pace.waited)
            for rank in range(1, size):
                comm.send(None, dest=rank, tag=RELEASE_TAG)
        else:  # held: no step, no round, until rank 0 has taken its steps (or it hangs in a wait)
            release = comm.irecv(source=0, tag=RELEASE_TAG)
            deadline = time.monotonic() + HANG_S
            while not release.test()[0] and time.monotonic() < deadline:
                time.sleep(0.01)
        while not ended:
            ended = _step(pace)
        if comm.Get_rank() != 0:
            release.wait()
        pace.close()
        counts, rounds, waited = pace.by_rank, pace.rounds, pace.waited_by_rank
        assert ahead_waits in (None, []), f"rank 0 waited for rounds {ahead_waits} while the others were held"
        assert sum(counts) >= size * TOTAL, f"the ranks took {counts} steps of the run's {size * TOTAL}"
        late = [(rank, r) for rank, rs in enumerate(waited) for r in rs if r < rounds - 1]
        assert not late, f"waits before the run's last two rounds (rank, round) {late} of {rounds} rounds"

    run_all(comm, body)

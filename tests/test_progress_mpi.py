"""The progress thread (:mod:`mpicomm.comm.progress`): a pending non-blocking exchange moves while the caller
makes no MPI call, and a run with the thread is bit for bit the run without it.

Runs at 2 ranks only (it skips itself at other counts: nothing here depends on the count). Whether the data
arrived is read from the receive buffer MPI writes into, never by timing.
"""

import time

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator, progress

from .algo_common import loss, make_model
from .conftest import run_all

pytestmark = pytest.mark.mpi

NUMEL = 2 * 2**20  # 8 MB of float32: far above every eager limit, so the transfer needs MPI's progress engine
HANG_S = 60.0  # a bound only against a hang


@pytest.fixture(autouse=True)
def _two_ranks(comm):
    if comm.Get_size() != 2:
        pytest.skip("runs at 2 ranks")


def _post(comm):
    """Post an 8 MB neighbour allgather on the ring into a receive buffer of -1; returns (handle, buffer)."""
    x = torch.full((NUMEL,), float(comm.rank))
    out = torch.full((len(comm.in_neighbors()), NUMEL), -1.0)
    comm.barrier()
    return comm.ineighbor_allgather(x, out=out), out


def _landed(out, comm) -> bool:
    """Whether the last element of every received row holds its sender's rank (read without MPI)."""
    return all(out[k, -1].item() == float(p) for k, p in enumerate(comm.in_neighbors()))


def test_pending_exchange_moves_while_the_caller_stays_out_of_mpi(comm, monkeypatch):
    """Without progress, the 8 MB exchange has not landed after the caller slept 0.3 s outside MPI (the setting
    discriminates); with the thread it lands while the caller only sleeps, and the first test() is True."""
    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        monkeypatch.setattr(progress, "_thread", lambda op: None)  # no progress mechanism
        handle, out = _post(c)
        time.sleep(0.3)
        moved_alone = _landed(out, c)
        handle.wait()
        problems = [] if _landed(out, c) else ["the blocking wait did not deliver"]
        thread = progress.ProgressThread()
        monkeypatch.setattr(progress, "_thread", lambda op: thread)
        try:
            handle, out = _post(c)
            start = time.monotonic()
            while not _landed(out, c) and time.monotonic() - start < HANG_S:
                time.sleep(0.02)  # no MPI call on this thread
            if not _landed(out, c):
                problems.append("the exchange did not move while the caller stayed out of MPI")
            if thread.polls == 0:
                problems.append("the thread never polled")
            # the data landed; the request also covers this rank's sends, which the thread completes too
            while not handle.test() and time.monotonic() - start < HANG_S:
                time.sleep(0.02)
            if not torch.equal(handle.wait()[:, :4], torch.tensor([[float(p)] * 4 for p in c.in_neighbors()])):
                problems.append("wrong data received")
        finally:
            thread.stop()
        moved = c.allgather_object(moved_alone)  # every rank reaches this before any verdict
        if any(moved):
            pytest.skip("this MPI moved the 8 MB exchange without progress: the check cannot discriminate here")
        assert not problems, "; ".join(problems)

    run_all(comm, body)


def test_overlapped_run_is_the_same_with_and_without_the_thread(comm, monkeypatch):
    """D-PSGD with the exchange posted before the forward pass: the same parameters bit for bit with the progress
    thread polling and with no progress mechanism."""
    def train(thread):
        monkeypatch.setattr(progress, "_thread", lambda op: thread)
        graph = Communicator(comm, topology.ring(comm.Get_size()))
        algo = make_algorithm("dpsgd", make_model(seed=comm.Get_rank()), graph, momentum=0.9, overlap=True)
        for _ in range(2):
            algo.begin_step()
            algo.zero_grad()
            loss(algo.model, comm.Get_rank(), algo.step_count).backward()
            algo.step()
        return algo.flat.data.clone()

    def body():
        thread = progress.ProgressThread()
        try:
            with_thread = train(thread)
        finally:
            thread.stop()
        assert thread._thread is not None, "the overlapped exchange never started the progress thread"
        assert torch.equal(with_thread, train(None))

    run_all(comm, body)

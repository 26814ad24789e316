"""The network model applied by the real Communicator: each collective takes its formula's time on top
of the real transfer, non-blocking transfers hide behind compute, and evaluation traffic is free.

Runs at 1, 2 and 4 ranks. Tolerance: a call may take up to 60 ms longer than its modelled cost (the
real transfer on shared memory plus scheduler noise with 4 ranks on 2 cores), never less.
"""

import time

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.comm import Communicator
from mpicomm.net import CostModel, parse_net

from .conftest import run_all

pytestmark = pytest.mark.mpi

NET = "80mbit,2ms"  # 10 MB/s: 40 KB costs 4 ms of bandwidth, so each call is short but clearly visible
SLACK = 0.06


def _timed(c, fn):
    c.comm.Barrier()
    t0 = time.perf_counter()
    modelled0 = c.clock.modelled_s
    fn()
    return time.perf_counter() - t0, c.clock.modelled_s - modelled0


def test_each_collective_costs_its_formula(comm):
    def body():
        n = comm.Get_size()
        c = Communicator(comm, topo.ring(n), net=NET)
        model = CostModel(parse_net(NET))
        x = torch.ones(10_000)  # 40 KB
        k_out, k_in = len(c.out_neighbors()), len(c.in_neighbors())
        cases = {
            "neighbor_allgather": (lambda: c.neighbor_allgather(x), model.neighbor(40_000 * k_out, 40_000 * k_in)),
            "neighbor_alltoallv": (lambda: c.neighbor_alltoallv([x] * k_out, [10_000] * k_in),
                                   model.neighbor(40_000 * k_out, 40_000 * k_in)),
            "allreduce": (lambda: c.allreduce(x.clone()), model.allreduce(40_000, n)),
            "allgather": (lambda: c.allgather(x), model.allgather(40_000, n)),
            "alltoall": (lambda: c.alltoall(torch.ones(10_000 * n)), model.alltoall(40_000 * n, n)),
            "bcast": (lambda: c.bcast(x.clone()), model.bcast(40_000, n)),
            "barrier": (c.barrier, model.barrier(n)),
            "iallreduce": (lambda: c.iallreduce(x.clone()).wait(), model.allreduce(40_000, n)),
        }
        for name, (call, expected) in cases.items():
            elapsed, modelled = _timed(c, call)
            assert modelled == pytest.approx(expected, rel=1e-12, abs=1e-15), (name, modelled, expected)
            assert expected - 1e-4 <= elapsed <= expected + SLACK, (name, elapsed, expected)
        if n > 1:
            assert c.clock.slept_s > 0.9 * c.clock.modelled_s

    run_all(comm, body)


def test_nonblocking_transfer_hides_behind_compute(comm):
    def body():
        n = comm.Get_size()
        c = Communicator(comm, topo.ring(n), net=NET)
        cost = CostModel(parse_net(NET)).allreduce(400_000, n)
        x = torch.ones(100_000)
        c.comm.Barrier()
        handle = c.iallreduce(x)
        time.sleep(cost + 0.02)  # "compute" longer than the transfer
        t0 = time.perf_counter()
        handle.wait()
        waited = time.perf_counter() - t0
        assert waited < SLACK, waited
        assert torch.all(x == n)

    run_all(comm, body)


def test_paused_and_unmetered_calls_cost_nothing_and_plain_communicator_sleeps_nothing(comm):
    def body():
        n = comm.Get_size()
        slow = Communicator(comm, topo.ring(n), net="1mbit,100ms")
        with slow.clock.paused():
            elapsed, modelled = _timed(slow, lambda: slow.allreduce(torch.ones(100_000)))
        assert modelled == 0.0 and elapsed < 1.0, (elapsed, modelled)
        booked = slow.ledger.bytes_contributed()  # the paused clock above still booked its bytes
        with slow.unmetered():  # monitoring traffic: neither modelled nor booked
            elapsed, modelled = _timed(slow, lambda: slow.allreduce(torch.ones(100_000)))
        assert modelled == 0.0 and elapsed < 1.0 and slow.ledger.bytes_contributed() == booked == 400_000
        plain = Communicator(comm, topo.ring(n))
        elapsed, modelled = _timed(plain, lambda: plain.allreduce(torch.ones(100_000)))
        assert modelled == 0.0 and plain.clock.slept_s == 0.0 and plain.clock.blocked_s > 0.0

    run_all(comm, body)

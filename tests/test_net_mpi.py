"""The network model applied by the real Communicator: each collective takes its formula's time on top
of the real transfer, non-blocking transfers hide behind compute, and evaluation traffic is free.

Runs at 1, 2 and 4 ranks. Wall time is only bounded from below (a call never returns before its
modelled cost has passed) and, to catch a hang, from far above; everything finer is read from the
clock's own books (what was modelled, what was slept), which do not depend on how busy the machine is.
How close real time comes to the model is measured in ``bench/transport/net_validate.py``, not asserted here.
"""

import math
import time

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.comm import Communicator
from mpicomm.net import CostModel, parse_net

from .conftest import run_all

pytestmark = pytest.mark.mpi

NET = "80mbit,2ms"  # 10 MB/s: 40 KB costs 4 ms of bandwidth, so each call is short but clearly visible
HANG = 10.0  # seconds: far above any modelled cost here, only a hung call takes this long


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
            "ialltoallv": (lambda: c.ialltoallv(x, [10_000] * n, [0] * n, torch.empty(10_000 * n), [10_000] * n).wait(),
                           model.alltoallv(40_000 * (n - 1), 40_000 * (n - 1), n - 1)),
        }
        for name, (call, expected) in cases.items():
            slept0 = c.clock.slept_s
            elapsed, modelled = _timed(c, call)
            assert modelled == pytest.approx(expected, rel=1e-12, abs=1e-15), (name, modelled, expected)
            if not name.startswith("i"):  # a blocking call waits out exactly its cost (the link is free)
                # deadline - now loses the low bits of perf_counter's magnitude (ulp ~1e-11 s after a day up)
                resolution = 4 * math.ulp(time.perf_counter())
                assert c.clock.slept_s - slept0 == pytest.approx(expected, rel=1e-12, abs=resolution), (name, expected)
            assert expected - 1e-4 <= elapsed <= expected + HANG, (name, elapsed, expected)

    run_all(comm, body)


def test_nonblocking_transfer_hides_behind_compute(comm):
    def body():
        n = comm.Get_size()
        c = Communicator(comm, topo.ring(n), net=NET)
        cost = CostModel(parse_net(NET)).allreduce(400_000, n)
        x = torch.ones(100_000)
        c.comm.Barrier()
        handle = c.iallreduce(x)
        assert c.clock.modelled_s == pytest.approx(cost)  # queued when posted
        time.sleep(cost + 0.02)  # "compute" longer than the transfer
        handle.wait()
        assert c.clock.slept_s == 0.0  # the modelled transfer was over before wait(): nothing left to sleep
        assert torch.all(x == n)

    run_all(comm, body)


def test_paused_and_unmetered_calls_cost_nothing_and_plain_communicator_sleeps_nothing(comm):
    def body():
        n = comm.Get_size()
        slow = Communicator(comm, topo.ring(n), net="1mbit,100ms")
        with slow.clock.paused():
            _, modelled = _timed(slow, lambda: slow.allreduce(torch.ones(100_000)))
        assert modelled == 0.0 and slow.clock.slept_s == 0.0, modelled
        booked = slow.ledger.bytes_contributed()  # the paused clock above still booked its bytes
        with slow.unmetered():  # monitoring traffic: neither modelled nor booked
            _, modelled = _timed(slow, lambda: slow.allreduce(torch.ones(100_000)))
        assert modelled == 0.0 and slow.clock.slept_s == 0.0
        assert slow.ledger.bytes_contributed() == booked == 400_000
        plain = Communicator(comm, topo.ring(n))
        elapsed, modelled = _timed(plain, lambda: plain.allreduce(torch.ones(100_000)))
        assert modelled == 0.0 and plain.clock.slept_s == 0.0 and plain.clock.blocked_s > 0.0

    run_all(comm, body)

"""Multi-rank tests of the Communicator: received values, Ledger bytes, buffer reuse, staging, errors.

Every topology is built from ``comm.Get_size()``, so the file runs at 1, 2 and 4 ranks. Each rank sends
a tensor whose values encode (sender, step, dtype), so a received row proves where it came from.
"""

import time

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.comm import Communicator, World, as_world, raise_together
from mpicomm.ledger import ANY

from .conftest import run_all

pytestmark = pytest.mark.mpi


def _topologies(n):
    out = [topo.ring(n), topo.exponential(n), topo.complete(n), topo.alternating_ring(n)]  # odd n: one sits out
    if n == 4:
        out.append(topo.torus(4, rows=2))
    if n & (n - 1) == 0:
        out += [topo.one_peer_exponential(n), topo.one_peer_hypercube(n)]
    return out


def _payload(sender: int, step: int, numel: int, dtype) -> torch.Tensor:
    base = torch.arange(numel, dtype=torch.float64) % 7
    return (base + 10 * sender + 100 * step).to(dtype)


@pytest.mark.parametrize("stage", ["auto", "always"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bfloat16, torch.float64])
def test_neighbor_allgather_values_and_ledger(comm, dtype, stage):
    def body():
        for schedule in _topologies(comm.Get_size()):
            c = Communicator(comm, schedule, stage=stage)
            numel = 13
            for step in range(3):
                t = c.topology(step)
                send = _payload(c.rank, step, numel, dtype)
                got = c.neighbor_allgather(send, step=step)
                sources = t.in_neighbors(c.rank)
                assert got.shape == (len(sources), numel), (schedule.name, got.shape)
                for row, src in zip(got, sources):
                    assert torch.equal(row, _payload(src, step, numel, dtype)), (schedule.name, step, src)
            nbytes = numel * send.element_size()
            expect_sent = sum(len(c.out_neighbors(s)) for s in range(3)) * nbytes
            expect_recv = sum(len(c.in_neighbors(s)) for s in range(3)) * nbytes
            assert c.ledger.bytes_sent() == expect_sent, (schedule.name, c.ledger.bytes_sent(), expect_sent)
            assert c.ledger.bytes_received() == expect_recv
            assert c.ledger.bytes_contributed() == 3 * nbytes
            for dst in c.out_neighbors(0):
                assert c.ledger.bytes_sent(peer=dst) > 0

    run_all(comm, body)


HOLD_S = 30  # hang guard: how long rank 0's in-neighbours hold their send back waiting for its word


def test_ineighbor_allgather_overlaps_and_matches_blocking(comm):
    """``ineighbor_allgather`` returns while its data cannot have arrived: rank 0 posts it while its
    in-neighbours hold their sends back until it says so, finds the request still pending before and after
    computing, then lets them send; every rank receives the rows the blocking call gives. (Were the post
    blocking, rank 0 would wait in it for its in-neighbours: they stop holding back after ``HOLD_S`` s, so the
    test fails on the pending check instead of hanging.)"""
    def body():
        c = Communicator(comm, topo.ring(comm.Get_size()))
        send = _payload(c.rank, 0, 1000, torch.float32)
        pending = []
        if c.rank == 0:
            handle = c.ineighbor_allgather(send)
            pending.append(not handle.test())
            busy = torch.randn(200, 200) @ torch.randn(200, 200)  # compute while the message is in flight
            pending.append(not handle.test())
            comm.Ibarrier().Wait()  # the in-neighbours may send now
        else:
            go = comm.Ibarrier()
            deadline = time.monotonic() + HOLD_S
            while not go.Test() and time.monotonic() < deadline:
                time.sleep(0.001)
            handle = c.ineighbor_allgather(send)
            busy = torch.randn(200, 200) @ torch.randn(200, 200)
        got = handle.wait().clone()
        assert handle.wait() is not None  # idempotent
        if c.rank != 0:
            go.Wait()
        expected = torch.stack([_payload(s, 0, 1000, torch.float32) for s in c.in_neighbors()]) \
            if c.in_neighbors() else torch.empty(0, 1000)
        assert torch.equal(got, expected)
        assert busy.shape == (200, 200)
        if c.rank == 0 and c.in_neighbors():
            assert pending == [True, True], f"request complete before any in-neighbour sent: {pending}"

    run_all(comm, body)


def test_receive_buffers_are_reused(comm):
    def body():
        c = Communicator(comm, topo.ring(comm.Get_size()))
        send = torch.ones(64)
        first = c.neighbor_allgather(send)
        second = c.neighbor_allgather(send * 2)
        if first.numel():
            assert first.data_ptr() == second.data_ptr()
        out = torch.empty_like(second)
        third = c.neighbor_allgather(send * 3, out=out)
        assert third is out
        total = torch.ones(8)
        assert c.allreduce(total).data_ptr() == total.data_ptr()

    run_all(comm, body)


@pytest.mark.parametrize("blocking, stage", [(True, "auto"), (False, "auto"), (False, "always")])
def test_neighbor_alltoallv_per_destination_payloads(comm, blocking, stage):
    def body():
        c = Communicator(comm, topo.exponential(comm.Get_size(), symmetric=False), stage=stage)
        dests, sources = c.out_neighbors(), c.in_neighbors()
        # length of the message from a to b is 3 + a + 2 b; values encode (a, b)
        sends = [torch.full((3 + c.rank + 2 * d,), float(100 * c.rank + d)) for d in dests]
        counts = [3 + s + 2 * c.rank for s in sources]
        if blocking:
            got = c.neighbor_alltoallv(sends, counts)
        else:
            handle = c.ineighbor_alltoallv(sends, counts)
            for t in sends:
                t.fill_(-1.0)  # copied at the call: changing the sends in flight changes nothing
            later = c.neighbor_alltoallv([t * 0 for t in sends], counts)  # reuses the blocking call's buffers
            got = handle.wait()
            assert all(torch.equal(t, torch.zeros_like(t)) for t in later)
        for s, t in zip(sources, got):
            assert torch.equal(t, torch.full((3 + s + 2 * c.rank,), float(100 * s + c.rank)))
        assert c.ledger.bytes_sent() == (1 if blocking else 2) * 4 * sum(3 + c.rank + 2 * d for d in dests)

    run_all(comm, body)


@pytest.mark.parametrize("stage", ["auto", "always"])
def test_centralized_collectives(comm, stage):
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        c = Communicator(comm, topo.complete(n), stage=stage)
        x = torch.arange(10, dtype=torch.float64) + r
        c.allreduce(x)
        assert torch.equal(x, n * torch.arange(10, dtype=torch.float64) + n * (n - 1) / 2)
        m = torch.tensor([float(r)])
        assert c.allreduce(m, op="max").item() == n - 1
        h = c.iallreduce(torch.ones(5, dtype=torch.int64))
        assert torch.equal(h.wait(), torch.full((5,), n, dtype=torch.int64))

        g = c.allgather(torch.tensor([r, 2 * r], dtype=torch.int32))
        assert torch.equal(g, torch.tensor([[k, 2 * k] for k in range(n)], dtype=torch.int32))

        send = torch.tensor([10 * r + k for k in range(n) for _ in range(2)], dtype=torch.uint8)
        got = c.alltoall(send)
        assert torch.equal(got, torch.tensor([10 * k + r for k in range(n) for _ in range(2)], dtype=torch.uint8))

        b = torch.full((3,), float(r))
        c.bcast(b, root=n - 1)
        assert torch.equal(b, torch.full((3,), float(n - 1)))

        nb = 10 * 8
        assert c.ledger.bytes_contributed("allreduce") == nb + 4 + 5 * 8
        assert c.ledger.bytes_sent("allreduce", ANY) == sum(2 * (n - 1) * b // n for b in (nb, 4, 40)) \
            if n > 1 else c.ledger.bytes_sent("allreduce") == 0
        assert c.ledger.bytes_sent("allgather") == 8 * (n - 1)
        assert c.ledger.bytes_sent("alltoall") == 2 * (n - 1)

    run_all(comm, body)


@pytest.mark.parametrize("stage", ["auto", "always"])
def test_ialltoallv_unequal_parts(comm, stage):
    """Rank a sends a + 2 b bytes of value 10 a + b to rank b, from overlapping parts of one send buffer, and
    nothing to the ranks below it; each receives packed in rank order; the Ledger books the non-empty parts."""
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        c = Communicator(comm, topo.ring(n), stage=stage)
        longest = r + 2 * (n - 1)
        send = torch.zeros(longest, dtype=torch.uint8)  # the part for b: bytes [0, r + 2 b)
        counts = [r + 2 * b if b >= r else 0 for b in range(n)]
        for b in range(r, n):  # the part for b starts at byte 0 and has its value only in its last two bytes
            send[r + 2 * b - 2:r + 2 * b] = 10 * r + b
        recv_counts = [a + 2 * r if r >= a else 0 for a in range(n)]
        out = torch.zeros(sum(recv_counts), dtype=torch.uint8)
        got = c.ialltoallv(send, counts, [0] * n, out, recv_counts).wait()
        assert got is out
        at = 0
        for a, count in enumerate(recv_counts):
            if count:
                assert got[at + count - 2:at + count].tolist() == [10 * a + r] * 2, (a, got)
            at += count
        assert c.ledger.bytes_contributed("alltoallv") == longest
        assert c.ledger.bytes_sent("alltoallv") == sum(counts) - counts[r]
        with pytest.raises(ValueError, match=f"need {n} send counts"):
            c.ialltoallv(send, counts[:-1], [0] * (n - 1), out, recv_counts)

    run_all(comm, body)


def test_alltoall_rejects_uneven_split(comm):
    def body():
        n = comm.Get_size()
        c = Communicator(comm, topo.ring(n))
        if n == 1:  # every length splits evenly over one rank
            return
        with pytest.raises(ValueError, match="multiple of the"):
            c.alltoall(torch.zeros(n + 1))

    run_all(comm, body)


def test_topology_size_mismatch_is_one_clear_error(comm):
    def body():
        n = comm.Get_size()
        with pytest.raises(ValueError, match=f"has {n + 1} ranks but the MPI communicator has {n}"):
            Communicator(comm, topo.ring(n + 1))

    run_all(comm, body)


@pytest.mark.parametrize("kind", ["mpi4py", "World"])
def test_raise_together_names_the_failing_rank(comm, kind):
    def body():
        n = comm.Get_size()
        bad = n - 1
        local = ValueError("lr must be > 0") if comm.Get_rank() == bad else None
        over = comm if kind == "mpi4py" else World(comm)
        with pytest.raises(ValueError, match=f"rank {bad}: ValueError: lr must be > 0"):
            raise_together(over, local)
        raise_together(over, None)  # no error anywhere: returns on every rank

    run_all(comm, body)


def test_the_world_wraps_mpi4py_agrees_on_objects_and_builds_a_communicator(comm):
    def body():
        n, me = comm.Get_size(), comm.Get_rank()
        world = as_world(comm)
        assert isinstance(world, World) and as_world(world) is world and world.comm is comm
        assert (world.rank, world.size) == (me, n)
        assert world.allgather_object({"rank": me, "sq": me * me}, "a test") == [{"rank": r, "sq": r * r}
                                                                                  for r in range(n)]
        built = Communicator(world, topo.complete(n))
        assert built.comm is comm and (built.rank, built.size) == (me, n)
        assert built.in_neighbors() == tuple(r for r in range(n) if r != me)
        assert as_world(built) is built  # a Communicator already has rank, size and allgather_object

    run_all(comm, body)

"""The Communicator's fast path (a plan cached per call shape) behaves exactly as its general path.

Blocking calls on CPU tensors that MPI reads in place run from a plan made by their first call: the same received
values, the same Ledger books (compared count for count with ``stage="always"``, which takes the general path),
the same pricing under a network model, every call inside one guarded wait, ``out=`` and the cached receive
buffers as before, and the general path's errors. Runs at 1, 2, 3 and 4 ranks.
"""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.comm import Communicator
from mpicomm.net import CostModel, parse_net

from .conftest import run_all

pytestmark = pytest.mark.mpi


def _calls(c, n, r, rounds=3):
    """A mix of every fast-path collective, repeated so that later calls run from the cached plans; returns what
    each call gave (cloned), in order."""
    got = []
    big = torch.arange(64, dtype=torch.float32)
    for k in range(rounds):
        x = torch.arange(12, dtype=torch.float64) + r + k  # a fresh tensor of one shape every round
        got.append(c.allreduce(x).clone())
        got.append(c.allreduce(big[16:24] + 0).clone())
        view = big.clone()
        c.allreduce(view[8:16])  # a view: the data pointer carries its offset
        got.append(view.clone())
        got.append(c.allreduce(torch.tensor(float(r + k)), op="max").clone())  # 0-d
        got.append(c.allreduce(torch.tensor([r + 1, 2], dtype=torch.int64), op="bor").clone())
        got.append(c.allgather(torch.tensor([r, k], dtype=torch.int32)).clone())
        v = torch.arange(3 * n, dtype=torch.float32) + 10 * r + k
        got.append(c.reduce_scatter(v, [3] * n).clone())
        if n > 1:
            uneven = [2] * (n - 1) + [4]
            got.append(c.reduce_scatter(torch.ones(sum(uneven)) * (r + 1), uneven).clone())
        for step in range(2):
            send = (torch.arange(7, dtype=torch.float32) + 100 * r + 10 * step + k).to(torch.bfloat16)
            got.append(c.neighbor_allgather(send, step=step).clone())
        got.append(c.neighbor_allgather(torch.full((5,), r, dtype=torch.uint8)).clone())
        for step in range(2):  # rank a sends (a + 2b) % 3 + 1 elements of 10a + b + k to rank b
            sends = [torch.full(((r + 2 * d) % 3 + 1,), 10 * r + d + k, dtype=torch.float32)
                     for d in c.out_neighbors(step)]
            parts = c.neighbor_alltoallv(sends, [(s + 2 * r) % 3 + 1 for s in c.in_neighbors(step)], step=step)
            assert all(torch.equal(p, torch.full_like(p, 10 * s + r + k)) for p, s in zip(parts, c.in_neighbors(step)))
            got.append(torch.cat([torch.zeros(0), *parts]).clone())
    return got


def test_fast_path_values_and_books_match_the_general_path(comm):
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        schedule = topo.one_peer_exponential(n) if n & (n - 1) == 0 else topo.ring(n)
        fast = Communicator(comm, schedule)
        general = Communicator(comm, schedule, stage="always")  # staged: never the fast path
        got_fast, got_general = _calls(fast, n, r), _calls(general, n, r)
        assert any(plan is not None for plan in fast._plans.values())
        assert not any(general._plans.values())  # staged: every plan is None, the general path ran
        assert len(got_fast) == len(got_general)
        for i, (a, b) in enumerate(zip(got_fast, got_general)):
            assert a.dtype == b.dtype and torch.equal(a, b), (i, a, b)
        assert fast.ledger.state_dict() == general.ledger.state_dict()
        assert fast.ledger.bytes_contributed() > 0

    run_all(comm, body)


def test_fast_path_values(comm):
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        c = Communicator(comm, topo.ring(n))
        for k in range(3):
            x = torch.full((6,), float(r + k))
            assert c.allreduce(x) is x and torch.equal(x, torch.full((6,), float(n * k + n * (n - 1) / 2)))
            g = c.allgather(torch.tensor([r, k], dtype=torch.int16))
            assert torch.equal(g, torch.tensor([[p, k] for p in range(n)], dtype=torch.int16))
            part = c.reduce_scatter(torch.arange(2 * n, dtype=torch.float32) + k, [2] * n)
            assert torch.equal(part, n * (torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + k))
            rows = c.neighbor_allgather(torch.full((3,), 10 * r + k, dtype=torch.int32))
            want = torch.tensor([[10 * s + k] * 3 for s in c.in_neighbors()], dtype=torch.int32).reshape(-1, 3)
            assert torch.equal(rows, want)

    run_all(comm, body)


def test_cached_receive_buffers_and_out(comm):
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        c = Communicator(comm, topo.ring(n))
        send = torch.full((4,), r, dtype=torch.uint8)
        first = c.neighbor_allgather(send)
        second = c.neighbor_allgather(send + 1)
        assert second is first  # the cached receive buffer, rewritten
        out = torch.empty_like(first)
        assert c.neighbor_allgather(send + 2, out=out) is out
        assert c.neighbor_allgather(send) is first  # out= left the cache alone
        assert torch.equal(out, torch.tensor([[s + 2] * 4 for s in c.in_neighbors()], dtype=torch.uint8)
                           .reshape(-1, 4))
        gathered = c.allgather(send)
        assert c.allgather(send) is gathered
        mine = torch.empty((n, 4), dtype=torch.uint8)
        assert c.allgather(send, out=mine) is mine and torch.equal(mine, gathered)
        counts = [1] * n
        part = c.reduce_scatter(torch.ones(n), counts)
        assert c.reduce_scatter(torch.ones(n), counts) is part
        kept = torch.empty(1)
        assert c.reduce_scatter(torch.ones(n) * 2, counts, out=kept) is kept and kept.item() == 2 * n
        assert part.item() == n
        other = c.neighbor_allgather(torch.zeros(8, dtype=torch.uint8))  # another shape: another buffer
        assert other.shape == (len(c.in_neighbors()), 8)
        assert other.numel() == 0 or other.data_ptr() != first.data_ptr()

    run_all(comm, body)


def test_fast_path_errors_are_the_general_paths(comm):
    def body():
        n = comm.Get_size()
        c = Communicator(comm, topo.ring(n))
        send = torch.zeros(6)
        c.neighbor_allgather(send)  # the plan exists from here
        c.allgather(send)
        c.allreduce(send)
        with pytest.raises(ValueError, match="contiguous"):
            c.neighbor_allgather(torch.zeros(6, 2)[:, 0])
        with pytest.raises(ValueError, match="out must have shape"):
            c.neighbor_allgather(send, out=torch.empty(len(c.in_neighbors()) + 1, 6))
        with pytest.raises(ValueError, match="out must have shape"):
            c.allgather(send, out=torch.empty(n, 6, dtype=torch.float64))
        with pytest.raises(ValueError, match="contiguous"):
            c.allgather(send, out=torch.empty(n, 12)[:, ::2])
        with pytest.raises(ValueError, match="op must be one of"):
            c.allreduce(send, op="prod")
        with pytest.raises(ValueError, match="contiguous"):
            c.allreduce(torch.zeros(6, 2)[:, 0])
        with pytest.raises(TypeError, match="reductions support"):
            c.allreduce(torch.zeros(6, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="reduce_scatter"):
            c.reduce_scatter(torch.zeros(n + 1), [1] * n)

    run_all(comm, body)


def test_fast_path_is_guarded_timed_priced_and_unmetered_on_request(comm):
    def body():
        n = comm.Get_size()
        net = "80mbit,2ms"
        c = Communicator(comm, topo.ring(n), net=net)
        model = CostModel(parse_net(net))
        x = torch.ones(1000)  # 4 KB
        k_out, k_in = len(c.out_neighbors()), len(c.in_neighbors())
        expected = {"allreduce": model.allreduce(4000, n), "allgather": model.allgather(4000, n),
                    "reduce_scatter": model.reduce_scatter(4000 * n, n),
                    "neighbor_allgather": model.neighbor(4000 * k_out, 4000 * k_in)}
        calls = {"allreduce": lambda: c.allreduce(x), "allgather": lambda: c.allgather(x),
                 "reduce_scatter": lambda: c.reduce_scatter(torch.ones(1000 * n), [1000] * n),
                 "neighbor_allgather": lambda: c.neighbor_allgather(x)}
        guard = c.guard
        waits = []
        previous = guard.after_wait
        guard.after_wait = lambda: waits.append(guard._wait)  # runs as each outermost wait ends
        try:
            for name, call in calls.items():
                for _ in range(2):  # the second from the cached plan
                    modelled, blocked, count = c.clock.modelled_s, c.clock.blocked_s, len(waits)
                    call()
                    assert c.clock.modelled_s - modelled == pytest.approx(expected[name], rel=1e-12), name
                    assert c.clock.blocked_s - blocked >= expected[name] * 0.999, name
                    assert len(waits) == count + 1 and waits[-1] is None, name  # one wait, closed
            booked = c.ledger.state_dict()
            modelled = c.clock.modelled_s
            with c.unmetered():
                for call in calls.values():
                    call()
            assert c.ledger.state_dict() == booked and c.clock.modelled_s == modelled
        finally:
            guard.after_wait = previous
        timed = Communicator(comm, topo.ring(n))  # no model: still timed
        blocked = timed.clock.blocked_s
        for _ in range(3):
            timed.allreduce(x)
        assert timed.clock.blocked_s > blocked and timed.clock.modelled_s == 0

    run_all(comm, body)


def test_neighbor_alltoallv_reads_parts_in_place_or_packs_them(comm):
    """Parts anywhere in memory (the fast path hands MPI their addresses) or strided (packed by the general path):
    the same parts arrive, from the cached receive buffer."""
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        c = Communicator(comm, topo.ring(n))
        dests, sources = c.out_neighbors(), c.in_neighbors()
        for k in range(3):
            scattered = [torch.full((3,), 10 * r + d + k, dtype=torch.int64) for d in dests]
            strided = [torch.full((3, 2), 10 * r + d + k, dtype=torch.int64)[:, 0] for d in dests]
            for sends in (scattered, strided):
                got = c.neighbor_alltoallv(sends, [3] * len(sources))
                assert len(got) == len(sources)
                for part, s in zip(got, sources):
                    assert torch.equal(part, torch.full((3,), 10 * s + r + k, dtype=torch.int64)), (part, s)
        assert c.ledger.bytes_sent("neighbor_alltoallv") == 6 * len(dests) * 3 * 8

    run_all(comm, body)


def test_callers_that_own_their_out_get_no_cached_buffer(comm):
    """With ``out=`` on every call the Communicator allocates no receive buffer of its own (a sharded gather's
    output can be most of a rank's memory)."""
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        c = Communicator(comm, topo.ring(n))
        send = torch.full((8,), r, dtype=torch.uint8)
        rows = torch.empty(len(c.in_neighbors()), 8, dtype=torch.uint8)
        gathered, part = torch.empty(n, 8), torch.empty(2)
        for _ in range(3):
            c.neighbor_allgather(send, out=rows)
            c.allgather(send.float(), out=gathered)
            c.reduce_scatter(torch.ones(2 * n), [2] * n, out=part)
        assert not c._recv, list(c._recv)
        assert torch.equal(gathered[:, 0], torch.arange(n, dtype=torch.float32))
        assert torch.equal(part, torch.full((2,), float(n)))

    run_all(comm, body)

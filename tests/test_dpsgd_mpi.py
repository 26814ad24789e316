"""D-PSGD against a single-process simulation of all ranks, state round trip, and its traffic."""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import grad_at, initial_flat, make_model, mixing, topologies_for, train
from .conftest import run_all

pytestmark = pytest.mark.mpi


def reference_dpsgd(schedule, steps, lr, momentum=0.0):
    """x_i <- sum_j W_ij x_j - lr * m_i, m_i <- mu m_i + g_i(x_i), for all ranks at once."""
    n = schedule.size
    x = initial_flat().repeat(n, 1)
    m = torch.zeros_like(x)
    for t in range(steps):
        g = torch.stack([grad_at(x[r], r, t) for r in range(n)])
        m = momentum * m + g if t else g.clone()
        x = mixing(schedule, t) @ x - lr * m
    return x


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dpsgd_matches_reference(comm, momentum):
    def body():
        for schedule in topologies_for(comm.Get_size()):
            c = Communicator(comm, schedule)
            algo = make_algorithm("dpsgd", make_model(seed=comm.Get_rank()), c, lr=0.1, momentum=momentum)
            train(algo, 5)
            expected = reference_dpsgd(schedule, 5, 0.1, momentum)[c.rank]
            torch.testing.assert_close(algo.flat.data, expected, rtol=1e-5, atol=1e-6)
            d = algo.flat.numel
            assert algo.stats()["step_bytes_sent"] == 4 * d * len(c.out_neighbors(4)), schedule.name

    run_all(comm, body)


def _one_peer_schedules(n):
    """The pairwise one-peer schedules at ``n`` ranks: the alternating ring (at an odd count one rank sits
    each step out) and, at a power of two, the one-peer hypercube."""
    out = [topo.alternating_ring(n)]
    if n & (n - 1) == 0:
        out.append(topo.one_peer_hypercube(n))
    return out


def test_dpsgd_one_peer_schedules_match_reference(comm):
    """D-PSGD on a pairwise schedule applies that step's W (one partner, weight 1/2) on every rank, and a rank
    sends its model to that one partner only: half a static ring's bytes, none for a rank that sits out."""
    def body():
        for schedule in _one_peer_schedules(comm.Get_size()):
            c = Communicator(comm, schedule)
            algo = make_algorithm("dpsgd", make_model(seed=comm.Get_rank()), c, lr=0.1, momentum=0.9)
            sent = []
            for _ in range(5):
                train(algo, 1)
                sent.append(algo.stats()["step_bytes_sent"])
            expected = reference_dpsgd(schedule, 5, 0.1, 0.9)[c.rank]
            torch.testing.assert_close(algo.flat.data, expected, rtol=1e-5, atol=1e-6)
            d = algo.flat.numel
            peers = [len(schedule.at(step).out_neighbors(c.rank)) for step in range(5)]
            assert all(p <= 1 for p in peers), schedule.name
            assert sent == [4 * d * p for p in peers], (schedule.name, sent, peers)

    run_all(comm, body)


def test_dpsgd_state_round_trip_is_bit_exact(comm):
    def body():
        schedule = topologies_for(comm.Get_size())[-1]
        straight = make_algorithm("dpsgd", make_model(), Communicator(comm, schedule), lr=0.05, momentum=0.9)
        train(straight, 6)
        first = make_algorithm("dpsgd", make_model(), Communicator(comm, schedule), lr=0.05, momentum=0.9)
        train(first, 3)
        state = first.state_dict()
        resumed = make_algorithm("dpsgd", make_model(seed=7), Communicator(comm, schedule), lr=0.05, momentum=0.9)
        resumed.load_state_dict(state)
        train(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)

    run_all(comm, body)


def test_mismatched_models_fail_on_every_rank(comm):
    def body():
        c = Communicator(comm, topologies_for(comm.Get_size())[0])
        width = 3 if comm.Get_rank() == comm.Get_size() - 1 and comm.Get_size() > 1 else 4
        model = torch.nn.Linear(width, 2)
        if comm.Get_size() == 1:
            return
        with pytest.raises(ValueError, match="model mismatch"):
            make_algorithm("dpsgd", model, c)

    run_all(comm, body)


def test_bad_option_fails_on_every_rank(comm):
    def body():
        c = Communicator(comm, topologies_for(comm.Get_size())[0])
        with pytest.raises(ValueError, match=r"lr must be in \(0.0, inf\)"):
            make_algorithm("dpsgd", make_model(), c, lr=-1.0)
        with pytest.raises(ValueError, match="unknown option"):
            make_algorithm("dpsgd", make_model(), c, bits=3)
        with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
            make_algorithm("nope", make_model(), c)

    run_all(comm, body)

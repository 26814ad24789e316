"""CHOCO's and DCD's degree-free state (algorithms/public_sum.py): s_i = sum_j W_ij x̂_j, its size, old checkpoints.

Every rank's own public copy x̂_j is gathered with MPI, so the sum a rank keeps is checked against the
definition computed from scratch in float32 (``W @ x̂``). The running sum adds one rounded W_ij q_j per
message and step while ``W @ x̂`` rounds once per product, so the two agree to float32 rounding of a
reordered sum of O(10) terms of size |x̂| < 10: rtol=1e-5, atol=1e-6 (float32 eps is 1.2e-7) leaves
a 10x margin. The same tolerance covers a run resumed from a converted per-neighbour checkpoint.
"""

import pytest
import torch

from mpicomm.algorithms import make_algorithm
from mpicomm.checkpoint import load_checkpoint, run_meta, save_checkpoint
from mpicomm.comm import Communicator

from .algo_common import make_model, mixing, topologies_for, train
from .conftest import run_all

pytestmark = pytest.mark.mpi

STEPS = 5
OPTIONS = {"lr": 0.1, "momentum": 0.9, "codec": "qsgd", "codec_options": {"bits": 3}, "seed": 3}
NAMES = {"choco": {"gamma": 0.4}, "dcd": {}}


def build(comm, name, schedule, model_seed=0):
    """``name`` with a stochastic codec (so the codec's generator state is part of what resumes)."""
    return make_algorithm(name, make_model(model_seed), Communicator(comm, schedule), **OPTIONS, **NAMES[name])


def own_copies(comm, algo) -> list[torch.Tensor]:
    """Per slot: every rank's own public copy x̂_j, stacked in rank order ``(n, d)``."""
    return [torch.stack(comm.allgather(pair[0].clone())) for pair in algo.gossip.pairs]


@pytest.mark.parametrize("name", NAMES)
def test_sum_is_the_mix_of_the_public_copies(comm, name):
    def body():
        for schedule in topologies_for(comm.Get_size()):
            algo = build(comm, name, schedule)
            train(algo, STEPS)
            rank = comm.Get_rank()
            for pair, copies, step in zip(algo.gossip.pairs, own_copies(comm, algo), algo.gossip.first_steps):
                assert torch.equal(pair[0], copies[rank])
                expected = (mixing(schedule, step) @ copies)[rank]
                torch.testing.assert_close(pair[1], expected, rtol=1e-5, atol=1e-6, msg=schedule.name)

    run_all(comm, body)


@pytest.mark.parametrize("name", NAMES)
def test_state_is_two_model_copies_per_topology_whatever_the_degree(comm, name):
    def body():
        for schedule in topologies_for(comm.Get_size()):
            algo = build(comm, name, schedule)
            d, slots = algo.flat.numel, algo.gossip.slots
            assert [tuple(p.shape) for p in algo.gossip.pairs] == [(2, d)] * len(slots), schedule.name
            assert algo.gossip.scratch.numel() == d
            state = algo.gossip.state_dict()
            assert set(state) == {"codec", "own_and_sum"}

    run_all(comm, body)


def old_form_state(comm, algo) -> dict:
    """``algo``'s gossip state as the per-neighbour form stored it: per slot, own copy then in-neighbours'.

    That form's copy of x̂_j on rank i was bit-identical to j's own copy (the sender adds the decoded bytes it
    sent), so gathering the own copies rebuilds exactly what it would have written.
    """
    rank = comm.Get_rank()
    copies = []
    for topo, gathered in zip(algo.gossip.slots, own_copies(comm, algo)):
        copies.append(gathered[[rank, *topo.in_neighbors(rank)]].clone())
    return {"codec": algo.gossip.codec.state_dict(), "copies": copies}


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_of_the_per_neighbour_form_is_converted(comm, name, mpi_tmp_path):
    def body():
        root = mpi_tmp_path / f"old_form_{name}"
        schedule = topologies_for(comm.Get_size())[-1]  # one-peer exponential at 4 ranks: two slots
        straight = build(comm, name, schedule)
        train(straight, 2 * STEPS)

        first = build(comm, name, schedule)
        train(first, STEPS)
        state = first.state_dict()
        state["extra"]["gossip"] = old_form_state(comm, first)
        expected_pairs = [p.clone() for p in first.gossip.pairs]
        save_checkpoint(root, first.comm, {"algo": state}, step=STEPS, meta=run_meta(first.comm, first))

        resumed = build(comm, name, schedule, model_seed=7)
        loaded, _ = load_checkpoint(root, resumed.comm, expect=run_meta(resumed.comm, resumed))
        resumed.load_state_dict(loaded["algo"])
        for mine, ref in zip(resumed.gossip.pairs, expected_pairs):
            assert torch.equal(mine[0], ref[0])
            torch.testing.assert_close(mine[1], ref[1], rtol=1e-5, atol=1e-6)
        train(resumed, STEPS)
        torch.testing.assert_close(resumed.flat.data, straight.flat.data, rtol=1e-5, atol=1e-6)

    run_all(comm, body)


def test_per_neighbour_state_of_another_schedule_is_refused(comm):
    def body():
        algo = build(comm, "choco", topologies_for(comm.Get_size())[0])
        d = algo.flat.numel
        bad = {"codec": algo.gossip.codec.state_dict(), "copies": [torch.zeros(9, d)]}
        with pytest.raises(ValueError, match=r"per-neighbour replica state has shapes \[\(9, \d+\)\], expected"):
            algo.gossip.load_state_dict(bad)

    run_all(comm, body)

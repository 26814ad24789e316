"""HSQ with its encode and allgather bucket by bucket during backward (overlap=True) == the blocking step."""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .conftest import run_all
from .overlap_common import resume_matches_straight, train
from .test_compressed_overlap_mpi import cnn, cnn_loss

pytestmark = pytest.mark.mpi


def run(algo, steps, micro=1):
    """The training loop on the CNN; buckets launched during each step's backward."""
    return train(algo, steps, cnn_loss, algo.bucketed, micro)


CASES = {  # the CNN's weights (72, 144 and 320 numbers) compressed, its biases raw
    "greedy": {"d": 8},
    "unbiased-rotation": {"d": 8, "mode": "unbiased", "codebook": "rotation"},
    "server-half": {"d": 8, "mode": "unbiased", "aggregation": "server", "participation": 0.5},
}


def _pair(comm, options, micro=1):
    """The same HSQ twice, without and with overlap (one bucket per tensor)."""
    algos = []
    for extra in ({}, {"overlap": True, "bucket_numel": 4, "first_bucket_numel": 4}):
        algo = make_algorithm("hsq", cnn(comm.Get_rank()), Communicator(comm, topo.ring(comm.Get_size())),
                              lr=0.05, momentum=0.9, weight_decay=1e-3, seed=7, min_compress=10, **options, **extra)
        algo.accumulate(micro)
        algos.append(algo)
    return algos


def _same(plain, over) -> None:
    assert torch.equal(over.flat.data, plain.flat.data)
    assert torch.equal(over.optimizer.state[over.optimizer.param_groups[0]["params"][0]]["momentum_buffer"],
                       plain.optimizer.state[plain.optimizer.param_groups[0]["params"][0]]["momentum_buffer"])
    assert over.last_participants == plain.last_participants
    mine, theirs = over.codec.state_dict(), plain.codec.state_dict()
    for key in ("norms", "sampler"):  # the generators advanced alike
        a, b = mine[key]["rng_state"], theirs[key]["rng_state"]
        assert (a is None and b is None) or torch.equal(a, b), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlap_is_bit_identical(comm, case):
    def body():
        plain, over = _pair(comm, CASES[case])
        assert len(over.bucketed.parts) == 6
        assert run(plain, 4) == [0] * 4
        assert run(over, 4) == [6] * 4  # every bucket launched during backward
        _same(plain, over)
        assert over.stats()["step_bytes_contributed"] == plain.stats()["step_bytes_contributed"]
        assert plain.codec.state_dict()["norms"]["rng_state"] is not None  # the norms were drawn

    run_all(comm, body)


def test_overlap_with_accumulation_and_resume_is_bit_identical(comm):
    """Accumulation of 3; and 2 + 2 == 4 steps, the save taken between steps (nothing in flight)."""
    def body():
        plain, over = _pair(comm, CASES["unbiased-rotation"], micro=3)
        run(plain, 3, micro=3)
        run(over, 3, micro=3)
        _same(plain, over)

        resume_matches_straight(lambda: _pair(comm, CASES["greedy"])[1], run, 2, 2, _same)

    run_all(comm, body)


def test_overlap_with_hierarchical_is_refused(comm):
    def body():
        with pytest.raises(ValueError, match="hierarchical cannot be combined with overlap"):
            make_algorithm("hsq", cnn(0), Communicator(comm, topo.ring(comm.Get_size())), overlap=True,
                           hierarchical=True)

    run_all(comm, body)

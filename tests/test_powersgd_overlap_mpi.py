"""PowerSGD with both allreduces bucket by bucket during backward (overlap=True) == the whole-gradient step."""

import pytest
import torch

from mpicomm.algorithms import make_algorithm

from .conftest import run_all
from .overlap_common import resume_matches_straight, train
from .test_compressed_overlap_mpi import cnn, cnn_loss
from .test_powersgd_mpi import _comm

pytestmark = pytest.mark.mpi


def run(algo, steps, micro=1):
    """The training loop on the CNN; buckets launched during each step's backward."""
    return train(algo, steps, cnn_loss, algo.bucketed, micro)


CASES = {  # warm-up 2 so that both phases and the switch run
    "rank1": {"rank": 1},
    "rank2-no-warm-start": {"rank": 2, "warm_start": False},
    "no-error-feedback": {"rank": 1, "error_feedback": False},
    "epsilon": {"rank": 2, "epsilon": 1e-8},
}


def _pair(comm, options, micro=1, optimizer=False):
    """The same PowerSGD twice, without and with overlap (buckets of about one tensor)."""
    common = {"warmup_steps": 2, "seed": 3, "min_compression_rate": 1.0, **options}  # weights compressed, biases not
    if not optimizer:
        common.update(lr=0.05, momentum=0.9, weight_decay=1e-3)
    algos = []
    for extra in ({}, {"overlap": True, "bucket_numel": 4, "first_bucket_numel": 4}):
        model = cnn(comm.Get_rank())
        opt = torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer else None
        algo = make_algorithm("powersgd", model, _comm(comm), optimizer=opt, **common, **extra)
        algo.accumulate(micro)
        algos.append(algo)
    return algos


def _same(plain, over) -> None:
    assert torch.equal(over.flat.data, plain.flat.data)
    assert torch.equal(over.q, plain.q)
    if plain.error is not None:
        assert torch.equal(over.error, plain.error)
        assert plain.error.abs().sum() > 0
    assert torch.equal(over.generator.get_state(), plain.generator.get_state())


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlap_is_bit_identical(comm, case):
    def body():
        plain, over = _pair(comm, CASES[case])
        buckets = over.bucketed.buckets
        assert len(buckets.ranges) == 6 and len(over.layout.matrices) == 3, (buckets.ranges, over.layout.matrices)
        assert run(plain, 5) == [0] * 5
        assert run(over, 5) == [6] * 5  # every bucket launched during backward
        _same(plain, over)
        assert over.stats()["step_bytes_contributed"] == plain.stats()["step_bytes_contributed"]

    run_all(comm, body)


def test_overlap_with_accumulation_and_a_user_optimizer_is_bit_identical(comm):
    def body():
        for micro, optimizer in ((3, False), (1, True)):
            plain, over = _pair(comm, CASES["rank2-no-warm-start"], micro=micro, optimizer=optimizer)
            run(plain, 4, micro)
            run(over, 4, micro)
            _same(plain, over)

    run_all(comm, body)


def test_overlap_state_round_trip_is_bit_exact(comm):
    """3 + 2 steps == 5 steps, the save taken between steps (nothing in flight) across the warm-up switch."""
    def body():
        resume_matches_straight(lambda: _pair(comm, CASES["rank1"])[1], run, 1, 4, _same)

    run_all(comm, body)


def test_overlap_with_hierarchical_is_refused(comm):
    def body():
        with pytest.raises(ValueError, match="hierarchical cannot be combined with overlap"):
            make_algorithm("powersgd", cnn(0), _comm(comm), overlap=True, hierarchical=True)

    run_all(comm, body)

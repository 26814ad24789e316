"""APMSqueeze with the 1-bit average pipelined over its chunks during backward (overlap=True) == the blocking step."""

import pytest
import torch

from mpicomm.algorithms import make_algorithm

from .conftest import run_all
from .overlap_common import resume_matches_straight, train
from .test_apmsqueeze_mpi import _comm
from .test_compressed_overlap_mpi import cnn, cnn_loss

pytestmark = pytest.mark.mpi


def tiny(seed: int = 0) -> torch.nn.Module:
    """Linear(3, 2): 8 parameters, so at 2 or more ranks whole chunks of the 1-bit average are padding."""
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def tiny_loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return model(torch.randn(4, 3, generator=g)).pow(2).mean()


MODELS = {"cnn": (cnn, cnn_loss), "tiny": (tiny, tiny_loss)}


def run(algo, steps, loss_fn, micro=1):
    """The training loop; buckets launched during each step's backward."""
    return train(algo, steps, loss_fn, algo.pipelined, micro)


def _pair(comm, model, micro=1):
    """The same APMSqueeze twice, without and with overlap (buckets of about one tensor, moved to chunks)."""
    build = MODELS[model][0]
    algos = []
    for extra in ({}, {"overlap": True, "bucket_numel": 4, "first_bucket_numel": 4}):
        algo = make_algorithm("apmsqueeze", build(comm.Get_rank()), _comm(comm), lr=0.01, weight_decay=1e-3,
                              warmup_steps=2, **extra)
        algo.accumulate(micro)
        algos.append(algo)
    return algos


def _same(plain, over) -> None:
    assert torch.equal(over.flat.data, plain.flat.data)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(over.adam_state()[key], plain.adam_state()[key]), key
    assert torch.equal(over.worker_error, plain.worker_error)
    assert torch.equal(over.server_error, plain.server_error)
    assert plain.worker_error.abs().sum() > 0


def _chunks(n: int, model: str) -> list[tuple[int, int]]:
    """The chunk range of each bucket, worked out by hand from the tensor offsets and L = 8 ceil(d / 8n)."""
    if model == "tiny" or n == 1:
        return [(0, n)]
    # cnn tensors start at 0, 72, 76, 220, 224, 544 (d = 549); each bucket boundary moves down to a multiple of L
    return {2: [(1, 2), (0, 1)], 3: [(2, 3), (1, 2), (0, 1)], 4: [(3, 4), (1, 3), (0, 1)]}.get(n)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_overlap_is_bit_identical(comm, model):
    def body():
        loss_fn = MODELS[model][1]
        plain, over = _pair(comm, model)
        expected = _chunks(comm.Get_size(), model)
        if expected is not None:
            assert over.pipelined.chunks == expected, over.pipelined.chunks
        buckets = len(over.pipelined.chunks)
        assert run(plain, 6, loss_fn) == [0] * 6
        assert run(over, 6, loss_fn) == [buckets] * 6  # every bucket launched during backward
        _same(plain, over)
        assert over.stats()["step_bytes_contributed"] == plain.stats()["step_bytes_contributed"]
        sent = {op: over.stats()[f"step_bytes_sent_{op}"] for op in ("alltoall", "allgather", "alltoallv")}
        blocking = plain.stats()
        assert sent["alltoallv"] == blocking["step_bytes_sent_alltoall"] + blocking["step_bytes_sent_allgather"]
        assert sent["alltoall"] == sent["allgather"] == 0

    run_all(comm, body)


def test_overlap_with_accumulation_is_bit_identical(comm):
    def body():
        plain, over = _pair(comm, "cnn", micro=3)
        run(plain, 4, cnn_loss, micro=3)
        run(over, 4, cnn_loss, micro=3)
        _same(plain, over)

    run_all(comm, body)


def test_overlap_state_round_trip_is_bit_exact(comm):
    """1 + 4 steps == 5 steps, the save taken between steps (nothing in flight) before the warm-up switch."""
    def body():
        resume_matches_straight(lambda: _pair(comm, "cnn")[1], lambda algo, k: run(algo, k, cnn_loss), 1, 4, _same)

    run_all(comm, body)


def test_overlap_refusals(comm):
    def body():
        with pytest.raises(ValueError, match="cannot overlap with variant='deepspeed'"):
            make_algorithm("apmsqueeze", cnn(0), _comm(comm), overlap=True, variant="deepspeed", warmup_steps=2)
        with pytest.raises(ValueError, match="hierarchical cannot be combined with overlap"):
            make_algorithm("apmsqueeze", cnn(0), _comm(comm), overlap=True, hierarchical=True, warmup_steps=2)

    run_all(comm, body)

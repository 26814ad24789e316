"""``algo.accumulate(N)`` and ``algo.clip_grad_norm_(C)`` against single-process references.

Accumulation: N micro-batches of b samples must give the update of one batch of N b (to float
tolerance), with one round of communication per update. Clipping: ``torch.nn.utils.clip_grad_norm_``
on the averaged gradient (centralized) or on each rank's own (decentralized), in one process.
"""

import pytest
import torch

from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import BATCH, batch, grad_at, initial_flat, make_model, mixing, topologies_for, train
from .conftest import run_all

pytestmark = pytest.mark.mpi

MICRO = 4


def train_micro(algo, steps: int, n: int) -> None:
    """``steps`` updates, each from ``n`` micro-batches that split this rank's batch of the step."""
    rank, b = algo.comm.rank, BATCH // n
    for t in range(steps):
        x, y = batch(rank, t)
        for k in range(n):
            algo.zero_grad()
            torch.nn.functional.cross_entropy(algo.model(x[k * b:(k + 1) * b]), y[k * b:(k + 1) * b]).backward()
            algo.step()
            assert algo.pending_micro_batches == (k + 1) % n
        assert algo.step_count == t + 1


CASES = {
    "allreduce_sgd": {"lr": 0.1, "momentum": 0.9},
    "allreduce_sgd-overlap": {"lr": 0.1, "momentum": 0.9, "overlap": True, "bucket_numel": 20},
    "dpsgd": {"lr": 0.1, "momentum": 0.9},
    "apmsqueeze": {"lr": 0.01, "warmup_steps": 2, "total_steps": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_accumulated_micro_batches_equal_one_big_batch(comm, case):
    name = case.split("-")[0]

    def body():
        schedule = topologies_for(comm.Get_size())[0]
        whole = make_algorithm(name, make_model(), Communicator(comm, schedule), **CASES[case])
        train(whole, 4)
        micro = make_algorithm(name, make_model(), Communicator(comm, schedule), **CASES[case])
        micro.accumulate(MICRO)
        train_micro(micro, 4, MICRO)
        torch.testing.assert_close(micro.flat.data, whole.flat.data, rtol=1e-5, atol=1e-6)
        assert micro.comm.ledger.totals() == whole.comm.ledger.totals()  # one round of traffic per update

    run_all(comm, body)


def test_overlap_hooks_wait_for_the_last_micro_batch(comm):
    def body():
        algo = make_algorithm("allreduce_sgd", make_model(), Communicator(comm, topologies_for(comm.Get_size())[0]),
                              overlap=True, bucket_numel=20)
        algo.accumulate(3)
        x, y = batch(comm.Get_rank(), 0)
        before = algo.comm.ledger.totals()
        for k in range(3):
            algo.zero_grad()
            torch.nn.functional.cross_entropy(algo.model(x), y).backward()
            launched = len(algo.buckets.handles)
            assert launched == (len(algo.buckets.ranges) if k == 2 else 0), (k, launched)
            if k < 2:
                assert algo.comm.ledger.totals() == before
            algo.step()
        assert algo.step_count == 1 and not algo.buckets.handles

    run_all(comm, body)


def test_accumulate_rejects_bad_counts(comm):
    def body():
        algo = make_algorithm("dpsgd", make_model(), Communicator(comm, topologies_for(comm.Get_size())[0]))
        for bad in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match="accumulate: n must be an int >= 1"):
                algo.accumulate(bad)
        algo.accumulate(2)
        algo.zero_grad()
        torch.nn.functional.cross_entropy(algo.model(batch(0, 0)[0]), batch(0, 0)[1]).backward()
        algo.step()
        with pytest.raises(RuntimeError, match="1 micro-batch"):
            algo.accumulate(3)

    run_all(comm, body)


def _clipped(g: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, float]:
    """``g`` clipped by torch's clip_grad_norm_ over the parameters of a fresh model (one process)."""
    model = make_model(0)
    offset = 0
    for p in model.parameters():
        p.grad = g[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    return torch.nn.utils.parameters_to_vector([p.grad for p in model.parameters()]), norm


CLIP = 0.2


def test_centralized_clipping_uses_the_averaged_gradient(comm):
    def body():
        n = comm.Get_size()
        algo = make_algorithm("allreduce_sgd", make_model(comm.Get_rank()),
                              Communicator(comm, topologies_for(n)[0]), lr=0.5)
        algo.clip_grad_norm_(CLIP)
        x, clipped_once = initial_flat(), False
        for t in range(4):
            train(algo, 1)
            g, norm = _clipped(torch.stack([grad_at(x, r, t) for r in range(n)]).mean(0), CLIP)
            clipped_once |= norm > CLIP
            x = x - 0.5 * g
            assert algo.stats()["grad_norm"] == pytest.approx(norm, rel=1e-5)
        torch.testing.assert_close(algo.flat.data, x, rtol=1e-5, atol=1e-6)
        assert clipped_once
        norms = comm.allgather(float(algo.last_grad_norm))
        assert norms == [norms[0]] * n

    run_all(comm, body)


def test_decentralized_clipping_uses_the_local_gradient(comm):
    def body():
        n = comm.Get_size()
        schedule = topologies_for(n)[0]
        algo = make_algorithm("dpsgd", make_model(), Communicator(comm, schedule), lr=0.5)
        algo.clip_grad_norm_(CLIP)
        x = initial_flat().repeat(n, 1)
        for t in range(4):
            train(algo, 1)
            g = torch.stack([_clipped(grad_at(x[r], r, t), CLIP)[0] for r in range(n)])
            x = mixing(schedule, t) @ x - 0.5 * g
        torch.testing.assert_close(algo.flat.data, x[comm.Get_rank()], rtol=1e-5, atol=1e-6)

    run_all(comm, body)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_clip_rejects_bad_norms_and_unsupported_algorithms(comm, bad):
    def body():
        c = Communicator(comm, topologies_for(comm.Get_size())[0])
        algo = make_algorithm("dpsgd", make_model(), c)
        with pytest.raises(ValueError, match="max_norm must be in"):
            algo.clip_grad_norm_(bad)
        squeeze = make_algorithm("apmsqueeze", make_model(), c, total_steps=4)
        with pytest.raises(ValueError, match="apmsqueeze does not support clip_grad_norm_"):
            squeeze.clip_grad_norm_(1.0)

    run_all(comm, body)

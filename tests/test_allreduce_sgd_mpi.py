"""AllReduce-SGD against a single-process simulation of all ranks; overlap == no overlap; traffic; state."""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import grad_at, initial_flat, loss, make_model, train
from .conftest import run_all

pytestmark = pytest.mark.mpi


def communicator(comm):
    return Communicator(comm, topo.ring(comm.Get_size()))


def recursive_doubling_sum(rows):
    """Sum of ``rows`` in MPICH's allreduce order: fold the first 2*rem in pairs, then adjacent pairs upward."""
    pof2 = 1 << (len(rows).bit_length() - 1)
    rem = len(rows) - pof2
    level = [rows[2 * k] + rows[2 * k + 1] for k in range(rem)] + list(rows[2 * rem:])
    while len(level) > 1:
        level = [level[2 * k] + level[2 * k + 1] for k in range(len(level) // 2)]
    return level[0]


def mpi_adds_in_tree_order(comm, numels) -> bool:
    """Collective: whether this MPI's allreduce equals ``recursive_doubling_sum`` bit for bit at each size.

    Always true for n <= 2 (IEEE addition commutes). MPICH adds in recursive-doubling order at every
    size; another library may not, and then bit-exact claims at n > 2 do not hold (see allgather_sum).
    """
    n, ok = comm.Get_size(), True
    for numel in numels:
        g = torch.Generator().manual_seed(numel)
        rows = torch.randn(n, numel, generator=g) * torch.randn(n, numel, generator=g).mul(3).exp()
        mine = rows[comm.Get_rank()].clone()
        communicator(comm).allreduce(mine)
        ok = ok and torch.equal(mine, recursive_doubling_sum(list(rows)))
    return all(comm.allgather(ok))


def reference_allreduce_sgd(n, steps, lr, momentum=0.0, weight_decay=0.0):
    """x <- x - lr * m, m <- mu m + mean_r g_r(x) + wd x: all ranks share one iterate."""
    x = initial_flat()
    m = torch.zeros_like(x)
    for t in range(steps):
        g = torch.stack([grad_at(x, r, t) for r in range(n)]).mean(0) + weight_decay * x
        m = momentum * m + g if t else g
        x = x - lr * m
    return x


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-2)])
def test_allreduce_sgd_matches_reference(comm, momentum, weight_decay):
    def body():
        algo = make_algorithm("allreduce_sgd", make_model(seed=comm.Get_rank()), communicator(comm), lr=0.1,
                              momentum=momentum, weight_decay=weight_decay)
        train(algo, 5)
        everyone = comm.allgather(algo.flat.data.clone())
        expected = reference_allreduce_sgd(comm.Get_size(), 5, 0.1, momentum, weight_decay)
        torch.testing.assert_close(algo.flat.data, expected, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(x, everyone[0]) for x in everyone), "ranks' parameters differ"

    run_all(comm, body)


def test_allreduce_sgd_traffic_is_one_fp32_allreduce(comm):
    def body():
        c = communicator(comm)
        algo = make_algorithm("allreduce_sgd", make_model(), c, lr=0.1)
        train(algo, 3)
        n, d = comm.Get_size(), algo.flat.numel
        stats = algo.stats()
        assert stats["step_bytes_contributed"] == 4 * d
        assert stats["step_bytes_sent"] == (2 * (n - 1) * 4 * d // n)
        assert stats["bits_per_parameter"] == 32.0
        assert c.ledger.contributed["allreduce"].messages == 3

    run_all(comm, body)


def _overlap_loop(algo, steps):
    """The training loop, alternating algo.zero_grad() and torch's set_to_none zero_grad (grads replaced)."""
    launched = []
    for t in range(steps):
        if t % 2:
            algo.model.zero_grad(set_to_none=True)
        else:
            algo.zero_grad()
        loss(algo.model, algo.comm.rank, t).backward()
        launched.append(len(algo.buckets.handles) if algo.buckets is not None else 0)
        algo.step()
    return launched


def test_overlap_is_bit_identical_and_launches_during_backward(comm):
    def body():
        kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}
        plain = make_algorithm("allreduce_sgd", make_model(), communicator(comm), **kwargs)
        c = communicator(comm)
        # 6-8-3 MLP: bucket_numel=5 gives buckets [W2,b2] (27), [b1] (8), [W1] (48) in launch order
        over = make_algorithm("allreduce_sgd", make_model(), c, overlap=True, bucket_numel=5, **kwargs)
        assert over.buckets.ranges == [[56, 83], [48, 56], [0, 48]]
        plain_launched = _overlap_loop(plain, 6)
        launched = _overlap_loop(over, 6)
        exact = mpi_adds_in_tree_order(comm, [83, 27, 8, 48])
        assert plain_launched == [0] * 6 and launched == [3] * 6, launched
        stats = over.stats()
        assert stats["step_bytes_contributed"] == 4 * 83 and c.ledger.contributed["allreduce"].messages == 18
        if exact:
            assert torch.equal(over.flat.data, plain.flat.data)
        else:  # an MPI whose summation order depends on the message size (n > 2 only)
            torch.testing.assert_close(over.flat.data, plain.flat.data, rtol=1e-6, atol=1e-7)
        reference = reference_allreduce_sgd(comm.Get_size(), 6, **kwargs)
        torch.testing.assert_close(over.flat.data, reference, rtol=1e-5, atol=1e-6)

    run_all(comm, body)


def test_buckets_are_cut_like_ddp_a_small_first_one_then_large_ones(comm):
    """The first bucket (the last layers) closes at first_bucket_numel, the others at bucket_numel."""
    def body():
        c = communicator(comm)
        # 6-8-3 MLP in launch order: W2,b2 (27) reach 5; then b1 (8) + W1 (48) together reach 40
        algo = make_algorithm("allreduce_sgd", make_model(), c, overlap=True, first_bucket_numel=5, bucket_numel=40)
        assert algo.buckets.ranges == [[56, 83], [0, 56]] and algo.buckets.size == [2, 2]
        default = make_algorithm("allreduce_sgd", make_model(), communicator(comm), overlap=True)
        assert (default.config.first_bucket_numel, default.config.bucket_numel) == (2**18, 25 * 2**18)
        with pytest.raises(ValueError, match=r"first_bucket_numel must be in \[1, inf\)"):
            make_algorithm("allreduce_sgd", make_model(), c, first_bucket_numel=0)

    run_all(comm, body)


def test_overlap_refuses_a_second_backward_and_keeps_the_first(comm):
    def body():
        kwargs = {"lr": 0.1, "overlap": True, "bucket_numel": 5}
        algo = make_algorithm("allreduce_sgd", make_model(), communicator(comm), **kwargs)
        algo.zero_grad()
        loss(algo.model, comm.Get_rank(), 0).backward()
        with pytest.raises(RuntimeError, match="one backward pass per step"):
            loss(algo.model, comm.Get_rank(), 1).backward()
        algo.step()
        train(algo, 2)
        twin = make_algorithm("allreduce_sgd", make_model(), communicator(comm), **kwargs)
        train(twin, 3)
        assert torch.equal(algo.flat.data, twin.flat.data)

    run_all(comm, body)


@pytest.mark.parametrize("overlap", [False, True])
def test_allreduce_sgd_state_round_trip_is_bit_exact(comm, overlap):
    def body():
        kwargs = {"lr": 0.05, "momentum": 0.9, "overlap": overlap, "bucket_numel": 5}
        straight = make_algorithm("allreduce_sgd", make_model(), communicator(comm), **kwargs)
        train(straight, 6)
        first = make_algorithm("allreduce_sgd", make_model(), communicator(comm), **kwargs)
        train(first, 3)
        resumed = make_algorithm("allreduce_sgd", make_model(seed=7), communicator(comm), **kwargs)
        resumed.load_state_dict(first.state_dict())
        train(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)

    run_all(comm, body)


def test_allreduce_sgd_bad_config_fails_on_every_rank(comm):
    def body():
        c = communicator(comm)
        with pytest.raises(ValueError, match=r"bucket_numel must be in \[1, inf\)"):
            make_algorithm("allreduce_sgd", make_model(), c, bucket_numel=0)
        with pytest.raises(ValueError, match="overlap must be a bool"):
            make_algorithm("allreduce_sgd", make_model(), c, overlap="yes")

    run_all(comm, body)

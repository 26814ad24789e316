"""shard=True over nodes (emulated: ranks_per_node=2): the two-level sharded exchange in the allreduce's order
(``shard_order="exact"``) trains bit for bit as the unsharded two-level exchange and, with ``full_grad``, leaves
the same p.grad; each rank owns its sub-shard of its node shard, and the 4-bit exchange between nodes sends the
hand-computed bytes."""

import math

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import make_model, train
from .conftest import run_all

pytestmark = pytest.mark.mpi


def _nodes(comm):
    """The world as nodes of 2 consecutive ranks (skips where they do not divide it)."""
    if comm.Get_size() % 2:
        pytest.skip("nodes of 2 ranks need an even world")
    return Communicator(comm, topo.ring(comm.Get_size()), ranks_per_node=2)


@pytest.mark.parametrize("name, options", [("allreduce_sgd", {"momentum": 0.9, "weight_decay": 1e-3}),
                                           ("allreduce_adam", {"weight_decay": 0.01})])
def test_two_level_shards_train_as_the_unsharded_two_levels(comm, name, options):
    def body():
        whole = make_algorithm(name, make_model(seed=comm.Get_rank()), _nodes(comm), hierarchical=True, **options)
        shards = make_algorithm(name, make_model(seed=comm.Get_rank()), _nodes(comm), hierarchical=True,
                                shard=True, shard_order="exact", full_grad=True, **options)
        train(whole, 10)
        train(shards, 10)
        assert torch.equal(shards.flat.data, whole.flat.data)
        assert torch.equal(shards.flat.grad, whole.flat.grad)  # full_grad: the averaged gradient, gathered
        # rank (node a, local j) owns sub-shard a of node shard j: local rank j's half, then node a's part of it
        n, rank, d = comm.Get_size(), comm.Get_rank(), whole.flat.numel
        nodes, local, node = n // 2, rank % 2, rank // 2
        half = [d - d // 2, d // 2] if d % 2 else [d // 2, d // 2]
        start = sum(half[:local])
        c = 8 * math.ceil(half[local] / (8 * nodes))
        lo, hi = start + min(node * c, half[local]), start + min((node + 1) * c, half[local])
        assert (shards.sharding.lo, shards.sharding.hi) == (lo, hi)

    run_all(comm, body)


def test_four_bit_two_level_sends_one_payload_per_other_node(comm):
    def body():
        n = comm.Get_size()
        algo = make_algorithm("allreduce_sgd", make_model(seed=comm.Get_rank()), _nodes(comm), hierarchical=True,
                              shard=True, shard_bits=4)
        nodes, d = n // 2, algo.flat.numel
        longest = max(d - d // 2, d // 2)
        c = 8 * math.ceil(longest / (8 * nodes))
        row = 4 * math.ceil(c / 512) + math.ceil(c * 4 / 8)
        before = algo.comm.ledger.bytes_sent("alltoall")
        train(algo, 2)
        assert algo.comm.ledger.bytes_sent("alltoall") - before == 2 * (nodes - 1) * row
        sums = comm.allgather(algo.flat.data.double().sum().item())
        assert len(set(sums)) == 1, sums

    run_all(comm, body)


def test_a_quantized_two_level_shard_refuses_another_world_size(comm):
    """Its reduce-scatter residual belongs to a node shard (averaging the saved ones would mix node shards); the
    exact exchange keeps none and resizes."""
    def body():
        quantized = make_algorithm("allreduce_sgd", make_model(), _nodes(comm), hierarchical=True, shard=True,
                                   shard_bits=4)
        exact = make_algorithm("allreduce_sgd", make_model(), _nodes(comm), hierarchical=True, shard=True)
        assert "cannot change world size" in quantized.resize_refusal()
        assert exact.resize_refusal() == ""

    run_all(comm, body)

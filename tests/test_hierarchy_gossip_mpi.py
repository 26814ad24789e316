"""Two-level gossip (``hierarchical`` on D-PSGD, D², PD-SGDM and CHOCO) over emulated nodes: a float64
reference of D-PSGD with the mixing matrix ``W_nodes ⊗ (1/L) 1 1ᵀ`` and one of CHOCO between node averages
step by step, each full-precision method against its flat self on that matrix, lossless CHOCO against
D-PSGD, one rank per node bit for bit the flat run, the Ledger and the modelled clock per link class,
and the refusals.

Runs at 1, 2 and 4 ranks: 4 as 2 nodes x 2 (and 1 x 4, 4 x 1), 2 as 1 x 2 and 2 x 1.
"""

import numpy as np
import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm

from .algo_common import grad_at, make_model, train
from .conftest import run_all
from .test_hierarchy_mpi import INTER, INTRA, close, communicator, node_sizes, second_step

pytestmark = pytest.mark.mpi

OPTIONS = {"lr": 0.1, "weight_decay": 1e-2}


def two_level_matrix(node_graph, k: int) -> np.ndarray:
    """``W_nodes ⊗ (1/k) 1 1ᵀ``: the mixing matrix of one two-level round, ranks ordered by node."""
    return np.kron(node_graph.W, np.full((k, k), 1.0 / k))


@pytest.mark.parametrize("kind", ["ring", "exponential"])
def test_two_level_dpsgd_matches_float64_reference_step_by_step(comm, kind):
    """x_i <- sum_j W[i, j] x_j - lr (g_i(x_i) + wd x_i) with W the two-level matrix, in float64 from the ranks'
    float32 iterates, at every node size; every rank of a node leaves the mixing with the same model."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        for k in node_sizes(n):
            algo = make_algorithm("dpsgd", make_model(seed=rank), communicator(comm, k), hierarchical=True,
                                  node_topology=kind, **OPTIONS)
            assert algo.node_gossip is not None
            W = torch.tensor(two_level_matrix(topo.build(kind, n // k), k))
            assert np.allclose(W.sum(0), 1) and np.allclose(W.sum(1), 1)
            for t in range(4):
                xs = torch.stack([x.double() for x in comm.allgather(algo.flat.data.clone())])
                g = grad_at(algo.flat.data.clone(), rank, t).double() + OPTIONS["weight_decay"] * xs[rank]
                expected = W[rank] @ xs - OPTIONS["lr"] * g
                train(algo, 1)
                assert close(algo.flat.data, expected), (k, t, float((algo.flat.data.double() - expected).norm()))

    run_all(comm, body)


# every method with the two-level gossip, with options that reach its paths (PD-SGDM: a round every second
# step, the momentum buffers mixed too)
METHODS = {"dpsgd": OPTIONS, "d2": OPTIONS,
           "pdsgdm": {**OPTIONS, "momentum": 0.9, "period": 2, "order": "cta", "average_momentum": True}}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_two_level_equals_flat_on_its_matrix_and_one_rank_per_node_is_flat(comm, name):
    """The two-level run equals the flat method on the topology of W_nodes ⊗ (1/L) 1 1ᵀ to float32 summation
    order; with one rank per node it is the flat run on the same graph bit for bit, and auto leaves that layout
    flat."""
    options = METHODS[name]

    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        flat = make_algorithm(name, make_model(seed=rank), communicator(comm, 1), hierarchical=False, **options)
        auto_one = make_algorithm(name, make_model(seed=rank), communicator(comm, 1), **options)
        forced_one = make_algorithm(name, make_model(seed=rank), communicator(comm, 1), hierarchical=True,
                                    **options)
        assert flat.node_gossip is None and auto_one.node_gossip is None and forced_one.node_gossip is not None
        for algo in (flat, auto_one, forced_one):
            train(algo, 5)
        assert torch.equal(auto_one.flat.data, flat.flat.data) and torch.equal(forced_one.flat.data, flat.flat.data)
        for k in node_sizes(n)[1:]:
            auto = make_algorithm(name, make_model(seed=rank), communicator(comm, k), **options)
            assert (auto.node_gossip is not None) == (n // k > 1), k
            forced = make_algorithm(name, make_model(seed=rank), communicator(comm, k), hierarchical=True,
                                    **options)
            matrix = topo.from_matrix(two_level_matrix(topo.ring(n // k), k), name="two-level")
            same_maths = make_algorithm(name, make_model(seed=rank), type(flat.comm)(comm, matrix),
                                        hierarchical=False, **options)
            train(forced, 5)
            train(same_maths, 5)
            torch.testing.assert_close(forced.flat.data, same_maths.flat.data, rtol=1e-5, atol=1e-7)
            if not np.allclose(matrix.W, topo.ring(n).W):  # another mixing matrix than the flat ring's
                assert not torch.allclose(forced.flat.data, flat.flat.data, rtol=1e-4), k

    run_all(comm, body)


def test_two_level_choco_matches_float64_reference_step_by_step(comm):
    """CHOCO between nodes on node averages (order cta, top-50 % codec, gamma 0.6): per node a and shard j,
    q = C(x̄_a[j] - x̂_a[j]), x̂_a += q, s_a += sum_b W_nodes[a, b] q_b, x̄_a[j] += gamma (s_a - x̂_a), then each
    rank steps from its node's x̄ with its own gradient; the sums in float64, the codec's own rounding."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        gamma, lr = 0.6, OPTIONS["lr"]
        for k in node_sizes(n):
            nodes = n // k
            algo = make_algorithm("choco", make_model(seed=0), communicator(comm, k), hierarchical=True,
                                  order="cta", codec="topk", codec_options={"ratio": 0.5}, gamma=gamma, lr=lr)
            W = torch.tensor(topo.ring(nodes).W)
            counts = algo.node_gossip.levels.counts
            bounds = [(sum(counts[:j]), sum(counts[:j + 1])) for j in range(k)]
            codec = algo.gossip.codec
            x0 = algo.flat.data.double().clone()
            own = [x0.clone() for _ in range(nodes)]      # x̂_a (the full vector, shard by shard)
            mixed = [x0.clone() for _ in range(nodes)]    # s_a
            for t in range(3):
                xs = torch.stack([x.double() for x in comm.allgather(algo.flat.data.clone())])
                means = [xs[a * k:(a + 1) * k].mean(0) for a in range(nodes)]
                for lo, hi in bounds:
                    qs = []
                    for a in range(nodes):
                        diff = (means[a][lo:hi] - own[a][lo:hi]).float()
                        qs.append(codec.decode(codec.encode(diff), hi - lo, out=torch.empty_like(diff)).double())
                    for a in range(nodes):
                        own[a][lo:hi] += qs[a]
                        mixed[a][lo:hi] += sum(W[a, b] * qs[b] for b in range(nodes))
                    for a in range(nodes):
                        means[a][lo:hi] += gamma * (mixed[a][lo:hi] - own[a][lo:hi])
                g = grad_at(algo.flat.data.clone(), rank, t).double()
                expected = means[rank // k] - lr * g
                train(algo, 1)
                assert close(algo.flat.data, expected, rel=1e-5), (k, t, float((algo.flat.data.double() - expected)
                                                                                .norm()))

    run_all(comm, body)


def test_two_level_lossless_choco_is_two_level_dpsgd(comm):
    """CHOCO with the identity codec, gamma 1 and order cta is D-PSGD, flat and in two levels, bit for bit."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        for k in node_sizes(n):
            dpsgd = make_algorithm("dpsgd", make_model(seed=rank), communicator(comm, k), hierarchical=True, lr=0.1)
            choco = make_algorithm("choco", make_model(seed=rank), communicator(comm, k), hierarchical=True,
                                   lr=0.1, codec="identity", gamma=1.0, order="cta")
            train(dpsgd, 4)
            train(choco, 4)
            assert torch.equal(choco.flat.data, dpsgd.flat.data), k

    run_all(comm, body)


@pytest.mark.parametrize("kind", ["ring", "exponential"])
def test_ledger_and_clock_per_link_class(comm, kind):
    """One step books (L - 1)/L of the model twice inside the node and the 1/L shard to each neighbouring node;
    its modelled time is reduce-scatter + neighbour exchange between nodes + allgather."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        for k in node_sizes(n):
            algo, modelled = second_step(comm, k, "dpsgd", node_topology=kind)
            stats, d = algo.stats(), algo.flat.numel
            counts = algo.node_gossip.levels.counts
            mine = counts[rank % k]
            graph = topo.build(kind, n // k)
            k_out, k_in = len(graph.out_neighbors(rank // k)), len(graph.in_neighbors(rank // k))
            assert stats["step_bytes_sent_intra"] == 4 * (d - mine) + 4 * (k - 1) * mine, (k, stats)
            assert stats["step_bytes_sent_inter"] == 4 * mine * k_out, (k, stats)
            expected = (INTRA.reduce_scatter(4 * d, k) + INTER.neighbor(4 * mine * k_out, 4 * mine * k_in)
                        + INTRA.allgatherv(4 * max(counts), k))
            assert modelled == pytest.approx(expected, rel=1e-9, abs=1e-15), k
            sent_to = {peer for (_, peer), nbytes in algo.comm.ledger.sent.items() if nbytes}
            node_peers = {b * k + rank % k for b in graph.out_neighbors(rank // k)}
            members = set(range(rank - rank % k, rank - rank % k + k)) - {rank}
            assert sent_to == node_peers | members, (k, sent_to)  # booked as the world's ranks

    run_all(comm, body)


def test_auto_on_one_host_keeps_no_node_communicator(comm):
    """hierarchical auto on the real layout (every rank on this host: one node) runs flat and keeps no node or
    cross-node communicator: an algorithm built per test case must not use up MPI's communicators."""
    def body():
        for name in ("dpsgd", "choco", "allreduce_adam", "allreduce_sgd"):
            c = communicator(comm, None)
            algo = make_algorithm(name, make_model(), c, lr=0.1)
            assert c.spans_nodes() is False and c._layout is None, name  # the layout was never built
            assert getattr(algo, "node_gossip", None) is None and getattr(algo, "two_level", None) is None

    run_all(comm, body)


def test_bad_settings_are_refused(comm):
    def body():
        n = comm.Get_size()
        with pytest.raises(ValueError, match="overlap"):
            make_algorithm("dpsgd", make_model(), communicator(comm, 1), hierarchical=True, overlap=True)
        with pytest.raises(ValueError, match="node_topology must be one of"):
            make_algorithm("dpsgd", make_model(), communicator(comm, 1), hierarchical=True, node_topology="mesh")
        custom = type(communicator(comm, 1))(comm, topo.from_matrix(topo.ring(n).W, name="custom"), ranks_per_node=1)
        with pytest.raises(ValueError, match="has no form over nodes: set node_topology"):
            make_algorithm("dpsgd", make_model(), custom, hierarchical=True)
        auto = make_algorithm("dpsgd", make_model(), communicator(comm, 1), hierarchical="auto", overlap=True)
        assert auto.node_gossip is None and auto.config.hierarchical is None

    run_all(comm, body)

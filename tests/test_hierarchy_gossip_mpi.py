"""Two-level gossip (``hierarchical`` on D-PSGD, D², PD-SGDM, CHOCO, DCD and Moniqua) over emulated nodes: a float64
reference of D-PSGD with the mixing matrix ``W_nodes ⊗ (1/L) 1 1ᵀ`` and ones of CHOCO, DCD and Moniqua between nodes
step by step, each full-precision method against its flat self on that matrix, lossless CHOCO against
D-PSGD, one rank per node bit for bit the flat run, the Ledger and the modelled clock per link class,
and the refusals.

Runs at 1, 2 and 4 ranks: 4 as 2 nodes x 2 (and 1 x 4, 4 x 1), 2 as 1 x 2 and 2 x 1. Checks followed by more
collectives agree across the ranks first (``assert_all``), so a failure on some ranks cannot hang the others.
"""

import numpy as np
import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.algorithms.shared.hierarchy import shard_layers

from .algo_common import grad_at, make_model, train
from .conftest import assert_all, run_all
from .moniqua_reference import reference_mix
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
                assert_all(comm, close(algo.flat.data, expected), (k, t, float((algo.flat.data.double() - expected)
                                                                                 .norm())))

    run_all(comm, body)


# every method with the two-level gossip whose round is linear, with options that reach its paths (PD-SGDM: a
# round every second step, the momentum buffers mixed too; PowerGossip at full rank, where its low-rank
# differences are exact; Moniqua-D² lossless)
METHODS = {"dpsgd": OPTIONS, "d2": OPTIONS,
           "pdsgdm": {**OPTIONS, "momentum": 0.9, "period": 2, "order": "cta", "average_momentum": True},
           "powergossip": {**OPTIONS, "momentum": 0.9, "rank": 8, "min_compression_rate": 0.0, "order": "cta",
                           "epsilon": 0.0, "broadcast_init": False},  # ranks apart: no zero difference
           "moniqua_d2": {**OPTIONS, "bits": 32, "parts": 1}}
TOLERANCE = {"powergossip": {"rtol": 1e-5, "atol": 1e-5}}  # QR of each difference: not a sum's rounding


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
            torch.testing.assert_close(forced.flat.data, same_maths.flat.data,
                                       **TOLERANCE.get(name, {"rtol": 1e-5, "atol": 1e-7}))
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
                assert_all(comm, close(algo.flat.data, expected, rel=1e-5),
                           (k, t, float((algo.flat.data.double() - expected).norm())))

    run_all(comm, body)


@pytest.mark.parametrize("codec", ["topk", "identity"])
def test_two_level_dcd_matches_float64_reference_step_by_step(comm, codec):
    """DCD between nodes (top-50 % codec, and the lossless path): every rank of node a holds y_a; per shard,
    half_a = W_nodes[a, a] (y_a - ŷ_a) + s_a + (1/L) sum_{i on a} u_i with u_i = -lr (g_i(y_a) + wd y_a), then
    q_a = C(half_a - ŷ_a), ŷ_a += q_a, s_a += sum_b W_nodes[a, b] q_b, y_a = ŷ_a (lossless: y_a = W_nodes y +
    mean u); the sums in float64, the codec's own rounding. The ranks start from different models (no
    broadcast), so the node average at the start is checked too."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        lr, wd = OPTIONS["lr"], OPTIONS["weight_decay"]
        for k in node_sizes(n):
            nodes = n // k
            starts = torch.stack([x.double() for x in comm.allgather(
                torch.nn.utils.parameters_to_vector(make_model(seed=rank).parameters()).detach())])
            algo = make_algorithm("dcd", make_model(seed=rank), communicator(comm, k), hierarchical=True,
                                  codec=codec, codec_options={"ratio": 0.5} if codec == "topk" else {},
                                  broadcast_init=False, **OPTIONS)
            W = torch.tensor(topo.ring(nodes).W)
            ys = [starts[a * k:(a + 1) * k].mean(0) for a in range(nodes)]
            assert_all(comm, close(algo.flat.data, ys[rank // k]), k)
            own = [y.clone() for y in ys]                                   # ŷ_a (the full vector)
            mixed = [sum(W[a, b] * ys[b] for b in range(nodes)) for a in range(nodes)]   # s_a
            counts = algo.node_gossip.levels.counts
            bounds = [(sum(counts[:j]), sum(counts[:j + 1])) for j in range(k)]
            lossy = codec != "identity"
            for t in range(3):
                here = algo.flat.data.clone()
                g = grad_at(here, rank, t).double() + wd * here.double()
                us = torch.stack([-lr * u for u in comm.allgather(g)])
                halves = []
                for a in range(nodes):
                    mean_u = us[a * k:(a + 1) * k].mean(0)
                    if lossy:
                        halves.append(W[a, a] * (ys[a] - own[a]) + mixed[a] + mean_u)
                    else:
                        halves.append(sum(W[a, b] * ys[b] for b in range(nodes)) + mean_u)
                if lossy:
                    for lo, hi in bounds:
                        qs = []
                        for a in range(nodes):
                            diff = (halves[a][lo:hi] - own[a][lo:hi]).float()
                            qs.append(algo.gossip.codec.decode(algo.gossip.codec.encode(diff), hi - lo,
                                                               out=torch.empty_like(diff)).double())
                        for a in range(nodes):
                            own[a][lo:hi] += qs[a]
                            mixed[a][lo:hi] += sum(W[a, b] * qs[b] for b in range(nodes))
                    ys = [o.clone() for o in own]
                else:
                    ys = halves
                train(algo, 1)
                assert_all(comm, close(algo.flat.data, ys[rank // k], rel=1e-5),
                           (k, t, float((algo.flat.data.double() - ys[rank // k]).norm())))

    run_all(comm, body)


@pytest.mark.parametrize("name", ["moniqua", "moniqua_d2"])
def test_two_level_moniqua_with_one_rank_per_node_is_flat_moniqua(comm, name):
    """One rank per node: each shard is the whole model, the node's average and its largest step are the rank's
    own, so two-level Moniqua and Moniqua-D² (default options: 4 bits on rotating quarters, observed theta,
    dither, guard) are their flat selves bit for bit; auto leaves that layout flat."""
    def body():
        rank = comm.Get_rank()
        flat = make_algorithm(name, make_model(seed=rank), communicator(comm, 1), hierarchical=False, lr=0.1)
        auto = make_algorithm(name, make_model(seed=rank), communicator(comm, 1), lr=0.1)
        forced = make_algorithm(name, make_model(seed=rank), communicator(comm, 1), hierarchical=True, lr=0.1)
        assert auto.node_gossip is None and forced.node_gossip is not None
        for algo in (flat, auto, forced):
            train(algo, 6)
        assert torch.equal(forced.flat.data, flat.flat.data) and torch.equal(auto.flat.data, flat.flat.data)
        assert forced.stats()["theta_max"] == flat.stats()["theta_max"]

    run_all(comm, body)


def test_two_level_moniqua_matches_reference_between_node_averages(comm):
    """Moniqua's round between node averages, shard by shard (4 bits, rotating halves of each tensor's part in
    the shard, a fixed theta, the shared dither keyed by the shard's coordinates): the pure-torch reference's
    mix of the N node averages on the shard's tensor parts, then each rank's own step lr (g_i + wd x_i)."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        lr, wd = OPTIONS["lr"], OPTIONS["weight_decay"]
        for k in node_sizes(n):
            nodes = n // k
            algo = make_algorithm("moniqua", make_model(seed=rank), communicator(comm, k), hierarchical=True,
                                  bits=4, parts=2, theta=1.0, gamma=1.0, **OPTIONS)
            W = torch.tensor(topo.ring(nodes).W, dtype=torch.float32)
            counts = algo.node_gossip.levels.counts
            bounds = [(sum(counts[:j]), sum(counts[:j + 1])) for j in range(k)]
            for t in range(4):
                xs = torch.stack(comm.allgather(algo.flat.data.clone()))
                means = torch.stack([xs[a * k:(a + 1) * k].sum(0) / k for a in range(nodes)])
                for lo, hi in bounds:
                    sizes = [part.numel for part in shard_layers(algo.flat.layers, lo, hi)]
                    theta = torch.full((len(sizes),), 1.0, dtype=torch.float64)
                    means[:, lo:hi] = reference_mix(means[:, lo:hi].contiguous(), W, t, theta, 4, 2, 1.0,
                                                    sizes=sizes)[0]
                g = grad_at(algo.flat.data.clone(), rank, t) + wd * algo.flat.data
                expected = means[rank // k] - lr * g
                train(algo, 1)
                ok = algo.stats()["wrapped_parts"] == 0 and torch.allclose(algo.flat.data, expected, rtol=1e-5,
                                                                           atol=1e-6)
                assert_all(comm, ok, (k, t, float((algo.flat.data - expected).abs().max())))

    run_all(comm, body)


def test_two_level_moniquas_step_statistic_is_the_largest_on_the_node(comm):
    """theta's step statistic for a shard is, per tensor part, the largest |lr g_i| over the node's ranks (the
    node average moves by at most that), not this rank's own: each rank's gradient here is (rank + 1) times
    one vector, so the node's largest is its last rank's."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        lr = 0.1
        for k in node_sizes(n):
            algo = make_algorithm("moniqua", make_model(seed=0), communicator(comm, k), hierarchical=True, lr=lr,
                                  momentum=0.0)
            base = torch.linspace(-1.0, 2.0, algo.flat.numel)
            got = algo.node_modulo.step_sizes(base * (rank + 1), lr, algo.optimizer)
            lo, hi = algo.node_gossip.levels.lo, algo.node_gossip.levels.hi
            last = rank - rank % k + k  # the node's last rank, plus one
            expected = [lr * last * float(base[lo + part.offset:lo + part.offset + part.numel].abs().max())
                        for part in shard_layers(algo.flat.layers, lo, hi)]
            assert_all(comm, np.allclose(got.numpy(), expected, rtol=1e-6), (k, got, expected))

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
            assert_all(comm, torch.equal(choco.flat.data, dpsgd.flat.data), k)

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
            assert_all(comm, stats["step_bytes_sent_intra"] == 4 * (d - mine) + 4 * (k - 1) * mine
                       and stats["step_bytes_sent_inter"] == 4 * mine * k_out, (k, stats))
            expected = (INTRA.reduce_scatter(4 * d, k) + INTER.neighbor(4 * mine * k_out, 4 * mine * k_in)
                        + INTRA.allgatherv(4 * max(counts), k))
            assert_all(comm, modelled == pytest.approx(expected, rel=1e-9, abs=1e-15), (k, modelled, expected))
            sent_to = {peer for (_, peer), nbytes in algo.comm.ledger.sent.items() if nbytes}
            node_peers = {b * k + rank % k for b in graph.out_neighbors(rank // k)}
            members = set(range(rank - rank % k, rank - rank % k + k)) - {rank}
            assert_all(comm, sent_to == node_peers | members, (k, sent_to))  # booked as the world's ranks

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

"""Two-level centralized exchange over emulated nodes (``ranks_per_node``): the layout, AllReduce-SGD against
flat and a float64 reference, EF-SignSGD's two-level step against a float64 reference step by step, the
Ledger and the modelled clock per link class, N + N == 2N resume (D-PSGD's two-level gossip too), and the
refusal of unequal nodes.

Runs at 1, 2 and 4 ranks: 4 as 2 nodes x 2 (and 1 x 4, 4 x 1), 2 as 1 x 2 and 2 x 1, 1 as one node of one
(where auto leaves the hierarchy off). The unequal-nodes refusal needs 3 ranks or more.
"""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import RANKS_PER_NODE_ENV, Communicator
from mpicomm.net import CostModel, parse_net
from mpicomm.training.loop import TrainConfig, run_training

from .algo_common import grad_at, initial_flat, make_model, train
from .conftest import run_all
from .test_resume_mpi import TinyTask

pytestmark = pytest.mark.mpi

NET = "intra=1000gbit,1us,inter=10gbit,5us"  # modelled costs of microseconds: visible in the books, not the wall


def communicator(comm, k, net=None):
    return Communicator(comm, topo.ring(comm.Get_size()), ranks_per_node=k, net=net)


def node_sizes(n):
    """Ranks per node to emulate at world size ``n`` (every divisor of n among 1, 2, 4)."""
    return [k for k in (1, 2, 4) if n % k == 0 and k <= n]


def close(a, b, rel=1e-6):
    """``||a - b|| <= rel ||b||`` in float64 (plus a hair for vectors that are zero)."""
    a, b = a.double(), b.double()
    return float((a - b).norm()) <= rel * float(b.norm()) + 1e-12


def test_layout_of_emulated_nodes(comm):
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        for k in node_sizes(n):
            c = communicator(comm, k)
            layout = c.nodes
            assert c.node_layout() is layout  # built once
            assert (layout.local_rank, layout.local_size, layout.node_index, layout.n_nodes) == (
                rank % k, k, rank // k, n // k)
            assert layout.members == tuple(range(rank - rank % k, rank - rank % k + k))
            assert layout.node.size == k and layout.cross.size == n // k
            assert layout.node.link == "intra" and layout.cross.link == "inter"
            assert layout.two_level == (n // k > 1 and k > 1)
            assert sum(layout.counts(83)) == 83 and layout.shard(83)[1] - layout.shard(83)[0] == layout.counts(83)[
                layout.local_rank]
            # The children book against the world's ranks: one allgather inside the node reaches exactly its members.
            layout.node.allgather(torch.ones(3))
            assert {peer for (_, peer) in c.ledger.sent} == set(layout.members) - {rank}
            assert c.ledger.bytes_sent_on("intra") == 12 * (k - 1) and c.ledger.bytes_sent_on("inter") == 0

    run_all(comm, body)


def reference_allreduce_sgd64(n, steps, lr, momentum, weight_decay):
    """AllReduce-SGD in float64 from float32 gradients: x <- x - lr m, m <- mu m + mean_r g_r(x) + wd x."""
    x = initial_flat().double()
    m = torch.zeros_like(x)
    for t in range(steps):
        g = torch.stack([grad_at(x.float(), r, t).double() for r in range(n)]).mean(0) + weight_decay * x
        m = momentum * m + g if t else g
        x = x - lr * m
    return x


def test_hierarchical_allreduce_sgd_equals_flat_and_float64(comm):
    def body():
        n = comm.Get_size()
        options = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}
        flat = make_algorithm("allreduce_sgd", make_model(seed=comm.Get_rank()), communicator(comm, 1),
                              hierarchical=False, **options)
        assert flat.two_level is None
        train(flat, 5)
        expected = reference_allreduce_sgd64(n, 5, **options)
        assert close(flat.flat.data, expected)
        for k in node_sizes(n):
            auto = make_algorithm("allreduce_sgd", make_model(seed=comm.Get_rank()), communicator(comm, k), **options)
            assert (auto.two_level is not None) == (k > 1 and n // k > 1), (k, auto.two_level)
            forced = make_algorithm("allreduce_sgd", make_model(seed=comm.Get_rank()), communicator(comm, k),
                                    hierarchical=True, **options)
            assert forced.two_level is not None
            for algo in (auto, forced):
                train(algo, 5)
                if algo.two_level is None:
                    assert torch.equal(algo.flat.data, flat.flat.data), k  # off: the flat step, bit for bit
                torch.testing.assert_close(algo.flat.data, flat.flat.data, rtol=1e-5, atol=1e-7)
                assert close(algo.flat.data, expected), (k, float((algo.flat.data.double() - expected).norm()))
                everyone = comm.allgather(algo.flat.data.clone())
                assert all(torch.equal(x, everyone[0]) for x in everyone), f"ranks' parameters differ at k={k}"

    run_all(comm, body)


@pytest.mark.parametrize("name,warm_up_user", [("allreduce_adam", ("apmsqueeze", {"warmup_steps": 2})),
                                               ("lamb", ("onebit_lamb", {"freeze_step": 2}))])
def test_hierarchical_adam_and_lamb_equal_flat(comm, name, warm_up_user):
    """AllReduce-Adam's and LAMB's two-level sum: the flat step to float32 summation order; auto on when two
    levels differ, for the 1-bit method whose warm-up runs the same code too."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        options = {"lr": 0.01, "weight_decay": 1e-2}
        flat = make_algorithm(name, make_model(seed=rank), communicator(comm, 1), hierarchical=False, **options)
        train(flat, 5)
        for k in node_sizes(n):
            auto = make_algorithm(name, make_model(seed=rank), communicator(comm, k), **options)
            assert (auto.two_level is not None) == (k > 1 and n // k > 1), k
            forced = make_algorithm(name, make_model(seed=rank), communicator(comm, k), hierarchical=True,
                                    **options)
            for algo in (auto, forced):
                train(algo, 5)
                if algo.two_level is None:
                    assert torch.equal(algo.flat.data, flat.flat.data), k
                torch.testing.assert_close(algo.flat.data, flat.flat.data, rtol=1e-5, atol=1e-6)
            user, user_options = warm_up_user  # the 1-bit method whose warm-up runs this code: the same choice
            onebit = make_algorithm(user, make_model(), communicator(comm, k), lr=0.01, **user_options)
            assert (onebit.two_level is None) == (auto.two_level is None), k

    run_all(comm, body)


def test_two_level_ef_signsgd_matches_float64_reference_step_by_step(comm):
    """Node sums of each shard, p = lr s + e, Delta = mean|p| sign(p), e <- p - Delta, x <- x - sum_a Delta_a / n."""
    def body():
        n, rank, lr = comm.Get_size(), comm.Get_rank(), 0.05
        k = 2 if n % 2 == 0 else 1
        algo = make_algorithm("ef_signsgd", make_model(seed=rank), communicator(comm, k), lr=lr, hierarchical=True)
        two = algo.two_level
        d, counts = algo.flat.numel, two.counts
        starts = [sum(counts[:j]) for j in range(k)]
        assert algo.error.numel() == counts[rank % k]
        for t in range(4):
            x = algo.flat.data.double().clone()
            errors = [e.double() for e in comm.allgather(algo.error.clone())]
            grads = [grad_at(algo.flat.data.clone(), r, t).double() for r in range(n)]
            update, new_errors = torch.zeros(d, dtype=torch.float64), {}
            for j in range(k):
                lo, hi = starts[j], starts[j] + counts[j]
                for a in range(n // k):
                    s = sum(grads[a * k + i][lo:hi] for i in range(k))
                    p = lr * s + errors[a * k + j]
                    delta = p.abs().mean() * torch.where(p >= 0, 1.0, -1.0).double()
                    new_errors[a * k + j] = p - delta
                    update[lo:hi] += delta
            expected = x - update / n
            train(algo, 1)
            assert close(algo.flat.data, expected), (t, float((algo.flat.data.double() - expected).norm()))
            assert close(algo.error, new_errors[rank]), t

    run_all(comm, body)


LINKS = CostModel(parse_net(NET))
INTRA, INTER = LINKS.on("intra"), LINKS.on("inter")  # the cost model of each link class under NET


def second_step(comm, k, name, **options):
    """A two-level ``name`` at ``k`` ranks per node under NET after two steps, and the seconds the second one
    was modelled at (the first warms up)."""
    c = communicator(comm, k, net=NET)
    algo = make_algorithm(name, make_model(), c, lr=0.1, hierarchical=True, **options)
    train(algo, 1)
    modelled = c.clock.modelled_s
    train(algo, 1)
    return algo, c.clock.modelled_s - modelled


@pytest.mark.parametrize("name", ["allreduce_sgd", "qsgd"])
def test_ledger_and_clock_per_link_class(comm, name):
    """One step's bytes on each link class and its modelled time are the two-level formulas; flat books all inter."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        intra, inter = INTRA, INTER
        for k in node_sizes(n):
            algo, modelled = second_step(comm, k, name)
            stats, d, nodes = algo.stats(), algo.flat.numel, n // k
            counts = algo.two_level.counts
            mine = counts[rank % k]
            intra_bytes = 4 * (d - mine) + 4 * (k - 1) * mine  # reduce-scatter out, then allgather of my shard
            if name == "allreduce_sgd":
                inter_bytes = 2 * (nodes - 1) * 4 * mine // nodes
                inter_cost = inter.allreduce(4 * mine, nodes)
            else:
                payload = algo.codec.payload_bytes(mine)
                inter_bytes = (nodes - 1) * payload
                inter_cost = inter.allgather(payload, nodes)
            assert stats["step_bytes_sent_intra"] == intra_bytes, (k, stats)
            assert stats["step_bytes_sent_inter"] == inter_bytes, (k, stats)
            assert stats["step_bytes_sent"] == intra_bytes + inter_bytes
            expected = intra.reduce_scatter(4 * d, k) + inter_cost + intra.allgatherv(4 * max(counts), k)
            assert modelled == pytest.approx(expected, rel=1e-9, abs=1e-15), k
        flat = communicator(comm, None, net=NET)
        algo = make_algorithm(name, make_model(), flat, lr=0.1, hierarchical=False)
        train(algo, 2)
        totals = flat.ledger.totals()
        assert totals["bytes_sent_intra"] == 0 and totals["bytes_sent_inter"] == totals["bytes_sent"]

    run_all(comm, body)


SCHEDULES = {  # the 1-bit methods cross into their compressed phase (0/1 Adam into its local steps) before step
    # 4; the local-update methods sync at steps 3 and 6 (and carry an error or outer momentum across the save)
    "apmsqueeze": {"warmup_steps": 2},
    "zeroone_adam": {"var_freeze_step": 5, "var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 2},
    "onebit_lamb": {"freeze_step": 2},
    "diloco": {"period": 3, "codec": "uniform", "codec_options": {"bits": 4}},
    "sparseloco": {"period": 3, "density": 0.25, "chunk": 16},
    "streaming_diloco": {"period": 3, "fragments": 2, "error_feedback": True},
    "decentralized_diloco": {"period": 3},
}


def _run(comm, name, k, out_dir, **cfg):
    task = TinyTask(comm.Get_rank())
    c = communicator(comm, k)
    algo = make_algorithm(name, task.model, c, hierarchical=True, **SCHEDULES.get(name, {}))
    config = TrainConfig(epochs=3, max_steps=8, lr=0.05, log_every=2, out_dir=out_dir, progress=False,
                         handle_signals=False, **cfg)
    summary = run_training(task, algo, config)
    return algo, summary


def two_levels(algo):
    """The algorithm's two-level exchange: the centralized ``two_level``, the gossip's ``node_gossip`` or Streaming
    DiLoCo's first fragment's."""
    return (getattr(algo, "two_level", None) or getattr(algo, "node_gossip", None)
            or next(iter(getattr(algo, "levels", [])), None))


@pytest.mark.parametrize("name", ["allreduce_sgd", "qsgd", "ef_signsgd", "allreduce_adam", "lamb", "hsq",
                                  "apmsqueeze", "zeroone_adam", "onebit_lamb", "powersgd", "diloco", "sparseloco",
                                  "streaming_diloco",
                                  "dpsgd", "pdsgdm", "choco", "dcd", "moniqua", "moniqua_d2", "powergossip",
                                  "decentralized_diloco"])
def test_resume_with_hierarchy_is_bit_exact(comm, name, tmp_path_factory):
    root = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.Get_rank() == 0 else None)

    def body():
        k = 2 if comm.Get_size() % 2 == 0 else 1
        straight, end = _run(comm, name, k, f"{root}/straight")
        _, first = _run(comm, name, k, f"{root}/split", stop_at_step=4)
        assert first["step"] == 4 and first["stopped_by_signal"]
        resumed, last = _run(comm, name, k, f"{root}/split", resume="latest")
        assert last["step"] == 8 and two_levels(resumed) is not None
        assert torch.equal(resumed.flat.data, straight.flat.data), float((resumed.flat.data - straight.flat.data)
                                                                         .abs().max())
        for key in ("bytes_sent", "bytes_sent_intra", "bytes_sent_inter"):
            assert last[key] == end[key], (key, last, end)

    run_all(comm, body)


def test_unequal_nodes_are_refused_with_one_line_on_every_rank(comm, monkeypatch):
    """3 ranks as nodes of 2: one ValueError, one line, the same on every rank; a flat run is not refused."""
    if comm.Get_size() < 3:
        pytest.skip("needs 3 ranks or more (nodes of 2 and 1)")
    sub = comm.Split(0 if comm.Get_rank() < 3 else 1, key=comm.Get_rank())

    def three_ranks():
        messages = []
        for how, name in (("argument", "allreduce_sgd"), ("environment", "allreduce_sgd"), ("argument", "dpsgd")):
            if how == "environment":
                monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
                c = Communicator(sub, topo.ring(3))
            else:
                monkeypatch.delenv(RANKS_PER_NODE_ENV, raising=False)
                c = Communicator(sub, topo.ring(3), ranks_per_node=2)
            try:
                make_algorithm(name, make_model(), c, lr=0.1)
                messages.append("no error")
            except ValueError as exc:
                messages.append(str(exc))
        everyone = sub.allgather(messages)
        assert all(m == everyone[0] for m in everyone), everyone
        assert all("\n" not in m and "same number of ranks on every node" in m and "2, 1" in m for m in messages), \
            messages
        make_algorithm("allreduce_sgd", make_model(), Communicator(sub, topo.ring(3), ranks_per_node=2), lr=0.1,
                       hierarchical=False)

    try:
        run_all(comm, three_ranks if comm.Get_rank() < 3 else lambda: None)
    finally:
        sub.Free()


def test_bad_ranks_per_node_settings(comm, monkeypatch):
    def body():
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="ranks_per_node"):
                Communicator(comm, topo.ring(comm.Get_size()), ranks_per_node=bad)
        monkeypatch.setenv(RANKS_PER_NODE_ENV, "two")
        with pytest.raises(ValueError, match=RANKS_PER_NODE_ENV):
            Communicator(comm, topo.ring(comm.Get_size()))
        monkeypatch.setenv(RANKS_PER_NODE_ENV, "")
        assert Communicator(comm, topo.ring(comm.Get_size())).ranks_per_node is None
        with pytest.raises(ValueError, match="overlap"):
            make_algorithm("allreduce_sgd", make_model(), communicator(comm, 1), hierarchical=True, overlap=True)
        with pytest.raises(ValueError, match="auto, on or off"):
            make_algorithm("qsgd", make_model(), communicator(comm, 1), hierarchical="sometimes")
        auto = make_algorithm("qsgd", make_model(), communicator(comm, 1), hierarchical="auto", overlap=True)
        assert auto.two_level is None and auto.config.hierarchical is None

    run_all(comm, body)

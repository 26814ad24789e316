"""DiLoCo, SparseLoCo and decentralized DiLoCo against float64 single-process references, reductions, traffic, state.

The references run every rank's inner and outer steps in one process (``grad_at`` gives each rank's gradient);
the compressed ones use the same codec as a black box on float32 inputs, as the ranks do.
"""

import numpy as np
import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.codecs import make_codec
from mpicomm.codecs.chunked_topk import ChunkedTopKCodec
from mpicomm.comm import Communicator

from .algo_common import grad_at, initial_flat, make_model, topologies_for, train
from .conftest import run_all

pytestmark = pytest.mark.mpi

STEPS = 7


def reference(name, schedule, steps, lr=0.1, period=3, momentum=0.0, weight_decay=0.0, outer_lr=0.7,
              outer_momentum=0.9, outer_nesterov=True, codec=None, ef_decay=0.95, gossip_rounds=1,
              inner_optimizer="sgd", beta1=0.9, beta2=0.999, eps=1e-8, ranks_per_node=None):
    """Every rank's local model after ``steps`` steps of ``name``, in float64 (codecs applied in float32).

    ``ranks_per_node`` k: DiLoCo's and SparseLoCo's sums in two levels (what is compressed, and error-fed, is
    each node's sum of each of the k shards; the first d mod k shards one element longer)."""
    n = schedule.size
    xg = initial_flat().double().repeat(n, 1)
    x, m_in, m_out = xg.clone(), torch.zeros_like(xg), torch.zeros_like(xg)
    v_in = torch.zeros_like(xg)
    k = ranks_per_node or 1
    d = xg.shape[1]
    counts = [d // k + (j < d % k) for j in range(k)] if ranks_per_node else [d]
    bounds = [(sum(counts[:j]), sum(counts[:j + 1])) for j in range(len(counts))]
    e = torch.zeros(n if ranks_per_node is None else n // k, d, dtype=torch.float64)

    def by_node(rows):  # the rows the codec sees: each rank's, or each node's sum
        return rows if ranks_per_node is None else rows.view(n // k, k, d).sum(1)

    def compress(rows):
        return torch.stack([torch.cat([codec.roundtrip(row[lo:hi].float()).double() for lo, hi in bounds])
                            for row in rows])

    for t in range(steps):
        g = torch.stack([grad_at(x[r].float(), r, t).double() for r in range(n)])
        if inner_optimizer == "adamw":  # decoupled decay; bias corrections count every inner step, syncs included
            x = x * (1 - lr * weight_decay)
            m_in = beta1 * m_in + (1 - beta1) * g
            v_in = beta2 * v_in + (1 - beta2) * g * g
            k = t + 1
            x = x - lr / (1 - beta1 ** k) * m_in / (v_in.sqrt() / (1 - beta2 ** k) ** 0.5 + eps)
        else:
            m_in = momentum * m_in + g + weight_decay * x
            x = x - lr * m_in
        if (t + 1) % period:
            continue
        s = (t + 1) // period - 1
        delta = xg - x
        if name == "diloco" and codec is None:
            delta = delta.mean(0).expand(n, -1)
        elif name == "diloco":
            p = by_node(delta) + e
            sent = compress(p)
            e = p - sent
            delta = (sent.sum(0) / n).expand(n, -1)
        elif name == "sparseloco":
            e = ef_decay * e + by_node(delta)
            sent = compress(e)
            e = e - sent
            delta = (sent.sum(0) / n).expand(n, -1)
        else:
            y = x
            for r in range(s * gossip_rounds, (s + 1) * gossip_rounds):
                y = torch.tensor(schedule.at(r).W, dtype=torch.float64) @ y
            delta = xg - y
        m_out = outer_momentum * m_out + delta
        xg = xg - outer_lr * (delta + outer_momentum * m_out if outer_nesterov else m_out)
        x = xg.clone()
    return x


CASES = [
    ("diloco", {}),
    ("diloco", {"momentum": 0.5, "weight_decay": 0.01, "outer_nesterov": False, "period": 2}),
    ("diloco", {"codec": "uniform", "codec_options": {"bits": 4}}),
    ("diloco", {"inner_optimizer": "adamw", "weight_decay": 0.1, "beta2": 0.95, "period": 2}),
    ("sparseloco", {"outer_lr": 1.0, "outer_momentum": 0.0, "density": 0.25, "chunk": 32, "bits": 2,
                    "inner_optimizer": "adamw", "eps": 1e-6}),
    ("sparseloco", {"outer_lr": 1.0, "outer_momentum": 0.0, "density": 0.25, "chunk": 32, "bits": 2}),
    ("sparseloco", {"outer_lr": 0.8, "outer_momentum": 0.0, "density": 0.1, "chunk": 100, "bits": 3,
                    "ef_decay": 0.5, "period": 2}),
    ("decentralized_diloco", {}),
    ("decentralized_diloco", {"gossip_rounds": 2, "momentum": 0.9, "period": 2}),
]
CODEC_FIELDS = {"density", "chunk", "bits", "codec", "codec_options"}


@pytest.mark.parametrize("name,options", CASES)
def test_matches_float64_reference_step_by_step(comm, name, options):
    """Each rank's model after every one of 7 steps (syncs in the middle and at the end) against the reference."""

    def body():
        n = comm.Get_size()
        schedules = topologies_for(n) if name == "decentralized_diloco" else [topology.ring(n)]
        full = {"period": 3, **options}
        algo_options = {k: v for k, v in full.items() if k != "outer_momentum" or name != "sparseloco"}
        ref = {k: v for k, v in full.items() if k not in CODEC_FIELDS}
        if name == "sparseloco":
            ref["codec"] = ChunkedTopKCodec(options["density"], options["chunk"], options["bits"])
        elif "codec" in options:
            ref["codec"] = make_codec(options["codec"], **options["codec_options"])
        for schedule in schedules:
            c = Communicator(comm, schedule)
            algo = make_algorithm(name, make_model(seed=c.rank), c, lr=0.1, **algo_options)
            for t in range(STEPS):
                train(algo, 1)
                expected = reference(name, schedule, t + 1, **ref)[c.rank]
                where = f"{schedule.name} step {t}"
                torch.testing.assert_close(algo.flat.data.double(), expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, where=where: f"{where}: {m}")

    run_all(comm, body)


TWO_LEVEL_CASES = [
    ("diloco", {}),
    ("diloco", {"codec": "uniform", "codec_options": {"bits": 4}}),
    ("sparseloco", {"outer_lr": 1.0, "outer_momentum": 0.0, "density": 0.25, "chunk": 16, "bits": 2}),
    ("decentralized_diloco", {"gossip_rounds": 2, "momentum": 0.9, "period": 2}),
]


@pytest.mark.parametrize("name,options", TWO_LEVEL_CASES)
def test_two_levels_match_the_reference(comm, name, options):
    """Emulated nodes of 2 (and of 1), hierarchical on: DiLoCo's and SparseLoCo's sums with the node's exact sum
    of each shard compressed between nodes, decentralized DiLoCo's gossip on W_nodes ⊗ (1/k) 1 1ᵀ."""

    def body():
        n = comm.Get_size()
        full = {"period": 3, **options}
        algo_options = {key: v for key, v in full.items() if key != "outer_momentum" or name != "sparseloco"}
        ref = {key: v for key, v in full.items() if key not in CODEC_FIELDS}
        if name == "sparseloco":
            ref["codec"] = ChunkedTopKCodec(options["density"], options["chunk"], options["bits"])
        elif "codec" in options:
            ref["codec"] = make_codec(options["codec"], **options["codec_options"])
        for k in [k for k in (1, 2) if n % k == 0]:
            c = Communicator(comm, topology.ring(n), ranks_per_node=k)
            algo = make_algorithm(name, make_model(seed=c.rank), c, lr=0.1, hierarchical=True, **algo_options)
            if name == "decentralized_diloco":
                assert algo.node_gossip is not None
                W = np.kron(topology.ring(n // k).W, np.full((k, k), 1.0 / k))
                schedule, ref["ranks_per_node"] = topology.from_matrix(W, name="two-level"), None
            else:
                assert algo.two_level is not None
                schedule, ref["ranks_per_node"] = topology.ring(n), k
            for t in range(STEPS):
                train(algo, 1)
                expected = reference(name, schedule, t + 1, **ref)[c.rank]
                torch.testing.assert_close(algo.flat.data.double(), expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, where=(k, t): f"nodes of {where[0]}, step {where[1]}: {m}")

    run_all(comm, body)


def _run(c, name, steps, optimizer=None, **options):
    model = make_model(seed=c.rank)
    opt = optimizer(model) if optimizer else None
    algo = make_algorithm(name, model, c, optimizer=opt, **options)  # resets c.ledger
    train(algo, steps)
    return algo.flat.data.clone(), c.ledger.totals()


def test_reductions(comm):
    """H = 1, outer SGD at lr 1 without momentum == allreduce_sgd; identity codec == uncompressed (bit for bit);
    decentralized DiLoCo without outer momentum == pdsgdm, and on the complete graph == diloco."""

    def body():
        n = comm.Get_size()
        c = Communicator(comm, topology.ring(n))
        plain = {"outer_lr": 1.0, "outer_momentum": 0.0}
        a, _ = _run(c, "diloco", 5, period=1, weight_decay=0.01, **plain)
        b, _ = _run(c, "allreduce_sgd", 5, weight_decay=0.01)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        a, _ = _run(c, "diloco", 7, period=3, codec="identity")
        b, _ = _run(c, "diloco", 7, period=3)
        assert torch.equal(a, b)
        for schedule in topologies_for(n):
            c = Communicator(comm, schedule)
            a, bytes_a = _run(c, "decentralized_diloco", 7, period=3, momentum=0.5, **plain)
            b, bytes_b = _run(c, "pdsgdm", 7, period=3, momentum=0.5)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=schedule.name)
            assert bytes_a == bytes_b, schedule.name
        c = Communicator(comm, topology.complete(n))
        a, _ = _run(c, "decentralized_diloco", 7, period=3)
        b, _ = _run(c, "diloco", 7, period=3)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    run_all(comm, body)


def test_user_optimizer_is_the_inner_step(comm):
    """optimizer=torch.optim.SGD(lr, momentum) gives the built-in SGD inner step's run; torch.optim.AdamW the
    built-in inner_optimizer "adamw" run."""

    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        for name in ("diloco", "sparseloco", "decentralized_diloco"):
            a, _ = _run(c, name, 7, period=3,
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5))
            b, _ = _run(c, name, 7, period=3, lr=0.1, momentum=0.5)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
            a, _ = _run(c, name, 7, period=3, optimizer=lambda m: torch.optim.AdamW(
                m.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.1))
            b, _ = _run(c, name, 7, period=3, lr=0.01, inner_optimizer="adamw", beta1=0.8, beta2=0.9,
                        weight_decay=0.1)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{name} adamw")

    run_all(comm, body)


@pytest.mark.parametrize("name,options", [
    ("diloco", {"period": 3}),
    ("diloco", {"period": 2, "codec": "uniform", "codec_options": {"bits": 4}}),
    ("sparseloco", {"period": 3, "density": 0.25, "chunk": 32}),
    ("decentralized_diloco", {"period": 2, "gossip_rounds": 2}),
])
def test_bytes_per_step_match_formula(comm, name, options):
    """Nothing between syncs; a sync: allreduce 4d (2 (n-1)/n of it sent), allgather P ((n-1) P sent), or gossip
    4d to each out-neighbour of each round."""

    def body():
        for schedule in topologies_for(comm.Get_size()):
            c = Communicator(comm, schedule)
            algo = make_algorithm(name, make_model(), c, **options)
            n, d, p = c.size, algo.flat.numel, options["period"]
            for t in range(2 * p + 1):
                train(algo, 1)
                contributed, sent = 0, 0
                if (t + 1) % p == 0:
                    s = (t + 1) // p - 1
                    if name == "decentralized_diloco":
                        k = options["gossip_rounds"]
                        degrees = [len(c.out_neighbors(r)) for r in range(s * k, s * k + k)]
                        contributed, sent = k * 4 * d, sum(degrees) * 4 * d
                    elif name == "sparseloco":
                        size = ChunkedTopKCodec(options["density"], options["chunk"]).payload_bytes(d)
                        contributed, sent = size, (n - 1) * size
                    elif "codec" in options:
                        size = make_codec("uniform", bits=4).payload_bytes(d)
                        contributed, sent = size, (n - 1) * size
                    else:
                        contributed, sent = 4 * d, (2 * (n - 1) * 4 * d // n if n > 1 else 0)
                stats = algo.stats()
                assert (stats["step_bytes_contributed"], stats["step_bytes_sent"]) == (contributed, sent), \
                    (schedule.name, t, stats)

    run_all(comm, body)


@pytest.mark.parametrize("name,options", [
    ("diloco", {"codec": "uniform", "codec_options": {"bits": 2, "rounding": "stochastic"}, "momentum": 0.5}),
    ("sparseloco", {"density": 0.25, "chunk": 32}),
    ("decentralized_diloco", {"momentum": 0.5}),
    ("decentralized_diloco", {"inner_optimizer": "adamw", "weight_decay": 0.1}),
])
def test_state_round_trip_is_bit_exact(comm, name, options):
    """4 + 5 steps == 9 steps with period 3, split inside a period: global copy, outer momentum, EF, codec."""

    def body():
        schedule = topologies_for(comm.Get_size())[-1]

        def build(seed=0):
            return make_algorithm(name, make_model(seed), Communicator(comm, schedule), lr=0.05, period=3, seed=3,
                                  **options)

        straight = build()
        train(straight, 9)
        first = build()
        train(first, 4)
        resumed = build(seed=7)
        resumed.load_state_dict(first.state_dict())
        train(resumed, 5)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        assert torch.equal(resumed.global_params, straight.global_params)

    run_all(comm, body)


BAD = [
    ("diloco", {"period": 0}, "period must be an int >= 1"),
    ("diloco", {"outer_lr": 0.0}, r"outer_lr must be in \(0.0, inf\)"),
    ("diloco", {"outer_momentum": 1.0}, r"outer_momentum must be in \[0.0, 1.0\)"),
    ("diloco", {"outer_nesterov": 1}, "outer_nesterov must be a bool"),
    ("diloco", {"codec": "nope"}, "codec must be one of"),
    ("diloco", {"codec_options": {"bits": 4}}, "need a codec"),
    ("diloco", {"codec": "uniform", "codec_options": {"bits": 9}}, "do not fit codec 'uniform'"),
    ("sparseloco", {"density": 0.0}, r"density must be in \(0.0, 1.0\]"),
    ("sparseloco", {"chunk": 0}, "chunk must be an int >= 1"),
    ("sparseloco", {"bits": 9}, r"bits must be an int in \[1, 8\]"),
    ("sparseloco", {"ef_decay": 1.5}, r"ef_decay must be in \[0.0, 1.0\]"),
    ("sparseloco", {"outer_momentum": 0.9}, "unknown option"),
    ("decentralized_diloco", {"gossip_rounds": 0}, "gossip_rounds must be an int >= 1"),
    ("decentralized_diloco", {"codec": "uniform"}, "unknown option"),
]


def test_bad_config_fails_on_every_rank(comm):
    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        for name, options, message in BAD:
            with pytest.raises(ValueError, match=message):
                make_algorithm(name, make_model(), c, **options)

    run_all(comm, body)

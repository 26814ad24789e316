"""Streaming DiLoCo against a float64 single-process reference, its reductions to DiLoCo, traffic, state, options.

The reference runs every rank's inner steps, fragment exchanges (started, then applied ``delay`` steps later) and
per-fragment outer Nesterov steps in one process; codecs are applied as a black box on float32 inputs, as the
ranks do. The test model (``make_model``) has 4 tensors of 48, 8, 24 and 3 elements.
"""

import re

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.algorithms.local.streaming_diloco import fragment_cuts, fragment_offsets
from mpicomm.codecs import make_codec
from mpicomm.comm import Communicator

from .algo_common import grad_at, initial_flat, make_model, train
from .conftest import assert_all, run_all

pytestmark = pytest.mark.mpi

# element bounds of the fragments of make_model's [48, 8, 24, 3] tensors, by P (nearest cut to p d / P)
BOUNDS = {1: [0, 83], 2: [0, 48, 83], 3: [0, 48, 56, 83], 4: [0, 48, 56, 80, 83]}


def reference(n, steps, lr=0.1, momentum=0.0, period=4, fragments=2, delay=1, alpha=0.5, outer_lr=0.7,
              outer_momentum=0.9, outer_nesterov=True, codec=None, error_feedback=False, ranks_per_node=None):
    """Every rank's local model after each of ``steps`` steps, in float64 (the codec applied in float32).

    ``ranks_per_node`` k: what is sent (and error-fed) is each node's sum of each of the k shards of a fragment
    (the first f mod k shards of an f-element fragment one element longer)."""
    xg = initial_flat().double().repeat(n, 1)
    x, m_in, m_out = xg.clone(), torch.zeros_like(xg), torch.zeros_like(xg)
    k = ranks_per_node or 1
    e = torch.zeros(n // k if ranks_per_node else n, xg.shape[1], dtype=torch.float64)

    def by_node(rows):
        return rows if ranks_per_node is None else rows.view(n // k, k, -1).sum(1)

    def compress(rows):  # each shard of the fragment on its own
        f = rows.shape[1]
        counts = [f // k + (j < f % k) for j in range(k)]
        cuts = [sum(counts[:j]) for j in range(k + 1)]
        return torch.stack([torch.cat([codec.roundtrip(row[a:b].float()).double() for a, b in zip(cuts, cuts[1:])])
                            for row in rows])

    bounds = BOUNDS[fragments]
    offsets = [int(p * period / fragments + 0.5) % period for p in range(fragments)]
    pending, history = [], []
    for t in range(steps):
        g = torch.stack([grad_at(x[r].float(), r, t).double() for r in range(n)])
        m_in = momentum * m_in + g
        x = x - lr * m_in
        for p in range(fragments):
            if (t + 1) % period != offsets[p]:
                continue
            s = slice(bounds[p], bounds[p + 1])
            q = by_node(xg[:, s] - x[:, s])
            if codec is not None:
                q = q + e[:, s] if error_feedback else q
                sent = compress(q)
                if error_feedback:
                    e[:, s] = q - sent
                q = sent
            pending.append((t + delay, s, q.sum(0) / n))
        for _, s, avg in [item for item in pending if item[0] == t]:
            m_out[:, s] = outer_momentum * m_out[:, s] + avg
            step = avg + outer_momentum * m_out[:, s] if outer_nesterov else m_out[:, s]
            new = xg[:, s] - outer_lr * step
            x[:, s] = alpha * x[:, s] + (1 - alpha) * new
            xg[:, s] = new
        pending = [item for item in pending if item[0] != t]
        history.append(x.clone())
    return history


def test_fragments_are_contiguous_balanced_and_staggered():
    """The cut nearest p d / P, never an empty fragment; offsets round(p H / P), halves up."""
    assert fragment_cuts([48, 8, 24, 3], 2) == [0, 1, 4] and fragment_cuts([48, 8, 24, 3], 4) == [0, 1, 2, 3, 4]
    assert fragment_cuts([1, 1, 1, 100], 3) == [0, 2, 3, 4] and fragment_cuts([10] * 10, 4) == [0, 2, 5, 7, 10]
    assert fragment_cuts([5], 1) == [0, 1]
    assert fragment_offsets(10, 4) == [0, 3, 5, 8] and fragment_offsets(4, 2) == [0, 2]
    assert fragment_offsets(10, 1) == [0] and fragment_offsets(2, 4) == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="fragments must be <= the model's 2 parameter tensors"):
        fragment_cuts([3, 4], 3)


CASES = [
    {"codec": None},
    {"codec": None, "period": 5, "delay": 2, "alpha": 0.25, "momentum": 0.5},
    {"period": 6, "fragments": 3, "alpha": 0.3, "outer_nesterov": False},                # 4-bit uniform, no EF
    {"fragments": 4, "delay": 0, "alpha": 0.0, "error_feedback": True, "outer_momentum": 0.5},
]


@pytest.mark.parametrize("options", CASES)
def test_matches_float64_reference_step_by_step(comm, options):
    """Each rank's model after every step (fragments started, in flight and applied) against the reference."""

    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        full = {"period": 4, "fragments": 2, **options}
        algo = make_algorithm("streaming_diloco", make_model(seed=c.rank), c, lr=0.1, **full)
        assert algo.bounds == BOUNDS[full["fragments"]]
        ref = {k: v for k, v in full.items() if k != "codec"}
        if "codec" not in options:
            ref["codec"] = make_codec("uniform", bits=4)
        steps = 2 * full["period"] + 3
        history = reference(c.size, steps, **ref)
        for t in range(steps):
            train(algo, 1)
            torch.testing.assert_close(algo.flat.data.double(), history[t][c.rank], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, t=t: f"step {t}: {m}")
        algo.close()

    run_all(comm, body)


@pytest.mark.parametrize("options", [CASES[1], CASES[3]])
def test_two_levels_match_the_reference(comm, options):
    """Emulated nodes of 2 (and of 1), hierarchical on: the node's exact sum of each shard of a fragment sent
    between nodes while the inner steps go on (fp32, and 4-bit with error feedback), spread at the due step."""

    def body():
        n = comm.Get_size()
        full = {"period": 4, "fragments": 2, **options}
        ref = {k: v for k, v in full.items() if k != "codec"}
        if "codec" not in options:
            ref["codec"] = make_codec("uniform", bits=4)
        steps = 2 * full["period"] + 3
        for k in [k for k in (1, 2) if n % k == 0]:
            c = Communicator(comm, topology.ring(n), ranks_per_node=k)
            algo = make_algorithm("streaming_diloco", make_model(seed=c.rank), c, lr=0.1, hierarchical=True, **full)
            assert all(levels is not None for levels in algo.levels)
            history = reference(n, steps, **ref, ranks_per_node=k)
            for t in range(steps):
                train(algo, 1)
                torch.testing.assert_close(algo.flat.data.double(), history[t][c.rank], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, where=(k, t): f"nodes of {where[0]}, step {where[1]}: {m}")
            algo.close()

    run_all(comm, body)


def _run(c, name, steps, **options):
    algo = make_algorithm(name, make_model(seed=c.rank), c, lr=0.1, **options)
    train(algo, steps)
    algo.close()
    return algo.flat.data.clone()


def test_one_blocking_replacing_fragment_is_diloco(comm):
    """P = 1, delay 0, alpha 0: the identity codec and 4-bit uniform with error feedback give ``diloco`` with the
    same codec bit for bit; the fp32 allreduce (non-blocking here) gives it up to rounding."""

    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        one = {"period": 3, "fragments": 1, "delay": 0, "alpha": 0.0}
        a = _run(c, "streaming_diloco", 7, codec="identity", codec_options={}, **one)
        assert torch.equal(a, _run(c, "diloco", 7, period=3, codec="identity"))
        assert torch.equal(a, _run(c, "diloco", 7, period=3))
        a = _run(c, "streaming_diloco", 7, error_feedback=True, momentum=0.5, **one)
        assert torch.equal(a, _run(c, "diloco", 7, period=3, codec="uniform", codec_options={"bits": 4},
                                   momentum=0.5))
        a = _run(c, "streaming_diloco", 7, codec=None, **one)
        torch.testing.assert_close(a, _run(c, "diloco", 7, period=3), rtol=1e-6, atol=1e-7)

    run_all(comm, body)


@pytest.mark.parametrize("options", [{"period": 4, "fragments": 4, "delay": 0}, {"period": 5, "fragments": 2},
                                     {"period": 6, "fragments": 3, "codec": None}])
def test_bytes_per_step_and_peak_match_formula(comm, options):
    """A step sends the fragments started at it: an allgather of P_p = payload_bytes(d_p) ((n-1) P_p sent) or an
    allreduce of 4 d_p; the peak is the largest such step, max_p P_p, and after whole periods the mean is
    sum_p P_p / H, so peak * sum_p P_p == mean * H * max_p P_p, and the peak is below DiLoCo's one message."""

    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        algo = make_algorithm("streaming_diloco", make_model(), c, **options)
        n, h, frags = c.size, options["period"], options["fragments"]
        sizes = [b - a for a, b in zip(BOUNDS[frags], BOUNDS[frags][1:])]
        if options.get("codec", "uniform") is None:
            payload = [4 * s for s in sizes]
            sent = [2 * (n - 1) * b // n for b in payload]
            whole = 4 * sum(sizes)
        else:
            codec = make_codec("uniform", bits=4)
            payload = [codec.payload_bytes(s) for s in sizes]
            sent = [(n - 1) * b for b in payload]
            whole = codec.payload_bytes(sum(sizes))
        offsets = fragment_offsets(h, frags)
        total, peak = 0, 0
        for t in range(2 * h):
            train(algo, 1)
            started = [p for p in range(frags) if (t + 1) % h == offsets[p]]
            stats = algo.stats()
            expected = (sum(payload[p] for p in started), sum(sent[p] for p in started))
            assert (stats["step_bytes_contributed"], stats["step_bytes_sent"]) == expected, (t, stats)
            total, peak = total + expected[0], max(peak, expected[0])
            assert algo.metrics() == {"peak_bytes_per_step": peak, "mean_bytes_per_step": total / (t + 1)}, t
        metrics = algo.metrics()
        assert metrics["peak_bytes_per_step"] == max(payload)
        assert metrics["mean_bytes_per_step"] == sum(payload) / h
        assert metrics["peak_bytes_per_step"] * sum(payload) == metrics["mean_bytes_per_step"] * h * max(payload)
        assert max(payload) < whole
        algo.close()

    run_all(comm, body)


@pytest.mark.parametrize("options", [
    {"codec": None},
    {"codec": "uniform", "codec_options": {"bits": 2, "rounding": "stochastic"}, "error_feedback": True},
    {"period": 6, "fragments": 3, "delay": 1},
])
def test_state_round_trip_inside_an_exchange_in_flight_is_bit_exact(comm, options):
    """2 + 7 == 9 steps, split while fragment 1's exchange (started after step 2, applied after step 3) is in
    flight; the run that saved goes on bit for bit as if it had not."""

    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        full = {"period": 4, "fragments": 2, "delay": 1, "momentum": 0.5, "seed": 3, **options}

        def build(seed=0):
            return make_algorithm("streaming_diloco", make_model(seed), c, lr=0.05, **full)

        straight = build()
        train(straight, 9)
        first = build()
        train(first, 2)
        assert [e.fragment for e in first.pending] == [1] and first.pending[0].handle is not None
        state = first.state_dict()
        resumed = build(seed=7)
        resumed.load_state_dict(state)
        train(first, 7)
        train(resumed, 7)
        for algo in (straight, first, resumed):
            algo.close()
        for algo in (first, resumed):
            assert torch.equal(algo.flat.data, straight.flat.data)
            assert torch.equal(algo.global_params, straight.global_params)
            assert algo.metrics() == straight.metrics()

    run_all(comm, body)


BAD = [
    ({"fragments": 0}, "fragments must be an int >= 1"),
    ({"fragments": 5}, "fragments must be <= the model's 4 parameter tensors"),
    ({"delay": -1}, "delay must be an int >= 0"),
    ({"period": 4, "fragments": 2, "delay": 2}, r"delay must be < period / fragments = 4 / 2"),
    ({"period": 10, "fragments": 4, "delay": 3}, r"delay must be < period / fragments = 10 / 4"),
    ({"alpha": 1.0}, r"alpha must be in \[0.0, 1.0\)"),
    ({"alpha": -0.1}, r"alpha must be in \[0.0, 1.0\)"),
    ({"error_feedback": 1}, "error_feedback must be a bool"),
    ({"codec": None, "codec_options": {"ratio": 0.1}}, "need a codec"),
    ({"codec": "topk"}, "do not fit codec 'topk'"),
    ({"period": 0}, "period must be an int >= 1"),
]


def test_bad_options_fail_on_every_rank_naming_the_option(comm):
    c = Communicator(comm, topology.ring(comm.Get_size()))
    for options, message in BAD:
        try:
            make_algorithm("streaming_diloco", make_model(), c, **options)
            ok, detail = False, f"{options}: no error"
        except ValueError as exc:
            ok, detail = re.search(message, str(exc)) is not None, f"{options}: {exc}"
        assert_all(comm, ok, detail)

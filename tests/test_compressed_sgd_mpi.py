"""Compressed-gradient allgather SGD (QSGD, TernGrad, SignSGD, EF-SignSGD, any codec) against references."""

import math

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.algorithms.shared.allgather_sum import tree_sum
from mpicomm.codecs import QSGDCodec, TernGradCodec
from mpicomm.comm import Communicator
from mpicomm.plan.wire import ef_signsgd_payload, qsgd_payload, signsgd_payload, terngrad_payload

from .algo_common import grad_at, initial_flat, make_model, train
from .conftest import run_all
from .test_allreduce_sgd_mpi import mpi_adds_in_tree_order, recursive_doubling_sum

pytestmark = pytest.mark.mpi

D = 83  # parameters of algo_common's 6-8-3 MLP


def communicator(comm):
    return Communicator(comm, topo.ring(comm.Get_size()))


def sign(x):
    """+1 where x >= 0, else -1 (the sign convention of every sign codec)."""
    return torch.where(x >= 0, 1.0, -1.0)


def reference(name, n, steps, lr, momentum=0.0, weight_decay=0.0, seed=0, **options):
    """All n ranks in one process; the stochastic codecs are called for their random draws only."""
    x, m = initial_flat(), torch.zeros(D)
    errors = [torch.zeros(D) for _ in range(n)]
    if name == "qsgd":
        codecs = [QSGDCodec(options["bits"], options["bucket_size"], seed=seed + r) for r in range(n)]
    elif name == "terngrad":
        codecs = [TernGradCodec(seed=seed + r) for r in range(n)]
    for t in range(steps):
        g = [grad_at(x, r, t) for r in range(n)]
        if name in ("qsgd", "terngrad"):
            u = sum(c.decode(c.encode(gr), D) for c, gr in zip(codecs, g)) / n
        elif name == "signsgd":
            u = torch.sign(sum(sign(gr) for gr in g))
        elif name == "ef_signsgd":
            p = [lr * gr + e for gr, e in zip(g, errors)]
            delta = [pr.abs().sum() / D * sign(pr) for pr in p]
            errors = [pr - dr for pr, dr in zip(p, delta)]
            u = sum(delta) / n
        else:
            u = sum(g) / n
        if name == "ef_signsgd":
            u = u + lr * weight_decay * x
        else:
            u = u + weight_decay * x
        m = momentum * m + u if t else u
        x = x - m if name == "ef_signsgd" else x - lr * m
    return x


CASES = [
    ("qsgd", {"bits": 2, "bucket_size": 16}),
    ("qsgd", {"bits": 8, "bucket_size": 512}),
    ("terngrad", {}),
    ("signsgd", {}),
    ("ef_signsgd", {}),
]


@pytest.mark.parametrize("name,options", CASES)
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-2)])
def test_matches_single_process_reference(comm, name, options, momentum, weight_decay):
    def body():
        lr = 0.02 if name == "signsgd" else 0.1
        algo = make_algorithm(name, make_model(seed=comm.Get_rank()), communicator(comm), lr=lr, seed=3,
                              momentum=momentum, weight_decay=weight_decay, **options)
        train(algo, 5)
        everyone = comm.allgather(algo.flat.data.clone())
        expected = reference(name, comm.Get_size(), 5, lr, momentum, weight_decay, seed=3, **options)
        torch.testing.assert_close(algo.flat.data, expected, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(x, everyone[0]) for x in everyone), "ranks' parameters differ"

    run_all(comm, body)


def test_identity_codec_is_allreduce_sgd_bit_for_bit(comm):
    def body():
        kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}
        base = make_algorithm("allreduce_sgd", make_model(), communicator(comm), **kwargs)
        ident = make_algorithm("compressed_sgd", make_model(), communicator(comm), codec="identity", **kwargs)
        train(base, 6)
        train(ident, 6)
        exact = mpi_adds_in_tree_order(comm, [D])
        if exact:  # always at n <= 2; at n > 2 whenever MPI adds in recursive-doubling order (MPICH does)
            assert torch.equal(ident.flat.data, base.flat.data)
        else:
            torch.testing.assert_close(ident.flat.data, base.flat.data, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ident.flat.data, reference("identity", comm.Get_size(), 6, **kwargs),
                                   rtol=1e-5, atol=1e-6)

    run_all(comm, body)


def test_tree_sum_adds_in_recursive_doubling_order(comm):
    def body():
        # values whose float32 sums depend on the grouping: each order below gives a different result
        for n, order in [(1, lambda a: a[0]), (2, lambda a: a[0] + a[1]), (3, lambda a: (a[0] + a[1]) + a[2]),
                         (4, lambda a: (a[0] + a[1]) + (a[2] + a[3])),
                         (5, lambda a: ((a[0] + a[1]) + a[2]) + (a[3] + a[4])),
                         (6, lambda a: ((a[0] + a[1]) + (a[2] + a[3])) + (a[4] + a[5])),
                         (8, lambda a: ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])))]:
            g = torch.Generator().manual_seed(n)
            rows = torch.randn(n, 4096, generator=g) * torch.randn(n, 4096, generator=g).mul(4).exp()
            scratch = []
            got = tree_sum(n, lambda r, buf, rows=rows: buf.copy_(rows[r]), torch.empty(4096), scratch)
            assert torch.equal(got, order(rows)) and torch.equal(recursive_doubling_sum(list(rows)), got), n
            assert len(scratch) <= n.bit_length() + 1, (n, len(scratch))
            if n >= 4:  # the data tells the orders apart: plain left-to-right summation disagrees
                assert not torch.equal(got, sum(rows[1:], rows[0].clone())), n

    run_all(comm, body)


WIRE = [
    ("qsgd", {"bits": 2, "bucket_size": 16}, lambda d: qsgd_payload(d, 2, 16)),
    ("qsgd", {"bits": 8, "bucket_size": 512}, lambda d: qsgd_payload(d, 8, 512)),
    ("terngrad", {}, terngrad_payload),
    ("signsgd", {}, signsgd_payload),
    ("ef_signsgd", {}, ef_signsgd_payload),
    ("compressed_sgd", {"codec": "identity"}, lambda d: 4 * d),
    ("compressed_sgd", {"codec": "fp16"}, lambda d: 2 * d),
    ("compressed_sgd", {"codec": "qsgd", "codec_options": {"bits": 4, "bucket_size": 32}},
     lambda d: 4 * math.ceil(d / 32) + math.ceil(4 * d / 8)),
]


@pytest.mark.parametrize("name,options,formula", WIRE)
def test_bytes_on_the_wire_equal_the_formula(comm, name, options, formula):
    def body():
        c = communicator(comm)
        algo = make_algorithm(name, make_model(), c, lr=0.05, **options)
        train(algo, 3)
        n, nbytes = comm.Get_size(), formula(D)
        stats = algo.stats()
        assert algo.codec.payload_bytes(D) == nbytes
        assert stats["step_bytes_contributed"] == nbytes
        assert stats["step_bytes_sent"] == (n - 1) * nbytes == stats["step_bytes_received"]
        assert stats["bits_per_parameter"] == 8 * nbytes / D
        assert stats["total_bytes_contributed"] == 3 * nbytes
        assert set(c.ledger.contributed) == {"allgather"} and c.ledger.contributed["allgather"].messages == 3

    run_all(comm, body)


def _step_with(algo, grad):
    algo.zero_grad()
    algo.flat.grad.copy_(grad)
    algo.step()


def test_ef_signsgd_error_buffer_is_p_minus_scaled_sign(comm):
    def body():
        rank, n = comm.Get_rank(), comm.Get_size()
        algo = make_algorithm("ef_signsgd", torch.nn.Linear(5, 1, bias=False), communicator(comm), lr=0.5)
        x0 = algo.flat.data.clone()
        g = torch.tensor([1.0, -2.0, 3.0, 0.0, -0.5]) * (rank + 1)
        _step_with(algo, g)
        p = 0.5 * g  # e starts at 0; dyadic values, so ||p||_1 = 3.25 (rank + 1) exactly
        s = torch.tensor(3.25 * (rank + 1), dtype=torch.float32) / 5
        expected = p - s * torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])  # sign(0) = +1
        e1_exact = torch.equal(algo.error, expected)
        scales = [torch.tensor(3.25 * (r + 1), dtype=torch.float32) / 5 for r in range(n)]
        step = sum(sr * torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0]) for sr in scales) / n
        torch.testing.assert_close(algo.flat.data, x0 - step, rtol=1e-6, atol=1e-7)
        _step_with(algo, g)
        p2 = 0.5 * g + expected
        torch.testing.assert_close(algo.error, p2 - p2.abs().sum() / 5 * sign(p2), rtol=0, atol=1e-6)
        assert e1_exact, (algo.error, expected)

    run_all(comm, body)


def test_signsgd_majority_vote_and_ties(comm):
    def body():
        rank, n = comm.Get_rank(), comm.Get_size()
        algo = make_algorithm("signsgd", torch.nn.Linear(4, 1, bias=False), communicator(comm), lr=0.25)
        x0 = algo.flat.data.clone()
        # coordinate 2 alternates with the rank: a tie (vote 0) at even n; coordinate 3 is 0, which votes +1
        _step_with(algo, torch.tensor([1.0, -3.0, 0.5 * (-1) ** rank, 0.0]))
        vote = torch.tensor([1.0, -1.0, 0.0 if n % 2 == 0 else 1.0, 1.0])
        assert torch.equal(algo.flat.data, x0 - 0.25 * vote)

    run_all(comm, body)


@pytest.mark.parametrize("name,options", [
    ("qsgd", {"bits": 2, "bucket_size": 16}),
    ("terngrad", {}),
    ("ef_signsgd", {}),
    ("compressed_sgd", {"codec": "randomk", "codec_options": {"ratio": 0.25}, "error_feedback": True}),
])
def test_state_round_trip_is_bit_exact(comm, name, options):
    def body():
        kwargs = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "seed": 5, **options}
        straight = make_algorithm(name, make_model(), communicator(comm), **kwargs)
        train(straight, 6)
        first = make_algorithm(name, make_model(), communicator(comm), **kwargs)
        train(first, 3)
        state = first.state_dict()
        resumed = make_algorithm(name, make_model(seed=7), communicator(comm), **kwargs)
        resumed.load_state_dict(state)
        train(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        if straight.error is not None:
            assert torch.equal(resumed.error, straight.error) and straight.error.abs().sum() > 0

    run_all(comm, body)


@pytest.mark.parametrize("name,options,message", [
    ("qsgd", {"bits": 1}, r"bits must be in \[2, 8\], got 1"),
    ("qsgd", {"bits": 9}, r"bits must be in \[2, 8\], got 9"),
    ("qsgd", {"bucket_size": 0}, r"bucket_size must be in \[1, inf\), got 0"),
    ("qsgd", {"bits": 2.0}, "bits must be an int"),
    ("compressed_sgd", {"codec": "nope"}, "codec must be one of"),
    ("compressed_sgd", {"codec": "qsgd", "codec_options": {"bits": 99}}, "do not fit codec 'qsgd'"),
    ("compressed_sgd", {"codec": "qsgd", "codec_options": {"seed": 1}}, "must not contain 'seed'"),
    ("signsgd", {"bits": 2}, "unknown option"),
])
def test_bad_config_fails_on_every_rank(comm, name, options, message):
    def body():
        with pytest.raises(ValueError, match=message):
            make_algorithm(name, make_model(), communicator(comm), **options)

    run_all(comm, body)


# ---------------------------------------------------------------- convergence on least squares
def _least_squares(rank, n):
    """A 256 x 8 least-squares problem (noisy targets); this rank's shard; and the optimal loss."""
    g = torch.Generator().manual_seed(11)
    a = torch.randn(256, 8, generator=g)
    b = a @ torch.randn(8, generator=g) + 0.3 * torch.randn(256, generator=g)
    best = torch.linalg.lstsq(a.double(), b.double().unsqueeze(1)).solution.squeeze(1).float()
    full_loss = lambda w: 0.5 * float(((a @ w - b) ** 2).mean())  # noqa: E731
    return a[rank::n], b[rank::n], full_loss, full_loss(best)


CONVERGE = [  # name, options, lr, allowed excess loss over the optimum after 100 full-batch steps
    ("allreduce_sgd", {}, 0.3, 1e-6),
    ("qsgd", {"bits": 2, "bucket_size": 4}, 0.3, 1e-3),
    ("qsgd", {"bits": 8, "bucket_size": 512}, 0.3, 1e-4),
    ("terngrad", {}, 0.3, 1e-3),
    ("signsgd", {}, 0.04, 1e-2),  # constant-step sign descent ends in an O(d lr^2) oscillation
    ("ef_signsgd", {}, 0.3, 1e-3),
]


def test_each_reaches_the_allreduce_sgd_loss_on_least_squares(comm):
    def body():
        rank, n = comm.Get_rank(), comm.Get_size()
        a, b, full_loss, best = _least_squares(rank, n)
        excess = {}
        for name, options, lr, _ in CONVERGE:
            model = torch.nn.Linear(8, 1, bias=False)
            torch.nn.init.zeros_(model.weight)
            algo = make_algorithm(name, model, communicator(comm), lr=lr, **options)
            for _ in range(100):
                algo.zero_grad()
                (0.5 * ((model(a).squeeze(1) - b) ** 2).mean()).backward()
                algo.step()
            excess[name + str(options.get("bits", ""))] = full_loss(algo.flat.data) - best
        bad = {k: v for (k, v), (*_, tol) in zip(excess.items(), CONVERGE) if not -1e-6 <= v <= tol}
        assert not bad, f"excess loss over the optimum {best:.4f}: {excess}"

    run_all(comm, body)

"""PD-SGDM and CPD-SGDM against single-process simulations, exact reductions, traffic, state and convergence.

Round r (the r-th communication, at step t with (t + 1) mod p == 0) mixes with ``schedule.at(r)``;
the references below follow that rule, so the time-varying schedule at 4 ranks checks it.
"""

import pytest
import torch

from mpicomm.algorithms import make_algorithm
from mpicomm.codecs import make_codec
from mpicomm.comm import Communicator

from .algo_common import grad_at, initial_flat, make_model, mixing, topologies_for, train
from .conftest import run_all
from .test_choco_dcd_mpi import LSQ_LR, LSQ_STEPS, LSQ_TOL, lsq_gap, reference_choco

pytestmark = pytest.mark.mpi

STEPS = 7


def reference_pdsgdm(schedule, steps, lr, period, momentum, order="atc", average_momentum=False):
    """m <- mu m + g; x <- x - lr m; every period-th step x <- W x (and m <- W m), for all ranks at once."""
    n = schedule.size
    x = initial_flat().repeat(n, 1)
    m = torch.zeros_like(x)
    for t in range(steps):
        g = torch.stack([grad_at(x[r], r, t) for r in range(n)])
        if order == "atc":
            m = momentum * m + g
            x = x - lr * m
        if (t + 1) % period == 0:
            w = mixing(schedule, (t + 1) // period - 1)
            x = w @ x
            m = w @ m if average_momentum else m
        if order == "cta":
            m = momentum * m + g
            x = x - lr * m
    return x


@pytest.mark.parametrize("period,momentum,order,average_momentum", [
    (3, 0.9, "atc", False),
    (2, 0.9, "cta", True),
    (1, 0.5, "atc", True),
])
def test_pdsgdm_matches_reference(comm, period, momentum, order, average_momentum):
    def body():
        for schedule in topologies_for(comm.Get_size()):
            c = Communicator(comm, schedule)
            algo = make_algorithm("pdsgdm", make_model(seed=c.rank), c, lr=0.1, period=period, momentum=momentum,
                                  order=order, average_momentum=average_momentum)
            train(algo, STEPS)
            expected = reference_pdsgdm(schedule, STEPS, 0.1, period, momentum, order, average_momentum)
            torch.testing.assert_close(algo.flat.data, expected[c.rank], rtol=1e-5, atol=1e-6, msg=schedule.name)

    run_all(comm, body)


@pytest.mark.parametrize("period,codec,options,order", [
    (2, "sign", {}, "atc"),
    (3, "topk", {"ratio": 0.3}, "cta"),
])
def test_cpdsgdm_matches_reference(comm, period, codec, options, order):
    def body():
        for schedule in topologies_for(comm.Get_size()):
            c = Communicator(comm, schedule)
            algo = make_algorithm("cpdsgdm", make_model(seed=c.rank), c, lr=0.1, period=period, momentum=0.9,
                                  gamma=0.4, codec=codec, codec_options=options, order=order)
            train(algo, STEPS)
            expected = reference_choco(schedule, STEPS, 0.1, make_codec(codec, **options), 0.4, 0.9, order, period)
            torch.testing.assert_close(algo.flat.data, expected[c.rank], rtol=1e-5, atol=1e-6, msg=schedule.name)

    run_all(comm, body)


def _run(c, name, steps, **options):
    algo = make_algorithm(name, make_model(seed=c.rank), c, lr=0.1, **options)  # resets c.ledger
    train(algo, steps)
    return algo.flat.data.clone(), c.ledger.totals()


def test_exact_reductions_bit_for_bit(comm):
    """Same parameters and the same bytes: each pair differs only in how it is configured."""
    pairs = [
        (("pdsgdm", {"period": 1, "momentum": 0.0, "order": "cta", "weight_decay": 1e-2}),
         ("dpsgd", {"weight_decay": 1e-2})),
        (("cpdsgdm", {"codec": "identity", "gamma": 1.0, "period": 3}), ("pdsgdm", {"period": 3})),
        (("cpdsgdm", {"codec": "identity", "gamma": 1.0, "period": 2, "order": "cta"}),
         ("pdsgdm", {"period": 2, "order": "cta"})),
        (("choco", {"codec": "identity", "gamma": 1.0, "momentum": 0.9}), ("pdsgdm", {"period": 1})),
        (("choco", {"codec": "sign", "gamma": 0.4}), ("cpdsgdm", {"codec": "sign", "gamma": 0.4, "period": 1,
                                                               "momentum": 0.0})),
    ]

    def body():
        for schedule in topologies_for(comm.Get_size()):
            c = Communicator(comm, schedule)
            for (name_a, opt_a), (name_b, opt_b) in pairs:
                a, b = _run(c, name_a, 5, **opt_a), _run(c, name_b, 5, **opt_b)
                assert torch.equal(a[0], b[0]), (name_a, opt_a, name_b, schedule.name)
                assert a[1] == b[1], (name_a, opt_a, name_b, schedule.name)

    run_all(comm, body)


@pytest.mark.parametrize("name,options,per_neighbor", [
    ("pdsgdm", {"period": 3}, lambda d: 4 * d),
    ("pdsgdm", {"period": 2, "average_momentum": True}, lambda d: 8 * d),
    ("cpdsgdm", {"period": 2, "codec": "qsgd", "codec_options": {"bits": 4}},
     lambda d: make_codec("qsgd", bits=4).payload_bytes(d)),
])
def test_bytes_per_step_match_formula(comm, name, options, per_neighbor):
    """out_degree(topology of the round) x message bytes on communication steps, 0 on the others."""

    def body():
        for schedule in topologies_for(comm.Get_size()):
            c = Communicator(comm, schedule)
            algo = make_algorithm(name, make_model(), c, **options)
            p = options["period"]
            for t in range(2 * p + 1):
                train(algo, 1)
                communicates = (t + 1) % p == 0
                expected = len(c.out_neighbors((t + 1) // p - 1)) * per_neighbor(algo.flat.numel) if communicates else 0
                assert algo.stats()["step_bytes_sent"] == expected, (schedule.name, t)

    run_all(comm, body)


@pytest.mark.parametrize("name,options", [
    ("pdsgdm", {"period": 2, "average_momentum": True}),
    ("cpdsgdm", {"period": 2, "codec": "qsgd", "codec_options": {"bits": 3}}),
])
def test_state_round_trip_is_bit_exact(comm, name, options):
    """3 + 3 steps == 6 steps with the split in the middle of a period (momentum, copies, codec generator)."""

    def body():
        schedule = topologies_for(comm.Get_size())[-1]

        def build(seed=0):
            return make_algorithm(name, make_model(seed), Communicator(comm, schedule), lr=0.05, seed=3, **options)

        straight = build()
        train(straight, 6)
        first = build()
        train(first, 3)
        resumed = build(seed=7)
        resumed.load_state_dict(first.state_dict())
        train(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        assert torch.equal(resumed.optimizer.state_dict()["state"][0]["momentum_buffer"],
                           straight.optimizer.state_dict()["state"][0]["momentum_buffer"])

    run_all(comm, body)


BAD = [
    ("pdsgdm", {"period": 0}, "period must be an int >= 1"),
    ("pdsgdm", {"period": 2.0}, "period must be an int >= 1"),
    ("pdsgdm", {"momentum": 1.0}, r"momentum must be in \[0.0, 1.0\)"),
    ("pdsgdm", {"momentum": -0.1}, r"momentum must be in \[0.0, 1.0\)"),
    ("pdsgdm", {"momentum": 0.0, "average_momentum": True}, "needs momentum > 0"),
    ("pdsgdm", {"order": "both"}, "order must be one of"),
    ("pdsgdm", {"codec": "sign"}, "unknown option"),
    ("cpdsgdm", {"period": 0}, "period must be an int >= 1"),
    ("cpdsgdm", {"gamma": 0.0}, r"gamma must be in \(0.0, 1.0\]"),
    ("cpdsgdm", {"gamma": 1.01}, r"gamma must be in \(0.0, 1.0\]"),
    ("cpdsgdm", {"codec": "moniqua"}, "codec must be one of"),
    ("cpdsgdm", {"codec": "topk", "codec_options": {"ratio": 2.0}}, "do not fit codec 'topk'"),
    ("cpdsgdm", {"momentum": 1.0}, r"momentum must be in \[0.0, 1.0\)"),
]


def test_bad_config_fails_on_every_rank(comm):
    def body():
        c = Communicator(comm, topologies_for(comm.Get_size())[0])
        for name, options, message in BAD:
            with pytest.raises(ValueError, match=message):
                make_algorithm(name, make_model(), c, **options)

    run_all(comm, body)


@pytest.mark.parametrize("name,options", [
    ("pdsgdm", {"period": 4}),
    ("pdsgdm", {"period": 4, "average_momentum": True}),
    ("cpdsgdm", {"period": 2, "codec": "sign", "gamma": 0.4}),
])
def test_reaches_dpsgd_loss_on_least_squares(comm, name, options):
    """With mu = 0.9 and lr = 0.004 (the same effective step as D-PSGD's 0.04): within 0.01 after 150 steps."""

    def body():
        base = lsq_gap(comm, "dpsgd", LSQ_STEPS, lr=LSQ_LR)
        gap = lsq_gap(comm, name, LSQ_STEPS, lr=LSQ_LR * (1 - 0.9), momentum=0.9, **options)
        assert gap <= base + LSQ_TOL, (gap, base)

    run_all(comm, body)
